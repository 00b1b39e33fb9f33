"""The hostile-input corpus (tests/hostile/cases.py) through the CLI: every case
is refused before any work with exit 2 and exactly one line on stderr that says
what is wrong, no traceback, nothing written and within LIMIT_S of CPU time.

Most cases run in-process through click's CliRunner against the real command
group (stderr kept apart, exit codes as the process gives them: `sys.exit`), a
few also through the real `segctl` process. And README's limits table is
checked against schemas/limits.py.
"""

from __future__ import annotations

import re
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from segctl.orchestrator import cli
from segctl.schemas import limits
from tests.conftest import ROOT, cpu_seconds, segctl
from tests.hostile.cases import CASES, Case, lay_out

# Costs are CPU seconds (conftest.cpu_seconds), never wall time: the lanes beside
# this one keep both cores busy at times, and wall time then is mostly waiting.
LIMIT_S = 5.0        # each case, refusal included
# A real process also starts Python and imports segctl (~2 s of CPU alone)
PROCESS_S = 4 * LIMIT_S
HANG_S = 120         # wall time: a case still running then is stopped (a hang fails, not blocks)


def arguments(case: Case, folder: Path) -> list[str]:
    return [str(folder / a) if (folder / a).exists() else a for a in case.cmd]


def snapshot(folder: Path) -> dict:
    return {p: (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


def assert_refused(case: Case, code: int, stderr: str, stdout: str) -> None:
    assert code == 2, (case.id, code, stderr[-2000:], stdout[-2000:])
    assert "Traceback" not in stderr + stdout, (case.id, stderr[-2000:])
    err = stderr.strip()
    assert err and "\n" not in err, (case.id, stderr[-3000:])
    assert case.expect in err, (case.id, case.expect, err)


class _Hung(BaseException):
    """Raised into a case that runs past HANG_S (a BaseException: no CLI handler catches it)."""


@contextmanager
def stopped_after(seconds: float):
    def stop(*_):
        raise _Hung(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _no_cluster(*_, **__):
    raise AssertionError("the cluster was contacted before the input was refused")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_before_any_work(case: Case, demo_dir, tmp_path, monkeypatch):
    folder = lay_out(case, demo_dir, tmp_path / "case")
    home = tmp_path / "home"
    before = snapshot(folder)
    monkeypatch.setattr(cli, "_head", _no_cluster)
    tic = cpu_seconds()
    with stopped_after(HANG_S):
        result = CliRunner().invoke(cli.main, arguments(case, folder),
                                    env={"SEGCTL_HOME": str(home), "SEGCTL_CLUSTER": None})
    seconds = cpu_seconds() - tic
    assert isinstance(result.exception, SystemExit), (case.id, result.exception)
    assert_refused(case, result.exit_code, result.stderr, result.stdout)
    assert snapshot(folder) == before and not home.exists(), case.id
    assert seconds <= LIMIT_S, (case.id, seconds)


PROCESS = [c for c in CASES if c.process]


@pytest.mark.slow   # 3 s; the same cases run in-process
@pytest.mark.parametrize("case", PROCESS, ids=[c.id for c in PROCESS])
def test_refused_by_the_real_process(case: Case, demo_dir, tmp_path):
    folder = lay_out(case, demo_dir, tmp_path / "case")
    home = tmp_path / "home"
    before = snapshot(folder)
    tic = cpu_seconds()
    proc = segctl(*arguments(case, folder), env={"SEGCTL_HOME": home, "SEGCTL_CLUSTER": None},
                  timeout=HANG_S)
    seconds = cpu_seconds() - tic
    assert_refused(case, proc.returncode, proc.stderr, proc.stdout)
    assert snapshot(folder) == before and not home.exists(), case.id
    assert seconds <= PROCESS_S, (case.id, seconds)


def test_the_corpus_covers_every_command_and_input():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
    assert {c.cmd[0] for c in CASES} == {"validate", "plan", "submit", "train", "tune"}
    assert {c.cmd[0] for c in PROCESS} >= {"validate", "plan", "submit"}


# ------------------------------------------------------------------ README's limits table


def _readme_rows() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## What segctl refuses (limits)\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): [c.strip() for c in m.group(0).strip("|").split(" | ")]
            for m in re.finditer(r"^\| `([A-Z_]+)` \|.*$", section, re.M)}


def test_readme_lists_every_limit_with_its_value():
    rows = _readme_rows()
    constants = {k: v for k, v in vars(limits).items() if k.isupper()}
    assert set(rows) == set(constants), set(rows) ^ set(constants)
    for name, value in constants.items():
        _, shown, why = rows[name]
        if isinstance(value, dict):
            assert all(key in why for key in value), name
        elif isinstance(value, str):
            assert shown == f"`{value}`", (name, shown)
        else:
            assert shown == f"{value:,}", (name, shown)
        assert why, name


def test_the_bounds_refuse_no_real_family():
    """Every model module mlx-lm ships is a model_type the config check accepts."""
    import pkgutil

    import mlx_lm.models
    names = [m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)]
    assert len(names) > 50
    for name in names:
        limits.check_model_config({"model_type": name, "num_hidden_layers": 1}, name)
