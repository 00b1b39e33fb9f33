"""What a node says about itself for `segctl cluster check`, and the link test
between two nodes: the check runs `segctl node facts`, `segctl node link-serve`
and `segctl node link-test` on the nodes over ssh.

A data-parallel ring (engine/distributed.py) sends every step's gradients over
the address each node joined the fleet with: on a Mac, the probe's en0 or en1
address, which on a laptop is Wi-Fi even when a Thunderbolt bridge to the next
Mac is up (and 10-25x faster). So a node lists its interfaces with their kind,
and the check names the interface each pair's traffic takes.

The interface probe takes `run`, `platform` and the sysfs folder as parameters,
as node/hardware.py does, so a test on Linux hands in a Mac's outputs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform as platform_module
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from segctl.schemas.defaults import segctl_home

from .hardware import probe
from .raynode import route_ip

# Interface kinds, faster first: a Thunderbolt bridge (40-80 Gb/s), Ethernet
# (1-10 Gb/s), Wi-Fi (well under 1 Gb/s in practice).
KINDS = ("thunderbolt", "ethernet", "wifi", "other")
PACKAGES = ("segctl", "mlx", "mlx-lm", "ray")
TOKEN = "auth_token"          # a node's cluster token, in segctl_home()
PING_ROUNDS = 20              # round trips timed for a link's latency
LINK_BYTES = 64 << 20         # bytes sent one way for a link's bandwidth
_PIECE = 1 << 20


# ---------------------------------------------------------------- interfaces

def interfaces(run=subprocess.run, platform: str = sys.platform,
               sys_net: Path = Path("/sys/class/net")) -> list[dict]:
    """This machine's interfaces that hold an IPv4 address, loopback left out:
    [{"name", "kind" (KINDS), "addresses", "speed_mbps" (None: not known)}]."""
    if platform == "darwin":
        return _mac_interfaces(run)
    return _linux_interfaces(run, sys_net)


def _linux_interfaces(run, sys_net: Path) -> list[dict]:
    proc = run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True)
    out = []
    for entry in json.loads(proc.stdout or "[]") if proc.returncode == 0 else []:
        name = entry.get("ifname", "")
        addresses = [a["local"] for a in entry.get("addr_info", [])
                     if a.get("family") == "inet" and not a["local"].startswith("127.")]
        if not addresses or name == "lo":
            continue
        kind = ("wifi" if (sys_net / name / "wireless").exists()
                else "thunderbolt" if name.startswith("thunderbolt") else "ethernet")
        out.append({"name": name, "kind": kind, "addresses": addresses,
                    "speed_mbps": _sysfs_speed(sys_net / name / "speed")})
    return out


def _sysfs_speed(path: Path) -> int | None:
    try:
        speed = int(path.read_text().strip())
    except (OSError, ValueError):   # a virtual or down link has none
        return None
    return speed if speed > 0 else None


def _mac_interfaces(run) -> list[dict]:
    """From `networksetup -listallhardwareports` (each port's name and device) and
    `ipconfig getifaddr DEVICE` (its address, exit 1 when it has none)."""
    proc = run(["networksetup", "-listallhardwareports"], capture_output=True, text=True)
    ports, port = [], None
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Hardware Port":
            port = value.strip()
        elif key.strip() == "Device" and port:
            ports.append((port, value.strip()))
            port = None
    out = []
    for port, device in ports:
        got = run(["ipconfig", "getifaddr", device], capture_output=True, text=True)
        address = got.stdout.strip() if got.returncode == 0 else ""
        if address:
            out.append({"name": device, "kind": mac_kind(port), "addresses": [address],
                        "speed_mbps": None, "port": port})
    return out


def mac_kind(port: str) -> str:
    """A macOS hardware port's name as a kind: "Wi-Fi" -> wifi, "Thunderbolt
    Bridge" -> thunderbolt, "Ethernet" / "USB 10/100/1000 LAN" -> ethernet."""
    p = port.lower()
    if "wi-fi" in p or "airport" in p:
        return "wifi"
    if "thunderbolt" in p:
        return "thunderbolt"
    if "ethernet" in p or "lan" in p:
        return "ethernet"
    return "other"


def speed_key(iface: dict) -> tuple:
    """Sorts interfaces fastest first: by kind, then by link speed where known."""
    return (KINDS.index(iface["kind"]), -(iface.get("speed_mbps") or 0))


def holding(address: str, ifaces: list[dict]) -> dict | None:
    """The interface that holds `address`, if any."""
    return next((i for i in ifaces if address in i["addresses"]), None)


# ---------------------------------------------------------------- facts

def facts(head: str | None = None, run=subprocess.run, platform: str = sys.platform) -> dict:
    """What `segctl cluster check` compares across nodes: versions, hardware, the
    cluster token's fingerprint (never the token), interfaces, and the address
    this node joins the fleet with (a Mac's probed LAN address; elsewhere the
    address on the route to the head `head`, else its fastest interface's)."""
    hw = probe(run, platform)
    ifaces = interfaces(run, platform)
    address = hw.ip if hw.os == "macos" else (route_ip(head) if head else None)
    if not address and ifaces:
        address = sorted(ifaces, key=speed_key)[0]["addresses"][0]
    token = segctl_home() / TOKEN
    return {"host": socket.gethostname(), "chip": hw.chip, "memory_gb": hw.memory_gb,
            "os": hw.os, "python": platform_module.python_version(),
            "versions": {p: _version(p) for p in PACKAGES},
            "token": fingerprint(token.read_text()) if token.is_file() else None,
            "interfaces": ifaces, "rdma": rdma_devices(run), "address": address}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def fingerprint(token: str) -> str:
    """Enough of the token's sha256 to tell two tokens apart, nothing to use it by."""
    return hashlib.sha256(token.strip().encode()).hexdigest()[:12]


# ---------------------------------------------------------------- the link test

def serve(port: int = 0, timeout: float = 60.0, ready=print) -> None:
    """Answer one link test on TCP `port` (0: any free one), then return; `ready`
    gets the port once it listens. Ping: b"P" echoed. Bulk: b"B", 8 bytes of
    length, the bytes; b"K" once all arrived. b"Q" or a closed link ends it."""
    with socket.create_server(("", port)) as server:
        server.settimeout(timeout)
        ready(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            while (op := _take(conn, 1)) not in (b"", b"Q"):
                if op == b"P":
                    conn.sendall(b"P")
                elif op == b"B":
                    left = struct.unpack("!Q", _take(conn, 8))[0]
                    while left:
                        got = conn.recv(min(left, _PIECE))
                        if not got:
                            return
                        left -= len(got)
                    conn.sendall(b"K")
                else:
                    return


def measure(address: str, port: int, nbytes: int = LINK_BYTES, rounds: int = PING_ROUNDS,
            timeout: float = 60.0) -> dict:
    """A link test against `serve` at address:port: the median round trip of one
    byte (ms), and `nbytes` sent one way (MB/s, until the other end has them all).
    `source`: this end's address, so the interface it went out of."""
    with socket.create_connection((address, port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        trips = []
        for _ in range(rounds):
            tic = time.perf_counter()
            s.sendall(b"P")
            _take(s, 1)
            trips.append(time.perf_counter() - tic)
        piece = memoryview(bytes(_PIECE))
        tic = time.perf_counter()
        s.sendall(b"B" + struct.pack("!Q", nbytes))
        for start in range(0, nbytes, _PIECE):
            s.sendall(piece[:min(_PIECE, nbytes - start)])
        if _take(s, 1) != b"K":
            raise ConnectionError(f"{address}:{port} did not take the {nbytes} bytes")
        seconds = time.perf_counter() - tic
        source = s.getsockname()[0]
        s.sendall(b"Q")
    return {"rtt_ms": round(statistics.median(trips) * 1e3, 3),
            "mb_per_s": round(nbytes / seconds / 1e6, 1), "bytes": nbytes,
            "seconds": round(seconds, 4), "source": source}


def _take(conn: socket.socket, n: int) -> bytes:
    """Exactly n bytes, or b"" if the link closed first."""
    got = b""
    while len(got) < n:
        part = conn.recv(n - len(got))
        if not part:
            return b""
        got += part
    return got


def rdma_devices(run=subprocess.run) -> list[str]:
    """This machine's RDMA devices as `ibv_devices` lists them (a Mac with RDMA
    over Thunderbolt 5 enabled: rdma_en2, rdma_en3...); [] where it has none or no
    such tool (RDMA needs macOS 26.2 or later and `rdma_ctl enable`)."""
    try:
        proc = run(["ibv_devices"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    lines = (proc.stdout or "").splitlines() if proc.returncode == 0 else []
    firsts = [words[0] for words in map(str.split, lines) if words]
    return [w for w in firsts if w != "device" and not w.startswith("-")]


def ring_endpoint(interface: str | None, fleet_address: str, ifaces=None, rdma=(),
                  run=subprocess.run) -> str:
    """Where this node's rank of a job on several nodes listens: "address:port", a
    port free now, on the address of `interface` (distributed.interface) or, without
    one, the address the node joined the fleet with. ValueError (one line) when this
    node has no such interface with an IPv4 address, or lacks one of the RDMA
    devices `rdma` (a JACCL rank's, the cluster file's) by `ibv_devices`."""
    if rdma:
        devices = rdma_devices(run)
        missing = [d for d in rdma if d not in devices]
        if missing:
            listed = ", ".join(devices) or "none: RDMA needs macOS 26.2+ and rdma_ctl enable"
            raise ValueError(f"distributed.backend: jaccl: {socket.gethostname()} has no RDMA "
                             f"device {', '.join(missing)} (ibv_devices lists: {listed})")
    address = fleet_address
    if interface:
        ifaces = interfaces() if ifaces is None else ifaces
        found = next((i for i in ifaces if i["name"] == interface), None)
        if found is None:
            have = ", ".join(sorted(i["name"] for i in ifaces)) or "none"
            raise ValueError(f"distributed.interface: {interface}: {socket.gethostname()} has no "
                             f"such interface with an IPv4 address (it has: {have})")
        address = found["addresses"][0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return f"{address}:{s.getsockname()[1]}"
