"""The memory planner against the real engine: one JSON row per configuration.

    python -m bench.planner_fit > bench/results/planner-cpu.jsonl
    python -m bench.planner_fit --orpo      # the ORPO rows only
    python -m bench.planner_fit --long > bench/results/planner-long-cpu.jsonl
    python -m bench.planner_fit --block > bench/results/planner-block-cpu.jsonl
    python -m bench.planner_fit --phases > bench/results/planner-phases-cpu.jsonl

Each model is a small random one written by `engine.demo.write_model` (the
vocabulary widened through the config, so ids beyond the toy tokenizer exist),
loaded through `engine.model.load_model`, with LoRA as `engine.train.run` puts
it. Each configuration runs two steps exactly as engine/train.py does (clear the
cache, reset the peak, `loss_and_grads`, `apply_grads`, one evaluation) on one
row of random tokens supervised in full (the head's worst case), and
`measured_gb` is the larger step's `mx.get_peak_memory()`: the Step event's
`peak_gb`. `predicted_gb` is `orchestrator.planner.predict_gb` for the same
shape; ratio = predicted / measured, which the planner's constants keep >= 1.
ORPO rows (`ORPO_MODELS`) run a preference row of a P-token prompt and two R-token
responses, two-branch (`method` orpo, seq = P + R) and prefix-shared
(orpo-shared, seq = P + 2R), against the same estimate with their method.
`--long` runs rows longer than their MLP chunk (`LONG_MODELS`: mlp_chunk, and
the boundaries offloaded to disk), then `HELD_OUT_LONG`: shapes the planner's
constants were not fitted to, whose rows say `held_out`. `--block` measures one
part alone: the blocked attention backward's last query block (over every key),
on random q, k, v of `BLOCK_SHAPES`, against `planner.block_backward` plus the
K/V gradient sums the planner counts beside it. `--phases` takes the top layer's
backward of each `LONG_MODELS` configuration apart where it runs (no offload):
active memory when it starts (`base_gb`), and above that the peaks of its
recomputed forward, of attention's backward (with what is alive when it starts)
and of the vjps around it; the planner's long-row terms are these phases, the
larger one counting. A summary goes to stderr. On two CPU cores the default run
takes about 2 minutes, `--long` about 20 (its bf16 rows are slow there),
`--block` about 1, `--phases` about 8.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from segctl.engine import attention
from segctl.engine import rows as rows_mod
from segctl.engine import step as step_mod
from segctl.engine.attention import blocked_grads
from segctl.engine.data import Example, PreferenceExample
from segctl.engine.demo import demo_examples, write_model
from segctl.engine.model import apply_lora, load_model, model_parts
from segctl.engine.optim import apply_grads, make_optimizer
from segctl.engine.settings import StepMemory
from segctl.engine.step import loss_and_grads
from segctl.orchestrator.planner import ModelInfo, block_backward, kv_grad_sums, model_info, predict_gb
from segctl.schemas.defaults import DEFAULT_ATTN_BLOCK, DEFAULT_HEAD_CHUNK

RANK = 8

# (arch, layers, hidden, vocab, dtype) -> cases (seq, segment_size, attn_block, grad_checkpoint).
# Segment sizes 1, 2, all layers and 0 (plain); a grad_checkpoint case; blocked
# attention backward where attn_block < seq.
MODELS = [
    (("qwen3", 8, 64, 300, "float32"),
     [(seq, seg, 2048, False) for seq in (64, 256, 1024) for seg in (1, 2, 8, 0)]),
    (("llama", 6, 128, 4000, "float32"),
     [(seq, seg, 2048, False) for seq in (256, 1024) for seg in (1, 2, 6, 0)]
     + [(1024, 0, 2048, True), (1024, 1, 512, False), (1024, 2, 512, False)]),
    (("qwen3", 4, 256, 8000, "float32"),
     [(seq, seg, 2048, False) for seq in (128, 512) for seg in (1, 2, 4, 0)]
     + [(512, 0, 2048, True), (1024, 1, 2048, False), (1024, 2, 256, False)]),
    (("llama", 5, 192, 1000, "float32"),
     [(768, seg, 2048, False) for seg in (1, 3, 5)]),
    (("qwen3", 4, 128, 2000, "bfloat16"),
     [(512, seg, 2048, False) for seg in (1, 2, 4, 0)]),
]

# (arch, layers, hidden, vocab, dtype) -> long cases (seq, segment_size, attn_block, mlp_chunk,
# offload): the MLP in chunks of rows, the boundaries on disk.
LLAMA_MLP = {"intermediate_size": 1024, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 128}   # MLP-heavy: two heads of 128, intermediate 4x hidden
LLAMA_GQA = {"intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 32}    # eight query heads over two K/V heads

# (arch, layers, hidden, vocab, dtype[, config overrides]) -> long cases (seq, segment_size,
# attn_block, mlp_chunk, offload): the MLP in chunks of rows (0: whole), the boundaries on disk.
LONG_MODELS = [
    (("qwen3", 8, 64, 300, "float32"),
     [(seq, seg, 512, chunk, off) for seq in (2048, 4096) for seg in (1, 2)
      for chunk, off in ((0, False), (256, False), (256, True))]),
    (("llama", 6, 128, 4000, "float32"),
     [(seq, 1, 1024, chunk, off) for seq in (2048, 4096)
      for chunk, off in ((0, False), (512, False), (512, True))]),
    (("llama", 4, 256, 2000, "float32", LLAMA_MLP),
     [(3072, 1, 256, 0, False), (3072, 1, 256, 384, False), (3072, 2, 256, 384, True)]),
    (("qwen3", 6, 128, 1000, "bfloat16"),
     [(3072, 1, 768, 0, False), (3072, 3, 768, 512, False), (3072, 1, 768, 512, True)]),
    (("llama", 4, 256, 2000, "float32", LLAMA_GQA),
     [(2048, seg, ab, chunk, False) for seg in (1, 2) for ab in (256, 1024)
      for chunk in (0, 256)]),
    (("llama", 3, 256, 1000, "bfloat16", LLAMA_MLP),
     [(2048, 1, 512, 0, False), (2048, 1, 512, 512, False)]),
]

# Held out: shapes and lengths none of the planner's constants was fitted to, run
# after the rows above (their rows say held_out).
HELD_OUT_LONG = [
    (("qwen3", 5, 192, 1500, "float32",
      {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32}),
     [(3584, 1, 512, 0, False), (3584, 2, 512, 448, False), (3584, 1, 512, 448, True)]),
    (("llama", 3, 384, 800, "bfloat16",
      {"intermediate_size": 1536, "num_attention_heads": 3, "num_key_value_heads": 1,
       "head_dim": 128}),
     [(2560, 1, 640, 0, False), (2560, 1, 640, 320, False)]),
    (("qwen3", 4, 160, 1200, "float32",
      {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 32}),
     [(3000, 1, 600, 0, False), (3000, 2, 600, 375, False), (3000, 1, 600, 375, True)]),
    (("llama", 3, 320, 900, "bfloat16",
      {"intermediate_size": 1280, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 64}),
     [(2304, 1, 384, 0, False), (2304, 1, 384, 288, False)]),
    # written down before the phase-by-phase refit was checked against them
    (("qwen3", 6, 224, 1100, "float32",
      {"intermediate_size": 672, "num_attention_heads": 7, "num_key_value_heads": 1,
       "head_dim": 32}),
     [(2816, 1, 704, 0, False), (2816, 2, 704, 352, False), (2816, 1, 704, 352, True)]),
    (("llama", 4, 288, 700, "bfloat16",
      {"intermediate_size": 1152, "num_attention_heads": 3, "num_key_value_heads": 1,
       "head_dim": 96}),
     [(2432, 1, 608, 0, False), (2432, 1, 608, 304, False)]),
]

# (arch, layers, hidden, vocab, dtype) -> ORPO cases (prompt P, response R, segment_size, method).
ORPO_MODELS = [
    (("qwen3", 8, 64, 300, "float32"),
     [(P, R, seg, m) for P, R in ((96, 32), (600, 200)) for seg in (1, 2, 0)
      for m in ("orpo", "orpo-shared")]),
    (("llama", 6, 128, 4000, "float32"),
     [(P, R, seg, m) for P, R in ((200, 56), (700, 150)) for seg in (1, 6, 0)
      for m in ("orpo", "orpo-shared")]),
]


# (dtype, heads, kv_heads, head_dim, seq, attn_block): the blocked backward alone.
BLOCK_SHAPES = [
    (dtype, h, kv, hd, L, ab)
    for dtype in ("float32", "bfloat16")
    for h, kv, hd in ((1, 1, 64), (2, 1, 128), (4, 2, 32), (6, 2, 64), (8, 1, 32), (8, 8, 32))
    for L, ab in ((1024, 256), (2048, 512), (3072, 768), (4096, 256))
]


def block_alone_gb(row: dict) -> float:
    """The planner's figure for a --block row: one block's backward and the K/V
    gradient sums (which the planner counts beside it)."""
    info = ModelInfo(model_type="llama", n_layers=1, hidden=row["heads"] * row["head_dim"],
                     intermediate=0, heads=row["heads"], kv_heads=row["kv_heads"],
                     head_dim=row["head_dim"], vocab=0, weight_bytes=0,
                     act_bytes=4 if row["dtype"] == "float32" else 2)
    return (block_backward(info, row["seq"], row["attn_block"])
            + kv_grad_sums(info, row["seq"])) / 1e9


def block_row(dtype: str, heads: int, kv_heads: int, head_dim: int, L: int, ab: int) -> dict:
    """The peak of blocked_grads' last block (rows L - ab .. L over all L keys) above
    its inputs, against the planner's block_backward and fp32 dK, dV sums."""
    dt = getattr(mx, dtype)
    key = mx.random.key(0)
    q, do = (mx.random.normal((1, heads, ab, head_dim), key=k).astype(dt)
             for k in mx.random.split(key))
    k, v = (mx.random.normal((1, kv_heads, L, head_dim), key=k).astype(dt)
            for k in mx.random.split(mx.random.key(1)))
    mx.eval(q, do, k, v)
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = blocked_grads(q, k, v, do, "causal", head_dim ** -0.5, ab)
    mx.eval(out)
    measured = (mx.get_peak_memory() - base) / 1e9
    del out, q, do, k, v
    predicted = block_alone_gb(dict(dtype=dtype, heads=heads, kv_heads=kv_heads,
                                    head_dim=head_dim, seq=L, attn_block=ab))
    return dict(part="block", dtype=dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                seq=L, attn_block=ab, measured_gb=round(measured, 6),
                predicted_gb=round(predicted, 6), ratio=round(predicted / measured, 3))


@contextmanager
def _phase_marks(log: list):
    """Within the block, the engine's layer backward and its phases append (label,
    active MB, peak MB since the last mark) to `log`; the originals come back on exit."""
    def mark(label):
        log.append((label, mx.get_active_memory() / 1e6, mx.get_peak_memory() / 1e6))
        mx.reset_peak_memory()

    def marked(fn, before, after, evaluate=lambda r: r):
        def run(*a, **k):
            if before:
                mark(before)
            r = fn(*a, **k)
            mx.eval(evaluate(r))
            mark(after)
            return r
        return run

    @contextmanager
    def eager_blocks(original=attention.eager_blocks):
        with original():
            yield
        mark("recompute")   # a pass 0 (engine/layer.py) or rows' forward (engine/rows.py)

    swaps = [(attention, "blocked_grads", marked(attention.blocked_grads, "attention-start",
                                                 "attention")),
             (attention, "eager_blocks", eager_blocks),
             (step_mod.rows, "vjp", marked(rows_mod.vjp, "start", "end")),
             (step_mod, "layer_vjp", marked(step_mod.layer_vjp, "start", "end"))]
    saved = [(m, name, getattr(m, name)) for m, name, _ in swaps]
    try:
        for m, name, fn in swaps:
            setattr(m, name, fn)
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


def phase_row(model, parts, example, seg: int, ab: int, chunk: int) -> dict:
    """The top layer's backward of one step (the second of two), taken apart."""
    log: list = []
    with _phase_marks(log):
        for _ in range(2):
            log.clear()
            gc.collect()
            mx.clear_cache()
            mx.reset_peak_memory()
            loss, grads = loss_and_grads(model, example,
                                         memory=StepMemory(segment_size=seg, attn_block=ab,
                                                           mlp_chunk=chunk),
                                         parts=parts)
            mx.eval(loss, grads)
            del loss, grads
    labels = [label for label, _, _ in log]
    i = labels.index("start")
    j = labels.index("end", i)
    base = log[i][1]
    inside = log[i + 1:j + 1]

    def peak(*which):
        return round(max((p for label, _, p in inside if label in which), default=base)
                     / 1e3 - base / 1e3, 6)
    at = [a for label, a, _ in inside if label == "attention-start"]
    return dict(base_gb=round(base / 1e3, 6), recompute_gb=peak("recompute"),
                attention_gb=peak("attention"), other_gb=peak("attention-start", "end"),
                attention_start_gb=round((at[0] - base) / 1e3, 6) if at else None)


def lora_bench_model(folder: Path, arch: str, layers: int, hidden: int, vocab: int,
                     dtype: str = "float32", config: dict | None = None):
    """(model with LoRA as engine/train.py puts it, its ModelInfo), written to
    `folder` by write_bench_model. Peak memory counts everything alive: the
    caller drops the model (and clears MLX's cache) before the next."""
    folder = write_bench_model(folder, arch, layers, hidden, vocab, dtype, config)
    model, _ = load_model(folder)
    apply_lora(model, rank=RANK, scale=20.0, dropout=0.0)
    mx.eval(model.parameters())
    return model, model_info(str(folder))


def write_bench_model(folder: Path, arch: str, layers: int, hidden: int, vocab: int,
                      dtype: str = "float32", config: dict | None = None) -> Path:
    """A random `arch` model of this shape in Hugging Face layout (weights in `dtype`;
    `config` overrides more of config.json)."""
    corpus = [f"{r['prompt']} {r['completion']}" for r in demo_examples(100, 1)]
    write_model(folder, arch, corpus=corpus, layers=layers, hidden=hidden,
                extra_config={"vocab_size": vocab, "torch_dtype": dtype, **(config or {})})
    if dtype != "float32":
        path = folder / "model.safetensors"
        weights = {k: v.astype(getattr(mx, dtype)) for k, v in mx.load(str(path)).items()}
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return folder


def measure_peak_gb(model, example, *, segment_size: int, head_chunk: int = DEFAULT_HEAD_CHUNK,
                    attn_block: int = DEFAULT_ATTN_BLOCK, grad_checkpoint: bool = False, steps: int = 2,
                    mlp_chunk: int = 0, offload: str | None = None, **method) -> float:
    """Peak GB of `steps` training steps on `example`, measured as engine/train.py
    measures a step (a fresh AdamW, so step 1 also allocates its moments)."""
    parts = model_parts(model, check=False)
    optimizer = make_optimizer(1e-5)
    peak = 0.0
    for _ in range(steps):
        mx.clear_cache()
        mx.reset_peak_memory()
        loss, grads = loss_and_grads(model, example,
                                     memory=StepMemory(segment_size=segment_size,
                                                       head_chunk=head_chunk,
                                                       attn_block=attn_block, mlp_chunk=mlp_chunk,
                                                       offload=offload,
                                                       grad_checkpoint=grad_checkpoint),
                                     parts=parts, **method)
        norm = apply_grads(model, optimizer, grads, 1.0)
        mx.eval(loss, norm, model.trainable_parameters(), optimizer.state)
        peak = max(peak, mx.get_peak_memory() / 1e9)
        del loss, grads, norm
    return peak


def random_row(seq: int, vocab: int, seed: int = 0) -> Example:
    mx.random.seed(seed)
    return Example(mx.random.randint(0, vocab, (seq,)).tolist(), 0)


def preference_row(P: int, R: int, vocab: int, seed: int = 0) -> PreferenceExample:
    mx.random.seed(seed)
    ids = mx.random.randint(0, vocab, (P + 2 * R,)).tolist()
    return PreferenceExample(ids[:P], ids[P:P + R], ids[P + R:])


def main() -> None:
    rows = []
    if "--phases" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            for i, ((arch, layers, hidden, vocab, dtype, *config), cases) in enumerate(LONG_MODELS):
                model, info = lora_bench_model(Path(tmp) / f"{i}-{arch}", arch, layers, hidden,
                                               vocab, dtype, *config)
                parts = model_parts(model, check=False)
                for seq, seg, ab, chunk, off in cases:
                    if off:
                        continue
                    row = dict(part="phases", arch=arch, layers=layers, hidden=hidden,
                               vocab=vocab, dtype=dtype, seq=seq, segment_size=seg,
                               attn_block=ab, mlp_chunk=chunk,
                               **phase_row(model, parts, random_row(seq, vocab), seg, ab, chunk),
                               info=info.to_dict())
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del model, parts
                gc.collect()
                mx.clear_cache()
        print(f"{len(rows)} configurations taken apart", file=sys.stderr)
        return
    if "--block" in sys.argv:
        for shape in BLOCK_SHAPES:
            rows.append(block_row(*shape))
            print(json.dumps(rows[-1]), flush=True)
        ratios = [r["ratio"] for r in rows]
        print(f"{len(rows)} block rows: ratio min {min(ratios):.3f} max {max(ratios):.3f}",
              file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp:
        fitted = (ORPO_MODELS if "--orpo" in sys.argv else LONG_MODELS if "--long" in sys.argv
                  else MODELS + ORPO_MODELS)
        held = HELD_OUT_LONG if "--long" in sys.argv else []
        models = [(m, False) for m in fitted] + [(m, True) for m in held]
        for i, (((arch, layers, hidden, vocab, dtype, *config), cases), held_out) in enumerate(
                models):
            # numbered: the default run meets a shape twice (its SFT and ORPO cases)
            model, info = lora_bench_model(Path(tmp) / f"{i}-{arch}-{layers}-{hidden}-{dtype}",
                                           arch, layers, hidden, vocab, dtype, *config)
            for case in cases:
                if isinstance(case[3], str):
                    rows.append(orpo_row(model, info, arch, layers, hidden, vocab, dtype, *case))
                    continue
                if len(case) == 5:
                    seq, seg, attn_block, chunk, off = case
                    ckpt, long = False, dict(mlp_chunk=chunk)
                    where = dict(offload=tempfile.mkdtemp(dir=tmp)) if off else {}
                else:
                    (seq, seg, attn_block, ckpt), long, where, off = case, {}, {}, False
                tic = time.perf_counter()
                measured = measure_peak_gb(model, random_row(seq, vocab), segment_size=seg,
                                           attn_block=attn_block, grad_checkpoint=ckpt,
                                           **long, **where)
                predicted = predict_gb(info, seq_len=seq, segment_size=seg, lora_rank=RANK,
                                       attn_block=attn_block, grad_checkpoint=ckpt, **long,
                                       **(dict(offload=True) if off else {}))
                row = dict(arch=arch, layers=layers, hidden=hidden, vocab=vocab, dtype=dtype,
                           seq=seq, segment_size=seg, attn_block=attn_block, **long,
                           **(dict(offload=True) if off else {}),
                           grad_checkpoint=ckpt, measured_gb=round(measured, 5),
                           predicted_gb=round(predicted, 5), ratio=round(predicted / measured, 3),
                           seconds=round(time.perf_counter() - tic, 2), info=info.to_dict(),
                           **(dict(held_out=True) if held_out else {}))
                rows.append(row)
                print(json.dumps(row), flush=True)
            # Free this model before the next: peak memory counts everything alive.
            del model
            gc.collect()
            mx.clear_cache()
    ratios = [r["ratio"] for r in rows]
    orpo = [r["ratio"] for r in rows if r.get("method", "sft") != "sft"]
    if orpo:
        print(f"orpo rows: ratio min {min(orpo):.3f} max {max(orpo):.3f}", file=sys.stderr)
    held = [r["ratio"] for r in rows if r.get("held_out")]
    if held:
        print(f"held-out rows: ratio min {min(held):.3f} max {max(held):.3f}", file=sys.stderr)
    long = [r["ratio"] for r in rows if r["seq"] >= 256]
    print(f"{len(rows)} rows: ratio min {min(ratios):.3f} max {max(ratios):.3f}; "
          f"seq >= 256: min {min(long):.3f} max {max(long):.3f}; "
          f"{sum(r < 1 for r in ratios)} below 1", file=sys.stderr)


def orpo_row(model, info, arch, layers, hidden, vocab, dtype, P, R, seg, method) -> dict:
    tic = time.perf_counter()
    shared = method == "orpo-shared"
    measured = measure_peak_gb(model, preference_row(P, R, vocab), segment_size=seg,
                               method="orpo", prefix_shared=shared)
    seq = P + 2 * R if shared else P + R
    predicted = predict_gb(info, seq_len=seq, segment_size=seg, lora_rank=RANK, method=method)
    row = dict(arch=arch, layers=layers, hidden=hidden, vocab=vocab, dtype=dtype, method=method,
               prompt=P, response=R, seq=seq, segment_size=seg, attn_block=DEFAULT_ATTN_BLOCK,
               grad_checkpoint=False, measured_gb=round(measured, 5),
               predicted_gb=round(predicted, 5), ratio=round(predicted / measured, 3),
               seconds=round(time.perf_counter() - tic, 2), info=info.to_dict())
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
