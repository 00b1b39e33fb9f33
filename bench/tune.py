"""Tune benchmark: held-out error of the measured memory model per node class, and
how long a tune of the demo model takes, on a local fleet of this machine.

    python -m bench.tune [--method sft|orpo] [--classes 0.06,2] [--seq-lens 256,512,1024]
                         [--sizes 1,2,4] [--off-lens 384,768] [--off-sizes 1,2,3,4]

One local Ray node per class (budget GB each), `segctl init-demo`'s model. Rows:
- tune: wall seconds of `segctl tune` over the grid (all classes in parallel),
  points measured, and per class the leave-one-out error the tune reports;
- retune: the same command again (every point reused: the incremental path);
- held_out: per class, the model fitted on the grid against points it never
  saw (lengths and sizes off the grid), measured afterwards by a second tune:
  predicted / measured - 1, max and mean of |error| over those that fit;
- point: each of those held-out points.

Target: held-out peak error <= 10%.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.orchestrator import row, segctl


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=["sft", "orpo"], default="sft")
    p.add_argument("--classes", default="0.06,2", help="budget GB per class, one node each")
    p.add_argument("--seq-lens", default="256,512,1024")
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--off-lens", default="384,768")
    p.add_argument("--off-sizes", default="1,2,3,4")
    args = p.parse_args(argv)
    from segctl.orchestrator import measured

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        init = segctl("init-demo", root / "demo", "--method", args.method)
        assert init.returncode == 0, init.stderr
        budgets = [float(b) for b in args.classes.split(",")]
        cluster = {"head": {"address": "auto", "port": _free_port(), "stores": str(root / "stores")},
                   "nodes": [{"name": f"node{i}", "local": True, "memory_gb": b,
                              "chip": f"sim{i}"} for i, b in enumerate(budgets)]}
        spec = root / "cluster.yaml"
        spec.write_text(yaml.safe_dump(cluster))
        up = segctl("cluster", "up", spec)
        assert up.returncode == 0, up.stderr
        try:
            model = root / "demo" / "model"
            common = ["--model", model, "--method", args.method, "--cluster", spec, "--json"]

            def tune(*extra):
                tic = time.perf_counter()
                proc = segctl("tune", *common, *extra)
                assert proc.returncode == 0, proc.stderr[-3000:]
                return json.loads(proc.stdout), time.perf_counter() - tic

            grid = ["--seq-lens", args.seq_lens, "--segment-sizes", args.sizes]
            rep, wall = tune(*grid)
            row(bench="tune", kind="tune", method=rep["method"], model=rep["model_key"],
                seconds=round(wall, 1), points=rep["measured"], seq_lens=args.seq_lens,
                sizes=args.sizes, classes=[
                    dict(node_class=c["node_class"], fits=sum(p["fits"] for p in c["points"]),
                         probed=len(c["points"]), loo_n=c["held_out"]["n"],
                         loo_max_abs=c["held_out"]["max_abs_error"],
                         loo_mean_abs=c["held_out"]["mean_abs_error"],
                         plans={p["seq_len"]: p["segment_size"] for p in c["plans"]})
                    for c in rep["classes"]])
            again, wall = tune(*grid)
            row(bench="tune", kind="retune", method=rep["method"], seconds=round(wall, 1),
                points=again["measured"], reused=again["reused"])

            key = rep["model_key"]
            before = measured.models_of(measured.read_plan(root / "stores", key))
            off, wall = tune("--seq-lens", args.off_lens, "--segment-sizes", args.off_sizes)
            fresh = [r for r in measured.read_plan(root / "stores", key) if r["tune"] == off["tune"]]
            for c in rep["classes"]:
                errors = []
                for r in fresh:
                    if r["node_class"] != c["node_class"] or not r["fits"]:
                        continue
                    m = before[measured.match_key(r)]
                    if m.gap(r["seq_len"]):
                        continue
                    pred = m.predict(r["seq_len"], r["segment_size"])
                    err = pred / r["peak_gb"] - 1
                    errors.append(err)
                    row(bench="tune", kind="point", method=rep["method"],
                        node_class=c["node_class"], seq_len=r["seq_len"],
                        segment_size=r["segment_size"], measured_gb=r["peak_gb"],
                        predicted_gb=round(pred, 6), error=round(err, 4))
                row(bench="tune", kind="held_out", method=rep["method"],
                    node_class=c["node_class"], n=len(errors),
                    max_abs_error=round(max(map(abs, errors)), 4) if errors else None,
                    mean_abs_error=round(sum(map(abs, errors)) / len(errors), 4) if errors else None,
                    off_lens=args.off_lens, off_sizes=args.off_sizes,
                    loo_max_abs=c["held_out"]["max_abs_error"])
        finally:
            segctl("cluster", "down", spec)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
