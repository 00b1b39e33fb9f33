"""From a validated sweep to what the head needs: per trial the resolved job, the
model's planner facts, the longest row, and the data files as bytes (the head and
the nodes share no file system with the machine that submits)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from segctl.schemas.cluster import DEFAULT_MARGIN, DEFAULT_SCALE
from segctl.schemas.records import NodeInfo
from segctl.schemas.sweep import Sweep

from . import planner


def prepare(sweep: Sweep, knobs: dict) -> dict:
    """The submit payload (see head.Controller.submit). Raises ValueError /
    engine DataError with one line for a model or data file it cannot use."""
    infos: dict[str, dict] = {}
    longest: dict[tuple, int] = {}
    blobs: dict[str, bytes] = {}
    trials = []
    for t in sweep.trials:
        job = t.job
        if job.model not in infos:
            infos[job.model] = planner.model_info(job.model).to_dict()
        d = job.data
        key = (job.model, d.train, d.valid, d.max_seq_length, d.overlong, d.mask_prompt)
        if key not in longest:
            longest[key] = planner.longest_row(job)
        inputs = {}
        for name, path in (("train.jsonl", d.train), ("valid.jsonl", d.valid)):
            if path:
                blob = Path(path).read_bytes()
                sha = hashlib.sha256(blob).hexdigest()
                blobs[sha] = blob
                inputs[name] = sha
        trials.append(dict(index=t.index, name=t.name, params=t.params,
                           job=job.model_dump(mode="json"), model_info=infos[job.model],
                           seq_len=longest[key], inputs=inputs))
    spec = sweep.spec.model_dump(mode="json")
    spec["planner"] = knobs
    return dict(name=sweep.spec.name, path=sweep.path, spec=spec, trials=trials, blobs=blobs)


def plan_rows(payload: dict, nodes: list[NodeInfo], root: Path | None = None) -> list[dict]:
    """`segctl plan`: per trial and node class, the segment size and predicted peak,
    from the plan table's measured model where `segctl tune` made one (stores
    under `root`), else the analytic estimate."""
    from segctl.schemas.job import JobSpec

    from . import measured
    fitted: dict[str, dict] = {}
    classes = {}
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
            key = planner.model_key(info)
            if key not in fitted:
                fitted[key] = measured.models_of(measured.read_plan(root, key)) if root else {}
            p = planner.plan(info, job, seq_len=t["seq_len"], budget_gb=n.memory_gb,
                             margin=knobs.get("margin", DEFAULT_MARGIN),
                             scale=knobs.get("scale", DEFAULT_SCALE),
                             measured=fitted[key].get(planner.tune_key(job, cls)))
            per[cls] = {"fits": p.fits, "segment_size": p.segment_size,
                        "predicted_gb": round(p.predicted_gb, 4), "source": p.source,
                        "reason": p.reason}
        rows.append({"trial": t["name"], "params": t["params"], "seq_len": t["seq_len"],
                     "classes": per})
    return rows
