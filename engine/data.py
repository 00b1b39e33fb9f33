"""Training rows -> token ids, with every bad row reported as `file:line: reason`.

Rows are jsonl in the shapes mlx-lm's LoRA trainer accepts:
  {"text": ...}                      loss on every token
  {"prompt": ..., "completion": ...} rendered with the chat template
  {"messages": [{"role", "content"}, ...]} rendered with the chat template
With `mask_prompt` the loss covers only the response (the completion, or the last
message); the prompt is context.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Example:
    ids: list[int]
    prompt_len: int  # tokens of context; the loss covers ids[prompt_len:]


class DataError(ValueError):
    """A data file or row we cannot train on; the message starts with file:line."""


@dataclass
class Dataset:
    examples: list[Example]
    truncated: int = 0   # rows cut to max_seq_length (policy "truncate")
    skipped: int = 0     # rows dropped for length (policy "skip")
    path: str = ""
    counts: dict = field(default_factory=dict)

    def __len__(self):
        return len(self.examples)


def load_dataset(path: str | Path, tokenizer, *, mask_prompt: bool = True,
                 max_seq_length: int = 2048, overlong: str = "truncate") -> Dataset:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: data file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    ds = Dataset([], path=str(path))
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from None
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


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a function of (seed, epoch) alone, so a
    resumed run needs only its position to continue exactly."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
