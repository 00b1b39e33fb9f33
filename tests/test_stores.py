"""The central stores: telemetry ingest (idempotent, fast), sealed Parquet and
memory.zarr per attempt, checkpoints and adapters in adapters.zarr, and `gather`
into folders mlx-lm loads. Real SQLite, Parquet, zarr, a real engine run, and a
real crash (SIGKILL) in the middle of a seal."""

from __future__ import annotations

import hashlib
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pyarrow.dataset as pads
import pytest
import zarr

from segctl.orchestrator.blobs import read_data
from segctl.orchestrator.gather import gather
from segctl.orchestrator.stores import SCHEMA, Stores
from segctl.schemas import store_rows as sr
from segctl.schemas.states import TrialState
from tests.conftest import cli_env

PHASES = ["fwd0", "fwd1", "head", "bwd1", "bwd0", "update"]


def run_events(first_step: int, last_step: int, *, evals=(), seq0: int = 0, t0: float = 1.7e9):
    """The events of one engine run over steps first..last, each with its seq."""
    out = [{"event": "start", "time": t0, "job": "j", "mode": "segmented", "segment_size": 2,
            "total_steps": last_step, "resumed_from": first_step - 1 or None, "train_rows": 10,
            "valid_rows": 2, "truncated": 0, "skipped": 0, "trainable_params": 100}]
    for s in range(first_step, last_step + 1):
        out.append({"event": "step", "time": t0 + s, "step": s, "loss": 3.0 / s, "tokens": 20 + s,
                    "seconds": 0.01, "tokens_per_s": 2000.0 + s, "lr": 1e-4, "grad_norm": 0.5,
                    "peak_gb": 0.1 + s / 1000, "active_gb": 0.05, "cache_gb": 0.01})
        out.append({"event": "phase", "time": t0 + s, "step": s,
                    "phases": [[p, round(0.01 * (i + 1) + s / 1000, 4)] for i, p in enumerate(PHASES)]})
        if s in evals:
            out.append({"event": "eval", "time": t0 + s, "step": s, "val_loss": 1.0 / s,
                        "val_tokens": 40, "seconds": 0.02})
    out.append({"event": "end", "time": t0 + last_step + 1, "step": last_step, "adapter": "a",
                "final_loss": 3.0 / last_step, "val_loss": None, "seconds": 1.0})
    for i, e in enumerate(out):
        e["seq"] = seq0 + i
    return out


def attempt_row(attempt_no: int, node: str = "mac-1", segment_size: int = 2, **kw) -> dict:
    row = dict(attempt_no=attempt_no, node=node, chip="M2", segment_size=segment_size,
               predicted_gb=1.5, budget_gb=16.0, outcome="succeeded", message="", started=1.7e9,
               ended=1.7e9 + 60, steps=0, peak_gb=None, final_loss=None, val_loss=None)
    row.update(kw)
    return row


def visible_files(root: Path) -> dict[str, bytes]:
    """Every file a reader could list (everything but .staging/ and SQLite's own)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and sr.TEMP not in p.parts and not p.name.startswith(sr.STAGING_DB)}


def staging_rows(root: Path, attempt: int | None = None) -> int:
    """Rows left in staging.db, read straight from SQLite."""
    con = sqlite3.connect(root / sr.STAGING_DB)
    try:
        where, args = (" WHERE attempt = ?", (attempt,)) if attempt is not None else ("", ())
        return con.execute("SELECT COUNT(*) FROM events" + where, args).fetchone()[0]
    finally:
        con.close()


def assert_no_temp(root: Path) -> None:
    staging = root / sr.TEMP
    assert not staging.exists() or not any(staging.iterdir()), list(staging.iterdir())
    hidden = [p for p in root.rglob("*") if p.name.startswith(".") and p != staging]
    assert not hidden, hidden
    assert {p.name for p in root.iterdir()} <= {sr.STAGING_DB, "staging.db-wal", "staging.db-shm",
                                               sr.TEMP, sr.TELEMETRY, sr.MEMORY_ZARR, sr.ADAPTERS_ZARR}


# ------------------------------------------------------------------ telemetry

def test_ingest_is_idempotent_and_events_read_back(tmp_path):
    reader = Stores(tmp_path / "stores")
    assert reader.events(1) == [] and not reader.is_sealed(1)
    assert not (tmp_path / "stores").exists(), "a reader creates nothing"

    st = Stores(tmp_path / "stores")
    events = run_events(1, 10, evals=(5, 10))
    assert st.ingest("sw-1", "sw-1-t000", 1, events[:15]) == 15
    assert st.ingest("sw-1", "sw-1-t000", 1, events[:15]) == 0      # the same batch again
    assert st.ingest("sw-1", "sw-1-t000", 1, events[10:]) == len(events) - 15   # overlapping
    assert st.events(1) == events
    assert reader.events(1, after_seq=20) == events[21:], "another instance reads what was written"
    assert reader.events(2) == []

    with pytest.raises(ValueError, match="belongs to sw-1/sw-1-t000"):
        st.ingest("sw-1", "sw-1-t001", 1, events[:1])
    with pytest.raises(ValueError, match="seq"):
        st.ingest("sw-1", "sw-1-t000", 1, [{"event": "step"}])
    with pytest.raises(ValueError, match="sweep"):
        st.ingest("../x", "t", 3, events[:1])
    assert st.events(1) == events, "a refused batch adds nothing"
    assert_no_temp(tmp_path / "stores")


def test_attempts_stay_apart_and_seal_is_idempotent(tmp_path):
    root = tmp_path / "stores"
    st = Stores(root)
    # attempt 7 dies after step 6; attempt 9 resumes the trial from a checkpoint at step 4
    first, second = run_events(1, 6, evals=(3,)), run_events(5, 8, evals=(8,))
    other = run_events(1, 3)
    for batch in (first[:8], first[8:]):
        st.ingest("sw-1", "sw-1-t000", 7, batch)
    st.ingest("sw-1", "sw-1-t000", 9, second)
    st.ingest("sw-2", "sw-2-t000", 8, other)
    st.ingest("sw-1", "sw-1-t000", 7, first)      # a late re-delivery
    st.seal_attempt("sw-1", "sw-1-t000", 7, attempt_row(1, outcome="node_lost", steps=6))
    st.seal_attempt("sw-1", "sw-1-t000", 9, attempt_row(2, node="mac-2", steps=8, final_loss=0.4))
    st.seal_attempt("sw-2", "sw-2-t000", 8, attempt_row(1, steps=3))
    assert st.is_sealed(7) and st.is_sealed(9) and st.is_sealed(8) and not st.is_sealed(10)

    steps = pads.dataset(root / "telemetry/steps", partitioning="hive").to_table().to_pylist()
    assert len(steps) == 6 + 4 + 3
    keys = [(r["attempt"], r["step"]) for r in steps]
    assert len(set(keys)) == len(keys), "no duplicates"
    by_attempt = {a: sorted(r["step"] for r in steps if r["attempt"] == a) for a in (7, 8, 9)}
    assert by_attempt == {7: [1, 2, 3, 4, 5, 6], 9: [5, 6, 7, 8], 8: [1, 2, 3]}
    assert {r["sweep"] for r in steps if r["attempt"] in (7, 9)} == {"sw-1"}
    assert {r["sweep"] for r in steps if r["attempt"] == 8} == {"sw-2"}
    s5 = {r["attempt"]: r for r in steps if r["step"] == 5 and r["trial"] == "sw-1-t000"}
    assert set(s5) == {7, 9} and s5[7]["loss"] == pytest.approx(0.6) and s5[9]["tokens"] == 25
    assert (root / sr.telemetry_file("steps", "sw-1", 7)).is_file()

    evals = pads.dataset(root / "telemetry/evals", partitioning="hive").to_table()
    assert sorted(zip(evals["attempt"].to_pylist(), evals["step"].to_pylist())) == [(7, 3), (9, 8)]
    attempts = pads.dataset(root / "telemetry/attempts", partitioning="hive").to_table().to_pylist()
    t0 = sorted((r for r in attempts if r["trial"] == "sw-1-t000"), key=lambda r: r["attempt_no"])
    assert [(r["attempt"], r["attempt_no"], r["node"], r["outcome"]) for r in t0] == \
        [(7, 1, "mac-1", "node_lost"), (9, 2, "mac-2", "succeeded")]
    assert t0[1]["final_loss"] == 0.4 and t0[0]["final_loss"] is None
    assert pads.dataset(root / "telemetry/steps", partitioning="hive").schema.names == \
        sr.STEPS.names + ["sweep"]

    before = visible_files(root)
    mtimes = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and "zarr" in str(p)}
    st.seal_attempt("sw-1", "sw-1-t000", 7, attempt_row(1, outcome="node_lost", steps=6))
    Stores(root).seal_attempt("sw-1", "sw-1-t000", 9, attempt_row(2, node="mac-2", steps=8,
                                                                  final_loss=0.4))
    assert visible_files(root) == before, "sealing again gives the same files, same names"
    assert mtimes == {p: p.stat().st_mtime_ns for p in mtimes}, "and leaves them untouched"

    with pytest.raises(ValueError, match="unknown column"):
        st.seal_attempt("sw-1", "sw-1-t000", 7, {"nod": "x"})
    assert_no_temp(root)


def test_memory_zarr_holds_per_phase_peaks(tmp_path):
    root = tmp_path / "stores"
    st = Stores(root)
    events = run_events(1, 4)
    events[4]["phases"] = events[4]["phases"][:-1]        # step 2 lacks its `update` phase
    st.ingest("sw-1", "sw-1-t003", 12, events)
    st.ingest("sw-1", "sw-1-t004", 13, run_events(1, 1)[:1])   # started, died before a step
    st.seal_attempt("sw-1", "sw-1-t003", 12, attempt_row(1, node="mac-3", segment_size=2))
    st.seal_attempt("sw-1", "sw-1-t004", 13, attempt_row(1, segment_size=4, outcome="failed"))

    store = zarr.open_group(root / "memory.zarr", mode="r")
    a = store["sw-1/sw-1-t003/attempt-12"]
    assert a.shape == (4, len(PHASES)) and a.dtype == np.float32
    assert a.attrs["phases"] == PHASES and a.attrs["steps"] == [1, 2, 3, 4]
    assert a.attrs["node"] == "mac-3" and a.attrs["segment_size"] == 2
    peaks = a[...]
    assert peaks[0].tolist() == pytest.approx([0.011, 0.021, 0.031, 0.041, 0.051, 0.061])
    assert np.isnan(peaks[1, -1]) and not np.isnan(peaks[1, :-1]).any()
    empty = store["sw-1/sw-1-t004/attempt-13"]
    assert empty.shape == (0, 0) and empty.attrs["segment_size"] == 4
    assert_no_temp(root)


def test_ingest_in_agent_batches_keeps_each_row_once(tmp_path):
    """How fast ingest goes is bench/orchestrator.py's to measure (`ingest`); this
    holds what it does at the agents' batch size: every row committed once, and a
    re-delivered (overlapping) batch adds nothing."""
    st = Stores(tmp_path / "stores")
    rows = [e for e in run_events(1, 20_000) if e["event"] == "step"]
    for i, e in enumerate(rows):
        e["seq"] = i
    new = [st.ingest("sw-1", "sw-1-t000", 1, rows[k:k + 500])   # the node agent's batch size
           for k in range(0, len(rows), 500)]
    assert new == [500] * 40
    assert st.ingest("sw-1", "sw-1-t000", 1, rows[9_750:10_250]) == 0   # a batch sent again
    assert staging_rows(tmp_path / "stores", 1) == 20_000
    assert Stores(tmp_path / "stores").events(1, after_seq=19_990) == rows[19_991:]


# ------------------------------------------------------------------ crash safety

SEAL_SCRIPT = """
import sys
from pathlib import Path
from segctl.orchestrator.stores import Stores

# Say where the seal is, on stdout, as it goes: the test kills it at one of these
# lines (argv[2]), where it waits for the kill.
put_parquet, put_dir = Stores._put_parquet, Stores._put_dir
def say(line):
    print(line, flush=True)
    if line == sys.argv[2]:
        sys.stdin.readline()   # the test never writes again: the kill lands here
def parquet(self, table, path):
    say(f"building {path.parent.parent.name}")    # telemetry/<table>/sweep=.../attempt-N.parquet
    put_parquet(self, table, path)
    say(f"placed {path.parent.parent.name}")
def node(self, target, write):
    say("building memory")
    put_dir(self, target, write)
    say("placed memory")
Stores._put_parquet, Stores._put_dir = parquet, node
import segctl.schemas.private as private
write_atomic = private.write_atomic
def aside(path, data=None, **kw):   # a file's bytes written aside, not yet renamed in
    def write(tmp):
        Path(tmp).write_bytes(data)
        say(f"aside {Path(path).parent.parent.name}")
    return write_atomic(path, write=write, **kw)
private.write_atomic = aside

st = Stores(Path(sys.argv[1]))
st.ingest("sw-1", "sw-1-t000", 1, [])      # set up, the attempt known: no lock needed till the end
say("ready")
sys.stdin.readline()
st.seal_attempt("sw-1", "sw-1-t000", 1, {"attempt_no": 1, "steps": 20000})
say("sealed")
"""


@pytest.mark.slow   # 9 s
def test_a_crash_during_seal_leaves_nothing_half_written(tmp_path):
    root = tmp_path / "stores"
    st = Stores(root)
    events = run_events(1, 20_000, evals=(10_000,))
    st.ingest("sw-1", "sw-1-t000", 1, events)
    # Killed as it starts the first file, with two files in place and the third
    # being built, with the third's bytes written aside but not yet renamed in,
    # and as the memory array is built. The child waits for its kill there, and
    # the test holds staging.db's write lock meanwhile, so the seal cannot commit
    # before it: each kill lands in the middle, whatever the machine's speed.
    for at in ("building steps", "placed evals", "aside attempts", "building memory"):
        proc = subprocess.Popen([sys.executable, "-c", SEAL_SCRIPT, str(root), at], env=cli_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        lock = sqlite3.connect(root / sr.STAGING_DB, isolation_level=None)
        try:
            assert proc.stdout.readline().strip() == "ready"
            lock.execute("BEGIN IMMEDIATE")
            proc.stdin.write("go\n")
            proc.stdin.flush()
            said = []
            while at not in said:   # a child stuck behind the lock gives up after 30 s, and says so
                said.append(proc.stdout.readline().strip())
                assert said[-1] and said[-1] != "sealed", (at, said)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stdin.close()
            if lock.in_transaction:
                lock.execute("ROLLBACK")
            lock.close()
        assert proc.returncode == -signal.SIGKILL
        # whatever a reader sees is whole: every Parquet file reads, every zarr node opens
        for table in ("steps", "evals", "attempts"):
            if (root / "telemetry" / table).exists():
                pads.dataset(root / "telemetry" / table, partitioning="hive").to_table()
        mem = root / sr.memory_array("sw-1", "sw-1-t000", 1)
        if mem.exists():
            assert zarr.open_array(mem, mode="r")[...].shape == (20_000, len(PHASES))
        # never sealed: every row still in staging, to seal again
        assert not Stores(root).is_sealed(1) and staging_rows(root, 1) == len(events)
        assert Stores(root).events(1) == events

    # what a writer killed in the middle of building leaves under .staging/
    dead = subprocess.Popen(["true"])
    dead.wait()
    (root / sr.TEMP / f"{dead.pid}-3-node/c").mkdir(parents=True)
    (root / sr.TEMP / f"{dead.pid}-3-node/zarr.json").write_text("{")
    (root / sr.TEMP / f"{dead.pid}-4-parquet").write_bytes(b"PAR1")

    st2 = Stores(root)          # the restarted head: seals again and clears the dead writer's temp
    st2.seal_attempt("sw-1", "sw-1-t000", 1, {"attempt_no": 1, "steps": 20000})
    assert st2.is_sealed(1)
    steps = pads.dataset(root / "telemetry/steps", partitioning="hive").to_table()
    assert steps.num_rows == 20_000
    assert staging_rows(root) == 0 and st2.events(1) == events
    assert_no_temp(root)


def test_sealing_prunes_staging_and_keeps_every_event(tmp_path):
    root = tmp_path / "stores"
    st = Stores(root)
    done, running = run_events(1, 30, evals=(10, 20)), run_events(1, 5)
    st.ingest("sw-1", "sw-1-t000", 1, done[:40])
    st.ingest("sw-1", "sw-1-t000", 1, done[40:])
    st.ingest("sw-1", "sw-1-t001", 2, running)
    st.seal_attempt("sw-1", "sw-1-t000", 1, attempt_row(1, steps=30))
    assert staging_rows(root, 1) == 0 and staging_rows(root, 2) == len(running)
    reader = Stores(root)
    assert st.events(1) == done == reader.events(1), "`segctl logs` reads them from the file"
    assert reader.events(1, after_seq=50) == done[51:] and reader.events(2) == running
    logged = pads.dataset(root / "telemetry/events", partitioning="hive").to_table()
    assert sorted(logged["seq"].to_pylist()) == list(range(len(done)))
    assert logged.filter(pads.field("event") == "eval").num_rows == 2

    # sealed is final: a late re-delivery adds nothing, sealing again touches nothing
    before = visible_files(root)
    mtimes = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()
              and not p.name.startswith(sr.STAGING_DB)}
    assert st.ingest("sw-1", "sw-1-t000", 1, done[:10]) == 0
    assert Stores(root).ingest("sw-1", "sw-1-t000", 1, done[-3:]) == 0
    st.seal_attempt("sw-1", "sw-1-t000", 1, attempt_row(1, steps=30))
    Stores(root).seal_attempt("sw-1", "sw-1-t000", 1, attempt_row(1, steps=30))
    assert staging_rows(root, 1) == 0 and visible_files(root) == before
    assert mtimes == {p: p.stat().st_mtime_ns for p in mtimes}
    assert pads.dataset(root / "telemetry/steps", partitioning="hive").to_table().num_rows == 30

    # a staging.db from a segctl that kept sealed attempts' rows: the next writer
    # puts their events in a file, then drops them
    con = sqlite3.connect(root / sr.STAGING_DB)
    con.executemany("INSERT INTO events VALUES (?, ?, ?)",
                    [(1, e["seq"], json.dumps(e)) for e in done])
    con.commit()
    con.close()
    (root / sr.telemetry_file("events", "sw-1", 1)).unlink()
    assert Stores(root).events(1) == done
    Stores(root).ingest("sw-1", "sw-1-t001", 2, running[-1:])    # a writer starts
    assert staging_rows(root, 1) == 0 and Stores(root).events(1) == done
    assert staging_rows(root, 2) == len(running)
    assert_no_temp(root)


SEAL_HELD = """
import sys
from pathlib import Path
from segctl.orchestrator.stores import Stores
st = Stores(Path(sys.argv[1]))
st.ingest("sw-1", "sw-1-t000", 1, [])      # set up, the attempt known: no lock needed till the end
print("ready", flush=True)
sys.stdin.readline()
st.seal_attempt("sw-1", "sw-1-t000", 1, {"attempt_no": 1, "steps": 300})
"""


def test_a_crash_between_the_files_and_the_prune_loses_and_doubles_nothing(tmp_path):
    root = tmp_path / "stores"
    events = run_events(1, 300, evals=(150,))
    Stores(root).ingest("sw-1", "sw-1-t000", 1, events)
    proc = subprocess.Popen([sys.executable, "-c", SEAL_HELD, str(root)], env=cli_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    lock = sqlite3.connect(root / sr.STAGING_DB, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")      # the seal's final transaction waits behind this
    proc.stdin.write("go\n")
    proc.stdin.flush()
    mem = root / sr.memory_array("sw-1", "sw-1-t000", 1)   # its last file
    deadline = time.monotonic() + 60
    while not (mem / "zarr.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.kill()                          # files in place, not sealed, rows not pruned
    proc.wait()
    lock.execute("ROLLBACK")
    lock.close()
    assert not Stores(root).is_sealed(1) and staging_rows(root, 1) == len(events)
    assert Stores(root).events(1) == events

    st = Stores(root)                    # the restarted head seals it again
    st.seal_attempt("sw-1", "sw-1-t000", 1, {"attempt_no": 1, "steps": 300})
    assert st.is_sealed(1) and staging_rows(root) == 0 and st.events(1) == events
    steps = pads.dataset(root / "telemetry/steps", partitioning="hive").to_table()
    assert sorted(steps["step"].to_pylist()) == list(range(1, 301)), "each step once"
    assert zarr.open_array(mem, mode="r").shape == (300, len(PHASES))
    assert_no_temp(root)


# ------------------------------------------------------------------ checkpoints and adapters

def test_checkpoints_round_trip_and_only_three_stay(tmp_path):
    root = tmp_path / "stores"
    st = Stores(root)
    assert st.latest_checkpoint("sw-1-t000") is None
    rng = np.random.default_rng(0)
    puts = {}
    for step in (10, 20, 30, 40, 50):
        files = {"adapters.safetensors": rng.bytes(5000 + step), "optimizer.safetensors": rng.bytes(777),
                 "state.json": json.dumps({"step": step}).encode(), "empty.bin": b"",
                 "zeros.bin": bytes(4096)}
        st.put_checkpoint("sw-1", "sw-1-t000", 3, step, files)
        puts[step] = files
        assert st.latest_checkpoint("sw-1-t000") == (step, files)
    kept = sorted(p.name for p in (root / "adapters.zarr/sw-1-t000/checkpoints").iterdir())
    assert kept == ["step-0000030", "step-0000040", "step-0000050", "zarr.json"]
    g = zarr.open_group(root / sr.checkpoint_group("sw-1-t000", 40), mode="r")
    assert g.attrs["step"] == 40 and g.attrs["attempt"] == 3
    assert g.attrs["files"] == sorted(puts[40])
    # one array holds the files back to back; the attributes say where each is
    assert [name for name, _ in g.members()] == ["data"]
    begin, end = g.attrs["packed"]["state.json"]
    assert g["data"][begin:end].tobytes() == puts[40]["state.json"]
    st.put_checkpoint("sw-1", "sw-1-t000", 3, 50, puts[50])     # re-delivered: no change
    assert Stores(root).latest_checkpoint("sw-1-t000") == (50, puts[50])
    assert st.latest_checkpoint("sw-1-t001") is None
    assert_no_temp(root)


def test_bf16_f16_f32_tensors_round_trip_bit_exact(tmp_path):
    rng = np.random.default_rng(1)
    bits16 = np.concatenate([rng.integers(0, 1 << 16, 200, dtype=np.uint16),
                             np.array([0x0000, 0x8000, 0x7FC1, 0xFF81, 0x7F80, 0x0001], np.uint16)])
    weights = {
        "layers.0.lora_a": mx.array(bits16.reshape(2, 103)).view(mx.bfloat16),
        "layers.0.lora_b": mx.array(bits16[:200].reshape(20, 10)).view(mx.float16),
        "layers.1.lora_a": mx.array(rng.integers(0, 1 << 32, 60, dtype=np.uint32).reshape(6, 10)
                                    ).view(mx.float32),
        "layers.1.lora_b": mx.array(np.array([0.0, -0.0, 0.0], np.float32)),
    }
    path = tmp_path / "a.safetensors"
    mx.save_safetensors(str(path), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4}}
    files = {"adapters.safetensors": path.read_bytes(),
             "adapter_config.json": (json.dumps(config, indent=2) + "\n").encode()}
    st = Stores(tmp_path / "stores")
    st.put_adapter("sw-1", "sw-1-t000", 5, files)

    assert st.adapter_files("sw-1-t000") == files, "the same bytes come back"
    tensors, cfg = Stores(tmp_path / "stores").adapter("sw-1-t000")
    assert cfg == config and set(tensors) == set(weights)
    assert tensors["layers.0.lora_b"].dtype == np.float16
    assert tensors["layers.1.lora_a"].dtype == np.float32
    assert tensors["layers.0.lora_a"].dtype == np.float32      # bf16, widened exactly
    for name, w in weights.items():
        got = tensors[name]
        if w.dtype == mx.bfloat16:
            assert np.array_equal((got.view(np.uint32) >> 16).astype(np.uint16), bits16.reshape(2, 103))
        else:
            assert got.tobytes() == np.array(w).tobytes(), name
    stored = zarr.open_group(tmp_path / "stores" / sr.adapter_group("sw-1-t000"), mode="r")
    assert stored.attrs["dtypes"]["layers.0.lora_a"] == "BF16" and stored.attrs["attempt"] == 5
    assert stored.attrs["adapter_config"] == config
    # one uint8 array: the tensors' bytes back to back, each one's place in the attributes
    assert [name for name, _ in stored.members()] == ["data"] and stored["data"].dtype == np.uint8
    b, e = stored.attrs["tensors"]["layers.0.lora_b"]["offsets"]
    assert stored["data"][b:e].tobytes() == np.array(weights["layers.0.lora_b"]).tobytes()
    assert stored.attrs["tensors"]["layers.0.lora_a"]["shape"] == [2, 103]
    assert read_data(tmp_path / "stores" / sr.adapter_group("sw-1-t000")) == \
        stored["data"][...].tobytes(), "the chunk read straight is what zarr reads"
    compact = dict(files, **{"adapter_config.json": b'{"fine_tune_type":"lora"}'})
    st.put_adapter("sw-1", "sw-1-t002", 5, compact)
    assert st.adapter_files("sw-1-t002") == compact, "the config's own bytes, too"
    with pytest.raises(ValueError, match="missing"):
        st.put_adapter("sw-1", "sw-1-t001", 5, {"adapters.safetensors": files["adapters.safetensors"]})
    with pytest.raises(ValueError, match="adapters.safetensors"):
        st.put_adapter("sw-1", "sw-1-t001", 5, dict(files, **{"adapters.safetensors": b"\x05" * 20}))
    assert not st.has_adapter("sw-1-t001")
    assert_no_temp(tmp_path / "stores")


@pytest.fixture(scope="module")
def trained(demo_dir, tmp_path_factory):
    """A real engine run of the demo job: 3 steps, a checkpoint after steps 1 and 2."""
    from segctl.engine.train import run
    from segctl.schemas.job import load_job
    out = tmp_path_factory.mktemp("trained") / "out"
    job = load_job(demo_dir / "job.yaml")
    job = job.model_copy(update={
        "output": str(out),
        "train": job.train.model_copy(update={"iters": 3, "checkpoint_every": 1, "val_batches": 4}),
        "telemetry": job.telemetry.model_copy(update={"phases": True})})
    events = []
    run(job, emit=lambda e: events.append(json.loads(e.model_dump_json())))
    for i, e in enumerate(events):
        e["seq"] = i
    return out, events


def test_real_adapter_through_the_stores_into_mlx_lm(demo_dir, trained, tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm import load

    out, events = trained
    root = tmp_path / "stores"
    st = Stores(root)
    st.ingest("demo-1", "demo-1-t000", 1, events)
    for ckpt in sorted((out / "checkpoints").iterdir()):
        step = int(ckpt.name.split("-")[1])
        st.put_checkpoint("demo-1", "demo-1-t000", 1, step,
                          {p.name: p.read_bytes() for p in ckpt.iterdir()})
    files = {n: (out / n).read_bytes() for n in ("adapters.safetensors", "adapter_config.json")}
    st.put_adapter("demo-1", "demo-1-t000", 1, files)
    st.put_adapter("demo-1", "demo-1-t001", 2, files)          # a second trial, same weights
    st.seal_attempt("demo-1", "demo-1-t000", 1, attempt_row(1, steps=3))

    step, ckpt = st.latest_checkpoint("demo-1-t000")
    last = out / "checkpoints/step-0000002"
    assert step == 2 and ckpt == {p.name: p.read_bytes() for p in last.iterdir()}
    mem = zarr.open_array(root / sr.memory_array("demo-1", "demo-1-t000", 1), mode="r")
    assert mem.shape[0] == 3 and mem.attrs["steps"] == [1, 2, 3]
    assert mem.attrs["phases"][-1] == "update" and not np.isnan(mem[...]).any()

    trials = [
        {"trial": "demo-1-t000", "state": TrialState.SUCCEEDED, "params": {"lr": 1e-4},
         "metrics": {"val_loss": 2.5, "final_loss": 2.0}},
        {"trial": "demo-1-t001", "state": TrialState.SUCCEEDED, "params": {"lr": 2e-4},
         "metrics": {"val_loss": 1.5, "final_loss": 2.2}},
        {"trial": "demo-1-t002", "state": TrialState.FAILED, "params": {}, "metrics": {}},
        {"trial": "demo-1-t003", "state": TrialState.SUCCEEDED, "params": {}, "metrics": {}},  # no adapter
    ]
    gathered = gather(st, trials, tmp_path / "export")
    manifest = json.loads((gathered / "manifest.json").read_text())
    assert [m["trial"] for m in manifest] == ["demo-1-t000", "demo-1-t001"]
    assert manifest[1]["params"] == {"lr": 2e-4} and manifest[1]["metrics"]["val_loss"] == 1.5
    for m in manifest:
        names = sorted(p.name for p in (gathered / m["trial"]).iterdir())
        assert names == ["adapter_config.json", "adapters.safetensors"] == sorted(m["files"])
        for name, digest in m["files"].items():
            blob = (gathered / m["trial"] / name).read_bytes()
            assert hashlib.sha256(blob).hexdigest() == digest
            assert blob == files[name], "the engine's own bytes"

    trained_weights = mx.load(str(out / "adapters.safetensors"))
    model, _ = load(str(demo_dir / "model"), adapter_path=str(gathered / "demo-1-t000"))
    loaded = dict(tree_flatten(model.parameters()))
    assert set(trained_weights) <= set(loaded)
    for name, w in trained_weights.items():
        assert np.array_equal(np.array(loaded[name]), np.array(w)), name
    assert any(float(mx.abs(w).max()) > 0 for n, w in trained_weights.items() if "lora_b" in n)

    best = gather(st, trials, tmp_path / "best", best=1)
    assert [m["trial"] for m in json.loads((best / "manifest.json").read_text())] == ["demo-1-t001"]
    trials[1]["metrics"] = {"final_loss": 2.2}                  # no val_loss: sorts last
    best = gather(st, trials, tmp_path / "best2", best=2, metric="val_loss")
    assert [m["trial"] for m in json.loads((best / "manifest.json").read_text())] == \
        ["demo-1-t000", "demo-1-t001"]
    (tmp_path / "empty").mkdir()
    assert gather(st, trials, tmp_path / "empty", best=1, metric="final_loss").name == "empty"
    assert (tmp_path / "empty/demo-1-t000/adapters.safetensors").is_file()
    assert_no_temp(root)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_gather_refuses_a_non_empty_out_and_leaves_nothing(tmp_path):
    st = Stores(tmp_path / "stores")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    trials = [{"trial": "t", "state": TrialState.SUCCEEDED, "params": {}, "metrics": {}}]
    with pytest.raises(ValueError) as e:
        gather(st, trials, out)
    assert "not empty" in str(e.value) and "\n" not in str(e.value)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="no succeeded trial"):
        gather(st, trials, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------ stores written before packing

def put_per_tensor(root: Path, trial: str, kind_dir: str, files: dict[str, bytes], attempt: int,
                   step: int | None = None, val_loss: float | None = None) -> None:
    """An adapter as segctl wrote it before packing: one zarr array per tensor (BF16
    widened to float32), the config parsed and the safetensors header in the attributes."""
    blob = files["adapters.safetensors"]
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    numpy = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
    g = zarr.open_group(root / sr.ADAPTERS_ZARR / trial / kind_dir, mode="w", attributes=dict(
        adapter_config=json.loads(files["adapter_config.json"]),
        dtypes={k: h["dtype"] for k, h in header.items()},
        safetensors_header=blob[8:8 + n].decode(), attempt=attempt, sweep="sw-1", trial=trial,
        step=step, val_loss=val_loss))
    for name, h in header.items():
        b, e = h["data_offsets"]
        values = np.frombuffer(blob[8 + n + b:8 + n + e], dtype=numpy[h["dtype"]])
        if h["dtype"] == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        g.create_array(name, data=values.reshape(h["shape"]),
                       chunks=tuple(max(1, d) for d in h["shape"]),
                       config={"write_empty_chunks": True})


def test_stores_written_one_array_per_tensor_still_read(tmp_path):
    rng = np.random.default_rng(7)
    bits16 = rng.integers(0, 1 << 16, 60, dtype=np.uint16)
    weights = {"layers.0.lora_a": mx.array(bits16.reshape(6, 10)).view(mx.bfloat16),
               "layers.0.lora_b": mx.array(rng.standard_normal((10, 4), dtype=np.float32)),
               "layers.1.lora_a": mx.array(np.array([0.0, -0.0], np.float32))}
    mx.save_safetensors(str(tmp_path / "a.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4}}
    files = {"adapters.safetensors": (tmp_path / "a.safetensors").read_bytes(),
             "adapter_config.json": (json.dumps(config, indent=2) + "\n").encode()}
    root = tmp_path / "stores"
    Stores(root).put_adapter("sw-1", "sw-1-t009", 1, files)     # makes the store's groups
    put_per_tensor(root, "sw-1-t000", "adapter", files, 2, step=30)
    put_per_tensor(root, "sw-1-t000", "best_adapter", files, 2, step=20, val_loss=0.5)
    ckpt = {"adapters.safetensors": files["adapters.safetensors"], "state.json": b'{"step": 30}',
            "empty.bin": b""}
    old = zarr.open_group(root / sr.checkpoint_group("sw-1-t000", 30), mode="w",
                          attributes=dict(step=30, attempt=2, sweep="sw-1", trial="sw-1-t000",
                                          files=sorted(ckpt)))
    for name, blob in ckpt.items():
        old.create_array(name, data=np.frombuffer(blob, dtype=np.uint8),
                         chunks=(max(1, len(blob)),), config={"write_empty_chunks": True})

    st = Stores(root)
    for kind in ("last", "best"):
        assert st.adapter_files("sw-1-t000", kind) == files
        tensors, cfg = st.adapter("sw-1-t000", kind)
        new, _ = st.adapter("sw-1-t009", kind="last")
        assert cfg == config and set(tensors) == set(new) == set(weights)
        assert all(tensors[k].dtype == new[k].dtype and tensors[k].tobytes() == new[k].tobytes()
                   for k in weights), "the same arrays from either layout"
    assert st.adapter_info("sw-1-t000") == {"attempt": 2, "step": 30, "val_loss": None}
    assert st.adapter_info("sw-1-t000", "best") == {"attempt": 2, "step": 20, "val_loss": 0.5}
    assert st.adapter_info("sw-1-t001") is None
    assert st.latest_checkpoint("sw-1-t000") == (30, ckpt)
    trials = [{"trial": "sw-1-t000", "state": TrialState.SUCCEEDED, "params": {}, "metrics": {}}]
    out = gather(st, trials, tmp_path / "out", best=1)
    assert (out / "sw-1-t000" / "adapters.safetensors").read_bytes() == files["adapters.safetensors"]
    assert json.loads((out / "manifest.json").read_text())[0]["adapter"] == "best"


# ------------------------------------------------------------------ staging.db size

def test_staging_db_gives_pages_back_after_sealed_attempts_are_pruned(tmp_path):
    root = tmp_path / "stores"
    st = Stores(root)
    pad = "x" * 2000     # events as big as a real batch's, so the attempts fill a few MB
    events = {a: [dict(e, note=pad) for e in run_events(1, 300)] for a in range(1, 6)}
    for a, evs in events.items():
        st.ingest("sw-1", f"sw-1-t{a:03d}", a, evs)
    size = lambda: sum(p.stat().st_size for p in root.glob(sr.STAGING_DB + "*"))
    st._con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    full = (root / sr.STAGING_DB).stat().st_size
    assert full > 5e6, full
    for a in range(1, 6):
        st.seal_attempt("sw-1", f"sw-1-t{a:03d}", a, attempt_row(a, steps=300))
    assert staging_rows(root) == 0
    st._con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert (root / sr.STAGING_DB).stat().st_size < full / 4, "the freed pages went back"
    assert size() < full / 2
    assert Stores(root).events(3) == events[3]

    # a staging.db made without auto_vacuum keeps working (and keeps its size)
    old = tmp_path / "old"
    old.mkdir()
    con = sqlite3.connect(old / sr.STAGING_DB)
    con.executescript("PRAGMA journal_mode=WAL;" + SCHEMA)
    con.close()
    st = Stores(old)
    st.ingest("sw-1", "sw-1-t001", 1, events[1])
    st.seal_attempt("sw-1", "sw-1-t001", 1, attempt_row(1, steps=300))
    assert staging_rows(old) == 0 and Stores(old).events(1) == events[1]
    assert st._con.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
