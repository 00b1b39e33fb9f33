"""state.db: sweeps, trials, attempts and every transition, in SQLite (WAL).

The head's controller is the only writer; `segctl status/logs/gather` open their
own read connections (WAL lets them read while the head writes). Every state
change of a trial goes through `move`, which checks it against the state machine
in schemas/records.py and writes the events row in the same transaction.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from node.raynode import private_dir, private_file
from schemas.records import MOVES, TERMINAL, SweepState, TrialState

SCHEMA = """
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


class TransitionError(RuntimeError):
    """A move the state machine does not allow: a controller bug, never user input."""


class StateError(RuntimeError):
    """state.db cannot be used (corrupt, locked, not ours): one line naming the file
    and what to do."""


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
    """A connection to state.db, checked: a corrupt, locked or foreign file is a
    StateError here, not a traceback at some later query."""
    OPENED.append(Path(path))
    try:
        if readonly:
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=LOCK_WAIT_S)
        else:
            fresh = not path.exists()
            # Who trained what on which data is nobody else's business: 0700/0600,
            # whatever the umask (SQLite gives -wal and -shm the file's mode).
            private_file(private_dir(path.parent) / path.name)
            con = sqlite3.connect(path, timeout=LOCK_WAIT_S, check_same_thread=False,
                                  isolation_level=None)  # explicit BEGIN/COMMIT below
            if not fresh:   # never add our tables to another program's database
                tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
                if tables and "sweeps" not in tables:
                    raise sqlite3.DatabaseError("it holds no sweeps table: another program's file")
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            con.executescript(SCHEMA)
        con.execute("SELECT id, state FROM sweeps LIMIT 1").fetchall()
    except sqlite3.Error as e:
        raise unusable(path, e) from None
    con.row_factory = sqlite3.Row
    return con


class State:
    """The writer. One connection shared by the head's threads behind a lock."""

    def __init__(self, path: Path, clock=time.time):
        self.path = Path(path)
        self.con = connect(self.path)
        self.lock = threading.RLock()
        self.clock = clock

    # -------------------------------------------------------------- plumbing
    def tx(self):
        return _Tx(self)

    def q(self, sql: str, args: Iterable = ()) -> list[sqlite3.Row]:
        with self.lock:
            return self.con.execute(sql, tuple(args)).fetchall()

    def one(self, sql: str, args: Iterable = ()) -> Optional[sqlite3.Row]:
        rows = self.q(sql, args)
        return rows[0] if rows else None

    # -------------------------------------------------------------- sweeps
    def add_sweep(self, name: str, path: str, spec: dict, trials: list[dict]) -> str:
        """Record a sweep and its trials (all PENDING); returns the sweep id `name-N`."""
        now = self.clock()
        with self.tx() as con:
            n = con.execute("SELECT COUNT(*) FROM sweeps WHERE name = ?", (name,)).fetchone()[0]
            sid = f"{name}-{n + 1}"
            while con.execute("SELECT 1 FROM sweeps WHERE id = ?", (sid,)).fetchone():
                n += 1
                sid = f"{name}-{n + 1}"
            con.execute("INSERT INTO sweeps VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                        (sid, name, path, json.dumps(spec), SweepState.RUNNING.value,
                         spec.get("priority", 0), spec.get("concurrency"), spec.get("retries", 3),
                         json.dumps(spec.get("placement") or {}), now, None))
            for t in trials:
                tid = f"{sid}-{t['name']}"
                con.execute(
                    "INSERT INTO trials (id, sweep, idx, params, job, model_info, seq_len, inputs,"
                    " state, runnable_since, created, updated) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (tid, sid, t["index"], json.dumps(t["params"]), json.dumps(t["job"]),
                     json.dumps(t["model_info"]), t["seq_len"], json.dumps(t["inputs"]),
                     TrialState.PENDING.value,
                     now, now, now))
                con.execute("INSERT INTO events (time, sweep, trial, attempt, from_state, to_state,"
                            " reason) VALUES (?,?,?,?,?,?,?)",
                            (now, sid, tid, None, None, TrialState.PENDING.value, "submitted"))
            con.execute("INSERT INTO events (time, sweep, trial, attempt, from_state, to_state,"
                        " reason) VALUES (?,?,?,?,?,?,?)",
                        (now, sid, None, None, None, SweepState.RUNNING.value,
                         f"submitted with {len(trials)} trials"))
        return sid

    def set_sweep_state(self, sid: str, to: SweepState, reason: str) -> None:
        now = self.clock()
        with self.tx() as con:
            row = con.execute("SELECT state FROM sweeps WHERE id = ?", (sid,)).fetchone()
            if row is None or row[0] == to.value:
                return
            ended = now if to in (SweepState.DONE, SweepState.CANCELLED, SweepState.FAILED) else None
            con.execute("UPDATE sweeps SET state = ?, ended = ? WHERE id = ?", (to.value, ended, sid))
            con.execute("INSERT INTO events (time, sweep, trial, attempt, from_state, to_state,"
                        " reason) VALUES (?,?,?,?,?,?,?)", (now, sid, None, None, row[0], to.value, reason))

    # -------------------------------------------------------------- trials
    def move(self, tid: str, to: TrialState, reason: str, *, attempt: int | None = None,
             **fields: Any) -> None:
        """Change a trial's state (checked against the state machine) and record why."""
        now = self.clock()
        with self.tx() as con:
            row = con.execute("SELECT sweep, state FROM trials WHERE id = ?", (tid,)).fetchone()
            frm = TrialState(row["state"])
            if to not in MOVES.get(frm, set()):
                raise TransitionError(f"trial {tid}: {frm.value} -> {to.value} is not a legal move")
            fields = dict(fields, state=to.value, updated=now)
            if to == TrialState.PENDING:
                fields["runnable_since"] = now
            sets = ", ".join(f"{k} = ?" for k in fields)
            con.execute(f"UPDATE trials SET {sets} WHERE id = ?", (*fields.values(), tid))
            con.execute("INSERT INTO events (time, sweep, trial, attempt, from_state, to_state,"
                        " reason) VALUES (?,?,?,?,?,?,?)",
                        (now, row["sweep"], tid, attempt, frm.value, to.value, reason))

    def trial(self, tid: str) -> sqlite3.Row:
        return self.one("SELECT * FROM trials WHERE id = ?", (tid,))

    # -------------------------------------------------------------- attempts
    def add_attempt(self, tid: str, *, node: str, chip: str, segment_size: int,
                    predicted_gb: float, budget_gb: float, resume_step: int | None,
                    ready: float) -> int:
        now = self.clock()
        with self.tx() as con:
            t = con.execute("SELECT sweep FROM trials WHERE id = ?", (tid,)).fetchone()
            n = con.execute("SELECT COUNT(*) FROM attempts WHERE trial = ?", (tid,)).fetchone()[0]
            cur = con.execute(
                "INSERT INTO attempts (trial, sweep, attempt_no, node, chip, segment_size,"
                " predicted_gb, budget_gb, resume_step, status, placed, ready)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (tid, t["sweep"], n + 1, node, chip, segment_size, predicted_gb, budget_gb,
                 resume_step, "placed", now, ready))
            return cur.lastrowid

    def update_attempt(self, aid: int, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.tx() as con:
            con.execute(f"UPDATE attempts SET {sets} WHERE id = ?", (*fields.values(), aid))

    def attempt(self, aid: int) -> sqlite3.Row:
        return self.one("SELECT * FROM attempts WHERE id = ?", (aid,))


class _Tx:
    def __init__(self, state: State):
        self.state = state

    def __enter__(self) -> sqlite3.Connection:
        self.state.lock.acquire()
        self.state.con.execute("BEGIN IMMEDIATE")
        return self.state.con

    def __exit__(self, typ, exc, tb):
        try:
            self.state.con.execute("COMMIT" if typ is None else "ROLLBACK")
        finally:
            self.state.lock.release()


# ------------------------------------------------------------------ read side

def read(path: Path) -> sqlite3.Connection:
    """A read-only connection for the CLI (fails clearly if there is no state yet)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: no sweeps recorded here yet")
    return connect(Path(path), readonly=True)


def sweep_status(con: sqlite3.Connection, sid: str | None) -> list[dict]:
    """Per sweep, per trial: state, the attempts (node, segment size, outcome, peak)."""
    if sid is None:
        sweeps = con.execute("SELECT * FROM sweeps ORDER BY created").fetchall()
    else:
        sweeps = con.execute("SELECT * FROM sweeps WHERE id = ?", (sid,)).fetchall()
        if not sweeps:
            raise KeyError(f"no sweep named {sid!r}")
    out = []
    for s in sweeps:
        trials = []
        for t in con.execute("SELECT * FROM trials WHERE sweep = ? ORDER BY idx", (s["id"],)):
            attempts = [dict(attempt=a["id"], attempt_no=a["attempt_no"], node=a["node"],
                             segment_size=a["segment_size"], predicted_gb=a["predicted_gb"],
                             status=a["status"], outcome=a["outcome"], message=a["message"],
                             step=a["step"], loss=a["loss"], peak_gb=a["peak_gb"],
                             resume_step=a["resume_step"], dispatch_s=a["dispatch_s"],
                             started=a["started"], ended=a["ended"])
                        for a in con.execute("SELECT * FROM attempts WHERE trial = ? ORDER BY id",
                                             (t["id"],))]
            trials.append(dict(trial=t["id"], state=t["state"], params=json.loads(t["params"]),
                               message=t["message"], final_loss=t["final_loss"],
                               val_loss=t["val_loss"], attempts=attempts))
        out.append(dict(sweep=s["id"], name=s["name"], state=s["state"], priority=s["priority"],
                        created=s["created"], ended=s["ended"], trials=trials))
    return out


def trial_events(con: sqlite3.Connection, tid: str, after: int = 0) -> list[dict]:
    return [dict(r) for r in con.execute(
        "SELECT * FROM events WHERE trial = ? AND id > ? ORDER BY id", (tid, after))]


def is_terminal(state: str) -> bool:
    return TrialState(state) in TERMINAL
