"""One decoder layer run over a long row in pieces: its forward and its backward
hold one block of attention rows or one chunk of MLP rows at a time.

A layer's memory at long context is not its boundary but its transients: at
32K tokens on a Llama-3.1-8B shape one MLP holds three [L, 14336] activations
(~2.8 GB in bf16), their gradients as many again, and MLX's attention backward
the whole [H, L, L] score matrix. Two kinds of op inside a layer are cut:

- attention calls (mlx-lm's `scaled_dot_product_attention`, swapped in), in
  blocks of `block` query rows (engine/attention.py);
- token-wise sublayers (the MLP, a mixture of experts): every row's output is a
  function of that row alone, so the MLP of rows [a, b) is the MLP of the whole
  row restricted to [a, b), in the forward and in the backward alike. Which
  children of a layer are token-wise is checked per layer class
  (`tokenwise_children`), not assumed from a name.

Outside any transform (the segment forward, the recompute of a segment's layer
inputs, a no-gradient pass) `eager(...)` runs those ops piece by piece and
evaluates each piece before the next, so a GPU queue never holds every piece's
transients at once.

Inside a vjp nothing can be evaluated without keeping its graph, so `layer_vjp`
takes the layer's backward in passes, with each heavy op (in the order the
layer calls them: op 0, op 1, ... op n-1) standing in as a function whose
forward is a stored value:

0. forward, eagerly, storing each op's inputs and output;
1. for k = n-1 down to 0: the vjp of the layer in which ops after k hand back
   their known input gradients, op k records the cotangent of its output, and
   ops before k hand back zeros; then op k's input gradients are computed
   piece by piece, outside any transform. An op's output cotangent depends only
   on the ops called after it (an op's input is made before it is called), so
   each is exact when recorded;
2. the vjp once more, every op handing back its gradients: the layer's input
   and parameter gradients.

Each pass runs only the layer's light parts (norms, projections, residuals);
the heavy ops run once forward (0) and once forward and backward, in pieces.
A token-wise sublayer's trainable parameters go into its stand-in as inputs so
that their gradients come back through it; its LoRA dropout must be off (a
chunk would draw other masks than the whole row does), else it is not cut.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import attention

# Children a layer may call its token-wise sublayer by; each is still checked.
TOKENWISE_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")


# ---------------------------------------------------------------- which children

# A probe of whether a layer (or a child) may be cut runs it on PROBE_ROWS rows,
# whole and in two pieces. The step's pieces are thousands of rows long, and a
# probe should run the kernels they run: mlx-lm's experts sort their tokens from
# 64 routed rows up, which a few rows never reach. On a 6-row probe, a gpt-oss
# layer's backward failed on CUDA (MLX 0.32: "cuGraphAddKernelNode ... invalid
# argument"), so its layers ran whole at 64K tokens, not rows apart.
PROBE_ROWS = 128


def spans(n: int, chunk: int) -> list[tuple[int, int]]:
    """Rows [0, n) in pieces of at most `chunk`, as even as can be: a row of
    2 chunk + 5 is three pieces of about (2 chunk + 5) / 3, never a 5-row tail
    (a few rows take other kernels than a chunk does: PROBE_ROWS)."""
    k = max(1, -(-n // chunk))
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def tokenwise_children(layer: nn.Module, run_layer, dim: int) -> list[str]:
    """Names of `layer`'s children that are token-wise and that the layer calls once,
    on its whole row. `run_layer(h)` runs the layer on h [1, n, dim]."""
    found = []
    for name in TOKENWISE_NAMES:
        child = layer.get(name) if isinstance(layer, dict) else None
        if not isinstance(child, nn.Module) or not _rowwise(child, dim):
            continue
        calls: list = []

        def spy(x, _child=child, _calls=calls):
            _calls.append(tuple(x.shape))
            return _child(x)
        try:
            with _swapped_child(layer, name, spy):
                mx.eval(run_layer(_probe_rows(dim, PROBE_ROWS)))
        except Exception:
            continue
        if calls == [(1, PROBE_ROWS, dim)]:
            found.append(name)
    return found


def _probe_rows(dim: int, n: int, dtype=mx.float32) -> mx.array:
    key = mx.random.key(7)  # its own key: the caller's random stream is left alone
    return mx.random.normal((1, n, dim), key=key).astype(dtype)


def _rowwise(module: nn.Module, dim: int) -> bool:
    """module(x) of PROBE_ROWS rows equals the module of its two halves apart, and
    keeps x's shape."""
    try:
        dtype = next((v.dtype for _, v in tree_flatten(module.parameters())
                      if mx.issubdtype(v.dtype, mx.floating)), mx.float32)
        x = _probe_rows(dim, PROBE_ROWS, dtype)
        whole = module(x)
        if not isinstance(whole, mx.array) or whole.shape != x.shape:
            return False
        half = PROBE_ROWS // 2
        cut = mx.concatenate([module(x[:, :half]), module(x[:, half:])], axis=1)
        return same_cut(whole, cut)
    except Exception:
        return False


def set_params(module: nn.Module, names: list[str], values) -> None:
    """Put `values` in as the module's parameters `names` (tracers inside a vjp)."""
    module.update(tree_unflatten(list(zip(names, values))))


def put_params(layers, keys: list[tuple[int, str]], values) -> None:
    """set_params over several layers: `keys` are (layer index, local name)."""
    by_layer: dict[int, tuple[list, list]] = {}
    for (i, local), v in zip(keys, values):
        names, vals = by_layer.setdefault(i, ([], []))
        names.append(local)
        vals.append(v)
    for i, (names, vals) in by_layer.items():
        set_params(layers[i], names, vals)


def same_cut(whole: mx.array, cut: mx.array) -> bool:
    """Whether an op run in pieces gave what it gave whole: the same shape and
    within 1% of the whole's largest magnitude (the order of sums differs)."""
    if whole.shape != cut.shape:
        return False
    a, b = whole.astype(mx.float32), cut.astype(mx.float32)
    scale = max(float(mx.max(mx.abs(a))), 1e-6)
    return bool(float(mx.max(mx.abs(a - b))) <= 1e-2 * scale)


def dropout_off(module: nn.Module) -> bool:
    return all(getattr(m, "_p_1", 1.0) == 1.0 for m in module.modules()
               if isinstance(m, nn.Dropout))


@contextmanager
def _swapped_child(layer: nn.Module, name: str, fn):
    # An instance attribute is found before the module's own dict entry, so the
    # layer calls `fn` while its parameter tree (and every name in it) stays as is.
    layer.__dict__[name] = fn
    try:
        yield
    finally:
        layer.__dict__.pop(name, None)


@contextmanager
def _children_swapped(layers_and_names, make):
    """Within the block, layer.<name>(x) calls make(child) for each (layer, names)."""
    done = []
    try:
        for layer, names in layers_and_names:
            for name in names:
                layer.__dict__[name] = make(layer[name])
                done.append((layer, name))
        yield
    finally:
        for layer, name in done:
            layer.__dict__.pop(name, None)


# ---------------------------------------------------------------- eager forward

@contextmanager
def eager(layers, tokenwise: list[list[str]], chunk: int):
    """Outside any transform: token-wise children of `layers` run `chunk` rows at a
    time and blocked attention one block at a time, each piece evaluated before
    the next."""
    cut = [(layer, names) for layer, names in zip(layers, tokenwise) if names] if chunk else []
    with attention.eager_blocks(), _children_swapped(cut, lambda child: _chunked(child, chunk)):
        yield


def _chunked(module, chunk):
    def run(x):
        n = x.shape[1]
        if n <= chunk or not dropout_off(module):
            return module(x)
        mx.eval(x)
        outs = []
        for a, b in spans(n, chunk):
            outs.append(module(x[:, a:b]))
            mx.eval(outs[-1])
        return mx.concatenate(outs, axis=1)
    return run


# ---------------------------------------------------------------- backward in passes

@dataclass
class _Op:
    inputs: list                     # evaluated primal inputs
    output: mx.array                 # evaluated forward output
    grads_of: Callable               # d_out -> input gradients, in pieces, outside transforms
    d_out: mx.array | None = None
    grads: tuple | None = None


@dataclass
class _Pass:
    ops: list[_Op]
    record: int | None = None        # None: pass 0 (forward, storing); else the op recording
    seen: int = 0
    modes: list[str] = field(default_factory=list)

    def next(self) -> tuple[int, str]:
        k, self.seen = self.seen, self.seen + 1
        if self.record is None:
            return k, "store"
        if k < self.record:
            return k, "zero"
        return k, "record" if k == self.record else "replay"


def layer_vjp(layer, names: list[str], fn, primals: list, cotangents: list, block: int,
              chunk: int) -> list:
    """mx.vjp(fn, primals, cotangents)[1] for `fn`, which runs `layer` once, with its
    attention backward in blocks of `block` query rows (0: MLX's own) and its
    token-wise children `names` in chunks of `chunk` rows (0: whole). `fn` must
    draw the same dropout masks on every call (the step seeds per layer)."""
    run = _Pass([])
    with _heavy(layer, names, block, chunk, run), attention.eager_blocks():
        fn(*primals)  # pass 0
    ops = run.ops
    if not ops:  # nothing to cut on this row: the plain vjp
        return mx.vjp(fn, primals, cotangents)[1]
    for k in reversed(range(len(ops))):
        with _heavy(layer, names, block, chunk, _Pass(ops, record=k)):
            mx.vjp(fn, primals, cotangents)
        mx.eval(ops[k].d_out)
        ops[k].grads = ops[k].grads_of(ops[k].d_out)
        ops[k].d_out = None
    with _heavy(layer, names, block, chunk, _Pass(ops, record=-1)):
        _, cots = mx.vjp(fn, primals, cotangents)
    return cots


@contextmanager
def _heavy(layer, names, block, chunk, run: _Pass):
    """Within the block, `layer`'s blockable attention calls and its token-wise
    children (on rows longer than the piece) are `run`'s stand-ins."""
    def attn(original):
        def sdpa(queries, keys, values, cache, scale, mask, sinks=None, softcap=None):
            if not block or queries.shape[2] <= block or not attention.blockable(cache, mask):
                return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                sinks=sinks, **attention.capped(softcap))
            extra = [] if sinks is None else [sinks]

            def compute(q, k, v, *s):
                return attention.attend(q, k, v, scale, mask, *s, softcap=softcap)

            def grads_of(ins, out):
                def grads(d):
                    # rowsum(dO O), for a row long enough to go tile by tile over its
                    # keys (its donor's K/V, its sinks and its soft cap included)
                    tiled = attention.tiles_keys(d.shape[2], *ins[3:])
                    return attention.blocked_grads(*ins[:3], d, mask, scale, block, *ins[3:],
                                                   delta=attention.delta_of(d, out) if tiled else None,
                                                   softcap=softcap)
                return grads
            return _stand_in(run, [queries, keys, values, *extra], compute, grads_of)
        return sdpa

    def tokenwise(child):
        def call(x):
            if not chunk or x.shape[1] <= chunk or not dropout_off(child):
                return child(x)
            pnames = [n for n, _ in tree_flatten(child.trainable_parameters())]
            params = [v for _, v in tree_flatten(child.trainable_parameters())]

            def compute(x, *p):
                return _chunked(child, chunk)(x)
            return _stand_in(run, [x, *params], compute,
                             lambda ins, out: lambda d: _chunked_vjp(child, pnames, ins[0],
                                                                     ins[1:], d, chunk))
        return call

    cut = [(layer, names)] if chunk and names else []
    with attention.swapped_sdpa([layer], attn), _children_swapped(cut, tokenwise):
        yield


def _stand_in(run: _Pass, inputs: list, compute, grads_for):
    """Pass 0: compute (eagerly, in pieces) and store; later passes: the stored
    output, with the vjp the pass gives this op."""
    k, mode = run.next()
    if mode == "store":
        out = compute(*inputs)
        mx.eval(inputs, out)
        run.ops.append(_Op(list(inputs), out, grads_for(list(inputs), out)))
        return out
    op = run.ops[k]

    @mx.custom_function
    def stand_in(*xs):
        return op.output

    @stand_in.vjp
    def stand_in_vjp(primals, cotangent, output):
        if mode == "record":
            op.d_out = cotangent[0] if isinstance(cotangent, (list, tuple)) else cotangent
        if mode == "replay":
            return tuple(op.grads)
        return tuple(mx.zeros_like(x) for x in primals)

    return stand_in(*inputs)


def _chunked_vjp(module, names, x, values, d_out, chunk):
    """(dx, *d params) of module at x with cotangent d_out, `chunk` rows at a time:
    rows are independent, so dx is the rows' dx side by side and each parameter's
    gradient the sum of the chunks'."""
    def f(xc, *p):
        set_params(module, names, p)
        return module(xc)

    dxs, acc = [], None
    try:
        for a, b in spans(x.shape[1], chunk):
            _, (dx, *dp) = mx.vjp(f, [x[:, a:b], *values], [d_out[:, a:b]])
            acc = dp if acc is None else [s + g for s, g in zip(acc, dp)]
            mx.eval(dx, acc)
            dxs.append(dx)
    finally:
        set_params(module, names, values)
    return (mx.concatenate(dxs, axis=1), *acc)
