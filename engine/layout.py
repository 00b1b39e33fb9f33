"""How a stream's layout reaches the layers: each layer's mask (the model's own,
a `BlockMask`, an array for attention written by hand, or an unpadded stream's
layout) and its RoPE positions, set on the layers for the time a stream runs.
"""

from __future__ import annotations

from contextlib import contextmanager

from . import ragged
from .attention import BlockMask, block_mask_sdpa, swapped_sdpa
from .plans import Stream
from .rows import RunRope, ropes


@contextmanager
def positions(parts, stream: Stream):
    """Within the block, the layers run as `embed`'s masks need: attention takes
    `BlockMask`s, a prefix-shared stream's ropes run run by run, and an unpadded
    stream's ropes and attention take its rows into the padded layout."""
    layout = stream.ragged
    holders = [m for layer in parts.layers for m in ropes(layer)] \
        if stream.runs or layout else []
    saved = [m["rope"] for m in holders]
    try:
        for m, rope in zip(holders, saved):
            m.rope = ragged.Rope(rope.__call__, layout) if layout else \
                RunRope(rope.__call__, stream.runs)
        with swapped_sdpa(parts.layers, lambda original: ragged.sdpa(block_mask_sdpa(original))
                          if layout else block_mask_sdpa(original)):
            yield
    finally:
        for m, rope in zip(holders, saved):
            m.rope = rope


def embed(parts, stream: Stream, rows: int = 0):
    """(h0, per-layer masks, per-layer extra inputs) of a stream; run the layers
    inside `positions`. `rows` > 0: full-attention layers attend `rows` query
    rows at a time too (the segmented step passes its attn_block)."""
    ids = stream.array()
    h = parts.embed(ids)
    extras = parts.layer_inputs(ids, h)
    return h, masks(parts, stream, h.shape[1], parts.masks(h), rows), extras


def masks(parts, stream: Stream, n: int, own: list, rows: int = 0) -> list:
    """Each layer's mask. Packed and prefix-shared streams and windows shorter
    than the sequence take a `BlockMask`, whose attention touches only the keys a row
    sees (a dense [n, n] array would make every layer's attention O(n^2)). A
    full-attention layer keeps the model's own "causal", or on a row longer than
    `rows` a BlockMask of `rows`-row blocks: where MLX's attention is not fused
    (on CUDA at head_dim 256, say) a whole layer's [H, n, n] scores are then
    never alive at once, in the forward recompute and in the backward's record
    and replay passes alike. A layer that computes its attention by hand takes
    the same masks as arrays. A ragged stream's layers take its layout (windowed
    where a layer is)."""
    if stream.ragged:
        return [ragged.layer_mask(stream.ragged, w) for w in parts.windows]
    out = []
    for takes, w, m in zip(parts.block_masks, parts.windows, own):
        if stream.units:
            bm = BlockMask(window=w, rows=None if w else rows or None, units=stream.units)
        elif stream.block is not None:
            bm = BlockMask(*stream.block, window=w, rows=None if w else rows or None)
        elif w and n > w:
            bm = BlockMask(window=w)
        elif not w and 0 < rows < n:
            bm = BlockMask(rows=rows)
        else:
            out.append(m)
            continue
        if takes:
            out.append(bm)
        else:  # the model's own array is lazy: built only where a layer reads it
            out.append(bm.array(n) if stream.masked else m)
    return out
