"""A layer backward whose attention holds one block of queries' scores at a time.

MLX's attention backward materialises the whole [H, L, L] score matrix and its
gradient for a layer: at 16K tokens that one transient is ~27 GB on a
Qwen3-0.6B shape, far above everything else the segmented step keeps. The score
blocks cannot be bounded inside one vjp (arrays evaluated while a transform
traces keep their graphs), so a layer's backward runs in two passes:

1. record: vjp of the layer with attention swapped for a function that records
   its q, k, v and the incoming cotangent dO (and passes zeros back);
2. outside any transform, dq, dk, dv are computed one block of `block` query
   rows at a time, each block evaluated (and its scores freed) before the next;
   a block of causal attention needs only the keys up to its last row;
3. replay: vjp of the layer again, attention now handing back those dq, dk, dv.

The swap replaces the `scaled_dot_product_attention` name that mlx-lm's model
modules call, only inside `_swapped`, and restores it on exit: nothing leaks to
other models in the process.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx


def layer_vjp(layer, fn, primals: list, cotangents: list, block: int) -> list:
    """mx.vjp(fn, primals, cotangents)[1] for a function `fn` that runs `layer` once,
    with the layer's attention backward taken in blocks of `block` query rows.
    `fn` must draw the same dropout masks on every call (the step seeds per layer)."""
    box: dict = {}
    with _swapped(layer, _recording(box)):
        _, cots = mx.vjp(fn, primals, cotangents)
    if "q" not in box:  # no attention was swapped, so the record pass is the plain vjp
        return cots
    q, k, v, d_out = box["q"], box["k"], box["v"], box["d_out"]
    mx.eval(q, k, v, d_out)
    grads = _blocked_grads(q, k, v, d_out, box["mask"], box["scale"], block)
    box.clear()
    with _swapped(layer, _replaying(grads)):
        _, cots = mx.vjp(fn, primals, cotangents)
    return cots


@contextmanager
def _swapped(layer, sdpa):
    modules = {sys.modules[type(m).__module__] for _, m in layer.named_modules()}
    modules = {m for m in modules if hasattr(m, "scaled_dot_product_attention")}
    saved = {m: m.scaled_dot_product_attention for m in modules}
    try:
        for m in modules:
            m.scaled_dot_product_attention = sdpa
        yield
    finally:
        for m, original in saved.items():
            m.scaled_dot_product_attention = original


def _fused(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _check(cache, sinks):
    if cache is not None or sinks is not None:
        raise ValueError("blockwise attention backward supports no cache and no sinks")


def _recording(box):
    def record(primals, cotangent, mask, scale):
        q, k, v = primals
        box.update(q=q, k=k, v=v, d_out=_first(cotangent), mask=mask, scale=scale)
        return mx.zeros_like(q), mx.zeros_like(k), mx.zeros_like(v)
    return _with_vjp(record)


def _replaying(grads):
    return _with_vjp(lambda primals, cotangent, mask, scale: grads)


def _with_vjp(backward):
    """An sdpa with the fused forward and `backward` as its vjp."""
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        _check(cache, sinks)

        @mx.custom_function
        def attn(q, k, v):
            return _fused(q, k, v, scale, mask)

        @attn.vjp
        def attn_vjp(primals, cotangent, output):
            return backward(primals, cotangent, mask, scale)

        return attn(queries, keys, values)
    return sdpa


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def _blocked_grads(q, k, v, d_out, mask, scale, block):
    causal = isinstance(mask, str) and mask == "causal"
    L, S = q.shape[2], k.shape[2]
    dq_blocks = []
    dk = mx.zeros(k.shape, dtype=mx.float32)
    dv = mx.zeros(v.shape, dtype=mx.float32)
    for i in range(0, L, block):
        j = min(i + block, L)
        end = j + (S - L) if (causal or isinstance(mask, mx.array)) else S
        # "causal" is lower-right aligned, so block rows i..j over keys [:end] keep
        # their own causal pattern; an array mask is sliced to the same rectangle.
        m = mask[..., i:j, :end] if isinstance(mask, mx.array) else mask
        _, (dqb, dkb, dvb) = mx.vjp(lambda a, b, c: [_fused(a, b, c, scale, m)],
                                    [q[:, :, i:j], k[:, :, :end], v[:, :, :end]],
                                    [d_out[:, :, i:j]])
        dk = _add_prefix(dk, dkb, end)
        dv = _add_prefix(dv, dvb, end)
        mx.eval(dqb, dk, dv)
        dq_blocks.append(dqb)
    return mx.concatenate(dq_blocks, axis=2), dk.astype(k.dtype), dv.astype(v.dtype)


def _add_prefix(acc, part, end):
    part = part.astype(acc.dtype)
    if end == acc.shape[2]:
        return acc + part
    return mx.concatenate([acc[:, :, :end] + part, acc[:, :, end:]], axis=2)
