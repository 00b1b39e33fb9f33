"""Measured peak memory: segment size 1 below plain autodiff and grad_checkpoint.

A comparison inside one process on one shape, not a timing: the peak counts live
allocations after mx.reset_peak_memory(), which other tenants of the machine do
not change.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from bench.engine import bench_model
from segctl.engine import Example, loss_and_grads
from tests.conftest import step_kw


def peak_of(model, ex, **kw) -> float:
    mx.clear_cache()
    mx.reset_peak_memory()
    loss, grads = loss_and_grads(model, ex, **step_kw(**kw))
    mx.eval(loss, grads)
    return mx.get_peak_memory() / 1e9


@pytest.mark.slow   # 4 s
def test_segment_size_one_peaks_below_plain_and_checkpoint():
    # Deep enough and long enough that stored activations dominate the weights.
    model = bench_model("qwen3", layers=8, dim=128, vocab=4096, dtype="float32")
    ids = mx.random.randint(0, 4096, (768,), key=mx.random.key(0)).tolist()
    ex = Example(ids, 384)
    plain = peak_of(model, ex, segment_size=0)
    ckpt = peak_of(model, ex, segment_size=0, grad_checkpoint=True)
    seg1 = peak_of(model, ex, segment_size=1, head_chunk=128)
    seg4 = peak_of(model, ex, segment_size=4, head_chunk=128)
    blocked = peak_of(model, ex, segment_size=1, head_chunk=128, attn_block=128)
    print(f"peak GB plain {plain:.3f} checkpoint {ckpt:.3f} seg1 {seg1:.3f} seg4 {seg4:.3f} "
          f"seg1+attn_block {blocked:.3f}")
    assert seg1 < 0.75 * plain
    assert seg1 < ckpt
    assert seg1 <= seg4
    assert blocked < seg1
