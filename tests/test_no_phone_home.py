"""No network traffic the user did not ask for: the real `segctl train` with every
installed tracker in `report_to` connects nowhere but loopback and unix sockets.

Two probes, so a tracker that phones home fails here whichever way it does it:
- an audit hook (a sitecustomize.py on the child's PYTHONPATH) records every
  `socket.connect`, `sendto`, `sendmsg` and `getaddrinfo` of every Python process, with
  its destination;
- where the machine allows it (Linux, unshare, iproute2), the child runs in a network
  and mount namespace of its own whose only way out is a veth with the default route,
  and whose resolv.conf names a nameserver behind it: any packet for the outside, from
  any process in any language (a tracker's native helper, a DNS query), is counted
  there and goes nowhere. Nothing leaves the machine even when the test fails.

MLflow keeps its telemetry off by itself under pytest and CI (PYTEST_CURRENT_TEST, CI,
GITHUB_ACTIONS, ... in mlflow/telemetry/utils.py, read once at import), which is how
the tests never saw it: the child gets a minimal environment built from nothing, and
a control run with SEGCTL_TRACKER_TELEMETRY=1 must see MLflow reach out, so the child
is proven to run as a user's would and the probes to see what they should.
"""

from __future__ import annotations

import ast
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from segctl.orchestrator.trackers import REQUIRES, TELEMETRY_OFF, TELEMETRY_OPT_IN, missing, telemetry_off
from segctl.schemas.job import TrackerSpec
from tests.conftest import OPENBLAS, ROOT, edit_job

INSTALLED = [name for name in REQUIRES if not missing([TrackerSpec(type=name)])]
SHORT = dict(iters=2, eval_every=2, val_batches=2, checkpoint_every=0, warmup=0)

# Loaded first by every Python process of the child (PYTHONPATH); appends one JSON line
# per network call, and one "start" line so a hook that never loaded cannot pass.
HOOK = r'''
import json, os, sys
_LOG = os.environ["NO_PHONE_HOME_LOG"]
def _write(rec):
    rec["pid"] = os.getpid()
    with open(_LOG, "a") as f:
        f.write(json.dumps(rec) + "\n")
def _hook(event, args):
    if event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
        sock, address = args[0], args[1]
        _write({"event": event, "family": int(sock.family), "address": repr(address)})
    elif event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex"):
        _write({"event": event, "host": repr(args[0])})
_write({"event": "start", "argv": sys.argv[:3]})
sys.addaudithook(_hook)
'''

# Inside the namespaces: loopback up, the rest of the world behind one end of a veth
# pair (its peer takes what it is given and answers nothing), DNS sent there too. ARP
# and IPv6 are off on the pair, so the counter moves only for what a process sends.
NAMESPACE = r"""
set -e
ip link set lo up
ip link add out0 type veth peer name peer0
for dev in out0 peer0; do echo 1 > /proc/sys/net/ipv6/conf/$dev/disable_ipv6; done
ip link set out0 arp off
ip addr add 198.18.0.1/24 dev out0
ip link set peer0 up
ip link set out0 up
ip route add default dev out0
printf 'nameserver 198.18.0.53\noptions timeout:1 attempts:1\n' > "$NS_DIR/resolv.conf"
mount --bind "$NS_DIR/resolv.conf" /etc/resolv.conf
ip -j -s link show out0 > "$NS_DIR/before.json"
set +e
"$@"
rc=$?
ip -j -s link show out0 > "$NS_DIR/after.json"
exit $rc
"""


def namespace_command() -> list[str] | None:
    """How to start a child in fresh network + mount namespaces here, or None."""
    if not sys.platform.startswith("linux") or not (shutil.which("unshare") and shutil.which("ip")):
        return None
    cmd = ["unshare", "-mn"] if os.geteuid() == 0 else ["unshare", "-rmn"]
    probe = subprocess.run([*cmd, "ip", "link", "add", "x0", "type", "veth", "peer", "name", "x1"],
                           capture_output=True, timeout=30)
    return cmd if probe.returncode == 0 else None


NS = namespace_command()


def tx_packets(link_json: Path) -> int:
    return json.loads(link_json.read_text())[0]["stats64"]["tx"]["packets"]


def local(rec: dict) -> bool:
    """A destination on this machine: a unix socket, loopback, or no host at all."""
    if rec["event"] == "start":
        return True
    if rec["event"].startswith("socket.get"):
        host = ast.literal_eval(rec["host"])   # the hook's repr of a str, bytes or None
        host = host.decode() if isinstance(host, bytes) else host
        if host in (None, "", "localhost"):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False
    if rec["family"] == socket.AF_UNIX:
        return True
    address = ast.literal_eval(rec["address"])
    try:
        ip = ipaddress.ip_address(address[0])
    except ValueError:
        return False
    return ip.is_loopback or getattr(ip, "ipv4_mapped", None) is not None and ip.ipv4_mapped.is_loopback


def train(demo_dir: Path, folder: Path, extra_env: dict) -> tuple[subprocess.CompletedProcess, list, int | None]:
    """`segctl train` of a 2-step demo job with every installed tracker, in a
    minimal environment: (process, the hook's records, packets sent outward or None)."""
    job = folder / "job.yaml"
    job.write_text((demo_dir / "job.yaml").read_text())
    edit_job(job, model=str(demo_dir / "model"), output=str(folder / "out"), train=SHORT,
             data={"train": str(demo_dir / "data/train.jsonl"),
                   "valid": str(demo_dir / "data/valid.jsonl")},
             report_to=INSTALLED)
    site = folder / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOOK)
    log = folder / "net.jsonl"
    # Built from nothing, not from ours: no PYTEST_*, CI or other marker a tracker
    # reads to keep quiet in tests. HOME is private: MLflow keeps an installation id there.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(folder / "user"),
           "LANG": "C.UTF-8", "PYTHONPATH": f"{site}{os.pathsep}{ROOT}",
           "SEGCTL_HOME": str(folder / "home"), "NO_PHONE_HOME_LOG": str(log),
           "NS_DIR": str(folder), **extra_env}
    if "wandb" in INSTALLED:
        env["WANDB_MODE"] = "offline"   # a user's local-only W&B: its server is not asked for
    if Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS
    cmd = [sys.executable, "-m", "segctl.orchestrator.cli", "train", str(job), "--json"]
    if NS:
        cmd = [*NS, "sh", "-c", NAMESPACE, "namespace", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder, timeout=120)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    sent = tx_packets(folder / "after.json") - tx_packets(folder / "before.json") if NS else None
    return proc, records, sent


@pytest.mark.slow   # 5 s
def test_segctl_train_with_every_tracker_stays_on_this_machine(demo_dir, tmp_path):
    assert "mlflow" in INSTALLED, "the dev install has mlflow: without it this test proves little"
    proc, records, sent = train(demo_dir, tmp_path, {})
    assert proc.returncode == 0, proc.stderr[-2000:]
    # A tracker that failed to open is dropped with a warning and would make no traffic.
    assert "warning" not in proc.stderr, proc.stderr[-2000:]
    assert any(r["event"] == "start" for r in records), "the audit hook never loaded"
    if "mlflow" in INSTALLED:
        assert (tmp_path / "home/trackers/mlflow.db").stat().st_size > 0
    if "tensorboard" in INSTALLED:
        assert list((tmp_path / "home/trackers/tensorboard").rglob("events.out.tfevents.*"))
    outward = [r for r in records if not local(r)]
    assert outward == [], f"segctl train with {INSTALLED} reached out: {outward}"
    assert sent in (None, 0), f"{sent} packets left the namespace for the outside"


@pytest.mark.slow   # 5 s
@pytest.mark.skipif(NS is None, reason="needs network namespaces: the control run reaches out")
def test_the_probes_see_mlflow_telemetry_when_the_user_opts_in(demo_dir, tmp_path):
    """The control: with the opt-in, the same child run does phone home (MLflow's config
    fetch), so the minimal environment really is a user's and both probes see it. If a
    future MLflow sends nothing at all, this fails and says so: then drop the control."""
    if "mlflow" not in INSTALLED:
        pytest.skip("mlflow is not installed")
    proc, records, sent = train(demo_dir, tmp_path, {TELEMETRY_OPT_IN: "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    outward = [r for r in records if not local(r)]
    assert any("mlflow" in r.get("host", "") for r in outward), \
        f"no MLflow telemetry seen even when opted in: {records}"
    assert sent and sent > 0, "the namespace's way out counted no packet for the outside"


def test_telemetry_off_unless_the_user_says_otherwise():
    """Off by default; the user's own value of a tracker's switch, or the opt-in, wins."""
    env = {}
    telemetry_off("mlflow", env)
    assert env == {"MLFLOW_DISABLE_TELEMETRY": "true"}
    env = {"MLFLOW_DISABLE_TELEMETRY": "false"}   # the user turned MLflow's telemetry on
    telemetry_off("mlflow", env)
    assert env == {"MLFLOW_DISABLE_TELEMETRY": "false"}
    env = {TELEMETRY_OPT_IN: "1"}
    telemetry_off("wandb", env)
    assert env == {TELEMETRY_OPT_IN: "1"}
    env = {}
    telemetry_off("wandb", env)
    assert env == TELEMETRY_OFF["wandb"] == {"WANDB_ERROR_REPORTING": "false"}
