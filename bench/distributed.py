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
  of the step the all_sum took (1 rank: one plain process, no ring);
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

    python -m bench.distributed --steps [--lab] [--ranks 1,2,4] [--shapes demo,qwen3-0.6b]
        [--iters 4] [--batch 4] [--row-tokens 128] [--dtype float32] > rows.jsonl

measures the step rows only (over loopback, or with --lab one rank per lab host,
the lab's lifecycle as above; 1 rank: one process, on the machine or in host
h1, no ring), of a
model of each shape: `demo` the model `segctl init-demo` writes, `qwen3-0.6b` a
random model of Qwen3-0.6B's layers, widths and heads (28 x 1024, 16 query and
8 K/V heads of 128, intermediate 3072; a 32,000-word vocabulary: the ring only
sees the adapter) in Hugging Face layout (bench.planner_fit's writer, in
--dtype). The job is the demo's (LoRA rank 8 on every linear of every layer),
--batch rows a step whatever the ring's size (so step times compare), the rows
the demo task's letters counting on, about --row-tokens tokens each (every rank
the same work). A row's compute_s is its step_s less its allreduce_s.

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
import random
import shutil
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
# The step rows' models beside `segctl init-demo`'s (SHAPES["demo"]): arch, layers,
# hidden, vocab and config.json's other sizes, for bench.planner_fit.write_bench_model
STEP_MODELS = {
    "qwen3-0.6b": ("qwen3", 28, 1024, 32000, {
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 3072, "rope_theta": 1e6, "max_position_embeddings": 40960}),
}
STEP_TIMEOUT_S = 1800   # a ring of steps, start-up to exit


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
    return dict(bench="allreduce", model=name, ranks=n, floats=floats, bytes=nbytes,
                seconds=round(s, 5), bus_gbps=round(2 * (n - 1) / n * nbytes / s / 1e9, 3),
                **ring_fields(n, lab))


def ring_fields(n: int, lab: Lab | None) -> dict:
    """Where a row's n ranks ran: over loopback, or one in each of the lab's first
    n hosts (their addresses); the link between them ("none" for one rank), and
    the CPU note where n ranks outnumber the cores."""
    out: dict = ({"where": "loopback", "link": "loopback"} if lab is None else
                 {"where": "lab", "link": "veth", "hosts": [h.address for h in lab.hosts[:n]]})
    if n == 1:
        out["link"] = "none"
    note = cpu_note(n)
    return dict(out, note=note) if note else out


def cpu_note(n: int, cores: int | None = None) -> str | None:
    """What a row of n ranks on this machine's cores measures, when not the link."""
    cores = cores or os.cpu_count() or 1
    return f"{n} ranks on {cores} cores: measures the CPU, not the link" if n > cores else None


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


def bench_lab(ranks: list[int], folder: Path, root: Path, with_loopback: bool = False,
              work: Callable[[Lab], None] | None = None) -> None:
    """Rows between lab hosts: a lab of max(ranks) hosts brought up at `root`,
    measured by `work(lab)` (default: the allreduce rows), and taken down whatever
    happens (SIGTERM too)."""
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
            if work is None:
                bench_allreduce(ranks, folder, made, with_loopback)
            else:
                work(made)
        finally:
            lab.down(made.root)
            print("bench.distributed: lab down", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


def step_data(n: int, tokens: int, seed: int = 0) -> list[dict]:
    """n rows of the demo's task ("after q" -> "r s t ..."), the letters counting on
    past "z" from "j" (the demo's letters, one token each in its tokenizers) so
    that every row runs about `tokens` tokens (the chat template and prompt are 12
    to 22 more: 16 counted)."""
    from segctl.engine.demo import START_LETTERS
    rng = random.Random(seed)
    letters = START_LETTERS + "z"
    words = max(1, tokens - 16)
    out = []
    for _ in range(n):
        start = rng.randrange(len(START_LETTERS))
        out.append({"prompt": f"after {letters[start]}", "completion": " ".join(
            letters[(start + 1 + i) % len(letters)] for i in range(words))})
    return out


def step_jobs(base: dict, where: str, n: int, *, iters: int, batch: int) -> list[dict]:
    """The job of each of n ranks: the demo job `base` with its model, data and
    output under `where` (the folder as the ranks see it), `batch` rows a step
    (the whole ring's), `iters` steps, no evals or checkpoints."""
    jobs = []
    for r in range(n):
        job = dict(base, model=f"{where}/model", output=f"{where}/out-{n}-{r}",
                   distributed={"nodes": n, "timeout_s": float(STEP_TIMEOUT_S)})
        job["data"] = dict(base["data"], train=f"{where}/data/train.jsonl", valid=None)
        job["train"] = {k: v for k, v in base["train"].items()
                        if k not in ("eval_every", "checkpoint_every", "val_batches")}
        job["train"].update(iters=iters, batch_size=batch, warmup=0)
        jobs.append(job)
    return jobs


def step_row(stdout: str) -> dict:
    """A step row's numbers from rank 0's `segctl train --json` output: the medians
    of its steps but the first (which builds everything)."""
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    steps = [e for e in events if e.get("event") == "step"][1:]
    if not steps:
        raise ValueError("no step events past the first")
    step_s = statistics.median(e["seconds"] for e in steps)
    ar = statistics.median(e.get("allreduce_s") or 0.0 for e in steps)
    return dict(rows=steps[-1]["rows"], steps=len(steps),
                row_tokens=round(statistics.median((e.get("seq_tokens") or 0)
                                                   / (e.get("rank_rows") or e["rows"]) for e in steps), 1),
                step_s=round(step_s, 4), compute_s=round(step_s - ar, 4), allreduce_s=round(ar, 5),
                allreduce_bytes=steps[-1].get("allreduce_bytes") or 0,
                allreduce_share=round(ar / step_s, 4),
                tokens_per_s=round(statistics.median(e["tokens_per_s"] for e in steps), 1))


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)   # one copy on the disk for every host
    except OSError:
        shutil.copy2(src, dst)


def step_folder(shape: str, folder: Path, demo: Path, row_tokens: int | None, dtype: str) -> Path:
    """folder/step-SHAPE: the model of `shape` and data/train.jsonl (the demo's own
    rows, or rows of about row_tokens tokens)."""
    src = folder / f"step-{shape}"
    (src / "data").mkdir(parents=True)
    if shape == "demo":
        shutil.copytree(demo / "model", src / "model", copy_function=_link)
    else:
        from bench.planner_fit import write_bench_model
        arch, layers, hidden, vocab, config = STEP_MODELS[shape]
        write_bench_model(src / "model", arch, layers, hidden, vocab, dtype, config)
    train = src / "data" / "train.jsonl"
    if row_tokens is None:
        shutil.copy2(demo / "data" / "train.jsonl", train)
    else:
        train.write_text("".join(json.dumps(r) + "\n" for r in step_data(64, row_tokens)))
    return src


def bench_step(ranks: list[int], iters: int, folder: Path, shapes: list[str] | None = None,
               lab: Lab | None = None, batch: int = 4, row_tokens: int | None = None,
               dtype: str = "float32") -> None:
    """The step rows: `segctl train` of the demo job on a model of each shape, on
    each ring size over loopback, or (`lab`) one rank in each of the lab's first n
    hosts, their files in each host's own /tmp (1 rank: one process, no ring)."""
    import yaml
    demo = folder / "demo"
    subprocess.run([sys.executable, "-m", "segctl.orchestrator.cli", "init-demo", str(demo)],
                   check=True, capture_output=True, cwd=ROOT)
    base = yaml.safe_load((demo / "job.yaml").read_text())
    for shape in shapes or ["demo"]:
        src = step_folder(shape, folder, demo, row_tokens, dtype)
        where = f"/tmp/{src.name}" if lab is not None else str(src)
        for n in ranks:
            for r, job in enumerate(step_jobs(base, where, n, iters=iters, batch=batch)):
                (src / f"job-{n}-{r}.yaml").write_text(yaml.safe_dump(job))
        hosts = lab.hosts[:max(ranks)] if lab is not None else []
        placed = [h.home.parent / "tmp" / src.name for h in hosts]   # as this machine sees them
        try:
            for path in placed:
                shutil.copytree(src, path, copy_function=_link)
            for n in ranks:
                def argv(r: int, n: int = n) -> list[str]:
                    return [sys.executable, "-m", "segctl.orchestrator.cli", "train",
                            f"{where}/job-{n}-{r}.yaml", "--json"]
                [first, *_] = _ring(argv, n, folder, timeout=STEP_TIMEOUT_S, lab=lab)
                row(bench="step", model=shape, ranks=n,
                    dtype="float32" if shape == "demo" else dtype, **step_row(first.stdout),
                    **ring_fields(n, lab))
        finally:
            for path in placed:
                shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)


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
    ap.add_argument("--iters", type=int, default=6,
                    help="steps of the demo job per ring size (the first is not counted)")
    ap.add_argument("--lab", action="store_true",
                    help="between the hosts of a lab (one rank per host): the allreduce rows only, "
                         "or with --steps the step rows only")
    ap.add_argument("--with-loopback", action="store_true",
                    help="with --lab: each allreduce ring over loopback too, right after the lab's")
    ap.add_argument("--lab-root", type=Path, default=LAB_ROOT,
                    help=f"with --lab: the lab's folder (default {LAB_ROOT})")
    ap.add_argument("--steps", action="store_true",
                    help="the step rows only (over loopback, or with --lab between lab hosts)")
    ap.add_argument("--shapes", default=None,
                    help=f"the step rows' models, of {', '.join(['demo', *STEP_MODELS])} "
                         "(default: demo; with --steps: all)")
    ap.add_argument("--batch", type=int, default=4,
                    help="rows a step, the whole ring's (default 4)")
    ap.add_argument("--row-tokens", type=int, default=None,
                    help="rows of about this many tokens (default: the demo's own rows; "
                         "with --steps: 128)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights of the step rows' models other than demo (default float32: "
                         "MLX's CPU multiplies bfloat16 matrices without BLAS, ~27x slower here)")
    a = ap.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",")]
    shapes = (a.shapes.split(",") if a.shapes else ["demo", *STEP_MODELS] if a.steps else ["demo"])
    unknown = [s for s in shapes if s != "demo" and s not in STEP_MODELS]
    if unknown:
        ap.error(f"--shapes: no shape {unknown[0]!r} (of {', '.join(['demo', *STEP_MODELS])})")
    if a.batch < max(ranks):
        ap.error(f"--batch {a.batch}: a ring of {max(ranks)} ranks needs {max(ranks)} rows a step")
    if a.iters < 2:
        ap.error("--iters: 2 or more (the first step is not counted)")
    if a.steps and a.with_loopback:
        ap.error("--with-loopback is for the allreduce rows, not --steps")
    row_tokens = a.row_tokens if a.row_tokens is not None else 128 if a.steps else None

    def steps(folder: Path, lab: Lab | None = None) -> None:
        bench_step(ranks, a.iters, folder, shapes, lab=lab, batch=a.batch, row_tokens=row_tokens,
                   dtype=a.dtype)

    if a.lab:
        if not a.steps and max(ranks) < 2:
            ap.error("--lab needs a ring of 2 ranks or more")
        with tempfile.TemporaryDirectory() as d:
            try:
                bench_lab(ranks, Path(d), a.lab_root, a.with_loopback,
                          work=(lambda made: steps(Path(d), made)) if a.steps else None)
            except LabBusy as e:
                print(f"bench.distributed: skipped: {e}; left as it is", file=sys.stderr)
                sys.exit(3)
            except KeyboardInterrupt:   # Ctrl-C or SIGTERM: the lab is down by now
                sys.exit("bench.distributed: interrupted")
        return
    with tempfile.TemporaryDirectory() as d:
        if not a.steps:
            bench_allreduce(ranks, Path(d))
        steps(Path(d))
    if not a.steps:
        for r in scaling_rows():
            row(**r)


if __name__ == "__main__":
    main()
