"""What this machine is: chip, memory, OS, cores, and (on macOS) the LAN address
Ray must be told to use. The one place that knows about macOS versus Linux, so
everything platform-specific about starting Ray hangs off a `Hardware`.

`run` and `platform` are parameters so a test on Linux can hand in the outputs
of a Mac's `sysctl` and `ipconfig`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Hardware:
    chip: str          # "m2-max", "intel-xeon-platinum-8480", ...
    memory_gb: float   # physical memory, GiB
    os: str            # "macos" | "linux" | sys.platform
    cores: int
    ip: str | None     # the address Ray must bind on macOS; None: Ray picks it


def probe(run=subprocess.run, platform: str = sys.platform) -> Hardware:
    if platform == "darwin":
        return _probe_macos(run)
    if platform.startswith("linux"):
        return _probe_linux()
    raise RuntimeError(f"segctl runs on macOS and Linux, not {platform}")


def default_name() -> str:
    """This machine's node name when none is given: the hostname, cut to what a
    node name and a Ray label allow."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])
    return name.strip("-_")[:63] or "local"


def ray_env(token_path: str, hw: Hardware | None = None) -> dict:
    """Environment additions for `ray start` and for every driver (ray.init):
    token authentication, and on macOS the flag without which Ray refuses to
    form a multi-node cluster."""
    hw = hw or probe()
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
           "RAY_USAGE_STATS_ENABLED": "0"}
    if hw.os == "macos":
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    return env


def chip_name(brand: str) -> str:
    """A CPU brand string as a short label: "Apple M2 Max" -> "m2-max",
    "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz" -> "intel-xeon-platinum-8480"."""
    s = re.sub(r"\((r|tm)\)", " ", brand, flags=re.I).split("@")[0]
    s = re.sub(r"\b(cpu|processor|apple)\b", " ", s, flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "unknown"


def _probe_macos(run) -> Hardware:
    def sysctl(key: str) -> str:
        return run(["sysctl", "-n", key], capture_output=True, text=True, check=True).stdout.strip()

    return Hardware(chip=chip_name(sysctl("machdep.cpu.brand_string")),
                    memory_gb=round(int(sysctl("hw.memsize")) / 2**30, 1),
                    os="macos", cores=int(sysctl("hw.ncpu")), ip=_mac_ip(run))


def _mac_ip(run) -> str | None:
    # en0 is Wi-Fi on laptops and Ethernet on desktops; en1 is Wi-Fi on the desktops
    # that have both. A Mac with neither up has no LAN address to offer Ray.
    for iface in ("en0", "en1"):
        out = run(["ipconfig", "getifaddr", iface], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return None


def _probe_linux() -> Hardware:
    meminfo = Path("/proc/meminfo").read_text()
    total = re.search(r"^MemTotal:\s+(\d+)", meminfo, re.M)
    assert total is not None   # every Linux kernel's meminfo has it
    kb = int(total.group(1))
    model = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    # ARM Linux often has no "model name"; the machine type is the best we have then
    chip = chip_name(model.group(1)) if model else os.uname().machine
    return Hardware(chip=chip, memory_gb=round(kb / 2**20, 1), os="linux",
                    cores=os.cpu_count() or 1, ip=None)
