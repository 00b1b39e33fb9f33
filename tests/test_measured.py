"""The measured memory model without Ray: the engine's probe runs on a real tiny
model (real peaks, real guard), the fit and its held-out error on those
measurements, the planner's choice from a measured model, the plan table in
real Parquet files, and `segctl tune`'s refusals of bad input."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from segctl.engine.measure import synthetic_row
from segctl.orchestrator import measured, planner
from segctl.orchestrator.stores import Stores
from segctl.schemas.job import JobSpec
from segctl.schemas.records import ProbeSpec

from .conftest import assert_one_line_error, probe_fresh, segctl

# Lengths where the tiny model's peaks are mostly its terms, not allocator rounding:
# at 192 tokens one 131 KB buffer freed earlier or later moved the smallest peak
# by 1% from run to run, on top of 8% of leave-one-out extrapolation to that corner.
GRID = [(L, s) for L in (256, 512, 1024) for s in (1, 2, 4)]
OFF_GRID = [(384, 3), (768, 3), (768, 1), (384, 4)]


def _probe(model: str, points, budget: float = 100.0, **kw) -> list[dict]:
    folder = Path(model).parent
    return probe_fresh(ProbeSpec(model=model, budget_gb=budget, points=points, steps=2, **kw),
                       folder)


def _rows(events: list[dict], node_class: str = "sim/1GB") -> list[dict]:
    """Probe events as plan-table rows (what the head files)."""
    return [dict(tune="t1", time=time.time(), model_name="m", n_layers=4, method="sft",
                 node_class=node_class, node="n", chip="sim", budget_gb=1.0, lora_rank=8,
                 lora_layers=-1, lora_keys="", head_chunk=512, attn_block=2048,
                 seq_len=e["seq_len"], segment_size=e["segment_size"], fits=e["fits"],
                 peak_gb=e["peak_gb"], phases=[l for l, _ in e["phases"]],
                 phase_peaks=[p for _, p in e["phases"]], step_s=e["step_s"], steps=e["steps"],
                 message=e["message"]) for e in events]


@pytest.fixture(scope="module")
def probed(demo_dir):
    model = str(demo_dir / "model")
    return model, _probe(model, GRID), _probe(model, OFF_GRID)


def _fit(events) -> measured.MemoryModel:
    return measured.models_of(_rows(events))[("sft", "sim/1GB", 512, 2048, "")]


@pytest.mark.slow   # `probed`: the demo probed at every grid point, 7 s
def test_probes_measure_every_point_with_each_phases_own_peak(probed):
    _, grid, _ = probed
    assert [(e["seq_len"], e["segment_size"]) for e in grid] == GRID
    for e in grid:
        labels = [l for l, _ in e["phases"]]
        assert e["fits"] and e["steps"] == 2 and e["step_s"] > 0
        assert labels[-1] == "update" and "head" in labels and "fwd0" in labels and "bwd0" in labels
        assert max(p for _, p in e["phases"]) == pytest.approx(e["peak_gb"], abs=2e-6)
    peak = {(e["seq_len"], e["segment_size"]): e["peak_gb"] for e in grid}
    # memory grows with the length and with the segment size
    for L, s in GRID:
        if s > 1:
            assert peak[(L, s)] > peak[(L, s // 2)]
        if L > GRID[0][0]:
            assert peak[(L, s)] > peak[(L // 2, s)]


@pytest.mark.slow   # `probed`: the demo probed at every grid point, 7 s
def test_the_fit_predicts_held_out_and_unprobed_points_within_ten_percent(probed):
    _, grid, off = probed
    model = _fit(grid)
    loo = measured.held_out(model)
    assert len(loo) == len(GRID)
    assert max(abs(r["error"]) for r in loo) <= 0.10, loo
    for e in off:   # lengths and sizes the grid never probed
        assert model.gap(e["seq_len"]) is None
        err = model.predict(e["seq_len"], e["segment_size"]) / e["peak_gb"] - 1
        assert abs(err) <= 0.10, (e["seq_len"], e["segment_size"], err)


@pytest.mark.slow   # `probed`: the demo probed at every grid point, 7 s
def test_a_point_the_guard_stops_is_a_measured_does_not_fit(demo_dir, probed):
    _, grid, _ = probed
    peak = {(e["seq_len"], e["segment_size"]): e["peak_gb"] for e in grid}
    budget = (peak[(512, 1)] + peak[(512, 2)]) / 2
    events = _probe(str(demo_dir / "model"), [(512, 1), (512, 2), (1024, 1)], budget=budget)
    fits = {(e["seq_len"], e["segment_size"]): e for e in events}
    assert fits[(512, 1)]["fits"]
    for p in ((512, 2), (1024, 1)):
        e = fits[p]
        assert not e["fits"] and e["step_s"] is None and e["steps"] == 0
        assert e["peak_gb"] >= budget and "crossed memory.budget_gb" in e["message"]


def test_synthetic_rows_have_the_planners_length():
    import random
    job = {"sft": JobSpec(model="m", data={"train": "-"}, train={"iters": 1}),
           "orpo": JobSpec(model="m", method="orpo", data={"train": "-"}, train={"iters": 1}),
           "orpo-2": JobSpec(model="m", method="orpo", data={"train": "-"}, train={"iters": 1},
                             orpo={"prefix_shared": False})}
    for L in (2, 7, 100, 513):
        for name, j in job.items():
            row = synthetic_row(j.method, L, 50, j.orpo.prefix_shared, random.Random(0))
            assert planner.row_tokens(row, j) == L, (name, L)


# ---------------------------------------------------------------- the planner's choice

def _model(events, **kw):
    return measured.fit([measured.point_of(r) for r in _rows(events)], n_layers=4,
                        head_chunk=512, attn_block=2048, lora_rank=8, lora_layers=-1, **kw)


def _job(**memory) -> JobSpec:
    return JobSpec(model="m", data={"train": "-"}, train={"iters": 1},
                   memory={"segment_size": "auto", **memory})


def _info(demo_dir):
    return planner.model_info(str(demo_dir / "model"))


@pytest.mark.slow   # `probed`: the demo probed at every grid point, 7 s
def test_auto_takes_the_fastest_size_that_fits_the_measured_model(demo_dir, probed):
    _, grid, _ = probed
    # equal step times: no size is faster, so auto takes the largest that fits
    # (the next test lets the times decide)
    model = _model([dict(e, step_s=1.0) for e in grid])
    info = _info(demo_dir)
    peak = {(e["seq_len"], e["segment_size"]): e["peak_gb"] for e in grid}
    # room for size 2 at 1024 tokens but not size 4 (the fitted curve is at least the measured peak)
    budget = (peak[(1024, 2)] * 1.05 + peak[(1024, 4)] * 0.95) / 2 / 0.85
    p = planner.plan(info, _job(), seq_len=1024, budget_gb=budget, measured=model)
    assert p.fits and p.source == "measured" and p.segment_size == 2, p.reason
    assert "measured" in p.reason and p.predicted_gb <= budget * 0.85
    # the same job without measurements: the analytic estimate, and it says so
    q = planner.plan(info, _job(), seq_len=1024, budget_gb=budget)
    assert q.source == "analytic" and "not tuned" in q.reason
    # rows over twice the longest probe (and not yet blocked): back to the estimate
    r = planner.plan(info, _job(), seq_len=2049, budget_gb=budget, measured=model)
    assert r.source == "analytic" and "longest probe" in r.reason


@pytest.mark.slow   # `probed`: the demo probed at every grid point, 7 s
def test_measured_times_pick_the_fastest_and_near_ties_go_to_the_larger_size(demo_dir, probed):
    _, grid, _ = probed
    info = _info(demo_dir)

    def with_times(fast: int):
        # the same peaks; step times that make `fast` clearly the fastest size
        timed = [dict(e, step_s=1.0 if e["segment_size"] == fast else 2.0) for e in grid]
        return _model(timed)

    for fast in (1, 2, 4):
        p = planner.plan(info, _job(), seq_len=512, budget_gb=10.0, measured=with_times(fast))
        assert p.segment_size == fast, p.reason
    flat = _model([dict(e, step_s=1.0) for e in grid])
    p = planner.plan(info, _job(), seq_len=512, budget_gb=10.0, measured=flat)
    assert p.segment_size == 4 and "fastest" in p.reason


@pytest.mark.slow   # `probed`: the demo probed at every grid point, 7 s
def test_a_stopped_probe_keeps_its_point_and_larger_ones_out_of_every_plan(demo_dir, probed):
    _, grid, _ = probed
    info = _info(demo_dir)
    budget = 10.0
    # pretend the guard stopped (512, 2) on this class: every plan at >= 512 tokens
    # must stay at size 1 whatever the fit says
    stopped = [dict(e, fits=False, peak_gb=budget, step_s=None)
               if (e["seq_len"], e["segment_size"]) == (512, 2) else dict(e, step_s=1.0)
               for e in grid]
    model = _model(stopped)
    for L in (512, 700, 1024):
        p = planner.plan(info, _job(), seq_len=L, budget_gb=budget, measured=model)
        assert p.fits and p.segment_size == 1, (L, p.reason)
    assert planner.plan(info, _job(), seq_len=300, budget_gb=budget,
                        measured=model).segment_size == 4


@pytest.mark.slow   # `probed`: the demo probed at every grid point, 7 s
def test_a_different_lora_rank_is_adjusted_not_refitted(demo_dir, probed):
    _, grid, _ = probed
    model = _model(grid)
    info = _info(demo_dir)
    at = lambda rank: planner.plan(info, _job(segment_size=2).model_copy(
        update={"lora": _job().lora.model_copy(update={"rank": rank})}),
        seq_len=512, budget_gb=10.0, measured=model).predicted_gb
    assert at(8) == pytest.approx(model.predict(512, 2), abs=1e-4)
    extra = planner.LORA_COPIES * 4 * planner._lora_params(info, 8, info.n_layers) / 1e9
    assert at(16) - at(8) == pytest.approx(extra, abs=2e-4)


# ---------------------------------------------------------------- the fit itself

def test_nnls_recovers_a_nonnegative_solution_and_clips_a_negative_one():
    rng = np.random.default_rng(0)
    A = rng.uniform(0.1, 1.0, size=(30, 4))
    x = np.array([0.5, 0.0, 2.0, 1.0])
    assert np.allclose(measured.nnls(A, A @ x), x, atol=1e-8)
    y = A @ np.array([1.0, -1.0, 0.5, 0.2])
    got = measured.nnls(A, y)
    assert (got >= 0).all()
    free = np.linalg.lstsq(A, y, rcond=None)[0]
    assert np.linalg.norm(A @ got - y) >= np.linalg.norm(A @ free - y) - 1e-9


def test_a_model_of_a_known_formula_is_exact():
    n = 8

    def truth(L, s):   # terms of each kind the fit has; the peak grows with L and s
        b = -(-n // s)
        return {"fwd": 1.0 + 1e-7 * L * b + 2e-9 * L * L, "head": 1.0 + 1e-7 * L * b,
                "bwd": 1.0 + 1e-7 * L * b + 3e-9 * (s + 1) * L * L + 1e-6 * (s + 1) * L,
                "update": 1.0}
    pts = [measured.Point(L, s, True, max(truth(L, s).values()), truth(L, s), 0.1 * L / 1000)
           for L in (500, 1000, 2000) for s in (1, 2, 4, 8)]
    m = measured.fit(pts, n_layers=n, head_chunk=512, attn_block=4096, lora_rank=8,
                     lora_layers=-1)
    assert max(abs(r["error"]) for r in measured.held_out(m)) < 1e-6
    assert m.predict(1500, 3) == pytest.approx(max(truth(1500, 3).values()), rel=1e-6)
    # too few points or a single length is not a model
    few = measured.fit(pts[:3], n_layers=n, head_chunk=512, attn_block=4096, lora_rank=8,
                       lora_layers=-1)
    assert few.gap(1000) is not None


@pytest.mark.slow   # `probed`: the demo probed at every grid point, 7 s
def test_the_plan_table_keeps_every_point_and_reads_the_latest(tmp_path, probed):
    _, grid, _ = probed
    stores = Stores(tmp_path)
    rows = _rows(grid[:3])
    for r in rows:
        stores.put_probe("m-key", r)
    again = dict(rows[0], tune="t2", time=rows[0]["time"] + 10, peak_gb=0.5)   # --force
    stores.put_probe("m-key", again)
    got = measured.read_plan(tmp_path, "m-key")
    assert len(got) == 3
    first = next(r for r in got if (r["seq_len"], r["segment_size"]) == (256, 1))
    assert first["tune"] == "t2" and first["peak_gb"] == 0.5
    files = list((tmp_path / "telemetry" / "plan" / "model=m-key").glob("*.parquet"))
    assert len(files) == 4   # nothing overwritten
    assert measured.read_plan(tmp_path, "other") == []
    with pytest.raises(ValueError, match="unknown column"):
        stores.put_probe("m-key", dict(rows[0], bogus=1))


# ---------------------------------------------------------------- the CLI's refusals

@pytest.mark.parametrize("args,fragments", [
    ((), ("--model",)),
    (("--model", "{model}", "--seq-lens", "1024,x"), ("--seq-lens", "'x'")),
    (("--model", "{model}", "--seq-lens", "1"), ("--seq-lens", ">= 2")),
    (("--model", "{model}", "--seq-lens", "64", "--segment-sizes", "0"), ("--segment-sizes",)),
    (("--model", "{missing}", "--seq-lens", "64"), ("model folder not found",)),
    (("--model", "{model}", "--seq-lens", "64", "--job", "{missing}.yaml"), ("not found",)),
])
def test_tune_refuses_bad_input_in_one_line(demo_dir, tmp_path, args, fragments):
    args = [a.format(model=demo_dir / "model", missing=tmp_path / "nope") for a in args]
    if "--seq-lens" not in args:
        args += ["--seq-lens", "64"]
    proc = segctl("tune", *args, env={"SEGCTL_HOME": tmp_path / "home"})
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "home").exists()   # refused before any fleet came up
