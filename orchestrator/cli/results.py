"""What a sweep leaves: `segctl gather` (its adapters) and `segctl report` (one
HTML page). Both read only the stores. Imports inside functions: see
cli/__init__.py."""

from __future__ import annotations

import json
from pathlib import Path

import click

from segctl.schemas.names import EXIT_INTERNAL
from segctl.schemas.states import TrialState

from . import _cluster, _fail, _from_db, _root, _says, cluster_option, main


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
    from segctl.orchestrator.gather import Mismatch
    from segctl.orchestrator.gather import gather as do_gather
    from segctl.orchestrator.stores import Stores
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
