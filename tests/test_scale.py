"""The scale bench's simulated fleet (bench/simfleet.py) at a tiny size, through the
real head actor on a real Ray head node: 3 simulated nodes, 20 trials of 5 steps.
Checks correctness only (bench/scale.py prints the numbers): every trial
succeeded, Parquet holds one steps row per trial and step, the checkpoints and
adapters reached the stores, and `segctl status`, `logs` and `gather` work on the
finished sweep through the real CLI (bench.scale.run asserts their exit codes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from bench.scale import run

pytestmark = pytest.mark.fleet

NODES, TRIALS, STEPS = 3, 20, 5


def test_simulated_fleet_runs_a_sweep_through_the_real_head(tmp_path):
    row = run(argparse.Namespace(
        nodes=NODES, trials=TRIALS, steps_per_trial=STEPS, step_s=0.01, max_trials=1,
        eval_every=0, checkpoint_every=2, hosts=2, timeout=240, dir=str(tmp_path), keep=True,
        profile=None, load_before=None))
    stores = Path(row["stores"])
    assert row["succeeded"] == TRIALS and row["attempts"] == TRIALS, row
    assert 0 < row["head_private_max_mb"] <= row["head_rss_max_mb"], row   # its own pages: part of RSS
    steps = ds.dataset(stores / "telemetry" / "steps", format="parquet",
                       partitioning="hive").to_table()
    assert steps.num_rows == TRIALS * STEPS == row["step_rows"]
    per_trial = {}
    for t, s in zip(steps["trial"].to_pylist(), steps["step"].to_pylist()):
        per_trial.setdefault(t, []).append(s)
    assert len(per_trial) == TRIALS
    assert all(sorted(s) == list(range(1, STEPS + 1)) for s in per_trial.values())
    # one memory row per step (the phase events), checkpoints and the adapter per trial
    from segctl.orchestrator.stores import Stores
    st = Stores(stores)
    for trial in per_trial:
        assert st.has_adapter(trial)
        assert st.latest_checkpoint(trial)[0] == 4   # steps 2 and 4 (none at the last)
    # gather exported every trial's adapter, byte for byte what the head stored
    manifest = json.loads((stores.parent / "all" / "manifest.json").read_text())
    assert sorted(m["trial"] for m in manifest) == sorted(per_trial)
    some = manifest[0]["trial"]
    assert (stores.parent / "all" / some / "adapters.safetensors").read_bytes() == \
        st.adapter_files(some)["adapters.safetensors"]


def test_adapter_bench_files_one_adapter_as_four_files():
    from bench.scale import adapter_cost
    row = adapter_cost(n=2)   # it checks the bytes read back are the bytes put
    assert row["tensors"] == 56 and row["demo_shape"]
    assert row["files_per_adapter"] == 4   # the trial's group, the adapter's, its array and chunk
