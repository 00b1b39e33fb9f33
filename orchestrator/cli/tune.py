"""`segctl tune`: measure a model's memory on every node class of the fleet and fit
the planner's measured model. Imports inside functions: see cli/__init__.py."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from segctl.schemas.defaults import DEFAULT_MARGIN
from segctl.schemas.limits import MAX_TOKENS
from segctl.schemas.names import EXIT_INTERNAL, METHODS

from .. import cli, views  # cli._head is looked up when called: tests replace it
from . import _cluster, _fail, _load, _root, cluster_option, main
from .checks import check_families, check_packing


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
    check_families("--model", [model])
    if job is not None:   # the probes train as the job does, packed where it asks
        check_packing(job_file, jobs=[job.model_copy(update={"model": model})])
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
    head = cli._head(spec, start=True)
    nodes = fleet.nodes()
    if not nodes:
        _fail("no node of the fleet is up (segctl cluster status)", EXIT_INTERNAL)
    req = tuning.request(tjob, info, seq_lens=lengths, sizes=sizes, nodes=nodes, root=root,
                         steps=steps, force=force)
    todo = sum(len(c["points"]) for c in req["classes"].values())
    reused = sum(c["reused"] for c in req["classes"].values())
    say = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
    say(views.tune_start_line(req, lengths, sizes, todo, reused))
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
