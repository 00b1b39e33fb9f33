"""Attention under block masks (prefix-shared rows, sliding windows), and its
backward one block of query rows at a time.

MLX's attention backward materialises the whole [H, L, L] score matrix and its
gradient for a layer: at 16K tokens that one transient is ~27 GB on a
Qwen3-0.6B shape, far above everything else the segmented step keeps.
`blocked_grads` computes dq, dk, dv outside any transform, one block of `block`
query rows at a time, each block evaluated (and its scores freed) before the
next; a block of causal attention needs only the keys up to its last row.
engine/layer.py runs a layer's backward around it (the layer's vjp cannot
evaluate anything inside), and `eager_blocks` evaluates a forward's blocks one
by one.

The swap replaces the `scaled_dot_product_attention` name that mlx-lm's model
modules call, only inside `swapped_sdpa`, and restores it on exit: nothing leaks
to other models in the process.

Masks that are not plain causal are `BlockMask`s, not [L, L] arrays: an array
mask makes MLX's attention unfused and holds [H, L, L] scores per layer (13.9 GB
against 4.6 GB two-branch at 8K on the H200,
bench/results/h200-orpo-v0-densemask.jsonl), and a block of it still spans every
key from 0. A BlockMask is cut into sdpa calls over sliced keys, each with a
"causal" string mask where that is exact and otherwise a boolean mask over its
own rectangle only:

- Prefix-shared ORPO runs [prompt P | chosen | rejected] as one sequence in which
  rejected rows must not see chosen columns and restart at position P. Its
  attention is two causal calls, each fused where MLX fuses: prompt+chosen rows
  over their own keys, and rejected rows over [prompt | rejected] keys, where
  "causal" (lower-right aligned) is exactly "the whole prompt and the rejected
  tokens so far".
- A sliding window w (mlx-lm's: key k is seen from query q iff k <= q and
  q - k < w, on positions) cuts the rows into blocks of `rows` (default_rows);
  rows [i, j) take only the keys [i - w + 1, j), so the forward, its recomputes
  and the blocked backward touch at most rows + w - 1 keys per row: linear in L,
  where mlx-lm's dense [L, L] window mask is quadratic. On the rejected side the
  window reaches back over positions, into the prompt's last keys.

- A packed sequence (several rows side by side, `units`) is cut at its rows
  first: each row's calls see only its own keys, under its own mask.

Only layers whose attention calls an mlx-lm module's `scaled_dot_product_attention`
can take a BlockMask (`takes_block_masks`); attention written by hand keeps
array masks. Every row sees all its keys in one call, so attention sinks (a
per-head logit in the softmax denominator only) pass to each call unchanged, and
the blocked backward returns their gradient too.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from segctl.schemas.defaults import ATTN_KEY_TILE, ATTN_TILED_ABOVE

# (MLX's CUDA attention cache sizes are set in segctl/__init__.py, before MLX loads.)


@dataclass(frozen=True)
class BlockMask:
    """A causal mask cut into sdpa calls over sliced keys.

    With `split`, the rows are [prompt | chosen | rejected]: rows before `split`
    are plain causal; rows from `split` on see the first `prompt` keys and the
    rejected keys up to themselves, at positions restarting at `prompt`. Without
    it, row i is position i. `window` limits every row to the keys whose position
    is less than `window` behind its own. Rows go `rows` at a time (windowed
    rows by default_rows): the segmented step blocks full-attention rows too on
    rows longer than its attn_block."""
    prompt: int = 0
    split: int | None = None
    window: int | None = None
    rows: int | None = None
    # A packed sequence: rows [start, end) of each unit attend only to keys of their
    # own unit, positions restarting at its start; (prompt, split) as above within
    # the unit (a preference row's block), or (0, None) for a plain row.
    units: tuple[tuple[int, int, int, int | None], ...] = ()

    def part(self, i: int, j: int):
        """(key ranges, mask) for query rows [i, j), all on one side of `split`."""
        w = self.window
        if self.split is None or j <= self.split:
            q0 = i
            first = max(0, i - w + 1) if w else 0
            ranges = [(first, j)]
        else:
            q0 = self.prompt + i - self.split
            first = max(0, q0 - w + 1) if w else 0  # the first position any row sees
            ranges = ([(first, self.prompt)] if first < self.prompt else []) + \
                [(self.split + max(0, first - self.prompt), j)]
        # The keys hold positions first, first + 1, ..., the last one row j-1's own.
        n = sum(b - a for a, b in ranges)
        if not w or n <= w:
            return ranges, "causal"
        q = mx.arange(q0, q0 + j - i)[:, None]
        k = mx.arange(first, first + n)[None, :]
        return ranges, (k <= q) & (q - k < w)

    def parts(self, i: int, j: int):
        """part() of rows [i, j), cut at `split` and, windowed, into `rows`-row blocks;
        a packed mask cuts at its units first: no call spans two rows' keys."""
        if self.units:
            out = []
            for start, end, prompt, split in self.units:
                if end <= i or start >= j:
                    continue
                unit = BlockMask(prompt, split, self.window, self.rows)
                for a, b, ranges, m in unit.parts(max(i, start) - start, min(j, end) - start):
                    out.append((a + start, b + start,
                                [(lo + start, hi + start) for lo, hi in ranges], m))
            return out
        cuts = [i] + ([self.split] if self.split is not None and i < self.split < j else []) + [j]
        step = self.rows or (default_rows(self.window) if self.window else None)
        out = []
        for lo, hi in zip(cuts, cuts[1:]):
            for a in range(lo, hi, step or hi - lo):
                b = min(a + step, hi) if step else hi
                out.append((a, b, *self.part(a, b)))
        return out

    def array(self, n: int) -> mx.array:
        """The same mask as an [n, n] boolean array, for attention written by hand."""
        if self.units:   # block-diagonal: each unit's own mask, nothing across units
            rows = []
            for start, end, prompt, split in self.units:
                own = BlockMask(prompt, split, self.window).array(end - start)
                left = mx.zeros((end - start, start), dtype=mx.bool_)
                right = mx.zeros((end - start, n - end), dtype=mx.bool_)
                rows.append(mx.concatenate([left, own, right], axis=1))
            return mx.concatenate(rows, axis=0)
        idx = mx.arange(n)
        m = idx[None, :] <= idx[:, None]
        pos = idx
        if self.split is not None:
            rejected = idx >= self.split
            chosen = (idx >= self.prompt) & ~rejected
            m = m & ~(rejected[:, None] & chosen[None, :])
            pos = mx.where(rejected, idx - self.split + self.prompt, idx)
        return m & (pos[:, None] - pos[None, :] < self.window) if self.window else m


def default_rows(window: int) -> int:
    """Query rows per call of a windowed BlockMask. A call of r rows reads r + w - 1
    keys per row, so fewer rows cost less, down to what a call itself costs. On
    the CPU that is negligible: Gemma-4-like window layers (w 512, 2K tokens) ran
    their forward and blocked backward ~20% faster at w/4 rows than at w. A GPU
    call launches several kernels, so there a block is a whole window (not yet
    measured)."""
    if mx.default_device() == mx.cpu:
        return max(64, window // 4)
    return window


def attend(q, k, v, scale, mask, sinks=None, softcap=None):
    """Attention of q over k, v under `mask`, a BlockMask included; `softcap`: the
    scores soft-capped (capped_attention)."""
    if not isinstance(mask, BlockMask):
        return _sdpa(q, k, v, scale, mask, sinks, softcap)
    outs = []
    for i, j, ranges, m in mask.parts(0, q.shape[2]):
        outs.append(_sdpa(q[:, :, i:j], _gather(k, ranges), _gather(v, ranges), scale, m, sinks,
                          softcap))
        if _EAGER[0]:
            mx.eval(outs[-1])
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _sdpa(q, k, v, scale, mask, sinks, softcap=None):
    if softcap:
        if sinks is not None:
            raise ValueError("soft-capped scores with attention sinks: no family has both")
        return capped_attention(q, k, v, scale, mask, softcap)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def capped_attention(q, k, v, scale, mask, softcap):
    """softmax(softcap * tanh(((q scale) k^T) / softcap), masked) v, as Gemma 2 and
    Gear write it by hand (scores in the inputs' dtype, a masked score the dtype's
    least value, the softmax precise); MLX's fused attention has no soft cap.
    The query heads sharing a K/V head go as one matrix (GQA). mask: None,
    "causal" (lower-right aligned) or a boolean array over [rows, keys]."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    qs = (q * scale).reshape(B, Hk, H // Hk, L, D)
    scores = qs @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None, :]
    if mask is not None:
        if mask.ndim == 4:   # [B or 1, H or 1, L, S] as the model made it
            mask = mx.expand_dims(mask, 2) if mask.shape[1] == 1 else \
                mask.reshape(mask.shape[0], Hk, H // Hk, L, S)
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ mx.expand_dims(v, 2)).reshape(B, H, L, D)


def block_mask_sdpa(original):
    """An mlx-lm `scaled_dot_product_attention` that also takes a BlockMask, and
    whose calls with sinks differentiate where MLX's do not (`own_sinks_vjp`)."""
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None, softcap=None):
        if sinks is not None and cache is None and own_sinks_vjp():
            return _sinks_attention(queries, keys, values, scale, mask, sinks, softcap)
        if isinstance(mask, BlockMask):
            _check(cache)
            return attend(queries, keys, values, scale, mask, sinks, softcap)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks,
                        **capped(softcap))
    return sdpa


def own_sinks_vjp() -> bool:
    """Whether attention with sinks takes its backward from `blocked_grads` (tile by
    tile) instead of MLX's: wherever MLX runs its fused attention kernel, whose vjp
    (MLX 0.32) takes no sinks ("Does not support VJP with respect to mask or
    attention sinks", measured on CUDA): any device but the CPU, where MLX's
    attention is plain operations that autodiff serves. Tests substitute it."""
    return mx.default_device() != mx.cpu


def _sinks_attention(q, k, v, scale, mask, sinks, softcap):
    """attend(...) with sinks, its vjp the tiled backward of all rows as one block."""
    @mx.custom_function
    def call(q, k, v, sinks):
        return attend(q, k, v, scale, mask, sinks, softcap)

    @call.vjp
    def call_vjp(primals, cotangent, output):
        q, k, v, sinks = primals
        d = cotangent[0] if isinstance(cotangent, (list, tuple)) else cotangent
        out = output[0] if isinstance(output, (list, tuple)) else output
        return blocked_grads(q, k, v, d, mask, scale, q.shape[2], sinks, delta=delta_of(d, out),
                             softcap=softcap)

    return call(q, k, v, sinks)


def plain_call(queries, keys, values, cache, scale, mask, sinks=None, softcap=None):
    """An attention call as mlx-lm makes one, its scores soft-capped when `softcap`
    is given (engine/capped.py): what a hand-written soft-capped attention is."""
    _check(cache)
    return _sdpa(queries, keys, values, scale, mask, sinks, softcap)


# Attention written by hand in an mlx-lm module as a function of its own, each
# made the one call it is (engine/capped.py): its name -> (a call -> the function).
HAND_WRITTEN = {
    "_softcap_attention": lambda call: lambda queries, keys, values, scale, softcap, mask: call(
        queries, keys, values, None, scale, mask, softcap=softcap),
}


def capped(softcap) -> dict:
    """The keyword a soft-capped attention call passes on (engine/capped.py's
    attention takes it; mlx-lm's own does not)."""
    return {} if softcap is None else {"softcap": softcap}


def takes_block_masks(layer) -> bool:
    """Whether `layer`'s attention calls an mlx-lm module's `scaled_dot_product_attention`
    (so that inside swapped_sdpa it takes a BlockMask); attention written by hand
    (unless engine/capped.py made it one call) needs array masks."""
    named = layer.named_modules()
    attention = [m for name, m in named if name.rsplit(".", 1)[-1].endswith(("attn", "attention"))]
    return bool(_sdpa_modules(attention or [m for _, m in named]))


def _sdpa_modules(modules) -> set:
    found = {sys.modules[type(m).__module__] for m in modules}
    return {m for m in found if hasattr(m, "scaled_dot_product_attention")}


def _gather(x, ranges):
    if len(ranges) == 1:
        a, b = ranges[0]
        return x[:, :, a:b]
    return mx.concatenate([x[:, :, a:b] for a, b in ranges], axis=2)


@contextmanager
def swapped_sdpa(layers, make):
    """Within the block, the model modules of `layers` call make(their sdpa), and
    their hand-written attention functions (HAND_WRITTEN) make(plain_call) too."""
    modules = _sdpa_modules(m for layer in layers for _, m in layer.named_modules())
    saved = [(m, name, getattr(m, name)) for m in modules
             for name in ("scaled_dot_product_attention", *HAND_WRITTEN) if hasattr(m, name)]
    try:
        for m, name, original in saved:
            setattr(m, name, make(original) if name == "scaled_dot_product_attention"
                    else HAND_WRITTEN[name](make(plain_call)))
        yield
    finally:
        for m, name, original in saved:
            setattr(m, name, original)


def _check(cache):
    if cache is not None:
        raise ValueError("block masks and the blockwise attention backward take no cache")


def blockable(cache, mask) -> bool:
    """Whether a call's gradient flows through q, k, v (and sinks) only, so that its
    backward can be taken in blocks: not with a cache, nor with an additive float
    mask (mlx-lm's MLA passes its position scores as the mask, and those carry
    gradients to the layer's weights); such calls keep MLX's own autodiff."""
    if cache is not None:
        return False
    return mask is None or isinstance(mask, (str, BlockMask)) or (
        isinstance(mask, mx.array) and mask.dtype == mx.bool_)


_EAGER = [False]


@contextmanager
def eager_blocks():
    """Within the block (outside any transform), `attend` evaluates each block of
    rows before the next: a GPU queue would otherwise allocate every block's
    scores before freeing the first."""
    saved, _EAGER[0] = _EAGER[0], True
    try:
        yield
    finally:
        _EAGER[0] = saved


def tiles_keys(L: int, sinks=None) -> bool:
    """Whether a row of L tokens takes its attention backward tile by tile over
    the keys (`tiled_vjp`), so its layer must hand `blocked_grads` the delta: past
    ATTN_TILED_ABOVE tokens, and at any length with attention sinks (MLX's own
    attention backward takes no sinks on CUDA)."""
    return L > ATTN_TILED_ABOVE or sinks is not None


def delta_of(d_out, out) -> mx.array:
    """rowsum(dO O) in fp32, [B, H, rows]: what the tiled backward needs of the
    attention's output `out` (so `out` itself can go)."""
    return (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(-1)


def blocked_grads(q, k, v, d_out, mask, scale, block, sinks=None, delta=None, softcap=None):
    """(dq, dk, dv[, d sinks]) of attention(q, k, v) under `mask` (scores soft-capped
    at `softcap`, if given) with cotangent d_out, `block` query rows at a time. On
    rows longer than ATTN_TILED_ABOVE, `delta` (rowsum(d_out * out) in fp32,
    [B, H, L], out being the attention's output) lets a block over more than
    ATTN_KEY_TILE keys run tile by tile (`tiled_vjp`): memory for one tile of
    scores, but on the H200 a 128K row's layer took 13 s there against 3.9 s
    through MLX's backward, which is why shorter rows keep MLX's."""
    L, S = q.shape[2], k.shape[2]
    # Each block's dq goes into its rows in place (the accumulator is evaluated and
    # held once): joining the blocks at the end would hold dq twice.
    dq = mx.zeros(q.shape, dtype=q.dtype)
    # dK, dV summed in fp32; held by this list alone, so each add is in place
    sums = [mx.zeros(k.shape, dtype=mx.float32), mx.zeros(v.shape, dtype=mx.float32)]
    extra = [] if sinks is None else [sinks]
    d_sinks = [mx.zeros(s.shape, dtype=mx.float32) for s in extra]
    # Last block first: a causal block's keys (and so its transients) shrink with
    # every block, so each fits in memory the one before it freed. First block
    # first, every allocation is larger than any freed, and CUDA's memory pool
    # (which keeps what MLX frees) grew past a 139 GB GPU at 128K tokens.
    for i in reversed(range(0, L, block)):
        j = min(i + block, L)
        for a, b, ranges, m in _block_parts(mask, i, j, L, S):
            keys = sum(hi - lo for lo, hi in ranges)
            # Sinks always go tile by tile: MLX (0.32) has no attention vjp with
            # respect to sinks on CUDA, so its backward per block fails there.
            if delta is not None and (extra or tiles_keys(L) and keys > ATTN_KEY_TILE):
                dqb = tiled_vjp(q[:, :, a:b], _gather(k, ranges), _gather(v, ranges),
                                d_out[:, :, a:b], delta[:, :, a:b], scale, m, sums, ranges,
                                *extra, d_sinks=d_sinks, softcap=softcap)
            else:
                _, (dqb, dkb, dvb, *dsb) = mx.vjp(
                    lambda x, y, z, *s: [_sdpa(x, y, z, scale, m, s[0] if s else None, softcap)],
                    [q[:, :, a:b], _gather(k, ranges), _gather(v, ranges), *extra],
                    [d_out[:, :, a:b]])
                sums[0] = _add_ranges(sums[0], dkb, ranges)
                sums[1] = _add_ranges(sums[1], dvb, ranges)
                d_sinks = [acc + g.astype(mx.float32) for acc, g in zip(d_sinks, dsb)]
                del dkb, dvb
            # The rows of the parts of a block do not overlap: adding to zeros is
            # writing the block's dq as it is.
            dq = dq.at[:, :, a:b].add(dqb)
            del dqb
            mx.eval(dq, sums, d_sinks)
            trim_cache()
    dk, dv = sums
    return (dq, dk.astype(k.dtype), dv.astype(v.dtype),
            *[g.astype(s.dtype) for g, s in zip(d_sinks, extra)])


def tiled_vjp(q, k, v, d_out, delta, scale, mask, sums, ranges, sinks=None, d_sinks=(),
              softcap=None):
    """dq of softmax(q k^T scale + mask) v for one block of query rows, its dk and
    dv added into sums = [dK, dV] (fp32, over the row's keys, of which k and v are
    `ranges`),
    its keys ATTN_KEY_TILE at a time: [heads, rows, tile] scores at most, where
    MLX's attention backward holds [heads, rows, keys] (and does on Metal, and on
    CUDA for a block over more keys than rows: 36 GB at 128K tokens and 1024 rows
    of an 8B shape). The same arithmetic as that backward: scores in the inputs'
    dtype, softmax and its gradient in fp32 (dS = P (dP - delta), delta =
    rowsum(dO O)), a first pass for each row's log-sum-exp. mask: None, "causal"
    (lower-right aligned) or a boolean array over [rows, keys]. Only k's heads are
    looked up: the query heads sharing a K/V head go as one matrix (GQA).

    Every score transform of the families served goes with it:
    - `sinks` ([heads], gpt-oss): a logit per head in every row's softmax
      denominator, with no value. A row's log-sum-exp starts from it; its
      gradient, -sum over rows of P(sink) delta, is added into d_sinks[0].
    - `softcap` (Gemma 2): scores c tanh(s / c), so dS is scaled by
      1 - tanh(s / c)^2 on its way back to q and k.

    Each tile is one compiled function: eager, its element-wise steps read and
    wrote the fp32 tile of scores about ten times; fused, they need not. The tile's
    dK, dV go straight into `sums` (in place: nothing else holds them), not into a
    block-sized pair first."""
    B, H, R, d = q.shape
    Hk, K = k.shape[1], k.shape[2]
    G = H // Hk
    f32 = mx.float32
    qs = (q * scale).reshape(B, Hk, G * R, d)
    do = d_out.reshape(B, Hk, G * R, d_out.shape[-1])   # v's head size may differ from q's (MLA)
    dl = delta.reshape(B, Hk, G * R, 1).astype(f32)
    # row r sees key c iff c <= r + K - R ("causal" is lower-right aligned)
    last = mx.tile(mx.arange(R) + (K - R), (G,)) if isinstance(mask, str) else None

    def masking(c0, c1):
        """The mode of a tile's mask and its array inputs."""
        if isinstance(mask, str):
            return ("causal", (mx.arange(c0, c1), last)) if c1 - 1 > K - R else ("none", ())
        if mask is None:
            return "none", ()
        seen = mx.broadcast_to(mask[..., c0:c1], (B, H, R, c1 - c0))
        return "array", (seen.reshape(B, Hk, G * R, c1 - c0),)

    tiles = [(c, min(c + ATTN_KEY_TILE, K)) for c in range(0, K, ATTN_KEY_TILE)]
    fns = _tile_fns(softcap)
    # Pass 1: each row's log-sum-exp over its keys (and its sink), a running max and sum.
    if sinks is None:
        top = mx.full((B, Hk, G * R, 1), -mx.inf, dtype=f32)
        total = mx.zeros(top.shape, dtype=f32)
    else:   # head h = (K/V head, group member): rows go (group member, row) within a K/V head
        sink = mx.repeat(sinks.astype(f32).reshape(1, Hk, G, 1), R, axis=2)
        top, total = mx.broadcast_to(sink, (B, Hk, G * R, 1)), mx.ones((B, Hk, G * R, 1), f32)
    for c0, c1 in tiles:
        mode, m = masking(c0, c1)
        top, total = fns[mode][0](qs, k[:, :, c0:c1], top, total, *m)
        mx.eval(top, total)
    # A row that sees no key: total 0, so its P is all 0 with any finite lse.
    lse = mx.where(total > 0, top + mx.log(total), 0)
    if sinks is not None:   # the sink's dS is P(sink) (0 - delta): it has no value
        d_sinks[0] += -(mx.exp(sink - lse) * dl).reshape(B, Hk, G, R).sum(axis=(0, 3)).reshape(H)
    # Pass 2: each tile's P, then dV, dP, dS and their share of dQ, dK.
    dq = mx.zeros(qs.shape, f32)
    for c0, c1 in tiles:
        mode, m = masking(c0, c1)
        dqt, dkt, dvt = fns[mode][1](qs, k[:, :, c0:c1], v[:, :, c0:c1], do, dl, lse, *m)
        dq = dq + dqt
        at = _sub_ranges(ranges, c0, c1)
        sums[0] = _add_ranges(sums[0], dkt, at)
        sums[1] = _add_ranges(sums[1], dvt, at)
        del dqt, dkt, dvt
        mx.eval(dq, sums)
    return (dq * scale).reshape(B, H, R, d).astype(q.dtype)


def _sub_ranges(ranges, c0, c1):
    """The row's key ranges that keys [c0, c1) of the gathered `ranges` are."""
    out, at = [], 0
    for a, b in ranges:
        lo, hi = max(c0, at), min(c1, at + b - a)
        if lo < hi:
            out.append((a + lo - at, a + hi - at))
        at += b - a
    return out


@lru_cache(maxsize=None)
def _tile_fns(softcap: float | None) -> dict:
    """{mask mode: (log-sum-exp step, gradients)} of one tile, each compiled once
    (and by MLX per shape: a block's tiles share one, but for its last)."""
    return {mode: _tile_pair(mode, softcap) for mode in ("causal", "array", "none")}


def _tile_pair(mode: str, softcap: float | None):
    f32 = mx.float32

    def scored(qs, kt):
        """(scores, d capped / d raw): raw scores, or soft-capped ones."""
        s = (qs @ kt.swapaxes(-1, -2)).astype(f32)
        if not softcap:
            return s, None
        t = mx.tanh(s / softcap)
        return t * softcap, 1 - t * t

    def masked(s, m):
        if mode == "causal":
            cols, last = m
            return mx.where(cols[None, :] <= last[:, None], s, -mx.inf)
        return mx.where(m[0], s, -mx.inf) if mode == "array" else s

    def scores(qs, kt, m):
        return masked(scored(qs, kt)[0], m)

    def lse_step(qs, kt, top, total, *m):
        s = scores(qs, kt, m)
        new = mx.maximum(top, s.max(axis=-1, keepdims=True))
        base = mx.where(new == -mx.inf, 0, new)  # no key seen yet: no -inf - -inf
        return new, total * mx.exp(top - base) + mx.exp(s - base).sum(axis=-1, keepdims=True)

    def grads(qs, kt, vt, do, dl, lse, *m):
        s, slope = scored(qs, kt)
        p = mx.exp(masked(s, m) - lse)
        dv = (p.astype(vt.dtype).swapaxes(-1, -2) @ do).astype(f32)
        ds = p * ((do @ vt.swapaxes(-1, -2)).astype(f32) - dl)
        ds = (ds if slope is None else ds * slope).astype(qs.dtype)
        return ds @ kt, (ds.swapaxes(-1, -2) @ qs).astype(f32), dv

    return mx.compile(lse_step), mx.compile(grads)


# Each block's transients have their own sizes, which MLX's buffer cache keeps
# after the block is done (it held 132 GB after 193 blocks of 256 rows at 128K
# tokens on the H200). Past this much cache, it is handed back.
CACHE_CAP = 4 << 30


def trim_cache():
    """The buffer cache handed back when it holds more than CACHE_CAP."""
    if mx.get_cache_memory() > CACHE_CAP:
        mx.clear_cache()


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
    # .at[].add updates the evaluated accumulator in place: the cost is the
    # part's, not the whole array's.
    part = part.astype(acc.dtype)
    at = 0
    for a, b in ranges:
        acc = acc.at[:, :, a:b].add(part[:, :, at:at + b - a])
        at += b - a
    return acc
