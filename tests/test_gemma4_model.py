"""Gemma-4 text models cut into parts: per-layer inputs, sliding/full windows, K/V
shared from donor layers and the logit softcap, checked against mlx-lm's forward."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map_with_path

from segctl.engine.demo import GEMMA4_WINDOW, demo_preferences, write_model
from segctl.engine.model import apply_lora, forward_parts, load_model, model_parts
from tests.conftest import segctl


@pytest.fixture(scope="module")
def gemma4_folder(tmp_path_factory):
    corpus = [f"{r['prompt']} {r['chosen']} {r['rejected']}" for r in demo_preferences(100, 1)]
    return write_model(tmp_path_factory.mktemp("gemma4") / "model", "gemma4_text", corpus=corpus,
                       seed=5, layers=6, hidden=64)


def long_ids(model, n=60):
    # Longer than the sliding window, so sliding and full layers see different masks.
    assert n > GEMMA4_WINDOW
    return mx.array([[(7 * i + 3) % model.args.vocab_size for i in range(n)]])


def test_parts_match_the_models_own_forward(gemma4_folder):
    model, _ = load_model(gemma4_folder)  # runs model_parts(check=True)
    parts = model_parts(model, check=True)
    ids = long_ids(model)
    ours, ref = forward_parts(parts, ids), model(ids)
    assert ours.dtype == ref.dtype == mx.float32
    assert mx.allclose(ours, ref, atol=1e-5, rtol=1e-5).item()
    # the softcap is part of the head: logits stay inside (-30, 30)
    assert mx.abs(parts.head(parts.norm(mx.ones((1, 2, 64))) * 100)).max().item() <= 30.0


def test_donors_and_windows(gemma4_folder):
    model, _ = load_model(gemma4_folder)
    parts = model_parts(model)
    assert parts.windows == [GEMMA4_WINDOW, None] * 3
    sharers = {i: d for i, d in enumerate(parts.donors) if d is not None}
    assert sharers == {3: 1, 4: 2, 5: 1}
    for i, d in sharers.items():
        assert d < i and parts.windows[d] == parts.windows[i]
        assert parts.donors[d] is None  # a donor computes its own K/V
    assert {parts.windows[d] for d in sharers.values()} == {GEMMA4_WINDOW, None}
    extras = parts.layer_inputs(long_ids(model), parts.embed(long_ids(model)))
    assert len(extras) == 6 and all(e.shape == (1, 60, 16) for e in extras)


def test_mlx_lm_loads_the_written_folder(gemma4_folder):
    from mlx_lm import load

    model, tok = load(str(gemma4_folder))
    cfg = json.loads((gemma4_folder / "config.json").read_text())
    assert model.model_type == cfg["model_type"] == "gemma4_text"
    # sharer layers were written without K/V projections, and strict loading agreed
    assert not hasattr(model.layers[3].self_attn, "k_proj")
    assert tok.encode("after q")


def test_lora_on_gemma4_stays_in_layers_and_grads_match(gemma4_folder):
    model, _ = load_model(gemma4_folder)
    apply_lora(model, rank=4, scale=10.0, dropout=0.0)
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert names and all(k.startswith("model.layers.") for k in names)
    assert not any(k.startswith("model.layers.4.self_attn.k_proj") for k in names)  # a sharer
    # Non-zero LoRA B, so the adapters change the output and their grads are not trivial.
    mx.random.seed(0)
    model.update(tree_map_with_path(
        lambda p, v: mx.random.normal(v.shape) * 0.05 if p.endswith("lora_b") else v,
        model.trainable_parameters()))
    parts = model_parts(model, check=True)
    ids = long_ids(model)
    weights = mx.random.normal((1, 60, model.args.vocab_size))

    def loss(fwd):
        return lambda: (fwd(ids) * weights).sum()

    ref_loss, ref_g = nn.value_and_grad(model, loss(model))()
    our_loss, our_g = nn.value_and_grad(model, loss(lambda x: forward_parts(parts, x)))()
    assert abs(ref_loss.item() - our_loss.item()) <= 1e-4 * abs(ref_loss.item())
    ref_g, our_g = dict(tree_flatten(ref_g)), dict(tree_flatten(our_g))
    # a donor's K projection learns from its sharers' attention too
    assert mx.abs(our_g["model.layers.1.self_attn.k_proj.lora_b"]).max().item() > 0
    for k in ref_g:
        assert mx.allclose(our_g[k], ref_g[k], atol=1e-4, rtol=1e-3).item(), k


@pytest.mark.slow   # 3 s
def test_init_demo_gemma4_orpo(tmp_path):
    d = tmp_path / "demo"
    proc = segctl("init-demo", d, "--arch", "gemma4_text", "--method", "orpo")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((d / "model" / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_text" and cfg["num_kv_shared_layers"] > 0
    rows = [json.loads(line) for line in (d / "data" / "train.jsonl").read_text().splitlines()]
    assert rows and all(set(r) == {"prompt", "chosen", "rejected"} for r in rows)
    assert all(r["chosen"] != r["rejected"] and len(r["chosen"]) == len(r["rejected"]) for r in rows)
    assert (d / "sweep.yaml").is_file()
    job = (d / "job.yaml").read_text()
    assert "method: orpo" in job and "prefix_shared: true" in job

    from segctl.schemas.job import JobSpec
    if "orpo" not in JobSpec.model_fields:
        pytest.skip("job schema lacks orpo")
    proc = segctl("validate", d / "job.yaml")
    assert proc.returncode == 0, proc.stderr
