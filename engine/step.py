"""One training step's loss and LoRA gradients, for SFT, ORPO and DPO, three ways.

- plain (`segment_size=0`): autodiff through the whole forward; the reference
  (engine/plain.py).
- grad_checkpoint: the same loss with every layer recomputed under `mx.checkpoint`
  in the backward, as mlx-lm's `--grad-checkpoint` does (engine/plain.py).
- segmented (`segment_size=N`): docs/engine.md. The forward keeps only the
  segment boundaries; a token-chunked head gives the loss and d(loss)/d(last
  boundary); the backward recomputes each segment under `mx.vjp` in reverse. Peak
  memory follows one segment instead of the whole stack. `keep` top layers may
  run once instead, their activations held through the head (`_kept`).

What a step computes, its rows as streams and loss plans, is engine/plans.py:
each loss is a small function of a few sums of per-position log-probs. The segmented head
computes each row's log p and its gradient d(log p)/dh with cotangent 1, chunk by
chunk; once all sums are known, the loss's gradient with respect to the sums
scales those rows into dh. Rows are independent, so this equals the gradient of
the unchunked loss.

DPO's reference model is the base model with the adapter switched off (every
LoRA layer's scale set to 0 for one no-gradient forward over the same streams,
before the step): no second model in memory, and the same reference sums for
plain autodiff and the segmented step.

Gemma-4 layers that reuse a donor layer's K/V (`parts.donors`): a segment that
holds a donor whose sharers sit in later segments also outputs the donor's K/V;
those segments take them as inputs, and in the backward their dK/dV are summed
and handed to the producer as extra cotangents next to dh.
"""

from __future__ import annotations

import math
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from segctl.schemas.defaults import DEFAULT_HEAD_CHUNK, SIDE_PASS_TOKENS

from . import attention, head, layout, rows
from . import fused as fusing
from .adapter import adapter_off
from .data import PreferenceExample
from .layer import eager, layer_vjp, put_params
from .model import ModelParts, model_parts
from .offload import Boundaries
from .plain import plain_step
from .plans import (
    RowPlan,
    StepError,
    Stream,
    has_rope,
    make_plan,
    make_plans,
    packed_stream,
    ragged_stream,
    side_stream,
    step_report,
)
from .ragged import Ragged, Windowed, layers_refusal
from .settings import StepMemory

PhaseHook = Callable[[str], None]


def plan_segments(n_layers: int, segment_size: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) layer ranges of at most `segment_size` layers."""
    if segment_size < 1:
        raise ValueError("segment_size must be >= 1")
    return [(lo, min(lo + segment_size, n_layers)) for lo in range(0, n_layers, segment_size)]


def loss_and_grads(model: nn.Module, example, *, memory: StepMemory, method: str = "sft",
                   prefix_shared: bool = False, lambda_: float = 0.1,
                   nll_scope: str = "response", beta: float = 0.1,
                   pack: bool = False, side: bool = False, ragged: bool = False,
                   pass_tokens: int = SIDE_PASS_TOKENS,
                   pack_length: int = 0,
                   micro: int = 0, align: int | None = None, parts: ModelParts | None = None,
                   on_phase: PhaseHook | None = None, metrics: dict | None = None):
    """(loss, grads) for one example or a batch (a list of them); grads keyed like
    tree_flatten(trainable_parameters()).

    method "sft" takes `Example`s, "orpo" and "dpo" `PreferenceExample`s. A batch's
    loss is the mean over every supervised token of its rows (SFT) or the mean of
    its rows' losses (ORPO, DPO), and its gradient that of the whole batch: the
    rows (or, with `pack`, sequences of rows: `make_plans`, each micro-batch of
    `micro` rows packed into sequences of at most `pack_length` tokens) run one
    after the other, their gradients summed. pack needs a model that packs
    exactly (`pack_refusal`). side: the rows not packed run side by side where
    they can (`make_plans`), [rows, longest] at a time, at most `pack_length`
    tokens of that, the longest padded to a multiple of `align` (None:
    `side_align()`); it needs a model whose rows batch exactly (`side_refusal`).
    pass_tokens: what one more group is weighed as when the rows are cut into
    groups (`plans.side_groups`; the benchmark's knob, a job keeps the default).
    ragged (with side): those groups run unpadded (engine/ragged.py) where their
    rows' attention and MLPs run whole (none longer than attn_block or
    mlp_chunk); it needs a model whose rows run so exactly (`ragged_refusal`).
    prefix_shared (ORPO, DPO): one pass over
    [prompt | chosen | rejected] instead of two; a row it cannot serve runs
    two-branch, and `metrics["prefix_shared"]` says whether every row ran
    shared. DPO first runs its reference forward (phase "ref"). `memory`: how
    the step spends memory (segment size, head chunk, attention blocks, MLP
    chunks, offload, grad_checkpoint: engine/settings.py). `metrics`, when
    given, receives the step's preference figures, means over its rows (ORPO:
    margin, accuracy, log_odds, nll; DPO: margin, accuracy, chosen_reward,
    rejected_reward), its shape (rows, sequences, tokens: the sequences'
    tokens), the batch's weight (what its loss is a mean over: SFT its
    supervised tokens, ORPO and DPO its rows) and, with offload, the seconds the
    step waited for the disk (offload_write_wait_s, offload_read_wait_s) and spent
    handing boundaries over, waits included (offload_append_s, offload_pop_s).
    """
    parts = parts or model_parts(model, check=False)
    batch = list(example) if isinstance(example, (list, tuple)) else [example]
    why = pack_refusal(parts) if pack else None
    if why:
        raise StepError(f"rows cannot be packed exactly on this model: {why}")
    why = side_refusal(parts) if side else None
    if why:
        raise StepError(f"rows cannot run side by side exactly on this model: {why}")
    why = ragged_refusal(parts) if ragged else None
    if why:
        raise StepError(f"rows cannot run side by side unpadded here: {why}")
    whole = min([n for n in (memory.attn_block, memory.mlp_chunk) if n > 0], default=sys.maxsize)
    plans = make_plans(batch, method, parts, pack=pack, side=side, ragged=whole if ragged else 0,
                       pack_length=pack_length,
                       micro=micro, align=side_align() if align is None else align,
                       pass_tokens=pass_tokens, prefix_shared=prefix_shared, lambda_=lambda_,
                       nll_scope=nll_scope, beta=beta,
                       reference=partial(reference_sums, model, parts, head_chunk=memory.head_chunk,
                                         attn_block=memory.attn_block, mlp_chunk=memory.mlp_chunk,
                                         on_phase=on_phase))
    loss, grads, reports = None, None, []
    offload_s: dict = {}
    for plan in plans:
        if memory.segment_size == 0:
            part, got, sums = plain_step(model, parts, plan, memory.grad_checkpoint, on_phase)
        else:
            part, got, sums = _segmented(model, parts, plan, memory, on_phase, offload_s)
        # Accumulated and evaluated plan by plan: one more set of LoRA gradients
        # is all a batch adds to a row's memory.
        loss = part if loss is None else loss + part
        grads = got if grads is None else {n: grads[n] + g for n, g in got.items()}
        del got
        mx.eval(loss, grads)
        reports += plan.report(sums)
    if metrics is not None:
        metrics.update(step_report(reports))
        metrics.update(rows=len(batch), sequences=sum(s.batch for p in plans for s in p.streams),
                       tokens=sum(s.tokens for p in plans for s in p.streams),
                       padded=sum(len(s.ids) for p in plans for s in p.streams),
                       weight=sum(p.weight for p in plans))
        if memory.segment_size and memory.offload:
            metrics.update({f"offload_{key}_s": s for key, s in offload_s.items()})
    # What the backward freed goes back before the update is built: on an 80 GB
    # CUDA card a 128K-token Gemma-4 step (37.4 GB at its peak) failed in its
    # update, no memory left to instantiate the update's graph, and ran with
    # MLX's buffer cache capped.
    attention.trim_cache()
    return loss, grads


def eval_loss(model: nn.Module, example, *, method: str = "sft", head_chunk: int = DEFAULT_HEAD_CHUNK,
              attn_block: int = 0, mlp_chunk: int = 0,
              prefix_shared: bool = False, lambda_: float = 0.1, nll_scope: str = "response",
              beta: float = 0.1, parts: ModelParts | None = None) -> tuple[float, int]:
    """(loss, weight) of one row without gradients, for validation: SFT weighs by
    supervised tokens, ORPO and DPO by rows (their loss is already a per-row
    figure). On rows longer than attn_block / mlp_chunk the forward goes in pieces
    as the step's does."""
    parts = parts or model_parts(model, check=False)
    plan = make_plan(example, method, parts, prefix_shared=prefix_shared, lambda_=lambda_,
                     nll_scope=nll_scope, beta=beta,
                     reference=partial(reference_sums, model, parts, head_chunk=head_chunk,
                                       attn_block=attn_block, mlp_chunk=mlp_chunk))
    return float(plan.loss(_nograd_sums(parts, plan.streams, head_chunk, attn_block,
                                        mlp_chunk))), plan.weight


def _nograd_sums(parts, streams, head_chunk, attn_block=0, mlp_chunk=0) -> mx.array:
    """The sums of `streams` from a forward without gradients, in the step's pieces."""
    sums: Any = 0
    for stream in streams:
        rows = attn_block if 0 < attn_block < stream.span else 0
        chunk = _pieces(mlp_chunk, stream)
        with layout.positions(parts, stream):
            h, masks, extras = layout.embed(parts, stream, rows)
            kv: dict = {}
            for i in range(len(parts.layers)):
                with eager(parts.layers, parts.tokenwise or [], chunk):
                    h, produced = _run(parts, i, i + 1, h, masks, extras, kv, None, chunk)
                kv.update(produced)
                mx.eval(h, produced)  # one layer's activations at a time
        logp = head.logp(parts, h, stream, head_chunk)
        sums = sums + stream.member.T @ logp
    return sums


def supervised_tokens(example) -> int:
    """Tokens whose log-probs the loss reads (the telemetry's tokens per step), of
    one row or a batch."""
    if isinstance(example, (list, tuple)):
        return sum(supervised_tokens(ex) for ex in example)
    if isinstance(example, PreferenceExample):
        return len(example.chosen) + len(example.rejected)
    return len(example.ids) - 1 - max(0, example.prompt_len - 1)


def side_align() -> int:
    """The multiple a side-by-side batch's length is padded to. On a GPU every new
    shape costs a build of its kernels and attention graphs (~0.1 s a shape on an
    H100, bench/README): lengths in steps of 32, as mlx-lm pads, keep the shapes
    of a whole run few. A CPU builds nothing per shape, so it pads nothing."""
    return 32 if on_gpu() else 1


def on_gpu() -> bool:
    """Whether MLX computes on a GPU here (Metal on a Mac, CUDA): the probe the
    layout choices read, one place for tests to substitute."""
    return mx.default_device() != mx.cpu


def pack_refusal(parts: ModelParts) -> str | None:
    """Why rows cannot be packed into one sequence of this model exactly, or None
    when they can. Not assumed from the family: two short rows run packed and
    apart through the layers without gradients, and every row's log p must agree
    (within the model dtype's rounding). Checked once per model."""
    if parts.pack_verdict is None:
        parts.pack_verdict = (_pack_refusal(parts),)
    return parts.pack_verdict[0]


def _pack_refusal(parts: ModelParts) -> str | None:
    if not has_rope(parts):
        return ("its layers keep their positions outside a `rope` module, so a packed row "
                "cannot restart at position 0")
    rows = [[(7 * i + 3) % 31 + 1 for i in range(n)] for n in (6, 9)]
    return _same_as_apart(parts, rows, packed_stream,
                          "its forward does not take a packed mask",
                          "two rows packed into one sequence give other log-probs than apart")


def side_refusal(parts: ModelParts) -> str | None:
    """Why rows cannot run side by side on this model exactly, or None when they can.
    Not assumed from the family: two short rows run side by side (the shorter
    padded) and apart through the layers without gradients, and every row's log p
    must agree (within the model dtype's rounding). Checked once per model."""
    if parts.side_verdict is None:
        parts.side_verdict = (_side_refusal(parts),)
    return parts.side_verdict[0]


def _side_refusal(parts: ModelParts) -> str | None:
    rows = [[(5 * i + 2) % 29 + 1 for i in range(n)] for n in (9, 6)]
    beside = lambda streams: side_stream(_one_row_each(streams))
    return _same_as_apart(parts, rows, beside, "its forward does not take rows side by side",
                          "two rows side by side give other log-probs than apart")


def ragged_refusal(parts: ModelParts) -> str | None:
    """Why rows cannot run side by side unpadded (engine/ragged.py) on this model
    exactly, or None when they can: the layers must take the layout
    (`ragged.layers_refusal`), and three rows run unpadded and apart through the layers
    without gradients must give the same log-probs. Checked once per model."""
    if parts.ragged_verdict is None:
        why = layers_refusal(parts)
        rows = [[(3 * i + 5) % 23 + 1 for i in range(n)] for n in (10, 4, 7)]
        beside = lambda streams: ragged_stream(_one_row_each(streams))
        parts.ragged_verdict = (why or _same_as_apart(
            parts, rows, beside, "its forward does not take rows side by side unpadded",
            "three rows side by side unpadded give other log-probs than apart"),)
    return parts.ragged_verdict[0]


def _one_row_each(streams: list[Stream]) -> list[RowPlan]:
    """Each stream a row of its own (its loss its first sum): what the side-by-side
    layouts group, for the checks against the rows apart."""
    return [RowPlan([s], lambda sums, ref: sums[0], 1) for s in streams]


def _same_as_apart(parts, rows: list[list[int]], together: Callable, refused: str,
                   differs: str) -> str | None:
    """None when `rows` run as `together(their streams)` give every row's log p as
    they do apart (within the model dtype's rounding), else why not."""
    alone = [_all_rows(r) for r in rows]
    try:
        got = _nograd_sums(parts, [together(alone)], DEFAULT_HEAD_CHUNK)
        want = mx.concatenate([_nograd_sums(parts, [s], DEFAULT_HEAD_CHUNK) for s in alone])
        err, size = float(mx.max(mx.abs(got - want))), float(mx.max(mx.abs(want)))
    except Exception as e:  # a family whose forward refuses the layout
        return f"{refused} ({type(e).__name__}: {e})"
    half = parts.embed(mx.array([[1]])).dtype in (mx.float16, mx.bfloat16)
    if not math.isfinite(err) or err > (2e-2 if half else 1e-3) * max(size, 1.0):
        return f"{differs} (max difference {err:.3g})"
    return None


def _all_rows(ids: list[int]) -> Stream:
    """A stream of `ids` whose every row is a sum of its own (its log p)."""
    n = len(ids) - 1
    return Stream(ids[:-1], list(range(n)), ids[1:], mx.eye(n))


# ---------------------------------------------------------------- DPO's reference

def reference_sums(model: nn.Module, parts: ModelParts, streams: list[Stream], head_chunk: int,
                   attn_block: int = 0, mlp_chunk: int = 0,
                   on_phase: PhaseHook | None = None) -> mx.array:
    """The base model's sums over `streams`: the no-gradient forward with the
    adapter switched off, evaluated, so the step sees constants."""
    with adapter_off(model):
        sums = _nograd_sums(parts, streams, head_chunk, attn_block, mlp_chunk)
        mx.eval(sums)
    if on_phase:
        on_phase("ref")
    return sums


def _run(parts, lo, hi, h, masks, extras, kv_in, seed, chunk: int = 0):
    """Layers [lo, hi) on h; returns (h, {donor: (K, V)} for the donors among them).
    Layer i runs under seed+i (here and in every recompute), so LoRA dropout draws
    the same masks in each pass. `chunk` > 0 (outside any transform): a layer
    that may runs `chunk` rows at a time (engine/rows.py)."""
    kv = dict(kv_in)
    produced = {}
    for i in range(lo, hi):
        if seed is not None:
            mx.random.seed(seed + i)
        if _by_rows(parts, i, masks[i], h, chunk):
            h = rows.forward(parts.layers[i], _caller(parts, i), h, masks[i], chunk)
            continue
        d = parts.donors[i]
        h, out = parts.call(i, h, masks[i], extras[i], kv[d] if d is not None else None)
        if i in parts.donors:
            kv[i] = produced[i] = out
    return h, produced


def _layers_fn(parts, lo, hi, masks):
    """Layers [lo, hi) on h alone: what a fused segment runs (engine/fused.py)."""
    return lambda h: _run(parts, lo, hi, h, masks, [None] * len(masks), {}, None)[0]


def _key(masks) -> tuple:
    """What a fused segment's graph depends on in its masks: a ragged layout's
    arrays go in as inputs, so it is only a name (and a window)."""
    return tuple("ragged" if isinstance(m, Ragged) else ("ragged", m.window)
                 if isinstance(m, Windowed) else m for m in masks)


def _by_rows(parts, i, mask, h, chunk) -> bool:
    """Whether layer i runs rows apart here: it passed the check at load, no later
    layer reads its K/V, and the row is longer than a chunk."""
    return bool(chunk and parts.rowwise and parts.rowwise[i] and i not in parts.donors
                and h.shape[1] > chunk and rows.usable(parts.layers[i], mask))


def _caller(parts, i):
    return lambda h, mask: parts.call(i, h, mask)[0]


# ---------------------------------------------------------------- segmented

@dataclass
class _Forward:
    masks: list
    extras: list
    kv: dict            # donor K/V that later segments read
    boundaries: Boundaries  # each segment's input, in memory or on disk
    fused: tuple | None = None  # its shape where its segments and head run compiled
    layout: Any = None          # a ragged stream's (its arrays go into the compiled functions)


def _segmented(model, parts, plan, memory, on_phase, offload_s):
    """The segmented step of one loss plan (docs/engine.md) under `memory` (a
    StepMemory); `offload_s` gathers the seconds spent on boundaries on disk."""
    phase = on_phase or (lambda label: None)
    head_chunk, attn_block, mlp_chunk = memory.head_chunk, memory.attn_block, memory.mlp_chunk
    layers = parts.layers
    keep = _kept_layers(parts, plan, memory)
    segments = plan_segments(len(layers) - keep, memory.segment_size) if keep < len(layers) else []
    names = _trainable_names(model)
    params = [_layer_params(layer, i, parts.prefix) for i, layer in enumerate(layers)]
    _check_all_trainables_in_layers(names, params)
    base_seed = mx.random.randint(0, 2**30, shape=()).item()
    tags = ["", "rejected."] if len(plan.streams) == 2 else [""]

    def forward(stream, tag, scratch):
        fwd = _Forward([], [], {}, scratch.enter_context(Boundaries(memory.offload)))
        top = _forward(parts, stream, segments, base_seed, phase, tag,
                       attn_block if 0 < attn_block < stream.span else 0,
                       _pieces(mlp_chunk, stream), fwd, memory.fused)
        return fwd, top

    with ExitStack() as scratch:  # boundaries on disk go at the end, whatever happens
        if keep:
            # One stream, its loss known once its head has run: the kept layers'
            # forward, head and backward in one vjp, then the segments below.
            stream = plan.streams[0]
            with layout.positions(parts, stream):
                fwd, top = forward(stream, "", scratch)
                got = _kept_fused(parts, plan, fwd, params, len(layers) - keep, top, head_chunk,
                                  phase, f"bwd{len(segments)}") if fwd.fused else None
                loss, sums, dh, grads, dkv = got or _kept(
                    parts, plan, fwd, params, len(layers) - keep, top, base_seed, head_chunk,
                    phase, f"bwd{len(segments)}")
                del top
                _backward(parts, fwd, segments, params, dh, grads, 0, 0, base_seed, phase, "",
                          dkv)
            _done(fwd, offload_s)
            mx.random.seed(base_seed + len(layers))
            return loss, {n: grads[n] for n in names}, sums

        # Forward every stream, keeping only boundaries (and cross-segment donor
        # K/V), then the head: each read row's log p and d(log p)/dh, chunk by chunk.
        forwards, heads = [], []
        sums = 0
        for stream, tag in zip(plan.streams, tags):
            with layout.positions(parts, stream):
                fwd, top = forward(stream, tag, scratch)
            logp, g = head.logp_and_grads(parts, top, stream, head_chunk, fwd.fused)
            del top
            phase(f"{tag}head")
            forwards.append(fwd)
            heads.append(g)
            sums = sums + stream.member.T @ logp

        # The loss is a function of a few sums: its gradient scales each row's g.
        loss, w = mx.value_and_grad(plan.loss)(sums)
        mx.eval(loss, w, sums)

        grads: dict = {}
        for k, (stream, fwd, tag) in enumerate(zip(plan.streams, forwards, tags)):
            g, heads[k] = heads[k], None  # this branch's head gradients live on only in dh
            dh = _scaled(stream, w, g)
            del g
            blocked = 0 < attn_block < stream.span
            with layout.positions(parts, stream):
                _backward(parts, fwd, segments, params, dh, grads, attn_block if blocked else 0,
                          _pieces(mlp_chunk, stream), base_seed, phase, tag)
            _done(fwd, offload_s)
            forwards[k] = fwd = None  # its donor K/V go before the next branch's backward
    mx.random.seed(base_seed + len(layers))
    return loss, {n: grads[n] for n in names}, sums


def _done(fwd: _Forward, offload_s: dict):
    """A stream's boundaries are done with: their seconds on disk gathered."""
    for key, seconds in fwd.boundaries.seconds.items():
        offload_s[key] = offload_s.get(key, 0.0) + seconds
    fwd.boundaries.close()


def _pieces(chunk: int, stream: Stream) -> int:
    return chunk if 0 < chunk < stream.span else 0


def _forward(parts, stream, segments, seed, phase, tag, rows, chunk, fwd: _Forward,
             fused: bool = False) -> mx.array:
    """Fill `fwd` with the stream's masks, extra inputs, donor K/V and each segment's
    input boundary; return the last layer's output. `fused`: run compiled where
    that is exact and the shape has come before (sets fwd.fused)."""
    # A boundary evaluated outside any transform is a graph-free leaf, so each
    # segment's activations die with it.
    h, fwd.masks, fwd.extras = layout.embed(parts, stream, rows)
    masks, extras = fwd.masks, fwd.extras
    shape, fwd.layout = stream.shape, stream.ragged
    fwd.fused = shape if fused and fusing.fusable(parts, stream, masks, extras, rows, chunk) \
        and fusing.ready(parts, shape) else None
    mx.eval(h, extras)
    for k, (lo, hi) in enumerate(segments):
        h_in = h
        out = fusing.forward(parts, fwd.fused, _key(masks[lo:hi]), lo, hi,
                             _layers_fn(parts, lo, hi, masks), h_in, fwd.layout) \
            if fwd.fused else None
        if out is not None:
            h, produced = out, {}
        else:
            fwd.fused = None   # not fused, or its trace failed: the rest runs unfused
            with eager(parts.layers, parts.tokenwise or [], chunk):
                h, produced = _run(parts, lo, hi, h_in, masks, extras, fwd.kv, seed, chunk)
        for d in _exports(parts, lo, hi):
            fwd.kv[d] = produced[d]
        mx.eval(h, fwd.kv)
        # Kept once the segment is done with it: on disk it is written while the
        # next segment computes, so the disk never reads what the device is reading.
        fwd.boundaries.append(h_in)
        del h_in
        phase(f"{tag}fwd{k}")
    return h


def _exports(parts, lo, hi) -> list[int]:
    """Donors in [lo, hi) read by a layer at or after hi."""
    return sorted({d for j, d in enumerate(parts.donors) if d is not None and lo <= d < hi <= j})


def _imports(parts, lo, hi) -> list[int]:
    """Donors before lo read by a layer in [lo, hi)."""
    return sorted({d for d in parts.donors[lo:hi] if d is not None and d < lo})


def _scaled(stream: Stream, w: mx.array, g: mx.array) -> mx.array:
    """dh of the loss: each read row's d(log p)/dh `g` scaled by the loss's
    gradient `w` with respect to the sums it is in, placed at its row."""
    return _place(stream, ((stream.member @ w)[:, None] * g).astype(g.dtype))


def _place(stream: Stream, rows_grad: mx.array) -> mx.array:
    """dh [batch, length, D] with each read row's gradient at its row (summed where a
    row is read twice, as prefix-shared ORPO's row P-1 is)."""
    L, D = len(stream.ids), rows_grad.shape[-1]
    if stream.contiguous:
        lo = stream.rows[0]
        pieces = [mx.zeros((lo, D), rows_grad.dtype)] if lo else []
        pieces.append(rows_grad)
        if lo + len(stream.rows) < L:
            pieces.append(mx.zeros((L - lo - len(stream.rows), D), rows_grad.dtype))
        flat = mx.concatenate(pieces)
    else:
        flat = mx.zeros((L, D), rows_grad.dtype).at[mx.array(stream.rows)].add(rows_grad)
    return flat.reshape(stream.batch, stream.length, D)


def _kept_layers(parts, plan, memory) -> int:
    """How many top layers this plan keeps (memory.keep): only a plan of one
    stream (two branches need both heads before either's gradient is known)
    whose layers run whole (attention in blocks and MLPs in chunks hold one
    piece at a time; a kept layer holds all of its activations)."""
    if len(plan.streams) != 1 or not memory.keep:
        return 0
    span = plan.streams[0].span
    if 0 < memory.attn_block < span or 0 < memory.mlp_chunk < span:
        return 0
    return min(memory.keep, len(parts.layers))


def _kept(parts, plan, fwd, params, lo, h_in, seed, head_chunk, phase, label):
    """The kept top layers [lo, N) of a one-stream plan, on their input h_in:
    (loss, sums, dh at lo, their gradients, donor K/V cotangents for below).
    Their forward runs inside the vjp and is evaluated there, so its graph (the
    activations) stays for the backward; the head runs on that output, the
    loss's gradient gives d(loss)/d(output), and the vjp's output is the
    dot product of the output with that constant, whose gradient it is exactly.
    The head's results leave the vjp as copies (head.detached)."""
    stream, out = plan.streams[0], {}

    def head_of(h):
        logp, g = head.logp_and_grads(parts, h, stream, head_chunk, detach=True)
        sums = stream.member.T @ logp
        loss, w = mx.value_and_grad(plan.loss)(sums)
        dh = _scaled(stream, w, g)
        mx.eval(loss, sums, dh)
        out.update(loss=head.detached(loss), sums=head.detached(sums))
        phase("head")
        return head.detached(dh)

    grads: dict = {}
    dkv: dict = {}
    dh = _unit_vjp(parts, fwd, lo, len(parts.layers), h_in, fwd.kv, None, dkv, params, grads,
                   seed, 0, 0, head_of)
    mx.eval(dh, dkv, grads)
    phase(label)
    return out["loss"], out["sums"], dh, grads, dkv


def _kept_fused(parts, plan, fwd, params, lo, h_in, chunk, phase, label):
    """`_kept`'s results for a fused plan whose loss is linear in its sums (SFT's),
    or None (another loss, or a failed trace: `_kept` runs them): their forward,
    the head and their backward as one compiled vjp (fused.joint) whose output is
    the loss, each read row's known weight times its log p (docs/engine.md,
    "Kept layers"). Rows go in padded to whole head chunks (weight 0)."""
    if not plan.linear:
        return None
    stream, n = plan.streams[0], len(parts.layers)
    m = len(stream.rows)
    pad = -m % chunk
    w = stream.member @ mx.grad(plan.loss)(mx.zeros((stream.member.shape[1],)))
    inputs = [mx.array(stream.rows + [0] * pad, dtype=mx.int32),
              mx.array(stream.targets + [0] * pad, dtype=mx.int32),
              mx.concatenate([w, mx.zeros((pad,), w.dtype)])]

    def loss_of(out, idx, targets, weights):
        logp = head.traced_logp(parts, out, idx, targets, chunk)
        return (weights * logp).sum(), logp

    got = fusing.joint(parts, fwd.fused, (chunk, *_key(fwd.masks[lo:])), lo, n,
                       _layers_fn(parts, lo, n, fwd.masks), loss_of, h_in, inputs, fwd.layout,
                       input_grad=lo > 0)
    if got is None:
        return None
    logp, dh, by_name = got
    sums = stream.member.T @ logp[:m]
    loss = plan.loss(sums)
    grads: dict = {}
    _add_compiled_grads(grads, params, lo, n, by_name)
    mx.eval(loss, sums, dh, grads)
    phase(label)
    return loss, sums, dh, grads, {}


def _backward(parts, fwd, segments, params, dh, grads, block, chunk, seed, phase, tag,
              dkv: dict | None = None):
    """Recompute each segment under vjp with the incoming cotangents, last first
    (`dkv`: donor K/V cotangents from kept layers above them)."""
    dkv = {} if dkv is None else dkv  # donor -> (dK, dV) summed over the sharers seen so far
    for k in reversed(range(len(segments))):
        lo, hi = segments[k]
        h_in = fwd.boundaries.pop()
        got = fusing.vjp(parts, fwd.fused, _key(fwd.masks[lo:hi]), lo, hi,
                         _layers_fn(parts, lo, hi, fwd.masks), h_in, dh, fwd.layout) \
            if fwd.fused else None
        if got is not None:
            dh, by_name = got
            _add_compiled_grads(grads, params, lo, hi, by_name)
        elif not block and not chunk:   # (a fused stream's failed trace lands here too)
            fwd.fused = None
            dh = _unit_vjp(parts, fwd, lo, hi, h_in, fwd.kv, dh, dkv, params, grads, seed, 0, 0)
        else:
            # One layer at a time (each in pieces, engine/layer.py): recompute the
            # segment's layer inputs and the K/V of its own donors first.
            xs, kv = [h_in], dict(fwd.kv)
            for i in range(lo, hi - 1):
                with eager(parts.layers, parts.tokenwise or [], chunk):
                    h, produced = _run(parts, i, i + 1, xs[-1], fwd.masks, fwd.extras, kv, seed,
                                       chunk)
                kv.update(produced)
                mx.eval(h, produced)
                xs.append(h)
            for i in reversed(range(lo, hi)):
                dh = _unit_vjp(parts, fwd, i, i + 1, xs.pop(), kv, dh, dkv, params, grads,
                               seed, block, chunk)
                # Evaluated layer by layer (the segment's first layer below, with the
                # rest): an unevaluated dh would keep this layer's last vjp graph (its
                # whole-row activations) alive through the next layer's backward.
                if i > lo:
                    mx.eval(dh, dkv, [grads[name] for name, _, _, _ in params[i]])
        if k == 0:
            dh = None  # no LoRA on the embedding
        mx.eval(dh, dkv, [grads[name] for i in range(lo, hi) for name, _, _, _ in params[i]])
        phase(f"{tag}bwd{k}")


def _unit_vjp(parts, fwd, lo, hi, h_in, kv, dh, dkv, params, grads, seed, block, chunk,
              head_of: Callable | None = None):
    """vjp of layers [lo, hi): inputs h and the donor K/V they import, outputs h and
    the K/V of their donors that later layers read (cotangents waiting in dkv).
    `head_of` (kept top layers, `_kept`): dh is not given but made from the
    evaluated output by head_of, inside the vjp."""
    imports, exports = _imports(parts, lo, hi), [d for d in range(lo, hi) if d in dkv]
    seg = [p for i in range(lo, hi) for p in params[i]]
    values = [v for _, _, _, v in seg]
    n_in = 2 * len(imports)

    def fn(x, *flat):
        kv_in = {d: (flat[2 * a], flat[2 * a + 1]) for a, d in enumerate(imports)}
        _set_params(parts.layers, seg, flat[n_in:])
        h, produced = _run(parts, lo, hi, x, fwd.masks, fwd.extras, kv_in, seed)
        if head_of is None:
            return [h, *[t for d in exports for t in produced[d]]]
        mx.eval(h)   # the forward, once: under the vjp its graph stays for the backward
        return [(h * head_of(h)).sum()]

    if hi == lo + 1 and not imports and not exports and \
            _by_rows(parts, lo, fwd.masks[lo], h_in, chunk):
        if seed is not None:
            mx.random.seed(seed + lo)
        dx, dps = rows.vjp(parts.layers[lo], _caller(parts, lo), h_in, fwd.masks[lo], dh,
                           [local for _, _, local, _ in seg], values, chunk, block)
        _add_grads(grads, seg, dps)
        return dx
    primals = [h_in, *[t for d in imports for t in kv[d]], *values]
    cotangents = [dh, *[t for d in exports for t in dkv.pop(d)]] if head_of is None \
        else [mx.array(1, h_in.dtype)]
    if block or chunk:
        cots = layer_vjp(parts.layers[lo], parts.tokenwise[lo] if parts.tokenwise else [],
                         fn, primals, cotangents, block, chunk)
    else:
        _, cots = mx.vjp(fn, primals, cotangents)
    _set_params(parts.layers, seg, values)  # drop the tracers from the modules
    for a, d in enumerate(imports):
        got = (cots[1 + 2 * a], cots[2 + 2 * a])
        dkv[d] = got if d not in dkv else (dkv[d][0] + got[0], dkv[d][1] + got[1])
    _add_grads(grads, seg, cots[1 + n_in:])
    return cots[0]


def _add_grads(grads, seg, values):
    for (name, _, _, _), g in zip(seg, values):
        grads[name] = grads[name] + g if name in grads else g


def _add_compiled_grads(grads, params, lo, hi, by_name):
    # a compiled function's gradients of layers [lo, hi), keyed (layer, local name)
    _add_grads(grads, [p for i in range(lo, hi) for p in params[i]],
               [by_name[i, local] for i in range(lo, hi) for _, _, local, _ in params[i]])


def _trainable_names(model) -> list[str]:
    return [n for n, _ in tree_flatten(model.trainable_parameters())]


def _layer_params(layer, i, prefix):
    """[(global name, layer index, local name, value)] of layer i's trainables."""
    return [(f"{prefix}.{i}.{local}", i, local, v)
            for local, v in tree_flatten(layer.trainable_parameters())]


def _set_params(layers, plist, values):
    put_params(layers, [(i, local) for _, i, local, _ in plist], values)


def _check_all_trainables_in_layers(names, params):
    inside = {name for p in params for name, _, _, _ in p}
    outside = [n for n in names if n not in inside]
    if outside:
        raise StepError(f"segmented step trains decoder layers only; {outside[0]} is outside them "
                        "(use segment_size 0 or drop it from lora.keys)")
