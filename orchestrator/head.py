"""The head's controller: it owns state.db and the stores and runs the loop (what
runs next, where, and what to do when it ends). orchestrator/actor.py runs it as
a detached Ray actor.

The controller decides nothing itself: it reads typed records (snapshot.py, from
state.py), asks a policy, a pure function of those records, and applies the
decision (state.db, the stores, the agents):
  placement.py   where a pending trial goes, at which plan, lent how much memory,
                 or why it waits; fairshare.py: whose trial is tried next;
  outcomes.py    what an ended attempt means for its trial: retry, re-plan, fail;
  asha.py        early stopping at the rungs (the sweep key `scheduler:`);
  probing.py     which node measures each queued class of a tune.

One loop, top to bottom each turn:
  1. see which nodes are alive (Ray's node table) and give each an agent;
  2. collect attempts that ended and apply their outcome;
  3. place pending trials: a tune's probes first, then highest priority first,
     among equal priorities the sweep furthest below its fair share, under the
     sweep's concurrency cap, only on nodes where the planner predicts the trial
     fits. A node takes up to its max_trials at once: each attempt holds the
     memory its plan predicts (plus the margin) and is guarded at that, and the
     next trial is planned in what is left. Each trial left pending gets the
     reason it waits in state.db (`segctl status` shows it).
Agents call back into the same actor (`started`, `ingest`, `checkpoint`), which
makes this actor the collector: the stores' only writer. Time is the injected
`clock` alone (a test's fake clock drives every decision that depends on it).

No failure stops the loop. Each is charged to the smallest thing it belongs to:
a sweep that cannot be planned fails that sweep, an agent that raises ends that
attempt (and frees its node), a store that cannot be written leaves that attempt
to be sealed again later; the loop goes on placing everyone else. What went
wrong goes to logs/head.log (rotated).
"""

from __future__ import annotations

import copy
import json
import logging
import logging.handlers
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import NamedTuple

import ray

from segctl.schemas.defaults import DEFAULT_MARGIN, DEFAULT_SCALE, TELEMETRY_CALLS_PER_S, TELEMETRY_FLUSH_S
from segctl.schemas.job import JobSpec
from segctl.schemas.private import private_dir
from segctl.schemas.records import (
    TERMINAL,
    AttemptResult,
    AttemptSpec,
    AttemptStatus,
    NodeInfo,
    Outcome,
    SweepState,
    TrialState,
    TuneState,
)

from . import asha, fairshare, measured, outcomes, placement, planner, probing
from .intake import check_payload, error_line, keep_inputs, read_input
from .snapshot import Trial
from .state import State, attempt_of, sweep_record, trial_of
from .stores import Stores
from .trackers import HeadStreams

LOG_BYTES, LOG_KEEP = 1 << 20, 3      # head.log rotates at 1 MiB, three old ones kept
TICK_S = 0.2
FILE_S = 0.5          # a turn files ended attempts for this long at most, then places again
# Ended attempts' results (their adapters) the head holds in memory while they wait to
# be filed; past this, a result stays in Ray's object store (which spills to disk)
# until its turn to be filed.
UNFILED_BYTES = 256 << 20
WAITING_WHOLE_UPTO = 2000  # pending trials whose reasons to wait are written every turn
WAITING_EVERY_S = 1.0  # past that, why every pending trial waits is written this often
NODES_EVERY_S = 1.0
# Ray's ways of saying "the worker or node that held this attempt is gone".
LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
        ray.exceptions.OwnerDiedError)


class Flight(NamedTuple):
    """An attempt handed to its node's agent, and the refs of what it returns."""
    attempt: int
    node: str
    sweep: str
    result: object   # the ref of its AttemptResult (its end time's ref is the key)


class Controller:
    """`list_nodes`, `spawn_agent`, `clock`, `wait` and `get` are how it reaches the
    world (Ray's node table, agent actors, time, ray.wait, ray.get): tests pass
    fakes to drive it through failures turn by turn."""

    def __init__(self, root: Path, *, list_nodes, spawn_agent, clock=time.time,
                 wait=None, get=None):
        self.root = Path(root)
        self.log = head_log(self.root)
        self.stores = Stores(self.root)
        self.stores.check()   # an unusable staging.db is said before state.db is made
        self.state = State(self.root / "state.db", clock=clock)
        self.list_nodes, self.spawn_agent, self.clock = list_nodes, spawn_agent, clock
        self.wait, self.get = wait or ray.wait, get or ray.get
        self.mu = threading.RLock()
        self.nodes: dict[str, NodeInfo] = {}
        self.agents: dict[str, object] = {}
        self.held: dict[str, dict] = {}         # node -> {attempt (or "tune:ID"): GB it holds}
        self.free_since: dict[str, float] = {}  # node -> when it last became free
        self.inflight: dict[object, Flight] = {}  # the ref of its end time -> the attempt
        # ended, not yet filed: (attempt, its result or, past UNFILED_BYTES, its ref, node)
        self.to_file: deque[tuple[int, object, str]] = deque()
        self.unfiled_bytes = 0                  # adapter bytes held by to_file's results
        self.starting: dict[str, tuple[object, object]] = {}   # node -> (agent, its ping)
        self.plans: dict[tuple, object] = {}    # (trial, class, budget, max_segment) -> Plan
        self.placements = 0                     # attempts placed by this head, counted
        self.served: dict[str, int] = {}        # sweep -> the count when it last got a node
        self.fitted: dict[str, dict] = {}       # model key -> {measured.match_key: MemoryModel}
        self.probing: dict[object, tuple[str, str, str]] = {}   # ref -> (tune, class, node)
        self.nodes_seen = 0.0
        self.trackers = HeadStreams(self.root, self.log)   # report_to: a thread of its own
        self.wake = threading.Event()          # set by requests that may make work runnable
        self.waiting = self.state.waiting()    # trial -> why it waits, as state.db has it
        self.waiting_noted = (float("-inf"), None)   # (when, (sweeps, nodes)) all were last
        self.recover()

    # ------------------------------------------------------------ requests
    def submit(self, payload: dict) -> str:
        """payload: name, path, spec (the sweep file as a dict, plus `planner`),
        trials [{index, name, params, job, model_info, seq_len, inputs: {file: sha}}],
        blobs {sha: bytes} (the data files, shipped from the submitting machine)."""
        sweep = check_payload(payload)
        keep_inputs(self.root / "inputs", payload["blobs"])
        with self.mu:
            sid = self.state.add_sweep(sweep["name"], sweep["path"], sweep["spec"],
                                       sweep["trials"])
        self.wake.set()
        return sid

    def cancel(self, target: str) -> list[str]:
        """Cancel a sweep (every trial not yet finished) or one trial."""
        with self.mu:
            sweep = self.state.sweep(target)
            if sweep is not None:
                trials = self.state.trials(target)
            elif self.state.trial(target) is not None:
                trials = [self.state.trial(target)]
            else:
                raise KeyError(f"no sweep or trial named {target!r}")
            done = []
            for t in trials:
                if t["state"] in TERMINAL:
                    continue
                tid = t["id"]
                self.state.move(tid, TrialState.CANCELLED, "cancelled by user")
                done.append(tid)
                self._cancel_attempts(tid)
            if sweep is not None:
                self.state.set_sweep_state(target, SweepState.CANCELLED, "cancelled by user")
            else:
                self._maybe_done(self.state.trial(target)["sweep"])
            return done

    def _cancel_attempts(self, tid: str) -> None:
        """Ask the agents running trial `tid`'s attempts to end them (each comes back
        through `finish`, which finds its trial terminal already)."""
        for a in self.state.open_attempts(tid):
            agent = self.agents.get(a["node"])
            if agent is not None:
                agent.cancel.remote(a["id"])

    def resume(self, sid: str) -> dict:
        with self.mu:
            s = self.state.sweep(sid)
            if s is None:
                raise KeyError(f"no sweep named {sid!r}")
            self.reseal(sid)   # results a failed store write left behind
            if s["state"] == SweepState.INTERRUPTED:
                self.state.set_sweep_state(sid, SweepState.RUNNING, "resumed by user")
                self.wake.set()
            return {"sweep": sid, "state": self.state.sweep(sid)["state"],
                    "unfinished": self.state.unfinished(sid)}

    def tune(self, request: dict) -> str:
        """request: model, model_key, model_name, n_layers, method, prefix_shared,
        method_key, lora, head_chunk, attn_block, mlp_chunk, steps, classes {class: {budget_gb,
        points [[seq_len, segment_size]], reused}}. Each class's points run on one
        free node of that class, ahead of pending trials. The tune lives in state.db:
        a head that restarts goes on with it."""
        with self.mu:
            tid = self.state.add_tune(request)
        self.wake.set()
        return tid

    def tune_status(self, tid: str) -> dict:
        with self.mu:
            t = self.state.tune(tid)
        if t is None:
            raise KeyError(f"no tune named {tid!r}")
        shown = ("state", "node", "budget_gb", "done", "fits", "reused", "error")
        return {"tune": tid, "started": t["started"], "state": t["state"], "classes": {
            cls: {k: c[k] for k in shown} | {"total": len(c["points"])}
            for cls, c in t["classes"].items()}}

    def cancel_tune(self, tid: str) -> None:
        """Stop a tune: queued classes never start, running probe processes end;
        every point already measured stays in the plan table."""
        with self.mu:
            for c in self.state.tune_classes(tid, TuneState.QUEUED):
                self.state.move_tune_class(tid, c["node_class"], TuneState.CANCELLED)
            for c in self.state.tune_classes(tid, TuneState.RUNNING):
                if c["node"] in self.agents:
                    self.agents[c["node"]].cancel.remote(f"tune:{tid}")

    def record_probe(self, tid: str, node: str, event: dict) -> None:
        """A node measured one point: its row goes into the plan table at once."""
        with self.mu:
            t, entry = self.state.tune(tid), self.state.tune_class_on(tid, node)
            if t is None or entry is None:
                raise KeyError(f"tune {tid!r} has no class measured on {node}")
            req, cls = t["request"], entry["node_class"]
            info = self.nodes.get(node)
            row = probing.point_row(tid, req, cls, node, info.chip if info else cls.split("/")[0],
                                    entry["budget_gb"], event)
            self.stores.put_probe(req["model_key"], row)
            self.state.count_probe(tid, cls, event["fits"])
            # plans made before this measurement are stale
            self.fitted.pop(req["model_key"], None)
            self.plans.clear()

    # ------------------------------------------------------------ from agents
    def started(self, aid: int, pid: int, t: float) -> None:
        with self.mu:
            a = self.state.attempt(aid)
            if a is None or a["status"] != AttemptStatus.PLACED:
                return
            trial = self.state.trial(a["trial"])
            self.state.update_attempt(aid, status=AttemptStatus.RUNNING.value, started=t, pid=pid,
                                      dispatch_s=t - a["ready"])
            if trial["state"] == TrialState.PLACED:
                self.state.move(a["trial"], TrialState.RUNNING,
                                f"engine process {pid} started on {a['node']}", attempt=aid)

    def ingest(self, aid: int, events: list[dict]) -> int:
        # The stores and state.db lock for themselves: a batch goes in without waiting
        # for `mu`, which the controller holds while it files ended attempts (their
        # adapters and Parquet files). Only a decision (asha) takes it.
        a = self.state.attempt(aid)
        new = self.stores.ingest(a["sweep"], a["trial"], aid, events)
        steps = [e for e in events if e.get("event") == "step"]
        if steps:
            last = steps[-1]
            peak = max([a["peak_gb"] or 0.0] + [e["peak_gb"] for e in steps])
            self.state.update_attempt(aid, step=last["step"], loss=last["loss"], peak_gb=peak)
        evals = [e for e in events if e.get("event") == "eval"]
        if evals:
            with self.mu:
                self.guarded(f"attempt {aid}: asha at its evals", self.judge, a, evals)
        self.guarded(f"attempt {aid}: its trackers", self.trackers.feed, a, events,
                     lambda: self.state.trial(a["trial"]))
        return new

    def judge(self, a, evals: list[dict]) -> None:
        """Early stopping (asha.py) at attempt `a`'s evals: each value at a rung is
        recorded in state.db with its decision, in one transaction; a stopped
        trial's attempt is cancelled through its agent."""
        scheduler = self.state.scheduler(a["sweep"])
        if scheduler is None:
            return
        rungs, tid = scheduler.rungs(), a["trial"]
        for e in evals:
            if e["step"] not in rungs:   # most evals: no rung, nothing to read
                continue
            value = float(e["val_loss"])
            d = asha.judge(scheduler, tid, e["step"], value,
                           self.state.rung_values(a["sweep"], e["step"]),
                           finished=self.state.trial(tid)["state"] in TERMINAL)
            if d is None:
                continue
            stop = d.reason if isinstance(d, asha.Stop) else None
            if self.state.record_rung(a["sweep"], d.rung, tid, d.value, attempt=a["id"],
                                      stop=stop) and stop:
                self._cancel_attempts(tid)
                self._maybe_done(a["sweep"])
                return

    def checkpoint(self, aid: int, step: int, files: dict[str, bytes]) -> None:
        a = self.state.attempt(aid)   # no `mu`: the stores lock for themselves (see ingest)
        self.stores.put_checkpoint(a["sweep"], a["trial"], aid, step, files)

    def model_folder(self, path: str) -> str:
        """A node asks for a model it does not have: only a model some trial trains
        is served (the token keeps strangers out; this keeps nodes to their business)."""
        if self.state.serves_model(path):
            return path
        raise PermissionError(f"{path}: not the model of any trial")

    # ------------------------------------------------------------ the loop
    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.turn()
            except Exception as e:  # a bug of ours above every guard: log it, go on
                self.fault("controller turn", e)
                time.sleep(1.0)

    def fault(self, what: str, e: BaseException) -> str:
        """Log a failure charged to `what` (with its trace) and return it in one line."""
        self.log.error(f"{what} failed", exc_info=(type(e), e, e.__traceback__))
        return f"{what}: {_one_line(e)}"

    def guarded(self, what: str, fn, *args):
        """fn(*args), a failure logged and charged to `what`, never to the loop."""
        try:
            return fn(*args)
        except Exception as e:
            self.fault(what, e)
            return None

    def turn(self) -> None:
        if self.clock() - self.nodes_seen > NODES_EVERY_S:
            self.guarded("listing nodes", self.refresh_nodes)
        if self.guarded("starting agents", self.agents_up):
            with self.mu:
                self.place()
        refs = list(self.inflight) + list(self.probing)
        ready = []
        if refs:   # ends still to file: look, but do not wait
            ready, _ = self.wait(refs, num_returns=len(refs),
                                 timeout=0 if self.to_file else TICK_S)
        elif not self.to_file:
            self.wake.wait(TICK_S)
        self.wake.clear()
        for ref in ready:
            if ref in self.probing:
                self._probed(ref)
                continue
            aid, node, _, result = self.inflight.pop(ref)
            if self.unfiled_bytes < UNFILED_BYTES:
                result = self._result(result, aid, node)
                self.unfiled_bytes += _adapter_bytes(result)
                ended = result.ended
            else:   # its result is fetched when its turn comes: the head's memory stays
                # bounded; the end time alone says when its node became free
                ended = self._ended(ref)
            self.to_file.append((aid, result, node))
            with self.mu:
                self.held.get(node, {}).pop(aid, None)
                self.free_since[node] = ended or self.clock()
        with self.mu:
            # Freed nodes get their next trial before the finished attempts are
            # filed: storing an adapter takes longer than starting a process. Filing
            # stops after FILE_S (the rest next turn), so nodes that free up meanwhile
            # wait for one turn's filing at most, however many attempts end together.
            self.place()
            filed, t0 = 0, self.clock()
            while self.to_file and (not filed or self.clock() - t0 < FILE_S):
                aid, result, node = self.to_file.popleft()
                if isinstance(result, AttemptResult):
                    self.unfiled_bytes -= _adapter_bytes(result)
                else:
                    result = self._result(result, aid, node)
                self.guarded(f"attempt {aid}: filing its end", self.finish, aid, result)
                filed += 1
            if filed:
                self.place()   # trials that went back to PENDING (oom, node lost)

    def _ended(self, ref) -> float | None:
        """When an attempt ended (its agent's clock), or None where the agent failed
        or was lost: its result says how when filed."""
        try:
            return self.get(ref)
        except Exception:
            return None

    def _result(self, ref, aid: int, node: str) -> AttemptResult:
        """How an attempt ended, whatever its agent did: a lost node or a failed agent
        (its disk, a refused model fetch, the head refusing its telemetry) is an
        outcome of that attempt, retried like a lost node."""
        try:
            return self.get(ref)
        except LOST as e:
            self.agents.pop(node, None)   # its agent died with it; a new one if it returns
            return AttemptResult(attempt=aid, outcome=Outcome.NODE_LOST,
                                 message=f"node {node} lost ({type(e).__name__})")
        except Exception as e:
            line = self.fault(f"attempt {aid}: the agent on {node} failed", e)
            return AttemptResult(attempt=aid, outcome=Outcome.AGENT_ERROR, message=line)

    def refresh_nodes(self) -> None:
        self.nodes_seen = self.clock()
        seen = {n.name: n for n in self.list_nodes() if n.alive}
        with self.mu:
            self.nodes = seen
            for name in list(self.agents):
                if name not in seen:
                    self.agents.pop(name)
            for name in seen:
                if name not in self.agents and name not in self.starting:
                    agent = self.spawn_agent(name)
                    self.starting[name] = (agent, agent.ping.remote())

    def agents_up(self) -> bool:
        """A node takes work once its agent answers (its worker process is up), so
        the first dispatch does not wait for an actor to start. True if one did."""
        came = False
        if self.starting:
            pings = {ping: name for name, (_, ping) in self.starting.items()}
            up, _ = self.wait(list(pings), num_returns=len(pings), timeout=0)
            for ping in up:
                name = pings[ping]
                agent, _ = self.starting.pop(name)
                try:
                    self.get(ping)
                except Exception as e:   # gone or broken before it started: the next refresh tries again
                    if not isinstance(e, LOST):
                        self.fault(f"agent on {name}", e)
                    continue
                with self.mu:
                    self.agents[name] = agent
                    self.free_since[name] = self.clock()
                came = True
        return came

    # ------------------------------------------------------------ placement
    def takes_work(self, n: NodeInfo) -> bool:
        """Whether node `n` can start one more attempt (placement.takes_work)."""
        return placement.takes_work(n, self.held, n.name in self.agents)

    def flush_s(self) -> float:
        """How often an attempt's agent forwards its telemetry: TELEMETRY_FLUSH_S, or
        longer so that every attempt the fleet can run at once sends about
        TELEMETRY_CALLS_PER_S batches a second in all."""
        return max(TELEMETRY_FLUSH_S, self.slots() / TELEMETRY_CALLS_PER_S)

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
        runs = Counter(f.sweep for f in self.inflight.values())
        sweeps, turn = {}, []
        for s in self.state.running_sweeps():
            try:   # a row an older or hostile writer left unusable fails its sweep alone
                spec = sweep_record(s)
                created = float(s["created"])
            except Exception as e:
                self.fail_sweep(s["id"], self.fault(f"sweep {s['id']}: reading it from state.db", e))
                continue
            sweeps[s["id"]] = spec
            turn.append(fairshare.Contender(
                sweep=s["id"], priority=spec["priority"], share=spec["share"],
                created=created, cap=spec["concurrency"],
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
        why: dict[str, str] = {}   # trial -> why it waits, for those tried and not placed
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
        self.waiting_noted = (now, shape)

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

    def _place_trial(self, spec: dict, t: Trial, free: list[NodeInfo],
                     eligible: dict) -> str | None:
        """Apply placement.place_trial for trial `t` of a sweep (`spec`: its
        sweep_record): start it on the node chosen (taking the node out of `free`
        once it is full), fail it, or return why it waits. None when it went; ''
        when it failed. `eligible`: the turn's cache for placement.eligible."""
        knobs = spec.get("planner") or {}
        margin = knobs.get("margin", DEFAULT_MARGIN)
        d = placement.place_trial(
            t, self.state.last_attempt_record(t.id), placement=spec.get("placement") or {},
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
        if not self.takes_work(d.node):
            free.remove(d.node)
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

    def _probed(self, ref) -> None:
        tid, cls, node = self.probing.pop(ref)
        try:
            result = self.get(ref)
        except LOST as e:
            result = {"error": f"node {node} lost ({type(e).__name__})"}
            self.agents.pop(node, None)
        except Exception as e:   # the agent failed (or the head refused a point): that class fails
            result = {"error": self.fault(f"tune {tid}: probes of {cls} on {node}", e)}
        with self.mu:
            self.held.get(node, {}).pop(f"tune:{tid}", None)
            self.free_since[node] = self.clock()
            error = result.get("error") or ""
            self.state.move_tune_class(tid, cls, probing.ended(error), error=error)

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
        job = JobSpec.model_validate(t.job)
        info = planner.ModelInfo.from_dict(t.model_info)
        return planner.plan(info, job, seq_len=t.seq_len,
                            budget_gb=node.memory_gb if budget_gb is None else budget_gb,
                            margin=knobs.get("margin", DEFAULT_MARGIN), scale=knobs.get("scale", DEFAULT_SCALE),
                            below=t.max_segment,
                            measured=self._measured(info, job, node.node_class))

    def _measured(self, info, job: JobSpec, node_class: str):
        """The tuned memory model for this trial on this class, if one was measured."""
        key = planner.model_key(info)
        if key not in self.fitted:
            self.fitted[key] = measured.models_of(measured.read_plan(self.root, key))
        return self.fitted[key].get(planner.tune_key(job, node_class))

    def dispatch(self, t: Trial, d: placement.Place) -> None:
        """Start the attempt placement decided (`d`: the node, the plan, what the
        attempt is lent). What the attempt needs from the head is read first: a
        damaged or missing input fails the trial (running it again cannot help). A
        failure once the attempt is recorded (the agent gone) ends that attempt, not
        the turn."""
        tid, node, plan = t.id, d.node, d.plan
        try:
            data = {name: read_input(self.root / "inputs" / sha)
                    for name, sha in t.inputs.items()}
            ckpt = self.stores.latest_checkpoint(tid)
        except Exception as e:
            line = self.fault(f"trial {tid}: reading its inputs on the head", e)
            self.state.move(tid, TrialState.FAILED, line, message=line)
            return self._maybe_done(t.sweep)
        job = copy.deepcopy(t.job)   # the record stays as state.db has it
        mem = job.setdefault("memory", {})
        mem["segment_size"] = plan.segment_size
        mem["offload"] = "disk" if plan.offload else "none"
        mem["budget_gb"] = d.budget_gb
        # Runnable since: the trial was pending and this node was free (the later).
        ready = max(t.runnable_since, self.free_since.get(node.name, 0.0))
        aid = self.state.add_attempt(tid, node=node.name, chip=node.chip,
                                     segment_size=plan.segment_size,
                                     predicted_gb=plan.predicted_gb, budget_gb=mem["budget_gb"],
                                     resume_step=ckpt[0] if ckpt else None, ready=ready)
        how = f"resuming from step {ckpt[0]}" if ckpt else "from the start"
        self.state.move(tid, TrialState.PLACED,
                        f"placed on {node.name} ({node.node_class}) at segment_size "
                        f"{plan.segment_size}, predicted peak {plan.predicted_gb:.3f} GB "
                        f"({plan.source}), {how}",
                        attempt=aid)
        spec = AttemptSpec(sweep=t.sweep, trial=tid, attempt=aid, job=job, data=data,
                           checkpoint_step=ckpt[0] if ckpt else None,
                           checkpoint=ckpt[1] if ckpt else {}, flush_s=self.flush_s())
        try:
            ended, result = self.agents[node.name].run.remote(spec)
        except Exception as e:
            line = self.fault(f"attempt {aid}: handing it to {node.name}", e)
            return self.finish(aid, AttemptResult(attempt=aid, outcome=Outcome.AGENT_ERROR,
                                                  message=line))
        self.inflight[ended] = Flight(aid, node.name, t.sweep, result)
        self.held.setdefault(node.name, {})[aid] = mem["budget_gb"]

    # ------------------------------------------------------------ outcomes
    def finish(self, aid: int, r: AttemptResult) -> None:
        """Apply how an attempt ended. The attempt is marked ended with its outcome
        first (so no restart runs it twice), then its telemetry is sealed into the
        stores; a seal that fails leaves the attempt unsealed for `reseal` (on
        `segctl resume` and on the head's restart) and does not hold the trial. A
        success whose adapter cannot be stored is not a success: the trial runs again.
        What the trial does next is outcomes.after's decision."""
        a = self.state.attempt(aid)
        tid, sid = a["trial"], a["sweep"]
        peak = max(a["peak_gb"] or 0.0, r.peak_gb or 0.0) or None
        self.state.update_attempt(aid, status=AttemptStatus.ENDED.value, outcome=r.outcome.value,
                                  message=r.message, ended=r.ended or self.clock(), peak_gb=peak,
                                  final_loss=r.final_loss, val_loss=r.val_loss,
                                  step=r.steps or a["step"])
        self.guarded(f"attempt {aid}: its trackers", self.trackers.ended, aid, r.outcome.value)
        self.guarded(f"attempt {aid}: sealing its telemetry (kept for resume)", self._seal, aid)
        t = self.state.trial_record(tid)
        if t.state == TrialState.STOPPED and r.adapter:   # it finished before the stop landed
            self.guarded(f"attempt {aid}: storing the adapter of a stopped trial",
                         lambda: self.stores.put_adapter(sid, tid, aid, r.adapter,
                                                         step=r.steps or None, val_loss=r.val_loss))
        if t.state in TERMINAL:
            return self._maybe_done(sid)
        if r.outcome == Outcome.SUCCEEDED:
            try:
                if r.best_adapter:   # first: the last adapter in place means both are
                    self.stores.put_adapter(sid, tid, aid, r.best_adapter, kind="best",
                                            step=r.best_step, val_loss=r.best_val_loss)
                self.stores.put_adapter(sid, tid, aid, r.adapter, step=r.steps or None,
                                        val_loss=r.val_loss)
            except Exception as e:
                line = self.fault(f"attempt {aid}: storing its adapter", e)
                r = AttemptResult(attempt=aid, outcome=Outcome.AGENT_ERROR,
                                  message=f"the head could not store the adapter ({line}); run again")
                self.state.update_attempt(aid, outcome=r.outcome.value, message=r.message)
        retries: int | str = 0
        used = 0
        if outcomes.charged(r.outcome):
            try:
                retries = sweep_record(self.state.sweep(sid))["retries"]
            except ValueError as e:   # its row in state.db is unusable: no retry can be counted
                retries = str(e)
            used = self.state.charged_attempts(tid)
        last = self.state.last_attempt_record(tid)
        for d in outcomes.after(r, attempt_of(a), t, last=last,
                                node=self.nodes.get(last.node) if last else None,
                                retries=retries, used=used):
            if isinstance(d, outcomes.Ended):
                self.state.move(tid, d.to, d.reason, attempt=aid, **d.fields)
            elif isinstance(d, outcomes.Fail):
                self.state.move(tid, TrialState.FAILED, d.reason, attempt=aid, message=d.message)
            elif isinstance(d, outcomes.Replan):
                bounds = {} if d.max_segment is None else {"max_segment": d.max_segment}
                if d.excluded is not None:
                    bounds["excluded"] = json.dumps(list(d.excluded))
                self.state.move(tid, TrialState.PENDING, d.reason, attempt=aid, **bounds)
            else:   # Retry: from its last checkpoint
                ckpt = self.stores.latest_checkpoint(tid)
                self.state.move(tid, TrialState.PENDING, "resume from checkpoint step "
                                f"{ckpt[0]}" if ckpt else "restart: no checkpoint yet", attempt=aid)
        self._maybe_done(sid)

    def _maybe_done(self, sid: str) -> None:
        state = self.state.sweep(sid)["state"]
        if state in (SweepState.RUNNING, SweepState.INTERRUPTED) and not self.state.unfinished(sid):
            self.state.set_sweep_state(sid, SweepState.DONE, "every trial finished")

    def reseal(self, sid: str | None = None) -> int:
        """Seal every ended attempt (of sweep `sid`, or all) whose seal failed before;
        returns how many are sealed now. One that fails again stays for next time."""
        done = 0
        for aid in self.state.ended_attempts(sid):
            if not self.stores.is_sealed(aid):
                done += self.guarded(f"attempt {aid}: sealing it again", self._seal,
                                     aid) is not None
        return done

    def _seal(self, aid: int) -> bool:
        a = self.state.attempt(aid)
        row = {k: a[k] for k in ("trial", "attempt_no", "node", "chip", "segment_size",
                                 "predicted_gb", "budget_gb", "outcome", "message", "started",
                                 "ended", "peak_gb", "final_loss", "val_loss")}
        row.update(attempt=aid, steps=a["step"] or 0)
        self.stores.seal_attempt(a["sweep"], a["trial"], aid, row)
        return True

    # ------------------------------------------------------------ restart
    def recover(self) -> None:
        """A new head over an old state.db: attempts that were in flight belong to a
        head that is gone. Close them, send their trials back to PENDING (resumed
        from their last checkpoint), and hold their sweeps until `segctl resume`. A tune
        goes on by itself: a class whose probe ran under the old head is queued again
        for the points it had not measured; the classes that finished keep their end."""
        for a in self.state.open_attempts():
            self.guarded(f"attempt {a['id']}: closing it after a restart", self.finish, a["id"],
                         AttemptResult(attempt=a["id"], outcome=Outcome.INTERRUPTED,
                                       message="the head restarted during this attempt"))
        self.reseal()
        for s in self.state.running_sweeps():
            self.state.set_sweep_state(s["id"], SweepState.INTERRUPTED,
                                       "the head restarted; `segctl resume` continues it")
        self.state.requeue_tunes()


def _adapter_bytes(r: AttemptResult) -> int:
    return sum(len(b) for files in (r.adapter, r.best_adapter) for b in files.values())


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An error as one short line; a remote task's error by its cause (Ray's own
    text carries the whole remote traceback)."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    return error_line(e, limit)


def head_log(root: Path) -> logging.Logger:
    """The head's own log, ROOT/logs/head.log, rotated so it never grows without bound."""
    log = logging.getLogger(f"segctl.head.{root}")
    if not log.handlers:
        folder = private_dir(root / "logs")
        handler = logging.handlers.RotatingFileHandler(folder / "head.log", maxBytes=LOG_BYTES,
                                                       backupCount=LOG_KEEP, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


class _PendingIds:
    """The ids of a sweep's pending trials in its order, read from state.db a page
    at a time as a turn indexes them (all at once when `whole`)."""
    PAGE = 256

    def __init__(self, state, sid: str, whole: bool):
        self.state, self.sid = state, sid
        self.ids, self.last, self.done = [], -1, False
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
