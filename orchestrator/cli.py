"""segctl: LoRA fine-tuning with the segmented-backward engine.

Commands are thin: parse, call one library function, print. User errors are one
line on stderr and exit code 2; the memory guard exits 3; nothing else leaks a
traceback unless SEGCTL_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import click

from schemas import SpecError
from schemas import events as ev


def _fail(message: str, code: int = ev.EXIT_BAD_INPUT):
    click.echo(f"segctl: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="segctl")
def main():
    """Fine-tune LLMs with LoRA under MLX, one segment of layers in memory at a time.

    \b
    Start here:
      segctl init-demo demo        # tiny random model + data + demo/job.yaml
      segctl train demo/job.yaml   # train it; the adapter lands in demo/adapters
    """


@main.command("init-demo")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(["llama", "qwen3", "minicpm"]), default="qwen3",
              show_default=True, help="mlx-lm architecture of the demo model")
@click.option("--seed", default=0, show_default=True, help="seed for weights and data")
def init_demo(directory: Path, arch: str, seed: int):
    """Write a small random-initialised model (Hugging Face layout), a synthetic SFT
    data set it visibly learns, and DIRECTORY/job.yaml. Nothing is downloaded."""
    from engine.demo import write_demo
    try:
        job = write_demo(directory, arch, seed=seed)
    except FileExistsError as e:
        _fail(str(e))
    click.echo(f"wrote {directory}/ (model/, data/, job.yaml)\nnext: segctl train {job}")


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
def validate(spec: Path):
    """Check a job file without running anything (exit 2 and one line per problem)."""
    from schemas.job import load_job
    try:
        load_job(spec)
    except SpecError as e:
        for line in e.problems:
            click.echo(line, err=True)
        sys.exit(ev.EXIT_BAD_INPUT)
    click.echo(f"{spec}: ok")


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
    from schemas.job import load_job
    from engine import telemetry
    from engine.data import DataError
    from engine.model import ModelError
    from engine.step import StepError
    from engine.train import OOMError, OutputError, run

    try:
        job = load_job(job_file)
    except SpecError as e:
        for line in e.problems:
            click.echo(line, err=True)
        sys.exit(ev.EXIT_BAD_INPUT)

    screen = telemetry.json_lines(sys.stdout) if as_json else telemetry.for_terminal()
    emit = telemetry.fan_out(screen, telemetry.events_file(lambda: job.output))
    step = {"n": None}

    def tracked(event):
        if isinstance(event, ev.Step):
            step["n"] = event.step
        emit(event)

    def error(kind, message, code):
        emit(ev.Error(time=time.time(), kind=kind, message=message, step=step["n"]))
        _fail(message, code)

    try:
        run(job, resume=resume, emit=tracked)
    except (ModelError,) as e:
        error("model", str(e), ev.EXIT_BAD_INPUT)
    except (DataError, StepError) as e:
        error("data", str(e), ev.EXIT_BAD_INPUT)
    except OutputError as e:
        error("data", str(e), ev.EXIT_BAD_INPUT)
    except OOMError as e:
        error("oom", str(e), ev.EXIT_OOM)
    except KeyboardInterrupt:
        error("internal", "interrupted", 130)
    except Exception as e:  # a bug of ours: say so in one line, keep the trace for debugging
        if os.environ.get("SEGCTL_DEBUG"):
            traceback.print_exc()
        error("internal", f"internal error: {type(e).__name__}: {e}", ev.EXIT_INTERNAL)


if __name__ == "__main__":
    main()
