"""The product on the lab: a fleet of hosts with real addresses, private disks
and real ssh, driven from inside host h1 the way a user drives a lab of Macs.

    h1  the head (trains nothing): `segctl init-demo`, the cluster file, the
        stores; every command below runs here, over ssh
    h2  node, by name        (host: h2)
    h3  node, by address     (host: 198.18.0.13)
    h4  node, by user@name   (host: root@h4)
    h5  outside the fleet: no token, not in cluster.yaml

The tests run in file order on one fleet: up, tune, a sweep over three hosts,
gather, then what an outsider cannot do, the ports and the token, and last
`cluster down`. The final test puts a head on a machine of several addresses
(this machine's root namespace: its own network and the lab's bridge), the
case where Ray left to itself advertises an address the nodes cannot reach."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import socket
import stat
import time
from pathlib import Path

import pytest

from segctl import lab as lablib
from segctl.schemas.states import SweepState, TrialState
from tests.conftest import segctl

from .conftest import commands, ssh, where_readable

pytestmark = pytest.mark.fleet   # a lab of hosts

LAB_HOSTS = 5
NODES = {"h2": "h2", "h3": "198.18.0.13", "h4": "root@h4"}   # name -> ssh target
HEAD_PORT = 6379
CLUSTER = f"""\
head:
  address: 198.18.0.11
  port: {HEAD_PORT}
  stores: ~/stores
nodes:
""" + "".join(f"  - name: {n}\n    host: {h}\n    memory_gb: 2\n" for n, h in NODES.items())
MODEL_CACHE = "tmp/segctl-work-0/models"    # under a host's folder: its /tmp/segctl-work-<uid>
# Refused connections fail after 3 tries instead of Ray's default 20-odd seconds.
FAST_REFUSAL = "RAY_NUM_REDIS_GET_RETRIES=3"
WRONG_TOKEN = "0" * 64


def run(lab, host: str, command: str, timeout: float = 300, ok: bool = True):
    proc = ssh(lab, host, command, timeout=timeout)
    if ok:
        assert proc.returncode == 0, (host, command, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def host_dir(lab, name: str) -> Path:
    """Host `name`'s folder on this machine's disk: home/ is its /root, tmp/ its /tmp."""
    return lab.host(name).home.parent


@pytest.fixture(scope="module")
def fleet(lab):
    """The demo in h1 only, a cluster file naming h2..h4, and the fleet up from h1
    over real ssh. Every --json output of the run is kept (the token must be in
    none of them)."""
    made = {"lab": lab, "json": [], "caches_before": {}}
    run(lab, "h1", "segctl init-demo demo >/dev/null && "
                   # tiny runs: 6 steps a trial
                   "sed -i 's/train.iters: \\[150\\]/train.iters: [6]/' demo/sweep.yaml && "
                   f"printf %s {shlex.quote(CLUSTER)} > cluster.yaml")
    made["caches_before"] = {n: (host_dir(lab, n) / MODEL_CACHE).exists() for n in NODES}
    made["up"] = run(lab, "h1", "segctl cluster up cluster.yaml --json", timeout=240)
    made["json"].append(made["up"].stdout)
    made["info"] = json.loads(made["up"].stdout)
    yield made
    if (host_dir(lab, "h1") / "home/stores/fleet.json").exists():   # a test failed before down
        ssh(lab, "h1", "segctl cluster down cluster.yaml", timeout=120)


def cluster_status(fleet) -> dict:
    proc = run(fleet["lab"], "h1", "segctl cluster status cluster.yaml --json", timeout=120)
    fleet["json"].append(proc.stdout)
    return {n["name"]: n for n in json.loads(proc.stdout)}


# ------------------------------------------------------------------ the product

def test_cluster_up_from_h1_joins_every_node_over_ssh(fleet):
    lab, info = fleet["lab"], fleet["info"]
    assert info["address"] == f"198.18.0.11:{HEAD_PORT}" and info["join"] == info["address"]
    assert {n: r["host"] for n, r in info["nodes"].items()} == NODES
    # each node's `ray start` runs in its own host, started there by `segctl node start`
    # (its pid as the host numbers it: each host has a process table of its own)
    for name, rec in info["nodes"].items():
        assert rec["pid"] in _host_pids(lab, name), name
        here = json.loads((host_dir(lab, name) / "home/.segctl/here.json").read_text())
        assert [(e["role"], e["name"], e["pid"]) for e in here] == [("node", name, rec["pid"])]
    assert info["head"]["pid"] in _host_pids(lab, "h1")
    nodes = cluster_status(fleet)
    assert set(nodes) == {"(head)", *NODES}
    assert nodes["(head)"]["head"] and not nodes["(head)"]["trains"]
    # every Ray node advertises its host's own address: the one the others reach
    assert {n: d["address"] for n, d in nodes.items()} == {
        "(head)": "198.18.0.11", "h2": "198.18.0.12", "h3": "198.18.0.13", "h4": "198.18.0.14"}
    assert all(d["alive"] and d["trial"] is None for d in nodes.values())


def test_cluster_check_from_h1_over_ssh(fleet):
    """Every node reachable, on the head's versions and token, and each pair's
    link timed over the address a ring of theirs would use; then an outsider
    (h5: no token) and a host that is not there, each named."""
    lab = fleet["lab"]
    proc = run(lab, "h1", "segctl cluster check cluster.yaml --json --mb 8", timeout=240)
    fleet["json"].append(proc.stdout)
    report = json.loads(proc.stdout)
    assert report["problems"] == []
    assert {n["name"]: (n["reachable"], n["address"]) for n in report["nodes"]} == {
        "h2": (True, "198.18.0.12"), "h3": (True, "198.18.0.13"), "h4": (True, "198.18.0.14")}
    assert all(n["token"] == report["head"]["token"] is not None and
               n["versions"] == report["head"]["versions"] for n in report["nodes"])
    assert [(p["a"], p["b"], p["interface"], p["kind"]) for p in report["pairs"]] == [
        ("h2", "h3", "eth0", "ethernet"), ("h2", "h4", "eth0", "ethernet"),
        ("h3", "h4", "eth0", "ethernet")]
    assert all(p["bytes"] == 8 << 20 and p["mb_per_s"] > 0 and p["rtt_ms"] > 0 and
               not p["faster"] for p in report["pairs"])
    wider = CLUSTER + ("  - name: h5\n    host: h5\n    memory_gb: 2\n"
                       "  - name: ghost\n    host: 198.18.0.99\n    memory_gb: 2\n")
    proc = run(lab, "h1", f"printf %s {shlex.quote(wider)} > wider.yaml && "
                          "segctl cluster check wider.yaml --mb 1", timeout=240, ok=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("segctl: problem: ")]
    assert len(problems) == 2, proc.stderr
    assert problems[0].startswith("segctl: problem: ghost: not reachable over ssh (198.18.0.99): ")
    assert problems[1] == "segctl: problem: h5: no cluster token"
    assert "h4 -> h5" in proc.stdout


def test_a_sweep_spreads_over_three_hosts_that_fetch_the_model_from_the_head(fleet):
    lab = fleet["lab"]
    assert fleet["caches_before"] == {n: False for n in NODES}
    for n in NODES:     # nothing fetched yet: up moves no model
        assert not (host_dir(lab, n) / MODEL_CACHE).exists(), n
    tune = run(lab, "h1", "segctl tune --model demo/model --seq-lens 64,128 --segment-sizes 1,2 "
                          "--steps 2 --cluster cluster.yaml --json", timeout=300)
    fleet["json"].append(tune.stdout)
    assert not json.loads(tune.stdout)["failed"], tune.stdout[-2000:]

    sub = run(lab, "h1", "segctl submit demo/sweep.yaml --cluster cluster.yaml --json",
              timeout=300)
    fleet["json"].append(sub.stdout)
    status = run(lab, "h1", "segctl status --cluster cluster.yaml --json")
    fleet["json"].append(status.stdout)
    [sweep] = json.loads(status.stdout)
    assert sweep["state"] == SweepState.DONE and len(sweep["trials"]) == 4
    assert all(t["state"] == TrialState.SUCCEEDED for t in sweep["trials"]), sweep
    ran_on = {a["node"] for t in sweep["trials"] for a in t["attempts"]}
    assert len(ran_on) >= 3 and ran_on <= set(NODES), ran_on
    fleet["sweep"] = sweep["sweep"]

    # the model reached each host that ran something through the head's chunked
    # fetch: the same bytes as h1's copy, in that host's private /tmp only
    model = host_dir(lab, "h1") / "home/demo/model"
    want = {p.name: _sha256(p) for p in model.iterdir() if p.is_file()}
    for n in ran_on:
        [cached] = list((host_dir(lab, n) / MODEL_CACHE).iterdir())
        assert {p.name: _sha256(p) for p in cached.iterdir()} == want, n
    assert not (host_dir(lab, "h1") / MODEL_CACHE).exists()   # h1 has it: fetched by no one
    assert not (host_dir(lab, "h5") / MODEL_CACHE).exists()


def test_stores_are_on_the_head_only_and_nodes_keep_no_adapter(fleet):
    lab = fleet["lab"]
    stores = host_dir(lab, "h1") / "home/stores"
    for part in ("state.db", "telemetry/steps", "adapters.zarr", "memory.zarr", "logs/head.log"):
        assert (stores / part).exists(), part
    for n in (*NODES, "h5"):
        names = {p.name for p in _files(host_dir(lab, n))}
        assert not names & {"state.db", "staging.db", "adapters.zarr", "zarr.json",
                            "adapters.safetensors", "adapter_config.json"}, (n, sorted(names))
        assert not (host_dir(lab, n) / "home/stores").exists()
    for n in NODES:   # a succeeded attempt's folder goes with it (the node's data cache stays)
        work = host_dir(lab, n) / f"tmp/segctl-work-0/{n}"
        left = [p for p in work.iterdir() if p.name != "data-cache"] if work.exists() else []
        assert not left, (n, left)


def test_gather_on_h1_gives_folders_mlx_lm_loads(fleet):
    lab = fleet["lab"]
    run(lab, "h1", f"segctl gather {fleet['sweep']} --out gathered --cluster cluster.yaml")
    manifest = json.loads((host_dir(lab, "h1") / "home/gathered/manifest.json").read_text())
    trials = [m["trial"] for m in manifest]
    assert len(trials) == 4
    load = run(lab, "h1", "python -c " + shlex.quote(
        "import sys, mlx_lm\n"
        "for path in sys.argv[1:]:\n"
        "    model, tok = mlx_lm.load('demo/model', adapter_path=path)\n"
        "print('LOADED', len(sys.argv) - 1)") + " " +
        " ".join(f"gathered/{t}" for t in trials))
    assert f"LOADED {len(trials)}" in load.stdout


# ------------------------------------------------------------------ an outsider (h5)

def test_an_outsider_cannot_join(fleet):
    lab = fleet["lab"]
    no_token = run(lab, "h5", "segctl node start --join 198.18.0.11:6379 --name evil "
                              "--memory-gb 1", ok=False)
    assert no_token.returncode != 0 and "no cluster token" in no_token.stderr
    wrong = run(lab, "h5", f"echo {WRONG_TOKEN} | segctl node start --join 198.18.0.11:6379 "
                           "--name evil --memory-gb 1 --token-stdin", ok=False)
    assert wrong.returncode != 0 and "refused this machine's token" in wrong.stderr, wrong
    # Ray's own `ray start`, without segctl and without the token
    raw = run(lab, "h5", f"{FAST_REFUSAL} ray start --address=198.18.0.11:6379 --num-cpus 1 "
                         "--disable-usage-stats --node-ip-address 198.18.0.15 "
                         "--resources '{\"segctl_node:evil\": 1}'", ok=False, timeout=120)
    assert "InvalidAuthToken" in raw.stdout + raw.stderr, (raw.stdout[-2000:], raw.stderr[-2000:])
    h5 = lab.host("h5")
    # nothing of Ray runs there (once the ssh sessions have closed)
    assert _wait(lambda: lablib.pids(h5) == [h5.sshd_pid]), commands(lablib.pids(h5))
    assert set(cluster_status(fleet)) == {"(head)", *NODES}


def _forge_fleet_record(lab) -> None:
    """In h5: the cluster file, and a fleet.json as the head's would read, naming
    the head's address and a live local process as "the head" (so segctl goes as
    far as Ray), with a token of its own: all an outsider can know. The live
    process is h5's sshd: pid 1 in h5."""
    h5 = lab.host("h5")
    record = {"address": f"198.18.0.11:{HEAD_PORT}", "port": HEAD_PORT,
              "token_path": "/root/stores/auth_token", "join": f"198.18.0.11:{HEAD_PORT}",
              "head": {"pid": 1, "started": h5.sshd_started, "node": None}, "nodes": {}}
    run(lab, "h5", f"printf %s {shlex.quote(CLUSTER)} > cluster.yaml && "
                   "segctl init-demo demo >/dev/null && mkdir -m 700 -p stores && "
                   f"(umask 077; echo {WRONG_TOKEN} > stores/auth_token; "
                   f"printf %s {shlex.quote(json.dumps(record))} > stores/fleet.json)")


def test_an_outsider_cannot_submit_cancel_or_read(fleet):
    lab = fleet["lab"]
    _forge_fleet_record(lab)
    for command in ("submit demo/sweep.yaml --cluster cluster.yaml",
                    f"cancel {fleet['sweep']} --cluster cluster.yaml",
                    "cluster status cluster.yaml --json"):
        out = run(lab, "h5", f"{FAST_REFUSAL} segctl {command}", ok=False, timeout=120)
        assert out.returncode != 0 and "cannot reach the fleet's head" in out.stderr, (command, out)
        assert "InvalidAuthToken" in out.stderr and out.stdout == "", (command, out)
    # status, logs and gather read the stores, which live on h1 alone
    for command in ("status --cluster cluster.yaml --json",
                    f"logs {fleet['sweep']}-t000 --cluster cluster.yaml",
                    f"gather {fleet['sweep']} --out got --cluster cluster.yaml"):
        out = run(lab, "h5", f"segctl {command}", ok=False)
        assert out.returncode != 0 and "no sweeps recorded here" in out.stderr, (command, out)
        assert fleet["sweep"] not in out.stdout
    # and the head saw nothing: still the one sweep, nothing cancelled
    [sweep] = json.loads(run(lab, "h1", "segctl status --cluster cluster.yaml --json").stdout)
    assert sweep["sweep"] == fleet["sweep"] and sweep["state"] == SweepState.DONE


DRIVER = """
import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
    print("CONNECTED", len(ray.nodes()))
except Exception as e:
    print("REFUSED", type(e).__name__)
"""

NODE_TABLE = """
import json, sys
from segctl.node.raynode import gcs_nodes
from segctl.node.hardware import ray_env
try:
    nodes = gcs_nodes(sys.argv[1], ray_env(sys.argv[2]))
    print(json.dumps(sorted(n["ip"] for n in nodes if n["alive"])))
except PermissionError as e:
    print("REFUSED", e)
"""


def test_an_outsider_driver_is_refused_by_the_heads_ray(fleet):
    lab = fleet["lab"]
    tmp5 = host_dir(lab, "h5") / "tmp"
    (tmp5 / "wrong_token").write_text(WRONG_TOKEN + "\n")
    for auth in ("", "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/tmp/wrong_token"):
        out = run(lab, "h5", f"{auth} {FAST_REFUSAL} python -c {shlex.quote(DRIVER)} "
                             f"198.18.0.11:{HEAD_PORT}", ok=False, timeout=120)
        assert "REFUSED" in out.stdout and "InvalidAuthToken" in out.stderr, (auth, out)
    # the node table straight from the GCS: refused with a wrong token...
    out = run(lab, "h5", f"python -c {shlex.quote(NODE_TABLE)} 198.18.0.11:{HEAD_PORT} "
                         "/tmp/wrong_token")
    assert out.stdout.startswith("REFUSED"), out
    # the runtime-env agent's HTTP API of every node wants it too
    for name, entry in cluster_status(fleet).items():
        [agent] = [p["port"] for p in entry["listening"] if p["process"].startswith("ray::Runtime")]
        out = run(lab, "h5", "python -c " + shlex.quote(
            "import sys, urllib.request, urllib.error\n"
            "try:\n"
            "    urllib.request.urlopen(sys.argv[1], data=b'{}', timeout=10)\n"
            "    print('ANSWERED')\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code)") +
            f" http://{entry['address']}:{agent}/get_or_create_runtime_env")
        assert out.stdout.strip() == "401", (name, out)
    # ... and read with the real one: the network lets h5 through, the token is the gate
    token = host_dir(lab, "h1") / "home/stores/auth_token"
    (tmp5 / "right_token").write_bytes(token.read_bytes())
    try:
        out = run(lab, "h5", f"python -c {shlex.quote(NODE_TABLE)} 198.18.0.11:{HEAD_PORT} "
                             "/tmp/right_token")
    finally:
        (tmp5 / "right_token").unlink()
    assert json.loads(out.stdout) == ["198.18.0.11", "198.18.0.12", "198.18.0.13", "198.18.0.14"]


# ------------------------------------------------------------------ ports and the token

# Ray binds these to every interface whatever --node-ip-address says (its gRPC
# servers take no bind address): the GCS (head only), the raylet's node manager
# and object manager ports, and one port per worker process (the head actor,
# each node's agent, drivers, idle workers). Everything else is bound to the
# host's fleet address.
WILDCARD_OK = {"gcs_server", "raylet"}


def _is_worker(process: str) -> bool:
    return process.startswith("ray::") and not process.startswith("ray::RuntimeEnv")


def test_ports_are_bound_to_the_fleet_address_but_rays_known_exceptions(fleet):
    lab = fleet["lab"]
    listed = cluster_status(fleet)
    hosts = {"h1": listed["(head)"], **{n: listed[n] for n in NODES}}
    for name, entry in hosts.items():
        host = lab.host(name)
        seen = _ss(lab, name)
        assert (host.address, 22, "sshd") in {(a, p, c) for c, _, a, p in seen}
        ray_side = [s for s in seen if s[0] != "sshd"]
        for proc, pid, bound, port in ray_side:
            assert bound in (host.address, "*"), (name, proc, bound, port)
            if bound == "*":
                assert proc in WILDCARD_OK or _is_worker(proc), (name, proc, port)
        wild = [(p, port) for p, _, b, port in ray_side if b == "*"]
        assert [port for p, port in wild if p == "gcs_server"] == ([HEAD_PORT] if name == "h1"
                                                                   else [])
        assert len([1 for p, _ in wild if p == "raylet"]) == 2, (name, wild)
        bound_here = {p for p, _, b, _ in ray_side if b == host.address}
        assert bound_here == {"ray::RuntimeEnv"}, (name, ray_side)   # the runtime-env agent
        # `cluster status` lists what `ss` sees (workers that come and go aside)
        steady = lambda rows: {(pid, b, port) for proc, pid, b, port in rows   # noqa: E731
                               if proc != "ray::IDLE" and not proc.startswith("ray::node_ports")}
        listed_rows = [(p["process"], p["pid"], p["address"], p["port"])
                       for p in entry["listening"]]
        assert steady(ray_side) <= steady(listed_rows) | _gone(lab, name, ray_side), (
            name, ray_side, listed_rows)
        assert entry["address"] == host.address


def test_the_token_is_private_and_in_no_log_or_json_output(fleet):
    lab = fleet["lab"]
    token_file = host_dir(lab, "h1") / "home/stores/auth_token"
    token = token_file.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    token_files = {token_file} | {host_dir(lab, n) / "home/.segctl/auth_token" for n in NODES}
    for f in token_files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        assert f.read_text().strip() == token
    # every file of every host (homes, /tmp with Ray's session logs, sshd's logs)
    found = [f for h in lab.hosts for f in _files(host_dir(lab, h.name))
             if f not in token_files and token.encode() in _read(f)]
    assert not found, found
    assert fleet["json"] and not [out for out in fleet["json"] if token in out]
    # nor on a command line or in an environment of any process of the lab
    for h in lab.hosts:
        for pid in lablib.pids(h):
            for part in ("cmdline", "environ"):
                assert token.encode() not in _read(Path(f"/proc/{pid}/{part}")), (h.name, pid)


def test_an_outsider_cannot_read_the_token_through_proc_or_the_lab_folder(fleet):
    """h5 looks for the token in every process it can see (command line,
    environment, the token file under its root and working folder) and in every
    host's token file on this machine's disk: nothing. The same look from h2 finds
    its own copy through its own Ray processes (the look is one that finds)."""
    lab = fleet["lab"]
    token = (host_dir(lab, "h1") / "home/stores/auth_token").read_text().strip()
    on_disk = [host_dir(lab, "h1") / "home/stores/auth_token"] + \
        [host_dir(lab, n) / "home/.segctl/auth_token" for n in NODES]
    members = [p for n in ("h1", *NODES) for p in lablib.pids(lab.host(n))]
    assert where_readable(lab, "h5", token, on_disk +
                          [f"/proc/{p}/root/root/.segctl/auth_token" for p in members]) == []
    seen_by_h2 = where_readable(lab, "h2", token)
    ray_node = fleet["info"]["nodes"]["h2"]["pid"]
    assert f"/proc/{ray_node}/root/root/.segctl/auth_token" in seen_by_h2, seen_by_h2
    assert not [p for p in seen_by_h2 if not p.endswith("/auth_token")], seen_by_h2


def test_cluster_down_leaves_only_sshd_on_every_host(fleet):
    lab = fleet["lab"]
    run(lab, "h1", "segctl cluster down cluster.yaml", timeout=180)
    assert not (host_dir(lab, "h1") / "home/stores/fleet.json").exists()
    for n in NODES:
        assert not (host_dir(lab, n) / "home/.segctl/here.json").exists(), n
    for h in lab.hosts:
        # nothing but sshd; the ssh session that ran `down` on h1 may take a moment
        # to close on h1's side, and only such a session's process may linger, or
        # one already exiting (its command line reads empty once its memory is gone)
        extra = [p for p in lablib.pids(h) if p != h.sshd_pid]
        assert all(c == "" or c.startswith("sshd: ") for c in commands(extra)), (
            h.name, commands(extra))
        assert _wait(lambda: lablib.pids(h) == [h.sshd_pid], timeout=10), (
            h.name, commands(lablib.pids(h)))


# ------------------------------------------------------------------ a head of several addresses

def test_a_head_on_a_machine_of_several_addresses_advertises_the_fleets(lab, tmp_path):
    """The head in this machine's root namespace (its own network plus the lab's
    bridge 198.18.0.1), h5 a node: Ray alone would advertise the address facing
    the default route, which h5 cannot reach, and h5's agent could never call the
    head actor. With head.address named, the head is advertised there."""
    port = _free_port()
    (tmp_path / "cluster.yaml").write_text(
        f"head:\n  address: {lablib.BRIDGE_ADDRESS}\n  port: {port}\n  stores: stores\n"
        "nodes:\n  - name: h5\n    host: h5\n    memory_gb: 2\n")
    env = {"PATH": f"{lab.root / 'bin'}:{os.environ['PATH']}"}   # `ssh` with the lab's config
    cluster = tmp_path / "cluster.yaml"
    assert segctl("init-demo", tmp_path / "demo", env=env).returncode == 0
    sweep = tmp_path / "demo/sweep.yaml"
    sweep.write_text(sweep.read_text().replace("train.iters: [150]", "train.iters: [4]")
                     .replace("lora.rank: [4, 8]", "lora.rank: [4]")
                     .replace("train.learning_rate: [1.0e-4, 2.0e-4]",
                              "train.learning_rate: [1.0e-4]"))
    up = segctl("cluster", "up", cluster, env=env, timeout=240)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        sub = segctl("submit", sweep, "--cluster", cluster, "--json", env=env, timeout=300)
        assert sub.returncode == 0, (sub.stdout[-3000:], sub.stderr[-3000:])
        status = segctl("cluster", "status", cluster, "--json", env=env, timeout=120)
        assert status.returncode == 0, status.stderr[-3000:]
        where = {n["name"]: n["address"] for n in json.loads(status.stdout)}
        assert where == {"(head)": lablib.BRIDGE_ADDRESS, "h5": "198.18.0.15"}
    finally:
        down = segctl("cluster", "down", cluster, env=env, timeout=180)
    assert down.returncode == 0, down.stderr[-3000:]
    h5 = lab.host("h5")
    assert lablib.pids(h5) == [h5.sshd_pid], commands(lablib.pids(h5))


# ------------------------------------------------------------------ helpers

def _ss(lab, name: str) -> list[tuple[str, int, str, int]]:
    """(process, pid, bound address or "*", port) of every listening TCP socket in
    host `name`, as its own `ss -ltnp` sees them."""
    out = run(lab, name, "ss -H -ltnp").stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        host, _, port = fields[3].rpartition(":")
        host = host.strip("[]").removeprefix("::ffff:")
        bound = "*" if host in ("*", "0.0.0.0", "::") else host
        for proc, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            rows.append((proc, int(pid), bound, int(port)))
    return rows


def _host_pids(lab, name: str) -> set[int]:
    """The processes of host `name` as it numbers them (what its `ps` and segctl's
    records there say)."""
    return {lablib.inner_pid(p) for p in lablib.pids(lab.host(name))}


def _gone(lab, name: str, rows) -> set:
    """Rows of host `name` whose process has exited since (a worker Ray let go
    meanwhile)."""
    live = _host_pids(lab, name)
    return {(pid, b, port) for _, pid, b, port in rows if pid not in live}


def _files(root: Path):
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath, n)
            if p.is_file() and not p.is_symlink():
                yield p


def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(64 << 20)
    except OSError:
        return b""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((lablib.BRIDGE_ADDRESS, 0))
        return s.getsockname()[1]


def _wait(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
