"""DPO in the segmented engine: the loss is DPO's sigmoid formula on summed
response log-probs, the reference is the base model computed with the adapter
switched off (checked against a fresh model without LoRA), two-branch,
prefix-shared and every segment size give plain autodiff's gradients, and the job,
sweep and telemetry vocabulary carries `dpo:`."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

import segctl.engine.head as head
import segctl.engine.plans as plans
import segctl.engine.step as step
from segctl.engine.adapter import adapter_off
from segctl.engine.data import PreferenceExample
from segctl.engine.model import load_model
from segctl.engine.settings import StepMemory
from segctl.engine.step import StepError, eval_loss, loss_and_grads
from segctl.schemas import SpecError
from segctl.schemas.job import JobSpec, load_job
from segctl.schemas.sweep import job_keys, load_sweep
from tests.conftest import assert_one_line_error, random_lora, segctl
from tests.test_orpo import branch_logps, preference
from tests.test_step import TOL, lora_model, random_example, worst_rel_error


def base_sums(folder, ex) -> tuple[float, float]:
    """Chosen and rejected response log p sums of the model without any LoRA."""
    base, _ = load_model(folder)
    return (sum(branch_logps(base, ex.prompt, ex.chosen)),
            sum(branch_logps(base, ex.prompt, ex.rejected)))


def lora_state(model) -> list:
    return [(m.scale, m.dropout.training) for m in model.modules() if hasattr(m, "lora_a")]


# ------------------------------------------------------------------ the loss


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma4_text"])
def test_dpo_value_is_the_formula_on_the_base_models_reference(tiny_models, arch):
    model = lora_model(tiny_models[arch])
    ex = preference(model.args.vocab_size, p=11, c=6, r=8, seed=4)
    lw, lr = (sum(branch_logps(model, ex.prompt, x)) for x in (ex.chosen, ex.rejected))
    lw_ref, lr_ref = base_sums(tiny_models[arch], ex)
    assert abs(lw - lw_ref) > 1e-2 and abs(lr - lr_ref) > 1e-2  # the adapter matters
    beta = 0.3
    rw, rr = beta * (lw - lw_ref), beta * (lr - lr_ref)
    expected = math.log1p(math.exp(-(rw - rr)))
    for seg, shared in ((0, False), (0, True), (2, False), (2, True)):
        metrics: dict = {}
        loss, _ = loss_and_grads(model, ex, method="dpo",
                                 memory=StepMemory(segment_size=seg, head_chunk=4),
                                 prefix_shared=shared, beta=beta, metrics=metrics)
        assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6), (seg, shared)
        # the rewards give back the reference sums: the base model's, adapter removed
        assert lw - metrics["chosen_reward"] / beta == pytest.approx(lw_ref, rel=1e-5)
        assert lr - metrics["rejected_reward"] / beta == pytest.approx(lr_ref, rel=1e-5)
        assert metrics["margin"] == pytest.approx(rw - rr, abs=1e-5)
        assert metrics["accuracy"] == float(rw > rr)
        assert metrics["prefix_shared"] is shared
    for shared in (False, True):
        val, weight = eval_loss(model, ex, method="dpo", beta=beta, head_chunk=3,
                                prefix_shared=shared)
        assert val == pytest.approx(expected, rel=1e-5, abs=1e-6) and weight == 1


# gemma4_text has 6 layers: layers 3 and 5 read layer 1's K/V, layer 4 reads layer
# 2's, so segment sizes 1 and 2 cut between a donor and its sharers.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma4_text"])
def test_dpo_gradients_equal_plain_autodiff(tiny_models, arch):
    model = lora_model(tiny_models[arch])
    # A 20-token prompt runs past llama's and gemma's sliding windows (8 and 16).
    ex = preference(model.args.vocab_size, p=20, c=9, r=7, seed=1)
    loss0, ref = loss_and_grads(model, ex, method="dpo", memory=StepMemory(segment_size=0),
                                beta=0.5)
    assert all(mx.max(mx.abs(g)).item() > 0 for g in ref.values())
    # (segment size, prefix-shared, head chunk, attention block); 0 = plain autodiff
    for seg, shared, chunk, block in ((0, True, 512, 0), (1, False, 512, 0), (1, True, 512, 0),
                                      (2, True, 3, 0), (2, False, 7, 7), (1, True, 512, 7)):
        metrics: dict = {}
        loss, grads = loss_and_grads(model, ex, method="dpo",
                                     memory=StepMemory(segment_size=seg, head_chunk=chunk,
                                                       attn_block=block),
                                     beta=0.5, prefix_shared=shared, metrics=metrics)
        assert metrics["prefix_shared"] is shared
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
        assert worst_rel_error(grads, ref) <= TOL, (arch, seg, shared, chunk, block)
    _, grads = loss_and_grads(model, ex, method="dpo",
                              memory=StepMemory(segment_size=0, grad_checkpoint=True),
                              prefix_shared=True, beta=0.5)
    assert worst_rel_error(grads, ref) <= TOL


def test_the_reference_pass_is_its_own_phase(tiny_models):
    model = lora_model(tiny_models["llama"])
    ex = preference(model.args.vocab_size, seed=3)
    seen: list = []
    loss_and_grads(model, ex, method="dpo", memory=StepMemory(segment_size=2), prefix_shared=False,
                   on_phase=seen.append)
    assert seen == ["ref", "fwd0", "fwd1", "fwd2", "head", "rejected.fwd0", "rejected.fwd1",
                    "rejected.fwd2", "rejected.head", "bwd2", "bwd1", "bwd0",
                    "rejected.bwd2", "rejected.bwd1", "rejected.bwd0"]


# ------------------------------------------------------------------ the adapter switch


def test_adapter_off_is_the_base_model_and_is_restored(tiny_models):
    folder = tiny_models["qwen3"]
    model = lora_model(folder)
    base, _ = load_model(folder)
    ids = mx.array([[(5 * i + 2) % model.args.vocab_size for i in range(13)]])
    adapted = model(ids)
    before = lora_state(model)
    with adapter_off(model):
        assert mx.array_equal(model(ids), base(ids))
    assert lora_state(model) == before and mx.array_equal(model(ids), adapted)
    assert not mx.array_equal(adapted, base(ids))


def test_dora_cannot_be_switched_off_by_its_scale(tiny_models):
    # DoRA rescales its whole output by m / |W + scale * BA|, so scale 0 is not the
    # base layer: refused rather than a wrong reference
    from mlx_lm.tuner.utils import linear_to_lora_layers
    model, _ = load_model(tiny_models["qwen3"])
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 2.0, "dropout": 0.0}, use_dora=True)
    with pytest.raises(StepError, match="DoRA"):
        with adapter_off(model):
            pass


def test_the_switch_is_restored_when_the_step_raises(tiny_models, monkeypatch):
    model = lora_model(tiny_models["qwen3"])
    ex = preference(model.args.vocab_size, seed=5)
    loss0, _ = loss_and_grads(model, ex, method="dpo", memory=StepMemory(segment_size=1))
    before = lora_state(model)
    assert before and all(scale == 2.0 for scale, _ in before)

    def boom(*args):
        raise RuntimeError("head failed")
    with monkeypatch.context() as m:
        m.setattr(head, "logp", boom)   # raises inside the reference pass
        with pytest.raises(RuntimeError, match="head failed"):
            loss_and_grads(model, ex, method="dpo", memory=StepMemory(segment_size=1))
    assert lora_state(model) == before
    loss, _ = loss_and_grads(model, ex, method="dpo", memory=StepMemory(segment_size=1))
    assert loss.item() == loss0.item()


def test_the_reference_pass_leaves_dropout_and_its_random_draws_alone(tiny_models):
    # With LoRA dropout on, the reference pass draws nothing: the generator is where
    # it was, so the step's per-layer dropout seeds are what they would be without
    # it, and segment sizes still agree (each layer runs under its own seed).
    model, _ = load_model(tiny_models["qwen3"])
    mx.random.seed(0)
    random_lora(model, dropout=0.3)
    model.train()
    ex = preference(model.args.vocab_size, seed=6)
    parts = step.model_parts(model, check=False)
    streams, _ = plans._preference_streams(ex, parts, True, False)
    mx.random.seed(11)
    sums = step.reference_sums(model, parts, streams, 512)
    after = mx.random.uniform(shape=(4,))
    mx.random.seed(11)
    assert mx.array_equal(after, mx.random.uniform(shape=(4,)))
    assert all(training for _, training in lora_state(model))
    lw_ref, lr_ref = base_sums(tiny_models["qwen3"], ex)
    assert sums[0].item() == pytest.approx(lw_ref, rel=1e-5)
    assert sums[1].item() == pytest.approx(lr_ref, rel=1e-5)

    results = []
    for seg in (1, 2):
        mx.random.seed(7)
        results.append(loss_and_grads(model, ex, method="dpo", memory=StepMemory(segment_size=seg),
                                      prefix_shared=True))
    (loss1, g1), (loss2, g2) = results
    assert abs(loss1.item() - loss2.item()) <= TOL * abs(loss1.item())
    assert worst_rel_error(g2, g1) <= TOL


def test_unusable_examples_are_step_errors(tiny_models):
    model = lora_model(tiny_models["qwen3"])
    ok = preference(model.args.vocab_size)
    with pytest.raises(StepError, match="empty rejected"):
        loss_and_grads(model, PreferenceExample(ok.prompt, ok.chosen, []), method="dpo",
                       memory=StepMemory(segment_size=1))
    with pytest.raises(StepError, match="method dpo takes a PreferenceExample"):
        loss_and_grads(model, random_example(model.args.vocab_size), method="dpo",
                       memory=StepMemory(segment_size=1))


# ------------------------------------------------------------------ segctl train


@pytest.mark.slow   # 5 s
def test_segctl_trains_a_dpo_job(tmp_path):
    from tests.test_orpo import train_preference_demo
    demo, events = train_preference_demo(tmp_path, "qwen3", "dpo")
    steps = [e for e in events if e["event"] == "step"]
    assert all(s["prefix_shared"] is True and s["accuracy"] in (0.0, 1.0)
               and s["margin"] == pytest.approx(s["chosen_reward"] - s["rejected_reward"],
                                                abs=1e-6)
               for s in steps)
    # LoRA's B starts at zero: the first step's policy is the reference itself
    assert steps[0]["margin"] == pytest.approx(0.0, abs=1e-6)
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    first = sum(s["loss"] for s in steps[:6]) / 6
    last = sum(s["loss"] for s in steps[-6:]) / 6
    assert last < first, (first, last)
    assert sum(s["accuracy"] for s in steps[-6:]) >= 4
    evals = [e for e in events if e["event"] == "eval"]
    assert len(evals) == 2 and all(math.isfinite(e["val_loss"]) for e in evals)
    from mlx_lm import load
    model, _ = load(str(demo / "model"), adapter_path=str(demo / "adapters"))
    assert model is not None


# ------------------------------------------------------------------ job, sweep, telemetry


JOB = """\
model: model
method: dpo
data:
  train: train.jsonl
train:
  iters: 3
dpo:
  beta: 0.25
  prefix_shared: false
"""


def test_dpo_job_reads_beta_and_round_trips_through_its_dump(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    job = load_job(tmp_path / "job.yaml")
    assert (job.method, job.dpo.beta, job.dpo.prefix_shared, job.prefix_shared) == \
        ("dpo", 0.25, False, False)
    dumped = job.model_dump(mode="json")
    assert dumped["dpo"] == {"beta": 0.25, "prefix_shared": False} and "orpo" not in dumped
    assert JobSpec.model_validate(dumped) == job
    plain = JobSpec.model_validate({"method": "dpo", "model": "m", "data": {"train": "t"},
                                    "train": {"iters": 1}})
    assert (plain.dpo.beta, plain.dpo.prefix_shared) == (0.1, True)
    sft = JobSpec.model_validate({"model": "m", "data": {"train": "t"}, "train": {"iters": 1}})
    assert "dpo" not in sft.model_dump() and "dpo" not in sft.model_dump_json()


@pytest.mark.parametrize("old, new, line, message", [
    ("  beta: 0.25", "  beta: -1", 8, "dpo.beta: Input should be greater than 0"),
    ("  beta: 0.25", "  bta: 0.25", 8, "dpo.bta: unknown key; did you mean 'beta'?"),
    ("method: dpo", "method: sft", 7, "dpo: only used with method: dpo"),
    ("method: dpo", "method: orpo", 7, "dpo: only used with method: dpo"),
])
def test_bad_dpo_config_is_a_one_line_error(tmp_path, old, new, line, message):
    path = tmp_path / "job.yaml"
    path.write_text(JOB.replace(old, new))
    with pytest.raises(SpecError) as e:
        load_job(path)
    assert e.value.problems == [f"{path}:{line}: {message}"]


def test_segctl_refuses_bad_dpo_config_with_exit_2(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB.replace("  beta: 0.25", "  beta: -1"))
    assert_one_line_error(segctl("validate", path), f"{path}:8: dpo.beta: Input should be "
                                                    "greater than 0")
    path.write_text(JOB.replace("method: dpo", "method: sft"))
    assert_one_line_error(segctl("train", path), f"{path}:7: dpo: only used with method: dpo")


def test_a_sweep_over_dpo_beta_expands_and_validates(tmp_path, demo_dir):
    assert {"dpo.beta", "dpo.prefix_shared"} <= set(job_keys())
    (tmp_path / "job.yaml").write_text(
        JOB.replace("model: model", f"model: {demo_dir / 'model'}")
           .replace("train: train.jsonl", f"train: {demo_dir / 'data' / 'train.jsonl'}"))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("name: s\nbase: job.yaml\ngrid:\n  dpo.beta: [0.05, 0.5]\n")
    trials = load_sweep(sweep).trials
    assert [t.job.dpo.beta for t in trials] == [0.05, 0.5]
    assert [t.params["dpo.beta"] for t in trials] == [0.05, 0.5]
    assert all(t.job.dpo.prefix_shared is False for t in trials)  # the rest of the section stays
    assert all(JobSpec.model_validate(t.job.model_dump(mode="json")) == t.job for t in trials)

    sweep.write_text("name: s\nbase: job.yaml\ngrid:\n  dpo.beta:\n    - 0.1\n    - 0\n"
                     "  dpo.bta: [1]\n")
    with pytest.raises(SpecError) as e:
        load_sweep(sweep)
    assert e.value.problems == [
        f"{sweep}:6: grid.dpo.beta[1]: Input should be greater than 0",
        f"{sweep}:7: grid.dpo.bta: unknown job key; did you mean 'dpo.beta'?"]


def test_dpo_is_planned_as_orpo_and_tuned_apart():
    from segctl.orchestrator.planner import ModelInfo, method_key, predict_gb
    info = ModelInfo("qwen3", 28, 1024, 3072, 16, 8, 128, 151936, 1_500_000_000, 2)
    for key in ("", "-shared"):
        for seg in (0, 1, 4):
            assert predict_gb(info, seq_len=4096, segment_size=seg, method="dpo" + key) == \
                predict_gb(info, seq_len=4096, segment_size=seg, method="orpo" + key)
    job = JobSpec.model_validate({"method": "dpo", "model": "m", "data": {"train": "t"},
                                  "train": {"iters": 1}})
    assert method_key(job) == "dpo-shared"
    assert method_key(job.model_copy(update={"dpo": job.dpo.model_copy(
        update={"prefix_shared": False})})) == "dpo"


def test_a_tune_probe_runs_dpo_steps(tiny_models):
    # what `segctl tune --method dpo` has a node run: the reference pass is a phase
    # of its own, fitted with the forward phases
    from segctl.engine.measure import run_probes
    from segctl.orchestrator.measured import group_of
    from segctl.schemas.records import ProbeSpec
    seen: list = []
    run_probes(ProbeSpec(model=str(tiny_models["qwen3"]), method="dpo", budget_gb=100.0,
                         points=[(30, 2)], steps=2), seen.append, lambda: 0.0)
    [probe] = seen
    assert probe.fits and probe.steps == 2
    assert [label for label, _ in probe.phases][:2] == ["ref", "fwd0"]
    assert group_of("ref") == "fwd"


def test_step_event_carries_dpo_rewards_into_the_steps_table():
    from segctl.orchestrator.stores import attempt_tables
    from segctl.schemas.events import Step
    figures = dict(time=1.0, step=1, loss=0.7, tokens=12, seconds=0.1, tokens_per_s=120.0,
                   lr=1e-4, grad_norm=0.5, peak_gb=1.0, active_gb=0.5, cache_gb=0.1)
    dpo = Step(**figures, margin=0.3, accuracy=1.0, prefix_shared=True, chosen_reward=0.2,
               rejected_reward=-0.1)
    assert Step.model_validate_json(dpo.model_dump_json()) == dpo
    events = [json.loads(dpo.model_dump_json()), json.loads(Step(**figures).model_dump_json())]
    steps = attempt_tables("t000", 1, events)["steps"].to_pydict()
    assert steps["chosen_reward"] == [0.2, None] and steps["rejected_reward"] == [-0.1, None]
    assert steps["margin"] == [0.3, None]
