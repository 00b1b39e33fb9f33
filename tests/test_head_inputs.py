"""What reaches the head from outside the CLI is held to the CLI's own checks.

A client holding the cluster token can call the head actor's `submit` with any
payload, and an older or hostile writer can leave any value in state.db. Here the
real Controller (the fakes of test_head_isolation stand in for Ray only) gets, for
each field of a sweep, a value of the wrong type: each is refused in one line
naming the field, and nothing is recorded. A sweep whose row in state.db is made
wrong after it was recorded fails alone, with its reason, while a healthy sweep
submitted after it runs to the end. And a node whose labels in Ray's node table
do not parse as finite numbers is left out, with a warning.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner

from segctl.orchestrator import fleet
from segctl.schemas.limits import MAX_MEMORY_GB
from segctl.schemas.states import SweepState, TrialState
from tests.test_head_isolation import World, adapter_dir, ok, payload, running, small, sweep_state, trials  # noqa: F401


def _set(p: dict, where: str, value) -> dict:
    """Payload `p` with the value at `where` replaced: 'spec.concurrency', 'name',
    'trials.0.job.train.learning_rate' ..."""
    node, *parts = p, *where.split(".")
    *parents, last = parts
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return p


# (where, a value of the wrong type, what the one line must name)
WRONG = [
    ("name", 123, "sweep name"),
    ("path", ["x"], "path"),
    ("spec.concurrency", "x", "concurrency"),
    ("spec.concurrency", 0, "concurrency"),
    ("spec.retries", "<img src=x onerror=alert(1)>", "retries"),
    ("spec.retries", -1, "retries"),
    ("spec.placement", "rack-a", "placement"),
    ("spec.placement", {"rack": ["a"]}, "placement.rack"),
    ("spec.priority", "high", "priority"),
    ("spec.share", "half", "share"),
    ("spec.share", True, "share"),
    ("spec.owner", ["me"], "owner"),
    ("spec.scheduler", "asha", "scheduler"),
    ("spec.scheduler", {"type": "asha", "grace_steps": "x", "max_steps": 4}, "scheduler.grace_steps"),
    ("spec.grid", "x", "grid"),
    ("spec.random", "x", "random"),
    ("spec.job", "x", "job"),
    ("spec.base", ["x"], "base"),
    ("spec.report_to", 7, "report_to"),
    ("spec.unknown_key", 1, "unknown_key"),
    ("spec.planner", {"margin": "x"}, "planner.margin"),
    ("spec.planner", {"scale": float("inf")}, "planner.scale"),
    ("spec", "x", "spec"),
    ("trials", "x", "trials"),
    ("trials", [], "trials"),
    ("trials.0", "x", "trials"),
    ("trials.0.index", "x", "index"),
    ("trials.0.name", "../x", "trial name"),
    ("trials.0.params", "x", "params"),
    ("trials.0.params", {"lr": float("nan")}, "params: not plain JSON"),
    ("trials.0.job", "x", "job"),
    ("trials.0.job.train.learning_rate", "x", "job.train.learning_rate"),
    ("trials.0.job.memory.segment_size", [1], "job.memory.segment_size"),
    ("trials.0.model_info", "x", "model_info: model info lacks"),
    ("trials.0.model_info.n_layers", "a billion", "model_info: "),
    ("trials.0.seq_len", "x", "seq_len"),
    ("trials.0.seq_len", 0, "seq_len"),
    ("trials.0.inputs", "x", "inputs"),
    ("trials.0.inputs", {"train.jsonl": "../../etc/passwd"}, "inputs"),
    ("blobs", "x", "blobs"),
    # weighed before any model reads it: 10,000 such trials would be a gigabyte
    ("trials.0.job.padding", "x" * 200_000, "a trial's job is 200,"),
]


@pytest.mark.parametrize("where, value, names", WRONG, ids=[f"{w}={v!r}"[:60] for w, v, _ in WRONG])
def test_each_field_of_a_wrong_type_is_refused_in_one_line(tmp_path, payload, where, value, names):
    c = World().controller(tmp_path)
    with pytest.raises(ValueError) as e:
        c.submit(_set(small(payload, "s", n=1), where, value))
    line = str(e.value)
    assert names in line and "\n" not in line and len(line) < 600, line
    assert c.state.sweeps() == []   # nothing recorded


def test_the_scheduler_is_held_to_every_trial_as_validate_holds_it(tmp_path, payload):
    """asha needs every trial to run max_steps and evaluate at every rung: a payload
    that skipped `validate` gets the same line."""
    c = World().controller(tmp_path)
    p = small(payload, "s", n=1, scheduler={"type": "asha", "grace_steps": 1, "max_steps": 10 ** 6})
    with pytest.raises(ValueError, match="scheduler.grace_steps: asha needs train.eval_every "
                                         "to divide grace_steps"):
        c.submit(p)


def test_what_is_recorded_is_what_the_schema_reads(tmp_path, payload):
    """Lax values the schema accepts (a number as a string, as YAML sometimes
    gives) are recorded as the numbers they mean, so no turn compares a string."""
    c = World().controller(tmp_path)
    p = small(payload, "s", n=1, concurrency="2", share="3", priority="1")
    p["trials"][0]["job"]["train"]["learning_rate"] = "1e-4"
    sid = c.submit(p)
    row = c.state.sweep(sid)
    spec = json.loads(row["spec"])
    assert (row["concurrency"], row["priority"]) == (2, 1)
    assert (spec["concurrency"], spec["share"], spec["priority"]) == (2, 3.0, 1)
    job = json.loads(c.state.trials(sid)[0]["job"])
    assert job["train"]["learning_rate"] == 1e-4


# ------------------------------------------------------------------ a bad row in state.db

# (column, SQL value): what an older or hostile writer may leave in a sweep's row
CORRUPT = [
    ("concurrency", "'x'"),
    ("priority", "'high'"),
    ("retries", "'many'"),
    ("placement", "'{not json'"),
    ("spec", "json_set(spec, '$.share', 'x')"),
    ("spec", "'[]'"),
    ("created", "'yesterday'"),
]


@pytest.mark.parametrize("column, value", CORRUPT, ids=[f"{c}={v}" for c, v in CORRUPT])
def test_a_sweep_made_wrong_in_state_db_fails_alone_and_the_others_complete(
        tmp_path, payload, adapter_dir, column, value):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    bad = c.submit(small(payload, "bad", n=2))
    con = sqlite3.connect(tmp_path / "state.db")
    con.execute(f"UPDATE sweeps SET {column} = {value} WHERE id = ?", (bad,))
    con.commit()
    con.close()
    good = c.submit(small(payload, "good", n=2))
    for _ in range(6):   # the node runs the good sweep's trials one after the other
        world.turns(c, 1)
        for r in running(world.agents["a"]):
            ok(r, r.args[0].attempt, adapter_dir)
    assert sweep_state(c, good) == SweepState.DONE
    assert set(trials(c, good).values()) == {TrialState.SUCCEEDED}
    assert sweep_state(c, bad) == SweepState.FAILED
    assert set(trials(c, bad).values()) == {TrialState.FAILED}
    [why] = [e["reason"] for e in c.state.q(
        "SELECT reason FROM events WHERE sweep = ? AND trial IS NULL AND to_state = ?", (bad, SweepState.FAILED.value))]
    assert f"sweep {bad}: reading it from state.db" in why and "\n" not in why
    message = c.state.trials(bad)[0]["message"]
    assert message == why


# ------------------------------------------------------------------ nodes' labels

def _ray_row(name: str, **ours) -> dict:
    """A row of ray.nodes() for segctl node `name` with labels segctl.<key>=<value>."""
    return {"Alive": True, "Resources": {f"segctl_node:{name}": 1.0},
            "Labels": {"segctl.chip": "m2", "segctl.os": "macos", "rack": "a",
                       **{f"segctl.{k}": v for k, v in ours.items()}}}


def test_a_node_whose_labels_are_not_finite_numbers_is_ignored_with_a_warning():
    rows = [_ray_row("good", memory_gb="24", max_trials="2"),
            _ray_row("inf", memory_gb="inf"), _ray_row("nan", memory_gb="nan"),
            _ray_row("negative", memory_gb="-8"), _ray_row("huge", memory_gb=f"{MAX_MEMORY_GB * 2}"),
            _ray_row("words", memory_gb="lots"), _ray_row("none"),
            _ray_row("trials", memory_gb="8", max_trials="1.5"),
            _ray_row("many", memory_gb="8", max_trials="100000"),
            _ray_row("default", memory_gb="8"),
            {"Alive": True, "Resources": {"CPU": 4.0}, "Labels": {}},   # not a segctl node
            dict(_ray_row("dead", memory_gb="inf"), Alive=False)]
    nodes, warnings = fleet.node_table(rows)
    assert [(n.name, n.memory_gb, n.max_trials) for n in nodes] == [("default", 8.0, 1),
                                                                     ("good", 24.0, 2)]
    assert nodes[1].labels == {"rack": "a"}
    ignored = ["inf", "nan", "negative", "huge", "words", "none", "trials", "many"]
    assert len(warnings) == len(ignored)
    for name, w in zip(ignored, warnings):
        assert w.startswith(f"node {name} ignored: ") and "\n" not in w, w
    assert "segctl.memory_gb='inf': expected a finite number > 0" in warnings[0]
    assert "no label segctl.memory_gb" in warnings[5]
    assert "segctl.max_trials='1.5': expected a whole number" in warnings[6]


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "0", "-1", str(MAX_MEMORY_GB + 1)])
def test_node_start_refuses_a_memory_budget_that_is_not_a_finite_number_in_bounds(value, tmp_path,
                                                                                 monkeypatch):
    from segctl.node.raynode import node_labels
    from segctl.orchestrator.cli import main
    monkeypatch.setenv("SEGCTL_HOME", str(tmp_path))
    result = CliRunner().invoke(main, ["node", "start", "--head", "--memory-gb", value])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("segctl: --memory-gb ") and "finite number" in line, line
    assert list(tmp_path.iterdir()) == []   # refused before anything started or was written
    with pytest.raises(ValueError, match="finite number"):   # nor can a label say it
        node_labels("n", "m2", float(value), "macos", {})


def test_a_retry_of_a_sweep_made_wrong_in_state_db_fails_its_trial_with_the_reason(tmp_path,
                                                                                  payload):
    """A trial running when its sweep's row went wrong: its out of memory cannot count
    retries against an unreadable `retries`, so it fails saying why."""
    from segctl.schemas.records import AttemptResult
    world = World(names=("a",))
    c = world.controller(tmp_path)
    sid = c.submit(small(payload, "s", n=1))
    world.turns(c, 2)
    [r] = running(world.agents["a"])
    c.state.con.execute("UPDATE sweeps SET retries = 'many' WHERE id = ?", (sid,))
    r.settle(AttemptResult(attempt=r.args[0].attempt, outcome="oom", message="out of memory"))
    world.turns(c, 2)
    t = c.state.trial(r.args[0].trial)
    assert t["state"] == TrialState.FAILED and sweep_state(c, sid) == SweepState.FAILED
    assert t["message"].startswith(f"sweep {sid}: reading it from state.db: retries: ")
