"""One training step's loss and LoRA gradients, three ways.

- plain (`segment_size=0`): autodiff through the model's own forward; the reference.
- grad_checkpoint: the same loss with every layer recomputed under `mx.checkpoint`
  in the backward, as mlx-lm's `--grad-checkpoint` does, but wrapped per call
  instead of patching the layer class for the whole process.
- segmented (`segment_size=N`): ../shared/ENGINE.md. The forward keeps only the
  segment boundaries; a token-chunked head gives the loss and d(loss)/d(last
  boundary); the backward recomputes each segment under `mx.vjp` in reverse. Peak
  memory follows one segment instead of the whole stack.

All three return the same loss: the mean cross-entropy over input positions
t in [max(0, prompt_len-1), len(ids)-2] predicting ids[t+1].
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .data import Example
from .model import ModelParts, model_parts

PhaseHook = Callable[[str], None]


class StepError(ValueError):
    """An example the loss cannot be computed on (e.g. no supervised tokens)."""


def plan_segments(n_layers: int, segment_size: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) layer ranges of at most `segment_size` layers."""
    if segment_size < 1:
        raise ValueError("segment_size must be >= 1")
    return [(lo, min(lo + segment_size, n_layers)) for lo in range(0, n_layers, segment_size)]


def loss_and_grads(model: nn.Module, example: Example, *, segment_size: int,
                   head_chunk: int = 512, attn_block: int = 0, grad_checkpoint: bool = False,
                   parts: ModelParts | None = None, on_phase: PhaseHook | None = None):
    """(loss, grads) for one example; grads keyed like tree_flatten(trainable_parameters()).

    attn_block (segmented only): when the sequence is longer, each layer's
    attention backward walks blocks of this many query rows (engine/attention.py);
    0 leaves attention to MLX's whole-matrix backward.
    """
    ids, start = _span(example)
    if segment_size == 0:
        return _plain(model, ids, start, grad_checkpoint, parts, on_phase)
    parts = parts or model_parts(model, check=False)
    return _segmented(model, parts, ids, start, segment_size, head_chunk, attn_block, on_phase)


def eval_loss(model: nn.Module, example: Example, *, head_chunk: int = 512,
              parts: ModelParts | None = None) -> tuple[float, int]:
    """(mean loss, supervised token count) without gradients, for validation."""
    ids, start = _span(example)
    parts = parts or model_parts(model, check=False)
    h = parts.embed(ids[None, :-1])
    for layer, mask in zip(parts.layers, parts.masks(h)):
        h = layer(h, mask)
        mx.eval(h)  # one layer's activations at a time
    loss = head_loss(parts, h, ids, start, head_chunk)
    return loss.item(), ids.shape[0] - 1 - start


def _span(example: Example) -> tuple[mx.array, int]:
    n = len(example.ids)
    start = max(0, example.prompt_len - 1)
    if n - 1 - start <= 0:
        raise StepError(f"example of {n} tokens with prompt_len {example.prompt_len} "
                        "has no response tokens to supervise")
    return mx.array(example.ids, dtype=mx.int32), start


# ---------------------------------------------------------------- the loss head

def head_loss(parts: ModelParts, h: mx.array, ids: mx.array, start: int,
              chunk: int) -> mx.array:
    """-(mean log p) of ids[start+1:] from the last hidden states h [1, L-1, D],
    without gradients (validation); logits exist one chunk at a time."""
    targets = ids[start + 1:]
    m = targets.shape[0]
    total = mx.array(0.0, dtype=mx.float32)
    for i in range(0, m, chunk):
        total = total + _chunk_logp(parts, targets[i:i + chunk])(h[0, start + i:start + i + chunk])
        mx.eval(total)
    return -total / m


def head_loss_and_grad(parts: ModelParts, h: mx.array, ids: mx.array, start: int,
                       chunk: int) -> tuple[mx.array, mx.array]:
    """(loss, d loss / d h) for the last hidden states h [1, L-1, D], bounded.

    The response span is cut into chunks of `chunk` token positions; each chunk's
    norm -> lm_head -> log-softmax -> target log p runs under its own vjp and is
    evaluated before the next starts, so [chunk, V] logits (and their cotangent)
    exist for one chunk at a time. One graph over all chunks is not enough: a
    GPU queue allocates every chunk's logits before the first is freed. Chunking
    is over positions, so each position's full-vocab log-sum-exp and gradient are
    those of the unchunked head; only the loss's float summation order differs.
    """
    targets = ids[start + 1:]
    m = targets.shape[0]
    cot = mx.array(-1.0 / m, dtype=mx.float32)
    total = mx.array(0.0, dtype=mx.float32)
    pieces = [mx.zeros((start, h.shape[-1]), dtype=h.dtype)] if start else []
    for i in range(0, m, chunk):
        f = _chunk_logp(parts, targets[i:i + chunk])
        (logp,), (g,) = mx.vjp(lambda hc: [f(hc)], [h[0, start + i:start + i + chunk]], [cot])
        total = total + logp
        mx.eval(total, g)
        pieces.append(g)
    return -total / m, mx.concatenate(pieces)[None]


def _chunk_logp(parts: ModelParts, targets: mx.array):
    def logp(hc):
        logits = parts.head(parts.norm(hc)).astype(mx.float32)
        picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        return mx.sum(picked - mx.logsumexp(logits, axis=-1))
    return logp


def _full_head_loss(logits: mx.array, ids: mx.array, start: int) -> mx.array:
    logits = logits[0, start:].astype(mx.float32)
    targets = ids[start + 1:]
    return nn.losses.cross_entropy(logits, targets, reduction="mean")


# ---------------------------------------------------------------- plain / checkpoint

def _plain(model, ids, start, grad_checkpoint, parts, on_phase):
    if grad_checkpoint:
        parts = parts or model_parts(model, check=False)

    def loss_fn(m):
        if not grad_checkpoint:
            return _full_head_loss(m(ids[None, :-1]), ids, start)
        h = parts.embed(ids[None, :-1])
        for layer, mask in zip(parts.layers, parts.masks(h)):
            h = _checkpointed(layer)(layer.trainable_parameters(), h, mask)
        return _full_head_loss(parts.head(parts.norm(h)), ids, start)

    loss, grads = nn.value_and_grad(model, lambda m: loss_fn(m))(model)
    grads = dict(tree_flatten(grads))
    mx.eval(loss, grads)
    if on_phase:
        on_phase("step")
    return loss, grads


def _checkpointed(layer: nn.Module):
    # The layer's trainable parameters go in as explicit inputs so the
    # checkpoint differentiates them; nothing is patched on the class.
    def run(params, h, mask):
        layer.update(params)
        return layer(h, mask)
    return mx.checkpoint(run)


# ---------------------------------------------------------------- segmented

def _segmented(model, parts, ids, start, segment_size, head_chunk, attn_block, on_phase):
    phase = on_phase or (lambda label: None)
    layers = parts.layers
    segments = plan_segments(len(layers), segment_size)
    names = _trainable_names(model)
    params = [_layer_params(layer, i) for i, layer in enumerate(layers)]
    _check_all_trainables_in_layers(names, params)
    blocked = 0 < attn_block < ids.shape[0] - 1

    # Forward: keep only the boundaries. A boundary evaluated outside any
    # transform is a graph-free leaf, so each segment's activations die with it.
    # Layer i always runs under seed base+i (here and in every recompute), so
    # LoRA dropout draws the same masks in each pass.
    base_seed = mx.random.randint(0, 2**30, shape=()).item()
    h = parts.embed(ids[None, :-1])
    masks = parts.masks(h)
    mx.eval(h)
    boundaries = [h]
    for k, (lo, hi) in enumerate(segments):
        h = _run_layers(layers, lo, hi, h, masks, base_seed)
        mx.eval(h)
        boundaries.append(h)
        phase(f"fwd{k}")

    # Head: loss and dh, chunk by chunk.
    loss, dh = head_loss_and_grad(parts, boundaries.pop(), ids, start, head_chunk)
    phase("head")

    # Backward: recompute each segment under vjp with the incoming cotangent.
    grads = {}
    for k in reversed(range(len(segments))):
        lo, hi = segments[k]
        h_in = boundaries.pop()
        if blocked:
            dh = _segment_backward_blocked(layers, masks, params, lo, hi, h_in, dh, grads,
                                           attn_block, base_seed)
        else:
            seg = [p for i in range(lo, hi) for p in params[i]]

            def seg_fn(x, *values):
                _set_params(layers, seg, values)
                return [_run_layers(layers, lo, hi, x, masks, base_seed)]

            values = [v for _, _, _, v in seg]
            _, cots = mx.vjp(seg_fn, [h_in, *values], [dh])
            _set_params(layers, seg, values)  # drop the tracers from the modules
            dh = cots[0]
            grads.update((name, g) for (name, _, _, _), g in zip(seg, cots[1:]))
        if k == 0:
            dh = None  # no LoRA on the embedding
        mx.eval(dh, [grads[name] for i in range(lo, hi) for name, _, _, _ in params[i]])
        phase(f"bwd{k}")
    mx.random.seed(base_seed + len(layers))
    return loss, {n: grads[n] for n in names}


def _segment_backward_blocked(layers, masks, params, lo, hi, h_in, dh, grads, block, base_seed):
    """A segment's backward one layer at a time, each with blockwise attention."""
    from .attention import layer_vjp

    xs = [h_in]  # inputs of the segment's layers, recomputed (segment-sized memory)
    for i in range(lo, hi - 1):
        xs.append(_run_layers(layers, i, i + 1, xs[-1], masks, base_seed))
        mx.eval(xs[-1])
    for i in reversed(range(lo, hi)):
        p = params[i]
        values = [v for _, _, _, v in p]
        dh, gs = layer_vjp(layers[i], masks[i], xs.pop(), values, dh,
                           lambda vals, p=p: _set_params(layers, p, vals), block, base_seed + i)
        _set_params(layers, p, values)
        grads.update((name, g) for (name, _, _, _), g in zip(p, gs))
        mx.eval(dh, list(gs))
    return dh


def _run_layers(layers, lo, hi, h, masks, base_seed):
    for i in range(lo, hi):
        mx.random.seed(base_seed + i)
        h = layers[i](h, masks[i])
    return h


def _trainable_names(model) -> list[str]:
    return [n for n, _ in tree_flatten(model.trainable_parameters())]


def _layer_params(layer, i):
    """[(global name, layer index, local name, value)] of layer i's trainables."""
    return [(f"model.layers.{i}.{local}", i, local, v)
            for local, v in tree_flatten(layer.trainable_parameters())]


def _set_params(layers, plist, values):
    by_layer: dict[int, list] = {}
    for (_, i, local, _), v in zip(plist, values):
        by_layer.setdefault(i, []).append((local, v))
    for i, items in by_layer.items():
        layers[i].update(tree_unflatten(items))


def _check_all_trainables_in_layers(names, params):
    inside = {name for p in params for name, _, _, _ in p}
    outside = [n for n in names if n not in inside]
    if outside:
        raise StepError(f"segmented step trains decoder layers only; {outside[0]} is outside them "
                        "(use segment_size 0 or drop it from lora.keys)")
