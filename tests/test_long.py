"""Long rows: the MLP in chunks of rows and the boundaries on disk keep the step
exact, take less memory, and leave nothing behind."""

from __future__ import annotations

import dataclasses
import os

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.base import scaled_dot_product_attention

from segctl.engine import Example, PreferenceExample, loss_and_grads
from segctl.engine.layer import tokenwise_children
from segctl.engine.model import model_parts
from segctl.engine.settings import StepMemory
from segctl.engine.train import OOMError
from tests.conftest import free_earlier_arrays, random_lora, step_kw
from tests.test_step import lora_model, random_example, worst_rel_error

TOL = 1e-4


@pytest.mark.parametrize("arch,tile", [("llama", None), ("qwen3", None), ("llama", 8)])
def test_mlp_chunks_and_offload_equal_plain(tiny_models, arch, tile, tmp_path, monkeypatch):
    """...and with attention's backward tile by tile over the keys (tile 8)."""
    if tile:
        from segctl.engine import attention
        monkeypatch.setattr(attention, "ATTN_KEY_TILE", tile)
        monkeypatch.setattr(attention, "ATTN_TILED_ABOVE", 16)
    model = lora_model(tiny_models[arch])
    parts = model_parts(model)
    assert all(names == ["mlp"] for names in parts.tokenwise)
    ex = random_example(model.args.vocab_size, n=41, prompt_len=13)
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
    # chunks that divide the row and that do not, alone and with attention blocks
    for seg, block, chunk, offload in ((1, 0, 8, None), (2, 0, 7, None), (1, 16, 13, None),
                                       (3, 7, 5, tmp_path), (5, 0, 40, tmp_path)):
        loss, grads = loss_and_grads(model, ex,
                                     memory=StepMemory(segment_size=seg, attn_block=block,
                                                       mlp_chunk=chunk, offload=offload),
                                     parts=parts)
        assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
        assert worst_rel_error(grads, ref) <= TOL, (arch, seg, block, chunk)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_validation_and_the_reference_pass_go_in_the_steps_pieces(tiny_models, method):
    """eval_loss (and DPO's reference forward) on a long row: in row chunks and
    attention blocks, the same loss as whole."""
    from segctl.engine.step import eval_loss
    model = lora_model(tiny_models["llama"])
    parts = model_parts(model)
    ex = random_example(model.args.vocab_size, n=41, prompt_len=13)
    if method == "dpo":
        ids = ex.ids
        ex = PreferenceExample(ids[:13], ids[13:27], ids[27:])
    whole, n = eval_loss(model, ex, method=method, parts=parts)
    cut, m = eval_loss(model, ex, method=method, attn_block=16, mlp_chunk=9, parts=parts)
    assert n == m and abs(cut - whole) <= TOL * abs(whole), (cut, whole)


def test_offload_is_bit_identical_to_memory_two_branch(tiny_models, tmp_path):
    model = lora_model(tiny_models["qwen3"])
    ids = mx.random.randint(1, model.args.vocab_size, (60,), key=mx.random.key(4)).tolist()
    ex = PreferenceExample(ids[:20], ids[20:40], ids[40:])
    kw = dict(method="orpo", segment_size=1, attn_block=16, mlp_chunk=9)
    loss, grads = loss_and_grads(model, ex, **step_kw(**kw))
    loss_d, grads_d = loss_and_grads(model, ex, **step_kw(**kw, offload=str(tmp_path / "scratch")))
    assert loss.item() == loss_d.item()
    assert all(mx.array_equal(grads[k], grads_d[k]).item() for k in grads)
    assert os.listdir(tmp_path / "scratch") == []


def test_a_step_that_fails_midway_leaves_no_scratch_file(tiny_models, tmp_path):
    model = lora_model(tiny_models["qwen3"])
    ex = random_example(model.args.vocab_size, n=41)
    seen = []

    def phase(label):
        seen.append(len(os.listdir(f"/proc/{os.getpid()}/fd")))
        if label == "bwd2":
            raise OOMError("budget crossed", 1.0)
    with pytest.raises(OOMError):
        loss_and_grads(model, ex, memory=StepMemory(segment_size=1, offload=str(tmp_path)),
                       on_phase=phase)
    assert os.listdir(tmp_path) == []
    # the unlinked file's descriptor was open during the step and is closed now
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) < max(seen)


def _phase_peaks(model, ex, **kw):
    out = {}

    def phase(label):
        out[label] = mx.get_peak_memory() / 1e6
        mx.reset_peak_memory()
    mx.clear_cache()
    mx.reset_peak_memory()
    loss_and_grads(model, ex, on_phase=phase, **step_kw(**kw))
    return out


@pytest.mark.slow   # 13 s
def test_mlp_chunks_bound_the_layer_and_offload_the_boundaries(tmp_path):
    """On a wide-MLP model the forward of a layer and its backward hold one chunk's
    MLP activations; with the boundaries on disk the forward's peak stops growing
    with depth."""
    free_earlier_arrays()
    from bench.engine import bench_model
    model = bench_model("qwen3", 12, 128, 512, "float32")
    ex = Example(mx.random.randint(1, 512, (2048,), key=mx.random.key(1)).tolist(), 1024)
    parts = model_parts(model, check=False)
    base = dict(segment_size=1, attn_block=256, parts=parts)
    whole = _phase_peaks(model, ex, mlp_chunk=0, **base)
    cut = _phase_peaks(model, ex, mlp_chunk=256, **base)
    disk = _phase_peaks(model, ex, mlp_chunk=256, offload=str(tmp_path), **base)
    fwd = lambda p: max(v for k, v in p.items() if k.startswith("fwd"))
    bwd = lambda p: max(v for k, v in p.items() if k.startswith("bwd"))
    assert fwd(cut) < 0.8 * fwd(whole), (fwd(cut), fwd(whole))
    assert bwd(cut) < 0.8 * bwd(whole), (bwd(cut), bwd(whole))
    # boundaries of 2048 x 128 fp32 (1 MB each): in memory each forward phase
    # holds one more; on disk the tenth holds what the second did (and at most
    # the one still being written)
    growth = lambda p: p["fwd11"] - p["fwd1"]
    assert growth(cut) > 8 and growth(disk) < 2, (cut, disk)   # < 2: the one being written


def test_a_segment_in_pieces_holds_one_layers_backward_at_a_time():
    """A segment of two layers whose backward goes in passes (blocked attention,
    the MLP whole) holds what a segment of one does, plus the layer input it
    recomputed: the first layer's backward is evaluated before the second's
    starts, not kept as a graph through it."""
    free_earlier_arrays()
    from bench.engine import bench_model
    model = bench_model("qwen3", 4, 128, 512, "float32")
    ex = Example(mx.random.randint(1, 512, (1024,), key=mx.random.key(1)).tolist(), 512)
    parts = model_parts(model, check=False)
    bwd = lambda p: max(v for k, v in p.items() if k.startswith("bwd"))
    one, two = (bwd(_phase_peaks(model, ex, segment_size=s, attn_block=128, mlp_chunk=0,
                                 parts=parts)) for s in (1, 2))
    # the recomputed input and a little of the allocator's; kept as a graph, the
    # first layer's backward held about ten hidden states more
    hidden_state = 1024 * 128 * 4 / 1e6
    assert two <= one + 4 * hidden_state, (one, two)


@pytest.mark.slow   # 10 s
def test_layers_run_rows_apart_hold_less_and_step_the_same():
    """engine/rows.py: a layer's light parts (norms, projections and their LoRA,
    RoPE, residuals) run a chunk of rows at a time beside the MLP, attention
    whole-row in blocks. Against the same step with them whole (`rowwise` off),
    the forward and the backward hold less, and loss and gradients are the same."""
    free_earlier_arrays()
    from bench.engine import bench_model
    model = bench_model("llama", 2, 512, 512, "float32")
    mx.random.seed(0)
    random_lora(model)
    ex = Example(mx.random.randint(1, 512, (1024,), key=mx.random.key(1)).tolist(), 512)
    parts = model_parts(model, check=False)
    assert parts.rowwise == [True, True]
    whole = dataclasses.replace(parts, rowwise=None)
    base = dict(segment_size=1, attn_block=64, mlp_chunk=128)
    cut, kept = _phase_peaks(model, ex, parts=parts, **base), _phase_peaks(model, ex, parts=whole,
                                                                            **base)
    fwd = lambda p: max(v for k, v in p.items() if k.startswith("fwd"))
    bwd = lambda p: max(v for k, v in p.items() if k.startswith("bwd"))
    assert fwd(cut) < 0.8 * fwd(kept) and bwd(cut) < 0.8 * bwd(kept), (cut, kept)
    loss, grads = loss_and_grads(model, ex, parts=parts, **step_kw(**base))
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
    assert abs(loss.item() - loss0.item()) <= TOL * abs(loss0.item())
    assert worst_rel_error(grads, ref) <= TOL


class _OneHead(nn.Module):
    """A decoder layer with one head of attention through mlx-lm's sdpa, RoPE as
    `self.rope`, and optionally something that is not row-wise besides."""

    def __init__(self, dim, twist=None):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.rope = nn.RoPE(dim)
        self.twist = twist

    def __call__(self, x, mask=None, cache=None):
        q, k, v = (self.rope(f(x))[:, None] if f is not self.v else f(x)[:, None]
                   for f in (self.q, self.k, self.v))
        out = x + self.o(scaled_dot_product_attention(q, k, v, cache=cache, scale=0.1,
                                                      mask=mask)[:, 0])
        return self.twist(out) if self.twist else out


def test_a_layer_runs_rows_apart_only_if_cut_equals_whole():
    from segctl.engine.rows import rowwise
    ok = _OneHead(16)
    assert rowwise(ok, lambda h, m: ok(h, m), 16, mx.float32)
    # rows mixed outside attention, positions not through `rope`: refused
    for twist in (lambda y: mx.cumsum(y, axis=1),
                  lambda y: y + mx.arange(y.shape[1])[None, :, None]):
        bad = _OneHead(16, twist)
        assert not rowwise(bad, lambda h, m: bad(h, m), 16, mx.float32)


class _Mixer(nn.Module):
    """Not token-wise: each row's output reads the rows before it."""
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def __call__(self, x):
        return mx.cumsum(self.proj(x), axis=1)


class _Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mlp = _Mixer(dim)
        self.ffn = nn.Linear(dim, dim)

    def __call__(self, x):
        return x + self.mlp(x) + self.ffn(x) + self.ffn(x)


def test_only_row_wise_children_called_once_are_cut():
    layer = _Layer(16)
    # mlp mixes rows; ffn is row-wise but called twice
    assert tokenwise_children(layer, layer, 16) == []
    layer.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    assert tokenwise_children(layer, layer, 16) == ["mlp"]


def test_lora_dropout_keeps_the_mlp_whole(tiny_models):
    """A chunk would draw other dropout masks than the whole row: with dropout on,
    the MLP is not cut, so the step is the one without chunks, draw for draw."""
    from segctl.engine.model import load_model
    model, _ = load_model(tiny_models["qwen3"])
    mx.random.seed(0)
    random_lora(model, dropout=0.3)
    ex = random_example(model.args.vocab_size, n=41)
    mx.random.seed(5)
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=1))
    mx.random.seed(5)
    loss, grads = loss_and_grads(model, ex, memory=StepMemory(segment_size=1, mlp_chunk=8))
    assert loss.item() == loss0.item()
    assert all(mx.array_equal(grads[k], ref[k]).item() for k in ref)


def test_rows_go_in_even_pieces_never_a_short_tail():
    from segctl.engine.layer import spans
    assert spans(10, 64) == [(0, 10)]
    assert spans(128, 64) == [(0, 64), (64, 128)]
    got = spans(2 * 64 + 5, 64)
    assert len(got) == 3 and got[0][0] == 0 and got[-1][1] == 133
    assert all(b - a <= 64 and b - a >= 44 for a, b in got)
    assert all(got[i][1] == got[i + 1][0] for i in range(2))


class _Picky(_OneHead):
    """Its forward fails on the probe's whole row, as a device's kernel may on a shape."""
    def __call__(self, x, mask=None, cache=None):
        if x.shape[1] > 100:
            raise RuntimeError("kernel launch failed:\ninvalid argument")
        return super().__call__(x, mask, cache)


def test_a_refused_layer_says_why_in_one_line():
    from segctl.engine.rows import refusal
    ok = _OneHead(16)
    assert refusal(ok, lambda h, m: ok(h, m), 16, mx.float32) is None
    mixer = _OneHead(16, lambda y: mx.cumsum(y, axis=1))
    assert refusal(mixer, lambda h, m: mixer(h, m), 16, mx.float32) == \
        "rows apart give another output than the whole row"
    picky = _Picky(16)
    assert refusal(picky, lambda h, m: picky(h, m), 16, mx.float32) == \
        "the row-wise probe raised RuntimeError: kernel launch failed: invalid argument"
