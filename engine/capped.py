"""Soft-capped attention as one attention call the engine can cut.

Gemma 2 writes its attention by hand: scores (q scale) k^T, capped as
c tanh(s / c), masked, a precise softmax, times v. Written so, a layer's
attention cannot take a BlockMask, go in blocks of query rows or tile by tile
over the keys, or run rows apart: a long row holds [heads, L, L] scores in its
forward and again in its backward. Gear, with `attn_logit_softcapping` set, does
the same in a module-level function (`_softcap_attention`).

So such a layer's attention becomes one `scaled_dot_product_attention(...,
softcap=c)` call, which engine/attention.py serves like any mlx-lm attention
call, the soft cap a transform of the scores (`capped_attention` forward, the
cap's slope in the blocked and tiled backward):

- Gemma 2's attention module is given a class of ours (`Gemma2Attention`, a
  subclass: the same parameters under the same names) whose forward is the
  family's own up to the scores and then makes that call;
- Gear's function is swapped inside the engine's attention swaps
  (engine/attention.py `swapped_sdpa`, `HAND_WRITTEN`).

A module gets the class only where its output with it equals its output without
on a few tokens (`adopt`), so a change in mlx-lm's Gemma 2 shows as a layer
left as it was, never as a different loss.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from . import attention

# The name engine/attention.py swaps, as it swaps mlx-lm's: a BlockMask, the
# blocked backward and rows apart reach the soft-capped layers through it.
scaled_dot_product_attention = attention.plain_call


@lru_cache(maxsize=None)
def _gemma2_class():
    from mlx_lm.models import gemma2

    class Gemma2Attention(gemma2.Attention):
        """mlx-lm's Gemma 2 attention with its scores made by one soft-capped call."""

        def __call__(self, x, mask=None, cache=None):
            if cache is not None:
                return super().__call__(x, mask, cache)
            B, L, _ = x.shape
            q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            out = scaled_dot_product_attention(self.rope(q), self.rope(k), v, None, self.scale,
                                               mask, softcap=self.attn_logit_softcapping)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    Gemma2Attention.__module__ = __name__   # where attention.swapped_sdpa finds the call
    return Gemma2Attention


def adopt(layers: list[nn.Module], dim: int, dtype) -> int:
    """Give each Gemma 2 attention module of `layers` our class where it computes
    what mlx-lm's does (checked on a few tokens of width `dim` under a causal
    boolean mask, the kind mlx-lm's Gemma 2 makes); returns how many took it."""
    modules = [m for layer in layers for _, m in layer.named_modules()
               if type(m).__module__ == "mlx_lm.models.gemma2" and type(m).__name__ == "Attention"
               and getattr(m, "attn_logit_softcapping", None)]
    if not modules:
        return 0
    ours = _gemma2_class()
    x = mx.random.normal((1, 6, dim), key=mx.random.key(13)).astype(dtype)
    mask = mx.tril(mx.ones((6, 6), dtype=mx.bool_))
    taken = 0
    for m in modules:
        original, training = type(m), m.training
        m.eval()   # LoRA dropout would draw other masks in the two calls
        try:
            theirs = m(x, mask)
            m.__class__ = ours
            if _same(theirs, m(x, mask)):
                taken += 1
                continue
        except Exception:
            pass
        finally:
            m.train(training)
        m.__class__ = original
    return taken


def _same(a: mx.array, b: mx.array) -> bool:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return bool(mx.allclose(a, b, rtol=1e-3, atol=1e-3 * max(float(mx.max(mx.abs(a))), 1.0)))
