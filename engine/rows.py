"""A decoder layer run a chunk of rows at a time, its attention over the whole row.

At long context a layer's memory is its whole-row work. engine/layer.py cuts
the two heavy ops (attention, the MLP) into pieces, but the rest of the layer
(norms, q/k/v/o projections with their LoRA, RoPE, residuals) still runs on
the whole row, and inside a vjp each of those ~30 [L, dim] arrays is alive at
once: 128K tokens of an 8B shape is ~1 GB per array. Yet every one of those
ops is a function of its own row: only attention mixes rows. So a layer is

    (q, k, v) = P(h)        rows apart: norm, projections, RoPE at the row's position
    o = attention(q, k, v)  the whole row, in blocks of query rows
    out = Q(h, o)           rows apart: o's projection, residuals, the MLP

and P and Q are the layer's own code, run on rows [a, b) with mlx-lm's
`scaled_dot_product_attention` swapped for a stand-in: while P runs it takes
the chunk's q, k, v (and the layer's output is thrown away); while Q runs it
hands back o's rows [a, b). RoPE sees the chunk's absolute positions through
the attention's `rope` (`RunRope`). The backward is the same three in reverse:
Q's vjp per chunk (d h, d o, d parameters), attention's blocked backward
(dq, dk, dv), P's vjp per chunk (d h, d parameters). Nothing larger than q, k,
v, o, their gradients and the layer's input and output gradient is ever whole.

That a layer may be cut so is not assumed from its class: `refusal` runs one
on PROBE_ROWS rows whole and cut, forward and backward, and only a layer that
gives the same is cut (once per layer class, at load; why a class was refused is
kept, and a job's start says it). A layer whose attention is
not one sdpa call of mlx-lm's (hand-written scores other than engine/capped.py's
soft cap, K/V from another layer, per-layer inputs) or whose LoRA dropout is on
keeps engine/layer.py's way. Attention sinks and a soft cap go with the call to
every block.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from segctl.schemas.limits import error_line

from . import attention
from .layer import PROBE_ROWS, dropout_off, same_cut, set_params, spans


class RunRope(nn.Module):
    """A layer's RoPE applied run by run from row `start` on: rows [a, b) of a run
    (a, b, p) sit at positions p, p + 1, ... (prefix-shared ORPO restarts the
    rejected rows at the prompt's end). No runs: row r is position r."""

    def __init__(self, rope, runs=None, start: int = 0):
        super().__init__()
        # Held as a bound method, not a child module, so the layer's parameter
        # tree is the same with the wrapper in place.
        self._rope = rope
        self._runs = runs
        self._start = start

    def __call__(self, x, offset=0):
        n, s = x.shape[-2], self._start
        if not self._runs:
            return self._rope(x, offset=offset + s)
        pieces = []
        for a, b, p in self._runs:
            lo, hi = max(a, s), min(b, s + n)
            if lo < hi:
                pieces.append(self._rope(x[..., lo - s:hi - s, :], offset=offset + p + lo - a))
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-2)


def ropes(layer) -> list:
    """The modules of a layer that hold its RoPE as `rope`."""
    return [m for _, m in layer.named_modules() if isinstance(m.get("rope"), nn.Module)]


class _NotRowwise(Exception):
    pass


class _Attn:
    """The stand-in for a layer's one attention call while a chunk of rows runs."""

    def __init__(self, out=None):
        self.out = out       # o's rows for this chunk (Q), or None (P: take q, k, v)
        self.taken = None    # (q, k, v) of the chunk
        self.scale = None
        self.mask = None
        self.sinks = None    # per head, the same for every chunk (gpt-oss)
        self.softcap = None  # soft-capped scores (engine/capped.py)
        self.calls = 0

    def make(self, original):
        def sdpa(queries, keys, values, cache, scale, mask, sinks=None, softcap=None):
            self.calls += 1
            if cache is not None or self.calls > 1:
                raise _NotRowwise("attention with a cache or more than one call")
            self.taken, self.scale, self.mask = (queries, keys, values), scale, mask
            self.sinks, self.softcap = sinks, softcap
            return queries if self.out is None else self.out
        return sdpa


@contextmanager
def _chunk(layer, start: int, attn: _Attn):
    """Within the block, `layer` runs rows from `start`: its ropes at their positions,
    its attention through `attn`."""
    holders = ropes(layer)
    saved = [m["rope"] for m in holders]
    try:
        for m, rope in zip(holders, saved):
            base, runs = (rope._rope, rope._runs) if isinstance(rope, RunRope) else \
                (rope.__call__, None)
            m.rope = RunRope(base, runs, start)
        with attention.swapped_sdpa([layer], attn.make):
            yield attn
    finally:
        for m, rope in zip(holders, saved):
            m.rope = rope


def _qkv(layer, call, h, mask, chunk):
    """(q, k, v, the _Attn that took the last chunk: its scale, mask, sinks and soft
    cap) over the whole row, P run a chunk at a time outside any transform."""
    parts = []   # a row has at least one chunk: `attn` is the last one's
    for a, b in spans(h.shape[1], chunk):
        with _chunk(layer, a, _Attn()) as attn:
            call(h[:, a:b], mask)
        if attn.taken is None or not (attn.mask is mask or (
                isinstance(mask, str) and attn.mask == mask)):
            raise _NotRowwise("no attention call, or not under the layer's own mask")
        mx.eval(attn.taken)
        parts.append(attn.taken)
    q, k, v = (mx.concatenate([p[j] for p in parts], axis=2) for j in range(3))
    return q, k, v, attn


def _attended(layer, call, h, mask, chunk):
    """(q, k, v, the call's _Attn, o): P chunk by chunk, then attention in its
    blocks, each evaluated as it is made."""
    q, k, v, how = _qkv(layer, call, h, mask, chunk)
    with attention.eager_blocks():
        o = attention.attend(q, k, v, how.scale, mask, how.sinks, how.softcap)
    mx.eval(o)
    return q, k, v, how, o


def forward(layer, call, h, mask, chunk: int) -> mx.array:
    """call(h, mask) (the layer's output) with every row-wise op `chunk` rows at a
    time and attention as its mask blocks it; outside any transform."""
    q, k, v, _, o = _attended(layer, call, h, mask, chunk)
    del q, k, v
    outs = []
    for a, b in spans(h.shape[1], chunk):
        with _chunk(layer, a, _Attn(o[:, :, a:b])):
            outs.append(call(h[:, a:b], mask))
        mx.eval(outs[-1])
    return mx.concatenate(outs, axis=1)


def vjp(layer, call, h, mask, d_out, names: list[str], values: list, chunk: int,
        block: int) -> tuple:
    """(d h, [d p for p in values]) of call(h, mask) with cotangent d_out, where
    `values` are the layer's trainable parameters `names`; in chunks and blocks
    as `forward`. The layer's parameters are `values` again on return."""
    n = h.shape[1]
    q, k, v, how, o = _attended(layer, call, h, mask, chunk)

    acc = None

    def add(dp):
        nonlocal acc
        acc = list(dp) if acc is None else [s + g for s, g in zip(acc, dp)]

    dhs, dos, deltas = [], [], []
    tiled = attention.tiles_keys(n, how.sinks)
    try:
        # Q: each chunk's output from its rows of h and of o.
        for a, b in spans(n, chunk):
            def q_part(x, oc, *p):
                set_params(layer, names, p)
                with _chunk(layer, a, _Attn(oc)):
                    return call(x, mask)
            _, (dx, do, *dp) = mx.vjp(q_part, [h[:, a:b], o[:, :, a:b], *values],
                                      [d_out[:, a:b]])
            add(dp)
            if tiled:  # rowsum(dO O): what the tiled backward needs of o, so o can go
                deltas.append(attention.delta_of(do, o[:, :, a:b]))
            mx.eval(dx, do, acc, deltas)
            dhs.append(dx)
            dos.append(do)
        del o
        do = mx.concatenate(dos, axis=2)
        delta = mx.concatenate(deltas, axis=2) if tiled else None
        del dos, deltas
        dq, dk, dv, *d_sinks = attention.blocked_grads(q, k, v, do, mask, how.scale, block or n,
                                                       sinks=how.sinks, delta=delta,
                                                       softcap=how.softcap)
        del q, k, v, do, delta
        # Sinks the layer trains (a parameter of its own) take their gradient here:
        # P hands the attention its sinks as they are, so its vjp gives them none.
        trained = [j for j, value in enumerate(values) if d_sinks and value is how.sinks]
        if trained and acc is not None:
            acc[trained[0]] = acc[trained[0]] + d_sinks[0]
        # P: each chunk's q, k, v from its rows of h.
        for j, (a, b) in enumerate(spans(n, chunk)):
            def p_part(x, *p):
                set_params(layer, names, p)
                with _chunk(layer, a, _Attn()) as attn:
                    call(x, mask)
                return list(attn.taken)
            _, (dx, *dp) = mx.vjp(p_part, [h[:, a:b], *values],
                                  [dq[:, :, a:b], dk[:, :, a:b], dv[:, :, a:b]])
            add(dp)
            dhs[j] = dhs[j] + dx
            mx.eval(dhs[j], acc)
    finally:
        set_params(layer, names, values)
    return mx.concatenate(dhs, axis=1), acc


def usable(layer, mask) -> bool:
    """Whether a layer that passed `rowwise` may be cut now: its LoRA dropout is off
    (a chunk would draw other masks than the whole row does) and its mask is not an
    array (a layer may slice one to its rows)."""
    return (mask is None or isinstance(mask, (str, attention.BlockMask))) and dropout_off(layer)


def rowwise(layer, call, dim: int, dtype, masks=("causal",)) -> bool:
    """Whether `layer` may run rows apart (`refusal` has nothing against it)."""
    return refusal(layer, call, dim, dtype, masks) is None


def refusal(layer, call, dim: int, dtype, masks=("causal",)) -> str | None:
    """Why `layer` run through `forward` and `vjp` in two chunks (its attention
    backward in blocks of a third of them) does not give what it gives on
    PROBE_ROWS rows whole under each of `masks` (its output, its input gradient and
    its trainable parameters' gradients); None when it does."""
    key = mx.random.key(11)  # its own key: the caller's random stream is left alone
    k1, k2 = mx.random.split(key)
    h = mx.random.normal((1, PROBE_ROWS, dim), key=k1).astype(dtype)
    g = mx.random.normal((1, PROBE_ROWS, dim), key=k2).astype(dtype)
    names = [n for n, _ in tree_flatten(layer.trainable_parameters())]
    values = [v for _, v in tree_flatten(layer.trainable_parameters())]
    try:
        with attention.swapped_sdpa([layer], attention.block_mask_sdpa):
            for mask in masks:
                differs = _cut_differs(layer, call, h, g, mask, names, values)
                if differs:
                    return f"rows apart give another {differs} than the whole row"
    except Exception as e:   # what raised, in one line: the device's words included
        return "the row-wise probe raised " + error_line(e, 200)
    return None


def _cut_differs(layer, call, h, g, mask, names, values) -> str | None:
    """What of the layer's output and gradients differs cut from whole, or None."""
    def whole(x, *p):
        set_params(layer, names, p)
        return call(x, mask)
    try:
        ref, (rdh, *rdp) = mx.vjp(whole, [h, *values], [g])
        mx.eval(ref, rdh, rdp)
    finally:
        set_params(layer, names, values)
    chunk = PROBE_ROWS // 2
    out = forward(layer, call, h, mask, chunk)
    dh, dp = vjp(layer, call, h, mask, g, names, values, chunk, PROBE_ROWS // 3)
    for what, a, b in zip(["output", "input gradient", *names], [ref[0], rdh, *rdp],
                          [out, dh, *dp]):
        if not same_cut(a, b):
            return what
    return None
