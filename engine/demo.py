"""Tiny self-contained demo: a random-initialised model in Hugging Face layout,
a toy prompt/completion (or prompt/chosen/rejected) data set it can learn
quickly, and a segctl job file.

Everything is built locally (no downloads), so `segctl` can be tried end to end
on a laptop CPU in about a minute.
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
import string
from pathlib import Path

from segctl.schemas.atomic import fsync_dir

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML; the generation prompt is a token-exact prefix of the full rendering,
# which is what prompt masking (offset = len(prompt tokens)) relies on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

JOB_TEMPLATE = """\
# segctl job: LoRA {what} of the demo model (see `segctl train --help`)
name: demo-{arch}
method: {method}
model: model
output: adapters
data:
  train: data/train.jsonl
  valid: data/valid.jsonl
{data_extra}  max_seq_length: 256
  overlong: truncate
{method_section}lora:
  rank: 8
  scale: 20.0
  dropout: 0.0
  num_layers: -1
train:
  iters: 300
  learning_rate: 2.0e-4
  schedule: cosine
  warmup: 10
  weight_decay: 0.01
  grad_clip: 1.0
  seed: 0
  eval_every: 50
  val_batches: 20
  checkpoint_every: 50
memory:
  segment_size: 1
  head_chunk: 512
"""

# Per-method parts of JOB_TEMPLATE. ORPO and DPO rows carry their own
# chosen/rejected split, so mask_prompt has no say there (ORPO: nll_scope plays its part).
JOB_PARTS = {
    "sft": {"what": "SFT", "data_extra": "  mask_prompt: true\n", "method_section": ""},
    "orpo": {
        "what": "ORPO",
        "data_extra": "",
        "method_section": (
            "orpo:\n"
            "  lambda: 0.1                  # weight of the odds-ratio term next to the NLL\n"
            "  nll_scope: response          # NLL over the chosen response (or full: prompt too)\n"
            "  prefix_shared: true          # one forward over [prompt | chosen | rejected]\n"
        ),
    },
    "dpo": {
        "what": "DPO",
        "data_extra": "",
        "method_section": (
            "dpo:\n"
            "  beta: 0.1                    # pull toward the reference (the base model, adapter off)\n"
            "  prefix_shared: true          # one forward over [prompt | chosen | rejected]\n"
        ),
    },
}


SWEEP_TEMPLATE = """\
# segctl sweep over the demo job: `segctl plan sweep.yaml`, then `segctl submit sweep.yaml`
name: demo
base: job.yaml
grid:                          # 2 x 2 = 4 trials, each a shorter run than job.yaml's
  train.learning_rate: [1.0e-4, 2.0e-4]
  lora.rank: [4, 8]
  train.iters: [150]
concurrency: 4
retries: 2
priority: 0
"""


# ---------------------------------------------------------------- data


# Start letters for the toy task; later letters keep completions short (1-16 letters).
START_LETTERS = "jklmnopqrstuvwxy"


def demo_examples(n: int, seed: int) -> list[dict]:
    """`n` rows of the toy task: "after q" -> "r s t u v w x y z".

    Chosen because a random-initialised model learns it under LoRA in a few
    hundred single-example steps: every completion token after the first is a
    fixed function of the token before it (letter -> next letter, "z" -> end),
    and only the first letter has to be read from the prompt. Tasks that must
    route many letters through attention (reverse, copy, sort) stay near the
    "some letter" loss for thousands of steps on a random model. The domain
    is small (16 prompts), so rows repeat.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start = rng.choice(START_LETTERS)
        rest = string.ascii_lowercase[string.ascii_lowercase.index(start) + 1 :]
        rows.append({"prompt": f"after {start}", "completion": " ".join(rest)})
    return rows


def demo_preferences(n: int, seed: int) -> list[dict]:
    """`n` preference rows of the same task: the right continuation is chosen, the
    same letters each shifted one on ("z" wraps to "a") are rejected.

    Same prompts as `demo_examples(n, seed)`; the rejected text has the chosen
    one's length and format and is wrong at every letter, so the preference is
    never ambiguous (a reversed list would equal the chosen one for "after y").
    """
    letters = string.ascii_lowercase
    rows = []
    for r in demo_examples(n, seed):
        shifted = " ".join(letters[(letters.index(c) + 1) % 26] for c in r["completion"].split())
        rows.append({"prompt": r["prompt"], "chosen": r["completion"], "rejected": shifted})
    return rows


def _render_chat(prompt: str, completion: str) -> str:
    # The text CHAT_TEMPLATE renders for one exchange; only used as BPE corpus, so
    # the tokenizer learns the merges that training sequences actually contain.
    return (
        f"<|im_start|>user\n{prompt}<|im_end|>\n"
        f"<|im_start|>assistant\n{completion}<|im_end|>\n"
    )


# ---------------------------------------------------------------- tokenizer


def _train_tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Strip the markers so BPE spends no merges on "<|", "im_start" and the like:
    # they are added whole as special tokens anyway.
    cleaned = []
    for text in corpus:
        for s in SPECIAL_TOKENS:
            text = text.replace(s, "\n")
        cleaned.append(text)
    tok.train_from_iterator(cleaned, trainer=trainer)
    return tok


def _write_tokenizer_files(out_dir: Path, tok) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(s)): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(
        out_dir / "special_tokens_map.json",
        {
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    )


# ---------------------------------------------------------------- model


def _model_config(arch: str, *, layers: int, hidden: int, vocab_size: int, eos: int, bos: int) -> dict:
    # here: the benchmarks import this module bare
    from segctl.schemas.job import DEMO_ARCHS as ARCHS
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    head_dim = 64 if hidden >= 512 and hidden % 64 == 0 else 32
    if hidden % head_dim:
        raise ValueError(f"hidden={hidden} must be a multiple of {head_dim}")
    heads = hidden // head_dim
    common = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    if arch == "gemma4_text":
        return _gemma4_config(common, head_dim=head_dim, layers=layers, vocab_size=vocab_size, bos=bos)
    if arch in FAMILY_CONFIGS:
        return {"model_type": arch, **common, "head_dim": head_dim,
                **FAMILY_CONFIGS[arch](layers=layers, head_dim=head_dim)}
    if arch == "llama":
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **common,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,  # exercises the separate lm_head path
        }
    if arch == "qwen3":
        return {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            **common,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "tie_word_embeddings": True,  # exercises the tied-embedding head path
        }
    return {
        "model_type": "minicpm",
        "architectures": ["MiniCPMForCausalLM"],
        **common,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "scale_emb": 2.0,
        "dim_model_base": 64,
        "scale_depth": 1.4,
        # Must stay untied: mlx-lm's minicpm sanitize() always adds lm_head.weight,
        # so a tied checkpoint fails strict loading (and its tied path also skips
        # the hidden/dim_model_base logit scaling that HF applies).
        "tie_word_embeddings": False,
    }


# Small enough that most demo rows (12-45 tokens) run past it, so the sliding
# layers of these families really slide.
DEMO_WINDOW = 16

def _alternating(layers: int) -> list[str]:
    """layer_types of sliding and full attention layers in turn, sliding first."""
    return [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]


# What each family adds to the common config: its own twists set to values that
# matter (multipliers not 1, soft-caps that bite), and sliding and full layers
# mixed where the family has both.
FAMILY_CONFIGS = {
    "gemma": lambda layers, head_dim: dict(rms_norm_eps=1e-6, tie_word_embeddings=True),
    "gemma2": lambda layers, head_dim: dict(
        rms_norm_eps=1e-6, query_pre_attn_scalar=head_dim, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=DEMO_WINDOW, tie_word_embeddings=True),
    "gemma3_text": lambda layers, head_dim: dict(
        rms_norm_eps=1e-6, query_pre_attn_scalar=head_dim, sliding_window=DEMO_WINDOW,
        sliding_window_pattern=2, rope_local_base_freq=10000.0, rope_theta=1e6,
        tie_word_embeddings=False),
    "gpt_oss": lambda layers, head_dim: dict(
        rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=DEMO_WINDOW, swiglu_limit=7.0, tie_word_embeddings=False,
        layer_types=_alternating(layers)),
    "olmo3": lambda layers, head_dim: dict(
        rms_norm_eps=1e-6, sliding_window=DEMO_WINDOW, tie_word_embeddings=False,
        layer_types=_alternating(layers)),
    "granite": lambda layers, head_dim: dict(
        rms_norm_eps=1e-5, logits_scaling=4.0, attention_multiplier=1.0 / head_dim,
        embedding_multiplier=6.0, residual_multiplier=0.5, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=True),
    "cohere": lambda layers, head_dim: dict(
        layer_norm_eps=1e-5, logit_scale=0.5, use_qk_norm=True, tie_word_embeddings=True),
}


GEMMA4_WINDOW = DEMO_WINDOW


def _gemma4_config(common: dict, *, head_dim: int, layers: int, vocab_size: int, bos: int) -> dict:
    # Layer types alternate sliding/full, and the last half of the layers (from 3
    # layers on) share K/V: the first half then holds a donor of each type, e.g. 6
    # layers s f s | f s f, layers 3 and 5 reading layer 1's K/V and layer 4 layer
    # 2's, so segment sizes 2 and 3 both cut between donors and their sharers (the
    # demo's 4 layers: s f | s f, 2 reads 0 and 3 reads 1).
    # (mlx-lm finds each sharer's donor by type among the non-shared layers, so
    # both types must occur there.)
    common = {k: v for k, v in common.items() if k != "rope_theta"}  # per type below
    return {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        **common,
        "head_dim": head_dim,
        "global_head_dim": 2 * head_dim,  # full layers have wider heads, as in Gemma 4
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": GEMMA4_WINDOW,
        "sliding_window_pattern": 2,
        "layer_types": _alternating(layers),
        "num_kv_shared_layers": layers // 2 if layers >= 3 else 0,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": vocab_size,
        "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                  "rope_type": "default"},
        },
        "pad_token_id": bos,
        "tie_word_embeddings": True,
    }


def write_model(
    out_dir: Path,
    arch: str,
    *,
    corpus: list[str],
    seed: int = 0,
    layers: int = 4,
    hidden: int = 128,
    vocab_size: int = 512,
    extra_config: dict | None = None,
) -> Path:
    """Write a random-initialised `arch` model + trained BPE tokenizer into `out_dir`.

    Weights come from mlx-lm's own Model class (default init, seeded), so key
    names are exactly what `mlx_lm.load` expects with strict loading; only the
    final norm gain is changed (see LOGIT_SCALE). Returns `out_dir`.
    """
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"refusing to write a model into non-empty folder {out_dir}")

    tok = _train_tokenizer(corpus, vocab_size)
    config = _model_config(
        arch,
        layers=layers,
        hidden=hidden,
        # The real size (specials included): BPE stops early on a small corpus.
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos=tok.token_to_id(EOS_TOKEN),
        bos=tok.token_to_id(PAD_TOKEN),
    )
    config.update(extra_config or {})

    arch_module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = arch_module.Model(arch_module.ModelArgs.from_dict(config))
    _set_readout_gain(model, config)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out_dir / "config.json", config)
    _write_tokenizer_files(out_dir, tok)
    return out_dir


# Typical |logit| of the untrained model. mlx-lm's default init gives ~1 for a tied
# head, ~0.6 for an untied one and ~0.3 for minicpm (its head input is divided by
# hidden/dim_model_base). LoRA leaves the final norm and head frozen, so at those
# scales the adapters cannot express confident predictions and plateau (demo job,
# 300 steps: val loss llama 0.63, minicpm 2.63 without the gain, ~0.002 with it).
# 1.5 keeps the untrained outputs close to uniform.
LOGIT_SCALE = 1.5


def _set_readout_gain(model, config: dict) -> None:
    import mlx.core as mx

    if config["tie_word_embeddings"]:
        head = model.model.embed_tokens.weight
    else:
        head = model.lm_head.weight
    row_norm = mx.linalg.norm(head, axis=1).mean().item()
    if config["model_type"] == "minicpm" and not config["tie_word_embeddings"]:
        row_norm /= config["hidden_size"] / config["dim_model_base"]
    row_norm /= config.get("logits_scaling", 1.0)     # granite divides the logits
    row_norm *= config.get("logit_scale", 1.0)        # cohere multiplies them
    # The final norm's output has norm sqrt(hidden) per unit gain, so a random
    # direction gives logits of std ~ gain * row_norm. Gemma's norms scale by
    # 1 + weight: a zero weight that still passes the input tells them apart.
    norm = model.model.norm
    gain = LOGIT_SCALE / row_norm
    zero = mx.zeros(norm.weight.shape, dtype=norm.weight.dtype)
    norm.weight = zero
    offset = float(mx.abs(norm(mx.ones((1, zero.shape[0]), dtype=zero.dtype))).max()) > 0
    norm.weight = mx.full(zero.shape, gain - 1.0 if offset else gain, dtype=zero.dtype)


# ---------------------------------------------------------------- job


def write_demo(
    out_dir: Path,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    n_train: int = 400,
    n_valid: int = 40,
    layers: int = 4,
    hidden: int = 128,
    method: str = "sft",
) -> Path:
    """Create `out_dir` with model/, data/{train,valid}.jsonl, job.yaml and sweep.yaml.

    `method` "sft" writes prompt/completion rows, "orpo" and "dpo" prompt/chosen/
    rejected rows and an `orpo:` / `dpo:` job section. Built in a sibling temp
    folder and renamed into place, so a failure never leaves a half-written demo
    behind. Returns the path of job.yaml.
    """
    out_dir = Path(out_dir)
    from segctl.schemas.job import DEMO_ARCHS as ARCHS
    from segctl.schemas.job import METHODS
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(
            f"{out_dir} already exists and is not an empty folder; choose a new path or remove it first"
        )

    # Disjoint seed streams; the task domain is tiny, so valid measures fit, not
    # generalisation.
    rows = demo_preferences if method in ("orpo", "dpo") else demo_examples
    train = rows(n_train, seed=2 * seed)
    valid = rows(n_valid, seed=2 * seed + 1)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Sibling of out_dir so the final rename stays on one file system; plain mkdir
    # (not mkdtemp) so the folder gets the usual umask permissions.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        # The tokenizer must learn the rejected texts' merges too.
        corpus = [_render_chat(r["prompt"], r[k]) for r in train
                  for k in ("completion", "chosen", "rejected") if k in r]
        write_model(tmp / "model", arch, corpus=corpus, seed=seed, layers=layers, hidden=hidden)
        (tmp / "data").mkdir()
        _write_jsonl(tmp / "data" / "train.jsonl", train)
        _write_jsonl(tmp / "data" / "valid.jsonl", valid)
        (tmp / "job.yaml").write_text(JOB_TEMPLATE.format(arch=arch, method=method,
                                                         **JOB_PARTS[method]), encoding="utf-8")
        (tmp / "sweep.yaml").write_text(SWEEP_TEMPLATE, encoding="utf-8")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename cannot replace a folder
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out_dir.parent)
    return out_dir / "job.yaml"


# ---------------------------------------------------------------- helpers


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
