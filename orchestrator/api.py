"""The head's API: what the CLI asks of it (a sweep to run, a cancel, a resume, a
tune) and what agents report to it (an engine started, telemetry, a checkpoint, a
tune's measurement). Methods of the Controller (orchestrator/head.py), kept here
so that its class reads as the loop: each takes the controller's lock, records
the request in state.db or the stores and, where that may make work runnable,
wakes the loop; nothing here places or decides an attempt's outcome.
"""

from __future__ import annotations

from segctl.schemas.records import (
    TERMINAL,
    AttemptStatus,
    SweepState,
    TrialState,
    TuneState,
    attempt_nodes,
)

from . import asha, probing
from .controller_base import ControllerBase
from .intake import check_payload, keep_inputs


class HeadAPI(ControllerBase):
    """The requests half of the Controller: its attributes are the Controller's."""

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
            elif (row := self.state.trial(target)) is not None:
                trials = [row]
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
                self._maybe_done(self.state.known_trial(target)["sweep"])
            return done

    def _cancel_attempts(self, tid: str) -> None:
        """Ask the agents running trial `tid`'s attempts to end them (each comes back
        through `finish`, which finds its trial terminal already)."""
        for a in self.state.open_attempts(tid):
            self._cancel_on(a["id"], attempt_nodes(a["node"]))   # several nodes: each rank

    def _cancel_on(self, aid: int, nodes) -> None:
        """Ask the agents of `nodes` (those up) to end attempt `aid` there."""
        for node in nodes:
            agent = self.agents.get(node)
            if agent is not None:
                agent.cancel.remote(aid)

    def resume(self, sid: str) -> dict:
        with self.mu:
            s = self.state.sweep(sid)
            if s is None:
                raise KeyError(f"no sweep named {sid!r}")
            self.reseal(sid)   # results a failed store write left behind
            if s["state"] == SweepState.INTERRUPTED:
                self.state.set_sweep_state(sid, SweepState.RUNNING, "resumed by user")
                self.wake.set()
            return {"sweep": sid, "state": self.state.known_sweep(sid)["state"],
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
            self.tuned.forget(req["model_key"])
            self.plans.clear()

    # ------------------------------------------------------------ from agents
    def started(self, aid: int, pid: int, t: float) -> None:
        with self.mu:
            a = self.state.attempt(aid)
            if a is None or a["status"] != AttemptStatus.PLACED:
                return
            trial = self.state.known_trial(a["trial"])
            self.state.update_attempt(aid, status=AttemptStatus.RUNNING.value, started=t, pid=pid,
                                      dispatch_s=t - a["ready"])
            if trial["state"] == TrialState.PLACED:
                self.state.move(a["trial"], TrialState.RUNNING,
                                f"engine process {pid} started on {a['node']}", attempt=aid)

    def ingest(self, aid: int, events: list[dict]) -> int:
        # The stores and state.db lock for themselves: a batch goes in without waiting
        # for `mu`, which the controller holds while it files ended attempts (their
        # adapters and Parquet files). Only a decision (asha) takes it.
        a = self.state.known_attempt(aid)
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
        # a job on several nodes: rank 0's events speak for the run (the others' steps
        # are the same step's), trackers see each once
        mine = [e for e in events if not e.get("rank")]
        self.guarded(f"attempt {aid}: its trackers", self.trackers.feed, a, mine,
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
                           finished=self.state.known_trial(tid)["state"] in TERMINAL)
            if d is None:
                continue
            stop = d.reason if isinstance(d, asha.Stop) else None
            if self.state.record_rung(a["sweep"], d.rung, tid, d.value, attempt=a["id"],
                                      stop=stop) and stop:
                self._cancel_attempts(tid)
                self._maybe_done(a["sweep"])
                return

    def checkpoint(self, aid: int, step: int, files: dict[str, bytes]) -> None:
        a = self.state.known_attempt(aid)   # no `mu`: the stores lock for themselves (see ingest)
        self.stores.put_checkpoint(a["sweep"], a["trial"], aid, step, files)

    def model_folder(self, path: str) -> str:
        """A node asks for a model it does not have: only a model some trial trains
        is served (the token keeps strangers out; this keeps nodes to their business)."""
        if self.state.serves_model(path):
            return path
        raise PermissionError(f"{path}: not the model of any trial")
