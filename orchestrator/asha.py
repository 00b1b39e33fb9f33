"""Early stopping by asynchronous successive halving (the ASHA paper; Ray Tune's
AsyncHyperBand): the sweep key `scheduler: {type: asha}`. Not to be confused with
fairshare.py, which shares the fleet between sweeps.

A trial's eval at a rung is recorded (once per sweep, rung and trial), and the
trial stops when at least `reduction` values are recorded at that rung (its own
included) and it is worse than the top 1/reduction of them. Nobody waits for a rung
to fill: the first trials there go on, later ones are judged against more values.

Pure: the controller reads the values already recorded at the rung and applies
the decision (state.db's `record_rung`, then cancelling the trial's attempt)."""

from __future__ import annotations

from typing import Mapping, NamedTuple

from segctl.schemas.search import SchedulerSpec


class Record(NamedTuple):
    """Record `value` as the trial's at `rung` (a step); the trial goes on."""
    trial: str
    rung: int
    value: float


class Stop(NamedTuple):
    """Record `value` at `rung` and stop the trial, for `reason` (one transaction)."""
    trial: str
    rung: int
    value: float
    reason: str


def judge(scheduler: SchedulerSpec, trial: str, step: int, value, recorded: Mapping[str, float],
          finished: bool) -> Record | Stop | None:
    """What to do with trial `trial`'s eval `value` at `step`: None when `step` is no
    rung or the trial has a value there already (a batch delivered twice, a head
    restart: a decision is taken once). `recorded`: trial -> value at this rung so
    far; `finished`: the trial is in a terminal state (recorded, never stopped)."""
    rungs = scheduler.rungs()
    if step not in rungs or trial in recorded:
        return None
    value = float(value)
    values = {**recorded, trial: value}
    cutoff = asha_cutoff(list(values.values()), scheduler.reduction)
    if not finished and len(values) >= scheduler.reduction and value > cutoff:
        return Stop(trial, step, value,
                    f"asha: {scheduler.metric} {value:.4g} at rung {rungs.index(step) + 1} "
                    f"(step {step}) below the top 1/{scheduler.reduction} of {len(values)} "
                    f"(cutoff {cutoff:.4g})")
    return Record(trial, step, value)


def asha_cutoff(values: list[float], reduction: int) -> float:
    """The value at the top 1/reduction of `values`, lower being better: their
    1/reduction quantile, interpolated linearly (numpy's default percentile)."""
    xs = sorted(values)
    pos = (len(xs) - 1) / reduction
    lo = int(pos)
    return xs[lo] if lo + 1 >= len(xs) else xs[lo] + (pos - lo) * (xs[lo + 1] - xs[lo])
