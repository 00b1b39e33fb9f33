"""segctl: LoRA fine-tuning with the segmented-backward engine.

Commands are thin: parse, call one library function, print. User errors are one
line on stderr and exit code 2; the memory guard exits 3; nothing else leaks a
traceback unless SEGCTL_DEBUG=1.

This module holds the command group `main` and what every command group shares
(errors, loading specs, reaching the fleet); the commands live one group to a
module beside it and register themselves on `main`; what they show people is
built in orchestrator/views.py.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import click

from segctl.schemas import SpecError
from segctl.schemas.defaults import stores_root
from segctl.schemas.errors import UserError
from segctl.schemas.limits import one_line

# stdlib-only names: the CLI starts without loading pydantic (schemas/names.py)
from segctl.schemas.names import EXIT_BAD_INPUT, EXIT_INTERNAL

# Imports inside functions, here and in every command module: `segctl status`,
# `logs` and `gather` pay the CLI's start-up each time, so pydantic, Ray, MLX and
# Arrow load only in the commands that use them (tests/test_layout.py), and
# `validate` never loads Ray.


def _fail(message: str, code: int = EXIT_BAD_INPUT):
    click.echo(one_line(f"segctl: {message}"), err=True)
    sys.exit(code)


def _says(e: BaseException) -> str:
    """An error's message: a KeyError's own text, not its repr's quotes."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


class _Group(click.Group):
    def invoke(self, ctx):
        from segctl.orchestrator.state_db import OPENED, unusable
        try:
            return super().invoke(ctx)
        except UserError as e:   # e.g. a corrupt or locked state.db or staging.db, named
            _fail(str(getattr(e, "cause", None) or e), e.exit_code)   # (the head's, by its cause)
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


def _load(loader, path):
    try:
        return loader(path)
    except SpecError as e:
        for line in e.problems:
            click.echo(one_line(line), err=True)
        sys.exit(EXIT_BAD_INPUT)


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
    return stores_root(spec)


def _head(spec, *, start: bool):
    """Connect to the fleet (bringing the embedded one up when allowed) and get the head.
    Commands call it as `cli._head`, looked up when called: the hostile-input tests
    replace it to prove that bad input is refused before the fleet is reached."""
    from segctl.orchestrator import fleet
    from segctl.orchestrator.actor import get_head
    try:
        fleet.connect(spec, start=start)
        return get_head(_root(spec), create=True)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__, EXIT_INTERNAL)


def _from_db(root: Path, read):
    """read(state.db's reader); no state.db, or no such sweep: a one-line error."""
    from segctl.orchestrator import state
    try:
        return read(state.read(root / "state.db"))
    except (FileNotFoundError, KeyError) as e:
        _fail(_says(e))


# The command groups, each registering its commands on `main` (last: they import the above).
from . import cluster, lab, results, sweeps, train, tune  # noqa: E402,F401
