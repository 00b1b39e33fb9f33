"""Data parallel benchmark: what a job on several ranks pays for its ring.

    python -m bench.distributed [--ranks 1,2,4] [--iters 6] > rows.jsonl
    python -m bench.distributed table rows.jsonl

Rows, each measured on this machine, every rank a process of one MLX ring over
loopback TCP (the ring a lab of Macs forms over its network, without the wire):
- allreduce: the step's one all_sum of a LoRA gradient of a real model's size
  (rank 8 on every linear of every layer: the demo model, Qwen3-0.6B, Llama-3.1-8B),
  fp32 as the engine sends it; the median of 5 after 2 untimed, seconds and the
  bus bandwidth a ring reaches, 2 (N - 1) / N x bytes / seconds;
- step: `segctl train` of the demo job (batch 4) on N ranks: the median step's
  seconds and its all_sum's seconds and bytes (rank 0's step events), the share
  of the step the all_sum took;
- scaling: the model below for an 8B 4-bit LoRA job on 2, 4 and 8 Macs.

The model: a ring all-reduce of S bytes over N ranks sends 2 (N - 1) / N x S
bytes per rank over its link, in 2 (N - 1) messages:

    t_allreduce = 2 (N - 1) / N x S / B + 2 (N - 1) x a

B the link's bandwidth (10 GbE 1.25 GB/s; Thunderbolt 4 40 Gb/s = 5 GB/s;
Thunderbolt 5 80 Gb/s = 10 GB/s, published rates, before TCP's overhead) and a a
hop's latency (0.1 ms assumed for a LAN or Thunderbolt bridge). A rank's step at
row length L is a single machine's step of one row (each rank one row of the
batch): the H200's measured 8B 4-bit step (bench/results/h200-long.jsonl, 8,192
and 32,768 tokens; 4,096 from 8,192 by halving, as the step is near linear in L
there). A Mac's step is several times longer, so the all-reduce's share of it
is smaller than the table says: the table is an upper bound.
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

ROOT = Path(__file__).resolve().parent.parent

# LoRA rank 8 on q, k, v, o, gate, up, down of every layer: the parameters (and so
# fp32 gradient floats) of each model's adapter, from its shape.
SHAPES = {   # layers, hidden, q out, k/v out, intermediate
    "demo": (4, 128, 128, 64, 384),      # `segctl init-demo`s qwen3
    "qwen3-0.6b": (28, 1024, 2048, 1024, 3072),
    "llama-3.1-8b": (32, 4096, 4096, 1024, 14336),
}
RANK = 8
LINKS = {"10GbE": 1.25e9, "Thunderbolt 4": 5e9, "Thunderbolt 5": 10e9}
HOP_S = 1e-4
H200_8B_STEP_S = {8192: 4.6341, 32768: 23.1998}   # bench/results/h200-long.jsonl, segctl, in memory


def lora_floats(name: str) -> int:
    layers, hidden, q, kv, inter = SHAPES[name]
    per_layer = sum(RANK * (i + o) for i, o in (
        (hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
        (hidden, inter), (hidden, inter), (inter, hidden)))
    return layers * per_layer


def allreduce_s(nbytes: float, ranks: int, bandwidth: float, hop_s: float = HOP_S) -> float:
    """The model's all-reduce time (above)."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * hop_s


def row(**kw) -> None:
    kw.update(machine=f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
              time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(json.dumps(kw), flush=True)


def free_ports(n: int) -> list[int]:
    """n ports free on loopback now, for a ring's host file."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _ring(argv_of, n: int, folder: Path, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """argv_of(rank) run as the n ranks of one ring over loopback, all at once."""
    hostfile = folder / f"hosts-{n}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(argv_of(r), env={**env, "MLX_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        if p.returncode:
            sys.exit(f"bench.distributed: a rank failed: {stderr.strip().splitlines()[-1:]}")
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def rank_allreduce(floats: int) -> None:
    """One rank of the all_sum measurement: prints rank 0's seconds."""
    import mlx.core as mx
    group = mx.distributed.init(strict=True, backend="ring")
    x = mx.random.normal((floats,), dtype=mx.float32)
    mx.eval(x)
    times = []
    for i in range(7):
        tic = time.perf_counter()
        y = mx.distributed.all_sum(x, group=group)
        mx.eval(y)
        if i >= 2:
            times.append(time.perf_counter() - tic)
    if group.rank() == 0:
        print(json.dumps({"seconds": statistics.median(times)}))


def bench_allreduce(ranks: list[int], folder: Path) -> None:
    for name in SHAPES:
        floats = lora_floats(name)
        for n in ranks:
            if n == 1:
                continue
            [first, *_] = _ring(lambda r: [sys.executable, "-m", "bench.distributed", "--rank-allreduce",
                                           str(floats)], n, folder)
            s = json.loads(first.stdout.strip().splitlines()[-1])["seconds"]
            nbytes = 4 * floats
            row(bench="allreduce", model=name, ranks=n, floats=floats, bytes=nbytes,
                seconds=round(s, 5), bus_gbps=round(2 * (n - 1) / n * nbytes / s / 1e9, 3),
                link="loopback")


def bench_step(ranks: list[int], iters: int, folder: Path) -> None:
    import yaml
    demo = folder / "demo"
    subprocess.run([sys.executable, "-m", "segctl.orchestrator.cli", "init-demo", str(demo)],
                   check=True, capture_output=True, cwd=ROOT)
    for n in ranks:
        base = yaml.safe_load((demo / "job.yaml").read_text())
        jobs = []
        for r in range(n):
            job = dict(base, model=str(demo / "model"), output=str(folder / f"out-{n}-{r}"),
                       distributed={"nodes": n})
            job["data"] = dict(base["data"], train=str(demo / "data" / "train.jsonl"), valid=None)
            job["train"] = {k: v for k, v in base["train"].items()
                            if k not in ("eval_every", "checkpoint_every", "val_batches")}
            job["train"].update(iters=iters, batch_size=4, warmup=0)
            path = folder / f"job-{n}-{r}.yaml"
            path.write_text(yaml.safe_dump(job))
            jobs.append(path)
        argv = lambda r: [sys.executable, "-m", "segctl.orchestrator.cli", "train", str(jobs[r]), "--json"]
        if n == 1:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            done = [subprocess.run(argv(0), capture_output=True, text=True, cwd=ROOT, env=env, check=True)]
        else:
            done = _ring(argv, n, folder)
        steps = [json.loads(line) for line in done[0].stdout.splitlines() if '"step"' in line]
        steps = [e for e in steps if e.get("event") == "step"][1:]   # the first builds everything
        step_s = statistics.median(e["seconds"] for e in steps)
        ar = statistics.median(e.get("allreduce_s") or 0.0 for e in steps)
        row(bench="step", model="demo", ranks=n, rows=4, steps=len(steps), step_s=round(step_s, 4),
            allreduce_s=round(ar, 5), allreduce_bytes=steps[-1].get("allreduce_bytes") or 0,
            allreduce_share=round(ar / step_s, 4), tokens_per_s=round(statistics.median(
                e["tokens_per_s"] for e in steps), 1), link="loopback")


def scaling_rows() -> list[dict]:
    nbytes = 4 * lora_floats("llama-3.1-8b")
    steps = {4096: H200_8B_STEP_S[8192] / 2, **H200_8B_STEP_S}
    out = []
    for link, bandwidth in LINKS.items():
        for n in (2, 4, 8):
            for length, step_s in sorted(steps.items()):
                t = allreduce_s(nbytes, n, bandwidth)
                out.append(dict(bench="scaling", model="llama-3.1-8b 4-bit", link=link, ranks=n,
                                row_tokens=length, step_s=round(step_s, 3), bytes=nbytes,
                                allreduce_s=round(t, 4), allreduce_share=round(t / (step_s + t), 4),
                                speedup=round(n * step_s / (step_s + t), 2)))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| link | ranks | row tokens | rank's step (s) | all-reduce (s) | share | speed-up |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("bench") == "scaling":
            lines.append(f"| {r['link']} | {r['ranks']} | {r['row_tokens']:,} | {r['step_s']:.2f} | "
                         f"{r['allreduce_s']:.3f} | {100 * r['allreduce_share']:.1f}% | "
                         f"{r['speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-allreduce"]:
        return rank_allreduce(int(argv[1]))
    if argv[:1] == ["table"]:
        from bench.jsonl import read_rows
        print(table(read_rows(argv[1], "bench.distributed", lambda r: None)))
        return
    ap = argparse.ArgumentParser(prog="python -m bench.distributed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4", help="ring sizes to measure (default 1,2,4)")
    ap.add_argument("--iters", type=int, default=6, help="steps of the demo job per ring size")
    a = ap.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",")]
    with tempfile.TemporaryDirectory() as d:
        bench_allreduce(ranks, Path(d))
        bench_step(ranks, a.iters, Path(d))
    for r in scaling_rows():
        row(**r)


if __name__ == "__main__":
    main()
