"""How one step spends memory: a job's `memory:` settings as the step reads them,
one object from the job (train.py, measure.py) to the segments (step.py)."""

from __future__ import annotations

from dataclasses import dataclass

from segctl.schemas.defaults import DEFAULT_HEAD_CHUNK


@dataclass(frozen=True)
class StepMemory:
    """segment_size: layers per segment, 0 for plain autodiff of the whole model.
    head_chunk: the loss head's tokens at a time. attn_block, mlp_chunk (segmented
    only; 0 off): a sequence longer than this runs its attention backward in
    blocks of this many query rows (engine/attention.py), its token-wise
    sublayers this many rows at a time (engine/layer.py). offload (segmented
    only): the folder the boundaries wait in between the forward and the
    backward (engine/offload.py), None to keep them in memory. grad_checkpoint
    (plain only): every layer recomputed under mx.checkpoint, as mlx-lm does.
    fused (segmented only): a segment's forward, its backward and the head's
    chunks run as `mx.compile`d functions where that is exact (engine/step.py,
    `fused.fusable`), as mlx-lm compiles its step, and so does the optimizer's
    update after it (engine/optim.apply_grads). keep (segmented only): the
    top `keep` layers are kept, not recomputed: their forward runs once, the
    head runs on its output, and their backward follows in the same vjp, so
    their activations are held through the head (engine/step.py, `_kept`;
    fused, an SFT plan's as one compiled vjp with the head, `_kept_fused`).
    Memory for speed: a kept layer's forward is not computed twice."""
    segment_size: int
    head_chunk: int = DEFAULT_HEAD_CHUNK
    attn_block: int = 0
    mlp_chunk: int = 0
    offload: str | None = None
    grad_checkpoint: bool = False
    fused: bool = False
    keep: int = 0
