"""The facts about a model that the memory planner needs, read from its folder
(config.json and the safetensors headers) or from an mlx-lm model's args: its
layers' shape, its mixture of experts, the bytes its weights take and the dtype
it computes in. `ModelInfo` is built on the machine that has the folder and
travels to the head as a dict."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

from segctl.schemas.limits import check_model_config, read_model_config

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_CONFIG_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelInfo:
    """The facts about a model the planner needs; built on the submitting machine
    (which has the model folder) and shipped to the head as a dict."""
    model_type: str
    n_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_bytes: int   # the model's safetensors on disk, which is what MLX loads
    act_bytes: int      # 4 for float32, 2 for bf16/fp16 (activations follow the weights' dtype)
    # Per layer, the width of an input of its own that the step holds for every token
    # from start to end (Gemma-4's per-layer inputs); 0: none.
    layer_input: int = 0
    # A mixture of experts: the experts of a layer (each MLP with a LoRA of its own,
    # as mlx-lm puts LoRA on every expert) and how many a token goes through (the
    # MLP's activations are that many experts' wide); `intermediate` is then one
    # expert's width. 0: a dense MLP. `shared`: the width of the experts every token
    # goes through besides (one MLP of that width, LoRA'd too); 0: none.
    experts: int = 0
    experts_per_tok: int = 0
    shared: int = 0
    # Layers of more than one kind (Gemma-4): each kind once, as (upto, head_dim,
    # intermediate, own_kv) with `upto` one past its last layer (LayerKind); the
    # fields above then hold the widest kind's head_dim and intermediate. (): alike.
    kinds: tuple = ()

    def to_dict(self) -> dict:
        # A field at its default stays out, so the plan tables of models without it
        # keep their names (model_key hashes this dict).
        d = {k: v for k, v in asdict(self).items() if k not in OPTIONAL_FACTS or v}
        if self.kinds:
            d["kinds"] = [list(k) for k in self.kinds]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelInfo":
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d and n not in OPTIONAL_FACTS]
        if missing:
            raise ValueError(f"model info lacks {', '.join(missing)}")
        values: dict[str, Any] = {n: d[n] if n == "model_type" else int(d[n])
                                  for n in names if n in d and n != "kinds"}
        info = cls(**values, kinds=_kinds_of(d.get("kinds") or [], values.get("n_layers", 0)))
        # The head plans from this dict as it arrives: hold it to config.json's bounds.
        check_model_config(dict(model_type=info.model_type, num_hidden_layers=info.n_layers,
                                hidden_size=info.hidden, intermediate_size=info.intermediate,
                                num_attention_heads=info.heads, num_key_value_heads=info.kv_heads,
                                head_dim=info.head_dim, vocab_size=info.vocab,
                                num_experts=info.experts, num_experts_per_tok=info.experts_per_tok,
                                shared_expert_intermediate_size=info.shared or None),
                           "model info")
        if info.act_bytes not in (1, 2, 4) or info.weight_bytes < 0 or \
                not 0 <= info.layer_input <= info.hidden * 64:
            raise ValueError(f"model info: act_bytes {info.act_bytes} / weight_bytes "
                             f"{info.weight_bytes} / layer_input {info.layer_input} out of range")
        return info


OPTIONAL_FACTS = ("layer_input", "experts", "experts_per_tok", "shared", "kinds")   # default 0 / ()


class LayerKind(NamedTuple):
    """Layers of one kind: `upto` is one past the last of them; `own_kv`: 1 where
    they make their own K/V, 0 where they read a donor layer's (Gemma-4)."""
    upto: int
    head_dim: int
    intermediate: int
    own_kv: int


def _kinds_of(raw, n_layers: int) -> tuple:
    """ModelInfo.kinds from its dict form (a list of 4-number lists), each held to
    the model's bounds: the head plans from it as it arrives."""
    if not isinstance(raw, list) or len(raw) > n_layers:
        raise ValueError(f"model info: kinds: expected a list of at most {n_layers}, "
                         f"got {str(raw)[:80]}")
    out = []
    for k in raw:
        if not (isinstance(k, list) and len(k) == 4 and
                all(isinstance(v, int) and not isinstance(v, bool) for v in k)):
            raise ValueError(f"model info: kinds: {k!r} is not [upto, head_dim, "
                             "intermediate, own_kv]")
        kind = LayerKind(*k)
        check_model_config(dict(model_type="kind", num_hidden_layers=kind.upto,
                                head_dim=kind.head_dim,
                                intermediate_size=kind.intermediate), "model info kinds")
        if kind.upto > n_layers or kind.own_kv not in (0, 1):
            raise ValueError(f"model info: kinds: {k!r} out of range")
        out.append(kind)
    return tuple(out)


def model_info(model_dir: str) -> ModelInfo:
    """ModelInfo from a local Hugging Face folder: config.json (its text_config wins
    where a multimodal config nests one) and the sizes and dtypes of *.safetensors.
    Raises ValueError with one line naming the folder."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ValueError(f"{folder}: model folder not found")
    config = read_model_config(folder)   # bounded: no billion layers reach the arithmetic below
    cfg = {**config, **config.get("text_config", {})} if isinstance(
        config.get("text_config"), dict) else config
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{folder}: no *.safetensors weights")
    return ModelInfo(**shape_facts(cfg, f"{folder}/config.json"),
                     weight_bytes=sum(p.stat().st_size for p in weights),
                     act_bytes=_act_bytes(weights, cfg))


def shape_facts(cfg: dict, where: str) -> dict:
    """ModelInfo's shape fields from a model's config (config.json's keys, or an
    mlx-lm ModelArgs' fields); a bad value raises ValueError naming `where`."""
    def whole(*keys, default=None):
        """The first of `keys` the config has, as a positive whole number."""
        for k in keys:
            v = cfg.get(k)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{where}: {k}: expected a whole number, got {v!r}")
                return v
        if default is None:
            raise ValueError(f"{where}: {keys[0]}: missing")
        return default

    hidden = whole("hidden_size", "d_model", "n_embd")
    heads = whole("num_attention_heads", "n_head")
    model_type = str(cfg.get("model_type", "?"))
    intermediate = whole("intermediate_size", "ffn_dim", default=4 * hidden)
    head_dim = whole("head_dim", default=hidden // heads)
    n_layers = whole("num_hidden_layers", "n_layer", "num_layers")
    # Gemma-4's layers are of up to four kinds: full-attention ones have heads of
    # global_head_dim, and the layers reading a donor's K/V make none of their own
    # and have an MLP twice as wide (mlx-lm's use_double_wide_mlp). The planner
    # plans each kind (`kinds`); the fields hold the widest.
    kinds = _layer_kinds(cfg, model_type, n_layers, head_dim, intermediate)
    if kinds:
        head_dim = max(k.head_dim for k in kinds)
        intermediate = max(k.intermediate for k in kinds)
    kinds = kinds if len(kinds) > 1 else ()   # one kind: the fields say it all
    # A mixture of experts is planned with every layer's MLP the experts' (the
    # larger LoRA and, past one expert a token, the larger activations).
    def first(*keys):
        return next((n for k in keys if (n := _count(cfg, k))), 0)
    experts = first("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    per_tok = first("num_experts_per_tok", "moe_k") if experts else 0
    shared = 0
    if experts:
        intermediate = whole("moe_intermediate_size", default=intermediate)
        shared = (first("shared_expert_intermediate_size")
                  or intermediate * first("n_shared_experts", "moe_num_shared_experts"))
    return dict(model_type=model_type, n_layers=n_layers,
                hidden=hidden, intermediate=intermediate, heads=heads,
                kv_heads=whole("num_key_value_heads", default=heads), head_dim=head_dim,
                vocab=whole("vocab_size"),
                layer_input=_count(cfg, "hidden_size_per_layer_input"),   # Gemma-4's
                experts=experts, experts_per_tok=per_tok, shared=shared, kinds=kinds)


def _layer_kinds(cfg: dict, model_type: str, n: int, head_dim: int, intermediate: int) -> tuple:
    """Gemma-4's kinds of layer (ModelInfo.kinds), as mlx-lm builds them: layer i is
    full attention by `layer_types` (else every `sliding_window_pattern`-th, 5 by
    default), and reads a donor's K/V among the last `num_kv_shared_layers`. ()
    for a model without either."""
    wide = _count(cfg, "global_head_dim")
    shared = min(_count(cfg, "num_kv_shared_layers"), n)
    if not wide and not shared:
        return ()
    types = cfg.get("layer_types")
    if not (isinstance(types, list) and len(types) == n):
        every = _count(cfg, "sliding_window_pattern") or 5
        types = ["full_attention" if (i + 1) % every == 0 else "sliding" for i in range(n)]
    double = bool(shared) and cfg.get("use_double_wide_mlp", model_type.startswith("gemma4")) is True
    upto: dict[tuple, int] = {}
    for i, kind in enumerate(types):
        sharer = i >= n - shared
        key = (wide if wide and kind == "full_attention" else head_dim,
               intermediate * (2 if sharer and double else 1), 0 if sharer else 1)
        upto[key] = i + 1
    return tuple(sorted(LayerKind(last, *key) for key, last in upto.items()))


def _count(cfg: dict, key: str) -> int:
    """cfg[key] where it is a positive whole number, else 0 (absent, 0 or not a
    number: a family's optional size that a config may leave out or turn off)."""
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _act_bytes(weights: list[Path], cfg: dict) -> int:
    """Bytes per activation: the dtype holding most of the floating-point weights
    (MLX computes in the weights' dtype; a quantized model's scales carry it),
    read from the safetensors headers; config's torch_dtype only if they say nothing."""
    from segctl.schemas.limits import safetensors_header
    by_dtype: dict[int, int] = {}
    for path in weights:
        header = safetensors_header(path)
        for name, t in header.items():
            if name != "__metadata__" and isinstance(t, dict) and t.get("dtype") in _DTYPE_BYTES:
                shape = t.get("shape") or [1]
                if not isinstance(shape, list) or not all(
                        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                    raise ValueError(f"{path}: not a safetensors file ({name!r} has shape {shape!r})")
                size = _DTYPE_BYTES[t["dtype"]]
                by_dtype[size] = by_dtype.get(size, 0) + math.prod(shape) * size
    if by_dtype:
        return min(4, max(by_dtype, key=lambda size: by_dtype[size]))
    return _CONFIG_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), 2)
