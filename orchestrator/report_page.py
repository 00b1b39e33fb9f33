"""The HTML of `segctl report`: one self-contained page. The data (report.collect)
goes in as JSON; a small plotting script of our own (report.js, shipped beside
this module as package data and inlined) draws it as SVG. Nothing is
fetched: no CDN, no fonts, no images, so the file opens anywhere, offline.

The page records every script error (window 'error', unhandled rejections,
console.error) in <html data-errors="[...]"> and, once drawn, the number of
charts in data-charts: a headless browser's dumped DOM says how it went.
"""

from __future__ import annotations

import html
import json
import math
from importlib.resources import files

CSS = r"""
:root { --bg:#f4f5f7; --card:#fff; --ink:#1d2330; --mute:#6b7385; --line:#e3e6ec;
        --grid:#eef0f4; --accent:#3b6fd8; --ok:#2e9d5b; --bad:#d9443b; --warn:#e08a1e; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif; }
header { background:linear-gradient(120deg,#1f2a44,#2f4a7f); color:#fff; padding:22px 32px 18px; }
header h1 { margin:0 0 6px; font-size:24px; font-weight:650; letter-spacing:.2px; }
header .sub { color:#c9d3ea; font-size:13px; }
.chips { display:flex; flex-wrap:wrap; gap:8px; margin-top:12px; }
.chip { background:rgba(255,255,255,.12); border-radius:999px; padding:3px 11px; font-size:12.5px; }
.chip b { font-weight:650; }
.kpis { display:grid; grid-template-columns:repeat(auto-fit,minmax(150px,1fr)); gap:12px;
        margin:-14px 32px 0; position:relative; }
.kpi { background:var(--card); border-radius:10px; padding:12px 16px;
       box-shadow:0 1px 3px rgba(20,30,60,.08),0 4px 14px rgba(20,30,60,.05); }
.kpi .v { font-size:22px; font-weight:650; }
.kpi .k { color:var(--mute); font-size:12px; text-transform:uppercase; letter-spacing:.5px; }
main { padding:18px 32px 40px; }
section { background:var(--card); border-radius:12px; padding:16px 20px 18px; margin:16px 0;
          box-shadow:0 1px 3px rgba(20,30,60,.08),0 4px 14px rgba(20,30,60,.05); }
section h2 { margin:0 0 4px; font-size:16px; font-weight:650; }
section p.note { margin:0 0 10px; color:var(--mute); font-size:12.5px; }
.row { display:flex; flex-wrap:wrap; gap:18px; }
.row > .plot { flex:1 1 520px; min-width:420px; max-width:860px; }
.plot { position:relative; }
.plot h3 { margin:6px 0 2px; font-size:13px; color:var(--mute); font-weight:600; }
svg { display:block; width:100%; height:auto; overflow:visible; }
svg text { font-family:inherit; fill:var(--mute); font-size:11px; }
svg .axis line, svg .axis path { stroke:#c5cad6; }
svg .gridline { stroke:var(--grid); }
.legend { display:flex; flex-wrap:wrap; gap:6px 10px; margin:8px 0 4px; align-items:center; }
.legend label { display:flex; align-items:center; gap:6px; cursor:pointer; padding:3px 9px;
                border:1px solid var(--line); border-radius:999px; font-size:12.5px;
                user-select:none; background:#fafbfc; }
.legend label.off { opacity:.4; }
.legend input { display:none; }
.sw { width:11px; height:11px; border-radius:3px; display:inline-block; flex:none; }
.legend .params { color:var(--mute); font-size:11.5px; }
button, select { font:inherit; font-size:12.5px; border:1px solid var(--line); background:#fff;
                 border-radius:7px; padding:3px 10px; cursor:pointer; color:var(--ink); }
button:hover { border-color:#b9c0cf; }
.tools { display:flex; gap:8px; align-items:center; flex-wrap:wrap; margin:4px 0; color:var(--mute);
         font-size:12.5px; }
.tip { position:absolute; pointer-events:none; background:rgba(25,31,45,.92); color:#fff;
       padding:5px 9px; border-radius:6px; font-size:12px; white-space:nowrap; display:none;
       z-index:5; }
table { border-collapse:collapse; width:100%; font-size:13px; }
th { text-align:left; color:var(--mute); font-weight:600; font-size:12px; border-bottom:1px solid var(--line);
     padding:6px 8px; }
td { padding:6px 8px; border-bottom:1px solid var(--grid); vertical-align:top; }
td.num { font-variant-numeric:tabular-nums; text-align:right; }
th.num { text-align:right; }
code { font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace; font-size:12px;
       color:#4a5266; }
.state { font-size:11.5px; font-weight:650; padding:2px 8px; border-radius:999px; }
.s-SUCCEEDED { background:#e3f4ea; color:#21804a; } .s-FAILED { background:#fbe4e2; color:#b8322a; }
.s-RUNNING, .s-PLACED { background:#e2ecfb; color:#2d5bb8; } .s-PENDING { background:#eef0f4; color:#596174; }
.s-STOPPED { background:#f3e6fa; color:#8a3bb0; } .s-CANCELLED { background:#eef0f4; color:#8a90a0; }
.s-OOM, .s-NODE_LOST { background:#fdf0dc; color:#a3600c; }
.medal { font-weight:700; color:#b58a12; }
footer { color:var(--mute); font-size:12px; padding:0 32px 30px; }
"""


# First in <head>: every error of the page's script, where a headless browser's DOM shows it.
CATCH = r"""
window.__errors = [];
window.__record = function (m) {
  window.__errors.push(String(m));
  document.documentElement.setAttribute("data-errors", JSON.stringify(window.__errors));
};
addEventListener("error", e => window.__record(e.message || "error"));
addEventListener("unhandledrejection", e => window.__record("unhandled rejection: " + e.reason));
(function () { const ce = console.error;
  console.error = function () { window.__record([].join.call(arguments, " ")); ce.apply(console, arguments); }; })();
"""


def script() -> str:
    """The page's plotting script, report.js, as the package holds it (a checkout's
    folder or an installed wheel alike)."""
    return files(__package__).joinpath("report.js").read_text(encoding="utf-8")


def _finite(x):
    """JSON has no NaN or Infinity: they go as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def esc(value) -> str:
    """The one way a value of the data enters the page's HTML: as text, whatever it is
    (a sweep's fields reach the stores from any client holding the head's token)."""
    return html.escape(str(value), quote=True)


def script_json(data) -> str:
    """`data` as JSON that is safe inside a <script> element: no `<` (so no
    `</script>` or `<!--`), `>` or `&` is left for the HTML parser to see, and no
    character outside ASCII (json's default); JSON.parse reads the escapes back."""
    blob = json.dumps(_finite(data), allow_nan=False, separators=(",", ":"))
    for c in "<>&":
        blob = blob.replace(c, f"\\u{ord(c):04x}")
    return blob


def _kpis(data: dict) -> list[tuple[str, str]]:
    """(label, value) pairs, both plain text."""
    trials = data["trials"]
    vals = [t["best_val_loss"] for t in trials if t["best_val_loss"] is not None]
    atts = [a for t in trials for a in t["attempts"]]
    sw = data["sweep"]
    span = ((sw["ended"] or data["generated"]) - sw["created"]) if sw["created"] else None
    steps = sum(t["steps"] or 0 for t in trials)
    return [("trials", str(len(trials))),
            ("best val loss", f"{min(vals):.4f}" if vals else "–"),
            ("attempts", f"{len(atts)}"),
            ("OOM re-plans", str(sum(a["outcome"] == "oom" for a in atts))),
            ("nodes lost", str(sum(a["outcome"] == "node_lost" for a in atts))),
            ("steps trained", f"{steps:,}"),
            ("wall time", _dur(span))]


def _gb(v) -> str:
    return f"{v:g} GB" if isinstance(v, (int, float)) else f"{v} GB"


def _dur(s) -> str:
    if s is None:
        return "–"
    s = int(round(s))
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def page(data: dict) -> str:
    """The whole HTML page for report.collect's `data`."""
    # Every value below is text until esc() makes it HTML; the markup around it is ours.
    sw = data["sweep"]
    chips = "".join(f'<span class="chip"><b>{esc(n)}</b> {esc(str(s).lower())}</span>'
                    for s, n in sorted(data["states"].items(), key=lambda kv: str(kv[0])))
    nodes = ", ".join(f'{n["node"]} ({_gb(n["budget_gb"])})' if n.get("budget_gb") else str(n["node"])
                      for n in data["nodes"])
    sched = sw.get("scheduler") or {}
    sub = " · ".join(esc(x) for x in (
        f"state {str(sw['state']).lower()}",
        f"concurrency {sw['concurrency']}" if sw.get("concurrency") else "",
        f"retries {sw['retries']}" if sw.get("retries") is not None else "",
        f"scheduler {sched.get('type') if isinstance(sched, dict) else sched}" if sched else "",
        f"nodes: {nodes}" if nodes else "") if x)
    kpis = "".join(
        f'<div class="kpi"><div class="k">{esc(k)}</div><div class="v">'
        + (f'<span id="trial-count">{esc(v)}</span>' if k == "trials" else esc(v))
        + "</div></div>" for k, v in _kpis(data))
    title = esc(f"segctl report: {sw['id']}")
    blob = script_json(data)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<script>{CATCH}</script>
<style>{CSS}</style></head>
<body>
<header><h1>Sweep {esc(sw['id'])}</h1><div class="sub">{sub}</div>
<div class="chips">{chips}</div></header>
<div class="kpis">{kpis}</div>
<main>
<section id="loss"><h2>Loss</h2><p class="note">Per trial; click a trial to hide or show it. Training
loss is smoothed (the raw curve is faint behind it); validation loss at each eval. A step
run again by a later attempt (a resume from a checkpoint) shows the later attempt's value.</p></section>
<section id="memory"><h2>Memory</h2><p class="note">Each phase's own peak per step (memory.zarr)
against the node's budget and the planner's predicted peak for that attempt; dashed lines are
earlier attempts of the trial.</p></section>
<section id="timeline"><h2>Attempts per node</h2><p class="note">Each bar an attempt (the faint part:
placed, waiting for its engine process); a red triangle marks an out-of-memory end (the trial
is re-planned with a smaller segment), an orange cross a lost node (the trial resumes from its
last checkpoint). Hover for details.</p></section>
<section id="params"><h2>Parameters</h2><p class="note">Each swept parameter against the
trial's best validation loss (final training loss where it had no validation set); lower is
better.</p></section>
<section id="best"><h2>Best adapters</h2></section>
<section id="trials"><h2>Trials</h2></section>
</main>
<footer>segctl report · generated from the stores (state.db, telemetry/, memory.zarr, adapters.zarr)</footer>
<script id="report-data" type="application/json">{blob}</script>
<script>
{script()}</script>
</body></html>
"""
