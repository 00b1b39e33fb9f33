"""QLoRA: a base quantized by `mlx_lm convert -q` trains through `segctl train`
(LoRA on its quantized linears, gradients exact), the adapter loads back with
`mlx_lm.load`, and the planner counts the quantized bytes."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from segctl.engine import Example, loss_and_grads
from segctl.engine.model import load_model, model_parts
from segctl.engine.settings import StepMemory
from segctl.orchestrator import planner
from tests.conftest import cli_env, random_lora, segctl
from tests.test_train_cli import copy_demo


@pytest.fixture(scope="module")
def q4(demo_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("q4") / "model"
    proc = subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path",
                           str(demo_dir / "model"), "--mlx-path", str(out), "-q",
                           "--q-bits", "4", "--q-group-size", "32"],
                          capture_output=True, text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_the_planner_counts_quantized_bytes(demo_dir, q4):
    full, quant = planner.model_info(str(demo_dir / "model")), planner.model_info(str(q4))
    assert quant.weight_bytes == sum(p.stat().st_size for p in q4.glob("*.safetensors"))
    # 4-bit weights with a scale and bias per 32 (embedding included): well under a third
    assert quant.weight_bytes < full.weight_bytes / 3
    assert (quant.n_layers, quant.hidden, quant.vocab) == (full.n_layers, full.hidden, full.vocab)
    gb = lambda info: planner.predict_gb(info, seq_len=256, segment_size=1)
    assert gb(quant) < gb(full)


def test_segmented_gradients_on_a_quantized_base_are_exact(q4):
    model, _ = load_model(q4)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    mx.random.seed(0)
    random_lora(model)
    parts = model_parts(model, check=False)
    vocab = model.args.vocab_size
    ex = Example(mx.random.randint(1, vocab, (60,), key=mx.random.key(1)).tolist(), 20)
    loss0, ref = loss_and_grads(model, ex, memory=StepMemory(segment_size=0))
    for seg, block in ((1, 0), (2, 16)):
        loss, grads = loss_and_grads(model, ex,
                                     memory=StepMemory(segment_size=seg, attn_block=block),
                                     parts=parts)
        assert abs(loss.item() - loss0.item()) <= 1e-4 * abs(loss0.item())
        for k in ref:
            err = mx.max(mx.abs(grads[k] - ref[k])).item() / mx.max(mx.abs(ref[k])).item()
            assert err <= 1e-4, (k, seg, err)


@pytest.mark.slow   # 6 s
def test_qlora_job_trains_and_the_adapter_loads_in_mlx_lm(demo_dir, q4, tmp_path):
    from mlx_lm import load

    job = copy_demo(demo_dir, tmp_path, model=str(q4), train={"iters": 40, "eval_every": 20})
    proc = segctl("train", job)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    base, tok = load(str(q4))
    tuned, _ = load(str(q4), adapter_path=str(out))
    lora = [m for _, m in tuned.named_modules() if hasattr(m, "lora_a")]
    assert lora and all(isinstance(m.linear, nn.QuantizedLinear) for m in lora)
    ids = mx.array([tok.encode("after q r s", add_special_tokens=False)])
    assert mx.max(mx.abs(base(ids) - tuned(ids))).item() > 1e-3
