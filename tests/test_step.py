"""The segmented step and grad_checkpoint give plain autodiff's loss and gradients."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from segctl.engine import Example, loss_and_grads, plan_segments
from segctl.engine.model import ModelError, load_model, model_parts
from segctl.engine.settings import StepMemory
from segctl.engine.step import StepError
from tests.conftest import random_lora

TOL = 1e-4  # fp32 worst relative error, per tensor: max|a-b| / max|b|


def lora_model(folder, seed=0):
    model, _ = load_model(folder)
    mx.random.seed(seed)
    return random_lora(model)


def random_example(vocab, n=41, prompt_len=13, seed=0):
    ids = mx.random.randint(1, vocab, (n,), key=mx.random.key(seed)).tolist()
    return Example(ids, prompt_len)


def worst_rel_error(grads, ref):
    assert grads.keys() == ref.keys()
    return max((mx.max(mx.abs(grads[k] - ref[k])) / mx.max(mx.abs(ref[k]))).item() for k in ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "minicpm"])
def test_segmented_and_checkpoint_equal_plain(tiny_models, arch):
    model = lora_model(tiny_models[arch])
    vocab = model.args.vocab_size
    names = [n for n, _ in tree_flatten(model.trainable_parameters())]
    for seed, prompt_len in ((0, 13), (1, 0), (2, 39)):
        ex = random_example(vocab, prompt_len=prompt_len, seed=seed)
        loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
        assert list(ref) == names
        assert all(mx.max(mx.abs(g)).item() > 0 for g in ref.values())
        # 5 layers: sizes 1, 2 and 3 (3 does not divide 5), small and large head
        # chunks, and attention backward in blocks of 7 and 16 query rows
        for seg, chunk, block in ((1, 512, 0), (2, 7, 0), (3, 1, 0), (5, 16, 0),
                                  (1, 512, 7), (3, 5, 16)):
            loss, grads = loss_and_grads(model, ex,
                                         memory=StepMemory(segment_size=seg, head_chunk=chunk,
                                                           attn_block=block))
            assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
            assert worst_rel_error(grads, ref) <= TOL, (arch, seg, chunk, block)
        loss, grads = loss_and_grads(model, ex,
                                     memory=StepMemory(segment_size=0, grad_checkpoint=True))
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
        assert worst_rel_error(grads, ref) <= TOL


def test_loss_is_mean_cross_entropy_of_the_response(tiny_models):
    # The contract: mean CE over t in [max(0, prompt_len-1), len-2] predicting ids[t+1],
    # computed here from the model's own full logits.
    model = lora_model(tiny_models["qwen3"])
    ex = random_example(model.args.vocab_size, n=30, prompt_len=9, seed=5)
    logits = model(mx.array([ex.ids[:-1]]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ts = range(ex.prompt_len - 1, len(ex.ids) - 1)
    expected = -sum(logp[t, ex.ids[t + 1]].item() for t in ts) / len(ts)
    for seg in (0, 2):
        loss, _ = loss_and_grads(model, ex, memory=StepMemory(segment_size=seg, head_chunk=4))
        assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_checkpoint_and_blocked_attention_patch_nothing(tiny_models):
    import mlx_lm.models.qwen3 as qwen3
    model = lora_model(tiny_models["qwen3"])
    cls = type(model.layers[0])
    before, sdpa = cls.__call__, qwen3.scaled_dot_product_attention
    ex = random_example(model.args.vocab_size)
    loss_and_grads(model, ex, memory=StepMemory(segment_size=0, grad_checkpoint=True))
    loss_and_grads(model, ex, memory=StepMemory(segment_size=2, attn_block=8))
    assert cls.__call__ is before and qwen3.scaled_dot_product_attention is sdpa


def test_segmented_reports_every_phase(tiny_models):
    model = lora_model(tiny_models["llama"])
    seen = []
    loss_and_grads(model, random_example(model.args.vocab_size), memory=StepMemory(segment_size=2),
                   on_phase=seen.append)
    assert seen == ["fwd0", "fwd1", "fwd2", "head", "bwd2", "bwd1", "bwd0"]


def test_plan_segments():
    assert plan_segments(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert plan_segments(4, 4) == [(0, 4)]
    assert plan_segments(3, 8) == [(0, 3)]
    with pytest.raises(ValueError):
        plan_segments(4, 0)


def test_no_response_tokens_is_an_error_not_nan(tiny_models):
    model = lora_model(tiny_models["qwen3"])
    with pytest.raises(StepError, match="no response tokens"):
        loss_and_grads(model, Example([5, 6, 7], 3), memory=StepMemory(segment_size=1))


def test_model_that_cannot_be_cut_is_refused(tiny_models):
    model, _ = load_model(tiny_models["qwen3"])
    del model.model.norm
    with pytest.raises(ModelError, match="cannot be cut"):
        model_parts(model, name="x")
