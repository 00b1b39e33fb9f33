"""Does `mx.compile` merge a segment's recompute with its forward?

A segmented step runs each segment's forward twice: once to keep its output
boundary, once again under `mx.vjp` for its backward (docs/engine.md). Kept
layers (StepMemory.keep) ran the forward once, but uncompiled: MLX traces a
compiled function's original graph when its inputs are being differentiated.
Another way would be one compiled function holding the forward, the head and
the vjp's recompute: `mx.compile` simplifies its graph, merging an operation
whose primitive and inputs equal another's, so the recompute could become the
forward itself, fused, with only what the backward reads kept. Whether it does
depends on every primitive of the layer comparing equal, which this measures
on layers of an mlx-lm model (no LoRA: the input's gradient alone):

  fwd            the layers' forward, compiled
  bwd            their recompute and vjp under a given cotangent, compiled
  head           the chunked loss head's log p and its gradient, compiled
  segmented      fwd, head and bwd as three graphs, each evaluated (today's step)
  one            fwd, head and the vjp in one compiled function
  one_vjp        the same, the forward taken from a vjp (as under a gradient:
                 MLX's attention then keeps its log-sum-exp, which a plain
                 forward does not, so only this forward can equal the recompute's)
  simple, simple_vjp   the same two without the head (cotangent = out / 2)
  joint          no forward of its own: one compiled vjp of the layers and the
                 head together, the forward run once inside it (as mlx-lm's
                 compiled step runs), each head chunk under `mx.checkpoint` so
                 its logits are made again in the backward instead of kept

Where the merge happens, `one` takes about bwd + head, not fwd + bwd + head;
`peak_gb` says what the head in the same graph costs. A `check` row compares
each one-graph function's loss and input gradient with `segmented`'s.

  python -m bench.merge [--shape cpu|qwen3-0.6b] [--layers N] [--rows B]
                        [--tokens T] [--repeats N] [--masks causal,none]

Each function runs once untimed, then --repeats times: the median's seconds
and the largest peak. One JSON row a function on stdout, then a Markdown table
on stderr (each function's seconds against today's three graphs; `python -m
bench.suite mac` runs this at the Qwen3-0.6B shape and prints the table after
its own). Bad options exit 2 with one line on stderr."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

from bench.throughput import _Parser, _positive

SHAPES = {   # (dim, heads, kv_heads, head_dim, intermediate, vocab, dtype)
    "cpu": (512, 8, 4, 64, 1536, 32000, "float32"),
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 151936, "bfloat16"),
}
HEAD_CHUNK = 1024   # tokens of the head at a time inside one graph


def build(shape: str, layers: int):
    import mlx.core as mx
    from mlx_lm.models import qwen3
    dim, heads, kv, hd, inter, vocab, dtype = SHAPES[shape]
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=dim, num_hidden_layers=layers,
                           intermediate_size=inter, num_attention_heads=heads,
                           num_key_value_heads=kv, head_dim=hd, rms_norm_eps=1e-6,
                           vocab_size=vocab, max_position_embeddings=40960, rope_theta=1e6,
                           tie_word_embeddings=True)
    model = qwen3.Model(args)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, getattr(mx, dtype)


def functions(model, B: int, T: int, mask):
    """{name: (function, its arguments' names)} over h [B, T, D]; the loss reads
    each row's second half."""
    import mlx.core as mx
    import mlx.nn as nn
    inner = model.model
    D = inner.norm.weight.shape[0]
    vocab = inner.embed_tokens.weight.shape[0]
    targets = mx.random.randint(0, vocab, (B * (T - T // 2),), key=mx.random.key(1))

    def layers(x):
        for layer in inner.layers:
            x = layer(x, mask=mask)
        return x

    def nll(y, t):   # a head chunk's summed -log p of its targets t
        logits = inner.embed_tokens.as_linear(inner.norm(y)).astype(mx.float32)
        return -mx.take_along_axis(nn.log_softmax(logits, -1), t, -1).sum()

    def head(out):
        hs = out[:, T // 2:].reshape(-1, D)
        lps, gs = [], []
        for i in range(0, hs.shape[0], HEAD_CHUNK):
            t = targets[i:i + HEAD_CHUNK, None]
            (lp,), (g,) = mx.vjp(lambda y, t=t: [nll(y, t)], [hs[i:i + HEAD_CHUNK]],
                                 [mx.array(1.0)])
            lps.append(lp)
            gs.append(g)
        g = mx.concatenate(gs).reshape(B, T - T // 2, D)
        return sum(lps), mx.concatenate([mx.zeros((B, T // 2, D), g.dtype), g], 1)

    def vjp(x, c):
        return mx.vjp(lambda y: [layers(y)], [x], [c])[1][0]

    def vjp_out(x):   # unused cotangent: only the forward is computed
        return mx.vjp(lambda y: [layers(y)], [x], [mx.zeros(x.shape, x.dtype)])[0][0]

    def joint(x):
        def loss(y):
            hs = layers(y)[:, T // 2:].reshape(-1, D)
            return [sum(mx.checkpoint(partial(nll, t=targets[i:i + HEAD_CHUNK, None]))(
                hs[i:i + HEAD_CHUNK]) for i in range(0, hs.shape[0], HEAD_CHUNK))]
        (lp,), (dx,) = mx.vjp(loss, [x], [mx.array(1.0)])
        return lp, dx

    fwd, bwd, head_c = mx.compile(layers), mx.compile(vjp), mx.compile(head)

    def segmented(x):
        out = fwd(x)
        mx.eval(out)
        loss, c = head_c(out)
        mx.eval(loss, c)
        return loss, bwd(x, c)

    def one(forward, with_head):
        def f(x):
            out = forward(x)
            loss, c = head(out) if with_head else (out.sum(), out * 0.5)
            return loss, vjp(x, c)
        return mx.compile(f)

    return {"fwd": (fwd, "h"), "bwd": (bwd, "hc"), "head": (head_c, "h"),
            "segmented": (segmented, "h"), "one": (one(layers, True), "h"),
            "one_vjp": (one(vjp_out, True), "h"), "simple": (one(layers, False), "h"),
            "simple_vjp": (one(vjp_out, False), "h"), "joint": (mx.compile(joint), "h")}


def timed(fn, args, repeats: int):
    import mlx.core as mx
    out = fn(*args)
    mx.eval(out)
    seconds, peaks = [], []
    for _ in range(repeats):
        mx.clear_cache()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        out = fn(*args)
        mx.eval(out)
        seconds.append(time.perf_counter() - tic)
        peaks.append(mx.get_peak_memory() / 1e9)
    return out, round(statistics.median(seconds), 4), round(max(peaks), 4)


def run(args) -> list[dict]:
    import mlx.core as mx
    model, dtype = build(args.shape, args.layers)
    D = SHAPES[args.shape][0]
    h = (mx.random.normal((args.rows, args.tokens, D), key=mx.random.key(0)) * 0.5).astype(dtype)
    rows = []
    for mask in args.masks:
        fns = functions(model, args.rows, args.tokens, "causal" if mask == "causal" else None)
        results = {}
        for name, (fn, takes) in fns.items():
            results[name], seconds, peak = timed(fn, [h] * len(takes), args.repeats)
            rows.append(dict(bench="merge", fn=name, mask=mask, seconds=seconds, peak_gb=peak,
                             shape=args.shape, layers=args.layers, rows=args.rows,
                             tokens=args.tokens, device=str(mx.default_device()),
                             mlx=mx.__version__))
            print(json.dumps(rows[-1]), flush=True)
        ref_loss, ref_dx = results["segmented"]
        for name in ("one", "one_vjp", "joint"):
            loss, dx = results[name]
            diff = mx.abs(dx.astype(mx.float32) - ref_dx.astype(mx.float32)).max().item()
            scale = mx.abs(ref_dx.astype(mx.float32)).max().item()
            rows.append(dict(bench="merge", fn="check", of=name, mask=mask,
                             loss=[ref_loss.item(), loss.item()],
                             dx_max_rel=round(diff / max(scale, 1e-30), 8)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _masks(text: str) -> list[str]:
    masks = text.split(",")
    if not masks or any(m not in ("causal", "none") for m in masks):
        raise argparse.ArgumentTypeError(f"{text!r}: causal, none or both (comma-separated)")
    return masks


def table(rows: list[dict]) -> str:
    """The rows as Markdown, one table a mask: seconds and peak, and seconds as a
    ratio of today's three graphs'; then the checks."""
    out = []
    for mask in dict.fromkeys(r["mask"] for r in rows):
        timed = [r for r in rows if r["mask"] == mask and r["fn"] != "check"]
        ref = next((r["seconds"] for r in timed if r["fn"] == "segmented"), None)
        first = timed[0] if timed else {}
        out += [f"bench.merge, {first.get('shape')} shape, {first.get('layers')} layers, "
                f"{first.get('rows')} x {first.get('tokens')} tokens, mask {mask}, "
                f"{first.get('device')}:", "",
                "| function | seconds | peak GB | vs segmented |", "|---|---|---|---|"]
        for r in timed:
            ratio = f"{r['seconds'] / ref:.2f}x" if ref else ""
            out.append(f"| {r['fn']} | {r['seconds']} | {r['peak_gb']} | {ratio} |")
        checks = [f"{r['of']}: loss {r['loss'][1]} against {r['loss'][0]}, input gradient "
                  f"within {r['dx_max_rel']} (relative)"
                  for r in rows if r["mask"] == mask and r["fn"] == "check"]
        out += [""] + checks + [""] if checks else [""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    """The rows (each printed as it lands); no table."""
    p = _Parser(prog="python -m bench.merge", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--layers", type=_positive, default=4)
    p.add_argument("--rows", type=_positive, default=4, help="sequences side by side")
    p.add_argument("--tokens", type=_positive, default=512, help="tokens a sequence")
    p.add_argument("--repeats", type=_positive, default=3)
    p.add_argument("--masks", type=_masks, default=["causal", "none"])
    return run(p.parse_args(argv))


def cli(argv: list[str] | None = None) -> list[dict]:
    rows = main(argv)
    print(table(rows), file=sys.stderr)
    return rows


if __name__ == "__main__":
    cli(sys.argv[1:])
