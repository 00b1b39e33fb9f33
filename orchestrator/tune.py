"""`segctl tune`: measure a model's memory and step time on every node class of
the fleet once, so every later plan for it is a measured one.

The flow, top to bottom:
  1. `request`: the grid (sequence lengths x segment sizes), the fleet's node
     classes (chip + budget), and per class the points the plan table lacks
     (all of them with --force);
  2. the head runs each class's points on one free node of that class, classes in
     parallel (head.Controller.tune), and files every point in the plan table as
     it lands;
  3. `report`: per class the fitted memory model (orchestrator/measured.py), its
     leave-one-out error, and the plan `auto` now makes at each sequence length;
  4. `plot`: peak against segment size per class, with the budget lines.
"""

from __future__ import annotations

import time
from pathlib import Path

from segctl.schemas.atomic import write_atomic
from segctl.schemas.job import JobSpec, LoraSpec, MemorySpec
from segctl.schemas.records import NodeInfo

from . import measured, planner


def parse_ints(text: str, what: str, *, low: int) -> list[int]:
    """'1024,4096' -> [1024, 4096]; ValueError naming `what` otherwise."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < low:
            raise ValueError(f"{what}: {part!r} is not a whole number >= {low} "
                             f"(expected a comma-separated list like {'1024,4096' if low > 1 else '1,2,4'})")
        out.append(int(part))
    return sorted(set(out))


def tune_job(model: str, method: str, job: JobSpec | None) -> JobSpec:
    """The job whose settings the probes run with: `job`'s (LoRA, head_chunk,
    attn_block, ORPO's or DPO's prefix_shared) or the defaults, at segment_size auto."""
    if job is not None:
        return job.model_copy(update={
            "model": model, "method": method,
            "memory": job.memory.model_copy(update={"segment_size": "auto", "budget_gb": None})})
    return JobSpec(model=model, method=method, data={"train": "-"}, train={"iters": 1},
                   lora=LoraSpec(), memory=MemorySpec(segment_size="auto"))


def classes_of(nodes: list[NodeInfo]) -> dict[str, list[NodeInfo]]:
    out: dict[str, list[NodeInfo]] = {}
    for n in nodes:
        out.setdefault(n.node_class, []).append(n)
    return dict(sorted(out.items()))


def request(job: JobSpec, info: planner.ModelInfo, *, seq_lens: list[int], sizes: list[int],
            nodes: list[NodeInfo], root: Path, steps: int, force: bool) -> dict:
    """What head.tune needs; per class the points still to measure."""
    key = planner.model_key(info)
    have = measured.read_plan(root, key)
    grid = [(L, s) for L in seq_lens for s in sizes]
    classes = {}
    for cls, members in classes_of(nodes).items():
        mk = planner.tune_key(job, cls)
        done = set() if force else {(r["seq_len"], r["segment_size"]) for r in have
                                    if measured.match_key(r) == mk}
        classes[cls] = {"budget_gb": members[0].memory_gb, "nodes": [n.name for n in members],
                        "points": [p for p in grid if p not in done],
                        "reused": sum(p in done for p in grid)}
    return dict(model=job.model, model_key=key, model_name="/".join(Path(job.model).parts[-2:]),
                n_layers=info.n_layers, method=job.method,
                prefix_shared=job.prefix_shared, method_key=planner.method_key(job),
                lora=job.lora.model_dump(), head_chunk=job.memory.head_chunk,
                attn_block=job.memory.attn_block, mlp_chunk=job.memory.mlp_chunk, steps=steps,
                pack_rows=pack_rows(job), pack=job.data.pack, classes=classes,
                seq_lens=seq_lens, sizes=sizes)


def pack_rows(job: JobSpec) -> int:
    """Rows a probe's step holds: the job's micro-batch where its rows go together,
    packed (planner.packs) or side by side (LoRA dropout off), else 1 (one row of
    the point's length). Which of the two, and whether the family allows it, is
    left to the node: its probe decides on the model it loads and the device it
    runs, as the job's training does (engine/measure.py)."""
    together = planner.packs(job, packable=True) or job.lora.dropout == 0
    return job.train.batch_size if together and job.train.batch_size > 1 else 1


def wait(get_status, on_change, poll_s: float = 0.5) -> dict:
    """Poll the head until no class is queued or running; `on_change(status)` sees
    every status that differs from the one before."""
    last = None
    while True:
        status = get_status()
        if status != last:
            on_change(status)
            last = status
        if all(c["state"] not in ("queued", "running") for c in status["classes"].values()):
            return status
        time.sleep(poll_s)


def report(req: dict, job: JobSpec, info: planner.ModelInfo, rows: list[dict], fitted: dict, *,
           margin: float) -> dict:
    """Per class: the measured points (`rows`, the model's plan table), the fitted
    model's leave-one-out error and, per sequence length, what `auto` plans now
    (the fastest size that fits)."""
    out = []
    for cls, c in req["classes"].items():
        mk = planner.tune_key(job, cls)
        model = fitted.get(mk)
        points = [r for r in rows if measured.match_key(r) == mk]
        errors = measured.held_out(model) if model else []
        abs_err = [abs(e["error"]) for e in errors]
        plans = []
        for L in req["seq_lens"]:
            p = planner.plan(info, job, seq_len=L, budget_gb=c["budget_gb"], margin=margin,
                             measured=model)
            step_s = (model.step_s(L, p.segment_size)
                      if model and p.source == "measured" else None)
            plans.append(dict(seq_len=L, segment_size=p.segment_size if p.fits else None,
                              fits=p.fits, predicted_gb=p.predicted_gb,
                              step_s=round(step_s, 4) if step_s else None, source=p.source,
                              reason=p.reason))
        out.append(dict(
            node_class=cls, budget_gb=c["budget_gb"], nodes=c["nodes"],
            fitted=bool(model and model.coef),
            points=[dict(seq_len=r["seq_len"], segment_size=r["segment_size"], fits=r["fits"],
                         peak_gb=r["peak_gb"], step_s=r["step_s"], tune=r["tune"])
                    for r in points],
            held_out=dict(n=len(errors), max_abs_error=max(abs_err, default=None),
                          mean_abs_error=round(sum(abs_err) / len(abs_err), 4) if abs_err else None,
                          rows=errors),
            plans=plans))
    return dict(model=req["model"], model_name=req["model_name"], model_key=req["model_key"],
                method=req["method_key"], margin=margin, classes=out)


def plot(rep: dict, path: Path, n_layers: int, fitted: dict, job: JobSpec) -> Path:
    """PNG: per class, measured peak (dots; x: stopped by the guard) and the fitted
    model (lines) against segment size, one colour per sequence length, with the
    budget (solid) and budget less the margin (dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = rep["classes"]
    fig, axes = plt.subplots(1, len(classes), figsize=(5.5 * len(classes), 4.2), squeeze=False)
    sizes = list(range(1, n_layers + 1))
    for ax, c in zip(axes[0], classes):
        model = fitted.get(planner.tune_key(job, c["node_class"]))
        lengths = sorted({p["seq_len"] for p in c["points"]} | {p["seq_len"] for p in c["plans"]})
        for i, L in enumerate(lengths):
            colour = f"C{i % 10}"
            pts = [p for p in c["points"] if p["seq_len"] == L]
            ok = [p for p in pts if p["fits"]]
            bad = [p for p in pts if not p["fits"]]
            ax.plot([p["segment_size"] for p in ok], [p["peak_gb"] for p in ok], "o", color=colour,
                    label=f"{L} tokens")
            ax.plot([p["segment_size"] for p in bad], [p["peak_gb"] for p in bad], "x",
                    color=colour, markersize=9)
            if model is not None and model.gap(L) is None:
                ax.plot(sizes, [model.predict(L, s) for s in sizes], "-", color=colour, alpha=0.7)
        budget = c["budget_gb"]
        ax.axhline(budget, color="k", linewidth=1.2, label="budget")
        ax.axhline(budget * (1 - rep["margin"]), color="k", linestyle="--", linewidth=1,
                   label=f"budget less {rep['margin']:.0%} margin")
        err = c["held_out"]["max_abs_error"]
        ax.set_title(f"{c['node_class']}" + (f" (held-out error <= {err:.1%})" if err is not None
                                             else ""), fontsize=10)
        ax.set_xlabel("segment size (layers)")
        ax.set_ylabel("peak GB (log scale)")
        ax.set_yscale("log")   # a budget of GBs over probes of MBs, both readable
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{rep['model_name']} ({rep['method']})\nmeasured peak (o), stopped by the memory "
                 "guard (x), fitted model (lines)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return write_atomic(path, write=lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
