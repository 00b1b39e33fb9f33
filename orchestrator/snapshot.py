"""What the head's policies read: typed records of state.db's rows (decoded once,
in state.py: `trial_of`, `attempt_of`) and of what the controller holds in a turn.
Frozen plain values, no Ray, no SQLite: a policy's test builds them by hand.

The policies (placement.py, outcomes.py, asha.py, probing.py) are functions from
these records, and the clock's `now` where one needs it, to decisions; the
controller (head.py) reads the records, calls the policy and applies what it
decides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from segctl.schemas.states import Outcome, TrialState


@dataclass(frozen=True)
class Sweep:
    """A running sweep as a placement turn schedules it: what the head schedules by,
    and the cluster's planner knobs it was submitted under."""
    id: str
    priority: int = 0
    share: float = 1.0
    concurrency: Optional[int] = None
    retries: int = 3
    placement: Mapping[str, str] = field(default_factory=dict)
    planner: Mapping[str, float] = field(default_factory=dict)   # margin, scale
    created: float = 0.0


@dataclass(frozen=True)
class Trial:
    """A trial as the controller plans, places and ends it."""
    id: str
    sweep: str
    state: TrialState
    job: dict = field(default_factory=dict)          # its JobSpec as JSON
    model_info: dict = field(default_factory=dict)   # planner.ModelInfo as a dict
    seq_len: int = 1
    inputs: dict = field(default_factory=dict)       # data file name -> sha256
    max_segment: Optional[int] = None   # after an oom: only sizes below this
    excluded: tuple[str, ...] = ()      # nodes where it ran out of memory at segment_size 1
    runnable_since: float = 0.0

    @property
    def own_budget_gb(self) -> Optional[float]:
        """The job's own `memory.budget_gb`, if it set one."""
        return (self.job.get("memory") or {}).get("budget_gb")

    @property
    def nodes(self) -> int:
        """The nodes it trains on at once (`distributed.nodes`)."""
        return (self.job.get("distributed") or {}).get("nodes", 1)

    @property
    def over_rdma(self) -> bool:
        """Whether its ranks talk over RDMA (`distributed.backend: jaccl`): the nodes
        it takes must be cabled to each other."""
        return (self.job.get("distributed") or {}).get("backend") == "jaccl"

    @property
    def min_nodes(self) -> int:
        """The fewest nodes a retry may go on (`distributed.min_nodes`, else `nodes`)."""
        return (self.job.get("distributed") or {}).get("min_nodes") or self.nodes


@dataclass(frozen=True)
class Attempt:
    """One attempt of a trial, as far as a decision about its trial needs it."""
    id: int
    trial: str
    sweep: str
    node: str
    segment_size: int
    budget_gb: Optional[float] = None   # what it was lent (its guard)
    outcome: Optional[Outcome | str] = None   # None while it runs


Held = Mapping[str, Mapping[object, float]]   # node -> {attempt (or "tune:ID"): GB it holds}
