"""Where events go: JSON lines for programs, a progress bar for people."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO

from segctl.schemas import events as ev


def json_lines(stream: IO[str]):
    def emit(event: ev.Event):
        stream.write(event.model_dump_json() + "\n")
        stream.flush()
    return emit


def events_file(folder_of):
    """Append events to <output>/events.jsonl, opened at the first event (the
    trainer creates the output folder only once its inputs are known good)."""
    state = {"f": None}

    def emit(event: ev.Event):
        if state["f"] is None:
            path = Path(folder_of()) / "events.jsonl"
            if not path.parent.exists():
                return
            state["f"] = open(path, "a", encoding="utf-8")
        state["f"].write(event.model_dump_json() + "\n")
        state["f"].flush()
    return emit


class ProgressBar:
    """A rich progress bar with loss, memory and speed; prints evals and checkpoints."""

    def __init__(self, console=None):
        from rich.console import Console
        self.console = console or Console(stderr=False)
        self.progress = None
        self.task = None

    def __call__(self, event: ev.Event):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        if isinstance(event, ev.Start):
            how = f"segment_size {event.segment_size}" if event.segment_size else event.mode
            resumed = f", resumed at step {event.resumed_from}" if event.resumed_from is not None else ""
            self.console.print(f"[bold]{event.job}[/]: {event.train_rows} rows, {how}, "
                               f"{event.trainable_params:,} LoRA parameters{resumed}"
                               + (f", {event.truncated} truncated" if event.truncated else "")
                               + (f", {event.skipped} skipped" if event.skipped else ""))
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                     TimeElapsedColumn(), TimeRemainingColumn(),
                                     console=self.console, transient=False)
            self.progress.start()
            self.task = self.progress.add_task("train", total=event.total_steps,
                                               completed=event.resumed_from or 0, info="")
        elif isinstance(event, ev.Step) and self.progress:
            self.progress.update(self.task, completed=event.step,
                                 info=f"loss {event.loss:.3f}  peak {event.peak_gb:.2f} GB  "
                                      f"{event.tokens_per_s:.0f} tok/s"
                                      + (f"  margin {event.margin:+.2f}"
                                         if event.margin is not None else ""))
        elif isinstance(event, ev.Eval):
            self._print(f"step {event.step}: val_loss {event.val_loss:.3f}")
        elif isinstance(event, ev.Checkpoint):
            self._print(f"step {event.step}: checkpoint {event.path}")
        elif isinstance(event, ev.End):
            self.close()
            self.console.print(f"done: adapter {event.adapter}"
                               + (f" (val_loss {event.val_loss:.3f})" if event.val_loss is not None else ""))
        elif isinstance(event, ev.Error):
            self.close()

    def _print(self, text):
        (self.progress.console if self.progress else self.console).print(text)

    def close(self):
        if self.progress:
            self.progress.stop()
            self.progress = None


def fan_out(*sinks):
    def emit(event):
        for s in sinks:
            s(event)
    return emit


def for_terminal(stream=None):
    stream = stream or sys.stdout
    return ProgressBar() if stream.isatty() else json_lines(stream)
