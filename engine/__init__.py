"""The single-machine engine: one LoRA job under MLX, no Ray."""

from .data import Example, PreferenceExample
from .settings import StepMemory
from .step import loss_and_grads, plan_segments

__all__ = ["Example", "PreferenceExample", "StepMemory", "loss_and_grads", "plan_segments"]
