"""The fleet: start, stop and look at the Ray cluster segctl schedules onto.

`up` starts the head on this machine, the cluster file's `local: true` nodes here
too (each a real Ray node process), and the remote Macs over ssh with
`segctl node start --join HEAD:PORT --token-stdin`. What it started is recorded
in `<stores>/fleet.json`; `down` stops exactly that, by pid here and by
`segctl node stop` over ssh. With no cluster file the fleet is embedded: this
machine is the head and the only node, with its real memory as the budget.

Every Ray process and every driver runs with token authentication: the token
lives in `<stores>/auth_token` (0600) on the head and reaches a remote node on
ssh's stdin, never on a command line.

Every pid recorded (fleet.json, here.json) comes with its process's start time,
and only a pid whose process still has that start time is ever signalled.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import math
import os
import secrets
import shlex
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from segctl.node import raynode
from segctl.node.hardware import Hardware, default_name, probe, ray_env
from segctl.schemas.atomic import write_atomic
from segctl.schemas.cluster import DEFAULT_MAX_TRIALS
from segctl.schemas.defaults import DEFAULT_NODE_MAX_TRIALS, segctl_home, stores_root
from segctl.schemas.limits import MAX_MEMORY_GB, MAX_TRIALS_PER_NODE
from segctl.schemas.private import private_dir, private_file
from segctl.schemas.records import NodeInfo

# `ray` itself is imported only where a driver is needed: the ssh helpers serve
# CLI commands that should not pay for importing Ray.
NAMESPACE = "segctl"
FLEET_FILE = "fleet.json"      # on the head, under the stores root: what `up` started
HERE_FILE = "here.json"        # on any machine, under $SEGCTL_HOME: what `node start` started
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
SSH_TIMEOUT_S = 180
PARALLEL_SSH = 8
RDMA_LABEL = "rdma."           # segctl.rdma.<peer> = the node's RDMA device cabled to <peer>


def ensure_token(stores: Path) -> Path:
    """The cluster's token, made once: 32 random bytes as hex, readable by the
    owner only."""
    path = Path(stores) / "auth_token"
    if path.exists() and path.read_text().strip():
        return path
    return _write_token(path, secrets.token_hex(32), replace=path.exists())


# ------------------------------------------------------------------ up / down

def up(spec, *, ssh=subprocess.run) -> dict:
    """Bring the fleet up and return what fleet.json records. A running fleet is
    left as it is; nodes of the cluster file missing from it are started. A node
    that cannot start does not stop the others: the fleet comes up without it and
    a RuntimeError names it afterwards."""
    root = stores_root(spec)
    with _locked(root):
        token = ensure_token(root)
        hw = probe()
        env = ray_env(str(token), hw)
        info = _read(root / FLEET_FILE)
        if info and not _head_answers(info, env):
            _stop_recorded(info, ssh)        # leftovers of a fleet whose head died
            info = None
        if info is None:
            info = _start_head(spec, root, token, hw)
            _write(root / FLEET_FILE, info)
        alive = {n["labels"].get("segctl.name") for n in raynode.gcs_nodes(info["address"], env) or []
                 if n["alive"]}
        missing = [n for n in (spec.nodes if spec else []) if n.name not in alive]
        failed = {}

        def started(n, get):
            try:
                info["nodes"][n.name] = get()
            except (RuntimeError, OSError, TimeoutError, ValueError,
                    subprocess.TimeoutExpired) as e:
                failed[n.name] = _one_line(e)
                return
            _write(root / FLEET_FILE, info)   # recorded as soon as it runs

        # Nodes sharing this machine start one after the other: Ray picks a starting
        # node's ports as it goes, and two starting at once can pick the same one.
        for n in (n for n in missing if n.local):
            started(n, lambda: _start_node(n, info, root, hw, ssh))
        with ThreadPoolExecutor(max_workers=PARALLEL_SSH) as pool:
            futures = {pool.submit(_start_node, n, info, root, hw, ssh): n
                       for n in missing if not n.local}
            for fut, n in futures.items():
                started(n, fut.result)
    if failed:
        raise RuntimeError("fleet up, but not " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    return info


def down(spec, *, ssh=subprocess.run) -> None:
    """Stop every node and the head that fleet.json records; remove fleet.json."""
    root = stores_root(spec)
    with _locked(root):
        info = _read(root / FLEET_FILE)
        if info is None:
            return
        failed = _stop_recorded(info, ssh)
        (root / FLEET_FILE).unlink(missing_ok=True)
    if failed:
        raise RuntimeError("fleet down, but could not stop " +
                           "; ".join(f"{k}: {v}" for k, v in failed.items()))


def connect(spec, *, start: bool = True) -> dict:
    """Join this process to the fleet as a Ray driver (namespace "segctl") and
    return fleet.json's record. Embedded with start=True brings the fleet up
    first when it is not running."""
    import ray

    root = stores_root(spec)
    info = _read(root / FLEET_FILE)
    running = info is not None and _running(info["head"])
    if not running:
        if spec is None and start:
            info = up(None)
        else:
            arg = "" if spec is None else " CLUSTER.yaml"
            raise ConnectionError(f"the fleet is not running (no live head recorded in "
                                  f"{root / FLEET_FILE}); start it with `segctl cluster up{arg}`")
    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address == info["address"]:
            return info
        ray.shutdown()
    _use_token(info["token_path"])
    _ray_messages_to_stderr()
    try:
        ray.init(address=info["address"], namespace=NAMESPACE, log_to_driver=False,
                 logging_level=logging.WARNING)
    except Exception as e:   # AuthenticationError, ConnectionError, RuntimeError, ...
        raise ConnectionError(f"cannot reach the fleet's head at {info['address']}: "
                              f"{_one_line(e)}") from None
    return info


def nodes(warnings: list | None = None) -> list[NodeInfo]:
    """The alive segctl nodes, from Ray's node table (needs a connected driver); a
    node whose labels do not parse is left out, with why in `warnings` if given."""
    import ray
    out, why = node_table(ray.nodes())
    if warnings is not None:
        warnings += why
    return out


def node_table(rows: list[dict]) -> tuple[list[NodeInfo], list[str]]:
    """The alive segctl nodes among Ray's node table's `rows` (ray.nodes()), by name,
    and a warning for each one left out because its labels do not parse: a memory
    budget that is not a finite number of GB within the bounds, or max_trials not a
    whole number within them (a node started by hand or by a broken segctl). The
    planner would fit everything on `inf` and nothing on `nan`."""
    out, warnings = [], []
    for n in rows:
        names = [r[len(raynode.NODE_RESOURCE):] for r in n.get("Resources", {})
                 if r.startswith(raynode.NODE_RESOURCE)]
        if not n.get("Alive") or not names:
            continue
        labels = n.get("Labels") or {}
        ours = {k.removeprefix(raynode.LABEL): v for k, v in labels.items()
                if k.startswith(raynode.LABEL)}
        try:
            out.append(NodeInfo(
                name=names[0], chip=ours.get("chip", "unknown"),
                memory_gb=_label_number(ours, "memory_gb", float, MAX_MEMORY_GB),
                os=ours.get("os", "unknown"), alive=True,
                max_trials=_label_number(ours, "max_trials", int, MAX_TRIALS_PER_NODE,
                                         DEFAULT_NODE_MAX_TRIALS),
                rdma={k.removeprefix(RDMA_LABEL): v for k, v in ours.items()
                      if k.startswith(RDMA_LABEL)},
                labels={k: v for k, v in labels.items()
                        if not k.startswith(raynode.LABEL) and not k.startswith("ray.io/")}))
        except ValueError as e:
            warnings.append(f"node {names[0]} ignored: {e}")
    return sorted(out, key=lambda n: n.name), warnings


def _label_number(ours: dict, key: str, kind, most, default=None):
    """Label segctl.<key> as a finite number > 0 and <= `most` (`kind`: float or int);
    `default` where it is missing. ValueError naming the label."""
    text = ours.get(key)
    if text is None and default is not None:
        return default
    if text is None:
        raise ValueError(f"no label {raynode.LABEL}{key}")
    try:
        x = kind(text)
    except (TypeError, ValueError):
        x = None
    if x is None or not math.isfinite(x) or not 0 < x <= most:
        what = "a finite number" if kind is float else "a whole number"
        raise ValueError(f"label {raynode.LABEL}{key}={str(text)[:40]!r}: expected {what} "
                         f"> 0 and at most {most}")
    return x


def ports(timeout: float = 60) -> list[dict]:
    """Every alive Ray node of the fleet (needs a connected driver): its address,
    whether it is the head, the segctl node(s) it is, and the TCP ports its Ray
    processes listen on (`raynode.node_ports`, run there by a task pinned to it:
    nothing assumes the nodes' processes can be seen from here)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0, max_retries=0)(raynode.node_ports)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote() for n in alive]
    out = []
    for n, ref in zip(alive, refs):
        try:
            got = ray.get(ref, timeout=timeout)
        except Exception as e:   # a node that cannot start a worker: say so, list the rest
            ray.cancel(ref, force=True)
            got = {"error": _one_line(e), "listening": []}
        res = n.get("Resources", {})
        out.append({"names": sorted(r[len(raynode.NODE_RESOURCE):] for r in res
                                    if r.startswith(raynode.NODE_RESOURCE)),
                    "head": raynode.HEAD_RESOURCE in res, "address": n["NodeManagerAddress"],
                    **got})
    return sorted(out, key=lambda d: (not d["head"], d["names"]))


# ------------------------------------------------------------------ one machine

def start_here(*, head: bool, address: str | None, name: str, memory_gb: float, chip: str,
               labels: dict, port: int, stores: Path | None, token: str | None,
               hw: Hardware, max_trials: int = DEFAULT_NODE_MAX_TRIALS) -> dict:
    """`segctl node start`: the head here (it also trains, as node `name`), or a
    node joining the head at `address`. Recorded in $SEGCTL_HOME/here.json for
    `segctl node stop`."""
    node = {"name": name, "memory_gb": memory_gb, "chip": chip, "labels": labels,
            "max_trials": max_trials}
    if head:
        root = Path(stores).expanduser() if stores else segctl_home()
        with _locked(root):
            token_path = (_write_token(root / "auth_token", token, replace=True) if token
                          else ensure_token(root))
            info = _read(root / FLEET_FILE)
            if info and _running(info["head"]):
                raise RuntimeError(f"a segctl head already runs here (pid {info['head']['pid']}, "
                                   f"{info['address']}); `segctl node stop` stops it")
            started = raynode.start_head(port=port, stores=root, node=node, hw=hw,
                                         log_dir=root / "logs")
            info = {"address": started["address"], "port": port, "token_path": str(token_path),
                    "head": {"pid": started["pid"], "started": started["started"], "node": name},
                    "nodes": {}}
            _write(root / FLEET_FILE, info)
        entry = {"role": "head", "pid": started["pid"], "started": started["started"],
                 "name": name, "address": started["address"], "stores": str(root)}
    else:
        if not address or ":" not in address:
            raise ValueError(f"--join {address!r}: expected HOST:PORT of the head")
        home = segctl_home()
        token_path = home / "auth_token"
        if token:
            _write_token(token_path, token, replace=True)
        elif not token_path.exists():
            raise RuntimeError(f"no cluster token: pass it with --token-stdin or copy the head's "
                               f"<stores>/auth_token to {token_path}")
        started = raynode.start_node(address=address, name=name, memory_gb=memory_gb, chip=chip,
                                     labels=labels, hw=hw, token_path=str(token_path),
                                     log_dir=home / "logs", max_trials=max_trials)
        entry = {"role": "node", "pid": started["pid"], "started": started["started"],
                 "name": name, "address": address}
    here = [e for e in _read(segctl_home() / HERE_FILE, []) if _running(e)]
    _write(segctl_home() / HERE_FILE, here + [entry])
    return entry


def stop_here() -> dict:
    """`segctl node stop`: stop what `segctl node start` started on this machine."""
    path = segctl_home() / HERE_FILE
    stopped = []
    for e in _read(path, []):
        raynode.stop(e["pid"], e.get("started"))
        stopped.append(e["name"])
        if e["role"] == "head":
            fleet = Path(e["stores"]) / FLEET_FILE
            info = _read(fleet)
            if info and (info["head"]["pid"], info["head"].get("started")) == \
                    (e["pid"], e.get("started")):
                fleet.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    return {"stopped": stopped}


# ------------------------------------------------------------------ ssh

def ssh_start_command(node, join: str) -> list[str]:
    """The ssh command that joins remote node `node` (a NodeSpec) to the head at
    `join`; the token follows on stdin. The chip is left to the remote probe
    unless the cluster file names it."""
    remote = ["segctl", "node", "start", "--join", join, "--name", node.name,
              "--memory-gb", f"{node.memory_gb:g}", "--max-trials", str(node.max_trials),
              "--token-stdin"]
    if node.chip and node.chip != "unknown":
        remote += ["--chip", node.chip]
    for k, v in cluster_labels(node).items():
        remote += ["--label", f"{k}={v}"]
    return ssh_argv(node.host or node.name, remote)


def cluster_labels(node) -> dict[str, str]:
    """The labels `cluster up` starts node `node` (a NodeSpec) with besides its own:
    the user's, and per RDMA peer `segctl.rdma.<peer>` = this node's device cabled
    to it (node_table reads them back into NodeInfo.rdma)."""
    return {**(node.labels or {}),
            **{f"{raynode.LABEL}{RDMA_LABEL}{peer}": dev for peer, dev in node.rdma.items()}}


def ssh_stop_command(host: str) -> list[str]:
    return ssh_argv(host, ["segctl", "node", "stop"])


def ssh_argv(host: str, remote: list[str]) -> list[str]:
    """`ssh ... -- HOST 'CMD'`: after `--` ssh never reads HOST as an option (a
    host "-oProxyCommand=..." is a host name, and not one that resolves), and
    the remote shell gets one line in which every argument is quoted, so a
    name, label or address reaches the remote segctl as the one argument it is
    and never as shell syntax."""
    return ["ssh", *SSH_OPTIONS, "--", host, shlex.join(remote)]


def _ssh(ssh, cmd: list[str], stdin: str = "") -> str:
    proc = ssh(cmd, input=stdin, capture_output=True, text=True, timeout=SSH_TIMEOUT_S)
    if proc.returncode != 0:
        why = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        raise RuntimeError(f"ssh {cmd[-2]}: {why[-1] if why else f'exit {proc.returncode}'}")
    return proc.stdout


# ------------------------------------------------------------------ internals

def _start_head(spec, root: Path, token: Path, hw: Hardware) -> dict:
    named = None
    if spec is None:
        # embedded: this machine is head and node; a free port, so a Ray the user
        # runs on the default port (DEFAULT_PORT) is left alone
        port = _free_port()
        node = {"name": default_name(), "memory_gb": hw.memory_gb, "chip": hw.chip, "labels": {},
                "max_trials": DEFAULT_MAX_TRIALS}
    else:
        named = _head_is_here(spec.head.address)
        port, node = spec.head.port, None
    # a head the cluster file names is advertised at that address: left to itself
    # Ray on Linux advertises whichever address faces the default route, which
    # the nodes may have no way to (another network, a container's bridge)
    started = raynode.start_head(port=port, stores=root, node=node, hw=hw, log_dir=root / "logs",
                                 node_ip=socket.gethostbyname(named) if named else None)
    # remote nodes join at the address the cluster file names, else at the one Ray
    # advertises for the head (this machine's LAN address)
    return {"address": started["address"], "port": port, "token_path": str(token),
            "join": f"{named}:{port}" if named else started["address"],
            "head": {"pid": started["pid"], "started": started["started"],
                     "node": node and node["name"]}, "nodes": {}}


def _start_node(n, info: dict, root: Path, hw: Hardware, ssh) -> dict:
    token = Path(info["token_path"])
    if n.local:
        started = raynode.start_node(
            address=info["address"], name=n.name, memory_gb=n.memory_gb,
            chip=n.chip if n.chip != "unknown" else hw.chip, labels=cluster_labels(n), hw=hw,
            token_path=str(token), log_dir=root / "logs",
            object_store_mb=raynode.LOCAL_OBJECT_STORE_MB, max_trials=n.max_trials)
        return {"pid": started["pid"], "started": started["started"], "local": True, "host": None}
    out = _ssh(ssh, ssh_start_command(n, info["join"]), stdin=token.read_text().strip())
    reply = json.loads(out.strip().splitlines()[-1])
    # its pid and start time are the remote Mac's: `segctl node stop` there checks them
    return {"pid": reply["pid"], "started": reply.get("started"), "local": False,
            "host": n.host or n.name}


def _stop_recorded(info: dict, ssh) -> dict:
    """Stop the nodes and head of a fleet.json record; {name: why} for the ones
    that could not be stopped."""
    failed = {}

    def stop_one(name, n):
        if n["local"]:
            raynode.stop(n["pid"], n.get("started"))
        else:
            _ssh(ssh, ssh_stop_command(n["host"]))

    with ThreadPoolExecutor(max_workers=PARALLEL_SSH) as pool:
        futures = {pool.submit(stop_one, k, n): k for k, n in info.get("nodes", {}).items()}
        for fut, name in futures.items():
            try:
                fut.result()
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                failed[name] = _one_line(e)
    raynode.stop(info["head"]["pid"], info["head"].get("started"))
    return failed


def _use_token(token_path: str) -> None:
    """Point this process's Ray at the fleet's token. Ray reads RAY_AUTH_* into its
    config when `ray` is imported and caches the token on first use, so both are
    refreshed here (config first, as Ray's own tests do)."""
    # Ray's own names for this, private: its stubs do not list them
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    os.environ.update(ray_env(token_path))
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _ray_messages_to_stderr() -> None:
    """Ray prints what the GCS tells a driver ("(raylet) The node ... has been marked
    dead") on the driver's stdout, log_to_driver or not: sent to stderr instead, so
    a command's stdout (`--json`) holds only what segctl prints."""
    from ray._private import worker

    show = worker.print_to_stdstream
    if getattr(show, "to_stderr", False):
        return

    def to_stderr(data, ignore_prefix):
        show({**data, "is_err": True}, ignore_prefix)
    setattr(to_stderr, "to_stderr", True)   # marks ours: a second call changes nothing
    worker.print_to_stdstream = to_stderr


def _running(record: dict) -> bool:
    """Is the process of a fleet.json / here.json record still the one recorded?"""
    return raynode.is_ours(record["pid"], record.get("started"))


def _head_answers(info: dict, env: dict) -> bool:
    return _running(info["head"]) and raynode.gcs_nodes(info["address"], env) is not None


def _head_is_here(address: str) -> str | None:
    """`cluster up` starts the head on the machine it runs on; a cluster file that
    names another machine as the head is run there. Returns the address remote
    nodes should use, None for "whatever Ray advertises" (auto, loopback)."""
    if address in ("auto", "localhost"):
        return None
    try:
        ip = socket.gethostbyname(address)
        if ipaddress.ip_address(ip).is_loopback:
            return None
        with socket.socket() as s:
            s.bind((ip, 0))     # binds only to an address of this machine
    except OSError:
        raise RuntimeError(f"head.address {address} is not this machine: run "
                           f"`segctl cluster up` on the head") from None
    return address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextmanager
def _locked(root: Path):
    """One `up`/`down` at a time per stores root (two CLI calls racing to bring
    up the embedded fleet would start two heads)."""
    private_dir(root)
    with open(private_file(root / "fleet.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
    except ValueError:
        raise RuntimeError(f"{path}: not valid JSON; remove it if no fleet is running") from None


def _write(path: Path, data) -> None:
    private_file(private_dir(path.parent) / path.name,
                         json.dumps(data, indent=2).encode())


def _write_token(path: Path, token: str, *, replace: bool) -> Path:
    data = (token.strip() + "\n").encode()
    private_dir(path.parent)
    if replace:
        return private_file(path, data)
    try:
        write_atomic(path, data, mode=0o600, replace=False)
    except FileExistsError:
        pass    # no clobbering a token another process just made
    return path


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
