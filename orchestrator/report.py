"""A sweep read back from the head's stores, for people: the progress that
`segctl status --watch` shows, and everything `segctl report` draws.

Reads only (state.db read-only; telemetry Parquet, memory.zarr and adapters.zarr
as files; staging.db for attempts still running), so both work from any shell on
the head's machine whether or not the head runs. Each function returns plain
dicts (JSON-ready); views.py and report_page.py turn them into a terminal frame
and an HTML page.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import zarr
from zarr.storage import LocalStore

from segctl.orchestrator import state as st
from segctl.orchestrator.gather import checked_entry, pick, read_gathered
from segctl.orchestrator.stores import Stores, phase_peaks
from segctl.schemas import store_rows as sr
from segctl.schemas.records import TERMINAL, AttemptStatus, SweepState, TrialState

RATE_STEPS = 20       # a running trial's step rate is taken over its last this many steps
MAX_POINTS = 600      # loss points per trial in the report (longer runs: bucket means)
MAX_MEMORY_ROWS = 200  # memory rows per attempt in the report (longer runs: bucket maxima)


def open_db(root: Path) -> st.State:
    """state.db read-only; FileNotFoundError (one line) when nothing was submitted."""
    return st.read(Path(root) / "state.db")


# ==================================================================== status --watch

def new_memo() -> dict:
    """What a watch keeps between snapshots: per attempt the events read so far (the
    last seq and the recent (time, step) pairs), per trial its planned steps."""
    return {"seq": {}, "recent": {}, "total": {}, "iters": {}}


def progress(db: st.State, stores: Stores, sweep: str | None, memo: dict,
             now: float | None = None) -> list[dict]:
    """Per sweep (all, or `sweep`): its trials' step of their steps, loss, recent
    step rate and time left, and the sweep's totals. `memo` (new_memo()) carries
    what was read before, so each call reads only new events."""
    now = time.time() if now is None else now
    out = []
    for sw in db.status(sweep):
        trials = [_trial_progress(db, stores, sw, t, memo) for t in sw["trials"]]
        counts: dict[str, int] = {}
        for t in trials:
            counts[t["state"]] = counts.get(t["state"], 0) + 1
        known = [t for t in trials if t["iters"]]
        done = sum(t["iters"] if _finished(t["state"]) else min(t["step"] or 0, t["iters"])
                   for t in known)
        total = sum(t["iters"] for t in known)
        rate = sum(t["rate"] or 0.0 for t in trials if t["state"] == TrialState.RUNNING)
        left = total - done
        eta = (left / rate if rate > 0 else None) if sw["state"] == SweepState.RUNNING else None
        out.append(dict(sweep=sw["sweep"], state=sw["state"], created=sw["created"],
                        ended=sw["ended"], time=now, trials=trials,
                        totals=dict(trials=len(trials), states=counts, steps=done,
                                    total_steps=total, rate=round(rate, 4) if rate else None,
                                    eta_s=None if eta is None else round(eta, 1),
                                    best_val_loss=_min(t["val_loss"] for t in trials))))
    return out


def _trial_progress(db, stores, sw, t, memo) -> dict:
    a = t["attempts"][-1] if t["attempts"] else None
    iters = memo["iters"].get(t["trial"])
    if t["trial"] not in memo["iters"]:
        job = json.loads(db.trial(t["trial"])["job"])
        iters = memo["iters"][t["trial"]] = (job.get("train") or {}).get("iters")
    rate = eta = None
    if a is not None and a["status"] != AttemptStatus.ENDED:
        rate = _read_rate(stores, a["attempt"], memo)
        iters = memo["total"].get(a["attempt"]) or iters   # the engine's own count (epochs)
    step = a["step"] if a else None
    if rate and iters and step is not None:
        eta = max(iters - step, 0) / rate
    return dict(trial=t["trial"], short=short_name(sw["sweep"], t["trial"]), state=t["state"],
                node=a["node"] if a else None, segment_size=a["segment_size"] if a else None,
                step=step, iters=iters, loss=a["loss"] if a else None, val_loss=t["val_loss"],
                peak_gb=a["peak_gb"] if a else None,
                rate=None if rate is None else round(rate, 4),
                eta_s=None if eta is None else round(eta, 1),
                attempts=[x["outcome"] or x["status"] for x in t["attempts"]],
                params=t["params"], message=t["message"])


def _read_rate(stores: Stores, aid: int, memo: dict) -> float | None:
    """Steps per second over the attempt's last RATE_STEPS steps, from its events."""
    recent = memo["recent"].setdefault(aid, deque(maxlen=RATE_STEPS))
    for e in stores.events(aid, memo["seq"].get(aid, -1)):
        memo["seq"][aid] = e["seq"]
        if e.get("event") == "step":
            recent.append((e["time"], e["step"]))
        elif e.get("event") == "start" and e.get("total_steps"):
            memo["total"][aid] = e["total_steps"]
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return None
    return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])


def _finished(state: str) -> bool:
    return TrialState(state) in TERMINAL


def short_name(sweep: str, trial: str) -> str:
    return trial[len(sweep) + 1:] if trial.startswith(sweep + "-") else trial


def _min(values):
    vals = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return min(vals) if vals else None


# ==================================================================== report

def collect(root: Path, sweep: str, *, gathered: Path | None = None, best: int = 5) -> dict:
    """Everything the report shows about `sweep`, as JSON-ready data: per trial its
    parameters, loss and val_loss curves, attempts (node, segment size, predicted peak,
    budget, outcome, times) and per-phase memory; the best adapters (from
    `gathered`/manifest.json when given, else ranked as `segctl gather --best` ranks
    them). KeyError: no such sweep; ValueError: an unreadable manifest; gather.Mismatch:
    an adapter (in the stores or in `gathered`) that is not what its node sent."""
    root = Path(root)
    db = open_db(root)
    try:
        [sw] = db.status(sweep)
        spec = json.loads(db.sweep(sweep)["spec"])
        stores = Stores(root)
        curves = _curves(root, stores, sweep, db)
        trials = []
        for t in sw["trials"]:
            attempts = [_attempt(dict(a)) for a in db.attempts(t["trial"])]
            c = curves.get(t["trial"], {"steps": {}, "evals": {}})
            loss = _merge(c["steps"], MAX_POINTS)
            evals = _merge(c["evals"], None)
            trials.append(dict(
                trial=t["trial"], short=short_name(sweep, t["trial"]), state=t["state"],
                message=t["message"], params=t["params"], final_loss=t["final_loss"],
                val_loss=t["val_loss"], best_val_loss=_min(v for _, v in evals),
                steps=max([s for s, _ in loss] + [a["steps"] or 0 for a in attempts] or [0]),
                loss=loss, evals=evals, attempts=attempts,
                memory=[m for a in attempts
                        if (m := _memory(root, stores, sweep, t["trial"], a)) is not None]))
        best_of = _best(stores, sw, gathered, best)
    finally:
        db.close()
    params = []
    for t in trials:
        params += [k for k in t["params"] if k not in params]
    nodes: dict[str, dict] = {}
    for t in trials:
        for a in t["attempts"]:
            n = nodes.setdefault(a["node"], {"node": a["node"], "chip": a["chip"], "attempts": 0})
            n["attempts"] += 1
            n["budget_gb"] = a["budget_gb"]
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["state"]] = counts.get(t["state"], 0) + 1
    return dict(sweep=dict(id=sw["sweep"], name=sw["name"], state=sw["state"],
                           created=sw["created"], ended=sw["ended"],
                           scheduler=spec.get("scheduler"), concurrency=spec.get("concurrency"),
                           retries=spec.get("retries")),
                generated=time.time(), params=params, states=counts,
                nodes=sorted(nodes.values(), key=lambda n: n["node"]),
                trials=trials, best=best_of)


_ATTEMPT_KEYS = ("attempt_no", "node", "chip", "segment_size", "predicted_gb", "budget_gb",
                 "resume_step", "status", "outcome", "message", "placed", "started", "ended",
                 "step", "peak_gb", "final_loss", "val_loss")


def _attempt(a: dict) -> dict:
    return dict({k: a[k] for k in _ATTEMPT_KEYS}, attempt=a["id"], steps=a["step"])


def _curves(root: Path, stores: Stores, sweep: str, db: st.State) -> dict:
    """trial -> {"steps": {attempt: [(step, loss)]}, "evals": {attempt: [(step, val_loss)]}}:
    sealed attempts from the Parquet tables, the others from their staged events."""
    out: dict = {}

    def add(kind, trial, attempt, step, value):
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            out.setdefault(trial, {"steps": {}, "evals": {}})[kind].setdefault(
                attempt, []).append((int(step), float(value)))

    # the unsealed first: one sealed meanwhile is read twice (the same rows), never missed
    unsealed = [(t["id"], a["id"]) for t in db.trials(sweep) for a in db.attempts(t["id"])
                if not stores.is_sealed(a["id"])]
    for table, column in (("steps", "loss"), ("evals", "val_loss")):
        for r in _table(root, table, sweep, ["trial", "attempt", "step", column]):
            add(table, r["trial"], r["attempt"], r["step"], r[column])
    for trial, aid in unsealed:
        for e in stores.events(aid):
            if e.get("event") == "step":
                add("steps", trial, aid, e["step"], e.get("loss"))
            elif e.get("event") == "eval":
                add("evals", trial, aid, e["step"], e.get("val_loss"))
    return out


def _table(root: Path, name: str, sweep: str, columns: list[str]) -> list[dict]:
    """Rows of one telemetry dataset for one sweep (none when it has no files yet)."""
    folder = root / sr.TELEMETRY / name / f"sweep={sweep}"
    files = sorted(str(p) for p in folder.glob("*.parquet")) if folder.is_dir() else []
    if not files:
        return []
    return ds.dataset(files, schema=sr.TABLES[name], format="parquet").to_table(
        columns=columns).to_pylist()


def _merge(by_attempt: dict[int, list], limit: int | None) -> list[list]:
    """One curve from a trial's attempts: a step a later attempt ran again (a resume
    from a checkpoint) is the later attempt's. Cut to about `limit` points by
    averaging buckets of consecutive steps."""
    points: dict[int, float] = {}
    for aid in sorted(by_attempt):
        for step, v in by_attempt[aid]:
            points[step] = v
    pts = sorted(points.items())
    if limit and len(pts) > limit:
        k = math.ceil(len(pts) / limit)
        pts = [(pts[min(i + k, len(pts)) - 1][0], sum(v for _, v in pts[i:i + k]) / len(pts[i:i + k]))
               for i in range(0, len(pts), k)]
    return [[s, round(v, 6)] for s, v in pts]


def _memory(root: Path, stores: Stores, sweep: str, trial: str, a: dict) -> dict | None:
    """An attempt's per-phase peaks by step (memory.zarr once sealed, else from its
    staged phase events), cut to MAX_MEMORY_ROWS rows of bucket maxima."""
    path = root / sr.memory_array(sweep, trial, a["attempt"])
    if (path / "zarr.json").is_file():
        arr = zarr.open_array(store=LocalStore(path, read_only=True), mode="r")
        peaks, labels, steps = arr[...], list(arr.attrs["phases"]), list(arr.attrs["steps"])
    else:
        peaks, labels, steps = phase_peaks(stores.events(a["attempt"]))
    if not labels or not len(steps):
        return None
    peaks = np.asarray(peaks, dtype=np.float64)
    if len(steps) > MAX_MEMORY_ROWS:
        k = math.ceil(len(steps) / MAX_MEMORY_ROWS)
        idx = list(range(0, len(steps), k))
        with np.errstate(all="ignore"):
            peaks = np.stack([np.nanmax(peaks[i:i + k], axis=0) for i in idx])
        steps = [steps[min(i + k, len(steps)) - 1] for i in idx]
    rows = [[None if math.isnan(v) else round(float(v), 6) for v in row] for row in peaks]
    return dict(attempt=a["attempt"], attempt_no=a["attempt_no"], node=a["node"],
                segment_size=a["segment_size"], predicted_gb=a["predicted_gb"],
                budget_gb=a["budget_gb"], outcome=a["outcome"], phases=labels,
                steps=[int(s) for s in steps], peaks=rows)


def _best(stores: Stores, sw: dict, gathered: Path | None, k: int) -> dict:
    """The best adapters: what `segctl gather` wrote to `gathered` (its manifest, every
    file checked against it and against its node's sha256), or the K it would export
    with --best K --metric val_loss, each as its manifest entry (checked the same way:
    a damaged store is refused here as gather refuses it)."""
    if gathered is not None:
        entries = read_gathered(stores, Path(gathered))
        return dict(source="manifest", path=str(Path(gathered) / "manifest.json"),
                    entries=entries)
    trials = [{"trial": t["trial"], "state": t["state"], "params": t["params"],
               "metrics": {"val_loss": t["val_loss"], "final_loss": t["final_loss"]}}
              for t in sw["trials"]]
    entries = [checked_entry(stores, t)[0] for t in pick(stores, trials, k, "val_loss")]
    return dict(source="ranking", path=None, entries=entries)


def render(data: dict) -> str:
    """The report as one self-contained HTML page (no network: CSS, script and data inline)."""
    from .report_page import page
    return page(data)
