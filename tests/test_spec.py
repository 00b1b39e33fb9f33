"""Job specs: every problem as `file:line: key: message`, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from segctl.schemas import SpecError, load_job
from tests.conftest import assert_one_line_error, segctl

VALID = """\
name: t
model: model
output: out
data:
  train: data/train.jsonl
train:
  iters: 3
"""


def job_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def problems(tmp_path, text) -> list[str]:
    with pytest.raises(SpecError) as e:
        load_job(job_file(tmp_path, text))
    return e.value.problems


def test_valid_job_resolves_paths_from_its_folder(tmp_path):
    job = load_job(job_file(tmp_path, VALID))
    assert job.model == str(tmp_path / "model")
    assert job.data.train == str(tmp_path / "data" / "train.jsonl")
    assert job.memory.segment_size == 1 and job.memory.head_chunk == 512


def test_unknown_key_says_did_you_mean(tmp_path):
    (p,) = problems(tmp_path, VALID + "lora:\n  rnak: 4\n")
    assert p == f"{tmp_path}/job.yaml:9: lora.rnak: unknown key; did you mean 'rank'?"


def test_wrong_type_and_range_point_at_their_lines(tmp_path):
    ps = problems(tmp_path, VALID.replace("iters: 3", "iters: ten") + "memory:\n  segment_size: -1\n")
    assert ps[0].startswith(f"{tmp_path}/job.yaml:7: train.iters: ")
    assert ps[1].startswith(f"{tmp_path}/job.yaml:9: memory.segment_size: ")
    assert "expected a whole number >= 0 or 'auto', got -1" in ps[1]


def test_missing_keys_and_cross_checks(tmp_path):
    ps = problems(tmp_path, "model: m\ndata:\n  train: t\ntrain:\n  learning_rate: 1\n")
    assert any("train: give either iters or epochs" in p for p in ps)
    (p,) = problems(tmp_path, VALID + "memory:\n  grad_checkpoint: true\n")
    assert "grad_checkpoint needs memory.segment_size 0" in p


def test_yaml_syntax_error_has_a_line(tmp_path):
    (p,) = problems(tmp_path, VALID + "lora: [1, 2\n")
    assert p.startswith(f"{tmp_path}/job.yaml:") and "invalid YAML" in p


def test_not_a_mapping(tmp_path):
    (p,) = problems(tmp_path, "- a\n- b\n")
    assert p.endswith("expected a mapping of keys, got list")


def test_cli_validate_and_train_refuse_bad_specs(tmp_path):
    bad = job_file(tmp_path, VALID + "trian:\n  iters: 3\n")
    for cmd in ("validate", "train"):
        err = assert_one_line_error(segctl(cmd, bad), "trian: unknown key; did you mean 'train'?")
        assert err.startswith(f"{bad}:8:")
    assert not (tmp_path / "out").exists()
    assert segctl("validate", job_file(tmp_path, VALID)).stdout.strip().endswith(": ok (job)")


def test_help_answers_questions():
    out = segctl("train", "--help").stdout
    assert "--resume" in out and "Exit codes" in out
