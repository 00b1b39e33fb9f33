"""Loading an mlx-lm model and cutting it into the pieces the segmented step needs.

The segmented backward calls the decoder layers one segment at a time, so it needs
the model as parts: embed -> layers (each with its attention mask) -> final norm ->
lm head. mlx-lm's model classes do not expose that split. For the families whose
forward is `embed -> layer(h, mask) ... -> norm -> head`, `_observe` lets the
model's own forward say what the parts are: it runs with every layer replaced by
a tap and mlx-lm's mask maker by a recorder, so the embedding (with whatever scale
the family applies), each layer's mask (its window, whatever the config calls
it) and the hand-over from layer to layer are the model's, not a guess. The head
is the lm_head (or tied embedding) plus the few logit transforms a family adds
(`_LOGIT_TWISTS`). Gemma-4's per-layer inputs and K/V sharing are cut by hand.

Then the cut is *checked* against the model's own forward on a row longer than
every window the config declares, so each mask kind the family uses is part of
the check. A model that calls its layers some other way, changes the hidden
state between them, builds masks of its own kind, or computes anything we do not
reproduce fails with a one-line `ModelError` instead of training on a different
loss. `check_family` runs the same cut on a model built from config.json alone
(no weights read), so validate, plan and submit refuse such a family up front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

from segctl.schemas.errors import UserError
from segctl.schemas.limits import read_model_config

from . import capped


class ModelError(UserError):
    """The model folder or its architecture cannot be used; message names the folder."""


@dataclass
class ModelParts:
    """The model as embed -> layers -> norm -> head, one layer callable at a time.

    Run layer i as `h, kv = call(i, h, masks(h)[i], extras[i], kv_of[donors[i]])`
    where `extras = layer_inputs(ids, embed(ids))` and `kv_of[j]` is the kv layer j
    returned; `forward_parts` is the reference composition.
    """
    embed: Callable[[mx.array], mx.array]       # ids [B, L] -> h [B, L, D]
    layers: list[nn.Module]                     # decoder layers (the modules LoRA goes on)
    masks: Callable[[mx.array], list]           # h -> one attention mask per layer
    norm: Callable[[mx.array], mx.array]        # final norm
    head: Callable[[mx.array], mx.array]        # normed h -> logits
    windows: list[int | None]                   # per layer: sliding window, None = full attention
    donors: list[int | None]                    # per layer: j when it attends with layer j's K/V
    layer_inputs: Callable[[mx.array, mx.array], list]  # (ids, embed(ids)) -> one extra per layer
    call: Callable[..., tuple]                  # (i, h, mask, extra=None, shared_kv=None) -> (h, kv)
    prefix: str = "model.layers"                # the layers' parameter names start so
    block_masks: list[bool] | None = None       # per layer: attention takes a BlockMask
    tokenwise: list[list[str]] | None = None    # per layer: its token-wise children (engine/layer.py)
    rowwise: list[bool] | None = None           # per layer: may run rows apart (engine/rows.py)
    # per layer class the row-wise probe refused: why (a layer with donor K/V or
    # per-layer inputs is not probed: those are whole by design)
    whole_rows: dict[str, str] = field(default_factory=dict)
    pack_verdict: tuple | None = None           # (why rows cannot be packed, or None): step.pack_refusal
    side_verdict: tuple | None = None           # (why rows cannot run side by side, or None): step.side_refusal
    ragged_verdict: tuple | None = None         # (the same, unpadded, or None): step.ragged_refusal
    fused: Any = None                           # engine/fused.py's Cache: compiled functions


def load_model(path: str | Path):
    """(model, tokenizer) from a local Hugging Face folder through mlx-lm's loader."""
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise ModelError(f"{folder}: model folder not found")
    config = _config(folder)
    if not list(folder.glob("model*.safetensors")):
        raise ModelError(f"{folder}: no model*.safetensors weights")
    try:
        model, _ = mlx_load_model(folder)
    except ValueError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"{folder}: {msg}") from None
    except Exception as e:  # corrupt safetensors, wrong shapes, missing tensors
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"{folder}: cannot load weights: {msg}") from None
    try:
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"{folder}: cannot load tokenizer: {msg}") from None
    model_parts(model, name=str(folder))  # fail now, not mid-training
    return model, tokenizer


def check_family(path: str | Path) -> None:
    """Refuse, without reading any weights, a model folder whose architecture cannot
    be cut into segments: the model is built from config.json with its parameters
    left unevaluated (MLX is lazy, so this allocates nothing) and cut as training
    would cut it. The numeric check of the cut needs the weights and runs when the
    model is loaded (`load_model`). Raises ModelError with one line."""
    from mlx_lm.utils import _get_classes

    folder = Path(path)
    config = _config(folder)
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except (Exception, SystemExit) as e:  # an mlx-lm module that exits on import (olmo)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"{folder}: model type {config['model_type']}: {msg}") from None
    model_parts(model, name=str(folder), check=False, run_layers=False)


def _config(folder: Path) -> dict:
    """config.json, held to schemas/limits.py's bounds before mlx-lm builds anything
    from it (a billion layers, a model_type that is a path)."""
    try:
        return read_model_config(folder)
    except ValueError as e:
        raise ModelError(str(e)) from None


def apply_lora(model: nn.Module, *, rank: int, scale: float, dropout: float,
               num_layers: int = -1, keys: list[str] | None = None) -> dict:
    """Freeze the model and put mlx-lm LoRA layers on it; returns the adapter config.

    The returned dict is mlx-lm's `adapter_config.json`, so `mlx_lm.load(...,
    adapter_path=...)` rebuilds exactly these layers.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    n = len(model.layers)
    num_layers = n if num_layers in (-1, None) or num_layers > n else num_layers
    params: dict = {"rank": rank, "scale": scale, "dropout": dropout}
    if keys:
        params["keys"] = list(keys)
    model.freeze()
    linear_to_lora_layers(model, num_layers, params)
    if not tree_flatten(model.trainable_parameters()):
        raise ModelError(f"lora.keys {keys} match no layer of the model")
    return {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}


def model_parts(model: nn.Module, *, name: str = "model", check: bool = True,
                run_layers: bool = True) -> ModelParts:
    """Cut `model` into `ModelParts`; with `check`, prove the cut against model(ids);
    `run_layers=False` runs no layer (no weights are evaluated) and leaves
    `block_masks` unset.
    A multimodal wrapper (mlx-lm keeps only its language model) is cut through
    its `language_model`, and still checked against the wrapper's own forward."""
    text = model
    if getattr(model, "model", None) is None and hasattr(model, "language_model"):
        text = model.language_model
    inner = getattr(text, "model", None)
    mtype = (getattr(getattr(model, "args", None), "model_type", "")
             or type(model).__module__.rsplit(".", 1)[-1])
    missing = [a for a in ("embed_tokens", "layers", "norm") if not hasattr(inner, a)]
    if inner is None or missing:
        raise ModelError(f"{name}: architecture {mtype} cannot be cut into segments "
                         f"(no model.{', model.'.join(missing or ['model'])})")
    length = check_length(text)
    ttype = getattr(getattr(text, "args", None), "model_type", "") or mtype
    if ttype == "gemma4_text":
        parts = _gemma4_parts(text, inner)
    else:
        parts = _plain_parts(text, inner, ttype, name, length)
    if text is not model:
        parts.prefix = "language_model.model.layers"
    if run_layers:  # not on a model built from config.json alone (check_family)
        h0 = parts.embed(mx.array([[1]]))
        capped.adopt(parts.layers, h0.shape[-1], h0.dtype)
        parts.block_masks = _block_mask_layers(parts, inner.embed_tokens.weight.shape[0])
        parts.tokenwise = _tokenwise_layers(parts, inner.embed_tokens.weight.shape[0])
        parts.rowwise, parts.whole_rows = _rowwise_layers(parts)
    if check:
        _check_parts(model, parts, name, mtype, length, inner.embed_tokens.weight.shape[0])
    return parts


# Beyond this many tokens the check does not run the model (a load-time forward
# of a real model grows with it); masks past it are still the ones the model's
# own forward asks for, by construction (`_observe`).
CHECK_CAP = 4096


def check_length(model) -> int:
    """Tokens in the cut check: longer than every window the config declares (up
    to CHECK_CAP), so each kind of mask a family uses is part of the check."""
    windows = [w for w in _declared_windows(getattr(model, "args", None)) if w < CHECK_CAP]
    return max(windows, default=4) + 2


def _declared_windows(args) -> list[int]:
    # Window-like sizes under whatever name the family gives them: sliding_window,
    # window_size, per-layer lists, chunked attention's chunk size.
    out = []
    for key, val in (vars(args).items() if args is not None else ()):
        k = key.lower()
        if not ("window" in k or k == "attention_chunk_size") or "pattern" in k or "layers" in k:
            continue
        vals = val if isinstance(val, (list, tuple)) else [val]
        out += [v for v in vals if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return out


@dataclass(frozen=True)
class _MaskSpec:
    """The arguments a layer's mask was made with by mlx-lm's create_attention_mask."""
    window: int | None
    array: bool

    def make(self, h):
        return create_attention_mask(h, None, window_size=self.window, return_array=self.array)


@dataclass
class _Observed:
    h0: mx.array                 # what the model hands its first layer
    masks: list                  # per layer: a _MaskSpec, None or "causal"
    mask_keys: list              # per layer: {argument name: None, or "mask" for the mask}


class _Tap:
    """Stands in for a layer while the model's own forward runs: records how it is
    called and hands its input on unchanged (so no layer computes anything)."""

    def __init__(self, layer, log):
        self._layer, self._log = layer, log

    def __getattr__(self, key):
        return getattr(self._layer, key)

    def __call__(self, *args, **kwargs):
        self._log.append((self, args, kwargs))
        return args[0] if args else next(iter(kwargs.values()))


class _CutError(Exception):
    pass


def _observe(inner, ids) -> _Observed:
    """Run inner(ids) with every layer replaced by a _Tap and the module's
    create_attention_mask by a recorder: the model's own forward then says what its
    first layer receives, which mask each layer gets, and that each layer's output
    goes unchanged into the next. Costs an embedding lookup, no layer."""
    import inspect
    import sys

    layers = list(inner.layers)
    log: list = []
    module = sys.modules[type(inner).__module__]
    saved_mask = getattr(module, "create_attention_mask", None)

    def record(h, cache=None, window_size=None, return_array=False):
        return _MaskSpec(window_size, bool(return_array))

    inner.layers = [_Tap(layer, log) for layer in layers]
    if saved_mask is not None:
        setattr(module, "create_attention_mask", record)
    # A family whose inner model takes its cache positionally is called with none.
    params = inspect.signature(inner.__call__).parameters
    cache = {"cache": None} if "cache" in params and \
        params["cache"].default is inspect.Parameter.empty else {}
    try:
        inner(ids, **cache)
    except _CutError:
        raise
    except Exception as e:
        raise _CutError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        inner.layers = layers
        if saved_mask is not None:
            setattr(module, "create_attention_mask", saved_mask)
    if len(log) != len(layers) or any(t._layer is not l for (t, _, _), l in zip(log, layers)):
        raise _CutError("its forward does not call each layer once, in order")
    masks, keys, prev = [], [], None
    for k, (tap, args, kwargs) in enumerate(log):
        bound = inspect.signature(tap._layer.__call__).bind(*args, **kwargs)
        names = list(bound.arguments)
        h = bound.arguments[names[0]]
        if k and h is not prev:
            raise _CutError("its forward changes the hidden state between layers")
        prev = h
        mkey = next((n for n in names[1:] if "mask" in n), None)
        mask = bound.arguments.get(mkey) if mkey else None
        others = [n for n in names[1:] if n != mkey and bound.arguments[n] is not None]
        if others:
            raise _CutError(f"its layers take more than the hidden state and a mask ({others[0]})")
        if mask is not None and not isinstance(mask, _MaskSpec) and not (
                isinstance(mask, str) and mask == "causal"):
            raise _CutError("it builds attention masks of its own kind")
        masks.append(mask)
        # The mask goes under its own name; the rest the model passed (None, a
        # cache it does not have) are passed as None again.
        keys.append({n: None for n in names[1:]} | ({mkey: "mask"} if mkey else {}))
    return _Observed(log[0][1][0] if log[0][1] else next(iter(log[0][2].values())), masks, keys)


def _block_mask_layers(parts: ModelParts, vocab: int) -> list[bool]:
    """Per layer, whether its attention takes a BlockMask (engine/attention.py) and
    gives what "causal" gives: it must hand the mask to mlx-lm's attention and
    nothing else (MLA, for one, also adds it to position scores itself). Tried
    once per layer class on a few tokens; a layer that fails gets array masks.
    Gemma-4's layers (K/V sharing, per-layer inputs) are tested to take them."""
    from .attention import BlockMask, block_mask_sdpa, swapped_sdpa, takes_block_masks

    if parts.donors and any(d is not None for d in parts.donors) or \
            type(parts.layers[0]).__module__.endswith("gemma4_text"):
        return [takes_block_masks(layer) for layer in parts.layers]
    verdict: dict[type, bool] = {}
    ids = mx.array([[(5 * i + 1) % vocab for i in range(6)]])
    out = []
    for i, layer in enumerate(parts.layers):
        kind = type(layer)
        if kind not in verdict:
            verdict[kind] = takes_block_masks(layer) and _same_with_block_mask(
                parts, i, ids, BlockMask, block_mask_sdpa, swapped_sdpa)
        out.append(verdict[kind])
    return out


def _tokenwise_layers(parts: ModelParts, vocab: int) -> list[list[str]]:
    """Per layer, the children engine/layer.py may run a chunk of rows at a time:
    checked once per layer class, on the embedding of a few tokens."""
    from .layer import tokenwise_children

    verdict: dict[type, list[str]] = {}
    out = []
    for i, layer in enumerate(parts.layers):
        kind = type(layer)
        if kind not in verdict:
            dim = parts.embed(mx.array([[1]])).shape[-1]

            def run_layer(h, i=i):
                extra = parts.layer_inputs(mx.array([[(5 * t + 1) % vocab for t in range(
                    h.shape[1])]]), h)[i]
                return parts.call(i, h.astype(parts.embed(mx.array([[1]])).dtype), "causal",
                                  extra, None)[0]
            verdict[kind] = [] if parts.donors[i] is not None else \
                tokenwise_children(layer, run_layer, dim)
        out.append(verdict[kind])
    return out


def _rowwise_layers(parts: ModelParts) -> tuple[list[bool], dict[str, str]]:
    """(per layer, whether engine/rows.py may run it a chunk of rows at a time: no
    K/V from another layer, no per-layer inputs, and the same output and gradients
    cut as whole under each mask kind the step gives it; checked once per layer
    class), (why the probe refused a class, by its name)."""
    from .attention import BlockMask
    assert parts.block_masks is not None   # model_parts sets them just before
    from .rows import refusal

    h0 = parts.embed(mx.array([[1]]))
    dim, dtype = h0.shape[-1], h0.dtype
    extras = parts.layer_inputs(mx.array([[1] * 6]), mx.zeros((1, 6, dim), dtype))
    verdict: dict[type, str | None] = {}
    out = []
    for i, layer in enumerate(parts.layers):
        kind = type(layer)
        if parts.donors[i] is not None or extras[i] is not None:
            out.append(False)
            continue
        if kind not in verdict:
            masks = ("causal", BlockMask(rows=2)) if parts.block_masks[i] else ("causal",)
            verdict[kind] = refusal(layer, lambda h, m, i=i: parts.call(i, h, m)[0], dim, dtype,
                                    masks)
        out.append(verdict[kind] is None)
    return out, {kind.__name__: why for kind, why in verdict.items() if why}


def _same_with_block_mask(parts, i, ids, BlockMask, block_mask_sdpa, swapped_sdpa) -> bool:
    try:
        h = parts.embed(ids)
        ref, _ = parts.call(i, h, "causal")
        with swapped_sdpa([parts.layers[i]], block_mask_sdpa):
            got, _ = parts.call(i, h, BlockMask(rows=2))
        return bool(mx.allclose(got, ref, rtol=1e-3, atol=1e-3).item())
    except Exception:
        return False


# Logit transforms a family applies after its lm_head (or tied embedding).
_LOGIT_TWISTS = {
    "gemma2": lambda args, out: mx.tanh(out / args.final_logit_softcapping)
    * args.final_logit_softcapping,
    "granite": lambda args, out: out / args.logits_scaling,
    "cohere": lambda args, out: out * args.logit_scale,
    "cohere2": lambda args, out: out * args.logit_scale,
}


def _plain_parts(model, inner, mtype, name, length) -> ModelParts:
    """Families whose forward is embed -> layer(h, mask) ... -> norm -> head. The
    embedding (with its scale) and each layer's mask come from the model's own
    forward (`_observe`), so a family's windows, layer types and mask patterns are
    the model's, whatever its config calls them."""
    args = getattr(model, "args", None)
    layers = list(inner.layers)
    try:
        seen = _observe(inner, mx.zeros((1, length), dtype=mx.int32))
    except _CutError as e:
        raise ModelError(f"{name}: architecture {mtype} cannot be cut into segments ({e})") \
            from None
    specs, keys = seen.masks, seen.mask_keys
    twist = _LOGIT_TWISTS.get(mtype)

    def embed(ids):
        return _observe(inner, ids).h0

    def head(hn):
        if mtype == "minicpm":
            if args.tie_word_embeddings:
                return hn @ inner.embed_tokens.weight.T
            return model.lm_head(hn / (args.hidden_size / args.dim_model_base))
        out = model.lm_head(hn) if hasattr(model, "lm_head") else inner.embed_tokens.as_linear(hn)
        return twist(args, out) if twist else out

    windows = [s.window if isinstance(s, _MaskSpec) else None for s in specs]

    def call(i, h, mask, extra=None, shared_kv=None):
        return layers[i](h, **{n: mask if v else None for n, v in keys[i].items()}), None

    return ModelParts(embed, layers, _masks_for(specs), inner.norm, head, windows,
                      [None] * len(layers), lambda ids, h0: [None] * len(layers), call)


def _gemma4_parts(model, inner) -> ModelParts:
    # Mirrors Gemma4TextModel.__call__ and Model.__call__ (mlx_lm/models/gemma4_text.py).
    args = model.args
    layers = list(inner.layers)
    n = len(layers)

    def embed(ids):
        return inner.embed_tokens(ids) * inner.embed_scale

    def layer_inputs(ids, h0):
        if not inner.hidden_size_per_layer_input:
            return [None] * n
        # A function of the token ids and the (frozen) embedding only, so no
        # gradient is lost by cutting it off; each layer then takes a leaf.
        pli = inner._project_per_layer_inputs(h0, inner._get_per_layer_inputs(ids))
        return [mx.stop_gradient(pli[:, :, i, :]) for i in range(n)]

    softcap = args.final_logit_softcapping

    def head(hn):
        out = inner.embed_tokens.as_linear(hn) if args.tie_word_embeddings else model.lm_head(hn)
        return mx.tanh(out / softcap) * softcap if softcap is not None else out

    windows = [inner.window_size if l.layer_type == "sliding_attention" else None for l in layers]
    donors = [j if j != i else None for i, j in enumerate(inner.previous_kvs)]

    def call(i, h, mask, extra=None, shared_kv=None):
        # offset 0: no cache, positions start at 0 (what the donor passes along too).
        h, kv, _ = layers[i](h, mask, None, per_layer_input=extra, shared_kv=shared_kv, offset=0)
        return h, kv

    specs = [_MaskSpec(w, False) for w in windows]
    return ModelParts(embed, layers, _masks_for(specs), inner.norm, head, windows, donors,
                      layer_inputs, call)


def _masks_for(specs: list) -> Callable[[mx.array], list]:
    # One mask per distinct spec, shared by the layers that use it, made as
    # mlx-lm makes them (a string "causal" while a window does not bite).
    def masks(h):
        made = {s: s.make(h) for s in set(specs) if isinstance(s, _MaskSpec)}
        return [made[s] if isinstance(s, _MaskSpec) else s for s in specs]
    return masks


def forward_parts(parts: ModelParts, ids: mx.array) -> mx.array:
    """Logits of `ids` [B, L] composed from the parts (the reference for the step)."""
    h = parts.embed(ids)
    extras = parts.layer_inputs(ids, h)
    needed = {d for d in parts.donors if d is not None}
    kv_of: dict = {}
    for i, mask in enumerate(parts.masks(h)):
        d = parts.donors[i]
        h, kv = parts.call(i, h, mask, extras[i], kv_of[d] if d is not None else None)
        if i in needed:
            kv_of[i] = kv
    return parts.head(parts.norm(h))


def _check_parts(model, parts: ModelParts, name: str, mtype: str, length: int,
                 vocab: int) -> None:
    # Compare our composition against the model's own forward on a row longer than
    # every window the config declares: a family that inserts extra work between
    # its layers, or masks a layer differently from what we give it, shows here.
    ids = mx.array([[(7 * i + 3) % vocab for i in range(length)]])
    bad = [i for i, d in enumerate(parts.donors) if d is not None and not 0 <= d < i]
    if bad:
        raise ModelError(f"{name}: architecture {mtype} cannot be cut into "
                         f"segments (layers {bad} share K/V with a later layer)")
    try:
        ours = forward_parts(parts, ids).astype(mx.float32)
        ref = model(ids).astype(mx.float32)
        err = float(mx.max(mx.abs(ours - ref)))
        size = float(mx.max(mx.abs(ref)))
    except Exception as e:
        raise ModelError(f"{name}: architecture {mtype} cannot be cut into "
                         f"segments ({type(e).__name__}: {e})") from None
    if not math.isfinite(err) or err > 1e-3 * max(size, 1.0):
        raise ModelError(f"{name}: architecture {mtype} cannot be cut into segments (its "
                         f"forward is not embed -> layers -> norm -> head on {length} tokens)")
