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

    from bench.distributed import lab_rank_argvs, ring_fields, ring_hosts
    from segctl.lab import Host
    assert ring_hosts(["198.18.0.11", "198.18.0.12"], [5001, 5002]) == [
        ["198.18.0.11:5001"], ["198.18.0.12:5002"]]
    with pytest.raises(ValueError):
        ring_hosts(["198.18.0.11"], [5001, 5002])
    hosts = [Host(name=f"h{i}", address=f"198.18.0.1{i}", netns=f"seglab-h{i}", veth=f"seglab{i}",
                  home=Path(f"/lab/h{i}/home"), sshd_pid=4200 + i, sshd_started="t") for i in (1, 2)]
    argvs = lab_rank_argvs(hosts, lambda r: ["python", "-m", "x", str(r)], "/tmp/hosts-2.json")
    # where a row's ranks ran, as the rows say it
    from segctl.lab import Lab
    assert ring_fields(2, None) == {"where": "loopback", "link": "loopback"}
    assert ring_fields(1, Lab(root=Path("/lab"), hosts=hosts)) == {
        "where": "lab", "link": "none", "hosts": ["198.18.0.11"]}
    for r, argv in enumerate(argvs):
        # entered through the host's sshd (its network), the rank's argv last
        assert argv[argv.index("-t") + 1] == str(hosts[r].sshd_pid) and "-n" in argv
        assert argv[-4:] == ["python", "-m", "x", str(r)]
        assert {f"MLX_RANK={r}", "MLX_HOSTFILE=/tmp/hosts-2.json", f"PYTHONPATH={ROOT}"} <= set(argv)


def fake_lab(monkeypatch, tmp_path) -> tuple[list, object]:
    """segctl.lab with up and down recorded in `calls` (no lab is made), and the Lab
    that up returns."""
    from segctl import lab
    calls: list = []
    made = lab.Lab(root=tmp_path, hosts=[])
    monkeypatch.setattr(lab, "load", lambda root=None: None)
    monkeypatch.setattr(lab, "why_not", lambda: None)
    monkeypatch.setattr(lab, "up", lambda n, root: calls.append(("up", n)) or made)
    monkeypatch.setattr(lab, "down", lambda root: calls.append(("down", root)))
    return calls, made


def test_the_lab_is_taken_down_whatever_the_bench_does(monkeypatch, tmp_path):
    import bench.distributed as bd
    from segctl import lab
    calls, made = fake_lab(monkeypatch, tmp_path)
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


def test_the_step_rows_model_has_qwen3_0_6bs_adapter():
    """The model the step rows write for qwen3-0.6b (its config as
    bench.planner_fit.write_bench_model makes it, built lazily: no weights) takes
    the LoRA gradient whose size the allreduce rows send for Qwen3-0.6B."""
    import importlib

    from bench.distributed import SHAPES, STEP_MODELS
    from segctl.engine.demo import _model_config
    from segctl.engine.model import apply_lora
    arch, layers, hidden, vocab, extra = STEP_MODELS["qwen3-0.6b"]
    config = _model_config(arch, layers=layers, hidden=hidden, vocab_size=600, eos=2, bos=0)
    config.update({"vocab_size": vocab, "torch_dtype": "bfloat16", **extra})
    hd = config["head_dim"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"] * hd,
            config["num_key_value_heads"] * hd, config["intermediate_size"]) == SHAPES["qwen3-0.6b"]
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(config))
    apply_lora(model, rank=8, scale=20.0, dropout=0.0, num_layers=-1, keys=None)   # the demo job's
    floats = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    assert floats == lora_floats("qwen3-0.6b") == 5_046_272


def test_every_ring_size_gets_the_same_global_batch():
    import yaml

    from bench.distributed import step_data, step_jobs
    from segctl.engine.demo import JOB_PARTS, JOB_TEMPLATE
    from segctl.schemas.job import JobSpec
    base = yaml.safe_load(JOB_TEMPLATE.format(arch="qwen3", method="sft", **JOB_PARTS["sft"]))
    for n in (1, 2, 4):
        jobs = step_jobs(base, "/tmp/step-demo", n, iters=4, batch=4)
        assert len(jobs) == n and len({j["output"] for j in jobs}) == n
        for job in jobs:
            spec = JobSpec.model_validate(job)
            assert spec.train.rows_per_step == 4 and spec.train.iters == 4
            assert spec.distributed.nodes == n and spec.lora.rank == 8 and spec.lora.num_layers == -1
            assert job["model"] == "/tmp/step-demo/model" and job["data"]["valid"] is None
            assert not {"eval_every", "checkpoint_every"} & set(job["train"])
    rows = step_data(8, 128)
    assert len(rows) == 8 and {len(r["completion"].split()) for r in rows} == {112}
    letters = "jklmnopqrstuvwxyz"   # the demo's: one token each in its tokenizers
    for r in rows:   # letters counting on from the prompt's, past z from j
        first, *rest = r["completion"].split()
        assert r["prompt"][-1] in letters[:-1] and first == letters[letters.index(r["prompt"][-1]) + 1]
        assert all((letters.index(b) - letters.index(a)) % 17 == 1 for a, b in zip([first, *rest], rest))


def test_a_step_row_is_rank_0s_medians_past_the_first_step():
    from bench.distributed import cpu_note, step_row

    def step(i, seconds, ar):
        return json.dumps(dict(event="step", step=i, seconds=seconds, tokens_per_s=400 / seconds,
                               rows=4, rank_rows=2 if ar is not None else None, seq_tokens=256,
                               allreduce_s=ar, allreduce_bytes=4 * 10 if ar is not None else None))
    out = "\n".join([json.dumps({"event": "start"}), step(1, 9.0, 5.0), step(2, 2.0, 0.5),
                     step(3, 1.0, 0.1), step(4, 4.0, 0.2), json.dumps({"event": "end"})])
    r = step_row(out)
    assert r == dict(rows=4, steps=3, row_tokens=128.0, step_s=2.0, compute_s=1.8, allreduce_s=0.2,
                     allreduce_bytes=40, allreduce_share=0.1, tokens_per_s=200.0)
    one = step_row("\n".join([step(1, 9.0, None), step(2, 1.0, None), step(3, 3.0, None)]))
    assert one["allreduce_s"] == one["allreduce_bytes"] == one["allreduce_share"] == 0
    assert one["compute_s"] == one["step_s"] == 2.0 and one["row_tokens"] == 64.0
    with pytest.raises(ValueError):
        step_row(step(1, 9.0, None))
    assert cpu_note(4, cores=2) == "4 ranks on 2 cores: measures the CPU, not the link"
    assert cpu_note(2, cores=2) is None


def test_the_lab_runs_the_step_rows_and_is_taken_down(monkeypatch, tmp_path):
    import bench.distributed as bd
    calls, made = fake_lab(monkeypatch, tmp_path)
    monkeypatch.setattr(bd, "bench_allreduce", lambda *a, **kw: calls.append("allreduce"))
    bd.bench_lab([1, 2, 4], tmp_path, tmp_path, work=lambda there: calls.append(("steps", there)))
    assert calls == [("up", 4), ("steps", made), ("down", tmp_path)]

    def fail(there):
        raise RuntimeError("a rank failed")
    calls.clear()
    with pytest.raises(RuntimeError):
        bd.bench_lab([1, 2], tmp_path, tmp_path, work=fail)
    assert calls == [("up", 2), ("down", tmp_path)]
    for bad in (["--steps", "--shapes", "demo,gpt-9"], ["--steps", "--lab", "--with-loopback"],
                ["--steps", "--ranks", "1,2,4", "--batch", "2"]):
        with pytest.raises(SystemExit) as e:
            bd.main(bad)
        assert e.value.code == 2
    assert calls == [("up", 2), ("down", tmp_path)]
