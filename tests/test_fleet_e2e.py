"""The fleet end to end: a real Ray head and three real Ray node processes on this
machine (`local: true` nodes of different memory budgets), the real CLI, the real
engine in fresh processes, real state.db / Parquet / zarr stores.

Budgets are set from peaks measured here first, so "fits" and "out of memory"
are decided by the engine's own memory guard, not by the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as pads
import pytest
import yaml

from segctl.node.raynode import alive
from segctl.schemas.states import Outcome, SweepState, TrialState

from .conftest import assert_one_line_error, cli_env, letter_model, segctl

pytestmark = pytest.mark.fleet

PORT = 6471


def _peak(root: Path, seg: int) -> float:
    job = {"name": f"probe{seg}", "model": str(root / "model"), "output": str(root / f"probe{seg}"),
           "data": {"train": str(root / "data/train.jsonl"), "max_seq_length": 512},
           "train": {"iters": 2}, "memory": {"segment_size": seg}}
    path = root / f"probe{seg}.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = segctl("train", path, "--json")
    assert proc.returncode == 0, proc.stderr
    return max(json.loads(l)["peak_gb"] for l in proc.stdout.splitlines() if '"event":"step"' in l)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    letter_model(root, 40, 6, words=(300, 400))   # ~300-400 tokens a row
    peaks = {seg: _peak(root, seg) for seg in (1, 4)}
    assert peaks[4] > 1.5 * peaks[1], peaks
    small = round((peaks[1] + peaks[4]) / 2, 4)   # seg 1 fits, seg 4 does not
    cluster = {
        "head": {"address": "auto", "port": PORT, "stores": str(root / "stores")},
        "planner": {"margin": 0.1, "scale": 1.0},
        "nodes": [
            {"name": "small", "local": True, "memory_gb": small, "chip": "sim-s", "labels": {"pool": "a"}},
            # medium and large are cabled for JACCL (this machine has no RDMA: the
            # nodes find their devices with the stand-in ibv_devices below)
            {"name": "medium", "local": True, "memory_gb": 0.25, "chip": "sim-m", "labels": {"pool": "b"},
             "rdma": {"large": "rdma_en3"}},
            {"name": "large", "local": True, "memory_gb": 0.5, "chip": "sim-l", "labels": {"pool": "b"},
             "rdma": {"medium": "rdma_en2"}},
        ],
    }
    (root / "bin").mkdir()
    (root / "bin" / "ibv_devices").write_text(f"#!/bin/sh\ncat {root / 'ibv_devices.txt'}\n")
    (root / "bin" / "ibv_devices").chmod(0o755)
    (root / "ibv_devices.txt").write_text("    device          node GUID\n    ------   ----------\n")
    (root / "cluster.yaml").write_text(yaml.safe_dump(cluster, sort_keys=False))
    job = {"name": "base", "model": "model",
           "data": {"train": "data/train.jsonl", "valid": "data/valid.jsonl", "max_seq_length": 512},
           "lora": {"rank": 4}, "train": {"iters": 4, "learning_rate": 1e-4, "val_batches": 2},
           "memory": {"segment_size": 1}}
    (root / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    try:
        up = segctl("cluster", "up", root / "cluster.yaml", timeout=180,
                    env={"PATH": f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}"})
        assert up.returncode == 0, up.stderr
        fleet_info = json.loads((root / "stores" / "fleet.json").read_text())
        yield {"root": root, "cluster": root / "cluster.yaml", "stores": root / "stores",
               "peaks": peaks, "small": small, "info": fleet_info}
        # a test may have replaced a node it took away: the processes recorded now count too
        now = json.loads((root / "stores" / "fleet.json").read_text())
    finally:
        # whatever `up` started, also where it failed or was cut short (a Ctrl-C):
        # a head left running holds the port and token the next run's fleet needs
        down = segctl("cluster", "down", root / "cluster.yaml", timeout=120)
    assert down.returncode == 0, down.stderr
    for pid in set(_pids(fleet_info) + _pids(now)):
        assert not alive(pid), f"process {pid} outlived `segctl cluster down`"


def _pids(info: dict) -> list[int]:
    pids = [info["head"]["pid"]] if info.get("head") else []
    return pids + [n["pid"] for n in info.get("nodes", {}).values() if n.get("pid")]


def _sweep(fleet, name: str, *, train: dict | None = None, job: dict | None = None,
           **spec) -> Path:
    """Write sweep `name` over the module's job.yaml (its `train` section updated by
    `train`, or the job inline with `job`'s keys replaced)."""
    base = yaml.safe_load((fleet["root"] / "job.yaml").read_text())
    base["train"].update(train or {})
    if job is not None:
        spec["job"] = dict(base, **job)
    else:
        (fleet["root"] / f"{name}-job.yaml").write_text(yaml.safe_dump(base))
        spec["base"] = f"{name}-job.yaml"
    path = fleet["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(name=name, **spec), sort_keys=False))
    return path


def _status(fleet, sid: str) -> dict:
    proc = segctl("status", sid, "--cluster", fleet["cluster"], "--json")
    assert proc.returncode == 0, proc.stderr
    [sweep] = json.loads(proc.stdout)
    return sweep


def _wait(fleet, sid: str, until, timeout: float = 180) -> dict:
    deadline = time.time() + timeout
    while True:
        sw = _status(fleet, sid)
        if until(sw):
            return sw
        assert time.time() < deadline, json.dumps(sw, indent=1)[-3000:]
        time.sleep(0.5)


def _steps(fleet, sid: str):
    ds = pads.dataset(fleet["stores"] / "telemetry" / "steps", partitioning="hive")
    return ds.to_table(filter=pads.field("sweep") == sid).to_pylist()


# ---------------------------------------------------------------- the tests

def test_cluster_status_lists_the_nodes(fleet):
    proc = segctl("cluster", "status", fleet["cluster"], "--json")
    assert proc.returncode == 0, proc.stderr
    nodes = {n["name"]: n for n in json.loads(proc.stdout)}
    assert {k for k, n in nodes.items() if n["trains"]} == {"small", "medium", "large"}
    assert nodes["small"]["memory_gb"] == fleet["small"] and nodes["large"]["chip"] == "sim-l"
    assert all(n["alive"] and not n["trial"] for n in nodes.values())


def test_sweep_spreads_over_nodes_and_big_trials_avoid_the_small_one(fleet, tmp_path):
    path = _sweep(fleet, "spread", grid={"memory.segment_size": [1, 4],
                                         "train.learning_rate": [1e-4, 2e-4],
                                         "lora.rank": [4, 8]})
    plan = segctl("plan", path, "--cluster", fleet["cluster"], "--json")
    assert plan.returncode == 0, plan.stderr
    for row in json.loads(plan.stdout):
        small = row["classes"][f"sim-s/{fleet['small']:g}GB"]
        assert small["fits"] == (row["params"]["memory.segment_size"] == 1), row

    proc = segctl("submit", path, "--cluster", fleet["cluster"], "--json", timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sid = proc.stderr.split("sweep ")[1].split(":")[0]
    sw = _status(fleet, sid)
    assert len(sw["trials"]) == 8 and sw["state"] == SweepState.DONE
    used = set()
    for t in sw["trials"]:
        assert t["state"] == TrialState.SUCCEEDED, t
        [a] = t["attempts"]
        assert {"node", "segment_size", "outcome", "peak_gb"} <= set(a)
        used.add(a["node"])
        if t["params"]["memory.segment_size"] == 4:
            assert a["node"] != "small", t
        assert a["peak_gb"] is not None and a["dispatch_s"] is not None
    assert len(used) >= 2, used
    # telemetry: 4 step rows per trial, each once, in the sweep's partition
    rows = _steps(fleet, sid)
    assert sorted((r["trial"], r["step"]) for r in rows) == sorted(
        (t["trial"], s) for t in sw["trials"] for s in range(1, 5))
    import zarr
    mem = zarr.open_group(str(fleet["stores"] / "memory.zarr"), mode="r")
    a = sw["trials"][0]["attempts"][0]
    arr = mem[f"{sid}/{sw['trials'][0]['trial']}/attempt-{a['attempt']}"]
    assert arr.shape[0] == 4 and arr.shape[1] == len(arr.attrs["phases"])

    # gather the 3 best: folders mlx-lm loads as they are
    out = tmp_path / "best"
    g = segctl("gather", sid, "--out", out, "--best", "3", "--cluster", fleet["cluster"])
    assert g.returncode == 0, g.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest) == 3
    losses = [m["metrics"]["val_loss"] for m in manifest]
    everything = sorted(t["val_loss"] for t in sw["trials"])
    assert sorted(losses) == everything[:3]
    import hashlib
    for m in manifest:
        for name, sha in m["files"].items():
            assert hashlib.sha256((out / m["trial"] / name).read_bytes()).hexdigest() == sha
    # mlx-lm loads the best one with its adapter: the adapter changes the model's
    # logits, and mlx-lm's greedy generation continues the prompt with the tuned
    # model's own top token (at most max_tokens of them, each in the vocabulary)
    proc = subprocess.run([sys.executable, "-c", ADAPTER_CHECK, str(fleet["root"] / "model"),
                           str(out / manifest[0]["trial"])], capture_output=True, text=True,
                          env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["shift"] > 0, got
    assert 1 <= len(got["tokens"]) <= 3 and got["tokens"][0] == got["greedy"], got
    assert all(0 <= t < got["vocab"] for t in got["tokens"]), got
    again = segctl("gather", sid, "--out", out, "--cluster", fleet["cluster"])
    assert_one_line_error(again, "not empty")


ADAPTER_CHECK = """
import json, sys
import mlx.core as mx, mlx_lm
from mlx_lm import stream_generate
base, tok = mlx_lm.load(sys.argv[1])
tuned, _ = mlx_lm.load(sys.argv[1], adapter_path=sys.argv[2])
ids = tok.encode("after a")
x = mx.array([ids])
out = list(stream_generate(tuned, tok, ids, max_tokens=3))
print(json.dumps({"shift": mx.max(mx.abs(base(x) - tuned(x))).item(),
                  "greedy": mx.argmax(tuned(x)[0, -1]).item(), "vocab": tuned(x).shape[-1],
                  "tokens": [r.token for r in out]}))
"""


def test_forced_oom_is_replanned_smaller_and_succeeds(fleet):
    # A planner told to trust a quarter of its estimate places segment_size 4 on the
    # small node; the engine's guard stops it there, and the re-plan goes smaller.
    spec = yaml.safe_load(fleet["cluster"].read_text())
    spec["planner"]["scale"] = 0.25
    optimistic = fleet["root"] / "optimistic.yaml"
    optimistic.write_text(yaml.safe_dump(spec))
    path = _sweep(fleet, "oom", placement={"name": "small"}, retries=4,
                  grid={"memory.segment_size": [4]})
    proc = segctl("submit", path, "--cluster", optimistic, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sid = proc.stderr.split("sweep ")[1].split(":")[0]
    [t] = _status(fleet, sid)["trials"]
    outcomes = [a["outcome"] for a in t["attempts"]]
    assert t["state"] == TrialState.SUCCEEDED and outcomes[0] == Outcome.OOM and outcomes[-1] == Outcome.SUCCEEDED, t
    sizes = [a["segment_size"] for a in t["attempts"]]
    assert sizes[0] == 4 and sizes == sorted(sizes, reverse=True) and sizes[-1] < 4, sizes
    assert all(a["node"] == "small" for a in t["attempts"])
    assert "crossed memory.budget_gb" in t["attempts"][0]["message"]
    reasons = [json.loads(l)["reason"] for l in proc.stdout.splitlines()]
    assert any("re-plan below segment_size 4" in r for r in reasons), reasons


def test_cancel_then_resume_after_a_head_restart(fleet):
    # t001 is long enough to be mid-run when the head goes away
    path = _sweep(fleet, "resume", train={"checkpoint_every": 5}, concurrency=1,
                  placement={"pool": "b"}, grid={"train.iters": [8, 120, 8]})
    # submitted and followed, as a user does: the head's death ends the wait below
    follower = subprocess.Popen([sys.executable, "-m", "segctl.orchestrator.cli", "submit", path,
                                 "--cluster", fleet["cluster"], "--json"], env=cli_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = follower.stderr.readline()   # "sweep resume-1: 3 trials"
    assert first.startswith("sweep "), first
    sid = first.split()[1].rstrip(":")
    t0, t1, t2 = (f"{sid}-t{i:03d}" for i in range(3))
    c = segctl("cancel", t2, "--cluster", fleet["cluster"])
    assert c.returncode == 0 and t2 in c.stdout, c.stderr
    _wait(fleet, sid, lambda sw: sw["trials"][0]["state"] == TrialState.SUCCEEDED
          and sw["trials"][1]["attempts"] and (sw["trials"][1]["attempts"][-1]["step"] or 0) >= 12)

    # The head goes away mid-trial (its actor killed, as a crash or restart would).
    # ray.kill returns before the actor is dead: wait until its name is free, or
    # `resume` could still reach the dying head and no new one would start.
    kill = ("from orchestrator import fleet; from schemas.cluster import load_cluster; import ray;"
            "import time;"
            f"fleet.connect(load_cluster('{fleet['cluster']}'), start=False);"
            "ray.kill(ray.get_actor('segctl-head', namespace='segctl'));"
            "end = time.monotonic() + 60\n"
            "while time.monotonic() < end:\n"
            "    try: ray.get_actor('segctl-head', namespace='segctl')\n"
            "    except ValueError: break\n"
            "    time.sleep(0.2)\n"
            "else: raise SystemExit('the killed head still answers to its name')")
    k = subprocess.run([sys.executable, "-c", kill], capture_output=True, text=True,
                       env=cli_env(), timeout=120)
    assert k.returncode == 0, k.stderr[-2000:]
    # the follower notices within a check or two and says how to go on
    assert follower.wait(timeout=90) == 1
    said = follower.stderr.read()
    assert f"`segctl resume {sid}` continues it" in said and "Traceback" not in said, said

    try:
        r = segctl("resume", sid, "--cluster", fleet["cluster"], "--json", timeout=300)
    except subprocess.TimeoutExpired:   # what the sweep waited for, in the failure
        pytest.fail(f"`segctl resume` did not end: {json.dumps(_status(fleet, sid))[-3000:]}")
    assert r.returncode == 1, r.stderr[-2000:]     # one trial was cancelled
    sw = _status(fleet, sid)
    states = [t["state"] for t in sw["trials"]]
    assert states == [TrialState.SUCCEEDED, TrialState.SUCCEEDED, TrialState.CANCELLED] and (
        sw["state"] == SweepState.DONE), sw
    assert [a["outcome"] for a in sw["trials"][0]["attempts"]] == [Outcome.SUCCEEDED]   # never rerun
    second = sw["trials"][1]["attempts"]
    assert [a["outcome"] for a in second] == [Outcome.INTERRUPTED, Outcome.SUCCEEDED], second
    assert second[1]["resume_step"] >= 10
    assert sw["trials"][2]["attempts"] == []
    _no_duplicate_steps(_steps(fleet, sid), t1, 120)
    # concurrency 1 on two free nodes: the attempts never overlapped
    spans = sorted((a["started"], a["ended"]) for t in sw["trials"] for a in t["attempts"])
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:])), spans


def test_higher_priority_runs_first_and_a_broken_model_fails_with_the_engines_message(fleet):
    # low's first trial runs until this test cancels it, once high is queued, so
    # high surely arrives while it runs (one at a time: the node runs two trials
    # at once, and this is about the queue)
    low = _sweep(fleet, "low", placement={"name": "large"},
                 grid={"train.iters": [100_000, 4, 4]}, concurrency=1)
    high = _sweep(fleet, "high", placement={"name": "large"}, priority=5,
                  grid={"train.seed": [0, 1]})
    first = segctl("submit", low, "--cluster", fleet["cluster"], "--detach").stdout.strip()
    _wait(fleet, first, lambda sw: sw["trials"][0]["state"] == TrialState.RUNNING)
    second = segctl("submit", high, "--cluster", fleet["cluster"], "--detach").stdout.strip()
    c = segctl("cancel", f"{first}-t000", "--cluster", fleet["cluster"])
    assert c.returncode == 0 and f"{first}-t000" in c.stdout, c.stderr

    # Weights that are not a model are refused at submit, before anything is written...
    import shutil
    garbage = fleet["root"] / "garbage-model"
    shutil.copytree(fleet["root"] / "model", garbage)
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    g = _sweep(fleet, "garbage", job={"model": "garbage-model"})
    assert_one_line_error(segctl("submit", g, "--cluster", fleet["cluster"]),
                          "model.safetensors: not a safetensors file")
    # ... while weights the planner can read but the engine cannot load (a tensor
    # missing) fail the trial on its node, with the engine's message, and no retry.
    import mlx.core as mx
    broken = fleet["root"] / "broken-model"
    shutil.copytree(fleet["root"] / "model", broken)
    weights = mx.load(str(broken / "model.safetensors"))
    weights.pop(sorted(weights)[0])
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    bad = _sweep(fleet, "broken", job={"model": "broken-model"}, placement={"pool": "b"})
    proc = segctl("submit", bad, "--cluster", fleet["cluster"], "--json", timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    [t] = _status(fleet, proc.stderr.split("sweep ")[1].split(":")[0])["trials"]
    assert t["state"] == TrialState.FAILED and len(t["attempts"]) == 1, t   # not retried
    assert "broken-model" in t["message"] and t["attempts"][0]["outcome"] == Outcome.FAILED, t

    done = lambda sw: sw["state"] == SweepState.DONE
    lows, highs = _wait(fleet, first, done)["trials"], _wait(fleet, second, done)["trials"]
    # low's first trial was running when high arrived; after it, high's trials go
    # first. Placement order is the attempts' ids (state.db numbers them as the head
    # places them); their engines' start times can swap when two are placed in one
    # turn (one takes the node's spare worker, the other starts cold).
    assert [t["state"] for t in lows] == [TrialState.CANCELLED, TrialState.SUCCEEDED, TrialState.SUCCEEDED], lows
    placed = lambda t: t["attempts"][0]["attempt"]
    assert max(placed(t) for t in highs) < min(placed(t) for t in lows[1:]), (highs, lows)


def test_a_trial_on_two_nodes_trains_what_one_process_trains(fleet, tmp_path):
    """distributed.nodes: 2 on the fleet: the head places both ranks at once, each
    node's agent starts its rank in MLX's ring, rank 0's adapter is the trial's,
    every rank's steps land in the stores, and the adapter is the one process's."""
    import numpy as np

    from segctl.orchestrator.stores import Stores
    train = {"iters": 4, "batch_size": 2, "learning_rate": 1e-4}
    path = _sweep(fleet, "ring", job={"train": dict(yaml.safe_load(
        (fleet["root"] / "job.yaml").read_text())["train"], **train),
        "distributed": {"nodes": 2}})
    proc = segctl("submit", path, "--cluster", fleet["cluster"], "--detach")
    assert proc.returncode == 0, proc.stderr
    sid = proc.stdout.strip()
    sw = _wait(fleet, sid, lambda sw: sw["state"] != SweepState.RUNNING, timeout=240)
    [t] = sw["trials"]
    assert t["state"] == TrialState.SUCCEEDED, t
    [a] = t["attempts"]
    nodes = a["node"].split(",")
    assert len(nodes) == 2 and len(set(nodes)) == 2   # one trial, on two nodes
    rows = [r for r in _steps(fleet, sid) if r["trial"] == t["trial"]]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, k) for s in range(1, 5)
                                                           for k in (0, 1)]
    assert all(r["rank_rows"] == 1 and r["allreduce_bytes"] > 0 for r in rows)
    # the same job in one process here
    job = yaml.safe_load((fleet["root"] / "job.yaml").read_text())
    job["train"].update(train)
    job.update(model=str(fleet["root"] / "model"), output=str(tmp_path / "one"),
               data={**job["data"], "train": str(fleet["root"] / "data/train.jsonl"),
                     "valid": str(fleet["root"] / "data/valid.jsonl")})
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(job))
    one = segctl("train", tmp_path / "one.yaml")
    assert one.returncode == 0, one.stderr[-2000:]
    import mlx.core as mx
    ref = {k: np.array(v) for k, v in mx.load(str(tmp_path / "one/adapters.safetensors")).items()}
    got, _ = Stores(fleet["stores"]).adapter(t["trial"])
    norm = lambda d: np.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in d.values()))
    assert got.keys() == ref.keys()
    assert norm({k: got[k] - ref[k] for k in ref}) <= 1e-5 * norm(ref)


def test_a_trial_over_jaccl_goes_to_cabled_nodes_with_mlxs_jaccl_environment(fleet):
    """backend jaccl on the fleet: the head takes the two nodes cabled to each other
    (the cluster file's rdma), each checks its RDMA device where it runs (a device
    it lacks fails the trial in one line), and each rank starts with MLX's JACCL
    environment, which MLX itself refuses on this Linux machine: one line too."""
    job = {"train": dict(yaml.safe_load((fleet["root"] / "job.yaml").read_text())["train"],
                         iters=2, batch_size=2), "distributed": {"nodes": 2, "backend": "jaccl"}}
    devices = fleet["root"] / "ibv_devices.txt"
    header = devices.read_text()
    ends = []
    for listed in ("rdma_en2\n", "rdma_en2\nrdma_en3\n"):   # large's first, then both
        devices.write_text(header + listed)
        proc = segctl("submit", _sweep(fleet, f"jaccl{len(ends)}", job=job), "--cluster",
                      fleet["cluster"], "--detach")
        assert proc.returncode == 0, proc.stderr
        sw = _wait(fleet, proc.stdout.strip(), lambda sw: sw["state"] != SweepState.RUNNING)
        [t] = sw["trials"]
        assert t["state"] == TrialState.FAILED, t
        ends.append(t["message"])
    assert "jaccl" in ends[0] and "has no RDMA device rdma_en3" in ends[0], ends[0]
    assert "rdma_en2" in ends[0] and "\n" not in ends[0]
    assert "the jaccl ring did not form: " in ends[1] and "\n" not in ends[1], ends[1]
    [a] = t["attempts"]
    assert sorted(a["node"].split(",")) == ["large", "medium"]


def _no_duplicate_steps(rows, trial, total):
    mine = [(r["attempt"], r["step"]) for r in rows if r["trial"] == trial]
    assert len(mine) == len(set(mine))
    assert {s for _, s in mine} == set(range(1, total + 1))


def test_bad_specs_are_refused_with_nothing_written(fleet):
    bad = _sweep(fleet, "bad", grid={"train.learnin_rate": [1e-4]})
    before = _status_count(fleet)
    proc = segctl("submit", bad, "--cluster", fleet["cluster"])
    assert_one_line_error(proc, "bad.yaml:", "did you mean 'train.learning_rate'")
    proc = segctl("plan", bad, "--cluster", fleet["cluster"])
    assert_one_line_error(proc, "did you mean 'train.learning_rate'")
    broken = fleet["root"] / "broken-cluster.yaml"
    broken.write_text("head: {port: 1}\nnodes:\n  - {name: a, memory_gb: 1}\n")
    proc = segctl("submit", _sweep(fleet, "fine"), "--cluster", broken)
    assert_one_line_error(proc, "broken-cluster.yaml:", "host")
    assert _status_count(fleet) == before


def _status_count(fleet) -> int:
    proc = segctl("status", "--cluster", fleet["cluster"], "--json")
    return len(json.loads(proc.stdout)) if proc.returncode == 0 else 0


def test_a_node_lost_mid_attempt_costs_no_trial_and_no_row(fleet):
    """It takes a node away from the module's fleet, and brings it back before it
    returns (pass or fail): the tests after it find the fleet whole."""
    path = _sweep(fleet, "lost", train={"iters": 80, "checkpoint_every": 5},
                  placement={"pool": "b"})
    proc = segctl("submit", path, "--cluster", fleet["cluster"], "--detach")
    assert proc.returncode == 0, proc.stderr
    sid = proc.stdout.strip()
    sw = _wait(fleet, sid, lambda sw: sw["trials"][0]["attempts"]
               and (sw["trials"][0]["attempts"][-1]["step"] or 0) >= 12)
    victim = sw["trials"][0]["attempts"][-1]["node"]
    info = json.loads((fleet["stores"] / "fleet.json").read_text())
    # The machine goes away: every process of that node at once, the engine included
    # (SIGTERM would let Ray drain the node gracefully, letting the attempt finish).
    os.killpg(info["nodes"][victim]["pid"], signal.SIGKILL)
    t_kill = time.time()
    try:
        sw = _wait(fleet, sid, lambda sw: sw["state"] != SweepState.RUNNING, timeout=240)
        [t] = sw["trials"]
        assert t["state"] == TrialState.SUCCEEDED, t
        lost, done = t["attempts"]
        assert lost["outcome"] == Outcome.NODE_LOST and lost["node"] == victim
        assert done["outcome"] == Outcome.SUCCEEDED and done["node"] != victim and done["resume_step"] >= 10
        print(f"node loss noticed after {done['started'] - t_kill:.1f} s")
        _no_duplicate_steps(_steps(fleet, sid), t["trial"], 80)
    finally:
        _bring_back(fleet, victim)


def _node_alive(fleet, name: str, want: bool, timeout: float) -> None:
    """Wait until `cluster status` shows node `name` alive (want) or gone (not want)."""
    deadline = time.time() + timeout
    while True:
        proc = segctl("cluster", "status", fleet["cluster"], "--json")
        if proc.returncode == 0:
            nodes = {n["name"]: n for n in json.loads(proc.stdout)}
            if bool(nodes.get(name, {}).get("alive")) == want:
                return
        assert time.time() < deadline, (name, want, proc.stdout[-2000:], proc.stderr[-2000:])
        time.sleep(0.5)


def _bring_back(fleet, name: str, timeout: float = 180) -> None:
    """Node `name` was killed: once Ray counts it gone, `segctl cluster up` starts
    it again (it starts the nodes of the cluster file that are not up)."""
    _node_alive(fleet, name, False, timeout)
    up = segctl("cluster", "up", fleet["cluster"], timeout=timeout)
    assert up.returncode == 0, up.stderr[-2000:]
    _node_alive(fleet, name, True, timeout)
