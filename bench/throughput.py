"""Training throughput on an SFT-like length mix: mlx-lm's trainer against segctl's
engine, batched, packed and unpacked, side by side in one run.

    python -m bench.throughput > bench/results/cpu-throughput.jsonl   # ~17 min on 2 cores
    python -m bench.throughput --shape qwen3-0.6b --rows 128 > ROWS.jsonl    # a GPU
    python -m bench.throughput table bench/results/cpu-throughput.jsonl

The model is mlx-lm's own qwen3 at --layers x --dim (default 8 x 512, vocab
32000, fp32; bench.engine.bench_model: intermediate 3 x dim, dim/64 heads of 64,
dim/128 K/V heads, tied embeddings) with random weights (seed 0 in every
process, so every configuration starts from the same weights), LoRA rank 8 scale
20 on every linear of every layer. `--shape qwen3-0.6b` is Qwen3-0.6B's shape
(28 x 1024, intermediate 3072, 16 heads of 128 over 8 K/V heads, vocab 151936,
tied, bf16).

The rows (the same for every configuration, built from --seed in each process):
--rows rows of random token ids whose lengths follow a log-normal of median
--median (300) tokens and sigma --sigma (0.6) of the log, clipped to [--min-len
32, --max-len 2048]: the lengths are its quantiles at (i + 0.5) / rows, shuffled
(a stratified sample, so a small --rows still has the mix's median and tail: at
32 rows a mean of 356 tokens, 90% under 630, the longest 1092; at 64, 1280).
Every row carries these figures as `lengths`. Each row's first half is its
prompt and the loss reads the second half (the tokens after the prompt, as
bench.engine's workload): `supervised_tokens`. tokens/s is supervised tokens
per second over the timed steps, which see every row once, in batches of B
(`--rows` must be a multiple of every batch size). --warmup steps (default 1)
run first, untimed, one row each (the first rows of the list), and `loss` is
the first warm-up step's: the same weights and the same row in every
configuration, so every row of a run shows the same loss up to float rounding.
`last_loss` is the last timed step's (mlx-lm's batches come in its own order).
With --passes N the timed steps run N times over the rows and tokens/s is the
median pass's (`pass_seconds` lists them all): a pass of 32 rows on a GPU takes
about a second (one step of batch 32), short enough for a moment's stall to move
one pass by much.
`peak_gb` is mx.get_peak_memory over the timed steps (reset after the warm-up);
`load_avg` the machine's 1-minute load before and after them (a shared machine
makes the figures noisy: compare rows of similar load).

Configurations (`--configs` picks some by name; default: all of these over
--batches 1,4,16 and --segment-sizes):
- `mlx-lm:bB` and `mlx-lm:bB:ckpt`: mlx-lm's `train` step by step: its
  iterate_batches (rows sorted by length, cut into batches of B, the batches in
  a seeded random order, each padded to 1 + the next multiple of 32 of its
  longest row), its default_loss, its mx.compile'd step (value_and_grad,
  optimizer update, with gradient accumulation 1), `mx.eval(state, ...)` and
  its clear-cache after every step (clear_cache_threshold 0); `:ckpt` adds its
  class-level grad_checkpoint (so one configuration per process: the parent
  runs each in a child `--one CONFIG`). iterate_batches gives each row
  lengths [offset, len(row)], and default_loss's mask keeps targets at token
  positions offset..length inclusive: one past the row's last token, the
  padding 0 after it (iterate_batches always pads at least one column). We pass
  [prompt_len, len(row) - 1] so that it reads exactly segctl's tokens.
  `pad_efficiency`: real tokens / (batch x padded length), over the timed steps.
  mx.compile traces each new padded shape once, inside the timed steps as in
  mlx-lm's first epoch (about 0.1 s a trace at 8 x 512 on the CPU). mlx-lm
  batch 16 peaks at ~22 GB on the default CPU run: on a smaller machine that
  row fails ("error") and the others run.
- `segctl:bB:packed:sS`, `segctl:bB:unpacked:sS`, `segctl:bB:side:sS` and
  `segctl:bB:auto:sS` (unpacked: one sequence per row, one after the other,
  what a job does with LoRA dropout on):
  the engine's loss_and_grads over B rows in list order, segment size S (0:
  plain autodiff), packed into sequences of at most --pack-length tokens (each
  row attending only to itself, positions restarting per row) or one sequence
  per row; auto packs iff `pack_refusal` finds the model packs exactly (what a
  job's `data.pack: auto` does), and on a GPU runs the rows side by side instead.
  `side`: the rows unpacked, side by side ([rows, longest] padded at their ends,
  longest first, cut where padding costs more than a pass, within --pack-length
  tokens; on a GPU lengths padded to a multiple of 32). `unpadded`: the same
  groups with their rows' tokens unpadded, only attention run as the padded
  batch (docs/engine.md, "Batches and packing"), where the model allows; auto
  does that too where it runs rows side by side. Then apply_grads (clip 1.0, the job default)
  and one mx.eval, mx.clear_cache before each step, as engine/train.py does;
  head_chunk, attn_block and mlp_chunk at the job defaults.
  `sequences_per_step`: the sequences a step ran (packing leaves no padding).
  `:fused` (e.g. `segctl:b32:side:s4:fused`): the segments run compiled where
  that is exact (docs/engine.md, "Fused segments"), as a job does on a GPU;
  `auto` fuses on a GPU too. Rows carry `fused`, and `phase_seconds`: the
  first timed pass's seconds by phase (fwd, head, bwd, update: the optimizer
  step and what follows the backward). `:kK` (e.g.
  `segctl:b32:unpadded:s2:fused:k14`): the top K layers are kept, not
  recomputed (docs/engine.md, "Kept layers"); rows carry `keep`. A fused
  step's optimizer update runs compiled too (engine/optim.apply_grads), as a
  job's does; `:eager-update` runs it op by op as before (rows carry
  `fused_update`), to weigh what that is worth. `:ptN` (e.g.
  `segctl:b32:unpadded:s2:fused:pt4096`): side-by-side rows are cut into
  groups weighing each further group as N tokens (plans.side_groups; default
  SIDE_PASS_TOKENS, as a job): larger N, fewer and wider passes; rows carry
  `pass_tokens`.

The optimizer is AdamW lr 1e-5 (engine/optim.make_optimizer) for both. Each
configuration prints one JSON row on stdout as it lands (a failing one prints
a row with "error"); at the end the parent prints a Markdown table on stderr:
tokens/s, peak GB and the ratio of tokens/s to mlx-lm batch 4 without
grad_checkpoint. `table FILE` prints it again from saved rows. Bad options exit
2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from segctl.schemas.defaults import DEFAULT_HEAD_CHUNK, SIDE_PASS_TOKENS

# Qwen3-0.6B's config.json shape (bench.suite's QWEN3_06B keeps bench_model's head_dim 64).
SHAPES = {
    "cpu": dict(arch="qwen3", layers=8, dim=512, vocab=32000, intermediate=None, heads=None,
                kv_heads=None, head_dim=None, dtype="float32", quantize=0),
    "qwen3-0.6b": dict(arch="qwen3", layers=28, dim=1024, vocab=151936, intermediate=3072,
                       heads=16, kv_heads=8, head_dim=128, dtype="bfloat16", quantize=0),
    # Llama-3.1-8B's shape (untied, GQA 32/8 heads of 128, rope theta 5e5), its base
    # weights quantized to 4 bits: QLoRA as a Mac user runs it (bench.suite's LLAMA_8B)
    "llama-8b-4bit": dict(arch="llama", layers=32, dim=4096, vocab=128256, intermediate=14336,
                          heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", quantize=4),
}
SHAPE_KEYS = ("arch", "layers", "dim", "vocab", "intermediate", "heads", "kv_heads", "head_dim",
              "dtype", "quantize")
UNTIED = {"llama": dict(tie=False, rope_theta=500000.0)}   # per arch, as bench.suite's LLAMA_8B
LR = 1e-5
GRAD_CLIP = 1.0
BUDGETS_GB = (16, 24)   # a 16 GB and a 24 GB Mac: the best configuration that fits each
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the rows

def length_mix(args) -> dict:
    return dict(dist="lognormal", median=args.median, sigma=args.sigma, min_len=args.min_len,
                max_len=args.max_len, seed=args.seed, rows=args.rows, loss_on="second half",
                sampling="stratified quantiles")


def make_rows(rows: int, median: float, sigma: float, min_len: int, max_len: int, seed: int,
              vocab: int) -> list[tuple[list[int], int]]:
    """(ids, prompt_len) per row. The lengths are the log-normal's quantiles at
    (i + 0.5) / rows (a stratified sample: the mix has the asked median and tail at
    any row count), rounded, clipped to [min_len, max_len] and shuffled; the ids
    random in [1, vocab); the first half of a row is its prompt. numpy's seeded
    generator: the same rows in every process."""
    import numpy as np
    z = [statistics.NormalDist().inv_cdf((i + 0.5) / rows) for i in range(rows)]
    lengths = [min(max_len, max(min_len, round(median * math.exp(sigma * x)))) for x in z]
    rng = np.random.default_rng(seed)
    out = []
    for n in rng.permutation(lengths).tolist():
        out.append((rng.integers(1, vocab, n).tolist(), n // 2))
    return out


def supervised(row) -> int:
    ids, prompt_len = row
    return len(ids) - max(prompt_len, 1)


def mix_stats(rows) -> dict:
    n = sorted(len(ids) for ids, _ in rows)
    q = lambda f: n[min(len(n) - 1, int(f * len(n)))]
    return dict(mean=round(statistics.mean(n), 1), p50=q(0.5), p90=q(0.9), longest=n[-1],
                tokens=sum(n), supervised=sum(supervised(r) for r in rows))


# ---------------------------------------------------------------- configurations

def parse_config(name: str) -> dict:
    """`mlx-lm:bB[:ckpt]` or
    `segctl:bB:packed|unpacked|side|unpadded|auto:sS[:fused][:kK][:ptN][:eager-update]` ->
    its dict; ValueError with the reason otherwise."""
    parts = name.split(":")
    bad = ValueError(f"bad configuration {name!r} (mlx-lm:bB[:ckpt] or "
                     "segctl:bB:packed|unpacked|side|unpadded|auto:sS[:fused][:kK][:ptN]"
                     "[:eager-update], e.g. "
                     "segctl:b4:packed:s0)")
    if len(parts) < 2 or not parts[1].startswith("b") or not parts[1][1:].isdigit() \
            or int(parts[1][1:]) < 1:
        raise bad
    batch = int(parts[1][1:])
    if parts[0] == "mlx-lm" and len(parts) in (2, 3):
        if len(parts) == 3 and parts[2] != "ckpt":
            raise bad
        return dict(name=name, impl="mlx-lm", batch=batch, grad_checkpoint=len(parts) == 3)
    options = parts[4:]
    keep = [o for o in options if o[:1] == "k" and o[1:].isdigit() and int(o[1:]) > 0]
    cut = [o for o in options if o[:2] == "pt" and o[2:].isdigit()]
    if parts[0] == "segctl" and len(parts) >= 4 and parts[2] in (
            "packed", "unpacked", "side", "unpadded", "auto") \
            and parts[3].startswith("s") and parts[3][1:].isdigit() \
            and len(options) == len(set(options)) \
            and all(o in ("fused", "eager-update") or o in keep or o in cut for o in options) \
            and len(keep) <= 1 and len(cut) <= 1 \
            and not (keep and parts[3] == "s0"):
        return dict(name=name, impl="segctl", batch=batch, pack=parts[2],
                    segment_size=int(parts[3][1:]), fused="fused" in options,
                    keep=int(keep[0][1:]) if keep else 0,
                    pass_tokens=int(cut[0][2:]) if cut else SIDE_PASS_TOKENS,
                    eager_update="eager-update" in options)
    raise bad


def default_configs(batches: list[int], segment_sizes: list[int]) -> list[str]:
    from segctl.engine.step import on_gpu
    names = []
    for b in batches:
        names += [f"mlx-lm:b{b}", f"mlx-lm:b{b}:ckpt"]
    for b in batches:
        for s in segment_sizes:
            names += [f"segctl:b{b}:unpacked:s{s}", f"segctl:b{b}:packed:s{s}"]
            names += [f"segctl:b{b}:side:s{s}", f"segctl:b{b}:unpadded:s{s}"] if b > 1 else []
            # a GPU's job fuses its segments; a CPU's does not (the side rows compare)
            names += [f"segctl:b{b}:side:s{s}:fused", f"segctl:b{b}:unpadded:s{s}:fused"] \
                if b > 1 and s and on_gpu() else []
    names += [f"segctl:b{max(batches)}:auto:s{s}" for s in segment_sizes[:1]]
    return names


# ---------------------------------------------------------------- one configuration

def _fuses(cfg: dict) -> bool:
    """`:fused` asks for compiled segments; auto does what a job does (on a GPU, fused)."""
    from segctl.engine.step import on_gpu
    return cfg["impl"] == "segctl" and cfg["segment_size"] > 0 and (
        cfg["fused"] or (cfg["pack"] == "auto" and on_gpu()))


def run_one(cfg: dict, args) -> dict:
    import segctl  # noqa: F401 (first: it sizes MLX's CUDA attention caches before MLX loads)
    # isort: split
    import mlx.core as mx

    from bench.engine import _device_name, bench_model
    from segctl.engine.optim import make_optimizer

    if args.cpu:
        mx.set_default_device(mx.cpu)
    model = bench_model(args.arch, args.layers, args.dim, args.vocab, args.dtype, seed=0,
                        intermediate=args.intermediate, heads=args.heads,
                        kv_heads=args.kv_heads, head_dim=args.head_dim, quantize=args.quantize,
                        **UNTIED.get(args.arch, {}))
    rows = make_rows(args.rows, args.median, args.sigma, args.min_len, args.max_len, args.seed,
                     args.vocab)
    optimizer = make_optimizer(LR)
    B = cfg["batch"]
    warm = [rows[k % len(rows):k % len(rows) + 1] for k in range(args.warmup)]  # a row a step
    if cfg["impl"] == "mlx-lm":
        step, timed, extra = _mlx_lm(model, optimizer, rows, cfg, args)
    else:
        step, timed, extra = _segctl(model, optimizer, rows, cfg, args)

    losses = [step(b, warmup=True)[0] for b in warm]
    # every batch shape once, untimed: kernels built, compiles cached; fused, twice
    # (a job's stream shape runs compiled from the second time it comes)
    for _ in range((2 if _fuses(cfg) else 1) if args.warm_pass else 0):
        for b in timed:
            step(b, warmup=False, count=False)
    mx.clear_cache()
    mx.reset_peak_memory()
    load = os.getloadavg()[0]
    passes = []   # the seconds of each timed pass over the rows
    for k in range(args.passes):
        seen_rows = tokens = 0
        tic = time.perf_counter()
        for b in timed:
            # the extras (padding, sequences) count one pass: every pass runs the same steps
            loss, n_rows, n_tokens = step(b, warmup=False, count=k == 0)
            losses.append(loss)
            seen_rows += n_rows
            tokens += n_tokens
        passes.append(time.perf_counter() - tic)
    # the median pass: one slow pass (a neighbour's burst on a shared machine) moves it least
    seconds = statistics.median(passes)
    peak = mx.get_peak_memory() / 1e9
    margs = model.args
    row = dict(bench="throughput", config=cfg["name"], impl=cfg["impl"], batch=B,
               packed=None, pack=None, grad_checkpoint=cfg.get("grad_checkpoint", False),
               segment_size=cfg.get("segment_size"),
               rows_seen=seen_rows, steps=len(timed), warmup=args.warmup,
               warm_pass=args.warm_pass, passes=args.passes,
               pass_seconds=[round(t, 3) for t in passes],
               supervised_tokens=tokens, seconds=round(seconds, 3),
               tokens_per_s=round(tokens / seconds, 2), peak_gb=round(peak, 4),
               loss=round(losses[0], 6), last_loss=round(losses[-1], 6),
               load_avg=[round(load, 2), round(os.getloadavg()[0], 2)])
    row.update(extra())
    row.update(arch=args.arch, quantize=args.quantize, layers=args.layers, dim=args.dim, vocab=args.vocab,
               intermediate=margs.intermediate_size, heads=margs.num_attention_heads,
               kv_heads=margs.num_key_value_heads, head_dim=margs.head_dim,
               tie=margs.tie_word_embeddings, dtype=args.dtype, lora=dict(rank=8, scale=20.0),
               lr=LR, lengths=dict(length_mix(args), **mix_stats(rows)),
               device=str(mx.default_device()), device_name=_device_name(),
               mlx=_version("mlx"), mlx_lm=_version("mlx-lm"))
    return row


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _mlx_lm(model, optimizer, rows, cfg, args):
    """mlx-lm's `train`, one step at a time (mlx_lm/tuner/trainer.py, 0.32)."""
    from functools import partial

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.nn.utils import average_gradients
    from mlx.utils import tree_map
    from mlx_lm.tuner import trainer

    B = cfg["batch"]
    if cfg["grad_checkpoint"]:
        trainer.grad_checkpoint(model.layers[0])
    loss_value_and_grad = nn.value_and_grad(model, trainer.default_loss)
    grad_accum_steps = 1
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def compiled(batch, prev_grad, do_update):
        (lvalue, toks), grad = loss_value_and_grad(model, *batch)
        if prev_grad is not None:
            grad = tree_map(lambda x, y: x + y, grad, prev_grad)
        if do_update:
            grad = average_gradients(grad)
            if grad_accum_steps > 1:
                grad = tree_map(lambda x: x / grad_accum_steps, grad)
            optimizer.update(model, grad)
            grad = None
        return lvalue, toks, grad

    model.train()
    seen = dict(real=0, padded=0)

    def batches(subset, size=B):
        """iterate_batches' own batches of `subset`, lengths [offset, len - 1]."""
        return [(arr, lengths - mx.array([0, 1]))
                for arr, lengths in trainer.iterate_batches(list(subset), size, args.max_len,
                                                            seed=args.seed)]

    def step(batch, warmup, count=True):
        arr, lengths = batches(batch, 1)[0] if warmup else batch
        lvalue, toks, grad = compiled((arr, lengths), None, True)
        mx.eval(state, lvalue, toks, grad)
        if mx.get_cache_memory() > 0:   # clear_cache_threshold 0
            mx.clear_cache()
        if not warmup and count:
            seen["real"] += int(mx.sum(lengths[:, 1]).item()) + arr.shape[0]
            seen["padded"] += arr.size
        return lvalue.item(), arr.shape[0], int(toks.item())

    def extra():
        return dict(pad_efficiency=round(seen["real"] / seen["padded"], 4),
                    processed_tokens=seen["padded"])
    return step, batches(rows), extra


def _segctl(model, optimizer, rows, cfg, args):
    import mlx.core as mx

    from segctl.engine.data import Example
    from segctl.engine.model import model_parts
    from segctl.engine.optim import apply_grads
    from segctl.engine.settings import StepMemory
    from segctl.engine.step import loss_and_grads, on_gpu, pack_refusal, ragged_refusal, side_refusal, supervised_tokens
    from segctl.schemas.defaults import DEFAULT_ATTN_BLOCK, DEFAULT_MLP_CHUNK

    B = cfg["batch"]
    parts = model_parts(model, check=False)
    why = None
    side = cfg["pack"] in ("side", "unpadded")
    if cfg["pack"] == "auto":   # as a job's data.pack: auto (engine/train.packing)
        why = pack_refusal(parts)
        side = on_gpu() and side_refusal(parts) is None
        pack = why is None and not side
    else:
        pack = cfg["pack"] == "packed"
    unpadded = side and cfg["pack"] != "side" and ragged_refusal(parts) is None
    fused = _fuses(cfg)
    fused_update = fused and not cfg["eager_update"]
    seen: dict = dict(sequences=[], tokens=0, padded=0, phases={})

    def step(batch, warmup, count=True):
        examples = [Example(ids, prompt_len) for ids, prompt_len in batch]
        metrics: dict = {}
        marks = [("", time.perf_counter())]
        mx.clear_cache()
        loss, grads = loss_and_grads(model, examples, method="sft",
                                     memory=StepMemory(segment_size=cfg["segment_size"],
                                                       head_chunk=args.head_chunk,
                                                       attn_block=DEFAULT_ATTN_BLOCK,
                                                       mlp_chunk=DEFAULT_MLP_CHUNK,
                                                       fused=fused, keep=cfg["keep"]),
                                     pack=pack, side=side, ragged=unpadded,
                                     pack_length=args.pack_length, micro=0,
                                     pass_tokens=cfg["pass_tokens"],
                                     parts=parts, metrics=metrics,
                                     on_phase=lambda label: marks.append((label,
                                                                          time.perf_counter())))
        apply_grads(model, optimizer, grads, GRAD_CLIP, fused=fused_update)
        del grads
        mx.eval(model.state, optimizer.state, loss)   # (a compiled update makes a new state)
        marks.append(("update", time.perf_counter()))
        if not warmup and count:
            _phase_seconds(marks, seen["phases"])
            seen["sequences"].append(metrics.get("sequences"))
            seen["tokens"] += metrics.get("tokens") or 0
            seen["padded"] += metrics.get("padded") or 0
        return loss.item(), len(examples), supervised_tokens(examples)

    timed = [rows[i:i + B] for i in range(0, len(rows), B)]

    def extra():
        seqs = seen["sequences"]
        return dict(packed=pack, side=side, unpadded=unpadded, pack=cfg["pack"], pack_refusal=why,
                    fused=fused, fused_update=fused_update, keep=cfg["keep"],
                    pass_tokens=cfg["pass_tokens"],
                    phase_seconds={g: round(t, 3) for g, t in seen["phases"].items()},
                    pack_length=args.pack_length if pack or side else None,
                    pad_efficiency=round(seen["tokens"] / seen["padded"], 4) if side else None,
                    sequences_per_step=round(statistics.mean(seqs), 3) if None not in seqs else None,
                    processed_tokens=seen["tokens"], head_chunk=args.head_chunk,
                    attn_block=DEFAULT_ATTN_BLOCK, mlp_chunk=DEFAULT_MLP_CHUNK)
    return step, timed, extra


def _phase_seconds(marks: list[tuple[str, float]], into: dict) -> None:
    """Add a step's seconds to `into` by phase group (fwd, head, bwd, update): each
    phase is the time since the one before it. The engine reports a phase once
    its arrays are evaluated, so on a GPU this is the device's time too."""
    from segctl.orchestrator.measured import group_of
    for (_, start), (label, end) in zip(marks, marks[1:]):
        group = group_of(label)
        into[group] = into.get(group, 0.0) + end - start


# ---------------------------------------------------------------- the parent

def child_argv(args, name: str) -> list[str]:
    argv = ["--one", name, "--rows", str(args.rows), "--warmup", str(args.warmup),
            "--seed", str(args.seed), "--median", str(args.median), "--sigma", str(args.sigma),
            "--min-len", str(args.min_len), "--max-len", str(args.max_len),
            "--pack-length", str(args.pack_length), "--passes", str(args.passes),
            "--head-chunk", str(args.head_chunk)] \
        + (["--warm-pass"] if args.warm_pass else [])
    for k in SHAPE_KEYS:
        v = getattr(args, k)
        if v is not None:
            argv += ["--" + k.replace("_", "-"), str(v)]
    return argv + (["--cpu"] if args.cpu else [])


def main(args) -> list[dict]:
    rows = []
    for turn, name in ((r, name) for r in range(1, args.rounds + 1) for name in args.configs):
        tic = time.time()
        # `-m` from the repository root: this tree's bench and engine run
        proc = subprocess.run([sys.executable, "-m", "bench.throughput", *child_argv(args, name)],
                              capture_output=True, text=True, cwd=ROOT)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        if proc.returncode == 0 and lines:
            row = json.loads(lines[-1])
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            row = dict(parse_config(name), config=name, bench="throughput", error=tail[0],
                       rc=proc.returncode, layers=args.layers, dim=args.dim, dtype=args.dtype,
                       lengths=length_mix(args))
            row.pop("name", None)
        row["wall_s"] = round(time.time() - tic, 1)
        if args.rounds > 1:
            row["round"] = turn
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the table

def _label(row: dict, lengths: bool = False) -> str:
    """The configuration in words; `lengths`: with its --pack-length (where a table
    mixes rows of several)."""
    if row.get("impl") == "mlx-lm":
        return f"mlx-lm batch {row['batch']}" + (", grad_checkpoint" if row.get("grad_checkpoint")
                                                 else "")
    pack = row.get("pack")
    if pack == "auto":
        how = ("pack auto (" + ("packed" if row.get("packed") else
                                "side, unpadded" if row.get("unpadded") else
                                "side" if row.get("side") else "unpacked") + ")") \
            if "error" not in row else "pack auto"
    elif pack == "unpadded" and not row.get("unpadded") and "error" not in row:
        how = "side (unpadded refused)"
    else:
        how = pack or ("packed" if row.get("packed") else "unpacked")
    seg = row.get("segment_size")
    return f"segctl batch {row['batch']}, {how}, " + ("plain" if not seg else f"segment {seg}") \
        + (", fused" if row.get("fused") else "") \
        + (f", top {row['keep']} kept" if row.get("keep") else "") \
        + (", update eager" if row.get("fused") and row.get("fused_update") is False else "") \
        + (f", a further pass weighed {row['pass_tokens']} tokens"
           if row.get("pass_tokens", SIDE_PASS_TOKENS) != SIDE_PASS_TOKENS else "") \
        + (f", at most {row['pack_length']} tokens a pass"
           if lengths and row.get("pack_length") else "")


def _shape(row: dict) -> str:
    mix = row.get("lengths") or {}
    quant = f", {row['quantize']}-bit base" if row.get("quantize") else ""
    return (f"{row.get('arch', 'qwen3')} {row.get('layers')} x {row.get('dim')}{quant}, "
            f"{row.get('dtype')}, {mix.get('rows')} rows, log-normal lengths median "
            f"{mix.get('median')} sigma {mix.get('sigma')} in [{mix.get('min_len')}, "
            f"{mix.get('max_len')}] (mean {mix.get('mean')}, longest {mix.get('longest')})"
            + (f", {row['device_name'] or row['device']}" if row.get("device") else ""))


def table(rows: list[dict]) -> str:
    """Markdown, one table per shape, length mix, `run` (a label a file of several
    runs gives each run's rows: a run is one machine at one time, and only its own
    rows compare) and `round` (--rounds), rows in the order they came; the ratio is tokens/s over mlx-lm
    batch 4 without grad_checkpoint's."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        key = json.dumps([row.get(k) for k in ("arch", "layers", "dim", "dtype", "vocab",
                                               "quantize")] +
                         [(row.get("lengths") or {}).get(k) for k in
                          ("median", "sigma", "min_len", "max_len", "seed", "rows")]
                         + [row.get("run"), row.get("round")])
        groups.setdefault(key, []).append(row)
    out = []
    for group in groups.values():
        base = next((r for r in group if r.get("impl") == "mlx-lm" and r.get("batch") == 4
                     and not r.get("grad_checkpoint") and "error" not in r), None)
        label = partial(_label, lengths=len({r.get("pack_length") for r in group
                                             if r.get("pack_length")}) > 1)
        run = ", ".join(([f"run `{group[0]['run']}`"] if group[0].get("run") else [])
                        + ([f"round {group[0]['round']}"] if group[0].get("round") else []))
        run = f" ({run})" if run else ""
        out += [f"{_shape(group[0])}{run}:", "",
                "| configuration | tokens/s | peak GB | seqs/step or pad eff. | loss (step 1) "
                "| vs mlx-lm batch 4 |", "|---|---|---|---|---|---|"]
        for row in group:
            if "error" in row:
                out.append(f"| {label(row)} | failed: {row['error']} | | | | |")
                continue
            shape = (f"{row['pad_efficiency']:.2f} pad eff." if row.get("pad_efficiency")
                     else f"{row['sequences_per_step']} seqs"
                     if row.get("sequences_per_step") is not None else "")
            ratio = ("1" if row is base else
                     f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "")
            out.append(f"| {label(row)} | {row['tokens_per_s']:.1f} | {row['peak_gb']:.3f} | "
                       f"{shape} | {row['loss']:.4f} | {ratio} |")
        ours = [r for r in group if r.get("impl") == "segctl" and "error" not in r]
        if base and ours:
            best = max(ours, key=lambda r: r["tokens_per_s"])
            out += ["", f"segctl's best: {label(best)}, {best['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                        f"mlx-lm batch 4's tokens/s at {best['peak_gb'] / base['peak_gb']:.2f}x "
                        "its peak."]
        theirs = [r for r in group if r.get("impl") == "mlx-lm" and "error" not in r]
        for budget in BUDGETS_GB:
            fit = [max((r for r in rows if r["peak_gb"] <= budget),
                       key=lambda r: r["tokens_per_s"], default=None) for rows in (ours, theirs)]
            if all(fit):
                out.append(f"Within {budget:g} GB: segctl's best ({label(fit[0])}) "
                           f"{fit[0]['tokens_per_s'] / fit[1]['tokens_per_s']:.2f}x the best "
                           f"mlx-lm configuration that fits ({label(fit[1])}).")
        out.append("")
    return "\n".join(out)


def _read_rows(path: str) -> list[dict]:
    from bench.jsonl import read_rows
    return read_rows(path, "bench.throughput table",
                     lambda row: None if row.get("bench") == "throughput"
                     else "not a bench.throughput row")


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------- the command line

def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: integers >= 0, please")
    return values


def _names(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    for name in names:
        try:
            parse_config(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    if not names:
        raise argparse.ArgumentTypeError("no configuration named")
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: 1 or more, please")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, exit 2 (argparse's own adds the usage)
        _fail(f"{self.prog}: error: {message}")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bench.throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu",
                   help="model shape preset (the flags below override its parts)")
    p.add_argument("--arch", choices=["qwen3", "llama"])
    p.add_argument("--quantize", type=int, choices=[0, 4, 8], help="base weights' bits (0: none)")
    p.add_argument("--layers", type=_positive)
    p.add_argument("--dim", type=_positive)
    p.add_argument("--vocab", type=_positive)
    p.add_argument("--intermediate", type=_positive, help="default 3 x dim")
    p.add_argument("--heads", type=_positive, help="default dim // 64")
    p.add_argument("--kv-heads", type=_positive, help="default max(1, dim // 128)")
    p.add_argument("--head-dim", type=_positive, help="default 64")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rows", type=_positive, default=32,
                   help="rows every configuration trains on, once (a multiple of each batch)")
    p.add_argument("--warmup", type=int, choices=range(0, 100), default=1, metavar="STEPS",
                   help="untimed steps first, over the first rows (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the length mix's and rows' seed")
    p.add_argument("--median", type=float, default=300.0, help="median row length (tokens)")
    p.add_argument("--sigma", type=float, default=0.6, help="sigma of log(length)")
    p.add_argument("--min-len", type=_positive, default=32)
    p.add_argument("--max-len", type=_positive, default=2048)
    p.add_argument("--pack-length", type=_positive, default=2048,
                   help="segctl: tokens per packed sequence at most")
    p.add_argument("--head-chunk", type=_positive, default=DEFAULT_HEAD_CHUNK,
                   help="segctl: the loss head's tokens at a time (a job's memory.head_chunk; "
                        f"default {DEFAULT_HEAD_CHUNK})")
    p.add_argument("--batches", type=_ints, default=[1, 4, 16])
    p.add_argument("--segment-sizes", type=_ints, default=None,
                   help="segctl segment sizes (0 = plain autodiff); default: 0 and the layers")
    p.add_argument("--configs", type=_names, default=None,
                   help="only these configurations, comma-separated (e.g. mlx-lm:b4,"
                        "mlx-lm:b4:ckpt,segctl:b16:packed:s0,segctl:b16:auto:s8)")
    p.add_argument("--warm-pass", action="store_true",
                   help="before timing, one untimed pass over every batch (each shape's kernels "
                        "built and mlx-lm's compiled step traced once, as in a long run; two "
                        "where segctl fuses its segments: a shape compiles the second time)")
    p.add_argument("--passes", type=_positive, default=1,
                   help="timed passes over the rows; tokens/s is the median pass's (a GPU's "
                        "pass of 32 rows takes about a second: time several)")
    p.add_argument("--rounds", type=_positive, default=1,
                   help="run the configurations in order this many times, each in a process of "
                        "its own (rows carry `round`; the table compares each round within "
                        "itself): on a GPU machine a process's speed may depend on what ran "
                        "before it, which a second round shows")
    p.add_argument("--one", metavar="CONFIG", help="run one configuration in this process")
    p.add_argument("--cpu", action="store_true", help="force the CPU device")
    return p


def parse(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    preset = SHAPES[args.shape]
    for k in SHAPE_KEYS:
        if getattr(args, k) is None:
            setattr(args, k, preset[k])
    if args.min_len < 2 or args.min_len > args.max_len:
        p.error(f"--min-len {args.min_len}: 2 to --max-len ({args.max_len}), please")
    if args.median <= 0 or args.sigma < 0 or not math.isfinite(args.median + args.sigma):
        p.error("--median must be > 0 and --sigma >= 0")
    if args.pack_length < args.max_len:
        p.error(f"--pack-length {args.pack_length} is shorter than a row may be "
                f"(--max-len {args.max_len})")
    if 0 in args.batches:
        p.error("--batches: batch sizes of 1 or more, please")
    if args.segment_sizes is None:
        args.segment_sizes = [0, args.layers]
    if args.one:
        try:
            cfg = parse_config(args.one)
        except ValueError as e:
            p.error(str(e))
        names = [args.one]
    else:
        names = args.configs or default_configs(args.batches, args.segment_sizes)
        args.configs = names
    for name in names:
        cfg = parse_config(name)
        if args.rows % cfg["batch"]:
            p.error(f"--rows {args.rows} is not a multiple of {name}'s batch {cfg['batch']} "
                    "(every configuration sees every row once)")
        if cfg.get("segment_size", 0) > args.layers:
            p.error(f"{name}: segment size {cfg['segment_size']} > --layers {args.layers}")
    return args


def cli(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["table"]:
        if len(argv) != 2:
            _fail("usage: python -m bench.throughput table ROWS.jsonl")
        print(table(_read_rows(argv[1])))
        return
    args = parse(argv)
    if args.one:
        print(json.dumps(run_one(parse_config(args.one), args)), flush=True)
        return
    tic = time.time()
    rows = main(args)
    if rows:
        print(table(rows), file=sys.stderr)
        print(f"{len(rows)} configurations in {time.time() - tic:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    cli()
