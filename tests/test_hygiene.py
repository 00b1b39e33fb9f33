"""Hygiene of what segctl keeps on disk and which processes it signals: the node's
model cache keyed by content, hub-cache snapshots served through their links (and
nothing else), attempt folders that do not pile up on a node, owner-only files
under any umask, and a recorded pid that now names another process left alone.
Real files, real SQLite, real engine and `sleep` processes; no Ray cluster."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from segctl.node import models, raynode
from segctl.schemas.private import private_dir, private_file
from segctl.schemas.records import AttemptSpec
from segctl.schemas.states import Outcome
from tests.test_stores import attempt_row, run_events

ON_HEAD = "/lab/models/tiny"        # a model path this "node" does not have


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from segctl.engine.demo import demo_examples, write_model
    corpus = [f"{r['prompt']} {r['completion']}" for r in demo_examples(50, 1)]
    return write_model(tmp_path_factory.mktemp("tiny") / "model", "qwen3", corpus=corpus,
                       seed=2, layers=2, hidden=32)


def serve(folder: Path, log: list | None = None):
    """The head's two calls as a node reaches them (over Ray in a fleet)."""
    def manifest(path):
        assert path == ON_HEAD
        return models.manifest(str(folder))

    def chunk(path, name, offset, n):
        if log is not None:
            log.append(name)
        return models.read_chunk(str(folder), name, offset, n)
    return dict(manifest=manifest, chunk=chunk)


def age(folder: Path, seconds: float) -> None:
    """Files last written `seconds` ago (so their hashes may be cached)."""
    t = time.time() - seconds
    for p in folder.rglob("*"):
        os.utime(p, (t, t), follow_symlinks=False)


# ------------------------------------------------------------------ 1. model cache

def test_weights_rewritten_in_place_reach_the_node(tiny_model, tmp_path):
    head = tmp_path / "head-model"
    shutil.copytree(tiny_model, head)
    age(head, 3600)
    weights = head / "model.safetensors"
    cache, fetched = tmp_path / "cache", []

    first = Path(models.local_model(ON_HEAD, cache, **serve(head, fetched)))
    assert (first / "model.safetensors").read_bytes() == weights.read_bytes()
    n = len(fetched)
    assert models.local_model(ON_HEAD, cache, **serve(head, fetched)) == str(first)
    assert len(fetched) == n, "unchanged: served from the cache"

    # retrained: same names, same size, other bytes, written in place (same inode)
    old = weights.read_bytes()
    new = old[:-64] + bytes(b ^ 0xFF for b in old[-64:])
    with open(weights, "r+b") as f:
        f.write(new)
    second = Path(models.local_model(ON_HEAD, cache, **serve(head, fetched)))
    assert second != first and len(fetched) > n
    assert (second / "model.safetensors").read_bytes() == new
    assert (first / "model.safetensors").read_bytes() == old, "an entry is never rewritten"
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]

    # The head hashes once per (path, size, mtime, inode): bytes changed with the
    # mtime forced back keep the cached hash, and a node fetching under that stale
    # manifest refuses bytes that do not match it rather than cache them.
    age(head, 1800)
    digest = dict((n, d) for n, _, d in models.manifest(str(head)))["model.safetensors"]
    assert digest == hashlib.sha256(new).hexdigest()
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.write(old)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert dict((n, d) for n, _, d in models.manifest(str(head)))["model.safetensors"] == digest
    with pytest.raises(OSError, match="not the file the head listed"):
        models.local_model(ON_HEAD, tmp_path / "cache2", **serve(head))
    assert not list((tmp_path / "cache2").iterdir()), "nothing half-fetched is kept"


# ------------------------------------------------------------------ 2. hub-cache snapshots

def hub_snapshot(model: Path, hub: Path) -> Path:
    """`model` laid out as the Hugging Face hub cache does it: blobs named by their
    sha256, a snapshot folder of relative links into ../../blobs, a ref."""
    repo = hub / "models--lab--tiny"
    snap = repo / "snapshots" / "4f3e2d1c0b"
    (repo / "blobs").mkdir(parents=True)
    files = [p for p in sorted(model.rglob("*")) if p.is_file()]
    extra = hub / "notes.txt"     # becomes a file in a subfolder of the snapshot
    extra.write_text("tokenizer notes\n")
    for src, rel in [(p, p.relative_to(model)) for p in files] + [(extra, Path("docs/notes.txt"))]:
        blob = repo / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("4f3e2d1c0b")
    return snap


def test_a_hub_cache_snapshot_is_served_through_its_links(tiny_model, tmp_path):
    snap = hub_snapshot(tiny_model, tmp_path / "hub")
    assert all(p.is_symlink() for p in snap.iterdir() if p.name != "docs")

    local = Path(models.local_model(ON_HEAD, tmp_path / "cache", **serve(snap)))
    got = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert got == sorted([p.name for p in tiny_model.iterdir()] + ["docs/notes.txt"])
    assert not [p for p in local.rglob("*") if p.is_symlink()], "the node gets plain files"
    cmp = filecmp.dircmp(tiny_model, local)
    assert not cmp.left_only and not cmp.diff_files
    from segctl.engine.model import load_model
    _, tok = load_model(str(local))
    assert tok.encode("after q")

    blob = next((snap.parent.parent / "blobs").iterdir())
    os.mkfifo(snap.parent.parent / "blobs" / "fifo")
    bad = {   # name in the snapshot -> where its link points, and what the head says
        "blobdir": (Path("../../blobs"), "link to a folder"),
        "pipe": (Path("../../blobs/fifo"), "not a regular file"),
        "zero": (Path("/dev/zero"), "not a regular file"),
        "gone": (Path("../../blobs/nothing"), "link to nothing"),
    }
    for name, (target, why) in bad.items():
        (snap / name).symlink_to(target)
        with pytest.raises(ValueError, match=why):
            models.manifest(str(snap))
        with pytest.raises(ValueError):
            models.read_chunk(str(snap), f"blobdir/{blob.name}" if name == "blobdir" else name, 0, 8)
        (snap / name).unlink()
    # names outside the folder are never resolved, link or not
    for name in (f"../../blobs/{blob.name}", str(blob), "docs/../../../blobs/" + blob.name):
        with pytest.raises(ValueError, match="not inside"):
            models.read_chunk(str(snap), name, 0, 8)
    # a folder link on the way to a name is not followed either
    (snap / "sub").symlink_to("docs")
    with pytest.raises(ValueError, match="not inside"):
        models.read_chunk(str(snap), "sub/notes.txt", 0, 8)
    (snap / "sub").unlink()
    assert models.read_chunk(str(snap), "docs/notes.txt", 0, 9) == b"tokenizer"


# ------------------------------------------------------------------ 4. attempt folders

def demo_job(demo_dir: Path) -> dict:
    from segctl.schemas.job import load_job
    job = load_job(demo_dir / "job.yaml").model_dump(mode="json")
    job["train"].update(iters=2, warmup=0, eval_every=0, val_batches=2, checkpoint_every=0)
    return job


def run(spec: AttemptSpec, work: Path):
    from segctl.node.attempt import run_attempt
    return run_attempt(spec, work, send_events=lambda batch: None,
                       send_checkpoint=lambda step, files: None, on_started=lambda pid, t: None)


@pytest.fixture
def open_umask():
    """A permissive umask for the test: modes must come from segctl, not from it."""
    old = os.umask(0)
    yield
    os.umask(old)


def assert_private(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        mode = p.lstat().st_mode
        want = 0o700 if stat.S_ISDIR(mode) else 0o600
        assert stat.S_IMODE(mode) == want and p.lstat().st_uid == os.getuid(), \
            (str(p), oct(stat.S_IMODE(mode)))


@pytest.mark.slow   # 6 s
def test_attempt_folders_do_not_pile_up_on_a_node(demo_dir, tmp_path, monkeypatch, open_umask):
    from segctl.node.agent import NodeAgent, work_root
    monkeypatch.setenv("SEGCTL_WORK", str(tmp_path / "work"))
    work = work_root("mac-1")
    job = demo_job(demo_dir)
    spec = lambda i, data: AttemptSpec(sweep="sw", trial="sw-t000", attempt=i, job=job, data=data)

    for i in range(1, 6):    # bad data: the engine refuses it, exit 2
        r = run(spec(i, {"train.jsonl": b'{"text": 1}\n'}), work)
        assert r.outcome == Outcome.FAILED and r.message, r
    kept = sorted(p.name for p in work.iterdir())
    assert kept == ["attempt-3", "attempt-4", "attempt-5", "data-cache"], \
        "the newest three failed folders, and the data sets tokenized on this node"
    outcome = json.loads((work / "attempt-5" / "outcome.json").read_text())
    assert outcome["outcome"] == Outcome.FAILED and outcome["message"] == r.message
    assert (work / "attempt-5" / "data" / "train.jsonl").is_file(), "kept as it ran, to debug"
    assert_private(tmp_path / "work")

    # the model cannot be had: an outcome (never an exception that would stall the head)
    def refused(path):
        raise PermissionError(f"{path}: not the model of any trial")
    from segctl.node.attempt import run_attempt
    r = run_attempt(spec(6, {"train.jsonl": b"{}\n"}), work, send_events=print,
                    send_checkpoint=print, on_started=print, model_dir=refused)
    assert (r.outcome, r.message) == (Outcome.FAILED, f"model {job['model']}: "
                                                f"{job['model']}: not the model of any trial")

    # an agent that died mid-attempt left a folder without an outcome: the next
    # agent of this node counts it as a failed one
    private_dir(work / "attempt-7" / "out")
    NodeAgent("mac-1", head=None)
    assert sorted(p.name for p in work.iterdir()) == ["attempt-5", "attempt-6", "attempt-7",
                                                      "data-cache"]
    assert not (work / "data-cache" / "outcome.json").exists()
    assert json.loads((work / "attempt-7" / "outcome.json").read_text())["outcome"] == "abandoned"

    data = {n: (demo_dir / "data" / n).read_bytes() for n in ("train.jsonl", "valid.jsonl")}
    ok = run(spec(8, data), work)
    assert ok.outcome == Outcome.SUCCEEDED and set(ok.adapter) == {"adapters.safetensors",
                                                             "adapter_config.json"}
    assert not (work / "attempt-8").exists(), "delivered with the result: the folder goes"
    assert sorted(p.name for p in work.iterdir()) == ["attempt-5", "attempt-6", "attempt-7",
                                                      "data-cache"]
    assert len(list((work / "data-cache").glob("*.json"))) == 2, "train and valid, tokenized"
    assert_private(tmp_path / "work")


# ------------------------------------------------------------------ 5. permissions

def test_stores_and_work_folders_are_private_under_any_umask(tmp_path, monkeypatch, open_umask):
    from segctl.orchestrator import fleet
    from segctl.orchestrator.stores import Stores
    root = tmp_path / "new" / "stores"          # its parent is made too
    st = Stores(root)
    st.ingest("sw-1", "sw-1-t000", 1, run_events(1, 4))
    st.ingest("sw-1", "sw-1-t000", 2, run_events(1, 2))   # still running: staging rows
    st.seal_attempt("sw-1", "sw-1-t000", 1, attempt_row(1, steps=4))
    st.put_checkpoint("sw-1", "sw-1-t000", 1, 2, {"state.json": b"{}", "w.bin": bytes(100)})
    fleet.ensure_token(root)
    fleet._write(root / fleet.FLEET_FILE, {"head": {}})
    with fleet._locked(root):
        pass
    # what the lead's state.db and inputs/ calls do
    private_file(root / "state.db")
    con = sqlite3.connect(root / "state.db")
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE t (x)")
    con.execute("INSERT INTO t VALUES (1)")
    con.commit()
    private_file(private_dir(root / "inputs") / "abc", b"rows")
    names = {p.name for p in root.iterdir()}
    assert {"staging.db", "staging.db-wal", "staging.db-shm", "state.db-wal", "telemetry",
            "memory.zarr", "adapters.zarr", "auth_token", "fleet.json", "inputs"} <= names
    assert_private(tmp_path / "new")
    con.close()

    # a folder made loose before is tightened; one of another user is refused
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    assert stat.S_IMODE(private_dir(loose).stat().st_mode) == 0o700
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(PermissionError, match="not a folder of this user"):
            private_dir(theirs)
        their_file = tmp_path / "their.db"
        their_file.write_bytes(b"theirs")
        os.chown(their_file, 65534, 65534)
        with pytest.raises(PermissionError, match="not a file of this user"):
            private_file(their_file, b"ours")
        assert their_file.read_bytes() == b"theirs", "refused before anything is written"
        monkeypatch.setenv("SEGCTL_WORK", str(theirs))     # someone took the /tmp name first
        from segctl.node.agent import work_root
        with pytest.raises(PermissionError):
            work_root("mac-1")
        assert not list(theirs.iterdir())


# ------------------------------------------------------------------ 6. recorded pids

def sleeper(argv0: str = "sleep") -> subprocess.Popen:
    """A `sleep` in its own session, as a `ray start --block` runs; `argv0` is what
    `ps` shows as its command line."""
    return subprocess.Popen(["bash", "-c", f"exec -a '{argv0}' sleep 120"],
                            start_new_session=True)


def test_a_recorded_pid_that_is_another_process_now_is_left_alone(tmp_path):
    from segctl.orchestrator import fleet
    from segctl.schemas.cluster import ClusterSpec, HeadSpec, NodeSpec
    # looks like a segctl node to a command-line check, but started after the record
    proc = sleeper(f"{sys.executable} -m ray.scripts.scripts start --address=x --block")
    other = sleeper()
    try:
        for p in (proc, other):   # bash has exec'd: the command line is argv0's, not bash's
            deadline = time.monotonic() + 30
            while subprocess.run(["ps", "-o", "comm=", "-p", str(p.pid)], capture_output=True,
                                 text=True).stdout.strip() != "sleep":
                assert time.monotonic() < deadline and p.poll() is None
                time.sleep(0.01)
        started = raynode.start_time(proc.pid)
        assert started and started == raynode.start_time(proc.pid)
        assert raynode.is_ours(proc.pid, None), "a command-line check alone would take it"
        stale = raynode.start_time(os.getpid())   # another process's: the pid's old owner
        raynode.stop(proc.pid, stale, timeout=1)
        assert proc.poll() is None, "a pid whose start time differs is not signalled"

        # `cluster down` over such a record signals nothing and forgets the record
        spec = ClusterSpec(head=HeadSpec(port=6399, stores=str(tmp_path / "stores")),
                           nodes=[NodeSpec(name="n1", local=True, memory_gb=1)])
        fleet._write(tmp_path / "stores" / fleet.FLEET_FILE, {
            "address": "127.0.0.1:6399", "port": 6399, "token_path": "",
            "head": {"pid": proc.pid, "started": stale, "node": None},
            "nodes": {"n1": {"pid": other.pid, "started": stale, "local": True, "host": None}}})
        fleet.down(spec)
        assert proc.poll() is None and other.poll() is None
        assert not (tmp_path / "stores" / fleet.FLEET_FILE).exists()

        # the process that was recorded is stopped
        raynode.stop(other.pid, raynode.start_time(other.pid), timeout=5)
        assert not raynode.alive(other.pid) and raynode.start_time(other.pid) is None
    finally:
        for p in (proc, other):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_start_time_on_a_mac_comes_from_ps_lstart():
    calls = []

    def mac_ps(cmd, **kw):
        calls.append(cmd)
        out = "Tue Mar  4 09:15:02 2025\n" if cmd[-1] == "4242" else ""
        return subprocess.CompletedProcess(cmd, 0 if out else 1, out, "")
    assert raynode.start_time(4242, platform="darwin", run=mac_ps) == "Tue Mar 4 09:15:02 2025"
    assert calls == [["ps", "-o", "lstart=", "-p", "4242"]]
    assert raynode.start_time(4243, platform="darwin", run=mac_ps) is None


def test_an_attempt_runs_in_a_spare_started_before_it(demo_dir, tmp_path):
    """A spare engine process imports ahead of its attempt; each attempt still gets a
    process of its own, used once, and one that died while waiting is passed over."""
    from segctl.node.attempt import run_attempt, spares
    from segctl.node.raynode import alive
    job = demo_job(demo_dir)
    data = {n: (demo_dir / "data" / n).read_bytes() for n in ("train.jsonl", "valid.jsonl")}
    spec = lambda i: AttemptSpec(sweep="sw", trial="sw-t000", attempt=i, job=job, data=data)

    def attempt(i):
        pids = []
        r = run_attempt(spec(i), tmp_path / "work", send_events=lambda batch: None,
                        send_checkpoint=lambda step, files: None,
                        on_started=lambda pid, t: pids.append(pid))
        assert r.outcome == Outcome.SUCCEEDED, r
        return pids[0]

    def waiting():
        return [p for _, p in spares.waiting]

    spares.close()
    spares.refill(sys.executable)
    [first] = waiting()
    assert attempt(1) == first.pid and first.returncode == 0    # ran there, and ended
    [second] = waiting()                                        # refilled
    assert second.pid != first.pid
    second.kill()
    second.wait()
    third = attempt(2)                                          # the dead one is skipped
    assert third not in (first.pid, second.pid)
    [spare] = waiting()
    spares.close()
    assert not waiting() and spare.returncode == 0 and not alive(spare.pid)
