"""`segctl gather`: a sweep's adapters out of the stores, one mlx-lm adapter folder
per trial plus a manifest, ready for `mlx_lm.load(model, adapter_path=OUT/<trial>)`.
Each trial's folder holds its best eval's adapter where the stores have one (it had
a validation set), else its last; the manifest says which, and from which step.

The whole folder is built next to `out` and renamed into place at the end, so a
crash or an error leaves either nothing or the finished folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

from segctl.schemas.atomic import fsync_dir
from segctl.schemas.states import TrialState

from .stores import Stores


def gather(stores: Stores, trials: list[dict], out: Path, best: int | None = None,
           metric: str = "val_loss") -> Path:
    """Export the SUCCEEDED trials that have an adapter (the `best` K by `metric`,
    lowest first, when given). `trials`: [{trial, state, params, metrics}].
    Returns `out`; raises ValueError (one line) when `out` is not new or empty, or
    when no trial qualifies."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not empty (gather writes a new folder)")
    chosen = pick(stores, trials, best, metric)
    if not chosen:
        raise ValueError("no succeeded trial with an adapter in the stores to gather")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.gather-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        manifest = []
        for t in chosen:
            folder = tmp / t["trial"]
            folder.mkdir()
            kind, info = exported(stores, t["trial"])
            files = stores.adapter_files(t["trial"], kind)
            for name, blob in files.items():
                _write(folder / name, blob)
            fsync_dir(folder)
            metrics = dict(t.get("metrics") or {})
            if kind == "best":
                metrics["best_val_loss"] = info["val_loss"]
            manifest.append({"trial": t["trial"], "params": t.get("params") or {},
                             "metrics": metrics, "adapter": kind, "step": info["step"],
                             "files": {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}})
        _write(tmp / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
        fsync_dir(tmp)   # every entry in place before the folder is renamed in
        os.replace(tmp, out)   # an empty `out` is replaced; a non-empty one was refused above
        fsync_dir(out.parent)  # the rename itself survives a power cut
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def pick(stores: Stores, trials: list[dict], best: int | None, metric: str) -> list[dict]:
    """The trials to export: succeeded, with an adapter; ranked by `metric` (missing
    or not a number sorts last; val_loss is the best eval's where the trial's best
    adapter is exported) and cut to `best` when given, else in the order given."""
    ok = [t for t in trials
          if t.get("state") == TrialState.SUCCEEDED and stores.has_adapter(t["trial"])]
    if best is None:
        return ok

    def key(t):
        v = (t.get("metrics") or {}).get(metric)
        # the adapters' metadata is read only where a best one may change the value:
        # a sweep has thousands of trials, and that is a file or two each
        if metric == "val_loss" and stores.has_adapter(t["trial"], "best"):
            kind, info = exported(stores, t["trial"])
            if kind == "best" and info["val_loss"] is not None:
                v = info["val_loss"]
        missing = not isinstance(v, (int, float)) or math.isnan(v)
        return (missing, 0.0 if missing else v)
    return sorted(ok, key=key)[:best]


def exported(stores: Stores, trial: str) -> tuple[str, dict]:
    """Which of the trial's adapters gather exports ("best" or "last") and its
    {attempt, step, val_loss}: the best eval's when the stores have one from the
    same attempt as the last (an older attempt's, left by a run that failed after
    it was stored, is not this trial's result)."""
    last = stores.adapter_info(trial)
    best = stores.adapter_info(trial, "best")
    if best is not None and last is not None and best["attempt"] == last["attempt"]:
        return "best", best
    return "last", last


def _write(path: Path, blob: bytes) -> None:
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
