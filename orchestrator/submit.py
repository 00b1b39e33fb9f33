"""From a validated sweep to what the head needs: per trial the resolved job, the
model's planner facts, the longest row, and the data files as bytes (the head and
the nodes share no file system with the machine that submits)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from segctl.schemas.records import NodeInfo
from segctl.schemas.sweep import Sweep

from . import planner
from .memory_settings import Tuned, plan_for


def prepare(sweep: Sweep, knobs: dict, tokens: dict | None = None) -> dict:
    """The submit payload (see head.Controller.submit). A trial's seq_len is its
    step_tokens: the longest sequence a step puts through the layers, packed where
    the job packs. `tokens` (a dict), when given, gets trial name -> a function of
    a batch size giving that trial's step_tokens at it (`segctl plan`'s largest
    batch that fits; the data are not read again). Raises ValueError / engine
    DataError with one line for a model or data file it cannot use."""
    infos: dict[str, dict] = {}
    packable: dict[str, bool] = {}
    lengths: dict[tuple, planner.RowLengths] = {}
    blobs: dict[str, bytes] = {}
    trials = []
    for t in sweep.trials:
        job = t.job
        if job.model not in infos:
            infos[job.model] = planner.model_info(job.model).to_dict()
            packable[job.model] = planner.family_packs(job.model)
        d = job.data
        # what the rows' lengths depend on (a sweep may vary any of it): the
        # method and prefix_shared decide how a preference row's streams run
        key = (job.model, d.train, d.valid, d.max_seq_length, d.overlong, d.mask_prompt,
               job.method, job.prefix_shared)
        if key not in lengths:
            lengths[key] = planner.row_lengths(job)   # the data read once per key
        step = functools.partial(planner.step_tokens, job, lengths[key],
                                 packable=packable[job.model])
        if tokens is not None:
            tokens[t.name] = lambda b, step=step: step(batch_size=b)
        inputs = {}
        for name, path in (("train.jsonl", d.train), ("valid.jsonl", d.valid)):
            if path:
                blob = Path(path).read_bytes()
                sha = hashlib.sha256(blob).hexdigest()
                blobs[sha] = blob
                inputs[name] = sha
        trials.append(dict(index=t.index, name=t.name, params=t.params,
                           job=job.model_dump(mode="json"), model_info=infos[job.model],
                           seq_len=step(), inputs=inputs))
    spec = sweep.spec.model_dump(mode="json")
    spec["planner"] = knobs
    return dict(name=sweep.spec.name, path=sweep.path, spec=spec, trials=trials, blobs=blobs)


def plan_rows(payload: dict, nodes: list[NodeInfo], root: Path | None = None,
              tokens: dict | None = None) -> list[dict]:
    """`segctl plan`: per trial and node class, the segment size and predicted peak,
    from the plan table's measured model where `segctl tune` made one (stores
    under `root`), else the analytic estimate. `tokens` (prepare's): where a
    batch does not fit, the reason names the largest batch that would."""
    from segctl.schemas.job import JobSpec

    tuned = Tuned(root)
    classes: dict = {}
    for n in nodes:
        classes.setdefault(n.node_class, n)
    knobs = payload["spec"].get("planner") or {}
    placement = payload["spec"].get("placement") or {}
    rows = []
    for t in payload["trials"]:
        job = JobSpec.model_validate(t["job"])
        info = planner.ModelInfo.from_dict(t["model_info"])
        per = {}
        for cls, n in classes.items():
            if not n.matches(placement):
                per[cls] = {"fits": False, "reason": "placement excludes it"}
                continue
            at = lambda seq_len: plan_for(tuned, info, job, seq_len=seq_len, node_class=cls,
                                          budget_gb=n.memory_gb, knobs=knobs)
            p = at(t["seq_len"])
            reason = p.reason
            if not p.fits and tokens and t["name"] in tokens and job.train.batch_size > 1:
                b = largest_batch(job.train.batch_size, tokens[t["name"]], lambda L: at(L).fits)
                if b:
                    reason += (f"; the largest batch that fits is {b} rows "
                               f"(train.batch_size: {b}, or raise train.grad_accumulation)")
            per[cls] = {"fits": p.fits, "segment_size": p.segment_size,
                        "predicted_gb": round(p.predicted_gb, 4), "source": p.source,
                        "reason": reason}
        rows.append({"trial": t["name"], "params": t["params"], "seq_len": t["seq_len"],
                     "classes": per})
    return rows


def largest_batch(batch_size: int, tokens, fits) -> int | None:
    """The largest b < batch_size whose step (`tokens(b)` tokens, packed) `fits`,
    or None: where not even b = 1 fits, or the batch's rows do not pack (every b
    gives the step of batch_size, which does not fit). A longer sequence never
    needs less memory (predict_gb counts the worst length up to it), so fitting
    holds for every b up to some size: found by bisection, a plan at each of
    log2(batch_size) lengths."""
    full = tokens(batch_size)
    lo, hi = 0, batch_size   # fits(tokens(lo)) (lo = 0: none yet); not fits(tokens(hi))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        L = tokens(mid)
        if L < full and fits(L):
            lo = mid
        else:
            hi = mid
    return lo or None
