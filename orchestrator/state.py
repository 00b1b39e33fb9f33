"""state.db: sweeps, trials, attempts, tunes, every transition and why each pending
trial waits, in SQLite (WAL).

The head's controller is the only writer; `segctl status/logs/gather` open their
own read-only State (WAL lets them read while the head writes). Every query is a
named method of State, so no other module knows the tables' columns. Every state
change goes through a method that checks it against the state machines in
schemas/records.py: `move` for a trial (writing its events row in the same
transaction), `update_attempt` for an attempt, `move_tune_class` for a tune.
What the head's policies read comes typed, its JSON decoded here once:
`sweep_record`, `trial_record` / `trial_of`, `last_attempt_record` / `attempt_of`
(the records of snapshot.py); the other readers still return sqlite3.Row.
The file itself (its schema, its migrations, how a connection is opened and why
one is refused) is state_db.py's.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from pydantic import ValidationError

from segctl.schemas.cluster import PlannerSpec
from segctl.schemas.limits import one_line
from segctl.schemas.search import SchedulerSpec
from segctl.schemas.states import (
    ATTEMPT_MOVES,
    MOVES,
    TERMINAL,
    TUNE_MOVES,
    TUNE_TERMINAL,
    AttemptStatus,
    Outcome,
    SweepState,
    TrialState,
    TuneState,
)
from segctl.schemas.sweep import SweepSpec

from .snapshot import Attempt, Sweep, Trial
from .state_db import TransitionError, connect, version

# The columns each reader gets, by name: no caller depends on the tables' order.
SWEEP = "id, name, path, spec, state, priority, concurrency, retries, placement, created, ended"
TRIAL = ("id, sweep, idx, params, job, model_info, seq_len, inputs, state, message, max_segment,"
         " excluded, runnable_since, created, updated, final_loss, val_loss")
ATTEMPT = ("id, trial, sweep, attempt_no, node, chip, segment_size, predicted_gb, budget_gb,"
           " resume_step, status, outcome, message, placed, started, ended, pid, ready,"
           " dispatch_s, step, loss, peak_gb, final_loss, val_loss")
EVENT = "id, time, sweep, trial, attempt, from_state, to_state, reason"
TUNE_CLASS = "tune, node_class, idx, state, node, points, budget_gb, done, fits, reused, error"


def _placeholders(values: Iterable) -> tuple[str, tuple]:
    values = tuple(values)
    return ", ".join(["?"] * len(values)), values


def _tune_state(classes: Iterable[str]) -> TuneState:
    """A tune's state from its classes': RUNNING while one is unfinished, then
    FAILED if one failed, CANCELLED if one was cancelled, else DONE."""
    states = set(classes)
    if states & {TuneState.QUEUED, TuneState.RUNNING}:
        return TuneState.RUNNING
    for end in (TuneState.FAILED, TuneState.CANCELLED):
        if end in states:
            return end
    return TuneState.DONE


def _update(con: sqlite3.Connection, table: str, key, value, fields: dict) -> None:
    """UPDATE `table` SET the named `fields` WHERE its `key` column(s) equal `value`."""
    keys, values = (key, value) if isinstance(key, tuple) else ((key,), (value,))
    sets = ", ".join(f"{k} = :set_{k}" for k in fields)
    where = " AND ".join(f"{k} = :key_{k}" for k in keys)
    con.execute(f"UPDATE {table} SET {sets} WHERE {where}",
                {**{f"set_{k}": v for k, v in fields.items()},
                 **{f"key_{k}": v for k, v in zip(keys, values)}})


def _event(con: sqlite3.Connection, now: float, sweep: str, trial: str | None,
           attempt: int | None, frm, to, reason: str) -> None:
    """The events row of one transition (states as their values)."""
    con.execute("INSERT INTO events (time, sweep, trial, attempt, from_state, to_state, reason)"
                " VALUES (?,?,?,?,?,?,?)",
                (now, sweep, trial, attempt, getattr(frm, "value", frm), getattr(to, "value", to),
                 reason))


class State:
    """state.db through named queries. The head's is the writer, one connection
    shared by its threads behind a lock; `read` gives the CLI a read-only one."""

    def __init__(self, path: Path, clock=time.time, *, readonly: bool = False):
        self.path = Path(path)
        self.con = connect(self.path, readonly=readonly)
        self.version = version(self.con, self.path)   # below LATEST: an older file, read only
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

    def count(self, sql: str, args: Iterable = ()) -> int:
        """A `SELECT COUNT(*) AS n ...` query's n (such a query always has its row)."""
        return int(self.q(sql, args)[0]["n"])

    def known_sweep(self, sid: str) -> sqlite3.Row:
        """Sweep `sid`'s row, which must exist (KeyError otherwise)."""
        return _must(self.sweep(sid), f"no sweep named {sid!r}")

    def close(self) -> None:
        self.con.close()

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
            con.execute(
                "INSERT INTO sweeps (id, name, path, spec, state, priority, concurrency, retries,"
                " placement, created, ended) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
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
                _event(con, now, sid, tid, None, None, TrialState.PENDING, "submitted")
            _event(con, now, sid, None, None, None, SweepState.RUNNING,
                   f"submitted with {len(trials)} trials")
        return sid

    def set_sweep_state(self, sid: str, to: SweepState, reason: str) -> None:
        now = self.clock()
        with self.tx() as con:
            row = con.execute("SELECT state FROM sweeps WHERE id = ?", (sid,)).fetchone()
            if row is None or row[0] == to.value:
                return
            ended = now if to in (SweepState.DONE, SweepState.CANCELLED, SweepState.FAILED) else None
            con.execute("UPDATE sweeps SET state = ?, ended = ? WHERE id = ?", (to.value, ended, sid))
            _event(con, now, sid, None, None, row[0], to, reason)

    def sweep(self, sid: str) -> Optional[sqlite3.Row]:
        return self.one(f"SELECT {SWEEP} FROM sweeps WHERE id = ?", (sid,))

    def scheduler(self, sid: str) -> Optional[SchedulerSpec]:
        """Sweep `sid`'s early stopping (its `scheduler:`), typed; None without one."""
        spec = json.loads(self.known_sweep(sid)["spec"]).get("scheduler")
        return SchedulerSpec.model_validate(spec) if spec else None

    def sweeps(self) -> list[sqlite3.Row]:
        """Every sweep, the oldest first."""
        return self.q(f"SELECT {SWEEP} FROM sweeps ORDER BY created")

    def running_sweeps(self) -> list[sqlite3.Row]:
        """The sweeps the controller places, in the order it serves them."""
        return self.q(f"SELECT {SWEEP} FROM sweeps WHERE state = ? ORDER BY priority DESC, created",
                      (SweepState.RUNNING.value,))

    # -------------------------------------------------------------- trials
    def move(self, tid: str, to: TrialState, reason: str, *, attempt: int | None = None,
             **fields: Any) -> None:
        """Change a trial's state (checked against the state machine) and record why."""
        with self.tx() as con:
            self._move(con, tid, to, reason, attempt, fields)

    def _move(self, con: sqlite3.Connection, tid: str, to: TrialState, reason: str,
              attempt: int | None, fields: dict) -> None:
        now = self.clock()
        row = con.execute("SELECT sweep, state FROM trials WHERE id = ?", (tid,)).fetchone()
        frm = TrialState(row["state"])
        if to not in MOVES.get(frm, set()):
            raise TransitionError(f"trial {tid}: {frm.value} -> {to.value} is not a legal move")
        fields = dict(fields, state=to.value, updated=now)
        if to == TrialState.PENDING:
            fields["runnable_since"] = now
        _update(con, "trials", "id", tid, fields)
        _event(con, now, row["sweep"], tid, attempt, frm, to, reason)

    def trial(self, tid: str) -> Optional[sqlite3.Row]:
        return self.one(f"SELECT {TRIAL} FROM trials WHERE id = ?", (tid,))

    def known_trial(self, tid: str) -> sqlite3.Row:
        """Trial `tid`'s row, which must exist (KeyError otherwise)."""
        return _must(self.trial(tid), f"no trial named {tid!r}")

    def trial_record(self, tid: str) -> Trial:
        """Trial `tid` typed, its JSON decoded (ValueError on a row left wrong,
        KeyError when there is none)."""
        return trial_of(self.known_trial(tid))

    def trials(self, sid: str, state: TrialState | None = None) -> list[sqlite3.Row]:
        """A sweep's trials (those in `state` when given) in their sweep's order."""
        if state is None:
            return self.q(f"SELECT {TRIAL} FROM trials WHERE sweep = ? ORDER BY idx", (sid,))
        return self.q(f"SELECT {TRIAL} FROM trials WHERE sweep = ? AND state = ? ORDER BY idx",
                      (sid, state.value))

    def results(self, sid: str) -> list[dict]:
        """A sweep's trials as `segctl gather` ranks them, in their sweep's order:
        {trial, state, params, metrics: {val_loss, final_loss}} (no attempts, no job)."""
        if self.sweep(sid) is None:
            raise KeyError(f"no sweep named {sid!r}")
        return [{"trial": t["id"], "state": t["state"], "params": json.loads(t["params"]),
                 "metrics": {"val_loss": t["val_loss"], "final_loss": t["final_loss"]}}
                for t in self.q("SELECT id, state, params, final_loss, val_loss FROM trials"
                                " WHERE sweep = ? ORDER BY idx", (sid,))]

    def pending_ids(self, sid: str, after: int = -1, limit: int = -1) -> list[tuple[str, int]]:
        """(id, idx) of a sweep's PENDING trials past index `after`, in their sweep's
        order, `limit` at most (-1: all)."""
        return [(r["id"], r["idx"]) for r in self.q(
            "SELECT id, idx FROM trials WHERE sweep = ? AND state = ? AND idx > ? ORDER BY idx"
            " LIMIT ?", (sid, TrialState.PENDING.value, after, limit))]

    def count_trials(self, sid: str, states: Iterable[TrialState]) -> int:
        marks, values = _placeholders(s.value for s in states)
        return self.count(f"SELECT COUNT(*) AS n FROM trials WHERE sweep = ? AND state IN ({marks})",
                          (sid, *values))

    def unfinished(self, sid: str) -> int:
        """How many of a sweep's trials are not yet in a terminal state."""
        return self.count_trials(sid, set(TrialState) - TERMINAL)

    def serves_model(self, path: str) -> bool:
        """Whether some trial trains, or some tune measures, the model folder `path`."""
        jobs = self.q("SELECT DISTINCT job FROM trials")
        requests = self.q("SELECT request FROM tunes")
        return (any(json.loads(r["job"]).get("model") == path for r in jobs)
                or any(json.loads(r["request"])["model"] == path for r in requests))

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
                 resume_step, AttemptStatus.PLACED.value, now, ready))
            return cur.lastrowid

    def update_attempt(self, aid: int, **fields: Any) -> None:
        """Set an attempt's fields; a change of `status` is checked against its moves."""
        with self.tx() as con:
            if "status" in fields:
                frm = AttemptStatus(con.execute("SELECT status FROM attempts WHERE id = ?",
                                                (aid,)).fetchone()["status"])
                to = AttemptStatus(fields["status"])
                if to not in ATTEMPT_MOVES.get(frm, set()):
                    raise TransitionError(f"attempt {aid}: {frm.value} -> {to.value} is not a "
                                          "legal move")
            _update(con, "attempts", "id", aid, fields)

    def attempt(self, aid: int) -> Optional[sqlite3.Row]:
        return self.one(f"SELECT {ATTEMPT} FROM attempts WHERE id = ?", (aid,))

    def known_attempt(self, aid: int) -> sqlite3.Row:
        """Attempt `aid`'s row, which must exist (KeyError otherwise)."""
        return _must(self.attempt(aid), f"no attempt {aid}")

    def attempts(self, tid: str) -> list[sqlite3.Row]:
        """A trial's attempts, the first first."""
        return self.q(f"SELECT {ATTEMPT} FROM attempts WHERE trial = ? ORDER BY id", (tid,))

    def last_attempt(self, tid: str) -> Optional[sqlite3.Row]:
        return self.one(f"SELECT {ATTEMPT} FROM attempts WHERE trial = ? ORDER BY id DESC LIMIT 1",
                        (tid,))

    def last_attempt_record(self, tid: str) -> Optional[Attempt]:
        row = self.last_attempt(tid)
        return None if row is None else attempt_of(row)

    def open_attempts(self, tid: str | None = None) -> list[sqlite3.Row]:
        """Attempts not yet ended (of trial `tid`, or all)."""
        sql = f"SELECT {ATTEMPT} FROM attempts WHERE status != ?"
        if tid is None:
            return self.q(sql + " ORDER BY id", (AttemptStatus.ENDED.value,))
        return self.q(sql + " AND trial = ? ORDER BY id", (AttemptStatus.ENDED.value, tid))

    def ended_attempts(self, sid: str | None = None) -> list[int]:
        """Ids of the attempts that ended (of sweep `sid`, or all)."""
        sql = "SELECT id FROM attempts WHERE status = ?"
        if sid is None:
            return [r["id"] for r in self.q(sql, (AttemptStatus.ENDED.value,))]
        return [r["id"] for r in self.q(sql + " AND sweep = ?", (AttemptStatus.ENDED.value, sid))]

    def charged_attempts(self, tid: str) -> int:
        """A trial's ended attempts that count against its sweep's retries (an
        interrupted one was the head's doing, not the trial's)."""
        return self.count("SELECT COUNT(*) AS n FROM attempts WHERE trial = ? AND outcome IS NOT NULL"
                          " AND outcome != ?", (tid, Outcome.INTERRUPTED.value))

    # -------------------------------------------------------------- rungs (asha)
    def rung_values(self, sid: str, rung: int) -> dict[str, float]:
        """trial -> the value it reported at rung `rung` of sweep `sid`."""
        return {r["trial"]: r["value"] for r in self.q(
            "SELECT trial, value FROM rungs WHERE sweep = ? AND rung = ?", (sid, rung))}

    def rungs(self, sid: str) -> list[dict]:
        """Every value recorded at a rung of sweep `sid`, in the order they came."""
        return [dict(r) for r in self.q(
            "SELECT sweep, rung, trial, value, time, attempt, stopped, reason FROM rungs"
            " WHERE sweep = ? ORDER BY time, rowid", (sid,))]

    def record_rung(self, sid: str, rung: int, tid: str, value: float, *,
                    attempt: int | None, stop: str | None) -> bool:
        """Record trial `tid`'s value at a rung and, when `stop` (the reason) is given,
        move it to STOPPED in the same transaction. Returns False, changing nothing,
        when the trial has a value at that rung already (a decision is taken once)."""
        with self.tx() as con:
            cur = con.execute(
                "INSERT OR IGNORE INTO rungs (sweep, rung, trial, value, time, attempt, stopped,"
                " reason) VALUES (?,?,?,?,?,?,?,?)",
                (sid, rung, tid, value, self.clock(), attempt, int(stop is not None), stop or ""))
            if cur.rowcount != 1:
                return False
            if stop is not None:
                self._move(con, tid, TrialState.STOPPED, stop, attempt, {"message": stop})
            return True

    # -------------------------------------------------------------- why trials wait
    def note_waiting(self, reasons: dict[str, tuple[str, str]], gone: Iterable[str]) -> None:
        """Record why pending trials wait (trial -> (sweep, reason); a new reason starts
        its `since`) and forget the trials in `gone`, in one transaction."""
        now = self.clock()
        with self.tx() as con:
            con.executemany("DELETE FROM waiting WHERE trial = ?", [(t,) for t in gone])
            con.executemany(
                "INSERT INTO waiting (trial, sweep, reason, since) VALUES (?,?,?,?) ON CONFLICT"
                " (trial) DO UPDATE SET reason = excluded.reason, since = excluded.since",
                [(t, sid, why, now) for t, (sid, why) in reasons.items()])

    def waiting(self, sid: str | None = None) -> dict[str, str]:
        """trial -> why it waits, as the head last recorded it (of sweep `sid`, or all); a
        file from before version 4 (read only) has none."""
        if self.version < 4:
            return {}
        if sid is None:
            return {r["trial"]: r["reason"] for r in self.q("SELECT trial, reason FROM waiting")}
        return {r["trial"]: r["reason"] for r in self.q(
            "SELECT trial, reason FROM waiting WHERE sweep = ?", (sid,))}

    # -------------------------------------------------------------- events, status
    def events(self, after: int = 0, *, sweep: str | None = None,
               trial: str | None = None) -> list[dict]:
        """The transitions of one sweep (its trials' too) or of one trial, after event
        id `after`, in order."""
        key, value = ("trial", trial) if trial is not None else ("sweep", sweep)
        return [dict(r) for r in self.q(
            f"SELECT {EVENT} FROM events WHERE {key} = ? AND id > ? ORDER BY id", (value, after))]

    def status(self, sid: str | None) -> list[dict]:
        """Per sweep, per trial: state, the attempts (node, segment size, outcome, peak)."""
        sweeps = self.sweeps() if sid is None else [self.known_sweep(sid)]
        out = []
        for s in sweeps:
            trials, waiting = [], self.waiting(s["id"])
            spec = json.loads(s["spec"])
            # two queries per sweep, not one per trial (a sweep has up to MAX_TRIALS)
            by_trial: dict[str, list] = {}
            for a in self.q(f"SELECT {ATTEMPT} FROM attempts WHERE sweep = ? ORDER BY id",
                            (s["id"],)):
                by_trial.setdefault(a["trial"], []).append(a)
            for t in self.q("SELECT id, state, params, message, final_loss, val_loss FROM trials"
                            " WHERE sweep = ? ORDER BY idx", (s["id"],)):
                attempts = [dict(attempt=a["id"], attempt_no=a["attempt_no"], node=a["node"],
                                 segment_size=a["segment_size"], predicted_gb=a["predicted_gb"],
                                 status=a["status"], outcome=a["outcome"], message=a["message"],
                                 step=a["step"], loss=a["loss"], peak_gb=a["peak_gb"],
                                 resume_step=a["resume_step"], dispatch_s=a["dispatch_s"],
                                 started=a["started"], ended=a["ended"])
                            for a in by_trial.get(t["id"], [])]
                why = None
                if t["state"] == TrialState.PENDING:   # the head places none of a held sweep
                    why = (f"the head restarted: `segctl resume {s['id']}` continues this sweep"
                           if s["state"] == SweepState.INTERRUPTED else waiting.get(t["id"]))
                trials.append(dict(trial=t["id"], state=t["state"], params=json.loads(t["params"]),
                                   message=t["message"], final_loss=t["final_loss"],
                                   val_loss=t["val_loss"], pending_reason=why,
                                   attempts=attempts))
            # owner and share live in the sweep's spec (a sweep from before them: '' and 1)
            out.append(dict(sweep=s["id"], name=s["name"], state=s["state"], priority=s["priority"],
                            share=spec.get("share", 1.0), owner=spec.get("owner", ""),
                            created=s["created"], ended=s["ended"], trials=trials))
        return out

    # -------------------------------------------------------------- tunes
    def add_tune(self, request: dict) -> str:
        """Record a tune and its classes (QUEUED, or DONE when nothing is left to
        measure); returns its id `tune-YYYYmmdd-HHMMSS-N`."""
        now = self.clock()
        stamp = f"tune-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
        with self.tx() as con:
            n = 1
            while con.execute("SELECT 1 FROM tunes WHERE id = ?", (f"{stamp}-{n}",)).fetchone():
                n += 1
            tid = f"{stamp}-{n}"
            states = [TuneState.QUEUED if c["points"] else TuneState.DONE
                      for c in request["classes"].values()]
            to = _tune_state(states)
            con.execute("INSERT INTO tunes (id, request, state, started, ended) VALUES (?,?,?,?,?)",
                        (tid, json.dumps(request), to.value, now,
                         now if to in TUNE_TERMINAL else None))
            for i, ((cls, c), state) in enumerate(zip(request["classes"].items(), states)):
                con.execute(
                    "INSERT INTO tune_classes (tune, node_class, idx, state, points, budget_gb,"
                    " reused) VALUES (?,?,?,?,?,?,?)",
                    (tid, cls, i, state.value, json.dumps([list(p) for p in c["points"]]),
                     c["budget_gb"], c.get("reused", 0)))
        return tid

    def tune(self, tid: str) -> Optional[dict]:
        """A tune: id, request, state, started, ended and its classes {node class: row}
        in the request's order; None when there is none of that id."""
        row = self.one("SELECT id, request, state, started, ended FROM tunes WHERE id = ?", (tid,))
        if row is None:
            return None
        classes = self.q(f"SELECT {TUNE_CLASS} FROM tune_classes WHERE tune = ? ORDER BY idx",
                         (tid,))
        return dict(row, request=json.loads(row["request"]),
                    classes={c["node_class"]: dict(c, points=json.loads(c["points"]))
                             for c in classes})

    def queued_tune_classes(self) -> list[dict]:
        """Every QUEUED class of every tune, the oldest tune first, with its tune's request."""
        rows = self.q(
            "SELECT tune_classes.tune AS tune, node_class, points, done, request FROM tune_classes"
            " JOIN tunes ON tunes.id = tune_classes.tune WHERE tune_classes.state = ?"
            " ORDER BY tunes.started, tunes.id, tune_classes.idx", (TuneState.QUEUED.value,))
        return [dict(r, points=json.loads(r["points"]), request=json.loads(r["request"]))
                for r in rows]

    def tune_classes(self, tid: str, state: TuneState) -> list[sqlite3.Row]:
        return self.q(f"SELECT {TUNE_CLASS} FROM tune_classes WHERE tune = ? AND state = ?"
                      " ORDER BY idx", (tid, state.value))

    def tune_class_on(self, tid: str, node: str) -> Optional[sqlite3.Row]:
        """The class of tune `tid` that node `node` measures (a node has one class)."""
        return self.one(f"SELECT {TUNE_CLASS} FROM tune_classes WHERE tune = ? AND node = ?",
                        (tid, node))

    def move_tune_class(self, tid: str, cls: str, to: TuneState, **fields: Any) -> None:
        """Change one class's state (checked against TUNE_MOVES); the tune's own
        state follows its classes' in the same transaction."""
        with self.tx() as con:
            row = con.execute("SELECT state FROM tune_classes WHERE tune = ? AND node_class = ?",
                              (tid, cls)).fetchone()
            frm = TuneState(row["state"])
            if to not in TUNE_MOVES.get(frm, set()):
                raise TransitionError(f"tune {tid}, {cls}: {frm.value} -> {to.value} is not a "
                                      "legal move")
            _update(con, "tune_classes", ("tune", "node_class"), (tid, cls),
                    dict(fields, state=to.value))
            self._settle_tune(con, tid)

    def count_probe(self, tid: str, cls: str, fits: bool) -> None:
        """One more point of a class measured."""
        with self.tx() as con:
            con.execute("UPDATE tune_classes SET done = done + 1, fits = fits + ?"
                        " WHERE tune = ? AND node_class = ?", (int(bool(fits)), tid, cls))

    def requeue_tunes(self) -> int:
        """After a head restart: each class whose probe ran under the old head is
        queued again (it measures the points still missing) or, when none is
        missing, done. Returns how many go again."""
        again = 0
        for t in self.q("SELECT id FROM tunes WHERE state = ?", (TuneState.RUNNING.value,)):
            for c in self.tune_classes(t["id"], TuneState.RUNNING):
                left = len(json.loads(c["points"])) - c["done"]
                self.move_tune_class(t["id"], c["node_class"],
                                     TuneState.QUEUED if left > 0 else TuneState.DONE, node=None)
                again += left > 0
        return again

    def _settle_tune(self, con: sqlite3.Connection, tid: str) -> None:
        frm = TuneState(con.execute("SELECT state FROM tunes WHERE id = ?", (tid,)).fetchone()[0])
        to = _tune_state(r[0] for r in con.execute(
            "SELECT state FROM tune_classes WHERE tune = ?", (tid,)))
        if to == frm:
            return
        if to not in TUNE_MOVES.get(frm, set()):
            raise TransitionError(f"tune {tid}: {frm.value} -> {to.value} is not a legal move")
        con.execute("UPDATE tunes SET state = ?, ended = ? WHERE id = ?",
                    (to.value, self.clock() if to in TUNE_TERMINAL else None, tid))


def _must(row: Optional[sqlite3.Row], missing: str) -> sqlite3.Row:
    if row is None:
        raise KeyError(missing)
    return row


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


# ------------------------------------------------------------------ typed records

def sweep_record(row) -> Sweep:
    """A sweep's row of state.db as the placement turn uses it: its spec with the
    row's own columns (priority, concurrency, retries, placement: what the head
    schedules by) held to SweepSpec, the planner's knobs to PlannerSpec, every value
    typed. A row an older or hostile writer left wrong is a ValueError naming the
    key, one line."""
    try:
        spec = json.loads(row["spec"])
        if not isinstance(spec, dict):
            raise ValueError(f"expected a mapping, got {type(spec).__name__}")
        placement = json.loads(row["placement"])
    except (ValueError, TypeError) as e:
        raise ValueError(one_line(f"spec or placement: not a JSON mapping ({e})")) from None
    given = {k: v for k, v in spec.items() if k != "planner"}
    given.update(priority=row["priority"], concurrency=row["concurrency"], retries=row["retries"],
                 placement=placement)
    try:
        sweep = SweepSpec.model_validate(given)
        knobs = PlannerSpec.model_validate(spec.get("planner") or {})
        created = float(row["created"])
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(one_line(f"{'.'.join(map(str, err['loc']))}: {err['msg']}")) from None
    except (TypeError, ValueError) as e:
        raise ValueError(one_line(f"created: not a time ({e})")) from None
    return Sweep(id=row["id"], priority=sweep.priority, share=sweep.share,
                 concurrency=sweep.concurrency, retries=sweep.retries,
                 placement=dict(sweep.placement), planner=knobs.model_dump(), created=created)


def trial_of(row) -> Trial:
    """A trials row (every column, or a mapping of them) as the policies read it."""
    return Trial(id=row["id"], sweep=row["sweep"], state=TrialState(row["state"]),
                 job=json.loads(row["job"]), model_info=json.loads(row["model_info"]),
                 seq_len=row["seq_len"], inputs=json.loads(row["inputs"]),
                 max_segment=row["max_segment"], excluded=tuple(json.loads(row["excluded"])),
                 runnable_since=row["runnable_since"])


def attempt_of(row) -> Attempt:
    """An attempts row as the policies read it (an outcome this segctl does not
    know stays text: it matches none of the Outcome values)."""
    outcome = row["outcome"]
    if outcome is not None and outcome in Outcome._value2member_map_:
        outcome = Outcome(outcome)
    return Attempt(id=row["id"], trial=row["trial"], sweep=row["sweep"], node=row["node"],
                   segment_size=row["segment_size"], budget_gb=row["budget_gb"], outcome=outcome)


# ------------------------------------------------------------------ read side

def read(path: Path) -> State:
    """A read-only State for the CLI (fails clearly if there is no state yet)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: no sweeps recorded here yet")
    return State(Path(path), readonly=True)


def is_terminal(state: str) -> bool:
    return TrialState(state) in TERMINAL
