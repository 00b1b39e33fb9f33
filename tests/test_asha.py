"""ASHA early stopping for sweeps (`scheduler: {type: asha, ...}`): the sweep spec's
checks, and the controller's decisions at the rungs, driven turn by turn with the
fake nodes, agents and clock of test_head_isolation (no Ray), over the real
state.db in tmp_path and the real planner on the demo model's facts.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import yaml

from segctl.orchestrator.asha import asha_cutoff
from segctl.orchestrator.head import Controller
from segctl.orchestrator.views import console, trials_table
from segctl.schemas.errors import SpecError
from segctl.schemas.records import AttemptResult, AttemptSpec
from segctl.schemas.search import SchedulerSpec
from segctl.schemas.states import Outcome, SweepState, TrialState
from segctl.schemas.sweep import load_sweep
from tests.conftest import assert_one_line_error, segctl
from tests.test_controller import live, payload, reasons, sweep_of  # noqa: F401 (fixture)
from tests.test_head_isolation import World, adapter_dir, sweep_state, trials  # noqa: F401

# grace 4, reduction 3, max 36: decisions at steps 4 and 12
ASHA = {"type": "asha", "metric": "val_loss", "grace_steps": 4, "reduction": 3, "max_steps": 36}


# ------------------------------------------------------------------ the spec

def test_rungs_are_grace_steps_times_powers_of_reduction_below_max_steps():
    assert SchedulerSpec.model_validate(ASHA).rungs() == [4, 12]
    assert SchedulerSpec(type="asha", grace_steps=1, reduction=2, max_steps=8).rungs() == [1, 2, 4]
    assert SchedulerSpec(type="asha", grace_steps=5, max_steps=6).rungs() == [5]


def test_cutoff_is_the_top_one_over_reduction_quantile():
    r = random.Random(0)
    for n in range(1, 12):
        for reduction in (2, 3, 4):
            xs = [r.uniform(0, 5) for _ in range(n)]
            assert asha_cutoff(xs, reduction) == pytest.approx(np.percentile(xs, 100 / reduction))
    assert asha_cutoff([3.0, 1.0, 2.0], 3) == pytest.approx(1 + 2 / 3)


def sweep_file(tmp_path, demo_dir, scheduler, **extra):
    """A sweep over the demo job (300 iters, eval_every 50, a validation set)."""
    doc = {"name": "asha", "base": str(demo_dir / "job.yaml"), **extra, "scheduler": scheduler}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


GOOD = {"type": "asha", "metric": "val_loss", "grace_steps": 50, "reduction": 3, "max_steps": 300}
BAD = [
    ({"type": "hyperband"}, "scheduler.type: "),
    ({"metric": "loss"}, "scheduler.metric: "),
    ({"grace_steps": 0}, "scheduler.grace_steps: "),
    ({"reduction": 1}, "scheduler.reduction: "),
    ({"grace_steps": 300}, "scheduler: max_steps (300) must be more than grace_steps (300)"),
    ({"patience": 2}, "scheduler.patience: "),
    ({"grace_steps": 75}, "scheduler.grace_steps: asha needs train.eval_every to divide "
                          "grace_steps (75)"),
    ({"max_steps": 200}, "scheduler.max_steps: must equal train.iters of every trial; trial t000 "
                         "has train.iters 300"),
]


@pytest.mark.parametrize("change, fragment", BAD)
def test_a_bad_scheduler_is_one_problem_naming_its_key(tmp_path, demo_dir, change, fragment):
    path = sweep_file(tmp_path, demo_dir, {**GOOD, **change})
    with pytest.raises(SpecError) as e:
        load_sweep(path)
    assert len(e.value.problems) == 1, e.value.problems
    assert fragment in e.value.problems[0] and e.value.problems[0].startswith(f"{path}:")


def test_asha_needs_a_validation_set(tmp_path, demo_dir):
    path = sweep_file(tmp_path, demo_dir, GOOD, grid={"data.valid": [None]})
    with pytest.raises(SpecError) as e:
        load_sweep(path)
    assert [p.split(": ", 1)[1] for p in e.value.problems] == [
        "scheduler.metric: asha needs data.valid (it compares val_loss)"]


def test_segctl_validate_refuses_bad_schedulers_in_one_line(tmp_path, demo_dir):
    ok = segctl("validate", sweep_file(tmp_path, demo_dir, GOOD))
    assert ok.returncode == 0, ok.stderr
    bad = sweep_file(tmp_path, demo_dir, {**GOOD, "reduction": 1})
    assert_one_line_error(segctl("validate", bad), "scheduler.reduction: ")
    bad = sweep_file(tmp_path, demo_dir, {**GOOD, "max_steps": 150})
    assert_one_line_error(segctl("validate", bad), "scheduler.max_steps: must equal train.iters")


# ------------------------------------------------------------------ the controller

def asha_sweep(payload, n: int) -> dict:
    p = sweep_of(payload, "s", n=n, segment_size=1, retries=3)
    p["spec"]["scheduler"] = dict(ASHA)
    for t in p["trials"]:   # as validate requires: an eval at every rung, max_steps iters
        t["job"]["train"].update(iters=ASHA["max_steps"], eval_every=ASHA["grace_steps"])
    return p


def on(world: World, c: Controller, trial: str) -> AttemptSpec:
    [spec] = [r.args[0] for r in live(world) if r.args[0].trial == trial]
    return spec


def report(c: Controller, spec: AttemptSpec, step: int, val_loss: float, seq: int) -> None:
    """The agent forwards one eval event of this attempt to the head."""
    c.ingest(spec.attempt, [{"seq": seq, "event": "eval", "time": 1.0, "step": step,
                             "val_loss": val_loss, "val_tokens": 10, "seconds": 0.1}])


def end(world: World, spec: AttemptSpec, outcome: str, **kw) -> None:
    [r] = [r for r in live(world) if r.args[0].attempt == spec.attempt]
    r.settle(AttemptResult(attempt=spec.attempt, outcome=outcome, **kw))


def cancels(world: World) -> list[int]:
    return [r.args[0] for a in world.agents.values() for r in a.calls if r.what == "cancel"]


def test_asha_stops_the_bottom_trials_and_a_freed_node_takes_a_pending_one(tmp_path, payload):
    world = World(names=("a", "b"))
    c = world.controller(tmp_path)
    sid = c.submit(asha_sweep(payload, 4))
    t0, t1, t2, t3 = (f"{sid}-t{i:03d}" for i in range(4))
    world.turns(c, 2)
    assert {s.trial for s in (r.args[0] for r in live(world))} == {t0, t1}
    report(c, on(world, c, t0), 4, 1.0, seq=1)
    report(c, on(world, c, t1), 4, 2.0, seq=1)   # worse, but only 2 values (< reduction): on
    report(c, on(world, c, t1), 8, 9.0, seq=2)   # not a rung: nothing recorded
    assert c.state.rung_values(sid, 4) == {t0: 1.0, t1: 2.0}
    assert set(trials(c, sid).values()) == {TrialState.PLACED, TrialState.PENDING} and not cancels(world)

    end(world, on(world, c, t0), "failed", message="bad row")   # frees a for t2
    world.turns(c, 1)
    s2 = on(world, c, t2)
    report(c, s2, 4, 3.0, seq=1)   # [1, 2, 3]: cutoff 1.667, 3.0 is below the top third
    why = "asha: val_loss 3 at rung 1 (step 4) below the top 1/3 of 3 (cutoff 1.667)"
    t = c.state.trial(t2)
    assert t["state"] == TrialState.STOPPED and t["message"] == why and reasons(c, t2)[-1] == why
    assert cancels(world) == [s2.attempt]   # its running attempt is told to end
    report(c, s2, 4, 3.0, seq=1)   # the same batch again: decided once
    assert cancels(world) == [s2.attempt]

    end(world, s2, "cancelled")   # the stopped attempt ends: a takes the last trial
    world.turns(c, 1)
    s3 = on(world, c, t3)
    assert c.state.attempt(s3.attempt)["node"] == "a"
    assert [a["outcome"] for a in c.state.attempts(t2)] == [Outcome.CANCELLED]   # no retry
    assert trials(c, sid)[t2] == TrialState.STOPPED
    assert c.state.rungs(sid)[-1] | {"time": None} == dict(
        sweep=sid, rung=4, trial=t2, value=3.0, time=None, attempt=s2.attempt, stopped=1,
        reason=why)

    # status shows the stopped trial with its reason
    [shown] = [x for x in c.state.status(sid)[0]["trials"] if x["trial"] == t2]
    assert shown["state"] == TrialState.STOPPED and shown["message"] == why
    out = console()
    with out.capture() as cap:
        out.print(trials_table(c.state.status(sid)[0]))
    assert "STOPPED" in cap.get() and "asha: val_loss 3" in cap.get()


def test_rung_records_survive_a_head_restart_and_decide_later_evals(tmp_path, payload):
    world = World(names=("a", "b", "c"))
    c = world.controller(tmp_path)
    sid = c.submit(asha_sweep(payload, 4))
    t0, t1, t2, t3 = (f"{sid}-t{i:03d}" for i in range(4))
    world.turns(c, 2)
    report(c, on(world, c, t0), 4, 1.0, seq=1)
    report(c, on(world, c, t1), 4, 2.0, seq=1)
    report(c, on(world, c, t2), 4, 1.5, seq=1)   # [1, 1.5, 2]: cutoff 1.333; 1.5 stops
    assert trials(c, sid)[t2] == TrialState.STOPPED
    report(c, on(world, c, t0), 12, 0.5, seq=2)   # first at rung 12: goes on
    del c   # the head goes away under its running attempts

    world2 = World(names=("a", "b", "c"))
    c2 = world2.controller(tmp_path)
    assert c2.state.rung_values(sid, 4) == {t0: 1.0, t1: 2.0, t2: 1.5}
    assert c2.state.rung_values(sid, 12) == {t0: 0.5}
    assert trials(c2, sid) == {t0: TrialState.PENDING, t1: TrialState.PENDING,
                               t2: TrialState.STOPPED, t3: TrialState.PENDING}
    c2.resume(sid)
    world2.turns(c2, 2)
    assert {r.args[0].trial for r in live(world2)} == {t0, t1, t3}   # not the stopped one
    # t1 resumed reports its rung again: decided before the restart, not again
    report(c2, on(world2, c2, t1), 4, 9.0, seq=1)
    assert c2.state.rung_values(sid, 4)[t1] == 2.0 and trials(c2, sid)[t1] == TrialState.PLACED
    # t3's first eval is judged against what the old head recorded: [1, 1.5, 2, 1.9],
    # cutoff 1.5 (alone at the rung it would go on)
    report(c2, on(world2, c2, t3), 4, 1.9, seq=1)
    t = c2.state.trial(t3)
    assert t["state"] == TrialState.STOPPED and t["message"] == (
        "asha: val_loss 1.9 at rung 1 (step 4) below the top 1/3 of 4 (cutoff 1.5)")
    # a trial at the top goes on; the sweep is done once the rest end
    report(c2, on(world2, c2, t0), 4, 0.1, seq=1)   # re-delivered, ignored
    assert trials(c2, sid)[t0] == TrialState.PLACED
    end(world2, on(world2, c2, t3), "cancelled")
    end(world2, on(world2, c2, t1), "failed", message="bad row")
    end(world2, on(world2, c2, t0), "failed", message="bad row")
    world2.turns(c2, 2)
    assert not live(world2)
    assert trials(c2, sid) == {t0: TrialState.FAILED, t1: TrialState.FAILED,
                               t2: TrialState.STOPPED, t3: TrialState.STOPPED}
    assert sweep_state(c2, sid) == SweepState.DONE


def test_a_stopped_trial_keeps_the_adapter_its_attempt_shipped(tmp_path, payload, adapter_dir):
    """The attempt finished before the stop reached it: its adapter is stored, the trial
    stays STOPPED (gather exports SUCCEEDED trials only)."""
    world = World(names=("a", "b", "c"))
    c = world.controller(tmp_path)
    sid = c.submit(asha_sweep(payload, 3))
    world.turns(c, 2)
    specs = [on(world, c, f"{sid}-t{i:03d}") for i in range(3)]
    for spec, v in zip(specs, (1.0, 1.2, 4.0)):
        report(c, spec, 4, v, seq=1)
    loser = specs[2]
    assert trials(c, sid)[loser.trial] == TrialState.STOPPED
    files = {n: (adapter_dir / n).read_bytes() for n in ("adapters.safetensors",
                                                         "adapter_config.json")}
    end(world, loser, "succeeded", steps=36, final_loss=1.0, val_loss=4.0, adapter=files)
    world.turns(c, 1)
    assert trials(c, sid)[loser.trial] == TrialState.STOPPED
    assert c.stores.adapter_files(loser.trial) == files
    assert c.stores.adapter_info(loser.trial)["step"] == 36


def test_the_commented_example_validates_as_is_and_uncommented(tmp_path, demo_dir):
    from tests.conftest import ROOT
    (tmp_path / "demo").symlink_to(demo_dir)   # examples/job.yaml points at ../demo
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "job.yaml").write_text((ROOT / "examples" / "job.yaml").read_text())
    text = (ROOT / "examples" / "sweep.yaml").read_text()
    lines = text.splitlines()
    start = lines.index("# scheduler:                    # optional early stopping (ASHA); null = "
                        "every trial runs to the end")
    for i in range(start, start + 6):
        lines[i] = lines[i][2:]   # uncomment the block
    for body, rungs in ((text, None), ("\n".join(lines) + "\n", [50, 150])):
        (tmp_path / "examples" / "sweep.yaml").write_text(body)
        sweep = load_sweep(tmp_path / "examples" / "sweep.yaml")
        assert len(sweep.trials) == 8
        assert (sweep.spec.scheduler and sweep.spec.scheduler.rungs()) == rungs


def test_the_head_refuses_a_bad_scheduler_that_skipped_the_cli(tmp_path, payload):
    c = World().controller(tmp_path)
    p = asha_sweep(payload, 1)
    p["spec"]["scheduler"]["reduction"] = 1
    with pytest.raises(ValueError, match="^scheduler.reduction: ") as e:
        c.submit(p)
    assert "\n" not in str(e.value) and not c.state.sweeps()
