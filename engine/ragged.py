"""Rows side by side without padding (docs/engine.md, "Batches and packing"):
a ragged batch.

Side by side pads every row to the longest: on a GPU a pass of the rows of an
SFT length mix is ~78% real tokens, and every linear layer, norm and MLP pays
for the rest. Only attention needs the rows apart; everything else in a layer
works token by token. So a ragged stream holds its rows' tokens one after
another with no padding, [1, T], and only attention sees them as the padded
batch [B, L] it needs: the layer's RoPE takes q and k into that layout
(`Rope`: row b's token t at [b, t], so each row's positions start at 0), the
attention call takes v there too and runs the model's own causal mask on it,
and its output goes back to the rows' tokens (`sdpa`). A padded position copies
its row's last token: under the causal mask no real token sees it, its output
is never taken back, and so its cotangent and what it passes on are zero, as
in the padded batch.

On a GPU T is rounded up (`TAIL_ALIGN` times the side-by-side alignment) so a
run's shapes repeat: the extra tokens belong to no row, attention never reads
them and the head reads none of them.

A sliding-window layer takes its window in the padded layout (a `BlockMask`
over each row's own positions, as a row alone). A family keeps its exactness
only where every layer's attention calls mlx-lm's `scaled_dot_product_attention`,
its RoPE sits in a `rope` module and no layer reads another's K/V
(`layers_refusal` checks those, and step.ragged_refusal runs three rows ragged
and apart)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .attention import BlockMask
from .rows import ropes

TAIL_ALIGN = 8   # T rounds up to TAIL_ALIGN x the side-by-side alignment (off the CPU)


@dataclass(eq=False)
class Ragged:
    """The layout of a ragged stream: sequences of `lengths` tokens one after
    another (then `tail` tokens of no row), attended as [len(lengths), width].
    It is also every full-attention layer's mask: the attention call finds the
    layout there (a sliding-window layer's is a `Windowed`).
    `gather` and `scatter` are put in as inputs while a fused segment traces."""
    lengths: tuple[int, ...]
    width: int
    tail: int = 0
    _arrays: list = field(default_factory=list, repr=False)

    @property
    def tokens(self) -> int:
        return sum(self.lengths) + self.tail

    @property
    def shape(self) -> tuple[int, int, int]:
        """What its compiled functions depend on: (tokens, sequences, width)."""
        return self.tokens, len(self.lengths), self.width

    def arrays(self) -> list[mx.array]:
        """[gather: each padded position's token, scatter: each token's padded position]."""
        if not self._arrays:
            gather, scatter, at = [], [], 0
            for b, n in enumerate(self.lengths):
                gather += [at + min(t, n - 1) for t in range(self.width)]
                scatter += [b * self.width + t for t in range(n)]
                at += n
            scatter += [0] * self.tail
            self._arrays = [mx.array(gather, dtype=mx.int32), mx.array(scatter, dtype=mx.int32)]
        return self._arrays

    def put(self, arrays: list) -> None:
        self._arrays = list(arrays)

    def pad(self, x: mx.array) -> mx.array:
        """[1, H, T, d] -> [B, H, L, d] (a [B, ...] array, already padded, as it is)."""
        if x.shape[0] != 1 or x.shape[2] != self.tokens:
            return x
        B, L = len(self.lengths), self.width
        rows = mx.take(x.swapaxes(1, 2), self.arrays()[0], axis=1)   # [1, B L, H, d]
        return rows.reshape(B, L, x.shape[1], x.shape[3]).swapaxes(1, 2)

    def unpad(self, o: mx.array) -> mx.array:
        """[B, H, L, d] -> [1, H, T, d]: each token's own position."""
        B, H, L, d = o.shape
        flat = o.swapaxes(1, 2).reshape(1, B * L, H, d)
        return mx.take(flat, self.arrays()[1], axis=1).swapaxes(1, 2)


@dataclass(frozen=True, eq=False)
class Windowed:
    """A sliding-window layer's mask on a ragged stream: each padded row attends
    over the keys less than `window` positions behind, as alone."""
    layout: Ragged
    window: int


def layer_mask(layout: Ragged, window: int | None):
    """A layer's mask on a ragged stream: the layout, windowed where the layer is."""
    return Windowed(layout, window) if window else layout


class Rope(nn.Module):
    """A layer's RoPE on a ragged stream: q or k into the padded layout first, so
    each row's positions start at 0 (an array already padded stays as it is)."""

    def __init__(self, rope, layout: Ragged):
        super().__init__()
        # Held as a bound method, not a child module, so the layer's parameter
        # tree is the same with the wrapper in place.
        self._rope = rope
        self._layout = layout

    def __call__(self, x, offset=0):
        return self._rope(self._layout.pad(x), offset=offset)


def sdpa(inner):
    """An mlx-lm `scaled_dot_product_attention` (`inner`: the engine's, taking block
    masks) that runs a call whose mask is a ragged layout on the padded rows, under
    the model's causal mask or its window (a `BlockMask`, as a row alone takes
    it), and gives each token its row's output."""
    def call(queries, keys, values, cache, scale, mask, sinks=None, softcap=None):
        if not isinstance(mask, (Ragged, Windowed)):
            return inner(queries, keys, values, cache, scale, mask, sinks, softcap)
        if cache is not None:
            raise ValueError("a ragged batch takes no cache")
        layout, window = (mask.layout, mask.window) if isinstance(mask, Windowed) else (mask, 0)
        own = BlockMask(window=window) if window and layout.width > window else "causal"
        q, k, v = (layout.pad(t) for t in (queries, keys, values))
        return layout.unpad(inner(q, k, v, None, scale, own, sinks, softcap))
    return call


def layers_refusal(parts) -> str | None:
    """Why this model's layers cannot take a ragged batch, from what they are, or
    None (the numbers are checked beside: step.ragged_refusal)."""
    if not all(parts.block_masks):
        return "a layer computes its attention by hand"
    if any(d is not None for d in parts.donors):
        return "layers share K/V"
    if not all(ropes(layer) for layer in parts.layers):
        return "its layers keep their positions outside a `rope` module"
    return None
