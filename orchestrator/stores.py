"""The central stores on the head: telemetry as it arrives, Parquet tables and
per-phase memory once an attempt ends, adapters and checkpoints per trial.

    staging.db       SQLite (WAL): the events of attempts still running, as
                     delivered, keyed by (attempt, seq) so a re-delivered batch adds
                     nothing; an attempt's rows go once it is sealed
    telemetry/       Parquet, hive-partitioned by sweep, one file per attempt:
                     steps/, evals/, attempts/ (schemas/store_rows.py), and events/:
                     every event as delivered (what `segctl logs` reads once sealed)
    memory.zarr      <sweep>/<trial>/attempt-<id>: float32 [steps, phases] peaks
    adapters.zarr    <trial>/adapter: the last step's LoRA tensors, packed: one uint8
                     array `data` (the safetensors file's data section, the tensors'
                     bytes back to back) and each tensor's dtype, shape and [begin, end)
                     in it in the group's attributes; <trial>/best_adapter: the same for
                     the best eval's adapter, when the trial had a validation set;
                     <trial>/checkpoints/step-NNNNNNN: the folder's files packed the same
                     way (one uint8 array, each file's [begin, end) in the attributes).
                     Stores written before the packing (one array per tensor or file)
                     are read as they are.

The collector on the head is the only writer; `segctl status/logs/gather` read.
Readers never see a half-written file: every Parquet file and zarr node is built
under `.staging/` (same file system, listed by no reader) and renamed into place.
Sealing writes an attempt's files first and then, in one transaction, marks it
sealed and deletes its staging rows: a crash before that commit leaves the rows
to seal again (same bytes), after it leaves the files; a sealed attempt is final
(sealing again and late re-deliveries change nothing).
Everything here is the owner's alone: folders 0700, files 0600, whatever the umask.
Nothing here knows about Ray or the trial state machine (state.db is the head's).
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# private_dir / private_file: also what the head uses for inputs/ and state.db
from segctl.node.raynode import alive
from segctl.orchestrator.state_db import LOCK_WAIT_S, StoreError
from segctl.schemas import store_rows as sr
from segctl.schemas.atomic import fsync_dir
from segctl.schemas.private import private_dir, private_file

from .blobs import (
    data_section,
    node_attrs,
    read_data,
    read_safetensors,
    rmtree,
    same_tree,
    settle_tree,
    tensor_bytes,
    tensor_values,
    write_packed_group,
    write_peaks_array,
    zarr_modules,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
  attempt INTEGER NOT NULL, seq INTEGER NOT NULL,
  body TEXT NOT NULL,                 -- the event's JSON as it arrived (seq included)
  PRIMARY KEY (attempt, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS attempts (
  attempt INTEGER PRIMARY KEY, sweep TEXT NOT NULL, trial TEXT NOT NULL,
  sealed REAL);                       -- set once its Parquet files and memory array are in place
"""

# PRAGMA user_version of staging.db: a newer one is refused before anything of it
# changes; a file from before versions (0, with these tables) is version 1.
STAGING_VERSION = 1
STAGING_TABLES = {"events": {"attempt", "seq", "body"},
                  "attempts": {"attempt", "sweep", "trial", "sealed"}}

VACUUM_PAGES = 256                # staging.db: free pages (4 KiB) that make a vacuum worth it
WAL_KEEP_BYTES = 16 << 20         # staging.db-wal is cut back to this after a checkpoint
_encode = json.JSONEncoder(separators=(",", ":")).encode
_counter = itertools.count()

# The adapters kept per trial: the last step's, and the best eval's (lowest val_loss).
ADAPTER_KINDS = ("last", "best")
# An attempt's events as delivered, kept when it is sealed: its staging rows go.
EVENTS = "events"
EVENTS_SCHEMA = pa.schema([("trial", pa.string()), ("attempt", pa.int64()), ("seq", pa.int64()),
                           ("event", pa.string()), ("time", pa.float64()),
                           ("body", pa.string())])   # the event's JSON, seq included


class Stores:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._con: sqlite3.Connection | None = None
        self._writer = False
        self._vacuums = False   # staging.db was made with auto_vacuum=INCREMENTAL
        self._known: dict[int, tuple[str, str]] = {}   # attempt -> (sweep, trial) registered
        self._lock = threading.RLock()

    def check(self) -> None:
        """Refuse an unusable staging.db now, in one line naming it (StoreError), not
        at the first telemetry; the head asks at its start. Nothing of it changes."""
        check_staging(self.root / sr.STAGING_DB)

    # ================================================================ write side

    def ingest(self, sweep: str, trial: str, attempt: int, events: list[dict]) -> int:
        """Keep a batch of an attempt's events; returns how many were new (a batch
        delivered twice counts once)."""
        try:
            rows = [(attempt, e["seq"], _encode(e)) for e in events]
        except (KeyError, TypeError) as e:
            raise ValueError(f"attempt {attempt}: every event must be a JSON object with an "
                             f"integer 'seq' ({type(e).__name__}: {e})") from None
        with self._lock, _transaction(self._write_db()) as con:
            self._register(con, sweep, trial, attempt)
            if _sealed(con, attempt):
                return 0   # everything it sent is in its files; this is a late re-delivery
            new = con.executemany("INSERT OR IGNORE INTO events VALUES (?, ?, ?)", rows).rowcount
        return max(new, 0)

    def seal_attempt(self, sweep: str, trial: str, attempt: int, row: dict) -> None:
        """The attempt ended: write its steps, evals, attempts and events Parquet files
        and its memory array from what was ingested, then mark it sealed and drop its
        staging rows. Sealing a sealed attempt changes nothing; sealing one whose seal
        was cut short writes the same bytes under the same names (an unchanged file is
        not touched)."""
        unknown = set(row) - set(sr.ATTEMPTS.names)
        if unknown:
            raise ValueError(f"attempt {attempt}: attempts row: unknown column(s) {sorted(unknown)}")
        for key, want in (("trial", trial), ("attempt", attempt)):
            if row.get(key, want) != want:
                raise ValueError(f"attempt {attempt}: attempts row: {key} is {row[key]!r}, not {want!r}")
        with self._lock:
            con = self._write_db()
            if self._known.get(attempt) != (sweep, trial):
                with _transaction(con):
                    self._register(con, sweep, trial, attempt)
            if _sealed(con, attempt):
                return
            bodies = [b for (b,) in con.execute(
                "SELECT body FROM events WHERE attempt = ? ORDER BY seq", (attempt,))]
        # the files are built without the lock (batches of running attempts go on
        # meanwhile); one sealer per attempt: the head's controller
        events = [json.loads(b) for b in bodies]
        tables = attempt_tables(trial, attempt, events)
        tables["attempts"] = pa.Table.from_pylist(
            [{**row, "trial": trial, "attempt": attempt}], schema=sr.ATTEMPTS)
        tables[EVENTS] = events_table(trial, attempt, events, bodies)
        for name in ("steps", "evals", "attempts", EVENTS):
            self._put_parquet(tables[name], self.root / sr.telemetry_file(name, sweep, attempt))
        peaks, labels, steps = phase_peaks(events)
        self._put_memory(sweep, trial, attempt, peaks, labels, steps,
                         node=row.get("node"), segment_size=row.get("segment_size"))
        with self._lock:
            with _transaction(con):   # sealed and pruned together, or neither
                con.execute("UPDATE attempts SET sealed = CAST(strftime('%s', 'now') AS REAL) "
                            "WHERE attempt = ?", (attempt,))
                con.execute("DELETE FROM events WHERE attempt = ?", (attempt,))
            self._give_back_pages()

    def put_probe(self, model_key: str, row: dict) -> None:
        """One probe point of a tune into the plan table, as its own file: a tune
        that dies half-way keeps every point it measured."""
        unknown = set(row) - set(sr.PLAN.names)
        if unknown:
            raise ValueError(f"plan row: unknown column(s) {sorted(unknown)}")
        table = pa.Table.from_pylist([row], schema=sr.PLAN)
        with self._lock:
            self._put_parquet(table, self.root / sr.plan_file(
                model_key, row["tune"], row["node"], row["seq_len"], row["segment_size"]))

    def put_checkpoint(self, sweep: str, trial: str, attempt: int, step: int,
                       files: dict[str, bytes]) -> None:
        """Keep a checkpoint folder's files exactly; only the newest few per trial stay."""
        _safe("trial", trial)
        for name in files:
            _safe("checkpoint file", name)
        names = sorted(files)
        attrs = dict(step=int(step), attempt=int(attempt), sweep=sweep, trial=trial, files=names)
        with self._lock:
            self._db(write=True)
        # built aside and renamed in without the lock (see seal_attempt); pruned under it
        ckpts = self.root / sr.ADAPTERS_ZARR / trial / "checkpoints"
        self._ensure_group(ckpts)
        self._put_dir(self.root / sr.checkpoint_group(trial, step),
                      lambda folder: write_packed_group(folder, attrs,
                                                        [bytes(files[n]) for n in names], names))
        with self._lock:
            for old in _checkpoint_dirs(ckpts)[:-sr.KEEP_CHECKPOINTS]:
                self._remove(old)

    def put_adapter(self, sweep: str, trial: str, attempt: int, files: dict[str, bytes], *,
                    kind: str = "last", step: int | None = None,
                    val_loss: float | None = None) -> None:
        """Keep a trial's adapter of `kind` (last: the final one; best: its best eval's):
        its tensors' bytes in one array, their layout, the config and the safetensors
        header as attributes, so the files can be rebuilt byte for byte; with the
        attempt, and the step and val_loss it is from where known."""
        _safe("trial", trial)
        path = _adapter_path(trial, kind)
        missing = {"adapters.safetensors", "adapter_config.json"} - set(files)
        if missing:
            raise ValueError(f"trial {trial}: adapter is missing {sorted(missing)}")
        header_text, data, tensors = read_safetensors(files["adapters.safetensors"])
        try:
            config_text = bytes(files["adapter_config.json"]).decode("utf-8")
            config = json.loads(config_text)
        except ValueError as e:   # UnicodeDecodeError included
            raise ValueError(f"trial {trial}: adapter_config.json: {e}") from None
        attrs = dict(adapter_config=config, adapter_config_json=config_text,
                     dtypes={n: t[0] for n, t in tensors.items()},
                     tensors={n: {"shape": list(shape), "offsets": list(span)}
                              for n, (_, shape, span) in tensors.items()},
                     safetensors_header=header_text, attempt=int(attempt), sweep=sweep, trial=trial,
                     step=None if step is None else int(step),
                     val_loss=None if val_loss is None else float(val_loss))
        with self._lock:
            self._db(write=True)
        self._ensure_group(self.root / sr.ADAPTERS_ZARR / trial)
        self._put_dir(self.root / path, lambda folder: write_packed_group(folder, attrs, [data]))

    # ================================================================ read side

    def is_sealed(self, attempt: int) -> bool:
        row = self._read("SELECT sealed FROM attempts WHERE attempt = ?", (attempt,))
        return bool(row) and row[0][0] is not None

    def events(self, attempt: int, after_seq: int = -1) -> list[dict]:
        """An attempt's events in seq order (each with its `seq`), after `after_seq`:
        from staging while it runs, from its events file once sealed."""
        bodies = [b for (b,) in self._read(
            "SELECT body FROM events WHERE attempt = ? AND seq > ? ORDER BY seq",
            (attempt, after_seq))]
        # None here and sealed now: sealed (files in place) and pruned in one commit
        # after our read, so the file has them all (no file: sealed by a segctl that
        # kept the rows, which the read above had)
        sealed = not bodies and self._read(
            "SELECT sweep FROM attempts WHERE attempt = ? AND sealed IS NOT NULL", (attempt,))
        path = sealed and self.root / sr.telemetry_file(EVENTS, sealed[0][0], attempt)
        if path and path.exists():
            bodies = pq.read_table(path, columns=["body"],
                                   filters=[("seq", ">", after_seq)])["body"].to_pylist()
        return [json.loads(b) for b in bodies]

    def latest_checkpoint(self, trial: str) -> tuple[int, dict[str, bytes]] | None:
        """(step, file name -> bytes) of the trial's newest checkpoint, or None."""
        for _ in range(5):  # a checkpoint pruned while we read it: take the newer one
            dirs = _checkpoint_dirs(self.root / sr.ADAPTERS_ZARR / trial / "checkpoints")
            if not dirs:
                return None
            try:
                attrs = node_attrs(dirs[-1])
                if "packed" in attrs:
                    data = read_data(dirs[-1])
                    files = {n: data[b:e] for n, (b, e) in attrs["packed"].items()}
                else:   # written before packing: one array per file
                    zarr, LocalStore = zarr_modules()
                    g = zarr.open_group(store=LocalStore(dirs[-1], read_only=True), mode="r")
                    files = {n: g[n][:].tobytes() for n in attrs["files"]}
            except (FileNotFoundError, KeyError):
                continue
            if (dirs[-1] / "zarr.json").exists():
                return int(attrs["step"]), files
        raise RuntimeError(f"trial {trial}: checkpoints keep changing under the reader")

    def has_adapter(self, trial: str, kind: str = "last") -> bool:
        # os.path, not pathlib: gather asks this of every trial of a sweep
        return os.path.isfile(os.path.join(self.root, _adapter_path(trial, kind), "zarr.json"))

    def adapter_info(self, trial: str, kind: str = "last") -> dict | None:
        """{attempt, step, val_loss} of the trial's adapter of `kind` (step and val_loss
        None where not known), or None when there is none."""
        try:   # only the group's own metadata is read: gather asks this of every trial
            a = node_attrs(self.root / _adapter_path(trial, kind))
        except FileNotFoundError:
            return None
        return {"attempt": a.get("attempt"), "step": a.get("step"), "val_loss": a.get("val_loss")}

    def adapter(self, trial: str, kind: str = "last") -> tuple[dict[str, np.ndarray], dict]:
        """The trial's LoRA tensors (name -> array in its original dtype; bfloat16,
        which numpy lacks, comes back widened to float32) and its adapter_config."""
        attrs, data = self._adapter_node(trial, kind)
        if data is None:   # written before packing: one array per tensor
            g = self._adapter_group(trial, kind)
            return {n: g[n][...] for n in attrs["dtypes"]}, dict(attrs["adapter_config"])
        return ({n: tensor_values(data[b:e], attrs["dtypes"][n], t["shape"])
                 for n, t in attrs["tensors"].items() for b, e in [t["offsets"]]},
                dict(attrs["adapter_config"]))

    def adapter_files(self, trial: str, kind: str = "last") -> dict[str, bytes]:
        """The trial's mlx-lm adapter folder, rebuilt: adapters.safetensors (the same
        bytes the engine wrote) and adapter_config.json."""
        attrs, data = self._adapter_node(trial, kind)
        head = attrs["safetensors_header"].encode("utf-8")
        if data is None:   # written before packing: one array per tensor
            g = self._adapter_group(trial, kind)
            data = data_section(attrs["safetensors_header"],
                                {n: tensor_bytes(g[n][...], code)
                                 for n, code in attrs["dtypes"].items()})
        # the config as it came (stores made before that kept it parsed only: as the engine writes it)
        config = attrs.get("adapter_config_json") or json.dumps(attrs["adapter_config"], indent=2) + "\n"
        return {"adapters.safetensors": len(head).to_bytes(8, "little") + head + data,
                "adapter_config.json": config.encode("utf-8")}

    def adapter_sha256(self, trial: str, kind: str = "last") -> dict[str, str] | None:
        """File name -> sha256 of the trial's adapter of `kind` as its node hashed it
        when it sent it (the `adapter` event of the attempt that stored it), or None
        where the stores hold no such event (stores from before nodes recorded it)."""
        try:
            a = node_attrs(self.root / _adapter_path(trial, kind))
        except FileNotFoundError:
            return None
        attempt, sweep = a.get("attempt"), a.get("sweep")
        if not isinstance(attempt, int) or not isinstance(sweep, str):
            return None
        path = self.root / sr.telemetry_file(EVENTS, sweep, attempt)
        if path.exists():   # sealed: only its adapter event is read, not its every step
            events = [json.loads(b) for b in pq.read_table(
                path, columns=["body"], filters=[("event", "==", "adapter")])["body"].to_pylist()]
        else:
            events = [e for e in self.events(attempt) if e.get("event") == "adapter"]
        key = "sha256" if kind == "last" else "best_sha256"
        sent = [e[key] for e in events if isinstance(e.get(key), dict)]
        return sent[-1] if sent else None

    # ================================================================ internals

    def _db(self, write: bool) -> sqlite3.Connection | None:
        """The staging.db connection. A reader opens it only if it exists and never
        creates it; the writer sets it up (private, WAL, tables), clears temp left by
        a head that crashed and prunes what an older segctl left of sealed attempts."""
        with self._lock:
            path = self.root / sr.STAGING_DB
            if write and not self._writer and self._con is not None:
                # A connection opened to read (the head's reseal asks is_sealed first)
                # holds SQLite's POSIX locks on these files, and private_file below
                # opening and closing them would drop every lock this process has
                # there: a reader closing elsewhere would then think itself the last
                # one and delete the WAL under the writer. Start the writer afresh.
                self._con.close()
                self._con = None
            if self._con is None:
                if not write and not path.exists():
                    return None
                if write:
                    check_staging(path)   # whose file and which version, before anything changes
                    private_dir(self.root)
                    private_file(path)    # SQLite makes -wal and -shm with its mode
                self._con = sqlite3.connect(path, timeout=LOCK_WAIT_S, isolation_level=None,
                                            check_same_thread=False)
                if not write:
                    try:
                        staging_version(self._con, path)
                    except (sqlite3.Error, StoreError) as e:
                        self._con.close()
                        self._con = None
                        raise _unusable(path, e) from None
            if write and not self._writer:
                for p in (path, path.with_name(path.name + "-wal"),
                          path.with_name(path.name + "-shm")):
                    if p.exists():
                        private_file(p)
                # before the first table: free pages can go back to the file system
                # (a staging.db made without it keeps them, and works as before)
                self._con.execute("PRAGMA auto_vacuum=INCREMENTAL")
                self._con.execute("PRAGMA journal_mode=WAL")
                self._con.execute("PRAGMA synchronous=NORMAL")
                self._con.execute(f"PRAGMA journal_size_limit={WAL_KEEP_BYTES}")
                self._con.executescript(SCHEMA)
                self._con.execute(f"PRAGMA user_version = {STAGING_VERSION}")
                self._clear_temp()
                self._writer = True
                self._vacuums = self._con.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
                self._prune_sealed()
                self._give_back_pages()
            return self._con

    def _write_db(self) -> sqlite3.Connection:
        """The writer's staging.db connection (made where it is missing)."""
        con = self._db(write=True)
        assert con is not None   # only a reader finds no file
        return con

    def _read(self, sql: str, args: tuple) -> list[tuple]:
        with self._lock:
            con = self._db(write=False)
            if con is None:
                return []
            try:
                return con.execute(sql, args).fetchall()
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):   # created, but the writer has not set it up yet
                    return []
                raise _unusable(self.root / sr.STAGING_DB, e) from None
            except sqlite3.DatabaseError as e:   # damaged past its first page
                raise _unusable(self.root / sr.STAGING_DB, e) from None

    def _register(self, con, sweep: str, trial: str, attempt: int) -> None:
        """Tie a (global) attempt id to its sweep and trial, once; a mismatch is a bug."""
        if self._known.get(attempt) == (sweep, trial):
            return
        _safe("sweep", sweep)
        _safe("trial", trial)
        con.execute("INSERT OR IGNORE INTO attempts (attempt, sweep, trial) VALUES (?, ?, ?)",
                    (attempt, sweep, trial))
        have = tuple(con.execute("SELECT sweep, trial FROM attempts WHERE attempt = ?",
                                 (attempt,)).fetchone())
        if have != (sweep, trial):
            raise ValueError(f"attempt {attempt} belongs to {have[0]}/{have[1]}, not {sweep}/{trial}")
        self._known[attempt] = have

    def _prune_sealed(self) -> None:
        """Sealed attempts whose staging rows are still there (sealed by a segctl that
        kept them): their events file first, then the rows go."""
        con = self._con
        assert con is not None   # the writer's, open
        for attempt, sweep, trial in con.execute(
                "SELECT attempt, sweep, trial FROM attempts a WHERE sealed IS NOT NULL AND "
                "EXISTS (SELECT 1 FROM events e WHERE e.attempt = a.attempt)").fetchall():
            bodies = [b for (b,) in con.execute(
                "SELECT body FROM events WHERE attempt = ? ORDER BY seq", (attempt,))]
            path = self.root / sr.telemetry_file(EVENTS, sweep, attempt)
            if not path.exists():
                self._put_parquet(events_table(trial, attempt, list(map(json.loads, bodies)),
                                               bodies), path)
            with _transaction(con):
                con.execute("DELETE FROM events WHERE attempt = ?", (attempt,))

    def _give_back_pages(self) -> None:
        """Return staging.db's free pages to the file system once there are enough of
        them, a bounded number per call (each one moved is a page written, under the
        lock every ingest takes). The file itself shrinks at the WAL's next checkpoint."""
        con = self._con
        assert con is not None   # the writer's, open
        if self._vacuums and con.execute("PRAGMA freelist_count").fetchone()[0] >= VACUUM_PAGES:
            # executescript: execute() steps the pragma once, and one step frees one page
            con.executescript(f"PRAGMA incremental_vacuum({VACUUM_PAGES * 4});")

    def _adapter_node(self, trial: str, kind: str) -> tuple[dict, bytes | None]:
        """(attributes, data bytes) of an adapter; data None for the per-tensor layout."""
        if not self.has_adapter(trial, kind):
            raise KeyError(f"trial {trial}: no {kind} adapter in the stores")
        path = self.root / _adapter_path(trial, kind)
        attrs = node_attrs(path)
        return attrs, (read_data(path) if "tensors" in attrs else None)

    def _adapter_group(self, trial: str, kind: str = "last"):
        if not self.has_adapter(trial, kind):
            raise KeyError(f"trial {trial}: no {kind} adapter in the stores")
        zarr, LocalStore = zarr_modules()
        return zarr.open_group(store=LocalStore(self.root / _adapter_path(trial, kind),
                                                read_only=True), mode="r")

    # ---- atomic placement: a file through private_file (schemas.atomic); a zarr
    # ---- node built under .staging/, fsynced, renamed into place

    def _temp(self, kind: str) -> Path:
        """A fresh temp path under .staging/ (named by pid: a later writer clears it)."""
        base = private_dir(self.root / sr.TEMP)
        return base / f"{os.getpid()}-{next(_counter)}-{kind}"

    def _clear_temp(self) -> None:
        """Temp left by a writer that died (a crashed head) goes; a live one's stays."""
        base = self.root / sr.TEMP
        if base.is_dir():
            for p in base.iterdir():
                pid = p.name.split("-", 1)[0]
                if not (pid.isdigit() and alive(int(pid))):
                    rmtree(p)

    def _put_parquet(self, table: pa.Table, path: Path) -> None:
        """Write a Parquet file (owner-only, atomically); an identical file already
        there is left untouched."""
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        private_dir(path.parent)
        try:
            if path.stat().st_size == len(data) and path.read_bytes() == data:
                return
        except FileNotFoundError:
            pass
        # Written aside under .staging/, as a zarr node is built: a writer killed
        # midway leaves its temporary where the next writer clears it
        # (_clear_temp), not a hidden file beside the table's that none would.
        private_file(path, data, tmp=self._temp("parquet"))

    def _put_memory(self, sweep, trial, attempt, peaks, labels, steps, *, node, segment_size):
        target = self.root / sr.memory_array(sweep, trial, attempt)
        self._ensure_group(target.parent)
        attrs = dict(phases=labels, steps=steps, node=node, segment_size=segment_size,
                     sweep=sweep, trial=trial, attempt=attempt)
        self._put_dir(target, lambda folder: write_peaks_array(folder, peaks, attrs))

    def _put_dir(self, target: Path, write) -> None:
        """`write(folder)` builds a zarr node in temp, which then replaces `target`. An
        identical target is left as it is; a different one is moved aside first, so a
        reader sees the old node or the new one (for an instant neither), never a mix."""
        tmp = self._temp("node")
        try:
            write(tmp)
            settle_tree(tmp)
            if target.exists():
                if same_tree(tmp, target):
                    return
                self._remove(target)
            os.rename(tmp, target)
            fsync_dir(target.parent)
        finally:
            rmtree(tmp)

    def _ensure_group(self, path: Path) -> None:
        """A zarr group at `path` and at every folder up to its store (`*.zarr`), each
        built in temp and renamed in; another creator winning the race is fine."""
        if (path / "zarr.json").is_file():
            return
        if not path.name.endswith(".zarr"):
            self._ensure_group(path.parent)
        tmp = self._temp("group")
        zarr, LocalStore = zarr_modules()
        try:
            zarr.open_group(store=LocalStore(tmp), mode="w")
            settle_tree(tmp)
            os.rename(tmp, path)
            fsync_dir(path.parent)
        except OSError:
            if not (path / "zarr.json").is_file():
                raise
        finally:
            rmtree(tmp)

    def _remove(self, path: Path) -> None:
        """Take a node out of sight at once (a rename), then delete it."""
        aside = self._temp("old")
        os.rename(path, aside)
        rmtree(aside)


def _sealed(con: sqlite3.Connection, attempt: int) -> bool:
    row = con.execute("SELECT sealed FROM attempts WHERE attempt = ?", (attempt,)).fetchone()
    return row is not None and row[0] is not None


def check_staging(path: Path) -> None:
    """Refuse a staging.db that is damaged, locked, another program's or a newer
    segctl's (StoreError, one line naming it and what to do) before anything of it
    changes: read through a connection of its own, closed before the writer's opens.
    A missing file passes."""
    if not path.exists():
        return
    try:
        con = sqlite3.connect(path, timeout=LOCK_WAIT_S)
        try:
            staging_version(con, path)
        finally:
            con.close()
    except (sqlite3.Error, StoreError) as e:
        raise _unusable(path, e) from None


def staging_version(con: sqlite3.Connection, path: Path) -> int:
    """Which version staging.db is at (0: new and empty); StoreError when a newer
    segctl wrote it, sqlite3.DatabaseError when it is not ours or not a database."""
    have = con.execute("PRAGMA user_version").fetchone()[0]
    if have > STAGING_VERSION:
        raise StoreError(f"{path}: written by a newer segctl (staging.db version {have}; this "
                         f"segctl knows up to {STAGING_VERSION}): upgrade segctl to use it")
    tables = {name: {c for (c,) in con.execute("SELECT name FROM pragma_table_info(?)", (name,))}
              for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
              if not name.startswith("sqlite_")}
    if tables and any(not cols <= tables.get(t, set()) for t, cols in STAGING_TABLES.items()):
        raise sqlite3.DatabaseError("it holds no segctl staging tables: another program's file")
    return STAGING_VERSION if tables else have


def _unusable(path: Path, e: Exception) -> StoreError:
    """staging.db cannot be used, in one line: what it is and what to do."""
    if isinstance(e, StoreError):
        return e
    text = " ".join(str(e).split())
    if "locked" in text or "busy" in text:
        return StoreError(f"{path}: locked by another process for {LOCK_WAIT_S:g} s (a second "
                          "head on the same stores? stop it, or wait for it, and try again)")
    return StoreError(f"{path}: not a usable segctl staging database ({text}); move it aside "
                      "(with its -wal and -shm files) and start the head again: it makes a new "
                      "one and seals what it can (the telemetry of attempts not sealed yet is "
                      "lost; state.db and the sealed telemetry, adapters and data are kept)")


@contextmanager
def _transaction(con: sqlite3.Connection):
    con.execute("BEGIN IMMEDIATE")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


# ==================================================================== tables

def attempt_tables(trial: str, attempt: int, events: list[dict]) -> dict[str, pa.Table]:
    """The steps and evals tables of one attempt from its events (seq order)."""
    out = {}
    for name, kind in sr.TABLE_EVENT.items():
        schema = sr.TABLES[name]
        rows = [e for e in events if e.get("event") == kind]
        cols = {"trial": [trial] * len(rows), "attempt": [attempt] * len(rows)}
        for field in schema:
            if field.name not in cols:
                cols[field.name] = [e.get(field.name) for e in rows]
        out[name] = pa.table(cols, schema=schema)
    return out


def events_table(trial: str, attempt: int, events: list[dict], bodies: list[str]) -> pa.Table:
    """The events file of one attempt: each event as delivered (`bodies`, seq order),
    with the columns a reader filters on."""
    return pa.table({"trial": [trial] * len(events), "attempt": [attempt] * len(events),
                     "seq": [e["seq"] for e in events], "event": [e.get("event") for e in events],
                     "time": [e.get("time") for e in events], "body": bodies},
                    schema=EVENTS_SCHEMA)


def phase_peaks(events: list[dict]) -> tuple[np.ndarray, list[str], list[int]]:
    """[steps, phases] float32 peaks (GB) from the phase events, NaN where a step
    lacks a phase; the phase labels in first-seen order and the step numbers."""
    labels: dict[str, int] = {}
    rows: dict[int, dict[int, float]] = {}
    for e in events:
        if e.get("event") != "phase":
            continue
        row = rows.setdefault(int(e["step"]), {})
        seen: dict[str, int] = {}
        for label, peak in e["phases"]:
            # a label twice in one step gets its own column: "label#2"
            n = seen[label] = seen.get(label, 0) + 1
            key = label if n == 1 else f"{label}#{n}"
            # a job on several nodes: each rank's phases of a step; the highest counts
            j = labels.setdefault(key, len(labels))
            if row.get(j) is None or (peak is not None and peak > row[j]):
                row[j] = peak
    steps = sorted(rows)
    peaks = np.full((len(steps), len(labels)), np.nan, dtype=np.float32)
    for i, s in enumerate(steps):
        for j, v in rows[s].items():
            peaks[i, j] = np.nan if v is None else v
    return peaks, list(labels), steps


# ==================================================================== files

def _safe(key: str, name: str) -> None:
    """Names become path components (and zarr node names, and hive partition values)."""
    if (not isinstance(name, str) or not name or name.startswith((".", "__"))
            or any(c in name for c in "/\\\0%")):
        raise ValueError(f"{key}: {name!r} cannot be used as a name in the stores "
                         "(empty, starts with '.' or '__', or has / \\ %)")


def _adapter_path(trial: str, kind: str) -> str:
    """Where a trial's adapter of `kind` lives, relative to the stores root."""
    if kind not in ADAPTER_KINDS:
        raise ValueError(f"adapter kind {kind!r} is not one of {ADAPTER_KINDS}")
    return sr.adapter_group(trial) if kind == "last" else f"{sr.ADAPTERS_ZARR}/{trial}/best_adapter"


def _checkpoint_dirs(folder: Path) -> list[Path]:
    """Finished checkpoints of a trial, oldest first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.glob("step-*") if (p / "zarr.json").is_file()),
                  key=lambda p: int(p.name.split("-", 1)[1]))
