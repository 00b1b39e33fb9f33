"""ASHA on real Ray: the embedded default fleet (`segctl submit` without a cluster
file starts Ray on this machine as one node running DEFAULT_MAX_TRIALS attempts at
once), the demo model, the real engine in fresh processes. test_asha drives the
controller's decisions turn by turn; this checks that they reach a real fleet:
the stop cancels a running engine process, the sweep still ends DONE, `submit`
exits 0 and `gather` exports a finished trial.

The outcome does not depend on timing. Placement takes pending trials in their
order and the sweep's concurrency is 2, so the two good learning rates (t000,
t001) run first and hold both slots to the end: their values are the first two
at rung 1 (step 9) and nobody is judged on two values. Every later trial has a
learning rate too small to learn (val_loss ~6.9 at step 9 against ~2.2 and ~3.2):
arriving with n <= 6 values of which two are good, the cutoff (the 1/3 quantile
interpolated) lies below it, so each one is stopped, whatever order they arrive in.
Rung 2 (step 27) sees only the two good ones: no decision. Each bad trial has 54
steps left after its rung-1 eval, seconds for the stop to land.
"""

from __future__ import annotations

import json

import pytest
import yaml

from segctl.node.raynode import alive
from segctl.schemas.states import Outcome, SweepState, TrialState

from .conftest import segctl

pytestmark = pytest.mark.fleet

GRACE, MAX_STEPS = 9, 63                      # rungs at steps 9 and 27
GOOD = [4e-4, 2e-4]                           # t000, t001: learn fast (warmup 10)
BAD = [1e-7, 2e-7, 3e-7, 5e-7]                # learn nothing in 9 steps


def test_asha_stops_the_weak_trials_of_a_sweep_on_the_embedded_fleet(demo_dir, tmp_path):
    home = tmp_path / "home"
    env = {"SEGCTL_HOME": home, "SEGCTL_CLUSTER": None}
    job = yaml.safe_load((demo_dir / "job.yaml").read_text())
    job.update(model=str(demo_dir / "model"), output=None)
    job["data"].update(train=str(demo_dir / "data/train.jsonl"),
                       valid=str(demo_dir / "data/valid.jsonl"))
    job["train"].update(iters=MAX_STEPS, eval_every=GRACE, checkpoint_every=GRACE, val_batches=4)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    sweep = {"name": "asha", "base": "job.yaml",
             "grid": {"train.learning_rate": GOOD + BAD},
             "concurrency": 2, "retries": 1,
             "scheduler": {"type": "asha", "metric": "val_loss", "grace_steps": GRACE,
                           "reduction": 3, "max_steps": MAX_STEPS}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))

    try:
        proc = segctl("submit", tmp_path / "sweep.yaml", env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        st = segctl("status", "--json", env=env)
        assert st.returncode == 0, st.stderr
        [sw] = json.loads(st.stdout)
        assert sw["state"] == SweepState.DONE, sw
        by_lr = {t["params"]["train.learning_rate"]: t for t in sw["trials"]}
        assert len(by_lr) == len(GOOD + BAD)

        for lr in GOOD:
            t = by_lr[lr]
            assert t["state"] == TrialState.SUCCEEDED, t
            assert t["attempts"][-1]["step"] == MAX_STEPS, t

        stopped = [by_lr[lr] for lr in BAD if by_lr[lr]["state"] == TrialState.STOPPED]
        assert stopped, [(t["trial"], t["state"], t["message"]) for t in sw["trials"]]
        # every bad one is stopped (see the module's docstring for why order cannot matter)
        assert len(stopped) == len(BAD), [(t["trial"], t["state"]) for t in sw["trials"]]
        for t in stopped:
            assert t["message"].startswith("asha: val_loss ") and "at rung 1 (step 9)" in t["message"], t
            [a] = t["attempts"]   # the stop cancels the attempt: not retried
            assert a["outcome"] == Outcome.CANCELLED, a
            assert a["step"] is not None and GRACE <= a["step"] < MAX_STEPS, a

        # logs show the transition with its reason
        logs = segctl("logs", stopped[0]["trial"], env=env)
        assert logs.returncode == 0, logs.stderr
        assert "-> STOPPED" in logs.stdout and "asha:" in logs.stdout, logs.stdout[-2000:]

        # gather --best 1 exports a finished trial, never a stopped one
        out = tmp_path / "best"
        g = segctl("gather", sw["sweep"], "--out", out, "--best", "1", env=env)
        assert g.returncode == 0, g.stderr
        [m] = json.loads((out / "manifest.json").read_text())
        assert m["trial"] in {by_lr[lr]["trial"] for lr in GOOD}, m
    finally:
        info = json.loads((home / "fleet.json").read_text()) if (home / "fleet.json").exists() else {}
        down = segctl("cluster", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    pids = ([info["head"]["pid"]] if info.get("head") else []) + [
        n["pid"] for n in info.get("nodes", {}).values() if n.get("pid")]
    assert not [pid for pid in pids if alive(pid)]
