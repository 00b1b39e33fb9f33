"""Fair share: how the fleet is shared between sweeps (and so between the people
who submit them): which sweep's pending trial a free node goes to next, and why a
trial the head did not get to waits. Plain functions over what the head knows in a
turn; no Ray, no state.db. (Early stopping, the sweep key `scheduler:`, is asha.py.)

- A higher `priority` goes first: its pending trials are tried on the free nodes
  before any of a lower priority; a lower one takes only what they cannot use.
  Nothing running is preempted: a higher priority waits for a node to free.
- Among sweeps of equal priority, weighted fair share: the next free node goes to
  the sweep with the fewest running attempts per unit of its `share` (ties: the one
  served least recently, then the oldest), so none starves another; shares 3 and 1
  hold 3:1 of what they run.
- Within a sweep, trials go in their order (the head skips one that fits no free
  node now and tries the next), under the sweep's concurrency cap.

Usage is running attempts, not node-seconds used: it needs no history (a restarted
head derives it from state.db), a sweep submitted later is not owed the time an
earlier one ran alone (it gets its share from the next free node on, not the whole
fleet until the accounts even out), and trials of one sweep take similar times, so
what a sweep runs at once is what it gets over time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Contender:
    """A running sweep in one turn's placement."""
    sweep: str
    priority: int
    share: float
    created: float
    running: int                 # its trials placed or running (their attempts hold nodes)
    pending: int                 # its pending trials this turn
    cap: Optional[int] = None    # its concurrency
    served: int = 0              # when it last got a node (the head's count of placements)
    tried: int = 0               # of its pending trials, how many this turn tried to place
    placed: int = 0              # ... and placed

    @property
    def usage(self) -> float:
        return self.running / self.share

    @property
    def capped(self) -> bool:
        return self.cap is not None and self.running >= self.cap

    def open(self) -> bool:
        """Whether it has a trial still to try this turn."""
        return self.tried < self.pending and not self.capped


def next_sweep(sweeps: list[Contender]) -> Contender | None:
    """The sweep whose next pending trial is tried on the free nodes; None when every
    sweep has tried all it may."""
    return min((s for s in sweeps if s.open()),
               key=lambda s: (-s.priority, s.usage, s.served, s.created), default=None)


def why_waiting(s: Contender, sweeps: list[Contender], *, nodes: int, slots: int) -> str:
    """Why the pending trials of `s` that this turn did not try wait: its cap, or no
    free node was left for them (`nodes` alive, with `slots` attempts at once in all)
    and who is ahead of them for the next one."""
    if not nodes:
        return "no node alive"
    if s.capped:
        return f"sweep concurrency cap ({s.running} running)"
    ahead = [h for h in sweeps if h.priority > s.priority and h.pending > h.placed
             and not h.capped]
    if ahead:
        h = min(ahead, key=lambda h: (-h.priority, h.created))
        return f"waiting behind priority {h.priority} sweep {h.sweep}"
    over = [y for y in sweeps if y.priority == s.priority and y.usage > s.usage]
    if over:
        y = max(over, key=lambda y: (y.usage, -y.created))
        what = "nodes" if slots == nodes else "slots"
        return f"waiting for its fair share (sweep {y.sweep} has {y.running} of {slots} {what})"
    return "waiting for a free node"
