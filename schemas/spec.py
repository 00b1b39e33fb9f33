"""Which kind of spec a YAML file is, and its loader: `segctl validate FILE`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from .cluster import load_cluster
from .job import load_job
from .sweep import load_sweep
from .yamlspec import load_yaml

Kind = Literal["job", "sweep", "cluster"]


def spec_kind(data: dict) -> Kind:
    """From the top-level keys: a cluster has nodes or head; a sweep has base,
    job, grid or random; anything else is read as a job."""
    keys = set(data) if isinstance(data, dict) else set()
    if keys & {"nodes", "head"}:
        return "cluster"
    if keys & {"base", "job", "grid", "random"}:
        return "sweep"
    return "job"


def load_spec(path: str | Path) -> tuple[Kind, object]:
    """(kind, validated spec): a JobSpec, a Sweep or a ClusterSpec. Raises
    SpecError with every problem."""
    data, _ = load_yaml(path)
    kind = spec_kind(data)
    loader = {"job": load_job, "sweep": load_sweep, "cluster": load_cluster}[kind]
    return kind, loader(path)
