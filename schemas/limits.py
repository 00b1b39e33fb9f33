"""Every bound segctl puts on what a user hands it, in one place.

Each is checked before any work starts (`validate`, `plan`, `submit`, `train`):
a file past a bound is one line naming the file (and line or key) and exit 2,
never a hang, a traceback or a half-written store. README.md's "What segctl
refuses (limits)" table lists every constant here (tests/test_hostile.py keeps
them in step).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
from pathlib import Path

# ------------------------------------------------------------------ spec files (YAML)

MAX_SPEC_BYTES = 1_000_000     # a job, sweep or cluster file
MAX_YAML_DEPTH = 32            # nested mappings / lists in a spec file (a job is 3 deep)
# YAML aliases (`*name`) are refused outright: a few hundred bytes of them expand
# to billions of nodes ("billion laughs"), and no segctl file needs them.

# ------------------------------------------------------------------ names and paths

MAX_NAME_CHARS = 64            # a job's name (names become file names and Ray labels)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"   # sweep and job names: safe in file names
# Trials are named <sweep>-t<index> (index < MAX_TRIALS), and are jobs themselves.
MAX_SWEEP_NAME_CHARS = MAX_NAME_CHARS - len("-t9999")
MAX_LABEL_CHARS = 63           # node names, chips, label keys and values: Ray labels
LABEL_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$"   # Ray's label syntax
NODE_NAME_PATTERN = r"^[A-Za-z0-9_-]+$"        # node names (each a Ray label: LABEL_PATTERN too)
LABEL_KEY_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"  # label keys of a cluster's nodes
MAX_HOST_CHARS = 255           # an ssh target or the head's address
HOST_PATTERN = r"^[A-Za-z0-9_\[][A-Za-z0-9_.@:%+\[\]-]*$"   # never an ssh option (-o...)
MAX_PATH_CHARS = 4096          # a path in a spec (the OS's PATH_MAX)
MAX_PATH_PART_CHARS = 255      # one component of such a path (the OS's NAME_MAX)

# ------------------------------------------------------------------ sweeps and jobs

MAX_TRIALS = 10_000            # trials of one sweep, counted before any is built
MAX_RETRIES = 100              # a sweep's retries per trial
MAX_PRIORITY = 1_000_000       # a sweep's priority, either sign (state.db keeps 64-bit integers)
MAX_TOKENS = 1 << 24           # max_seq_length, head_chunk, attn_block
MAX_STEPS = 1_000_000_000      # iters, epochs, warmup, eval_every, checkpoint_every, val_batches
MAX_BATCH = 4096               # train.batch_size rows and train.grad_accumulation micro-batches
MAX_SEED = 2**32 - 1           # train.seed (the engine seeds MLX with seed * 1000003 + step)
MAX_MEMORY_GB = 65_536         # a node's or a job's memory budget
MAX_PORT = 65_535              # the head's port (1 ..)
MAX_TRIALS_PER_NODE = 32       # a node's max_trials (its agent serves this many calls at once)
MAX_RANKS = 256                # distributed.nodes: the machines one job trains across
# A sweep is expanded into MAX_TRIALS copies of its job at most, each sent to the head
# and kept in state.db: an 880 KB sweep made 2.2 MB trials, 22 GB in all. So lists are
# bounded, and so are a trial's job and all of them together, sized before any is built.
MAX_LIST_ITEMS = 1024          # a list or mapping in a job or sweep (lora.keys, report_to, choice, grid, ...)
MAX_KEY_CHARS = 255            # one lora.keys entry (a module path in a layer)
MAX_JOB_BYTES = 100_000        # one trial's job as JSON (a real one is about 1 KB)
MAX_EXPANDED_BYTES = 100_000_000   # all trials' jobs of one sweep as JSON

# ------------------------------------------------------------------ model folders (config.json)

MAX_CONFIG_BYTES = 16_000_000  # config.json (quantized models list every layer's settings)
MAX_JSON_DEPTH = 32            # nesting in config.json and in a data row
MAX_LAYERS = 1024              # num_hidden_layers and the like; the largest models have ~130
MAX_HIDDEN = 65_536            # hidden_size; also the largest LoRA rank
MAX_INTERMEDIATE = 262_144     # intermediate_size and the like
MAX_VOCAB = 4_000_000          # vocab_size
MAX_HEADS = 1024               # attention and key/value heads
MAX_HEAD_DIM = 4096            # head_dim
MAX_POSITIONS = 1 << 26        # max_position_embeddings, sliding_window
MAX_EXPERTS = 4096             # MoE experts (and experts per token)
RDMA_DEVICE_PATTERN = r"^[A-Za-z][A-Za-z0-9_]{0,39}$"   # an RDMA device (ibv_devices: rdma_en3)
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20   # a *.safetensors file's JSON header (tensor names, shapes)
# model_type names an mlx-lm module (some have '-': nemotron-nas) and the tune table's folder
MODEL_TYPE_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_-]*$"

# ------------------------------------------------------------------ data files (JSONL)

MAX_ROW_BYTES = 1_000_000      # one row of a data file, read (and tokenised) whole

# ------------------------------------------------------------------ what we print

MAX_MESSAGE_CHARS = 2000       # one problem line; what the user wrote is shortened to fit
MAX_PROBLEMS = 50              # problem lines shown for one file, then "and N more problems"

# config.json key -> (least, most) whole number; a key given as null is left to the
# model's default. Expert counts may be 0 (a dense model of a MoE family).
CONFIG_BOUNDS = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers"), (1, MAX_LAYERS)),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd"), (1, MAX_HIDDEN)),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "moe_intermediate_size",
                     "shared_expert_intermediate_size"), (1, MAX_INTERMEDIATE)),
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input"), (1, MAX_VOCAB)),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_key_value_heads"), (1, MAX_HEADS)),
    **dict.fromkeys(("head_dim", "global_head_dim"), (1, MAX_HEAD_DIM)),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "sliding_window"), (1, MAX_POSITIONS)),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                     "num_experts_per_tok", "moe_k", "n_shared_experts",
                     "moe_num_shared_experts"), (0, MAX_EXPERTS)),
}


# ------------------------------------------------------------------ checks


def check_model_config(config, where: str) -> None:
    """Refuse a model's config.json (`config`, parsed; `where` names it) whose
    model_type is not a plain identifier or whose sizes are not whole numbers
    within CONFIG_BOUNDS. A multimodal config's text_config is held to
    the same bounds. Raises ValueError with one line."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    levels = [("", config)]
    if isinstance(config.get("text_config"), dict):
        levels.append(("text_config.", config["text_config"]))
    mtype = config.get("model_type")
    if mtype is None:
        raise ValueError(f"{where}: model_type: missing")
    for prefix, cfg in levels:
        mtype = cfg.get("model_type", mtype)
        if not isinstance(mtype, str) or len(mtype) > MAX_NAME_CHARS or not re.fullmatch(
                MODEL_TYPE_PATTERN, mtype):
            raise ValueError(f"{where}: {prefix}model_type: {_shown(mtype)} is not a plain name "
                             f"(letters, digits, '_', '-'; at most {MAX_NAME_CHARS})")
        for key, (least, most) in CONFIG_BOUNDS.items():
            v = cfg.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{where}: {prefix}{key}: expected a whole number, got {_shown(v)}")
            if v < least:
                raise ValueError(f"{where}: {prefix}{key}: expected a whole number >= {least}, got {v}")
            if v > most:
                raise ValueError(f"{where}: {prefix}{key}: {v} is more than {most}")


def read_model_config(folder: str | Path) -> dict:
    """A model folder's config.json, parsed (bounded) and checked with
    check_model_config. Raises ValueError with one line naming the file."""
    folder = Path(folder)
    path = folder / "config.json"
    try:
        raw = read_bounded(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ValueError(f"{folder}: no config.json (expected a Hugging Face model folder)") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        config = load_json(raw)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    check_model_config(config, str(path))
    return config


def safetensors_header(source: str | Path | bytes, where: str | None = None) -> dict:
    """The JSON header of a safetensors file, parsed (load_json): tensor name ->
    {dtype, shape, data_offsets}, and "__metadata__". `source` is the file's path
    (only the header is read) or its bytes (`where` then names it in messages).
    Its length is checked against the file's size and MAX_SAFETENSORS_HEADER_BYTES
    before anything is read; the tensors' data starts 8 + that length in. Raises
    ValueError("<where>: not a safetensors file (<why>)"), one line."""
    blob = source if isinstance(source, (bytes, bytearray, memoryview)) else None
    where = where or ("safetensors" if blob is not None else str(source))
    try:
        if blob is not None:
            header = _safetensors_header(io.BytesIO(blob), len(blob))
        else:
            st = os.stat(source)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            with open(source, "rb") as f:
                header = _safetensors_header(f, os.fstat(f.fileno()).st_size)
    except OSError as e:
        raise ValueError(one_line(f"{where}: not a safetensors file ({e.strerror or e})")) from None
    except ValueError as e:
        raise ValueError(one_line(f"{where}: not a safetensors file ({e})")) from None
    return header


def _safetensors_header(f, size: int) -> dict:
    head = f.read(8)
    if len(head) < 8:
        raise ValueError("shorter than the 8-byte header length")
    n = int.from_bytes(head, "little")
    # a header longer than the file is not a header (and would be read whole)
    if n > size - 8 or n > MAX_SAFETENSORS_HEADER_BYTES:
        raise ValueError(f"header length {n} out of range")
    header = load_json(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; a device, a pipe or a
    longer file is a ValueError saying so (never read whole)."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return raw


def load_json(text: str | bytes):
    """json.loads held to strict JSON (no NaN / Infinity, no float overflowing to
    inf) and at most MAX_JSON_DEPTH levels of nesting. ValueError with the reason."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8: {e.reason}") from None
    except json.JSONDecodeError as e:
        raise ValueError(str(e)) from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def json_depth(value) -> int:
    """Levels of lists / dicts in a parsed JSON value (walked without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in children)
    return deepest


def json_bytes(value) -> int:
    """Bytes of `value` as JSON (what a trial's job weighs on the wire and in
    state.db); a YAML value JSON has no type for (a date) counts as its text, a
    key JSON cannot have is left out."""
    return len(json.dumps(value, default=str, skipkeys=True, ensure_ascii=False).encode())


def path_problem(value: str) -> str:
    """Why `value` cannot be a path in a spec, or "" when it can."""
    if len(value) > MAX_PATH_CHARS:
        return f"path is {len(value)} characters; at most {MAX_PATH_CHARS}"
    if any(not c.isprintable() for c in value):
        return f"path {_shown(value)} has control characters"
    if any(len(part) > MAX_PATH_PART_CHARS for part in value.split("/")):
        return f"a name in path {_shown(value)} is longer than {MAX_PATH_PART_CHARS} characters"
    return ""


def check_path(value: str | None) -> str | None:
    """A pydantic AfterValidator for path fields."""
    if value is not None and (problem := path_problem(value)):
        raise ValueError(problem)
    return value


def one_line(text: str) -> str:
    """`text` as one printable line of at most MAX_MESSAGE_CHARS: control
    characters (newlines, terminal escapes) written as escapes, the middle cut
    when too long (the start names the file, the end says what is wrong)."""
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in str(text))
    if len(text) > MAX_MESSAGE_CHARS:
        half = (MAX_MESSAGE_CHARS - 5) // 2
        text = f"{text[:half]} ... {text[-half:]}"
    return text


def error_line(e: BaseException, limit: int = 300) -> str:
    """An unexpected error as one short line: its type and text, whitespace folded."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _shown(value, limit: int = 80) -> str:
    """A user's value in a message: repr, cut to `limit` characters."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text[:40]} is out of range")
    return x
