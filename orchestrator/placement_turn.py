"""The placement turn: free nodes to a tune's probes, then to pending trials, as
the pure policies say (probing.assign; fairshare.next_sweep for whose trial is
tried next; placement.place_trial for where and at which plan, or why it waits).
Methods of the Controller (orchestrator/head.py), kept here so that its class
reads as the loop; this half applies the policies' decisions: it starts
attempts and probes, fails what cannot run, and writes why the others wait.
"""

from __future__ import annotations

from collections import Counter

from segctl.schemas.defaults import DEFAULT_MARGIN
from segctl.schemas.job import JobSpec
from segctl.schemas.records import NodeInfo, SweepState, TrialState, TuneState

from . import fairshare, placement, planner, probing
from .controller_base import ControllerBase
from .memory_settings import plan_for
from .snapshot import Sweep, Trial
from .state import sweep_record, trial_of

WAITING_WHOLE_UPTO = 2000  # pending trials whose reasons to wait are written every turn
WAITING_EVERY_S = 1.0  # past that, why every pending trial waits is written this often

class PlacementTurn(ControllerBase):
    """The placement half of the Controller: its attributes are the Controller's."""

    def takes_work(self, n: NodeInfo) -> bool:
        """Whether node `n` can start one more attempt (placement.takes_work)."""
        return placement.takes_work(n, self.held, n.name in self.agents)

    def slots(self) -> int:
        """Attempts the fleet can run at once."""
        return sum(n.max_trials for n in self.nodes.values())

    def spare(self, n: NodeInfo) -> float:
        """GB of node `n`'s budget no running attempt holds."""
        return placement.spare(n, self.held)

    def place(self) -> None:
        """Free nodes to pending trials: a tune's probes first, then trial by trial in
        the order of fairshare.next_sweep (priority, then fair share among equals, then
        each sweep's own order), each where placement.place_trial says. Every pending
        trial left has its reason in state.db."""
        free = [n for n in self.nodes.values() if self.takes_work(n)]
        free = self._place_probes(free)
        # What each sweep runs is what it has in flight: an attempt that ended this turn
        # frees its share before its trial's end is filed.
        runs = Counter(f.sweep for f in {f.attempt: f for f in self.inflight.values()}.values())
        sweeps, turn = {}, []
        for s in self.state.running_sweeps():
            try:   # a row an older or hostile writer left unusable fails its sweep alone
                spec = sweep_record(s)
            except Exception as e:
                self.fail_sweep(s["id"], self.fault(f"sweep {s['id']}: reading it from state.db", e))
                continue
            sweeps[s["id"]] = spec
            turn.append(fairshare.Contender(
                sweep=s["id"], priority=spec.priority, share=spec.share,
                created=spec.created, cap=spec.concurrency,
                pending=self.state.count_trials(s["id"], [TrialState.PENDING]),
                running=runs[s["id"]],
                served=self.served.get(s["id"], 0)))
        # A sweep can have 20,000 pending trials and a turn places a few: their ids
        # are read a page at a time as the turn gets to them, and a whole row (its
        # job, its model) only for a trial it tries. Why each of the others waits is
        # written every turn up to WAITING_WHOLE_UPTO pending trials; past that, once
        # a second, or at once when the sweeps or nodes change.
        now = self.clock()
        shape = (frozenset(sweeps), frozenset(self.nodes))
        whole = placement.every_reason_due(sum(c.pending for c in turn), shape,
                                           self.waiting_noted, now, upto=WAITING_WHOLE_UPTO,
                                           every_s=WAITING_EVERY_S)
        pending = {sid: _PendingIds(self.state, sid, whole) for sid in sweeps}
        why: dict[str, str | None] = {}   # trial -> why it waits (None: placed), for those tried
        tried: dict[str, str] = {}   # trial -> its sweep
        eligible: dict = {}   # the nodes a placement may use, found once a turn
        while free and (c := fairshare.next_sweep(turn)) is not None:
            tid = pending[c.sweep][c.tried]
            c.tried += 1
            tried[tid] = c.sweep
            try:
                why[tid] = self._place_trial(sweeps[c.sweep], self.state.trial_record(tid), free,
                                             eligible)
            except Exception as e:   # this sweep cannot be planned: it fails, the others go on
                self.fail_sweep(c.sweep, self.fault(f"sweep {c.sweep}: placing it", e))
                turn.remove(c)
                continue
            if why[tid] is None:
                c.running += 1
                c.placed += 1
                self.placements += 1
                self.served[c.sweep] = self.placements
        if not whole:   # only the trials this turn tried
            self._note_waiting({t: (tried[t], r) for t, r in why.items() if r}, looked_at=tried)
            return
        self._note_waiting(placement.waiting_reasons(
            turn, {c.sweep: pending[c.sweep].all() for c in turn}, why, nodes=len(self.nodes),
            slots=self.slots()))
        self.waiting_noted: tuple[float, object] = (now, shape)

    def _note_waiting(self, waiting: dict[str, tuple[str, str]],
                      looked_at=None) -> None:
        """Write to state.db the reasons that changed since the last placement (most
        trials wait for the same reason turn after turn); see placement.waiting_changes."""
        changed, gone = placement.waiting_changes(self.waiting, waiting, looked_at)
        if changed or gone:
            self.state.note_waiting(changed, gone)
            if looked_at is None:
                self.waiting = {t: v[1] for t, v in waiting.items()}
            else:
                for t in gone:
                    del self.waiting[t]
                self.waiting.update({t: v[1] for t, v in changed.items()})

    def _place_trial(self, spec: Sweep, t: Trial, free: list[NodeInfo],
                     eligible: dict) -> str | None:
        """Apply placement.place_trial for trial `t` of a sweep (`spec`: its
        sweep_record): start it on the node chosen (taking the node out of `free`
        once it is full), fail it, or return why it waits. None when it went; ''
        when it failed. `eligible`: the turn's cache for placement.eligible."""
        knobs = dict(spec.planner)
        margin = knobs.get("margin", DEFAULT_MARGIN)
        d = placement.place_trial(
            t, self.state.last_attempt_record(t.id), placement=dict(spec.placement),
            margin=margin, nodes=self.nodes, free=free, held=self.held, cache=eligible,
            plan=lambda n, budget_gb: (self._plan(t, n, knobs) if budget_gb is None else
                                       self._plan_now(t, n, knobs, budget_gb=budget_gb)))
        if isinstance(d, placement.Wait):
            return d.reason
        if isinstance(d, placement.Fail):
            self.state.move(t.id, TrialState.FAILED, d.reason, message=d.reason)
            self._maybe_done(t.sweep)
            return ""
        self.dispatch(t, d)
        for n in [d.node] + [r.node for r in d.ranks]:
            if n in free and not self.takes_work(n):
                free.remove(n)
        return None

    def fail_sweep(self, sid: str, reason: str) -> None:
        """The sweep cannot go on: its trials that have not started fail with the
        reason, running ones finish, and nothing more of it is placed."""
        for t in self.state.trials(sid, TrialState.PENDING):
            self.state.move(t["id"], TrialState.FAILED, reason, message=reason)
        self.state.set_sweep_state(sid, SweepState.FAILED, reason)

    def _place_probes(self, free: list[NodeInfo]) -> list[NodeInfo]:
        """Start the probes probing.assign gives a node, fail the classes it finds
        no node for; returns the nodes left free. Probes go first: what they
        measure plans the trials."""
        queued = [probing.Queued(c["tune"], c["node_class"], c["request"], c["points"], c["done"])
                  for c in self.state.queued_tune_classes()]
        decisions, left = probing.assign(queued, free, self.nodes, self.held)
        for d in decisions:
            if isinstance(d, probing.NoNode):
                self.state.move_tune_class(d.tune, d.node_class, TuneState.FAILED, error=d.error)
                continue
            ref = self.agents[d.node].probe.remote(d.tune, d.spec)
            self.probing[ref] = (d.tune, d.node_class, d.node)
            self.held[d.node] = {f"tune:{d.tune}": float("inf")}   # probes measure a whole node
            self.state.move_tune_class(d.tune, d.node_class, TuneState.RUNNING, node=d.node)
        return left

    def _plan(self, t: Trial, node: NodeInfo, knobs: dict):
        # a plan depends on the node only through its class (chip and budget): one per
        # class, not one per node, or a fleet of N alike nodes plans each trial N times
        key = (t.id, *placement.plan_class(node), t.max_segment)
        if key not in self.plans:
            self.plans[key] = self._plan_now(t, node, knobs)
        return self.plans[key]

    def _plan_now(self, t: Trial, node: NodeInfo, knobs: dict, budget_gb: float | None = None):
        """The planner's answer for trial `t` (a Trial, or its state.db row) on `node`."""
        if not isinstance(t, Trial):
            t = trial_of(t)
        return plan_for(self.tuned, planner.ModelInfo.from_dict(t.model_info),
                        JobSpec.model_validate(t.job), seq_len=t.seq_len,
                        node_class=node.node_class,
                        budget_gb=node.memory_gb if budget_gb is None else budget_gb,
                        knobs=knobs, below=t.max_segment)

class _PendingIds:
    """The ids of a sweep's pending trials in its order, read from state.db a page
    at a time as a turn indexes them (all at once when `whole`)."""
    PAGE = 256

    def __init__(self, state, sid: str, whole: bool):
        self.state, self.sid = state, sid
        self.ids: list[str] = []
        self.last, self.done = -1, False
        if whole:
            self.all()

    def _more(self, limit: int) -> None:
        rows = self.state.pending_ids(self.sid, after=self.last, limit=limit)
        self.ids += [tid for tid, _ in rows]
        if rows:
            self.last = rows[-1][1]
        self.done = limit < 0 or len(rows) < limit

    def __getitem__(self, i: int) -> str:
        while i >= len(self.ids) and not self.done:
            self._more(self.PAGE)
        return self.ids[i]

    def all(self) -> list[str]:
        if not self.done:
            self._more(-1)
        return self.ids
