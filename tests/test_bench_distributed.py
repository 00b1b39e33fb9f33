"""bench.distributed: its adapter sizes are the engine's, its model is the ring's
arithmetic, and a short run prints every kind of row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mlx.utils import tree_flatten

from bench.distributed import allreduce_s, lora_floats, scaling_rows, table
from tests.conftest import ROOT, cli_env


def test_the_demo_adapter_has_the_size_the_bench_sends(demo_dir):
    from segctl.engine.model import apply_lora, load_model
    model, _ = load_model(str(demo_dir / "model"))
    apply_lora(model, rank=8, scale=20.0, dropout=0.0, num_layers=-1, keys=None)   # the demo job's
    floats = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    assert floats == lora_floats("demo")


def test_the_model_is_a_rings_arithmetic():
    assert allreduce_s(84e6, 1, 1.25e9) == 0
    # 2 ranks: each sends half the vector twice (reduce-scatter, all-gather)
    assert allreduce_s(84e6, 2, 1.25e9, hop_s=0) == pytest.approx(84e6 / 1.25e9)
    assert allreduce_s(84e6, 8, 1.25e9, hop_s=0) == pytest.approx(2 * 7 / 8 * 84e6 / 1.25e9)
    rows = scaling_rows()
    assert {(r["link"], r["ranks"], r["row_tokens"]) for r in rows} == {
        (link, n, t) for link in ("10GbE", "Thunderbolt 4", "Thunderbolt 5") for n in (2, 4, 8)
        for t in (4096, 8192, 32768)}
    assert all(0 < r["allreduce_share"] < 1 and r["speedup"] <= r["ranks"] for r in rows)
    assert table(rows).count("\n") == len(rows) + 1


@pytest.mark.slow   # ~30 s: rings of 2 processes
def test_a_short_run_prints_allreduce_step_and_scaling_rows():
    proc = subprocess.run([sys.executable, "-m", "bench.distributed", "--ranks", "1,2", "--iters", "3"],
                          capture_output=True, text=True, cwd=ROOT, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    kinds = {r["bench"] for r in rows}
    assert kinds == {"allreduce", "step", "scaling"}
    steps = {r["ranks"]: r for r in rows if r["bench"] == "step"}
    assert steps[1]["allreduce_bytes"] == 0 and steps[2]["allreduce_bytes"] == 4 * (lora_floats("demo") + 2)
    assert all(r["seconds"] > 0 for r in rows if r["bench"] == "allreduce")


def test_a_lab_ring_runs_one_rank_per_host_on_its_address():
    from pathlib import Path

    from bench.distributed import lab_rank_argvs, ring_hosts
    from segctl.lab import Host
    assert ring_hosts(["198.18.0.11", "198.18.0.12"], [5001, 5002]) == [
        ["198.18.0.11:5001"], ["198.18.0.12:5002"]]
    with pytest.raises(ValueError):
        ring_hosts(["198.18.0.11"], [5001, 5002])
    hosts = [Host(name=f"h{i}", address=f"198.18.0.1{i}", netns=f"seglab-h{i}", veth=f"seglab{i}",
                  home=Path(f"/lab/h{i}/home"), sshd_pid=4200 + i, sshd_started="t") for i in (1, 2)]
    argvs = lab_rank_argvs(hosts, lambda r: ["python", "-m", "x", str(r)], "/tmp/hosts-2.json")
    for r, argv in enumerate(argvs):
        # entered through the host's sshd (its network), the rank's argv last
        assert argv[argv.index("-t") + 1] == str(hosts[r].sshd_pid) and "-n" in argv
        assert argv[-4:] == ["python", "-m", "x", str(r)]
        assert {f"MLX_RANK={r}", "MLX_HOSTFILE=/tmp/hosts-2.json", f"PYTHONPATH={ROOT}"} <= set(argv)


def test_the_lab_is_taken_down_whatever_the_bench_does(monkeypatch, tmp_path):
    import bench.distributed as bd
    from segctl import lab
    calls = []
    made = lab.Lab(root=tmp_path, hosts=[])
    monkeypatch.setattr(lab, "load", lambda root=None: None)
    monkeypatch.setattr(lab, "why_not", lambda: None)
    monkeypatch.setattr(lab, "up", lambda n, root: calls.append(("up", n)) or made)
    monkeypatch.setattr(lab, "down", lambda root: calls.append(("down", root)))
    for error in (RuntimeError("a rank hung"), KeyboardInterrupt()):
        def fail(*a, error=error, **kw):
            raise error
        monkeypatch.setattr(bd, "bench_allreduce", fail)
        calls.clear()
        with pytest.raises(type(error)):
            bd.bench_lab([2, 4], tmp_path, tmp_path, with_loopback=False)
        assert calls == [("up", 4), ("down", tmp_path)]
    # a lab already up (someone else's) is neither used nor taken down
    busy = lab.Lab(root=tmp_path, hosts=[lab._plan(tmp_path, 1)])
    monkeypatch.setattr(lab, "load", lambda root=None: busy)
    monkeypatch.setattr(lab, "pids", lambda h: [1234])
    calls.clear()
    with pytest.raises(bd.LabBusy):
        bd.bench_lab([2], tmp_path, tmp_path, with_loopback=False)
    assert calls == []
    with pytest.raises(SystemExit) as e:
        bd.main(["--lab", "--ranks", "2", "--lab-root", str(tmp_path)])
    assert e.value.code == 3 and calls == []
