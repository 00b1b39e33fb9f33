"""Telemetry events: what the engine says while it trains, one JSON line each.

A program reading the engine (the node agent, a test, a notebook) sees these and
nothing else. Memory figures are in GB (1e9 bytes), as MLX reports them.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from .names import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_OOM, EXIT_RANK_LOST  # noqa: F401 (re-exported)


class Event(BaseModel):
    time: float = Field(description="unix seconds")


class Start(Event):
    event: Literal["start"] = "start"
    job: str
    mode: str                      # plain | grad_checkpoint | segmented
    segment_size: int
    total_steps: int
    resumed_from: Optional[int] = None
    train_rows: int
    valid_rows: int
    truncated: int                 # rows cut to max_seq_length
    skipped: int                   # rows dropped for length
    trainable_params: int
    batch_size: int = 1            # rows per micro-batch
    grad_accumulation: int = 1     # micro-batches per step
    packed: bool = False           # whether a micro-batch's rows run packed into sequences
    pack_reason: Optional[str] = None  # data.pack auto: why the rows run unpacked here
    side_by_side: bool = False     # whether rows not packed run side by side
    unpadded: bool = False         # side by side: their tokens unpadded (engine/ragged.py)
    unpadded_reason: Optional[str] = None  # side by side: why the rows run padded here
    fused: bool = False            # segments run compiled where exact (a GPU's segmented step)
    rank: Optional[int] = None     # a job on several nodes (distributed.nodes): this process's
    ranks: int = 1                 # place in the ring, and how many there are
    # layer classes that the row-wise probe kept whole (engine/rows.py), with why:
    # on long rows their light parts hold whole-row arrays, so they need more memory
    whole_rows: Optional[dict[str, str]] = None


class Step(Event):
    event: Literal["step"] = "step"
    step: int
    loss: float
    tokens: int                    # supervised tokens this step
    seconds: float
    tokens_per_s: float
    lr: float
    grad_norm: float
    peak_gb: float                 # the step's peak: the highest of its phases' peaks
    active_gb: float
    cache_gb: float
    # Preference methods only (None for sft). ORPO: lw, lr are the length-normalised
    # mean log p of the chosen and rejected responses. DPO: the rewards
    # beta * (log p - reference log p), summed over each response.
    margin: Optional[float] = None         # ORPO lw - lr; DPO chosen minus rejected reward
    accuracy: Optional[float] = None       # 1.0 if the margin is > 0 else 0.0
    prefix_shared: Optional[bool] = None   # False: the row fell back to two branches
    chosen_reward: Optional[float] = None      # DPO only
    rejected_reward: Optional[float] = None    # DPO only
    rows: int = 1                  # rows in the step (batch_size x grad_accumulation)
    sequences: int = 1             # sequences they ran as (fewer than rows when packed)
    seq_tokens: Optional[int] = None   # tokens of those sequences, every row's whole length
    # how full the sequences are: packed, their tokens over sequences x pack_length;
    # side by side, over the padded [rows, longest] batches they ran as
    pack_efficiency: Optional[float] = None
    # A job on several nodes: this rank's, its share of the rows (`rows` is the whole
    # step's), and the all_sum that made the step's gradient the whole batch's.
    rank: Optional[int] = None
    rank_rows: Optional[int] = None
    allreduce_s: Optional[float] = None
    allreduce_bytes: Optional[int] = None


class Phase(Event):
    event: Literal["phase"] = "phase"
    step: int
    phases: list[tuple[str, float]]  # (label, that phase's own peak GB), in order


class Eval(Event):
    event: Literal["eval"] = "eval"
    step: int
    val_loss: float
    val_tokens: int
    seconds: float


class Checkpoint(Event):
    event: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str


class End(Event):
    event: Literal["end"] = "end"
    step: int                      # the last step run (before total_steps when stopped early)
    adapter: str
    final_loss: Optional[float]
    val_loss: Optional[float]      # the last eval's
    seconds: float
    # The adapter of the eval with the lowest val_loss (None without a validation set).
    best_adapter: Optional[str] = None
    best_step: Optional[int] = None
    best_val_loss: Optional[float] = None
    stopped_early: bool = False    # train.early_stop ended the run at `step`
    stop_reason: Optional[str] = None


class Error(Event):
    event: Literal["error"] = "error"
    kind: Literal["oom", "data", "model", "distributed", "internal"]
    message: str
    step: Optional[int] = None


class Probe(Event):
    """One (sequence length, segment size) point of `segctl tune`: a few real
    training steps on a synthetic row of exactly `seq_len` tokens."""
    event: Literal["probe"] = "probe"
    seq_len: int
    segment_size: int
    fits: bool                       # False: the memory guard stopped it (a measured "does not fit")
    peak_gb: float                   # highest step peak; when it does not fit, the peak it was stopped at
    phases: list[tuple[str, float]]  # (label, that phase's own peak GB), the highest over the steps
    step_s: Optional[float] = None   # median seconds of the steps after the first (None: did not fit)
    steps: int                       # steps that ran to the end
    message: str = ""


AnyEvent = Union[Start, Step, Phase, Eval, Checkpoint, End, Error, Probe]

