"""`segctl lab up/down`: the lab rig (segctl.lab), hosts in network namespaces on
one Linux machine to try a fleet on. Imports inside functions: see
cli/__init__.py."""

from __future__ import annotations

import json
from pathlib import Path

import click

from segctl.schemas.names import EXIT_INTERNAL

from .. import views
from . import _fail, main


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
    from segctl import lab as lablib
    try:
        made = lablib.up(n, root or lablib.LAB_ROOT)
    except lablib.NotALab as e:      # a folder that is not a lab's: left as it was
        _fail(str(e))
    except lablib.LabError as e:
        _fail(str(e), EXIT_INTERNAL)
    if as_json:
        click.echo(json.dumps(views.lab_hosts(made), indent=2))
        return
    for line in views.lab_lines(made):
        click.echo(line)


@lab.command("down")
@_lab_root
def lab_down(root):
    """Stop everything running in the lab's hosts; remove its namespaces and bridge."""
    from segctl import lab as lablib
    try:
        lablib.down(root or lablib.LAB_ROOT)
    except lablib.NotALab as e:
        _fail(str(e))
    except lablib.LabError as e:
        _fail(str(e), EXIT_INTERNAL)
    click.echo("lab down")
