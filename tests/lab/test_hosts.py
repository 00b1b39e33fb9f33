"""What a lab host is: its own address on a shared segment, its own home and
/tmp, its own process table, real ssh with segctl on the PATH, and Ray
spanning hosts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from segctl import lab as lablib
from segctl.node import raynode

from .conftest import HOSTS, commands, run_in, ssh, where_readable

pytestmark = pytest.mark.fleet   # a lab of hosts

# Connects to every ADDRESS:PORT given and prints which answered: run inside a
# host, it is that host's view of the network (no `ping` on this machine).
_REACH = """
import json, socket, sys
ok = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        ok[target] = True
    except OSError:
        ok[target] = False
print(json.dumps(ok))
"""


def test_each_host_has_its_address_and_reaches_the_others(lab):
    assert [h.address for h in lab.hosts] == [f"198.18.0.{10 + i}" for i in range(1, HOSTS + 1)]
    with socket.create_server(("198.18.0.1", 0)) as driver:   # the bridge: the root namespace
        targets = [f"{h.address}:22" for h in lab.hosts] + \
            [f"198.18.0.1:{driver.getsockname()[1]}"]
        for h in lab.hosts:
            addr = run_in(h, ["ip", "-4", "-o", "addr", "show"])
            assert addr.returncode == 0, addr.stderr
            mine = sorted(line.split()[3] for line in addr.stdout.splitlines())
            assert mine == ["127.0.0.1/8", f"{h.address}/15"], addr.stdout
            # nothing but the lab's segment is routed: no traffic leaves the machine
            route = run_in(h, ["ip", "-4", "route", "show"])
            assert route.stdout.split()[:3] == ["198.18.0.0/15", "dev", "eth0"], route.stdout
            assert len(route.stdout.strip().splitlines()) == 1, route.stdout
            reach = run_in(h, ["python", "-c", _REACH, *targets])
            assert reach.returncode == 0, reach.stderr
            assert all(json.loads(reach.stdout).values()), (h.name, reach.stdout)
        # and the driver reaches each host's sshd across the bridge
        for h in lab.hosts:
            socket.create_connection((h.address, 22), timeout=2).close()


def test_home_and_tmp_are_private_to_each_host(lab):
    mark = f"lab-mark-{uuid.uuid4().hex[:8]}"
    h1, h2 = lab.hosts[:2]
    wrote = ssh(lab, h1, f"mkdir -p ~/.segctl && echo {h1.name} > ~/.segctl/{mark} && "
                         f"echo {h1.name} > /tmp/{mark} && cat ~/.segctl/{mark} /tmp/{mark}")
    assert wrote.returncode == 0 and wrote.stdout.split() == [h1.name] * 2, wrote
    # on disk the host's home is its own folder of the lab
    assert (h1.home / ".segctl" / mark).read_text().strip() == h1.name
    for other in lab.hosts[1:]:
        look = ssh(lab, other, f"ls ~/.segctl/{mark} /tmp/{mark}")
        assert look.returncode != 0 and look.stdout == "", (other.name, look)
    assert not (Path.home() / ".segctl" / mark).exists()
    assert not Path("/tmp", mark).exists()
    assert not (h2.home / ".segctl" / mark).exists()


def test_a_host_sees_only_its_own_processes_and_files(lab):
    """A process of h2 with a secret in its token file, its working folder, its
    environment and its command line: h2 itself reads it every way (the probe
    works), h3 (the outsider) none, through /proc or the lab's folders, and no
    /proc of this machine lies under h3's to uncover."""
    h2, h3 = lab.host("h2"), lab.host("h3")
    secret = uuid.uuid4().hex
    started = subprocess.run(lablib.ssh_argv(lab, h2, (
        "mkdir -p ~/.segctl && cd ~/.segctl && (umask 077; cat > auth_token) && "
        "s=$(cat auth_token) && { SEGCTL_SECRET=$s setsid python -c "
        "'import time; time.sleep(300)' $s </dev/null >/dev/null 2>&1 & echo $!; }")),
        input=secret, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    inner = int(started.stdout.split()[0])
    [member] = [p for p in lablib.pids(h2) if lablib.inner_pid(p) == inner]
    on_disk = h2.home / ".segctl" / "auth_token"
    try:
        # (every process of h2 has h2's root: the token file under each one's)
        assert {f"/proc/{inner}/{part}" for part in (
                "cmdline", "environ", "cwd/auth_token", "root/root/.segctl/auth_token")
                } | {str(on_disk)} <= set(where_readable(lab, h2, secret, [on_disk]))
        assert where_readable(lab, h3, secret, [on_disk, f"/proc/{member}/environ"]) == []
        # h3's process table is its own: no pid of h2's there, however numbered
        listed = ssh(lab, h3, "ps -e -o pid=,args=")
        assert listed.returncode == 0 and secret not in listed.stdout, listed
        assert {int(line.split()[0]) for line in listed.stdout.splitlines()} <= \
            set(range(1, 1000)), listed.stdout      # numbered from 1 in h3
        # and unmounting h3's /proc uncovers nothing (a copy of its mounts, so h3 keeps its own)
        under = ssh(lab, h3, "env -u LD_PRELOAD unshare --mount --propagation private sh -c "
                             "'umount -l /proc && ls -A /proc'")
        assert under.returncode == 0 and under.stdout == "", under
    finally:
        os.kill(member, signal.SIGKILL)


def test_ssh_finds_segctl_and_each_host_has_its_name(lab):
    helped = ssh(lab, "h1", "segctl --help")
    assert helped.returncode == 0, helped.stderr
    assert "Usage: segctl" in helped.stdout
    names = ssh(lab, "h1", "echo $HOSTNAME; for h in " +
                " ".join(h.name for h in lab.hosts) + "; do ssh $h hostname; done")
    # hosts ssh to each other by name too (each has the lab's key and /etc/hosts)
    assert names.returncode == 0, names.stderr
    assert names.stdout.split() == ["h1"] + [h.name for h in lab.hosts]


# A driver in a host: joins the cluster, waits until `want` nodes are alive,
# prints them.
_DRIVER = """
import json, sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
deadline = time.monotonic() + 60
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) >= int(sys.argv[2]) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps(alive))
"""


def _ray_start(lab, host, args: list[str]) -> dict:
    """`ray start --block` in `host`, in a session of our own: nsenter (`proc`)
    runs it as its child in the host's PID namespace; that child's pid as this
    machine numbers it (and its descendants) stop it."""
    argv = ["ray", "start", "--block", "--disable-usage-stats", "--num-cpus", "1",
            "--object-store-memory", str(80 * 2**20), "--node-ip-address", host.address, *args]
    with open(lab.root / host.name / "ray-start.log", "ab") as log:
        proc = subprocess.Popen(lablib.inside(host, argv), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 10
    while not (pid := int((children.read_text().split() or [0])[0])):
        assert proc.poll() is None and time.monotonic() < deadline, "nsenter started nothing"
        time.sleep(0.01)
    return {"pid": pid, "started": raynode.start_time(pid), "proc": proc}


def test_ray_forms_one_cluster_across_two_hosts(lab):
    h1, h2 = lab.hosts[:2]
    head_at = f"{h1.address}:6379"
    started = []
    try:
        started.append(_ray_start(lab, h1, ["--head", "--port", "6379",
                                            "--include-dashboard=false"]))
        deadline = time.monotonic() + 60
        while not _listening(h1.address, 6379):
            assert started[0]["proc"].poll() is None, _log(lab, h1)
            assert time.monotonic() < deadline, "the Ray head in h1 did not listen within 60 s"
            time.sleep(0.2)
        started.append(_ray_start(lab, h2, [f"--address={head_at}"]))
        driver = run_in(h1, ["python", "-c", _DRIVER, head_at, "2"], timeout=120)
        assert driver.returncode == 0, driver.stderr[-2000:]
        assert json.loads(driver.stdout.strip().splitlines()[-1]) == [h1.address, h2.address], \
            _log(lab, h2)
    finally:
        for s in reversed(started):      # by pid, the node before its head; never `ray stop`
            raynode.stop(s["pid"], s["started"])
            s["proc"].wait(timeout=10)
    # nothing of Ray outlives its `ray start` process: only each host's sshd is left
    for h in (h1, h2):
        assert lablib.pids(h) == [h.sshd_pid], (h.name, commands(lablib.pids(h)))


def _listening(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def _log(lab, host) -> str:
    return (lab.root / host.name / "ray-start.log").read_text(errors="replace")[-2000:]


