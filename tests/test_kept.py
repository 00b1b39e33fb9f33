"""Kept top layers (memory.keep, engine/step.py `_kept`): the top layers' forward
runs once and stays for their backward, the head in between. Each check is
against plain autodiff of the model's own forward of the same rows; where a
plan cannot keep (two branches, layers in pieces) it runs recomputed, as exact."""

from __future__ import annotations

import mlx.core as mx
import pytest

from segctl.engine import PreferenceExample, loss_and_grads
from segctl.engine.model import model_parts
from segctl.engine.settings import StepMemory
from tests.test_batches import SHAPES, TOL, batch_case, one_by_one, rows_of
from tests.test_step import lora_model, worst_rel_error


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma4_text"])
def test_kept_top_layers_give_the_plain_gradient(tiny_models, arch):
    # llama: sliding (window 8) and full layers; gemma4_text: the kept layers read
    # K/V of donors below them (layers 3 and 5 read layer 1's, layer 4 layer 2's)
    model, parts, batch, loss0, ref = batch_case(tiny_models[arch], arch)
    n = len(parts.layers)
    for seg, keep, kw in ((1, 1, {}), (2, 3, dict(pack=True, pack_length=48)),
                          (2, n, dict(side=True, pack_length=100)), (1, n - 1, {}),
                          (2, 2, dict(side=True, ragged=arch != "gemma4_text",
                                      pack_length=100))):
        phases: list[str] = []
        loss, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=seg, keep=keep),
                                     parts=parts, on_phase=phases.append, **kw)
        case = (arch, seg, keep, kw)
        assert abs(loss.item() - loss0) <= TOL * abs(loss0), case
        assert worst_rel_error(grads, ref) <= TOL, case
        # each stream: forward of the segments below the kept layers only, the head
        # inside the kept layers' vjp, then their backward and the segments' below
        below = -(-(n - keep) // seg)
        first = phases[:below + 2]
        assert first == [f"fwd{k}" for k in range(below)] + ["head", f"bwd{below}"], case


def test_preference_plans_keep_where_one_stream_and_recompute_two_branches(tiny_models):
    """ORPO and DPO prefix-shared (one stream) keep their top layers; a row whose
    two prompts differ runs two branches, which need both heads before either's
    gradient is known: recomputed, as exact."""
    model = lora_model(tiny_models["qwen3"])
    parts = model_parts(model, check=False)
    V = model.args.vocab_size

    def toks(n, seed):
        return mx.random.randint(1, V, (n,), key=mx.random.key(seed)).tolist()

    shared = PreferenceExample(toks(7, 1), toks(5, 2), toks(6, 3))
    branches = PreferenceExample(toks(6, 7), toks(4, 8), toks(5, 9), rejected_prompt=toks(5, 10))
    for method in ("orpo", "dpo"):
        for row, kept in ((shared, True), (branches, False)):
            loss0, ref = one_by_one(model, [row], method, prefix_shared=False)
            phases: list[str] = []
            loss, grads = loss_and_grads(model, row, method=method, prefix_shared=True,
                                         memory=StepMemory(segment_size=2, keep=3), parts=parts,
                                         on_phase=phases.append)
            assert abs(loss.item() - loss0) <= TOL * abs(loss0), (method, kept)
            assert worst_rel_error(grads, ref) <= TOL, (method, kept)
            forwards = [p for p in phases if p.startswith(("fwd", "rejected.fwd"))]
            assert len(forwards) == (1 if kept else 2 * 3), (method, phases)


def test_layers_in_pieces_are_not_kept(tiny_models):
    """Attention in blocks and MLPs in chunks hold one piece at a time, which a
    kept layer (all its activations held) would undo: such a stream recomputes."""
    model = lora_model(tiny_models["llama"])
    parts = model_parts(model, check=False)
    batch = rows_of(model.args.vocab_size, SHAPES[:2])
    loss0, ref = one_by_one(model, batch)
    phases: list[str] = []
    loss, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=2, keep=2,
                                                                 attn_block=8, mlp_chunk=7),
                                 parts=parts, on_phase=phases.append)
    assert abs(loss.item() - loss0) <= TOL * abs(loss0)
    assert worst_rel_error(grads, ref) <= TOL
    assert phases[:3] == ["fwd0", "fwd1", "fwd2"]


def test_kept_layers_over_boundaries_on_disk(tiny_models, tmp_path):
    """The segments below the kept layers keep their boundaries on disk; the step's
    seconds on disk are reported and nothing is left in the folder."""
    model = lora_model(tiny_models["llama"])
    parts = model_parts(model, check=False)
    batch = rows_of(model.args.vocab_size, SHAPES[:3])
    loss0, ref = one_by_one(model, batch)
    metrics: dict = {}
    loss, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=1, keep=2,
                                                                 offload=str(tmp_path)),
                                 pack=True, pack_length=100, parts=parts, metrics=metrics)
    assert abs(loss.item() - loss0) <= TOL * abs(loss0)
    assert worst_rel_error(grads, ref) <= TOL
    assert metrics["offload_append_s"] >= 0 and metrics["offload_pop_s"] >= 0
    assert not list(tmp_path.iterdir())


def test_a_kept_head_leaves_no_chunk_logits_behind(tiny_models):
    """Inside the kept layers' vjp every evaluated array keeps its graph: the head's
    chunks, left as they are, would hold every chunk's [chunk, vocab] logits to
    the end of it. Copied out (`detach`), the head holds what it returns."""
    from segctl.engine import head
    from segctl.engine.plans import Stream

    model = lora_model(tiny_models["qwen3"])
    parts = model_parts(model, check=False)
    n, V = 600, model.args.vocab_size
    ids = mx.random.randint(1, V, (n + 1,), key=mx.random.key(5)).tolist()
    stream = Stream(ids[:-1], list(range(n)), ids[1:], mx.ones((n, 1)))
    h = mx.random.normal((1, n, model.args.hidden_size))
    held = {}
    for detach in (False, True):
        def fn(x, detach=detach):
            base = mx.get_active_memory()
            logp, g = head.logp_and_grads(parts, x * 1.0, stream, 16, detach=detach)
            mx.eval(logp, g)
            held[detach] = mx.get_active_memory() - base
            return [(x * g.reshape(x.shape)).sum()]
        mx.vjp(fn, [h], [mx.array(1.0)])
    logits = n * V * 4      # every chunk's fp32 logits, once
    assert held[False] > logits > 4 * held[True], held


FUSED_KEPT = {   # arch -> (segment size, keep, layout): llama's windows fuse unpadded only
    "qwen3": [(1, 2, {}), (2, 5, dict(side=True, pack_length=100)),
              (2, 3, dict(side=True, ragged=True, pack_length=100))],
    "llama": [(1, 5, dict(side=True, ragged=True, pack_length=100))],
}


@pytest.mark.parametrize("arch", sorted(FUSED_KEPT))
def test_fused_kept_layers_run_as_one_compiled_vjp_and_give_the_plain_gradient(tiny_models,
                                                                            arch):
    """Fused, an SFT plan's kept layers run as one compiled vjp of their forward
    and the head (fused.joint): the forward once, inside it. Each stream shape
    runs so from its second time (before, `_kept` runs it); rows alone, side by
    side, unpadded, and every layer kept (no segment below)."""
    model, parts, batch, loss0, ref = batch_case(tiny_models[arch], arch)
    n = len(parts.layers)
    for seg, keep, kw in FUSED_KEPT[arch]:
        fused = model_parts(model, check=False)
        memory = StepMemory(segment_size=seg, keep=keep, fused=True, head_chunk=4)
        for time in range(2):
            phases: list[str] = []
            loss, grads = loss_and_grads(model, batch, memory=memory, parts=fused,
                                         on_phase=phases.append, **kw)
            case = (arch, seg, keep, kw, time)
            assert abs(loss.item() - loss0) <= TOL * abs(loss0), case
            assert worst_rel_error(grads, ref) <= TOL, case
            below = -(-(n - keep) // seg)
            # the second time: no head of its own, the kept layers' one vjp instead
            head = [] if time else ["head"]
            assert phases[:below + 2 - time] == [f"fwd{k}" for k in range(below)] + head \
                + [f"bwd{below}"], case
        joints = [k for fns in fused.fused.fns.values() for k in fns if k[0] == "joint"]
        assert joints and all(k[1:3] == (n - keep, n) for k in joints), case
