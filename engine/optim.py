"""AdamW with a schedule and global-norm clipping: the update after every step."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_unflatten


def schedule(lr: float, name: str = "constant", *, warmup: int = 0, total: int = 1,
             end_fraction: float = 0.0):
    """Learning rate as a function of the step: constant, or linear warmup then cosine."""
    if name == "constant":
        main = lr
        if not warmup:
            return main
        main = optim.schedulers.linear_schedule(lr, lr, 1)
    elif name == "cosine":
        main = optim.cosine_decay(lr, max(1, total - warmup), lr * end_fraction)
    else:
        raise ValueError(f"unknown schedule {name!r}")
    if not warmup:
        return main
    ramp = optim.linear_schedule(0.0, lr, warmup)
    return optim.join_schedules([ramp, main], [warmup])


def make_optimizer(lr, weight_decay: float = 0.01) -> optim.AdamW:
    return optim.AdamW(learning_rate=lr, betas=[0.9, 0.999], eps=1e-8,
                       weight_decay=weight_decay)


def apply_grads(model, optimizer, grads: dict, grad_clip: float | None = 1.0):
    """Clip the global norm and update; the caller evaluates model + optimizer state
    in its one barrier. Returns the pre-clip gradient norm (lazy)."""
    tree = tree_unflatten(list(grads.items()))
    if grad_clip:
        tree, norm = optim.clip_grad_norm(tree, grad_clip)
    else:
        norm = mx.sqrt(sum((mx.sum(g.astype(mx.float32) ** 2) for g in grads.values()), mx.array(0.0)))
    optimizer.update(model, tree)
    return norm
