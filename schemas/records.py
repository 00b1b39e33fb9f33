"""What the fleet records and passes around: trial states, attempt outcomes, the
plan of an attempt, and the messages between the head and a node agent.

The state machine (docs/design.md):

    PENDING -> PLACED -> RUNNING -> SUCCEEDED
                             |-> OOM        -> PENDING (smaller segment size)
                             |-> NODE_LOST  -> PENDING (resume from checkpoint)
                             |-> FAILED     (bad data, bad model, retries spent)
    any non-terminal -> CANCELLED
    any non-terminal -> STOPPED  (the sweep's asha scheduler: worse than the top at a rung)

An attempt is PLACED -> RUNNING -> ENDED (or PLACED -> ENDED when it never
started), and ends with an Outcome; OUTCOME_MOVES says which state its trial
moves to then. A tune (`segctl tune`) runs per node class QUEUED -> RUNNING ->
DONE | FAILED | CANCELLED; a head restart sends a RUNNING class back to QUEUED.
Every table here is enforced where state.db is written (orchestrator/state.py):
a move that is not in it is a controller bug and raises.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import BaseModel, Field

from .defaults import DEFAULT_ATTN_BLOCK, DEFAULT_HEAD_CHUNK, DEFAULT_MLP_CHUNK
from .job import LoraSpec, Method


class TrialState(str, Enum):
    PENDING = "PENDING"
    PLACED = "PLACED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    OOM = "OOM"
    NODE_LOST = "NODE_LOST"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    STOPPED = "STOPPED"    # early-stopped by the sweep's scheduler (asha), with its reason


TERMINAL = {TrialState.SUCCEEDED, TrialState.FAILED, TrialState.CANCELLED, TrialState.STOPPED}
# Legal moves; anything else is a bug in the controller and raises.
MOVES = {
    TrialState.PENDING: {TrialState.PLACED, TrialState.FAILED, TrialState.CANCELLED,
                         TrialState.STOPPED},
    TrialState.PLACED: {TrialState.RUNNING, TrialState.NODE_LOST, TrialState.OOM,
                        TrialState.FAILED, TrialState.SUCCEEDED, TrialState.CANCELLED,
                        TrialState.STOPPED},
    TrialState.RUNNING: {TrialState.SUCCEEDED, TrialState.OOM, TrialState.NODE_LOST,
                         TrialState.FAILED, TrialState.CANCELLED, TrialState.STOPPED},
    TrialState.OOM: {TrialState.PENDING, TrialState.FAILED, TrialState.CANCELLED,
                     TrialState.STOPPED},
    TrialState.NODE_LOST: {TrialState.PENDING, TrialState.FAILED, TrialState.CANCELLED,
                           TrialState.STOPPED},
}


class SweepState(str, Enum):
    RUNNING = "RUNNING"          # the controller schedules its trials
    INTERRUPTED = "INTERRUPTED"  # the head restarted under it; `segctl resume` continues it
    DONE = "DONE"                # every trial terminal
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"            # the sweep itself could not go on (e.g. its model cannot be planned)


class AttemptStatus(str, Enum):
    PLACED = "placed"      # recorded and handed to its node's agent
    RUNNING = "running"    # its engine process started
    ENDED = "ended"        # it has an outcome


ATTEMPT_MOVES = {
    AttemptStatus.PLACED: {AttemptStatus.RUNNING, AttemptStatus.ENDED},
    AttemptStatus.RUNNING: {AttemptStatus.ENDED},
}


class Outcome(str, Enum):
    """How an attempt ended, as the node agent reports it (or the head, for what
    happened around the agent). The values are what state.db and `--json` hold."""
    SUCCEEDED = "succeeded"
    OOM = "oom"
    NODE_LOST = "node_lost"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # The head restarted under a running attempt: not the trial's fault, so it
    # does not count against the sweep's retries.
    INTERRUPTED = "interrupted"
    # The agent failed around the attempt (its disk, a refused call, the head
    # unable to store the adapter): retried like a lost node.
    AGENT_ERROR = "agent_error"


OUTCOMES = tuple(o.value for o in Outcome)   # as plain strings (schemas/store_rows.py)
# The state an attempt's outcome moves its trial to (head.Controller.finish), before
# the retry decides whether OOM and NODE_LOST go on to PENDING.
OUTCOME_MOVES = {
    Outcome.SUCCEEDED: TrialState.SUCCEEDED,
    Outcome.OOM: TrialState.OOM,
    Outcome.NODE_LOST: TrialState.NODE_LOST,
    Outcome.INTERRUPTED: TrialState.NODE_LOST,
    Outcome.AGENT_ERROR: TrialState.NODE_LOST,
    Outcome.FAILED: TrialState.FAILED,
    Outcome.CANCELLED: TrialState.CANCELLED,
}


class TuneState(str, Enum):
    """Where one node class of a `segctl tune` stands, and the tune as a whole
    (RUNNING while any class is QUEUED or RUNNING, then how its classes ended)."""
    QUEUED = "queued"        # waiting for a free node of its class
    RUNNING = "running"      # a node of the class is measuring its points
    DONE = "done"            # every point measured (or none was needed)
    FAILED = "failed"        # its probes failed, or no node of the class is up
    CANCELLED = "cancelled"


TUNE_TERMINAL = {TuneState.DONE, TuneState.FAILED, TuneState.CANCELLED}
TUNE_MOVES = {
    # the head restarted under a running probe: queued again, it measures what is left
    TuneState.RUNNING: {TuneState.DONE, TuneState.FAILED, TuneState.CANCELLED, TuneState.QUEUED},
    TuneState.QUEUED: {TuneState.RUNNING, TuneState.FAILED, TuneState.CANCELLED},
}


class Plan(BaseModel):
    """The planner's answer for one trial on one node class."""
    segment_size: int
    predicted_gb: float
    budget_gb: float
    fits: bool
    reason: str = ""
    source: str = "analytic"         # measured: from `segctl tune`'s probes; analytic: estimated
    offload: bool = False            # boundaries on disk (memory.offload disk, or auto's choice)


class NodeInfo(BaseModel):
    """A node as the head sees it (from Ray's node table: resources + labels)."""
    name: str
    chip: str = "unknown"
    memory_gb: float = Field(description="the training budget on this node")
    os: str = "unknown"
    labels: dict[str, str] = {}
    alive: bool = True
    max_trials: int = 1   # attempts it runs at once, while their predicted peaks fit memory_gb

    @property
    def node_class(self) -> str:
        return f"{self.chip}/{self.memory_gb:g}GB"

    def matches(self, placement: dict) -> bool:
        """A sweep's placement selector: every label given must be the node's
        (chip, name and os count as labels too)."""
        have = dict(self.labels, chip=self.chip, name=self.name, os=self.os)
        return all(str(have.get(k)) == str(v) for k, v in placement.items())


class AttemptSpec(BaseModel):
    """What the head sends a node agent to run one attempt of a trial."""
    sweep: str
    trial: str
    attempt: int                     # global attempt id (state.db)
    job: dict                        # JobSpec as JSON, segment_size resolved, budget set
    data: dict[str, bytes]           # file name -> bytes (train / valid jsonl)
    checkpoint_step: Optional[int] = None
    checkpoint: dict[str, bytes] = {}   # file name -> bytes of the checkpoint to resume from


class ProbeSpec(BaseModel):
    """What `segctl tune` has one node measure: a few training steps at each
    (sequence length, segment size) point, under the node's memory budget."""
    model: str                       # the model folder (fetched from the head when absent)
    method: Method = "sft"
    prefix_shared: bool = True       # orpo, dpo: one pass over [prompt | chosen | rejected]
    lora: LoraSpec = LoraSpec()
    head_chunk: int = DEFAULT_HEAD_CHUNK
    attn_block: int = DEFAULT_ATTN_BLOCK
    mlp_chunk: int = DEFAULT_MLP_CHUNK
    budget_gb: float
    points: list[tuple[int, int]]    # (seq_len, segment_size), measured in this order
    steps: int = Field(3, ge=1, description="steps per point; the first is not timed")
    seed: int = 0


class AttemptResult(BaseModel):
    """What a node agent returns when an attempt ends."""
    attempt: int
    outcome: Outcome
    message: str = ""
    exit_code: Optional[int] = None
    peak_gb: Optional[float] = None
    steps: int = 0
    ended: Optional[float] = None    # unix time the engine process exited (the node was free)
    final_loss: Optional[float] = None
    val_loss: Optional[float] = None
    adapter: dict[str, bytes] = {}   # adapters.safetensors + adapter_config.json on success
    # The adapter of the run's best eval (the lowest val_loss), named as `adapter`'s files;
    # empty when the job has no validation set.
    best_adapter: dict[str, bytes] = {}
    best_step: Optional[int] = None
    best_val_loss: Optional[float] = None
