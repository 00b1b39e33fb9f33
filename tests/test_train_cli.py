"""`segctl train` end to end on the demo: the adapter works in mlx-lm, resume equals
an uninterrupted run, the memory guard fires, and bad input is refused cleanly."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tests.conftest import ROOT, assert_one_line_error, cli_env, edit_job, segctl


def events(folder: Path) -> list[dict]:
    return [json.loads(l) for l in (folder / "events.jsonl").read_text().splitlines()]


def copy_demo(demo_dir: Path, tmp_path: Path, **edits) -> Path:
    """A private job over the shared demo model/data: only job.yaml is copied."""
    job = tmp_path / "job.yaml"
    shutil.copy(demo_dir / "job.yaml", job)
    edit_job(job, model=str(demo_dir / "model"), output=str(tmp_path / "out"),
             data={"train": str(demo_dir / "data/train.jsonl"),
                   "valid": str(demo_dir / "data/valid.jsonl")})
    return edit_job(job, **edits)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow   # 8 s
def test_demo_trains_and_adapter_loads_in_mlx_lm(demo_dir, tmp_path):
    from mlx_lm import generate, load

    job = copy_demo(demo_dir, tmp_path)
    proc = segctl("train", job)
    assert proc.returncode == 0, proc.stderr
    # stdout is not a terminal: nothing but JSON lines
    lines = [json.loads(l) for l in proc.stdout.splitlines()]
    kinds = [e["event"] for e in lines]
    assert kinds[0] == "start" and kinds[-1] == "end" and "eval" in kinds and "checkpoint" in kinds
    steps = [e for e in lines if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, len(steps) + 1))
    assert all(e["peak_gb"] > 0 and e["tokens"] > 0 for e in steps)
    evals = [e["val_loss"] for e in lines if e["event"] == "eval"]
    assert evals[-1] < 0.8 * steps[0]["loss"], "the demo model visibly learns"

    out = tmp_path / "out"
    assert (out / "adapters.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert events(out) == lines

    base, tok = load(str(demo_dir / "model"))
    tuned, _ = load(str(demo_dir / "model"), adapter_path=str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "reverse: a b c d"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = mx.array([tok.encode(prompt, add_special_tokens=False)])
    assert mx.max(mx.abs(base(ids) - tuned(ids))).item() > 1e-3
    assert generate(base, tok, prompt, max_tokens=12) != generate(tuned, tok, prompt, max_tokens=12)


@pytest.mark.slow   # 7 s
def test_resume_after_kill_equals_uninterrupted(demo_dir, tmp_path):
    edits = dict(train={"iters": 12, "checkpoint_every": 3, "eval_every": 6})
    (tmp_path / "a").mkdir()
    full = copy_demo(demo_dir, tmp_path / "a", **edits)
    assert segctl("train", full).returncode == 0

    (tmp_path / "b").mkdir()
    job = copy_demo(demo_dir, tmp_path / "b", **edits)
    proc = subprocess.Popen([sys.executable, "-m", "segctl.orchestrator.cli", "train", str(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), cwd=ROOT)
    try:
        for line in proc.stdout:  # kill hard once a checkpoint has landed
            if json.loads(line)["event"] == "checkpoint":
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    out = tmp_path / "b" / "out"
    assert not (out / "adapters.safetensors").exists()

    resumed = segctl("train", job, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    start = json.loads(resumed.stdout.splitlines()[0])
    assert start["event"] == "start" and start["resumed_from"] in (3, 6, 9)

    a = mx.load(str(tmp_path / "a" / "out" / "adapters.safetensors"))
    b = mx.load(str(out / "adapters.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]).item(), k


@pytest.mark.slow   # 4 s
def test_memory_guard_stops_with_oom_and_keeps_checkpoint(demo_dir, tmp_path):
    job = copy_demo(demo_dir, tmp_path, train={"iters": 4, "checkpoint_every": 2, "eval_every": 0})
    assert segctl("train", job).returncode == 0
    ckpt = tmp_path / "out" / "checkpoints" / "step-0000002"
    before = {p.name: sha(p) for p in ckpt.iterdir()}

    edit_job(job, memory={"budget_gb": 1e-6})
    proc = segctl("train", job, "--resume")
    assert_one_line_error(proc, "memory.budget_gb", code=3)
    last = json.loads(proc.stdout.splitlines()[-1])
    assert last["event"] == "error" and last["kind"] == "oom" and last["step"] is None
    assert events(tmp_path / "out")[-1]["kind"] == "oom"
    assert {p.name: sha(p) for p in ckpt.iterdir()} == before


# ---------------------------------------------------------------- bad input

def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def bad_data_job(demo_dir, tmp_path, rows: str, **edits) -> Path:
    train = write(tmp_path / "train.jsonl", rows)
    job = copy_demo(demo_dir, tmp_path, data={"train": str(train), "valid": None})
    return edit_job(job, **edits)


GOOD = '{"prompt": "reverse: a b", "completion": "b a"}\n'


@pytest.mark.parametrize("rows, fragments", [
    (GOOD + GOOD + '{"prompt": "x", \n', ["train.jsonl:3:", "not valid JSON"]),
    (GOOD + '{"prompt": "reverse: a b"}\n', ["train.jsonl:2:", "'completion'"]),
    (GOOD + '{"prompt": "reverse: a b", "completion": ""}\n', ["train.jsonl:2:", "empty"]),
    ('{"txt": "hello"}\n', ["train.jsonl:1:", "none of 'text'"]),
    ('[1, 2]\n', ["train.jsonl:1:", "JSON object"]),
    (GOOD + '{"messages": [{"role": "user", "content": "hi"}]}\n', ["train.jsonl:2:", "assistant"]),
])
def test_bad_data_rows(demo_dir, tmp_path, rows, fragments):
    job = bad_data_job(demo_dir, tmp_path, rows)
    assert_one_line_error(segctl("train", job), *fragments)
    assert not (tmp_path / "out").exists()


def test_overlong_rows_are_counted_not_silent(demo_dir, tmp_path):
    long = '{"text": "' + " ".join(["a b c d"] * 40) + '"}\n'
    job = bad_data_job(demo_dir, tmp_path, GOOD * 3 + long * 2,
                       train={"iters": 2, "checkpoint_every": 0, "eval_every": 0})
    for policy, key in (("skip", "skipped"), ("truncate", "truncated")):
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        edit_job(job, data={"overlong": policy, "max_seq_length": 32})
        proc = segctl("train", job)
        assert proc.returncode == 0, proc.stderr
        start = json.loads(proc.stdout.splitlines()[0])
        assert start[key] == 2 and start["train_rows"] == (3 if policy == "skip" else 5)


def test_response_cut_away_by_truncation_is_a_row_error(demo_dir, tmp_path):
    job = bad_data_job(demo_dir, tmp_path, GOOD + '{"prompt": "' + "x " * 80 + '", "completion": "y"}\n',
                       data={"max_seq_length": 48})
    assert_one_line_error(segctl("train", job), "train.jsonl:2:", "no response tokens")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow   # 6 s
def test_bad_model_folders(demo_dir, tmp_path):
    job = copy_demo(demo_dir, tmp_path, model=str(tmp_path / "nowhere"))
    assert_one_line_error(segctl("train", job), "nowhere", "not found")

    broken = tmp_path / "broken"
    shutil.copytree(demo_dir / "model", broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 100)
    edit_job(job, model=str(broken))
    assert_one_line_error(segctl("train", job), str(broken), "weights")

    alien = tmp_path / "alien"
    shutil.copytree(demo_dir / "model", alien)
    cfg = json.loads((alien / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    (alien / "config.json").write_text(json.dumps(cfg))
    edit_job(job, model=str(alien))
    assert_one_line_error(segctl("train", job), str(alien), "no_such_arch")

    (alien / "config.json").write_text("{not json")
    assert_one_line_error(segctl("train", job), "config.json", "JSON")
    assert not (tmp_path / "out").exists()


def test_output_in_use_needs_resume(demo_dir, tmp_path):
    job = copy_demo(demo_dir, tmp_path)
    write(tmp_path / "out" / "something", "x")
    assert_one_line_error(segctl("train", job), "not empty", "--resume")


def test_epochs_constant_schedule_and_phase_telemetry(demo_dir, tmp_path):
    job = bad_data_job(demo_dir, tmp_path, GOOD * 5,
                       train={"iters": None, "epochs": 2, "schedule": "constant", "warmup": 2,
                              "learning_rate": 1e-3, "checkpoint_every": 0, "eval_every": 0},
                       memory={"segment_size": 2}, telemetry={"phases": True})
    proc = segctl("train", job)
    assert proc.returncode == 0, proc.stderr
    evs = [json.loads(l) for l in proc.stdout.splitlines()]
    steps = [e for e in evs if e["event"] == "step"]
    assert len(steps) == 10  # 2 epochs x 5 rows
    assert [round(s["lr"], 6) for s in steps[:4]] == [0.0, 0.0005, 0.001, 0.001]
    assert all(s["lr"] == pytest.approx(1e-3) for s in steps[2:])
    phases = [e for e in evs if e["event"] == "phase"]
    assert len(phases) == 10
    labels = [label for label, _ in phases[0]["phases"]]
    assert labels == ["fwd0", "fwd1", "head", "bwd1", "bwd0", "update"]  # 4 layers, segments of 2
    # each phase's own peak; the step's peak is the highest of them
    for step, phase in zip(steps, phases):
        peaks = [p for _, p in phase["phases"]]
        assert min(peaks) > 0 and max(peaks) == pytest.approx(step["peak_gb"], abs=1e-6)
