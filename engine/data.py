"""Training rows -> token ids, with every bad row reported as `file:line: reason`.

Rows are jsonl in the shapes mlx-lm's LoRA trainer accepts:
  {"text": ...}                      loss on every token
  {"prompt": ..., "completion": ...} rendered with the chat template
  {"messages": [{"role", "content"}, ...]} rendered with the chat template
With `mask_prompt` the loss covers only the response (the completion, or the last
message); the prompt is context.

For ORPO and DPO, rows are preference pairs in mlx-lm-lora's ORPO shape:
  {"prompt": ..., "chosen": ..., "rejected": ..., "system": ...(optional)}
prompt is a string (the user's message) or a list of messages ("question" is
read when "prompt" is absent, as mlx-lm-lora does); chosen and rejected are a
string, a {"content": ...} object, or a list of messages ending with the
assistant's (a whole conversation, as many preference sets on the Hub have it:
only that last message is the response).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import stat
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from segctl.schemas.atomic import write_atomic
from segctl.schemas.defaults import DEFAULT_MAX_SEQ_LENGTH
from segctl.schemas.errors import UserError
from segctl.schemas.limits import MAX_ROW_BYTES, load_json, one_line


@dataclass(frozen=True)
class Example:
    ids: list[int]
    prompt_len: int  # tokens of context; the loss covers ids[prompt_len:]


@dataclass(frozen=True)
class PreferenceExample:
    prompt: list[int]    # the rendered prompt, generation header included
    chosen: list[int]    # response tokens only: the chosen sequence is prompt + chosen
    rejected: list[int]  # response tokens only: the rejected sequence is prompt + rejected
    # The rejected branch's own prompt when its tokens differ from `prompt`; such
    # a row cannot share one prefix, so the step runs it as two branches.
    rejected_prompt: Optional[list[int]] = None


class DataError(UserError, ValueError):
    """A data file or row we cannot train on; the message starts with file:line and
    is one line (a row's keys are the user's: newlines in them are escaped)."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


@dataclass
class Dataset:
    examples: list  # Example for sft, PreferenceExample for orpo and dpo
    truncated: int = 0   # rows cut to max_seq_length (policy "truncate")
    skipped: int = 0     # rows dropped for length (policy "skip")
    path: str = ""

    def __len__(self):
        return len(self.examples)


def load_dataset(path: str | Path, tokenizer, *, method: str = "sft", mask_prompt: bool = True,
                 max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH, overlong: str = "truncate") -> Dataset:
    """The rows of a jsonl file as token ids, for the job's `method` ("sft", "orpo"
    or "dpo"; orpo and dpo rows are preference pairs and `mask_prompt` does not
    apply)."""
    if method in ("orpo", "dpo"):
        return load_preferences(path, tokenizer, max_seq_length=max_seq_length, overlong=overlong)
    if method != "sft":
        raise ValueError(f"unknown method {method!r}")
    path = Path(path)
    ds = Dataset([], path=str(path))
    for where, row in _rows(path):
        ids, prompt_len = encode_row(row, tokenizer, mask_prompt, where)
        if len(ids) > max_seq_length:
            if overlong == "skip":
                ds.skipped += 1
                continue
            ids = ids[:max_seq_length]
            ds.truncated += 1
        if len(ids) - max(prompt_len, 1) <= 0:
            raise DataError(f"{where}: no response tokens left to train on "
                            f"({len(ids)} tokens, prompt {prompt_len}; "
                            f"max_seq_length {max_seq_length} cuts it all)")
        ds.examples.append(Example(ids, prompt_len))
    if not ds.examples:
        raise DataError(f"{path}: no usable rows")
    return ds


def _rows(path: Path):
    """(`file:line`, parsed JSON) for each non-blank line of a jsonl file. A line is
    read up to MAX_ROW_BYTES and no further (a row past it is refused before it is
    parsed or tokenised), and its JSON nested at most MAX_JSON_DEPTH deep."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise DataError(f"{path}: not a regular file")
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{path}: data file not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    with f:
        lineno = 0
        while raw := f.readline(MAX_ROW_BYTES + 1):
            lineno += 1
            where = f"{path}:{lineno}"
            if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
                raise DataError(f"{where}: row is longer than {MAX_ROW_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                row = load_json(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            except ValueError as e:
                raise DataError(f"{where}: not valid JSON ({e})") from None
            _check_unicode(row, where)
            yield where, row


def _check_unicode(row, where: str) -> None:
    """JSON may escape half of a UTF-16 pair alone ("\\udc00"): such a string is no
    text a tokenizer takes (it raised a TypeError from inside the tokenizer)."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end].encode("unicode_escape").decode("ascii")
        raise DataError(f"{where}: not valid Unicode text (a lone surrogate {bad})") from None


def encode_row(row, tokenizer, mask_prompt: bool, where: str) -> tuple[list[int], int]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    if "prompt" in row or "completion" in row:
        prompt, completion = row.get("prompt"), row.get("completion")
        for key, val in (("prompt", prompt), ("completion", completion)):
            if not isinstance(val, str):
                raise DataError(f"{where}: '{key}' must be a string"
                                + (" (missing)" if val is None else ""))
        if not completion:
            raise DataError(f"{where}: 'completion' is empty")
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": completion}]
        return _chat(messages, tokenizer, mask_prompt, where)
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: messages[{i}] needs string 'role' and 'content'")
        if mask_prompt and messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: with mask_prompt the last message must be the "
                            f"assistant's, got '{messages[-1]['role']}'")
        return _chat(messages, tokenizer, mask_prompt, where)
    if "text" in row:
        text = row["text"]
        if not isinstance(text, str) or not text:
            raise DataError(f"{where}: 'text' must be a non-empty string")
        ids = list(tokenizer.encode(text))
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids.append(tokenizer.eos_token_id)
        return ids, 0
    raise DataError(f"{where}: row has none of 'text', 'prompt'/'completion', 'messages' "
                    f"(keys: {', '.join(sorted(row)) or 'none'})")


def _chat(messages, tokenizer, mask_prompt, where):
    try:
        ids = list(tokenizer.apply_chat_template(messages, return_dict=False))
        prompt_len = 0
        if mask_prompt:
            prompt_len = len(tokenizer.apply_chat_template(
                messages[:-1], add_generation_prompt=True, return_dict=False))
    except Exception as e:
        raise DataError(f"{where}: chat template failed ({e})") from None
    return ids, prompt_len


def load_preferences(path: str | Path, tokenizer, *, max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH,
                     overlong: str = "truncate") -> Dataset:
    """Preference pairs (ORPO, DPO). Each branch (prompt + chosen, prompt + rejected) is
    held to max_seq_length by cutting its response's tail ("truncate") or by
    dropping the row ("skip"); a row counts once however many branches were cut."""
    path = Path(path)
    ds = Dataset([], path=str(path))
    for where, row in _rows(path):
        ex = encode_preference(row, tokenizer, where)
        room_c = max_seq_length - len(ex.prompt)
        room_r = max_seq_length - len(ex.rejected_prompt or ex.prompt)
        if len(ex.chosen) > room_c or len(ex.rejected) > room_r:
            if overlong == "skip":
                ds.skipped += 1
                continue
            ex = PreferenceExample(ex.prompt, ex.chosen[:max(room_c, 0)],
                                   ex.rejected[:max(room_r, 0)], ex.rejected_prompt)
            ds.truncated += 1
        if min(room_c, room_r) <= 0:
            raise DataError(f"{where}: the prompt alone is {len(ex.prompt)} tokens; max_seq_length "
                            f"{max_seq_length} leaves no response tokens to train on")
        ds.examples.append(ex)
    if not ds.examples:
        raise DataError(f"{path}: no usable rows")
    return ds


def encode_preference(row, tokenizer, where: str) -> PreferenceExample:
    """One preference row -> prompt ids and the two responses' ids, each response
    being exactly what the chat template adds after the prompt."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected")
               if k not in row and not (k == "prompt" and "question" in row)]
    if missing:
        raise DataError(f"{where}: a preference row needs 'prompt', 'chosen' and 'rejected'; "
                        f"missing {', '.join(repr(k) for k in missing)} "
                        f"(keys: {', '.join(sorted(row)) or 'none'})")
    if row.get("preference_score", 1.0) != 1.0:
        # mlx-lm-lora scales the chosen log p by it; we would silently train something else
        raise DataError(f"{where}: 'preference_score' is not supported (only 1.0)")
    prompt = _prompt_messages(row, where)
    chosen = _response(row["chosen"], "chosen", where)
    rejected = _response(row["rejected"], "rejected", where)

    # Thinking templates (Qwen3) render a finished answer with an empty think block;
    # the prompt must carry that block too to be a prefix (mlx-lm-lora does the same).
    kwargs = {"enable_thinking": False} if getattr(tokenizer, "has_thinking", False) else {}
    try:
        prompt_ids = list(tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, return_dict=False, **kwargs))
        full = [list(tokenizer.apply_chat_template(
                    prompt + [{"role": "assistant", "content": text}], return_dict=False, **kwargs))
                for text in (chosen, rejected)]
    except Exception as e:
        raise DataError(f"{where}: chat template failed ({e})") from None
    if not prompt_ids:
        raise DataError(f"{where}: the chat template renders the prompt as no tokens")
    # Each branch's prompt is what its rendering shares with the prompt's. The
    # text must extend the prompt's; its tokens may still differ at the seam, when
    # the tokenizer merges the prompt's last characters with the response's first
    # (a generation prompt ending in a space). That branch's prompt is then shorter,
    # and a row whose two branch prompts differ runs as two branches in the step.
    try:
        prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                    tokenize=False, **kwargs)
        texts = [tokenizer.apply_chat_template(
                     prompt + [{"role": "assistant", "content": text}], tokenize=False, **kwargs)
                 for text in (chosen, rejected)]
    except Exception as e:
        raise DataError(f"{where}: chat template failed ({e})") from None
    prompts = []
    for ids, text, key in zip(full, texts, ("chosen", "rejected")):
        n = _common_prefix(ids, prompt_ids)
        if not text.startswith(prompt_text) or n == 0:
            raise DataError(f"{where}: chat template does not render the prompt as a prefix of "
                            f"the prompt + '{key}' conversation, so its response tokens cannot "
                            f"be told apart")
        if len(ids) == n:
            raise DataError(f"{where}: '{key}' renders to no tokens after the prompt")
        prompts.append(n)
    (nc, nr), (fc, fr) = prompts, full
    return PreferenceExample(fc[:nc], fc[nc:], fr[nr:],
                             rejected_prompt=None if fr[:nr] == fc[:nc] else fr[:nr])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _prompt_messages(row: dict, where: str) -> list[dict]:
    key = "prompt" if "prompt" in row else "question"
    prompt, system = row[key], row.get("system")
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: '{key}' is empty")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        _check_messages(prompt, key, where)
        if prompt[-1]["role"] == "assistant":
            raise DataError(f"{where}: '{key}' must not end with the assistant's message "
                            f"(the response is 'chosen' / 'rejected')")
        messages = list(prompt)
    else:
        raise DataError(f"{where}: '{key}' must be a non-empty string or a non-empty list of messages")
    if "system" in row:
        if not isinstance(system, str) or not system:
            raise DataError(f"{where}: 'system' must be a non-empty string")
        if messages[0]["role"] == "system":
            raise DataError(f"{where}: both 'system' and a system message in '{key}'; give one")
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _response(value, key: str, where: str) -> str:
    """The response text of a chosen / rejected value."""
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if isinstance(value, list):
        if not value:
            raise DataError(f"{where}: '{key}' is an empty list")
        _check_messages(value, key, where)
        if value[-1]["role"] != "assistant":
            raise DataError(f"{where}: '{key}' must end with the assistant's message, "
                            f"got '{value[-1]['role']}'")
        value = value[-1]["content"]
    elif isinstance(value, dict):
        if not isinstance(value.get("content"), str) or value.get("role", "assistant") != "assistant":
            raise DataError(f"{where}: '{key}' as an object needs a string 'content' "
                            f"(and role 'assistant' if it has one)")
        value = value["content"]
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string or a list of messages, "
                        f"got {type(value).__name__}")
    if not value:
        raise DataError(f"{where}: '{key}' is empty")
    return value


def _check_messages(messages: list, key: str, where: str) -> None:
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {key}[{i}] needs string 'role' and 'content'")


# ---------------------------------------------------------------- a node's cache

CACHE_FORMAT = 1
CACHE_KEEP = 64          # data sets a cache folder keeps, the most recently used
_WEIGHTS = (".safetensors", ".bin", ".gguf", ".npz", ".pt", ".pth")


def load_dataset_cached(path: str | Path, tokenizer, *, model_dir: str | Path,
                        cache: str | Path | None, **opts) -> Dataset:
    """`load_dataset`, kept in the folder `cache` (a node's) under a key of all the
    tokens depend on: the file's bytes, the model folder's files but its weights
    (tokenizer, template, config), the options, this module's code and the
    tokenizer libraries' versions. A node runs many trials of one data set, each
    in a process of its own: rendering and tokenizing took ~1 s of every attempt
    on the demo's 400 rows, and grows with the rows. A bad file is never cached:
    it raises here every time, as `load_dataset` does. No cache: no caching."""
    if cache is None:
        return load_dataset(path, tokenizer, **opts)
    try:
        key = _cache_key(Path(path), Path(model_dir), opts)
    except OSError:   # unreadable: load_dataset says why, in its words
        return load_dataset(path, tokenizer, **opts)
    entry = Path(cache) / f"{key}.json"
    ds = _read_entry(entry, str(path))
    if ds is None:
        ds = load_dataset(path, tokenizer, **opts)
        try:
            Path(cache).mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomic(entry, json.dumps(_entry(ds)), mode=0o600)
            _prune(Path(cache))
        except OSError:
            pass   # a cache that cannot be written is no cache, not a failed attempt
    return ds


def _cache_key(path: Path, model_dir: Path, opts: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([CACHE_FORMAT, sorted(opts.items())] + [
        _version(p) for p in ("transformers", "tokenizers", "mlx-lm")]).encode())
    h.update(hashlib.sha256(Path(__file__).read_bytes()).digest())
    h.update(_file_digest(path))
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHTS):
            h.update(f.name.encode() + b"\0" + _file_digest(f))
    return h.hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _file_digest(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def _entry(ds: Dataset) -> dict:
    rows = [[e.ids, e.prompt_len] if isinstance(e, Example) else
            [e.prompt, e.chosen, e.rejected, e.rejected_prompt] for e in ds.examples]
    return {"format": CACHE_FORMAT, "truncated": ds.truncated, "skipped": ds.skipped,
            "rows": rows}


def _read_entry(entry: Path, path: str) -> Dataset | None:
    """The cached Dataset, or None when there is none or it is not whole."""
    try:
        doc = json.loads(entry.read_text())
        if doc["format"] != CACHE_FORMAT:
            return None
        examples = [Example(list(r[0]), int(r[1])) if len(r) == 2 else
                    PreferenceExample(list(r[0]), list(r[1]), list(r[2]),
                                      None if r[3] is None else list(r[3]))
                    for r in doc["rows"]]
        ds = Dataset(examples, int(doc["truncated"]), int(doc["skipped"]), path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        entry.unlink(missing_ok=True)   # damaged: made again
        return None
    os.utime(entry)   # most recently used
    return ds if ds.examples else None


def _prune(cache: Path) -> None:
    entries = sorted(cache.glob("*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
    for f in entries[CACHE_KEEP:]:
        f.unlink(missing_ok=True)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a function of (seed, epoch) alone, so a
    resumed run needs only its position to continue exactly."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
