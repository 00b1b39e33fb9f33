"""`segctl tune` end to end: a real Ray head and three real Ray node processes on
this machine in two node classes (two small nodes, one big), the real CLI, probe
runs of the real engine under each node's memory guard, the real plan table.

The small class's budget is set from peaks measured here first, so that at the
sweep's row length segment size 2 fits it and 4 does not; the guard, not the
test, decides which probes "do not fit".
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from segctl.node.raynode import alive
from segctl.schemas.states import Outcome, SweepState, TrialState

from .conftest import letter_model, probe_fresh, segctl

pytestmark = pytest.mark.fleet

PORT = 6473
LENGTHS, SIZES = (128, 256, 384), (1, 2, 4)
# `make test` runs the lab beside this module on two cores, and three engines probe
# here at once: a raylet starved past Ray's 5 missed health checks (about a minute)
# was once marked dead, and `tune` lost its node. A fleet's own cluster keeps Ray's
# default; this one waits 20 checks before it calls a node lost.
PATIENT_RAY = {"RAY_health_check_failure_threshold": 20}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from segctl.orchestrator import planner
    from segctl.schemas.job import load_job
    from segctl.schemas.records import ProbeSpec

    root = tmp_path_factory.mktemp("tune")
    letter_model(root, 12, 3, words=(150, 250))   # ~270 tokens at most
    job = {"name": "base", "model": "model",
           "data": {"train": "data/train.jsonl", "valid": "data/valid.jsonl", "max_seq_length": 512},
           "lora": {"rank": 8}, "train": {"iters": 3, "learning_rate": 1e-4, "val_batches": 1},
           "memory": {"segment_size": "auto"}}
    (root / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    seq_len = planner.longest_row(load_job(root / "job.yaml"))
    assert 256 < seq_len <= 512, seq_len

    # The small budget: size 2 fits at the sweep's rows with room for the margin
    # and the fit's error, size 4 does not.
    p2, p4 = (e["peak_gb"] for e in probe_fresh(
        ProbeSpec(model=str(root / "model"), budget_gb=100, steps=2,
                  points=[(seq_len, 2), (seq_len, 4)]), root))
    low = p2 * 1.12 / 0.9
    assert low < p4 * 0.95, (p2, p4)
    small = round((low + p4 * 0.95) / 2, 5)
    cluster = {
        "head": {"address": "auto", "port": PORT, "stores": str(root / "stores")},
        "planner": {"margin": 0.1},
        "nodes": [
            {"name": "small-a", "local": True, "memory_gb": small, "chip": "sim-s"},
            {"name": "small-b", "local": True, "memory_gb": small, "chip": "sim-s"},
            {"name": "big", "local": True, "memory_gb": 0.5, "chip": "sim-l"},
        ],
    }
    (root / "cluster.yaml").write_text(yaml.safe_dump(cluster, sort_keys=False))
    try:
        up = segctl("cluster", "up", root / "cluster.yaml", timeout=180, env=PATIENT_RAY)
        assert up.returncode == 0, up.stderr
        info = json.loads((root / "stores" / "fleet.json").read_text())
        yield {"root": root, "cluster": root / "cluster.yaml", "stores": root / "stores",
               "small": small, "seq_len": seq_len, "small_class": f"sim-s/{small:g}GB",
               "big_class": "sim-l/0.5GB"}
    finally:   # whatever `up` started, also where it failed or was cut short
        down = segctl("cluster", "down", root / "cluster.yaml", timeout=120)
    assert down.returncode == 0, down.stderr
    pids = [info["head"]["pid"]] + [n["pid"] for n in info["nodes"].values() if n.get("pid")]
    for pid in pids:
        assert not alive(pid), f"process {pid} outlived `segctl cluster down`"


def _tune(fleet, *args) -> dict:
    proc = segctl("tune", "--model", fleet["root"] / "model", "--cluster", fleet["cluster"],
                  "--json", *args, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _plan_rows(fleet) -> list[dict]:
    files = sorted((fleet["stores"] / "telemetry" / "plan").glob("model=*/*.parquet"))
    return [r for f in files for r in pq.read_table(f).to_pylist()]


def _by_class(report: dict) -> dict:
    return {c["node_class"]: c for c in report["classes"]}


# ---------------------------------------------------------------- the tests

def test_tune_measures_the_grid_on_one_node_per_class_and_fits_it(fleet):
    rep = _tune(fleet, "--seq-lens", ",".join(map(str, LENGTHS)),
                "--segment-sizes", ",".join(map(str, SIZES)))
    assert rep["measured"] == 2 * 9 and rep["reused"] == 0 and not rep["failed"]
    cls = _by_class(rep)
    assert set(cls) == {fleet["small_class"], fleet["big_class"]}
    rows = _plan_rows(fleet)
    assert len(rows) == 18
    for name, c in cls.items():
        assert sorted((p["seq_len"], p["segment_size"]) for p in c["points"]) == \
            sorted((L, s) for L in LENGTHS for s in SIZES)
        # one node of each class measured all of its class's points
        assert len({r["node"] for r in rows if r["node_class"] == name}) == 1
        assert c["fitted"] and c["held_out"]["n"] >= 4, (c["points"], c["held_out"])
        # Peaks here are ~10 MB, where an allocator page or two is several percent
        # (runs gave 5-10.1%); the 10% claim is measured at bench scale (bench.tune).
        assert c["held_out"]["max_abs_error"] <= 0.15, c["held_out"]
    # the small budget stops the long, large points: each a measured "does not fit",
    # and every point at least as long and as large stopped too
    stopped = {(p["seq_len"], p["segment_size"]) for p in cls[fleet["small_class"]]["points"]
               if not p["fits"]}
    assert (384, 4) in stopped and (128, 1) not in stopped, stopped
    for L, s in stopped:
        assert {(L2, s2) for L2 in LENGTHS for s2 in SIZES if L2 >= L and s2 >= s} <= stopped
    assert all(p["fits"] for p in cls[fleet["big_class"]]["points"])
    for r in rows:
        if not r["fits"]:
            assert r["peak_gb"] >= fleet["small"] and "crossed" in r["message"]
        else:
            assert r["step_s"] > 0 and r["phases"][-1] == "update"
    png = Path(rep["plot"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # per length, what auto now plans: at 256 tokens the small class stays under size 4
    small256 = next(p for p in cls[fleet["small_class"]]["plans"] if p["seq_len"] == 256)
    assert small256["fits"] and small256["segment_size"] <= 2 and small256["source"] == "measured"
    assert small256["predicted_gb"] <= fleet["small"] * 0.9


def test_retune_reuses_measurements_and_the_fit_predicted_the_new_length(fleet):
    from segctl.orchestrator import measured
    before = measured.models_of(measured.read_plan(fleet["stores"], _model_key(fleet)))
    rep = _tune(fleet, "--seq-lens", "128,192,256,384", "--segment-sizes", "1,2,4")
    assert rep["measured"] == 2 * 3 and rep["reused"] == 2 * 9
    new = [r for r in _plan_rows(fleet) if r["tune"] == rep["tune"]]
    assert sorted({r["seq_len"] for r in new}) == [192]
    for r in new:
        if not r["fits"]:
            continue
        model = before[(r["method"], r["node_class"], r["head_chunk"], r["attn_block"], "")]
        err = model.predict(192, r["segment_size"]) / r["peak_gb"] - 1
        assert abs(err) <= 0.10, (r["node_class"], r["segment_size"], err)
    # --force measures again, and the newer rows are the ones read
    forced = _tune(fleet, "--seq-lens", "128", "--segment-sizes", "1", "--force")
    assert forced["measured"] == 2 and forced["reused"] == 0
    latest = measured.read_plan(fleet["stores"], _model_key(fleet))
    assert {r["tune"] for r in latest if (r["seq_len"], r["segment_size"]) == (128, 1)} == \
        {forced["tune"]}


def _model_key(fleet) -> str:
    from segctl.orchestrator import planner
    return planner.model_key(planner.model_info(str(fleet["root"] / "model")))


def test_auto_plans_differ_by_class_and_the_sweep_runs_with_no_oom(fleet):
    sweep = {"name": "tuned", "base": "job.yaml", "concurrency": 3, "retries": 0,
             "grid": {"memory.segment_size": ["auto", 4], "lora.rank": [4, 8]}}
    path = fleet["root"] / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    plan = segctl("plan", path, "--cluster", fleet["cluster"], "--json")
    assert plan.returncode == 0, plan.stderr
    small_c, big_c = fleet["small_class"], fleet["big_class"]
    chosen = {}
    for row in json.loads(plan.stdout):
        small, big = row["classes"][small_c], row["classes"][big_c]
        assert small["source"] == big["source"] == "measured", row
        assert big["fits"], row
        if row["params"]["memory.segment_size"] == 4:
            assert not small["fits"], row   # size 4 never goes to the small class
        else:
            assert small["fits"] and small["segment_size"] <= 2, row
            assert small["predicted_gb"] <= fleet["small"] * 0.9
            chosen[row["params"]["lora.rank"]] = (small["segment_size"], big["segment_size"])
    text = segctl("plan", path, "--cluster", fleet["cluster"])
    assert text.returncode == 0 and "measured" in text.stdout

    proc = segctl("submit", path, "--cluster", fleet["cluster"], "--json", timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sid = proc.stderr.split("sweep ")[1].split(":")[0]
    st = segctl("status", sid, "--cluster", fleet["cluster"], "--json")
    [sw] = json.loads(st.stdout)
    assert sw["state"] == SweepState.DONE
    for t in sw["trials"]:
        assert t["state"] == TrialState.SUCCEEDED, t
        [a] = t["attempts"]           # no OOM, no retry: one attempt each
        assert a["outcome"] == Outcome.SUCCEEDED, a
        small_node = a["node"].startswith("small")
        if t["params"]["memory.segment_size"] == 4:
            assert a["node"] == "big" and a["segment_size"] == 4, a
        else:
            want = chosen[t["params"]["lora.rank"]][0 if small_node else 1]
            assert a["segment_size"] == want, (a, chosen)
        if small_node:
            assert a["peak_gb"] <= fleet["small"]
