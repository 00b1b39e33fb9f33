"""Switching a model's adapter off for a pass: DPO's reference model is the base
model, so its reference forward runs the same layers with every LoRA layer
adding nothing (engine/step.py's `reference_sums`)."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.nn as nn
from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear
from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear

from .plans import StepError


@contextmanager
def adapter_off(model: nn.Module):
    """Every LoRA layer of `model` computes exactly its base layer's output inside
    the block: LoRA adds `scale * z` to the base output, so scale 0 adds zero.
    Its dropout is off too, so the pass draws no random numbers: the step's
    dropout masks come from the same generator. Both are restored on the way out,
    whatever happens inside."""
    if any(isinstance(m, (DoRALinear, DoRAEmbedding)) for m in model.modules()):
        # DoRA rescales the whole output by m / |W + scale * BA|: scale 0 is not the base
        raise StepError("DoRA layers cannot be switched off for a reference pass")
    lora = [m for m in model.modules()
            if isinstance(m, (LoRALinear, LoRASwitchLinear, LoRAEmbedding))]
    saved = [(m, m.scale, m.dropout.training) for m in lora]
    try:
        for m in lora:
            m.scale = 0.0
            m.dropout.train(False)
        yield
    finally:
        for m, scale, training in saved:
            m.scale = scale
            m.dropout.train(training)
