"""A job's memory settings resolved against a node: the one path `segctl train`,
`segctl plan` and the head's placement all take.

    YAML memory.segment_size / offload (int | auto, none | disk | auto)
      -> plan_for: the planner on the node's budget, from the measured model that
         `segctl tune` fitted for this model, method and node class (Tuned), else
         the analytic estimate
      -> resolved: the job with the plan's segment size and offload written in
         (and the budget the node lends it), ready for the engine

The planner (planner.py) stays pure: it is handed the measured model. Tuned reads
the plan table of a stores root once per model and keeps it; the head drops a
model's entry when a tune of it ends (`forget`), so the next plan reads the new
measurements.
"""

from __future__ import annotations

from pathlib import Path

from segctl.schemas.defaults import DEFAULT_MARGIN, DEFAULT_SCALE
from segctl.schemas.job import JobSpec

from . import measured, planner


class Tuned:
    """The measured memory models of the plan table under a stores root (none
    without one), read once per model."""

    def __init__(self, root: Path | None):
        self.root = root
        self.fitted: dict[str, dict] = {}   # model key -> {measured.match_key: MemoryModel}

    def model_for(self, info: planner.ModelInfo, job: JobSpec, node_class: str):
        """The fitted model for `job` on `node_class`, or None where none was measured."""
        key = planner.model_key(info)
        if key not in self.fitted:
            self.fitted[key] = (measured.models_of(measured.read_plan(self.root, key))
                                if self.root is not None else {})
        return self.fitted[key].get(planner.tune_key(job, node_class))

    def forget(self, model_key: str) -> None:
        self.fitted.pop(model_key, None)


def plan_for(tuned: Tuned, info: planner.ModelInfo, job: JobSpec, *, seq_len: int,
             node_class: str, budget_gb: float, knobs: dict | None = None,
             below: int | None = None) -> planner.Plan:
    """The plan for `job` on a node of `node_class` lending `budget_gb`: `knobs` the
    cluster's planner margin and scale (defaults where absent), `below` the bound an
    out-of-memory attempt left (only sizes below it)."""
    knobs = knobs or {}
    return planner.plan(info, job, seq_len=seq_len, budget_gb=budget_gb,
                        margin=knobs.get("margin", DEFAULT_MARGIN),
                        scale=knobs.get("scale", DEFAULT_SCALE), below=below,
                        measured=tuned.model_for(info, job, node_class))


def resolved(job: JobSpec, plan: planner.Plan, budget_gb: float | None = None) -> JobSpec:
    """`job` with the plan's segment size and offload (and, given, the budget its
    node lends it) in place of `auto`: what the engine runs."""
    update: dict = {"segment_size": plan.segment_size,
                    "offload": "disk" if plan.offload else "none"}
    if budget_gb is not None:
        update["budget_gb"] = budget_gb
    return job.model_copy(update={"memory": job.memory.model_copy(update=update)})
