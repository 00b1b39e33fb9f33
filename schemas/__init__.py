"""The vocabulary every package imports: specs, telemetry records, their validation.

Pure data: no Ray, no MLX.
"""

from .errors import SpecError
from .job import JobSpec, load_job

__all__ = ["SpecError", "JobSpec", "load_job"]
