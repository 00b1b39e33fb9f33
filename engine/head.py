"""The token-chunked loss head (docs/engine.md, "One step, segment size N"): each
read row's log p of its target, and in the segmented step its gradient with
respect to the last boundary, `chunk` rows at a time, so the [tokens, vocab]
logits of a long row never exist whole."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np

from . import fused as fused_fns
from .model import ModelParts
from .plans import Stream


def logp_and_grads(parts, h, stream: Stream, chunk: int, fused: tuple | None = None,
                   detach: bool = False):
    """(log p [M], d log p / dh [M, D]) of the stream's read rows, `chunk` rows at a
    time: each chunk's norm -> lm_head -> log-softmax -> target log p runs under its
    own vjp and is evaluated before the next starts, so [chunk, V] logits (and their
    cotangent) exist for one chunk at a time. One graph over all chunks is not
    enough: a GPU queue allocates every chunk's logits before the first is freed.
    `fused` (the stream's shape): each chunk's vjp runs compiled. `detach`
    (called inside another vjp, as a kept top's head is): each chunk's results
    are copied out of their graph (`detached`), which would else hold the
    chunk's logits to the end of that vjp."""
    rows, targets = stream.rows, mx.array(stream.targets, dtype=mx.int32)
    h = h.reshape(-1, h.shape[-1])   # side by side, rows index the sequences one after another
    logps, gs = [], []
    for i in range(0, len(rows), chunk):
        if stream.contiguous:
            hc = h[rows[0] + i:rows[0] + min(i + chunk, len(rows))]   # (not the rows after)
        else:
            hc = h[mx.array(rows[i:i + chunk])]
        if fused is not None:
            lp, g = fused_fns.compiled(parts, fused, ("head",), lambda: partial(_chunk_vjp, parts))(
                hc, targets[i:i + chunk])
        else:
            lp, g = _chunk_vjp(parts, hc, targets[i:i + chunk])
        mx.eval(lp, g)
        if detach:
            lp, g = detached(lp), detached(g)
        logps.append(lp)
        gs.append(g)
    return mx.concatenate(logps), mx.concatenate(gs)


def detached(a: mx.array) -> mx.array:
    """An evaluated copy of `a` that holds no graph. Under a gradient transform
    MLX keeps the graph of every array it evaluates (any of them may be
    differentiated later), and each op's result holds its inputs, so only a
    copy made from the bytes is free of it: one trip through host memory, the
    size of `a`."""
    if a.dtype == mx.bfloat16:   # (numpy has no bfloat16: its bits go as uint16)
        return mx.array(np.array(a.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.array(a))


def logp(parts, h, stream: Stream, chunk: int) -> mx.array:
    """log p [M] of the stream's read rows, `chunk` rows at a time, no gradients."""
    rows, targets = mx.array(stream.rows), mx.array(stream.targets, dtype=mx.int32)
    h = h.reshape(-1, h.shape[-1])   # side by side, rows index the sequences one after another
    out = []
    for i in range(0, len(stream.rows), chunk):
        out.append(_chunk_logp(parts, targets[i:i + chunk])(h[rows[i:i + chunk]]))
        mx.eval(out[-1])
    return mx.concatenate(out)


def traced_logp(parts, h, idx: mx.array, targets: mx.array, chunk: int) -> mx.array:
    """log p of rows `idx` of h (flattened) inside a function being traced and
    differentiated whole (fused kept layers, engine/fused.joint): `chunk` rows at
    a time, each under `mx.checkpoint`, so the backward makes a chunk's logits
    again instead of keeping every chunk's from the forward. idx and targets are
    the traced function's inputs (a compiled function replays its constants)."""
    hs = h.reshape(-1, h.shape[-1])[idx]
    return mx.concatenate([mx.checkpoint(_chunk_logp(parts, targets[i:i + chunk]))(hs[i:i + chunk])
                           for i in range(0, idx.shape[0], chunk)])


def _chunk_vjp(parts, hc, targets):
    f = _chunk_logp(parts, targets)
    (lp,), (g,) = mx.vjp(lambda x: [f(x)], [hc], [mx.ones((hc.shape[0],), mx.float32)])
    return lp, g


def _chunk_logp(parts: ModelParts, targets: mx.array):
    def logp(hc):
        logits = parts.head(parts.norm(hc)).astype(mx.float32)
        picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        return picked - mx.logsumexp(logits, axis=-1)
    return logp
