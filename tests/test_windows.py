"""Sliding-window layers in the segmented step: their masks are BlockMasks whose
attention touches only the keys inside the window, in the forward and in the
blocked backward, and the step still gives plain autodiff's loss and gradients.

The models are mlx-lm's own families built from their ModelArgs at a tiny shape
with a window of 8 tokens: gemma4_text (sliding and full layers, K/V sharing),
olmo3, gemma3_text, and gpt_oss (attention sinks)."""

from __future__ import annotations

import importlib
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_attention_mask

from segctl.engine import Example, loss_and_grads
from segctl.engine.attention import BlockMask, attend, blocked_grads, default_rows
from segctl.engine.data import PreferenceExample
from segctl.engine.model import model_parts
from segctl.engine.settings import StepMemory
from segctl.engine.step import eval_loss
from tests.conftest import WIDE, random_lora, step_kw
from tests.test_step import TOL, worst_rel_error

W = 8
PAIR = ["sliding_attention", "full_attention"]

# Each family at a tiny shape, sliding and full layers mixed.
FAMILIES = {
    "gemma4_text": dict(
        num_key_value_heads=1, global_head_dim=32, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128, num_kv_shared_layers=3, layer_types=PAIR * 3,
        sliding_window_pattern=2, final_logit_softcapping=30.0, tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                               "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 1e4,
                                  "rope_type": "default"}}),
    "olmo3": dict(layer_types=["sliding_attention"] * 2 + ["full_attention"] * 1 +
                  ["sliding_attention"] * 3),
    "gemma3_text": dict(sliding_window_pattern=3, query_pre_attn_scalar=16.0),
    # Every expert on for every token: no top-k choice to flip on rounding.
    "gpt_oss": dict(layer_types=PAIR * 3, num_local_experts=2, num_experts_per_tok=2),
}


def tiny(name: str, **extra):
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    cfg = dict(model_type=name, hidden_size=64, num_hidden_layers=6, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
               vocab_size=128, max_position_embeddings=1024, rope_theta=10000.0,
               tie_word_embeddings=False, sliding_window=W)
    cfg.update(FAMILIES.get(name, {}), **extra)
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    if name == "gpt_oss":  # sinks start at zero; give them weight so they matter
        model.update({"model": {"layers": [{"self_attn": {"sinks": mx.random.normal((4,))}}
                                           for _ in model.layers]}})
    random_lora(model)
    if name in WIDE:
        model.set_dtype(mx.float64)
    return model


def tokens(n, seed):
    return mx.random.randint(1, 128, (n,), key=mx.random.key(seed)).tolist()


def assert_equal_step(got, ref, what):
    (loss, grads), (loss0, grads0) = got, ref
    assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item()), what
    assert worst_rel_error(grads, grads0) <= TOL, what


# ---------------------------------------------------------------- attend on random q, k, v

def window_mask(n, w):
    """mlx-lm's own mask for n tokens under window w ("causal" while it does not bite)."""
    return create_attention_mask(mx.zeros((1, n, 1)), None, window_size=w)


def qkv(n, heads, kv_heads, seed, dim=8):
    key = mx.random.key(seed)
    q, k, v = (mx.random.normal((1, h, n, dim), key=kk)
               for h, kk in zip((heads, kv_heads, kv_heads), mx.random.split(key, 3)))
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_attend_equals_mlx_lms_window_mask(heads, kv_heads):
    worst = 0.0
    for n in (1, 5, 7, 8, 9, 37, 100):
        for w in (1, 3, 8, 16):
            for rows in (None, 1, 8, 13):
                q, k, v = qkv(n, heads, kv_heads, seed=n * 100 + w)
                for sinks in (None, mx.random.normal((heads,), key=mx.random.key(w))):
                    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3,
                                                               mask=window_mask(n, w), sinks=sinks)
                    got = attend(q, k, v, 0.3, BlockMask(window=w, rows=rows), sinks)
                    worst = max(worst, mx.abs(got - ref).max().item())
    assert worst < 1e-5


def visible(q, k, prompt, split, w):
    """Whether row q sees key k in [prompt | chosen | rejected] (split None: one
    plain sequence), spelled out: rejected rows skip chosen keys, and positions
    restart at `prompt` on the rejected side."""
    rejected = split is not None and q >= split
    if rejected and prompt <= k < split:
        return False
    pos = (lambda i: i - split + prompt if split is not None and i >= split else i)
    return k <= q and (w is None or pos(q) - pos(k) < w)


@pytest.mark.parametrize("prompt,split,n", [(None, None, 23), (5, 9, 23), (12, 17, 30), (2, 20, 26)])
def test_block_mask_array_and_attend_with_windows(prompt, split, n):
    # The array form is the mask spelled out; attend equals sdpa under it, with
    # windows biting inside the prompt, across the split and not at all.
    for w in (None, 1, 4, 8, 40):
        bm = BlockMask(prompt or 0, split, w, rows=5)
        arr = bm.array(n)
        assert arr.tolist() == [[visible(q, k, prompt, split, w) for k in range(n)]
                                for q in range(n)]
        if split is None and w and n > w:
            assert mx.array_equal(arr, window_mask(n, w))
        q, k, v = qkv(n, 4, 2, seed=n + (w or 0))
        sinks = mx.random.normal((4,), key=mx.random.key(3))
        for s in (None, sinks):
            ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=arr, sinks=s)
            assert mx.allclose(attend(q, k, v, 0.3, bm, s), ref, atol=1e-5).item(), (w, s)


@pytest.mark.parametrize("split", [None, 17])
def test_blocked_grads_equal_autodiff_under_the_dense_mask(split):
    n, heads = 40, 4
    q, k, v = qkv(n, heads, 2, seed=7)
    d_out = mx.random.normal(q.shape, key=mx.random.key(8))
    sinks = mx.random.normal((heads,), key=mx.random.key(9))
    for w in (3, 8, 16):
        bm = BlockMask(12 if split else 0, split, w, rows=6)
        dense = bm.array(n)
        for s in (None, sinks):
            extra = [] if s is None else [s]
            _, ref = mx.vjp(lambda a, b, c, *t: [mx.fast.scaled_dot_product_attention(
                a, b, c, scale=0.3, mask=dense, sinks=t[0] if t else None)],
                [q, k, v, *extra], [d_out])
            # autodiff through attend, and the blocked backward at several block sizes
            _, got = mx.vjp(lambda a, b, c, *t: [attend(a, b, c, 0.3, bm, *t)],
                            [q, k, v, *extra], [d_out])
            blocked = [blocked_grads(q, k, v, d_out, bm, 0.3, block, s) for block in (1, 7, 16)]
            for g in [got, *blocked]:
                assert len(g) == len(ref)
                for a, b in zip(g, ref):
                    assert mx.allclose(a, b, atol=1e-5).item(), (w, s is None)


def _causal_noise(n):
    keep = mx.random.uniform(shape=(n, n), key=mx.random.key(5)) > 0.3
    return mx.tril(keep) | mx.eye(n).astype(mx.bool_)


@pytest.mark.parametrize("mask", ["causal", None, "causal-long-keys", "prefix", "window",
                                  "array"])
@pytest.mark.parametrize("twist", [None, "sinks", "softcap"])
def test_the_tiled_backward_equals_autodiff(mask, twist, monkeypatch):
    """A block over more keys than ATTN_KEY_TILE runs tile by tile (scores for one
    tile of keys at a time, a first pass for each row's log-sum-exp): the same
    dq, dk, dv (and d sinks) as autodiff of the attention, under every mask a
    block can have, with attention sinks (gpt-oss) and soft-capped scores (Gemma 2)."""
    from segctl.engine import attention
    monkeypatch.setattr(attention, "ATTN_KEY_TILE", 5)
    monkeypatch.setattr(attention, "ATTN_TILED_ABOVE", 8)
    tiled = []
    original = attention.tiled_vjp
    monkeypatch.setattr(attention, "tiled_vjp",
                        lambda *a, **kw: tiled.append(1) or original(*a, **kw))
    n, keys = 37, 37
    if mask == "causal-long-keys":
        n, mask = 16, "causal"   # fewer rows than keys: "causal" is lower-right aligned
    m = {"prefix": BlockMask(10, 20), "window": BlockMask(window=7),
         "array": _causal_noise(n)}.get(mask, mask)
    q, k, v = qkv(n, 4, 2, seed=3)
    k, v = (qkv(keys, 4, 2, seed=4)[1:]) if keys != n else (k, v)
    d_out = mx.random.normal(q.shape, key=mx.random.key(6))
    sinks = [mx.random.normal((4,), key=mx.random.key(9))] if twist == "sinks" else []
    cap = 2.0 if twist == "softcap" else None
    out, ref = mx.vjp(lambda a, b, c, *s: [attend(a, b, c, 0.3, m, *s, softcap=cap)],
                      [q, k, v, *sinks], [d_out])
    delta = (d_out * out[0]).sum(-1)
    for block in (4, 16):
        got = blocked_grads(q, k, v, d_out, m, 0.3, block, *sinks, delta=delta, softcap=cap)
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert mx.allclose(a, b, atol=1e-5).item(), (mask, twist, block)
    assert tiled, "no block went tile by tile"
    # rows no longer than ATTN_TILED_ABOVE keep MLX's backward per block, but for
    # sinks, which MLX's CUDA backward does not take: they always go tile by tile
    monkeypatch.setattr(attention, "ATTN_TILED_ABOVE", n)
    tiled.clear()
    blocked_grads(q, k, v, d_out, m, 0.3, 4, *sinks, delta=delta, softcap=cap)
    assert bool(tiled) == bool(sinks)


def test_the_tiled_backward_holds_a_tile_of_scores(monkeypatch):
    """At 2,048 keys, 512-row blocks and tiles of 256 keys, the tiled backward's
    peak is a fraction of MLX's attention backward's, which holds [heads, rows,
    keys] scores."""
    from segctl.engine import attention
    monkeypatch.setattr(attention, "ATTN_KEY_TILE", 256)
    monkeypatch.setattr(attention, "ATTN_TILED_ABOVE", 1024)
    n = 2048
    q, k, v = qkv(n, 8, 2, seed=1, dim=16)
    d_out = mx.random.normal(q.shape, key=mx.random.key(2))
    out = attend(q, k, v, 0.25, "causal")
    delta = (d_out * out).sum(-1)
    mx.eval(q, k, v, d_out, delta)
    peaks = []
    for dl in (None, delta):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(blocked_grads(q, k, v, d_out, "causal", 0.25, 512, delta=dl))
        peaks.append(mx.get_peak_memory() - base)
    assert peaks[1] < 0.5 * peaks[0], peaks


# ---------------------------------------------------------------- linear cost

def spy_on_sdpa(monkeypatch):
    """Record (query rows, keys) of every attention call."""
    calls = []
    original = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return original(q, k, v, **kw)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    return calls


def test_window_layers_touch_only_window_keys(monkeypatch):
    # Every layer slides: each attention call, forward, recompute and blocked
    # backward, takes at most rows + w - 1 keys, whatever the sequence length, and
    # the keys touched per token do not grow with it.
    model = tiny("gemma4_text", num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
                 num_kv_shared_layers=0)
    parts = model_parts(model)
    assert parts.windows == [W, W]
    bound = max(default_rows(W), 16) + W - 1
    per_token = {}
    for n in (300, 600):
        calls = spy_on_sdpa(monkeypatch)
        for block in (0, 16):
            loss_and_grads(model, Example(tokens(n, n), n // 2),
                           memory=StepMemory(segment_size=1, attn_block=block), parts=parts)
        pair = PreferenceExample(tokens(n // 2, 1), tokens(n // 4, 2), tokens(n // 4, 3))
        loss_and_grads(model, pair, method="orpo", prefix_shared=True,
                       memory=StepMemory(segment_size=1, attn_block=16), parts=parts)
        monkeypatch.undo()
        assert calls and max(keys for _, keys in calls) <= bound, n
        per_token[n] = sum(rows * keys for rows, keys in calls) / n
    assert per_token[600] <= 1.05 * per_token[300], per_token


# ---------------------------------------------------------------- the step on real families

@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_equals_plain_autodiff(family):
    model = tiny(family)
    parts = model_parts(model)
    assert any(parts.windows) and not all(parts.windows)
    for n, prompt_len in ((80, 20), (41, 0)):
        ex = Example(tokens(n, n), prompt_len)
        ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))   # the model's own forward
        for seg in (1, 2):
            for block in (0, 16):
                got = loss_and_grads(model, ex,
                                     memory=StepMemory(segment_size=seg, attn_block=block),
                                     parts=parts)
                assert_equal_step(got, ref, (family, n, seg, block))
        got = loss_and_grads(model, ex, memory=StepMemory(segment_size=0, grad_checkpoint=True),
                             parts=parts)
        assert_equal_step(got, ref, (family, n, "grad_checkpoint"))
        val, weight = eval_loss(model, ex, parts=parts)
        assert val == pytest.approx(ref[0].item(), rel=TOL) and weight == n - max(1, prompt_len)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefix_shared_orpo_equals_two_branch_plain_autodiff(family):
    # Rejected rows' windows reach back across the split into the prompt's keys.
    model = tiny(family)
    parts = model_parts(model)
    ex = PreferenceExample(tokens(30, 1), tokens(25, 2), tokens(20, 3))
    ref = loss_and_grads(model, ex, method="orpo", memory=StepMemory(segment_size=0),
                         prefix_shared=False)
    for seg, block in ((0, 0), (1, 0), (1, 16), (2, 0), (2, 16)):
        metrics: dict = {}
        got = loss_and_grads(model, ex, method="orpo", prefix_shared=True,
                             memory=StepMemory(segment_size=seg, attn_block=block), parts=parts,
                             metrics=metrics)
        assert metrics["prefix_shared"] is True
        assert_equal_step(got, ref, (family, seg, block))
    got = loss_and_grads(model, ex, method="orpo", prefix_shared=True,
                         memory=StepMemory(segment_size=0, grad_checkpoint=True), parts=parts)
    assert_equal_step(got, ref, (family, "grad_checkpoint"))


def test_the_plain_reference_is_the_models_own_forward_and_nothing_leaks():
    model = tiny("olmo3")
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    original = module.scaled_dot_product_attention
    parts = model_parts(model, check=False)  # its checks at load swap attention in and out
    seen = []

    def own(*args, **kwargs):
        # Called as the module's own function, with the model's own (array) mask.
        seen.append(module.scaled_dot_product_attention is own and
                    isinstance(kwargs.get("mask"), (mx.array, str)))
        return original(*args, **kwargs)
    module.scaled_dot_product_attention = own
    try:
        ex = Example(tokens(40, 4), 10)
        loss_and_grads(model, ex, memory=StepMemory(segment_size=0), parts=parts)
        assert seen and all(seen)
        seen.clear()
        for kw in (dict(segment_size=1), dict(segment_size=2, attn_block=16),
                   dict(segment_size=0, grad_checkpoint=True)):
            loss_and_grads(model, ex, **step_kw(**kw))
            eval_loss(model, ex)
            assert module.scaled_dot_product_attention is own, kw
        assert seen and not all(seen)  # the step's window layers went through BlockMasks
    finally:
        module.scaled_dot_product_attention = original


def test_hand_written_attention_keeps_array_masks():
    # mlx-lm's gemma2 layer as it is (engine/capped.py not applied) computes its
    # scores by hand (soft-capped), so it never sees a BlockMask.
    from segctl.engine.attention import takes_block_masks
    from segctl.engine.layout import masks as _masks
    from segctl.engine.plans import Stream
    gemma2 = importlib.import_module("mlx_lm.models.gemma2")
    layer = gemma2.TransformerBlock(gemma2.ModelArgs.from_dict(dict(
        model_type="gemma2", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=64,
        num_key_value_heads=1)))
    olmo3 = tiny("olmo3")
    assert not takes_block_masks(layer) and takes_block_masks(olmo3.layers[0])

    class Parts:
        layers, windows = [layer, olmo3.layers[0], olmo3.layers[2]], [W, W, None]
        block_masks = [takes_block_masks(layer) for layer in layers]
    own = [window_mask(20, W), window_mask(20, W), "causal"]
    plain = _masks(Parts, Stream(list(range(20)), [0], [1], mx.ones((1, 1))), 20, own)
    assert plain[0] is own[0] and plain[1] == BlockMask(window=W) and plain[2] == "causal"
    shared = _masks(Parts, Stream(list(range(20)), [0], [1], mx.ones((1, 1)), block=(6, 12)),
                    20, own)
    assert mx.array_equal(shared[0], BlockMask(6, 12, W).array(20))
    assert shared[1] == BlockMask(6, 12, W) and shared[2] == BlockMask(6, 12, None)
