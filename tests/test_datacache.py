"""The node's cache of tokenized data sets (engine/data.py `load_dataset_cached`)."""

from __future__ import annotations

import json
import shutil

import pytest

from segctl.engine.data import DataError, load_dataset, load_dataset_cached
from segctl.engine.model import load_model


class _Untouchable:
    """Stands where a tokenizer goes to show it is not called: a cache hit reads no row."""

    def __getattr__(self, name):
        raise AssertionError(f"the tokenizer was used ({name}) on a cache hit")


@pytest.fixture(scope="module")
def demo(demo_dir):
    _, tok = load_model(demo_dir / "model")
    return demo_dir, tok


@pytest.mark.parametrize("method", ["sft", "orpo"])
def test_a_cached_data_set_is_the_data_set(demo, tmp_path, method):
    folder, tok = demo
    if method == "sft":
        data = folder / "data" / "train.jsonl"
        opts = dict(method="sft", mask_prompt=False, max_seq_length=8, overlong="truncate")
    else:
        data = tmp_path / "pairs.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "yes " * (i + 1),
                                            "rejected": "no " * (i + 2)}) + "\n"
                                for i in range(6)))
        opts = dict(method="orpo", max_seq_length=12, overlong="truncate")
    cache = tmp_path / "cache"
    ref = load_dataset(data, tok, **opts)
    first = load_dataset_cached(data, tok, model_dir=folder / "model", cache=cache, **opts)
    again = load_dataset_cached(data, _Untouchable(), model_dir=folder / "model", cache=cache,
                                **opts)
    for got in (first, again):
        assert got.examples == ref.examples and (got.truncated, got.skipped) == (
            ref.truncated, ref.skipped)
    assert ref.truncated > 0          # the options are part of what is kept
    assert len(list(cache.glob("*.json"))) == 1


def test_what_the_tokens_depend_on_is_in_the_key(demo, tmp_path):
    folder, tok = demo
    model = tmp_path / "model"
    shutil.copytree(folder / "model", model)
    data = tmp_path / "train.jsonl"
    shutil.copy(folder / "data" / "train.jsonl", data)
    cache = tmp_path / "cache"
    opts = dict(method="sft", mask_prompt=True, max_seq_length=256, overlong="truncate")
    load = lambda **kw: load_dataset_cached(data, tok, model_dir=model, cache=cache,
                                            **{**opts, **kw})
    load()
    load(mask_prompt=False)                       # an option
    with data.open("a") as f:                     # the data's bytes
        f.write(json.dumps({"text": "one more row"}) + "\n")
    load()
    cfg = model / "tokenizer_config.json"         # a tokenizer file of the model folder
    cfg.write_text(cfg.read_text() + "\n")
    load()
    assert len(list(cache.glob("*.json"))) == 4
    # weights are not part of it: a new adapter's base is the same tokenizer
    (model / "extra.safetensors").write_bytes(b"x")
    load()
    assert len(list(cache.glob("*.json"))) == 4


def test_a_damaged_entry_is_made_again_and_bad_data_is_never_kept(demo, tmp_path):
    folder, tok = demo
    data, cache = folder / "data" / "train.jsonl", tmp_path / "cache"
    opts = dict(method="sft", mask_prompt=True, max_seq_length=256, overlong="truncate")
    ref = load_dataset_cached(data, tok, model_dir=folder / "model", cache=cache, **opts)
    [entry] = cache.glob("*.json")
    entry.write_text(entry.read_text()[:100])     # cut short, as a full disk leaves it
    got = load_dataset_cached(data, tok, model_dir=folder / "model", cache=cache, **opts)
    assert got.examples == ref.examples
    assert json.loads(entry.read_text())["rows"]  # whole again
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    for _ in range(2):
        with pytest.raises(DataError, match="bad.jsonl:1"):
            load_dataset_cached(bad, tok, model_dir=folder / "model", cache=cache, **opts)
    assert len(list(cache.glob("*.json"))) == 1
