"""One job across several machines: data parallel over MLX's distributed ring.

Every rank holds the whole model and the same adapter. A step's rows (the global
batch: train.batch_size x grad_accumulation, in the data order of the whole job)
are dealt out, row k to rank k mod N; each rank runs the segmented step on its
share, which gives the mean loss and gradient over its share's weight (SFT: its
supervised tokens; ORPO, DPO: its rows). One all_sum of [w_r * loss_r, w_r,
w_r * grads_r] over the ranks then gives

    loss = sum_r w_r loss_r / sum_r w_r,   grads = sum_r w_r grads_r / sum_r w_r

which is the single-process step's loss and gradient over the whole batch (its
mean over every token, or every row): the same update on every rank, so the
adapters stay equal without ever being sent. Evals are dealt out the same way
and their sums added. Rank 0 alone writes checkpoints, the adapter and evals.

A rank learns where it stands from MLX's own environment, which whoever starts
the ranks sets (a fleet's agents; a test): MLX_RANK and, for the ring, MLX_HOSTFILE
(a JSON list, per rank, of its "host:port"); for JACCL, MLX_JACCL_COORDINATOR and
MLX_IBV_DEVICES (`ring_environ`). A collective that makes no progress
for `distributed.timeout_s` ends the process (EXIT_RANK_LOST); a ring that does
not form in that time, SIGALRM: a rank whose peer is gone never hangs, and its
attempt ends as a lost node does.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from segctl.schemas.errors import UserError
from segctl.schemas.job import DistributedSpec
from segctl.schemas.names import EXIT_RANK_LOST

RANK_ENV, HOSTFILE_ENV = "MLX_RANK", "MLX_HOSTFILE"
# JACCL (RDMA over Thunderbolt 5): rank 0's "ip:port", where the ranks meet first, and
# a JSON file, per rank, of its RDMA device to each other rank (null for itself)
COORDINATOR_ENV, DEVICES_ENV = "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES"


class RingError(UserError, RuntimeError):
    """This process cannot take its place in the job's ring (one line)."""


class RankLost(RuntimeError):
    """A collective failed because a peer is gone (its process, host or link)."""


@dataclass(frozen=True)
class Ring:
    group: Any          # mx.distributed.Group
    rank: int
    size: int
    timeout_s: float


def writes(ring: Ring | None) -> bool:
    """Whether this process writes what the job leaves: on one node it does; of a
    ring, rank 0 alone."""
    return ring is None or ring.rank == 0


def join(spec: DistributedSpec, environ=os.environ) -> Ring | None:
    """This process's place in the job's ring; None for a job on one node."""
    if spec.nodes == 1:
        return None
    jaccl = spec.backend == "jaccl"
    needs = [RANK_ENV] + ([COORDINATOR_ENV, DEVICES_ENV] if jaccl else [HOSTFILE_ENV])
    missing = [k for k in needs if not environ.get(k)]
    if missing:
        raise RingError(f"distributed.nodes: {spec.nodes}: this process is not one of a ring "
                        f"({' and '.join(missing)} unset): run one `segctl train` per node with "
                        f"MLX_RANK=0..{spec.nodes - 1}"
                        + (" and MLX_JACCL_COORDINATOR (rank 0's ip:port) and MLX_IBV_DEVICES (a "
                           "JSON file of every rank's RDMA device to every other)" if jaccl else
                           " and MLX_HOSTFILE naming every rank's host:port"))
    try:
        with _alarm(spec.timeout_s):
            group = mx.distributed.init(strict=True, backend=spec.backend)
    except Exception as e:   # MLX says which peer or file it could not reach
        raise RingError(f"distributed: the {spec.backend} ring did not form: {e}") from None
    if group.size() != spec.nodes:
        raise RingError(f"distributed.nodes: {spec.nodes}, but the ring has {group.size()} ranks")
    return Ring(group=group, rank=group.rank(), size=group.size(), timeout_s=spec.timeout_s)


def ring_environ(rank: int, hostfile: str, devices: str | None = None) -> dict[str, str]:
    """MLX's environment for rank `rank` of a ring whose hostfile (a JSON list of
    every rank's ["host:port"], rank 0 first) is `hostfile`; with `devices`, JACCL's
    device file, the environment of a JACCL rank instead, its coordinator rank 0's
    address from the hostfile."""
    if devices is None:
        return {RANK_ENV: str(rank), HOSTFILE_ENV: hostfile}
    with open(hostfile, encoding="utf-8") as f:
        first = json.load(f)[0][0]
    return {RANK_ENV: str(rank), COORDINATOR_ENV: first, DEVICES_ENV: devices}


def same_start(ring: Ring | None, step: int) -> None:
    """Every rank resumes from the same step (each needs the same checkpoint), or
    RingError: ranks a step apart would wait on each other's collectives."""
    if ring is not None and add_up(ring, [step, step * step]) != [ring.size * step,
                                                                 ring.size * step * step]:
        raise RingError("distributed: the ranks resume from different steps (each needs the "
                        "same checkpoint)")


def share(rows: list, ring: Ring | None) -> list:
    """This rank's rows of a step (all of them on one node): row k to rank k mod N."""
    return rows if ring is None else rows[ring.rank::ring.size]


def reduce_step(ring: Ring, loss: mx.array, grads: dict[str, mx.array],
                weight: float) -> tuple[mx.array, dict[str, mx.array], dict]:
    """The whole batch's loss and gradients from this rank's (means over its share's
    `weight`), and what the reduction cost: {allreduce_s, allreduce_bytes}. One
    all_sum of one float32 vector: fewer, larger messages than one per tensor."""
    names = list(grads)
    w = mx.array([float(weight)], dtype=mx.float32)
    flat = mx.concatenate([mx.reshape(loss.astype(mx.float32), (1,)) * w, w]
                          + [mx.reshape(grads[n].astype(mx.float32), (-1,)) * w for n in names])
    mx.eval(flat)
    tic = time.perf_counter()
    with collective(ring, "the step's all_sum"):
        total = mx.distributed.all_sum(flat, group=ring.group)
        mx.eval(total)
    seconds = time.perf_counter() - tic
    whole = total[1]
    out, at = {}, 2
    for n in names:
        g = grads[n]
        out[n] = (total[at:at + g.size] / whole).reshape(g.shape).astype(g.dtype)
        at += g.size
    return (total[0] / whole).astype(loss.dtype), out, {"allreduce_s": seconds,
                                                        "allreduce_bytes": flat.nbytes}


def add_up(ring: Ring | None, values: list[float]) -> list[float]:
    """`values` summed over the ranks (an eval's loss and weight); as they are on
    one node."""
    if ring is None:
        return values
    with collective(ring, "the eval's all_sum"):
        total = mx.distributed.all_sum(mx.array(values, dtype=mx.float32), group=ring.group)
        mx.eval(total)
    return np.array(total, dtype=np.float64).tolist()


@contextmanager
def collective(ring: Ring, what: str):
    """Run a collective: a peer that is gone ends it as RankLost (MLX's ring says so
    when the link breaks) or, when nothing comes back at all, the watchdog ends
    the process after the ring's timeout."""
    where = f"{what} on rank {ring.rank} of {ring.size}"
    try:
        with watchdog(ring.timeout_s, where):
            yield
    except RuntimeError as e:
        raise RankLost(f"distributed: {where} failed, a rank is gone ({e})") from None


@contextmanager
def _alarm(timeout_s: float):
    """A peer that never comes leaves MLX's ring set-up waiting for ever, holding
    Python's lock, so no thread of ours can act: the kernel ends the process
    instead (SIGALRM, its default action) when `timeout_s` passes. A process that
    is not its main thread cannot set the alarm and joins without it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(timeout_s)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@contextmanager
def watchdog(timeout_s: float, what: str):
    """Ends the process (EXIT_RANK_LOST, a line on stderr) when what runs inside has
    not returned in `timeout_s`: a collective whose peer is gone or cut off, which
    waiting longer does not bring back."""
    def give_up() -> None:
        print(f"distributed: {what} made no progress in {timeout_s:g} s: a rank is gone or cut "
              "off", file=sys.stderr, flush=True)
        os._exit(EXIT_RANK_LOST)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
