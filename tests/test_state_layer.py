"""state.db as a layer: its versions and migrations (a file from before versions
opens with every row intact; a file from a newer segctl is refused in one line;
a migration that fails leaves the file as it was), the state machines it
enforces, and tunes that outlive the head (at the State level, and through the
controller with the fake nodes of tests/test_head_isolation.py).

Real SQLite files; no Ray cluster.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from segctl.orchestrator import state as statelib
from segctl.orchestrator import state_db
from segctl.orchestrator.state import State
from segctl.orchestrator.state_db import LATEST, StateError, TransitionError
from segctl.schemas.records import OUTCOME_MOVES, AttemptResult, AttemptStatus, Outcome, TrialState, TuneState
from tests.test_head_isolation import World

V1_SQL = Path(__file__).parent / "fixtures" / "state_v1.sql"


class Clock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def tables(path: Path) -> dict[str, list[dict]]:
    """Every row of every table, by table, through a plain connection."""
    con = sqlite3.connect(path)
    con.row_factory = sqlite3.Row
    names = [r[0] for r in con.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    out = {n: [dict(r) for r in con.execute(f"SELECT * FROM {n} ORDER BY rowid")] for n in names}
    con.close()
    return out


def user_version(path: Path) -> int:
    con = sqlite3.connect(path)
    try:
        return con.execute("PRAGMA user_version").fetchone()[0]
    finally:
        con.close()


def old_db(path: Path) -> Path:
    """A state.db as segctl wrote it before versions: the old schema text, a sweep,
    two trials, an ended and a running attempt, their events; user_version 0."""
    con = sqlite3.connect(path)
    con.executescript(V1_SQL.read_text())
    con.execute("INSERT INTO sweeps (id, name, path, spec, state, priority, concurrency, retries,"
                " placement, created, ended) VALUES ('s-1', 's', 'sweep.yaml', '{}', 'RUNNING', 0,"
                " NULL, 3, '{}', 1.0, NULL)")
    for i, st in enumerate(("SUCCEEDED", "RUNNING")):
        con.execute("INSERT INTO trials (id, sweep, idx, params, job, model_info, seq_len, inputs,"
                    " state, runnable_since, created, updated, final_loss) VALUES"
                    " (?, 's-1', ?, '{\"lr\": 0.1}', '{\"model\": \"m\"}', '{}', 64, '{}', ?, 1.0,"
                    " 1.0, 2.0, ?)", (f"s-1-t{i}", i, st, 0.5 if i == 0 else None))
        con.execute("INSERT INTO attempts (trial, sweep, attempt_no, node, chip, segment_size,"
                    " status, outcome, placed, step) VALUES (?, 's-1', 1, 'a', 'sim', 2, ?, ?,"
                    " 1.5, 7)", (f"s-1-t{i}", "ended" if i == 0 else "running",
                                 "succeeded" if i == 0 else None))
        con.execute("INSERT INTO events (time, sweep, trial, attempt, from_state, to_state, reason)"
                    " VALUES (2.0, 's-1', ?, 1, 'RUNNING', ?, 'x')", (f"s-1-t{i}", st))
    con.commit()
    con.close()
    assert user_version(path) == 0
    return path


# ------------------------------------------------------------------ versions

def test_version_1_is_the_schema_from_before_versions_and_never_changes():
    assert state_db.MIGRATIONS[0].strip() == V1_SQL.read_text().strip()
    assert LATEST == len(state_db.MIGRATIONS) >= 2


def test_a_db_from_before_versions_opens_migrated_with_every_row_intact(tmp_path):
    db = old_db(tmp_path / "state.db")
    before = tables(db)
    ro = statelib.read(db)   # the CLI reads it before any head has migrated it
    assert [t["state"] for t in ro.status("s-1")[0]["trials"]] == [TrialState.SUCCEEDED, TrialState.RUNNING]
    ro.close()
    assert user_version(db) == 0

    st = State(db)
    after = tables(db)
    assert user_version(db) == LATEST
    assert {k: v for k, v in after.items() if k in before} == before
    assert after["tunes"] == [] and after["tune_classes"] == []
    [sweep] = st.status(None)
    assert sweep["trials"][0]["final_loss"] == 0.5
    assert sweep["trials"][0]["attempts"][0]["outcome"] == Outcome.SUCCEEDED
    assert [a["id"] for a in st.open_attempts()] == [2]
    st.move("s-1-t1", TrialState.NODE_LOST, "lost")   # and it is written as before
    st.close()
    assert State(db).trial("s-1-t1")["state"] == TrialState.NODE_LOST   # opening it again: no migration
    assert user_version(db) == LATEST


def test_a_fresh_db_is_at_the_latest_version(tmp_path):
    State(tmp_path / "state.db").close()
    assert user_version(tmp_path / "state.db") == LATEST
    assert {"sweeps", "trials", "attempts", "events", "tunes", "tune_classes"} <= set(
        tables(tmp_path / "state.db"))


def test_a_db_from_a_newer_segctl_is_refused_in_one_line(tmp_path):
    from tests.conftest import assert_one_line_error, segctl
    home = tmp_path / "home"
    State(home / "state.db").close()
    con = sqlite3.connect(home / "state.db")
    con.execute(f"PRAGMA user_version = {LATEST + 1}")
    con.close()
    db = home / "state.db"
    before = db.read_bytes()
    for opener in (State, statelib.read):
        with pytest.raises(StateError) as e:
            opener(db)
        assert "written by a newer segctl" in str(e.value) and str(db) in str(e.value)
        assert "\n" not in str(e.value)
    assert db.read_bytes() == before
    proc = segctl("status", env={"SEGCTL_HOME": home})
    assert_one_line_error(proc, str(db), "written by a newer segctl")


def test_a_migration_that_fails_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    db = tmp_path / "state.db"
    State(db).close()
    before = tables(db)
    broken = "CREATE TABLE half (x INTEGER);\nINSERT INTO nowhere (x) VALUES (1);\n"
    monkeypatch.setattr(state_db, "MIGRATIONS", [*state_db.MIGRATIONS, broken])
    monkeypatch.setattr(state_db, "LATEST", LATEST + 1)
    with pytest.raises(StateError, match="no such table: nowhere"):
        State(db)
    assert user_version(db) == LATEST and tables(db) == before   # no `half` table


def test_statements_split_where_sql_does_not_in_comments_or_strings():
    script = "CREATE TABLE a (x TEXT DEFAULT 'p;q');  -- a; b\nCREATE TABLE b (y);\n"
    assert [s.strip() for s in state_db.statements(script)] == [
        "CREATE TABLE a (x TEXT DEFAULT 'p;q');", "-- a; b\nCREATE TABLE b (y);"]


# ------------------------------------------------------------------ state machines

def test_outcomes_and_states_keep_the_strings_state_db_holds():
    assert [o.value for o in Outcome] == ["succeeded", "oom", "node_lost", "failed", "cancelled",
                                          "interrupted", "agent_error"]
    assert set(OUTCOME_MOVES) == set(Outcome)
    assert [s.value for s in AttemptStatus] == ["placed", "running", "ended"]
    assert [s.value for s in TuneState] == ["queued", "running", "done", "failed", "cancelled"]
    assert AttemptResult(attempt=1, outcome="oom").outcome is Outcome.OOM
    assert json.dumps({"o": Outcome.NODE_LOST}) == '{"o": "node_lost"}'


def test_an_attempt_that_ended_does_not_start_again(tmp_path):
    st = State(old_db(tmp_path / "state.db"))
    st.update_attempt(2, status=AttemptStatus.ENDED.value, outcome=Outcome.INTERRUPTED.value)
    with pytest.raises(TransitionError, match="ended -> running"):
        st.update_attempt(2, status=AttemptStatus.RUNNING.value)
    assert st.attempt(2)["status"] == AttemptStatus.ENDED
    assert st.charged_attempts("s-1-t1") == 0 and st.charged_attempts("s-1-t0") == 1


# ------------------------------------------------------------------ tunes

def request(**points) -> dict:
    """A tune request as `segctl tune` sends it; `points`: class name -> its points."""
    return {"model": "m", "model_key": "k", "model_name": "m", "n_layers": 2, "method": "sft",
            "prefix_shared": False, "method_key": "sft",
            "lora": {"rank": 8, "num_layers": -1, "scale": 20.0, "dropout": 0.0},
            "head_chunk": 512, "attn_block": 2048, "steps": 2,
            "classes": {cls.replace("_", "/"): {"budget_gb": 8.0, "points": p, "reused": 1}
                        for cls, p in points.items()}}


def test_a_tune_and_its_classes_live_in_state_db(tmp_path):
    clock = Clock()
    st = State(tmp_path / "state.db", clock=clock)
    tid = st.add_tune(request(sim_8GB=[[64, 1], [64, 2], [128, 1]], sim_16GB=[[64, 1]],
                              sim_32GB=[]))
    assert st.add_tune(request(sim_8GB=[])).endswith("-2")   # same second: the next number
    t = st.tune(tid)
    assert t["state"] == TuneState.RUNNING and t["request"]["model"] == "m"
    assert {c: v["state"] for c, v in t["classes"].items()} == {
        "sim/8GB": "queued", "sim/16GB": "queued", "sim/32GB": "done"}   # the request's order
    assert [c["node_class"] for c in st.queued_tune_classes()] == ["sim/8GB", "sim/16GB"]
    with pytest.raises(TransitionError, match="queued -> done"):
        st.move_tune_class(tid, "sim/8GB", TuneState.DONE)

    st.move_tune_class(tid, "sim/8GB", TuneState.RUNNING, node="a")
    st.move_tune_class(tid, "sim/16GB", TuneState.RUNNING, node="b")
    st.count_probe(tid, "sim/8GB", fits=True)
    st.count_probe(tid, "sim/16GB", fits=False)
    st.close()

    # The head dies here; a new one opens the same file.
    st = State(tmp_path / "state.db", clock=clock)
    assert st.requeue_tunes() == 1   # the 16GB class had measured all it had
    t = st.tune(tid)
    assert t["state"] == TuneState.RUNNING
    assert {c: (v["state"], v["node"], v["done"], v["fits"]) for c, v in t["classes"].items()} == {
        "sim/8GB": (TuneState.QUEUED, None, 1, 1), "sim/16GB": (TuneState.DONE, None, 1, 0),   # nothing left
        "sim/32GB": (TuneState.DONE, None, 0, 0)}
    st.move_tune_class(tid, "sim/8GB", TuneState.RUNNING, node="a")
    clock.now += 5
    st.move_tune_class(tid, "sim/8GB", TuneState.FAILED, error="disk full")
    t = st.tune(tid)
    assert t["state"] == TuneState.FAILED and t["ended"] == clock.now
    assert st.requeue_tunes() == 0   # a finished tune stays as it ended
    assert st.serves_model("m") and not st.serves_model("other")


def test_a_tune_goes_on_after_the_head_restarts(tmp_path):
    """Two classes probing; the head dies after one finished and the other measured
    one of its three points. The new head probes the two points left, on a node of
    that class, and leaves the finished class alone."""
    world = World(names=("a", "b"))
    world.nodes[1].memory_gb = 16.0
    c = world.controller(tmp_path)
    world.turns(c, 1)
    tid = c.tune(request(sim_8GB=[[64, 1], [64, 2], [128, 1]], sim_16GB=[[64, 1]]))
    world.turns(c, 1)
    [pa] = probes(world, "a")
    [pb] = probes(world, "b")
    assert pa.args[1].points == [(64, 1), (64, 2), (128, 1)]
    c.record_probe(tid, "a", point(64, 1))
    c.record_probe(tid, "b", point(64, 1, fits=False))
    pb.settle({"measured": 1, "error": ""})
    world.turns(c, 1)
    assert c.tune_status(tid)["classes"]["sim/16GB"]["state"] == TuneState.DONE
    del c   # the head dies with a's probe running

    world2 = World(names=("a", "b"))
    world2.nodes[1].memory_gb = 16.0
    c2 = world2.controller(tmp_path)
    status = c2.tune_status(tid)
    assert status["state"] == TuneState.RUNNING
    assert {k: (v["state"], v["done"], v["total"]) for k, v in status["classes"].items()} == {
        "sim/8GB": (TuneState.QUEUED, 1, 3), "sim/16GB": (TuneState.DONE, 1, 1)}
    assert c2.model_folder("m") == "m"   # its nodes may still fetch the model
    world2.turns(c2, 2)
    [again] = probes(world2, "a")
    assert not probes(world2, "b")
    assert again.args[1].points == [(64, 2), (128, 1)]
    c2.record_probe(tid, "a", point(64, 2))
    c2.record_probe(tid, "a", point(128, 1))
    again.settle({"measured": 2, "error": ""})
    world2.turns(c2, 1)
    status = c2.tune_status(tid)
    assert status["state"] == TuneState.DONE
    assert status["classes"]["sim/8GB"] == {"state": TuneState.DONE, "node": "a", "budget_gb": 8.0,
                                            "done": 3, "fits": 3, "reused": 1, "error": "",
                                            "total": 3}
    assert not any(c2.held.values())


def test_cancelling_tunes_stops_a_running_probe_and_a_queued_class(tmp_path):
    world = World(names=("a",))
    c = world.controller(tmp_path)
    world.turns(c, 1)
    running = c.tune(request(sim_8GB=[[64, 1]]))
    world.turns(c, 1)
    queued = c.tune(request(sim_8GB=[[64, 1]]))   # waits: a is measuring the first
    world.turns(c, 1)
    assert c.tune_status(queued)["classes"]["sim/8GB"]["state"] == TuneState.QUEUED
    c.cancel_tune(queued)
    assert c.tune_status(queued)["state"] == TuneState.CANCELLED
    c.cancel_tune(running)
    assert [r.args[0] for r in world.agents["a"].calls if r.what == "cancel"] == [
        f"tune:{running}"]
    [p] = probes(world, "a")
    p.settle({"measured": 0, "error": "cancelled"})
    world.turns(c, 1)
    assert c.tune_status(running)["state"] == TuneState.CANCELLED
    assert not probes(world, "a")   # the cancelled class never started


def probes(world: World, node: str) -> list:
    return [r for r in world.agents[node].calls if r.what == "probe" and not r.done]


def point(seq_len: int, segment_size: int, fits: bool = True) -> dict:
    """One probe event as the node sends it."""
    return {"event": "probe", "time": 1.0, "seq_len": seq_len, "segment_size": segment_size,
            "fits": fits, "peak_gb": 0.5, "phases": [["forward", 0.4]], "step_s": 0.1,
            "steps": 2, "message": ""}
