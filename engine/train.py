"""The training loop: one LoRA job on this machine, from a validated JobSpec.

Reads top to bottom as the story of a run: load and check everything (nothing is
written before the inputs are known good), put LoRA on the model, maybe resume,
then step -> maybe eval (keeping the adapter of the best one, maybe stopping early)
-> maybe checkpoint, and save the adapter. Everything the run has to say goes out
as telemetry events through `emit`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from segctl.schemas import events as ev
from segctl.schemas.atomic import fsync_dir, write_atomic
from segctl.schemas.errors import UserError
from segctl.schemas.job import JobSpec

from . import distributed
from . import step as step_module  # its on_gpu probe, which tests substitute
from .data import DataError, Dataset, epoch_order, load_dataset_cached
from .model import ModelError, apply_lora, load_model, model_parts
from .optim import apply_grads, make_optimizer, schedule
from .plans import StepError
from .settings import StepMemory
from .step import eval_loss, loss_and_grads, pack_refusal, ragged_refusal, side_refusal, supervised_tokens

Emit = Callable[[ev.Event], None]
GB = 1e9
ADAPTER = "adapters.safetensors"
BEST_ADAPTER = "best_adapters.safetensors"   # the adapter of the best eval, beside the last


class OOMError(RuntimeError):
    """A measured peak crossed the job's memory budget."""

    def __init__(self, message: str, peak_gb: float = 0.0):
        super().__init__(message)
        self.peak_gb = peak_gb   # the peak that crossed it


class OutputError(UserError, ValueError):
    """The output folder cannot be used as asked."""


def run(job: JobSpec, *, resume: bool = False, emit: Emit = lambda e: None,
        clock: Callable[[], float] = time.time, data_cache: str | Path | None = None) -> Path:
    """Train `job`; returns the output folder. Raises ModelError / DataError /
    OutputError for bad input (before anything is written) and OOMError when the
    memory guard fires (the last checkpoint stays as it was). `data_cache`: a
    folder that keeps tokenized data sets between runs (a node's)."""
    if job.output is None:
        raise OutputError("output: required key is missing (where the adapter lands)")
    if job.memory.segment_size == "auto":
        raise OutputError("memory.segment_size: 'auto' must be resolved by the planner first")
    out = Path(job.output)
    ckpt = latest_checkpoint(out) if resume else None
    if not resume and out.exists() and any(out.iterdir()):
        raise OutputError(f"{out}: output folder is not empty (use --resume to continue it, "
                          "or choose another output)")

    # --- inputs, all checked before the first byte is written
    model, tokenizer = load_model(job.model)
    d = job.data
    opts: dict[str, Any] = dict(method=job.method, mask_prompt=d.mask_prompt, max_seq_length=d.max_seq_length,
                overlong=d.overlong)
    cached: dict[str, Any] = dict(model_dir=job.model, cache=data_cache)
    train_set = load_dataset_cached(d.train, tokenizer, **cached, **opts)
    valid_set = load_dataset_cached(d.valid, tokenizer, **cached, **opts) if d.valid else None
    mx.random.seed(job.train.seed)
    adapter_config = apply_lora(model, rank=job.lora.rank, scale=job.lora.scale,
                                dropout=job.lora.dropout, num_layers=job.lora.num_layers,
                                keys=job.lora.keys)
    parts = model_parts(model, check=False)
    # on several nodes: this process's place in the ring, joined before anything is
    # written (every rank has checked its inputs by now)
    ring = distributed.join(job.distributed)
    per_step = job.train.rows_per_step
    pack, pack_reason = packing(job, parts)
    side = side_by_side(job, parts)
    pack_kw = dict(pack=pack, side=side, pack_length=pack_length(job), micro=job.train.batch_size)
    if job.train.iters:
        total = job.train.iters
    else:
        assert job.train.epochs is not None   # TrainSpec asks for iters or epochs
        total = job.train.epochs * -(-len(train_set) // per_step)
    lr = schedule(job.train.learning_rate, job.train.schedule, warmup=job.train.warmup, total=total)
    optimizer = make_optimizer(lr, job.train.weight_decay)
    start_step, best = 0, BestSoFar()
    if ckpt is not None:
        start_step, best = load_checkpoint(ckpt, model, optimizer, per_step)
    distributed.same_start(ring, start_step)

    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "adapter_config.json", adapter_config)
    best = restore_best(out, ckpt, best)
    seg = job.memory.segment_size
    mode = "segmented" if seg else ("grad_checkpoint" if job.memory.grad_checkpoint else "plain")
    # Boundaries offloaded to disk wait in an unlinked file here (engine/offload.py).
    # (auto reaches a node already decided: the head writes disk or none into the job)
    scratch = str(out / "scratch") if job.memory.offload != "none" and seg else None
    # On a GPU the segments run compiled where that is exact (engine/fused.py): one
    # kernel where a segment's elementwise work took many, as mlx-lm compiles its
    # step (bench/README). A CPU gains less and compiles each new shape slowly.
    memory = StepMemory(segment_size=seg, head_chunk=job.memory.head_chunk,
                        attn_block=job.memory.attn_block, mlp_chunk=job.memory.mlp_chunk,
                        offload=scratch, grad_checkpoint=job.memory.grad_checkpoint,
                        fused=bool(seg) and step_module.on_gpu())
    pack_kw["ragged"], unpadded_reason = unpadding(side, parts)
    n_trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    emit(ev.Start(time=clock(), job=job.name, mode=mode, segment_size=seg, total_steps=total,
                  resumed_from=start_step if ckpt is not None else None,
                  train_rows=len(train_set), valid_rows=len(valid_set or []),
                  truncated=train_set.truncated + (valid_set.truncated if valid_set else 0),
                  skipped=train_set.skipped + (valid_set.skipped if valid_set else 0),
                  trainable_params=n_trainable, batch_size=job.train.batch_size,
                  grad_accumulation=job.train.grad_accumulation, packed=pack,
                  pack_reason=pack_reason, side_by_side=side, unpadded=pack_kw["ragged"],
                  unpadded_reason=unpadded_reason, fused=memory.fused,
                  rank=ring.rank if ring else None, ranks=ring.size if ring else 1,
                  whole_rows=parts.whole_rows or None))

    budget = job.memory.budget_gb
    method = method_options(job)
    t_run = time.perf_counter()
    loss = val = stop = None
    early = job.train.early_stop
    last = start_step
    model.train()
    for step in range(start_step + 1, total + 1):
        last = step
        batch = batch_at(train_set, job.train.seed, step, per_step)
        # The RNG is a function of (seed, step): a resumed run draws what the
        # uninterrupted one would have.
        mx.random.seed(job.train.seed * 1_000_003 + step)
        mine = distributed.share(batch, ring)   # this node's rows (all of them on one)
        m = measured_step(model, optimizer, mine, parts=parts, step=step, budget=budget,
                          memory=memory, grad_clip=job.train.grad_clip, method=method, pack=pack_kw,
                          ring=ring)
        loss = float(m.loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {step}")
        # how full the step's sequences are: packed, over pack_length each; side
        # by side, over the tokens they ran as (padded: [rows, longest]; unpadded:
        # the rows' own, and the tail that rounds them up)
        fill = pack_length(job) if pack else "padded" if side else None
        emit(step_event(clock(), step, m, batch, mine, ring, fill,
                        lr=float(optimizer.learning_rate.item())))
        if job.telemetry.phases:
            emit(ev.Phase(time=clock(), step=step, phases=m.phases))
        if valid_set and ((job.train.eval_every and step % job.train.eval_every == 0)
                          or step == total):
            val = evaluate(model, parts, valid_set, job, step, emit, clock, ring)
            if (track_best(best, step, val, early.min_delta if early else 0.0)
                    and distributed.writes(ring)):
                _save_tensors(out / BEST_ADAPTER, model.trainable_parameters())
            if early and best.stale >= early.patience and step < total:
                # before any checkpoint of this step: a resume reaches the same stop
                stop = (f"val_loss did not improve by more than {early.min_delta:g} in "
                        f"{best.stale} eval(s); best {best.val_loss:.6g} at step {best.step}")
                break
        if (job.train.checkpoint_every and step % job.train.checkpoint_every == 0 and step < total
                and distributed.writes(ring)):
            path = save_checkpoint(out, step, model, optimizer, adapter_config, job.train.seed,
                                   best, rows_per_step=per_step)
            emit(ev.Checkpoint(time=clock(), step=step, path=str(path)))

    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)  # empty: its files were unlinked at birth
    adapter = save_adapter(out, model)
    emit(ev.End(time=clock(), step=last, adapter=str(adapter), final_loss=loss, val_loss=val,
                seconds=time.perf_counter() - t_run,
                best_adapter=str(out / BEST_ADAPTER) if best.step is not None else None,
                best_step=best.step, best_val_loss=best.val_loss if best.step is not None else None,
                stopped_early=stop is not None, stop_reason=stop))
    return out


def step_event(time_: float, step: int, m: "MeasuredStep", batch: list, mine: list,
               ring: distributed.Ring | None, fill: int | str | None, *, lr: float) -> ev.Step:
    """A step's telemetry: `batch` its rows, `mine` this rank's share of them (all
    of them on one node), `fill` how its sequences' fullness is counted (packed:
    over this many tokens each; "padded": over the padded tokens; None: not)."""
    tokens = supervised_tokens(batch)
    sequences, seq_tokens = m.metrics["sequences"], m.metrics["tokens"]
    full = (seq_tokens / (sequences * fill) if isinstance(fill, int) else
            seq_tokens / m.metrics["padded"] if fill == "padded" else None)
    get = m.metrics.get
    return ev.Step(time=time_, step=step, loss=float(m.loss), tokens=tokens, seconds=m.seconds,
                   tokens_per_s=tokens / m.seconds, lr=lr, grad_norm=m.grad_norm.item(),
                   peak_gb=m.peak_gb, active_gb=mx.get_active_memory() / GB,
                   cache_gb=mx.get_cache_memory() / GB, margin=get("margin"),
                   accuracy=get("accuracy"), prefix_shared=get("prefix_shared"),
                   chosen_reward=get("chosen_reward"), rejected_reward=get("rejected_reward"),
                   rows=len(batch), sequences=sequences, seq_tokens=seq_tokens,
                   pack_efficiency=full, rank=ring.rank if ring else None,
                   rank_rows=len(mine) if ring else None, allreduce_s=get("allreduce_s"),
                   allreduce_bytes=get("allreduce_bytes"))


def run_reported(job: JobSpec, *, resume: bool = False, emit: Emit = lambda e: None,
                 clock: Callable[[], float] = time.time, debug: bool = False,
                 data_cache: str | Path | None = None) -> tuple[int, str]:
    """`run`, with every way it can end turned into an exit code and, on failure, an
    Error event: (0, "") done, (2, msg) bad input, (3, msg) memory guard, (1, msg) a
    bug of ours. `segctl train` and the node's worker process both end this way."""
    last = {"step": None}

    def tracked(event):
        if isinstance(event, ev.Step):
            last["step"] = event.step
        emit(event)

    def error(kind: str, message: str, code: int) -> tuple[int, str]:
        emit(ev.Error(time=clock(), kind=kind, message=message, step=last["step"]))
        return code, message

    try:
        run(job, resume=resume, emit=tracked, clock=clock, data_cache=data_cache)
    except ModelError as e:
        return error("model", str(e), ev.EXIT_BAD_INPUT)
    except (DataError, StepError, OutputError) as e:
        return error("data", str(e), ev.EXIT_BAD_INPUT)
    except distributed.RingError as e:
        return error("distributed", str(e), ev.EXIT_BAD_INPUT)
    except distributed.RankLost as e:
        return error("distributed", str(e), ev.EXIT_RANK_LOST)
    except OOMError as e:
        return error("oom", str(e), ev.EXIT_OOM)
    except KeyboardInterrupt:
        return error("internal", "interrupted", 130)
    except Exception as e:  # a bug of ours: one line, the trace only when debugging
        if debug:
            import traceback
            traceback.print_exc()
        return error("internal", f"internal error: {type(e).__name__}: {e}", ev.EXIT_INTERNAL)
    return ev.EXIT_OK, ""


def packing(job: JobSpec, parts) -> tuple[bool, str | None]:
    """(whether a micro-batch's rows run packed, why not where `data.pack: auto`
    leaves them apart). Packing is only ever exact: a model the engine cannot pack
    exactly (`pack_refusal`), or LoRA dropout (a packed sequence would draw other
    masks than its rows apart), trains unpacked under auto and is refused under
    true. A micro-batch of one row has nothing to pack: no check runs at start-up
    (the planner's `step_tokens` plans it as one row too). On a GPU, auto runs the
    rows side by side where they can (unpadded where the family allows): one wide
    pass beats packed sequences there (bench/README's GPU rows), a CPU the other
    way round."""
    asked = job.data.pack
    if asked is False or job.train.batch_size == 1:
        return False, None
    if asked == "auto" and step_module.on_gpu() and side_by_side(job, parts):
        return False, ("on a GPU the rows run side by side instead: one wide pass of the "
                       "rows is faster there than packed sequences")
    why = pack_refusal(parts)
    if why is None and job.lora.dropout > 0:
        why = "lora.dropout is on: a packed sequence draws other dropout masks than its rows"
    if why is None:
        return True, None
    if asked is True:
        raise ModelError(f"{job.model}: data.pack: true: rows cannot be packed exactly ({why}); "
                         "use pack: auto or false")
    return False, why


def side_by_side(job: JobSpec, parts) -> bool:
    """Whether a micro-batch's rows that are not packed (all of them unpacked, the
    two-branch preference rows packed) run side by side, [rows, longest] padded at
    their ends, as mlx-lm batches: one wide pass instead of one per row, which a
    GPU runs in about the time of one. Exact where the model's rows batch
    exactly (`side_refusal`) and LoRA dropout is off (a batch draws other masks
    than its rows apart); else they run one after the other."""
    return job.train.batch_size > 1 and job.lora.dropout == 0 and side_refusal(parts) is None


def unpadding(side: bool, parts) -> tuple[bool, str | None]:
    """(whether rows side by side go unpadded, why not where they run side by side):
    where that is exact (`ragged_refusal`), only attention then runs the padded
    batch (engine/ragged.py)."""
    why = ragged_refusal(parts) if side else None
    return side and why is None, why


def pack_length(job: JobSpec) -> int:
    return job.data.pack_length or job.data.max_seq_length


def method_options(job: JobSpec) -> dict:
    """The loss_and_grads / eval_loss keywords that the job's method sets."""
    if job.method == "orpo":
        o = job.orpo
        return dict(method="orpo", lambda_=o.lambda_, nll_scope=o.nll_scope,
                    prefix_shared=o.prefix_shared)
    if job.method == "dpo":
        return dict(method="dpo", beta=job.dpo.beta, prefix_shared=job.dpo.prefix_shared)
    return dict(method="sft")


@dataclass
class MeasuredStep:
    loss: mx.array
    grad_norm: mx.array
    seconds: float
    peak_gb: float                     # the step's peak: the highest of its phases
    phases: list[tuple[str, float]]    # (label, that phase's own peak GB), in order
    metrics: dict


def measured_step(model, optimizer, example, *, parts, step: int, budget: float | None,
                  memory: StepMemory, grad_clip: float | None, method: dict,
                  pack: dict | None = None, ring: distributed.Ring | None = None) -> MeasuredStep:
    """One optimizer step over `example` (a row or a batch of them; `pack`: the
    step's pack, pack_length and micro keywords) under the memory guard, with each
    phase's own peak: the peak counter restarts at every phase boundary, so a
    phase's figure is what it alone needed (a plan's measured memory model is
    fitted phase by phase).
    Raises OOMError when a phase's peak crosses `budget`."""
    phases: list[tuple[str, float]] = []

    def on_phase(label: str):
        peak = mx.get_peak_memory() / GB
        mx.reset_peak_memory()
        phases.append((label, round(peak, 6)))
        if budget and peak > budget:
            raise OOMError(f"peak {peak:.3f} GB crossed memory.budget_gb {budget} "
                           f"during {label} of step {step}", peak)

    mx.clear_cache()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    metrics: dict = {}
    loss, grads = loss_and_grads(model, example, memory=memory, parts=parts, on_phase=on_phase,
                                 metrics=metrics, **(pack or {}), **method)
    if ring is not None:   # this rank's share -> the whole batch's (engine/distributed.py)
        loss, grads, cost = distributed.reduce_step(ring, loss, grads, metrics["weight"])
        metrics.update(cost)
    grad_norm = apply_grads(model, optimizer, grads, grad_clip, fused=memory.fused)
    del grads
    mx.eval(loss, grad_norm, model.trainable_parameters(), optimizer.state)
    seconds = time.perf_counter() - tic
    on_phase("update")
    return MeasuredStep(loss, grad_norm, seconds, max(p for _, p in phases), phases, metrics)


def batch_at(ds: Dataset, seed: int, step: int, rows: int) -> list:
    """The rows of step `step` (from 1): the next `rows` of the data order, which
    goes on across epochs (a step may end one epoch and start the next)."""
    return [example_at(ds, seed, (step - 1) * rows + k) for k in range(rows)]


def example_at(ds: Dataset, seed: int, position: int):
    """The example at a global position (steps so far): epochs reshuffle by seed."""
    n = len(ds)
    epoch, i = divmod(position, n)
    return ds.examples[epoch_order(n, seed, epoch)[i]]


@dataclass
class BestSoFar:
    """The eval with the lowest val_loss so far (its adapter is BEST_ADAPTER), and how
    many evals in a row have not beaten the best by more than early_stop's min_delta."""
    step: int | None = None
    val_loss: float = math.inf
    stale: int = 0

    def state(self) -> dict:
        return {"best_step": self.step, "best_val_loss": None if self.step is None else self.val_loss,
                "stale_evals": self.stale}

    @classmethod
    def from_state(cls, state: dict) -> "BestSoFar":
        if state.get("best_step") is None:   # none yet, or a checkpoint from before best tracking
            return cls()
        return cls(int(state["best_step"]), float(state["best_val_loss"]),
                   int(state.get("stale_evals", 0)))


def track_best(best: BestSoFar, step: int, val: float, min_delta: float) -> bool:
    """Count the eval into `best`; True when it is a new best (its adapter is to be kept)."""
    best.stale = 0 if val < best.val_loss - min_delta else best.stale + 1
    if val < best.val_loss:
        best.step, best.val_loss = step, val
        return True
    return False


def evaluate(model, parts, valid: Dataset, job: JobSpec, step: int, emit: Emit, clock,
             ring: distributed.Ring | None = None) -> float:
    """The validation loss over the eval's rows (each rank its share of them, the
    sums added over the ranks); rank 0 alone emits it."""
    tic = time.perf_counter()
    rows = valid.examples if job.train.val_batches < 0 else valid.examples[:job.train.val_batches]
    rows = distributed.share(list(rows), ring)
    model.eval()
    total, tokens = 0.0, 0
    method = method_options(job)
    for ex in rows:
        loss, n = eval_loss(model, ex, head_chunk=job.memory.head_chunk,
                            attn_block=job.memory.attn_block, mlp_chunk=job.memory.mlp_chunk,
                            parts=parts, **method)
        total, tokens = total + loss * n, tokens + n
    model.train()
    total, weight = distributed.add_up(ring, [total, tokens])   # over the ranks, if any
    tokens = int(weight)
    val = total / tokens
    if distributed.writes(ring):
        emit(ev.Eval(time=clock(), step=step, val_loss=val, val_tokens=tokens,
                     seconds=time.perf_counter() - tic))
    return val


# ---------------------------------------------------------------- files

def save_adapter(folder: Path, model) -> Path:
    return _save_tensors(folder / ADAPTER, model.trainable_parameters())


def restore_best(out: Path, ckpt: Path | None, best: BestSoFar) -> BestSoFar:
    """The best eval as of the checkpoint resumed from, with its adapter in `out`. A
    newer one there (from an eval after the checkpoint) is replaced: the run writes it
    again when it passes that eval."""
    kept = ckpt / BEST_ADAPTER if ckpt is not None else None
    if best.step is not None and kept is not None and kept.is_file():
        write_atomic(out / BEST_ADAPTER, kept.read_bytes())
        return best
    (out / BEST_ADAPTER).unlink(missing_ok=True)   # none as of the checkpoint: none yet
    return BestSoFar()


def save_checkpoint(out: Path, step: int, model, optimizer, adapter_config: dict,
                    seed: int, best: BestSoFar, keep: int = 3, rows_per_step: int = 1) -> Path:
    """adapter + optimizer state + step/data position (+ the best eval so far and its
    adapter), written to a temp folder and renamed into place, so a crash never leaves
    a half checkpoint."""
    root = out / "checkpoints"
    final = root / f"step-{step:07d}"
    tmp = root / f".step-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _save_tensors(tmp / ADAPTER, model.trainable_parameters())
    _save_tensors(tmp / "optimizer.safetensors", optimizer.state)
    _write_json(tmp / "adapter_config.json", adapter_config)
    if best.step is not None:
        write_atomic(tmp / BEST_ADAPTER, (out / BEST_ADAPTER).read_bytes())
    # Data position is the rows the steps took (the order is a function of seed and epoch);
    # the RNG is reseeded from (seed, step) every step.
    _write_json(tmp / "state.json", {"step": step, "data_position": step * rows_per_step,
                                     "rows_per_step": rows_per_step, "seed": seed,
                                     "rng": "mx.random.seed(seed * 1000003 + step)",
                                     **best.state()})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    done = sorted(p for p in (out / "checkpoints").glob("step-*") if (p / "state.json").exists())
    return done[-1] if done else None


def load_checkpoint(path: Path, model, optimizer, rows_per_step: int = 1) -> tuple[int, BestSoFar]:
    """Loads the adapter and optimizer state; returns the step and the best eval so far.
    A checkpoint of another number of rows a step is refused before anything is
    loaded: its steps would not be this job's (the data order would shift)."""
    saved = json.loads((path / "state.json").read_text())
    theirs = int(saved.get("rows_per_step", 1))   # a checkpoint from before batches: 1
    if theirs != rows_per_step:
        raise OutputError(f"{path}: checkpoint of {theirs} row(s) a step, the job trains "
                          f"{rows_per_step} (train.batch_size x grad_accumulation): resume with "
                          "the batch it was made with, or start a new output")
    adapters = mx.load(str(path / ADAPTER))
    assert isinstance(adapters, dict)   # a safetensors file: name -> array
    model.load_weights(list(adapters.items()), strict=False)
    state = mx.load(str(path / "optimizer.safetensors"))
    assert isinstance(state, dict)
    optimizer.state = tree_unflatten(list(state.items()))
    mx.eval(model.parameters(), optimizer.state)
    return int(saved["step"]), BestSoFar.from_state(saved)


def _save_tensors(path: Path, tree) -> Path:
    weights = dict(tree_flatten(tree))
    return write_atomic(path, write=lambda tmp: mx.save_safetensors(str(tmp), weights))


def _write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


__all__ = ["run", "run_reported", "OOMError", "OutputError", "ModelError", "DataError", "StepError"]
