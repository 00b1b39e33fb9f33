"""Experiment trackers: a run's metrics and params streamed to TensorBoard, MLflow
or W&B as it trains (`report_to` in a job or a sweep).

One tracker run per trial, grouped per sweep (per job name under `segctl train`):

    tensorboard  <dir>/<sweep>/<trial>/ event files, the params in the HParams tab
                 (dir: <home>/trackers/tensorboard)
    mlflow       an experiment per sweep, a run per trial tagged segctl.sweep and
                 segctl.trial (uri: sqlite:///<home>/trackers/mlflow.db)
    wandb        project (default segctl), group = the sweep, run name = the trial;
                 wandb's own environment and settings (WANDB_MODE=offline, ...)

Each adapter is three calls, open (its constructor, with the params), log(step,
metrics) and close(final, status), and imports its package only when a run opens:
the engine never imports a tracker, and one that is not installed is refused at
validate, submit and train (`missing`), never found missing mid-sweep.

Where the events come from: a sweep's from the head (Controller.ingest feeds
`HeadStreams`, which writes on a thread of its own, so a slow or broken tracker never
holds the controller's lock); `segctl train`'s from its own event loop (`job_sink`).
Either way a tracker that fails is logged once and dropped for that run; the trial
goes on.

No tracker phones home unless asked: before a tracker is imported, its own usage
telemetry is turned off (`TELEMETRY_OFF`), unless SEGCTL_TRACKER_TELEMETRY=1 or the
user set that variable themselves. What the user points a tracker at (a W&B server,
an MLflow URI) is theirs to choose and is never touched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from segctl.schemas.job import JobSpec, TrackerSpec
from segctl.schemas.private import private_dir

# What each tracker imports, and the extra that installs it (pip install 'segctl[NAME]').
REQUIRES = {"tensorboard": ("tensorboard",), "mlflow": ("mlflow",), "wandb": ("wandb",)}
# MLflow's database stores (its default here is SQLite) need SQLAlchemy and Alembic too.
DB_REQUIRES = ("sqlalchemy", "alembic")
DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# Per step; evals add val_loss. Preference methods add their own where the engine sends them.
STEP_METRICS = ("loss", "lr", "tokens_per_s", "peak_gb", "grad_norm", "margin", "accuracy",
                "chosen_reward", "rejected_reward")
# The job settings every run records as params, beside the keys its sweep varies.
PARAM_KEYS = ("method", "model", "lora.rank", "lora.scale", "lora.dropout", "lora.num_layers",
              "lora.keys", "train.learning_rate", "train.iters", "train.epochs", "train.schedule",
              "train.warmup", "train.weight_decay", "train.grad_clip", "train.seed",
              "train.eval_every", "data.max_seq_length", "memory.segment_size", "orpo.lambda",
              "dpo.beta")
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"   # how a run ended (MLflow's words)
BACKLOG = 10_000      # event batches the head's tracker thread may fall behind by

# Each tracker's switch for the traffic it makes on its own, to its makers' hosts.
# MLflow (3.x) fetches a config from mlflow-telemetry.io at its first tracked call and
# then posts usage events; it reads its switch per call, but is quiet by itself only
# under pytest and CI.
# wandb reports its errors to sentry.io. TensorBoard's writer sends nothing.
TELEMETRY_OFF = {"mlflow": {"MLFLOW_DISABLE_TELEMETRY": "true"},
                 "wandb": {"WANDB_ERROR_REPORTING": "false"},
                 "tensorboard": {}}
TELEMETRY_OPT_IN = "SEGCTL_TRACKER_TELEMETRY"   # =1: leave the trackers' telemetry as they ship it


def missing(trackers: list[TrackerSpec]) -> list[str]:
    """One line per tracker whose package is not installed here, naming the extra."""
    out = []
    for t in trackers:
        mods = REQUIRES[t.type]
        if t.type == "mlflow" and (t.uri is None or t.uri.split(":")[0].split("+")[0] in DB_SCHEMES):
            mods += DB_REQUIRES
        absent = [m for m in mods if importlib.util.find_spec(m) is None]
        if absent:
            out.append(f"report_to: {t.type} needs {', '.join(absent)}, not installed here: "
                       f"pip install 'segctl[{t.type}]'")
    return out


@dataclass(frozen=True)
class RunName:
    group: str    # the sweep's id (a job's name under segctl train)
    name: str     # the trial's name in its sweep (t000), or the output folder's
    key: str      # unique and stable: the trial's id; finds the run again on a resume


def params_of(job: dict, varied: dict) -> dict:
    """The run's params: the main job settings and the keys its sweep varies, as trained."""
    flat = {}
    for key in PARAM_KEYS:
        value = job
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            flat[key] = value
    flat.update(varied)
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
            for k, v in flat.items()}


def metrics_of(event: dict) -> tuple[int, dict] | None:
    """(step, metrics) of a step or eval event; None for any other."""
    kind = event.get("event")
    if kind == "step":
        return event["step"], {k: float(event[k]) for k in STEP_METRICS
                               if event.get(k) is not None}
    if kind == "eval":
        return event["step"], {"val_loss": float(event["val_loss"])}
    return None


def final_of(end: dict) -> dict:
    """The result of a run from its end event."""
    final = {"final_loss": end.get("final_loss"), "final_val_loss": end.get("val_loss"),
             "best_val_loss": end.get("best_val_loss"), "best_step": end.get("best_step"),
             "steps": end.get("step")}
    return {k: float(v) for k, v in final.items() if v is not None}


# ------------------------------------------------------------------ adapters

def telemetry_off(tracker: str, environ=os.environ) -> None:
    """Turn `tracker`'s usage telemetry off in this process (and the ones it starts),
    before the tracker is imported; a value the user set, or the opt-in, wins."""
    if environ.get(TELEMETRY_OPT_IN, "").strip().lower() in ("1", "true", "yes", "on"):
        return
    for name, value in TELEMETRY_OFF[tracker].items():
        environ.setdefault(name, value)


def _trackers_home(home: Path) -> Path:
    return private_dir(Path(home) / "trackers")


def _user_dir(path: str) -> Path:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class TensorBoardRun:
    """Event files written with TensorBoard's own EventFileWriter: the scalars as the
    scalars plugin reads them, the params as an HParams session."""

    def __init__(self, spec: TrackerSpec, home: Path, names: RunName, params: dict, resume: bool):
        telemetry_off("tensorboard")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        root = _user_dir(spec.dir) if spec.dir else private_dir(_trackers_home(home) / "tensorboard")
        folder = root / names.group / names.name
        n = 1
        while not resume and folder.exists() and any(folder.iterdir()):   # a new run: a new folder
            n += 1
            folder = root / names.group / f"{names.name}-{n}"
        self.folder = private_dir(folder) if not spec.dir else _user_dir(str(folder))
        self.writer = EventFileWriter(str(self.folder))
        self.last_step = 0
        self._hparams(params, names.group)

    def _event(self, step: int, values: list):
        from tensorboard.compat.proto import event_pb2
        event = event_pb2.Event(wall_time=time.time(), step=int(step))
        for tag, tensor, meta in values:
            event.summary.value.add(tag=tag, tensor=tensor, metadata=meta)
        self.writer.add_event(event)

    def _hparams(self, params: dict, group: str):
        from tensorboard.plugins.hparams import metadata, plugin_data_pb2
        info = plugin_data_pb2.SessionStartInfo(group_name=group, start_time_secs=time.time())
        for k, v in params.items():
            if isinstance(v, bool):
                info.hparams[k].bool_value = v
            elif isinstance(v, (int, float)):
                info.hparams[k].number_value = v
            else:
                info.hparams[k].string_value = str(v)
        meta = metadata.create_summary_metadata(
            plugin_data_pb2.HParamsPluginData(session_start_info=info))
        self._event(0, [(metadata.SESSION_START_INFO_TAG, metadata.NULL_TENSOR, meta)])

    def log(self, step: int, metrics: dict) -> None:
        import numpy as np
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.util import tensor_util
        meta = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
            data_class=summary_pb2.DataClass.DATA_CLASS_SCALAR)
        self._event(step, [(k, tensor_util.make_tensor_proto(np.float32(v)), meta)
                           for k, v in metrics.items()])
        self.last_step = max(self.last_step, step)

    def close(self, final: dict, status: str) -> None:
        from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
        if final:
            self.log(int(final.get("steps", self.last_step)),
                     {f"final/{k}": v for k, v in final.items()})
        end = plugin_data_pb2.SessionEndInfo(
            status=api_pb2.STATUS_SUCCESS if status == FINISHED else api_pb2.STATUS_FAILURE,
            end_time_secs=time.time())
        meta = metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(session_end_info=end))
        self._event(self.last_step, [(metadata.SESSION_END_INFO_TAG, metadata.NULL_TENSOR, meta)])
        self.writer.close()


_mlflow_clients: dict[str, object] = {}   # one per tracking URI: opening a database store is slow


class MlflowRun:
    """An MlflowClient run (no global "active run": a head streams many at once)."""

    def __init__(self, spec: TrackerSpec, home: Path, names: RunName, params: dict, resume: bool):
        telemetry_off("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        for name in ("mlflow", "alembic"):   # after the import: mlflow sets its own level then
            logging.getLogger(name).setLevel(logging.WARNING)
        uri, artifacts = spec.uri, None
        if uri is None:
            trackers = _trackers_home(home)
            uri = f"sqlite:///{trackers / 'mlflow.db'}"
            artifacts = (trackers / "mlartifacts").as_uri()   # never ./mlartifacts of the cwd
        if uri not in _mlflow_clients:
            _mlflow_clients[uri] = MlflowClient(tracking_uri=uri)
        self.client = c = _mlflow_clients[uri]
        exp = c.get_experiment_by_name(names.group)
        eid = exp.experiment_id if exp else c.create_experiment(
            names.group, artifact_location=artifacts, tags={"segctl.sweep": names.group})
        found = c.search_runs([eid], filter_string=f"tags.`segctl.trial` = '{names.key}'",
                              max_results=1, order_by=["attributes.start_time DESC"]) \
            if resume else []
        if found:
            self.run_id = found[0].info.run_id
            c.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = c.create_run(eid, run_name=names.name, tags={
                "segctl.sweep": names.group, "segctl.trial": names.key}).info.run_id
            c.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])
        self.last_step = 0

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric
        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, int(step))
                                                    for k, v in metrics.items()])
        self.last_step = max(self.last_step, step)

    def close(self, final: dict, status: str) -> None:
        if final:
            self.log(int(final.get("steps", self.last_step)), final)
        self.client.set_terminated(self.run_id, status)


class WandbRun:
    """A wandb run of its own (reinit create_new: a head runs many at once); its console
    capture is off, so `segctl train --json` prints only events."""

    def __init__(self, spec: TrackerSpec, home: Path, names: RunName, params: dict, resume: bool):
        telemetry_off("wandb")
        import wandb
        folder = _user_dir(spec.dir) if spec.dir else _trackers_home(home)
        self.run = wandb.init(project=spec.project or "segctl", entity=spec.entity,
                              group=names.group, name=names.name, id=names.key,
                              resume="allow", dir=str(folder), config=params,
                              reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=int(step))

    def close(self, final: dict, status: str) -> None:
        self.run.summary.update(final)
        self.run.finish(exit_code=0 if status == FINISHED else 1)


ADAPTERS = {"tensorboard": TensorBoardRun, "mlflow": MlflowRun, "wandb": WandbRun}


# ------------------------------------------------------------------ one run, every tracker

class Reporter:
    """One run's trackers, each a run of its own. A tracker that raises is said once
    through `warn` and dropped for this run: the others, and the training, go on."""

    def __init__(self, trackers: list[TrackerSpec], *, home: Path, names: RunName, params: dict,
                 resume: bool, warn: Callable[[str], None]):
        self.trackers, self.home, self.names = trackers, Path(home), names
        self.params, self.resume, self.warn = params, resume, warn
        self.runs: dict[str, object] | None = None     # None: not opened yet
        self.closed = False

    def _call(self, name: str, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            self.runs.pop(name, None)
            text = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            self.warn(f"tracker {name} of {self.names.key}: {what} failed ({text}); "
                      "it is off for this run")

    def open(self) -> None:
        if self.runs is not None:
            return
        self.runs = {}
        for t in self.trackers:
            def start(t=t):
                self.runs[t.type] = ADAPTERS[t.type](t, self.home, self.names, self.params,
                                                     self.resume)
            self.runs[t.type] = None
            self._call(t.type, "opening its run", start)

    def log(self, step: int, metrics: dict) -> None:
        self.open()
        for name, run in list(self.runs.items()):
            self._call(name, "logging", run.log, step, metrics)

    def close(self, final: dict, status: str) -> None:
        if self.closed or self.runs is None:
            self.closed = True
            return
        for name, run in list(self.runs.items()):
            self._call(name, "closing its run", run.close, final, status)
        self.closed = True

    def event(self, event: dict) -> None:
        """Feed one engine event (as JSON): runs open at the first, close at end or error."""
        if self.closed:
            return
        kind = event.get("event")
        if kind == "start":
            self.open()
        elif kind == "end":
            self.close(final_of(event), FINISHED)
        elif kind == "error":
            self.close({}, KILLED if event.get("message") == "interrupted" else FAILED)
        elif (m := metrics_of(event)) is not None:
            self.log(*m)


# ------------------------------------------------------------------ segctl train

def job_sink(job: JobSpec, home: Path, *, resume: bool, warn: Callable[[str], None]):
    """An event sink for `segctl train` streaming to the job's trackers (None without
    any): group = the job's name, run = the output folder's name; --resume continues
    the run the trackers have for that output folder."""
    if not job.report_to:
        return None
    out = Path(job.output)
    names = RunName(group=job.name, name=out.name,
                    key=f"{job.name}-{hashlib.sha256(str(out).encode()).hexdigest()[:12]}")
    rep = Reporter(job.report_to, home=home, names=names, resume=resume, warn=warn,
                   params=params_of(job.model_dump(mode="json"), {}))
    return lambda event: rep.event(event.model_dump(mode="json"))


# ------------------------------------------------------------------ the head

class HeadStreams:
    """The head's side. `feed` (under the controller's lock) only looks up which
    trackers the attempt's trial has, once per attempt, and queues the batch; a thread
    of its own writes. An event delivered twice is written once (by its seq)."""

    def __init__(self, root: Path, log: logging.Logger, backlog: int = BACKLOG):
        self.root, self.log = Path(root), log
        self.q: queue.Queue = queue.Queue(maxsize=backlog)
        self.routes: dict[int, tuple | None] = {}   # attempt -> (trackers, names, params) or None
        self.reporters: dict[str, Reporter] = {}    # trial -> its open runs
        self.seen: dict[int, int] = {}               # attempt -> highest seq written
        self.thread: threading.Thread | None = None
        self.behind = False

    def feed(self, attempt, events: list[dict], trial_of: Callable[[], dict]) -> None:
        aid = attempt["id"]
        if aid not in self.routes:
            t = trial_of()
            job = json.loads(t["job"])
            trackers = [TrackerSpec.model_validate(x) for x in job.get("report_to") or []]
            sweep = attempt["sweep"]
            names = RunName(group=sweep, name=t["id"].removeprefix(f"{sweep}-"), key=t["id"])
            self.routes[aid] = (trackers, names, params_of(job, json.loads(t["params"]))) \
                if trackers else None
        if self.routes[aid] is not None:
            self._put(("events", aid, self.routes[aid], events))

    def ended(self, aid: int, outcome: str) -> None:
        """The attempt ended: close what its events did not (cancelled, lost, stopped)."""
        route = self.routes.pop(aid, None)
        if route is not None:
            self._put(("ended", aid, route, outcome))

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued batch is written (tests; a head shutting down)."""
        deadline = time.monotonic() + timeout
        while self.q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.q.unfinished_tasks

    def _put(self, item) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True, name="trackers")
            self.thread.start()
        try:
            self.q.put_nowait(item)
        except queue.Full:   # the trackers are too slow: they lose rows, the head never waits
            if not self.behind:
                self.log.warning(f"trackers are {self.q.maxsize} batches behind; "
                                 "dropping batches until they catch up")
            self.behind = True
        else:
            self.behind = False

    def _run(self) -> None:
        while True:
            item = self.q.get()
            try:
                self._write(*item)
            except Exception as e:   # a bug of ours: logged, the next batch goes on
                self.log.error("trackers: writing a batch failed",
                               exc_info=(type(e), e, e.__traceback__))
            finally:
                self.q.task_done()

    def _write(self, what: str, aid: int, route: tuple, payload) -> None:
        trackers, names, params = route
        if what == "ended":
            self.seen.pop(aid, None)
            rep = self.reporters.pop(names.key, None)
            if rep is not None:
                rep.close({}, {"succeeded": FINISHED, "cancelled": KILLED}.get(payload, FAILED))
            return
        rep = self.reporters.get(names.key)
        if rep is None or rep.closed:   # a trial's later attempt goes on in the same run
            rep = self.reporters[names.key] = Reporter(
                trackers, home=self.root, names=names, params=params, resume=True,
                warn=self.log.warning)
        for e in sorted(payload, key=lambda e: e.get("seq", 0)):
            if e.get("seq", 0) <= self.seen.get(aid, -1):
                continue
            self.seen[aid] = e.get("seq", 0)
            rep.event(e)
