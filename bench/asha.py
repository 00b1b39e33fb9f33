"""ASHA against the full grid: one 27-trial sweep of the demo model (learning rate x
LoRA rank x LoRA scale), run twice on the embedded fleet of this machine (no
cluster file: Ray on this machine, one node running DEFAULT_MAX_TRIALS attempts at
once): once to the end, once with `scheduler: asha`.

    python -m bench.asha [--iters 189] [--grace 7] [--eval-every 7] [--plot PNG]

One JSON row per run:
- best_val_loss: the lowest final val_loss of a SUCCEEDED trial (state.db);
  best_eval_val_loss: the lowest eval of a SUCCEEDED trial (telemetry/evals),
  what `gather` exports as the trial's best adapter;
- node_s: sum over attempts of ended - started (engine process time on a node);
- makespan_s: first placement to last end;
- stopped: trials STOPPED by ASHA; steps: steps trained over all attempts.
Then a row of ratios, ASHA / full. Target: best val_loss within 5% of the full
grid's in <= 40% of its node-seconds.

The plot: the best eval val_loss seen so far against the node-seconds spent so
far, both runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import yaml

from bench.orchestrator import row, segctl

# Async ASHA lets the first arrivals at a rung go on, so the order of trials matters:
# each list is in mixed order (middle, low, high), neither best-first nor worst-first.
GRID = {"lora.rank": [8, 2, 16], "lora.scale": [10.0, 5.0, 20.0],
        "train.learning_rate": [1e-4, 2e-5, 5e-4]}


def write_sweeps(root: Path, demo: Path, iters: int, grace: int, eval_every: int) -> dict:
    job = yaml.safe_load((demo / "job.yaml").read_text())
    job.update(model=str(demo / "model"), output=None)
    job["data"].update(train=str(demo / "data/train.jsonl"), valid=str(demo / "data/valid.jsonl"))
    job["train"].update(iters=iters, eval_every=eval_every, val_batches=4,
                        checkpoint_every=max(eval_every, iters // 3))
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    paths = {}
    for name, scheduler in (("full", None), ("asha", {
            "type": "asha", "metric": "val_loss", "grace_steps": grace, "reduction": 3,
            "max_steps": iters})):
        doc = {"name": name, "base": "job.yaml", "grid": GRID, "concurrency": None, "retries": 1}
        if scheduler:
            doc["scheduler"] = scheduler
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(doc, sort_keys=False))
    return paths


def measure(home: Path, sid: str) -> dict:
    import pyarrow.dataset as ds

    from segctl.orchestrator.state import read
    from segctl.schemas.states import TrialState
    state = read(home / "state.db")
    trials = [dict(t) for t in state.q("SELECT id, state, val_loss FROM trials WHERE sweep = ?",
                                       (sid,))]
    attempts = [dict(a) for a in state.q(
        "SELECT trial, placed, started, ended, step, outcome FROM attempts WHERE sweep = ?", (sid,))]
    state.close()
    done = {t["id"] for t in trials if t["state"] == TrialState.SUCCEEDED}
    evals = ds.dataset(home / "telemetry" / "evals", partitioning="hive").to_table(
        filter=ds.field("sweep") == sid).to_pylist()
    spans = [(a["started"], a["ended"]) for a in attempts if a["started"] and a["ended"]]
    return {
        "trials": len(trials),
        "succeeded": len(done),
        "stopped": sum(t["state"] == TrialState.STOPPED for t in trials),
        "best_val_loss": min(t["val_loss"] for t in trials if t["id"] in done),
        "best_eval_val_loss": min(e["val_loss"] for e in evals if e["trial"] in done),
        "node_s": round(sum(e - s for s, e in spans), 2),
        "makespan_s": round(max(a["ended"] for a in attempts) - min(a["placed"] for a in attempts), 2),
        "steps": sum(a["step"] or 0 for a in attempts),
        "median_attempt_s": round(statistics.median(e - s for s, e in spans), 2),
        "_spans": spans, "_evals": [(e["time"], e["val_loss"]) for e in evals],
    }


def curve(m: dict) -> tuple[list[float], list[float]]:
    """(node-seconds spent, best eval val_loss so far) at each eval's arrival."""
    xs, ys, best = [], [], float("inf")
    for t, v in sorted(m["_evals"]):
        best = min(best, v)
        xs.append(sum(max(0.0, min(e, t) - s) for s, e in m["_spans"]))
        ys.append(best)
    return xs, ys


def plot(runs: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, m in runs.items():
        xs, ys = curve(m)
        ax.step(xs, ys, where="post", label=f"{name}: {m['node_s']:.0f} node-s, best {ys[-1]:.4f}")
        ax.axvline(m["node_s"], ls=":", color=ax.lines[-1].get_color())
    ax.set_xlabel("node-seconds spent (sum over attempts)")
    ax.set_ylabel("best eval val_loss so far")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=189, help="steps of a trial run to the end")
    p.add_argument("--grace", type=int, default=7, help="ASHA's first rung")
    p.add_argument("--eval-every", type=int, default=7)
    p.add_argument("--plot", type=Path, default=Path(__file__).parent / "results" / "asha-cpu.png")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        home = root / "home"
        env = {"SEGCTL_HOME": str(home)}
        import os
        os.environ.update(env)
        os.environ.pop("SEGCTL_CLUSTER", None)
        assert segctl("init-demo", root / "demo").returncode == 0
        paths = write_sweeps(root, root / "demo", args.iters, args.grace, args.eval_every)
        runs = {}
        try:
            for name, path in paths.items():
                proc = segctl("submit", path, timeout=1800)
                assert proc.returncode == 0, proc.stderr[-2000:]
                m = measure(home, f"{name}-1")
                runs[name] = m
                row(bench="asha", run=name, iters=args.iters, grace=args.grace,
                    eval_every=args.eval_every, reduction=3,
                    **{k: v for k, v in m.items() if not k.startswith("_")})
        finally:
            segctl("cluster", "down", timeout=300)
        full, asha = runs["full"], runs["asha"]
        row(bench="asha", run="ratio",
            best_val_loss=round(asha["best_val_loss"] / full["best_val_loss"], 4),
            best_eval_val_loss=round(asha["best_eval_val_loss"] / full["best_eval_val_loss"], 4),
            node_s=round(asha["node_s"] / full["node_s"], 4),
            makespan_s=round(asha["makespan_s"] / full["makespan_s"], 4),
            target_met=(asha["best_val_loss"] <= 1.05 * full["best_val_loss"]
                        and asha["node_s"] <= 0.40 * full["node_s"]))
        plot(runs, args.plot, f"27 trials of the demo model, {args.iters} steps, "
                              f"ASHA grace {args.grace}, reduction 3")


if __name__ == "__main__":
    main()
