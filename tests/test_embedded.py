"""The embedded default: no cluster file. `segctl submit` starts Ray on this
machine as a one-node fleet with its real memory and keeps the stores in
$SEGCTL_HOME; `segctl cluster down` stops what it started."""

from __future__ import annotations

import json

import pytest
import yaml

from segctl.node.hardware import default_name, probe
from segctl.node.raynode import alive
from segctl.schemas.states import TrialState

from .conftest import assert_one_line_error, segctl

pytestmark = pytest.mark.fleet


def preference_sweep(tmp_path, env, arch: str, method: str, knob: str) -> list[dict]:
    """A 2-trial sweep over `knob` (0.1, 0.5) on a `method` demo of `arch`; every
    trial succeeds; returns its step rows from the telemetry store."""
    import pyarrow.dataset as ds
    folder = tmp_path / method
    assert segctl("init-demo", folder, "--arch", arch, "--method", method).returncode == 0
    sweep = {"name": method, "base": "job.yaml", "grid": {
        knob: [0.1, 0.5], "train.iters": [4], "train.eval_every": [2],
        "train.checkpoint_every": [2], "memory.segment_size": ["auto"]}}
    (folder / "sweep2.yaml").write_text(yaml.safe_dump(sweep))
    proc = segctl("submit", folder / "sweep2.yaml", env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sweeps = {s["sweep"]: s for s in json.loads(segctl("status", "--json", env=env).stdout)}
    trials = sweeps[f"{method}-1"]["trials"]
    assert [t["state"] for t in trials] == [TrialState.SUCCEEDED, TrialState.SUCCEEDED], trials
    assert sorted(t["params"][knob] for t in trials) == [0.1, 0.5]
    steps = ds.dataset(env["SEGCTL_HOME"] / "telemetry" / "steps", partitioning="hive").to_table(
        filter=ds.field("sweep") == f"{method}-1").to_pylist()
    assert len(steps) == 8
    return steps


def test_submit_a_job_on_this_machine_then_status_logs_and_down(demo_dir, tmp_path):
    home = tmp_path / "home"
    env = {"SEGCTL_HOME": home, "SEGCTL_CLUSTER": None}
    job = yaml.safe_load((demo_dir / "job.yaml").read_text())
    job.update(model=str(demo_dir / "model"), output=None)
    job["data"].update(train=str(demo_dir / "data/train.jsonl"), valid=str(demo_dir / "data/valid.jsonl"))
    job["train"].update(iters=6, eval_every=3, checkpoint_every=3)
    job["memory"]["segment_size"] = "auto"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))

    # nothing is running yet: cancel has no head to talk to, status has no state
    assert_one_line_error(segctl("status", env=env), "no sweeps recorded here yet")

    try:
        proc = segctl("submit", tmp_path / "job.yaml", env=env, timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
        [sweep] = json.loads(segctl("status", "--json", env=env).stdout)
        [trial] = sweep["trials"]
        [a] = trial["attempts"]
        assert trial["state"] == TrialState.SUCCEEDED and a["node"] == default_name()
        assert a["segment_size"] == 4   # auto: every layer in one segment fits this machine

        nodes = json.loads(segctl("cluster", "status", "--json", env=env).stdout)
        assert [(n["name"], n["memory_gb"], n["trial"]) for n in nodes] == [
            (default_name(), probe().memory_gb, None)]

        logs = segctl("logs", trial["trial"], env=env)
        assert logs.returncode == 0, logs.stderr
        for fragment in ("PENDING -> PLACED", "step 6: loss", "eval at step 3",
                         "checkpoint at step 3", "RUNNING -> SUCCEEDED"):
            assert fragment in logs.stdout, (fragment, logs.stdout)
        assert (home / "state.db").exists() and (home / "adapters.zarr").exists()

        # Preference jobs go through the same fleet unchanged: a Gemma-4 ORPO sweep
        # over orpo.lambda, and a gpt-oss (sinks, sliding layers, MoE) DPO sweep
        # over dpo.beta, on the running one-node fleet.
        steps = preference_sweep(tmp_path, env, "gemma4_text", "orpo", "orpo.lambda")
        assert all(r["margin"] is not None and r["prefix_shared"] for r in steps)
        out = tmp_path / "best"
        assert segctl("gather", "orpo-1", "--out", out, "--best", "1", env=env).returncode == 0
        from mlx_lm import load
        [folder] = [p for p in out.iterdir() if p.is_dir()]
        load(str(tmp_path / "orpo" / "model"), adapter_path=str(folder))

        steps = preference_sweep(tmp_path, env, "gpt_oss", "dpo", "dpo.beta")
        assert all(r["margin"] is not None and r["chosen_reward"] is not None for r in steps)
    finally:
        info = json.loads((home / "fleet.json").read_text()) if (home / "fleet.json").exists() else {}
        down = segctl("cluster", "down", env=env)
        assert down.returncode == 0, down.stderr
    pids = [info["head"]["pid"]] + [n["pid"] for n in info.get("nodes", {}).values() if n.get("pid")]
    assert not [pid for pid in pids if alive(pid)]
