"""One attempt of a trial, in a fresh process: `python -m segctl.node.worker JOB.json [--resume]
[--data-cache DIR] [--ring RANK HOSTFILE [--rdma DEVICES]]`;
or the probe points of a tune: `python -m segctl.node.worker --probe SPEC.json`;
or a spare, `python -m segctl.node.worker --spare`, which imports the engine first
and then reads one line from stdin, {"args": [...], "cwd": DIR}, and runs as above.

The node agent starts one of these per attempt so no MLX state (allocator, compiled
graphs, peak counters) leaks from one trial into the next. Events go to stdout as
JSON lines; the exit code says how it ended (schemas/events.py).

The agent holds our stdin open. If the agent dies (its Ray worker or the whole
node goes away), stdin reaches EOF and we exit at once instead of training on as
an orphan nobody listens to.
"""

from __future__ import annotations

import json
import os
import sys
import threading


def _exit_when_parent_goes() -> None:
    def watch():
        try:
            while sys.stdin.buffer.read(1 << 16):
                pass
        except Exception:
            pass
        os._exit(137)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    if argv == ["--spare"]:
        spare = _wait_as_spare()
        if spare is None:
            return 0
        argv = spare
    _exit_when_parent_goes()
    from segctl.engine import telemetry
    from segctl.engine.train import run_reported
    from segctl.schemas.job import JobSpec

    if argv[0] == "--probe":
        return _probe(argv[1])
    path, resume = argv[0], "--resume" in argv[1:]
    cache = argv[argv.index("--data-cache") + 1] if "--data-cache" in argv[1:] else None
    if "--ring" in argv[1:]:   # one rank of a job on several nodes: MLX's own variables,
        # set here, not in the process's environment, so a spare started earlier serves too
        from segctl.engine.distributed import ring_environ
        at = argv.index("--ring")
        rdma = argv[argv.index("--rdma") + 1] if "--rdma" in argv[1:] else None
        os.environ.update(ring_environ(int(argv[at + 1]), argv[at + 2], rdma))
    with open(path, encoding="utf-8") as f:
        job = JobSpec.model_validate(json.load(f))
    code, message = run_reported(job, resume=resume, emit=telemetry.json_lines(sys.stdout),
                                 debug=bool(os.environ.get("SEGCTL_DEBUG")), data_cache=cache)
    if code:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    return code


def _wait_as_spare() -> list[str] | None:
    """Import what every attempt imports, then wait for the arguments; None when
    the agent goes away first (end-of-file)."""
    import segctl.engine.measure  # noqa: F401  (mlx, mlx-lm, transformers: the slow part)
    import segctl.engine.train  # noqa: F401
    import segctl.schemas.job  # noqa: F401
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return None
    order = json.loads(line)
    os.chdir(order["cwd"])
    return list(order["args"])


def _probe(path: str) -> int:
    import time

    from segctl.engine import telemetry
    from segctl.engine.measure import run_probes
    from segctl.engine.model import ModelError
    from segctl.schemas import events as ev
    from segctl.schemas.records import ProbeSpec

    emit = telemetry.json_lines(sys.stdout)
    with open(path, encoding="utf-8") as f:
        spec = ProbeSpec.model_validate(json.load(f))
    try:
        run_probes(spec, emit, time.time)
    except ModelError as e:
        emit(ev.Error(time=time.time(), kind="model", message=str(e)))
        return ev.EXIT_BAD_INPUT
    except Exception as e:  # a bug of ours: one line, the trace only when debugging
        if os.environ.get("SEGCTL_DEBUG"):
            import traceback
            traceback.print_exc()
        emit(ev.Error(time=time.time(), kind="internal",
                      message=f"internal error: {type(e).__name__}: {e}"))
        return ev.EXIT_INTERNAL
    return ev.EXIT_OK


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: interpreter shutdown aborts while the watcher thread holds stdin.
    os._exit(code)
