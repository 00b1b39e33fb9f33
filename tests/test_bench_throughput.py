"""bench/throughput.py end to end at a tiny size: each configuration in its own
process, both implementations over the same rows and the same supervised tokens,
the same first-step loss, the table, and bad input as one line."""

from __future__ import annotations

import json

import pytest

from bench import throughput

# 2 layers x 64, 8 rows of 32..64 tokens (median 40), packed sequences of <= 128
TINY = ["--layers", "2", "--dim", "64", "--vocab", "512", "--rows", "8", "--median", "40",
        "--max-len", "64", "--pack-length", "128"]
CONFIGS = ["mlx-lm:b1", "mlx-lm:b4", "segctl:b1:unpacked:s0", "segctl:b4:unpacked:s2",
           "segctl:b4:packed:s2", "segctl:b4:auto:s0", "segctl:b4:side:s1:fused",
           "segctl:b4:unpadded:s1"]


def test_both_implementations_run_the_same_rows_and_agree(tmp_path, capsys):
    throughput.cli(TINY + ["--passes", "2", "--configs", ",".join(CONFIGS)])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["config"] for r in rows] == CONFIGS
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    by = {r["config"]: r for r in rows}

    # every configuration saw every row once, and the loss read the same tokens:
    # mlx-lm's mask (its default_loss) counts exactly segctl's supervised tokens
    args = throughput.parse(TINY + ["--configs", ",".join(CONFIGS)])
    mix = throughput.mix_stats(throughput.make_rows(8, 40, 0.6, 32, 64, 0, 512))
    assert mix["longest"] <= 64 and mix["supervised"] > 0
    for r in rows:
        assert r["rows_seen"] == 8 and r["supervised_tokens"] == mix["supervised"], r
        assert r["steps"] == 8 // r["batch"] and r["tokens_per_s"] > 0 and r["peak_gb"] > 0
        # two timed passes over the rows, the median's tokens/s (of two, their mean)
        assert r["passes"] == 2 and len(r["pass_seconds"]) == 2, r
        assert abs(r["seconds"] - sum(r["pass_seconds"]) / 2) < 2e-3, r
        assert r["lengths"]["median"] == 40 and r["lengths"]["tokens"] == mix["tokens"]
        assert r["layers"] == args.layers == 2 and r["mlx"] and r["mlx_lm"]

    # segctl's first timed pass by phase: the segmented step's forward, head,
    # backward and update, plain autodiff's one step; all within the pass (how
    # much of a tiny pass they cover depends on the machine's load)
    for r in rows:
        if r["impl"] == "segctl":
            phases = r["phase_seconds"]
            assert set(phases) == ({"fwd", "head", "bwd", "update"} if r["segment_size"]
                                   else {"step", "update"}), r
            assert min(phases.values()) >= 0 and max(phases.values()) > 0, r
            assert sum(phases.values()) <= r["pass_seconds"][0] + 0.005, r   # (each rounded)

    # the same weights and the same first row: the first step's loss agrees
    want = by["segctl:b1:unpacked:s0"]["loss"]
    got = by["mlx-lm:b1"]["loss"]
    assert abs(got - want) <= 1e-3 * abs(want), (got, want)
    assert all(abs(r["loss"] - want) <= 1e-3 * abs(want) for r in rows), [r["loss"] for r in rows]

    # packing: fewer sequences than rows, no padding; auto resolves to packed on qwen3
    assert by["segctl:b4:unpacked:s2"]["sequences_per_step"] == 4
    assert by["segctl:b4:packed:s2"]["sequences_per_step"] < 4
    assert by["segctl:b4:auto:s0"]["packed"] is True and by["segctl:b4:auto:s0"]["pack"] == "auto"
    assert 0 < by["mlx-lm:b4"]["pad_efficiency"] < 1
    # asked for, fused (auto on this CPU is not); the same loss, checked above
    assert by["segctl:b4:side:s1:fused"]["fused"] is True and by["segctl:b4:auto:s0"]["fused"] is False
    assert by["mlx-lm:b4"]["processed_tokens"] > by["segctl:b4:packed:s2"]["processed_tokens"]
    # the side-by-side groups with their rows' tokens unpadded: no padding (on a CPU, no tail)
    assert by["segctl:b4:unpadded:s1"]["unpadded"] is True and by["segctl:b4:side:s1:fused"]["unpadded"] is False
    assert by["segctl:b4:unpadded:s1"]["pad_efficiency"] == 1 > by["segctl:b4:side:s1:fused"]["pad_efficiency"]

    # the table: ratios of tokens/s against mlx-lm batch 4
    lines = err.splitlines()
    assert "| configuration | tokens/s | peak GB |" in err
    assert next(l for l in lines if l.startswith("| mlx-lm batch 4 |")).endswith("| 1 |")
    base = by["mlx-lm:b4"]["tokens_per_s"]
    mine = next(l for l in lines if l.startswith("| segctl batch 4, packed, segment 2 |"))
    assert mine.endswith(f"| {by['segctl:b4:packed:s2']['tokens_per_s'] / base:.2f}x |"), mine
    assert any(l.startswith("| segctl batch 4, pack auto (packed), plain |") for l in lines)
    assert any(l.startswith("| segctl batch 4, side, segment 1, fused |") for l in lines)
    assert any(l.startswith("| segctl batch 4, unpadded, segment 1 |") for l in lines)
    assert "segctl's best:" in err

    # the same table from the saved rows
    saved = tmp_path / "rows.jsonl"
    saved.write_text(out)
    throughput.cli(["table", str(saved)])
    assert capsys.readouterr().out.strip() == throughput.table(rows).strip()
    assert throughput.table(rows).strip() in err


def test_rounds_run_each_configuration_again_and_kept_layers_agree(capsys):
    """--rounds 2: the list twice, each round's rows compared within it; `:k2`
    (the top two layers kept) trains the same rows to the same first loss."""
    configs = ["mlx-lm:b4", "segctl:b4:unpacked:s1:k2"]
    throughput.cli(TINY + ["--rounds", "2", "--head-chunk", "16", "--configs", ",".join(configs)])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["config"], r["round"]) for r in rows] == [(c, k) for k in (1, 2) for c in configs]
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    kept = [r for r in rows if r["impl"] == "segctl"]
    assert all(r["keep"] == 2 and r["head_chunk"] == 16 for r in kept)
    assert all(abs(r["loss"] - rows[0]["loss"]) <= 1e-3 * abs(rows[0]["loss"]) for r in kept)
    for k in (1, 2):
        assert f"(round {k}):" in err
    lines = [l for l in err.splitlines() if l.startswith("| segctl batch 4, unpacked, segment 1, "
                                                         "top 2 kept |")]
    assert [l.split("|")[-2].strip() for l in lines] == [
        f"{kept[k]['tokens_per_s'] / rows[2 * k]['tokens_per_s']:.2f}x" for k in (0, 1)]


def test_a_fused_rows_update_runs_compiled_unless_asked_eager(capsys):
    """`:fused` compiles the optimizer's update too (as a job's fused step does);
    `:eager-update` runs it op by op: the same rows, the same first loss."""
    configs = ["segctl:b4:unpacked:s1:fused", "segctl:b4:unpacked:s1:fused:eager-update"]
    throughput.cli(TINY + ["--configs", ",".join(configs)])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    assert [(r["fused"], r["fused_update"]) for r in rows] == [(True, True), (True, False)]
    assert rows[0]["loss"] == rows[1]["loss"]
    assert "| segctl batch 4, unpacked, segment 1, fused, update eager |" in err


def test_a_heavier_pass_cuts_the_rows_into_fewer_groups(capsys):
    """`:ptN` weighs each further side-by-side group as N tokens: a pass heavier
    than any group's padding puts the batch's rows into fewer, wider groups,
    and the step trains the same rows to the same first loss."""
    configs = ["segctl:b8:unpadded:s1", "segctl:b8:unpadded:s1:pt0", "segctl:b8:unpadded:s1:pt100000"]
    throughput.cli(TINY + ["--pack-length", "512", "--configs", ",".join(configs)])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    assert [r["pass_tokens"] for r in rows] == [1024, 0, 100000]
    groups = [r["sequences_per_step"] for r in rows]
    assert groups[2] == 1 < groups[1], groups   # 8 rows of <= 64 tokens fit one pass of 512
    assert all(abs(r["loss"] - rows[0]["loss"]) <= 1e-5 * abs(rows[0]["loss"]) for r in rows)
    assert "| segctl batch 8, unpadded, segment 1, a further pass weighed 100000 tokens |" in err


def test_mlx_lm_lengths_would_read_one_token_past_each_row():
    """Why the benchmark hands mlx-lm [prompt_len, len - 1]: iterate_batches' own
    [offset, len] makes default_loss also read the padding after each row."""
    import mlx.core as mx
    from mlx_lm.tuner.trainer import default_loss, iterate_batches

    rows = throughput.make_rows(4, 40, 0.6, 32, 64, 0, 512)
    (arr, lengths), = iterate_batches(rows, 4, 2048)
    assert arr.shape[1] > max(len(ids) for ids, _ in rows)   # at least one padding column
    ntoks = lambda lens: default_loss(lambda x: mx.zeros((*x.shape, 512)), arr, lens)[1].item()
    want = sum(throughput.supervised(r) for r in rows)
    assert ntoks(lengths) == want + 4
    assert ntoks(lengths - mx.array([0, 1])) == want


@pytest.mark.parametrize("argv, says", [
    (["--batches", "1,x"], "argument --batches: '1,x' is not a comma-separated list"),
    (["--configs", "segctl:b4:squashed:s0"], "bad configuration 'segctl:b4:squashed:s0'"),
    (["--configs", "segctl:b4:side:s1:fast"], "bad configuration 'segctl:b4:side:s1:fast'"),
    (["--rows", "6", "--configs", "mlx-lm:b4"], "--rows 6 is not a multiple of mlx-lm:b4's"),
    (["--shape", "llama-70b"], "argument --shape: invalid choice: 'llama-70b'"),
    (["--passes", "0"], "argument --passes: '0': 1 or more, please"),
    (["--rounds", "0"], "argument --rounds: '0': 1 or more, please"),
    (["--head-chunk", "0"], "argument --head-chunk: '0': 1 or more, please"),
    (["--configs", "segctl:b4:side:s0:k1"], "bad configuration 'segctl:b4:side:s0:k1'"),
    (["--configs", "segctl:b4:side:s1:k0"], "bad configuration 'segctl:b4:side:s1:k0'"),
    (["--configs", "segctl:b4:side:s1:k1:k2"], "bad configuration 'segctl:b4:side:s1:k1:k2'"),
    (["--configs", "segctl:b4:side:s1:eager"], "bad configuration 'segctl:b4:side:s1:eager'"),
    (["--configs", "segctl:b4:side:s1:ptx"], "bad configuration 'segctl:b4:side:s1:ptx'"),
    (["--configs", "segctl:b4:side:s1:pt8:pt9"], "bad configuration 'segctl:b4:side:s1:pt8:pt9'"),
    (["table"], "usage: python -m bench.throughput table ROWS.jsonl"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        throughput.cli(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err


def test_table_refuses_a_file_of_other_rows(tmp_path, capsys):
    bad = tmp_path / "rows.jsonl"
    bad.write_text(json.dumps({"arch": "llama", "seq": 64}) + "\n")
    with pytest.raises(SystemExit) as e:
        throughput.cli(["table", str(bad)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == (f"bench.throughput table: {bad}, line 1: "
                                         "not a bench.throughput row")


def test_table_compares_each_run_within_itself():
    """Rows of two runs (two machines, or one at two times) in one file: a table
    each, every ratio against that run's own mlx-lm batch 4."""
    def row(run, config, tps):
        return dict(throughput.parse_config(config), bench="throughput", config=config, run=run,
                    tokens_per_s=tps, peak_gb=1.0, loss=1.0, layers=2, dim=64,
                    lengths={"rows": 8})
    rows = [row("a", "mlx-lm:b4", 100.0), row("a", "segctl:b4:side:s1", 150.0),
            row("b", "mlx-lm:b4", 300.0), row("b", "segctl:b4:side:s1", 330.0)]
    text = throughput.table(rows)
    assert text.count("| configuration |") == 2 and "(run `a`)" in text and "(run `b`)" in text
    assert [l.rsplit("|", 2)[1].strip() for l in text.splitlines()
            if l.startswith("| segctl batch 4, side")] == ["1.50x", "1.10x"]
