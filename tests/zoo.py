"""Tiny random instances of every decoder family mlx-lm ships.

`families()` lists the modules of the installed `mlx_lm.models` that define a
`Model` and a `ModelArgs` (found by walking the package, not from a list), and
`tiny_model(name)` builds one with small dimensions, windows of 8 tokens and a
mix of sliding and full layers where the family has them. Fields this file has
no value for are filled from their type; a family whose arguments still do not
build is reported with the reason (the test prints them).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
import typing

WINDOW = 8
MAX_PARAMS = 5_000_000
LAYERS = 6

# Values for the argument names mlx-lm's families share; a family takes those
# its ModelArgs declares.
COMMON = dict(
    hidden_size=32, num_hidden_layers=LAYERS, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, vocab_size=256, rms_norm_eps=1e-5, layer_norm_eps=1e-5,
    norm_eps=1e-5, norm_epsilon=1e-5, layer_norm_epsilon=1e-5, rope_theta=10000.0,
    max_position_embeddings=512, sliding_window=WINDOW, sliding_window_pattern=3,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bias=False,
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
    moe_k=2, moe_num_experts=4, mlp_only_layers=[], decoder_sparse_step=1,
    n_routed_experts=4, n_shared_experts=1, shared_expert_intermediate_size=32,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
    num_key_value_groups=2, partial_rotary_factor=1.0, rotary_dim=8, rope_scaling=None,
    n_embd=32, n_layer=LAYERS, n_head=4, n_positions=512, n_inner=64, d_model=32,
    n_layers=LAYERS, n_heads=4, n_kv_heads=2, dim=32, d_ff=64, embed_dim=32,
    layers=LAYERS, hidden_dim=64, ffn_dim=64, num_vocab=256, model_dim=32, num_layers=LAYERS,
)

# Per-family settings that make the tiny instance exercise what the family is
# about: both kinds of layer where windows alternate, multipliers not equal to 1.
OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=8.0, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(query_pre_attn_scalar=8.0, sliding_window_pattern=3),
    "gear": dict(attn_logit_softcapping=5.0),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=None,
                    swiglu_limit=7.0),
    "olmo3": dict(layer_types=None),
    "granite": dict(embedding_multiplier=3.0, attention_multiplier=0.2,
                    residual_multiplier=0.5, logits_scaling=4.0),
    "cohere": dict(logit_scale=0.5, use_qk_norm=True),
    "minicpm": dict(scale_emb=12.0, dim_model_base=16, scale_depth=1.4),
    "gemma4_text": dict(
        global_head_dim=16, hidden_size_per_layer_input=4, vocab_size_per_layer_input=256,
        num_kv_shared_layers=2, final_logit_softcapping=30.0, sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                            "rope_type": "proportional"},
                         "sliding_attention": {"partial_rotary_factor": 1.0,
                                               "rope_theta": 1e4, "rope_type": "default"}}),
    "llama4_text": dict(no_rope_layers=[1, 1, 1, 0] * 2, attention_chunk_size=WINDOW,
                        interleave_moe_layer_step=2),
    "exaone4": dict(sliding_window_pattern="LLG"),
    "mellum": dict(layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
                   rope_parameters={"sliding_attention": {"rope_theta": 1e4},
                                    "full_attention": {"rope_theta": 1e6}}),
    "exaone_moe": dict(layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
                       is_moe_layer=[False, True] * (LAYERS // 2)),
    "afmoe": dict(layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)),
    "baichuan_m1": dict(sliding_window_layers=[0, 2, 4], conv_window=2),
    "lfm2": dict(layer_types=["conv", "full_attention"] * (LAYERS // 2)),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * (LAYERS // 2)),
}


def families() -> list[str]:
    """Every module of mlx_lm.models defining Model and ModelArgs, by name."""
    import mlx_lm.models as pkg
    out = []
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            mod = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):  # needs an optional package (olmo exits): listed, fails to build
            out.append(info.name)
            continue
        if hasattr(mod, "Model") and hasattr(mod, "ModelArgs"):
            out.append(info.name)
    return sorted(out)


def tiny_config(name: str) -> dict:
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    cfg = {"model_type": name}
    fields = {f.name: f for f in dataclasses.fields(mod.ModelArgs)}
    hints = typing.get_type_hints(mod.ModelArgs) if fields else {}
    for fname, f in fields.items():
        if fname in COMMON:
            cfg[fname] = COMMON[fname]
        elif fname in cfg:
            continue
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            cfg[fname] = _by_type(hints.get(fname))
    if "text_config" in fields:
        # A multimodal wrapper: its language model tiny too (the defaults are full size).
        text = f"{name}_text" if importlib.util.find_spec(f"mlx_lm.models.{name}_text") else None
        cfg["text_config"] = {**COMMON, **(tiny_config(text) if text else {}),
                              "model_type": text or name}
    cfg.update({k: v for k, v in OVERRIDES.get(name, {}).items() if k in fields})
    return cfg


def _by_type(t):
    origin = typing.get_origin(t)
    if origin is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return _by_type(args[0]) if args else None
    if t is bool:
        return False
    if t is int:
        return 4
    if t is float:
        return 1.0
    if t is str:
        return ""
    if origin in (list, tuple) or t in (list, tuple):
        return None
    if origin is dict or t is dict:
        return {}
    return None


def tiny_model(name: str, seed: int = 0):
    """(model, config) of a random fp32 instance; raises whatever the family raises."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    cfg = tiny_config(name)
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    # Parameters are lazy until evaluated: a family whose size this file does
    # not reach is reported instead of filling the machine.
    size = sum(v.size for _, v in tree_flatten(model.parameters()))
    if size > MAX_PARAMS:
        raise ValueError(f"{size} parameters with the tiny settings (a field this file does "
                         "not set keeps its full-size default)")
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, cfg
