"""The best checkpoint: a run keeps the adapter of its best eval beside its last,
`train.early_stop` ends a run whose val_loss stopped improving, a resume keeps the
best so far, the head stores both adapters and `segctl gather` exports the best with
the step it is from. The real engine on the demo model, real stores and CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from segctl.schemas.states import Outcome, TrialState
from tests.conftest import assert_one_line_error, edit_job, segctl

# A learning rate this large makes val_loss worse within a few evals: patience 2 ends
# the run long before its 40 steps.
EARLY = dict(iters=40, learning_rate=0.05, warmup=0, eval_every=2, val_batches=4,
             checkpoint_every=2, early_stop={"patience": 2})


def demo_job(demo_dir: Path, folder: Path, **edits) -> Path:
    """A private job over the shared demo model and data."""
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.yaml"
    shutil.copy(demo_dir / "job.yaml", job)
    edit_job(job, model=str(demo_dir / "model"), output=str(folder / "out"),
             data={"train": str(demo_dir / "data/train.jsonl"),
                   "valid": str(demo_dir / "data/valid.jsonl")})
    return edit_job(job, **edits)


def train(job: Path, *args) -> list[dict]:
    proc = segctl("train", job, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(l) for l in proc.stdout.splitlines()]


def tensors(path: Path) -> dict:
    return mx.load(str(path))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.fixture(scope="module")
def stopped(demo_dir, tmp_path_factory):
    """One run of the demo job that early_stop ends: (its folder, its events)."""
    folder = tmp_path_factory.mktemp("stopped")
    return folder, train(demo_job(demo_dir, folder, train=EARLY))


@pytest.mark.slow   # 5 s
def test_early_stop_ends_the_run_and_the_best_evals_adapter_is_kept(stopped):
    folder, events = stopped
    out = folder / "out"
    end = events[-1]
    evals = [(e["step"], e["val_loss"]) for e in events if e["event"] == "eval"]
    steps = [e["step"] for e in events if e["event"] == "step"]
    best_step, best_val = min(evals, key=lambda sv: (sv[1], sv[0]))

    assert end["event"] == "end" and end["stopped_early"] is True
    assert steps == list(range(1, end["step"] + 1)) and end["step"] < EARLY["iters"]
    assert (end["best_step"], end["best_val_loss"]) == (best_step, best_val)
    # it stops at the eval that makes `patience` evals in a row without improvement
    after = [v for s, v in evals if s > best_step]
    assert len(after) == 2 and all(v >= best_val for v in after) and evals[-1][0] == end["step"]
    assert end["val_loss"] == evals[-1][1] and "did not improve" in end["stop_reason"]

    # the best adapter is the adapter of the best step (its checkpoint holds the same),
    # and the final adapter is the last step's, as without early_stop
    assert end["best_adapter"] == str(out / "best_adapters.safetensors")
    best = tensors(out / "best_adapters.safetensors")
    assert same(best, tensors(out / f"checkpoints/step-{best_step:07d}/adapters.safetensors"))
    assert not same(best, tensors(out / "adapters.safetensors"))
    last_ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert int(last_ckpt.name.split("-")[1]) < end["step"], "no checkpoint at the stopping step"
    state = json.loads((last_ckpt / "state.json").read_text())
    assert (state["best_step"], state["best_val_loss"]) == (best_step, best_val)


def test_resume_keeps_the_best_so_far(demo_dir, stopped, tmp_path):
    """A crash after the last checkpoint (here: that checkpoint alone, and a newer best
    adapter beside it that the lost steps wrote): the resumed run ends as the
    uninterrupted one did, with the same best step and the same best adapter bytes."""
    folder, events = stopped
    first = events[-1]
    ckpt = sorted((folder / "out/checkpoints").iterdir())[-1]
    assert int(ckpt.name.split("-")[1]) > first["best_step"], "the best is before the checkpoint"
    job = demo_job(demo_dir, tmp_path, train=EARLY)
    shutil.copytree(ckpt, tmp_path / "out/checkpoints" / ckpt.name)
    shutil.copy(folder / "out/adapters.safetensors", tmp_path / "out/best_adapters.safetensors")

    end = train(job, "--resume")[-1]
    assert {k: end[k] for k in ("step", "best_step", "best_val_loss", "stopped_early")} == \
        {k: first[k] for k in ("step", "best_step", "best_val_loss", "stopped_early")}
    assert (tmp_path / "out/best_adapters.safetensors").read_bytes() == \
        (folder / "out/best_adapters.safetensors").read_bytes()
    assert same(tensors(tmp_path / "out/adapters.safetensors"),
                tensors(folder / "out/adapters.safetensors"))


@pytest.mark.parametrize("edits, where", [
    (dict(data={"valid": None}), "train.early_stop needs data.valid"),
    (dict(train={"eval_every": 0}), "train: early_stop needs eval_every >= 1"),
    (dict(train={"early_stop": {"patience": 0}}), "train.early_stop.patience:"),
    (dict(train={"early_stop": {"patience": 2, "min_delta": -0.1}}), "train.early_stop.min_delta:"),
    (dict(train={"early_stop": {"patience": 2, "metric": "loss"}}), "train.early_stop.metric:"),
    (dict(train={"early_stop": {"patience": 2, "min_dleta": 0.1}}), "did you mean 'min_delta'"),
])
def test_bad_early_stop_is_one_line_exit_2(demo_dir, tmp_path, edits, where):
    job = demo_job(demo_dir, tmp_path, train=EARLY)
    edit_job(job, **edits)
    assert_one_line_error(segctl("validate", job), str(job), where)
    if "data.valid" in where:   # train refuses it the same way, before anything is written
        assert_one_line_error(segctl("train", job), where)
        assert not (tmp_path / "out").exists()


@pytest.mark.slow   # 6 s
def test_the_head_stores_the_best_and_gather_exports_it(demo_dir, tmp_path):
    """The fleet path without Ray: the head's controller (fake nodes and agents) places
    two trials, each runs as a real attempt (node/attempt.py, a fresh engine process),
    the head stores what comes back, `segctl gather --best` exports from the stores."""
    from segctl.node.attempt import run_attempt
    from segctl.orchestrator.submit import prepare
    from segctl.schemas.sweep import load_sweep
    from tests.test_head_isolation import World, running, small

    payload = small(prepare(load_sweep(demo_dir / "sweep.yaml"), {}), "s", n=2)
    without, with_valid = (t["job"] for t in payload["trials"])
    assert with_valid["lora"]["rank"] == 8, "the demo job's rank: early_stop ends it (above)"
    with_valid["train"].update(EARLY, checkpoint_every=4)
    without["train"].update(iters=3, eval_every=0, checkpoint_every=0)
    without["data"]["valid"] = None
    home = tmp_path / "home"
    world = World(names=("a", "b"))
    c = world.controller(home)
    sid = c.submit(payload)
    world.turns(c, 1)
    results = {}
    for agent in world.agents.values():
        for ref in running(agent):
            spec = ref.args[0]
            shipped = lambda step, files, s=spec: c.stores.put_checkpoint(
                s.sweep, s.trial, s.attempt, step, files)
            results[spec.trial] = r = run_attempt(
                spec, tmp_path / "work", send_events=lambda batch: None,
                send_checkpoint=shipped, on_started=lambda pid, t: None)
            assert r.outcome == Outcome.SUCCEEDED, r.message
            ref.settle(r)
    world.turns(c, 1)
    t_last, t_best = sorted(results)
    r = results[t_best]
    assert r.best_step is not None and r.best_step < r.steps < EARLY["iters"]
    assert results[t_last].best_adapter == {} and results[t_last].best_step is None
    # the checkpoint that went to the head holds the best so far, for a resume elsewhere
    step, ckpt = c.stores.latest_checkpoint(t_best)
    assert step >= r.best_step
    assert ckpt["best_adapters.safetensors"] == r.best_adapter["adapters.safetensors"]

    out = tmp_path / "export"
    proc = segctl("gather", sid, "--out", out, "--best", "2", env={"SEGCTL_HOME": home})
    assert proc.returncode == 0, proc.stderr
    manifest = {m["trial"]: m for m in json.loads((out / "manifest.json").read_text())}
    m = manifest[t_best]
    assert (m["adapter"], m["step"], m["metrics"]["best_val_loss"]) == \
        ("best", r.best_step, r.best_val_loss)
    assert (out / t_best / "adapters.safetensors").read_bytes() == r.best_adapter["adapters.safetensors"]
    m = manifest[t_last]
    assert (m["adapter"], m["step"]) == ("last", results[t_last].steps)
    assert (out / t_last / "adapters.safetensors").read_bytes() == \
        results[t_last].adapter["adapters.safetensors"]

    from mlx.utils import tree_flatten
    from mlx_lm import load
    model, _ = load(str(demo_dir / "model"), adapter_path=str(out / t_best))
    loaded = dict(tree_flatten(model.parameters()))
    best = mx.load(str(out / t_best / "adapters.safetensors"))
    assert all(mx.array_equal(loaded[k], w).item() for k, w in best.items())


def test_best_ranks_by_the_best_eval_and_only_its_own_attempts_best(stopped, tmp_path):
    """--best K ranks by the best eval's val_loss where the best adapter is exported;
    a best stored for an attempt whose last adapter did not land (the head failed
    between the two) is not the trial's: its later success exports its last."""
    from segctl.orchestrator.gather import gather
    from segctl.orchestrator.stores import Stores
    folder, events = stopped
    out = folder / "out"
    files = lambda name: {"adapters.safetensors": (out / name).read_bytes(),
                          "adapter_config.json": (out / "adapter_config.json").read_bytes()}
    st = Stores(tmp_path / "stores")
    for trial in ("s-1-t000", "s-1-t001"):
        st.put_adapter("s-1", trial, 1, files("best_adapters.safetensors"), kind="best",
                       step=2, val_loss=0.5)
    st.put_adapter("s-1", "s-1-t000", 1, files("adapters.safetensors"), step=6)
    st.put_adapter("s-1", "s-1-t001", 2, files("adapters.safetensors"), step=6)   # no best
    st.put_adapter("s-1", "s-1-t002", 3, files("adapters.safetensors"), step=6)
    trials = [{"trial": t, "state": TrialState.SUCCEEDED, "params": {}, "metrics": {"val_loss": v}}
              for t, v in (("s-1-t000", 9.0), ("s-1-t001", 0.7), ("s-1-t002", 0.8))]
    got = json.loads((gather(st, trials, tmp_path / "x", best=2) / "manifest.json").read_text())
    assert [(m["trial"], m["adapter"], m["step"]) for m in got] == \
        [("s-1-t000", "best", 2), ("s-1-t001", "last", 6)]
    assert (tmp_path / "x/s-1-t000/adapters.safetensors").read_bytes() == \
        (out / "best_adapters.safetensors").read_bytes()
    assert (tmp_path / "x/s-1-t001/adapters.safetensors").read_bytes() == \
        (out / "adapters.safetensors").read_bytes()
