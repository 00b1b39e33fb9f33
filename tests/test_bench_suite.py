"""bench/suite.py's plans: every configuration is one bench.engine accepts, and the
Mac plan (which only a lab's Apple Silicon runs in full) runs end to end here at a
tiny size, each row through its own process as on a Mac."""

from __future__ import annotations

import json

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


@pytest.mark.slow   # 6 processes, 40 s
def test_the_mac_plan_runs_end_to_end_at_a_tiny_size(tmp_path, monkeypatch, capsys):
    """Every row through its own process, as JSON on stdout, then the table on
    stderr: ours beside mlx-lm's grad_checkpoint, as ratios of its peak and step."""
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
    # and the mac plan's throughput rows (bench.throughput), tiny too
    monkeypatch.setitem(suite.THROUGHPUT, "mac-tiny", [
        "--layers", "2", "--dim", "64", "--vocab", "256", "--rows", "4", "--min-len", "8",
        "--median", "24", "--max-len", "64", "--pack-length", "64",
        "--configs", "mlx-lm:b4,segctl:b4:packed:s0", "--warm-pass"])
    # and whether compile merges a block's recompute (bench.merge), tiny too
    monkeypatch.setitem(suite.MERGE, "mac-tiny", ["--layers", "1", "--rows", "1", "--tokens",
                                                  "32", "--repeats", "1", "--masks", "causal"])
    suite.cli(["mac-tiny"])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    merges = [r for r in rows if r.get("bench") == "merge"]
    assert [r["fn"] for r in merges][-4:] == ["joint", "check", "check", "check"]
    assert "| one_vjp |" in err and "vs segmented |" in err
    rows = [r for r in rows if r.get("bench") != "merge"]
    rates = [r for r in rows if r.get("bench") == "throughput"]
    assert [r["config"] for r in rates] == ["mlx-lm:b4", "segctl:b4:packed:s0"]
    assert not [r for r in rates if "error" in r] and all(r["warm_pass"] for r in rates)
    assert "| segctl batch 4, packed, plain |" in err and "vs mlx-lm batch 4" in err
    rows = [r for r in rows if r.get("bench") != "throughput"]
    assert len(rows) == len(suite.PLANS["mac"])
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    assert {r["impl"] for r in rows} == {"mlx-lm", "segctl"}
    ours = [r for r in rows if r["impl"] == "segctl"]
    assert all(r["peak_gb"] > 0 and r["phases"] for r in ours)
    assert any(r["offload"] for r in ours) and any(r["mlp_chunk"] for r in ours)

    # the table: one group per shape (both 128-token here: arch tells them apart)
    assert err.count("| configuration | peak GB |") == 2
    assert "llama 2 x 128, 4-bit base, bfloat16, 128 tokens:" in err
    lines = err.splitlines()
    base = next(l for l in lines if l.startswith("| mlx-lm grad_checkpoint"))
    assert base.endswith("| 1 | 1 |")
    mine = [l for l in lines if l.startswith("| ours, segment 1, attn_block 32")]
    assert len(mine) == len(ours) and any("offload disk" in l for l in mine)
    for row in ours:   # each row's ratios against its own shape's mlx-lm row
        b = next(r for r in rows if r["impl"] == "mlx-lm" and r["arch"] == row["arch"])
        ratios = f"| {row['peak_gb'] / b['peak_gb']:.2f}x | {row['step_s'] / b['step_s']:.2f}x |"
        assert any(line.endswith(ratios) for line in mine), (ratios, mine)
    # the same table again from the saved rows
    saved = tmp_path / "mac.jsonl"
    saved.write_text(out)
    suite.cli(["table", str(saved)])
    assert capsys.readouterr().out.strip() == err.strip()


def test_a_failed_row_shows_in_the_table_and_bad_input_is_one_line(tmp_path, capsys):
    rows = [dict(arch="llama", layers=2, dim=64, dtype="float32", seq=64, impl="mlx-lm",
                 mode="checkpoint", peak_gb=2.0, step_s=4.0, tokens_per_gb=32),
            dict(arch="llama", layers=2, dim=64, dtype="float32", seq=64, impl="segctl",
                 mode="segmented", segment_size=2, peak_gb=0.5, step_s=5.0, tokens_per_gb=128),
            dict(arch="llama", layers=2, dim=64, dtype="float32", seq=64, impl="segctl",
                 mode="segmented", segment_size=1, offload="/tmp/x", error="out of memory")]
    text = suite.table(rows)
    assert "| ours, segment 2, MLP whole | 0.50 | 5.00 | 128 | 0.25x | 1.25x |" in text
    assert "| ours, segment 1, MLP whole, offload disk | failed: out of memory |" in text

    for argv, says in [(["nope"], "unknown plan 'nope'"), (["cpu", "8k"], "seqs: '8k'"),
                       (["table"], "which file?"),
                       (["table", str(tmp_path / "none.jsonl")], "none.jsonl: No such file")]:
        with pytest.raises(SystemExit) as e:
            suite.cli(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and says in err[-1], (argv, err)
    bad = tmp_path / "rows.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps({"bench": "offload"}) + "\n")
    with pytest.raises(SystemExit) as e:
        suite.cli(["table", str(bad)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == (f"bench.suite table: {bad}, line 3: not a bench.engine "
                                         "row (no arch, layers, dim, dtype, seq)")


def test_gemma4_variants_change_only_the_kind_of_layer_they_name(capsys):
    """bench.engine's Gemma-4 variants (the gpu-gemma4-kinds plan): --no-double-mlp
    leaves the K/V sharers reading their donor's K/V with the others' MLP width;
    --kv-shared 0 gives every layer K/V of its own (and so the single MLP);
    --layer-input 0 drops the per-layer inputs. Another family refuses them."""
    def shape(**variant):
        model = engine.bench_model("gemma4_text", 10, 128, 512, "float32", **variant)
        layers = model.model.layers
        return ([l.mlp.gate_proj.linear.weight.shape[0] for l in layers],
                [l.self_attn.has_kv for l in layers], layers[0].per_layer_input_gate is not None)

    widths, own_kv, inputs = shape()
    assert widths == [512] * 5 + [1024] * 5 and own_kv == [True] * 5 + [False] * 5 and inputs
    assert shape(double_mlp=False) == ([512] * 10, own_kv, True)
    assert shape(kv_shared=0) == ([512] * 10, [True] * 10, True)
    assert shape(kv_shared=0, layer_input=0) == ([512] * 10, [True] * 10, False)
    with pytest.raises(SystemExit) as e:
        engine.parse(["--arch", "llama", "--no-double-mlp"])
    assert e.value.code == 2 and "gemma4_text's, not llama's" in capsys.readouterr().err
