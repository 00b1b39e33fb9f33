"""state.db's file: its schema as a list of migrations, how a connection to it is
opened (checked, migrated, private), and the errors that say in one line why a
file cannot be used. state.py's State is the only reader and writer of its rows.

Versions: `PRAGMA user_version` says how many of MIGRATIONS the file has. Opening
it for writing runs the missing ones in order, in one transaction, then sets the
version; a file written by a newer segctl is refused in one line. A file from
before versions existed (user_version 0, the tables there) is version 1. A
migration, once released, never changes: a change is a new one at the end.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from segctl.schemas.errors import UserError
from segctl.schemas.private import private_dir, private_file

# Version 1: the schema before versions existed, as it was (tests/fixtures/state_v1.sql).
V1 = """
CREATE TABLE IF NOT EXISTS sweeps (
  id TEXT PRIMARY KEY, name TEXT NOT NULL, path TEXT, spec TEXT NOT NULL,
  state TEXT NOT NULL, priority INTEGER NOT NULL, concurrency INTEGER,
  retries INTEGER NOT NULL, placement TEXT NOT NULL, created REAL NOT NULL, ended REAL);
CREATE TABLE IF NOT EXISTS trials (
  id TEXT PRIMARY KEY, sweep TEXT NOT NULL REFERENCES sweeps(id), idx INTEGER NOT NULL,
  params TEXT NOT NULL, job TEXT NOT NULL, model_info TEXT NOT NULL, seq_len INTEGER NOT NULL,
  inputs TEXT NOT NULL,           -- data file name -> sha256 of its bytes under inputs/
  state TEXT NOT NULL, message TEXT NOT NULL DEFAULT '',
  max_segment INTEGER,            -- after an oom: only sizes below this
  excluded TEXT NOT NULL DEFAULT '[]',   -- nodes where it ran out of memory at segment_size 1
  runnable_since REAL, created REAL NOT NULL, updated REAL NOT NULL,
  final_loss REAL, val_loss REAL);
CREATE INDEX IF NOT EXISTS trials_by_sweep ON trials(sweep, idx);
CREATE TABLE IF NOT EXISTS attempts (
  id INTEGER PRIMARY KEY AUTOINCREMENT, trial TEXT NOT NULL REFERENCES trials(id),
  sweep TEXT NOT NULL, attempt_no INTEGER NOT NULL, node TEXT NOT NULL, chip TEXT,
  segment_size INTEGER NOT NULL, predicted_gb REAL, budget_gb REAL, resume_step INTEGER,
  status TEXT NOT NULL,           -- placed | running | ended
  outcome TEXT, message TEXT NOT NULL DEFAULT '',
  placed REAL NOT NULL, started REAL, ended REAL, pid INTEGER,
  ready REAL,                     -- runnable: trial pending and its node free (the later)
  dispatch_s REAL,                -- ready -> engine process started
  step INTEGER, loss REAL, peak_gb REAL, final_loss REAL, val_loss REAL);
CREATE INDEX IF NOT EXISTS attempts_by_trial ON attempts(trial, id);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, sweep TEXT NOT NULL,
  trial TEXT, attempt INTEGER, from_state TEXT, to_state TEXT NOT NULL, reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_trial ON events(trial, id);
"""

# Version 2: `segctl tune` runs, so that a head that restarts resumes them.
V2 = """
CREATE TABLE tunes (
  id TEXT PRIMARY KEY, request TEXT NOT NULL,   -- what `segctl tune` sent (JSON)
  state TEXT NOT NULL, started REAL NOT NULL, ended REAL);
CREATE TABLE tune_classes (
  tune TEXT NOT NULL REFERENCES tunes(id), node_class TEXT NOT NULL, idx INTEGER NOT NULL,
  state TEXT NOT NULL, node TEXT,                -- node: the one measuring it (RUNNING)
  points TEXT NOT NULL,           -- JSON [[seq_len, segment_size]], measured in this order
  budget_gb REAL NOT NULL, done INTEGER NOT NULL DEFAULT 0, fits INTEGER NOT NULL DEFAULT 0,
  reused INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '',
  PRIMARY KEY (tune, node_class));
"""

# Version 3: the values trials reported at the rungs of an asha sweep, each with the
# decision taken on it, so that a head that restarts decides on from the same record.
V3 = """
CREATE TABLE rungs (
  sweep TEXT NOT NULL REFERENCES sweeps(id), rung INTEGER NOT NULL,   -- rung: its step
  trial TEXT NOT NULL REFERENCES trials(id), value REAL NOT NULL, time REAL NOT NULL,
  attempt INTEGER, stopped INTEGER NOT NULL DEFAULT 0, reason TEXT NOT NULL DEFAULT '',
  PRIMARY KEY (sweep, rung, trial));
"""

# Version 4: why each pending trial of a running sweep is not placed yet, as the head
# found it at its last placement (`segctl status` shows it); a trial's row goes when it
# is placed or ends.
V4 = """
CREATE TABLE waiting (
  trial TEXT PRIMARY KEY REFERENCES trials(id), sweep TEXT NOT NULL REFERENCES sweeps(id),
  reason TEXT NOT NULL, since REAL NOT NULL);   -- since: when the head first gave this reason
"""

MIGRATIONS = [V1, V2, V3, V4]   # MIGRATIONS[n] takes a file from version n to n + 1
LATEST = len(MIGRATIONS)

class TransitionError(RuntimeError):
    """A move the state machine does not allow: a controller bug, never user input."""


class StoreError(UserError, RuntimeError):
    """A store's file cannot be used (corrupt, locked, another program's, a newer
    segctl's): one line naming the file and what to do."""


class StateError(StoreError):
    """state.db cannot be used: one line naming the file and what to do."""


def unusable(path: Path, e: sqlite3.Error) -> StateError:
    text = str(e)
    if "locked" in text or "busy" in text:
        return StateError(f"{path}: locked by another process for {LOCK_WAIT_S:g} s (a second "
                          "head on the same stores? stop it, or wait for it, and try again)")
    return StateError(f"{path}: not a usable segctl state database ({text}); move it aside "
                      "and start again: the telemetry, adapters and data beside it are kept")


OPENED: list[Path] = []   # state.db files this process opened, the last one last
LOCK_WAIT_S = 30.0        # how long a connection waits for another writer's lock


def connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    """A connection to state.db, checked (and, for writing, migrated): a corrupt,
    locked, foreign or newer file is a StateError here, not a traceback at some
    later query."""
    OPENED.append(Path(path))
    con = None
    try:
        if readonly:
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=LOCK_WAIT_S)
            version(con, path)   # a newer file's tables may not mean what this code reads
        else:
            if path.exists():   # whose file and which version, before its mode or journal change
                check_before_writing(path)
            # Who trained what on which data is nobody else's business: 0700/0600,
            # whatever the umask (SQLite gives -wal and -shm the file's mode).
            private_file(private_dir(path.parent) / path.name)
            con = sqlite3.connect(path, timeout=LOCK_WAIT_S, check_same_thread=False,
                                  isolation_level=None)  # explicit BEGIN/COMMIT below
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            migrate(con, path)
        con.execute("SELECT id, state FROM sweeps LIMIT 1").fetchall()
    except (sqlite3.Error, StateError) as e:
        if con is not None:
            con.close()
        raise (e if isinstance(e, StateError) else unusable(path, e)) from None
    con.row_factory = sqlite3.Row
    return con


def check_before_writing(path: Path) -> None:
    """Refuse an existing state.db that is another program's file or a newer
    segctl's before the writer changes anything of it (its mode, its journal): read
    through a connection of its own, closed before the writer's opens."""
    con = sqlite3.connect(path, timeout=LOCK_WAIT_S)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
        if tables and "sweeps" not in tables:   # never add our tables to another program's database
            raise sqlite3.DatabaseError("it holds no sweeps table: another program's file")
        version(con, path)
    finally:
        con.close()


def version(con: sqlite3.Connection, path: Path) -> int:
    """Which version the file is at; StateError when a newer segctl wrote it."""
    have = con.execute("PRAGMA user_version").fetchone()[0]
    if have > LATEST:
        raise StateError(f"{path}: written by a newer segctl (state.db version {have}; this "
                         f"segctl knows up to {LATEST}): upgrade segctl to use it")
    if have == 0 and con.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sweeps'").fetchone():
        return 1   # made before state.db had versions: version 1's tables are there
    return have


def migrate(con: sqlite3.Connection, path: Path) -> None:
    """Run the migrations the file lacks, in order, in one transaction: a crash or
    an error leaves it at its old version, whole."""
    if version(con, path) == LATEST:
        return
    con.execute("BEGIN IMMEDIATE")   # read again under the write lock: one head migrates
    try:
        for script in MIGRATIONS[version(con, path):]:
            for statement in statements(script):
                con.execute(statement)
        con.execute(f"PRAGMA user_version = {LATEST}")
        con.execute("COMMIT")
    except BaseException:
        if con.in_transaction:   # SQLite may have rolled it back itself (a full disk)
            con.execute("ROLLBACK")
        raise


def statements(script: str) -> list[str]:
    """A script's statements one by one (executescript would commit the open
    transaction first); a `;` inside a comment or a string does not end one."""
    out, pending = [], ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                out.append(pending)
            pending = ""
    return out
