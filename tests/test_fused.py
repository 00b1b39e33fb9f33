"""Fused segments (engine/fused.py): a segment's forward, its backward
and the head's chunks run as `mx.compile`d functions where that is exact. Each
check runs the same steps fused and unfused from the same weights, the weights
updated between steps (a compiled function that kept the weights it was traced
with would show there), and the layouts a compiled function cannot follow run
unfused."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from segctl.engine import Example, PreferenceExample, loss_and_grads
from segctl.engine.model import load_model, model_parts
from segctl.engine.settings import StepMemory
from tests.conftest import random_lora
from tests.test_step import lora_model, worst_rel_error

TOL = 1e-5
SHAPES = [(23, 5), (9, 0), (31, 30), (14, 3), (40, 12)]


def rows_of(vocab, shapes, seed=0):
    return [Example(mx.random.randint(1, vocab, (n,), key=mx.random.key(seed + k)).tolist(), p)
            for k, (n, p) in enumerate(shapes)]


def three_steps(model, batch, fused: bool, **kw):
    """[(loss, grads)] of three steps from the model's weights, each followed by a
    plain gradient update; the weights are put back at the end. Returns them and
    the compiled functions the steps kept (parts.fused). A stream's shape runs
    compiled from the second time it comes: steps 2 and 3 here."""
    start = [(n, mx.array(v)) for n, v in tree_flatten(model.trainable_parameters())]
    parts = model_parts(model, check=False)
    memory = StepMemory(segment_size=kw.pop("seg", 2), fused=fused)
    out = []
    for _ in range(3):
        loss, grads = loss_and_grads(model, batch, parts=parts, memory=memory, **kw)
        mx.eval(loss, grads)
        out.append((loss.item(), grads))
        model.update(tree_unflatten([(n, v - 0.5 * grads[n])
                                     for n, v in tree_flatten(model.trainable_parameters())]))
    model.update(tree_unflatten(start))
    return out, parts.fused


def assert_same(a, b):
    for (la, ga), (lb, gb) in zip(a, b):
        assert abs(la - lb) <= TOL * abs(la)
        assert worst_rel_error(gb, ga) <= TOL


@pytest.mark.parametrize("seg", [1, 2])
def test_fused_steps_are_the_unfused_steps_as_the_weights_change(tiny_models, seg):
    model = lora_model(tiny_models["qwen3"])
    batch = rows_of(model.args.vocab_size, SHAPES)
    for kw in (dict(side=True, pack_length=400, align=16), dict()):   # side by side; rows alone
        want, _ = three_steps(model, batch, False, seg=seg, **kw)
        got, compiled = three_steps(model, batch, True, seg=seg, **kw)
        assert_same(want, got)
        segments = -(-len(model.layers) // seg)
        # for each shape, one forward and one backward per segment, and the head
        assert compiled.fns and not compiled.once
        for fns in compiled.fns.values():
            assert sorted(k[0] for k in fns) == ["bwd"] * segments + ["fwd"] * segments + ["head"]
    # the steps moved the weights: the third step's loss is not the first's
    assert abs(got[2][0] - got[0][0]) > 1e-3


def preference_rows(vocab, shapes):
    """PreferenceExamples of (prompt, chosen, rejected) lengths, random tokens."""
    toks = lambda n, seed: mx.random.randint(1, vocab, (n,), key=mx.random.key(seed)).tolist()
    return [PreferenceExample(toks(p, 3 * k + 1), toks(c, 3 * k + 2), toks(r, 3 * k + 3))
            for k, (p, c, r) in enumerate(shapes)]


def test_a_preference_step_in_two_branches_fuses_too(tiny_models):
    model = lora_model(tiny_models["qwen3"])
    batch = preference_rows(model.args.vocab_size, [(7, 5, 6), (12, 3, 8)])
    for method in ("orpo", "dpo"):
        kw = dict(method=method, prefix_shared=False)
        want, _ = three_steps(model, batch, False, **kw)
        got, compiled = three_steps(model, batch, True, **kw)
        assert_same(want, got)
        assert compiled.fns, method


def test_layouts_a_compiled_function_cannot_follow_run_unfused(tiny_models):
    """Packed and prefix-shared streams (their masks and RoPE runs follow the rows'
    lengths), sliding windows cut into blocks, attention blocked by rows, LoRA
    dropout (its masks come from the random state) and Gemma-4's donor K/V run as
    before: nothing is compiled, and the step is still the unfused one."""
    qwen = lora_model(tiny_models["qwen3"])
    batch = rows_of(qwen.args.vocab_size, SHAPES)
    V = qwen.args.vocab_size
    pref = [PreferenceExample([3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13])]
    llama = lora_model(tiny_models["llama"])   # layers with a window of 8
    gemma = lora_model(tiny_models["gemma4_text"])
    mx.random.seed(0)
    dropped = random_lora(load_model(tiny_models["qwen3"])[0], dropout=0.1)
    cases = {
        "packed": (qwen, batch, dict(pack=True, pack_length=400)),
        "prefix-shared": (qwen, pref, dict(method="orpo", prefix_shared=True)),
        "windows": (llama, rows_of(V, [(30, 4)]), {}),
        "attention blocks": (qwen, rows_of(V, [(30, 4)]), dict(block=8)),
        "donor K/V": (gemma, rows_of(gemma.args.vocab_size, [(20, 4)]), {}),
        "dropout": (dropped, rows_of(V, [(20, 4)]), {}),
    }
    for name, (model, rows, kw) in cases.items():
        parts = model_parts(model, check=False)
        block = kw.pop("block", 0)
        mx.random.seed(1)
        loss, grads = loss_and_grads(model, rows, parts=parts, **kw,
                                     memory=StepMemory(segment_size=2, attn_block=block,
                                                       fused=True))
        mx.eval(loss, grads)
        assert parts.fused is None, name
        unfused = model_parts(model, check=False)
        mx.random.seed(1)
        loss0, ref = loss_and_grads(model, rows, parts=unfused, **kw,
                                    memory=StepMemory(segment_size=2, attn_block=block))
        assert loss.item() == loss0.item() and worst_rel_error(grads, ref) == 0.0, name


def test_a_job_fuses_its_segments_on_a_gpu_and_says_so(demo_dir, tmp_path, monkeypatch):
    """What a job runs: fused where the step is segmented on a GPU (the probe that
    says so substituted here), and the start event says it; a CPU, or plain
    autodiff, runs unfused."""
    import json

    from segctl.engine import step, train
    from segctl.schemas.job import load_job
    job = load_job(demo_dir / "job.yaml")

    runs = iter(range(3))

    def start_of(seg):
        j = job.model_copy(update={
            "output": str(tmp_path / f"out{next(runs)}"),
            "train": job.train.model_copy(update={"iters": 1, "batch_size": 2, "eval_every": 0}),
            "memory": job.memory.model_copy(update={"segment_size": seg})})
        events = []
        train.run(j, emit=lambda e: events.append(json.loads(e.model_dump_json())))
        return events[0]

    assert start_of(2)["fused"] is False
    monkeypatch.setattr(step, "on_gpu", lambda: True)
    first = start_of(2)
    assert first["event"] == "start" and first["fused"] is True and first["side_by_side"] is True
    # and its side-by-side rows run unpadded (engine/ragged.py), fused too
    assert first["unpadded"] is True and first["unpadded_reason"] is None
    assert start_of(0)["fused"] is False


def test_a_shape_runs_compiled_from_its_second_time_and_few_shapes_are_kept(tiny_models,
                                                                             monkeypatch):
    """A trace costs about what the segment's run does and stays until its function
    goes: a shape seen once never pays for one, and a model keeps the functions of
    the MAX_SHAPES stream shapes used last."""
    from segctl.engine import fused
    monkeypatch.setattr(fused, "MAX_SHAPES", 2)
    model = lora_model(tiny_models["qwen3"])
    parts = model_parts(model, check=False)
    memory = StepMemory(segment_size=2, fused=True)
    V = model.args.vocab_size

    def step(n):
        loss, grads = loss_and_grads(model, rows_of(V, [(n, 2)]), parts=parts, memory=memory)
        mx.eval(loss, grads)
        return list(parts.fused.fns), sorted(parts.fused.once)

    assert step(10) == ([], [(1, 9)])          # [sequences, length]: the row less its last
    assert step(10) == ([(1, 9)], [])
    assert step(12) == ([(1, 9)], [(1, 11)])
    assert step(12) == ([(1, 9), (1, 11)], [])
    assert step(10) == ([(1, 11), (1, 9)], [])                 # used last: at the end
    assert step(14) == ([(1, 11), (1, 9)], [(1, 13)])
    assert step(14) == ([(1, 9), (1, 13)], [])                 # (1, 11) dropped, its traces too


def test_a_layer_that_evaluates_inside_runs_unfused_from_the_trace_that_meets_it(tiny_models):
    """MLX cannot trace an evaluation (the engine's own attention-sinks backward
    evaluates its tiles, off the CPU): the step goes on unfused from that segment,
    exact, and the model fuses no more."""
    model = lora_model(tiny_models["qwen3"])
    batch = rows_of(model.args.vocab_size, [(20, 4)])
    want, _ = three_steps(model, batch, False)
    mlp = model.model.layers[3].mlp
    call = type(mlp).__call__

    class Evaluating(type(mlp)):
        def __call__(self, x):
            out = call(self, x)
            mx.eval(out)   # allowed in a plain run, refused in a trace
            return out

    mlp.__class__ = Evaluating
    try:
        got, cache = three_steps(model, batch, True)
    finally:
        mlp.__class__ = Evaluating.__bases__[0]
    assert_same(want, got)
    assert "function transformations" in cache.refused and not cache.fns


@pytest.mark.parametrize("clip", [1.0, None])
def test_a_fused_update_is_the_eager_update(tiny_models, tmp_path, clip):
    """The optimizer's update compiled (a fused step's, engine/optim.apply_grads)
    is the eager one, step after step, under a schedule with warmup and weight
    decay, with and without the clip, and across a checkpoint's load (which
    replaces the optimizer's state); the compiled function goes with its
    optimizer."""
    import gc

    from segctl.engine import optim as optim_mod
    from segctl.engine.train import BestSoFar, load_checkpoint, save_checkpoint
    models = [lora_model(tiny_models["qwen3"]) for _ in range(2)]
    opts = [optim_mod.make_optimizer(optim_mod.schedule(1e-2, "cosine", warmup=2, total=6))
            for _ in models]
    batch = rows_of(models[0].args.vocab_size, SHAPES[:2])
    norms = []
    for step in range(1, 6):
        norms.append([])
        for model, opt, fused in zip(models, opts, (False, True)):
            _, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=2))
            norm = optim_mod.apply_grads(model, opt, grads, clip, fused=fused)
            mx.eval(norm, model.trainable_parameters(), opt.state)
            norms[-1].append(norm.item())
            if step == 3:   # to a checkpoint and back: a new state object
                path = save_checkpoint(tmp_path / str(fused), step, model, opt, {}, 0, BestSoFar())
                load_checkpoint(path, model, opt)
        assert norms[-1][0] == norms[-1][1]
        for (n, a), (_, b) in zip(tree_flatten(models[0].trainable_parameters()),
                                  tree_flatten(models[1].trainable_parameters())):
            assert mx.array_equal(a, b), (step, n)
        for (n, a), (_, b) in zip(tree_flatten(opts[0].state), tree_flatten(opts[1].state)):
            assert mx.array_equal(a, b), (step, n)
    assert opts[1].state["step"].item() == 5 and norms[0] != norms[-1]
    assert len(optim_mod._COMPILED) >= 1
    del opts, models, opt, model
    gc.collect()
    assert len(optim_mod._COMPILED) == 0
