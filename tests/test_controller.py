"""The controller's decisions, one at a time: what happens to a trial after each
way an attempt can end (out of memory above segment_size 1, at 1 alone on a
node, at 1 sharing one, a broken agent, retries spent), driven turn by turn with
the fake nodes, agents and clock of test_head_isolation (no Ray), over the real
state.db in tmp_path and the real planner on the demo model's facts.

Each test reads the decision from state.db as `segctl status` would (the trial's
state, excluded, max_segment, its events' reasons) and from what the fake agents
were asked to run next (node, segment_size, budget).
"""

from __future__ import annotations

import json

import pytest
import ray

from segctl.orchestrator.head import Controller
from segctl.orchestrator.submit import prepare
from segctl.schemas.records import AttemptResult, AttemptSpec
from segctl.schemas.states import Outcome, SweepState, TrialState
from segctl.schemas.sweep import load_sweep
from tests.test_head_isolation import Ref, World, running, small, sweep_state, trials

N_LAYERS = 4   # the demo model's layers: `auto` on a roomy node plans segment_size 4


@pytest.fixture(scope="module")
def payload(demo_dir):
    """The demo sweep as the CLI would send it (real model facts, real data bytes)."""
    return prepare(load_sweep(demo_dir / "sweep.yaml"), {})


def sweep_of(payload: dict, name: str, n: int = 1, segment_size="auto", **spec) -> dict:
    """n copies of the demo's first trial at `segment_size` (equal plans), sweep keys `spec`."""
    p = small(payload, name, n=1, **spec)
    first = p["trials"][0]
    first["job"].setdefault("memory", {})["segment_size"] = segment_size
    p["trials"] = [dict(json.loads(json.dumps(first)), index=i, name=f"t{i:03d}")
                   for i in range(n)]
    return p


def live(world: World) -> list[Ref]:
    """Every attempt the controller handed to an agent and is still waiting on."""
    return [r for a in world.agents.values() for r in running(a)]


def only(world: World) -> AttemptSpec:
    [r] = live(world)
    return r.args[0]


def end(world: World, spec: AttemptSpec, outcome: str, message: str = "") -> None:
    [r] = [r for r in live(world) if r.args[0].attempt == spec.attempt]
    r.settle(AttemptResult(attempt=spec.attempt, outcome=outcome, message=message))


def node_of(c: Controller, spec: AttemptSpec) -> str:
    return c.state.attempt(spec.attempt)["node"]


def reasons(c: Controller, tid: str) -> list[str]:
    return [r["reason"] for r in c.state.q("SELECT reason FROM events WHERE trial = ? ORDER BY id",
                                           (tid,))]


def attempts(c: Controller, tid: str) -> list:
    return c.state.q("SELECT * FROM attempts WHERE trial = ? ORDER BY id", (tid,))


# ------------------------------------------------------------------ out of memory

def test_oom_above_segment_size_one_replans_smaller_on_the_same_node(tmp_path, payload):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    c.submit(sweep_of(payload, "s", retries=3))
    world.turns(c, 2)
    first = only(world)
    assert first.job.memory.segment_size == N_LAYERS   # auto: the largest that fits
    end(world, first, "oom", "crossed memory.budget_gb")
    world.turns(c, 1)
    t = c.state.trial(first.trial)
    assert t["max_segment"] == N_LAYERS and json.loads(t["excluded"]) == []   # a is not held against it
    assert f"re-plan below segment_size {N_LAYERS} after out of memory on a" in reasons(c, first.trial)
    second = only(world)   # placed again at once, smaller, on the same node
    assert second.trial == first.trial and second.attempt != first.attempt
    assert second.job.memory.segment_size == N_LAYERS - 1 and node_of(c, second) == "a"
    # and again: each re-plan goes below the size that ran out of memory last
    end(world, second, "oom", "crossed memory.budget_gb")
    world.turns(c, 1)
    assert c.state.trial(first.trial)["max_segment"] == N_LAYERS - 1
    assert only(world).job.memory.segment_size == N_LAYERS - 2
    assert [a["segment_size"] for a in attempts(c, first.trial)] == [4, 3, 2]
    assert [a["outcome"] for a in attempts(c, first.trial)] == [Outcome.OOM, Outcome.OOM, None]


def test_oom_at_segment_size_one_alone_on_a_node_excludes_it(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    sid = c.submit(sweep_of(payload, "s", segment_size=1, retries=5))
    world.turns(c, 2)
    first = only(world)
    was = node_of(c, first)
    assert first.job.memory.budget_gb == 8.0   # the node's whole budget: not sharing
    end(world, first, "oom", "crossed memory.budget_gb")
    world.turns(c, 1)
    t = c.state.trial(first.trial)
    assert json.loads(t["excluded"]) == [was] and t["max_segment"] is None
    assert f"out of memory at segment_size 1 on {was}: try a larger node" in reasons(c, first.trial)
    # both nodes are free: it goes to the other one, never back to the one excluded
    second = only(world)
    other = node_of(c, second)
    assert other != was and second.job.memory.segment_size == 1
    end(world, second, "oom", "crossed memory.budget_gb")
    world.turns(c, 2)
    # out of memory at 1 on every node that matches: it fails (retries were left) saying so
    t = c.state.trial(first.trial)
    assert t["state"] == TrialState.FAILED and json.loads(t["excluded"]) == ["a", "b"]
    why = "out of memory at segment_size 1 on ['a', 'b'] and no other node matches"
    assert reasons(c, first.trial)[-1] == why and t["message"] == why   # status shows it
    assert not live(world) and len(attempts(c, first.trial)) == 2
    assert sweep_state(c, sid) == SweepState.DONE


def test_oom_under_the_jobs_own_budget_is_not_sharing(tmp_path, payload):
    """A job that asks for less than the node (memory.budget_gb) and runs out of it
    alone at segment_size 1 excludes the node, as on a whole node: it was not sharing."""
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    p = sweep_of(payload, "s", segment_size=1, retries=5)
    for t in p["trials"]:
        t["job"]["memory"]["budget_gb"] = 2.0
    c.submit(p)
    world.turns(c, 2)
    first = only(world)
    assert first.job.memory.budget_gb == 2.0
    end(world, first, "oom", "crossed memory.budget_gb")
    world.turns(c, 1)
    t = c.state.trial(first.trial)
    assert json.loads(t["excluded"]) == [node_of(c, first)]
    assert not any("next on a node to itself" in r for r in reasons(c, first.trial))


def test_a_trial_that_fits_no_node_fails_with_the_reason_in_its_message(tmp_path, payload):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    p = sweep_of(payload, "s", segment_size=1)
    for t in p["trials"]:
        t["seq_len"] = 10 ** 9   # no node holds a billion tokens
    sid = c.submit(p)
    world.turns(c, 1)
    [t] = c.state.trials(sid)
    assert t["state"] == TrialState.FAILED and t["message"].startswith("does not fit any node (a: ")


def test_a_trial_excluded_from_the_free_node_waits_for_another(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    sid = c.submit(sweep_of(payload, "s", n=2, segment_size=1))
    world.turns(c, 2)
    on = {node_of(c, r.args[0]): r.args[0] for r in live(world)}
    assert sorted(on) == ["a", "b"]
    end(world, on["a"], "oom", "crossed memory.budget_gb")
    world.turns(c, 3)
    # a is free but excluded for this trial; b is busy: it waits, a stays idle
    assert trials(c, sid)[on["a"].trial] == TrialState.PENDING
    assert [node_of(c, r.args[0]) for r in live(world)] == ["b"]
    end(world, on["b"], "failed", "bad row")
    world.turns(c, 1)
    nxt = only(world)
    assert nxt.trial == on["a"].trial and node_of(c, nxt) == "b"


def test_oom_while_sharing_a_node_runs_next_on_a_node_to_itself(tmp_path, payload):
    world = World(names=("a", "b"))
    for n in world.nodes:
        n.max_trials = 2
    a, b = world.nodes
    c = world.controller(tmp_path)
    sid = c.submit(sweep_of(payload, "s", n=6, segment_size=1, retries=3))
    world.turns(c, 2)
    by_node: dict[str, list[AttemptSpec]] = {}
    for r in live(world):
        by_node.setdefault(node_of(c, r.args[0]), []).append(r.args[0])
    assert {n: len(v) for n, v in by_node.items()} == {"a": 2, "b": 2}
    victim = by_node["a"][0]
    lent = c.state.attempt(victim.attempt)["budget_gb"]
    assert lent < a.memory_gb   # sharing: held to its prediction plus margin (or an even share)
    end(world, victim, "oom", "crossed memory.budget_gb")
    world.turns(c, 2)
    t = c.state.trial(victim.trial)
    # not the node's fault: a is not excluded (and the size cannot go lower)
    assert t["state"] == TrialState.PENDING and json.loads(t["excluded"]) == []
    assert reasons(c, victim.trial)[-1] == (f"out of memory sharing a ({lent:.3f} GB lent): "
                                            "next on a node to itself")
    # a's free slot goes to the next trial in line, which may share; the victim waits
    placed = {r.args[0].trial: node_of(c, r.args[0]) for r in live(world)}
    assert victim.trial not in placed and placed[f"{sid}-t004"] == "a"
    assert trials(c, sid)[f"{sid}-t005"] == TrialState.PENDING
    # b empties (both its trials end in one turn): the victim gets all of b, and b
    # takes nothing else while it runs, though t005 is waiting
    for spec in by_node["b"]:
        end(world, spec, "failed", "bad row")
    world.turns(c, 2)
    again = [r.args[0] for r in live(world) if r.args[0].trial == victim.trial]
    assert len(again) == 1 and node_of(c, again[0]) == "b"
    assert again[0].job.memory.budget_gb == b.memory_gb
    assert c.state.attempt(again[0].attempt)["budget_gb"] == b.memory_gb
    assert not c.takes_work(b) and trials(c, sid)[f"{sid}-t005"] == TrialState.PENDING
    assert [node_of(c, r.args[0]) for r in live(world)].count("b") == 1


def test_oom_above_segment_size_one_while_sharing_replans_smaller_and_alone(tmp_path, payload):
    """Both remedies at once: the size goes down (finish: the segment_size > 1 branch
    comes first) and, because the attempt was held to less than the whole node,
    placement waits for the node to itself (_place_sweep asks _shared_oom of
    every trial, whatever its size)."""
    world = World(names=("a",))
    world.nodes[0].max_trials = 2
    c = world.controller(tmp_path)
    c.submit(sweep_of(payload, "s", n=2, retries=3))
    world.turns(c, 2)
    victim, other = sorted((r.args[0] for r in live(world)), key=lambda s: s.attempt)
    size = victim.job.memory.segment_size
    assert size > 1 and c.state.attempt(victim.attempt)["budget_gb"] < 8.0
    end(world, victim, "oom", "crossed memory.budget_gb")
    world.turns(c, 2)
    t = c.state.trial(victim.trial)
    assert t["state"] == TrialState.PENDING and t["max_segment"] == size and json.loads(t["excluded"]) == []
    assert reasons(c, victim.trial)[-1] == (f"re-plan below segment_size {size} after out of "
                                            "memory on a")
    assert [r.args[0].trial for r in live(world)] == [other.trial]   # a is shared: it waits
    end(world, other, "failed", "bad row")
    world.turns(c, 1)
    again = only(world)
    assert again.trial == victim.trial and again.job.memory.segment_size < size
    assert again.job.memory.budget_gb == 8.0


# ------------------------------------------------------------------ retries

@pytest.mark.parametrize("how", ["oom", "agent_error", "node_lost"])
def test_retries_spent_fail_the_trial_with_the_reason(tmp_path, payload, how):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    sid = c.submit(sweep_of(payload, "s", retries=1))
    for _ in range(2):   # retries: 1 = two attempts in all
        world.turns(c, 2)
        spec = only(world)
        [r] = live(world)
        if how == "oom":
            r.settle(AttemptResult(attempt=spec.attempt, outcome="oom", message="crossed"))
        elif how == "agent_error":
            r.settle(error=OSError(28, "No space left on device"))
        else:
            r.settle(error=ray.exceptions.RayActorError())
    world.turns(c, 3)
    assert not live(world)   # no third attempt
    t = c.state.trial(spec.trial)
    assert t["state"] == TrialState.FAILED and t["message"] == "retries spent"
    assert reasons(c, spec.trial)[-1] == "retries spent (2 attempts, retries: 1)"
    assert [a["outcome"] for a in attempts(c, spec.trial)] == [how, how]
    assert sweep_state(c, sid) == SweepState.DONE


def test_a_head_restart_costs_no_retry(tmp_path, payload):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    sid = c.submit(sweep_of(payload, "s", segment_size=1, retries=0))
    world.turns(c, 2)
    first = only(world)
    del c   # the head goes away mid-attempt
    world2 = World(names=("a",))
    c2 = world2.controller(tmp_path)
    assert attempts(c2, first.trial)[0]["outcome"] == Outcome.INTERRUPTED
    assert trials(c2, sid) == {first.trial: TrialState.PENDING}
    c2.resume(sid)
    world2.turns(c2, 2)
    assert only(world2).trial == first.trial   # retries: 0, and yet it runs again


# ------------------------------------------------------------------ where a retry goes

def test_a_retry_goes_to_another_node_than_the_one_it_broke_on(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    c.submit(sweep_of(payload, "s", segment_size=1, retries=5))
    world.turns(c, 2)
    seen = []
    for _ in range(3):
        spec = only(world)
        seen.append(node_of(c, spec))
        [r] = live(world)
        r.settle(error=OSError(28, "No space left on device"))   # that node's disk is full
        world.turns(c, 1)
    # both nodes free each time: every retry leaves the node the last attempt broke on
    assert seen == ["a", "b", "a"]
    assert json.loads(c.state.trial(spec.trial)["excluded"]) == []   # broken is not excluded
    assert reasons(c, spec.trial).count("restart: no checkpoint yet") == 3
    assert node_of(c, only(world)) == "b"


def test_a_retry_takes_the_node_it_broke_on_when_no_other_is_free(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    sid = c.submit(sweep_of(payload, "s", n=2, segment_size=1, retries=5))
    world.turns(c, 2)
    on = {node_of(c, r.args[0]): r.args[0] for r in live(world)}
    [r] = [r for r in live(world) if r.args[0].attempt == on["a"].attempt]
    r.settle(error=OSError(28, "No space left on device"))
    world.turns(c, 1)
    # b is busy with the other trial: a takes the retry rather than leave it waiting
    again = [r.args[0] for r in live(world) if r.args[0].trial == on["a"].trial]
    assert len(again) == 1 and node_of(c, again[0]) == "a"
    assert set(trials(c, sid).values()) == {TrialState.PLACED}


# ------------------------------------------------------------------ the clock

def test_attempt_times_come_from_the_controllers_clock(tmp_path, payload):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    submitted = world.now
    sid = c.submit(sweep_of(payload, "s", segment_size=1))
    world.turns(c, 1)   # the agent comes up and takes the trial in this turn
    spec = only(world)
    a = c.state.attempt(spec.attempt)
    assert c.state.trial(spec.trial)["created"] == submitted and a["placed"] == world.now
    # runnable since the later of: the trial pending, its node free (its agent up)
    assert c.free_since["a"] == world.now and a["ready"] == world.now
    c.started(spec.attempt, pid=42, t=world.now + 1.5)
    assert c.state.attempt(spec.attempt)["dispatch_s"] == pytest.approx(1.5)
    assert trials(c, sid)[spec.trial] == TrialState.RUNNING
    world.now += 100.0
    end(world, spec, "failed", "bad row")
    world.turns(c, 1)
    # no `ended` from the node: the head's clock says when it ended, and the node is free since
    assert c.state.attempt(spec.attempt)["ended"] == world.now == c.free_since["a"]


# ------------------------------------------------------------------ a trial on several nodes

def test_a_trial_on_two_nodes_runs_one_rank_on_each_and_ends_as_its_first_failing_rank(
        tmp_path, payload):
    world = World(names=("a", "b", "c"))
    c = world.controller(tmp_path)
    p = sweep_of(payload, "s", segment_size=1, retries=3)
    job = p["trials"][0]["job"]
    job["distributed"] = {"nodes": 2}
    job["train"]["batch_size"] = 2
    c.submit(p)
    world.turns(c, 2)
    ranks = sorted((r.args[0] for r in live(world)), key=lambda spec: spec.rank)
    assert [spec.rank for spec in ranks] == [0, 1] and ranks[0].attempt == ranks[1].attempt
    aid, ring = ranks[0].attempt, ranks[0].ring
    nodes = c.state.attempt(aid)["node"].split(",")
    assert len(set(nodes)) == 2 and ranks[1].ring == ring
    assert ring == [f"{n}.lan:{ring[i].rsplit(':', 1)[1]}" for i, n in enumerate(nodes)]
    # rank 1's process is lost: rank 0 is cancelled, and the attempt ends once, as rank 1's
    [r1] = [r for r in running(world.agents[nodes[1]])]
    r1.settle(AttemptResult(attempt=aid, outcome="node_lost", message="engine killed"))
    world.turns(c, 1)
    assert any(r.what == "cancel" and r.args == (aid,) for r in world.agents[nodes[0]].calls)
    assert c.state.attempt(aid)["status"] != "ended"   # rank 0 still out
    [r0] = [r for r in running(world.agents[nodes[0]])]
    r0.settle(AttemptResult(attempt=aid, outcome="cancelled", message="cancelled"))
    world.turns(c, 2)
    a = c.state.attempt(aid)
    assert a["outcome"] == Outcome.NODE_LOST and a["message"] == f"rank 1 on {nodes[1]}: engine killed"
    # the retry takes two nodes again, the one it did not break on first
    again = sorted((r.args[0] for r in live(world)), key=lambda spec: spec.rank)
    assert len(again) == 2 and again[0].attempt != aid
    assert "c" in c.state.attempt(again[0].attempt)["node"].split(",")


def test_a_trial_on_more_nodes_than_are_free_waits_saying_so(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    p = sweep_of(payload, "s", segment_size=1)
    job = p["trials"][0]["job"]
    job["distributed"] = {"nodes": 3}
    job["train"]["batch_size"] = 3
    c.submit(p)
    world.turns(c, 2)
    assert not live(world)
    [(reason,)] = c.state.q("SELECT reason FROM waiting")
    assert reason.startswith("waiting for 3 nodes that fit together (2 free now; 2 up")


def test_a_node_without_the_rings_interface_fails_the_trial_saying_so(tmp_path, payload):
    world = World(names=("a", "b"))
    spawn = world.spawn

    def spawn_b_without_en9(name):
        agent = spawn(name)
        if name == "b":
            agent.refuse["ring_endpoint"] = ValueError(
                "distributed.interface: en9: b has no such interface with an IPv4 address "
                "(it has: eth0)")
        return agent
    world.spawn = spawn_b_without_en9
    c = world.controller(tmp_path)
    p = sweep_of(payload, "s", segment_size=1)
    job = p["trials"][0]["job"]
    job["distributed"] = {"nodes": 2, "interface": "en9"}
    job["train"]["batch_size"] = 2
    c.submit(p)
    world.turns(c, 2)
    assert not live(world)
    [t] = c.state.q("SELECT * FROM trials")
    assert t["state"] == TrialState.FAILED and "en9: b has no such interface" in t["message"]
