"""The head: a detached Ray actor that owns state.db and the stores and runs the
controller loop (what runs next, where, and what to do when it ends).

One loop, top to bottom each turn:
  1. see which nodes are alive (Ray's node table) and give each an agent;
  2. collect attempts that ended and apply their outcome (the state machine);
  3. place pending trials: highest priority first, among equal priorities the
     sweep furthest below its fair share (orchestrator/scheduler.py), the sweep's
     concurrency cap holds, only on nodes where the planner predicts the trial
     fits. A node takes up to its max_trials at once: each attempt holds the
     memory its plan predicts (plus the margin) and is guarded at that, and the
     next trial is planned in what is left. Each trial left pending gets the
     reason it waits in state.db (`segctl status` shows it).
Agents call back into the same actor (`started`, `ingest`, `checkpoint`), which
makes this actor the collector: the stores' only writer.

No failure stops the loop. Each is charged to the smallest thing it belongs to:
a sweep that cannot be planned fails that sweep, an agent that raises ends that
attempt (and frees its node), a store that cannot be written leaves that attempt
to be sealed again later; the loop goes on placing everyone else. What went
wrong goes to logs/head.log (rotated).
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import os
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import NamedTuple

import ray
from pydantic import ValidationError

from segctl.node import models
from segctl.node.raynode import private_dir
from segctl.schemas.atomic import write_atomic
from segctl.schemas.defaults import (DEFAULT_MARGIN, DEFAULT_MLP_CHUNK, DEFAULT_SCALE, TELEMETRY_CALLS_PER_S,
                                     TELEMETRY_FLUSH_S)
from segctl.schemas.job import JobSpec
from segctl.schemas.records import (OUTCOME_MOVES, TERMINAL, AttemptResult, AttemptSpec,
                                    AttemptStatus, NodeInfo, Outcome, ProbeSpec, SweepState,
                                    TrialState, TuneState)
from segctl.schemas.sweep import SchedulerSpec, SweepSpec

from . import measured, planner, scheduler
from .state import State, read as read_state
from .stores import Stores
from .trackers import HeadStreams

HEAD_NAME = "segctl-head"
LOG_BYTES, LOG_KEEP = 1 << 20, 3      # head.log rotates at 1 MiB, three old ones kept
NAMESPACE = "segctl"
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
        sweep = _check_payload(payload)
        for sha, blob in payload["blobs"].items():
            if hashlib.sha256(blob).hexdigest() != sha:
                raise ValueError(f"input {sha[:12]} arrived damaged")
        inputs = private_dir(self.root / "inputs")   # copies of people's training data
        for sha, blob in payload["blobs"].items():
            _write_input(inputs / sha, blob)
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
            row = dict(tune=tid, time=event["time"], model_name=req["model_name"],
                       n_layers=req["n_layers"], method=req["method_key"], node_class=cls,
                       node=node, chip=info.chip if info else cls.split("/")[0],
                       budget_gb=entry["budget_gb"], lora_rank=req["lora"]["rank"],
                       lora_layers=req["lora"]["num_layers"],
                       lora_keys=measured.lora_keys_text(req["lora"].get("keys")),
                       head_chunk=req["head_chunk"], attn_block=req["attn_block"],
                       seq_len=event["seq_len"], segment_size=event["segment_size"],
                       fits=event["fits"], peak_gb=event["peak_gb"],
                       phases=[label for label, _ in event["phases"]],
                       phase_peaks=[peak for _, peak in event["phases"]],
                       step_s=event.get("step_s"), steps=event["steps"],
                       message=event.get("message", ""))
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
        """Asynchronous successive halving (the ASHA paper; Ray Tune's AsyncHyperBand):
        a trial's eval at a rung is recorded in state.db, and the trial stops when at
        least `reduction` values are recorded at that rung (this one included) and it
        is worse than the top 1/reduction of them. Nobody waits for a rung to fill:
        the first trials there go on, later ones are judged against more values."""
        spec = json.loads(self.state.sweep(a["sweep"])["spec"]).get("scheduler")
        if not spec:
            return
        rungs = SchedulerSpec.model_validate(spec).rungs()
        for e in evals:
            if e["step"] not in rungs:
                continue
            tid, rung, value = a["trial"], e["step"], float(e["val_loss"])
            values = self.state.rung_values(a["sweep"], rung)
            if tid in values:
                continue   # decided before (a batch delivered twice, a head restart)
            values[tid] = value
            cutoff = asha_cutoff(list(values.values()), spec["reduction"])
            stop = None
            if (self.state.trial(tid)["state"] not in TERMINAL and len(values) >= spec["reduction"]
                    and value > cutoff):
                stop = (f"asha: {spec['metric']} {value:.4g} at rung {rungs.index(rung) + 1} "
                        f"(step {rung}) below the top 1/{spec['reduction']} of {len(values)} "
                        f"(cutoff {cutoff:.4g})")
            if self.state.record_rung(a["sweep"], rung, tid, value, attempt=a["id"], stop=stop) \
                    and stop:
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
            filed, t0 = 0, time.monotonic()
            while self.to_file and (not filed or time.monotonic() - t0 < FILE_S):
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
        """Whether node `n` can start one more attempt: its agent is up, it runs
        fewer than its max_trials, and memory is left (a tune holds it whole)."""
        held = self.held.get(n.name, {})
        return n.name in self.agents and len(held) < n.max_trials and self.spare(n) > 0

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
        return n.memory_gb - sum(self.held.get(n.name, {}).values())

    def place(self) -> None:
        """Free nodes to pending trials: a tune's probes first, then trial by trial in
        the order of scheduler.next_sweep (priority, then fair share among equals, then
        each sweep's own order). Every pending trial left has its reason in state.db."""
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
            sweeps[s["id"]] = (s, spec)
            turn.append(scheduler.Contender(
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
        now = time.monotonic()
        shape = (frozenset(sweeps), frozenset(self.nodes))
        whole = (sum(c.pending for c in turn) <= WAITING_WHOLE_UPTO or shape != self.waiting_noted[1]
                 or now - self.waiting_noted[0] >= WAITING_EVERY_S)
        pending = {sid: _PendingIds(self.state, sid, whole) for sid in sweeps}
        why: dict[str, str] = {}   # trial -> why it waits, for those tried and not placed
        tried: dict[str, str] = {}   # trial -> its sweep
        eligible: dict = {}   # the nodes a placement may use, found once a turn
        while free and (c := scheduler.next_sweep(turn)) is not None:
            (s, spec), tid = sweeps[c.sweep], pending[c.sweep][c.tried]
            c.tried += 1
            tried[tid] = c.sweep
            try:
                why[tid] = self._place_trial(s, spec, self.state.trial(tid), free, eligible)
            except Exception as e:   # this sweep cannot be planned: it fails, the others go on
                self.fail_sweep(s["id"], self.fault(f"sweep {s['id']}: placing it", e))
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
        nodes = len(self.nodes)
        slots = self.slots()
        waiting = {}
        for c in turn:
            left = scheduler.why_waiting(c, turn, nodes=nodes, slots=slots)
            for tid in pending[c.sweep].all():
                reason = why.get(tid, left)
                if reason:   # None: placed now; '': failed now
                    waiting[tid] = (c.sweep, reason)
        self._note_waiting(waiting)
        self.waiting_noted = (now, shape)

    def _note_waiting(self, waiting: dict[str, tuple[str, str]],
                      looked_at=None) -> None:
        """Write to state.db the reasons that changed since the last placement (most
        trials wait for the same reason turn after turn). `looked_at`: the trials
        `waiting` speaks for (default: every pending trial); a trial among them and
        not in `waiting` no longer waits."""
        changed = {t: v for t, v in waiting.items() if self.waiting.get(t) != v[1]}
        scope = self.waiting if looked_at is None else looked_at
        gone = [t for t in scope if t not in waiting and t in self.waiting]
        if changed or gone:
            self.state.note_waiting(changed, gone)
            if looked_at is None:
                self.waiting = {t: v[1] for t, v in waiting.items()}
            else:
                for t in gone:
                    del self.waiting[t]
                self.waiting.update({t: v[1] for t, v in changed.items()})

    def _eligible(self, placement: dict, excluded: set, cache: dict) -> tuple[set, dict]:
        """(names, {(class, memory_gb): one such node}) of the nodes a trial with this
        placement and these excluded nodes may use; `cache` keeps them for the turn:
        most trials share both, and a fleet has hundreds of nodes of a few classes."""
        key = (json.dumps(placement, sort_keys=True), frozenset(excluded))
        if key not in cache:
            names, classes = set(), {}
            for n in self.nodes.values():
                if n.matches(placement) and n.name not in excluded:
                    names.add(n.name)
                    classes.setdefault(_plan_class(n), n)
            cache[key] = names, classes
        return cache[key]

    def _place_trial(self, s, spec: dict, t, free: list[NodeInfo], eligible: dict) -> str | None:
        """Place trial `t` of sweep `s` on the best of `free` where it fits now (taking
        the node out of `free` once it is full). None when it went; else why it waits
        ('' when it failed instead: no node it may use can ever hold it). `eligible`:
        the turn's cache for `_eligible`."""
        placement = spec.get("placement") or {}
        knobs = spec.get("planner") or {}
        margin = knobs.get("margin", DEFAULT_MARGIN)
        excluded = set(json.loads(t["excluded"]))
        names, classes = self._eligible(placement, excluded, eligible)
        if not names:
            if excluded and self.nodes:
                why = (f"out of memory at segment_size 1 on {sorted(excluded)} "
                       "and no other node matches")
                self.state.move(t["id"], TrialState.FAILED, why, message=why)
                self._maybe_done(s["id"])
                return ""
            return "no node alive" + (f" matches its placement {placement}" if self.nodes else "")
        # Whether it fits a node at all is judged on the whole node (a plan depends
        # on the node only through its class) ...
        by_class = {k: self._plan(t, n, knobs) for k, n in classes.items()}
        if not any(p.fits for p in by_class.values()):
            worst = "; ".join(f"{n}: {by_class[_plan_class(self.nodes[n])].reason}"
                              for n in sorted(names))
            why = f"does not fit any node ({worst})"
            self.state.move(t["id"], TrialState.FAILED, why, message=why)
            self._maybe_done(s["id"])
            return ""
        # ... where it goes now, on what running attempts leave of each (a trial
        # that ran out of memory sharing a node waits for one to itself).
        solo = self._shared_oom(t)
        fitting, short = [], []   # short: free nodes it may use, too small for it now
        for n in free:
            if n.name not in names:
                continue
            whole = by_class[_plan_class(n)]
            if not whole.fits:
                short.append(whole)
            elif not (solo and self.held.get(n.name)):
                spare = self.spare(n)
                plan = whole if spare >= n.memory_gb else self._plan_now(
                    t, n, knobs, budget_gb=spare)
                if plan.fits:
                    fitting.append((n, plan))
                else:
                    short.append(plan)
        if not fitting:   # it fits somewhere busy: it waits for room there
            if short:
                need = min(p.predicted_gb for p in short) / (1 - margin)
                return (f"no free node fits (needs {need:.3g} GB, largest free budget "
                        f"{max(p.budget_gb for p in short):.3g} GB)")
            if solo and any(n.name in names for n in free):
                return "waiting for a node to itself (it ran out of memory sharing one)"
            why = "waiting for a free node"   # the free ones are nodes it may not use
            if placement:
                why += f" matching its placement {placement}"
            if excluded:
                why += (f" other than {', '.join(sorted(excluded))} (out of memory at "
                        "segment_size 1 there)")
            return why
        # the least loaded node first (spread, then stack), then the fastest plan; a
        # trial whose last attempt broke on a node (lost, or its agent failed: a full
        # disk) goes to another one where it can, or that node takes every retry
        broke = self._broke_on(t)
        node, plan = max(fitting, key=lambda np: (np[0].name != broke,
                                                  -len(self.held.get(np[0].name, {})),
                                                  np[1].segment_size, -np[0].memory_gb))
        self.dispatch(t, node, plan, margin, solo)
        if not self.takes_work(node):
            free.remove(node)
        return None

    def _broke_on(self, t) -> str | None:
        """The node trial `t`'s last attempt ended on as lost or with its agent failing."""
        a = self.state.last_attempt(t["id"])
        return a["node"] if a and a["outcome"] in (Outcome.NODE_LOST, Outcome.AGENT_ERROR) else None

    def _shared_oom(self, t) -> bool:
        """Whether trial `t`'s last attempt ran out of memory under less than it would
        have had alone on its node (sharing it): the prediction it was held to was low.
        Alone means the node's memory, or the job's own `memory.budget_gb` where that
        is smaller: a trial held to its own budget was not sharing."""
        a = self.state.last_attempt(t["id"])
        node = self.nodes.get(a["node"]) if a else None
        if not (a and a["outcome"] == Outcome.OOM and node and a["budget_gb"] is not None):
            return False
        own = (json.loads(t["job"]).get("memory") or {}).get("budget_gb")
        alone = min(node.memory_gb, own) if own else node.memory_gb
        return a["budget_gb"] < alone - 1e-9

    def fail_sweep(self, sid: str, reason: str) -> None:
        """The sweep cannot go on: its trials that have not started fail with the
        reason, running ones finish, and nothing more of it is placed."""
        for t in self.state.trials(sid, TrialState.PENDING):
            self.state.move(t["id"], TrialState.FAILED, reason, message=reason)
        self.state.set_sweep_state(sid, SweepState.FAILED, reason)

    def _place_probes(self, free: list[NodeInfo]) -> list[NodeInfo]:
        """Each queued class of a tune gets a free node of its class; returns the
        nodes left free. Probes go first: what they measure plans the trials."""
        for c in self.state.queued_tune_classes():
            tid, cls, req = c["tune"], c["node_class"], c["request"]
            node = next((n for n in free if n.node_class == cls and not self.held.get(n.name)),
                        None)
            if node is None:
                if not any(n.node_class == cls for n in self.nodes.values()):
                    self.state.move_tune_class(tid, cls, TuneState.FAILED,
                                               error=f"no node of class {cls} is up")
                continue
            # A probe walks its points in order, so after a head restart the points
            # still to measure are those after the `done` already filed.
            spec = ProbeSpec(model=req["model"], method=req["method"],
                             prefix_shared=req["prefix_shared"], lora=req["lora"],
                             head_chunk=req["head_chunk"], attn_block=req["attn_block"],
                             # a tune filed by an older head has no mlp_chunk
                             mlp_chunk=req.get("mlp_chunk", DEFAULT_MLP_CHUNK),
                             budget_gb=node.memory_gb, points=c["points"][c["done"]:],
                             steps=req["steps"], pack_rows=req.get("pack_rows", 1))
            ref = self.agents[node.name].probe.remote(tid, spec)
            self.probing[ref] = (tid, cls, node.name)
            self.held[node.name] = {f"tune:{tid}": float("inf")}   # probes measure a whole node
            self.state.move_tune_class(tid, cls, TuneState.RUNNING, node=node.name)
            free = [n for n in free if n.name != node.name]
        return free

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
            error = result.get("error") or ""   # "cancelled": node/probes.py's word for a cancel
            to = (TuneState.CANCELLED if error == TuneState.CANCELLED.value else
                  TuneState.FAILED if error else TuneState.DONE)
            self.state.move_tune_class(tid, cls, to, error=error)

    def _plan(self, t, node: NodeInfo, knobs: dict):
        # a plan depends on the node only through its class (chip and budget): one per
        # class, not one per node, or a fleet of N alike nodes plans each trial N times
        key = (t["id"], *_plan_class(node), t["max_segment"])
        if key not in self.plans:
            self.plans[key] = self._plan_now(t, node, knobs)
        return self.plans[key]

    def _plan_now(self, t, node: NodeInfo, knobs: dict, budget_gb: float | None = None):
        job = JobSpec.model_validate(json.loads(t["job"]))
        info = planner.ModelInfo.from_dict(json.loads(t["model_info"]))
        return planner.plan(info, job, seq_len=t["seq_len"],
                            budget_gb=node.memory_gb if budget_gb is None else budget_gb,
                            margin=knobs.get("margin", DEFAULT_MARGIN), scale=knobs.get("scale", DEFAULT_SCALE),
                            below=t["max_segment"],
                            measured=self._measured(info, job, node.node_class))

    def _measured(self, info, job: JobSpec, node_class: str):
        """The tuned memory model for this trial on this class, if one was measured."""
        key = planner.model_key(info)
        if key not in self.fitted:
            self.fitted[key] = measured.models_of(measured.read_plan(self.root, key))
        return self.fitted[key].get(planner.tune_key(job, node_class))

    def dispatch(self, t, node: NodeInfo, plan, margin: float = 0.0, solo: bool = False) -> None:
        """Start an attempt of trial `t` on `node`. What the attempt needs from the
        head is read first: a damaged or missing input fails the trial (running it
        again cannot help). A failure once the attempt is recorded (the agent gone)
        ends that attempt, not the turn.

        A node alone to itself (max_trials 1), or a `solo` attempt, gets all of the
        node; a node that shares lends each attempt what its plan predicts plus the
        margin, at least its even share of the node (a low prediction of a small
        trial costs nothing then), at most what is left; the attempt's guard holds
        it to that."""
        tid = t["id"]
        try:
            data = {name: _read_input(self.root / "inputs" / sha)
                    for name, sha in json.loads(t["inputs"]).items()}
            ckpt = self.stores.latest_checkpoint(tid)
        except Exception as e:
            line = self.fault(f"trial {tid}: reading its inputs on the head", e)
            self.state.move(tid, TrialState.FAILED, line, message=line)
            return self._maybe_done(t["sweep"])
        hold = node.memory_gb if node.max_trials == 1 or solo else min(
            self.spare(node), max(plan.predicted_gb / (1 - margin),
                                  node.memory_gb / node.max_trials))
        job = json.loads(t["job"])
        mem = job.setdefault("memory", {})
        mem["segment_size"] = plan.segment_size
        mem["offload"] = "disk" if plan.offload else "none"
        mem["budget_gb"] = min(mem.get("budget_gb") or hold, hold)
        # Runnable since: the trial was pending and this node was free (the later).
        ready = max(t["runnable_since"], self.free_since.get(node.name, 0.0))
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
        spec = AttemptSpec(sweep=t["sweep"], trial=tid, attempt=aid, job=job, data=data,
                           checkpoint_step=ckpt[0] if ckpt else None,
                           checkpoint=ckpt[1] if ckpt else {}, flush_s=self.flush_s())
        try:
            ended, result = self.agents[node.name].run.remote(spec)
        except Exception as e:
            line = self.fault(f"attempt {aid}: handing it to {node.name}", e)
            return self.finish(aid, AttemptResult(attempt=aid, outcome=Outcome.AGENT_ERROR,
                                                  message=line))
        self.inflight[ended] = Flight(aid, node.name, t["sweep"], result)
        self.held.setdefault(node.name, {})[aid] = mem["budget_gb"]

    # ------------------------------------------------------------ outcomes
    def finish(self, aid: int, r: AttemptResult) -> None:
        """Apply how an attempt ended. The attempt is marked ended with its outcome
        first (so no restart runs it twice), then its telemetry is sealed into the
        stores; a seal that fails leaves the attempt unsealed for `reseal` (on
        `segctl resume` and on the head's restart) and does not hold the trial. A
        success whose adapter cannot be stored is not a success: the trial runs again."""
        a = self.state.attempt(aid)
        tid, sid = a["trial"], a["sweep"]
        peak = max(a["peak_gb"] or 0.0, r.peak_gb or 0.0) or None
        self.state.update_attempt(aid, status=AttemptStatus.ENDED.value, outcome=r.outcome.value,
                                  message=r.message, ended=r.ended or self.clock(), peak_gb=peak,
                                  final_loss=r.final_loss, val_loss=r.val_loss,
                                  step=r.steps or a["step"])
        self.guarded(f"attempt {aid}: its trackers", self.trackers.ended, aid, r.outcome.value)
        self.guarded(f"attempt {aid}: sealing its telemetry (kept for resume)", self._seal, aid)
        t = self.state.trial(tid)
        if t["state"] == TrialState.STOPPED and r.adapter:   # it finished before the stop landed
            self.guarded(f"attempt {aid}: storing the adapter of a stopped trial",
                         lambda: self.stores.put_adapter(sid, tid, aid, r.adapter,
                                                         step=r.steps or None, val_loss=r.val_loss))
        if t["state"] in TERMINAL:
            return self._maybe_done(sid)
        seg, node = a["segment_size"], a["node"]
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
        to = OUTCOME_MOVES[r.outcome]
        if to == TrialState.SUCCEEDED:
            self.state.move(tid, TrialState.SUCCEEDED, f"finished on {node}: final loss "
                            f"{_fmt(r.final_loss)}, val loss {_fmt(r.val_loss)}", attempt=aid,
                            final_loss=r.final_loss, val_loss=r.val_loss, message="")
        elif to == TrialState.OOM:
            self.state.move(tid, TrialState.OOM, f"{node}: {r.message}", attempt=aid)
            if not self._retry_left(tid, sid, aid):
                pass
            elif seg > 1:
                self.state.move(tid, TrialState.PENDING,
                                f"re-plan below segment_size {seg} after out of memory on {node}",
                                attempt=aid, max_segment=min(seg, t["max_segment"] or seg))
            elif self._shared_oom(t):
                self.state.move(tid, TrialState.PENDING,
                                f"out of memory sharing {node} ({a['budget_gb']:.3f} GB lent): "
                                "next on a node to itself", attempt=aid)
            else:
                excluded = sorted(set(json.loads(t["excluded"])) | {node})
                self.state.move(tid, TrialState.PENDING,
                                f"out of memory at segment_size 1 on {node}: try a larger node",
                                attempt=aid, excluded=json.dumps(excluded))
        elif to == TrialState.NODE_LOST:
            self.state.move(tid, TrialState.NODE_LOST, r.message, attempt=aid)
            if r.outcome == Outcome.INTERRUPTED or self._retry_left(tid, sid, aid):
                ckpt = self.stores.latest_checkpoint(tid)
                self.state.move(tid, TrialState.PENDING, "resume from checkpoint step "
                                f"{ckpt[0]}" if ckpt else "restart: no checkpoint yet", attempt=aid)
        elif to == TrialState.CANCELLED:
            self.state.move(tid, TrialState.CANCELLED, "cancelled", attempt=aid)
        else:
            self.state.move(tid, TrialState.FAILED, r.message or "failed", attempt=aid,
                            message=r.message)
        self._maybe_done(sid)

    def _retry_left(self, tid: str, sid: str, aid: int) -> bool:
        try:
            retries = sweep_record(self.state.sweep(sid))["retries"]
        except ValueError as e:   # its row in state.db is unusable: no retry can be counted
            why = f"sweep {sid}: reading it from state.db: {e}"
            self.state.move(tid, TrialState.FAILED, why, attempt=aid, message=why)
            return False
        used = self.state.charged_attempts(tid)
        if used > retries:
            self.state.move(tid, TrialState.FAILED, f"retries spent ({used} attempts, "
                            f"retries: {retries})", attempt=aid, message="retries spent")
            return False
        return True

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


def _check_payload(payload) -> dict:
    """What the CLI validated, checked again where it lands, by the same schema code
    (schemas/sweep.py's check_expanded: every key of the sweep, every trial's job,
    the scheduler against the trials; the planner's knobs as cluster.yaml's): a caller
    holding the token but not using the CLI must not get into state.db a value a
    placement turn cannot compare or plan with. Returns the sweep and its trials as
    the head records them, every value as its schema reads it. Raises ValueError
    with one line."""
    import re

    from segctl.schemas.cluster import PlannerSpec
    from segctl.schemas.limits import (MAX_NAME_CHARS, MAX_SWEEP_NAME_CHARS, NAME_PATTERN,
                                       one_line, path_problem)
    from segctl.schemas.sweep import check_expanded
    if not isinstance(payload, dict):
        raise ValueError(f"a submission is a mapping, not {type(payload).__name__}")
    name, path, spec = payload.get("name"), payload.get("path"), payload.get("spec")
    if not isinstance(name, str) or len(name) > MAX_SWEEP_NAME_CHARS or not re.fullmatch(
            NAME_PATTERN, name):
        raise ValueError(f"sweep name {str(name)[:80]!r} is not a plain name of at most "
                         f"{MAX_SWEEP_NAME_CHARS} characters")
    if not isinstance(path, str) or path_problem(path):
        raise ValueError(f"path: {path_problem(path) if isinstance(path, str) else 'expected a string'}")
    if not isinstance(spec, dict):
        raise ValueError(f"spec: expected a mapping, got {type(spec).__name__}")
    try:
        knobs = PlannerSpec.model_validate(spec.get("planner") or {})
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(one_line(f"planner.{'.'.join(map(str, err['loc']))}: "
                                  f"{err['msg']}")) from None
    # the sweep is recorded under the name checked above, whatever its spec says
    sweep_keys = {k: v for k, v in spec.items() if k != "planner"} | {"name": name}
    trials = payload.get("trials")
    sweep = check_expanded(sweep_keys, trials)
    blobs = payload.get("blobs")
    if not isinstance(blobs, dict) or not all(isinstance(b, bytes) for b in blobs.values()):
        raise ValueError("blobs: expected a mapping of sha256 -> bytes")
    out, seen = [], set()
    for raw, t in zip(trials, sweep.trials):
        try:
            if not re.fullmatch(NAME_PATTERN, t.name) or len(f"{name}-{t.name}") > MAX_NAME_CHARS:
                raise ValueError(f"trial name {t.name[:80]!r} is not a plain name")
            if t.name in seen:
                raise ValueError("a second trial of this name")
            seen.add(t.name)
            try:
                info = planner.ModelInfo.from_dict(raw.get("model_info"))
            except Exception as e:
                raise ValueError(f"model_info: {e}") from None
            seq_len = raw.get("seq_len")
            if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
                raise ValueError(f"seq_len: expected a whole number >= 1, got {str(seq_len)[:80]!r}")
            inputs = raw.get("inputs")
            if not isinstance(inputs, dict) or "train.jsonl" not in inputs or \
                    set(inputs) - {"train.jsonl", "valid.jsonl"} or \
                    any(sha not in blobs for sha in inputs.values()):
                raise ValueError("inputs: expected {train.jsonl: sha256[, valid.jsonl: sha256]} "
                                 "of files among the blobs sent")
            try:
                json.dumps(t.params, allow_nan=False)   # kept in state.db as JSON
            except (TypeError, ValueError) as e:
                raise ValueError(f"params: not plain JSON ({e})") from None
        except Exception as e:
            why = one_line(str(e)) if isinstance(e, ValueError) else _one_line(e)
            raise ValueError(f"trial {t.name[:80]!r}: {why}") from None
        out.append(dict(index=t.index, name=t.name, params=t.params,
                        job=t.job.model_dump(mode="json"), model_info=info.to_dict(),
                        seq_len=seq_len, inputs=dict(inputs)))
    recorded = sweep.spec.model_dump(mode="json")
    if "owner" not in spec:   # the head's own user would be no one's answer to "who"
        recorded.pop("owner")
    recorded["planner"] = knobs.model_dump()
    return dict(name=name, path=path, spec=recorded, trials=out)


def sweep_record(row) -> dict:
    """A sweep's row of state.db as the placement turn uses it: its spec with the
    row's own columns (priority, concurrency, retries, placement: what the head
    schedules by) held to SweepSpec, the planner's knobs to PlannerSpec, every value
    typed. A row an older or hostile writer left wrong is a ValueError naming the
    key, one line."""
    from segctl.schemas.cluster import PlannerSpec
    from segctl.schemas.limits import one_line
    try:
        spec = json.loads(row["spec"])
        if not isinstance(spec, dict):
            raise ValueError(f"expected a mapping, got {type(spec).__name__}")
        placement = json.loads(row["placement"])
    except (ValueError, TypeError) as e:
        raise ValueError(one_line(f"spec or placement: not a JSON mapping ({e})")) from None
    given = {k: v for k, v in spec.items() if k != "planner"}
    given.update(priority=row["priority"], concurrency=row["concurrency"], retries=row["retries"],
                 placement=placement)
    try:
        sweep = SweepSpec.model_validate(given)
        knobs = PlannerSpec.model_validate(spec.get("planner") or {})
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(one_line(f"{'.'.join(map(str, err['loc']))}: {err['msg']}")) from None
    return dict(sweep.model_dump(mode="json"), planner=knobs.model_dump())


def _plan_class(n: NodeInfo) -> tuple[str, float]:
    """What a node's plans depend on: its class (chip) and its memory budget."""
    return n.node_class, n.memory_gb


def _adapter_bytes(r: AttemptResult) -> int:
    return sum(len(b) for files in (r.adapter, r.best_adapter) for b in files.values())


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An error as one short line; a remote task's error by its cause (Ray's own
    text carries the whole remote traceback)."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def asha_cutoff(values: list[float], reduction: int) -> float:
    """The value at the top 1/reduction of `values`, lower being better: their
    1/reduction quantile, interpolated linearly (numpy's default percentile)."""
    xs = sorted(values)
    pos = (len(xs) - 1) / reduction
    lo = int(pos)
    return xs[lo] if lo + 1 >= len(xs) else xs[lo] + (pos - lo) * (xs[lo + 1] - xs[lo])


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _write_input(path: Path, blob: bytes) -> None:
    """Keep a data file under its sha256 (its name). A copy already there is trusted
    only if its bytes still hash to its name; otherwise it is replaced atomically
    (two submits of the same file at once each write aside under a name of their own)."""
    if path.exists() and _sha256(path) == path.name:
        return
    write_atomic(path, blob, mode=0o600)


def _read_input(path: Path) -> bytes:
    """A data file kept under its sha256, checked: the head never ships rotten bytes."""
    blob = path.read_bytes()
    if hashlib.sha256(blob).hexdigest() != path.name:
        raise ValueError(f"{path}: the head's copy of this data file is damaged; submit again")
    return blob


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


# ------------------------------------------------------------------ the actor

class Head:
    """Controller as a Ray actor: requests arrive on Ray's threads, the loop runs on
    its own."""

    def __init__(self, root: str):
        self.root = root
        self.c = self.controller(Path(root))
        self.stop = threading.Event()
        threading.Thread(target=self.c.run_forever, args=(self.stop,), daemon=True,
                         name="controller").start()

    def controller(self, root: Path) -> Controller:
        """The controller over the fleet: Ray's node table, an agent actor per node.
        The one seam of the actor: a simulated fleet (bench/simfleet.py) hands in
        its own nodes and agents here and runs everything else as it is."""
        from segctl.node.agent import spawn
        from segctl.orchestrator.fleet import nodes
        me = ray.get_runtime_context().current_actor
        return Controller(root, list_nodes=nodes, spawn_agent=lambda n: spawn(n, me))

    def ping(self) -> dict:
        return {"root": self.root, "pid": os.getpid(), "nodes": sorted(self.c.nodes),
                "busy": {n: sorted(map(str, h)) for n, h in self.c.held.items() if h}}

    def submit(self, payload: dict) -> str:
        return self.c.submit(payload)

    def cancel(self, target: str) -> list[str]:
        return self.c.cancel(target)

    def resume(self, sid: str) -> dict:
        return self.c.resume(sid)

    def started(self, aid: int, pid: int, t: float) -> None:
        self.c.started(aid, pid, t)

    def ingest(self, aid: int, events: list[dict]) -> int:
        return self.c.ingest(aid, events)

    def checkpoint(self, aid: int, step: int, files: dict) -> None:
        self.c.checkpoint(aid, step, files)

    def tune(self, request: dict) -> str:
        return self.c.tune(request)

    def tune_status(self, tid: str) -> dict:
        return self.c.tune_status(tid)

    def cancel_tune(self, tid: str) -> None:
        self.c.cancel_tune(tid)

    def record_probe(self, tid: str, node: str, event: dict) -> None:
        self.c.record_probe(tid, node, event)

    def model_manifest(self, path: str) -> list:
        return models.manifest(self.c.model_folder(path))

    def model_chunk(self, path: str, name: str, offset: int, n: int) -> bytes:
        return models.read_chunk(self.c.model_folder(path), name, offset, n)


def get_head(root: Path, *, create: bool = True):
    """The running head actor for this stores root (created if asked and absent)."""
    try:
        head = ray.get_actor(HEAD_NAME, namespace=NAMESPACE)
    except ValueError:
        if not create:
            raise ConnectionError("no segctl head is running on this cluster") from None
        if (Path(root) / "state.db").exists():   # a broken one is said here in one line,
            read_state(Path(root) / "state.db").close()   # not by a head that dies starting
        Stores(Path(root)).check()                   # and so is a broken staging.db
        head = ray.remote(Head).options(
            name=HEAD_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=64, resources={"segctl_head": 0.001},
        ).remote(str(root))
    info = ray.get(head.ping.remote(), timeout=120)
    if Path(info["root"]) != Path(root):
        raise ConnectionError(f"this cluster's head keeps its stores in {info['root']}, not {root}")
    return head


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
