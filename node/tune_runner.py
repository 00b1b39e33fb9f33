"""Run a tune's probe points on this node: one fresh engine process
(`python -m segctl.node.worker --probe`) walks them, and each point's measurement goes to
the head the moment it exists, so a probe run that dies keeps what it measured.

No Ray here, as in node/attempt.py: the agent passes in how to reach the head.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Callable

from segctl.schemas.private import private_dir, private_file
from segctl.schemas.records import ProbeSpec

from .attempt import DRAIN_S, Running, _last, start_worker


def run_probes(spec: ProbeSpec, work: Path, *, send: Callable[[dict], None],
               model_dir: Callable[[str], str] = lambda path: path,
               running: Running | None = None, python: str = sys.executable) -> dict:
    """Returns {"measured": n, "error": message or ""}."""
    running = running or Running()
    folder = private_dir(work) / f"probe-{id(spec)}"
    shutil.rmtree(folder, ignore_errors=True)
    try:
        local = spec.model_copy(update={"model": model_dir(spec.model)})
    except Exception as e:   # refused by the head, or the fetch broke: the tune's error
        return {"measured": 0, "error": f"model {spec.model}: "
                                        f"{_last(str(e).splitlines()) or type(e).__name__}"}
    private_dir(folder)
    private_file(folder / "probe.json", local.model_dump_json().encode())
    started = start_worker(["--probe", str(folder / "probe.json")], folder, running, python)
    if started is None:
        shutil.rmtree(folder, ignore_errors=True)
        return {"measured": 0, "error": "cancelled"}
    proc, stderr, drain = started
    measured, error = 0, ""
    for raw in proc.stdout:
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        if event.get("event") == "probe":
            send(event)
            measured += 1
        elif event.get("event") == "error":
            error = event["message"]
    code = proc.wait()
    drain.join(timeout=DRAIN_S)
    proc.stdin.close()
    shutil.rmtree(folder, ignore_errors=True)
    if running.cancelled:
        error = "cancelled"
    elif code and not error:
        error = _last(stderr) or f"probe process exited with {code}"
    return {"measured": measured, "error": error}
