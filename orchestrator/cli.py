"""segctl: LoRA fine-tuning with the segmented-backward engine.

Commands are thin: parse, call one library function, print. User errors are one
line on stderr and exit code 2; the memory guard exits 3; nothing else leaks a
traceback unless SEGCTL_DEBUG=1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from segctl.schemas import SpecError
from segctl.schemas.defaults import DEFAULT_MARGIN, DEFAULT_NODE_MAX_TRIALS, DEFAULT_PORT
from segctl.schemas.limits import MAX_TOKENS, MAX_TRIALS_PER_NODE, one_line
# stdlib-only names: the CLI starts without loading pydantic (schemas/names.py)
from segctl.schemas.names import DEMO_ARCHS, EXIT_BAD_INPUT, EXIT_INTERNAL, METHODS

from . import views


def _fail(message: str, code: int = EXIT_BAD_INPUT):
    click.echo(one_line(f"segctl: {message}"), err=True)
    sys.exit(code)


def _says(e: BaseException) -> str:
    """An error's message: a KeyError's own text, not its repr's quotes."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


class _Group(click.Group):
    def invoke(self, ctx):
        import sqlite3

        from segctl.orchestrator.state import OPENED, StoreError, unusable
        try:
            return super().invoke(ctx)
        except StoreError as e:   # a corrupt or locked state.db or staging.db, named
            _fail(str(getattr(e, "cause", None) or e))   # (the head's own, by its cause)
        except sqlite3.DatabaseError as e:   # ... found only at a later query
            _fail(str(unusable(OPENED[-1] if OPENED else Path("state.db"), e)))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="segctl")
def main():
    """Fine-tune LLMs with LoRA under MLX, one segment of layers in memory at a time,
    alone or across a fleet of Macs.

    \b
    Start here:
      segctl init-demo demo           # tiny random model + data + job.yaml + sweep.yaml
      segctl train demo/job.yaml      # train on this machine (no Ray)
      segctl tune --model demo/model --seq-lens 256,512,1024   # measure memory per node class
      segctl plan demo/sweep.yaml     # what would run where, at which segment size
      segctl submit demo/sweep.yaml   # run the sweep (this machine unless --cluster)
      segctl status                   # sweeps and trials; segctl gather exports adapters
    """


@main.command("init-demo")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(DEMO_ARCHS), default="qwen3", show_default=True,
              help="mlx-lm architecture of the demo model (gemma3_text, gpt_oss, olmo3: "
                   "sliding and full attention layers; gemma4_text: also later layers "
                   "sharing earlier layers' K/V; gemma2: soft-capped attention and logits)")
@click.option("--method", type=click.Choice(METHODS), default="sft",
              show_default=True,
              help="sft: prompt/completion rows; orpo, dpo: prompt/chosen/rejected rows and an "
                   "orpo: / dpo: section in job.yaml")
@click.option("--seed", default=0, show_default=True, help="seed for weights and data")
def init_demo(directory: Path, arch: str, method: str, seed: int):
    """Write a small random-initialised model (Hugging Face layout), a synthetic
    data set it visibly learns, DIRECTORY/job.yaml and DIRECTORY/sweep.yaml.
    Nothing is downloaded."""
    from segctl.engine.demo import write_demo
    try:
        job = write_demo(directory, arch, seed=seed, method=method)
    except FileExistsError as e:
        _fail(str(e))
    click.echo(f"wrote {directory}/ (model/, data/, job.yaml, sweep.yaml)\nnext: segctl train {job}")


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
def validate(spec: Path):
    """Check a job, sweep or cluster file without running or writing anything
    (exit 2 and one `file:line: key: message` per problem)."""
    from segctl.schemas.spec import load_spec
    kind, obj = _load(load_spec, spec)
    if kind in ("job", "sweep"):
        _check_families(spec, [obj.model] if kind == "job" else [t.job.model for t in obj.trials])
        _check_packing(spec, obj if kind == "sweep" else None, [obj] if kind == "job" else None)
        _check_trackers(spec, [obj] if kind == "job" else [t.job for t in obj.trials])
    what = {"job": "job", "sweep": f"sweep of {len(getattr(obj, 'trials', []))} trials",
            "cluster": f"cluster of {len(getattr(obj, 'nodes', []))} nodes"}[kind]
    click.echo(f"{spec}: ok ({what})")


def _check_trackers(where, jobs) -> None:
    """Exit 2 naming the extra to install when a tracker of `report_to` is not
    installed here (refused now, not found missing mid-sweep)."""
    from segctl.orchestrator.trackers import missing
    trackers = {t.type: t for job in jobs for t in job.report_to}
    for line in missing(list(trackers.values())):
        _fail(f"{where}: {line}")


def _check_families(where, models) -> None:
    """Exit 2 with the reason when a model folder holds an architecture the engine
    refuses (no weights are read). A folder that is not here is left to plan and
    submit, which need it."""
    from segctl.engine.model import ModelError, check_family
    for model in sorted(set(models)):
        if (Path(model) / "config.json").is_file():
            try:
                check_family(model)
            except ModelError as e:
                _fail(f"{where}: model: {e}")


def _check_packing(spec: Path, sweep=None, jobs=None) -> None:
    """Exit 2 when a job asks `data.pack: true` of a model whose family the engine
    cannot pack exactly (PACKABLE_FAMILIES; config.json's model_type, or its
    text_config's), where the user wrote it: every trial of a sweep counts (its
    base or an axis may set it). `jobs` without `sweep`: job files named `spec`."""
    from segctl.orchestrator.planner import family_packs, model_types
    pairs = [(t.job, t) for t in sweep.trials] if sweep is not None else [(j, None) for j in jobs]
    packs: dict[str, bool] = {}   # model folder -> its verdict, read once per sweep
    for job, trial in pairs:
        if job.data.pack is not True or not (Path(job.model) / "config.json").is_file():
            continue   # a folder that is not here is left to plan and submit, which need it
        try:
            if job.model not in packs:
                packs[job.model] = family_packs(job.model)
            if packs[job.model]:
                continue
            types = model_types(job.model)
        except ValueError as e:
            _fail(f"{spec}: model: {e}")
        what = types[0] + (f" (text model {types[1]})" if types[1:] else "")
        _fail(f"{_pack_where(spec, sweep, trial)}: true: model type {what} cannot be packed "
              "exactly (use pack: auto, which trains it unpacked, or pack: false)")


def _pack_where(spec: Path, sweep, trial) -> str:
    """`file:line: key` of the data.pack a trial (or, without a sweep, the job file)
    has: its sweep axis, the sweep's inline job, or the base job file."""
    from segctl.schemas.yamlspec import line_of, load_yaml
    _, root = load_yaml(spec)
    if sweep is None:
        return f"{spec}:{line_of(root, ['data', 'pack'])}: data.pack"
    if "data.pack" in trial.params:
        if "data.pack" in sweep.spec.grid:
            value = trial.params["data.pack"]
            i = next((i for i, v in enumerate(sweep.spec.grid["data.pack"])
                      if v == value and type(v) is type(value)), None)   # 1 == True: the type too
            if i is None:
                return f"{spec}:{line_of(root, ['grid', 'data.pack'])}: grid.data.pack"
            return f"{spec}:{line_of(root, ['grid', 'data.pack', i])}: grid.data.pack[{i}]"
        return f"{spec}:{line_of(root, ['random', 'params', 'data.pack'])}: random.params.data.pack"
    if sweep.spec.job is not None:
        return f"{spec}:{line_of(root, ['job', 'data', 'pack'])}: job.data.pack"
    base = spec.parent / sweep.spec.base
    _, node = load_yaml(base)
    return f"{base}:{line_of(node, ['data', 'pack'])}: data.pack"


def _load(loader, path):
    try:
        return loader(path)
    except SpecError as e:
        for line in e.problems:
            click.echo(one_line(line), err=True)
        sys.exit(EXIT_BAD_INPUT)


@main.command()
@click.argument("job_file", metavar="JOB.yaml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--resume", is_flag=True,
              help="continue from the last checkpoint in the output folder "
                   "(ends with the adapter an uninterrupted run would give)")
@click.option("--json", "as_json", is_flag=True,
              help="print events as JSON lines even on a terminal")
def train(job_file: Path, resume: bool, as_json: bool):
    """Train one LoRA job on this machine (no Ray).

    Events go to OUTPUT/events.jsonl and to stdout: a progress bar on a terminal,
    JSON lines otherwise. Exit codes: 0 done, 2 bad input (nothing written),
    3 memory.budget_gb crossed (last checkpoint kept), 1 internal error.
    """
    from segctl.schemas.job import load_job
    from segctl.engine import telemetry
    from segctl.engine.train import run_reported

    job = _load(load_job, job_file)
    if job.output is None:
        _fail(f"{job_file}: output: required key is missing (segctl train writes the adapter there)")
    _check_trackers(job_file, [job])
    job = _resolve_auto(job, job_file)

    screen = telemetry.json_lines(sys.stdout) if as_json else telemetry.for_terminal()
    emit = telemetry.fan_out(screen, telemetry.events_file(lambda: job.output))
    if job.report_to:   # the trackers hear the run's events too, in $SEGCTL_HOME/trackers by default
        from segctl.schemas.defaults import segctl_home
        from segctl.orchestrator.trackers import job_sink
        warn = lambda line: click.echo(one_line(f"segctl: warning: {line}"), err=True)
        emit = telemetry.fan_out(emit, job_sink(job, segctl_home(), resume=resume, warn=warn))
    code, message = run_reported(job, resume=resume, emit=emit,
                                 debug=bool(os.environ.get("SEGCTL_DEBUG")))
    if code:
        _fail(message, code)


def _resolve_auto(job, job_file):
    """`segment_size: auto` (or `offload: auto`) under `segctl train`: plan against
    this machine's memory (or memory.budget_gb when set), from this machine's
    `segctl tune` measurements in $SEGCTL_HOME's stores when there are any."""
    if job.memory.segment_size != "auto" and job.memory.offload != "auto":
        return job
    from segctl.engine.data import DataError
    from segctl.node.probe import default_name, probe
    from segctl.orchestrator import measured, planner
    from segctl.schemas.defaults import stores_root
    from segctl.schemas.records import NodeInfo
    try:
        info = planner.model_info(job.model)
        seq_len = planner.step_tokens(job)   # the longest packed sequence where the job packs
    except (ValueError, DataError) as e:
        _fail(f"{job_file}: {e}")
    hw = probe()
    budget = job.memory.budget_gb or hw.memory_gb
    here = NodeInfo(name=default_name(), chip=hw.chip, memory_gb=hw.memory_gb).node_class
    tuned = measured.models_of(measured.read_plan(stores_root(None), planner.model_key(info)))
    plan = planner.plan(info, job, seq_len=seq_len, budget_gb=budget,
                        measured=tuned.get(planner.tune_key(job, here)))
    key = "segment_size" if job.memory.segment_size == "auto" else "offload"
    if not plan.fits:
        _fail(f"{job_file}: memory.{key}: auto: {plan.reason}")
    disk = "disk" if plan.offload else "none"
    click.echo(f"segment_size {job.memory.segment_size} -> {plan.segment_size}, offload "
               f"{job.memory.offload} -> {disk} (predicted peak {plan.predicted_gb:.2f} GB "
               f"of {budget:g} GB, {plan.source})", err=True)
    return job.model_copy(update={"memory": job.memory.model_copy(
        update={"segment_size": plan.segment_size, "offload": disk})})


# ==================================================================== the fleet

cluster_option = click.option(
    "--cluster", "cluster_file", envvar="SEGCTL_CLUSTER",
    type=click.Path(dir_okay=False, path_type=Path),
    help="the fleet's cluster.yaml [env SEGCTL_CLUSTER]; without it: this machine alone, "
         "stores under $SEGCTL_HOME (default ~/.segctl)")


def _cluster(cluster_file):
    if cluster_file is None:
        return None
    from segctl.schemas.cluster import load_cluster
    return _load(load_cluster, cluster_file)


def _root(spec) -> Path:
    from segctl.schemas.defaults import stores_root
    return stores_root(spec)


def _head(spec, *, start: bool):
    """Connect to the fleet (bringing the embedded one up when allowed) and get the head."""
    from segctl.orchestrator import fleet
    from segctl.orchestrator.head import get_head
    try:
        fleet.connect(spec, start=start)
        return get_head(_root(spec), create=True)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__, EXIT_INTERNAL)


def _knobs(spec) -> dict:
    return spec.planner.model_dump() if spec is not None and spec.planner else {}


def _payload(sweep_file, spec, tokens: dict | None = None):
    """Validate the sweep and everything it names; exit 2 before anything is written.
    `tokens` (a dict) gets each trial's step_tokens by batch size (prepare's)."""
    from segctl.engine.data import DataError
    from segctl.orchestrator.submit import prepare
    from segctl.schemas.spec import load_spec
    from segctl.schemas.sweep import load_sweep, single_job_sweep
    kind, _ = _load(load_spec, sweep_file)
    if kind == "cluster":
        _fail(f"{sweep_file}: this is a cluster file; submit a sweep or a job file")
    sweep = _load(single_job_sweep if kind == "job" else load_sweep, sweep_file)
    _check_families(sweep_file, [t.job.model for t in sweep.trials])
    _check_packing(sweep_file, sweep)
    _check_trackers(sweep_file, [t.job for t in sweep.trials])
    try:
        return prepare(sweep, _knobs(spec), tokens)
    except (ValueError, DataError, OSError) as e:
        _fail(f"{sweep_file}: {e}")


def _status(root: Path, sid: str | None) -> list[dict]:
    return _from_db(root, lambda db: db.status(sid))


def _from_db(root: Path, read):
    """read(state.db's reader); no state.db, or no such sweep: a one-line error."""
    from segctl.orchestrator import state
    try:
        return read(state.read(root / "state.db"))
    except (FileNotFoundError, KeyError) as e:
        _fail(_says(e))


@main.command()
@click.argument("sweep_file", metavar="SWEEP.yaml", type=click.Path(dir_okay=False, path_type=Path))
@cluster_option
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
def plan(sweep_file: Path, cluster_file, as_json: bool):
    """List a sweep's trials and, per node class, the segment size the planner
    picks and its predicted peak, or "does not fit". Runs nothing.

    The planner column says where each prediction comes from: "measured" (the
    model was tuned on that class: `segctl tune`) or "analytic" (estimated
    from the model's shape)."""
    from segctl.orchestrator.submit import plan_rows
    spec = _cluster(cluster_file)
    tokens: dict = {}
    payload = _payload(sweep_file, spec, tokens)
    rows = plan_rows(payload, _declared_nodes(spec), _root(spec), tokens)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        views.console().print(views.plan_table(rows))


def _declared_nodes(spec):
    from segctl.node.probe import default_name, probe
    from segctl.schemas.records import NodeInfo
    if spec is None:
        hw = probe()
        return [NodeInfo(name=default_name(), chip=hw.chip, memory_gb=hw.memory_gb, os=hw.os)]
    return [NodeInfo(name=n.name, chip=n.chip, memory_gb=n.memory_gb, labels=n.labels or {},
                     max_trials=n.max_trials)
            for n in spec.nodes]


@main.command()
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path),
              help="the model folder to tune (default: --job's model)")
@click.option("--method", type=click.Choice(METHODS), default=None,
              help="the loss the probes train with [default: --job's, else sft]")
@click.option("--seq-lens", required=True, metavar="N,N,...",
              help="row lengths in tokens to probe, e.g. 1024,4096,8192")
@click.option("--segment-sizes", default="1,2,4,8", show_default=True, metavar="N,N,...",
              help="segment sizes to probe (sizes over the model's layer count become it)")
@click.option("--job", "job_file", type=click.Path(dir_okay=False, path_type=Path),
              help="probe with this job's LoRA and memory settings (head_chunk, attn_block, "
                   "orpo/dpo.prefix_shared); default: the job defaults. Trials use the measured "
                   "model when their method, head_chunk, attn_block and lora.keys match; LoRA "
                   "rank and layers may differ")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(1, 100),
              help="training steps per point; the first warms up and is not timed")
@click.option("--force", is_flag=True, help="re-measure points the plan table already has")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="where the PNG goes [default: STORES/tune/<model>-<method>.png]")
@cluster_option
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def tune(model_dir, method, seq_lens, segment_sizes, job_file, steps, force, plot_path,
         cluster_file, as_json):
    """Measure a model's peak memory and step time on every node class of the fleet
    (chip + memory budget) and fit the planner's measured memory model.

    \b
    For each (sequence length, segment size) one node of each class runs a few
    real training steps on a synthetic row, classes in parallel, under its
    memory guard: a point that crosses the budget is a measured "does not fit".
    Every point goes into the plan table (STORES/telemetry/plan/); points
    already there are reused unless --force. Then, per class: the fitted
    model's leave-one-out error, the segment size `auto` now picks per length,
    and a PNG of peak against segment size with the budget lines. From then on
    `segctl plan` and the head plan this model from the measurements.

    Probe lengths up to your longest rows: plans reach 2x the longest probe, and
    rows over attn_block (2048) need probes over it; beyond that the planner
    falls back to its analytic estimate and says so. Ctrl-C stops the probes
    and keeps what they measured.
    """
    import ray
    from segctl.orchestrator import fleet, measured, planner
    from segctl.orchestrator import tune as tuning
    from segctl.schemas.job import load_job
    job = _load(load_job, job_file) if job_file else None
    if model_dir is None and job is None:
        _fail("give --model PATH (or --job JOB.yaml)")
    model = str(Path(model_dir).resolve()) if model_dir else job.model
    _check_families("--model", [model])
    if job is not None:   # the probes train as the job does, packed where it asks
        _check_packing(job_file, jobs=[job.model_copy(update={"model": model})])
    try:
        lengths = tuning.parse_ints(seq_lens, "--seq-lens", low=2)
        sizes = tuning.parse_ints(segment_sizes, "--segment-sizes", low=1)
        info = planner.model_info(model)
    except ValueError as e:
        _fail(str(e))
    if lengths[-1] > MAX_TOKENS:   # a probe row that long would only exhaust the nodes
        _fail(f"--seq-lens: {lengths[-1]} is more than {MAX_TOKENS} tokens")
    method = method or (job.method if job else "sft")
    tjob = tuning.tune_job(model, method, job)
    sizes = sorted({min(s, info.n_layers) for s in sizes})
    spec = _cluster(cluster_file)
    root = _root(spec)
    head = _head(spec, start=True)
    nodes = fleet.nodes()
    if not nodes:
        _fail("no node of the fleet is up (segctl cluster status)", EXIT_INTERNAL)
    req = tuning.request(tjob, info, seq_lens=lengths, sizes=sizes, nodes=nodes, root=root,
                         steps=steps, force=force)
    todo = sum(len(c["points"]) for c in req["classes"].values())
    reused = sum(c["reused"] for c in req["classes"].values())
    say = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
    say(f"tuning {req['model_name']} ({req['method_key']}) on {len(req['classes'])} node "
        f"class(es): {len(lengths)} lengths x {len(sizes)} sizes; {todo} point(s) to measure, "
        f"{reused} reused from the plan table")
    tic = time.time()
    tid = ray.get(head.tune.remote(req))
    try:
        status = tuning.wait(lambda: ray.get(head.tune_status.remote(tid)),
                             lambda st: say(views.tune_progress(st)))
    except KeyboardInterrupt:
        ray.get(head.cancel_tune.remote(tid))
        _fail(f"{tid} cancelled: the points measured so far are kept; run the same command "
              "again to measure the rest", 130)
    except ray.exceptions.RayError as e:   # the head went away under the tune
        _fail(f"{tid}: lost the head ({type(e).__name__}); the points measured so far are "
              "kept; run the same command again to measure the rest", EXIT_INTERNAL)
    seconds = time.time() - tic
    margin = spec.planner.margin if spec else DEFAULT_MARGIN
    rows = measured.read_plan(root, req["model_key"])
    fitted = measured.models_of(rows)
    rep = tuning.report(req, tjob, info, rows, fitted, margin=margin)
    rep.update(tune=tid, seconds=round(seconds, 1), measured=todo, reused=reused,
               failed={c: v["error"] for c, v in status["classes"].items() if v["error"]})
    path = plot_path or root / "tune" / f"{req['model_name'].replace('/', '-')}-{req['method_key']}.png"
    rep["plot"] = str(tuning.plot(rep, Path(path), info.n_layers, fitted, tjob))
    if as_json:
        click.echo(json.dumps(rep, indent=2))
    else:
        views.console().print(views.tune_table(rep))
        for line in views.tune_notes(rep):
            click.echo(line)
    if rep["failed"]:
        sys.exit(1)


@main.command()
@click.argument("sweep_file", metavar="SWEEP.yaml", type=click.Path(dir_okay=False, path_type=Path))
@cluster_option
@click.option("--detach", is_flag=True, help="print the sweep id and return; the sweep goes on")
@click.option("--json", "as_json", is_flag=True, help="transitions as JSON lines, not a table")
def submit(sweep_file: Path, cluster_file, detach: bool, as_json: bool):
    """Run a sweep (or a single job) on the fleet.

    \b
    Everything is validated first: a bad file, key, model or data row exits 2
    with one line per problem and nothing is written. Without --cluster, Ray
    starts on this machine (one node, its real memory) and the stores live in
    $SEGCTL_HOME (default ~/.segctl). Without --detach a live table follows the
    trials to the end (Ctrl-C leaves the sweep running). Exit 0 when every
    trial succeeded (or was stopped by the sweep's asha scheduler), 1 otherwise.
    """
    spec = _cluster(cluster_file)
    payload = _payload(sweep_file, spec)   # every refusal comes before Ray is even imported
    import ray
    head = _head(spec, start=True)
    sid = ray.get(head.submit.remote(payload))
    if detach:
        click.echo(sid)
        return
    click.echo(f"sweep {sid}: {len(payload['trials'])} trials", err=True)
    sys.exit(_follow(_root(spec), sid, as_json, head))


HEAD_CHECK_S = 10   # _follow: how often it asks whether the head still runs


def _follow(root: Path, sid: str, as_json: bool, head=None) -> int:
    """Show the sweep until it stops running; the exit code says how it went. A
    head that dies meanwhile (state.db would say RUNNING for ever) ends the wait
    with a line saying how to go on."""
    import time as _time
    from segctl.orchestrator import state
    from segctl.schemas.states import SweepState, TrialState
    db = state.read(root / "state.db")
    seen = 0
    live = None
    checked = _time.monotonic()
    if not as_json and sys.stdout.isatty():
        from rich.live import Live
        live = Live(refresh_per_second=2)
        live.start()
    try:
        while True:
            [sw] = db.status(sid)
            if live:
                live.update(views.trials_table(sw))
            else:
                for e in db.events(seen, sweep=sid):
                    seen = e["id"]
                    click.echo(json.dumps(e) if as_json else views.transition_line(e))
            if sw["state"] != SweepState.RUNNING:
                break
            if head is not None and _time.monotonic() - checked > HEAD_CHECK_S:
                checked = _time.monotonic()
                if not _head_alive(head):
                    click.echo(f"the head stopped while sweep {sid} ran: `segctl resume {sid}` "
                               "continues it", err=True)
                    return 1
            _time.sleep(0.5)
    except KeyboardInterrupt:
        click.echo(f"\nleft sweep {sid} running: segctl status {sid}", err=True)
        return 130
    finally:
        if live:
            live.stop()
    # a trial the sweep's scheduler stopped went as the sweep asked
    stopped = [t for t in sw["trials"] if t["state"] == TrialState.STOPPED]
    failed = [t for t in sw["trials"] if t["state"] not in (TrialState.SUCCEEDED,
                                                            TrialState.STOPPED)]
    click.echo(f"sweep {sid} {sw['state'].lower()}: "
               f"{len(sw['trials']) - len(failed) - len(stopped)} of {len(sw['trials'])} trials "
               f"succeeded" + (f", {len(stopped)} stopped early (asha)" if stopped else "")
               + f"; stores in {root}", err=True)
    return 0 if not failed else 1


@main.command()
@click.argument("sweep", required=False)
@cluster_option
@click.option("--json", "as_json", is_flag=True, help="JSON: per sweep, per trial: state and "
              "attempts (node, segment_size, outcome, peak_gb, ...); indented on a terminal, "
              "one line when piped")
@click.option("--watch", is_flag=True, help="keep showing progress (step bars, ETA) until "
              "Ctrl-C; piped (or with --json): one JSON line per interval")
@click.option("--interval", type=click.FloatRange(0.05, 3600), default=2.0, show_default=True,
              help="--watch: seconds between snapshots")
@click.option("--count", type=click.IntRange(1), default=None,
              help="--watch: stop after N snapshots")
@click.option("--until-done", is_flag=True,
              help="--watch: stop after the first snapshot where no shown sweep is running")
def status(sweep, cluster_file, as_json: bool, watch: bool, interval: float, count,
           until_done: bool):
    """Show sweeps (all, or SWEEP) and their trials, from the head's state.db.

    --watch reads the stores (state.db and the telemetry) every --interval seconds,
    whether or not the head runs: on a terminal a table updating in place, each trial
    with its step bar and ETA (from its recent step rate) and the sweep's totals; piped
    or with --json one JSON line per snapshot ({"time", "sweeps": [...]}). Ctrl-C
    quits with exit 0."""
    if watch or count or until_done:
        sys.exit(_watch(_root(_cluster(cluster_file)), sweep, interval, count, until_done,
                        as_json))
    sweeps = _status(_root(_cluster(cluster_file)), sweep)
    if as_json:   # indented for a person at a terminal; piped, compact (3x faster to write)
        click.echo(json.dumps(sweeps, indent=2 if sys.stdout.isatty() else None))
        return
    console = views.console()
    if not sweeps:
        console.print("no sweeps yet: segctl submit SWEEP.yaml")
    for sw in sweeps:
        console.print(views.trials_table(sw))


def _watch(root: Path, sweep, interval: float, count, until_done: bool, as_json: bool) -> int:
    """`status --watch`: a snapshot every `interval` s, live on a terminal, else JSON lines."""
    from segctl.orchestrator import report
    from segctl.orchestrator.stores import Stores
    from segctl.schemas.states import SweepState
    memo, stores = report.new_memo(), Stores(root)
    try:
        db = report.open_db(root)
        snap = report.progress(db, stores, sweep, memo)
    except (FileNotFoundError, KeyError) as e:
        _fail(_says(e))
    live = None
    if not as_json and sys.stdout.isatty():
        from rich.live import Live
        live = Live(views.watch_view(snap), console=views.console(), auto_refresh=False)
        live.start()
    shown = 0
    try:
        while True:
            shown += 1
            if live:
                live.update(views.watch_view(snap), refresh=True)
            else:
                click.echo(json.dumps({"time": time.time(), "sweeps": snap}))
                sys.stdout.flush()
            if (count and shown >= count) or (
                    until_done and all(s["state"] != SweepState.RUNNING for s in snap)):
                return 0
            time.sleep(interval)
            snap = report.progress(db, stores, sweep, memo)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:   # `| head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if live:
            live.stop()


@main.command()
@click.argument("trial")
@cluster_option
@click.option("-f", "--follow", is_flag=True, help="keep printing until the trial finishes")
def logs(trial, cluster_file, follow: bool):
    """A trial's story: its transitions and each attempt's engine events."""
    import time as _time
    from segctl.orchestrator import state
    from segctl.orchestrator.stores import Stores
    root = _root(_cluster(cluster_file))
    try:
        db = state.read(root / "state.db")
    except FileNotFoundError as e:
        _fail(str(e))
    if db.trial(trial) is None:
        _fail(f"no trial named {trial!r} (segctl status lists them)")
    stores = Stores(root)
    last_event, last_seq = 0, {}
    while True:
        lines = []   # (time, line): transitions and engine events in the order they happened
        for e in db.events(last_event, trial=trial):
            last_event = e["id"]
            lines.append((e["time"], views.transition_line(e)))
        for a in db.attempts(trial):
            for e in stores.events(a["id"], last_seq.get(a["id"], -1)):
                last_seq[a["id"]] = e["seq"]
                lines.append((e.get("time", 0), views.engine_line(e)))
        for _, line in sorted(lines, key=lambda x: x[0]):
            click.echo(line)
        if not follow or state.is_terminal(db.trial(trial)["state"]):
            break
        _time.sleep(0.5)


@main.command()
@click.argument("target", metavar="SWEEP|TRIAL")
@cluster_option
def cancel(target, cluster_file):
    """Cancel a whole sweep or one trial; running attempts are stopped."""
    import ray
    head = _head(_cluster(cluster_file), start=False)
    try:
        done = ray.get(head.cancel.remote(target))
    except KeyError as e:
        _fail(_says(e))
    except ray.exceptions.RayTaskError as e:
        _fail(str(e.cause) if getattr(e, "cause", None) else str(e).splitlines()[-1])
    click.echo(f"cancelled {len(done)} trial(s)" + (f": {', '.join(done)}" if done else ""))


@main.command()
@click.argument("sweep")
@cluster_option
@click.option("--detach", is_flag=True, help="return at once; the sweep goes on")
@click.option("--json", "as_json", is_flag=True, help="transitions as JSON lines")
def resume(sweep, cluster_file, detach: bool, as_json: bool):
    """Continue a sweep after the head restarted. Finished trials are never rerun;
    interrupted ones continue from their last checkpoint."""
    import ray
    spec = _cluster(cluster_file)
    head = _head(spec, start=True)
    try:
        info = ray.get(head.resume.remote(sweep))
    except ray.exceptions.RayTaskError as e:
        _fail(_says(getattr(e, "cause", e)))
    from segctl.schemas.states import SweepState
    click.echo(f"sweep {sweep}: {info['state'].lower()}, {info['unfinished']} unfinished trial(s)",
               err=True)
    if not detach and info["state"] == SweepState.RUNNING:
        sys.exit(_follow(_root(spec), sweep, as_json, head))


def _head_alive(head) -> bool:
    """False once the head actor is dead; a head too busy to answer in time is alive."""
    import ray
    try:
        ray.get(head.ping.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        pass
    return True


@main.command()
@click.argument("sweep")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="new folder: one mlx-lm adapter folder per trial + manifest.json")
@click.option("--best", type=int, default=None,
              help="only the K best trials by --metric (val_loss: each trial's best eval)")
@click.option("--metric", default="val_loss", show_default=True,
              type=click.Choice(["val_loss", "final_loss"]), help="lower is better")
@cluster_option
def gather(sweep, out: Path, best, metric, cluster_file):
    """Export a sweep's adapters: OUT/<trial>/ loads with
    mlx_lm.load(model, adapter_path=OUT/<trial>) and holds the adapter of the trial's
    best eval where it had a validation set, else its last; OUT/manifest.json lists
    trial, parameters, metrics, which adapter ("best" or "last") from which step, and
    the sha256 of every file. Every file is checked against the sha256 its node
    recorded when it sent it: a damaged store exits 1 and writes nothing. OUT and
    its files are the owner's alone (0700 / 0600)."""
    from segctl.orchestrator.gather import Mismatch, gather as do_gather
    from segctl.orchestrator.stores import Stores
    from segctl.schemas.states import TrialState
    if best is not None and best < 1:
        _fail("--best: must be at least 1")
    root = _root(_cluster(cluster_file))
    trials = _from_db(root, lambda db: db.results(sweep))
    if not any(t["state"] == TrialState.SUCCEEDED for t in trials):
        _fail(f"sweep {sweep} has no succeeded trial to gather")
    try:
        path = do_gather(Stores(root), trials, out, best=best, metric=metric)
    except Mismatch as e:   # damaged stores, not bad input
        _fail(str(e), EXIT_INTERNAL)
    except (ValueError, FileExistsError) as e:
        _fail(str(e))
    manifest = json.loads((path / "manifest.json").read_text())
    unchecked = sum(not m["verified"] for m in manifest)
    if unchecked:
        click.echo(f"{unchecked} adapter(s) exported unchecked: the stores hold no sha256 from "
                   "their node (stored by a segctl from before nodes recorded it)", err=True)
    click.echo(f"wrote {len(manifest)} adapter folder(s) and manifest.json to {path}")


@main.command()
@click.argument("sweep")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="the HTML file to write  [default: SWEEP.html here]")
@click.option("--gathered", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="the folder `segctl gather --out` wrote: list its manifest's adapters "
                   "(default: the ones `gather --best K` would export)")
@click.option("--best", type=click.IntRange(1), default=5, show_default=True,
              help="without --gathered: how many adapters to list")
@cluster_option
def report(sweep, out, gathered, best: int, cluster_file):
    """Write one self-contained HTML page about SWEEP (opens offline: no network, its
    data and scripts inline): loss and val-loss curves per trial, per-phase memory
    against each node's budget and the planner's prediction, the attempts per node
    over time (out-of-memory re-plans and lost nodes marked), each swept parameter
    against the best val loss, and the best adapters. Reads only the stores. With
    --gathered, every file there is checked against its manifest and the sha256 its
    node recorded: a changed file exits 1 and writes nothing."""
    from segctl.orchestrator.gather import Mismatch
    from segctl.orchestrator.report import collect, render
    from segctl.schemas.atomic import write_atomic
    out = out or Path(f"{sweep}.html")
    if not out.parent.is_dir():   # refused before the stores are read
        _fail(f"--out {out}: folder {out.parent} does not exist")
    try:
        data = collect(_root(_cluster(cluster_file)), sweep, gathered=gathered, best=best)
    except Mismatch as e:   # damaged stores or gathered folder, not bad input
        _fail(str(e), EXIT_INTERNAL)
    except (FileNotFoundError, KeyError, ValueError) as e:
        _fail(_says(e))
    try:
        write_atomic(out, render(data), mode=0o600)   # who trained what is the owner's alone
    except OSError as e:
        _fail(f"--out {out}: cannot write there ({e.strerror or e})")
    click.echo(f"wrote {out}: {len(data['trials'])} trials, {out.stat().st_size:,} bytes")


# -------------------------------------------------------------------- cluster / node

@main.group()
def cluster():
    """Start, stop and show the fleet described by a cluster.yaml."""


def _cluster_arg(f):
    return click.argument("cluster_file", metavar="[CLUSTER.yaml]", required=False,
                          envvar="SEGCTL_CLUSTER",
                          type=click.Path(dir_okay=False, path_type=Path))(f)


@cluster.command("up")
@_cluster_arg
@click.option("--json", "as_json", is_flag=True, help="print the fleet record (address, pids)")
def cluster_up(cluster_file, as_json: bool):
    """Start the head and every node (local ones here, remote ones over ssh). A
    fleet already up is left as it is; nodes missing from it are started."""
    from segctl.orchestrator import fleet
    spec = _cluster(cluster_file)
    if not as_json:
        n = len(spec.nodes) if spec else 1
        click.echo(f"starting the head and {n} node(s) ...", err=True)
    try:
        info = fleet.up(spec)
    except (RuntimeError, OSError, TimeoutError) as e:
        _fail(str(e).splitlines()[0], EXIT_INTERNAL)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        names = list(info.get("nodes") or {})
        if (info.get("head") or {}).get("node"):
            names.insert(0, f"{info['head']['node']} (on the head)")
        click.echo(f"fleet up: head {info.get('address')}; nodes: {', '.join(names) or 'none'}; "
                   f"stores {_root(spec)}")


@cluster.command("down")
@_cluster_arg
def cluster_down(cluster_file):
    """Stop every node and the head this fleet started (running trials are lost
    to the head; `segctl resume` continues them after the next `up`)."""
    from segctl.orchestrator import fleet
    try:
        fleet.down(_cluster(cluster_file))
    except (RuntimeError, OSError) as e:
        _fail(str(e).splitlines()[0], EXIT_INTERNAL)
    click.echo("fleet down")


@cluster.command("status")
@_cluster_arg
@click.option("--json", "as_json", is_flag=True)
def cluster_status(cluster_file, as_json: bool):
    """Per node: chip, memory budget, busy/free and the trial running there; per
    Ray node (the head too): its address and the TCP ports its Ray processes
    listen on, with the address each is bound to ("*": every interface)."""
    from segctl.orchestrator import fleet
    from segctl.orchestrator import state
    spec = _cluster(cluster_file)
    try:
        fleet.connect(spec, start=False)
    except (ConnectionError, RuntimeError) as e:
        _fail(str(e).splitlines()[0], EXIT_INTERNAL)
    running = {}
    db = _root(spec) / "state.db"
    if db.exists():
        for a in state.read(db).open_attempts():
            running.setdefault(a["node"], []).append(a["trial"])   # up to its max_trials
    ray_nodes = fleet.ports()
    where = {name: r for r in ray_nodes for name in r["names"]}
    nodes, warnings = [], []
    for n in fleet.nodes(warnings):
        r = where.get(n.name, {})
        nodes.append(dict(n.model_dump(), trial=", ".join(running.get(n.name, [])) or None,
                          trials=running.get(n.name, []), trains=True,
                          head=r.get("head", False), address=r.get("address"),
                          listening=r.get("listening", []),
                          **({"error": r["error"]} if "error" in r else {})))
    for r in ray_nodes:   # the head, when it trains nothing: its own entry ("(head)")
        if r["head"] and not r["names"]:
            nodes.insert(0, dict(name="(head)", chip=None, memory_gb=None, os=None, labels={},
                                 alive=True, trial=None, trains=False, head=True,
                                 address=r["address"], listening=r["listening"],
                                 **({"error": r["error"]} if "error" in r else {})))
    for d in (spec.nodes if spec else []):
        if d.name not in {n["name"] for n in nodes}:
            nodes.append(dict(name=d.name, chip=d.chip, memory_gb=d.memory_gb, os="?",
                              labels=d.labels or {}, alive=False, trial=None, trains=True,
                              head=False, address=None, listening=[]))
    for w in warnings:   # a node the head ignores: its labels do not parse
        click.echo(one_line(f"segctl: warning: {w}"), err=True)
    if as_json:
        click.echo(json.dumps(nodes, indent=2))
        return
    from rich.table import Table
    console = views.console()
    console.print(views.nodes_table([n for n in nodes if n["trains"]]))
    ports = Table(title="listening (TCP)", title_justify="left")
    for col in ("node", "address", "process", "pid", "bound to", "ports"):
        ports.add_column(col)
    for n in nodes:
        if n.get("error"):
            ports.add_row(n["name"], n["address"] or "", f"[red]{n['error']}[/]", "", "", "")
        by: dict = {}
        for p in n["listening"]:
            by.setdefault((p["process"], p["pid"], p["address"]), []).append(str(p["port"]))
        for (proc, pid, bound), nums in sorted(by.items(), key=lambda kv: int(kv[1][0])):
            ports.add_row(n["name"], n["address"] or "", proc, str(pid),
                          "every interface" if bound == "*" else bound, ", ".join(nums))
    console.print(ports)


@main.group()
def node():
    """Run on each Mac of a fleet: join it to the head (wraps `ray start`)."""


@node.command("start")
@click.option("--head", "is_head", is_flag=True, help="start the head here")
@click.option("--join", "address", metavar="HOST:PORT", help="join the head at HOST:PORT")
@click.option("--name", default=None, help="node name (default: the hostname)")
@click.option("--memory-gb", type=float, default=None,
              help="training budget (default: this machine's memory from the probe)")
@click.option("--chip", default=None, help="default: from the probe (e.g. m2-max)")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="extra node label")
@click.option("--max-trials", type=click.IntRange(1, MAX_TRIALS_PER_NODE), default=DEFAULT_NODE_MAX_TRIALS,
              show_default=True, help="trials this node runs at once (while their predicted "
                                      "peaks fit --memory-gb)")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, help="--head: the Ray port")
@click.option("--stores", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="--head: stores root (default $SEGCTL_HOME or ~/.segctl)")
@click.option("--token-stdin", is_flag=True,
              help="read the cluster token from stdin (else $SEGCTL_HOME/auth_token)")
def node_start(is_head, address, name, memory_gb, chip, labels, max_trials, port, stores,
               token_stdin):
    """Start Ray on this machine as the head (--head) or as a node of the head at
    HOST:PORT (--join), with this machine's chip, memory and labels."""
    import math

    from segctl.node.probe import default_name, probe
    from segctl.orchestrator import fleet
    from segctl.schemas.limits import MAX_MEMORY_GB
    if is_head == bool(address):
        _fail("give exactly one of --head or --join HOST:PORT")
    if memory_gb is not None and not (math.isfinite(memory_gb) and 0 < memory_gb <= MAX_MEMORY_GB):
        # click reads inf and nan as numbers; the planner would fit everything or nothing
        _fail(f"--memory-gb {memory_gb:g}: expected a finite number of GB > 0 and at most "
              f"{MAX_MEMORY_GB}")
    parsed = {}
    for item in labels:
        k, sep, v = item.partition("=")
        if not sep or not k:
            _fail(f"--label {item!r}: expected KEY=VALUE")
        parsed[k] = v
    hw = probe()
    try:
        info = fleet.start_here(head=is_head, address=address, name=name or default_name(),
                                memory_gb=memory_gb or hw.memory_gb, chip=chip or hw.chip,
                                labels=parsed, port=port, stores=stores,
                                token=sys.stdin.read().strip() if token_stdin else None, hw=hw,
                                max_trials=max_trials)
    except (RuntimeError, OSError, TimeoutError, ValueError) as e:
        _fail(str(e).splitlines()[0], EXIT_INTERNAL)
    click.echo(json.dumps(info))


@node.command("stop")
def node_stop():
    """Stop the Ray processes `segctl node start` started on this machine."""
    from segctl.orchestrator import fleet
    click.echo(json.dumps(fleet.stop_here()))


@main.group()
def lab():
    """A lab of N hosts on this Linux machine to try a fleet on (needs root): each
    host is a network namespace with its own address in 198.18.0.0/15, its own
    home and /tmp, and its own sshd. `segctl lab up 4`, then a cluster.yaml naming
    h2..h4 as hosts, run from `ssh h1`; docs/fleet.md walks through it."""


def _lab_root(f):
    return click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
                        help="the lab's folder: new, empty, or one a lab made "
                             "(its lab.json)  [default: /var/lib/segctl-lab]")(f)


@lab.command("up")
@click.argument("n", type=click.IntRange(1, 200))
@_lab_root
@click.option("--json", "as_json", is_flag=True, help="the hosts as JSON")
def lab_up(n: int, root, as_json: bool):
    """Make N hosts h1..hN (198.18.0.11, .12, ...), each answering ssh."""
    from segctl.orchestrator import lab as lablib
    try:
        made = lablib.up(n, root or lablib.LAB_ROOT)
    except lablib.NotALab as e:      # a folder that is not a lab's: left as it was
        _fail(str(e))
    except lablib.LabError as e:
        _fail(str(e), EXIT_INTERNAL)
    if as_json:
        click.echo(json.dumps([{"name": h.name, "address": h.address, "home": str(h.home),
                                "sshd_pid": h.sshd_pid} for h in made.hosts], indent=2))
        return
    for h in made.hosts:
        click.echo(f"{h.name}  {h.address}  home {h.home}  sshd pid {h.sshd_pid}")
    click.echo(f"ssh -F {made.ssh_config} h1 CMD   (or PATH={made.root / 'bin'}:$PATH ssh h1 CMD)")


@lab.command("down")
@_lab_root
def lab_down(root):
    """Stop everything running in the lab's hosts; remove its namespaces and bridge."""
    from segctl.orchestrator import lab as lablib
    try:
        lablib.down(root or lablib.LAB_ROOT)
    except lablib.NotALab as e:
        _fail(str(e))
    except lablib.LabError as e:
        _fail(str(e), EXIT_INTERNAL)
    click.echo("lab down")


if __name__ == "__main__":
    main()
