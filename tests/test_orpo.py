"""ORPO in the segmented engine: the loss is ENGINE.md's formula, and two-branch,
prefix-shared, grad_checkpoint and every segment size give plain autodiff's
gradients, on llama (sliding window 8), qwen3 and gemma4_text (K/V sharing)."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

from segctl.engine.data import PreferenceExample
from segctl.engine.settings import StepMemory
from segctl.engine.step import StepError, eval_loss, loss_and_grads
from tests.conftest import edit_job, segctl
from tests.test_step import lora_model, random_example, worst_rel_error

TOL = 1e-4  # fp32 worst relative error per tensor, as in test_step


def preference(vocab, p=20, c=9, r=7, seed=0):
    ids = lambda n, s: mx.random.randint(1, vocab, (n,), key=mx.random.key(s)).tolist()
    return PreferenceExample(ids(p, seed), ids(c, seed + 1), ids(r, seed + 2))


def branch_logps(model, prompt, response) -> list[float]:
    """log p of each response token, from the model's own full forward."""
    seq = prompt + response
    logits = model(mx.array([seq[:-1]]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [logp[t, seq[t + 1]].item() for t in range(len(prompt) - 1, len(seq) - 1)]


@pytest.mark.parametrize("scope", ["response", "full"])
def test_orpo_value_is_the_hand_computed_formula(tiny_models, scope):
    model = lora_model(tiny_models["qwen3"])
    ex = preference(model.args.vocab_size, p=11, c=6, r=8, seed=4)
    lc, lr_ = branch_logps(model, ex.prompt, ex.chosen), branch_logps(model, ex.prompt, ex.rejected)
    lw, lr = sum(lc) / len(lc), sum(lr_) / len(lr_)
    log1mexp = lambda x: math.log(max(1 - math.exp(x), 1e-7))
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
    if scope == "full":
        full = branch_logps(model, ex.prompt[:1], ex.prompt[1:] + ex.chosen)
        nll = -sum(full) / len(full)
    else:
        nll = -lw
    lam = 0.3
    expected = nll + lam * math.log1p(math.exp(-log_odds))
    for seg, shared in ((0, False), (0, True), (2, False), (2, True)):
        metrics: dict = {}
        loss, _ = loss_and_grads(model, ex, method="orpo",
                                 memory=StepMemory(segment_size=seg, head_chunk=4),
                                 prefix_shared=shared, lambda_=lam, nll_scope=scope,
                                 metrics=metrics)
        assert loss.item() == pytest.approx(expected, rel=1e-5)
        assert metrics["margin"] == pytest.approx(lw - lr, abs=1e-5)
        assert metrics["accuracy"] == float(lw > lr)
        assert metrics["prefix_shared"] is shared
    val, weight = eval_loss(model, ex, method="orpo", lambda_=lam, nll_scope=scope, head_chunk=3)
    assert val == pytest.approx(expected, rel=1e-5) and weight == 1


# gemma4_text has 6 layers: layers 3 and 5 read layer 1's K/V, layer 4 reads layer
# 2's, so segment sizes 1, 2 and 3 all cut between a donor and its sharers.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma4_text"])
@pytest.mark.parametrize("scope", ["response", "full"])
def test_orpo_gradients_equal_plain_autodiff(tiny_models, arch, scope):
    model = lora_model(tiny_models[arch])
    # A 20-token prompt runs past llama's and gemma's sliding windows (8 and 16).
    ex = preference(model.args.vocab_size, p=20, c=9, r=7, seed=1)
    loss0, ref = loss_and_grads(model, ex, method="orpo", memory=StepMemory(segment_size=0),
                                nll_scope=scope)
    assert all(mx.max(mx.abs(g)).item() > 0 for g in ref.values())
    # (segment size, prefix-shared, head chunk, attention block); 0 = plain autodiff
    for seg, shared, chunk, block in ((0, True, 512, 0), (1, False, 512, 0), (1, True, 512, 0),
                                      (2, True, 3, 0), (2, False, 7, 7), (3, True, 5, 7),
                                      (1, True, 512, 7), (len(model.layers), True, 4, 0)):
        metrics: dict = {}
        loss, grads = loss_and_grads(model, ex, method="orpo",
                                     memory=StepMemory(segment_size=seg, head_chunk=chunk,
                                                       attn_block=block),
                                     prefix_shared=shared, nll_scope=scope, metrics=metrics)
        assert metrics["prefix_shared"] is shared
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
        assert worst_rel_error(grads, ref) <= TOL, (arch, seg, shared, chunk, block)
    loss, grads = loss_and_grads(model, ex, method="orpo",
                                 memory=StepMemory(segment_size=0, grad_checkpoint=True),
                                 prefix_shared=True, nll_scope=scope)
    assert worst_rel_error(grads, ref) <= TOL


def test_gemma4_sft_gradients_equal_plain_autodiff(tiny_models):
    model = lora_model(tiny_models["gemma4_text"])
    for seed, prompt_len in ((0, 13), (1, 0)):
        ex = random_example(model.args.vocab_size, n=41, prompt_len=prompt_len, seed=seed)
        loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
        for seg, chunk, block in ((1, 512, 0), (2, 7, 0), (3, 1, 0), (4, 16, 0), (6, 512, 0),
                                  (1, 512, 7), (3, 5, 16)):
            loss, grads = loss_and_grads(model, ex,
                                         memory=StepMemory(segment_size=seg, head_chunk=chunk,
                                                           attn_block=block))
            assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
            assert worst_rel_error(grads, ref) <= TOL, (seg, chunk, block)
        _, grads = loss_and_grads(model, ex,
                                  memory=StepMemory(segment_size=0, grad_checkpoint=True))
        assert worst_rel_error(grads, ref) <= TOL


@pytest.mark.parametrize("method", ["orpo", "dpo"])
def test_rows_whose_prompts_differ_run_two_branch(tiny_models, method):
    model = lora_model(tiny_models["qwen3"])
    ex = preference(model.args.vocab_size, seed=2)
    other = PreferenceExample(ex.prompt, ex.chosen, ex.rejected,
                              rejected_prompt=ex.prompt[:-3] + [5, 6])
    _, ref = loss_and_grads(model, other, method=method, memory=StepMemory(segment_size=0))
    metrics: dict = {}
    _, grads = loss_and_grads(model, other, method=method, memory=StepMemory(segment_size=2),
                              prefix_shared=True, metrics=metrics)
    assert metrics["prefix_shared"] is False
    assert worst_rel_error(grads, ref) <= TOL


@pytest.mark.slow   # 4 s
def test_prefix_shared_peak_is_below_two_branch(tmp_path):
    # A long prompt and short responses: two-branch keeps two sets of boundaries
    # (and runs the prompt twice); prefix-shared one set over P + 2R tokens.
    from segctl.engine.demo import demo_examples, write_model
    corpus = [f"{r['prompt']} {r['completion']}" for r in demo_examples(50, 1)]
    model = lora_model(write_model(tmp_path / "m", "qwen3", corpus=corpus, seed=1, layers=12,
                                   hidden=128))
    ex = preference(model.args.vocab_size, p=500, c=16, r=16, seed=3)
    peaks = {}
    for seg, block in ((0, 0), (1, 64)):
        for shared in (False, True):
            mx.clear_cache()
            mx.reset_peak_memory()
            loss, grads = loss_and_grads(model, ex, method="orpo",
                                         memory=StepMemory(segment_size=seg, attn_block=block),
                                         prefix_shared=shared)
            mx.eval(loss, grads)
            del loss, grads
            peaks[seg, shared] = mx.get_peak_memory() / 1e9
    print("peaks GB", peaks)
    assert peaks[0, True] < peaks[0, False]
    assert peaks[1, True] < peaks[1, False]


def test_unusable_preference_examples_are_step_errors(tiny_models):
    model = lora_model(tiny_models["qwen3"])
    ok = preference(model.args.vocab_size)
    for bad, what in ((PreferenceExample([], ok.chosen, ok.rejected), "empty prompt"),
                      (PreferenceExample(ok.prompt, [], ok.rejected), "empty chosen"),
                      (PreferenceExample(ok.prompt, ok.chosen, []), "empty rejected")):
        with pytest.raises(StepError, match=what):
            loss_and_grads(model, bad, method="orpo", memory=StepMemory(segment_size=1))
    with pytest.raises(StepError, match="PreferenceExample"):
        loss_and_grads(model, random_example(model.args.vocab_size), method="orpo",
                       memory=StepMemory(segment_size=1))


def train_preference_demo(tmp_path, arch: str, method: str) -> list[dict]:
    """`segctl init-demo --method METHOD` then 24 steps of `segctl train` at segment
    size 2 (24 step events); returns (the demo folder, the events)."""
    demo = tmp_path / "demo"
    proc = segctl("init-demo", demo, "--arch", arch, "--method", method)
    assert proc.returncode == 0, proc.stderr
    edit_job(demo / "job.yaml", train={"iters": 24, "eval_every": 12, "checkpoint_every": 0,
                                       "warmup": 2, "learning_rate": 1e-3},
             memory={"segment_size": 2})
    proc = segctl("train", demo / "job.yaml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 24
    return demo, events


@pytest.mark.slow   # 7 s
@pytest.mark.parametrize("arch", ["qwen3", "gemma4_text"])
def test_segctl_trains_the_orpo_demo(tmp_path, arch):
    demo, events = train_preference_demo(tmp_path, arch, "orpo")
    steps = [e for e in events if e["event"] == "step"]
    assert all(s["prefix_shared"] is True and s["margin"] is not None
               and s["accuracy"] in (0.0, 1.0) for s in steps)
    first = sum(s["loss"] for s in steps[:6]) / 6
    last = sum(s["loss"] for s in steps[-6:]) / 6
    assert last < first, (first, last)
    evals = [e for e in events if e["event"] == "eval"]
    assert len(evals) == 2 and all(math.isfinite(e["val_loss"]) for e in evals)

    from mlx_lm import load
    model, _ = load(str(demo / "model"), adapter_path=str(demo / "adapters"))
    assert model is not None
