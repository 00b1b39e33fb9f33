"""A sweep's search: the random parameters it draws (`random:`) and the early
stopping of its trials (`scheduler:`, ASHA). Pydantic only; schemas/sweep.py
builds the trials from them, orchestrator/asha.py judges at the rungs.
"""

from __future__ import annotations

import math
import random
from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from .job import Strict
from .limits import MAX_LIST_ITEMS, MAX_STEPS, MAX_TRIALS
from .yamlspec import did_you_mean

DISTRIBUTIONS = ("log_uniform", "uniform", "choice")


class Distribution(Strict):
    """One random parameter: exactly one of the three keys."""
    log_uniform: Optional[tuple[float, float]] = Field(None, description="[low, high], 0 < low < high")
    uniform: Optional[tuple[float, float]] = Field(None, description="[low, high], low <= high")
    choice: Optional[list[Any]] = Field(None, max_length=MAX_LIST_ITEMS,
                                        description="values drawn with equal chance")

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, v):
        if not isinstance(v, dict) or len(v) != 1:
            raise ValueError("expected one of {log_uniform: [low, high]}, {uniform: [low, high]}, "
                             "{choice: [values]}")
        (kind,) = v
        if kind not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution '{kind}'" + did_you_mean(str(kind), list(DISTRIBUTIONS)))
        if v[kind] is None:   # else every field is None and draw() has nothing to draw from
            raise ValueError(f"{kind}: needs a value")
        return v

    @model_validator(mode="after")
    def _ranges(self):
        if self.log_uniform is not None and not 0 < self.log_uniform[0] < self.log_uniform[1]:
            raise ValueError(f"log_uniform needs 0 < low < high, got {list(self.log_uniform)}")
        if self.uniform is not None and not self.uniform[0] <= self.uniform[1]:
            raise ValueError(f"uniform needs low <= high, got {list(self.uniform)}")
        if self.choice is not None and not self.choice:
            raise ValueError("choice needs at least one value")
        return self

    def draw(self, rng: random.Random):
        if self.log_uniform is not None:
            lo, hi = self.log_uniform
            return math.exp(rng.uniform(math.log(lo), math.log(hi)))
        if self.uniform is not None:
            return rng.uniform(*self.uniform)
        assert self.choice is not None   # the validator asks for one of the three
        return rng.choice(self.choice)


class RandomSpec(Strict):
    seed: int = Field(0, description="draws are the same for the same seed")
    samples: int = Field(ge=1, le=MAX_TRIALS, description="draws; each is combined with every grid point")
    params: dict[str, Distribution] = Field(min_length=1, max_length=MAX_LIST_ITEMS,
                                            description="dotted job key -> distribution")


class SchedulerSpec(Strict):
    """Asynchronous successive halving (ASHA): each trial reports its eval at the rungs
    grace_steps * reduction^k below max_steps; one worse than the top 1/reduction of
    the values recorded at that rung so far is stopped (docs/design.md, "Trial states")."""
    type: Literal["asha"] = Field(description="the only scheduler: asha")
    metric: Literal["val_loss"] = Field("val_loss", description="lower is better")
    grace_steps: int = Field(ge=1, le=MAX_STEPS,
                             description="the first rung: steps every trial runs")
    reduction: int = Field(3, ge=2, le=MAX_STEPS,
                           description="rungs are reduction times apart; the top 1/reduction "
                                       "at a rung goes on")
    max_steps: int = Field(ge=1, le=MAX_STEPS,
                           description="the steps a trial that is never stopped runs: "
                                       "train.iters of every trial")

    @model_validator(mode="after")
    def _above_grace(self):
        if self.max_steps <= self.grace_steps:
            raise ValueError(f"max_steps ({self.max_steps}) must be more than grace_steps "
                             f"({self.grace_steps})")
        return self

    def rungs(self) -> list[int]:
        """The steps a decision is taken at: grace_steps * reduction^k below max_steps."""
        out, step = [], self.grace_steps
        while step < self.max_steps:
            out.append(step)
            step *= self.reduction
        return out
