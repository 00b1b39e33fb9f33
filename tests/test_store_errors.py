"""Each store names itself in its errors, and is looked at before it is changed.

A staging.db that is garbage, another program's, a newer segctl's or locked is
one line naming staging.db and what to do, from the head (the real Controller,
its Ray fakes from test_head_isolation) and from the CLI; never a traceback, and
never state.db blamed for it. Moved aside as that line says, the head starts and
seals what it can. A newer state.db or staging.db is refused before its mode,
its folder's mode or its journal mode change.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from segctl.orchestrator import stores as stores_mod
from segctl.orchestrator.state import State
from segctl.orchestrator.state_db import LATEST, StateError, StoreError
from segctl.orchestrator.stores import STAGING_VERSION, Stores
from segctl.schemas import store_rows as sr
from segctl.schemas.states import TrialState
from tests.conftest import locked
from tests.test_head_isolation import World, payload, running, small  # noqa: F401
from tests.test_stores import run_events


def _running_attempt(home: Path, payload: dict) -> tuple[str, int]:
    """A head that placed a trial whose engine sent its first events, then went
    away (its connections closed): (the trial, its attempt)."""
    world = World(names=("a",))
    c = world.controller(home)
    c.submit(small(payload, "s", n=1))
    world.turns(c, 2)
    [r] = running(world.agents["a"])
    spec = r.args[0]
    c.ingest(spec.attempt, run_events(1, 2))
    c.state.close()
    c.stores._con.close()
    return spec.trial, spec.attempt


def _journal(path: Path) -> str:
    con = sqlite3.connect(path)
    try:
        return con.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        con.close()


def _rollback_journal(path: Path, version: int) -> None:
    """Make `path` a file of `version`, in rollback-journal mode, readable by all:
    what a refusal must leave as it is."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=DELETE")
    con.execute(f"PRAGMA user_version = {version}")
    con.close()
    os.chmod(path, 0o644)
    os.chmod(path.parent, 0o755)


def _modes(path: Path) -> tuple[int, int]:
    return stat.S_IMODE(path.stat().st_mode), stat.S_IMODE(path.parent.stat().st_mode)


def _logs(home: Path, trial: str, monkeypatch):
    from segctl.orchestrator.cli import main
    monkeypatch.setenv("SEGCTL_HOME", str(home))
    return CliRunner().invoke(main, ["logs", trial])


def test_a_garbage_staging_db_is_one_line_naming_it_and_aside_the_head_starts_and_seals(
        tmp_path, payload, monkeypatch):
    home = tmp_path / "home"
    trial, aid = _running_attempt(home, payload)
    staging = home / sr.STAGING_DB
    for extra in ("-wal", "-shm"):
        Path(f"{staging}{extra}").unlink(missing_ok=True)
    staging.write_bytes(b"this is not a database" * 100)
    before = staging.read_bytes()
    with pytest.raises(StoreError) as e:
        World().controller(home)
    line = str(e.value)
    assert line.startswith(f"{staging}: not a usable segctl staging database") and "\n" not in line
    assert "move it aside" in line and "state.db" not in line.split(";")[0]
    assert staging.read_bytes() == before
    # the CLI says the same line, exit 2, and blames no state.db
    result = _logs(home, trial, monkeypatch)
    assert result.exit_code == 2 and "Traceback" not in result.output
    [said] = result.stderr.strip().splitlines()
    assert said == f"segctl: {line}"
    # moved aside, the head starts and seals what it can: the attempt that was
    # running is closed and sealed (its telemetry went with the broken file)
    staging.rename(home / "staging.db.broken")
    c = World().controller(home)
    assert c.stores.is_sealed(aid)
    assert (home / sr.telemetry_file("attempts", c.state.attempt(aid)["sweep"], aid)).exists()
    assert c.state.trial(trial)["state"] == TrialState.PENDING   # to run again


def test_another_programs_staging_db_is_refused_untouched(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    staging = home / sr.STAGING_DB
    con = sqlite3.connect(staging)
    con.execute("CREATE TABLE events (id INTEGER, what TEXT)")   # our table's name, not ours
    con.commit()
    con.close()
    before = staging.read_bytes()
    with pytest.raises(StoreError, match="another program's file") as e:
        World().controller(home)
    assert str(e.value).startswith(f"{staging}: ")
    assert staging.read_bytes() == before and not (home / "state.db").exists()


def test_a_newer_staging_db_is_refused_before_its_mode_or_journal_change(tmp_path, payload):
    home = tmp_path / "home"
    _running_attempt(home, payload)
    staging = home / sr.STAGING_DB
    _rollback_journal(staging, STAGING_VERSION + 1)
    with pytest.raises(StoreError) as e:
        World().controller(home)
    assert str(e.value) == (f"{staging}: written by a newer segctl (staging.db version "
                            f"{STAGING_VERSION + 1}; this segctl knows up to {STAGING_VERSION}): "
                            "upgrade segctl to use it")
    assert _modes(staging) == (0o644, 0o755) and _journal(staging) == "delete"
    with pytest.raises(StoreError, match="newer segctl"):   # a reader refuses it too
        Stores(home).events(1)


def test_a_locked_staging_db_is_one_line_saying_who_holds_it(tmp_path, payload, monkeypatch):
    home = tmp_path / "home"
    _running_attempt(home, payload)
    monkeypatch.setattr(stores_mod, "LOCK_WAIT_S", 0.3)
    with locked(home / sr.STAGING_DB):
        with pytest.raises(StoreError, match="staging.db: locked by another process"):
            World().controller(home)


def test_a_newer_state_db_is_refused_before_its_mode_or_journal_change(tmp_path):
    home = tmp_path / "home"
    State(home / "state.db").close()
    db = home / "state.db"
    _rollback_journal(db, LATEST + 1)
    with pytest.raises(StateError) as e:
        World().controller(home)
    assert str(e.value).startswith(f"{db}: written by a newer segctl (state.db version {LATEST + 1}")
    assert _modes(db) == (0o644, 0o755) and _journal(db) == "delete"
    assert not Path(f"{db}-wal").exists()
