"""The job spec: one LoRA fine-tuning run (`job.yaml`), as `segctl train` reads it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Optional, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from .defaults import DEFAULT_ATTN_BLOCK, DEFAULT_HEAD_CHUNK, DEFAULT_MAX_SEQ_LENGTH, DEFAULT_MLP_CHUNK
from .limits import (
    MAX_BATCH,
    MAX_HIDDEN,
    MAX_HOST_CHARS,
    MAX_KEY_CHARS,
    MAX_LAYERS,
    MAX_LIST_ITEMS,
    MAX_MEMORY_GB,
    MAX_NAME_CHARS,
    MAX_RANKS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    NAME_PATTERN,
    check_path,
)
from .names import DEMO_ARCHS, METHODS, Method  # noqa: F401 (re-exported)
from .yamlspec import did_you_mean, load_yaml, validate

# A path a spec names: bounded in length, no control characters.
PathStr = Annotated[str, AfterValidator(check_path)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class DataSpec(Strict):
    train: PathStr = Field(description="jsonl of training rows (text | prompt+completion | messages)")
    valid: Optional[PathStr] = Field(None, description="jsonl of validation rows")
    mask_prompt: bool = Field(True, description="loss on the response only (else on every token)")
    max_seq_length: int = Field(DEFAULT_MAX_SEQ_LENGTH, ge=2, le=MAX_TOKENS,
                                description="tokens per row at most")
    overlong: Literal["truncate", "skip"] = Field(
        "truncate", description="what happens to a longer row; counted in telemetry either way")
    pack: Union[bool, Literal["auto"]] = Field(
        "auto", description="a step's rows run as few sequences as possible, each row attending "
                            "only to itself, positions restarting per row (the same gradients as "
                            "unpacked); auto = wherever the family packs exactly, true = refuse a "
                            "family that cannot, false = one sequence per row")
    pack_length: Optional[int] = Field(None, ge=2, le=MAX_TOKENS,
                                       description="tokens per packed sequence at most; null = "
                                                   "max_seq_length (a row longer than this runs alone)")

    @model_validator(mode="after")
    def _pack_holds_a_row(self):
        if self.pack_length is not None and self.pack_length < self.max_seq_length:
            raise ValueError(f"pack_length {self.pack_length} is shorter than a row may be "
                             f"(max_seq_length {self.max_seq_length}, overlong: {self.overlong}): "
                             f"use pack_length >= {self.max_seq_length} or a smaller max_seq_length")
        return self


class LoraSpec(Strict):
    rank: int = Field(8, ge=1, le=MAX_HIDDEN)
    scale: float = Field(20.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    num_layers: int = Field(-1, ge=-1, le=MAX_LAYERS,
                            description="last N decoder layers get LoRA; -1 = all")
    keys: Optional[list[Annotated[str, Field(max_length=MAX_KEY_CHARS)]]] = Field(
        None, max_length=MAX_LIST_ITEMS,
        description="module paths in a layer, e.g. self_attn.q_proj; default every linear")


class EarlyStopSpec(Strict):
    metric: Literal["val_loss"] = Field("val_loss", description="what is watched, lower is better")
    patience: int = Field(ge=1, le=MAX_STEPS,
                          description="evals in a row without improvement before the run ends")
    min_delta: float = Field(0.0, ge=0, description="an eval improves when it beats the best so "
                                                    "far by more than this")


class TrainSpec(Strict):
    iters: Optional[int] = Field(None, ge=1, le=MAX_STEPS,
                                 description="optimizer steps (batch_size x grad_accumulation rows each)")
    epochs: Optional[int] = Field(None, ge=1, le=MAX_STEPS,
                                  description="passes over the data instead of iters")
    batch_size: int = Field(1, ge=1, le=MAX_BATCH,
                            description="rows per micro-batch (mlx-lm's batch_size); a step's loss "
                                        "is the mean over every supervised token of its rows (ORPO, "
                                        "DPO: the mean of the rows' losses)")
    grad_accumulation: int = Field(1, ge=1, le=MAX_BATCH,
                                   description="micro-batches per optimizer step (mlx-lm's "
                                               "grad_accumulation_steps): the step's gradient is "
                                               "exactly that of all their rows as one batch")
    learning_rate: float = Field(1e-4, gt=0)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup: int = Field(0, ge=0, le=MAX_STEPS, description="linear warmup steps")
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: Optional[float] = Field(1.0, gt=0, description="global-norm clip; null = off")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    eval_every: int = Field(0, ge=0, le=MAX_STEPS,
                            description="validate every N steps (and at the end); 0 = only at the end")
    val_batches: int = Field(25, ge=-1, le=MAX_STEPS,
                             description="validation rows per evaluation; -1 = all")
    checkpoint_every: int = Field(0, ge=0, le=MAX_STEPS,
                                  description="checkpoint every N steps; 0 = never")
    early_stop: Optional[EarlyStopSpec] = Field(
        None, description="end the run once the metric stopped improving (needs data.valid and "
                          "eval_every); the adapter of the best eval is kept either way")

    @model_validator(mode="after")
    def _one_length(self):
        if self.iters is None and self.epochs is None:
            raise ValueError("give either iters or epochs")
        if self.iters is not None and self.epochs is not None:
            raise ValueError("give iters or epochs, not both")
        return self

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.grad_accumulation

    @model_validator(mode="after")
    def _early_stop_needs_evals(self):
        if self.early_stop is not None and not self.eval_every:
            raise ValueError("early_stop needs eval_every >= 1 (it counts evals without improvement)")
        return self


class MemorySpec(Strict):
    segment_size: Union[int, Literal["auto"]] = Field(
        1, description="layers per segment; 0 = plain autodiff; auto = the largest that the "
                       "memory planner predicts fits the budget")
    grad_checkpoint: bool = Field(False, description="with segment_size 0: per-layer recompute")
    head_chunk: int = Field(DEFAULT_HEAD_CHUNK, ge=1, le=MAX_TOKENS,
                            description="token positions per loss-head chunk")
    attn_block: int = Field(DEFAULT_ATTN_BLOCK, ge=0, le=MAX_TOKENS,
                            description="segmented: on rows longer than this, attention backward "
                                        "in blocks of this many query rows; 0 = off")
    mlp_chunk: int = Field(DEFAULT_MLP_CHUNK, ge=0, le=MAX_TOKENS,
                           description="segmented: on rows longer than this, each layer's MLP "
                                       "runs this many rows at a time, forward and backward; "
                                       "0 = off")
    offload: Literal["none", "disk", "auto"] = Field(
        "none", description="segmented: where segment boundaries wait for the backward: "
                            "none = memory, disk = a scratch file beside the attempt's "
                            "output, removed at step end (long rows on a tight budget), "
                            "auto = disk only where the planner finds memory too small")
    budget_gb: Optional[float] = Field(None, gt=0, le=MAX_MEMORY_GB,
                                       description="stop with an oom error past this peak")

    @field_validator("segment_size", mode="before")
    @classmethod
    def _segment_size(cls, v):
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_LAYERS:
            raise ValueError(f"{v} is more than {MAX_LAYERS} layers")
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError(f"expected a whole number >= 0 or 'auto', got {v!r}")

    @model_validator(mode="after")
    def _offload_needs_segments(self):
        if self.offload != "none" and self.segment_size == 0:
            raise ValueError(f"offload: {self.offload} keeps segment boundaries on disk; segment_size 0 "
                             "(plain autodiff) has none: use segment_size >= 1 or auto")
        return self


class DistributedSpec(Strict):
    nodes: int = Field(1, ge=1, le=MAX_RANKS,
                       description="machines the job trains on at once, each a share of every "
                                   "step's rows (data parallel over MLX's distributed ring); 1: one")
    backend: Literal["ring", "jaccl"] = Field(
        "ring", description="ring: TCP between the nodes; jaccl: RDMA over Thunderbolt 5 (recent "
                            "macOS on Macs that have it)")
    interface: Optional[str] = Field(None, max_length=MAX_HOST_CHARS,
                                     description="the network the ring uses, by interface name "
                                                 "(default: the address each node joined with)")
    timeout_s: float = Field(120.0, gt=0, le=86_400,
                             description="a collective that makes no progress this long ends every "
                                         "rank, which fails the attempt as a lost node")
    min_nodes: Optional[int] = Field(
        None, ge=1, le=MAX_RANKS,
        description="a retry may go on as few nodes as this when `nodes` do not fit together "
                    "(the same global batch, a larger share each: the same steps); default: nodes")

    @model_validator(mode="after")
    def _min_within_nodes(self):
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes: {self.min_nodes} is more than nodes: {self.nodes}")
        return self


class TelemetrySpec(Strict):
    phases: bool = Field(False, description="emit the peak after each phase of the segmented step")


class OrpoSpec(Strict):
    # `lambda` is a Python keyword: the field is lambda_, written `lambda:` in YAML and dumps
    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    lambda_: float = Field(0.1, alias="lambda", ge=0,
                           description="weight of the odds-ratio term: loss = nll + lambda * "
                                       "softplus(-log_odds)")
    nll_scope: Literal["response", "full"] = Field(
        "response", description="response = -mean log p of the chosen response; full = mean over "
                                "the prompt and chosen tokens of the chosen sequence")
    prefix_shared: bool = Field(True, description="one forward over [prompt | chosen | rejected] "
                                                  "instead of a chosen and a rejected branch")


class DpoSpec(Strict):
    beta: float = Field(0.1, gt=0, description="strength of the pull to the reference (the base "
                                               "model): loss = softplus(-beta * (chosen - rejected "
                                               "log-ratio to the reference))")
    prefix_shared: bool = Field(True, description="one forward over [prompt | chosen | rejected] "
                                                  "instead of a chosen and a rejected branch")


# Experiment trackers a run can stream to (`report_to`); orchestrator/trackers.py
# writes to them, the engine never imports one.
Tracker = Literal["tensorboard", "mlflow", "wandb"]
TRACKERS = get_args(Tracker)
# The keys each tracker takes besides `type` (where it writes).
TRACKER_KEYS = {"tensorboard": ("dir",), "mlflow": ("uri",), "wandb": ("project", "entity", "dir")}


class TrackerSpec(Strict):
    """One entry of `report_to`: a tracker's name, or {type: name, ...} saying where it
    writes. Defaults are under the stores root (<home>/trackers/)."""
    type: Tracker
    dir: Optional[PathStr] = Field(None, description="tensorboard: the log root, a folder per sweep "
                                                     "(default <home>/trackers/tensorboard); wandb: "
                                                     "where its wandb/ folder goes (default "
                                                     "<home>/trackers)")
    uri: Optional[PathStr] = Field(None, description="mlflow: the tracking URI (default "
                                                     "sqlite:///<home>/trackers/mlflow.db)")
    project: Optional[str] = Field(None, pattern=NAME_PATTERN, max_length=MAX_NAME_CHARS,
                                   description="wandb: the project (default segctl)")
    entity: Optional[str] = Field(None, pattern=NAME_PATTERN, max_length=MAX_NAME_CHARS,
                                  description="wandb: the team or user (default wandb's own)")

    @model_validator(mode="before")
    @classmethod
    def _name_or_mapping(cls, v):
        if isinstance(v, str):
            v = {"type": v}
        if not isinstance(v, dict):
            raise ValueError(f"expected a tracker's name ({', '.join(TRACKERS)}) or "
                             f"{{type: name, ...}}, got {type(v).__name__}")
        kind = v.get("type")
        if isinstance(kind, str) and kind not in TRACKERS:
            raise ValueError(f"unknown tracker {kind!r}" + did_you_mean(kind, list(TRACKERS)))
        for key in v:   # said here: the key of a list item has no "did you mean" otherwise
            if key not in cls.model_fields:
                raise ValueError(f"{key}: unknown key" + did_you_mean(str(key), list(cls.model_fields)))
        return v

    @model_validator(mode="after")
    def _keys_of_its_type(self):
        for key in ("dir", "uri", "project", "entity"):
            if getattr(self, key) is not None and key not in TRACKER_KEYS[self.type]:
                takes = ", ".join(TRACKER_KEYS[self.type])
                raise ValueError(f"{key}: not a key of {self.type} (it takes {takes})")
        return self


def _trackers_list(v):
    """`report_to: tensorboard` is `report_to: [tensorboard]`; null is none."""
    return [] if v is None else [v] if isinstance(v, (str, dict)) else v


def _each_tracker_once(v: list[TrackerSpec]) -> list[TrackerSpec]:
    counts = Counter(t.type for t in v)   # not list.count per item: that is quadratic
    twice = sorted(t for t, n in counts.items() if n > 1)
    if twice:
        raise ValueError(f"{', '.join(twice)} given more than once")
    return v


ReportTo = Annotated[list[TrackerSpec], Field(max_length=MAX_LIST_ITEMS),
                     BeforeValidator(_trackers_list), AfterValidator(_each_tracker_once)]


def resolve_trackers(trackers: list[TrackerSpec], folder: Path) -> list[TrackerSpec]:
    """A tracker's relative `dir` is taken from `folder` (the file that wrote it)."""
    return [t.model_copy(update={"dir": str((folder / t.dir).resolve())}) if t.dir else t
            for t in trackers]


class JobSpec(Strict):
    # a key of mlx-lm's LoRA config in a job gets the segctl key to use (yamlspec)
    mlx_lm_hints: ClassVar[bool] = True

    name: str = Field("job", pattern=NAME_PATTERN, max_length=MAX_NAME_CHARS,
                      description="letters, digits, '.', '_', '-'")
    method: Method = Field(
        "sft", description="sft: rows of text / prompt+completion / messages; orpo, dpo: "
                           "prompt+chosen+rejected")
    model: PathStr = Field(description="local Hugging Face model folder")
    output: Optional[PathStr] = Field(None, description="folder the adapter lands in (segctl train "
                                                        "needs it; a sweep's trials land in the stores)")
    data: DataSpec
    lora: LoraSpec = LoraSpec()
    train: TrainSpec
    memory: MemorySpec = MemorySpec()
    telemetry: TelemetrySpec = TelemetrySpec()
    distributed: DistributedSpec = DistributedSpec()
    orpo: OrpoSpec = OrpoSpec()
    dpo: DpoSpec = DpoSpec()
    report_to: ReportTo = Field(
        [], description="trackers the run's metrics and params stream to: tensorboard, mlflow, "
                        "wandb (each a name or {type: name, dir|uri|project: ...})")

    @field_validator("orpo", "dpo")
    @classmethod
    def _section_needs_its_method(cls, v, info: ValidationInfo):
        # runs only when the key was given (defaults are not validated); a method
        # that failed validation is not in info.data, and is the only error then
        if info.data.get("method", info.field_name) != info.field_name:
            raise ValueError(f"only used with method: {info.field_name}")
        return v

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # A job's dump has no section of another method, so it validates again
        # (and an sft job reads as before).
        d = handler(self)
        if isinstance(d, dict):
            for section in ("orpo", "dpo"):
                if self.method != section:
                    d.pop(section, None)
            if not self.report_to:
                d.pop("report_to", None)
            if self.distributed == DistributedSpec():   # one node: a dump reads as before
                d.pop("distributed", None)
        return d

    @property
    def prefix_shared(self) -> bool:
        """The preference method's prefix_shared (ORPO's or DPO's); sft has one stream."""
        pref: OrpoSpec | DpoSpec = self.dpo if self.method == "dpo" else self.orpo
        return pref.prefix_shared

    @model_validator(mode="after")
    def _modes(self):
        if self.memory.grad_checkpoint and self.memory.segment_size not in (0,):
            raise ValueError("memory.grad_checkpoint needs memory.segment_size 0")
        if self.data.pack is True and self.lora.dropout > 0:
            raise ValueError("data.pack: true needs lora.dropout 0: a packed sequence draws other "
                             "dropout masks than its rows apart (use pack: auto or false)")
        if self.train.early_stop is not None and not self.data.valid:
            raise ValueError("train.early_stop needs data.valid (the validation set it watches)")
        n = self.distributed.nodes
        if n > 1 and self.train.rows_per_step < n:
            raise ValueError(f"distributed.nodes: {n} nodes need at least {n} rows a step (each takes "
                             f"a share); train.batch_size x grad_accumulation is "
                             f"{self.train.rows_per_step}")
        if n > 1 and self.lora.dropout > 0:
            raise ValueError("distributed.nodes > 1 needs lora.dropout 0: a node's share of the rows "
                             "would draw other dropout masks than the whole batch")
        return self


def load_job(path: str | Path) -> JobSpec:
    """Validate a job file; relative paths in it are taken from the file's folder."""
    path = Path(path)
    data, node = load_yaml(path)
    job = validate(JobSpec, path, data, node)
    base = path.resolve().parent
    resolve = lambda p: str((base / p).resolve()) if p else p
    return job.model_copy(update={
        "model": resolve(job.model), "output": resolve(job.output),
        "report_to": resolve_trackers(job.report_to, base),
        "data": job.data.model_copy(update={"train": resolve(job.data.train),
                                            "valid": resolve(job.data.valid)}),
    })
