"""Every decoder family of the installed mlx-lm trains exactly or is refused,
and packs exactly or says why it cannot.

The families are found by walking `mlx_lm.models` (tests/zoo.py), not listed by
hand. For each one that builds as a tiny random model (fp32, windows of 8
tokens, sliding and full layers mixed where the family has them), either the cut
is refused with a one-line `ModelError`, or the segmented step's loss and LoRA
gradients at segment sizes 1 and 2, with the attention backward in blocks and
the MLP in chunks of rows (engine/layer.py), rows apart where the layer allows
it (engine/rows.py), boundaries in memory and on disk, equal plain autodiff of
the model's own forward on a row longer than every window. The tile thresholds
are lowered (rows past 16 tokens go tile by tile over 7 keys), and the walk
counts in which layers the backward went tile by tile (`tile_counter`).
Nothing in between: a family may not load and then train on another loss.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from segctl.engine import Example, loss_and_grads
from segctl.engine.model import ModelError, check_length, model_parts
from segctl.engine.settings import StepMemory
from segctl.engine.step import pack_refusal, ragged_refusal, side_refusal
from segctl.schemas.families import (
    PACKABLE_FAMILIES,
    ROWWISE_FAMILIES,
    SINKS_FAMILIES,
    TILED_FAMILIES,
)
from tests.conftest import WIDE, random_lora
from tests.zoo import families, tiny_model

pytestmark = pytest.mark.slow   # the walk over every model family

TOL = 1e-4
BLOCK = 16
CHUNK = 11   # MLP rows per chunk: divides no row length here
TILE = 7     # keys per tile, on rows past TILED_ABOVE tokens
TILED_ABOVE = 16


def tile_counter(monkeypatch) -> list[list[int]]:
    """Lower the tile thresholds and count: one [parts over more than TILE keys,
    parts that went tile by tile] per attention backward in blocks
    (`blocked_grads`: one per attention layer a segmented backward reaches)."""
    from segctl.engine import attention
    monkeypatch.setattr(attention, "ATTN_KEY_TILE", TILE)
    monkeypatch.setattr(attention, "ATTN_TILED_ABOVE", TILED_ABOVE)
    counts: list[list[int]] = []
    tiled, blocked = attention.tiled_vjp, attention.blocked_grads

    def count_tile(*args, **kwargs):
        counts[-1][1] += 1
        return tiled(*args, **kwargs)

    def count_block(q, k, v, d_out, mask, scale, block, *rest, **kwargs):
        L, S = q.shape[2], k.shape[2]
        wide = sum(sum(b - a for a, b in ranges) > TILE
                   for i in range(0, L, block)
                   for _, _, ranges, _ in attention._block_parts(mask, i, min(i + block, L), L, S))
        counts.append([wide, 0])
        return blocked(q, k, v, d_out, mask, scale, block, *rest, **kwargs)

    monkeypatch.setattr(attention, "tiled_vjp", count_tile)
    monkeypatch.setattr(attention, "blocked_grads", count_block)
    return counts


def tiled_in_every_layer(counts, layers: int) -> bool:
    """Every layer's attention backward went in blocks (one call each) and every
    part of a block over more than a tile of keys went tile by tile (with sinks,
    every part does)."""
    return len(counts) == layers and all(t >= w for w, t in counts) and \
        sum(w for w, _ in counts) > 0




def _lora(model, family):
    mx.random.seed(1)
    random_lora(model)
    if family in WIDE:
        model.set_dtype(mx.float64)


def _trainable(family):
    """(model with random LoRA, its parts), or the test skipped where the family does
    not build or is refused (test_family_trains_exactly_or_is_refused says why)."""
    try:
        model, _ = tiny_model(family)
        parts = model_parts(model, name=family)
    except (Exception, SystemExit):
        pytest.skip(f"{family}: not built or refused (test_family_trains_exactly_or_is_refused)")
    _lora(model, family)
    return model, parts


def _vocab(model):
    text = model.language_model if hasattr(model, "language_model") else model
    return text.model.embed_tokens.weight.shape[0]


def _worst(grads, ref) -> float:
    """The largest per-tensor relative error of `grads` against `ref`, except that a
    tensor whose gradient is zero in exact arithmetic (a top-1 router's, say: its
    normalised score is always 1) holds rounding noise only, so it is measured
    against the largest gradient. Each tensor's scale is read once: a mixture's
    hundreds of LoRA tensors made a scale per tensor over all of them seconds
    of the walk."""
    assert grads.keys() == ref.keys()
    tops = {k: mx.max(mx.abs(g)).item() for k, g in ref.items()}
    floor = 1e-5 * max(tops.values())
    return max(mx.max(mx.abs(grads[k] - ref[k])).item() / max(tops[k], floor) for k in ref)


@pytest.mark.parametrize("family", families())
def test_family_trains_exactly_or_is_refused(family, monkeypatch, tmp_path):
    try:
        model, _ = tiny_model(family)
    except (Exception, SystemExit) as e:
        pytest.skip(f"{family}: not built here ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''})"[:200])
    try:
        parts = model_parts(model, name=family)
    except ModelError as e:
        assert "\n" not in str(e) and str(e).startswith(f"{family}: ")
        return
    # The planner's lists of row-wise and tiled families are the engine's verdicts.
    assert all(parts.rowwise) == (family in ROWWISE_FAMILIES), (family, parts.rowwise)
    sinks = any(name.endswith(".sinks") for name, _ in tree_flatten(model.parameters()))
    assert sinks == (family in SINKS_FAMILIES), (family, sinks)
    # and a probed layer class kept whole says why, in one line
    probed = [not d and x is None for d, x in zip(
        parts.donors, parts.layer_inputs(mx.array([[1]]), parts.embed(mx.array([[1]]))))]
    assert bool(parts.whole_rows) == any(p and not r for p, r in zip(probed, parts.rowwise))
    assert all(why and "\n" not in why for why in parts.whole_rows.values())
    _lora(model, family)
    n = check_length(getattr(model, "language_model", model)) + 2 * BLOCK + 3      # past every window, several blocks
    vocab = _vocab(model)
    ids = mx.random.randint(1, vocab, (n,), key=mx.random.key(0)).tolist()
    ex = Example(ids, n // 4)
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
    # Real gradients (a family may leave a few exactly zero, e.g. q/k under a norm).
    live = sum(mx.max(mx.abs(g)).item() > 0 for g in ref.values())
    assert live >= len(ref) / 2, (family, live, len(ref))
    counts = tile_counter(monkeypatch)
    verdicts = []
    for seg, offload in ((1, None), (2, tmp_path)):
        counts.clear()
        loss, grads = loss_and_grads(model, ex,
                                     memory=StepMemory(segment_size=seg, attn_block=BLOCK,
                                                       mlp_chunk=CHUNK, offload=offload),
                                     parts=parts)
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item()), (family, seg)
        worst = _worst(grads, ref)
        assert worst <= TOL, (family, seg, worst)
        verdicts.append(tiled_in_every_layer(counts, len(parts.layers)))
    assert verdicts[0] == verdicts[1] == (family in TILED_FAMILIES), (family, verdicts, counts)
    _packs_exactly_or_says_why(model, parts, family, ids, n)


def _packs_exactly_or_says_why(model, parts, family, ids, n):
    """Rows packed into one sequence (the long row past every window, and two
    shorter ones) train as the same rows apart under plain autodiff, or the
    engine says in one line why this family cannot be packed; the planner's list
    of packable families is that verdict."""
    why = pack_refusal(parts)
    assert (why is None) == (family in PACKABLE_FAMILIES), (family, why)
    if why is not None:
        assert "\n" not in why
        return
    batch = [Example(ids, n // 4), Example(ids[:n // 3], 2), Example(ids[-7:], 0)]
    loss0, ref = loss_and_grads(model, batch, memory=StepMemory(segment_size=0), pack=False)
    for seg in (1, 2):
        metrics: dict = {}
        loss, grads = loss_and_grads(model, batch,
                                     memory=StepMemory(segment_size=seg, attn_block=BLOCK,
                                                       mlp_chunk=CHUNK),
                                     pack=True, pack_length=2 * n, parts=parts, metrics=metrics)
        assert metrics["sequences"] == 1
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item()), (family, seg)
        worst = _worst(grads, ref)
        assert worst <= TOL, (family, "packed", seg, worst)


# The families named in the README's table as trained exactly, beyond the zoo-wide
# SFT check: preference methods, two-branch and prefix-shared, on the same models.
NAMED = ["llama", "gemma", "gemma2", "gemma3_text", "gemma4_text", "gpt_oss", "olmo3",
         "granite", "cohere"]


@pytest.mark.parametrize("family", NAMED)
def test_named_family_preference_methods_are_exact(family):
    from segctl.engine import PreferenceExample
    model, _ = tiny_model(family)
    parts = model_parts(model, name=family)
    _lora(model, family)
    vocab = _vocab(model)
    w = check_length(model)
    toks = mx.random.randint(1, vocab, (3 * w,), key=mx.random.key(3)).tolist()
    # A prompt and responses each longer than the windows: the rejected rows of a
    # prefix-shared pass see the prompt across a window boundary.
    ex = PreferenceExample(toks[:w], toks[w:2 * w], toks[2 * w:2 * w + w - 3])
    for method in ("orpo", "dpo"):
        for shared in (False, True):
            metrics: dict = {}
            loss0, ref = loss_and_grads(model, ex, method=method,
                                        memory=StepMemory(segment_size=0), prefix_shared=shared,
                                        metrics=metrics)
            for seg in (1, 2):
                got: dict = {}
                loss, grads = loss_and_grads(model, ex, method=method,
                                             memory=StepMemory(segment_size=seg, attn_block=BLOCK,
                                                               mlp_chunk=CHUNK),
                                             prefix_shared=shared, parts=parts, metrics=got)
                assert got["prefix_shared"] == metrics["prefix_shared"]
                assert abs(loss.item() - loss0.item()) <= TOL * max(abs(loss0.item()), 1e-3), \
                    (family, method, shared, seg)
                worst = _worst(grads, ref)
                assert worst <= TOL, (family, method, shared, seg, worst)


def test_a_refused_family_stops_validate_plan_submit_and_tune(demo_dir, tmp_path):
    import json

    from tests.conftest import assert_one_line_error, segctl
    from tests.test_train_cli import copy_demo
    from tests.zoo import tiny_config

    folder = tmp_path / "neox"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config("gpt_neox")))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)   # never read
    job = copy_demo(demo_dir, tmp_path, model=str(folder))
    home = tmp_path / "home"
    for cmd in (["validate", job], ["plan", job], ["submit", job, "--detach"],
                ["tune", "--model", folder, "--seq-lens", "64"]):
        err = assert_one_line_error(segctl(*cmd, env={"SEGCTL_HOME": home}),
                                    "gpt_neox cannot be cut into segments", "no model.embed_tokens")
        assert "model: " in err
    assert not home.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", families())
def test_prefix_shared_preference_runs_exactly_or_falls_back(family):
    """Prefix-shared ORPO on every family that trains: exact, whether its layers
    take block masks (`parts.block_masks`) or get array masks instead."""
    from segctl.engine import PreferenceExample
    model, parts = _trainable(family)
    w = check_length(getattr(model, "language_model", model))
    toks = mx.random.randint(1, _vocab(model), (3 * w,), key=mx.random.key(3)).tolist()
    ex = PreferenceExample(toks[:w], toks[w:2 * w], toks[2 * w:3 * w - 3])
    loss0, ref = loss_and_grads(model, ex, method="orpo", memory=StepMemory(segment_size=0),
                                prefix_shared=True)
    loss, grads = loss_and_grads(model, ex, method="orpo",
                                 memory=StepMemory(segment_size=2, attn_block=BLOCK,
                                                   mlp_chunk=CHUNK),
                                 prefix_shared=True, parts=parts)
    assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item()), family
    worst = _worst(grads, ref)
    assert worst <= TOL, (family, worst)


def test_layers_that_use_the_mask_themselves_get_arrays():
    # deepseek_v3's MLA adds the mask to its position scores before attention: it
    # may not see a BlockMask. Plain attention may, and so may gemma2's scores by
    # hand once engine/capped.py has made them one soft-capped call.
    for family, takes in (("gemma2", True), ("deepseek_v3", False), ("llama", True),
                          ("gpt_oss", True)):
        parts = model_parts(tiny_model(family)[0], name=family)
        assert parts.block_masks == [takes] * len(parts.layers), family


@pytest.mark.parametrize("family", families())
def test_family_fuses_exactly_or_runs_unfused(family, monkeypatch):
    """A GPU's fused segments (engine/fused.py) on every family: a row shorter than
    every window (so every layer keeps the model's own mask), the fused step
    after the one that sees its shape equal to the unfused step; attention sinks
    through the engine's own vjp, as on a GPU. A family whose segments take other
    inputs (per-layer inputs, donor K/V) runs unfused and compiles nothing."""
    from segctl.engine import attention
    model, parts = _trainable(family)
    monkeypatch.setattr(attention, "own_sinks_vjp", lambda: True)
    ids = mx.random.randint(1, _vocab(model), (7,), key=mx.random.key(0)).tolist()
    ex = Example(ids, 2)
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=2), parts=parts)
    fused = StepMemory(segment_size=2, fused=True)
    for _ in range(2):
        loss, grads = loss_and_grads(model, ex, memory=fused, parts=parts)
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item()), family
        assert _worst(grads, ref) <= TOL, family
    row = mx.array([ids[:-1]])
    if any(d is not None for d in parts.donors) or any(
            x is not None for x in parts.layer_inputs(row, parts.embed(row))):
        assert parts.fused is None, family   # never even counted a shape
    elif parts.fused is not None and parts.fused.refused:   # a trace met an eval inside
        assert "function transformations" in parts.fused.refused, family
        assert not parts.fused.fns


@pytest.mark.parametrize("family", families())
def test_family_runs_rows_unpadded_exactly_or_says_why(family, monkeypatch):
    """Rows side by side without padding (engine/ragged.py) on every family: the
    step over three rows of other lengths, ragged, unfused and fused (the second
    fused step compiled, its tail rounding the tokens up), equals the rows apart
    under plain autodiff; or the engine says in one line why the family cannot."""
    from segctl.engine import attention
    model, parts = _trainable(family)
    why = side_refusal(parts) or ragged_refusal(parts)   # (unpadded is a way of side by side)
    if why is not None:
        assert "\n" not in why, family
        return
    monkeypatch.setattr(attention, "own_sinks_vjp", lambda: True)
    ids = mx.random.randint(1, _vocab(model), (11,), key=mx.random.key(0)).tolist()
    batch = [Example(ids, 2), Example(ids[:5], 1), Example(ids[3:10], 0)]
    loss0, ref = loss_and_grads(model, batch, memory=StepMemory(segment_size=0), parts=parts)
    for fused, align in ((False, 1), (True, 4), (True, 4)):
        metrics: dict = {}
        loss, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=2, fused=fused),
                                     side=True, ragged=True, pack_length=64, align=align,
                                     parts=parts, metrics=metrics)
        assert metrics["sequences"] == 1, family
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item()), (family, fused)
        worst = _worst(grads, ref)
        assert worst <= TOL, (family, "ragged", fused, worst)
