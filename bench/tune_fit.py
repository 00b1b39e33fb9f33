"""The measured memory model on one machine, at a real model's shape: probe a grid
and points off it in one process (engine/measure.py, what a tune runs on a node),
fit on the grid (orchestrator/measured.py) and print how far its predictions of
the off-grid points are from their measured peaks. No fleet: for the H200, where
only the engine runs (bench/README.md says how the GPU rows were made).

    python -m bench.tune_fit --layers 28 --dim 1024 --vocab 151936 --dtype bfloat16 \
        --grid-lens 1024,2048,4096,8192 --grid-sizes 1,2,4,8 \
        --off-lens 1536,3072,6144 --off-sizes 1,3,6

Rows: probe (every point measured), fit (per regime: leave-one-out error on the
grid) and held_out (each off-grid point: predicted / measured - 1), summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.orchestrator import row
from segctl.schemas.defaults import DEFAULT_ATTN_BLOCK, DEFAULT_HEAD_CHUNK


def write_shaped_model(out: Path, *, layers: int, dim: int, vocab: int, dtype: str) -> Path:
    """A qwen3 model of this shape with random weights in `dtype`, in Hugging Face
    layout, with a small trained tokenizer (probe rows are random ids below its
    size; the head still spans the full `vocab`)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from segctl.engine.demo import _model_config, write_model
    write_model(out, "qwen3", corpus=["a b c d e f g h"] * 50, layers=1, hidden=64)
    config = _model_config("qwen3", layers=layers, hidden=dim, vocab_size=vocab, eos=2, bos=0)
    config.update(num_attention_heads=dim // 64, num_key_value_heads=max(1, dim // 128),
                  head_dim=128 if dim >= 1024 else 64, intermediate_size=3 * dim,
                  torch_dtype=dtype, max_position_embeddings=40960, tie_word_embeddings=True)
    arch = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--method", choices=["sft", "orpo"], default="sft")
    p.add_argument("--grid-lens", default="256,512,1024")
    p.add_argument("--grid-sizes", default="1,2,4,8")
    p.add_argument("--off-lens", default="384,768")
    p.add_argument("--off-sizes", default="1,3,6")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-gb", type=float, default=100.0)
    args = p.parse_args(argv)

    import mlx.core as mx

    from segctl.engine.measure import run_probes
    from segctl.orchestrator import measured
    from segctl.schemas.records import ProbeSpec

    ints = lambda s: [int(x) for x in s.split(",")]
    grid = [(L, s) for L in ints(args.grid_lens) for s in ints(args.grid_sizes)]
    off = [(L, s) for L in ints(args.off_lens) for s in ints(args.off_sizes)]
    off += [(L, s) for L in ints(args.grid_lens) for s in ints(args.off_sizes)
            if s not in ints(args.grid_sizes)]
    shape = dict(layers=args.layers, dim=args.dim, vocab=args.vocab, dtype=args.dtype,
                 method=args.method, device=str(mx.default_device()))
    with tempfile.TemporaryDirectory() as d:
        model = write_shaped_model(Path(d) / "model", layers=args.layers, dim=args.dim,
                                   vocab=args.vocab, dtype=args.dtype)
        events: dict[tuple, dict] = {}

        def keep(e):
            e = e.model_dump()
            events[(e["seq_len"], e["segment_size"])] = e
            row(bench="tune_fit", kind="probe", **shape, seq_len=e["seq_len"],
                segment_size=e["segment_size"], fits=e["fits"], peak_gb=e["peak_gb"],
                step_s=e["step_s"], phases=e["phases"])

        tic = time.perf_counter()
        run_probes(ProbeSpec(model=str(model), method=args.method, budget_gb=args.budget_gb,
                             points=grid + off, steps=args.steps), keep, time.time)
        probe_s = time.perf_counter() - tic

    def point(e):
        return measured.point_of(dict(e, phases=[l for l, _ in e["phases"]],
                                      phase_peaks=[v for _, v in e["phases"]]))

    fitted = measured.fit([point(events[k]) for k in grid], n_layers=args.layers,
                          head_chunk=DEFAULT_HEAD_CHUNK, attn_block=DEFAULT_ATTN_BLOCK,
                          lora_rank=8, lora_layers=-1)
    loo = measured.held_out(fitted)
    for r in loo:
        row(bench="tune_fit", kind="loo", **shape, **r)
    errors = []
    for k in off:
        e = events[k]
        if not e["fits"] or fitted.gap(k[0]):
            continue
        pred = fitted.predict(*k)
        errors.append(pred / e["peak_gb"] - 1)
        row(bench="tune_fit", kind="held_out", **shape, seq_len=k[0], segment_size=k[1],
            measured_gb=e["peak_gb"], predicted_gb=round(pred, 4), error=round(errors[-1], 4))
    row(bench="tune_fit", kind="summary", **shape, grid=len(grid), off_grid=len(off),
        probe_seconds=round(probe_s, 1), regimes=sorted(fitted.longest),
        loo_max_abs=max((abs(r["error"]) for r in loo), default=None),
        held_out_n=len(errors), held_out_max_abs=round(max(map(abs, errors)), 4) if errors else None,
        held_out_mean_abs=round(sum(map(abs, errors)) / len(errors), 4) if errors else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
