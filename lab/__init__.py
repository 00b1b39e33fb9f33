"""A lab in a box: N hosts on this Linux machine, so the fleet can be tested
across real addresses, real private disks and real ssh.

Layout (ROOT defaults to /var/lib/segctl-lab):

    bridge  segbr0             198.18.0.1/15 in the root namespace (the driver)
    host i  netns seglab-h{i}  eth0 198.18.0.{10+i}/15, lo up, veth seglab{i} on the bridge,
                               hostname h{i} (its own UTS namespace)
    ROOT/h{i}/home             the host's $HOME (/root inside it): ~/.segctl, ~/.ssh
    ROOT/h{i}/tmp              the host's /tmp; /run and /dev/shm are private tmpfs
    ROOT/h{i}/etc              its sshd_config, host key, init.pid (its sshd) and logs
    ROOT/ssh_config            `ssh -F ROOT/ssh_config h1 CMD`; ROOT/bin/ssh wraps it
    ROOT/id_ed25519            the driver's key, in every host's authorized_keys
    ROOT/lab.json              what `up` made (every name under ROOT, every host): `down`
                               works from it alone, and a later `up` replaces only that

Only 198.18.0.0/15 (RFC 2544's benchmarking range) is used: no host has a
route anywhere else, so no traffic of the lab leaves this machine.

Each host is one long-lived sshd, the init of a PID namespace of its own:
`ip netns exec NS unshare --mount --uts` then a fork into a fresh PID namespace
(`_PID_NAMESPACE`), whose boot mounts that namespace's /proc in place of the
machine's, the host's folders, and hides the other hosts' folders, then execs
sshd. Every ssh session (and `nsenter -t SSHD_PID -m -n -u -p`, see `inside`)
runs in the host's network, filesystem view and process table: a host sees
its own processes only, so it cannot read another's files or environment
through /proc/PID/root, cwd or environ. Killing a host's sshd kills every
process of the host (the kernel's doing, when a PID namespace's init dies).
Every host is root of this one kernel, though: this separates what the hosts
see, it is no wall against a host's root that unmounts what hides the rest.
The code (the repo and its venv) is shared, as installed software is; when the
venv's Python lives under the driver's $HOME (pyenv in /root/.pyenv) that
folder is bound read-only into each host's home, or nothing would run there.

`up` takes an empty or new folder, or one holding its own lab.json; any other
folder (`--root /tmp`, a home) is refused before anything in it is touched.
`up` on a machine where a lab is up refuses in one line (a lab is global: the
bridge, the namespace names and the addresses are the machine's); a lab whose
namespaces and sshds are all gone (a reboot) is cleared first. `up` starts
every host from an empty home; `down` leaves the folders for post-mortems
(logs of sshd and of whatever ran in /tmp) and lab.json, marked down.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from segctl.node.raynode import alive, is_ours, start_time
from segctl.schemas.atomic import write_atomic

from . import system
from .system import LabError, NotALab

LAB_ROOT = Path("/var/lib/segctl-lab")
REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
SSHD = Path("/usr/sbin/sshd")
ROOT_HOME = Path(pwd.getpwuid(0).pw_dir)   # what each host's own home is bound over
BRIDGE = "segbr0"
NETWORK = ipaddress.ip_network("198.18.0.0/15")
BRIDGE_ADDRESS = "198.18.0.1"
FIRST_HOST = 10            # host i is 198.18.0.{FIRST_HOST + i}
MAX_HOSTS = 200
STATE = "lab.json"
MADE_BY = "segctl lab"     # in lab.json: a record of ours, not someone else's lab.json
# what `up` makes directly under ROOT besides the host folders (h1, h2, ...)
FILES = (STATE, ".lock", "id_ed25519", "id_ed25519.pub", "known_hosts", "ssh_config", "hosts",
         "bin")
INIT_PID = "init.pid"      # in ROOT/h{i}/etc: the host's sshd as this machine numbers it
NETNS_DIR = Path("/run/netns")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
START_TIMEOUT_S = 15
STOP_TIMEOUT_S = 5
TOOLS = ("ip", "unshare", "nsenter", "setsid", "ssh", "ssh-keygen", "mount")


@dataclass(frozen=True)
class Host:
    name: str            # "h1": its hostname, its ssh alias, a natural node name
    address: str         # "198.18.0.11"
    netns: str           # "seglab-h1"
    veth: str            # "seglab1": its cable's end on the bridge (root namespace)
    home: Path           # on this machine's disk; /root inside the host
    sshd_pid: int | None       # as this machine numbers it (1 in the host's own PID namespace)
    sshd_started: str | None   # the sshd's start time: a reused pid is never signalled


@dataclass(frozen=True)
class Lab:
    root: Path
    hosts: list[Host]

    @property
    def ssh_config(self) -> Path:
        return self.root / "ssh_config"

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in the lab at {self.root}")


# ------------------------------------------------------------------ probe

def why_not() -> str | None:
    """Why a lab cannot be made here (one line), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"a lab needs Linux namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "a lab needs root (network namespaces, bridges and mounts)"
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:
        return (f"a lab needs {', '.join(missing)} on the PATH "
                "(iproute2, util-linux, openssh-client)")
    if not os.access(SSHD, os.X_OK):
        return f"a lab needs an OpenSSH server at {SSHD} (apt-get install openssh-server)"
    if not (VENV / "bin" / "segctl").exists():
        return f"a lab runs segctl from {VENV}; make install first"
    # root in a container may still lack CAP_SYS_ADMIN / CAP_NET_ADMIN, or may not
    # mount a /proc: try every namespace a host has for real (they vanish with the
    # `true` that holds them)
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--pid", "--fork",
                            "--mount-proc", "true"],
                           capture_output=True, text=True, env=system.unthreaded_env())
    if probe.returncode != 0:
        return f"cannot make namespaces here: {system.last_line(probe.stderr)}"
    return None


# ------------------------------------------------------------------ up / down

def up(n: int, root: Path | str = LAB_ROOT) -> Lab:
    """Make a lab of `n` hosts and return it once every host's sshd answers."""
    if not 1 <= n <= MAX_HOSTS:
        raise LabError(f"a lab has 1 to {MAX_HOSTS} hosts, not {n}")
    root = Path(root).resolve()
    _refuse_if_not_a_lab(root)     # before anything is written: not even the lock
    reason = why_not()
    if reason:
        raise LabError(reason)
    with system.locked(root):
        before = _refuse_if_up(root)
        hosts = [_plan(root, i) for i in range(1, n + 1)]
        made = sorted({*FILES, *(h.name for h in hosts)})
        replaced = before["made"] if before else [STATE, ".lock"]
        _refuse_clashes(root, made, replaced)
        # recorded before anything is made, so a `down` after a crash mid-way
        # (or this function's own rollback) knows every name it may have to remove,
        # and a later `up` every folder it may replace (the old lab's too, until gone)
        state = {"made_by": MADE_BY, "up": True, "n": n, "bridge": BRIDGE,
                 "made_netns_dir": not system.is_mount(NETNS_DIR),
                 "made": sorted({*made, *replaced}), "hosts": [_host_record(h) for h in hosts]}
        _write_state(root, state)
        try:
            _write_files(root, hosts, replaced)
            state["made"] = made
            _write_state(root, state)
            _make_network(hosts)
            for h in hosts:
                _start_sshd(root, h, hosts)
            hosts = [_wait_sshd(root, h) for h in hosts]   # booting side by side
        except BaseException as e:
            why = str(e) if isinstance(e, LabError) else f"lab up failed: {system.one_line(e)}"
            try:
                _down(root)   # KeyboardInterrupt too: a half-made lab is never left behind
            except LabError as left:
                why += f"; and rolling back: {left}"
            raise LabError(why) from None
        state["hosts"] = [_host_record(h) for h in hosts]
        _write_state(root, state)
    return Lab(root=root, hosts=hosts)


def down(root: Path | str = LAB_ROOT) -> None:
    """Stop every process of the lab recorded at `root` and remove its namespaces,
    links and bridge. Idempotent; needs only ROOT/lab.json, not the process that
    made the lab. Raises LabError (one line) naming whatever is still there."""
    root = Path(root).resolve()
    state = _read_state(root)     # NotALab for a lab.json not ours, before the lock touches ROOT
    if state is None or not state["up"]:
        return
    with system.locked(root):
        _down(root)


def restart_host(lab: Lab, name: str) -> Host:
    """Boot host `name` again after a power-off (every process in it killed, its
    sshd too, so its /run, /dev/shm and mount namespace went with them; its
    disk, home and /tmp, stay): a fresh sshd as `up` starts one, in the same
    network namespace. Returns the host with its new sshd, which lab.json and
    `lab.hosts` now record. Refuses while anything still runs in the host."""
    with system.locked(lab.root):
        state = _read_state(lab.root)
        if state is None:
            raise LabError(f"no lab recorded at {lab.root}")
        i = next((k for k, h in enumerate(state["hosts"]) if h["name"] == name), None)
        if i is None:
            raise LabError(f"no host {name!r} in the lab at {lab.root}")
        old = _host_from(state["hosts"][i])
        if _host_pids(old):
            raise LabError(f"{name} is still running (processes {_host_pids(old)}); power it off first")
        etc = lab.root / name / "etc"
        (etc / INIT_PID).unlink(missing_ok=True)       # the dead sshd's
        for log in ("boot.log", "sshd.log"):            # the last boot's, kept aside
            if (etc / log).exists():
                os.replace(etc / log, etc / f"{log}.1")
        fresh = Host(**{**asdict(old), "sshd_pid": None, "sshd_started": None})
        _start_sshd(lab.root, fresh, [_host_from(h) for h in state["hosts"]])
        new = _wait_sshd(lab.root, fresh)
        state["hosts"][i] = _host_record(new)
        _write_state(lab.root, state)
    lab.hosts[:] = [new if h.name == name else h for h in lab.hosts]
    return new


def load(root: Path | str = LAB_ROOT) -> Lab | None:
    """The lab recorded at `root` (made by this or another process), or None."""
    root = Path(root).resolve()
    state = _read_state(root)
    if state is None or not state["up"]:
        return None
    return Lab(root=root, hosts=[_host_from(h) for h in state["hosts"]])


# ------------------------------------------------------------------ running things in a host

def host_env() -> dict:
    """The environment of a session in a host: segctl (the repo's venv, where it
    is installed) on the PATH, and OpenBLAS preloaded where it exists (MLX's own
    CPU BLAS is several times slower)."""
    env = {"PATH": f"{VENV / 'bin'}:{SYSTEM_PATH}"}
    if OPENBLAS.exists():
        env["LD_PRELOAD"] = str(OPENBLAS)
    return env


def ssh_argv(lab: Lab, host: Host | str, command: str) -> list[str]:
    """`ssh` to `host` with the lab's client config; `command` is a shell line."""
    name = host if isinstance(host, str) else host.name
    return ["ssh", "-F", str(lab.ssh_config), name, command]


def inside(host: Host, argv: list[str], env: dict | None = None) -> list[str]:
    """`argv` run in `host` without ssh: its network, filesystem, hostname and
    process table (entered through its sshd), from its home, with a session's
    environment (the caller's own is not carried in) plus `env`. Entering a PID
    namespace takes a fork: the pid of this command is nsenter's, outside the
    host, and `argv` runs as its child (`inner_pid` numbers it as the host does)."""
    if host.sshd_pid is None:
        raise LabError(f"host {host.name} has no sshd recorded")
    full = {"HOME": "/root", "USER": "root", "LOGNAME": "root", **host_env(), **(env or {})}
    # nsenter itself must not load OpenBLAS: its threads make entering a mount
    # namespace fail (EINVAL); the command inside gets it back from host_env
    return ["env", "-u", "LD_PRELOAD",
            "nsenter", "-t", str(host.sshd_pid), "-m", "-n", "-u", "-p", "--wd=/root", "--",
            "env", "-i", *(f"{k}={v}" for k, v in full.items()), *argv]


def pids(host: Host) -> list[int]:
    """Live processes of `host`, as this machine numbers them: those in its network
    namespace (zombies have none) or in its PID namespace (which a process that
    made a network namespace of its own is still in)."""
    spaces = [NETNS_DIR / host.netns]
    # (the start time alone: no `ps` per call, this runs in polling loops)
    if host.sshd_pid and host.sshd_started and start_time(host.sshd_pid) == host.sshd_started:
        spaces.append(Path(f"/proc/{host.sshd_pid}/ns/pid"))
    wanted = set()
    for path in spaces:
        try:
            st = os.stat(path)
        except (FileNotFoundError, ProcessLookupError):
            continue
        wanted.add((st.st_ino, st.st_dev))
    if not wanted:
        return []
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        for ns in ("net", "pid"):
            try:
                st = os.stat(f"/proc/{entry.name}/ns/{ns}")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            if (st.st_ino, st.st_dev) in wanted:
                out.append(int(entry.name))
                break
    return out


def inner_pid(pid: int) -> int | None:
    """Process `pid` of this machine as its own (innermost) PID namespace numbers it:
    what `ps`, Ray and segctl's records in a host say. None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid   # a kernel before 4.1: no PID namespaces to tell apart


# ------------------------------------------------------------------ internals: up

def _plan(root: Path, i: int) -> Host:
    return Host(name=f"h{i}", address=str(NETWORK.network_address + FIRST_HOST + i),
                netns=f"seglab-h{i}", veth=f"seglab{i}", home=root / f"h{i}" / "home",
                sshd_pid=None, sshd_started=None)


def _refuse_if_not_a_lab(root: Path) -> None:
    """A lab is made in a new or empty folder, or in one holding its own lab.json:
    never in a folder of other things (`--root /tmp`, a home)."""
    if not root.exists():
        return
    if not root.is_dir():
        raise NotALab(f"{root} is not a folder")
    if _read_state(root) is None and any(root.iterdir()):
        raise NotALab(f"{root} is not empty and holds no {STATE}: not a lab's folder, left "
                      "as it is; name a new or empty one")


def _refuse_clashes(root: Path, made: list[str], replaced: list[str]) -> None:
    """Refuse (before anything is written) to make a name under `root` that is
    there but not the lab's, or to replace a host folder that holds a mount point
    (never rmtree through a mount: a lab's folders are never mounted here)."""
    theirs = sorted(n for n in made if n not in replaced and os.path.lexists(root / n))
    if theirs:
        raise NotALab(f"{root / theirs[0]} is not the lab's ({STATE} does not record it); "
                      "move it away or name another folder")
    for name in replaced:
        mounted = [m for m in system.mountpoints() if m == root / name or root / name in m.parents]
        if mounted:
            raise LabError(f"{mounted[0]} is a mount point; not replacing {root / name}")


def _refuse_if_up(root: Path) -> dict | None:
    """One lab per machine: refuse when one is up (here or at another root); clear
    the record of one whose namespaces and sshds are all gone. Returns the record
    of the lab that was here (now down), if any."""
    state = _read_state(root)
    if state is not None and state["up"]:
        hosts = [_host_from(h) for h in state["hosts"]]
        if any(_lives(h) for h in hosts) or system.link_exists(state["bridge"]):
            raise LabError(f"a lab of {len(hosts)} hosts is already up at {root} "
                           f"({hosts[0].address}..{hosts[-1].address}); take it down first")
        _down(root)   # leftovers of a lab whose machine rebooted: nothing to stop
        state = _read_state(root)
    if system.link_exists(BRIDGE):
        raise LabError(f"bridge {BRIDGE} already exists: another lab is up on this machine "
                       f"(not recorded at {root})")
    taken = sorted(p.name for p in NETNS_DIR.glob("seglab-h*")) if NETNS_DIR.is_dir() else []
    if taken:
        raise LabError(f"network namespace {taken[0]} already exists: another lab is up on "
                       f"this machine (not recorded at {root})")
    return state


def _write_files(root: Path, hosts: list[Host], replaced: list[str]) -> None:
    """Fresh folders for every host, the lab's client key, known hosts and ssh
    config, /etc/hosts, and per host an sshd config and host key; what the lab
    made here before (`replaced`, from its lab.json) goes first, nothing else."""
    for name in replaced:
        old = root / name
        if name in (STATE, ".lock"):
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink(missing_ok=True)
    system.keygen(root / "id_ed25519", "segctl-lab")
    known = "".join(_write_host(root, h) for h in hosts)
    (root / "known_hosts").write_text(known)
    (root / "ssh_config").write_text(_ssh_config(hosts, root / "id_ed25519", root / "known_hosts"))
    (root / "hosts").write_text("127.0.0.1 localhost\n" +
                                "".join(f"{h.address} {h.name}\n" for h in hosts))
    # each host holds the client side too, so hosts ssh to each other by name
    # (a head in h1 runs `cluster up` to h2, h3...)
    for h in hosts:
        ssh_dir = h.home / ".ssh"
        shutil.copy(root / "id_ed25519", ssh_dir / "id_ed25519")
        (ssh_dir / "known_hosts").write_text(known)
        (ssh_dir / "config").write_text(
            _ssh_config(hosts, Path("~/.ssh/id_ed25519"), Path("~/.ssh/known_hosts")))
    _write_ssh_wrapper(root)


def _write_host(root: Path, h: Host) -> str:
    """Host `h`'s folders, sshd config and host key; its known_hosts line."""
    system.private(root / h.name)
    etc = system.private(root / h.name / "etc")
    system.keygen(etc / "ssh_host_ed25519_key", h.name)
    (etc / "sshd_config").write_text(_sshd_config(h, etc))
    tmp = root / h.name / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    # sshd's StrictModes: the home and ~/.ssh must not be writable by others
    ssh_dir = system.private(h.home / ".ssh")
    shutil.copy(root / "id_ed25519.pub", ssh_dir / "authorized_keys")
    key = (etc / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    return f"{h.name},{h.address} {' '.join(key)}\n"


def _write_ssh_wrapper(root: Path) -> None:
    """ROOT/bin/ssh: plain `ssh` with the lab's config, for code that runs `ssh`
    itself (segctl's fleet): put ROOT/bin first on its PATH."""
    bin_dir = system.private(root / "bin")
    search = os.pathsep.join(p for p in os.environ.get("PATH", SYSTEM_PATH).split(os.pathsep)
                             if p and Path(p).resolve() != bin_dir)   # never itself
    real = shutil.which("ssh", path=search) or "/usr/bin/ssh"
    (bin_dir / "ssh").write_text(f"#!/bin/sh\nexec {shlex.quote(real)} -F "
                                 f'{shlex.quote(str(root / "ssh_config"))} "$@"\n')
    os.chmod(bin_dir / "ssh", 0o700)


def _sshd_config(h: Host, etc: Path) -> str:
    env = " ".join(f"{k}={v}" for k, v in host_env().items())
    return "\n".join([
        f"ListenAddress {h.address}:22",
        f"HostKey {etc / 'ssh_host_ed25519_key'}",
        "PidFile /run/sshd.pid",           # the host's own /run: it says 1 (ROOT/hI/etc/init.pid)
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "AuthenticationMethods publickey",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",                       # PAM would reach for the machine's logind and limits
        "AuthorizedKeysFile .ssh/authorized_keys",
        "StrictModes yes",
        "UseDNS no",
        "PrintMotd no",
        "PrintLastLog no",
        "X11Forwarding no",
        # sshd's SetEnv is applied after its own PATH: a non-interactive
        # `ssh host segctl ...` finds the venv without any shell start-up file
        f"SetEnv {env}",
        "Subsystem sftp internal-sftp",
        "MaxStartups 64:30:128",           # `cluster up` opens several sessions at once
        "LogLevel INFO", ""])


def _ssh_config(hosts: list[Host], key: Path, known_hosts: Path) -> str:
    blocks = [f"Host {h.name} {h.address}\n  HostName {h.address}\n" for h in hosts]
    names = " ".join(p for h in hosts for p in (h.name, h.address))
    return "".join(blocks) + "\n".join([
        f"Host {names}", "  User root", f"  IdentityFile {key}", "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {known_hosts}", "  GlobalKnownHostsFile /dev/null",
        "  StrictHostKeyChecking yes", "  BatchMode yes", "  ConnectTimeout 5",
        "  LogLevel ERROR", ""])


def _make_network(hosts: list[Host]) -> None:
    system.ip("link", "add", BRIDGE, "type", "bridge")
    system.ip("addr", "add", f"{BRIDGE_ADDRESS}/{NETWORK.prefixlen}", "dev", BRIDGE)
    system.ip("link", "set", BRIDGE, "up")
    for h in hosts:
        system.ip("netns", "add", h.netns)
        # one veth pair: the host's end is created straight inside its namespace as eth0
        system.ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
        system.ip("link", "set", h.veth, "master", BRIDGE, "up")
        system.ip("-n", h.netns, "addr", "add", f"{h.address}/{NETWORK.prefixlen}", "dev", "eth0")
        system.ip("-n", h.netns, "link", "set", "eth0", "up")
        system.ip("-n", h.netns, "link", "set", "lo", "up")


# The host's boot, as the init of its fresh PID namespace (in its own mount and
# UTS namespaces): that namespace's /proc in place of the machine's (unmounted
# first, so no umount in the host uncovers it); a private /run (mount(8) keeps
# its utab there, and sshd needs /run/sshd), /dev/shm (Ray's object store) and
# /tmp; the other hosts' folders (the NHIDE paths before the pairs) covered by
# empty read-only ones; the shared software (SRC DST pairs) bound read-only into
# the home, then the home over root's; the lab's /etc/hosts; the hostname; then
# sshd in the foreground, so its pid is this process's: 1.
_BOOT = r"""
set -eu
sshd=$1 name=$2 home=$3 roots_home=$4 tmp=$5 hosts=$6 config=$7 log=$8 nhide=$9
shift 9
umount -n -l /proc
mount -n -t proc -o nosuid,nodev,noexec lab-proc /proc
mount -n -t tmpfs -o mode=0755 lab-run /run
mkdir -m 0755 /run/sshd
mount -n -t tmpfs -o mode=1777 lab-shm /dev/shm
while [ "$nhide" -gt 0 ]; do
  if [ -d "$1" ]; then mount -n -t tmpfs -o ro,mode=0700,size=4k lab-hidden "$1"; fi
  nhide=$((nhide - 1))
  shift
done
while [ $# -gt 1 ]; do
  mkdir -p "$2"
  mount -n --bind "$1" "$2"
  mount -n -o remount,bind,ro "$2"
  shift 2
done
mount -n --rbind "$tmp" /tmp
mount -n --rbind "$home" "$roots_home"
mount -n --bind "$hosts" /etc/hosts
hostname "$name"
exec "$sshd" -D -f "$config" -E "$log"
"""

# Run argv[2:] as the init of a new PID namespace and write its pid, as this
# machine numbers it, to argv[1]; then leave it, as `setsid -f` left it: an
# orphan of this machine's init, no child of a process that waits for it.
# (`unshare --pid --fork` would stay, waiting, a second process per host.)
_PID_NAMESPACE = r"""
import ctypes, os, sys
CLONE_NEWPID = 0x20000000
if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWPID) != 0:
    sys.exit("unshare(CLONE_NEWPID): " + os.strerror(ctypes.get_errno()))
child = os.fork()
if child == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{child}\n")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""


def _start_sshd(root: Path, h: Host, hosts: list[Host]) -> None:
    """Boot host `h` of the lab of `hosts` (whose folders it is not to see)."""
    etc = root / h.name / "etc"
    # checked first for a clear error (sshd -t wants /run/sshd: a throwaway /run)
    check = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            'mount -n -t tmpfs lab-run /run && mkdir /run/sshd && exec "$@"',
                            "sshd-check", str(SSHD), "-t", "-f", str(etc / "sshd_config")],
                           capture_output=True, text=True, env=system.unthreaded_env())
    if check.returncode != 0:
        raise LabError(f"{h.name}: sshd refuses its config: {system.last_line(check.stderr)}")
    hidden = [str(root / o.name) for o in hosts if o.name != h.name]
    pairs = [str(p) for src, dst in _shared_software(h) for p in (src, dst)]
    argv = ["setsid", "-f", "ip", "netns", "exec", h.netns,
            "unshare", "--mount", "--uts", "--propagation", "private", "--",
            sys.executable, "-I", "-c", _PID_NAMESPACE, str(etc / INIT_PID),
            "sh", "-c", _BOOT, f"lab-{h.name}", str(SSHD), h.name, str(h.home), str(ROOT_HOME),
            str(root / h.name / "tmp"), str(root / "hosts"), str(etc / "sshd_config"),
            str(etc / "sshd.log"), str(len(hidden)), *hidden, *pairs]
    with open(etc / "boot.log", "ab") as log:
        # setsid -f: the sshd is no child of ours and no member of our session, so
        # it outlives this process (and a Ctrl-C in its terminal)
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True,
                       env=system.unthreaded_env())


def _wait_sshd(root: Path, h: Host) -> Host:
    """The host once its sshd answers on port 22, with the sshd's pid (as this
    machine numbers it, from the file its boot writes) and start time."""
    etc = root / h.name / "etc"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        pid = system.read_pid(etc / INIT_PID)
        is_sshd = pid is not None and system.exe(pid) == str(SSHD)
        if pid is not None and is_sshd and system.port_open(h.address, 22):
            return Host(**{**asdict(h), "sshd_pid": pid, "sshd_started": start_time(pid)})
        logs = [etc / "boot.log", etc / "sshd.log"]
        said = "".join(p.read_text(errors="replace") for p in logs if p.exists())
        # the boot script stops at its first error (set -e), sshd at a fatal one
        if said.strip() and not pids(h):
            raise LabError(f"{h.name} did not boot: {system.last_line(said)} (logs: {etc})")
        if time.monotonic() > deadline:
            raise LabError(f"{h.name}: sshd did not answer on {h.address}:22 within "
                           f"{START_TIMEOUT_S} s (logs: {etc})")
        time.sleep(0.05)


def _shared_software(h: Host) -> list[tuple[Path, Path]]:
    """(folder, where the host sees it) for the software a host needs that lives
    where the host has its own folder: under root's home or under /tmp (a fresh
    clone there), hidden otherwise. The repo, its venv and the Python the venv
    was made from (pyenv's), outermost folders only: bound into the host's own
    home and tmp folders before those cover /root and /tmp."""
    python = (VENV / "bin" / "python").resolve()
    found = {p.resolve() for p in (REPO, VENV, python.parent.parent)}
    out = []
    for hidden, into in ((ROOT_HOME, h.home), (Path("/tmp"), h.home.parent / "tmp")):
        under = sorted(p for p in found if hidden in p.parents)
        out += [(p, into / p.relative_to(hidden)) for p in under
                if not any(q in p.parents for q in under)]
    return out


# ------------------------------------------------------------------ internals: down

def _down(root: Path) -> None:
    state = _read_state(root)
    if state is None or not state["up"]:
        return
    hosts = [_host_from(h) for h in state["hosts"]]
    for h in hosts:
        _stop_processes(h)
    for h in hosts:
        # the cable first: deleting one end of a veth pair deletes both at once,
        # whereas after `netns del` the kernel drops them in its own time
        if system.link_exists(h.veth):
            system.ip("link", "del", h.veth)
        if (NETNS_DIR / h.netns).exists():
            system.ip("netns", "del", h.netns)
    if system.link_exists(state["bridge"]):
        system.ip("link", "del", state["bridge"])
    # `ip netns add` makes /run/netns a mount point of its own the first time;
    # undone when it was this lab's doing and no other namespace lives there now
    if state.get("made_netns_dir") and system.is_mount(NETNS_DIR) and not any(NETNS_DIR.iterdir()):
        system.umount(NETNS_DIR)
        NETNS_DIR.rmdir()
    left = ([f"process {p}" for h in hosts for p in _host_pids(h)] +
            [f"netns {h.netns}" for h in hosts if (NETNS_DIR / h.netns).exists()] +
            [f"link {n}" for n in [h.veth for h in hosts] + [state["bridge"]] if system.link_exists(n)])
    if left:   # the record stays up, so `down` can be run again
        raise LabError(f"lab down, but still there: {', '.join(left)}")
    # kept, marked down: what the lab made here, for the next `up` to replace
    _write_state(root, {**state, "up": False})


def _stop_processes(h: Host) -> None:
    """Everything running in the host (its sshd, its sessions and whatever they
    left running, Ray included): its sshd SIGKILLed, which kills every process of
    its PID namespace with it (the power cord); then SIGTERM and SIGKILL to
    whatever is left in its network (entered from outside its PID namespace)."""
    if h.sshd_pid and is_ours(h.sshd_pid, h.sshd_started):
        try:
            os.kill(h.sshd_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + STOP_TIMEOUT_S
        signalled: set[int] = set()
        while live := _host_pids(h):
            for p in set(live) - signalled:   # newcomers too: sshd forks, Ray respawns
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
                signalled.add(p)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)


def _host_pids(h: Host) -> list[int]:
    found = set(pids(h))
    if h.sshd_pid and is_ours(h.sshd_pid, h.sshd_started):
        found.add(h.sshd_pid)
    return sorted(p for p in found if alive(p))


def _lives(h: Host) -> bool:
    return (NETNS_DIR / h.netns).exists() or bool(
        h.sshd_pid and is_ours(h.sshd_pid, h.sshd_started))


# ------------------------------------------------------------------ small helpers

def _host_record(h: Host) -> dict:
    return {**asdict(h), "home": str(h.home)}


def _host_from(d: dict) -> Host:
    return Host(**{**d, "home": Path(d["home"])})


def _read_state(root: Path) -> dict | None:
    """The lab recorded at `root`; None where nothing is. NotALab for a lab.json
    that is not a record of ours."""
    try:
        state = json.loads((root / STATE).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (ValueError, UnicodeDecodeError) as e:
        raise NotALab(f"{root / STATE}: not a lab record ({system.one_line(e)}); not touching "
                      f"{root}") from None
    if not isinstance(state, dict) or state.get("made_by") != MADE_BY:
        raise NotALab(f"{root / STATE} is not a segctl lab's record; not touching {root}")
    return state


def _write_state(root: Path, state: dict) -> None:
    write_atomic(root / STATE, json.dumps(state, indent=1))
