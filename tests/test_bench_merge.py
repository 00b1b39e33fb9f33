"""bench/merge.py: the one-graph functions it times compute today's step (`joint`,
the forward inside the vjp with the head's chunks checkpointed, too)."""

from __future__ import annotations

import json

import pytest

from bench import merge


def test_one_graph_functions_compute_the_segmented_step(capsys):
    rows = merge.cli(["--layers", "2", "--rows", "2", "--tokens", "48", "--repeats", "1",
                      "--masks", "causal,none"])
    out, err = capsys.readouterr()
    assert [json.loads(line) for line in out.splitlines()] == rows
    # then the table on stderr: a table a mask, each function against today's graphs
    assert err.count("| function | seconds | peak GB | vs segmented |") == 2
    assert err.count("| segmented |") == 2 and err.count("| 1.00x |") >= 2
    assert merge.table(rows).strip() == err.strip()
    names = ["fwd", "bwd", "head", "segmented", "one", "one_vjp", "simple", "simple_vjp", "joint"]
    for mask in ("causal", "none"):
        timed = [r for r in rows if r["mask"] == mask and r["fn"] != "check"]
        assert [r["fn"] for r in timed] == names
        assert all(r["seconds"] > 0 and r["peak_gb"] > 0 for r in timed)
        checks = {r["of"]: r for r in rows if r["mask"] == mask and r["fn"] == "check"}
        assert sorted(checks) == ["joint", "one", "one_vjp"]
        for r in checks.values():   # fp32 on this CPU: the same arithmetic
            ref, got = r["loss"]
            assert abs(got - ref) <= 1e-5 * abs(ref) and r["dx_max_rel"] <= 1e-5, r


@pytest.mark.parametrize("argv, says", [
    (["--layers", "0"], "argument --layers: '0': 1 or more, please"),
    (["--masks", "causal,full"], "argument --masks: 'causal,full': causal, none or both"),
    (["--shape", "llama"], "argument --shape: invalid choice: 'llama'"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        merge.cli(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
