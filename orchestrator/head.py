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
makes this actor the collector: the stores' only writer. The class has two
halves in modules of their own, so that this one reads as the loop: api.py (the
requests, from the CLI and from agents) and placement_turn.py (step 3, applying
the placement policies). Time is the injected
`clock` alone (a test's fake clock drives every decision that depends on it).

No failure stops the loop. Each is charged to the smallest thing it belongs to:
a sweep that cannot be planned fails that sweep, an agent that raises ends that
attempt (and frees its node), a store that cannot be written leaves that attempt
to be sealed again later; the loop goes on placing everyone else. What went
wrong goes to logs/head.log (rotated).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import ray

from segctl.schemas.defaults import TELEMETRY_CALLS_PER_S, TELEMETRY_FLUSH_S
from segctl.schemas.job import JobSpec
from segctl.schemas.limits import error_line
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
    nodes_field,
)

from . import outcomes, placement, probing
from .api import HeadAPI
from .intake import read_input
from .memory_settings import Tuned, resolved
from .placement_turn import PlacementTurn
from .snapshot import Trial
from .state import State, attempt_of, sweep_record
from .stores import Stores
from .trackers import HeadStreams

LOG_BYTES, LOG_KEEP = 1 << 20, 3      # head.log rotates at 1 MiB, three old ones kept
TICK_S = 0.2
FILE_S = 0.5          # a turn files ended attempts for this long at most, then places again
# Ended attempts' results (their adapters) the head holds in memory while they wait to
# be filed; past this, a result stays in Ray's object store (which spills to disk)
# until its turn to be filed.
UNFILED_BYTES = 256 << 20
NODES_EVERY_S = 1.0
# An agent that has not answered its first ping by then (its actor stuck in Ray's
# queue, its worker process never registered) is given up and started again: a
# node whose agent never comes would otherwise take no work for ever.
AGENT_START_S = 120.0
RING_ENDPOINT_S = 30.0   # a node of a trial on several nodes names its ring address in this
# Ray's ways of saying "the worker or node that held this attempt is gone".
LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
        ray.exceptions.OwnerDiedError)


class Gang(NamedTuple):
    """The ranks of an attempt on several nodes (`nodes`, rank 0 first) and how
    each ended, as they end ((rank, node, result))."""
    nodes: list[str]
    ends: list[tuple[int, str, AttemptResult]]


class Flight(NamedTuple):
    """An attempt handed to its node's agent, and the refs of what it returns."""
    attempt: int
    node: str
    sweep: str
    result: object   # the ref of its AttemptResult (its end time's ref is the key)


class Controller(HeadAPI, PlacementTurn):
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
        self.agents: dict[str, Any] = {}         # node -> its agent (a Ray actor handle)
        self.held: dict[str, dict] = {}         # node -> {attempt (or "tune:ID"): GB it holds}
        self.free_since: dict[str, float] = {}  # node -> when it last became free
        self.inflight: dict[object, Flight] = {}  # the ref of its end time -> the attempt
        # ended, not yet filed: (attempt, its result or, past UNFILED_BYTES, its ref, node)
        self.to_file: deque[tuple[int, object, str]] = deque()
        self.unfiled_bytes = 0                  # adapter bytes held by to_file's results
        self.starting: dict[str, tuple[object, object, float]] = {}   # node -> (agent, ping, since)
        self.plans: dict[tuple, object] = {}    # (trial, class, budget, max_segment) -> Plan
        self.placements = 0                     # attempts placed by this head, counted
        self.served: dict[str, int] = {}        # sweep -> the count when it last got a node
        self.tuned = Tuned(self.root)          # the plan table's measured models, read once each
        self.probing: dict[object, tuple[str, str, str]] = {}   # ref -> (tune, class, node)
        self.gangs: dict[int, Gang] = {}        # an attempt on several nodes -> its ranks' ends
        self.nodes_seen = 0.0
        self.trackers = HeadStreams(self.root, self.log)   # report_to: a thread of its own
        self.wake = threading.Event()          # set by requests that may make work runnable
        self.waiting = self.state.waiting()    # trial -> why it waits, as state.db has it
        self.waiting_noted: tuple[float, object] = (float("-inf"), None)   # (when, (sweeps, nodes)) all were last
        self.recover()

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
            if aid in self.gangs:   # one rank of an attempt on several nodes
                self._rank_ended(aid, node, result)
                continue
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

    def _rank_ended(self, aid: int, node: str, ref) -> None:
        """One rank of attempt `aid` ended: its node is free. A rank that did not
        succeed ends the attempt, so its peers are cancelled (their collectives
        would end them anyway, after distributed.timeout_s); once every rank has
        ended, the attempt's end (outcomes.ranks_ended) is filed as one."""
        g = self.gangs[aid]
        result = self._result(ref, aid, node)
        first_to_fail = result.outcome != Outcome.SUCCEEDED and all(
            r.outcome == Outcome.SUCCEEDED for _, _, r in g.ends)
        g.ends.append((g.nodes.index(node), node, result))
        with self.mu:
            self.held.get(node, {}).pop(aid, None)
            self.free_since[node] = result.ended or self.clock()
        if first_to_fail:   # the ranks still out are cancelled, once
            self.guarded(f"attempt {aid}: cancelling its other ranks", self._cancel_on, aid,
                         [n for n in g.nodes if n not in {e[1] for e in g.ends}])
        if len(g.ends) == len(g.nodes):
            del self.gangs[aid]
            ended = outcomes.ranks_ended(aid, g.ends)
            self.unfiled_bytes += _adapter_bytes(ended)
            self.to_file.append((aid, ended, g.nodes[0]))

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
                    self.starting[name] = (agent, agent.ping.remote(), self.clock())
                    self.log.info(f"node {name}: starting its agent")

    def agents_up(self) -> bool:
        """A node takes work once its agent answers (its worker process is up), so
        the first dispatch does not wait for an actor to start. True if one did."""
        came = False
        if self.starting:
            pings = {ping: name for name, (_, ping, _) in self.starting.items()}
            up, _ = self.wait(list(pings), num_returns=len(pings), timeout=0)
            for ping in up:
                name = pings[ping]
                agent, _, _ = self.starting.pop(name)
                try:
                    self.get(ping)
                except Exception as e:   # gone or broken before it started: the next refresh tries again
                    if not isinstance(e, LOST):
                        self.fault(f"agent on {name}", e)
                    continue
                with self.mu:
                    self.agents[name] = agent
                    self.free_since[name] = self.clock()
                self.log.info(f"node {name}: its agent is up")
                came = True
            for name, (agent, _, since) in list(self.starting.items()):
                if self.clock() - since > AGENT_START_S:   # the next refresh starts another
                    del self.starting[name]
                    self.log.warning(f"node {name}: its agent did not answer in "
                                     f"{AGENT_START_S:.0f} s; starting another")
                    if isinstance(agent, ray.actor.ActorHandle):
                        self.guarded(f"agent on {name}: ending it", ray.kill, agent)
        return came

    # ------------------------------------------------------------ starting what placement chose
    def flush_s(self) -> float:
        """How often an attempt's agent forwards its telemetry: TELEMETRY_FLUSH_S, or
        longer so that every attempt the fleet can run at once sends about
        TELEMETRY_CALLS_PER_S batches a second in all."""
        return max(TELEMETRY_FLUSH_S, self.slots() / TELEMETRY_CALLS_PER_S)

    def dispatch(self, t: Trial, d: placement.Place) -> None:
        """Start the attempt placement decided (`d`: the node, the plan, what the
        attempt is lent). What the attempt needs from the head is read first: a
        damaged or missing input fails the trial (running it again cannot help). A
        failure once the attempt is recorded (the agent gone) ends that attempt, not
        the turn."""
        tid, node, plan = t.id, d.node, d.plan
        ranks = [placement.Rank(node, plan, d.budget_gb), *d.ranks]
        try:
            data = {name: read_input(self.root / "inputs" / sha)
                    for name, sha in t.inputs.items()}
            ckpt = self.stores.latest_checkpoint(tid)
        except Exception as e:
            line = self.fault(f"trial {tid}: reading its inputs on the head", e)
            self.state.move(tid, TrialState.FAILED, line, message=line)
            return self._maybe_done(t.sweep)
        job = JobSpec.model_validate(t.job)
        rdma = placement.rdma_matrix([r.node for r in ranks]) if d.ranks and t.over_rdma else []
        ring = self._ring(t, job, ranks, rdma) if d.ranks else []
        if ring is None:
            return None
        names = nodes_field([r.node.name for r in ranks])
        # Runnable since: the trial was pending and its nodes were free (the latest).
        ready = max([t.runnable_since] + [self.free_since.get(r.node.name, 0.0) for r in ranks])
        aid = self.state.add_attempt(tid, node=names, chip=node.chip,
                                     segment_size=plan.segment_size,
                                     predicted_gb=max(r.plan.predicted_gb for r in ranks),
                                     budget_gb=min(r.budget_gb for r in ranks),
                                     resume_step=ckpt[0] if ckpt else None, ready=ready)
        how = f"resuming from step {ckpt[0]}" if ckpt else "from the start"
        where = (f"{node.name} ({node.node_class})" if not d.ranks else
                 f"{len(ranks)} nodes {', '.join(r.node.name for r in ranks)} ("
                 + (f"jaccl, coordinator {ring[0]}" if rdma else f"ring {' '.join(ring)}") + ")")
        self.state.move(tid, TrialState.PLACED,
                        f"placed on {where} at segment_size "
                        f"{plan.segment_size}, predicted peak {plan.predicted_gb:.3f} GB "
                        f"({plan.source}), {how}",
                        attempt=aid)
        if d.ranks:
            self.gangs[aid] = Gang(nodes=[r.node.name for r in ranks], ends=[])
        if len(ranks) != job.distributed.nodes:   # a retry on fewer, down to its min_nodes
            job = job.model_copy(update={"distributed": job.distributed.model_copy(
                update={"nodes": len(ranks), "min_nodes": None})})
        for rank, r in enumerate(ranks):
            spec = AttemptSpec(sweep=t.sweep, trial=tid, attempt=aid,
                               job=resolved(job, r.plan, r.budget_gb), data=data,
                               checkpoint_step=ckpt[0] if ckpt else None,
                               checkpoint=ckpt[1] if ckpt else {}, flush_s=self.flush_s(),
                               rank=rank, ring=ring, rdma=rdma)
            try:
                ended, result = self.agents[r.node.name].run.remote(spec)
            except Exception as e:
                line = self.fault(f"attempt {aid}: handing it to {r.node.name}", e)
                failed = AttemptResult(attempt=aid, outcome=Outcome.AGENT_ERROR, message=line)
                if not d.ranks:
                    return self.finish(aid, failed)
                ended, result = ray.put(self.clock()), ray.put(failed)
            self.inflight[ended] = Flight(aid, r.node.name, t.sweep, result)
            self.held.setdefault(r.node.name, {})[aid] = r.budget_gb

    def _ring(self, t: Trial, job: JobSpec, ranks: list, rdma: list) -> list[str] | None:
        """Every rank's "host:port" for a trial on several nodes, rank 0 first, each
        node's own answer (its `distributed.interface`, or the address it joined the
        fleet with; a port free there), each node checking the RDMA devices its
        JACCL rank uses (`rdma`, rank by rank). None when a node could not say: a
        node without that interface or device fails the trial with why; one that
        does not answer leaves it pending for the next turn."""
        try:
            return list(self.get([self.agents[r.node.name].ring_endpoint.remote(
                job.distributed.interface, [dev for dev in rdma[i] if dev] if rdma else None)
                for i, r in enumerate(ranks)], timeout=RING_ENDPOINT_S))
        except Exception as e:
            line = self.fault(f"trial {t.id}: the addresses of its ring", e)
            cause = getattr(e, "cause", None) or e   # a remote error: what the node raised
            if isinstance(cause, ValueError):   # the node has no such interface
                self.state.move(t.id, TrialState.FAILED, line, message=_one_line(e))
                self._maybe_done(t.sweep)
            return None

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

    # ------------------------------------------------------------ outcomes
    def finish(self, aid: int, r: AttemptResult) -> None:
        """Apply how an attempt ended. The attempt is marked ended with its outcome
        first (so no restart runs it twice), then its telemetry is sealed into the
        stores; a seal that fails leaves the attempt unsealed for `reseal` (on
        `segctl resume` and on the head's restart) and does not hold the trial. A
        success whose adapter cannot be stored is not a success: the trial runs again.
        What the trial does next is outcomes.after's decision."""
        a = self.state.known_attempt(aid)
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
                retries = sweep_record(self.state.known_sweep(sid)).retries
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
                bounds: dict[str, object] = ({} if d.max_segment is None
                                             else {"max_segment": d.max_segment})
                if d.excluded is not None:
                    bounds["excluded"] = json.dumps(list(d.excluded))
                self.state.move(tid, TrialState.PENDING, d.reason, attempt=aid, **bounds)
            else:   # Retry: from its last checkpoint
                ckpt = self.stores.latest_checkpoint(tid)
                self.state.move(tid, TrialState.PENDING, "resume from checkpoint step "
                                f"{ckpt[0]}" if ckpt else "restart: no checkpoint yet", attempt=aid)
        self._maybe_done(sid)

    def _maybe_done(self, sid: str) -> None:
        state = self.state.known_sweep(sid)["state"]
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
        a = self.state.known_attempt(aid)
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
        open_attempts = self.state.open_attempts()
        for a in open_attempts:
            self.guarded(f"attempt {a['id']}: closing it after a restart", self.finish, a["id"],
                         AttemptResult(attempt=a["id"], outcome=Outcome.INTERRUPTED,
                                       message="the head restarted during this attempt"))
        self.reseal()
        held = self.state.running_sweeps()
        for s in held:
            self.state.set_sweep_state(s["id"], SweepState.INTERRUPTED,
                                       "the head restarted; `segctl resume` continues it")
        self.state.requeue_tunes()
        self.log.info(f"head started (pid {os.getpid()}): {len(open_attempts)} attempt(s) "
                      f"closed, {len(held)} sweep(s) held for `segctl resume`")


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
