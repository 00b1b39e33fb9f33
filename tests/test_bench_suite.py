"""bench/suite.py's plans: every configuration is one bench.engine accepts, and the
Mac plan (which only a lab's Apple Silicon runs in full) runs end to end here at a
tiny size, each row through its own process as on a Mac."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from bench import engine, suite

# The Mac plan's structure (impls, modes, mlp_chunk, offload, quantized base) at a
# size the CPU runs in seconds: a row of 128 tokens, attention blocks and MLP
# chunks of 32, so the long-row paths run.
TINY = dict(layers=2, dim=128, intermediate=256, heads=2, kv_heads=1, head_dim=64, vocab=512,
            seq=128, steps=1)


@pytest.mark.parametrize("plan", sorted(suite.PLANS))
def test_every_configuration_of_every_plan_parses(plan):
    for cfg in suite.PLANS[plan]:
        args = engine.parse(suite.argv_of(cfg))
        assert args.seq == cfg["seq"] and args.impl == cfg.get("impl", "segctl"), cfg


def test_the_mac_plan_runs_end_to_end_at_a_tiny_size(tmp_path, monkeypatch):
    tiny = []
    for cfg in suite.PLANS["mac"]:
        cfg = dict(cfg, **TINY)
        if cfg.get("impl") == "segctl":
            cfg["attn_block"] = 32
            cfg["mlp_chunk"] = 32 if cfg.get("mlp_chunk") else 0
        if "offload" in cfg:
            cfg["offload"] = str(tmp_path / "offload")
        tiny.append(cfg)
    monkeypatch.setitem(suite.PLANS, "mac-tiny", tiny)
    out = io.StringIO()
    with redirect_stdout(out):
        suite.main("mac-tiny")
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(rows) == len(suite.PLANS["mac"])
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    assert {r["impl"] for r in rows} == {"mlx-lm", "segctl"}
    ours = [r for r in rows if r["impl"] == "segctl"]
    assert all(r["peak_gb"] > 0 and r["phases"] for r in ours)
    assert any(r["offload"] for r in ours) and any(r["mlp_chunk"] for r in ours)
