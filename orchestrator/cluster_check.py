"""`segctl cluster check`: before a fleet trains (and a job's ranks form a ring),
is every node of a cluster.yaml reachable over ssh, running the same segctl,
mlx, mlx-lm and Ray as the head, holding the head's token, and how fast is the
link each pair of nodes would send a ring's traffic over?

Run on the head's machine (where `cluster up` runs). Each node answers `segctl
node facts` over ssh (node/link.py); each pair (a, b) runs a link test, b
serving (`segctl node link-serve`) and a sending (`segctl node link-test`) to
the address b joins the fleet with, which is the address a ring of theirs
would use. `verdict` turns what came back into problems, a pure function the
tests feed by hand; `check` does the ssh.
"""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import combinations
from pathlib import Path

from segctl.node import link
from segctl.schemas.limits import error_line

from .fleet import SSH_TIMEOUT_S, ssh_argv


def check(spec, *, nbytes: int = link.LINK_BYTES, ssh=subprocess.run,
          popen=subprocess.Popen) -> dict:
    """{"head", "nodes", "pairs", "problems"} for the cluster `spec`."""
    head = None if spec.head.address == "auto" else spec.head.address
    here = link.facts(head)
    token = Path(spec.head.stores) / link.TOKEN
    here["token"] = link.fingerprint(token.read_text()) if token.is_file() else None
    nodes = []
    for n in spec.nodes:
        argv = _on(n, ["node", "facts", *(["--head", head] if head else [])])
        try:
            got = ssh(argv, capture_output=True, text=True, timeout=SSH_TIMEOUT_S)
            row = json.loads(got.stdout) if got.returncode == 0 else None
            why = None if row else _last_line(got.stderr or got.stdout, got.returncode)
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            row, why = None, error_line(e, 200)
        nodes.append(dict(row or {}, name=n.name, target=_target(n), reachable=row is not None,
                          cabled=n.rdma, **({"error": why} if why else {})))
    pairs = [_pair(spec, a, b, nbytes, ssh, popen)
             for a, b in combinations([n for n in nodes if n["reachable"]], 2)]
    return {"head": here, "nodes": nodes, "pairs": pairs,
            "problems": verdict(here, nodes, pairs)}


def verdict(head: dict, nodes: list[dict], pairs: list[dict]) -> list[str]:
    """One line per problem: a node not reachable, a version other than the head's
    (named with the nodes that have each), a missing or other token, a pair whose
    link test failed or whose traffic leaves by a slower interface than one its
    host has, an RDMA device the cluster file names (`cabled`) that the node's
    `ibv_devices` does not list."""
    out = [f"{n['name']}: not reachable over ssh ({n['target']}): {n.get('error', '?')}"
           for n in nodes if not n["reachable"]]
    up = [n for n in nodes if n["reachable"]]
    for package in link.PACKAGES:
        mine = head["versions"].get(package)
        other: dict[str, list[str]] = {}
        for n in up:
            theirs = n["versions"].get(package)
            if theirs != mine:
                other.setdefault(theirs or "not installed", []).append(n["name"])
        if other:
            out.append(f"{package} {mine or 'not installed'} on the head, " + "; ".join(
                f"{v} on {', '.join(names)}" for v, names in sorted(other.items())))
    if head["token"] is None:
        out.append("no cluster token on the head yet: `segctl cluster up` makes one")
    else:
        out += [f"{n['name']}: " + ("no cluster token" if n["token"] is None else
                                    "a cluster token other than the head's")
                for n in up if n["token"] != head["token"]]
    for n in up:
        missing = sorted({dev for dev in (n.get("cabled") or {}).values()} - set(n.get("rdma") or []))
        if missing:
            out.append(f"{n['name']}: the cluster file's rdma names {', '.join(missing)}, which "
                       f"ibv_devices there does not list (it lists: {', '.join(n.get('rdma') or []) or 'none'})")
    for p in pairs:
        if p.get("error"):
            out.append(f"{p['a']} -> {p['b']}: the link test failed: {p['error']}")
        elif p.get("faster"):
            out.append(f"{p['a']} -> {p['b']}: traffic leaves {p['a']} by {p['interface']} "
                       f"({p['kind']}) while {p['faster']} is up: a ring would run slower "
                       "than it could (`distributed.interface` picks the network)")
    return out


def _pair(spec, a: dict, b: dict, nbytes: int, ssh, popen) -> dict:
    """a sends to b's fleet address: its latency and bandwidth, the interface the
    traffic leaves a by, and a faster interface of a's if one is up."""
    row = {"a": a["name"], "b": b["name"], "address": b["address"]}
    by_name = {n.name: n for n in spec.nodes}
    try:
        server = popen(_on(by_name[b["name"]], ["node", "link-serve", "--timeout", "60"]),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return dict(row, error=error_line(e, 200))
    try:
        port = (server.stdout.readline() if server.stdout else "").strip()
        if not port.isdigit():
            return dict(row, error=_last_line(server.communicate(timeout=30)[1], server.poll()))
        got = ssh(_on(by_name[a["name"]], ["node", "link-test", "--to",
                                           f"{b['address']}:{port}", "--bytes", str(nbytes)]),
                  capture_output=True, text=True, timeout=SSH_TIMEOUT_S)
        if got.returncode != 0:
            return dict(row, error=_last_line(got.stderr or got.stdout, got.returncode))
        measured = json.loads(got.stdout)
    finally:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if measured["source"].startswith("127."):   # two nodes of one machine
        used, best = {"name": "lo", "kind": "loopback"}, []
    else:
        used = link.holding(measured["source"], a["interfaces"]) or {
            "name": "?", "kind": "other", "speed_mbps": None}
        best = sorted(a["interfaces"], key=link.speed_key)[:1]
    faster = best and link.speed_key(best[0]) < link.speed_key(used)
    return dict(row, interface=used["name"], kind=used["kind"], rtt_ms=measured["rtt_ms"],
                mb_per_s=measured["mb_per_s"], bytes=measured["bytes"],
                faster=f"{best[0]['name']} ({best[0]['kind']})" if faster else None)


def _on(node, args: list[str]) -> list[str]:
    """`segctl ARGS` run on `node`: over ssh, or for a local node here, by the
    interpreter and code this check runs on."""
    if node.local:
        return [sys.executable, "-m", "segctl.orchestrator.cli", *args]
    return ssh_argv(node.host or node.name, ["segctl", *args])


def _target(node) -> str:
    return "this machine" if node.local else (node.host or node.name)


def _last_line(text: str | None, code) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {code}"
