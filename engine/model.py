"""Loading an mlx-lm model and cutting it into the pieces the segmented step needs.

The segmented backward calls the decoder layers one segment at a time, so it needs
the model as parts: embed -> layers (each with its attention mask) -> final norm ->
lm head. mlx-lm's model classes do not expose that split, so `model_parts` finds it
by the names mlx-lm's decoder-only families share (`model.embed_tokens`,
`model.layers`, `model.norm`) plus the few per-family twists (embedding and head
scales, Gemma-4's per-layer inputs, logit softcap and K/V sharing), and then
*checks* the split against the model's own forward on a short input. A model that
calls its layers some other way fails that check with a one-line error instead of
training on wrong gradients.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_lm.models.base import create_attention_mask


class ModelError(Exception):
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


def load_model(path: str | Path):
    """(model, tokenizer) from a local Hugging Face folder through mlx-lm's loader."""
    from mlx_lm.utils import load_model as mlx_load_model, load_tokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise ModelError(f"{folder}: model folder not found")
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{folder}/config.json: not valid JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"{folder}/config.json: no model_type")
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


def apply_lora(model: nn.Module, *, rank: int, scale: float, dropout: float,
               num_layers: int = -1, keys: list[str] | None = None) -> dict:
    """Freeze the model and put mlx-lm LoRA layers on it; returns the adapter config.

    The returned dict is mlx-lm's `adapter_config.json`, so `mlx_lm.load(...,
    adapter_path=...)` rebuilds exactly these layers.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    n = len(model.layers)
    num_layers = n if num_layers in (-1, None) or num_layers > n else num_layers
    params = {"rank": rank, "scale": scale, "dropout": dropout}
    if keys:
        params["keys"] = list(keys)
    model.freeze()
    linear_to_lora_layers(model, num_layers, params)
    if not tree_flatten(model.trainable_parameters()):
        raise ModelError(f"lora.keys {keys} match no layer of the model")
    return {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}


def model_parts(model: nn.Module, *, name: str = "model", check: bool = True) -> ModelParts:
    """Cut `model` into `ModelParts`; with `check`, prove the cut against model(ids)."""
    inner = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm") if not hasattr(inner, a)]
    if inner is None or missing:
        raise ModelError(f"{name}: architecture {getattr(model, 'model_type', '?')} cannot be "
                         f"cut into segments (no model.{', model.'.join(missing or ['model'])})")
    if getattr(model.args, "model_type", "") == "gemma4_text":
        parts = _gemma4_parts(model, inner)
    else:
        parts = _plain_parts(model, inner)
    if check:
        _check_parts(model, parts, name)
    return parts


def _plain_parts(model, inner) -> ModelParts:
    # llama / qwen3 / minicpm and the like: layer(h, mask) -> h, no K/V sharing.
    args = model.args
    mtype = getattr(args, "model_type", "")
    embed_scale = float(getattr(args, "scale_emb", 1.0)) if mtype == "minicpm" else 1.0
    layers = list(inner.layers)

    def embed(ids):
        h = inner.embed_tokens(ids)
        return h * embed_scale if embed_scale != 1.0 else h

    def head(hn):
        if mtype == "minicpm":
            if args.tie_word_embeddings:
                return hn @ inner.embed_tokens.weight.T
            return model.lm_head(hn / (args.hidden_size / args.dim_model_base))
        if hasattr(model, "lm_head"):
            return model.lm_head(hn)
        return inner.embed_tokens.as_linear(hn)

    window = getattr(inner, "sliding_window", None) or None
    windows = [window if getattr(l, "use_sliding", False) else None for l in layers]

    def call(i, h, mask, extra=None, shared_kv=None):
        return layers[i](h, mask), None

    return ModelParts(embed, layers, _masks_for(windows), inner.norm, head, windows,
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

    return ModelParts(embed, layers, _masks_for(windows), inner.norm, head, windows, donors,
                      layer_inputs, call)


def _masks_for(windows: list[int | None]) -> Callable[[mx.array], list]:
    # One mask per distinct window, shared by the layers that use it, built as
    # mlx-lm builds them (a string "causal" while the window does not bite).
    def masks(h):
        made = {w: create_attention_mask(h, None, window_size=w) for w in set(windows)}
        return [made[w] for w in windows]
    return masks


def forward_parts(parts: ModelParts, ids: mx.array) -> mx.array:
    """Logits of `ids` [B, L] composed from the parts (the reference for the step)."""
    h = parts.embed(ids)
    extras = parts.layer_inputs(ids, h)
    needed = {d for d in parts.donors if d is not None}
    kv_of = {}
    for i, mask in enumerate(parts.masks(h)):
        d = parts.donors[i]
        h, kv = parts.call(i, h, mask, extras[i], kv_of[d] if d is not None else None)
        if i in needed:
            kv_of[i] = kv
    return parts.head(parts.norm(h))


def _check_parts(model, parts: ModelParts, name: str) -> None:
    # Compare our composition against the model's own forward on a short input:
    # a family that inserts extra work between its layers shows up here.
    vocab = model.args.vocab_size
    # Longer than a small sliding window, so the window masks are part of the check.
    smallest = min((w for w in parts.windows if w), default=None)
    n = smallest + 2 if smallest and smallest <= 62 else 6
    ids = mx.array([[(7 * i + 3) % vocab for i in range(n)]])
    bad = [i for i, d in enumerate(parts.donors) if d is not None and not 0 <= d < i]
    if bad:
        raise ModelError(f"{name}: architecture {model.args.model_type} cannot be cut into "
                         f"segments (layers {bad} share K/V with a later layer)")
    try:
        ours = forward_parts(parts, ids).astype(mx.float32)
        ref = model(ids).astype(mx.float32)
        err = mx.max(mx.abs(ours - ref)).item()
        size = mx.max(mx.abs(ref)).item()
    except Exception as e:
        raise ModelError(f"{name}: architecture {model.args.model_type} cannot be cut into "
                         f"segments ({type(e).__name__}: {e})") from None
    if not math.isfinite(err) or err > 1e-3 * max(size, 1.0):
        raise ModelError(f"{name}: architecture {model.args.model_type} cannot be cut into "
                         f"segments (its layers are not called as embed -> layers -> norm -> head)")
