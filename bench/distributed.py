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

    python -m bench.distributed --lab [--ranks 2,4] [--with-loopback] > rows.jsonl

measures the allreduce rows between hosts of a lab (segctl.lab: network
namespaces of this machine joined by a bridge, 198.18.0.11, .12, ...): one rank
per host, each listening on its host's address, so the ring's bytes cross a veth
pair and the bridge (kernel TCP between namespaces, not a wire). The lab has as
many hosts as the largest ring, is brought up for the run and always taken down
after it (an error, Ctrl-C or SIGTERM too); a lab already up on the machine is
left alone and the run skipped (exit 3). --with-loopback measures each ring over
loopback too, right after the lab's, for a ratio on a shared, noisy machine.

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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from segctl.lab import Host, Lab

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
# --lab's own folder (its hosts' homes, logs and lab.json), not the default lab's,
# whose last hosts' folders (kept for post-mortems) an `up` there would replace
LAB_ROOT = Path("/var/lib/segctl-lab-bench")


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


def ring_hosts(addresses: list[str], ports: list[int]) -> list[list[str]]:
    """An MLX ring's host file: rank r listens on addresses[r]:ports[r]."""
    return [[f"{a}:{p}"] for a, p in zip(addresses, ports, strict=True)]


def lab_rank_argvs(hosts: list[Host], argv_of: Callable[[int], list[str]], hostfile: str) -> list[list[str]]:
    """argv_of(r) run in hosts[r] (its network, filesystem view and processes), as
    rank r of a ring whose host file is at `hostfile` as the hosts see it."""
    from segctl import lab
    env = {"PYTHONPATH": str(ROOT), "MLX_HOSTFILE": hostfile}
    return [lab.inside(h, argv_of(r), {**env, "MLX_RANK": str(r)}) for r, h in enumerate(hosts)]


def _ring(argv_of: Callable[[int], list[str]], n: int, folder: Path, timeout: float = 600,
          lab: Lab | None = None) -> list[subprocess.CompletedProcess]:
    """argv_of(rank) run as the n ranks of one ring, all at once: processes of this
    machine over loopback, or (`lab`) one in each of the lab's first n hosts, over
    their addresses. A rank that fails ends the run (the others are killed)."""
    name = f"hosts-{n}.json"
    ports = free_ports(n)   # a lab host's namespace is fresh: these are free there too
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if lab is None:
        hostfile = folder / name
        hostfile.write_text(json.dumps(ring_hosts(["127.0.0.1"] * n, ports)))
        argvs = [argv_of(r) for r in range(n)]
        env["MLX_HOSTFILE"] = str(hostfile)
    else:
        hosts = lab.hosts[:n]
        text = json.dumps(ring_hosts([h.address for h in hosts], ports))
        for h in hosts:   # ROOT/hI/tmp: the host's own /tmp
            (h.home.parent / "tmp" / name).write_text(text)
        argvs = lab_rank_argvs(hosts, argv_of, f"/tmp/{name}")
    procs = [subprocess.Popen(argv, env={**env, "MLX_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, argv in enumerate(argvs)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            if p.returncode:
                sys.exit(f"bench.distributed: a rank failed: {stderr.strip().splitlines()[-1:]}")
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
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


def allreduce_row(name: str, n: int, lab: Lab | None, folder: Path) -> dict:
    """One allreduce row: a ring of n ranks all_sum-ing model `name`'s gradient,
    over loopback or between the hosts of `lab`."""
    floats = lora_floats(name)
    [first, *_] = _ring(lambda r: [sys.executable, "-m", "bench.distributed", "--rank-allreduce",
                                   str(floats)], n, folder, lab=lab)
    s = json.loads(first.stdout.strip().splitlines()[-1])["seconds"]
    nbytes = 4 * floats
    out = dict(bench="allreduce", model=name, ranks=n, floats=floats, bytes=nbytes,
               seconds=round(s, 5), bus_gbps=round(2 * (n - 1) / n * nbytes / s / 1e9, 3))
    if lab is None:
        out.update(link="loopback", where="loopback")
    else:
        out.update(link="veth", where="lab", hosts=[h.address for h in lab.hosts[:n]])
    if n > (os.cpu_count() or 1):
        out["note"] = f"{n} ranks on {os.cpu_count()} cores: measures the CPU, not the link"
    return out


def bench_allreduce(ranks: list[int], folder: Path, lab: Lab | None = None,
                    with_loopback: bool = False) -> None:
    """The allreduce rows: over loopback, or between the hosts of `lab` (then,
    with_loopback, each ring over loopback too, right after the lab's)."""
    for name in SHAPES:
        for n in ranks:
            if n == 1:
                continue
            row(**allreduce_row(name, n, lab, folder))
            if lab is not None and with_loopback:
                row(**allreduce_row(name, n, None, folder))


class LabBusy(Exception):
    """A lab is already up on this machine: not ours to take down."""


def lab_busy(root: Path) -> str | None:
    """Why a lab cannot be brought up for the bench now: one is up (recorded at the
    default root or at `root`, with its namespaces or processes still there)."""
    from segctl import lab
    for where in dict.fromkeys([lab.LAB_ROOT, root]):
        there = lab.load(where)
        if there and any((lab.NETNS_DIR / h.netns).exists() or lab.pids(h) for h in there.hosts):
            return f"a lab of {len(there.hosts)} hosts is up at {where}"
    return None


def bench_lab(ranks: list[int], folder: Path, root: Path, with_loopback: bool) -> None:
    """The allreduce rows between lab hosts: a lab of max(ranks) hosts brought up
    at `root`, measured, and taken down whatever happens (SIGTERM too)."""
    from segctl import lab
    busy = lab_busy(root)
    if busy:
        raise LabBusy(busy)
    reason = lab.why_not()
    if reason:
        sys.exit(f"bench.distributed: no lab here: {reason}")

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        try:
            made = lab.up(max(ranks), root)   # rolls itself back if it fails half-way
        except lab.LabError as e:
            if "already" in str(e):           # another lab (another root) holds the machine
                raise LabBusy(str(e)) from None
            raise
        try:
            print(f"bench.distributed: lab of {len(made.hosts)} hosts up at {made.root}",
                  file=sys.stderr, flush=True)
            bench_allreduce(ranks, folder, made, with_loopback)
        finally:
            lab.down(made.root)
            print("bench.distributed: lab down", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    ap.add_argument("--lab", action="store_true",
                    help="the allreduce rows between the hosts of a lab (one rank per host) only")
    ap.add_argument("--with-loopback", action="store_true",
                    help="with --lab: each ring over loopback too, right after the lab's")
    ap.add_argument("--lab-root", type=Path, default=LAB_ROOT,
                    help=f"with --lab: the lab's folder (default {LAB_ROOT})")
    a = ap.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",")]
    if a.lab:
        if max(ranks) < 2:
            ap.error("--lab needs a ring of 2 ranks or more")
        with tempfile.TemporaryDirectory() as d:
            try:
                bench_lab(ranks, Path(d), a.lab_root, a.with_loopback)
            except LabBusy as e:
                print(f"bench.distributed: skipped: {e}; left as it is", file=sys.stderr)
                sys.exit(3)
            except KeyboardInterrupt:   # Ctrl-C or SIGTERM: the lab is down by now
                sys.exit("bench.distributed: interrupted")
        return
    with tempfile.TemporaryDirectory() as d:
        bench_allreduce(ranks, Path(d))
        bench_step(ranks, a.iters, Path(d))
    for r in scaling_rows():
        row(**r)


if __name__ == "__main__":
    main()
