"""The embedded default: no cluster file. `segctl submit` starts Ray on this
machine as a one-node fleet with its real memory and keeps the stores in
$SEGCTL_HOME; `segctl cluster down` stops what it started."""

from __future__ import annotations

import json

import yaml

from node.probe import default_name, probe
from node.raynode import alive

from .conftest import assert_one_line_error, segctl


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
        assert trial["state"] == "SUCCEEDED" and a["node"] == default_name()
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

        # ORPO jobs go through the same fleet unchanged: a Gemma-4 preference sweep
        # over orpo.lambda on the running one-node fleet.
        orpo = tmp_path / "orpo"
        assert segctl("init-demo", orpo, "--arch", "gemma4_text", "--method", "orpo").returncode == 0
        sweep = {"name": "orpo", "base": "job.yaml", "grid": {
            "orpo.lambda": [0.1, 0.5], "train.iters": [4], "train.eval_every": [2],
            "train.checkpoint_every": [2], "memory.segment_size": ["auto"]}}
        (orpo / "orpo.yaml").write_text(yaml.safe_dump(sweep))
        proc = segctl("submit", orpo / "orpo.yaml", env=env, timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
        sweeps = {s["sweep"]: s for s in json.loads(segctl("status", "--json", env=env).stdout)}
        trials = sweeps["orpo-1"]["trials"]
        assert [t["state"] for t in trials] == ["SUCCEEDED", "SUCCEEDED"], trials
        import pyarrow.dataset as ds
        steps = ds.dataset(home / "telemetry" / "steps", partitioning="hive").to_table(
            filter=ds.field("sweep") == "orpo-1").to_pylist()
        assert len(steps) == 8
        assert all(r["margin"] is not None and r["prefix_shared"] for r in steps)
        out = tmp_path / "best"
        assert segctl("gather", "orpo-1", "--out", out, "--best", "1", env=env).returncode == 0
        from mlx_lm import load
        [folder] = [p for p in out.iterdir() if p.is_dir()]
        load(str(orpo / "model"), adapter_path=str(folder))

        # DPO too: a beta sweep over a gpt-oss demo (sinks, sliding layers, MoE).
        dpo = tmp_path / "dpo"
        assert segctl("init-demo", dpo, "--arch", "gpt_oss", "--method", "dpo").returncode == 0
        sweep = {"name": "dpo", "base": "job.yaml", "grid": {
            "dpo.beta": [0.1, 0.5], "train.iters": [4], "train.eval_every": [2],
            "train.checkpoint_every": [2], "memory.segment_size": ["auto"]}}
        (dpo / "dpo.yaml").write_text(yaml.safe_dump(sweep))
        proc = segctl("submit", dpo / "dpo.yaml", env=env, timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
        sweeps = {s["sweep"]: s for s in json.loads(segctl("status", "--json", env=env).stdout)}
        trials = sweeps["dpo-1"]["trials"]
        assert [t["state"] for t in trials] == ["SUCCEEDED", "SUCCEEDED"], trials
        assert sorted(t["params"]["dpo.beta"] for t in trials) == [0.1, 0.5]
        steps = ds.dataset(home / "telemetry" / "steps", partitioning="hive").to_table(
            filter=ds.field("sweep") == "dpo-1").to_pylist()
        assert len(steps) == 8
        assert all(r["margin"] is not None and r["chosen_reward"] is not None for r in steps)
    finally:
        info = json.loads((home / "fleet.json").read_text()) if (home / "fleet.json").exists() else {}
        down = segctl("cluster", "down", env=env)
        assert down.returncode == 0, down.stderr
    pids = [info["head"]["pid"]] + [n["pid"] for n in info.get("nodes", {}).values() if n.get("pid")]
    assert not [pid for pid in pids if alive(pid)]
