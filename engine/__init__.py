"""The single-machine engine: one LoRA job under MLX, no Ray."""

from .data import Example
from .step import loss_and_grads, plan_segments

__all__ = ["Example", "loss_and_grads", "plan_segments"]
