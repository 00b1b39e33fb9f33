"""The head at scale: the real head actor (Controller, state.db, stores, ingest)
over a simulated fleet (bench/simfleet.py: N nodes whose agents live in a few Ray
actors, each attempt a fake engine emitting the real events at `--step-s` a step).
One JSON row per run.

    python -m bench.scale --nodes 50 --trials 2000 [--steps-per-trial 200] [--step-s 0.01]
    python -m bench.scale --adapter-only     # what filing one adapter costs (no Ray)

The Ray cluster is a real `segctl` head node (fleet.up with no training nodes,
stopped by its pid at the end); the sweeps go in through the real submit path
(load_sweep + prepare on the demo model, split into sweeps of at most MAX_TRIALS);
`segctl status`, `segctl logs` and `segctl gather` run through the real CLI on the
finished sweeps.

Measures:
- head_cpu_cores: the head actor process's CPU seconds (user + system) over the
  wall time from the first submit to the last sweep DONE (target <= 1 core);
- dispatch p50/p99/max: per attempt, from runnable (the trial pending and its node
  free) to its engine started, as the head records it (target p99 < 1 s);
- ingest_rows_per_s: events the head took in (steps, phases, evals, ...) per second
  of that wall time; step rows are counted back from Parquet (= trials x steps);
- makespan against the ideal (trials x steps x step_s / slots);
- head_rss_max_mb (VmHWM: with the pages of Ray's object store the head touched),
  head_private_max_mb (its own pages, sampled every 5 s), state.db / staging.db / telemetry / adapters.zarr on disk;
- the CLI's wall time for status (table and --json), logs of one trial, gather of
  the best 10 and of the whole sweep (targets < 1 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env: dict, timeout: float = 600) -> tuple[float, subprocess.CompletedProcess]:
    tic = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "segctl.orchestrator.cli", *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=timeout)
    return time.perf_counter() - tic, p


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_private_mb(pid: int) -> float:
    """The process's own pages (private, clean + dirty) in MB. Its RSS also counts
    the pages of Ray's shared object store (/dev/shm) it has touched: the ended
    attempts' results that Ray holds, whoever holds them."""
    kb = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            kb += int(line.split()[1])
    return kb / 1024


def proc_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def du(path: Path) -> tuple[int, int]:
    """(bytes, files) under `path`."""
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
                files += 1
            except OSError:
                pass
    return total, files


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def demo_sweeps(d: Path, trials: int, steps: int, eval_every: int, checkpoint_every: int) -> list:
    """The demo job at `steps` iterations, a grid over seeds split into sweeps of at
    most MAX_TRIALS, as `segctl submit` would load them."""
    from segctl.engine.demo import write_demo
    from segctl.schemas.limits import MAX_TRIALS
    from segctl.schemas.sweep import load_sweep
    write_demo(d / "demo", "qwen3", n_train=60, n_valid=8)
    base = yaml.safe_load((d / "demo" / "job.yaml").read_text())
    base["train"].update(iters=steps, eval_every=eval_every, checkpoint_every=checkpoint_every)
    (d / "demo" / "scale.yaml").write_text(yaml.safe_dump(base))
    out, start, k = [], 0, 0
    while start < trials:
        n = min(MAX_TRIALS, trials - start)
        sweep = {"name": f"scale{k}", "base": "scale.yaml", "retries": 2,
                 "grid": {"train.seed": list(range(start, start + n))}}
        path = d / "demo" / f"scale{k}.yaml"
        path.write_text(yaml.safe_dump(sweep))
        out.append(load_sweep(path))
        start, k = start + n, k + 1
    return out


def adapter_cost(n: int = 30, stores_cls=None) -> dict:
    """What filing one adapter costs the head: CPU and wall seconds per `put_adapter`
    of an adapter shaped like the scale runs' (the demo model, rank 8: 56 tensors),
    and per `adapter_files` reading it back; the files a stored adapter takes.
    `stores_cls`: another Stores to measure (an older one, for a before/after)."""
    from bench.simfleet import DEMO_SHAPE, FakeEngine
    from segctl.orchestrator.stores import Stores
    stores_cls = stores_cls or Stores
    job = {"memory": {"segment_size": 1}, "lora": {"rank": 8, "scale": 20.0, "num_layers": -1}}
    eng = FakeEngine(job, 1, 1)
    adapters = [eng.adapter(step) for step in range(n)]
    with tempfile.TemporaryDirectory(prefix="segctl-adapter-") as d:
        st = stores_cls(Path(d) / "stores")
        st.put_adapter("sw", "sw-t0", 1, adapters[0])       # the store and its groups made once
        cpu0, tic = time.process_time(), time.perf_counter()
        for i, files in enumerate(adapters):
            st.put_adapter("sw", f"sw-t{i + 1}", 1, files)
        put_cpu, put_wall = time.process_time() - cpu0, time.perf_counter() - tic
        cpu0, tic = time.process_time(), time.perf_counter()
        for i, files in enumerate(adapters):
            got = st.adapter_files(f"sw-t{i + 1}")
            assert got["adapters.safetensors"] == files["adapters.safetensors"]
        read_cpu, read_wall = time.process_time() - cpu0, time.perf_counter() - tic
        files_per = du(Path(d) / "stores" / "adapters.zarr" / "sw-t1")[1]
    return dict(bench="adapter", tensors=len(eng._tensors()), n=n,
                adapter_kb=round(len(adapters[0]["adapters.safetensors"]) / 1024, 1),
                put_cpu_s=round(put_cpu / n, 4), put_wall_s=round(put_wall / n, 4),
                read_cpu_s=round(read_cpu / n, 4), read_wall_s=round(read_wall / n, 4),
                files_per_adapter=files_per, demo_shape=DEMO_SHAPE == eng.shape,
                machine=f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
                time=time.strftime("%Y-%m-%dT%H:%M:%S"))


def run(a) -> dict:
    import ray

    from bench.simfleet import SimHead
    from segctl.orchestrator import fleet
    from segctl.orchestrator.actor import HEAD_NAME, NAMESPACE
    from segctl.orchestrator.state import read as read_state
    from segctl.orchestrator.submit import prepare
    from segctl.schemas.cluster import ClusterSpec, HeadSpec
    from segctl.schemas.records import TERMINAL, SweepState, TrialState

    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    d = Path(tempfile.mkdtemp(prefix="segctl-scale-", dir=a.dir))
    stores = d / "stores"
    sweeps = demo_sweeps(d, a.trials, a.steps_per_trial, a.eval_every, a.checkpoint_every)
    payloads = [prepare(s, {}) for s in sweeps]
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    spec = ClusterSpec(head=HeadSpec(port=port, stores=str(stores)), nodes=[])
    fleet.up(spec)
    try:
        fleet.connect(spec, start=False)
        head = ray.remote(SimHead).options(
            name=HEAD_NAME, namespace=NAMESPACE, num_cpus=0, max_concurrency=64,
            resources={"segctl_head": 0.001},
        ).remote(str(stores), {"nodes": a.nodes, "max_trials": a.max_trials, "hosts": a.hosts,
                               "step_s": a.step_s, "memory_gb": 8.0, "profile": a.profile})
        info = ray.get(head.ping.remote(), timeout=120)
        pid = info["pid"]
        while len(ray.get(head.ping.remote())["nodes"]) < a.nodes:
            time.sleep(0.2)
        cpu0, tic = proc_cpu(pid), time.time()
        sids = [ray.get(head.submit.remote(p), timeout=600) for p in payloads]
        submit_s = time.time() - tic
        db = read_state(stores / "state.db")
        last, private, looked = 0.0, 0.0, 0.0
        while True:
            if time.time() - looked > 5:   # reading it walks the head's pages: ~40 ms at 3 GB
                private, looked = max(private, proc_private_mb(pid)), time.time()
            states = [db.sweep(sid)["state"] for sid in sids]
            if all(s != SweepState.RUNNING for s in states):
                break
            if time.time() - last > 10:
                done = sum(db.count_trials(sid, TERMINAL) for sid in sids)
                print(f"[{time.time() - tic:6.0f} s] {done}/{a.trials} trials finished, head "
                      f"{(proc_cpu(pid) - cpu0) / (time.time() - tic):.2f} cores", file=sys.stderr,
                      flush=True)
                last = time.time()
            if time.time() - tic > a.timeout:
                raise TimeoutError(f"not done after {a.timeout} s")
            time.sleep(0.5)
        wall = time.time() - tic
        cpu = proc_cpu(pid) - cpu0
        hwm = proc_hwm_mb(pid)   # DONE comes after every seal and adapter is in place
        if a.profile:
            Path(a.profile).write_text(json.dumps(ray.get(head.profile.remote(60)), indent=1))
    finally:
        ray.shutdown()
        fleet.down(spec)

    env = {**os.environ, "SEGCTL_HOME": str(stores)}
    env.pop("SEGCTL_CLUSTER", None)
    timings = {}
    timings["status_s"], p = cli("status", env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    timings["status_json_s"], p = cli("status", "--json", env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    status = json.loads(p.stdout)
    trials = [t for sw in status for t in sw["trials"]]
    attempts = [x for t in trials for x in t["attempts"]]
    ok = sum(t["state"] == TrialState.SUCCEEDED for t in trials)
    one = trials[len(trials) // 2]["trial"]
    timings["logs_s"], p = cli("logs", one, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    log_lines = len(p.stdout.splitlines())
    timings["gather_best10_s"], p = cli("gather", sids[0], "--out", d / "best10", "--best", 10,
                                        env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    timings["gather_s"], p = cli("gather", sids[0], "--out", d / "all", env=env)
    assert p.returncode == 0, p.stderr[-2000:]

    import pyarrow.dataset as ds
    step_rows = ds.dataset(stores / "telemetry" / "steps", format="parquet",
                           partitioning="hive").count_rows()
    events = ds.dataset(stores / "telemetry" / "events", format="parquet",
                        partitioning="hive").count_rows()
    disp = [x["dispatch_s"] for x in attempts if x["dispatch_s"] is not None]
    slots = a.nodes * a.max_trials
    ideal = a.trials * a.steps_per_trial * a.step_s / slots
    size = lambda p: sum(du(q)[0] for q in [p] if q.exists()) if p.is_dir() else \
        sum(q.stat().st_size for q in p.parent.glob(p.name + "*"))
    tele_bytes, tele_files = du(stores / "telemetry")
    row = dict(
        bench="scale", stores_layout="packed", nodes=a.nodes, max_trials=a.max_trials, trials=a.trials,
        sweeps=len(sids), steps_per_trial=a.steps_per_trial, step_s=a.step_s,
        eval_every=a.eval_every, checkpoint_every=a.checkpoint_every, sim_hosts=a.hosts,
        succeeded=ok, attempts=len(attempts), wall_s=round(wall, 1), submit_s=round(submit_s, 2),
        ideal_s=round(ideal, 1), makespan_ratio=round(wall / ideal, 3),
        head_cpu_s=round(cpu, 1), head_cpu_cores=round(cpu / wall, 3),
        dispatch_p50_s=round(statistics.median(disp), 4), dispatch_p99_s=round(pct(disp, 0.99), 4),
        dispatch_max_s=round(max(disp), 4),
        step_rows=step_rows, events=events, ingest_rows_per_s=round(events / wall),
        step_rows_per_s=round(step_rows / wall), offered_step_rows_per_s=round(slots / a.step_s),
        head_rss_max_mb=round(hwm),
        head_private_max_mb=round(private),
        state_db_mb=round(size(stores / "state.db") / 1e6, 2),
        staging_db_mb=round(size(stores / "staging.db") / 1e6, 2),
        staging_wal_mb=round(size(stores / "staging.db-wal") / 1e6, 2),
        telemetry_mb=round(tele_bytes / 1e6, 2), telemetry_files=tele_files,
        adapters_zarr_mb=round(du(stores / "adapters.zarr")[0] / 1e6, 2),
        adapters_zarr_files=du(stores / "adapters.zarr")[1],
        **{k: round(v, 3) for k, v in timings.items()}, logs_lines=log_lines,
        targets={"head_cpu_cores": 1.0, "dispatch_p99_s": 1.0, "cli_s": 1.0},
        machine=f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
        load_before=a.load_before, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if not a.keep:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
    else:
        row["stores"] = str(stores)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--steps-per-trial", type=int, default=200)
    ap.add_argument("--step-s", type=float, default=0.01, help="seconds per simulated step")
    ap.add_argument("--max-trials", type=int, default=1, help="attempts a node runs at once")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--hosts", type=int, default=4, help="Ray actors the simulated agents live in")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--dir", default=None, help="where the throw-away stores go (default: tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the stores; the row says where")
    ap.add_argument("--profile", default=None, help="sample the head's threads; write the "
                    "top frames to this JSON file")
    ap.add_argument("--out", type=Path, default=None, help="append the row to this JSONL file")
    ap.add_argument("--adapter-only", action="store_true", help="only time filing one "
                    "adapter (put_adapter, adapter_files) and print that row")
    a = ap.parse_args()
    a.load_before = round(os.getloadavg()[0], 2)
    row = {**adapter_cost(), "load_before": a.load_before} if a.adapter_only else run(a)
    print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
