"""A real sweep's stores, cheaply: the head's controller (its real state.db and
stores) places the demo sweep's trials on two fake nodes, and each attempt runs
for real (node/attempt.py: a fresh engine process, its telemetry and checkpoints
handed to the head as an agent hands them). Only Ray is left out, as in
tests/test_head_isolation.py. Two attempts go wrong the ways a fleet does: one
runs out of memory for real (a budget far below its peak: the engine's memory
guard stops it) and is re-planned smaller; one loses its node after it shipped
its checkpoints and resumes from the last one on a node that is free.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import yaml

from segctl.node.attempt import run_attempt
from segctl.orchestrator.submit import prepare
from segctl.schemas.records import SweepState
from segctl.schemas.sweep import load_sweep
from tests.conftest import edit_job
from tests.test_head_isolation import World, running

ITERS = 30   # per trial: evals every 5 steps, checkpoints every 12 (a resume redoes steps)


class RealTime(World):
    """The controller's clock is the engine's: attempts and telemetry line up in time."""

    def clock(self) -> float:
        return time.time()


def run_sweep(demo_dir: Path, home: Path, work: Path, on_batch=lambda sid: None) -> dict:
    """Run the 4-trial demo sweep to the end; returns {sweep, oom, lost, trials} (the
    sweep id, the two trials that went wrong, all four). `on_batch(sweep id)` is called
    after each telemetry batch the head takes in, while attempts run."""
    work.mkdir(parents=True, exist_ok=True)
    job = work / "job.yaml"
    shutil.copy(demo_dir / "job.yaml", job)
    edit_job(job, model=str(demo_dir / "model"), output=None,
             data={"train": str(demo_dir / "data/train.jsonl"),
                   "valid": str(demo_dir / "data/valid.jsonl")},
             memory={"segment_size": "auto"},
             train={"iters": ITERS, "eval_every": 5, "val_batches": 2, "checkpoint_every": 12,
                    "warmup": 2})
    sweep = work / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "look", "base": "job.yaml", "concurrency": 2, "retries": 2,
        "grid": {"train.learning_rate": [1e-4, 4e-4], "lora.rank": [4, 8]}}, sort_keys=False))
    payload = prepare(load_sweep(sweep), {})

    world = RealTime(names=("a", "b"))
    c = world.controller(home)
    sid = c.submit(payload)
    trials = [t["id"] for t in c.state.trials(sid)]
    oom, lost = trials[1], trials[2]
    tried: set[str] = set()

    def attempt(agent_ref):
        spec = agent_ref.args[0]
        first = spec.trial not in tried
        tried.add(spec.trial)
        if first and spec.trial == oom:   # far below any step's peak: the guard stops step 1
            job = spec.job.model_copy(update={
                "memory": spec.job.memory.model_copy(update={"budget_gb": 0.001})})
            spec = spec.model_copy(update={"job": job})
        r = run_attempt(spec, work / "nodes",
                        send_events=lambda batch, a=spec.attempt: (c.ingest(a, batch),
                                                                   on_batch(sid)),
                        send_checkpoint=lambda step, files, a=spec.attempt:
                            c.checkpoint(a, step, files),
                        on_started=lambda pid, t, a=spec.attempt: c.started(a, pid, t))
        if first and spec.trial == lost:   # its machine went away after the last checkpoint
            agent_ref.settle(error=ray.exceptions.RayActorError())
        else:
            agent_ref.settle(r)

    with ThreadPoolExecutor(2) as pool:
        for _ in range(200):
            c.turn()
            if c.state.sweep(sid)["state"] != SweepState.RUNNING:
                break
            refs = [r for agent in world.agents.values() for r in running(agent)]
            if refs:
                list(pool.map(attempt, refs))
            else:
                time.sleep(0.3)   # a lost node's agent comes back at the next listing
        else:
            raise AssertionError("the sweep did not end")
    c.state.close()
    return {"sweep": sid, "oom": oom, "lost": lost, "trials": trials}
