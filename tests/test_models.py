"""A node without the model folder fetches it from the head in chunks into its
cache (no shared file system): byte-identical, loadable, fetched once."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from segctl.node import models


def test_a_missing_model_is_fetched_once_and_loads(tiny_models, tmp_path, monkeypatch):
    real = tiny_models["qwen3"]
    on_head = "/lab/models/qwen-tiny"            # a path this "node" does not have
    calls = {"chunks": 0}

    def manifest(path):
        assert path == on_head
        return models.manifest(str(real))

    def chunk(path, name, offset, n):
        calls["chunks"] += 1
        return models.read_chunk(str(real), name, offset, n)

    monkeypatch.setattr(models, "CHUNK", 4096)   # many chunks per file
    cache = tmp_path / "cache"
    local = Path(models.local_model(on_head, cache, manifest=manifest, chunk=chunk))
    assert local.parent == cache and calls["chunks"] > len(list(real.iterdir()))
    cmp = filecmp.dircmp(real, local)
    assert not cmp.left_only and not cmp.right_only and not cmp.diff_files
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]   # no temp left

    before = calls["chunks"]
    assert models.local_model(on_head, cache, manifest=manifest, chunk=chunk) == str(local)
    assert calls["chunks"] == before                                      # from the cache

    from segctl.engine.model import load_model
    model, tok = load_model(str(local))
    assert tok.encode("after q")


def test_a_model_this_machine_has_is_used_in_place(tiny_models, tmp_path):
    def never(*a):
        raise AssertionError("fetched a model that is here")
    path = str(tiny_models["llama"])
    assert models.local_model(path, tmp_path, manifest=never, chunk=never) == path


def test_the_head_serves_nothing_outside_the_model_folder(tiny_models):
    with pytest.raises(ValueError, match="not inside"):
        models.read_chunk(str(tiny_models["qwen3"]), "../../etc/passwd", 0, 10)
