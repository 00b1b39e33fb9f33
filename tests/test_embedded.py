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
    finally:
        info = json.loads((home / "fleet.json").read_text()) if (home / "fleet.json").exists() else {}
        down = segctl("cluster", "down", env=env)
        assert down.returncode == 0, down.stderr
    pids = [info["head"]["pid"]] + [n["pid"] for n in info.get("nodes", {}).values() if n.get("pid")]
    assert not [pid for pid in pids if alive(pid)]
