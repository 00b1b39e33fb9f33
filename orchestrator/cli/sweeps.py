"""A sweep's life on the fleet: `validate`, `plan`, `submit`, `status`, `logs`,
`cancel` and `resume`. Imports inside functions: see cli/__init__.py."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from segctl.schemas.states import SweepState, TrialState

from .. import cli, views  # cli._head is looked up when called: tests replace it
from . import _cluster, _fail, _from_db, _load, _root, _says, cluster_option, main
from .checks import check_families, check_nodes, check_packing, check_trackers

HEAD_CHECK_S = 10   # _follow: how often it asks whether the head still runs


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
def validate(spec: Path):
    """Check a job, sweep or cluster file without running or writing anything
    (exit 2 and one `file:line: key: message` per problem)."""
    from segctl.schemas.spec import load_spec
    kind, obj = _load(load_spec, spec)
    if kind in ("job", "sweep"):
        check_families(spec, [obj.model] if kind == "job" else [t.job.model for t in obj.trials])
        check_packing(spec, obj if kind == "sweep" else None, [obj] if kind == "job" else None)
        check_trackers(spec, [obj] if kind == "job" else [t.job for t in obj.trials])
    what = {"job": "job", "sweep": f"sweep of {len(getattr(obj, 'trials', []))} trials",
            "cluster": f"cluster of {len(getattr(obj, 'nodes', []))} nodes"}[kind]
    click.echo(f"{spec}: ok ({what})")


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
    check_families(sweep_file, [t.job.model for t in sweep.trials])
    check_packing(sweep_file, sweep)
    check_trackers(sweep_file, [t.job for t in sweep.trials])
    check_nodes(sweep_file, sweep, _declared_nodes(spec))
    try:
        return prepare(sweep, _knobs(spec), tokens)
    except (ValueError, DataError, OSError) as e:
        _fail(f"{sweep_file}: {e}")


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
    from segctl.node.hardware import default_name, probe
    from segctl.schemas.records import NodeInfo
    if spec is None:
        hw = probe()
        return [NodeInfo(name=default_name(), chip=hw.chip, memory_gb=hw.memory_gb, os=hw.os)]
    return [NodeInfo(name=n.name, chip=n.chip, memory_gb=n.memory_gb, labels=n.labels or {},
                     max_trials=n.max_trials, rdma=n.rdma)
            for n in spec.nodes]


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
    head = cli._head(spec, start=True)
    sid = ray.get(head.submit.remote(payload))
    if detach:
        click.echo(sid)
        return
    click.echo(f"sweep {sid}: {len(payload['trials'])} trials", err=True)
    sys.exit(_follow(_root(spec), sid, as_json, head))


def _follow(root: Path, sid: str, as_json: bool, head=None) -> int:
    """Show the sweep until it stops running; the exit code says how it went. A
    head that dies meanwhile (state.db would say RUNNING for ever) ends the wait
    with a line saying how to go on."""
    from segctl.orchestrator import state
    db = state.read(root / "state.db")
    seen = 0
    live = None
    checked = time.monotonic()
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
            if head is not None and time.monotonic() - checked > HEAD_CHECK_S:
                checked = time.monotonic()
                if not _head_alive(head):
                    click.echo(f"the head stopped while sweep {sid} ran: `segctl resume {sid}` "
                               "continues it", err=True)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        click.echo(f"\nleft sweep {sid} running: segctl status {sid}", err=True)
        return 130
    finally:
        if live:
            live.stop()
    click.echo(views.sweep_end_line(sid, sw, root), err=True)
    # a trial the sweep's scheduler stopped went as the sweep asked
    done = (TrialState.SUCCEEDED, TrialState.STOPPED)
    return 0 if all(t["state"] in done for t in sw["trials"]) else 1


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
    sweeps = _from_db(_root(_cluster(cluster_file)), lambda db: db.status(sweep))
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
    last_event = 0
    last_seq: dict[int, int] = {}   # attempt -> the last event seq shown
    while True:
        lines = []   # (time, line): transitions and engine events in the order they happened
        for move in db.events(last_event, trial=trial):
            last_event = move["id"]
            lines.append((move["time"], views.transition_line(move)))
        for a in db.attempts(trial):
            for event in stores.events(a["id"], last_seq.get(a["id"], -1)):
                last_seq[a["id"]] = event["seq"]
                lines.append((event.get("time", 0), views.engine_line(event)))
        for _, line in sorted(lines, key=lambda x: x[0]):
            click.echo(line)
        row = db.trial(trial)
        if not follow or row is None or state.is_terminal(row["state"]):
            break
        time.sleep(0.5)


@main.command()
@click.argument("target", metavar="SWEEP|TRIAL")
@cluster_option
def cancel(target, cluster_file):
    """Cancel a whole sweep or one trial; running attempts are stopped."""
    import ray
    head = cli._head(_cluster(cluster_file), start=False)
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
    head = cli._head(spec, start=True)
    try:
        info = ray.get(head.resume.remote(sweep))
    except ray.exceptions.RayTaskError as e:
        _fail(_says(getattr(e, "cause", e)))
    click.echo(f"sweep {sweep}: {info['state'].lower()}, {info['unfinished']} unfinished trial(s)",
               err=True)
    if not detach and info["state"] == SweepState.RUNNING:
        sys.exit(_follow(_root(spec), sweep, as_json, head))
