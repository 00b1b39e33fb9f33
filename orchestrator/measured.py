"""The measured memory model: what `segctl tune` probed, fitted per model, method
and node class, so the planner predicts from measurements where it has them.

A step's peak is the highest of its phases' own peaks (engine/train.measured_step),
and each phase grows with the sequence length L and the segment size s in its own
way, so each is fitted apart, by non-negative least squares on the terms the
engine's memory is made of (orchestrator/planner.py spells them out):

  forward   resident + boundaries + one layer's forward     1, L*b, L, L^2
  head      resident + boundaries + one chunk of logits     1, L*b, min(L, head_chunk)
  backward  ... + a segment's activations, one layer's       1, L*b, (s+1)*L, (s+1)*L^2
            backward transients
  update    resident + the optimizer's temporaries          1, L

with b = ceil(n_layers / s) boundaries kept. Rows longer than attn_block take the
blocked attention backward, another shape: a second regime, fitted apart. A
prediction is the highest phase prediction, and never less than what a point
probed at a length and size no larger measured (memory only grows with both),
which also keeps every measured "does not fit" out of the plans.

Step time is not fitted: it is read off the probes of each size, interpolated
over length, so `auto` prefers the size measured fastest (larger segments skip
boundaries, but a larger graph can cost more; which wins differs by machine).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from segctl.schemas import store_rows as sr

GROUPS = ("fwd", "head", "bwd", "update")
EXTRAPOLATE = 2.0    # predict rows up to this many times the longest probed row of a regime
MIN_POINTS = 4       # fitting points a regime needs (at 2+ lengths and 2+ sizes)


@dataclass(frozen=True)
class Point:
    seq_len: int
    segment_size: int
    fits: bool
    peak_gb: float
    groups: dict          # phase group -> its highest phase peak (GB)
    step_s: float | None


def group_of(label: str) -> str:
    """fwd3, rejected.bwd0, head, update -> fwd, bwd, head, update; DPO's ref (its
    reference forward, one layer at a time without gradients) -> fwd."""
    if label == "ref":
        return "fwd"
    label = label.removeprefix("rejected.")
    for g in ("fwd", "bwd"):
        if label.startswith(g):
            return g
    return label


def point_of(row: dict) -> Point:
    groups: dict[str, float] = {}
    for label, peak in zip(row.get("phases") or [], row.get("phase_peaks") or []):
        g = group_of(label)
        groups[g] = max(groups.get(g, 0.0), peak)
    return Point(int(row["seq_len"]), int(row["segment_size"]), bool(row["fits"]),
                 float(row["peak_gb"]), groups, row.get("step_s"))


@dataclass
class MemoryModel:
    """Peak and step time of one model, method and node class, from its probes."""
    n_layers: int
    head_chunk: int
    attn_block: int
    lora_rank: int        # the LoRA the probes ran with (the planner adjusts for another)
    lora_layers: int
    points: list[Point]
    tune: str = ""
    coef: dict = field(default_factory=dict)     # (regime, group) -> coefficients
    longest: dict = field(default_factory=dict)  # regime -> longest fitting probe

    def regime(self, seq_len: int) -> str:
        # the engine blocks a stream of seq_len - 1 inputs (planner._peak_bytes's rule)
        return "blocked" if 0 < self.attn_block < seq_len - 1 else "full"

    def lengths(self, seq_len: int) -> list[int]:
        """The lengths whose peaks bound rows of up to seq_len tokens: a row just short
        enough to skip the blocked backward can need more than a longer one."""
        if self.regime(seq_len) == "blocked":
            return [seq_len, self.attn_block + 1]
        return [seq_len]

    def gap(self, seq_len: int) -> str | None:
        """Why rows of seq_len tokens are outside what was measured; None if inside."""
        for L in self.lengths(seq_len):
            r = self.regime(L)
            if r not in self.longest:
                what = f"rows over attn_block {self.attn_block}" if r == "blocked" else \
                       f"rows up to attn_block {self.attn_block}"
                return f"no fitted probes of {what}"
            if L > EXTRAPOLATE * self.longest[r]:
                return f"{L} tokens is over {EXTRAPOLATE:g}x the longest probe ({self.longest[r]})"
        return None

    def predict(self, seq_len: int, segment_size: int) -> float:
        """Predicted peak GB (call `gap` first: outside it this extrapolates blindly)."""
        s = min(segment_size, self.n_layers)
        fitted = max(float(np.dot(_features(g, L, s, self.n_layers, self.head_chunk),
                                  self.coef[(self.regime(L), g)]))
                     for L in self.lengths(seq_len) for g in GROUPS
                     if (self.regime(L), g) in self.coef)
        floor = max((p.peak_gb for p in self.points
                     if p.seq_len <= seq_len and min(p.segment_size, self.n_layers) <= s),
                    default=0.0)
        return max(fitted, floor)

    def step_s(self, seq_len: int, segment_size: int) -> float | None:
        """Measured seconds per step at this size, interpolated between the probed
        lengths (the nearest one's outside them); None when the size was not probed."""
        s = min(segment_size, self.n_layers)
        timed = sorted((p.seq_len, p.step_s) for p in self.points
                       if p.fits and p.step_s and min(p.segment_size, self.n_layers) == s)
        if not timed:
            return None
        return float(np.interp(seq_len, [L for L, _ in timed], [t for _, t in timed]))

    def measured(self, seq_len: int, segment_size: int) -> Point | None:
        return next((p for p in self.points
                     if p.seq_len == seq_len and p.segment_size == segment_size), None)


def fit(points: list[Point], *, n_layers: int, head_chunk: int, attn_block: int,
        lora_rank: int, lora_layers: int, tune: str = "") -> MemoryModel:
    """The model of `points` (every probe of one model, method and class)."""
    m = MemoryModel(n_layers, head_chunk, attn_block, lora_rank, lora_layers, list(points), tune)
    for regime in ("full", "blocked"):
        good = [p for p in points if p.fits and m.regime(p.seq_len) == regime]
        if (len(good) < MIN_POINTS or len({p.seq_len for p in good}) < 2
                or len({min(p.segment_size, n_layers) for p in good}) < 2):
            continue
        for g in GROUPS:
            have = [p for p in good if g in p.groups]
            if have:
                m.coef[(regime, g)] = _nnls_fit(
                    [_features(g, p.seq_len, min(p.segment_size, n_layers), n_layers, head_chunk)
                     for p in have], [p.groups[g] for p in have])
        if not any(r == regime for r, _ in m.coef):
            continue
        m.longest[regime] = max(p.seq_len for p in good)
    return m


def held_out(model: MemoryModel) -> list[dict]:
    """Leave-one-out: each fitting probe predicted by the model fitted on the others
    (skipped where the others do not cover it). Rows: seq_len, segment_size,
    measured_gb, predicted_gb, error (predicted / measured - 1)."""
    rows = []
    for i, p in enumerate(model.points):
        if not p.fits:
            continue
        others = fit(model.points[:i] + model.points[i + 1:], n_layers=model.n_layers,
                     head_chunk=model.head_chunk, attn_block=model.attn_block,
                     lora_rank=model.lora_rank, lora_layers=model.lora_layers)
        if others.gap(p.seq_len):
            continue
        # the held-out point's own row is gone, so its floor is too: this is the fit
        pred = others.predict(p.seq_len, p.segment_size)
        rows.append(dict(seq_len=p.seq_len, segment_size=p.segment_size, measured_gb=p.peak_gb,
                         predicted_gb=round(pred, 6), error=round(pred / p.peak_gb - 1, 4)))
    return rows


# ---------------------------------------------------------------- the plan table

# What a probe's figures depend on besides (seq_len, segment_size); LoRA rank and
# layers only change the resident LoRA state, which the planner adjusts for.
MatchKey = tuple   # (method, node_class, head_chunk, attn_block, lora_keys)


def match_key(row: dict) -> MatchKey:
    return (row["method"], row["node_class"], int(row["head_chunk"]), int(row["attn_block"]),
            row.get("lora_keys") or "")


def read_plan(root: Path, model_key: str) -> list[dict]:
    """The plan table's rows of one model, the latest of each point."""
    folder = Path(root) / sr.TELEMETRY / sr.PLAN_TABLE / f"model={model_key}"
    # not a hidden one: a write cut short by a crash (schemas.atomic's temp name)
    files = sorted(f for f in folder.glob("*.parquet")
                   if not f.name.startswith(".")) if folder.is_dir() else []
    if not files:
        return []
    import pyarrow.parquet as pq
    latest: dict[tuple, dict] = {}
    for f in files:
        for row in pq.read_table(f, schema=sr.PLAN).to_pylist():
            k = match_key(row) + (row["seq_len"], row["segment_size"])
            if k not in latest or row["time"] >= latest[k]["time"]:
                latest[k] = row
    return sorted(latest.values(), key=lambda r: (match_key(r), r["seq_len"], r["segment_size"]))


def models_of(rows: list[dict]) -> dict[MatchKey, MemoryModel]:
    """One fitted model per match key."""
    by: dict[MatchKey, list[dict]] = {}
    for r in rows:
        by.setdefault(match_key(r), []).append(r)
    out = {}
    for key, rs in by.items():
        last = max(rs, key=lambda r: r["time"])
        out[key] = fit([point_of(r) for r in rs], n_layers=int(last["n_layers"]),
                       head_chunk=key[2], attn_block=key[3], lora_rank=int(last["lora_rank"]),
                       lora_layers=int(last["lora_layers"]), tune=last["tune"])
    return out


def lora_keys_text(keys) -> str:
    return json.dumps(sorted(keys)) if keys else ""


# ---------------------------------------------------------------- fitting

def _features(group: str, L: int, s: int, n_layers: int, head_chunk: int) -> list[float]:
    b = math.ceil(n_layers / s)
    if group == "fwd":
        return [1.0, L * b, L, L * L]
    if group == "head":
        return [1.0, L * b, min(L, head_chunk)]
    if group == "bwd":
        # s layers' saved activations plus one layer's backward transients, which
        # grow like one more layer's: (s + 1) ties the L and L^2 terms to the size,
        # so a class with few probes that fit still pins them down
        return [1.0, L * b, (s + 1) * L, (s + 1) * L * L]
    return [1.0, L]


def _nnls_fit(rows: list[list[float]], target: list[float]) -> np.ndarray:
    """Non-negative least squares (each term only adds memory or time) of the
    relative error: every row is divided by its target, so small rows count as
    much as large ones; columns are scaled to 1 to keep L^2 next to 1
    well-conditioned."""
    y = np.asarray(target, dtype=np.float64)
    A = np.asarray(rows, dtype=np.float64) / np.maximum(y, 1e-12)[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    return nnls(A / scale, np.ones_like(y)) / scale


def nnls(A: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """argmin ||Ax - b|| over x >= 0 (Lawson and Hanson's active-set method)."""
    n = A.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)          # the "passive" set: variables allowed > 0
    tol = 1e-12 * max(1.0, float(np.abs(A).sum()) * float(np.abs(b).max(initial=0.0)))
    for _ in range(max_iter):
        w = A.T @ (b - A @ x)
        if free.all() or not (w[~free] > tol).any():
            break
        free[np.argmax(np.where(free, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            # step back toward x until the first variable hits zero; drop it
            bad = free & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return x
