"""`report_to`: a run's metrics and params streamed to TensorBoard and MLflow (and W&B
where installed), read back with each tracker's own reader. A real job through
`segctl train`; a real sweep through the head's ingest path (the controller with fake
nodes and agents, real engine processes, real state.db and Parquet); a tracker that
breaks at runtime; bad `report_to` keys and missing packages at validate, train and
submit. Offline only: nothing leaves the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
import yaml

from segctl.schemas.states import TrialState
from tests.conftest import assert_one_line_error, cli_env, edit_job, segctl

SHORT = dict(iters=6, eval_every=3, val_batches=4, checkpoint_every=0, warmup=0)


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard's own reader sees the run's folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if not tag.startswith("_hparams_/")}


def tensorboard_hparams(folder: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata
    acc = EventAccumulator(str(folder))
    acc.Reload()
    info = metadata.parse_session_start_info_plugin_data(
        acc.PluginTagToContent("hparams")[metadata.SESSION_START_INFO_TAG])
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def mlflow_client(home: Path):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{home / 'trackers' / 'mlflow.db'}")


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def f32(pairs) -> list[tuple[int, float]]:
    """TensorBoard keeps scalars as float32."""
    return [(s, float(np.float32(v))) for s, v in pairs]


# ------------------------------------------------------------------ segctl train

@pytest.fixture(scope="module")
def tracked(demo_dir, tmp_path_factory):
    """One `segctl train` of the demo job (6 steps, evals at 3 and 6) with report_to
    tensorboard and mlflow under a private SEGCTL_HOME: (folder, home, events)."""
    folder = tmp_path_factory.mktemp("train")
    job = folder / "job.yaml"
    job.write_text((demo_dir / "job.yaml").read_text())
    edit_job(job, model=str(demo_dir / "model"), output="out", train=SHORT,
             data={"train": str(demo_dir / "data/train.jsonl"),
                   "valid": str(demo_dir / "data/valid.jsonl")},
             report_to=["tensorboard", {"type": "mlflow"}])
    home = folder / "home"
    proc = segctl("train", job, "--json", env={"SEGCTL_HOME": home})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning" not in proc.stderr, proc.stderr
    printed = [json.loads(line) for line in proc.stdout.splitlines()]   # stdout is events only
    events = [json.loads(line) for line in (folder / "out/events.jsonl").read_text().splitlines()]
    assert printed == events
    return folder, home, events


@pytest.mark.slow   # `tracked`: one `segctl train` streaming to the trackers
def test_train_streams_every_step_and_eval_to_tensorboard(tracked):
    folder, home, events = tracked
    steps = [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    evals = [(e["step"], e["val_loss"]) for e in events if e["event"] == "eval"]
    assert [s for s, _ in steps] == list(range(1, 7)) and [s for s, _ in evals] == [3, 6]
    run = home / "trackers/tensorboard/demo-qwen3/out"   # group: the job's name; run: its output
    got = tensorboard_scalars(run)
    assert got["loss"] == f32(steps)
    assert got["val_loss"] == f32(evals)
    for tag, key in (("lr", "lr"), ("tokens_per_s", "tokens_per_s"), ("peak_gb", "peak_gb")):
        assert got[tag] == f32((e["step"], e[key]) for e in events if e["event"] == "step")
    end = events[-1]
    assert got["final/final_val_loss"] == f32([(6, end["val_loss"])])
    hp = tensorboard_hparams(run)
    assert hp["train.learning_rate"] == pytest.approx(2e-4) and hp["lora.rank"] == 8
    assert hp["method"] == "sft"
    # the stores root is the user's alone
    assert (home / "trackers").stat().st_mode & 0o777 == 0o700


@pytest.mark.slow   # `tracked`: one `segctl train` streaming to the trackers
def test_train_streams_params_and_metrics_to_mlflow(tracked):
    folder, home, events = tracked
    client = mlflow_client(home)
    exp = client.get_experiment_by_name("demo-qwen3")
    [run] = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "out" and run.info.status == "FINISHED"
    p = run.data.params
    assert (p["train.learning_rate"], p["lora.rank"], p["train.iters"], p["method"]) == \
        ("0.0002", "8", "6", "sft")
    # MLflow keeps float64: the values are the telemetry's exactly
    assert history(client, run.info.run_id, "loss") == \
        [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    assert history(client, run.info.run_id, "val_loss") == \
        [(e["step"], e["val_loss"]) for e in events if e["event"] == "eval"]
    end = events[-1]
    assert run.data.metrics["final_loss"] == end["final_loss"]
    assert run.data.metrics["best_val_loss"] == end["best_val_loss"]


@pytest.mark.slow   # `tracked`: one `segctl train` streaming to the trackers
def test_wandb_offline_run_from_the_same_events(tracked, tmp_path, monkeypatch):
    """W&B where it is installed (it is not in the test extra), offline: the run's
    events through the same Reporter `segctl train` uses; wandb writes its offline run."""
    pytest.importorskip("wandb")
    from segctl.orchestrator.trackers import Reporter, RunName
    from segctl.schemas.job import TrackerSpec
    monkeypatch.setenv("WANDB_MODE", "offline")
    folder, home, events = tracked
    warned = []
    rep = Reporter([TrackerSpec(type="wandb")], home=tmp_path, resume=False, warn=warned.append,
                   names=RunName(group="demo-qwen3", name="out", key="demo-qwen3-wb"),
                   params={"lora.rank": 8})
    for e in events:
        rep.event(e)
    assert rep.closed and warned == []
    [run] = (tmp_path / "trackers/wandb").glob("offline-run-*-demo-qwen3-wb")
    assert (run / "run-demo-qwen3-wb.wandb").stat().st_size > 0


# ------------------------------------------------------------------ sweeps, through the head

@pytest.mark.slow   # 2 engine runs
def test_a_sweep_streams_one_run_per_trial_grouped_per_sweep(demo_dir, tmp_path):
    """Two trials of a real sweep, each a real attempt (node/attempt.py: a fresh engine
    process) whose event batches reach the head through Controller.ingest as an agent's
    would. One TensorBoard folder and one MLflow run per trial under the sweep, each
    with the swept params and the loss the head sealed into Parquet."""
    from segctl.orchestrator.submit import prepare
    from segctl.schemas.sweep import load_sweep
    from tests.test_head_isolation import World, run_placed

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "trk", "base": str(demo_dir / "job.yaml"),
        "grid": {"train.learning_rate": [1e-4, 3e-4], "train.iters": [4], "train.eval_every": [2],
                 "train.val_batches": [4], "train.checkpoint_every": [0]},
        "report_to": ["tensorboard", "mlflow"]}))
    home = tmp_path / "home"
    world = World(names=("a", "b"))
    c = world.controller(home)
    sid = c.submit(prepare(load_sweep(path), {}))
    world.turns(c, 1)
    run_placed(world, c, tmp_path / "work")
    world.turns(c, 3)   # a turn files ended attempts for FILE_S at most, the rest the next
    assert c.trackers.flush()
    states = {t["id"]: t["state"] for t in c.state.trials(sid)}
    assert set(states.values()) == {TrialState.SUCCEEDED} and len(states) == 2

    table = lambda name: ds.dataset(home / "telemetry" / name, partitioning="hive").to_table()
    steps, evals = table("steps").to_pylist(), table("evals").to_pylist()
    client = mlflow_client(home)
    exp = client.get_experiment_by_name(sid)
    runs = {r.data.tags["segctl.trial"]: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(runs) == sorted(states)
    assert sorted(p.name for p in (home / "trackers/tensorboard" / sid).iterdir()) == ["t000", "t001"]
    lrs = set()
    for tid, run in runs.items():
        loss = sorted((r["step"], r["loss"]) for r in steps if r["trial"] == tid)
        val = sorted((r["step"], r["val_loss"]) for r in evals if r["trial"] == tid)
        assert [s for s, _ in loss] == [1, 2, 3, 4] and [s for s, _ in val] == [2, 4]
        assert run.data.tags["segctl.sweep"] == sid and run.info.status == "FINISHED"
        assert run.info.run_name == tid.removeprefix(f"{sid}-")
        assert history(client, run.info.run_id, "loss") == loss
        assert history(client, run.info.run_id, "val_loss") == val
        assert run.data.params["train.iters"] == "4"
        lrs.add(run.data.params["train.learning_rate"])
        tb = tensorboard_scalars(home / "trackers/tensorboard" / sid / run.info.run_name)
        assert tb["loss"] == f32(loss) and tb["val_loss"] == f32(val)
    assert lrs == {"0.0001", "0.0003"}


@pytest.mark.slow   # `tracked`: one `segctl train` streaming to the trackers
def test_a_tracker_that_breaks_is_logged_once_and_the_trial_goes_on(demo_dir, tracked, tmp_path):
    """A TensorBoard dir that cannot be made (a file is in the way): the head logs it
    once, that tracker is off for the trial, MLflow still gets every row, a batch
    delivered twice is written once, and the trial succeeds."""
    from segctl.orchestrator.submit import prepare
    from segctl.schemas.records import AttemptResult
    from segctl.schemas.sweep import load_sweep
    from tests.test_head_isolation import World, running

    folder, _, events = tracked
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    job = job_with(demo_dir, private(tmp_path / "base"), None)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "brk", "base": str(job), "report_to": [
        {"type": "tensorboard", "dir": str(blocked)}, "mlflow"]}))
    home = tmp_path / "home"
    world = World(names=("a",))
    c = world.controller(home)
    sid = c.submit(prepare(load_sweep(path), {}))
    world.turns(c, 1)
    [ref] = running(world.agents["a"])
    aid = ref.args[0].attempt
    batch = [{**e, "seq": i} for i, e in enumerate(events)]
    c.ingest(aid, batch[:5])
    c.ingest(aid, batch[:5])      # delivered again
    c.ingest(aid, batch[5:])
    out = folder / "out"
    ref.settle(AttemptResult(attempt=aid, outcome="succeeded", steps=6,
                             final_loss=events[-1]["final_loss"], val_loss=events[-1]["val_loss"],
                             adapter={n: (out / n).read_bytes()
                                      for n in ("adapters.safetensors", "adapter_config.json")}))
    world.turns(c, 1)
    assert c.trackers.flush()
    [t] = c.state.trials(sid)
    assert t["state"] == TrialState.SUCCEEDED
    log = (home / "logs/head.log").read_text()
    assert log.count("tracker tensorboard") == 1 and "opening its run failed" in log
    assert "tracker mlflow" not in log
    client = mlflow_client(home)
    [run] = client.search_runs([client.get_experiment_by_name(sid).experiment_id])
    assert history(client, run.info.run_id, "loss") == \
        [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    assert run.info.status == "FINISHED"


# ------------------------------------------------------------------ bad input

def private(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def job_with(demo_dir: Path, folder: Path, report_to) -> Path:
    job = folder / "job.yaml"
    job.write_text((demo_dir / "job.yaml").read_text())
    return edit_job(job, model=str(demo_dir / "model"), output=str(folder / "out"),
                    data={"train": str(demo_dir / "data/train.jsonl"),
                          "valid": str(demo_dir / "data/valid.jsonl")}, report_to=report_to)


@pytest.mark.parametrize("report_to, fragment", [
    (["tensorbord"], "report_to.0: unknown tracker 'tensorbord'; did you mean 'tensorboard'?"),
    (["mlflow", "mlflow"], "report_to: mlflow given more than once"),
    ([{"type": "mlflow", "dir": "x"}], "report_to.0: dir: not a key of mlflow (it takes uri)"),
    ([{"type": "wandb", "projet": "x"}], "report_to.0: projet: unknown key; did you mean 'project'?"),
    ([{"dir": "x"}], "report_to.0.type: required key is missing"),
    ([3], "report_to.0: expected a tracker's name (tensorboard, mlflow, wandb)"),
    ([{"type": "wandb", "project": "a b"}], "report_to.0.project: "),
])
def test_bad_report_to_is_one_problem_naming_the_key(demo_dir, tmp_path, report_to, fragment):
    from segctl.schemas.errors import SpecError
    from segctl.schemas.job import load_job
    job = job_with(demo_dir, tmp_path, report_to)
    with pytest.raises(SpecError) as e:
        load_job(job)
    [line] = e.value.problems
    assert line.startswith(f"{job}:") and fragment in line, line


def test_segctl_validate_refuses_a_bad_tracker_in_one_line(demo_dir, tmp_path):
    job = job_with(demo_dir, tmp_path, ["tensorboard", "mlfow"])
    assert_one_line_error(segctl("validate", job), f"{job}:", "report_to.1: unknown tracker "
                          "'mlfow'; did you mean 'mlflow'?")


def test_a_sweep_sets_report_to_once_for_all_its_trials(demo_dir, tmp_path):
    from segctl.schemas.sweep import load_sweep
    job = job_with(demo_dir, tmp_path, ["tensorboard"])
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "s", "base": "job.yaml", "report_to": ["mlflow"],
                                     "grid": {"lora.rank": [4, 8]}}))
    assert_one_line_error(segctl("validate", sweep), "report_to: also in the base job")
    sweep.write_text(yaml.safe_dump({"name": "s", "base": "job.yaml",
                                     "grid": {"report_to": [["mlflow"], ["wandb"]]}}))
    assert_one_line_error(segctl("validate", sweep), "grid.report_to: set for the whole sweep")
    # the base job's report_to, or the sweep's with its dir from the sweep's folder
    sweep.write_text(yaml.safe_dump({"name": "s", "base": "job.yaml", "grid": {"lora.rank": [4, 8]}}))
    assert {t.job.report_to[0].type for t in load_sweep(sweep).trials} == {"tensorboard"}
    edit_job(job, report_to=None)
    sweep.write_text(yaml.safe_dump({"name": "s", "base": "job.yaml", "grid": {"lora.rank": [4, 8]},
                                     "report_to": [{"type": "tensorboard", "dir": "tb"}]}))
    assert [t.job.report_to[0].dir for t in load_sweep(sweep).trials] == [str(tmp_path / "tb")] * 2


def segctl_without(module: str, *args, env: dict) -> subprocess.CompletedProcess:
    """The real CLI in a process where `module` cannot be imported (as if not installed)."""
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv = ['segctl', *sys.argv[1:]]; "
            "from segctl.orchestrator.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, env={**cli_env(), **env}, timeout=300)


@pytest.mark.parametrize("tracker, module", [("mlflow", "mlflow"), ("tensorboard", "tensorboard"),
                                             ("wandb", "wandb"), ("mlflow", "sqlalchemy")])
def test_a_tracker_not_installed_is_refused_naming_the_extra(demo_dir, tmp_path, tracker, module):
    job = job_with(demo_dir, tmp_path, ["tensorboard", "mlflow", "wandb"])
    assert_one_line_error(segctl_without(module, "validate", job, env={}),
                          f"report_to: {tracker} needs {module}", f"pip install 'segctl[{tracker}]'")


def test_train_and_submit_refuse_a_missing_tracker_before_anything_is_written(demo_dir, tmp_path):
    job = job_with(demo_dir, tmp_path, ["wandb"])
    env = {"SEGCTL_HOME": str(tmp_path / "home")}
    for command in ("train", "submit"):   # submit: before Ray is started
        assert_one_line_error(segctl_without("wandb", command, job, env=env),
                              "report_to: wandb needs wandb", "pip install 'segctl[wandb]'")
    assert not (tmp_path / "out").exists() and not (tmp_path / "home").exists()
