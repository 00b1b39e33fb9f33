"""One job on several ranks (engine/distributed.py): each rank a real `segctl train`
process, joined by MLX's ring over loopback TCP as Macs join over their network.
The ranks' step is the single process's step on the same global batch: the same
losses, the same adapter (fp32), and every rank ends with the same adapter."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

from bench.distributed import free_ports
from tests.conftest import ROOT, assert_one_line_error, cli_env, segctl

pytestmark = pytest.mark.slow   # ~20 s: three training processes


def _job(demo_dir, tmp_path, name: str, *, nodes: int, output: str | None = None, **train) -> str:
    """The demo job, 10 steps of 4 rows, on `nodes` nodes, written beside the test."""
    job = yaml.safe_load((demo_dir / "job.yaml").read_text())
    job.update(name=name, model=str(demo_dir / "model"), output=str(tmp_path / (output or name)),
               distributed={"nodes": nodes})
    job["data"].update(train=str(demo_dir / "data" / "train.jsonl"),
                       valid=str(demo_dir / "data" / "valid.jsonl"))
    job["train"].update({"iters": 10, "batch_size": 4, "eval_every": 5, "val_batches": 6,
                         "checkpoint_every": 5, "warmup": 0, **train})
    path = tmp_path / f"{output or name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return str(path)


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _ranks(jobs: list[str]) -> list[subprocess.CompletedProcess]:
    """`segctl train` of jobs[r] as rank r of one ring over loopback, all at once."""
    ports = free_ports(len(jobs))
    hostfile = jobs[0] + ".hosts.json"
    with open(hostfile, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    procs = [subprocess.Popen([sys.executable, "-m", "segctl.orchestrator.cli", "train", job, "--json"],
                              env={**cli_env(), "MLX_RANK": str(r), "MLX_HOSTFILE": hostfile},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for r, job in enumerate(jobs)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _adapter(folder) -> dict[str, np.ndarray]:
    import mlx.core as mx
    return {k: np.array(v) for k, v in mx.load(str(folder / "adapters.safetensors")).items()}


def test_two_ranks_train_what_one_process_trains(demo_dir, tmp_path):
    one = segctl("train", _job(demo_dir, tmp_path, "one", nodes=1), "--json")
    assert one.returncode == 0, one.stderr[-2000:]
    # each rank its own output folder, as each node has its own on a fleet
    ranks = _ranks([_job(demo_dir, tmp_path, "two", nodes=2),
                    _job(demo_dir, tmp_path, "two", nodes=2, output="two-rank1")])
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]

    single = _events(one.stdout)
    losses = [e["loss"] for e in single if e["event"] == "step"]
    for rank, r in enumerate(ranks):
        events = _events(r.stdout)
        [start] = [e for e in events if e["event"] == "start"]
        assert (start["rank"], start["ranks"]) == (rank, 2)
        steps = [e for e in events if e["event"] == "step"]
        # the whole batch's loss on every rank; each ran half of its rows
        assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-5)
        assert [(s["rows"], s["rank_rows"], s["rank"]) for s in steps] == [(4, 2, rank)] * 10
        assert all(s["allreduce_bytes"] > 0 and s["allreduce_s"] >= 0 for s in steps)
        # the eval's sums are added over the ranks; rank 0 alone says it
        evals = [e["val_loss"] for e in events if e["event"] == "eval"]
        want = [e["val_loss"] for e in single if e["event"] == "eval"]
        assert evals == (pytest.approx(want, rel=1e-5) if rank == 0 else [])

    ref = _adapter(tmp_path / "one")
    first, second = _adapter(tmp_path / "two"), _adapter(tmp_path / "two-rank1")
    assert first.keys() == ref.keys() == second.keys()
    for k in ref:
        assert np.array_equal(first[k], second[k]), k   # the same update on every rank
    # the single process's adapter up to float rounding, which the rows' sums in
    # another order and Adam's division by small second moments (a LoRA B starts at
    # zero) bring to ~1e-6 of the whole after 10 steps
    norm = lambda d: np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in d.values()))
    assert norm({k: first[k] - ref[k] for k in ref}) <= 1e-5 * norm(ref)
    # rank 0 alone writes checkpoints
    assert (tmp_path / "two" / "checkpoints").is_dir()
    assert not (tmp_path / "two-rank1" / "checkpoints").exists()


def test_a_rank_whose_peer_never_comes_ends_instead_of_waiting(demo_dir, tmp_path):
    job = _job(demo_dir, tmp_path, "lonely", nodes=2)
    spec = yaml.safe_load(open(job))
    spec["distributed"]["timeout_s"] = 3
    with open(job, "w") as f:
        yaml.safe_dump(spec, f)
    ports = free_ports(2)
    with open(job + ".hosts.json", "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    alone = segctl("train", job, env={"MLX_RANK": "0",
                                      "MLX_HOSTFILE": job + ".hosts.json"}, timeout=120)
    # MLX's set-up holds Python's lock while it waits: the kernel ends it (SIGALRM)
    assert alone.returncode == -signal.SIGALRM, (alone.returncode, alone.stderr[-2000:])
    assert not (tmp_path / "lonely").exists()


def test_a_rank_killed_mid_job_ends_its_peer_as_a_lost_rank(demo_dir, tmp_path):
    jobs = [_job(demo_dir, tmp_path, "cut", nodes=2, iters=100_000),
            _job(demo_dir, tmp_path, "cut", nodes=2, iters=100_000, output="cut-rank1")]
    for job in jobs:
        spec = yaml.safe_load(open(job))
        # long enough for both ranks to start on a loaded machine (the ring must form
        # first); the cut itself is seen at once, as the broken link, not by the timeout
        spec["distributed"]["timeout_s"] = 60
        with open(job, "w") as f:
            yaml.safe_dump(spec, f)
    ports = free_ports(2)
    with open(jobs[0] + ".hosts.json", "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    procs = [subprocess.Popen([sys.executable, "-m", "segctl.orchestrator.cli", "train", job, "--json"],
                              env={**cli_env(), "MLX_RANK": str(r), "MLX_HOSTFILE": jobs[0] + ".hosts.json"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for r, job in enumerate(jobs)]
    try:
        trained = False
        for line in procs[1].stdout:   # rank 1 trains: its second step's all_sum is done
            if '"event":"step"' in line.replace(" ", "") and '"step":2' in line.replace(" ", ""):
                trained = True
                break
        assert trained, procs[1].stderr.read()[-2000:]
        procs[1].kill()
        survivor = procs[0]
        out, err = survivor.communicate(timeout=120)
        # a lost peer: exit 4 and an error event saying so, never a hang (MLX's
        # ring prints its own lines on stderr meanwhile)
        assert survivor.returncode == 4, (survivor.returncode, err[-2000:])
        last = _events(out)[-1]
        assert last["event"] == "error" and last["kind"] == "distributed", last
        assert "all_sum on rank 0 of 2 failed, a rank is gone" in last["message"], last
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_a_job_on_several_nodes_is_refused_where_it_cannot_run(demo_dir, tmp_path):
    # outside a ring: one line saying where it runs
    job = _job(demo_dir, tmp_path, "alone", nodes=2)
    assert_one_line_error(segctl("train", job), "distributed.nodes: 2",
                          "not one of a ring", "MLX_RANK=0..1", "MLX_HOSTFILE")
    assert not (tmp_path / "alone").exists()
    # a step with fewer rows than nodes, or dropout: refused at validate
    few = _job(demo_dir, tmp_path, "few", nodes=3, batch_size=2)
    assert_one_line_error(segctl("validate", few), "distributed.nodes: 3 nodes need at least 3 rows")
    spec = yaml.safe_load(open(job))
    spec["lora"]["dropout"] = 0.1
    with open(job, "w") as f:
        yaml.safe_dump(spec, f)
    assert_one_line_error(segctl("validate", job), "needs lora.dropout 0")
    spec["lora"]["dropout"] = 0.0
    spec["distributed"]["min_nodes"] = 3
    with open(job, "w") as f:
        yaml.safe_dump(spec, f)
    assert_one_line_error(segctl("validate", job), "min_nodes: 3 is more than nodes: 2")
    # more nodes than the fleet has (the embedded one is this machine alone), or a
    # backend the fleet does not start: plan and submit say so, nothing is sent
    two = _job(demo_dir, tmp_path, "fleet", nodes=2)
    for command in ("plan", "submit"):
        assert_one_line_error(segctl(command, two, env={"SEGCTL_HOME": str(tmp_path / "home")}),
                              "distributed.nodes: 2: the cluster has 1 node(s)",
                              "a trial's ranks each take a node of their own")
    # over JACCL, the nodes must be cabled to each other (the cluster file's rdma)
    spec = yaml.safe_load(open(two))
    spec["distributed"]["backend"] = "jaccl"
    with open(two, "w") as f:
        yaml.safe_dump(spec, f)
    cluster = tmp_path / "c.yaml"
    nodes = "nodes:\n  - {name: a, local: true, memory_gb: 8%s}\n  - {name: b, local: true, memory_gb: 8%s}\n"
    cluster.write_text(nodes % ("", ""))
    home = {"SEGCTL_HOME": str(tmp_path / "home")}
    assert_one_line_error(segctl("plan", two, "--cluster", cluster, env=home),
                          "distributed.backend: jaccl: no 2 nodes of the cluster are cabled to each "
                          "other over RDMA")
    cluster.write_text(nodes % (", rdma: {b: rdma_en3}", ", rdma: {a: rdma_en2}"))
    planned = segctl("plan", two, "--cluster", cluster, env=home)
    assert planned.returncode == 0, planned.stderr
    assert not (tmp_path / "home").exists()


def test_a_jaccl_rank_gets_mlxs_jaccl_environment_and_says_what_it_lacks(demo_dir, tmp_path):
    """Over JACCL a rank needs MLX_RANK, MLX_JACCL_COORDINATOR (rank 0's ip:port)
    and MLX_IBV_DEVICES (every rank's RDMA device to every other): the node's
    worker sets them from the head's ring and device matrix, and a rank started by
    hand without them is refused in one line. This Linux machine has no RDMA: MLX
    itself refuses the backend there, in one line too."""
    from segctl.engine.distributed import ring_environ
    from segctl.node.attempt import _ring_args
    from segctl.schemas.job import JobSpec
    from segctl.schemas.records import AttemptSpec
    job = _job(demo_dir, tmp_path, "rdma", nodes=2)
    spec = yaml.safe_load(open(job))
    spec["distributed"]["backend"] = "jaccl"
    with open(job, "w") as f:
        yaml.safe_dump(spec, f)
    matrix = [[None, "rdma_en3"], ["rdma_en2", None]]
    attempt = AttemptSpec(sweep="s", trial="t", attempt=1, job=JobSpec.model_validate(spec),
                          data={}, rank=1, ring=["198.18.0.11:5000", "198.18.0.12:5001"],
                          rdma=matrix)
    args = _ring_args(attempt, tmp_path)
    assert args == ["--ring", "1", str(tmp_path / "hostfile.json"), "--rdma", str(tmp_path / "rdma.json")]
    assert json.loads((tmp_path / "rdma.json").read_text()) == matrix
    env = ring_environ(1, args[2], args[4])
    assert env == {"MLX_RANK": "1", "MLX_JACCL_COORDINATOR": "198.18.0.11:5000",
                   "MLX_IBV_DEVICES": str(tmp_path / "rdma.json")}
    assert ring_environ(0, "h.json") == {"MLX_RANK": "0", "MLX_HOSTFILE": "h.json"}
    lacking = segctl("train", job, env={"MLX_RANK": "0"})
    assert_one_line_error(lacking, "MLX_JACCL_COORDINATOR and MLX_IBV_DEVICES unset")
    here = segctl("train", job, env=env)
    assert_one_line_error(here, "distributed: the jaccl ring did not form: ")
    assert not (tmp_path / "rdma").exists()
