"""The reference step: one loss plan's loss and LoRA gradients by plain autodiff
of the whole forward, or with every layer recomputed under `mx.checkpoint` in
the backward, as mlx-lm's `--grad-checkpoint` does, but wrapped per call instead
of patching the layer class for the whole process (engine/step.py's
`segment_size=0`). Where a stream needs no masks of the engine's own, the
model's own forward runs as it is."""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import attention, layout
from .attention import block_mask_sdpa, swapped_sdpa


def plain_step(model, parts, plan, grad_checkpoint, on_phase):
    """(loss, grads, sums) of one loss plan by autodiff of the whole forward."""
    def loss_fn(m):
        sums = 0
        for stream in plan.streams:
            logits = _logits(m, parts, stream, grad_checkpoint)
            lg = logits.reshape(-1, logits.shape[-1])[mx.array(stream.rows)].astype(mx.float32)
            tg = mx.array(stream.targets)[:, None]
            logp = mx.take_along_axis(lg, tg, axis=-1)[:, 0] - mx.logsumexp(lg, axis=-1)
            sums = sums + stream.member.T @ logp
        return plan.loss(sums), sums

    # Positions stay set through the backward too: mx.checkpoint reruns the layer
    # there. Only a single-stream (prefix-shared) plan has runs. The model's own
    # forward runs as it is.
    shared = next((s for s in plan.streams if s.runs or s.ragged), plan.streams[0])
    own = all(_own_forward(s, grad_checkpoint) for s in plan.streams)
    # The model's own forward runs as it is: off the CPU, its calls with sinks take
    # their backward from the tiles (attention.own_sinks_vjp: MLX's takes none there).
    with (_own_sinks(parts) if own else layout.positions(parts, shared)):
        (loss, sums), grads = nn.value_and_grad(model, loss_fn)(model)
        grads = dict(tree_flatten(grads))
        mx.eval(loss, sums, grads)
    if on_phase:
        on_phase("step")
    return loss, grads, sums


def _own_sinks(parts):
    return swapped_sdpa(parts.layers, block_mask_sdpa) if attention.own_sinks_vjp() \
        else nullcontext()


def _own_forward(stream, grad_checkpoint) -> bool:
    return not grad_checkpoint and not stream.masked


def _logits(model, parts, stream, grad_checkpoint):
    if _own_forward(stream, grad_checkpoint):
        return model(stream.array())
    h, masks, extras = layout.embed(parts, stream)
    kv: dict = {}
    for i, layer in enumerate(parts.layers):
        d = parts.donors[i]
        shared = kv[d] if d is not None else None
        if grad_checkpoint:
            h, out = _checkpointed(parts, i, masks[i], extras[i], shared is not None)(
                layer.trainable_parameters(), h, *(shared or ()))
        else:
            h, out = parts.call(i, h, masks[i], extras[i], shared)
        kv[i] = out
    return parts.head(parts.norm(h))


def _checkpointed(parts, i, mask, extra, has_shared):
    # The layer's trainable parameters go in as explicit inputs so the
    # checkpoint differentiates them; nothing is patched on the class.
    layer = parts.layers[i]

    def run(params, h, *shared):
        layer.update(params)
        h, out = parts.call(i, h, mask, extra, tuple(shared) if has_shared else None)
        return [h, *(out or ())]
    ckpt = mx.checkpoint(run)

    def call(params, h, *shared):
        h, *out = ckpt(params, h, *shared)
        return h, (tuple(out) or None)
    return call
