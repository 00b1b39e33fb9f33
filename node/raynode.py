"""Ray on one machine: start the head or a node as a `ray start --block` child of
its own session, wait until the cluster sees it, stop it by its pid.

Why `--block` and pids, never `ray stop`: `ray stop` kills every Ray process of
the user on the machine, other clusters included. A `ray start --block` process
owns its node: SIGTERM to it drains and tears down that node's GCS/raylet/
workers (all in its process group), so a fleet is stopped by the pids it
recorded and nothing else.

The naming contract the head actor relies on: a training node has the custom
resource `segctl_node:<name>` = 1 and the labels segctl.name / segctl.chip /
segctl.memory_gb / segctl.os plus the user's; the head has `segctl_head` = 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from .probe import Hardware, ray_env

HEAD_RESOURCE = "segctl_head"
NODE_RESOURCE = "segctl_node:"   # + name
LABEL = "segctl."                # prefix of the labels segctl sets itself
START_TIMEOUT_S = 60
# Nodes sharing one machine (local nodes of a cluster file) each get a small
# object store: segctl moves adapters and checkpoints through it, not datasets.
LOCAL_OBJECT_STORE_MB = 512

# Ray's label syntax (Kubernetes'): 63 chars at most, alphanumeric at both ends.
_LABEL_RE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")


def node_labels(name: str, chip: str, memory_gb: float, os_name: str, labels: dict) -> dict:
    """The labels of a segctl training node: ours, then the user's (keys as written)."""
    ours = {f"{LABEL}name": name, f"{LABEL}chip": chip, f"{LABEL}memory_gb": f"{memory_gb:g}",
            f"{LABEL}os": os_name}
    out = dict(ours, **{str(k): str(v) for k, v in (labels or {}).items()})
    for k, v in out.items():
        key = k.rsplit("/", 1)[-1]
        if not key or not _LABEL_RE.fullmatch(key) or not _LABEL_RE.fullmatch(v):
            raise ValueError(f"label {k}={v}: Ray labels are at most 63 characters of "
                             f"letters, digits, '-', '_', '.', starting and ending alphanumeric")
    return out


def start_head(*, port: int, stores: Path, node: dict | None, hw: Hardware, log_dir: Path,
               object_store_mb: int | None = None) -> dict:
    """Start the head here (token at <stores>/auth_token, made by the fleet). With
    `node` ({name, memory_gb, chip, labels}) the head also trains as that node.
    Returns {"pid", "address"} once the GCS answers."""
    token = Path(stores) / "auth_token"
    if not token.exists():
        raise RuntimeError(f"{token}: no cluster token (the fleet writes it before the head starts)")
    resources, labels = {HEAD_RESOURCE: 1}, {}
    if node:
        resources[NODE_RESOURCE + node["name"]] = 1
        labels = node_labels(node["name"], node["chip"], node["memory_gb"], hw.os,
                             node.get("labels") or {})
    args = ["--head", "--port", str(port), "--include-dashboard=false"]
    env = ray_env(str(token), hw)
    pid = _spawn(args, resources, labels, hw, env, Path(log_dir) / "head.log", object_store_mb)
    here = f"{hw.ip or '127.0.0.1'}:{port}"   # the address Ray was given, else loopback
    found = _wait(pid, Path(log_dir) / "head.log",
                  lambda ns: [n for n in ns if n["head"] and n["alive"]],
                  here, env, what=f"the head on port {port}")
    return {"pid": pid, "address": f"{found[0]['ip']}:{port}"}


def start_node(*, address: str, name: str, memory_gb: float, chip: str, labels: dict,
               hw: Hardware, token_path: str, log_dir: Path,
               object_store_mb: int | None = None) -> dict:
    """Join this machine to the head at `address` as segctl node `name`. Returns
    {"pid", "name"} once the node is alive in the cluster's node table."""
    if not Path(token_path).exists():
        raise RuntimeError(f"{token_path}: no cluster token")
    resource = NODE_RESOURCE + name
    all_labels = node_labels(name, chip, memory_gb, hw.os, labels)
    env = ray_env(token_path, hw)
    before = gcs_nodes(address, env)
    if before is None:
        raise ConnectionError(f"no Ray head answers at {address}")
    if any(n["alive"] and resource in n["resources"] for n in before):
        raise RuntimeError(f"a node named {name!r} is already in the cluster at {address}")
    log = Path(log_dir) / f"node-{name}.log"
    pid = _spawn([f"--address={address}"], {resource: 1}, all_labels, hw, env, log,
                 object_store_mb)
    _wait(pid, log, lambda ns: [n for n in ns if n["alive"] and resource in n["resources"]],
          address, env, what=f"node {name}")
    return {"pid": pid, "name": name}


def stop(pid: int, timeout: float = 5) -> None:
    """Stop the `ray start --block` process `pid` and its node: SIGTERM (Ray drains
    and tears the node down), wait, then SIGKILL whatever of its process group is
    left. A pid that is gone or is not a `ray start` is left alone."""
    if not is_ray_start(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    # started in a session of its own, so its process group id is its pid
    while time.monotonic() < deadline and (alive(pid) or _group(pid)):
        time.sleep(0.2)
    for member in _group(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while alive(pid) and time.monotonic() < deadline + 5:
        time.sleep(0.1)


def is_ray_start(pid: int) -> bool:
    """Is `pid` a live `ray start` process? Guards against a recorded pid that the
    OS has since given to something else."""
    if not alive(pid):
        return False
    cmd = subprocess.run(["ps", "-o", "command=", "-p", str(pid)],
                         capture_output=True, text=True).stdout
    return "ray" in cmd and " start" in cmd


def gcs_nodes(address: str, env: dict, timeout: float = 5) -> list[dict] | None:
    """The cluster's node table straight from the GCS, read in a fresh process with
    the token env (so this process's Ray state and auth cache stay untouched).
    None: nothing answers at `address`. Raises when the token is refused."""
    if not _port_open(address):   # GcsClient itself waits 40 s on a closed port
        return None
    out = subprocess.run([sys.executable, "-c", _GCS_QUERY, address, str(timeout)],
                         capture_output=True, text=True, env={**os.environ, **env},
                         timeout=timeout + 60)
    try:
        reply = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"cannot read the node table at {address}: "
                           f"{_last_line(out.stderr)}") from None
    if "error" in reply:
        if "Authentication" in reply["error"] or "InvalidAuthToken" in reply["error"]:
            raise PermissionError(f"the Ray head at {address} refused this machine's token")
        return None
    return reply["nodes"]


# ray._raylet.GcsClient is what `ray status` itself uses: it reads the node table
# without registering a driver (a driver makes the head start workers).
_GCS_QUERY = r"""
import json, sys
try:
    from ray._raylet import GcsClient
    infos = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=float(sys.argv[2]))
    print(json.dumps({"nodes": [
        {"alive": i.state == 0, "head": i.is_head_node, "ip": i.node_manager_address,
         "resources": dict(i.resources_total), "labels": dict(i.labels)}
        for i in infos.values()]}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
"""


def start_command(args: list[str], resources: dict, labels: dict, hw: Hardware,
                  object_store_mb: int | None = None) -> list[str]:
    """The `ray start --block` command line of a head (args: --head --port P) or a
    node (args: --address=HEAD:PORT) on the machine `hw` describes."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", *args, "--block",
           # segctl's actors take no CPU slot (training runs in its own process); one
           # slot keeps Ray from pre-starting workers that eat a Mac's memory
           "--num-cpus", "1",
           "--resources", json.dumps(resources),
           "--labels", ",".join(f"{k}={v}" for k, v in labels.items()),
           "--disable-usage-stats", *_free_port_args()]
    if object_store_mb:
        cmd += ["--object-store-memory", str(object_store_mb * 2**20)]
    if hw.os == "macos":
        # left to itself Ray on macOS takes the loopback address (or, with the
        # cluster flag, whichever faces the default route: a VPN's, say); the
        # other Macs reach this one on its LAN address
        if not hw.ip:
            raise RuntimeError("this Mac has no LAN address on en0/en1; Ray needs one to "
                               "form a cluster")
        cmd += ["--node-ip-address", hw.ip]
    return cmd


def _spawn(args: list[str], resources: dict, labels: dict, hw: Hardware, env: dict,
           log: Path, object_store_mb: int | None) -> int:
    cmd = start_command(args, resources, labels, hw, object_store_mb)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        # its own session: a Ctrl-C in the shell that ran segctl does not reach the
        # node, and its process group is exactly this node's processes
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **env},
                                start_new_session=True)
    return proc.pid


def _free_port_args() -> list[str]:
    """Ports that are fixed by default (the dashboard agent's 52365) clash when
    several nodes share a machine; take free ones, held open together so the
    three differ."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(3)]
        for s in socks:
            s.bind(("", 0))
        ports = [s.getsockname()[1] for s in socks]
    return ["--dashboard-agent-listen-port", str(ports[0]), "--metrics-export-port",
            str(ports[1]), "--runtime-env-agent-port", str(ports[2])]


def _wait(pid: int, log: Path, pick, address: str, env: dict, *, what: str,
          timeout: float = START_TIMEOUT_S) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        if not alive(pid):
            raise RuntimeError(f"{what} did not start: {_last_line(log.read_text(errors='replace'))}"
                               f" (log: {log})")
        found = pick(gcs_nodes(address, env, timeout=2) or [])
        if found:
            return found
        if time.monotonic() > deadline:
            stop(pid)
            raise TimeoutError(f"{what} did not come up within {timeout:.0f} s (log: {log})")
        time.sleep(0.5)


def _port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def alive(pid: int) -> bool:
    """Is process `pid` running (a zombie is not)?"""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:   # our child and it has exited: reaped
            return False
    except ChildProcessError:
        pass                                         # not our child
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                          text=True).stdout.strip()
    return bool(stat) and not stat.startswith("Z")


def _group(pgid: int) -> list[int]:
    """Live members of process group `pgid` (zombies excluded)."""
    out = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat="], capture_output=True,
                         text=True).stdout
    return [int(p) for p, g, s in (line.split()[:3] for line in out.splitlines() if line.strip())
            if int(g) == pgid and not s.startswith("Z")]


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["(no output)"])[-1]
