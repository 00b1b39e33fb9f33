"""Rows side by side without padding (engine/ragged.py): the rows' tokens one
after another, attention alone run as the padded batch. Each check compares
with plain autodiff of every row alone, and with the padded side-by-side step."""

from __future__ import annotations

import mlx.core as mx
import pytest

from segctl.engine import loss_and_grads
from segctl.engine.model import model_parts
from segctl.engine.plans import make_plans
from segctl.engine.ragged import Ragged, Rope
from segctl.engine.settings import StepMemory
from segctl.engine.step import ragged_refusal
from tests.test_batches import SHAPES, one_by_one, rows_of
from tests.test_fused import assert_same, preference_rows, three_steps
from tests.test_step import lora_model, worst_rel_error

TOL = 1e-4


def test_the_layout_takes_each_token_to_its_row_and_back():
    layout = Ragged((3, 1, 2), width=4, tail=2)
    gather, scatter = (a.tolist() for a in layout.arrays())
    # padded positions copy their row's last token; the tail tokens belong to no row
    assert gather == [0, 1, 2, 2, 3, 3, 3, 3, 4, 5, 5, 5]
    assert scatter == [0, 1, 2, 4, 8, 9, 0, 0]
    x = mx.arange(8 * 2 * 3).reshape(1, 8, 2, 3).swapaxes(1, 2)   # [1, H, T, d] as a layer has it
    padded = layout.pad(x)
    assert padded.shape == (3, 2, 4, 3) and layout.pad(padded) is padded
    assert padded[1, :, 0].tolist() == x[0, :, 3].tolist()          # row 1's only token
    back = layout.unpad(padded)
    assert back[..., :6, :].tolist() == x[..., :6, :].tolist()     # every row's token comes back


def test_each_rows_positions_start_at_zero(tiny_models):
    """RoPE is relative: a row run at positions shifted by its start scores almost
    the same, so the step's numbers alone would not tell. Each row's q and k take
    exactly the positions it has alone."""
    model = lora_model(tiny_models["qwen3"])
    rope = model.layers[0].self_attn.rope
    layout = Ragged((5, 3), width=6)
    x = mx.random.normal((1, 2, 8, model.args.head_dim), key=mx.random.key(1))
    got = Rope(rope, layout)(x)
    assert got.shape == (2, 2, 6, model.args.head_dim)
    assert mx.array_equal(got[0, :, :5], rope(x[:, :, :5])[0])
    assert mx.array_equal(got[1, :, :3], rope(x[:, :, 5:])[0])


def test_rows_side_by_side_unpadded_are_the_rows_one_by_one(tiny_models):
    model = lora_model(tiny_models["qwen3"])
    parts = model_parts(model, check=False)
    assert ragged_refusal(parts) is None
    batch = rows_of(model.args.vocab_size, SHAPES)
    loss0, ref = one_by_one(model, batch)
    for seg, align in ((0, 1), (1, 1), (2, 16), (5, 16)):
        metrics: dict = {}
        loss, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=seg), side=True,
                                     ragged=True, pack_length=100, align=align, parts=parts,
                                     metrics=metrics)
        assert abs(loss.item() - loss0) <= TOL * abs(loss0), (seg, align)
        assert worst_rel_error(grads, ref) <= TOL, (seg, align)
        # the side-by-side groups, [40, 31] [23, 14, 9], with no padding: their
        # tokens (rounded up to 8 x align where align > 1)
        tokens = sum(n for n, _ in SHAPES) - len(SHAPES)
        assert metrics["tokens"] == tokens and metrics["sequences"] == 2
        assert metrics["padded"] == (tokens if align == 1 else 128 + 128)
    # a group longer than attn_block (its attention in blocks) stays padded: [39, 30]
    # padded, [22, 13, 8] not
    metrics = {}
    loss, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=2, attn_block=32),
                                 side=True, ragged=True, pack_length=100, parts=parts,
                                 metrics=metrics)
    assert abs(loss.item() - loss0) <= TOL * abs(loss0)
    assert worst_rel_error(grads, ref) <= TOL
    assert metrics["padded"] == 2 * 39 + 43 and metrics["sequences"] == 3


def test_preference_rows_run_ragged_in_two_branches(tiny_models):
    model = lora_model(tiny_models["qwen3"])
    batch = preference_rows(model.args.vocab_size, [(7, 5, 9), (12, 3, 8)])
    for method in ("orpo", "dpo"):
        loss0, ref = one_by_one(model, batch, method)
        loss, grads = loss_and_grads(model, batch, method=method, memory=StepMemory(segment_size=2),
                                     side=True, ragged=True, pack_length=200)
        assert abs(loss.item() - loss0) <= TOL * abs(loss0), method
        assert worst_rel_error(grads, ref) <= TOL, method


def test_fused_ragged_steps_are_the_unfused_ones_as_the_weights_change(tiny_models):
    model = lora_model(tiny_models["qwen3"])
    kw = dict(side=True, ragged=True, pack_length=400, align=16)
    first = rows_of(model.args.vocab_size, SHAPES)
    want, _ = three_steps(model, first, False, **kw)
    got, compiled = three_steps(model, first, True, **kw)
    assert_same(want, got)
    assert [len(shape) for shape in compiled.fns] == [5]    # [1, T] and (T, rows, width)


def test_a_fused_layout_is_an_input_not_what_the_trace_saw(tiny_models):
    """Rows of other lengths in the same shapes (5 rows, the longest 39 tokens:
    width 48; 112 tokens, 128 with the tail) reuse the compiled functions: a
    layout captured at the trace would put their tokens in the first rows' places."""
    model = lora_model(tiny_models["qwen3"])
    parts = model_parts(model, check=False)
    kw = dict(side=True, ragged=True, pack_length=400, align=16, parts=parts)
    first = rows_of(model.args.vocab_size, SHAPES)
    other = rows_of(model.args.vocab_size, [(40, 12), (30, 3), (25, 5), (12, 0), (10, 2)], seed=7)
    loss0, ref = one_by_one(model, other)
    fused = StepMemory(segment_size=2, fused=True)
    for _ in range(2):   # compiled the second time
        loss_and_grads(model, first, memory=fused, **kw)
    (shape,) = parts.fused.fns
    loss, grads = loss_and_grads(model, other, memory=fused, **kw)
    assert list(parts.fused.fns) == [shape]   # the same functions ran
    assert abs(loss.item() - loss0) <= TOL * abs(loss0)
    assert worst_rel_error(grads, ref) <= TOL


def test_sliding_window_layers_run_unpadded_inside_their_windows(tiny_models):
    """llama's tiny model mixes sliding-window layers (window 8) in: in the padded
    layout each row takes its window as alone, its rows longer than the window."""
    model = lora_model(tiny_models["llama"])
    parts = model_parts(model, check=False)
    assert ragged_refusal(parts) is None and any(parts.windows)
    batch = rows_of(model.args.vocab_size, SHAPES)
    loss0, ref = one_by_one(model, batch)
    for seg, fused in ((1, False), (2, True), (2, True)):
        metrics: dict = {}
        loss, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=seg, fused=fused),
                                     side=True, ragged=True, pack_length=100, align=16,
                                     parts=parts, metrics=metrics)
        assert abs(loss.item() - loss0) <= TOL * abs(loss0), seg
        assert worst_rel_error(grads, ref) <= TOL, seg
        assert metrics["sequences"] == 2 and metrics["padded"] == 2 * 128
    assert parts.fused.fns    # the second fused step ran compiled


def test_what_cannot_run_unpadded_is_refused_with_the_reason(tiny_models):
    gemma4 = model_parts(lora_model(tiny_models["gemma4_text"]), check=False)   # shares K/V
    assert ragged_refusal(gemma4) == "layers share K/V"
    with pytest.raises(ValueError, match="unpadded here: layers share K/V"):
        loss_and_grads(lora_model(tiny_models["gemma4_text"]), rows_of(64, SHAPES),
                       memory=StepMemory(segment_size=1), side=True, ragged=True,
                       pack_length=100)


def test_only_a_group_with_padding_runs_unpadded(tiny_models):
    parts = model_parts(lora_model(tiny_models["qwen3"]), check=False)
    kw = dict(side=True, ragged=400, pack_length=400)   # ragged: the longest it takes
    (plan,) = make_plans(rows_of(64, [(12, 2), (12, 0)]), "sft", parts, **kw)
    assert plan.streams[0].ragged is None and plan.streams[0].batch == 2
    (plan,) = make_plans(rows_of(64, [(12, 2), (9, 0)]), "sft", parts, **kw)
    assert plan.streams[0].ragged.lengths == (11, 8) and plan.streams[0].batch == 1
    # aligned, equal rows are padded too: they run unpadded, the tail rounding T up
    (plan,) = make_plans(rows_of(64, [(12, 2), (12, 0)]), "sft", parts, align=16, **kw)
    assert plan.streams[0].ragged.shape == (128, 2, 16) and plan.streams[0].tokens == 22
