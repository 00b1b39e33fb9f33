"""A segment's forward, its recompute under vjp and the head's chunks as compiled
functions (docs/engine.md, "Fused segments"): on a GPU a layer's elementwise work
then runs as a few fused kernels instead of one kernel an operation, as mlx-lm
compiles its whole step.

A compiled function replays the graph it traced: an array it did not take as an
input stays what it was then, and every Python branch goes as it went then. So
the segment's LoRA weights go in as inputs beside its boundary and cotangent
(the frozen base weights, the norm and the head may stay captured), and so do
a ragged stream's layout arrays (engine/ragged.py: which token sits where);
only streams whose segments take nothing else fuse (`fusable`).

MLX traces a compiled function again for each new input shape and keeps every
trace until the function goes (~5 MB a shape on an 8 x 256 model), and a trace
takes time. So a stream's shape runs compiled from the second time it comes
(`ready`: a shape seen once never pays for a trace), and a model keeps the
functions of its `MAX_SHAPES` shapes used last (`Cache`), each shape's own, so
that dropping one frees its traces.

A layer that evaluates an array inside its call (the engine's own backward of
attention sinks, off the CPU) cannot be traced at all: MLX refuses at the
trace, and the model runs unfused from there on (`Cache.refused`), the segment
at hand included."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from .layer import dropout_off, put_params

Run = Callable[[mx.array], mx.array]   # layers [lo, hi) on h, as the modules hold them
Shape = tuple[int, ...]   # a stream's [sequences, length] (plans.Stream.shape)
MAX_SHAPES = 16           # stream shapes whose compiled functions a model keeps
SEEN_ONCE = 4096          # shapes remembered as seen once (then forgotten, all)


@dataclass
class Cache:
    """A model's compiled functions (`ModelParts.fused`): by stream shape, the one
    used last at the end, and by what each runs; and the shapes seen once."""
    fns: OrderedDict[Shape, dict[tuple, Callable]] = field(default_factory=OrderedDict)
    once: set[Shape] = field(default_factory=set)
    refused: str | None = None   # why a trace failed: the model fuses no more


def ready(parts, shape: Shape) -> bool:
    """Whether a stream of `shape` runs compiled this time: not the first time the
    model sees the shape, from the second on (made room for, dropping the shape
    used longest ago past MAX_SHAPES)."""
    cache = parts.fused = parts.fused or Cache()
    if cache.refused:
        return False
    if shape in cache.fns:
        cache.fns.move_to_end(shape)
        return True
    if shape not in cache.once:
        if len(cache.once) >= SEEN_ONCE:
            cache.once.clear()
        cache.once.add(shape)
        return False
    cache.once.discard(shape)
    cache.fns[shape] = {}
    if len(cache.fns) > MAX_SHAPES:
        cache.fns.popitem(last=False)   # MLX frees the traces with the functions
    return True


def fusable(parts, stream, masks, extras, rows: int, chunk: int) -> bool:
    """Whether the stream's segments can run compiled with the same result: the
    model's own masks or a ragged layout (no packed or prefix-shared layout, whose
    masks and RoPE runs follow the rows' lengths, and no window or attention block
    cut into calls), no per-layer inputs, no donor K/V, no pieces evaluated inside
    a layer, and no dropout (its masks come from the random state)."""
    own = stream.ragged
    return ((not stream.masked or own is not None) and not stream.runs and not rows and not chunk
            and all(m is None or isinstance(m, str) or own is not None and
                    (m is own or getattr(m, "layout", None) is own) for m in masks)
            and all(e is None for e in extras) and all(d is None for d in parts.donors)
            and all(dropout_off(layer) for layer in parts.layers))


def compiled(parts, shape: Shape, key: tuple, make: Callable) -> Callable:
    """The compiled `make()` for `key` in streams of `shape` (`ready` said so)."""
    fns = parts.fused.fns[shape]
    fn = fns.get(key)
    if fn is None:
        fn = fns[key] = mx.compile(make())
    return fn


def forward(parts, shape: Shape, key: tuple, lo: int, hi: int, run: Run,
            h: mx.array, layout=None) -> mx.array | None:
    """Layers [lo, hi) on h, compiled (None where the trace failed: run them
    unfused); `key` names what else the run depends on (the layers' masks);
    `layout`: a ragged stream's, its arrays put in as inputs."""
    names, values = _trainables(parts, lo, hi)
    aux = layout.arrays() if layout else []
    make = lambda: _with_weights(parts, names, run, layout)
    return _traced(parts, names, values, layout, aux,
                   lambda: compiled(parts, shape, ("fwd", lo, hi, *key), make)(h, *aux, *values))


def vjp(parts, shape: Shape, key: tuple, lo: int, hi: int, run: Run, h: mx.array,
        dh: mx.array, layout=None):
    """(d h_in, {(layer, name): gradient}) of layers [lo, hi) at h under cotangent
    dh, the recompute and its vjp compiled (None where the trace failed)."""
    names, values = _trainables(parts, lo, hi)
    aux = layout.arrays() if layout else []

    def make():
        fn = _with_weights(parts, names, run, layout)
        return lambda x, d, *flat: mx.vjp(lambda y, *p: [fn(y, *flat[:len(aux)], *p)],
                                          [x, *flat[len(aux):]], [d])[1]

    cots = _traced(parts, names, values, layout, aux, lambda: compiled(
        parts, shape, ("bwd", lo, hi, *key), make)(h, dh, *aux, *values))
    return None if cots is None else (cots[0], dict(zip(names, cots[1:])))


def joint(parts, shape: Shape, key: tuple, lo: int, hi: int, run: Run, head: Callable,
          h: mx.array, inputs: list[mx.array], layout=None, input_grad: bool = True):
    """(log p of the read rows, d h_in or None, {(layer, name): gradient}) of layers
    [lo, hi) and the head on h as one compiled vjp: their forward runs once, inside
    it, as mlx-lm's compiled step runs (the kept top layers of a plan whose loss
    is linear in its sums: engine/step.py). `head(out, *inputs)` -> (loss, log p),
    the loss differentiated, log p returned beside it; `inputs`: the head's arrays
    (rows, targets, weights), inputs of the compiled function like the layout's.
    input_grad False: no gradient of h (the layers start at the embedding). None
    where the trace failed."""
    names, values = _trainables(parts, lo, hi)
    aux = layout.arrays() if layout else []
    n_in, first = len(inputs), 1 if input_grad else 0

    def make():
        fn = _with_weights(parts, names, run, layout)

        def step(x, *flat):
            head_in, rest = flat[:n_in], flat[n_in:]

            def loss(*primals):
                y, p = (primals[0], primals[1:]) if input_grad else (x, primals)
                out = fn(y, *rest[:len(aux)], *p)
                value, logp = head(out, *head_in)
                return [value, mx.stop_gradient(logp)]
            primals = ([x] if input_grad else []) + list(rest[len(aux):])
            (_, logp), cots = mx.vjp(loss, primals, [mx.array(1.0), mx.zeros(head_in[0].shape)])
            return logp, cots
        return step

    got = _traced(parts, names, values, layout, aux, lambda: compiled(
        parts, shape, ("joint", lo, hi, input_grad, *key), make)(h, *inputs, *aux, *values))
    if got is None:
        return None
    logp, cots = got
    return logp, (cots[0] if input_grad else None), dict(zip(names, cots[first:]))


def _traced(parts, names, values, layout, aux, call: Callable):
    """call(), or None where its trace met an evaluation inside (the model is then
    fused no more); the weights and the layout's arrays put back either way (a
    trace leaves its tracers in the modules)."""
    try:
        return call()
    except ValueError as e:   # MLX: "... eval an array during function transformations ..."
        if "function transformations" not in str(e):
            raise
        parts.fused.refused = str(e).splitlines()[0]
        parts.fused.fns.clear()
        return None
    finally:
        put_params(parts.layers, names, values)
        if layout:
            layout.put(aux)


def _trainables(parts, lo, hi) -> tuple[list[tuple[int, str]], list[mx.array]]:
    flat = [((i, local), v) for i in range(lo, hi)
            for local, v in tree_flatten(parts.layers[i].trainable_parameters())]
    return [n for n, _ in flat], [v for _, v in flat]


def _with_weights(parts, names, run: Run, layout=None):
    n = len(layout.arrays()) if layout else 0

    def fn(h, *values):
        if layout:
            layout.put(values[:n])
        put_params(parts.layers, names, values[n:])
        return run(h)
    return fn

