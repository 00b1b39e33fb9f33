"""Ray on one machine: start the head or a node as a `ray start --block` child of
its own session, wait until the cluster sees it, stop it by its pid.

Why `--block` and pids, never `ray stop`: `ray stop` kills every Ray process of
the user on the machine, other clusters included. A `ray start --block` process
owns its node: SIGTERM to it drains and tears down that node's GCS/raylet/
workers (all in its process group), so a fleet is stopped by the pids it
recorded and nothing else. Each pid is recorded with its process's start time
(`start_time`): a pid the OS has since handed to another process is never
signalled.

Also the small file helpers every side uses for what it keeps on disk
(`private_dir`, `private_file`: owner-only, whatever the umask).

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
import stat
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
    Returns {"pid", "started", "address"} once the GCS answers ("started": the
    process's start time, which `stop` checks before it signals the pid)."""
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
    proc = _spawn(args, resources, labels, hw, env, Path(log_dir) / "ray-head.log", object_store_mb)
    here = f"{hw.ip or '127.0.0.1'}:{port}"   # the address Ray was given, else loopback
    found = _wait(proc, Path(log_dir) / "ray-head.log",
                  lambda ns: [n for n in ns if n["head"] and n["alive"]],
                  here, env, what=f"the head on port {port}")
    return {**proc, "address": f"{found[0]['ip']}:{port}"}


def start_node(*, address: str, name: str, memory_gb: float, chip: str, labels: dict,
               hw: Hardware, token_path: str, log_dir: Path,
               object_store_mb: int | None = None) -> dict:
    """Join this machine to the head at `address` as segctl node `name`. Returns
    {"pid", "started", "name"} once the node is alive in the cluster's node table."""
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
    proc = _spawn([f"--address={address}"], {resource: 1}, all_labels, hw, env, log,
                  object_store_mb)
    _wait(proc, log, lambda ns: [n for n in ns if n["alive"] and resource in n["resources"]],
          address, env, what=f"node {name}")
    return {**proc, "name": name}


def stop(pid: int, started: str | None = None, timeout: float = 5) -> None:
    """Stop the `ray start --block` process `pid` and its node: SIGTERM (Ray drains
    and tears the node down), wait, then SIGKILL whatever of its process group is
    left. Only if `pid` is still the process that was recorded (`is_ours`): a
    pid that is gone or now belongs to another process is left alone."""
    if not is_ours(pid, started):
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
    return "ray.scripts.scripts start" in cmd and "--block" in cmd


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


LOG_BYTES = 1 << 20   # a `ray start` log past this moves aside when the node starts again


def _spawn(args: list[str], resources: dict, labels: dict, hw: Hardware, env: dict,
           log: Path, object_store_mb: int | None) -> dict:
    """Start `ray start --block`; {"pid", "started"} of the process."""
    cmd = start_command(args, resources, labels, hw, object_store_mb)
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


# ------------------------------------------------------------------ private files

def private_dir(path) -> Path:
    """Folder `path`, made if missing (with any missing parents), readable by its
    owner only (0700) whatever the umask; it must be a folder of this user (a
    name in a shared /tmp may have been taken by someone else first). Parents
    that were already there are left as they are."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass          # made by someone else meanwhile: checked below like any other
        if p != path:
            _own(p, stat.S_ISDIR, "folder")
            os.chmod(p, 0o700)
    _own(path, stat.S_ISDIR, "folder")
    os.chmod(path, 0o700)
    return path


def private_file(path, data: bytes | None = None) -> Path:
    """File `path` readable and writable by its owner only (0600) whatever the
    umask: made empty if missing, written with `data` if given (in place; write
    to a temp name and rename for atomicity). Its folder must exist."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path}: not a file of this user (uid {st.st_uid})")
        os.fchmod(fd, 0o600)
        if data is not None:
            os.ftruncate(fd, 0)
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(data)
    finally:
        os.close(fd)
    return path


def _own(path: Path, kind, what: str) -> None:
    st = os.stat(path)
    if not kind(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path}: not a {what} of this user (uid {st.st_uid}); "
                              "segctl keeps its files in folders only their owner can read")
