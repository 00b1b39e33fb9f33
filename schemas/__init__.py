"""The vocabulary every package imports: specs, telemetry records, their validation.

Pure data: no Ray, no MLX. The specs (pydantic) load on first use, so that the
engine's own imports (schemas.limits) run where only MLX is installed, as the
benchmarks do on a GPU machine.
"""

from .errors import SpecError

__all__ = ["SpecError", "JobSpec", "load_job"]


def __getattr__(name):
    if name in ("JobSpec", "load_job"):
        from . import job
        return getattr(job, name)
    raise AttributeError(f"module 'schemas' has no attribute {name!r}")
