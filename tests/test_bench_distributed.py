"""bench.distributed: its adapter sizes are the engine's, its model is the ring's
arithmetic, and a short run prints every kind of row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mlx.utils import tree_flatten

from bench.distributed import allreduce_s, lora_floats, scaling_rows, table
from tests.conftest import ROOT, cli_env


def test_the_demo_adapter_has_the_size_the_bench_sends(demo_dir):
    from segctl.engine.model import apply_lora, load_model
    model, _ = load_model(str(demo_dir / "model"))
    apply_lora(model, rank=8, scale=20.0, dropout=0.0, num_layers=-1, keys=None)   # the demo job's
    floats = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    assert floats == lora_floats("demo")


def test_the_model_is_a_rings_arithmetic():
    assert allreduce_s(84e6, 1, 1.25e9) == 0
    # 2 ranks: each sends half the vector twice (reduce-scatter, all-gather)
    assert allreduce_s(84e6, 2, 1.25e9, hop_s=0) == pytest.approx(84e6 / 1.25e9)
    assert allreduce_s(84e6, 8, 1.25e9, hop_s=0) == pytest.approx(2 * 7 / 8 * 84e6 / 1.25e9)
    rows = scaling_rows()
    assert {(r["link"], r["ranks"], r["row_tokens"]) for r in rows} == {
        (link, n, t) for link in ("10GbE", "Thunderbolt 4", "Thunderbolt 5") for n in (2, 4, 8)
        for t in (4096, 8192, 32768)}
    assert all(0 < r["allreduce_share"] < 1 and r["speedup"] <= r["ranks"] for r in rows)
    assert table(rows).count("\n") == len(rows) + 1


@pytest.mark.slow   # ~30 s: rings of 2 processes
def test_a_short_run_prints_allreduce_step_and_scaling_rows():
    proc = subprocess.run([sys.executable, "-m", "bench.distributed", "--ranks", "1,2", "--iters", "3"],
                          capture_output=True, text=True, cwd=ROOT, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    kinds = {r["bench"] for r in rows}
    assert kinds == {"allreduce", "step", "scaling"}
    steps = {r["ranks"]: r for r in rows if r["bench"] == "step"}
    assert steps[1]["allreduce_bytes"] == 0 and steps[2]["allreduce_bytes"] == 4 * (lora_floats("demo") + 2)
    assert all(r["seconds"] > 0 for r in rows if r["bench"] == "allreduce")
