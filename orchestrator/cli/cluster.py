"""The fleet's machines: `segctl cluster up/down/status` (from a cluster.yaml) and
`segctl node start/stop` (on one Mac, wrapping `ray start`). Imports inside
functions: see cli/__init__.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from segctl.schemas.defaults import DEFAULT_NODE_MAX_TRIALS, DEFAULT_PORT
from segctl.schemas.limits import MAX_MEMORY_GB, MAX_TRIALS_PER_NODE, one_line
from segctl.schemas.names import EXIT_INTERNAL

from .. import views
from . import _cluster, _fail, _root, main


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
        click.echo(views.fleet_up_line(info, _root(spec)))


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
    from segctl.orchestrator import fleet, state
    from segctl.schemas.records import attempt_nodes
    spec = _cluster(cluster_file)
    try:
        fleet.connect(spec, start=False)
    except (ConnectionError, RuntimeError) as e:
        _fail(str(e).splitlines()[0], EXIT_INTERNAL)
    running: dict = {}
    db = _root(spec) / "state.db"
    if db.exists():
        for a in state.read(db).open_attempts():
            for node in attempt_nodes(a["node"]):   # an attempt on several nodes: each one
                running.setdefault(node, []).append(a["trial"])   # up to its max_trials
    ray_nodes = fleet.ports()
    where = {name: r for r in ray_nodes for name in r["names"]}
    nodes: list = []
    warnings: list = []
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
    console = views.console()
    console.print(views.nodes_table([n for n in nodes if n["trains"]]))
    console.print(views.ports_table(nodes))


@cluster.command("check")
@_cluster_arg
@click.option("--json", "as_json", is_flag=True, help="print the whole report as JSON")
@click.option("--mb", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="MB each pair's bandwidth test sends")
def cluster_check(cluster_file, as_json: bool, mb: int):
    """Before training on a fleet: is every node reachable over ssh, on the head's
    segctl / mlx / mlx-lm / Ray versions and token? Per node its memory and chip;
    per pair of nodes the latency and bandwidth of the link a ring of theirs would
    use (to the address a node joins the fleet with), the interface it leaves by,
    and a warning where a faster one is up (Wi-Fi while a Thunderbolt bridge is).
    Exit 1 when a problem is found, 2 for a bad cluster file."""
    from segctl.orchestrator.cluster_check import check
    spec = _cluster(cluster_file)
    if spec is None:
        _fail("cluster check needs a cluster file: give CLUSTER.yaml or set $SEGCTL_CLUSTER")
    report = check(spec, nbytes=mb << 20)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        console = views.console()
        console.print(views.check_nodes_table(report))
        if report["pairs"]:
            console.print(views.check_pairs_table(report["pairs"]))
        for line in report["problems"]:
            click.echo(one_line(f"segctl: problem: {line}"), err=True)
        if not report["problems"]:
            click.echo(f"{len(report['nodes'])} node(s) checked: no problem found")
    sys.exit(1 if report["problems"] else 0)


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
    from segctl.node.hardware import default_name, probe
    from segctl.orchestrator import fleet
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


@node.command("facts")
@click.option("--head", metavar="ADDRESS", default=None,
              help="the head's address (the node's own is the one on the route to it)")
def node_facts(head):
    """Print this machine's facts as JSON for `segctl cluster check`: versions,
    chip, memory, the cluster token's fingerprint, interfaces, fleet address."""
    from segctl.node import link
    click.echo(json.dumps(link.facts(head)))


@node.command("link-serve")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="TCP port to listen on (0: a free one)")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=60, show_default=True,
              help="seconds to wait for the tester and for each of its messages")
def node_link_serve(port, timeout):
    """Answer one `segctl node link-test` (for `segctl cluster check`): prints the
    port it listens on, then serves one tester and exits."""
    from segctl.node import link
    try:
        # flushed at once: over ssh stdout is a pipe, and the tester waits for the port
        link.serve(port, timeout, ready=lambda p: print(p, flush=True))
    except OSError as e:
        _fail(f"link-serve: {e}", EXIT_INTERNAL)


@node.command("link-test")
@click.option("--to", "to", required=True, metavar="HOST:PORT",
              help="a `segctl node link-serve` of another node")
@click.option("--bytes", "nbytes", type=click.IntRange(1, 1 << 32), default=64 << 20,
              show_default=True, help="bytes sent for the bandwidth")
def node_link_test(to, nbytes):
    """Time a link to a `segctl node link-serve`: the median round trip of one
    byte and the bandwidth of --bytes sent one way, as JSON."""
    from segctl.node import link
    host, sep, port = to.rpartition(":")
    if not sep or not host or not port.isdigit():
        _fail(f"--to {to!r}: expected HOST:PORT")
    try:
        click.echo(json.dumps(link.measure(host.strip("[]"), int(port), nbytes)))
    except (OSError, ConnectionError) as e:
        _fail(f"link-test {to}: {e}", EXIT_INTERNAL)


@node.command("stop")
def node_stop():
    """Stop the Ray processes `segctl node start` started on this machine."""
    from segctl.orchestrator import fleet
    click.echo(json.dumps(fleet.stop_here()))
