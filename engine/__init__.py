"""The single-machine engine: one LoRA job under MLX, no Ray."""

from .data import Example, PreferenceExample
from .step import loss_and_grads, plan_segments

__all__ = ["Example", "PreferenceExample", "loss_and_grads", "plan_segments"]
