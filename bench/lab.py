"""The fleet across hosts: one JSON row per measure, on a lab of this machine
(`segctl lab up`: network namespaces with their own addresses, disks and sshd).

    python -m bench.lab [--nodes 3] [--trials 24] [--iters 4] [--max-trials 1,2,4]

h1 is the head (it trains nothing); h2.. are the nodes, each joined over real
ssh, each fetching the model from the head. For each max_trials the same sweep
of short trials runs from a fresh `cluster up`:
- makespan: first dispatch to last attempt end, against max_trials 1 (one trial
  per node at a time) measured in the same run;
- dispatch: seconds from a trial becoming runnable to its engine process started
  on a node, p50 and p99 over every attempt;
then ingest: step rows per second from a driver on h2 into the head actor on
h1, over the lab's bridge, in the batches agents send.

Needs root on Linux (see `segctl lab up --help`); elsewhere it prints one row
saying why it did not run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time

import yaml

from bench.orchestrator import row
from segctl.schemas.defaults import DEFAULT_PORT
from segctl.schemas.states import TrialState

HEAD_PORT = DEFAULT_PORT


def ssh(lab, host: str, command: str, timeout: float = 900):
    import subprocess

    from segctl import lab as lablib
    return subprocess.run(lablib.ssh_argv(lab, host, command), capture_output=True, text=True,
                          timeout=timeout)


def must(proc, what: str) -> str:
    if proc.returncode:
        raise SystemExit(f"{what} failed: {(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout


def cluster_file(nodes: list[str], max_trials: int) -> str:
    return yaml.safe_dump({
        "head": {"address": "198.18.0.11", "port": HEAD_PORT, "stores": "~/stores"},
        "nodes": [{"name": n, "host": n, "memory_gb": 2, "max_trials": max_trials}
                  for n in nodes]}, sort_keys=False)


def sweep_once(lab, nodes: list[str], trials: int, iters: int, max_trials: int) -> dict:
    """A fresh fleet at `max_trials`, the sweep, its attempts; the fleet down again."""
    name = f"mt{max_trials}"
    sweep = {"name": name, "base": "short.yaml", "grid": {"train.seed": list(range(trials))}}
    must(ssh(lab, "h1", f"printf %s {shlex.quote(cluster_file(nodes, max_trials))} > "
                        f"{name}.yaml && printf %s {shlex.quote(yaml.safe_dump(sweep))} > "
                        f"demo/{name}-sweep.yaml"), "writing the files")
    must(ssh(lab, "h1", f"segctl cluster up {name}.yaml --json", timeout=300), "cluster up")
    try:
        tic = time.time()
        sub = ssh(lab, "h1", f"segctl submit demo/{name}-sweep.yaml --cluster {name}.yaml --json")
        wall = time.time() - tic
        st = json.loads(must(ssh(lab, "h1", f"segctl status --cluster {name}.yaml --json"),
                             "status"))
        [sw] = [s for s in st if s["name"] == name]
        if sub.returncode or any(t["state"] != TrialState.SUCCEEDED for t in sw["trials"]):
            raise SystemExit(f"sweep {name} failed: {sub.stderr[-2000:]}")
        attempts = [a for t in sw["trials"] for a in t["attempts"]]
        ingest = bench_ingest(lab, nodes[0], attempts[0]["attempt"]) if max_trials == 1 else None
    finally:
        ssh(lab, "h1", f"segctl cluster down {name}.yaml", timeout=300)
    return {"attempts": attempts, "wall": wall, "ingest": ingest}


INGEST = """
import json, time, ray
from bench.orchestrator import step_events
from segctl.orchestrator.actor import HEAD_NAME, NAMESPACE
ray.init(address="198.18.0.11:{port}", namespace=NAMESPACE, log_to_driver=False)
head = ray.get_actor(HEAD_NAME, namespace=NAMESPACE)
events = step_events({rows}, seq0=1_000_000)
tic = time.perf_counter()
for i in range(0, {rows}, {batch}):
    ray.get(head.ingest.remote({aid}, events[i:i + {batch}]))
print(json.dumps(time.perf_counter() - tic))
"""


def bench_ingest(lab, host: str, aid: int, rows: int = 100_000, batch: int = 500) -> dict:
    """A driver on node host `host` (its token from `segctl node start`) sends step
    rows to the head actor on h1, into an attempt of this run's own stores."""
    code = INGEST.format(port=HEAD_PORT, rows=rows, batch=batch, aid=aid)
    env = ("RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/.segctl/auth_token "
           "RAY_USAGE_STATS_ENABLED=0")
    out = must(ssh(lab, host, f"{env} python -c {shlex.quote(code)}"), "ingest driver")
    secs = json.loads(out.strip().splitlines()[-1])
    return dict(rows=rows, batch=batch, seconds=round(secs, 3), rows_per_s=round(rows / secs))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--max-trials", default="1,2,4", help="comma-separated; 1 is the baseline")
    a = ap.parse_args()
    from segctl import lab as lablib
    why = lablib.why_not()
    if why:
        row(bench="lab", skipped=why)
        return
    levels = sorted({1, *map(int, a.max_trials.split(","))})
    lab = lablib.up(a.nodes + 1)
    try:
        nodes = [h.name for h in lab.hosts[1:]]
        must(ssh(lab, "h1", "segctl init-demo demo >/dev/null && cd demo && python -c "
                 + shlex.quote(
                     "import yaml; j = yaml.safe_load(open('job.yaml')); "
                     f"j['train'].update(iters={a.iters}, eval_every=0, checkpoint_every=0); "
                     "j['data'].pop('valid', None); "
                     "open('short.yaml', 'w').write(yaml.safe_dump(j))")), "init-demo")
        base = None
        for k in levels:
            got = sweep_once(lab, nodes, a.trials, a.iters, k)
            att = got["attempts"]
            first = min(x["started"] - x["dispatch_s"] for x in att)
            makespan = max(x["ended"] for x in att) - first
            base = base or makespan
            disp = [x["dispatch_s"] for x in att]
            per_node = {}
            for x in att:
                per_node[x["node"]] = per_node.get(x["node"], 0) + 1
            row(bench="lab-makespan", hosts=a.nodes, trials=a.trials, iters=a.iters,
                max_trials=k, makespan_s=round(makespan, 3),
                vs_one_at_a_time=round(makespan / base, 4),
                mean_trial_s=round(statistics.mean(x["ended"] - x["started"] for x in att), 3),
                attempts=len(att), attempts_per_node=per_node, submit_wall_s=round(got["wall"], 3))
            row(bench="lab-dispatch", hosts=a.nodes, max_trials=k, attempts=len(disp),
                p50_s=round(pct(disp, 0.5), 4), p99_s=round(pct(disp, 0.99), 4),
                max_s=round(max(disp), 4))
            if got["ingest"]:
                row(bench="lab-ingest", path=f"driver on {nodes[0]} -> head actor on h1 "
                    "over the bridge", **got["ingest"])
    finally:
        lablib.down(lab.root)


if __name__ == "__main__":
    main()
