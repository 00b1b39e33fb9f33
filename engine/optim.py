"""AdamW with a schedule and global-norm clipping: the update after every step."""

from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten


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


def apply_grads(model, optimizer, grads: dict, grad_clip: float | None = 1.0,
                fused: bool = False):
    """Clip the global norm and update; the caller evaluates model + optimizer state
    in its one barrier. Returns the pre-clip gradient norm (lazy). `fused`: the
    clip and the update run as one compiled function (as a fused step's segments
    do, engine/fused.py): on a GPU each of the hundreds of LoRA arrays otherwise
    costs a dozen small kernels (AdamW's moments, decay, the step, the clip), so
    this is the update's time less its launches. The same arithmetic either way."""
    tree = tree_unflatten(list(grads.items()))
    if not fused:
        tree, norm = _clipped(tree, grad_clip)
        optimizer.update(model, tree)
        return norm
    params = tree_unflatten([(k, v) for k, v in tree_flatten(model.trainable_parameters())
                             if k in grads])
    update = _compiled(optimizer, grad_clip, params)
    state = optimizer.state
    try:
        params, optimizer.state, norm = update(params, tree, state)
    except BaseException:
        optimizer.state = state   # (a failed trace would leave its tracers there)
        raise
    model.update(params)
    return norm


def _clipped(tree: dict, grad_clip: float | None):
    if grad_clip:
        return optim.clip_grad_norm(tree, grad_clip)
    leaves = [g for _, g in tree_flatten(tree)]
    return tree, mx.sqrt(sum((mx.sum(g.astype(mx.float32) ** 2) for g in leaves), mx.array(0.0)))


# An optimizer's compiled update, by clip: the function traces the optimizer's own
# apply_gradients once (its schedule and step counter are state, so each call reads
# them anew) and goes with the optimizer (it holds the optimizer weakly).
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(optimizer, grad_clip: float | None, params: dict):
    fns = _COMPILED.setdefault(optimizer, {})
    if grad_clip not in fns:
        # AdamW's moments made before the first trace, so the state's shape is fixed
        # (a checkpoint's load later replaces it with a state of the same shape)
        optimizer.init(params)
        ref = weakref.ref(optimizer)

        def update(params, tree, state):
            opt = ref()
            opt.state = state   # the trace's tracers; the caller puts the result back
            tree, norm = _clipped(tree, grad_clip)
            return opt.apply_gradients(tree, params), opt.state, norm
        fns[grad_clip] = mx.compile(update)
    return fns[grad_clip]
