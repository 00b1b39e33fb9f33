"""What becomes of a trial when one of its attempts ends: the state it moves to for
that outcome, then whether it goes again (re-planned smaller, on a node to itself,
on another node, or resumed from its checkpoint) or fails (retries spent, a sweep
whose retries cannot be read). The recovery policy of docs/design.md's "Trial
states", as pure functions; the controller (head.py `finish`) applies the moves.

    succeeded                  -> SUCCEEDED
    oom above segment_size 1   -> OOM -> PENDING below that size
    oom at 1, sharing a node   -> OOM -> PENDING on a node to itself
    oom at 1, alone            -> OOM -> PENDING, that node excluded
    node_lost, agent_error     -> NODE_LOST -> PENDING (resume from its checkpoint)
    interrupted (head restart) -> NODE_LOST -> PENDING, never charged
    cancelled                  -> CANCELLED;  failed -> FAILED
Each go again counts against the sweep's `retries` (an interrupted one does not):
spent, the trial FAILS instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from segctl.schemas.names import EXIT_RANK_LOST
from segctl.schemas.records import (
    OUTCOME_MOVES,
    AttemptResult,
    NodeInfo,
    Outcome,
    TrialState,
    attempt_nodes,
)

from .snapshot import Attempt, Trial


@dataclass(frozen=True)
class Ended:
    """The trial's move for how its attempt ended (`fields`: its row's columns set)."""
    to: TrialState
    reason: str
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Replan:
    """Back to PENDING, planned again under new bounds: below `max_segment`, or
    never on the `excluded` nodes (None: that bound unchanged)."""
    reason: str
    max_segment: Optional[int] = None
    excluded: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class Retry:
    """Back to PENDING as it is: it resumes from its last checkpoint (the controller
    reads which one, and says so in the reason)."""


@dataclass(frozen=True)
class Fail:
    """The trial fails: `reason` in its events, `message` shown by `segctl status`."""
    reason: str
    message: str


Decision = Union[Ended, Replan, Retry, Fail]


def after(r: AttemptResult, a: Attempt, t: Trial, *, last: Optional[Attempt],
          node: Optional[NodeInfo], retries: int | str, used: int) -> list[Decision]:
    """The moves of trial `t` now that its attempt `a` ended as `r`, in order.
    `last`: the trial's last attempt (`a`, as state.db has it now); `node`: the
    node `last` ran on, if it is still up; `retries`: the sweep's, or why they
    cannot be read; `used`: the trial's attempts charged against them so far (both
    read only where `charged(r.outcome)`)."""
    # an attempt on several nodes: where its outcome happened (the rank out of memory)
    to, where = OUTCOME_MOVES[r.outcome], r.node or a.node
    if to == TrialState.SUCCEEDED:
        return [Ended(TrialState.SUCCEEDED, f"finished on {where}: final loss "
                      f"{_fmt(r.final_loss)}, val loss {_fmt(r.val_loss)}",
                      dict(final_loss=r.final_loss, val_loss=r.val_loss, message=""))]
    if to == TrialState.OOM:
        moves: list[Decision] = [Ended(TrialState.OOM, f"{where}: {r.message}")]
        spent = retries_spent(retries, used, a.sweep)
        if spent is not None:
            return moves + [spent]
        seg = a.segment_size
        if seg > 1:
            return moves + [Replan(f"re-plan below segment_size {seg} after out of memory on "
                                   f"{where}", max_segment=min(seg, t.max_segment or seg))]
        if shared_oom(last, node, t.own_budget_gb):
            return moves + [Replan(f"out of memory sharing {where} ({a.budget_gb:.3f} GB lent): "
                                   "next on a node to itself")]
        return moves + [Replan(f"out of memory at segment_size 1 on {where}: try a larger node",
                               excluded=tuple(sorted(set(t.excluded) | {where})))]
    if to == TrialState.NODE_LOST:
        moves = [Ended(TrialState.NODE_LOST, r.message)]
        if r.outcome == Outcome.INTERRUPTED:   # the head's doing: never charged
            return moves + [Retry()]
        spent = retries_spent(retries, used, a.sweep)
        return moves + [Retry() if spent is None else spent]
    if to == TrialState.CANCELLED:
        return [Ended(TrialState.CANCELLED, "cancelled")]
    return [Ended(TrialState.FAILED, r.message or "failed", dict(message=r.message))]


def charged(outcome: Outcome) -> bool:
    """Whether an attempt that ended so counts against its sweep's retries when its
    trial goes again (the caller reads `retries` and `used` for `after` only then)."""
    return OUTCOME_MOVES[outcome] in (TrialState.OOM, TrialState.NODE_LOST) and \
        outcome != Outcome.INTERRUPTED


def retries_spent(retries: int | str, used: int, sweep: str) -> Optional[Fail]:
    """A Fail when no retry is left (`retries` text: why they cannot be read), else None."""
    if isinstance(retries, str):
        why = f"sweep {sweep}: reading it from state.db: {retries}"
        return Fail(why, why)
    if used > retries:
        return Fail(f"retries spent ({used} attempts, retries: {retries})", "retries spent")
    return None


def shared_oom(last: Optional[Attempt], node: Optional[NodeInfo],
               own_budget_gb: Optional[float]) -> bool:
    """Whether a trial's last attempt ran out of memory under less than it would
    have had alone on its `node` (sharing it): the prediction it was held to was
    low. Alone means the node's memory, or the job's own `memory.budget_gb` where
    that is smaller: a trial held to its own budget was not sharing. A node no
    longer up says nothing."""
    if not (last and last.outcome == Outcome.OOM and node and last.budget_gb is not None):
        return False
    alone = min(node.memory_gb, own_budget_gb) if own_budget_gb else node.memory_gb
    return last.budget_gb < alone - 1e-9


def broke_on(last: Optional[Attempt]) -> tuple[str, ...]:
    """The node(s) a trial's last attempt ended on as lost or with its agent failing
    (a retry goes elsewhere where it can); all of them for an attempt on several."""
    if last and last.outcome in (Outcome.NODE_LOST, Outcome.AGENT_ERROR):
        return tuple(attempt_nodes(last.node))
    return ()


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def ranks_ended(attempt: int, ends: list[tuple[int, str, AttemptResult]]) -> AttemptResult:
    """How an attempt on several nodes ended, from its ranks' ends ((rank, node,
    result) in the order they came): every rank succeeded, rank 0's result (it
    alone wrote the adapter); else the first rank to end otherwise, named (its
    peers' ends follow from it: a lost ring, or the head cancelling them), or
    cancelled if each was; a rank that lost its ring counts only when no other
    rank failed. Its peak is the highest rank's."""
    peak = max((r.peak_gb or 0.0 for _, _, r in ends), default=0.0) or None
    last = max((r.ended or 0.0 for _, _, r in ends), default=0.0) or None
    if all(r.outcome == Outcome.SUCCEEDED for _, _, r in ends):
        first = next(r for rank, _, r in ends if rank == 0)
        return first.model_copy(update={"peak_gb": peak, "ended": last})
    failed = [(rank, node, r) for rank, node, r in ends
              if r.outcome not in (Outcome.SUCCEEDED, Outcome.CANCELLED)]
    # a rank that lost its ring (EXIT_RANK_LOST) ended because another did: that
    # other is the cause, whichever end reached the head first
    cause = next((e for e in failed if e[2].exit_code != EXIT_RANK_LOST), None) or \
        next(iter(failed), None)
    if cause is None:
        return AttemptResult(attempt=attempt, outcome=Outcome.CANCELLED, message="cancelled",
                             peak_gb=peak, ended=last)
    rank, node, r = cause
    return r.model_copy(update={"attempt": attempt, "node": node, "peak_gb": peak, "ended": last,
                                "message": f"rank {rank} on {node}: {r.message}",
                                "adapter": {}, "best_adapter": {}})
