"""The head as a Ray actor: a detached, named actor on the head machine whose
requests (from the CLI and from agents) arrive on Ray's threads and go to the
Controller (head.py), whose loop runs on a thread of its own."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import ray

from segctl.node import models

from .head import Controller
from .state import read as read_state
from .stores import Stores

HEAD_NAME = "segctl-head"
NAMESPACE = "segctl"


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
