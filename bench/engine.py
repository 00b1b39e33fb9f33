"""One engine configuration, a few LoRA steps, one JSON row on stdout.

    python -m bench.engine --arch qwen3 --layers 8 --dim 256 --vocab 32000 --seq 1024 \
        --dtype float32 --steps 3 --mode segmented --segment-size 1

The model is mlx-lm's own architecture at the given shape with random weights
(hidden=dim, intermediate=3*dim, heads=dim//64, kv heads=max(1, dim//128),
head_dim=64, tied embeddings, rope theta 1e6; --intermediate, --heads, --kv-heads,
--head-dim, --no-tie, --rope-theta override them; --quantize 4 quantizes the base
model first, QLoRA), LoRA rank 8 scale 20 on every linear of every
layer, one sequence of --seq random tokens with the loss on its second half
(mlx-lm's workload). `--impl mlx-lm` times mlx-lm's own trainer loss and step
(`default_loss`, its compiled step, its class-level grad_checkpoint) on the same
model. grad_checkpoint patches a class for the whole process, so run one
configuration per process: `python -m bench.suite` does that.

`--method orpo` runs one preference pair instead: a --seq//2-token prompt and a
chosen and a rejected response of the other half each (so each branch is --seq
tokens, and prefix-shared runs 1.5 x --seq), loss ENGINE.md's ORPO with nll
scope response and lambda 0.1; `--prefix-shared` runs it as one sequence.
`--impl mlx-lm-lora` times mlx-lm-lora's ORPO trainer step on the same pair
(bench/orpo_ref.py; the same loss in our notation).

`--arch gemma4_text`, `--arch gemma3_text` and `--arch gpt_oss` build Gemma-4-,
Gemma-3- and gpt-oss-like models (gemma4_config, gemma3_config and gpt_oss_config
say which shapes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from itertools import accumulate

import segctl  # noqa: F401 (first: it sizes MLX's CUDA attention caches before MLX loads)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from segctl.engine.data import Example, PreferenceExample
from segctl.engine.demo import FAMILY_CONFIGS
from segctl.engine.model import apply_lora, model_parts
from segctl.engine.optim import apply_grads, make_optimizer
from segctl.engine.settings import StepMemory
from segctl.engine.step import loss_and_grads
from segctl.schemas.defaults import DEFAULT_HEAD_CHUNK


def bench_model(arch: str, layers: int, dim: int, vocab: int, dtype: str, seed: int = 0, *,
                intermediate: int | None = None, heads: int | None = None,
                kv_heads: int | None = None, head_dim: int | None = None,
                tie: bool | None = None, rope_theta: float | None = None, quantize: int = 0,
                kv_shared: int | None = None, layer_input: int | None = None,
                double_mlp: bool | None = None):
    """The shape overrides (None: the defaults in the module docstring) apply to the
    generic config only; gemma4_text and gemma3_text keep their own shapes, but for
    Gemma-4's layers that read a donor's K/V (`kv_shared`), its per-layer inputs'
    width (`layer_input`) and its sharers' double-wide MLP (`double_mlp`), which
    tell its kinds of layer apart and apply to gemma4_text only (`parse` refuses
    them for another --arch).
    quantize=BITS (0 = off) quantizes the base model, every Linear and the Embedding
    (nn.quantize's default predicate, as mlx-lm's conversion does; group size 64),
    after set_dtype and before the LoRA layers go on: QLoRA."""
    import importlib
    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    hd = 64 if head_dim is None else head_dim
    cfg = dict(model_type=arch, hidden_size=dim, num_hidden_layers=layers,
               intermediate_size=3 * dim, num_attention_heads=max(1, dim // 64),
               num_key_value_heads=max(1, dim // 128), head_dim=hd, rms_norm_eps=1e-6,
               vocab_size=vocab, max_position_embeddings=65536, rope_theta=1e6,
               tie_word_embeddings=True)
    if arch == "minicpm":
        cfg.update(scale_emb=12.0, dim_model_base=256, scale_depth=1.4)
    if arch in FAMILY_CONFIGS:  # the demo's twists (multipliers, soft-caps, layer types)
        cfg.update(FAMILY_CONFIGS[arch](layers=layers, head_dim=hd))
    overrides = dict(intermediate_size=intermediate, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, tie_word_embeddings=tie,
                     rope_theta=rope_theta)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    if arch == "gemma4_text":
        cfg = gemma4_config(layers, dim, vocab, kv_shared, layer_input, double_mlp)
    if arch == "gemma3_text":
        cfg = gemma3_config(layers, dim, vocab)
    if arch == "gpt_oss":
        cfg = gpt_oss_config(layers, dim, vocab)
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    if arch == "gemma3_text":  # tied, as its checkpoints load (sanitize drops lm_head)
        model.pop("lm_head")
        model.tie_word_embeddings = True
    model.set_dtype(getattr(mx, dtype))
    if quantize:
        nn.quantize(model, group_size=64, bits=quantize)
    mx.eval(model.parameters())
    mx.random.seed(seed + 1)
    apply_lora(model, rank=8, scale=20.0, dropout=0.0)
    mx.eval(model.parameters())
    return model


def gemma4_config(layers: int, dim: int, vocab: int, kv_shared: int | None = None,
                  layer_input: int | None = None, double_mlp: bool | None = None) -> dict:
    """Gemma-4-E2B-like at (layers=35, dim=1536, vocab=262144): 8 query heads of 256
    (full-attention layers 512) over one K/V head, 4 sliding (window 512) to 1 full,
    the last 20/35 of the layers reading the K/V of the last earlier layer of their
    type (`kv_shared` of them, if given), 256-wide per-layer inputs (`layer_input`
    wide, if given; 0: none), intermediate 4 x dim (double in sharers, unless
    `double_mlp` is False)."""
    return dict(use_double_wide_mlp=double_mlp is not False,
                model_type="gemma4_text", hidden_size=dim, num_hidden_layers=layers,
                intermediate_size=4 * dim, num_attention_heads=8, head_dim=256,
                global_head_dim=512, num_key_value_heads=1, rms_norm_eps=1e-6,
                vocab_size=vocab, vocab_size_per_layer_input=vocab,
                hidden_size_per_layer_input=256 if layer_input is None else layer_input,
                num_kv_shared_layers=(20 * layers) // 35 if kv_shared is None else kv_shared,
                sliding_window=512, sliding_window_pattern=5, final_logit_softcapping=30.0,
                max_position_embeddings=131072, tie_word_embeddings=True)


def gpt_oss_config(layers: int, dim: int, vocab: int) -> dict:
    """gpt-oss-20b-like at (layers=24, dim=2880, vocab=201088), as its config.json:
    64 query heads of 64 over 8 K/V heads with an attention sink each, sliding
    (window 128) and full layers alternating, 32 experts of dim each (4 a token),
    YaRN RoPE (factor 32 over 4,096 positions), untied."""
    return dict(model_type="gpt_oss", hidden_size=dim, num_hidden_layers=layers,
                intermediate_size=dim, num_local_experts=32, num_experts_per_tok=4,
                head_dim=64, num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5,
                vocab_size=vocab, sliding_window=128, rope_theta=150000, swiglu_limit=7.0,
                rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                  original_max_position_embeddings=4096),
                layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                tie_word_embeddings=False)


def gemma3_config(layers: int, dim: int, vocab: int) -> dict:
    """Gemma-3-4B-like at (layers=34, dim=2560, vocab=262144): 8 query heads of 256
    over 4 K/V heads, 5 sliding (window 1024) to 1 full, intermediate 4 x dim."""
    return dict(model_type="gemma3_text", hidden_size=dim, num_hidden_layers=layers,
                intermediate_size=4 * dim, num_attention_heads=8, num_key_value_heads=4,
                head_dim=256, rms_norm_eps=1e-6, vocab_size=vocab, rope_theta=1e6,
                rope_local_base_freq=1e4, query_pre_attn_scalar=256, sliding_window=1024,
                sliding_window_pattern=6, max_position_embeddings=131072)


def run(args) -> dict:
    t0 = time.perf_counter()
    model = bench_model(args.arch, args.layers, args.dim, args.vocab, args.dtype,
                        intermediate=args.intermediate, heads=args.heads,
                        kv_heads=args.kv_heads, head_dim=args.head_dim, tie=args.tie,
                        rope_theta=args.rope_theta, quantize=args.quantize,
                        kv_shared=args.kv_shared, layer_input=args.layer_input,
                        double_mlp=args.double_mlp)
    build_s = time.perf_counter() - t0
    print(f"model built in {build_s:.1f}s", file=sys.stderr, flush=True)
    margs = getattr(model, "args", None)
    mx.random.seed(123)
    ids = mx.random.randint(0, args.vocab, (args.seq,)).tolist()
    prompt_len = args.seq // 2
    opt = make_optimizer(1e-5)
    phases: list[tuple[str, float]] = []   # (label, that phase's own peak GB), the last step's
    clock: list[float] = []  # each phase's end, seconds into the step (the last step's)

    p, r = args.seq // 2, args.seq - args.seq // 2
    pair = PreferenceExample(ids[:p], ids[p:], mx.random.randint(0, args.vocab, (r,)).tolist())
    orpo = dict(method="orpo", prefix_shared=args.prefix_shared) if args.method == "orpo" else {}

    if args.impl == "mlx-lm-lora":
        from bench.orpo_ref import mlx_lm_lora_orpo_step
        do_step = mlx_lm_lora_orpo_step(model, opt, pair.prompt, pair.chosen, pair.rejected,
                                        grad_checkpoint=args.mode == "checkpoint")
    elif args.impl == "mlx-lm":
        step = _mlx_lm_step(model, opt, args.mode == "checkpoint")
        batch = (mx.array([ids]), mx.array([[prompt_len, args.seq]]))
        do_step = lambda: step(batch)
    else:
        seg = 0 if args.mode in ("plain", "checkpoint") else args.segment_size
        parts = model_parts(model, check=False)
        if not args.rows:  # every layer the way it ran before row chunks (A/B)
            parts.rowwise = None
        ex = pair if orpo else Example(ids, prompt_len)
        state = [model.state, opt.state]

        def do_step():
            def on_phase(label):
                # The peak is reset at each phase's end, so each phase's own peak is
                # seen (which layer's backward, which part of the step, is the peak).
                own = mx.get_peak_memory() / 1e9
                mx.reset_peak_memory()
                phases.append((label, own))
                clock.append(time.perf_counter())
                # also as it happens, so a step cut short still shows how far it got
                print(f"phase {label} {clock[-1] - starts:.1f}s peak {own:.2f} GB "
                      f"(step {max(p for _, p in phases):.2f}) "
                      f"active {mx.get_active_memory() / 1e9:.2f} GB",
                      file=sys.stderr, flush=True)
            loss, grads = loss_and_grads(model, ex,
                                         memory=StepMemory(segment_size=seg,
                                                           head_chunk=args.head_chunk,
                                                           attn_block=args.attn_block,
                                                           mlp_chunk=args.mlp_chunk or 0,
                                                           offload=args.offload or None,
                                                           grad_checkpoint=args.mode == "checkpoint"),
                                         parts=parts, on_phase=on_phase if args.phases else None,
                                         **orpo)
            apply_grads(model, opt, grads, 1.0)
            mx.eval(state, loss)
            return loss

    if args.optimizer_state:
        # The optimizer's moments made before the first step, as they stand from the
        # second step on: one step measures a run's steady peak (no update is made).
        opt.init(model.trainable_parameters())
        mx.eval(opt.state)
    times, peaks, losses = [], [], []
    for _ in range(args.steps):
        phases.clear()
        clock.clear()
        mx.clear_cache()
        mx.reset_peak_memory()
        starts = time.perf_counter()
        loss = do_step()
        times.append(time.perf_counter() - starts)
        peaks.append(max([mx.get_peak_memory() / 1e9, *(p for _, p in phases)]))
        losses.append(loss.item())
    row = {
        "impl": args.impl, "method": args.method, "mode": args.mode,
        "prefix_shared": args.prefix_shared if args.impl == "segctl" and orpo else None,
        "arch": args.arch, "layers": args.layers,
        "dim": args.dim,
        "intermediate": getattr(margs, "intermediate_size", None),
        "heads": getattr(margs, "num_attention_heads", None),
        "kv_heads": getattr(margs, "num_key_value_heads", None),
        "head_dim": getattr(margs, "head_dim", None),
        "tie": getattr(margs, "tie_word_embeddings", None),
        "quantize": args.quantize,
        # Gemma-4's variants (absent: the model's own)
        **{k: v for k, v in (("kv_shared", args.kv_shared), ("layer_input", args.layer_input),
                             ("double_mlp", args.double_mlp)) if v is not None},
        # what the planner's ModelInfo.weight_bytes is (the LoRA layers' few bytes too)
        "weight_bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        "build_s": round(build_s, 1),  # making the random model (a first process: its kernels too)
        "vocab": args.vocab, "seq": args.seq, "dtype": args.dtype,
        "segment_size": args.segment_size if args.mode == "segmented" else None,
        "head_chunk": args.head_chunk if args.impl == "segctl" else None,
        "attn_block": args.attn_block if args.mode == "segmented" else None,
        "mlp_chunk": (args.mlp_chunk or None) if args.impl == "segctl" else None,
        "offload": (args.offload or None) if args.impl == "segctl" else None,
        "rows": sum(parts.rowwise or []) if args.impl == "segctl" and args.mlp_chunk else None,
        # layers whose MLP runs mlp_chunk rows at a time, and why a layer class does
        # not run rows apart (engine/rows.py's probe)
        "tokenwise": sum(bool(t) for t in parts.tokenwise or [])
        if args.impl == "segctl" and args.mlp_chunk else None,
        "whole_rows": (parts.whole_rows or None) if args.impl == "segctl" else None,
        "peak_gb": round(max(peaks), 4),
        "tokens_per_gb": round(args.seq / max(peaks)) if max(peaks) > 0 else None,
        "step_s": round(statistics.median(times[1:] if len(times) > 1 else times), 4),
        "first_step_s": round(times[0], 4),
        "loss": round(losses[0], 4),
        "steps": args.steps,
        "optimizer_state": args.optimizer_state or None,
        "device": str(mx.default_device()),
        "device_name": _device_name(),
    }
    row["predicted_gb"] = planned_gb(model, row, args) if args.impl == "segctl" else None
    if args.phases:
        # `phases`: the step's peak up to each phase's end; `phase_peaks`: its own
        labels = [label for label, _ in phases]
        row["phases"] = [[label, round(p, 4)]
                         for label, p in zip(labels, accumulate((p for _, p in phases), max))]
        row["phase_peaks"] = [round(p, 4) for _, p in phases]
        # where the last step's time went: forward, head, backward, the rest (update)
        if clock and "head" in labels:
            h = labels.index("head")
            row["phase_s"] = {"fwd": round(clock[h - 1] - starts, 3),
                              "head": round(clock[h] - clock[h - 1], 3),
                              "bwd": round(clock[-1] - clock[h], 3),
                              "update": round(starts + times[-1] - clock[-1], 3)}
    return row


def planned_gb(model, row: dict, args) -> float | None:
    """What the planner (orchestrator/planner.py) predicts for this row's step, from
    the model's config (as `segctl plan` reads config.json) and the bytes its
    weights took: a row checks the planner where it is measured. None where the
    planner has no figure for it."""
    from segctl.orchestrator.planner import ModelInfo, predict_gb, shape_facts
    try:
        margs = getattr(model, "args", None)
        info = ModelInfo(**shape_facts(dict(vars(margs)), "the model's args"),
                         weight_bytes=row["weight_bytes"],
                         act_bytes=4 if row["dtype"] == "float32" else 2)
        got = predict_gb(info, seq_len=row["seq"], segment_size=row["segment_size"] or 0,
                         head_chunk=args.head_chunk, attn_block=args.attn_block or 0,
                         mlp_chunk=args.mlp_chunk or 0, offload=bool(args.offload),
                         grad_checkpoint=args.mode == "checkpoint", method=args.method)
    except (ValueError, TypeError, KeyError):
        return None
    return round(got, 4)


def _device_name() -> str | None:
    try:
        info = mx.device_info()
        return info.get("device_name") or info.get("architecture")
    except Exception:
        return None


def _mlx_lm_step(model, optimizer, grad_ckpt: bool):
    # mlx-lm 0.32's trainer step, as `mlx_lm.tuner.trainer.train` builds it.
    from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
    if grad_ckpt:
        grad_checkpoint(model.layers[0])
    loss_value_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch):
        (lvalue, toks), grad = loss_value_and_grad(model, *batch)
        optimizer.update(model, grad)
        return lvalue, toks

    def run(batch):
        lvalue, toks = step(batch)
        mx.eval(state, lvalue, toks)
        return lvalue
    return run


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3*dim)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default dim//64)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="K/V heads (default max(1, dim//128))")
    p.add_argument("--head-dim", type=int, default=None, help="default 64")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None,
                   help="tied embeddings (default: tied; Llama-3.1-8B is --no-tie)")
    p.add_argument("--rope-theta", type=float, default=None, help="default 1e6")
    p.add_argument("--kv-shared", type=int, default=None, metavar="N",
                   help="gemma4_text: the last N layers read an earlier layer's K/V "
                        "(default 20/35 of --layers; 0: every layer has its own)")
    p.add_argument("--layer-input", type=int, default=None, metavar="WIDTH",
                   help="gemma4_text: each layer's per-layer input width (default 256; 0: none)")
    p.add_argument("--double-mlp", action=argparse.BooleanOptionalAction, default=None,
                   help="gemma4_text: the layers reading a donor's K/V have an MLP twice as "
                        "wide (default: they do, as Gemma-4-E2B's)")
    p.add_argument("--quantize", type=int, default=0, metavar="BITS",
                   help="quantize the base model to BITS before LoRA (QLoRA; 0 = off)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", default="segmented", choices=["segmented", "plain", "checkpoint"])
    p.add_argument("--segment-size", type=int, default=1)
    p.add_argument("--head-chunk", type=int, default=DEFAULT_HEAD_CHUNK)
    p.add_argument("--attn-block", type=int, default=0,
                   help="segmented: attention backward in blocks of this many query rows (0 = off)")
    p.add_argument("--impl", default="segctl", choices=["segctl", "mlx-lm", "mlx-lm-lora"],
                   help="mlx-lm-lora: its ORPO trainer step (--method orpo only)")
    p.add_argument("--method", default="sft", choices=["sft", "orpo"])
    p.add_argument("--prefix-shared", action="store_true",
                   help="orpo: one pass over [prompt | chosen | rejected]")
    p.add_argument("--mlp-chunk", type=int, default=0,
                   help="segctl: MLP in chunks of this many rows (0 = off; passed only when set)")
    p.add_argument("--offload", default=None, metavar="DIR",
                   help="segctl: offload boundary activations to DIR (passed only when set)")
    p.add_argument("--rows", action=argparse.BooleanOptionalAction, default=True,
                   help="segctl: with --mlp-chunk, run the layers that may rows apart, a chunk at "
                        "a time (engine/rows.py); --no-rows keeps every layer's light parts whole")
    p.add_argument("--phases", action="store_true", help="add per-phase peaks (segctl only)")
    p.add_argument("--optimizer-state", action="store_true",
                   help="make the optimizer's state before the first step, so a one-step run "
                        "peaks as every later step does")
    p.add_argument("--cpu", action="store_true", help="force the CPU device")
    args = p.parse_args(argv)
    variants = (args.kv_shared, args.layer_input, args.double_mlp)
    if args.arch != "gemma4_text" and any(v is not None for v in variants):
        p.error(f"--kv-shared, --layer-input and --double-mlp are gemma4_text's, "
                f"not {args.arch}'s")
    return args


if __name__ == "__main__":
    a = parse()
    if {"mlx-lm-lora": "orpo", "mlx-lm": "sft"}.get(a.impl, a.method) != a.method:
        sys.exit(f"--impl {a.impl} runs {'ORPO' if a.impl == 'mlx-lm-lora' else 'SFT'} only")
    if a.cpu:
        mx.set_default_device(mx.cpu)
    print(json.dumps(run(a)), flush=True)
    sys.exit(0)
