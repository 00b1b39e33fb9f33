"""What the Controller's two halves (api.py: its requests; placement_turn.py: its
placement turn) share with it, declared for the type checker: the attributes
head.Controller sets in its __init__ and the methods one half calls that the
other or the Controller defines. Nothing here runs: the methods are declared
only while type checking, so they never shadow the real ones in the Controller's
method order."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from segctl.schemas.records import NodeInfo

from .memory_settings import Tuned
from .state import State
from .stores import Stores
from .trackers import HeadStreams


class ControllerBase:
    root: Path
    clock: Callable[[], float]
    state: State
    stores: Stores
    mu: threading.RLock
    wake: threading.Event
    nodes: dict[str, NodeInfo]
    agents: dict[str, Any]               # node -> its agent (a Ray actor handle)
    held: dict[str, dict]                # node -> {attempt (or "tune:ID"): GB it holds}
    inflight: dict[object, Any]          # the ref of an attempt's end time -> its head.Flight
    probing: dict[object, tuple[str, str, str]]
    plans: dict[tuple, Any]
    placements: int
    served: dict[str, int]
    tuned: Tuned
    trackers: HeadStreams
    waiting: dict[str, str]
    waiting_noted: tuple[float, object]

    if TYPE_CHECKING:
        def fault(self, what: str, e: BaseException) -> str: ...
        def guarded(self, what: str, fn: Callable, *args: Any) -> Any: ...
        def reseal(self, sid: str | None = None) -> int: ...
        def dispatch(self, t: Any, d: Any) -> None: ...
        def _maybe_done(self, sid: str) -> None: ...
