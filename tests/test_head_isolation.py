"""The head's controller driven turn by turn with fake nodes, agents and clock
(and its real state.db and stores): every failure is charged to the thing it
belongs to, a sweep, an attempt, a node, and the loop goes on placing the rest.

The fakes stand in for Ray only: an agent's `run.remote(spec)` returns the refs of
its end time and of its result, which the test settles together with a result or an
exception; `wait` and `get` read those refs.
Everything the controller writes is real.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import ray

from segctl.orchestrator import head as head_mod
from segctl.orchestrator.head import Controller
from segctl.orchestrator.state_db import StateError
from segctl.orchestrator.submit import prepare
from segctl.schemas.records import AttemptResult, NodeInfo
from segctl.schemas.states import AttemptStatus, Outcome, SweepState, TrialState, TuneState
from segctl.schemas.sweep import load_sweep
from tests.conftest import locked


class Ref:
    """A fake object ref: pending until the test settles it."""

    def __init__(self, what: str, *args):
        self.what, self.args = what, args
        self.done, self.value, self.error = False, None, None

    def settle(self, value=None, error: BaseException | None = None):
        self.done, self.value, self.error = True, value, error


class EndOf:
    """The ref of a run's end time: settled with its run's ref."""

    what = "ended"

    def __init__(self, run: Ref):
        self.run = run

    @property
    def done(self):
        return self.run.done

    @property
    def error(self):
        return self.run.error

    @property
    def value(self):
        return self.run.value.ended


class Method:
    def __init__(self, agent: "Agent", name: str):
        self.agent, self.name = agent, name

    def remote(self, *args):
        if self.agent.refuse.get(self.name):
            raise self.agent.refuse[self.name]
        ref = Ref(self.name, *args)
        self.agent.calls.append(ref)
        if self.name in ("ping", "cancel"):
            ref.settle(True)
        if self.name == "ring_endpoint":   # where its rank of a ring would listen
            ref.settle(f"{self.agent.name}.lan:{5000 + len(self.agent.calls)}")
        return (EndOf(ref), ref) if self.name == "run" else ref


class Agent:
    def __init__(self, name: str):
        self.name = name
        self.calls: list[Ref] = []
        self.refuse: dict[str, BaseException] = {}
        for m in ("run", "probe", "ping", "cancel", "ring_endpoint"):
            setattr(self, m, Method(self, m))

    def runs(self) -> list[Ref]:
        return [r for r in self.calls if r.what == "run"]


class World:
    """Nodes, agents and time as the controller sees them."""

    def __init__(self, names=("a", "b"), memory_gb: float = 8.0):
        self.now = 1000.0
        self.nodes = [NodeInfo(name=n, chip="sim", memory_gb=memory_gb) for n in names]
        self.agents: dict[str, Agent] = {}
        self.list_error: BaseException | None = None

    def clock(self) -> float:
        return self.now

    def list_nodes(self):
        if self.list_error:
            raise self.list_error
        return self.nodes

    def spawn(self, name: str) -> Agent:
        self.agents[name] = Agent(name)
        return self.agents[name]

    @staticmethod
    def wait(refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.done]
        return ready, [r for r in refs if not r.done]

    @staticmethod
    def get(ref, timeout=None):
        if isinstance(ref, list):
            return [World.get(r) for r in ref]
        if ref.error is not None:
            raise ref.error
        return ref.value

    def controller(self, root: Path) -> Controller:
        return Controller(root, list_nodes=self.list_nodes, spawn_agent=self.spawn,
                          clock=self.clock, wait=self.wait, get=self.get)

    def turns(self, c: Controller, n: int = 3) -> None:
        for _ in range(n):
            self.now += 2.0   # past NODES_EVERY_S: nodes are listed each turn
            c.turn()


def ok(ref: Ref, aid: int, adapter_dir: Path, ended: float | None = None) -> None:
    files = {n: (adapter_dir / n).read_bytes()
             for n in ("adapters.safetensors", "adapter_config.json")}
    ref.settle(AttemptResult(attempt=aid, outcome="succeeded", steps=2, final_loss=1.0,
                             val_loss=1.5, ended=ended, adapter=files))


def running(agent: Agent) -> list[Ref]:
    return [r for r in agent.runs() if not r.done]


def run_placed(world: World, c: Controller, work: Path) -> None:
    """Run every attempt the controller has placed through the real engine, in a
    process of its own as a node would, feed its events to the head, and settle it."""
    from segctl.node.attempt import run_attempt
    for agent in world.agents.values():
        for ref in running(agent):
            spec = ref.args[0]
            r = run_attempt(spec, work,
                            send_events=lambda batch, a=spec.attempt: c.ingest(a, batch),
                            send_checkpoint=lambda step, files: None,
                            on_started=lambda pid, t, a=spec.attempt: c.started(a, pid, t))
            assert r.outcome == Outcome.SUCCEEDED, r.message
            ref.settle(r)


def trials(c: Controller, sid: str) -> dict[str, str]:
    return {r["id"]: r["state"] for r in c.state.q("SELECT id, state FROM trials WHERE sweep = ?",
                                                   (sid,))}


def sweep_state(c: Controller, sid: str) -> str:
    return c.state.one("SELECT state FROM sweeps WHERE id = ?", (sid,))["state"]


@pytest.fixture(scope="module")
def payload(demo_dir):
    """The demo sweep as the CLI would send it (real model facts, real data bytes)."""
    return prepare(load_sweep(demo_dir / "sweep.yaml"), {})


@pytest.fixture(scope="module")
def adapter_dir(demo_dir, tmp_path_factory):
    """A real adapter folder (adapters.safetensors + adapter_config.json) from two
    real engine steps, returned as a finished attempt's result."""
    from segctl.engine.train import run
    from segctl.schemas.job import load_job
    out = tmp_path_factory.mktemp("adapter") / "out"
    job = load_job(demo_dir / "job.yaml")
    job = job.model_copy(update={"output": str(out),
                                 "train": job.train.model_copy(update={"iters": 2})})
    run(job, emit=lambda e: None)
    return out


def small(payload: dict, name: str, n: int = 2, **spec) -> dict:
    p = json.loads(json.dumps({k: v for k, v in payload.items() if k != "blobs"}))
    p["blobs"] = payload["blobs"]
    p["name"] = name
    p["trials"] = p["trials"][:n]
    p["spec"].update(spec)
    return p


def test_an_unplannable_sweep_fails_alone_and_the_others_are_placed(tmp_path, payload):
    world = World()
    c = world.controller(tmp_path)
    bad = small(payload, "bad", priority=10)   # first in line
    for t in bad["trials"]:
        t["model_info"] = {"n_layers": "a billion"}   # what no planner can use
    with pytest.raises(ValueError, match="model info lacks"):
        c.submit(bad)   # a caller that skipped the CLI's checks is refused at the door ...
    # ... and a sweep already in state.db (from an older head) fails at placement, alone
    sid_bad = c.state.add_sweep(bad["name"], bad["path"], bad["spec"], bad["trials"])
    sid_good = c.submit(small(payload, "good"))
    world.turns(c)
    assert sweep_state(c, sid_bad) == SweepState.FAILED
    assert set(trials(c, sid_bad).values()) == {TrialState.FAILED}
    msg = c.state.one("SELECT message FROM trials WHERE sweep = ?", (sid_bad,))["message"]
    assert "placing it" in msg and "\n" not in msg
    assert set(trials(c, sid_good).values()) == {TrialState.PLACED}, trials(c, sid_good)
    assert "placing it" in (tmp_path / "logs" / "head.log").read_text()


@pytest.mark.parametrize("field, value, fragment", [
    ("n_layers", 10**9, "num_hidden_layers: 1000000000 is more than 1024"),
    ("model_type", "../../x", "not a plain name"),
    ("vocab", -1, "vocab_size: expected a whole number >= 1"),
])
def test_submit_refuses_model_facts_out_of_bounds_in_one_line(tmp_path, payload, field, value,
                                                              fragment):
    c = World().controller(tmp_path)
    bad = small(payload, "bad", n=1)
    bad["trials"][0]["model_info"][field] = value
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")) as e:
        c.submit(bad)
    assert "\n" not in str(e.value)
    assert not c.state.q("SELECT * FROM sweeps") and not (tmp_path / "inputs").exists()


def test_an_agent_error_ends_that_attempt_frees_its_node_and_keeps_the_other_result(
        tmp_path, payload, adapter_dir):
    world = World()
    c = world.controller(tmp_path)
    sid = c.submit(small(payload, "s", retries=1))
    world.turns(c)
    [ra], [rb] = running(world.agents["a"]), running(world.agents["b"])
    aid_a, aid_b = ra.args[0].attempt, rb.args[0].attempt
    # In the same turn: a's agent fails (its disk is full), b's attempt succeeds.
    ra.settle(error=ray.exceptions.RayTaskError("run", "OSError: [Errno 28] No space left",
                                                OSError(28, "No space left on device")))
    ok(rb, aid_b, adapter_dir)
    world.turns(c, 1)
    a = c.state.attempt(aid_a)
    assert a["status"] == AttemptStatus.ENDED and a["outcome"] == Outcome.AGENT_ERROR
    assert "No space left" in a["message"] and "\n" not in a["message"]
    assert c.state.attempt(aid_b)["outcome"] == Outcome.SUCCEEDED
    states = trials(c, sid)
    assert sorted(states.values()) == [TrialState.PLACED, TrialState.SUCCEEDED], states   # a's trial re-placed
    assert c.stores.is_sealed(aid_a) and c.stores.is_sealed(aid_b)
    # the node that failed is free again and took the retry
    again = running(world.agents["a"]) + running(world.agents["b"])
    assert len(again) == 1 and again[0].args[0].trial == a["trial"]


def test_results_past_the_byte_bound_wait_in_rays_store_and_are_filed_in_turn(
        tmp_path, payload, adapter_dir, monkeypatch):
    """The head holds ended results (their adapters) in memory up to UNFILED_BYTES;
    past that, an ended attempt's node is freed at once but its result is fetched
    only when its turn to be filed comes, and one whose node died meanwhile is a
    lost node's attempt: run again. A node counts as free from its engine's exit,
    fetched or not."""
    monkeypatch.setattr(head_mod, "UNFILED_BYTES", 1)   # the first result held fills it
    monkeypatch.setattr(head_mod, "FILE_S", 0.0)        # one filed per turn
    world = World(names=("a", "b", "c"))
    fetched = []
    get = world.get
    world.get = lambda ref: (ref.what == "run" and fetched.append(ref), get(ref))[1]
    c = world.controller(tmp_path)
    sid = c.submit(small(payload, "s", n=3, retries=1))
    world.turns(c, 1)
    refs = sorted((r for a in world.agents.values() for r in running(a)),
                  key=lambda r: r.args[0].attempt)
    node = {id(r): name for name, a in world.agents.items() for r in a.runs()}
    assert len(refs) == 3
    exits = [world.now - 1.5, world.now - 0.5]
    for r, t in zip(refs[:2], exits):
        ok(r, r.args[0].attempt, adapter_dir, ended=t)
    refs[2].settle(error=ray.exceptions.RayActorError())   # its node died after it ended
    world.turns(c, 1)
    # the first result was fetched and filed; the other two wait as refs, their nodes free
    assert fetched == [refs[0]] and c.unfiled_bytes == 0
    assert not any(c.held.get(n) for n in "abc")
    # free from their engines' exits, the second's result unfetched; the lost one's from now
    assert [c.free_since[node[id(r)]] for r in refs] == [*exits, world.now]
    assert [aid for aid, *_ in c.to_file] == [r.args[0].attempt for r in refs[1:]]
    world.turns(c, 2)
    assert fetched == refs and not c.to_file and c.unfiled_bytes == 0
    aids = [r.args[0].attempt for r in refs]
    assert [c.state.attempt(a)["outcome"] for a in aids] == [
        Outcome.SUCCEEDED, Outcome.SUCCEEDED, Outcome.NODE_LOST]
    assert [c.stores.has_adapter(c.state.attempt(a)["trial"]) for a in aids] == [True, True, False]
    assert sorted(trials(c, sid).values()) == [   # run again
        TrialState.PLACED, TrialState.SUCCEEDED, TrialState.SUCCEEDED]


def test_retries_bound_a_failing_agent(tmp_path, payload):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    sid = c.submit(small(payload, "s", n=1, retries=1))
    for _ in range(4):
        world.turns(c, 1)
        for r in running(world.agents["a"]):
            r.settle(error=ray.exceptions.RayTaskError("run", "PermissionError", PermissionError(
                "model refused")))
    assert list(trials(c, sid).values()) == [TrialState.FAILED]
    assert sweep_state(c, sid) == SweepState.DONE
    assert c.state.one("SELECT COUNT(*) AS n FROM attempts")["n"] == 2


def test_a_failed_seal_does_not_hold_the_trial_and_resume_seals_it_again(
        tmp_path, payload, monkeypatch):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    sid = c.submit(small(payload, "s", n=1))
    world.turns(c, 1)
    [r] = running(world.agents["a"])
    aid = r.args[0].attempt
    c.ingest(aid, [{"seq": 0, "event": "step", "step": 1, "loss": 2.0, "peak_gb": 0.1,
                    "time": 1.0, "tokens": 10, "lr": 1e-4, "seconds": 0.1}])
    real_seal = c.stores.seal_attempt

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(c.stores, "seal_attempt", disk_full)
    r.settle(AttemptResult(attempt=aid, outcome="failed", message="bad data row", steps=1))
    world.turns(c, 1)
    assert list(trials(c, sid).values()) == [TrialState.FAILED]   # not stuck RUNNING
    assert c.state.attempt(aid)["status"] == AttemptStatus.ENDED and not c.stores.is_sealed(aid)
    monkeypatch.setattr(c.stores, "seal_attempt", real_seal)
    c.resume(sid)
    assert c.stores.is_sealed(aid)


def test_a_success_whose_adapter_cannot_be_stored_runs_again(tmp_path, payload, adapter_dir,
                                                            monkeypatch):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    sid = c.submit(small(payload, "s", n=1))
    world.turns(c, 1)
    [r] = running(world.agents["a"])
    real_put = c.stores.put_adapter

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(c.stores, "put_adapter", disk_full)
    ok(r, r.args[0].attempt, adapter_dir)
    world.turns(c, 1)
    first = c.state.attempt(r.args[0].attempt)
    assert first["outcome"] == Outcome.AGENT_ERROR and "could not store the adapter" in first["message"]
    monkeypatch.setattr(c.stores, "put_adapter", real_put)
    [r2] = running(world.agents["a"])
    ok(r2, r2.args[0].attempt, adapter_dir)
    world.turns(c, 1)
    assert list(trials(c, sid).values()) == [TrialState.SUCCEEDED]
    assert (tmp_path / "adapters.zarr").exists()


def test_the_head_restarts_over_attempts_it_cannot_seal(tmp_path, payload, monkeypatch):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    stuck = c.submit(small(payload, "stuck", n=1))
    world.turns(c, 1)
    [r] = running(world.agents["a"])
    # The head goes away mid-attempt; its stores cannot be written for this one.
    del c
    real_seal = head_mod.Stores.seal_attempt

    def refuse(self, sweep, trial, attempt, row):
        if sweep == stuck:
            raise OSError(36, "File name too long")
        return real_seal(self, sweep, trial, attempt, row)
    monkeypatch.setattr(head_mod.Stores, "seal_attempt", refuse)
    world2 = World(names=("a",))
    c2 = world2.controller(tmp_path)   # must not raise
    assert sweep_state(c2, stuck) == SweepState.INTERRUPTED
    assert list(trials(c2, stuck).values()) == [TrialState.PENDING]
    assert not c2.stores.is_sealed(r.args[0].attempt)
    other = c2.submit(small(payload, "other", n=1))
    world2.turns(c2, 1)
    assert list(trials(c2, other).values()) == [TrialState.PLACED]
    monkeypatch.setattr(head_mod.Stores, "seal_attempt", real_seal)
    c2.resume(stuck)
    assert c2.stores.is_sealed(r.args[0].attempt)


def test_a_damaged_input_fails_its_trial_and_an_agent_that_refuses_its_attempt(tmp_path,
                                                                             payload):
    world = World()
    c = world.controller(tmp_path)
    world.turns(c, 1)
    sid = c.submit(small(payload, "s", n=1))
    for f in (tmp_path / "inputs").iterdir():
        f.write_bytes(b"rot")   # the head's copy of the data went bad
    world.agents["b"].refuse["run"] = ray.exceptions.RayActorError()
    world.turns(c, 1)
    [t] = c.state.q("SELECT * FROM trials WHERE sweep = ?", (sid,))
    assert t["state"] == TrialState.FAILED and "damaged" in t["message"] and "\n" not in t["message"]
    assert not c.state.q("SELECT * FROM attempts")   # nothing was started
    # Good data again; node a is busy with another sweep, b's agent refuses the call.
    other = c.submit(small(payload, "other", n=2, retries=3))
    world.turns(c, 1)
    ended = c.state.q("SELECT * FROM attempts WHERE outcome = 'agent_error'")
    assert ended and all(a["node"] == "b" for a in ended)
    assert "handing it to b" in ended[0]["message"]
    assert not c.held.get("b") and set(trials(c, other).values()) <= {
        TrialState.PENDING, TrialState.PLACED, TrialState.FAILED}
    assert TrialState.PLACED in trials(c, other).values()


def test_a_probe_error_fails_that_class_and_frees_the_node(tmp_path):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    world.turns(c, 1)
    tid = c.tune({"model": "m", "model_key": "k", "model_name": "m", "n_layers": 2,
                  "method": "sft", "prefix_shared": False, "method_key": "sft",
                  "lora": {"rank": 8, "num_layers": -1, "scale": 20.0, "dropout": 0.0},
                  "head_chunk": 512, "attn_block": 2048, "steps": 2,
                  "classes": {"sim/8GB": {"budget_gb": 8.0, "points": [[64, 1]]}}})
    world.turns(c, 1)
    [p] = [r for r in world.agents["a"].calls if r.what == "probe"]
    p.settle(error=ray.exceptions.RayTaskError("probe", "OSError", OSError(28, "disk full")))
    world.turns(c, 1)
    cls = c.tune_status(tid)["classes"]["sim/8GB"]
    assert cls["state"] == TuneState.FAILED and "disk full" in cls["error"]
    assert not any(c.held.values())


def test_listing_nodes_or_starting_an_agent_can_fail_and_the_loop_goes_on(tmp_path, payload):
    world = World()
    c = world.controller(tmp_path)
    world.list_error = RuntimeError("GCS unreachable")
    world.turns(c, 2)
    world.list_error = None
    sid = c.submit(small(payload, "s", n=1))
    world.turns(c, 2)
    assert list(trials(c, sid).values()) == [TrialState.PLACED]
    assert "GCS unreachable" in (tmp_path / "logs" / "head.log").read_text()


def test_an_agent_that_never_answers_is_given_up_and_started_again(tmp_path, payload):
    world = World(names=("a",))
    spawned: list[Agent] = []

    class Mute(Method):   # its actor never starts: the ping stays pending
        def remote(self, *args):
            ref = Ref("ping")
            self.agent.calls.append(ref)
            return ref

    def spawn(name: str) -> Agent:
        agent = Agent(name)
        if not spawned:
            agent.ping = Mute(agent, "ping")
        spawned.append(agent)
        world.agents[name] = agent
        return agent

    world.spawn = spawn
    c = world.controller(tmp_path)
    sid = c.submit(small(payload, "s", n=1))
    world.turns(c, 3)
    assert len(spawned) == 1 and "a" not in c.agents
    assert list(trials(c, sid).values()) == [TrialState.PENDING]
    world.now += head_mod.AGENT_START_S
    world.turns(c, 2)
    assert len(spawned) == 2 and c.agents["a"] is spawned[1]
    assert list(trials(c, sid).values()) == [TrialState.PLACED]
    assert "its agent did not answer" in (tmp_path / "logs" / "head.log").read_text()


def test_head_log_rotates(tmp_path, monkeypatch):
    monkeypatch.setattr(head_mod, "LOG_BYTES", 2000)
    log = head_mod.head_log(tmp_path / "r")
    for i in range(200):
        log.error("turn %d failed: %s", i, "x" * 50)
    files = sorted(p.name for p in (tmp_path / "r" / "logs").iterdir())
    assert files == ["head.log", "head.log.1", "head.log.2", "head.log.3"]
    assert all((tmp_path / "r" / "logs" / f).stat().st_size <= 2100 for f in files)
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()


def test_two_submits_of_the_same_data_at_once_both_land(tmp_path, payload):
    import threading
    world = World()
    c = world.controller(tmp_path)
    errors, ids = [], []

    def go(i):
        try:
            ids.append(c.submit(small(payload, f"s{i}", n=1)))
        except Exception as e:   # pragma: no cover - the failure this test is for
            errors.append(e)
    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(ids) == 8
    inputs = list((tmp_path / "inputs").iterdir())
    assert all(not p.name.startswith(".tmp") for p in inputs)
    assert oct((tmp_path / "inputs").stat().st_mode & 0o777) == "0o700"
    import hashlib
    for p in inputs:
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name
    # a damaged copy is replaced, not trusted
    victim = inputs[0]
    victim.write_bytes(b"rot")
    c.submit(small(payload, "again", n=1))
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == victim.name


@pytest.mark.parametrize("damage", ["garbage", "torn", "foreign"])
def test_a_corrupt_state_db_is_one_line_naming_it_in_every_reader(tmp_path, payload, damage):
    from tests.conftest import assert_one_line_error, segctl
    home = tmp_path / "home"
    c = World().controller(home)
    c.submit(small(payload, "s", n=1))
    c.state.con.close()
    db = home / "state.db"
    for extra in ("state.db-wal", "state.db-shm"):
        (home / extra).unlink(missing_ok=True)
    if damage == "garbage":
        db.write_bytes(b"this is not a database" * 100)
    elif damage == "torn":   # the header survives, the pages after it do not
        blob = bytearray(db.read_bytes())
        blob[100:] = b"\xff" * (len(blob) - 100)
        db.write_bytes(bytes(blob))
    else:   # a real SQLite file, not ours
        db.unlink()
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE t (x)")
        con.commit()
        con.close()
    for args in (["status"], ["status", "--json"], ["logs", "s-1-x"], ["gather", "s-1", "--out",
                                                                      tmp_path / "out"]):
        proc = segctl(*args, env={"SEGCTL_HOME": home})
        err = assert_one_line_error(proc, str(db))
        assert "move it aside" in err, err
    assert not (tmp_path / "out").exists()
    before = db.read_bytes()
    with pytest.raises(StateError, match="move it aside"):
        World().controller(home)   # the head refuses it too, and leaves it as it was
    assert db.read_bytes() == before


def test_state_db_and_inputs_are_private(tmp_path, payload):
    import os
    old = os.umask(0)
    try:
        c = World().controller(tmp_path / "home")
        c.submit(small(payload, "s", n=1))
    finally:
        os.umask(old)
    assert (tmp_path / "home" / "state.db").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "home" / "inputs").stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "home" / "inputs").iterdir())


def test_a_locked_state_db_is_one_line_saying_who_holds_it(tmp_path, monkeypatch):
    from segctl.orchestrator import state_db
    World().controller(tmp_path).state.con.close()
    monkeypatch.setattr(state_db, "LOCK_WAIT_S", 0.3)
    with locked(tmp_path / "state.db"):
        with pytest.raises(StateError, match="locked by another process"):
            World().controller(tmp_path)


# ------------------------------------------------------------------ several trials per node

def _fixed(payload: dict, name: str, n: int, segment_size: int = 1) -> dict:
    """n copies of the first trial at a fixed segment size: equal predicted peaks."""
    p = small(payload, name, n=1)
    first = p["trials"][0]
    first["job"].setdefault("memory", {})["segment_size"] = segment_size
    p["trials"] = [dict(json.loads(json.dumps(first)), index=i, name=f"t{i:03d}")
                   for i in range(n)]
    return p


def _predicted(c: Controller, sid: str, node: NodeInfo) -> float:
    t = c.state.q("SELECT * FROM trials WHERE sweep = ? ORDER BY idx", (sid,))[0]
    return c._plan_now(t, node, {}).predicted_gb


def test_a_node_runs_as_many_trials_as_its_max_trials_and_its_memory_allow(tmp_path, payload):
    from segctl.schemas.cluster import DEFAULT_MARGIN
    world = World(names=("a",))
    world.nodes[0].max_trials = 3
    c = world.controller(tmp_path)
    c.submit(_fixed(payload, "s", n=4))
    world.turns(c, 2)
    runs = running(world.agents["a"])
    assert len(runs) == 3   # max_trials, not memory, is the bound on 8 GB
    for r in runs:   # each guarded at its predicted peak plus the margin, or its even share
        p = c._plan_now(c.state.trial(r.args[0].trial), world.nodes[0], {}).predicted_gb
        assert r.args[0].job.memory.budget_gb == pytest.approx(
            max(p / (1 - DEFAULT_MARGIN), world.nodes[0].memory_gb / 3))
    assert sum(c.held["a"].values()) <= world.nodes[0].memory_gb
    # one ends: the fourth takes its place
    runs[0].settle(AttemptResult(attempt=runs[0].args[0].attempt, outcome="failed",
                                 message="bad row"))
    world.turns(c, 1)
    assert len(running(world.agents["a"])) == 3


def test_memory_bounds_the_trials_a_node_shares(tmp_path, payload):
    from segctl.schemas.cluster import DEFAULT_MARGIN
    world = World(names=("a",))
    c0 = world.controller(tmp_path / "probe")
    p = _predicted(c0, c0.submit(_fixed(payload, "s", n=1)), world.nodes[0])
    # room for two predicted peaks (with their margins) and half of a third
    world.nodes[0].memory_gb = round(2.5 * p / (1 - DEFAULT_MARGIN), 6)
    world.nodes[0].max_trials = 8
    c = world.controller(tmp_path / "run")
    sid = c.submit(_fixed(payload, "s", n=4))
    world.turns(c, 2)
    assert len(running(world.agents["a"])) == 2
    assert sorted(trials(c, sid).values()) == [
        TrialState.PENDING, TrialState.PENDING, TrialState.PLACED, TrialState.PLACED]


def test_trials_spread_over_nodes_before_they_stack(tmp_path, payload):
    world = World(names=("a", "b"))
    for n in world.nodes:
        n.max_trials = 2
    c = world.controller(tmp_path)
    c.submit(_fixed(payload, "s", n=2))
    world.turns(c, 2)
    assert len(running(world.agents["a"])) == 1 and len(running(world.agents["b"])) == 1


def test_a_node_alone_to_one_trial_lends_it_the_whole_budget(tmp_path, payload):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    c.submit(_fixed(payload, "s", n=2))
    world.turns(c, 2)
    [r] = running(world.agents["a"])
    assert r.args[0].job.memory.budget_gb == world.nodes[0].memory_gb


def test_oom_at_size_one_excludes_the_node_and_retries_end_in_a_reason(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    sid = c.submit(_fixed(payload, "s", n=1))
    world.turns(c, 1)
    [r] = running(world.agents["a"]) + running(world.agents["b"])
    first = r.args[0]
    r.settle(AttemptResult(attempt=first.attempt, outcome="oom", message="crossed the budget"))
    world.turns(c, 1)
    [t] = c.state.q("SELECT * FROM trials WHERE sweep = ?", (sid,))
    node = c.state.attempt(first.attempt)["node"]
    assert json.loads(t["excluded"]) == [node]
    [r2] = running(world.agents["a"]) + running(world.agents["b"])
    assert c.state.attempt(r2.args[0].attempt)["node"] != node   # the other node took it
    r2.settle(AttemptResult(attempt=r2.args[0].attempt, outcome="oom", message="again"))
    world.turns(c, 1)
    [t] = c.state.q("SELECT * FROM trials WHERE sweep = ?", (sid,))
    assert t["state"] == TrialState.FAILED, t["state"]
    assert c.state.one("SELECT reason FROM events WHERE trial = ? ORDER BY id DESC",
                       (t["id"],))["reason"] == ("out of memory at segment_size 1 on ['a', 'b'] "
                                                 "and no other node matches")


def test_out_of_memory_while_sharing_runs_again_on_a_node_to_itself(tmp_path, payload):
    world = World(names=("a",))
    world.nodes[0].max_trials = 3
    c = world.controller(tmp_path)
    sid = c.submit(_fixed(payload, "s", n=3))
    world.turns(c, 2)
    runs = running(world.agents["a"])
    assert len(runs) == 3
    victim = runs[0].args[0]
    runs[0].settle(AttemptResult(attempt=victim.attempt, outcome="oom", message="crossed"))
    world.turns(c, 2)
    t = c.state.trial(victim.trial)
    assert t["state"] == TrialState.PENDING and json.loads(t["excluded"]) == []   # not held against a
    assert not [r for r in running(world.agents["a"]) if r.args[0].trial == victim.trial]
    for r in running(world.agents["a"]):   # the other two finish: a is idle
        r.settle(AttemptResult(attempt=r.args[0].attempt, outcome="failed", message="x"))
    world.turns(c, 2)
    [again] = running(world.agents["a"])
    assert again.args[0].trial == victim.trial
    assert again.args[0].job.memory.budget_gb == world.nodes[0].memory_gb
    assert trials(c, sid)[victim.trial] == TrialState.PLACED
