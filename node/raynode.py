"""Ray on one machine: start the head or a node as a `ray start --block` child of
its own session, wait until the cluster sees it, stop it by its pid.

Why `--block` and pids, never `ray stop`: `ray stop` kills every Ray process of
the user on the machine, other clusters included. A `ray start --block` process
owns its node: SIGTERM to it drains and tears down that node's GCS/raylet/
workers (all in its process group), so a fleet is stopped by the pids it
recorded and nothing else. Each pid is recorded with its process's start time
(`start_time`): a pid the OS has since handed to another process is never
signalled.

The naming contract the head actor relies on: a training node has the custom
resource `segctl_node:<name>` = 1 and the labels segctl.name / segctl.chip /
segctl.memory_gb / segctl.os plus the user's; the head has `segctl_head` = 1.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from segctl.schemas.defaults import DEFAULT_NODE_MAX_TRIALS
from segctl.schemas.limits import MAX_MEMORY_GB
from segctl.schemas.private import private_dir, private_file

from .hardware import Hardware, ray_env

HEAD_RESOURCE = "segctl_head"
NODE_RESOURCE = "segctl_node:"   # + name
LABEL = "segctl."                # prefix of the labels segctl sets itself
START_TIMEOUT_S = 60
RAY_START = "segctl.node.raystart"   # `ray start` less Ray Client (node/raystart.py)
RAY_STARTS = (RAY_START, "ray.scripts.scripts")   # ours, and Ray's own as fleets before it ran
# Nodes sharing one machine (local nodes of a cluster file) each get a small
# object store: segctl moves adapters and checkpoints through it, not datasets.
LOCAL_OBJECT_STORE_MB = 512

# Ray's label syntax (Kubernetes'): 63 chars at most, alphanumeric at both ends.
_LABEL_RE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")


def node_labels(name: str, chip: str, memory_gb: float, os_name: str, labels: dict,
                max_trials: int = DEFAULT_NODE_MAX_TRIALS) -> dict:
    """The labels of a segctl training node: ours, then the user's (keys as written)."""
    if not (isinstance(memory_gb, (int, float)) and math.isfinite(memory_gb)
            and 0 < memory_gb <= MAX_MEMORY_GB):   # the head would ignore such a node
        raise ValueError(f"memory_gb {memory_gb!r}: expected a finite number of GB > 0 and at "
                         f"most {MAX_MEMORY_GB}")
    ours = {f"{LABEL}name": name, f"{LABEL}chip": chip, f"{LABEL}memory_gb": f"{memory_gb:g}",
            f"{LABEL}os": os_name, f"{LABEL}max_trials": str(int(max_trials))}
    out = dict(ours, **{str(k): str(v) for k, v in (labels or {}).items()})
    for k, v in out.items():
        key = k.rsplit("/", 1)[-1]
        if not key or not _LABEL_RE.fullmatch(key) or not _LABEL_RE.fullmatch(v):
            raise ValueError(f"label {k}={v}: Ray labels are at most 63 characters of "
                             f"letters, digits, '-', '_', '.', starting and ending alphanumeric")
    return out


def start_head(*, port: int, stores: Path, node: dict | None, hw: Hardware, log_dir: Path,
               object_store_mb: int | None = None, node_ip: str | None = None) -> dict:
    """Start the head here (token at <stores>/auth_token, made by the fleet). With
    `node` ({name, memory_gb, chip, labels}) the head also trains as that node.
    `node_ip`: the fleet's address of this machine (the cluster file's
    head.address), which Ray then advertises; None lets Ray pick (see
    `start_command`). Returns {"pid", "started", "address"} once the GCS answers
    ("started": the process's start time, which `stop` checks before it signals
    the pid)."""
    token = Path(stores) / "auth_token"
    if not token.exists():
        raise RuntimeError(f"{token}: no cluster token (the fleet writes it before the head starts)")
    resources, labels = {HEAD_RESOURCE: 1}, {}
    if node:
        resources[NODE_RESOURCE + node["name"]] = 1
        labels = node_labels(node["name"], node["chip"], node["memory_gb"], hw.os,
                             node.get("labels") or {}, node.get("max_trials", DEFAULT_NODE_MAX_TRIALS))
    args = ["--head", "--port", str(port), "--include-dashboard=false"]
    env = ray_env(str(token), hw)
    ip = _node_ip(hw, node_ip)
    proc = _spawn(args, resources, labels, hw, env, Path(log_dir) / "ray-head.log", object_store_mb,
                  ip)
    here = f"{ip or '127.0.0.1'}:{port}"   # the address Ray was given, else loopback
    found = _wait(proc, Path(log_dir) / "ray-head.log",
                  lambda ns: [n for n in ns if n["head"] and n["alive"]],
                  here, env, what=f"the head on port {port}")
    return {**proc, "address": f"{found[0]['ip']}:{port}"}


def start_node(*, address: str, name: str, memory_gb: float, chip: str, labels: dict,
               hw: Hardware, token_path: str, log_dir: Path,
               object_store_mb: int | None = None, max_trials: int = DEFAULT_NODE_MAX_TRIALS) -> dict:
    """Join this machine to the head at `address` as segctl node `name`. Returns
    {"pid", "started", "name"} once the node is alive in the cluster's node table."""
    if not Path(token_path).exists():
        raise RuntimeError(f"{token_path}: no cluster token")
    resource = NODE_RESOURCE + name
    all_labels = node_labels(name, chip, memory_gb, hw.os, labels, max_trials)
    env = ray_env(token_path, hw)
    before = gcs_nodes(address, env)
    if before is None:
        raise ConnectionError(f"no Ray head answers at {address}")
    if any(n["alive"] and resource in n["resources"] for n in before):
        raise RuntimeError(f"a node named {name!r} is already in the cluster at {address}")
    log = Path(log_dir) / f"node-{name}.log"
    # on Linux the node advertises the address it reaches the head from (a
    # machine with several networks: Docker's, a VPN's, a lab's bridge)
    proc = _spawn([f"--address={address}"], {resource: 1}, all_labels, hw, env, log,
                  object_store_mb, _node_ip(hw, route_ip(address)))
    _wait(proc, log, lambda ns: [n for n in ns if n["alive"] and resource in n["resources"]],
          address, env, what=f"node {name}")
    return {**proc, "name": name}


def stop(pid: int, started: str | None = None, timeout: float = 5) -> None:
    """Stop the `ray start --block` process `pid` and its node: SIGTERM (Ray drains
    and tears the node down), wait, then SIGKILL whatever of its process group and
    of its descendants is left. Only if `pid` is still the process that was
    recorded (`is_ours`): a pid that is gone or now belongs to another process is
    left alone.

    Descendants count because Ray starts each worker (the head actor, a node's
    agent, and through the agent the engine processes) in a process group of its
    own: they are the raylet's children, not members of `pid`'s group, and would
    otherwise outlive the node by seconds, orphaned. They are listed before the
    signal (an orphan no longer says whose it was) with their start times, so a
    pid reused meanwhile is never signalled."""
    if not is_ours(pid, started):
        return
    tree = descendants(pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout

    def left() -> list[int]:
        # started in a session of its own, so its process group id is its pid
        return sorted(set(_group(pid)) | {p for p, t in tree.items() if _same(p, t)})

    while time.monotonic() < deadline and (alive(pid) or left()):
        time.sleep(0.2)
    for member in left():
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while (alive(pid) or left()) and time.monotonic() < deadline + 5:
        time.sleep(0.1)


def descendants(pid: int) -> dict[int, str | None]:
    """The live (not zombie) descendants of `pid`, each with its start time."""
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True,
                         text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and not parts[2].startswith("Z"):
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return {p: start_time(p) for p in found}


def _same(pid: int, started: str | None) -> bool:
    """Is `pid` alive and still the process that had start time `started`?"""
    return started is not None and start_time(pid) == started and alive(pid)


def is_ours(pid: int, started: str | None) -> bool:
    """Is `pid` still the process recorded with start time `started`? The OS hands
    a finished process's pid to the next one; the pair (pid, start time) names one
    process. A record without a start time (written by an older segctl) falls back
    to the command line: a `ray start ... --block` as segctl runs it."""
    if not alive(pid):
        return False
    if started is not None:
        return start_time(pid) == started
    cmd = subprocess.run(["ps", "-ww", "-o", "command=", "-p", str(pid)],   # -ww: never cut
                         capture_output=True, text=True).stdout
    return any(f"{m} start" in cmd for m in RAY_STARTS) and "--block" in cmd


def start_time(pid: int, *, platform: str = sys.platform, run=subprocess.run) -> str | None:
    """When process `pid` started, as a string that is equal only for the same
    process; None when there is no such process. Linux: field 22 of
    /proc/PID/stat (clock ticks after boot); macOS: `ps -o lstart=` (to the
    second). `platform` and `run` let a test hand in a Mac's `ps`."""
    if platform.startswith("linux"):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return None
        return fields[19]   # fields after "(comm)" start at field 3
    out = run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True,
              env={**os.environ, "LC_ALL": "C"})   # one date format, whatever the locale
    return " ".join(out.stdout.split()) or None


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
                  object_store_mb: int | None = None, node_ip: str | None = None) -> list[str]:
    """The `ray start --block` command line of a head (args: --head --port P) or a
    node (args: --address=HEAD:PORT) on the machine `hw` describes. `node_ip`:
    the address Ray advertises for this node on Linux (macOS: always `hw.ip`);
    None lets Ray pick, which on a machine of several networks is whichever
    faces the default route, not necessarily the one the fleet shares."""
    cmd = [sys.executable, "-m", RAY_START, "start", *args, "--block",
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
    elif node_ip:
        cmd += ["--node-ip-address", node_ip]
    return cmd


def _node_ip(hw: Hardware, fleet_ip: str | None) -> str | None:
    """The address a `ray start` here advertises: a Mac's LAN address from the
    probe (`start_command` insists on it), else the fleet's address of this
    machine when known."""
    return hw.ip if hw.os == "macos" else fleet_ip


def route_ip(address: str) -> str | None:
    """This machine's address on the route to `address` (HOST:PORT or HOST): what
    the kernel would send from. A UDP socket's connect sends no packet. None
    when there is no route (or the name does not resolve)."""
    host, sep, port = address.rpartition(":")
    host, port = (host, port) if sep else (address, "0")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host.strip("[]")), int(port or 0) or 9))
            return s.getsockname()[0]
    except (OSError, ValueError):
        return None


LOG_BYTES = 1 << 20   # a `ray start` log past this moves aside when the node starts again


def _spawn(args: list[str], resources: dict, labels: dict, hw: Hardware, env: dict,
           log: Path, object_store_mb: int | None, node_ip: str | None = None) -> dict:
    """Start `ray start --block`; {"pid", "started"} of the process."""
    cmd = start_command(args, resources, labels, hw, object_store_mb, node_ip)
    private_dir(log.parent)
    if log.exists() and log.stat().st_size > LOG_BYTES:   # one older run kept, never more
        os.replace(log, log.with_name(log.name + ".1"))
    with open(private_file(log), "ab") as out:
        # its own session: a Ctrl-C in the shell that ran segctl does not reach the
        # node, and its process group is exactly this node's processes
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **env},
                                start_new_session=True)
    # read at once: our child cannot be reaped (and its pid reused) before we wait on it
    return {"pid": proc.pid, "started": start_time(proc.pid)}


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


def _wait(proc: dict, log: Path, pick, address: str, env: dict, *, what: str,
          timeout: float = START_TIMEOUT_S) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        if not alive(proc["pid"]):
            raise RuntimeError(f"{what} did not start: {_last_line(log.read_text(errors='replace'))}"
                               f" (log: {log})")
        found = pick(gcs_nodes(address, env, timeout=2) or [])
        if found:
            return found
        if time.monotonic() > deadline:
            stop(proc["pid"], proc["started"])
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
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                           text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


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


# ------------------------------------------------------------------ listening ports

def node_ports() -> dict:
    """Run as a Ray task on a node (fleet.ports() pins one to each): the TCP ports
    this node's Ray processes listen on, found from the `ray start` process above
    this worker (the raylet's parent) and everything under it: its GCS (on the
    head), raylet, agents and workers. This worker's own port is left out: it
    exists only for the question."""
    me = os.getpid()
    root = _ray_start_above(me)
    pids = [root, *descendants(root)]
    return {"pid": root, "listening": [p for p in listening(pids) if p["pid"] != me]}


def listening(pids: list[int], *, platform: str = sys.platform, run=subprocess.run) -> list[dict]:
    """TCP sockets in LISTEN state held by processes `pids`, as
    [{"process", "pid", "address", "port"}] sorted by port; address "*" is every
    interface (0.0.0.0 and/or ::). Linux reads /proc; macOS asks lsof."""
    if platform.startswith("linux"):
        found = _listening_linux(pids)
    else:
        out = run(["lsof", "-nP", "-a", "-p", ",".join(map(str, pids)), "-iTCP",
                   "-sTCP:LISTEN", "-F", "pcn"], capture_output=True, text=True).stdout
        found = _parse_lsof(out)
    return sorted(found, key=lambda p: (p["port"], p["address"], p["pid"]))


def _listening_linux(pids: list[int]) -> list[dict]:
    owner: dict[str, int] = {}    # socket inode -> pid
    spaces: dict[int, int] = {}   # network namespace -> a pid in it
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            spaces.setdefault(os.stat(f"/proc/{pid}/ns/net").st_ino, pid)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner.setdefault(link[8:-1], pid)
    out, seen = [], set()
    for pid in spaces.values():
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                if len(f) < 10 or f[3] != "0A" or f[9] not in owner or f[9] in seen:
                    continue          # 0A: LISTEN
                seen.add(f[9])
                host, port = f[1].split(":")
                who = owner[f[9]]
                out.append({"process": _comm(who), "pid": who, "address": _proc_address(host),
                            "port": int(port, 16)})
    return out


def _proc_address(hexed: str) -> str:
    """An address of /proc/net/tcp{,6}: hex, 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexed)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)
    return "*" if addr in ("0.0.0.0", "::") else addr.removeprefix("::ffff:")


def _parse_lsof(out: str) -> list[dict]:
    """`lsof -F pcn` output: p<pid>, c<command>, then f<fd> / n<address:port> per socket."""
    found, pid, comm = [], None, ""
    for line in out.splitlines():
        tag, value = line[:1], line[1:]
        if tag == "p":
            pid = int(value)
        elif tag == "c":
            comm = value
        elif tag == "n" and pid is not None:
            host, _, port = value.rpartition(":")
            host = host.strip("[]")
            found.append({"process": comm, "pid": pid,
                          "address": "*" if host in ("*", "0.0.0.0", "::") else host,
                          "port": int(port)})
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _ray_start_above(pid: int) -> int:
    """The `ray start` process this process runs under (a worker's parent is the
    raylet, whose parent is `ray start`); the parent when there is none."""
    parent = first = _parent(pid)
    while parent and parent > 1:
        cmd = subprocess.run(["ps", "-ww", "-o", "command=", "-p", str(parent)],
                             capture_output=True, text=True).stdout
        if any(f"{m} start" in cmd for m in RAY_STARTS) or "ray start" in cmd:
            return parent
        parent = _parent(parent)
    return first or pid


def _parent(pid: int) -> int | None:
    out = subprocess.run(["ps", "-o", "ppid=", "-p", str(pid)], capture_output=True,
                         text=True).stdout.strip()
    return int(out) if out.isdigit() else None
