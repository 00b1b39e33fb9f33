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

Prefix-shared ORPO runs [prompt P | chosen | rejected] as one sequence in which
rejected rows must not see chosen columns. Its mask is a `BlockMask`, not an
[L, L] array: an array mask makes MLX's attention unfused and holds [H, L, L]
scores per layer (13.9 GB against 4.6 GB two-branch at 8K on the H200,
bench/results/h200-orpo-v0-densemask.jsonl). Its attention is two causal calls
instead, each fused where MLX fuses: prompt+chosen rows over their own keys, and
rejected rows over [prompt | rejected] keys, where "causal" (lower-right
aligned) is exactly "the whole prompt and the rejected tokens so far". With a
sliding window the calls take window masks over positions, as mlx-lm's do.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class BlockMask:
    """The attention mask of [prompt | chosen | rejected] rows: rows before `split`
    are plain causal; rows from `split` on see the first `prompt` keys and the
    rejected keys up to themselves, at positions restarting at `prompt`."""
    prompt: int
    split: int
    window: int | None = None

    def part(self, i: int, j: int):
        """(key ranges, mask) for query rows [i, j), all on one side of `split`."""
        if j <= self.split:
            ranges, q0 = [(0, j)], i
        else:
            ranges, q0 = [(0, self.prompt), (self.split, j)], self.prompt + i - self.split
        n_keys = sum(b - a for a, b in ranges)
        if not self.window or q0 + (j - i) <= self.window:
            return ranges, "causal"
        q = mx.arange(q0, q0 + j - i)[:, None]
        k = mx.arange(n_keys)[None, :]
        return ranges, (k <= q) & (q - k < self.window)

    def parts(self, i: int, j: int):
        """part() of [i, j), cut at `split` when the rows span it."""
        cuts = [i] + ([self.split] if i < self.split < j else []) + [j]
        return [(a, b, *self.part(a, b)) for a, b in zip(cuts, cuts[1:])]


def attend(q, k, v, scale, mask):
    """Attention of q over k, v under `mask`, a BlockMask included."""
    if not isinstance(mask, BlockMask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    outs = []
    for i, j, ranges, m in mask.parts(0, q.shape[2]):
        kk, vv = _gather(k, ranges), _gather(v, ranges)
        outs.append(mx.fast.scaled_dot_product_attention(q[:, :, i:j], kk, vv, scale=scale, mask=m))
    return mx.concatenate(outs, axis=2)


def block_mask_sdpa(original):
    """An mlx-lm `scaled_dot_product_attention` that also takes a BlockMask."""
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(mask, BlockMask):
            _check(cache, sinks)
            return attend(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return sdpa


def _gather(x, ranges):
    if len(ranges) == 1:
        a, b = ranges[0]
        return x[:, :, a:b]
    return mx.concatenate([x[:, :, a:b] for a, b in ranges], axis=2)


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
    with swapped_sdpa([layer], lambda original: sdpa):
        yield


@contextmanager
def swapped_sdpa(layers, make):
    """Within the block, the model modules of `layers` call make(their sdpa)."""
    modules = {sys.modules[type(m).__module__] for layer in layers
               for _, m in layer.named_modules()}
    modules = {m for m in modules if hasattr(m, "scaled_dot_product_attention")}
    saved = {m: m.scaled_dot_product_attention for m in modules}
    try:
        for m in modules:
            m.scaled_dot_product_attention = make(saved[m])
        yield
    finally:
        for m, original in saved.items():
            m.scaled_dot_product_attention = original


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
            return attend(q, k, v, scale, mask)

        @attn.vjp
        def attn_vjp(primals, cotangent, output):
            return backward(primals, cotangent, mask, scale)

        return attn(queries, keys, values)
    return sdpa


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def _blocked_grads(q, k, v, d_out, mask, scale, block):
    L, S = q.shape[2], k.shape[2]
    dq_blocks = []
    dk = mx.zeros(k.shape, dtype=mx.float32)
    dv = mx.zeros(v.shape, dtype=mx.float32)
    for i in range(0, L, block):
        j = min(i + block, L)
        for a, b, ranges, m in _block_parts(mask, i, j, L, S):
            _, (dqb, dkb, dvb) = mx.vjp(
                lambda x, y, z: [mx.fast.scaled_dot_product_attention(x, y, z, scale=scale,
                                                                      mask=m)],
                [q[:, :, a:b], _gather(k, ranges), _gather(v, ranges)], [d_out[:, :, a:b]])
            dk = _add_ranges(dk, dkb, ranges)
            dv = _add_ranges(dv, dvb, ranges)
            mx.eval(dqb, dk, dv)
            dq_blocks.append(dqb)
    return mx.concatenate(dq_blocks, axis=2), dk.astype(k.dtype), dv.astype(v.dtype)


def _block_parts(mask, i, j, L, S):
    """(rows a..b, key ranges, mask) covering query rows [i, j)."""
    if isinstance(mask, BlockMask):
        return mask.parts(i, j)
    causal = isinstance(mask, str) and mask == "causal"
    end = j + (S - L) if (causal or isinstance(mask, mx.array)) else S
    # "causal" is lower-right aligned, so block rows i..j over keys [:end] keep
    # their own causal pattern; an array mask is sliced to the same rectangle.
    m = mask[..., i:j, :end] if isinstance(mask, mx.array) else mask
    return [(i, j, [(0, end)], m)]


def _add_ranges(acc, part, ranges):
    part = part.astype(acc.dtype)
    at = 0
    for a, b in ranges:
        piece = part[:, :, at:at + b - a]
        at += b - a
        acc = mx.concatenate([acc[:, :, :a], acc[:, :, a:b] + piece, acc[:, :, b:]], axis=2)
    return acc
