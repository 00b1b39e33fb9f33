"""The agent on each node: a Ray actor pinned to its node that runs attempts the
head sends it, up to the node's max_trials at once, each in a fresh engine
process (node/attempt.py), and the probe points of a tune (node/tune_runner.py).

It reaches the head through the head actor's handle: telemetry batches, then
checkpoints and the adapter as bytes. Nothing assumes a shared file system.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path

import ray

from segctl.schemas.limits import MAX_TRIALS_PER_NODE
from segctl.schemas.private import private_dir
from segctl.schemas.records import AttemptResult, AttemptSpec, ProbeSpec

from .attempt import Running, abandoned, run_attempt
from .link import ring_endpoint
from .models import local_model
from .tune_runner import run_probes

CALL_TIMEOUT_S = 120


def work_root(name: str) -> Path:
    """This node's work folder (attempts, probes; the model cache beside it), the
    user's alone: in a shared /tmp a folder of this name made by someone else is
    refused, not used."""
    base = private_dir(os.environ.get("SEGCTL_WORK") or os.path.join(
        tempfile.gettempdir(), f"segctl-work-{os.getuid()}"))
    return private_dir(base / name)


class NodeAgent:
    def __init__(self, name: str, head):
        self.name = name
        self.head = head
        self.running: dict[int | str, Running] = {}   # an attempt, or "tune:NAME"
        self.lock = threading.Lock()
        abandoned(work_root(name))   # no attempt of this node runs before its agent does

    def ping(self) -> dict:
        return {"name": self.name, "host": socket.gethostname(), "pid": os.getpid(),
                "running": sorted(map(str, self.running))}

    @ray.method(num_returns=2)
    def run(self, spec: AttemptSpec) -> tuple[float | None, AttemptResult]:
        """Run one attempt; two objects back: when it ended, and how (its adapter's
        bytes among it). The head frees the node by the first and may leave the
        second in Ray's object store until it files it."""
        running = Running()
        with self.lock:
            self.running[spec.attempt] = running
        head = self.head
        try:
            result = run_attempt(
                spec, work_root(self.name),
                send_events=lambda batch: ray.get(
                    head.ingest.remote(spec.attempt, batch), timeout=CALL_TIMEOUT_S),
                send_checkpoint=lambda step, files: ray.get(
                    head.checkpoint.remote(spec.attempt, step, files), timeout=CALL_TIMEOUT_S),
                on_started=lambda pid, t: head.started.remote(spec.attempt, pid, t),
                model_dir=self._model_dir, running=running)
            return result.ended, result
        except BaseException:
            # the attempt ends with this error (the head out of reach, a full disk):
            # its engine too, or it would train on beside the trial's next attempt
            running.cancel()
            raise
        finally:
            with self.lock:
                self.running.pop(spec.attempt, None)

    def ring_endpoint(self, interface: str | None, rdma: list[str] | None = None) -> str:
        """Where this node's rank of a job on several nodes will listen, with the RDMA
        devices a JACCL rank uses here checked (link.ring_endpoint)."""
        return ring_endpoint(interface, ray.util.get_node_ip_address(), rdma=rdma or ())

    def probe(self, tune: str, spec: ProbeSpec) -> dict:
        """Measure a tune's points here; each one goes to the head as it lands."""
        running = Running()
        key = f"tune:{tune}"
        with self.lock:
            self.running[key] = running
        try:
            return run_probes(spec, work_root(self.name), running=running,
                              model_dir=self._model_dir,
                              send=lambda event: ray.get(
                                  self.head.record_probe.remote(tune, self.name, event),
                                  timeout=CALL_TIMEOUT_S))
        finally:
            with self.lock:
                self.running.pop(key, None)

    def _model_dir(self, path: str) -> str:
        """The model folder on this node, fetched from the head the first time."""
        head = self.head
        return local_model(
            path, work_root(self.name).parent / "models",
            manifest=lambda p: ray.get(head.model_manifest.remote(p), timeout=CALL_TIMEOUT_S),
            chunk=lambda p, name, offset, n: ray.get(head.model_chunk.remote(p, name, offset, n),
                                                     timeout=CALL_TIMEOUT_S))

    def cancel(self, attempt: int | str) -> bool:
        with self.lock:
            running = self.running.get(attempt)
        if running:
            running.cancel()
        return running is not None


def spawn(name: str, head):
    """The agent of node `name`, pinned to it by its segctl_node resource; it takes
    no CPU slot (training runs in its own process)."""
    return ray.remote(NodeAgent).options(
        # several attempts at once (max_trials), plus probes, cancels and pings
        num_cpus=0, max_concurrency=MAX_TRIALS_PER_NODE + 8,
        resources={f"segctl_node:{name}": 0.001}, max_restarts=0,
    ).remote(name, head)
