"""Faults across hosts, on the lab: a link cut, a host powered off, the head
host killed, a node's disk filling up, a node partitioned from the head, and
the head restarted between sweeps with readers of its stores coming and going
(after a sweep with no fault, the baseline); then one trial on two nodes (a
ring) with a rank's engine killed, its host powered off, its link cut mid
all-reduce, the head restarted under it, each adapter equal to an undisturbed
ring's, and the same job on 1, 2 and 3 hosts giving the same adapter. Each scenario runs a sweep of its
own on one fleet (head h1 trains nothing; nodes h2, h3, h4), breaks something
while the sweep runs, lets it finish, and then the same checker reads the
head's stores on h1 (from this machine's disk) and asserts:

- every step row is there exactly once per attempt (no (attempt, step) twice
  in telemetry/steps; a succeeded attempt has each of its steps once);
- every SUCCEEDED trial's adapter, as `segctl gather` on h1 writes it, is
  byte-identical to what its node sent (the sha256 the node put in the
  attempt's telemetry, the `adapter` event, before returning);
- no finished trial ran again (at most one succeeded attempt per trial, none
  placed after its SUCCEEDED transition);
- every trial ends SUCCEEDED, or FAILED/CANCELLED with a stated reason; every
  attempt ends with an outcome (and a reason, unless it succeeded) and is
  sealed into the Parquet stores;
- no engine process outlived its attempt by more than LeftBehind.GRACE_S,
  and none runs on any host once the sweep is done.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from segctl import lab as lablib
from segctl.orchestrator import state_db
from segctl.orchestrator.stores import _checkpoint_dirs
from segctl.schemas import store_rows as sr
from segctl.schemas.states import Outcome, SweepState, TrialState

from .conftest import run_in, ssh

pytestmark = pytest.mark.fleet   # a lab of hosts

LAB_HOSTS = 4
NODES = ("h2", "h3", "h4")
CLUSTER = """\
head:
  address: 198.18.0.11
  port: 6379
  stores: ~/stores
nodes:
""" + "".join(f"  - {{name: {n}, host: {n}, memory_gb: 2}}\n" for n in NODES)
WORK = "/tmp/segctl-work-0"          # a node's work root (node/agent.py work_root, uid 0)


# ------------------------------------------------------------------ the fleet

def run(lab, host: str, command: str, timeout: float = 300, ok: bool = True):
    proc = ssh(lab, host, command, timeout=timeout)
    if ok:
        assert proc.returncode == 0, (host, command, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def stores_root(lab) -> Path:
    """The head's stores, on this machine's disk (h1's ~/stores)."""
    return lab.host("h1").home / "stores"


@pytest.fixture(scope="module")
def fleet(lab):
    run(lab, "h1", "segctl init-demo demo >/dev/null && "
                   f"printf %s {shlex.quote(CLUSTER)} > cluster.yaml")
    run(lab, "h1", "segctl cluster up cluster.yaml --json", timeout=240)
    yield lab
    if (stores_root(lab) / "fleet.json").exists():
        ssh(lab, "h1", "segctl cluster down cluster.yaml", timeout=180)


@pytest.fixture
def whole(fleet):
    """The fleet with every node up (a scenario before may have lost one): `cluster
    up` again starts the nodes missing from it."""
    lab = fleet
    if set(alive_nodes(lab)) != set(NODES):
        run(lab, "h1", "segctl cluster up cluster.yaml --json", timeout=240)
        assert wait_for(lambda: set(alive_nodes(lab)) == set(NODES), 60), alive_nodes(lab)
    return lab


def alive_nodes(lab) -> list[str]:
    proc = run(lab, "h1", "segctl cluster status cluster.yaml --json", timeout=120, ok=False)
    if proc.returncode != 0:
        return []
    return sorted(n["name"] for n in json.loads(proc.stdout)
                  if n["name"] != "(head)" and n.get("alive"))


def submit(lab, name: str, *, trials: int = 3, iters: int = 40, every: int = 5,
           retries: int = 3, grid: dict | None = None) -> str:
    """A sweep of `trials` demo trials of `iters` steps, a checkpoint every `every`
    steps (and `grid`'s keys, one value each), submitted detached; its id."""
    rates = ", ".join(f"{(i + 1) * 1.0e-4:.1e}" for i in range(trials))
    sweep = (f"name: {name}\nbase: job.yaml\ngrid:\n"
             f"  train.learning_rate: [{rates}]\n  train.iters: [{iters}]\n"
             f"  train.checkpoint_every: [{every}]\n  train.eval_every: [0]\n"
             + "".join(f"  {k}: [{v}]\n" for k, v in (grid or {}).items())
             + f"concurrency: {trials}\nretries: {retries}\n")
    out = run(lab, "h1", f"printf %s {shlex.quote(sweep)} > demo/{name}.yaml && "
                         f"segctl submit demo/{name}.yaml --cluster cluster.yaml --detach")
    return out.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------ reading the head's stores

def db(lab):
    return state_db.connect(stores_root(lab) / "state.db", readonly=True)


def attempts(lab, sid: str) -> list[dict]:
    con = db(lab)
    try:
        return [dict(r) for r in con.execute("SELECT * FROM attempts WHERE sweep = ? ORDER BY id",
                                             (sid,))]
    finally:
        con.close()


def sweep_state(lab, sid: str) -> str:
    con = db(lab)
    try:
        return con.execute("SELECT state FROM sweeps WHERE id = ?", (sid,)).fetchone()["state"]
    finally:
        con.close()


def running_on(lab, sid: str, node: str, min_step: int = 1) -> dict | None:
    """The attempt of `sid` running on `node` that has reached `min_step`, if any."""
    for a in attempts(lab, sid):
        if a["node"] == node and a["status"] == "running" and (a["step"] or 0) >= min_step:
            return a
    return None


def wait_for(cond, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


def wait_done(lab, sid: str, timeout: float) -> str:
    state = wait_for(lambda: (s := sweep_state(lab, sid)) != SweepState.RUNNING and s, timeout)
    assert state, (f"sweep {sid} still running after {timeout:.0f} s",
                   [(a["id"], a["node"], a["status"], a["outcome"], a["step"])
                    for a in attempts(lab, sid)])
    return state


# ------------------------------------------------------------------ the checker

def check(lab, sid: str, watch: "LeftBehind") -> dict:
    """The one checker every scenario ends with (see the module's docstring).
    Returns the sweep's trials, attempts and step rows for the scenario's own
    assertions."""
    root = stores_root(lab)
    con = db(lab)
    try:
        sweep = dict(con.execute("SELECT * FROM sweeps WHERE id = ?", (sid,)).fetchone())
        trials = {r["id"]: dict(r) for r in con.execute(
            "SELECT * FROM trials WHERE sweep = ? ORDER BY idx", (sid,))}
        tries = [dict(r) for r in con.execute(
            "SELECT * FROM attempts WHERE sweep = ? ORDER BY id", (sid,))]
        moves = [dict(r) for r in con.execute(
            "SELECT * FROM events WHERE sweep = ? AND trial IS NOT NULL ORDER BY id", (sid,))]
    finally:
        con.close()
    assert sweep["state"] == SweepState.DONE, sweep

    # every trial finished, with a stated reason when it did not succeed
    for tid, t in trials.items():
        last = [m for m in moves if m["trial"] == tid][-1]
        assert last["to_state"] == t["state"], (tid, last, t["state"])
        assert t["state"] in (TrialState.SUCCEEDED, TrialState.FAILED, TrialState.CANCELLED), (tid, t["state"])
        if t["state"] != TrialState.SUCCEEDED:
            assert t["message"].strip() and last["reason"].strip(), (tid, t, last)
    # every attempt ended with an outcome (and why, unless it succeeded), and is sealed
    done = sealed(root)
    for a in tries:
        assert a["status"] == "ended" and a["outcome"], a
        assert a["outcome"] == Outcome.SUCCEEDED or a["message"].strip(), a
        assert a["id"] in done, f"attempt {a['id']} is not sealed"

    # every step row once per attempt (and rank, on several nodes); a succeeded
    # attempt has each of its steps once from each of its ranks
    steps = _table(root, "steps", sid, ["attempt", "step", "rank", "time"])
    seen: dict[tuple[int, int, int], int] = {}
    for attempt, step, rank in zip(steps["attempt"], steps["step"], steps["rank"]):
        key = (attempt, step, rank or 0)
        seen[key] = seen.get(key, 0) + 1
    doubled = {k: n for k, n in seen.items() if n > 1}
    assert not doubled, f"step rows more than once: {doubled}"
    assert {a for a, _, _ in seen} <= {a["id"] for a in tries}
    for a in tries:
        if a["outcome"] == Outcome.SUCCEEDED:
            total = json.loads(trials[a["trial"]]["job"])["train"]["iters"]
            ranks = len(a["node"].split(","))   # a retry may run on fewer (min_nodes)
            have = sorted((s, r) for (att, s, r) in seen if att == a["id"])
            assert have == [(s, r) for s in range((a["resume_step"] or 0) + 1, total + 1)
                            for r in range(ranks)], (a["id"], have)

    # no finished trial ran again
    for tid, t in trials.items():
        won = [a for a in tries if a["trial"] == tid and a["outcome"] == Outcome.SUCCEEDED]
        assert len(won) <= 1, (tid, won)
        if t["state"] == TrialState.SUCCEEDED:
            assert len(won) == 1, (tid, [a for a in tries if a["trial"] == tid])
            [done] = [m for m in moves if m["trial"] == tid and m["to_state"] == TrialState.SUCCEEDED]
            assert done["attempt"] == won[0]["id"], (tid, done)
            later = [a["id"] for a in tries if a["trial"] == tid and a["placed"] > done["time"]]
            assert not later, f"{tid} ran again after it succeeded: attempts {later}"

    # the adapters gathered on h1 are the bytes their nodes sent
    succeeded = [tid for tid, t in trials.items() if t["state"] == TrialState.SUCCEEDED]
    if succeeded:
        out = f"gathered-{sid}"
        run(lab, "h1", f"rm -rf {out} && segctl gather {sid} --out {out} --cluster cluster.yaml")
        events = _table(root, "events", sid, ["attempt", "event", "body"])
        sent = {}
        for attempt, kind, body in zip(events["attempt"], events["event"], events["body"]):
            if kind == "adapter":
                assert attempt not in sent, f"attempt {attempt}: two adapter events"
                sent[attempt] = json.loads(body)["sha256"]
        manifest = json.loads((lab.host("h1").home / out / "manifest.json").read_text())
        assert sorted(m["trial"] for m in manifest) == sorted(succeeded)
        for tid in succeeded:
            [won] = [a for a in tries if a["trial"] == tid and a["outcome"] == Outcome.SUCCEEDED]
            folder = lab.host("h1").home / out / tid
            got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
            assert won["id"] in sent, f"attempt {won['id']}: no digest of the adapter its node sent"
            assert got == sent[won["id"]], (tid, won["id"], got, sent[won["id"]])

    # no engine outlived its attempt, and none runs now the sweep is done
    assert not watch.orphans, f"engines left running after their attempt ended: {watch.orphans}"
    assert wait_for(lambda: not engines(lab), 20), engines(lab)
    return {"trials": trials, "attempts": tries, "moves": moves, "steps": steps}


def sealed(root: Path) -> set[int]:
    """Attempts the stores have sealed, read as `segctl logs` reads staging.db: a
    connection of another process that opens, reads and closes (closed here at
    once, so none of this process stays open to hold the head's WAL in place)."""
    con = sqlite3.connect(root / "staging.db", timeout=30)
    try:
        return {a for (a,) in con.execute("SELECT attempt FROM attempts WHERE sealed IS NOT NULL")}
    finally:
        con.close()


def _table(root: Path, name: str, sid: str, columns: list[str]) -> dict[str, list]:
    folder = root / "telemetry" / name / f"sweep={sid}"
    if not folder.is_dir():
        return {c: [] for c in columns}
    return ds.dataset(folder, format="parquet").to_table(columns=columns).to_pydict()


def engines(lab) -> list[tuple[str, int, str]]:
    """Engine processes (`python -m segctl.node.worker`) running an attempt in any
    host: (host, pid, its command line and working folder). A spare waiting for its
    attempt (`worker --spare`, its folder not yet an attempt's) runs nothing."""
    found = []
    for h in lab.hosts:
        for pid in lablib.pids(h):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            where = f"{cmd[:120]} in {cwd}"
            if "node.worker" in cmd and ("--spare" not in cmd or "/attempt-" in cwd):
                found.append((h.name, pid, where))
    return found


class LeftBehind:
    """Watches the engines of every host while a scenario runs (once a second): an
    engine still running GRACE_S after the head ended its attempt was left behind
    (it would train on as an orphan beside the attempt that runs its trial next)."""

    GRACE_S = 15

    def __init__(self, lab):
        self.lab = lab
        self.ended_seen: dict[int, float] = {}
        self.orphans: dict[int, tuple[str, int]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="left-behind")
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self.sample()
            except Exception:   # the head's state.db mid-restart: next second
                pass

    def sample(self) -> None:
        running = {}
        for host, pid, cmd in engines(self.lab):
            m = re.search(r"/attempt-(\d+)(/job\.json| in |$)", cmd)
            if m:
                running[int(m.group(1))] = (host, pid)
        if not running:
            return
        con = db(self.lab)
        try:
            ended = [r["id"] for r in con.execute(
                f"SELECT id FROM attempts WHERE status = 'ended' AND id IN "
                f"({','.join('?' * len(running))})", list(running))]
        finally:
            con.close()
        now = time.monotonic()
        for aid in ended:
            if now - self.ended_seen.setdefault(aid, now) > self.GRACE_S:
                self.orphans[aid] = running[aid]

    def close(self) -> dict:
        self.stop.set()
        self.thread.join(timeout=10)
        return self.orphans


@pytest.fixture
def watch(whole):
    w = LeftBehind(whole)
    yield w
    w.close()


# ------------------------------------------------------------------ faults

def link(lab, host: str, up: bool) -> None:
    """Plug or unplug host's cable (its veth end on the bridge, in this namespace)."""
    lablib.system.ip("link", "set", lab.host(host).veth, "up" if up else "down")


def power_off(lab, host: str) -> None:
    """Every process in the host SIGKILLed, its sshd too; its disk stays."""
    h = lab.host(host)
    deadline = time.monotonic() + 10
    while live := lablib._host_pids(h):
        for p in live:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert time.monotonic() < deadline, f"{host}: processes {live} survive SIGKILL"
        time.sleep(0.05)


def first_running(lab, sid: str, min_step: int, timeout: float = 60) -> dict:
    """The first attempt of `sid` (lowest id) running on a node with `min_step` steps
    done (so it has shipped a checkpoint when min_step > the checkpoint interval)."""
    def found():
        live = [a for a in attempts(lab, sid) if a["status"] == "running"
                and (a["step"] or 0) >= min_step]
        return live[0] if live else None
    got = wait_for(found, timeout)
    assert got, attempts(lab, sid)
    return got


def shipped(lab) -> dict[str, int]:
    """Trial -> the step of its newest finished checkpoint in the head's stores."""
    out = {}
    for trial in (stores_root(lab) / sr.ADAPTERS_ZARR).glob("*"):
        dirs = _checkpoint_dirs(trial / "checkpoints")
        if dirs:
            out[trial.name] = int(dirs[-1].name.split("-", 1)[1])
    return out


def later_attempts(got: dict, a: dict) -> list[dict]:
    return [b for b in got["attempts"] if b["trial"] == a["trial"] and b["id"] > a["id"]]


# ------------------------------------------------------------------ scenarios

def test_0_no_fault_the_checker_passes(whole, watch):
    """The baseline (and the warm-up: every node's agent is up after it)."""
    t0 = time.monotonic()
    lab = whole
    sid = submit(lab, "calm", iters=20, every=5)
    wait_done(lab, sid, 60)
    got = check(lab, sid, watch)
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())
    assert {a["outcome"] for a in got["attempts"]} == {Outcome.SUCCEEDED}
    print(f"\n[0] {sid}: {time.monotonic() - t0:.0f} s")


def test_a_link_cut_for_30_s_mid_attempt(whole, watch):
    lab = whole
    t0 = time.monotonic()
    sid = submit(lab, "cut", iters=200, every=10)
    victim = first_running(lab, sid, min_step=11)
    link(lab, victim["node"], up=False)
    try:
        time.sleep(30)
    finally:
        link(lab, victim["node"], up=True)
    wait_done(lab, sid, 100)
    got = check(lab, sid, watch)
    [ended] = [a for a in got["attempts"] if a["id"] == victim["id"]]
    assert ended["outcome"] in (Outcome.SUCCEEDED, Outcome.NODE_LOST, Outcome.AGENT_ERROR), ended
    if ended["outcome"] != Outcome.SUCCEEDED:   # ran again, from a checkpoint it had shipped
        later = later_attempts(got, ended)
        assert later and later[0]["resume_step"], later
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())
    print(f"\n[a] {sid}: {victim['node']}'s attempt {ended['outcome']} ({ended['message']}); "
          f"{time.monotonic() - t0:.0f} s")


def test_b_a_host_powered_off_and_back(whole, watch):
    lab = whole
    t0 = time.monotonic()
    sid = submit(lab, "poweroff", iters=200, every=10)
    victim = first_running(lab, sid, min_step=11)
    host = victim["node"]
    power_off(lab, host)
    # the head finds the node gone (Ray's health checks) and sends its trial elsewhere
    lost = wait_for(lambda: next((a for a in attempts(lab, sid) if a["id"] == victim["id"]
                                  and a["status"] == "ended"), None), 60)
    assert lost and lost["outcome"] == Outcome.NODE_LOST, lost
    # `cluster up` starts the nodes Ray's node table does not list alive: wait
    # until Ray too has found the machine gone (a Mac rebooted overnight)
    assert wait_for(lambda: host not in alive_nodes(lab), 60, every=2), alive_nodes(lab)
    gone = time.monotonic() - t0
    lablib.restart_host(lab, host)
    run(lab, "h1", "segctl cluster up cluster.yaml --json", timeout=240)   # joins it again
    assert wait_for(lambda: host in alive_nodes(lab), 60), alive_nodes(lab)
    wait_done(lab, sid, 90)
    got = check(lab, sid, watch)
    later = later_attempts(got, victim)
    assert later and later[0]["resume_step"] and later[0]["node"] != host, later
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())
    print(f"\n[b] {sid}: {host} powered off (Ray saw it dead at {gone:.0f} s), back, joined "
          f"again; {time.monotonic() - t0:.0f} s")


def test_c_the_head_host_killed_and_restarted(whole, watch):
    lab = whole
    t0 = time.monotonic()
    sid = submit(lab, "headloss", iters=200, every=10)
    # power off once two running trials have a checkpoint in the head's stores;
    # others may be too young to have shipped one, and start again from step 0
    running = lambda: {a["trial"] for a in attempts(lab, sid) if a["status"] == "running"}
    assert wait_for(lambda: len(running() & set(shipped(lab))) >= 2, 60), attempts(lab, sid)
    power_off(lab, "h1")
    had = shipped(lab)   # what the head held when it died
    lablib.restart_host(lab, "h1")
    run(lab, "h1", "segctl cluster up cluster.yaml --json", timeout=240)
    resumed = run(lab, "h1", f"segctl resume {sid} --cluster cluster.yaml --json", timeout=180)
    got = check(lab, sid, watch)
    cut = [a for a in got["attempts"] if a["outcome"] == Outcome.INTERRUPTED]
    assert cut and all("head restarted" in a["message"] for a in cut), got["attempts"]
    assert sum(a["trial"] in had for a in cut) >= 2, (had, cut)
    for a in cut:   # each went on in an attempt of its own, from its newest checkpoint
        later = later_attempts(got, a)   # (or a newer one the restarted head sealed)
        assert later and (later[0]["resume_step"] or 0) >= had.get(a["trial"], 0), \
            (a, later, had)
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values()), resumed.stderr
    print(f"\n[c] {sid}: {len(cut)} attempts interrupted; {time.monotonic() - t0:.0f} s")


def test_d_a_node_disk_fills_during_an_attempt(whole, watch):
    """Each node's work folder is a small disk of its own (a tmpfs in the host);
    the one that runs the first attempt fills up while it trains."""
    lab = whole
    t0 = time.monotonic()
    disks = []
    try:
        for n in NODES:
            folder = f"{WORK}/{n}"
            made = run_in(lab.host(n), ["sh", "-c", f"mkdir -p {folder} && mount -t tmpfs -o "
                                                    f"size=16m,mode=0700 segdisk {folder}"])
            assert made.returncode == 0, made.stderr
            disks.append(n)
        sid = submit(lab, "diskfull", iters=100, every=10)
        victim = first_running(lab, sid, min_step=1)
        host = victim["node"]
        run_in(lab.host(host), ["sh", "-c", f"dd if=/dev/zero of={WORK}/{host}/fill bs=64k "
                                            "2>/dev/null; true"])
        wait_done(lab, sid, 90)
        got = check(lab, sid, watch)
    finally:
        for n in disks:
            run_in(lab.host(n), ["umount", "-l", f"{WORK}/{n}"])
    [ended] = [a for a in got["attempts"] if a["id"] == victim["id"]]
    assert ended["outcome"] in (Outcome.FAILED, Outcome.AGENT_ERROR), ended
    assert "No space left on device" in ended["message"], ended
    trial = got["trials"][victim["trial"]]
    if trial["state"] != TrialState.SUCCEEDED:
        assert "No space left on device" in trial["message"], trial
    else:   # it went elsewhere
        assert later_attempts(got, ended)[-1]["node"] != host
    print(f"\n[d] {sid}: {host}'s attempt {ended['outcome']} ({ended['message']}); trial "
          f"{trial['state']}; {time.monotonic() - t0:.0f} s")


PARTITION_S = 10   # below Ray's own time to declare a node dead: the node lives on


def test_e_a_node_partitioned_from_the_head_trains_on(whole, watch):
    lab = whole
    t0 = time.monotonic()
    sid = submit(lab, "partition", iters=200, every=10)
    victim = first_running(lab, sid, min_step=3)
    link(lab, victim["node"], up=False)
    cut = time.time()
    try:
        time.sleep(PARTITION_S)
    finally:
        link(lab, victim["node"], up=True)
        healed = time.time()
    wait_done(lab, sid, 90)
    got = check(lab, sid, watch)
    [ended] = [a for a in got["attempts"] if a["id"] == victim["id"]]
    if ended["outcome"] == Outcome.SUCCEEDED:
        # it trained through the partition, and what it did then landed (once: the
        # checker) when it healed
        during = [t for a, t in zip(got["steps"]["attempt"], got["steps"]["time"])
                  if a == ended["id"] and cut + 1 < t < healed - 1]
        assert during, "no step of the partitioned attempt ran during the partition"
    else:   # or the attempt was run again
        assert later_attempts(got, ended), got["attempts"]
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())
    print(f"\n[e] {sid}: {victim['node']}'s attempt {ended['outcome']}; "
          f"{time.monotonic() - t0:.0f} s")


def test_f_a_head_restarted_between_sweeps_and_a_reader_that_comes_and_goes(whole, watch):
    """The head stopped and started again over its stores (`cluster down`, `cluster
    up`), a sweep, and readers of the stores on h1 while it runs (`segctl logs`):
    a reader that closes must never take the head's staging WAL with it."""
    lab = whole
    t0 = time.monotonic()
    run(lab, "h1", "segctl cluster down cluster.yaml", timeout=180)
    run(lab, "h1", "segctl cluster up cluster.yaml --json", timeout=240)
    sid = submit(lab, "restarted", iters=100, every=10)
    first_running(lab, sid, min_step=1)
    for _ in range(3):
        run(lab, "h1", f"segctl logs {sid}-t000 --cluster cluster.yaml >/dev/null")
    wait_done(lab, sid, 60)
    got = check(lab, sid, watch)
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())
    print(f"\n[f] {sid}: {time.monotonic() - t0:.0f} s")


# ------------------------------------------------------------------ one trial on two nodes

# distributed.nodes: 2 (a rank on each of two of the three nodes, a row of each
# two-row step each); a collective that makes no progress for 10 s ends its rank
RING = {"distributed.nodes": 2, "distributed.timeout_s": 10, "train.batch_size": 2}
_ring_reference: dict = {}   # the grid of a ring trial -> its undisturbed adapter


def ring_trial(lab, name: str, iters: int = 60, grid: dict = RING) -> str:
    return submit(lab, name, trials=1, iters=iters, every=10, grid=grid)


def ring_adapter(lab, sid: str, trial: str | None = None):
    from segctl.orchestrator.stores import Stores
    tensors, _ = Stores(stores_root(lab)).adapter(trial or f"{sid}-t000")
    return tensors


def same_as_undisturbed(lab, sid: str, watch, grid: dict = RING) -> None:
    """The trial's adapter is an undisturbed run's of the same ring trial (made
    once, first) within fp32 rounding, its norm's 1e-5."""
    import numpy as np
    key = json.dumps(grid, sort_keys=True)
    if key not in _ring_reference:
        calm = ring_trial(lab, "ringcalm", grid=grid)
        wait_done(lab, calm, 120)
        _ring_reference[key] = ring_adapter(lab, calm)
    got, ref = ring_adapter(lab, sid), _ring_reference[key]
    norm = lambda d: np.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in d.values()))
    assert got.keys() == ref.keys()
    assert norm({k: got[k] - ref[k] for k in ref}) <= 1e-5 * norm(ref)


def ring_victim(lab, sid: str) -> tuple[dict, str]:
    """The trial's running attempt once it has shipped a checkpoint, and the node of
    its rank 1."""
    a = first_running(lab, sid, min_step=21)
    nodes = a["node"].split(",")
    assert len(nodes) == 2, a
    return a, nodes[1]


def off_until_done(lab, sid: str, host: str) -> None:
    """`host` powered off while sweep `sid` finishes on the other nodes; then, once
    Ray has found it gone, back on and joined to the fleet again."""
    power_off(lab, host)
    try:
        wait_done(lab, sid, 180)
    finally:
        assert wait_for(lambda: host not in alive_nodes(lab), 90, every=2), alive_nodes(lab)
        lablib.restart_host(lab, host)
        run(lab, "h1", "segctl cluster up cluster.yaml --json", timeout=240)


def ring_ended(got: dict, victim: dict, ways: tuple = (Outcome.NODE_LOST,)) -> None:
    """The victim attempt ended in one of `ways` (a lost node), with a message, and
    the trial went on from a checkpoint, on two nodes, to SUCCEEDED."""
    [ended] = [a for a in got["attempts"] if a["id"] == victim["id"]]
    assert ended["outcome"] in ways and ended["message"], ended
    later = later_attempts(got, ended)
    assert later and later[0]["resume_step"] and len(later[0]["node"].split(",")) == 2, later
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())


def test_g_a_ring_rank_killed(whole, watch):
    lab = whole
    t0 = time.monotonic()
    sid = ring_trial(lab, "rankkill")
    victim, host = ring_victim(lab, sid)
    [pid] = [p for h, p, where in engines(lab)
             if h == host and f"/attempt-{victim['id']}" in where]
    os.kill(pid, signal.SIGKILL)
    wait_done(lab, sid, 120)
    got = check(lab, sid, watch)
    ring_ended(got, victim)
    [ended] = [a for a in got["attempts"] if a["id"] == victim["id"]]
    assert f"rank 1 on {host}" in ended["message"], ended
    same_as_undisturbed(lab, sid, watch)
    print(f"\n[g] {sid}: rank 1's engine on {host} killed: {ended['message']}; "
          f"{time.monotonic() - t0:.0f} s")


def test_h_a_ring_host_powered_off(whole, watch):
    lab = whole
    t0 = time.monotonic()
    sid = ring_trial(lab, "ringpower")
    victim, host = ring_victim(lab, sid)
    off_until_done(lab, sid, host)   # the trial goes on on the other nodes
    got = check(lab, sid, watch)
    ring_ended(got, victim)
    assert host not in later_attempts(got, victim)[0]["node"].split(",")
    same_as_undisturbed(lab, sid, watch)
    print(f"\n[h] {sid}: {host} (rank 1) powered off; {time.monotonic() - t0:.0f} s")


def test_i_a_ring_link_cut_mid_allreduce(whole, watch):
    lab = whole
    t0 = time.monotonic()
    sid = ring_trial(lab, "ringcut")
    victim, host = ring_victim(lab, sid)
    link(lab, host, up=False)   # every step all-reduces: the cut lands in one
    try:
        time.sleep(20)          # past the ring's 10 s: its ranks end, none hangs
    finally:
        link(lab, host, up=True)
    wait_done(lab, sid, 180)
    got = check(lab, sid, watch)
    # Cut off, the host is seen lost, or its agent fails the attempt (an agent_error:
    # a loaded CI run saw one, its message not kept); either way the attempt is
    # retried from its checkpoint, as the rest of the check holds.
    ring_ended(got, victim, (Outcome.NODE_LOST, Outcome.AGENT_ERROR))
    same_as_undisturbed(lab, sid, watch)
    print(f"\n[i] {sid}: {host}'s link cut for 20 s; {time.monotonic() - t0:.0f} s")


def test_j_the_head_restarted_under_a_ring(whole, watch):
    lab = whole
    t0 = time.monotonic()
    sid = ring_trial(lab, "ringhead")
    victim, _ = ring_victim(lab, sid)
    assert wait_for(lambda: f"{sid}-t000" in shipped(lab), 60)
    power_off(lab, "h1")
    lablib.restart_host(lab, "h1")
    run(lab, "h1", "segctl cluster up cluster.yaml --json", timeout=240)
    run(lab, "h1", f"segctl resume {sid} --cluster cluster.yaml --json", timeout=180)
    got = check(lab, sid, watch)
    [cut] = [a for a in got["attempts"] if a["id"] == victim["id"]]
    assert cut["outcome"] == Outcome.INTERRUPTED, cut
    later = later_attempts(got, cut)
    assert later and later[0]["resume_step"] and len(later[0]["node"].split(",")) == 2, later
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())
    same_as_undisturbed(lab, sid, watch)
    print(f"\n[j] {sid}: the head restarted under a ring; {time.monotonic() - t0:.0f} s")


def test_k_the_same_job_on_one_two_and_three_hosts_trains_the_same_adapter(whole, watch):
    """One sweep, its trials the same job on 1, 2 and 3 nodes (a 6-row step: 6,
    3 and 2 rows a rank): the three share the fleet, the three-node trial waiting
    for all three, and end with the same adapter within fp32 rounding."""
    import numpy as np
    lab = whole
    t0 = time.monotonic()
    grid = ("name: hosts\nbase: job.yaml\ngrid:\n  distributed.nodes: [1, 2, 3]\n"
            "  train.batch_size: [6]\n  train.iters: [20]\n  train.eval_every: [0]\n"
            "concurrency: 3\n")
    sid = run(lab, "h1", f"printf %s {shlex.quote(grid)} > demo/hosts.yaml && segctl submit "
                         "demo/hosts.yaml --cluster cluster.yaml --detach").stdout.split()[-1]
    wait_done(lab, sid, 180)
    got = check(lab, sid, watch)
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())
    by_nodes = {len(a["node"].split(",")): a for a in got["attempts"]}
    assert sorted(by_nodes) == [1, 2, 3]
    tensors = {n: ring_adapter(lab, sid, a["trial"]) for n, a in by_nodes.items()}
    norm = lambda d: np.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in d.values()))
    for n in (2, 3):
        assert norm({k: tensors[n][k] - tensors[1][k] for k in tensors[1]}) <= \
            1e-5 * norm(tensors[1]), n
    print(f"\n[k] {sid}: on 1, 2 and 3 hosts; {time.monotonic() - t0:.0f} s")


def test_l_a_ring_of_three_resumes_on_its_min_nodes_two(whole, watch):
    """distributed: {nodes: 3, min_nodes: 2} and a rank's host powered off: the
    retry goes on the two nodes left, each a larger share of the same 6-row steps,
    and trains the undisturbed three-node run's adapter."""
    lab = whole
    t0 = time.monotonic()
    grid = dict(RING, **{"distributed.nodes": 3, "distributed.min_nodes": 2,
                         "train.batch_size": 6})
    sid = ring_trial(lab, "ringmin", grid=grid)
    victim = first_running(lab, sid, min_step=21)
    host = victim["node"].split(",")[2]
    off_until_done(lab, sid, host)
    got = check(lab, sid, watch)
    [ended] = [a for a in got["attempts"] if a["id"] == victim["id"]]
    assert ended["outcome"] == Outcome.NODE_LOST, ended
    later = later_attempts(got, ended)
    assert later and later[0]["resume_step"] and len(later[0]["node"].split(",")) == 2, later
    assert all(t["state"] == TrialState.SUCCEEDED for t in got["trials"].values())
    same_as_undisturbed(lab, sid, watch, grid)
    print(f"\n[l] {sid}: {host} (rank 2 of 3) powered off, went on on two; "
          f"{time.monotonic() - t0:.0f} s")
