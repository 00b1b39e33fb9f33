"""What the fleet records and passes around: the plan of an attempt, and the
messages between the head and a node agent; and, re-exported from
schemas/states.py, trial states and attempt outcomes.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from .defaults import DEFAULT_ATTN_BLOCK, DEFAULT_HEAD_CHUNK, DEFAULT_MLP_CHUNK, TELEMETRY_FLUSH_S
from .job import JobSpec, LoraSpec, Method
from .states import (  # noqa: F401
    ATTEMPT_MOVES,
    MOVES,
    OUTCOME_MOVES,
    OUTCOMES,
    TERMINAL,
    TUNE_MOVES,
    TUNE_TERMINAL,
    AttemptStatus,
    Outcome,
    SweepState,
    TrialState,
    TuneState,
)


def attempt_nodes(node: str) -> list[str]:
    """The nodes of an attempt as state.db names them (its `node`): one, or those
    of a trial on several nodes, rank 0 first, joined by commas (`nodes_field`)."""
    return node.split(",")


def nodes_field(names: list[str]) -> str:
    """An attempt's `node` in state.db for its nodes, rank 0 first."""
    return ",".join(names)


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
    rdma: dict[str, str] = {}   # peer node -> this node's RDMA device cabled to it (jaccl)

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
    job: JobSpec                     # its memory settings resolved for the node, budget set
    data: dict[str, bytes]           # file name -> bytes (train / valid jsonl)
    checkpoint_step: Optional[int] = None
    checkpoint: dict[str, bytes] = {}   # file name -> bytes of the checkpoint to resume from
    flush_s: float = TELEMETRY_FLUSH_S  # forward telemetry at least this often (the head's pace)
    # A job on several nodes (job.distributed.nodes): this node's rank, and every
    # rank's "host:port" in the ring (MLX's hostfile), rank 0 first. Empty: one node.
    # Over JACCL (backend jaccl), rank 0's is the coordinator, and `rdma` says which
    # RDMA device each rank reaches each other rank by (MLX_IBV_DEVICES: rank i's
    # row, None for itself).
    rank: int = 0
    ring: list[str] = []
    rdma: list[list[Optional[str]]] = []


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
    # > 1: each point is a step of this many rows, seq_len tokens in all, run as the
    # job runs its micro-batch (engine/train.packing, side_by_side on the node's
    # device): packed into one sequence, or side by side (unpadded where the family
    # allows); 1: one row of seq_len tokens
    pack_rows: int = Field(1, ge=1)
    pack: Union[bool, Literal["auto"]] = "auto"   # the job's data.pack


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
    # A job on several nodes: the node where the attempt's outcome happened (the
    # rank that ran out of memory, or was lost first); None on one node.
    node: Optional[str] = None
