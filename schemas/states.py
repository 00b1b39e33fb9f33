"""Where trials, sweeps, attempts and tunes stand, and the moves between: plain
enums and tables (stdlib only), so the CLI can name them without loading the
message schemas (schemas/records.py re-exports every name here).

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
