"""The fleet on real Ray processes on this machine: a head and three `local: true`
nodes of different budgets, plus one "remote" node reached through an `ssh`
stand-in that runs the remote command here, under its own SEGCTL_HOME, through
the real `segctl node start --join ... --token-stdin` / `segctl node stop`.

Token auth is on throughout. Every Ray process started here is checked gone by
pid at the end."""

from __future__ import annotations

import json
import os
import random
import shlex
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

from segctl.node import raynode
from segctl.node.hardware import Hardware, chip_name, default_name, probe, ray_env
from segctl.orchestrator import fleet
from segctl.schemas.cluster import ClusterSpec, HeadSpec, NodeSpec
from tests.conftest import cli_env

pytestmark = pytest.mark.fleet

LOCAL = {"small": 0.5, "mid": 2.0, "big": 8.0}      # name -> budget GB
REMOTE = "mac9"


# ------------------------------------------------------------------ probe

def test_probe_this_machine():
    hw = probe()
    assert hw.os == "linux" and hw.memory_gb > 0.5 and hw.cores >= 1 and hw.chip
    env = ray_env("/x/auth_token", hw)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == "/x/auth_token"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env


def mac_run(answers: dict):
    """What `sysctl -n KEY` / `ipconfig getifaddr IF` print on a Mac; a missing
    answer is a failing command, as on a Mac with that interface down."""
    def run(cmd, **kw):
        key = cmd[-1]
        if key not in answers:
            if kw.get("check"):
                raise subprocess.CalledProcessError(1, cmd)
            return subprocess.CompletedProcess(cmd, 1, "", "")
        return subprocess.CompletedProcess(cmd, 0, answers[key] + "\n", "")
    return run


def test_probe_macos():
    answers = {"hw.memsize": str(32 * 2**30), "machdep.cpu.brand_string": "Apple M2 Max",
               "hw.ncpu": "12", "en0": "10.0.0.7"}
    hw = probe(run=mac_run(answers), platform="darwin")
    assert hw == Hardware(chip="m2-max", memory_gb=32.0, os="macos", cores=12, ip="10.0.0.7")
    assert ray_env("/t", hw)["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    # a Mac Studio on Wi-Fi only: en0 (Ethernet) is down, en1 has the address
    answers.update({"en1": "10.0.0.8", "hw.memsize": str(192 * 2**30),
                    "machdep.cpu.brand_string": "Apple M2 Ultra"})
    del answers["en0"]
    hw = probe(run=mac_run(answers), platform="darwin")
    assert (hw.chip, hw.memory_gb, hw.ip) == ("m2-ultra", 192.0, "10.0.0.8")
    assert chip_name("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz") == "intel-xeon-platinum-8480"


def test_ssh_start_command_carries_the_node():
    node = NodeSpec(name="mac9", host="lab@mac9.local", chip="m2-ultra", memory_gb=96,
                    labels={"rack": "b2"})
    cmd = fleet.ssh_start_command(node, "10.0.0.2:6379")
    assert cmd[:1] == ["ssh"] and "BatchMode=yes" in cmd and cmd[-2] == "lab@mac9.local"
    assert shlex.split(cmd[-1]) == [
        "segctl", "node", "start", "--join", "10.0.0.2:6379", "--name", "mac9",
        "--memory-gb", "96", "--max-trials", "2", "--token-stdin", "--chip", "m2-ultra",
        "--label", "rack=b2"]
    # the chip of a node the file does not describe is left to that Mac's probe
    plain = fleet.ssh_start_command(NodeSpec(name="air", host="air", memory_gb=16), "h:1")
    assert "--chip" not in shlex.split(plain[-1])
    assert fleet.ssh_stop_command("lab@mac9.local")[-2:] == ["lab@mac9.local", "segctl node stop"]


def test_hostile_cluster_values_reach_ssh_and_the_remote_shell_as_data(tmp_path):
    """A host, name, chip or label that is shell syntax or an ssh option never acts
    as one: the schema refuses such values already, and even one that got past it
    (model_construct skips validation) is the destination after `--` and one
    quoted argument of the remote command line."""
    marker = tmp_path / "pwned"
    touch = f"touch {marker}"
    node = NodeSpec.model_construct(
        name=f"n;{touch}", host=f"-oProxyCommand={touch}", local=False, chip=f"`{touch}`",
        memory_gb=1.0, labels={"k": f"v' ; {touch} ; '", f"$({touch})": "x"})
    start, stop = fleet.ssh_start_command(node, "10.0.0.2:6379"), fleet.ssh_stop_command(node.host)
    for cmd in (start, stop):
        # ssh's own options, then `--`, then the host: ssh reads nothing after `--` as one
        assert cmd[:len(fleet.SSH_OPTIONS) + 3] == ["ssh", *fleet.SSH_OPTIONS, "--", node.host]
        assert len(cmd) == len(fleet.SSH_OPTIONS) + 4
    # The remote side: sshd hands the command line to the user's shell (`sh -c LINE`);
    # a stand-in segctl prints the arguments it got.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "segctl").write_text(
        f"#!/bin/sh\nexec {sys.executable} -c "
        "'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    (bin_dir / "segctl").chmod(0o755)
    got = subprocess.run(["sh", "-c", start[-1]], capture_output=True, text=True,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert got.returncode == 0, got.stderr
    argv = json.loads(got.stdout)
    assert argv[argv.index("--name") + 1] == node.name
    assert argv[argv.index("--chip") + 1] == node.chip
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--label"] == [
        f"{k}={v}" for k, v in node.labels.items()]
    # and the real ssh client takes the host as a (bad) host name, not an option
    for cmd in (start, stop):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
        assert out.returncode != 0
    assert not marker.exists()


def test_a_linux_node_advertises_its_address_toward_the_head():
    assert raynode.route_ip("127.0.0.1:6379") == "127.0.0.1"
    assert raynode.route_ip("not a host:1") is None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:   # this machine's address
        try:                                                      # toward a LAN head, if any
            s.connect(("192.0.2.1", 9))
            mine = s.getsockname()[0]
        except OSError:
            mine = None
    assert raynode.route_ip("192.0.2.1:6379") == mine
    linux = Hardware(chip="x", memory_gb=8.0, os="linux", cores=2, ip=None)
    cmd = raynode.start_command(["--address=10.0.0.2:6379"], {}, {}, linux, node_ip="10.0.0.9")
    assert cmd[cmd.index("--node-ip-address") + 1] == "10.0.0.9"
    assert raynode._node_ip(linux, "10.0.0.9") == "10.0.0.9"
    mac = Hardware(chip="m2", memory_gb=8.0, os="macos", cores=8, ip="10.0.0.7")
    assert raynode._node_ip(mac, "10.0.0.9") == "10.0.0.7"      # a Mac: its en0/en1 address


def test_listening_ports_from_proc_and_from_lsof():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        mine = raynode.listening([os.getpid()])
    assert {"process": Path(f"/proc/{os.getpid()}/comm").read_text().strip(), "pid": os.getpid(),
            "address": "127.0.0.1", "port": port} in mine
    assert raynode._proc_address("00000000") == "*"
    assert raynode._proc_address("0B0012C6") == "198.18.0.11"
    assert raynode._proc_address("00000000000000000000000000000000") == "*"
    # what `lsof -F pcn` prints on a Mac
    lsof = "p501\ncgcs_server\nf12\nn*:6379\np502\ncraylet\nf30\nn10.0.0.7:41000\nf31\nn[::1]:41001\n"
    assert raynode.listening([501, 502], platform="darwin",
                             run=lambda *a, **k: subprocess.CompletedProcess(a, 0, lsof, "")) == [
        {"process": "gcs_server", "pid": 501, "address": "*", "port": 6379},
        {"process": "raylet", "pid": 502, "address": "10.0.0.7", "port": 41000},
        {"process": "raylet", "pid": 502, "address": "::1", "port": 41001}]


# ------------------------------------------------------------------ a real fleet

def free_port() -> int:
    for port in random.sample(range(6400, 6500), 100):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 6400-6499")


def here_ssh(remote_home: Path):
    """Stands in for `ssh HOST CMD`: runs CMD's segctl on this machine as if it were
    the remote Mac (its own SEGCTL_HOME), stdin passed through."""
    def ssh(cmd, *, input="", capture_output=True, text=True, timeout=None):
        ssh.calls.append((cmd, input))
        argv = shlex.split(cmd[-1])
        assert cmd[0] == "ssh" and argv[0] == "segctl"
        return subprocess.run([sys.executable, "-m", "segctl.orchestrator.cli", *argv[1:]],
                              input=input, capture_output=True, text=True, timeout=timeout,
                              env=dict(cli_env(), SEGCTL_HOME=str(remote_home)))
    ssh.calls = []
    return ssh


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    remote_home = tmp_path_factory.mktemp("mac9-home")
    spec = ClusterSpec(
        head=HeadSpec(port=free_port(), stores=str(root)),
        nodes=[NodeSpec(name=n, local=True, memory_gb=gb, chip=f"chip-{n}",
                        labels={"tier": n}) for n, gb in LOCAL.items()]
        + [NodeSpec(name=REMOTE, host="lab@mac9.local", memory_gb=96, chip="m2-ultra",
                    labels={"rack": "b2"})])
    ssh = here_ssh(remote_home)
    pids: set[int] = set()

    def remember():
        rec = json.loads((root / "fleet.json").read_text())
        here = json.loads((remote_home / "here.json").read_text())
        mine = [rec["head"]["pid"]] + [n["pid"] for n in rec["nodes"].values()]
        for pid in mine + [e["pid"] for e in here]:
            pids.add(pid)
            pids.update(raynode._group(pid))   # its raylet, agents, workers

    t = time.monotonic()
    try:
        info = fleet.up(spec, ssh=ssh)
        remember()
        fleet.connect(spec, start=False)
        yield dict(spec=spec, root=root, remote_home=remote_home, ssh=ssh, info=info,
                   remember=remember, pids=pids, started_s=time.monotonic() - t)
    finally:
        ray.shutdown()
        if (root / "fleet.json").exists():
            remember()
            fleet.down(spec, ssh=ssh)
        for pid in pids:        # whatever a failed test left behind
            raynode.stop(pid, timeout=5)


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


def test_up_starts_every_node_with_its_labels(lab):
    got = {n.name: n for n in fleet.nodes()}
    assert sorted(got) == sorted([*LOCAL, REMOTE])
    for name, gb in LOCAL.items():
        n = got[name]
        assert (n.memory_gb, n.chip, n.os, n.labels) == (gb, f"chip-{name}", "linux", {"tier": name})
    assert (got[REMOTE].memory_gb, got[REMOTE].chip, got[REMOTE].labels) == (96, "m2-ultra",
                                                                             {"rack": "b2"})
    # the remote node got the token on stdin, owner-readable only, never on a command line
    token = (lab["root"] / "auth_token").read_text().strip()
    (cmd, stdin), = lab["ssh"].calls
    assert stdin == token and token not in " ".join(cmd)
    remote_token = lab["remote_home"] / "auth_token"
    assert remote_token.read_text().strip() == token
    assert (lab["root"] / "auth_token").stat().st_mode & 0o777 == 0o600
    assert remote_token.stat().st_mode & 0o777 == 0o600
    # the head holds segctl_head and trains nothing
    heads = [n for n in ray.nodes() if n["Alive"] and "segctl_head" in n["Resources"]]
    assert len(heads) == 1
    assert not any(r.startswith("segctl_node:") for r in heads[0]["Resources"])


DRIVER = textwrap.dedent("""
    import sys, ray
    try:
        ray.init(address=sys.argv[1], log_to_driver=False)
        print("CONNECTED", len(ray.nodes()))
    except Exception as e:
        print("REFUSED", type(e).__name__)
""")


@pytest.mark.parametrize("auth", ["none", "wrong-token", "the-token"])
def test_only_a_driver_with_the_token_connects(lab, tmp_path, auth):
    env = {k: v for k, v in cli_env().items() if not k.startswith("RAY_AUTH")}
    env["RAY_NUM_REDIS_GET_RETRIES"] = "3"   # Ray retries a refused connect for 20 s
    if auth == "wrong-token":
        (tmp_path / "tok").write_text("0" * 64)
        env.update(ray_env(str(tmp_path / "tok")))
    if auth == "the-token":
        env.update(ray_env(lab["info"]["token_path"]))
    out = subprocess.run([sys.executable, "-c", DRIVER, lab["info"]["address"]], env=env,
                         capture_output=True, text=True, timeout=120)
    said = out.stdout + out.stderr[-2000:]
    if auth == "the-token":
        assert "CONNECTED 5" in out.stdout, said
    else:
        assert "REFUSED" in out.stdout and "InvalidAuthToken" in out.stderr, said


def test_actor_pinned_by_node_resource_runs_there(lab):
    @ray.remote
    class Where:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    ids = {r.removeprefix("segctl_node:"): n["NodeID"] for n in ray.nodes() if n["Alive"]
           for r in n["Resources"] if r.startswith("segctl_node:")}
    for name in ("small", REMOTE):
        actor = Where.options(resources={f"segctl_node:{name}": 0.01}, num_cpus=0).remote()
        assert ray.get(actor.node.remote(), timeout=120) == ids[name]
        lab["remember"]()   # the actor's worker joins its node's process group
        ray.kill(actor)


def test_up_again_leaves_a_running_fleet_alone(lab):
    before = json.loads((lab["root"] / "fleet.json").read_text())
    calls = len(lab["ssh"].calls)
    assert fleet.up(lab["spec"], ssh=lab["ssh"]) == before
    assert json.loads((lab["root"] / "fleet.json").read_text()) == before
    assert len(lab["ssh"].calls) == calls


def test_stopping_one_node_leaves_the_others(lab):
    pid = json.loads((lab["root"] / "fleet.json").read_text())["nodes"]["small"]["pid"]
    group = raynode._group(pid)
    raynode.stop(pid)
    assert not any(alive(p) for p in [pid, *group])
    assert wait_for(lambda: "small" not in {n.name for n in fleet.nodes()})
    assert {n.name for n in fleet.nodes()} == {"mid", "big", REMOTE}
    # `up` brings back the one that is missing and touches nothing else
    before = json.loads((lab["root"] / "fleet.json").read_text())
    after = fleet.up(lab["spec"], ssh=lab["ssh"])
    assert after["nodes"]["small"]["pid"] != pid
    assert {k: v for k, v in after["nodes"].items() if k != "small"} == \
           {k: v for k, v in before["nodes"].items() if k != "small"}
    lab["remember"]()
    assert wait_for(lambda: {n.name for n in fleet.nodes()} == {*LOCAL, REMOTE})


def test_down_leaves_no_process_behind(lab):
    lab["remember"]()
    ray.shutdown()
    fleet.down(lab["spec"], ssh=lab["ssh"])
    assert not (lab["root"] / "fleet.json").exists()
    assert not (lab["remote_home"] / "here.json").exists()
    assert lab["ssh"].calls[-1][0][-1] == "segctl node stop"
    assert wait_for(lambda: not [p for p in lab["pids"] if alive(p)], timeout=10), \
        [p for p in lab["pids"] if alive(p)]
    with pytest.raises(ConnectionError, match="segctl cluster up"):
        fleet.connect(lab["spec"], start=False)


EMBEDDED = textwrap.dedent("""
    import json, os
    from segctl.orchestrator import fleet
    from segctl.node import raynode
    try:
        info = fleet.connect(None)           # nothing running: brings the embedded fleet up
        again = fleet.connect(None)          # running: just connects
        rec = json.load(open(os.path.join(os.environ["SEGCTL_HOME"], "fleet.json")))
        group = raynode._group(rec["head"]["pid"])
        print(json.dumps({"nodes": [n.model_dump() for n in fleet.nodes()], "same": info == again,
                          "pids": [rec["head"]["pid"], *group]}))
    finally:
        import ray; ray.shutdown()
        fleet.down(None)
""")


def test_embedded_default_is_this_machine_alone(tmp_path):
    out = subprocess.run([sys.executable, "-c", EMBEDDED], capture_output=True, text=True,
                         env=dict(cli_env(), SEGCTL_HOME=str(tmp_path)), timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    (node,) = got["nodes"]
    hw = probe()
    assert node["name"] == default_name()
    assert (node["memory_gb"], node["chip"], node["os"]) == (hw.memory_gb, hw.chip, "linux")
    assert got["same"]
    assert not (tmp_path / "fleet.json").exists()
    assert wait_for(lambda: not [p for p in got["pids"] if alive(p)], timeout=10)


def test_ray_start_command_on_a_mac():
    mac = Hardware(chip="m2-max", memory_gb=32.0, os="macos", cores=12, ip="10.0.0.7")
    labels = raynode.node_labels("studio", mac.chip, 24, mac.os, {"rack": "b2"})
    cmd = raynode.start_command(["--address=10.0.0.2:6379"], {"segctl_node:studio": 1}, labels, mac)
    assert cmd[cmd.index("--node-ip-address") + 1] == "10.0.0.7" and "--block" in cmd
    assert cmd[cmd.index("--labels") + 1] == ("segctl.name=studio,segctl.chip=m2-max,"
                                              "segctl.memory_gb=24,segctl.os=macos,"
                                              "segctl.max_trials=1,rack=b2")
    linux = Hardware(chip="x", memory_gb=8.0, os="linux", cores=2, ip=None)
    assert "--node-ip-address" not in raynode.start_command(["--head"], {}, {}, linux)
    with pytest.raises(RuntimeError, match="LAN address"):
        raynode.start_command(["--head"], {}, {}, Hardware("m1", 8.0, "macos", 8, None))
    with pytest.raises(ValueError, match="label"):
        raynode.node_labels("studio", "m1", 8, "macos", {"rack": "b 2"})
