"""Run one attempt on this node: lay out its inputs, start the engine in a fresh
process, forward its telemetry in batches, ship checkpoints and the adapter as
bytes, and say how it ended.

No Ray here: the agent (node/agent.py) passes in how to reach the head, so this
runs the same under a test with plain callables.

The attempt's folder (its data, the engine's checkpoints and adapter) is the
user's alone (0700, the engine runs under umask 077) and does not outlive the
attempt: once the result is in hand (the adapter's bytes are in it) a succeeded
or cancelled attempt's folder is removed. One that failed (failed, oom, node
lost) keeps its folder for debugging, with `outcome.json` saying how it ended,
but only the newest KEEP_FAILED such folders of a node stay; folders an agent
that died left behind count as failed ("abandoned") when the next agent starts.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from segctl.schemas import events as ev
from segctl.schemas.private import private_dir, private_file
from segctl.schemas.records import AttemptResult, AttemptSpec

DATA_CACHE = "data-cache"   # beside the attempt folders of a node: tokenized data sets
DRAIN_S = 5          # seconds the worker's stderr gets to drain once it has exited
FLUSH_ROWS = 500     # forward telemetry when this many are waiting, or every spec.flush_s
KEEP_FAILED = 3      # folders of attempts that did not succeed, kept per node for debugging
OUTCOME_FILE = "outcome.json"   # in a kept folder: how its attempt ended


class Running:
    """The engine process of one attempt, so `cancel` can reach it."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.cancelled = False
        self.lock = threading.Lock()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.proc and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)


def run_attempt(spec: AttemptSpec, work: Path, *,
                send_events: Callable[[list[dict]], None],
                send_checkpoint: Callable[[int, dict[str, bytes]], None],
                on_started: Callable[[int, float], None],
                model_dir: Callable[[str], str] = lambda path: path,
                running: Running | None = None,
                python: str = sys.executable) -> AttemptResult:
    """`model_dir` maps the job's model path to a folder on this machine (fetching
    it from the head when this machine does not have it)."""
    running = running or Running()
    folder = private_dir(work) / f"attempt-{spec.attempt}"
    shutil.rmtree(folder, ignore_errors=True)
    private_dir(folder / "data")
    out = folder / "out"

    # Inputs arrive as bytes: no shared file system.
    for name, blob in spec.data.items():
        private_file(folder / "data" / name, blob)
    job = spec.job
    try:
        model = model_dir(job.model)
    except Exception as e:   # refused by the head, or the fetch broke: an outcome, not a crash
        outcome = "failed" if isinstance(e, (ValueError, PermissionError)) else "node_lost"
        return _ended(folder, AttemptResult(
            attempt=spec.attempt, outcome=outcome, ended=time.time(),
            message=f"model {job.model}: {_last(str(e).splitlines()) or type(e).__name__}"))
    job = job.model_copy(update={
        "model": model, "output": str(out),
        "data": job.data.model_copy(update={
            "train": str(folder / "data" / "train.jsonl"),
            "valid": str(folder / "data" / "valid.jsonl") if job.data.valid else None}),
        "telemetry": job.telemetry.model_copy(update={"phases": True}),   # feed memory.zarr
    })
    resume = spec.checkpoint_step is not None
    if resume:
        ckpt = private_dir(out / "checkpoints" / f"step-{spec.checkpoint_step:07d}")
        for name, blob in spec.checkpoint.items():
            private_file(ckpt / name, blob)
    private_file(folder / "job.json", job.model_dump_json().encode())

    # Tokenized data sets outlive the attempt: the node's next trial of the same
    # data and model reads them instead of tokenizing again (engine/data.py).
    started = start_worker([str(folder / "job.json")] + (["--resume"] if resume else [])
                           + ["--data-cache", str(private_dir(work / DATA_CACHE))]
                           + _ring_args(spec, folder), folder, running, python)
    if started is None:
        return _ended(folder, AttemptResult(attempt=spec.attempt, outcome="cancelled",
                                            message="cancelled"))
    proc, stderr, drain = started
    on_started(proc.pid, time.time())

    batch: list = []
    seq, last_flush = 0, time.monotonic()
    end = err = None
    peak = 0.0
    steps = 0

    def flush():
        nonlocal batch, last_flush
        if batch:
            send_events(batch)
            batch = []
        last_flush = time.monotonic()

    for raw in proc.stdout:
        try:
            event = json.loads(raw)
        except ValueError:
            continue  # not one of ours (a library printing to stdout)
        event["seq"] = _seq(seq, spec)
        seq += 1
        batch.append(event)
        kind = event.get("event")
        if kind == "step":
            peak = max(peak, event["peak_gb"])
            steps = event["step"]
        elif kind == "end":
            end = event
        elif kind == "error":
            err = event
        if kind == "checkpoint":
            # Telemetry up to the checkpoint first, then the checkpoint: a resume
            # elsewhere never restarts from a step whose rows the head lacks.
            flush()
            files = _checkpoint_files(Path(event["path"]))
            if files is not None:   # None: pruned by the engine already, a newer one follows
                send_checkpoint(event["step"], files)
        elif kind == "eval" or len(batch) >= FLUSH_ROWS or \
                time.monotonic() - last_flush >= spec.flush_s:
            # An eval goes at once: at an ASHA rung it decides whether the trial goes
            # on, and the attempt trains on (paying node time) until the head hears it.
            flush()
    code = proc.wait()
    ended = time.time()
    drain.join(timeout=DRAIN_S)
    flush()
    proc.stdin.close()

    result = dict(attempt=spec.attempt, exit_code=code, peak_gb=peak or None, steps=steps,
                  ended=ended)
    if running.cancelled:
        outcome, message = "cancelled", "cancelled"
    elif code == ev.EXIT_OK and end is not None and spec.rank > 0:
        outcome, message = "succeeded", ""   # rank 0 alone writes the adapter
    elif code == ev.EXIT_OK and end is not None:
        outcome, message = "succeeded", ""
        adapter = _read_files(out, ("adapters.safetensors", "adapter_config.json"))
        best = {}
        if end.get("best_adapter"):   # the best eval's adapter, beside the last in `out`
            best = {"adapters.safetensors": (out / Path(end["best_adapter"]).name).read_bytes(),
                    "adapter_config.json": adapter["adapter_config.json"]}
        # what leaves this node, by digest, in the attempt's own telemetry: the head's
        # copy (`segctl gather`) can be checked against it
        digest = lambda files: {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
        send_events([{"event": "adapter", "seq": _seq(seq, spec), "time": time.time(),
                      "sha256": digest(adapter), **({"best_sha256": digest(best)} if best else {})}])
        result.update(final_loss=end.get("final_loss"), val_loss=end.get("val_loss"),
                      adapter=adapter, best_adapter=best, best_step=end.get("best_step"),
                      best_val_loss=end.get("best_val_loss"))
    elif code == ev.EXIT_OOM:
        outcome, message = "oom", err["message"] if err else "memory budget crossed"
    elif code == ev.EXIT_BAD_INPUT:
        outcome, message = "failed", err["message"] if err else _last(stderr)
    elif code == ev.EXIT_RANK_LOST:   # a peer of its ring is gone: as a lost node, retried
        outcome, message = "node_lost", _last(stderr) or "a rank of the ring is gone"
    elif code == -signal.SIGALRM:   # engine/distributed.py: its ring did not form in time
        outcome = "node_lost"
        message = "the ring did not form in distributed.timeout_s: a rank never joined"
    elif code < 0 or code == 137:
        # Killed by a signal we did not send: the process is gone as if its machine were.
        outcome = "node_lost"
        message = f"engine process killed by signal {-code if code < 0 else 9}"
    else:
        outcome = "failed"
        message = (err["message"] if err else _last(stderr)) or f"engine exited with {code}"
    return _ended(folder, AttemptResult(outcome=outcome, message=message, **result))


def _ring_args(spec: AttemptSpec, folder: Path) -> list[str]:
    """The worker's arguments for one rank of a job on several nodes: its rank and
    MLX's hostfile (every rank's host:port), written in the attempt's folder; over
    JACCL also its device file (every rank's RDMA device to every other)."""
    if not spec.ring:
        return []
    private_file(folder / "hostfile.json", json.dumps([[a] for a in spec.ring]).encode())
    args = ["--ring", str(spec.rank), str(folder / "hostfile.json")]
    if spec.rdma:
        private_file(folder / "rdma.json", json.dumps(spec.rdma).encode())
        args += ["--rdma", str(folder / "rdma.json")]
    return args


def _seq(n: int, spec: AttemptSpec) -> int:
    """The head's number for this attempt's `n`th event: the ranks of a job on
    several nodes send theirs to one attempt, each its own residue mod the ranks
    (the head keys events by attempt and seq, and a re-sent batch is known by it)."""
    return n * max(len(spec.ring), 1) + spec.rank


def _ended(folder: Path, result: AttemptResult) -> AttemptResult:
    """The attempt's folder once its result is in hand: gone, or kept for debugging
    with how it ended (the newest KEEP_FAILED of them)."""
    if result.outcome in ("succeeded", "cancelled"):
        shutil.rmtree(folder, ignore_errors=True)
    else:
        _mark(folder, {"outcome": result.outcome, "message": result.message,
                       "exit_code": result.exit_code, "ended": result.ended or time.time()})
    prune_failed(folder.parent)
    return result


def abandoned(work: Path) -> None:
    """When an agent starts: folders of attempts or probes that no live agent runs
    (an agent that died left them, without a result) count as failed ones."""
    if work.is_dir():
        for folder in work.iterdir():
            if folder.name == DATA_CACHE:
                continue
            if folder.is_dir() and not (folder / OUTCOME_FILE).exists():
                _mark(folder, {"outcome": "abandoned", "message": "the agent that ran it is gone",
                               "ended": time.time()})
        prune_failed(work)


def prune_failed(work: Path, keep: int = KEEP_FAILED) -> None:
    """Only the newest `keep` kept folders (those with an outcome.json) stay."""
    kept = sorted(work.glob(f"*/{OUTCOME_FILE}"), key=lambda p: p.stat().st_mtime_ns)
    for mark in kept[:max(len(kept) - keep, 0)]:
        shutil.rmtree(mark.parent, ignore_errors=True)


def _mark(folder: Path, outcome: dict) -> None:
    if folder.is_dir():
        private_file(folder / OUTCOME_FILE, (json.dumps(outcome, indent=2) + "\n").encode())


def start_worker(args: list[str], cwd: Path, running: Running, python: str):
    """`python -m segctl.node.worker ARGS` in `cwd`, registered with `running` so a cancel
    reaches it: (process, its last stderr lines as they are read, the thread reading
    them); None when `running` was cancelled before it started.

    The process is a spare when one is ready (see `spares`): a fresh process all the
    same, only started before it was needed."""
    with running.lock:
        if running.cancelled:
            return None
        proc = spares.take(python, args, cwd) or _popen(python, args, cwd)
        running.proc = proc
    spares.refill(python)
    stderr: list[str] = []
    pipe = proc.stderr
    assert pipe is not None   # opened with a pipe
    drain = threading.Thread(target=lambda: stderr.extend(pipe.read().decode(
        "utf-8", "replace").splitlines()[-20:]), daemon=True)
    drain.start()
    return proc, stderr, drain


def _popen(python: str, args: list[str], cwd: Path | None) -> subprocess.Popen:
    # umask 077: what the engine writes (checkpoints, the adapter) is the user's alone
    return subprocess.Popen([python, "-m", "segctl.node.worker", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, umask=0o077,
                            env=engine_env())


def engine_env() -> dict[str, str]:
    """The agent's environment less Ray's credentials: the agent is a Ray worker,
    and Ray may hand its workers the fleet's token in their environment. The
    engine never talks to Ray, and a process's environment is readable by
    whoever can read its /proc entry."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}


class Spares:
    """Engine processes started ahead of their attempt. Importing MLX, mlx-lm and
    transformers takes seconds, paid before every attempt's first step; a spare
    (`worker --spare`) has done it while the node was busy and waits on stdin for
    its arguments. Each attempt still gets a process of its own, used once.

    SEGCTL_SPARE_WORKERS sets how many wait (default 1; 0: none). A spare that the
    agent leaves behind reads end-of-file on stdin and exits."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: list[tuple[tuple, subprocess.Popen]] = []

    def size(self) -> int:
        try:
            return max(0, int(os.environ.get("SEGCTL_SPARE_WORKERS", "1")))
        except ValueError:
            return 1

    def take(self, python: str, args: list[str], cwd: Path) -> subprocess.Popen | None:
        while True:
            with self.lock:
                found = next((i for i, (key, _) in enumerate(self.waiting)
                              if key == _key(python)), None)
                if found is None:
                    return None
                _, proc = self.waiting.pop(found)
            try:   # a spare that died since (killed, out of memory) is skipped
                if proc.poll() is None:
                    assert proc.stdin is not None   # a spare is opened with a pipe
                    proc.stdin.write((json.dumps({"args": args, "cwd": str(cwd)}) + "\n").encode())
                    proc.stdin.flush()
                    return proc
            except OSError:
                pass
            _reap(proc)

    def refill(self, python: str) -> None:
        with self.lock:
            self.waiting = [(key, p) for key, p in self.waiting if p.poll() is None]
            missing = self.size() - sum(key == _key(python) for key, _ in self.waiting)
            for _ in range(max(missing, 0)):
                self.waiting.append((_key(python), _popen(python, ["--spare"], None)))

    def close(self) -> None:
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for _, proc in waiting:
            _reap(proc)


def _key(python: str) -> tuple:
    """A spare serves an attempt of the same interpreter and environment only (the
    environment is the process's from its start)."""
    return python, tuple(sorted(engine_env().items()))


def _reap(proc: subprocess.Popen) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.close()      # end-of-file: a waiting spare exits by itself
        proc.wait(timeout=5)
    except Exception:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe:
            pipe.close()


spares = Spares()
atexit.register(spares.close)


def _checkpoint_files(folder: Path) -> dict[str, bytes] | None:
    """A checkpoint folder's files; None when the engine has pruned it already (it
    keeps its newest few, and the agent fell behind while the head was slow or out
    of reach), or pruned it while it was read."""
    try:
        files = _read_files(folder)
        if sorted(p.name for p in folder.iterdir()) == sorted(files):
            return files
    except FileNotFoundError:
        pass
    return None


def _read_files(folder: Path, names=None) -> dict[str, bytes]:
    names = names or sorted(p.name for p in folder.iterdir() if p.is_file())
    return {n: (folder / n).read_bytes() for n in names}


def _last(lines: list[str]) -> str:
    lines = [l for l in lines if l.strip()]
    return lines[-1] if lines else ""


