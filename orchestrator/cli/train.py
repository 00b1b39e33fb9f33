"""One machine, no Ray: `segctl init-demo` and `segctl train`. Imports inside
functions: see cli/__init__.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from segctl.schemas.defaults import segctl_home, stores_root
from segctl.schemas.limits import one_line
from segctl.schemas.names import DEMO_ARCHS, METHODS

from .. import views
from . import _fail, _load, main
from .checks import check_trackers


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
    from segctl.engine import telemetry
    from segctl.engine.train import run_reported
    from segctl.schemas.job import load_job

    job = _load(load_job, job_file)
    if job.output is None:
        _fail(f"{job_file}: output: required key is missing (segctl train writes the adapter there)")
    check_trackers(job_file, [job])
    job = _resolve_auto(job, job_file)

    screen = telemetry.json_lines(sys.stdout) if as_json else telemetry.for_terminal()
    emit = telemetry.fan_out(screen, telemetry.events_file(lambda: job.output))
    if job.report_to:   # the trackers hear the run's events too, in $SEGCTL_HOME/trackers by default
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
    from segctl.node.hardware import default_name, probe
    from segctl.orchestrator import planner
    from segctl.orchestrator.memory_settings import Tuned, plan_for, resolved
    from segctl.schemas.records import NodeInfo
    try:
        info = planner.model_info(job.model)
        seq_len = planner.step_tokens(job)   # the longest packed sequence where the job packs
    except (ValueError, DataError) as e:
        _fail(f"{job_file}: {e}")
    hw = probe()
    budget = job.memory.budget_gb or hw.memory_gb
    here = NodeInfo(name=default_name(), chip=hw.chip, memory_gb=hw.memory_gb).node_class
    plan = plan_for(Tuned(stores_root(None)), info, job, seq_len=seq_len, node_class=here,
                    budget_gb=budget)
    key = "segment_size" if job.memory.segment_size == "auto" else "offload"
    if not plan.fits:
        _fail(f"{job_file}: memory.{key}: auto: {plan.reason}")
    done = resolved(job, plan)
    click.echo(views.resolved_line(job.memory, plan, done.memory.offload, budget), err=True)
    return done
