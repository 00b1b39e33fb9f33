"""Where a pending trial goes: which free node, at which plan, lent how much memory,
or why it waits, or that it never can run (docs/design.md, "Sharing the fleet",
step 4). Which sweep's trial is tried next is fairshare.py's question; this
module answers for one trial at a time, on plain values: the nodes up, the free
ones, what running attempts hold, and a `plan(node, budget_gb)` function (the
planner with the trial's memory model; None: the whole node's budget).

The controller (head.py `place`) asks `place_trial` for each trial its turn
tries, applies the decision (dispatch to the node's agent, a FAILED move, or the
reason it waits in state.db) and takes the node out of the free ones once it is
full."""

from __future__ import annotations

import json
from typing import Callable, Mapping, NamedTuple, Optional

from segctl.schemas.records import NodeInfo, Plan

from .fairshare import Contender, why_waiting
from .outcomes import broke_on, shared_oom
from .snapshot import Attempt, Held, Trial

PlanFn = Callable[[NodeInfo, Optional[float]], Plan]   # (node, budget GB or None: all of it)


class Rank(NamedTuple):
    """One more node of a trial on several nodes, at its own plan and budget."""
    node: NodeInfo
    plan: Plan
    budget_gb: float


class Place(NamedTuple):
    """Start an attempt of `trial` on `node` at `plan`, guarded at `budget_gb`
    (`solo`: it has the node to itself); a trial on several nodes has its rank 0
    there and ranks 1, 2, ... on `ranks`."""
    trial: str
    node: NodeInfo
    plan: Plan
    budget_gb: float
    solo: bool
    ranks: tuple[Rank, ...] = ()


class Wait(NamedTuple):
    """`trial` stays pending, for `reason` (`segctl status` shows it)."""
    trial: str
    reason: str


class Fail(NamedTuple):
    """`trial` can never run where it may: it fails for `reason`."""
    trial: str
    reason: str


def plan_class(n: NodeInfo) -> tuple[str, float]:
    """What a node's plans depend on: its class (chip) and its memory budget."""
    return n.node_class, n.memory_gb


def spare(n: NodeInfo, held: Held) -> float:
    """GB of node `n`'s budget no running attempt holds."""
    return n.memory_gb - sum(held.get(n.name, {}).values())


def takes_work(n: NodeInfo, held: Held, agent_up: bool) -> bool:
    """Whether node `n` can start one more attempt: its agent is up, it runs fewer
    than its max_trials, and memory is left (a tune holds it whole)."""
    return agent_up and len(held.get(n.name, {})) < n.max_trials and spare(n, held) > 0


def eligible(nodes: Mapping[str, NodeInfo], placement: dict, excluded,
             cache: dict) -> tuple[set, dict]:
    """(names, {(class, memory_gb): one such node}) of the nodes a trial with this
    placement and these excluded nodes may use; `cache` keeps them for the turn:
    most trials share both, and a fleet has hundreds of nodes of a few classes."""
    key = (json.dumps(placement, sort_keys=True), frozenset(excluded))
    if key not in cache:
        names: set = set()
        classes: dict = {}
        for n in nodes.values():
            if n.matches(placement) and n.name not in excluded:
                names.add(n.name)
                classes.setdefault(plan_class(n), n)
        cache[key] = names, classes
    return cache[key]


def place_trial(t: Trial, last: Optional[Attempt], *, placement: dict, margin: float,
                nodes: Mapping[str, NodeInfo], free: list[NodeInfo], held: Held,
                plan: PlanFn, cache: dict) -> Place | Wait | Fail:
    """Trial `t` (its last attempt `last`) of a sweep with this `placement` and
    planner `margin`: on the best of the `free` nodes where it fits now, else why
    it waits, else (no node it may use can ever hold it) Fail. `cache`: the turn's
    cache for `eligible`."""
    excluded = set(t.excluded)
    names, classes = eligible(nodes, placement, excluded, cache)
    if not names:
        if excluded and nodes:
            return Fail(t.id, f"out of memory at segment_size 1 on {sorted(excluded)} "
                              "and no other node matches")
        return Wait(t.id, "no node alive" + (f" matches its placement {placement}"
                                             if nodes else ""))
    # Whether it fits a node at all is judged on the whole node (a plan depends
    # on the node only through its class) ...
    by_class = {k: plan(n, None) for k, n in classes.items()}
    if not any(p.fits for p in by_class.values()):
        worst = "; ".join(f"{n}: {by_class[plan_class(nodes[n])].reason}" for n in sorted(names))
        return Fail(t.id, f"does not fit any node ({worst})")
    # ... where it goes now, on what running attempts leave of each (a trial
    # that ran out of memory sharing a node waits for one to itself).
    solo = shared_oom(last, nodes.get(last.node) if last else None, t.own_budget_gb)
    fitting, short = [], []   # short: free nodes it may use, too small for it now
    for n in free:
        if n.name not in names:
            continue
        whole = by_class[plan_class(n)]
        if not whole.fits:
            short.append(whole)
        elif not (solo and held.get(n.name)):
            left = spare(n, held)
            p = whole if left >= n.memory_gb else plan(n, left)
            if p.fits:
                fitting.append((n, p))
            else:
                short.append(p)
    # a trial on several nodes takes `nodes` of them; a retry (it ran before) as few
    # as its `min_nodes`, when that many fit now and no more
    ranks = min(t.nodes, max(len(fitting), t.min_nodes)) if last else t.nodes
    if len(fitting) < ranks:   # it fits somewhere busy: it waits for room there
        if ranks > 1:
            return Wait(t.id, _why_not_together(ranks, fitting, names, by_class, nodes))
        return Wait(t.id, _why_not_now(short, solo, any(n.name in names for n in free),
                                       placement, excluded, margin))
    # the least loaded node first (spread, then stack), then the fastest plan; a
    # trial whose last attempt broke on a node (lost, or its agent failed: a full
    # disk) goes to other ones where it can, or that node takes every retry. A trial
    # on several nodes takes the first `ranks` of that order, all at once or none.
    broke = broke_on(last)
    fitting.sort(key=lambda np: (np[0].name not in broke, -len(held.get(np[0].name, {})),
                                 np[1].segment_size, -np[0].memory_gb), reverse=True)
    if t.over_rdma and ranks > 1:   # JACCL: nodes cabled to each other, the most that fit
        fewest = t.min_nodes if last else ranks
        fitting = next((m for r in range(ranks, fewest - 1, -1)
                        if (m := mesh(fitting, r, key=lambda np: np[0]))), [])
        if not fitting:
            return Wait(t.id, _why_not_cabled(ranks, nodes, names, by_class))
        ranks = len(fitting)
    lent = [Rank(n, p, lent_gb(n, p, margin=margin, solo=solo, spare_gb=spare(n, held),
                               own_gb=t.own_budget_gb)) for n, p in fitting[:ranks]]
    return Place(t.id, lent[0].node, lent[0].plan, lent[0].budget_gb, solo, tuple(lent[1:]))


def _why_not_together(ranks: int, fitting: list, names: set, by_class: dict,
                      nodes: Mapping[str, NodeInfo]) -> str:
    """Why a trial on `ranks` nodes waits: fewer of the nodes it may use fit it now
    (`fitting`), or are up at all."""
    could = [n.name for n in _up_that_fit(names, nodes, by_class)]
    why = f"waiting for {ranks} nodes that fit together ({len(fitting)} free now"
    if len(could) < ranks:
        why += f"; {len(could)} up that it fits: {', '.join(could) or 'none'}"
    return why + ")"


def _up_that_fit(names: set, nodes: Mapping[str, NodeInfo], by_class: dict) -> list[NodeInfo]:
    """The nodes up that a trial may use (`names`) and fits on, whole, by name."""
    return [nodes[n] for n in sorted(names) if by_class[plan_class(nodes[n])].fits]


def cabled(a: NodeInfo, b: NodeInfo) -> bool:
    """Whether nodes a and b each name the RDMA device cabled to the other (JACCL)."""
    return b.name in a.rdma and a.name in b.rdma


def mesh(order: list, size: int, key=lambda x: x) -> list:
    """`size` items of `order` whose nodes (`key`) are all cabled to each other,
    the earliest in `order` first (greedy from each start in turn); [] if none."""
    for i, first in enumerate(order):
        chosen = [first]
        for x in order[:i] + order[i + 1:]:
            if len(chosen) < size and all(cabled(key(x), key(c)) for c in chosen):
                chosen.append(x)
        if len(chosen) == size:
            return sorted(chosen, key=order.index)
    return []


def rdma_matrix(nodes: list[NodeInfo]) -> list[list[Optional[str]]]:
    """JACCL's device file for ranks on `nodes` (rank order): rank i's RDMA device
    to rank j, None for itself."""
    return [[None if a is b else a.rdma.get(b.name) for b in nodes] for a in nodes]


def _why_not_cabled(ranks: int, nodes: Mapping[str, NodeInfo], names: set, by_class: dict) -> str:
    """Why a trial over RDMA waits with enough free nodes that fit it: no `ranks` of
    them are cabled to each other; and which such set of the nodes up it could take."""
    some = mesh(_up_that_fit(names, nodes, by_class), ranks)
    return (f"waiting for {ranks} nodes cabled to each other over RDMA that fit together ("
            + (f"{', '.join(n.name for n in some)} are, not all free now" if some else
               f"no {ranks} of the nodes up that it fits are: see cluster.yaml's rdma")
            + ")")


def _why_not_now(short: list[Plan], solo: bool, free_eligible: bool, placement: dict,
                 excluded: set, margin: float) -> str:
    if short:
        need = min(p.predicted_gb for p in short) / (1 - margin)
        return (f"no free node fits (needs {need:.3g} GB, largest free budget "
                f"{max(p.budget_gb for p in short):.3g} GB)")
    if solo and free_eligible:
        return "waiting for a node to itself (it ran out of memory sharing one)"
    why = "waiting for a free node"   # the free ones are nodes it may not use
    if placement:
        why += f" matching its placement {placement}"
    if excluded:
        why += (f" other than {', '.join(sorted(excluded))} (out of memory at "
                "segment_size 1 there)")
    return why


def lent_gb(node: NodeInfo, plan: Plan, *, margin: float, solo: bool, spare_gb: float,
            own_gb: Optional[float]) -> float:
    """The memory an attempt at `plan` is lent on `node` (its guard holds it to it).
    A node alone to itself (max_trials 1), or a `solo` attempt, lends all of the
    node; a node that shares lends what the plan predicts plus the margin, at least
    its even share of the node (a low prediction of a small trial costs nothing
    then), at most what is left. The job's own budget, where smaller, wins."""
    hold = node.memory_gb if node.max_trials == 1 or solo else min(
        spare_gb, max(plan.predicted_gb / (1 - margin), node.memory_gb / node.max_trials))
    return min(own_gb or hold, hold)


def waiting_reasons(turn: list[Contender], pending: Mapping[str, list[str]],
                    tried: Mapping[str, Optional[str]], *, nodes: int,
                    slots: int) -> dict[str, tuple[str, str]]:
    """Why each pending trial (`pending`: sweep -> its pending trials' ids) waits
    after a turn, trial -> (sweep, reason): the reason found when the turn tried it
    (`tried`: None, placed; '', failed: neither waits), else its sweep's reason
    not to have got to it (fairshare.why_waiting)."""
    waiting = {}
    for c in turn:
        left = why_waiting(c, turn, nodes=nodes, slots=slots)
        for tid in pending[c.sweep]:
            reason = tried.get(tid, left)
            if reason:
                waiting[tid] = (c.sweep, reason)
    return waiting


def waiting_changes(known: Mapping[str, str], waiting: Mapping[str, tuple[str, str]],
                    looked_at=None) -> tuple[dict, list]:
    """What to write of why trials wait: (trial -> (sweep, reason) changed since
    `known` (trial -> the reason state.db has), trials that no longer wait).
    `looked_at`: the trials `waiting` speaks for (None: every pending trial); a
    trial among them and not in `waiting` no longer waits."""
    changed = {t: v for t, v in waiting.items() if known.get(t) != v[1]}
    scope = known if looked_at is None else looked_at
    return changed, [t for t in scope if t not in waiting and t in known]


def every_reason_due(pending: int, shape, noted: tuple[float, object], now: float, *,
                     upto: int, every_s: float) -> bool:
    """Whether a turn writes why every pending trial waits, or only the trials it
    tried: always up to `upto` pending trials; past that when the sweeps or nodes
    (`shape`) changed since the last whole write (`noted`: its (time, shape)), or
    `every_s` after it."""
    return pending <= upto or shape != noted[1] or now - noted[0] >= every_s
