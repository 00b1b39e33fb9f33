"""The tile-by-tile attention backward on the families whose attention is not
plain: sinks the model trains (gpt-oss), Gemma 2's soft-capped attention made one
call (engine/capped.py), Gemma-4's donor K/V on a long row with offload."""

from __future__ import annotations

import mlx.core as mx
import pytest

from segctl.engine import Example, loss_and_grads
from segctl.engine.model import check_length, model_parts
from segctl.engine.settings import StepMemory
from tests.test_families import TOL, _lora, _vocab, _worst, tile_counter, tiled_in_every_layer
from tests.zoo import tiny_model

pytestmark = pytest.mark.slow   # tiny models of three families, several steps each


def _row(model):
    n = check_length(getattr(model, "language_model", model)) + 35
    ids = mx.random.randint(1, _vocab(model), (n,), key=mx.random.key(0)).tolist()
    return Example(ids, n // 4)


def test_sinks_the_model_trains_get_their_gradient_rows_apart(monkeypatch):
    """gpt-oss with its sinks unfrozen: run rows apart and tile by tile, the sinks'
    gradient is the attention's, added to the layer's own."""
    model, _ = tiny_model("gpt_oss")
    parts = model_parts(model, name="gpt_oss")
    assert all(parts.rowwise)
    _lora(model, "gpt_oss")
    for layer in parts.layers:
        layer.self_attn.unfreeze(keys=["sinks"], recurse=False)
    ex = _row(model)
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
    assert any(k.endswith("sinks") for k in ref)
    counts = tile_counter(monkeypatch)
    loss, grads = loss_and_grads(model, ex, memory=StepMemory(segment_size=1, attn_block=16,
                                                              mlp_chunk=11), parts=parts)
    assert tiled_in_every_layer(counts, len(parts.layers))
    assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
    assert _worst(grads, ref) <= TOL


def test_gemma2_attention_is_one_soft_capped_call():
    """Each Gemma 2 attention module gets engine/capped.py's class (the same
    parameters, the same output); the model's own forward is unchanged by it."""
    from mlx.utils import tree_flatten

    model, _ = tiny_model("gemma2")
    ids = mx.array([list(range(1, 20))])
    before = model(ids)
    names = [n for n, _ in tree_flatten(model.parameters())]
    parts = model_parts(model, name="gemma2")
    kinds = {type(layer.self_attn).__module__ for layer in parts.layers}
    assert kinds == {"segctl.engine.capped"}
    assert all(parts.block_masks)
    assert [n for n, _ in tree_flatten(model.parameters())] == names
    assert mx.allclose(model(ids), before, atol=1e-5).item()


def test_gemma4_donor_kv_tiles_with_offload(monkeypatch, tmp_path):
    """Gemma-4 (layers reading a donor's K/V) at segment sizes 1 and 3, in memory
    and on disk: exact, and every layer's backward tile by tile."""
    model, _ = tiny_model("gemma4_text")
    parts = model_parts(model, name="gemma4_text")
    assert any(d is not None for d in parts.donors)
    _lora(model, "gemma4_text")
    ex = _row(model)
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
    counts = tile_counter(monkeypatch)
    for seg, offload in ((1, tmp_path), (3, None)):
        counts.clear()
        loss, grads = loss_and_grads(model, ex, memory=StepMemory(
            segment_size=seg, attn_block=16, mlp_chunk=11, offload=offload), parts=parts)
        assert tiled_in_every_layer(counts, len(parts.layers)), counts
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
        assert _worst(grads, ref) <= TOL


def test_sinks_differentiate_where_mlx_attention_backward_takes_none(monkeypatch):
    """On a GPU MLX's attention backward refuses sinks; there (the probe substituted
    here) every step of gpt-oss, plain, grad_checkpoint and segmented on short
    rows, takes the tiled backward for its sink calls, and stays exact."""
    from segctl.engine import attention
    model, _ = tiny_model("gpt_oss")
    parts = model_parts(model, name="gpt_oss")
    _lora(model, "gpt_oss")
    ids = mx.random.randint(1, _vocab(model), (20,), key=mx.random.key(0)).tolist()
    ex = Example(ids, 5)
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
    calls = []
    own = attention._sinks_attention
    monkeypatch.setattr(attention, "_sinks_attention", lambda *a: calls.append(1) or own(*a))
    monkeypatch.setattr(attention, "own_sinks_vjp", lambda: True)
    for memory in (StepMemory(segment_size=0), StepMemory(segment_size=0, grad_checkpoint=True),
                   StepMemory(segment_size=1), StepMemory(segment_size=len(parts.layers))):
        calls.clear()
        loss, grads = loss_and_grads(model, ex, memory=memory, parts=parts)
        assert len(calls) >= len(parts.layers), memory
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
        assert _worst(grads, ref) <= TOL, memory
