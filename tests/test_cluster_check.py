"""`segctl cluster check` without a lab: a Mac's interfaces from its commands'
outputs, the verdict on hand-made reports, a real link test over loopback, and
the command on a cluster of two local nodes (tests/lab/test_fleet_lab.py runs it
over real ssh between hosts)."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest

from segctl.node import link
from segctl.orchestrator.cluster_check import verdict
from tests.conftest import assert_one_line_error, segctl

PORTS = """\
Hardware Port: Ethernet
Device: en0
Ethernet Address: 00:00:00:00:00:01

Hardware Port: Wi-Fi
Device: en1
Ethernet Address: 00:00:00:00:00:02

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: 00:00:00:00:00:03

Hardware Port: Thunderbolt 1
Device: en2
Ethernet Address: 00:00:00:00:00:04
"""


def mac_run(addresses: dict):
    """A Mac's networksetup and ipconfig, with `addresses` {device: address}."""
    def run(cmd, **kw):
        if cmd[:1] == ["networksetup"]:
            return subprocess.CompletedProcess(cmd, 0, PORTS, "")
        if cmd[:2] == ["ipconfig", "getifaddr"] and cmd[2] in addresses:
            return subprocess.CompletedProcess(cmd, 0, addresses[cmd[2]] + "\n", "")
        return subprocess.CompletedProcess(cmd, 1, "", "")
    return run


def test_a_macs_interfaces_and_which_is_fastest():
    # a laptop on Wi-Fi with a Thunderbolt bridge to the next Mac; Ethernet unplugged
    got = link.interfaces(mac_run({"en1": "198.18.1.7", "bridge0": "198.18.2.7"}), "darwin")
    assert [(i["name"], i["kind"], i["addresses"]) for i in got] == [
        ("en1", "wifi", ["198.18.1.7"]), ("bridge0", "thunderbolt", ["198.18.2.7"])]
    assert sorted(got, key=link.speed_key)[0]["name"] == "bridge0"
    assert link.holding("198.18.1.7", got)["kind"] == "wifi"
    assert [link.mac_kind(p) for p in ("Wi-Fi", "USB 10/100/1000 LAN", "iPhone USB")] == [
        "wifi", "ethernet", "other"]


def test_linux_interfaces_read_ip_and_sysfs(tmp_path):
    listing = [{"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1"}]},
               {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "198.18.0.11"}]},
               {"ifname": "wlan0", "addr_info": [{"family": "inet", "local": "198.18.1.11"}]},
               {"ifname": "eth1", "addr_info": []}]
    (tmp_path / "eth0").mkdir()
    (tmp_path / "eth0" / "speed").write_text("10000\n")
    (tmp_path / "wlan0" / "wireless").mkdir(parents=True)

    def run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 0, json.dumps(listing), "")
    got = link.interfaces(run, "linux", tmp_path)
    assert [(i["name"], i["kind"], i["speed_mbps"]) for i in got] == [
        ("eth0", "ethernet", 10000), ("wlan0", "wifi", None)]


def _node(name, **kw):
    facts = {"name": name, "target": name, "reachable": True, "token": "abc",
             "versions": {"segctl": "0.9", "mlx": "0.32.4", "mlx-lm": "0.32.2", "ray": "2.50"}}
    return {**facts, **kw}


def test_the_verdict_names_each_problem_and_who_has_it():
    head = _node("(head)")
    nodes = [_node("m1"), _node("m2", versions=dict(head["versions"], mlx="0.31.0")),
             _node("m3", versions=dict(head["versions"], mlx="0.31.0", ray=None), token=None),
             _node("m4", token="other", cabled={"m1": "rdma_en3", "m2": "rdma_en4"},
                   rdma=["rdma_en2", "rdma_en3"]),
             {"name": "m5", "target": "lab@m5", "reachable": False, "error": "No route to host"}]
    pairs = [{"a": "m1", "b": "m2", "interface": "en1", "kind": "wifi",
              "faster": "bridge0 (thunderbolt)"},
             {"a": "m1", "b": "m3", "error": "Connection refused"},
             {"a": "m2", "b": "m3", "interface": "bridge0", "kind": "thunderbolt", "faster": None}]
    got = verdict(head, nodes, pairs)
    assert got == [
        "m5: not reachable over ssh (lab@m5): No route to host",
        "mlx 0.32.4 on the head, 0.31.0 on m2, m3",
        "ray 2.50 on the head, not installed on m3",
        "m3: no cluster token",
        "m4: a cluster token other than the head's",
        "m4: the cluster file's rdma names rdma_en4, which ibv_devices there does not list "
        "(it lists: rdma_en2, rdma_en3)",
        "m1 -> m2: traffic leaves m1 by en1 (wifi) while bridge0 (thunderbolt) is up: a ring "
        "would run slower than it could (`distributed.interface` picks the network)",
        "m1 -> m3: the link test failed: Connection refused"]
    assert verdict(head, nodes[:1], pairs[2:]) == []
    assert verdict(dict(head, token=None), [], []) == [
        "no cluster token on the head yet: `segctl cluster up` makes one"]


def test_a_link_test_over_loopback():
    ports: list = []
    ready = threading.Event()
    server = threading.Thread(target=link.serve, kwargs=dict(
        timeout=30, ready=lambda p: (ports.append(p), ready.set())))
    server.start()
    assert ready.wait(30)
    got = link.measure("127.0.0.1", ports[0], nbytes=8 << 20, rounds=5)
    server.join(30)
    assert not server.is_alive()
    assert got["bytes"] == 8 << 20 and got["source"] == "127.0.0.1"
    assert got["rtt_ms"] > 0 and got["mb_per_s"] > 0


def test_cluster_check_on_two_local_nodes(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("head:\n  address: 127.0.0.1\n  stores: stores\nnodes:\n"
                       "  - {name: a, local: true, memory_gb: 2}\n"
                       "  - {name: b, local: true, memory_gb: 2}\n")
    proc = segctl("cluster", "check", str(cluster), "--json", "--mb", "4", cwd=tmp_path)
    report = json.loads(proc.stdout)
    # no fleet was ever up: no token on the head, none on the nodes (one line each)
    assert proc.returncode == 1
    assert report["problems"] == [
        "no cluster token on the head yet: `segctl cluster up` makes one"]
    assert [n["name"] for n in report["nodes"]] == ["a", "b"]
    assert all(n["reachable"] and n["versions"] == report["head"]["versions"]
               for n in report["nodes"])
    (pair,) = report["pairs"]
    assert (pair["a"], pair["b"], pair["address"], pair["interface"]) == ("a", "b", "127.0.0.1",
                                                                          "lo")
    assert pair["bytes"] == 4 << 20 and pair["mb_per_s"] > 0 and pair["rtt_ms"] > 0
    # the tables, and the problem on stderr
    proc = segctl("cluster", "check", str(cluster), "--mb", "1", cwd=tmp_path)
    assert proc.returncode == 1 and "a -> b" in proc.stdout and "(head)" in proc.stdout
    assert proc.stderr.strip() == ("segctl: problem: no cluster token on the head yet: "
                                   "`segctl cluster up` makes one")


def test_bad_input_is_one_line(tmp_path):
    proc = segctl("node", "link-test", "--to", "nowhere")
    assert_one_line_error(proc, "--to 'nowhere': expected HOST:PORT")
    proc = segctl("cluster", "check", cwd=tmp_path, env={"SEGCTL_CLUSTER": None})
    assert_one_line_error(proc, "cluster check needs a cluster file")
    (tmp_path / "c.yaml").write_text("nodes:\n  - {name: a, memory_gb: 2}\n")
    proc = segctl("cluster", "check", "c.yaml", cwd=tmp_path)
    assert_one_line_error(proc, "c.yaml")


def test_a_ring_rank_listens_on_the_named_interface_or_the_fleet_address():
    from segctl.node.link import ring_endpoint
    ifaces = [{"name": "lo0x", "kind": "ethernet", "addresses": ["127.0.0.1"], "speed_mbps": None}]
    host, port = ring_endpoint("lo0x", "198.18.0.99", ifaces).rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert ring_endpoint(None, "127.0.0.1", ifaces).startswith("127.0.0.1:")
    with pytest.raises(ValueError, match=r"distributed.interface: en9: .* no such interface "
                                         r"with an IPv4 address \(it has: lo0x\)"):
        ring_endpoint("en9", "127.0.0.1", ifaces)


# What `ibv_devices` prints on a Mac with RDMA over Thunderbolt 5 enabled (two cables).
IBV_DEVICES = """    device                 node GUID
    ------              ----------------
    rdma_en2            0000000000000000
    rdma_en3            0000000000000000
"""


def test_a_jaccl_rank_checks_its_rdma_devices_where_it_runs():
    """The Mac path: `ibv_devices` lists the RDMA devices (none where the tool or
    RDMA is missing); a rank whose cluster file names a device the node lacks is
    refused in one line naming what it has."""
    from segctl.node.link import rdma_devices, ring_endpoint

    def run(stdout="", code=0, missing=False):
        def call(argv, **kw):
            assert argv == ["ibv_devices"]
            if missing:
                raise FileNotFoundError("ibv_devices")
            return subprocess.CompletedProcess(argv, code, stdout, "")
        return call

    assert rdma_devices(run(IBV_DEVICES)) == ["rdma_en2", "rdma_en3"]
    assert rdma_devices(run(missing=True)) == [] == rdma_devices(run("", code=1))
    assert ring_endpoint(None, "127.0.0.1", rdma=["rdma_en3"], run=run(IBV_DEVICES)).startswith(
        "127.0.0.1:")
    with pytest.raises(ValueError, match=r"jaccl: .* has no RDMA device rdma_en5 \(ibv_devices "
                                         r"lists: rdma_en2, rdma_en3\)"):
        ring_endpoint(None, "127.0.0.1", rdma=["rdma_en2", "rdma_en5"], run=run(IBV_DEVICES))
    with pytest.raises(ValueError, match=r"lists: none: RDMA needs macOS 26.2\+ and rdma_ctl enable"):
        ring_endpoint(None, "127.0.0.1", rdma=["rdma_en2"], run=run(missing=True))
