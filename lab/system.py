"""The machine's tools as the lab uses them: `ip`, mounts, processes, ports, ssh
keys, private folders, and the one-line errors a lab fails with. No lab state
here: lab/__init__.py decides what to make and unmake.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path


class LabError(RuntimeError):
    """A lab could not be made or unmade; the message is one line."""


class NotALab(LabError):
    """The folder named is not a lab's (bad input): refused before anything in it
    was touched."""


def unthreaded_env() -> dict:
    """Our environment less LD_PRELOAD: a preloaded OpenBLAS starts threads in every
    process, and a threaded process cannot enter or make a mount namespace."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, env=unthreaded_env())
    if out.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {last_line(out.stderr)}")


def umount(path: Path) -> None:
    # umount(8) would leave /run/mount (libmount's lock folder) behind: the syscall
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(str(path).encode(), 0) != 0:
        raise LabError(f"umount {path}: {os.strerror(ctypes.get_errno())}")


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()   # this (root) namespace's links


def is_mount(path: Path) -> bool:
    return path.resolve() in mountpoints()


def mountpoints() -> set[Path]:
    # field 5 of mountinfo, with the kernel's octal escapes (\040 for a space)
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return {Path(ln.split()[4].encode().decode("unicode_escape")) for ln in lines if ln.strip()}


def exe(pid: int) -> str | None:
    """What process `pid` runs; None when it is gone (or going)."""
    try:
        return os.path.realpath(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)


def private(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


@contextmanager
def locked(root: Path):
    """One `up` or `down` at a time per lab folder."""
    private(root)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def last_line(text: str) -> str:
    """The last message in a tool's output; indented lines continue a message (mount's
    "dmesg(1) may have more information" hint) and are not one."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    heads = [ln for ln in lines if not ln[0].isspace()] or lines
    return heads[-1].strip() if heads else "(no output)"


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {last_line(str(e)) if str(e) else 'no message'}"
