"""Batches, gradient accumulation and exact packing: a step over several rows is
the mean of their losses (token-weighted for SFT), and its gradient that of the
whole batch, whether its rows run apart, packed into sequences, or in
micro-batches; each checked against plain autodiff of the rows one by one."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from segctl.engine import Example, PreferenceExample, loss_and_grads
from segctl.engine.attention import BlockMask
from segctl.engine.model import model_parts
from segctl.engine.plans import RowPlan, Stream, first_fit, make_plans, side_groups
from segctl.engine.settings import StepMemory
from segctl.engine.step import pack_refusal, side_refusal, supervised_tokens
from tests.conftest import assert_one_line_error, edit_job, segctl
from tests.test_step import lora_model, worst_rel_error

TOL = 1e-4


def rows_of(vocab, shapes, seed=0):
    """Examples of (length, prompt_len)."""
    return [Example(mx.random.randint(1, vocab, (n,), key=mx.random.key(seed + k)).tolist(), p)
            for k, (n, p) in enumerate(shapes)]


def one_by_one(model, batch, method="sft", **kw):
    """The batch's loss and gradients from plain autodiff of each row alone: the
    rows' losses weighted by supervised tokens (SFT) or equally (ORPO, DPO)."""
    weights = [supervised_tokens(ex) if method == "sft" else 1 for ex in batch]
    total = sum(weights)
    loss, grads = 0.0, {}
    for ex, w in zip(batch, weights):
        l, g = loss_and_grads(model, ex, method=method, memory=StepMemory(segment_size=0), **kw)
        loss += l.item() * w / total
        for k, v in g.items():
            grads[k] = grads[k] + v * (w / total) if k in grads else v * (w / total)
    return loss, grads


SHAPES = [(23, 5), (9, 0), (31, 30), (14, 3), (40, 12)]


def batch_case(folder, arch):
    """(model, parts, the SHAPES rows, their plain loss, their plain gradients) of
    a tiny model; gemma4_text in float64 (its fp32 rounding alone is ~1e-4)."""
    model = lora_model(folder)
    if arch == "gemma4_text":
        model.set_dtype(mx.float64)
    batch = rows_of(model.args.vocab_size, SHAPES)
    return (model, model_parts(model, check=False), batch, *one_by_one(model, batch))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma4_text"])
def test_a_batch_packed_or_apart_is_the_rows_one_by_one(tiny_models, arch):
    # llama's tiny model mixes sliding (window 8) and full layers; gemma4_text has
    # K/V donors read across segments.
    model, parts, batch, loss0, ref = batch_case(tiny_models[arch], arch)
    assert pack_refusal(parts) is None
    assert side_refusal(parts) is None
    for seg, pack, side, block, micro in ((0, True, False, 0, 0), (1, True, False, 0, 0),
                                          (2, True, False, 8, 0), (1, False, False, 8, 0),
                                          (2, True, False, 8, 2), (0, False, False, 0, 3),
                                          (0, False, True, 0, 0), (1, False, True, 0, 0),
                                          (2, False, True, 8, 0), (2, False, True, 8, 3)):
        metrics: dict = {}
        loss, grads = loss_and_grads(model, batch,
                                     memory=StepMemory(segment_size=seg, attn_block=block,
                                                       mlp_chunk=7 if block else 0),
                                     pack=pack, side=side, pack_length=48 if pack else 100,
                                     micro=micro, parts=parts, metrics=metrics)
        case = (arch, seg, pack, side, block, micro)
        assert abs(loss.item() - loss0) <= TOL * abs(loss0), case
        assert worst_rel_error(grads, ref) <= TOL, case
        assert metrics["rows"] == 5
        assert metrics["tokens"] == sum(n - 1 for n, _ in SHAPES)
        if pack and not micro:
            assert metrics["sequences"] == 3     # 40+9 over 48 apart: [40] [31,14] [23,9]
        elif not pack:
            assert metrics["sequences"] == 5
        if side:  # [40, 31] [23, 14, 9] side by side (2 x 39, 3 x 22 <= 100 tokens); by
            # micro-batches of 3: [31, 23, 9] [40, 14]
            assert metrics["padded"] == (2 * 39 + 3 * 22 if not micro else 3 * 30 + 2 * 39), case


def test_preference_rows_pack_as_whole_blocks(tiny_models):
    """ORPO and DPO: a row's [prompt | chosen | rejected] block packs as one unit;
    a row whose two prompts differ runs as two branches beside the packed ones.
    The step's loss is the mean of the rows' losses."""
    model = lora_model(tiny_models["llama"])
    parts = model_parts(model, check=False)
    V = model.args.vocab_size

    def toks(n, seed):
        return mx.random.randint(1, V, (n,), key=mx.random.key(seed)).tolist()

    batch = [PreferenceExample(toks(7, 1), toks(5, 2), toks(6, 3)),
             PreferenceExample(toks(4, 4), toks(9, 5), toks(3, 6)),
             PreferenceExample(toks(6, 7), toks(4, 8), toks(5, 9), rejected_prompt=toks(5, 10)),
             PreferenceExample(toks(12, 11), toks(3, 12), toks(8, 13))]
    for method in ("orpo", "dpo"):
        loss0, ref = one_by_one(model, batch, method, prefix_shared=False)
        for seg in (0, 1, 2):
            metrics: dict = {}
            loss, grads = loss_and_grads(model, batch, method=method,
                                         memory=StepMemory(segment_size=seg,
                                                           attn_block=4 if seg == 2 else 0),
                                         pack=True, pack_length=64, prefix_shared=True,
                                         parts=parts, metrics=metrics)
            assert abs(loss.item() - loss0) <= TOL * abs(loss0), (method, seg)
            assert worst_rel_error(grads, ref) <= TOL, (method, seg)
            # three shared rows in one sequence; the fourth's two branches apart
            assert metrics["sequences"] == 3 and metrics["rows"] == 4
            assert metrics["prefix_shared"] is False   # not every row ran shared
            # two branches each (their sequences 11+12, 12+6, 9+9, 14+19 tokens), side
            # by side: all eight in one [8, 19] pass, or within 30 tokens the last
            # row's branches one after the other and each other row's as [2, longest]
            for pack_length, padded in ((200, 8 * 19), (30, 14 + 19 + 2 * 12 + 2 * 12 + 2 * 9)):
                metrics = {}
                loss, grads = loss_and_grads(model, batch, method=method,
                                             memory=StepMemory(segment_size=seg,
                                                               attn_block=4 if seg == 2 else 0),
                                             side=True, pack_length=pack_length, parts=parts,
                                             metrics=metrics)
                assert abs(loss.item() - loss0) <= TOL * abs(loss0), (method, seg, pack_length)
                assert worst_rel_error(grads, ref) <= TOL, (method, seg, pack_length)
                assert metrics["sequences"] == 8 and metrics["padded"] == padded


def test_packed_attention_touches_only_each_rows_own_keys():
    """A packed mask's calls never span two rows, so its attention costs each
    row's own keys (linear in the pack length), and its array form is the
    block-diagonal of the rows' own masks."""
    units = ((0, 5, 0, None), (5, 12, 3, 9), (12, 20, 0, None))
    for window, rows in ((None, None), (3, None), (None, 2)):
        mask = BlockMask(window=window, rows=rows, units=units)
        covered = mx.zeros((20, 20), dtype=mx.bool_)
        for a, b, ranges, m in mask.parts(0, 20):
            unit = next(u for u in units if u[0] <= a < u[1])
            assert b <= unit[1] and all(unit[0] <= lo < hi <= unit[1] for lo, hi in ranges)
            keys = mx.concatenate([mx.arange(lo, hi) for lo, hi in ranges])
            n = keys.shape[0]
            if isinstance(m, str):   # lower-right aligned causal
                m = mx.arange(n)[None, :] <= mx.arange(b - a)[:, None] + n - (b - a)
            sub = mx.zeros((b - a, 20), dtype=mx.bool_)
            sub[:, keys] = m
            covered[a:b] = sub
        assert mx.array_equal(covered, mask.array(20)).item(), (window, rows)
        for start, end, prompt, split in units:
            own = BlockMask(prompt, split, window).array(end - start)
            assert mx.array_equal(mask.array(20)[start:end, start:end], own).item()
            assert not mask.array(20)[start:end, :start].any().item()


def test_first_fit_packs_longest_first_into_as_few_bins():
    assert first_fit([3, 9, 4, 6, 2, 7], lambda n: n, 10) == [[9], [7, 3], [6, 4], [2]]
    assert first_fit([12, 3], lambda n: n, 10) == [[12], [3]]   # too long: a bin of its own
    assert first_fit([], lambda n: n, 10) == []


def test_micro_batches_pack_apart_and_every_plan_divides_by_the_whole_step(tiny_models):
    model = lora_model(tiny_models["qwen3"])
    parts = model_parts(model, check=False)
    batch = rows_of(model.args.vocab_size, [(8, 0)] * 4)
    whole = make_plans(batch, "sft", parts, pack=True, pack_length=64)
    micro = make_plans(batch, "sft", parts, pack=True, pack_length=64, micro=2)
    assert [p.rows for p in whole] == [4] and [p.rows for p in micro] == [2, 2]
    assert sum(p.weight for p in micro) == supervised_tokens(batch) == 28


# ---------------------------------------------------------------- the job

def _events(proc) -> list[dict]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_train_runs_batches_packed_and_says_so(demo_dir, tmp_path):
    from tests.test_train_cli import copy_demo
    job = copy_demo(demo_dir, tmp_path)
    edit_job(job, train={"iters": 2, "batch_size": 3, "grad_accumulation": 2, "eval_every": 0,
                         "checkpoint_every": 0},
             data={"pack": "auto"})
    events = _events(segctl("train", job, "--json"))
    start = events[0]
    assert start["packed"] is True and start["pack_reason"] is None
    assert (start["batch_size"], start["grad_accumulation"]) == (3, 2)
    steps = [e for e in events if e["event"] == "step"]
    assert [s["rows"] for s in steps] == [6, 6]
    assert all(s["sequences"] <= 2 and 0 < s["pack_efficiency"] <= 1 for s in steps)
    assert all(s["seq_tokens"] > s["tokens"] for s in steps)


def test_epochs_count_steps_of_a_batch(demo_dir, tmp_path):
    from tests.test_train_cli import copy_demo
    job = copy_demo(demo_dir, tmp_path)
    rows = sum(1 for _ in open(demo_dir / "data" / "train.jsonl"))
    edit_job(job, train={"iters": None, "epochs": 1, "batch_size": 64, "grad_accumulation": 2,
                         "eval_every": 0, "checkpoint_every": 0})
    events = _events(segctl("train", job, "--json"))
    assert events[0]["total_steps"] == -(-rows // 128)


def test_accumulation_is_the_gradient_of_the_whole_batch(demo_dir, tmp_path):
    """batch_size 2 x grad_accumulation 2 and batch_size 4 take the same steps,
    packed or not: the same losses and gradient norms, step after step."""
    from tests.test_train_cli import copy_demo
    seen = {}
    for name, batch, accum, pack in (("a", 4, 1, True), ("b", 2, 2, True), ("c", 1, 4, False)):
        (tmp_path / name).mkdir()
        job = copy_demo(demo_dir, tmp_path / name)
        edit_job(job, train={"iters": 3, "batch_size": batch, "grad_accumulation": accum,
                             "warmup": 0, "eval_every": 0, "checkpoint_every": 0},
                 data={"pack": pack})
        seen[name] = [(e["loss"], e["grad_norm"], e["tokens"])
                      for e in _events(segctl("train", job, "--json")) if e["event"] == "step"]
    for other in ("b", "c"):
        for (l0, g0, t0), (l, g, t) in zip(seen["a"], seen[other]):
            assert t == t0 and abs(l - l0) <= 1e-5 * l0 and abs(g - g0) <= 1e-4 * g0, other


def test_auto_leaves_rows_apart_with_dropout_and_says_why(demo_dir, tmp_path):
    from tests.test_train_cli import copy_demo
    job = copy_demo(demo_dir, tmp_path)
    edit_job(job, train={"iters": 1, "batch_size": 2, "eval_every": 0, "checkpoint_every": 0},
             lora={"dropout": 0.1})
    events = _events(segctl("train", job, "--json"))
    assert events[0]["packed"] is False and "dropout" in events[0]["pack_reason"]
    assert [e["sequences"] for e in events if e["event"] == "step"] == [2]


@pytest.mark.parametrize("train,data,lora,words", [
    ({"batch_size": 0}, {}, {}, ("train.batch_size", "greater than or equal to 1")),
    ({"grad_accumulation": 5000}, {}, {}, ("train.grad_accumulation", "less than or equal to 4096")),
    ({}, {"pack_length": 100}, {}, ("pack_length 100 is shorter than a row may be",
                                    "max_seq_length 256")),
    ({}, {"pack": True}, {"dropout": 0.1}, ("data.pack: true needs lora.dropout 0",)),
])
def test_bad_batch_settings_are_one_line_at_validate(demo_dir, tmp_path, train, data, lora, words):
    from tests.test_train_cli import copy_demo
    job = copy_demo(demo_dir, tmp_path)
    edit_job(job, train=train, data=data, lora=lora)
    assert_one_line_error(segctl("validate", job), *words)
    assert not (tmp_path / "out").exists()


def test_a_tune_probe_runs_the_jobs_rows_as_the_job_would_on_this_device(tiny_models,
                                                                           monkeypatch):
    """`segctl tune --job` of a job whose batch goes together has its probes run
    that many rows, each point's length in all, as the job's training would on the
    node: packed on a CPU under pack auto, side by side and unpadded on a GPU or
    under pack false; with LoRA dropout, one row."""
    from segctl.engine import step as step_module
    from segctl.engine.measure import row_layout, run_probes
    from segctl.engine.model import apply_lora, load_model, model_parts
    from segctl.orchestrator.tune import pack_rows
    from segctl.schemas.job import JobSpec
    from segctl.schemas.records import ProbeSpec
    job = dict(model="m", data={"train": "t"}, train={"iters": 1, "batch_size": 4})
    assert pack_rows(JobSpec.model_validate(job)) == 4
    assert pack_rows(JobSpec.model_validate({**job, "data": {"train": "t", "pack": False}})) == 4
    assert pack_rows(JobSpec.model_validate({**job, "lora": {"dropout": 0.1}})) == 1
    assert pack_rows(JobSpec.model_validate({**job, "train": {"iters": 1}})) == 1

    folder = str(tiny_models["qwen3"])
    model, _ = load_model(folder)
    apply_lora(model, rank=4, scale=10.0, dropout=0.0, num_layers=-1, keys=None)
    parts = model_parts(model, check=False)
    spec = ProbeSpec(model=folder, budget_gb=100.0, points=[(48, 2)], steps=2, pack_rows=4)
    both = dict(side=True, ragged=True)   # a preference row's branches side by side
    assert row_layout(spec, parts) == dict(pack=True, **both)
    assert row_layout(spec.model_copy(update={"pack": False}), parts) == dict(pack=False, **both)
    assert row_layout(spec.model_copy(update={"pack_rows": 1}), parts) == {}
    dropout = spec.model_copy(update={"lora": spec.lora.model_copy(update={"dropout": 0.1})})
    assert row_layout(dropout, parts) == {}
    with monkeypatch.context() as m:
        m.setattr(step_module, "on_gpu", lambda: True)
        assert row_layout(spec, parts) == dict(pack=False, **both)

    for method, pack in (("sft", "auto"), ("orpo", "auto"), ("sft", False)):
        seen: list = []
        run_probes(spec.model_copy(update={"method": method, "pack": pack}), seen.append,
                   lambda: 0.0)
        [probe] = seen
        assert probe.fits and probe.steps == 2, probe.message
        assert sum(label.startswith("bwd") for label, _ in probe.phases) == 3   # 5 layers, segments of 2


def test_resume_goes_on_with_the_batch_it_was_made_with(demo_dir, tmp_path):
    """A checkpoint records its rows a step: the same batch resumes where it was,
    another is one line (its steps would not be this job's), nothing written."""
    from tests.test_train_cli import copy_demo
    job = copy_demo(demo_dir, tmp_path)
    edit_job(job, train={"iters": 3, "batch_size": 2, "eval_every": 0, "checkpoint_every": 1})
    _events(segctl("train", job, "--json"))
    ckpts = sorted((tmp_path / "out" / "checkpoints").glob("step-*"))
    state = json.loads((ckpts[-1] / "state.json").read_text())
    assert (state["step"], state["data_position"], state["rows_per_step"]) == (2, 4, 2)
    before = sorted(p.name for p in (tmp_path / "out").rglob("*"))
    edit_job(job, train={"iters": 4, "grad_accumulation": 2})
    err = assert_one_line_error(segctl("train", job, "--resume"), "checkpoint of 2 row(s) a step",
                                "the job trains 4")
    assert "step-0000002" in err
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == before
    edit_job(job, train={"grad_accumulation": 1})
    events = _events(segctl("train", job, "--resume", "--json"))
    assert events[0]["resumed_from"] == 2 and [e["step"] for e in events
                                               if e["event"] == "step"] == [3, 4]


def test_side_groups_weigh_padding_against_passes():
    """Rows side by side are cut where the padding a longer group would carry costs
    more than one more pass; never past the capacity."""
    def row(n):
        return RowPlan([Stream(list(range(n)), [0], [1], mx.ones((1, 1)))], lambda s, r: s, 1)

    rows = [row(n) for n in (20, 100, 17, 95, 18)]
    lengths = lambda groups: [[len(r.streams[0].ids) for r in g] for g in groups]
    assert lengths(side_groups(rows, 1000, pass_tokens=50)) == [[100, 95], [20, 18, 17]]
    assert lengths(side_groups(rows, 1000, pass_tokens=0)) == [[100], [95], [20], [18], [17]]
    assert lengths(side_groups(rows, 1000, pass_tokens=10_000)) == [[100, 95, 20, 18, 17]]
    assert lengths(side_groups(rows, 250, pass_tokens=10_000)) == [[100, 95], [20, 18, 17]]
    assert lengths(side_groups(rows, 0)) == [[100], [95], [20], [18], [17]]
    # aligned to 32, 100 and 95 both take 128: [2, 128] is over 200 tokens
    assert lengths(side_groups(rows, 200, align=32, pass_tokens=50)) == [[100], [95], [20, 18, 17]]


def test_rows_side_by_side_padded_past_their_longest_are_still_exact(tiny_models):
    """A GPU pads a side-by-side batch to a multiple of 32 (side_align): the padding
    past the longest row is as invisible as the rest."""
    model = lora_model(tiny_models["qwen3"])
    parts = model_parts(model, check=False)
    batch = rows_of(model.args.vocab_size, SHAPES)
    loss0, ref = one_by_one(model, batch)
    for seg in (0, 2):
        metrics: dict = {}
        loss, grads = loss_and_grads(model, batch, memory=StepMemory(segment_size=seg), side=True,
                                     pack_length=400, align=16, parts=parts, metrics=metrics)
        assert abs(loss.item() - loss0) <= TOL * abs(loss0), seg
        assert worst_rel_error(grads, ref) <= TOL, seg
        assert metrics["padded"] == 5 * 48   # the longest, 39 tokens, padded to 48


def test_auto_runs_rows_side_by_side_on_a_gpu_and_packs_on_a_cpu(tiny_models, monkeypatch):
    from segctl.engine import step, train
    from segctl.schemas.job import JobSpec
    model = lora_model(tiny_models["qwen3"])
    parts = model_parts(model, check=False)
    job = JobSpec(model="m", data={"train": "t.jsonl"}, train={"iters": 1, "batch_size": 4})
    assert train.packing(job, parts) == (True, None) and step.side_align() == 1
    monkeypatch.setattr(step, "on_gpu", lambda: True)
    pack, why = train.packing(job, parts)
    assert not pack and "side by side" in why and train.side_by_side(job, parts)
    assert step.side_align() == 32
    # asked for, packing is what runs; with dropout nothing runs side by side
    forced = JobSpec(model="m", data={"train": "t.jsonl", "pack": True},
                     train={"iters": 1, "batch_size": 4})
    assert train.packing(forced, parts) == (True, None)
    drop = JobSpec(model="m", data={"train": "t.jsonl"}, train={"iters": 1, "batch_size": 4},
                   lora={"dropout": 0.1})
    assert not train.packing(drop, parts)[0] and not train.side_by_side(drop, parts)
