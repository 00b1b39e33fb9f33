"""Many users, one fleet: sweeps share the nodes by `priority` (higher first, nothing
running is preempted) and, among equal priorities, by weighted fair share (running
attempts per `share`); each trial left PENDING says why, in state.db and in
`segctl status`. Driven turn by turn with the fake nodes, agents and clock of
test_head_isolation (no Ray), over the real state.db in tmp_path, the real planner
on the demo model's facts, and the real CLI (click's CliRunner) reading that state.db.
"""

from __future__ import annotations

import getpass
import json
from collections import Counter

import pytest
import yaml
from click.testing import CliRunner

from segctl.orchestrator.cli import main
from segctl.orchestrator.head import Controller
from segctl.schemas.errors import SpecError
from segctl.schemas.states import SweepState, TrialState
from segctl.schemas.sweep import load_sweep, submitter
from tests.conftest import assert_one_line_error, segctl
from tests.test_controller import end, live, payload, sweep_of  # noqa: F401 (fixture)
from tests.test_head_isolation import World


def submit(c: Controller, payload: dict, name: str, n: int, **spec) -> str:
    """n equal trials at segment_size 1; no concurrency cap unless given (the demo's is 4)."""
    spec.setdefault("concurrency", None)
    return c.submit(sweep_of(payload, name, n=n, segment_size=1, **spec))


def running(world: World) -> Counter:
    """Attempts live now, per sweep."""
    return Counter(r.args[0].sweep for r in live(world))


def placed(c: Controller) -> Counter:
    """Attempts ever placed, per sweep."""
    return Counter({r["sweep"]: r["n"] for r in c.state.q(
        "SELECT sweep, COUNT(*) AS n FROM attempts GROUP BY sweep")})


def end_oldest(world: World, c: Controller) -> str:
    """The oldest live attempt ends (every trial runs as long): a node frees. Returns its sweep."""
    spec = min((r.args[0] for r in live(world)), key=lambda s: s.attempt)
    end(world, spec, "failed", "bad row")
    world.turns(c, 1)
    return spec.sweep


def status(root) -> dict[str, dict]:
    """`segctl status --json` over the stores in `root`, by sweep."""
    result = CliRunner().invoke(main, ["status", "--json"],
                                env={"SEGCTL_HOME": str(root), "SEGCTL_CLUSTER": None})
    assert result.exit_code == 0, result.output
    return {s["sweep"]: s for s in json.loads(result.stdout)}


def shown(root, sid: str) -> dict[str, str]:
    """Pending trial -> its reason, as `segctl status --json` shows it."""
    return {t["trial"]: t["pending_reason"] for t in status(root)[sid]["trials"]
            if t["state"] == TrialState.PENDING}


def table(root) -> str:
    result = CliRunner().invoke(main, ["status"], env={"SEGCTL_HOME": str(root),
                                                       "SEGCTL_CLUSTER": None})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


# ------------------------------------------------------------------ fair share

def test_equal_shares_split_the_fleet_and_neither_starves(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    first = submit(c, payload, "first", n=20)
    world.turns(c, 2)
    assert running(world) == {first: 2}   # alone, it takes the whole fleet
    second = submit(c, payload, "second", n=20)
    world.turns(c, 2)
    # nothing running is preempted: the second waits for a node, ahead of the first
    assert running(world) == {first: 2}
    why = f"waiting for its fair share (sweep {first} has 2 of 2 nodes)"
    assert set(c.state.waiting(second).values()) == {why}
    assert set(c.state.waiting(first).values()) == {"waiting for a free node"}
    assert set(shown(tmp_path, second).values()) == {why}
    assert end_oldest(world, c) == first
    assert running(world) == {first: 1, second: 1}   # the freed node went to the second
    before = placed(c)
    for _ in range(16):
        end_oldest(world, c)
        assert running(world) == {first: 1, second: 1}
    got = placed(c) - before
    assert got[first] == got[second] == 8   # they alternate: ~N/2 each of N placements
    # at equal usage both wait for a free node, neither for the other
    assert set(shown(tmp_path, second).values()) == {"waiting for a free node"}


def test_shares_3_to_1_hold_3_to_1_of_the_nodes_and_of_the_placements(tmp_path, payload):
    world = World(names=("a", "b", "c", "d"))
    c = world.controller(tmp_path)
    big = submit(c, payload, "big", n=40, share=3)
    small = submit(c, payload, "small", n=40, share=1)
    world.turns(c, 2)
    assert running(world) == {big: 3, small: 1}
    before = placed(c)
    for _ in range(24):
        end_oldest(world, c)
        assert running(world) == {big: 3, small: 1}
    got = placed(c) - before
    assert got[big] == 18 and got[small] == 6
    [sw] = [s for s in status(tmp_path).values() if s["sweep"] == big]
    assert sw["share"] == 3 and sw["owner"] == submitter()


def test_a_share_gives_no_node_it_cannot_use(tmp_path, payload):
    """Fair share decides who goes first, never that a node stays idle: a sweep whose
    concurrency cap is reached leaves the free nodes to the other, whatever its share."""
    world = World(names=("a", "b", "c"))
    c = world.controller(tmp_path)
    capped = submit(c, payload, "capped", n=5, share=10, concurrency=1)
    other = submit(c, payload, "other", n=5)
    world.turns(c, 2)
    assert running(world) == {capped: 1, other: 2}
    assert set(shown(tmp_path, capped).values()) == {"sweep concurrency cap (1 running)"}
    assert set(shown(tmp_path, other).values()) == {"waiting for a free node"}


# ------------------------------------------------------------------ priority

def test_a_higher_priority_submitted_later_goes_first_when_a_node_frees(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    low = submit(c, payload, "low", n=6)
    world.turns(c, 2)
    assert running(world) == {low: 2}
    high = submit(c, payload, "high", n=2, priority=5)
    world.turns(c, 2)
    # no preemption: both of low's attempts run on, high waits for a node to free
    assert running(world) == {low: 2}
    assert not [r for a in world.agents.values() for r in a.calls if r.what == "cancel"]
    assert set(shown(tmp_path, high).values()) == {"waiting for a free node"}
    behind = f"waiting behind priority 5 sweep {high}"
    assert set(shown(tmp_path, low).values()) == {behind}
    assert set(c.state.waiting(low).values()) == {behind}
    assert behind in table(tmp_path)
    for n in (1, 2):   # each node that frees goes to high, though low's trials came first
        end_oldest(world, c)
        assert running(world) == Counter({low: 2 - n, high: n})
    # high has nothing left to place: low is next in line
    assert set(shown(tmp_path, low).values()) == {"waiting for a free node"}
    end_oldest(world, c)
    assert running(world) == {low: 1, high: 1}


# ------------------------------------------------------------------ why a trial waits

def test_no_node_alive(tmp_path, payload):
    world = World(names=())
    c = world.controller(tmp_path)
    sid = submit(c, payload, "s", n=2)
    world.turns(c, 2)
    assert set(c.state.waiting(sid).values()) == {"no node alive"}
    assert set(shown(tmp_path, sid).values()) == {"no node alive"}
    assert "no node alive" in table(tmp_path)


def test_a_reason_is_written_when_it_changes_not_every_turn(tmp_path, payload):
    world = World(names=())
    c = world.controller(tmp_path)
    sid = submit(c, payload, "s", n=1, concurrency=1)
    world.turns(c, 1)
    since = lambda: c.state.one("SELECT since FROM waiting")["since"]   # noqa: E731
    first = since()
    world.turns(c, 5)
    assert since() == first and set(c.state.waiting(sid).values()) == {"no node alive"}
    world.nodes = World(names=("a",)).nodes
    world.turns(c, 2)
    assert c.state.waiting(sid) == {} and running(world) == {sid: 1}


def test_no_free_node_fits_says_what_it_needs_and_what_is_free(tmp_path, payload):
    world = World(names=("a", "tiny"))
    world.nodes[1].memory_gb = 0.001   # a node too small for any demo trial
    c = world.controller(tmp_path)
    sid = submit(c, payload, "s", n=2)
    world.turns(c, 2)
    assert running(world) == {sid: 1}   # on a, the one node it fits
    [why] = shown(tmp_path, sid).values()
    assert why.startswith("no free node fits (needs ") and why.endswith(
        "GB, largest free budget 0.001 GB)")
    need = float(why.split("needs ")[1].split(" GB")[0])
    assert 0.001 < need < 8.0
    assert c.state.trial(f"{sid}-t001")["state"] == TrialState.PENDING   # it fits a: not failed


def test_placement_no_alive_node_matches_or_only_busy_ones_do(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    nowhere = submit(c, payload, "nowhere", n=1, placement={"room": "b12"})
    only_b = submit(c, payload, "only-b", n=2, placement={"name": "b"})
    world.turns(c, 2)
    assert c.state.waiting(nowhere) == {
        f"{nowhere}-t000": "no node alive matches its placement {'room': 'b12'}"}
    assert running(world) == {only_b: 1}   # a is free, but not for it
    assert c.state.waiting(only_b) == {
        f"{only_b}-t001": "waiting for a free node matching its placement {'name': 'b'}"}


def test_a_sweep_held_by_a_head_restart_says_how_it_goes_on(tmp_path, payload):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    sid = submit(c, payload, "s", n=2)
    world.turns(c, 2)
    del c
    World(names=("a",)).controller(tmp_path)   # a new head over the same state.db
    assert set(shown(tmp_path, sid).values()) == {
        f"the head restarted: `segctl resume {sid}` continues this sweep"}


def test_placed_and_finished_trials_have_no_reason(tmp_path, payload):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    sid = submit(c, payload, "s", n=2)
    world.turns(c, 2)
    first, second = f"{sid}-t000", f"{sid}-t001"
    assert set(c.state.waiting(sid)) == {second}
    end_oldest(world, c)
    assert c.state.waiting(sid) == {}   # the second is placed: its row is gone
    trials = {t["trial"]: t for t in status(tmp_path)[sid]["trials"]}
    assert trials[first]["pending_reason"] is None and trials[second]["pending_reason"] is None


# ------------------------------------------------------------------ the sweep keys

def sweep_file(tmp_path, demo_dir, **keys):
    doc = {"name": "shared", "base": str(demo_dir / "job.yaml"), **keys}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_the_keys_default_to_priority_0_share_1_and_the_submitter(tmp_path, demo_dir):
    spec = load_sweep(sweep_file(tmp_path, demo_dir)).spec
    assert (spec.priority, spec.share, spec.owner) == (0, 1.0, submitter())
    assert submitter() == getpass.getuser()
    spec = load_sweep(sweep_file(tmp_path, demo_dir, priority=5, share="2.5",
                                 owner="ana@lab")).spec
    assert (spec.priority, spec.share, spec.owner) == (5, 2.5, "ana@lab")


@pytest.mark.parametrize("key, value, fragment", [
    ("share", 0, "share: Input should be greater than 0"),
    ("share", -1.5, "share: Input should be greater than 0"),
    ("share", "lots", "share: Input should be a valid number"),
    ("share", True, "share: expected a number > 0, not a boolean"),
    ("share", float("inf"), "share: Input should be a finite number"),
    ("share", 1e7, "share: Input should be less than or equal to 1000000"),
    ("priority", "high", "priority: Input should be a valid integer"),
    ("priority", 1.5, "priority: Input should be a valid integer"),
    ("owner", "ana smith", "owner: String should match pattern"),
    ("owner", "x" * 65, "owner: String should have at most 64 characters"),
])
def test_a_bad_key_is_one_problem_naming_it(tmp_path, demo_dir, key, value, fragment):
    path = sweep_file(tmp_path, demo_dir, **{key: value})
    with pytest.raises(SpecError) as e:
        load_sweep(path)
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith(f"{path}:") and fragment in e.value.problems[0], \
        e.value.problems


def test_segctl_validate_refuses_a_bad_share_in_one_line(tmp_path, demo_dir):
    proc = segctl("validate", sweep_file(tmp_path, demo_dir, share=0, priority=3))
    assert_one_line_error(proc, "sweep.yaml:", "share: Input should be greater than 0")


def test_the_head_refuses_bad_keys_that_skipped_the_cli(tmp_path, payload):
    c = World().controller(tmp_path)
    for key, value, fragment in (("share", 0, "^share: Input should be greater than 0"),
                                 ("owner", "a b", "^owner: String should match pattern"),
                                 ("priority", 2**70, "^priority: ")):
        p = sweep_of(payload, "s", n=1)
        p["spec"][key] = value
        with pytest.raises(ValueError, match=fragment) as e:
            c.submit(p)
        assert "\n" not in str(e.value)
    assert not c.state.sweeps()


def test_the_commented_example_keys_validate(tmp_path, demo_dir):
    from tests.conftest import ROOT
    (tmp_path / "demo").symlink_to(demo_dir)   # examples/job.yaml points at ../demo
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "job.yaml").write_text((ROOT / "examples" / "job.yaml").read_text())
    text = (ROOT / "examples" / "sweep.yaml").read_text()
    assert "\n# share: 1 " in text and "\n# owner: ana " in text
    text = text.replace("\n# share: 1 ", "\nshare: 1.5 ")   # uncommented, as a user would
    text = text.replace("\n# owner: ana ", "\nowner: ana ")
    (tmp_path / "examples" / "sweep.yaml").write_text(text)
    spec = load_sweep(tmp_path / "examples" / "sweep.yaml").spec
    assert (spec.priority, spec.share, spec.owner) == (0, 1.5, "ana")


def test_a_large_backlog_is_read_a_page_at_a_time_and_its_reasons_follow(tmp_path, payload,
                                                                          monkeypatch):
    """Past WAITING_WHOLE_UPTO pending trials a turn reads ids a page at a time and
    writes only the tried trials' reasons; every pending trial's reason is written
    again within WAITING_EVERY_S, or at once when the sweeps change. Placement is the
    same: trials in their sweep's order, fair share between sweeps."""
    from segctl.orchestrator import head
    from segctl.orchestrator import placement_turn as turn
    monkeypatch.setattr(turn, "WAITING_WHOLE_UPTO", 0)
    monkeypatch.setattr(turn, "WAITING_EVERY_S", 3600.0)
    monkeypatch.setattr(turn._PendingIds, "PAGE", 2)
    reads = []
    original = head.State.pending_ids
    monkeypatch.setattr(head.State, "pending_ids",
                        lambda self, *a, **k: reads.append(k) or original(self, *a, **k))
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    first = submit(c, payload, "first", n=9)
    world.turns(c, 2)    # a new sweep: every reason written (whole read)
    assert running(world) == {first: 2}
    assert set(c.state.waiting(first).values()) == {"waiting for a free node"}
    assert len(c.state.waiting(first)) == 7
    reads.clear()
    order = [r["id"] for r in c.state.trials(first)]
    end_oldest(world, c)   # the sweeps are the same: a page read, not the backlog
    assert reads and all(k.get("limit") == 2 for k in reads)
    started = sorted((r.args[0].attempt, r.args[0].trial) for r in live(world))
    assert started[-1][1] == order[2]   # the next in the sweep's order
    # the trial placed no longer waits; the others keep their reason
    assert order[2] not in c.state.waiting(first) and len(c.state.waiting(first)) == 6
    second = submit(c, payload, "second", n=3)
    world.turns(c, 1)   # the sweeps changed: every reason written again
    why = f"waiting for its fair share (sweep {first} has 2 of 2 nodes)"
    assert set(c.state.waiting(second).values()) == {why}


def test_the_head_paces_its_fleets_telemetry(tmp_path, payload):
    """Agents forward telemetry every TELEMETRY_FLUSH_S on a small fleet; on a large
    one the head asks for less often, so that all attempts at once send about
    TELEMETRY_CALLS_PER_S batches a second (a batch costs the head the same whatever
    its size)."""
    from segctl.orchestrator import head
    from segctl.schemas.records import NodeInfo
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    submit(c, payload, "first", n=3)
    world.turns(c, 1)
    assert [r.args[0].flush_s for r in live(world)] == [head.TELEMETRY_FLUSH_S] * 2
    c.nodes = {f"n{i}": NodeInfo(name=f"n{i}", chip="sim", memory_gb=8, max_trials=2)
               for i in range(250)}
    assert c.flush_s() == pytest.approx(500 / head.TELEMETRY_CALLS_PER_S)
    assert c.flush_s() > head.TELEMETRY_FLUSH_S


def test_the_trials_table_wraps_its_last_column_under_itself_and_cuts_nothing():
    """`segctl status` lays out its lines itself (rich's wrapping of 20,000 lines
    took seconds): a long reason or message wraps at spaces under its own column,
    in the reason's colour; on a terminal too narrow for that the whole line wraps."""
    from rich.console import Console

    from segctl.orchestrator.views import trials_table
    reason = "no free node fits (needs 12.3 GB, largest free budget 8 GB)"
    message = "the engine stopped: " + "word " * 30 + "x" * 40
    sweep = dict(sweep="s-1", state=SweepState.RUNNING, owner="ann", priority=2, share=1.0, trials=[
        dict(trial="s-1-t000", state=TrialState.PENDING, params={"train.seed": 1}, message="",
             val_loss=None, pending_reason=reason, attempts=[]),
        dict(trial="s-1-t001", state=TrialState.FAILED, params={}, message=message, val_loss=None,
             attempts=[dict(outcome="failed", status="ended", node="n1", segment_size=2,
                            step=10, loss=1.5, peak_gb=3.2)])])
    for width in (100, 60):
        out = Console(width=width, force_terminal=True, color_system="standard")
        with out.capture() as cap:
            out.print(trials_table(sweep))
        text = cap.get()
        plain = Console(width=width)
        with plain.capture() as cap:
            plain.print(trials_table(sweep))
        lines = cap.get().splitlines()
        assert all(len(line) <= width for line in lines), lines
        squeezed = "".join(cap.get().split())   # a word longer than the column is cut
        assert squeezed.count("".join(message.split())) == 1
        assert "".join(reason.split()) + "train.seed=1" in squeezed
        assert "\x1b[33mno free node fits" in text   # the reason in yellow
        if width == 100:   # every continuation starts under the column
            col = lines[2].index("no free node")
            more = [line for line in lines[3:] if not line.startswith("t0")]
            assert more and all(not line[:col].strip() for line in more), lines
