"""Fleet benchmark: one JSON row per measure, on K local Ray nodes of this machine.

    python -m bench.orchestrator [--nodes 3] [--trials 12] [--iters 3] [--rows 200000]

- dispatch: seconds from a trial becoming runnable (submitted, or sent back to
  PENDING) to its engine process being started on a node, over every attempt.
- makespan: wall time of a sweep of short trials against the ideal, the total
  work (sum of attempt durations) divided by K.
- ingest: step rows per second through the collector, both the stores' write
  path alone and through the running head actor over Ray (batches as agents send:
  one agent, then K at once, each waiting for its last batch's answer).

Targets: dispatch < 1 s, makespan <= 1.15x ideal, >= 50,000 rows/s.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def row(**kw):
    kw.update(machine=f"{platform.node()} ({platform.machine()}, {_cores()} cores)",
              time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(json.dumps(kw), flush=True)


def _cores() -> int:
    import os
    return os.cpu_count() or 0


def segctl(*args, timeout=900):
    from tests.conftest import cli_env
    return subprocess.run([sys.executable, "-m", "segctl.orchestrator.cli", *map(str, args)],
                          capture_output=True, text=True, env=cli_env(), timeout=timeout)


def step_events(n: int, seq0: int = 0) -> list[dict]:
    now = time.time()
    return [{"event": "step", "seq": seq0 + i, "time": now, "step": i + 1, "loss": 1.0 / (i + 1),
             "tokens": 300, "seconds": 0.1, "tokens_per_s": 3000.0, "lr": 1e-4, "grad_norm": 0.5,
             "peak_gb": 0.02, "active_gb": 0.01, "cache_gb": 0.001} for i in range(n)]


def bench_ingest_stores(rows: int, batch: int) -> None:
    from segctl.orchestrator.stores import Stores
    with tempfile.TemporaryDirectory() as d:
        stores = Stores(Path(d))
        events = step_events(rows)
        tic = time.perf_counter()
        for i in range(0, rows, batch):
            stores.ingest("bench-1", "bench-1-t000", 1, events[i:i + batch])
        secs = time.perf_counter() - tic
        tic = time.perf_counter()
        stores.seal_attempt("bench-1", "bench-1-t000", 1, {
            "trial": "bench-1-t000", "attempt": 1, "attempt_no": 1, "node": "n", "chip": "c",
            "segment_size": 1, "predicted_gb": 0.1, "budget_gb": 1.0, "outcome": "succeeded",
            "message": "", "started": 0.0, "ended": 1.0, "steps": rows, "peak_gb": 0.02,
            "final_loss": 0.1, "val_loss": 0.1})
        seal = time.perf_counter() - tic
    row(bench="ingest", path="stores", rows=rows, batch=batch, seconds=round(secs, 3),
        rows_per_s=round(rows / secs), seal_seconds=round(seal, 3), target_rows_per_s=50000)


def bench_fleet(nodes: int, trials: int, iters: int, rows: int, batch: int, port: int) -> None:
    from segctl.engine.demo import write_demo
    from segctl.schemas.states import TrialState
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        write_demo(d / "demo", "qwen3", n_train=60, n_valid=8)
        base = yaml.safe_load((d / "demo" / "job.yaml").read_text())
        base["train"].update(iters=iters, eval_every=0, checkpoint_every=0)
        base["data"].pop("valid")
        (d / "demo" / "short.yaml").write_text(yaml.safe_dump(base))
        sweep = {"name": "bench", "base": "short.yaml", "grid": {"train.seed": list(range(trials))}}
        (d / "demo" / "bench.yaml").write_text(yaml.safe_dump(sweep))
        cluster = {"head": {"address": "auto", "port": port, "stores": str(d / "stores")},
                   "nodes": [{"name": f"n{i}", "local": True, "memory_gb": 4, "chip": "sim"}
                             for i in range(nodes)]}
        (d / "cluster.yaml").write_text(yaml.safe_dump(cluster))
        up = segctl("cluster", "up", d / "cluster.yaml")
        if up.returncode:
            sys.exit(f"cluster up failed: {up.stderr.strip()}")
        try:
            tic = time.time()
            sub = segctl("submit", d / "demo" / "bench.yaml", "--cluster", d / "cluster.yaml",
                         "--json")
            wall = time.time() - tic
            st = segctl("status", "--cluster", d / "cluster.yaml", "--json")
            [sw] = json.loads(st.stdout)
            attempts = [a for t in sw["trials"] for a in t["attempts"]]
            if sub.returncode or any(t["state"] != TrialState.SUCCEEDED for t in sw["trials"]):
                sys.exit(f"sweep failed: {sub.stderr[-2000:]}")
            disp = [a["dispatch_s"] for a in sorted(attempts, key=lambda a: a["started"])]
            row(bench="dispatch", nodes=nodes, attempts=len(disp),
                median_s=round(statistics.median(disp), 4), max_s=round(max(disp), 4),
                each_s=[round(x, 3) for x in disp], target_s=1.0)
            first = min(a["started"] - a["dispatch_s"] for a in attempts)
            makespan = max(a["ended"] for a in attempts) - first
            work = sum(a["ended"] - a["started"] for a in attempts)
            ideal = work / nodes
            row(bench="makespan", nodes=nodes, trials=trials, iters=iters,
                makespan_s=round(makespan, 3), ideal_s=round(ideal, 3),
                ratio=round(makespan / ideal, 4), mean_trial_s=round(work / len(attempts), 3),
                submit_wall_s=round(wall, 3), target_ratio=1.15)
            for senders in sorted({1, nodes}):   # one agent sending, and the whole fleet
                bench_ingest_head(d, attempts[0]["attempt"], rows, batch, senders)
        finally:
            segctl("cluster", "down", d / "cluster.yaml")


def bench_ingest_head(d: Path, aid: int, rows: int, batch: int, senders: int) -> None:
    """Batches sent to the real head actor over Ray, as node agents send them (into
    a finished attempt of the bench's own throw-away stores, after its own rows):
    `senders` batches in flight at once, as that many agents each wait for their
    last batch's answer before sending the next."""
    code = f"""
import json, sys, time, ray
sys.path.insert(0, {str(ROOT)!r})
from bench.orchestrator import step_events
from segctl.orchestrator import fleet
from segctl.orchestrator.actor import get_head
from segctl.schemas.cluster import load_cluster
spec = load_cluster({str(d / 'cluster.yaml')!r})
fleet.connect(spec, start=False)
head = get_head(fleet.stores_root(spec), create=False)
events = step_events({rows}, seq0=1_000_000)
tic = time.perf_counter()
inflight = []
for i in range(0, {rows}, {batch}):
    inflight.append(head.ingest.remote({aid}, events[i:i + {batch}]))
    if len(inflight) >= {senders}:
        ray.get(inflight.pop(0))
ray.get(inflight)
print(json.dumps(time.perf_counter() - tic))
"""
    from tests.conftest import cli_env
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=cli_env(), timeout=600)
    if p.returncode:
        sys.exit(f"head ingest failed: {p.stderr[-2000:]}")
    secs = json.loads(p.stdout.strip().splitlines()[-1])
    row(bench="ingest", path="head actor over Ray", rows=rows, batch=batch, senders=senders,
        seconds=round(secs, 3), rows_per_s=round(rows / secs), target_rows_per_s=50000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=500, help="rows per ingest call (agents send "
                    "at most 500 or every 0.5 s)")
    ap.add_argument("--port", type=int, default=6481)
    a = ap.parse_args()
    bench_ingest_stores(a.rows, a.batch)
    bench_fleet(a.nodes, a.trials, a.iters, a.rows, a.batch, a.port)


if __name__ == "__main__":
    main()
