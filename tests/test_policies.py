"""The head's policies on plain values: placement, outcomes, early stopping (asha)
and tune probing decide from typed records, no Ray, no state.db, no clock of their
own (tests/test_controller.py and friends drive the controller that applies them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from segctl.orchestrator import asha, outcomes, placement, probing
from segctl.orchestrator.snapshot import Attempt, Trial
from segctl.schemas.names import EXIT_RANK_LOST
from segctl.schemas.records import AttemptResult, NodeInfo, Outcome, Plan, TrialState, TuneState
from segctl.schemas.search import SchedulerSpec
from segctl.schemas.states import TrialState

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("placement", "outcomes", "asha", "probing", "fairshare", "snapshot")


def trial(tid="s-t0", **kw) -> Trial:
    return Trial(id=tid, sweep="s", state=kw.pop("state", TrialState.PENDING), **kw)


def attempt(node="a", outcome=None, segment_size=4, budget_gb=8.0, aid=1) -> Attempt:
    return Attempt(id=aid, trial="s-t0", sweep="s", node=node, segment_size=segment_size,
                   budget_gb=budget_gb, outcome=outcome)


def node(name, memory_gb=8.0, max_trials=1, chip="sim", **labels) -> NodeInfo:
    return NodeInfo(name=name, chip=chip, memory_gb=memory_gb, max_trials=max_trials,
                    labels=labels)


def test_the_policies_import_nothing_that_does_io_and_read_no_clock():
    """Pure: no Ray, no SQLite, no stores, no time; `now` comes from the caller."""
    for name in POLICIES:
        src = (ROOT / "orchestrator" / f"{name}.py").read_text()
        imported = set()
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, ast.Import):
                imported |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom):
                imported.add((n.module or "").split(".")[0] if n.level == 0 else n.module or "")
        assert not imported & {"ray", "sqlite3", "time", "os", "state", "stores", "head"}, name
    head = (ROOT / "orchestrator" / "head.py").read_text()
    assert "time.monotonic()" not in head and "time.time()" not in head


# ------------------------------------------------------------------ asha

ASHA = SchedulerSpec(type="asha", grace_steps=4, reduction=2, max_steps=16)   # rungs 4, 8


def test_asha_records_each_trial_once_per_rung_and_only_at_rungs():
    assert ASHA.rungs() == [4, 8]
    assert asha.judge(ASHA, "t1", 5, 1.0, {}, finished=False) is None   # not a rung
    assert asha.judge(ASHA, "t1", 4, 1.0, {"t1": 0.5}, finished=False) is None   # decided before
    assert asha.judge(ASHA, "t1", 4, "1.5", {}, finished=False) == asha.Record("t1", 4, 1.5)


def test_asha_stops_a_trial_worse_than_the_top_fraction_once_enough_values_are_in():
    # below `reduction` values nobody is judged: the first at a rung always goes on
    assert asha.judge(ASHA, "t1", 8, 9.0, {}, finished=False) == asha.Record("t1", 8, 9.0)
    stop = asha.judge(ASHA, "t2", 8, 3.0, {"t1": 1.0}, finished=False)
    assert isinstance(stop, asha.Stop) and (stop.trial, stop.rung, stop.value) == ("t2", 8, 3.0)
    assert stop.reason == ("asha: val_loss 3 at rung 2 (step 8) below the top 1/2 of 2 "
                           "(cutoff 2)")
    # the better one goes on; so does a trial already finished, whatever its value
    assert asha.judge(ASHA, "t2", 8, 0.5, {"t1": 1.0}, finished=False) == asha.Record("t2", 8, 0.5)
    assert asha.judge(ASHA, "t2", 8, 3.0, {"t1": 1.0}, finished=True) == asha.Record("t2", 8, 3.0)


def test_asha_cutoff_interpolates_like_numpys_percentile():
    assert asha.asha_cutoff([3.0, 1.0, 2.0], 3) == pytest.approx(1 + 2 / 3)
    assert asha.asha_cutoff([5.0], 2) == 5.0


# ------------------------------------------------------------------ outcomes

def ended(outcome, message="", **kw) -> AttemptResult:
    return AttemptResult(attempt=1, outcome=outcome, message=message, **kw)


def after(r, a=None, t=None, *, node_gb=8.0, retries=3, used=1, last=...):
    a = a or attempt(outcome=r.outcome)
    return outcomes.after(r, a, t or trial(), last=a if last is ... else last,
                          node=node("a", node_gb) if node_gb else None, retries=retries, used=used)


def test_a_success_ends_the_trial_with_its_losses():
    [d] = after(ended("succeeded", final_loss=1.0, val_loss=None))
    assert d == outcomes.Ended(TrialState.SUCCEEDED, "finished on a: final loss 1.0000, val loss -",
                               dict(final_loss=1.0, val_loss=None, message=""))


def test_oom_above_segment_size_one_replans_below_it():
    r = ended("oom", "crossed memory.budget_gb")
    assert after(r) == [outcomes.Ended(TrialState.OOM, "a: crossed memory.budget_gb"),
                        outcomes.Replan("re-plan below segment_size 4 after out of memory on a",
                                        max_segment=4)]
    # a bound lower already stays the bound
    assert after(r, t=trial(max_segment=3))[1].max_segment == 3


def test_oom_at_segment_size_one_sharing_waits_for_a_node_to_itself_else_excludes_the_node():
    r = ended("oom")
    shared = attempt(outcome=Outcome.OOM, segment_size=1, budget_gb=3.0)
    assert after(r, shared)[1] == outcomes.Replan(
        "out of memory sharing a (3.000 GB lent): next on a node to itself")
    alone = attempt(outcome=Outcome.OOM, segment_size=1, budget_gb=8.0)
    assert after(r, alone, trial(excluded=("c",)))[1] == outcomes.Replan(
        "out of memory at segment_size 1 on a: try a larger node", excluded=("a", "c"))
    # held to the job's own budget is not sharing; a node gone says nothing either
    own = trial(job={"memory": {"budget_gb": 3.0}})
    assert after(r, shared, own)[1].excluded == ("a",)
    assert after(r, shared, node_gb=None)[1].excluded == ("a",)


@pytest.mark.parametrize("outcome", ["oom", "node_lost", "agent_error"])
def test_spent_retries_fail_the_trial(outcome):
    moves = after(ended(outcome), used=3, retries=2)
    assert moves[-1] == outcomes.Fail("retries spent (3 attempts, retries: 2)", "retries spent")
    assert after(ended(outcome), used=3, retries=3)[-1] in (
        outcomes.Retry(), outcomes.Replan("re-plan below segment_size 4 after out of memory on a",
                                          max_segment=4))


def test_unreadable_retries_fail_the_trial_saying_why():
    assert after(ended("oom"), retries="retries: not a number")[-1] == outcomes.Fail(
        "sweep s: reading it from state.db: retries: not a number",
        "sweep s: reading it from state.db: retries: not a number")


def test_a_lost_node_resumes_and_a_head_restart_is_never_charged():
    assert after(ended("node_lost", "node a lost")) == [
        outcomes.Ended(TrialState.NODE_LOST, "node a lost"), outcomes.Retry()]
    assert after(ended("interrupted"), used=9, retries=0)[-1] == outcomes.Retry()


def test_cancelled_and_failed_end_the_trial():
    assert after(ended("cancelled")) == [outcomes.Ended(TrialState.CANCELLED, "cancelled")]
    assert after(ended("failed", "bad row")) == [
        outcomes.Ended(TrialState.FAILED, "bad row", dict(message="bad row"))]
    assert after(ended("failed"))[0].reason == "failed"


def test_broke_on_names_the_node_of_a_lost_or_failed_agent_only():
    assert outcomes.broke_on(attempt(outcome=Outcome.NODE_LOST)) == ("a",)
    assert outcomes.broke_on(attempt(outcome=Outcome.AGENT_ERROR)) == ("a",)
    assert outcomes.broke_on(attempt(node="a,b", outcome=Outcome.NODE_LOST)) == ("a", "b")
    assert outcomes.broke_on(attempt(outcome=Outcome.OOM)) == ()
    assert outcomes.broke_on(None) == ()


def rank_end(outcome, message="", peak=1.0, ended=10.0, adapter=None) -> AttemptResult:
    return AttemptResult(attempt=9, outcome=outcome, message=message, peak_gb=peak, ended=ended,
                         adapter=adapter or {})


def test_an_attempt_on_several_nodes_ends_as_its_first_rank_to_fail():
    ok = outcomes.ranks_ended(9, [(1, "b", rank_end("succeeded", peak=2.0, ended=12.0)),
                                  (0, "a", rank_end("succeeded", adapter={"x": b"1"}))])
    assert (ok.outcome, ok.adapter, ok.peak_gb, ok.ended, ok.node) == (
        "succeeded", {"x": b"1"}, 2.0, 12.0, None)   # rank 0's adapter, the highest peak
    # rank 1 ran out of memory; rank 0 then lost its ring: the attempt is rank 1's oom
    oom = outcomes.ranks_ended(9, [(1, "b", rank_end("oom", "memory budget crossed")),
                                   (0, "a", rank_end("node_lost", "a rank of the ring is gone"))])
    assert (oom.outcome, oom.node, oom.message) == ("oom", "b", "rank 1 on b: memory budget crossed")
    # rank 0's lost ring reached the head first; rank 1's process was killed: rank 1 counts
    gone = rank_end("node_lost", "a rank is gone").model_copy(update={"exit_code": EXIT_RANK_LOST})
    killed = outcomes.ranks_ended(9, [(0, "a", gone),
                                      (1, "b", rank_end("node_lost", "engine killed by signal 9"))])
    assert (killed.node, killed.message) == ("b", "rank 1 on b: engine killed by signal 9")
    assert outcomes.ranks_ended(9, [(0, "a", gone), (1, "b", rank_end("cancelled"))]).node == "a"
    # the head cancelled the peers of a lost rank: the loss is what counts
    lost = outcomes.ranks_ended(9, [(0, "a", rank_end("cancelled", "cancelled")),
                                    (2, "c", rank_end("node_lost", "node c lost")),
                                    (1, "b", rank_end("cancelled", "cancelled"))])
    assert (lost.outcome, lost.node) == ("node_lost", "c")
    assert outcomes.ranks_ended(9, [(0, "a", rank_end("cancelled")),
                                    (1, "b", rank_end("succeeded"))]).outcome == "cancelled"
    # an oom on a node of several excludes that node alone
    t = trial(job={"distributed": {"nodes": 2}})
    moves = outcomes.after(oom, attempt(node="a,b", segment_size=1), t, last=None, node=None,
                           retries=3, used=1)
    assert moves[-1].excluded == ("b",)


# ------------------------------------------------------------------ placement

def plans(table: dict, calls: list | None = None):
    """A planner on plain values: {(node class memory, budget or None): Plan}; it
    fits where predicted <= budget (segment size: the budget, so bigger is faster)."""
    def plan(n: NodeInfo, budget_gb):
        if calls is not None:
            calls.append((n.name, budget_gb))
        budget = n.memory_gb if budget_gb is None else budget_gb
        need = table.get(n.memory_gb, 4.0)
        return Plan(segment_size=max(1, int(budget)), predicted_gb=need, budget_gb=budget,
                    fits=need <= budget, reason=f"needs {need} GB")
    return plan


def place(t=None, *, nodes, free=None, held=None, last=None, placement_=None, table=None,
          calls=None, margin=0.0):
    nodes = {n.name: n for n in nodes}
    return placement.place_trial(
        t or trial(), last, placement=placement_ or {}, margin=margin, nodes=nodes,
        free=list(nodes.values()) if free is None else free, held=held or {},
        plan=plans(table or {}, calls), cache={})


def test_no_node_alive_or_matching_waits_saying_so():
    assert place(nodes=[]) == placement.Wait("s-t0", "no node alive")
    assert place(nodes=[node("a")], placement_={"chip": "m4"}) == placement.Wait(
        "s-t0", "no node alive matches its placement {'chip': 'm4'}")


def test_a_trial_no_node_can_hold_fails_naming_each():
    assert place(nodes=[node("a"), node("b", 4.0)], table={8.0: 9.0, 4.0: 9.0}) == placement.Fail(
        "s-t0", "does not fit any node (a: needs 9.0 GB; b: needs 9.0 GB)")
    excluded = trial(excluded=("a",))
    assert place(excluded, nodes=[node("a")]) == placement.Fail(
        "s-t0", "out of memory at segment_size 1 on ['a'] and no other node matches")


def test_the_least_loaded_free_node_takes_it_then_the_faster_plan():
    a, b = node("a", max_trials=2), node("b", max_trials=2)
    d = place(nodes=[a, b], held={"a": {7: 2.0}})
    assert isinstance(d, placement.Place) and d.node.name == "b" and not d.solo
    # equally loaded: the larger segment size (all of b's 8 GB against a's 6 left)
    d = place(nodes=[a, b], held={"a": {7: 2.0}, "b": {8: 2.0}}, table={8.0: 1.0})
    assert d.node.name in ("a", "b") and d.plan.segment_size == 6


def test_a_shared_node_is_planned_on_what_is_left_and_lends_its_share():
    a = node("a", max_trials=4)
    calls = []
    d = place(nodes=[a], held={"a": {7: 3.0}}, table={8.0: 1.0}, calls=calls, margin=0.5)
    assert calls == [("a", None), ("a", 5.0)]   # the whole node, then what is left of it
    # predicted 1 GB plus the margin is 2; its even share of the node, 2, is not less
    assert d.budget_gb == pytest.approx(2.0)
    assert placement.lent_gb(a, d.plan, margin=0.5, solo=False, spare_gb=5.0, own_gb=None) == 2.0
    assert placement.lent_gb(a, d.plan, margin=0.0, solo=True, spare_gb=5.0, own_gb=None) == 8.0
    assert placement.lent_gb(a, d.plan, margin=0.0, solo=False, spare_gb=1.5, own_gb=None) == 1.5
    assert placement.lent_gb(a, d.plan, margin=0.0, solo=True, spare_gb=8, own_gb=3.0) == 3.0


def test_a_busy_node_that_cannot_hold_it_now_makes_it_wait_saying_how_much():
    a = node("a", max_trials=2)
    assert place(nodes=[a], held={"a": {7: 6.0}}, table={8.0: 3.0}, margin=0.25) == \
        placement.Wait("s-t0", "no free node fits (needs 4 GB, largest free budget 2 GB)")


def test_a_trial_that_ran_out_of_memory_sharing_waits_for_a_node_to_itself():
    a, b = node("a", max_trials=2), node("b", max_trials=2)
    last = attempt(node="a", outcome=Outcome.OOM, segment_size=1, budget_gb=4.0)
    assert place(nodes=[a], held={"a": {7: 1.0}}, last=last) == placement.Wait(
        "s-t0", "waiting for a node to itself (it ran out of memory sharing one)")
    d = place(nodes=[a, b], held={"a": {7: 1.0}}, last=last)
    assert d.node.name == "b" and d.solo and d.budget_gb == 8.0


def test_a_retry_goes_elsewhere_than_the_node_it_broke_on_where_it_can():
    a, b = node("a"), node("b")
    last = attempt(node="a", outcome=Outcome.NODE_LOST)
    assert place(nodes=[a, b], last=last).node.name == "b"
    assert place(nodes=[a, b], free=[a], last=last).node.name == "a"


def test_a_trial_on_several_nodes_takes_them_all_at_once_or_waits_saying_for_how_many():
    a, b, c = node("a"), node("b", 16.0), node("c", 4.0)
    t = trial(job={"distributed": {"nodes": 2}})
    d = place(t, nodes=[a, b, c], table={4.0: 9.0})   # c can never hold it
    assert isinstance(d, placement.Place)
    assert {d.node.name, *(r.node.name for r in d.ranks)} == {"a", "b"}
    assert [r.budget_gb for r in d.ranks] == [8.0 if d.node.name == "b" else 16.0]
    # one of the two busy: none is taken, and it says why
    assert place(t, nodes=[a, b, c], free=[a, c], table={4.0: 9.0}) == placement.Wait(
        "s-t0", "waiting for 2 nodes that fit together (1 free now)")
    # only one node up that can hold it: it waits (more may join), naming what it has
    assert place(t, nodes=[a, c], table={4.0: 9.0}) == placement.Wait(
        "s-t0", "waiting for 2 nodes that fit together (1 free now; 1 up that it fits: a)")
    # a retry after a lost rank prefers nodes it did not break on
    three = trial(job={"distributed": {"nodes": 2}})
    d = place(three, nodes=[a, node("a2"), node("a3")],
              last=attempt(node="a,a2", outcome=Outcome.NODE_LOST))
    assert "a3" in {d.node.name, *(r.node.name for r in d.ranks)}
    # min_nodes: a first attempt waits for all of them; a retry goes on as few
    t3 = trial(job={"distributed": {"nodes": 3, "min_nodes": 2}})
    assert isinstance(place(t3, nodes=[a, b, c], table={4.0: 9.0}), placement.Wait)
    d = place(t3, nodes=[a, b, c], table={4.0: 9.0}, last=attempt(node="a,b,x",
                                                                 outcome=Outcome.NODE_LOST))
    assert isinstance(d, placement.Place) and len(d.ranks) == 1
    assert place(t3, nodes=[a, c], table={4.0: 9.0}, last=attempt(outcome=Outcome.NODE_LOST)) == \
        placement.Wait("s-t0", "waiting for 2 nodes that fit together (1 free now; "
                               "1 up that it fits: a)")


def cabled(*nodes: NodeInfo, rdma: str = "rdma_en{}") -> list[NodeInfo]:
    """`nodes` each naming a device to every other (a full mesh of cables)."""
    return [n.model_copy(update={"rdma": {m.name: rdma.format(j) for j, m in enumerate(nodes)
                                          if m is not n}}) for n in nodes]


def test_a_trial_over_rdma_takes_nodes_cabled_to_each_other_or_waits_saying_so():
    """backend jaccl: the N nodes must each name their RDMA device to every other;
    the device file JACCL reads is each rank's row of those names."""
    a, b, c, d = cabled(node("a"), node("b"), node("c"))[:3] + [node("d", 16.0)]
    t = trial(job={"distributed": {"nodes": 2, "backend": "jaccl"}})
    got = place(t, nodes=[a, b, c, d])   # d is the roomiest, but has no cables
    assert isinstance(got, placement.Place) and "d" not in {got.node.name, got.ranks[0].node.name}
    ring = [got.node, got.ranks[0].node]
    matrix = placement.rdma_matrix(ring)
    assert matrix[0][0] is None and matrix[1][1] is None
    assert matrix[0][1] == ring[0].rdma[ring[1].name] and matrix[1][0] == ring[1].rdma[ring[0].name]
    # three cabled nodes, two of them busy: it waits, naming a set that would do
    assert place(t, nodes=[a, b, c, d], free=[a, d]) == placement.Wait(
        "s-t0", "waiting for 2 nodes cabled to each other over RDMA that fit together "
                "(a, b are, not all free now)")
    # a cable one way only is no cable
    one_way = [a, b.model_copy(update={"rdma": {}}), d]
    assert place(t, nodes=one_way) == placement.Wait(
        "s-t0", "waiting for 2 nodes cabled to each other over RDMA that fit together "
                "(no 2 of the nodes up that it fits are: see cluster.yaml's rdma)")
    # the same trial over TCP takes any two
    assert isinstance(place(trial(job={"distributed": {"nodes": 2}}), nodes=one_way),
                      placement.Place)
    # a retry with min_nodes goes on the largest cabled set that fits, down to it
    t3 = trial(job={"distributed": {"nodes": 3, "min_nodes": 2, "backend": "jaccl"}})
    pair = cabled(node("a"), node("b")) + [node("c")]
    assert isinstance(place(t3, nodes=pair), placement.Wait)
    got = place(t3, nodes=pair, last=attempt(node="a,b,x", outcome=Outcome.NODE_LOST))
    assert isinstance(got, placement.Place) and {got.node.name, got.ranks[0].node.name} == {"a", "b"}


def test_free_nodes_it_may_not_use_make_it_wait_for_one_it_may():
    a, b = node("a", room="x"), node("b", room="y")
    t = trial(excluded=("c",))
    assert place(t, nodes=[a, b, node("c")], free=[b], placement_={"room": "x"}) == placement.Wait(
        "s-t0", "waiting for a free node matching its placement {'room': 'x'} other than c "
                "(out of memory at segment_size 1 there)")


def test_eligible_nodes_are_found_once_a_turn_per_placement_and_exclusions():
    nodes = {n.name: n for n in (node("a"), node("b"), node("c", 16.0))}
    cache = {}
    names, classes = placement.eligible(nodes, {}, {"b"}, cache)
    assert names == {"a", "c"} and set(classes) == {("sim/8GB", 8.0), ("sim/16GB", 16.0)}
    nodes.pop("a")
    assert placement.eligible(nodes, {}, {"b"}, cache)[0] == {"a", "c"}   # the turn's answer


def test_a_node_takes_work_while_its_agent_is_up_a_slot_and_memory_are_left():
    a = node("a", max_trials=2)
    assert placement.takes_work(a, {"a": {1: 4.0}}, agent_up=True)
    assert not placement.takes_work(a, {"a": {1: 4.0}}, agent_up=False)
    assert not placement.takes_work(a, {"a": {1: 1.0, 2: 1.0}}, agent_up=True)   # slots
    assert not placement.takes_work(a, {"a": {"tune:x": float("inf")}}, agent_up=True)


def test_waiting_changes_write_only_what_changed():
    known = {"t1": "no node alive", "t2": "waiting for a free node"}
    now = {"t1": ("s", "no node alive"), "t3": ("s", "waiting for a free node")}
    assert placement.waiting_changes(known, now) == ({"t3": ("s", "waiting for a free node")},
                                                     ["t2"])
    # a turn that looked at t2 only speaks for t2
    assert placement.waiting_changes(known, {}, looked_at={"t2": "s"}) == ({}, ["t2"])


# ------------------------------------------------------------------ tune probing

REQUEST = dict(model="m", method="sft", prefix_shared=True, lora={"rank": 8}, head_chunk=64,
               attn_block=128, steps=2)


def queued(tune="tune-1", cls="sim/8GB", done=0) -> probing.Queued:
    return probing.Queued(tune, cls, REQUEST, [[64, 1], [64, 2], [128, 1]], done)


def test_each_queued_class_gets_a_free_idle_node_of_its_class():
    a, b, big = node("a"), node("b"), node("c", 16.0)
    nodes = {n.name: n for n in (a, b, big)}
    decisions, left = probing.assign([queued(done=1)], [a, b, big], nodes, {"a": {7: 1.0}})
    [d] = decisions
    assert (d.tune, d.node_class, d.node) == ("tune-1", "sim/8GB", "b")   # a runs something
    assert d.spec.points == [(64, 2), (128, 1)] and d.spec.budget_gb == 8.0   # what is left
    assert [n.name for n in left] == ["a", "c"]
    # the job's batch and pack reach the node (a request of an older head: one row, auto)
    assert (d.spec.pack_rows, d.spec.pack) == (1, "auto")
    c = probing.Queued("tune-1", "sim/8GB", dict(REQUEST, pack_rows=4, pack=False), [[64, 1]])
    [d], _ = probing.assign([c], [a], {"a": a}, {})
    assert (d.spec.pack_rows, d.spec.pack) == (4, False)


def test_a_class_waits_for_a_busy_node_and_fails_with_none_up():
    a = node("a")
    decisions, left = probing.assign([queued(), queued("tune-2"), queued(cls="m4/8GB")], [a],
                                     {"a": a}, {})
    assert [type(d) for d in decisions] == [probing.ProbeOn, probing.NoNode]   # tune-2 waits
    assert decisions[1] == probing.NoNode("tune-1", "m4/8GB", "no node of class m4/8GB is up")
    assert left == []


def test_a_probes_end_says_its_class_state():
    assert probing.ended("") == probing.ended(None) == TuneState.DONE
    assert probing.ended("cancelled") == TuneState.CANCELLED
    assert probing.ended("node a lost (RayActorError)") == TuneState.FAILED


def test_a_measured_point_is_one_row_of_the_plan_table():
    req = dict(REQUEST, model_name="demo", n_layers=4, method_key="sft",
               lora={"rank": 8, "num_layers": -1, "keys": None})
    event = dict(time=5.0, seq_len=64, segment_size=2, fits=True, peak_gb=1.5, steps=2,
                 phases=[["forward", 1.0], ["backward", 1.5]])
    row = probing.point_row("tune-1", req, "sim/8GB", "a", "sim", 8.0, event)
    assert (row["tune"], row["node_class"], row["node"], row["budget_gb"]) == (
        "tune-1", "sim/8GB", "a", 8.0)
    assert row["phases"] == ["forward", "backward"] and row["phase_peaks"] == [1.0, 1.5]
    assert row["step_s"] is None and row["message"] == "" and row["lora_rank"] == 8


def test_only_an_attempt_that_may_go_again_is_charged():
    assert [o.value for o in Outcome if outcomes.charged(o)] == ["oom", "node_lost", "agent_error"]


def test_every_reason_is_written_for_a_small_backlog_a_changed_fleet_or_once_in_a_while():
    due = lambda pending, shape, now: placement.every_reason_due(   # noqa: E731
        pending, shape, (100.0, "s1"), now, upto=10, every_s=1.0)
    assert due(10, "s1", 100.0)                                    # a small backlog: always
    assert not due(11, "s1", 100.5)                                # a large one: the tried only
    assert due(11, "s2", 100.5) and due(11, "s1", 101.0)           # ... until it changes or 1 s
    assert placement.every_reason_due(11, "s1", (float("-inf"), None), 0.0, upto=10, every_s=1)


def test_every_pending_trial_has_the_reason_it_was_not_placed_or_its_sweeps():
    from segctl.orchestrator.fairshare import Contender
    first = Contender(sweep="s1", priority=0, share=1.0, created=1.0, running=2, pending=3,
                      tried=2, placed=1)
    capped = Contender(sweep="s2", priority=0, share=1.0, created=2.0, running=1, pending=1,
                       cap=1)
    tried = {"a": None, "b": "no free node fits (needs 9 GB, largest free budget 8 GB)", "x": ""}
    got = placement.waiting_reasons([first, capped], {"s1": ["a", "b", "c"], "s2": ["d"]},
                                    tried, nodes=2, slots=2)
    assert got == {"b": ("s1", tried["b"]), "c": ("s1", "waiting for a free node"),
                   "d": ("s2", "sweep concurrency cap (1 running)")}


def test_a_trial_row_is_decoded_once_into_its_record():
    from segctl.orchestrator.state import attempt_of, trial_of
    row = dict(id="s-t0", sweep="s", state=TrialState.PENDING, job='{"memory": {"budget_gb": 2.0}}',
               model_info="{}", seq_len=64, inputs='{"train.jsonl": "ab"}', max_segment=3,
               excluded='["b", "a"]', runnable_since=5.0)
    t = trial_of(row)
    assert t.state == TrialState.PENDING and t.excluded == ("b", "a") and t.own_budget_gb == 2.0
    a = attempt_of(dict(id=1, trial="s-t0", sweep="s", node="a", segment_size=2, budget_gb=None,
                        outcome="oom"))
    assert a.outcome == Outcome.OOM
    assert attempt_of(dict(a.__dict__, outcome="from-the-future")).outcome == "from-the-future"
