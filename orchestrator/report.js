// segctl report's plotting: scales, axes, lines and markers as SVG; nothing else.
// orchestrator/report_page.py inlines this file after the page's data element
// (#report-data, JSON); nothing is fetched.
"use strict";
const D = JSON.parse(document.getElementById("report-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#3b6fd8","#e4572e","#2e9d5b","#9b59b6","#f2a51a","#17a2b8","#d6457f",
                 "#7a8b2a","#8c564b","#5560c9","#c0392b","#16a085"];
const color = i => i < PALETTE.length ? PALETTE[i] : `hsl(${(i * 137.5) % 360},62%,48%)`;
D.trials.forEach((t, i) => { t.color = color(i); t.on = true; });
let charts = 0;

function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function h(tag, attrs, parent, text) {
  const e = document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
// Extrema by a loop: Math.max(...values) passes every value as an argument, and past
// a few hundred thousand of them (a long sweep's loss points) the call overflows the stack.
function least(values, start = Infinity) { let m = start; for (const v of values) if (v < m) m = v; return m; }
function most(values, start = -Infinity) { let m = start; for (const v of values) if (v > m) m = v; return m; }
const fmt = (v, d = 4) => v === null || v === undefined ? "–" : (+v).toFixed(d);
function fmtNum(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1).replace("e-", "e−");
  return +v.toPrecision(4) + "";
}
function fmtGB(v) {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "0";
  if (v >= 1) return +v.toPrecision(3) + " GB";
  if (v >= 1e-3) return +(v * 1e3).toPrecision(3) + " MB";
  return +(v * 1e6).toPrecision(3) + " kB";
}
function fmtDur(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  const hh = Math.floor(s / 3600), mm = Math.floor(s % 3600 / 60), ss = s % 60;
  return hh ? `${hh}h ${String(mm).padStart(2, "0")}m` : mm ? `${mm}m ${String(ss).padStart(2, "0")}s` : `${ss}s`;
}

// ---- scales
function niceStep(span, n) {
  const raw = span / Math.max(1, n), p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
}
function linear(lo, hi, a, b, pad = 0) {
  if (!(hi > lo)) { const c = isFinite(lo) ? lo : 0; lo = c - 1; hi = c + 1; }
  const span = hi - lo; lo -= span * pad; hi += span * pad;
  const s = v => a + (v - lo) / (hi - lo) * (b - a);
  s.ticks = n => { const st = niceStep(hi - lo, n), out = [];
    for (let v = Math.ceil(lo / st) * st; v <= hi + st * 1e-9; v += st) out.push(+v.toPrecision(12));
    return out; };
  s.lo = lo; s.hi = hi; s.fmt = fmtNum;
  return s;
}
function logScale(lo, hi, a, b) {
  if (!(lo > 0)) lo = 1e-6;
  if (!(hi > lo)) hi = lo * 10;
  const L = Math.log10(lo) - 0.08, H = Math.log10(hi) + 0.08;
  const s = v => a + (Math.log10(Math.max(v, 1e-30)) - L) / (H - L) * (b - a);
  s.ticks = () => { const out = [];
    for (let e = Math.floor(L); e <= Math.ceil(H); e++)
      for (const m of (H - L > 4 ? [1] : H - L > 2 ? [1, 3] : [1, 2, 5])) {
        const v = m * Math.pow(10, e); if (Math.log10(v) >= L && Math.log10(v) <= H) out.push(v); }
    return out; };
  s.lo = Math.pow(10, L); s.hi = Math.pow(10, H); s.fmt = fmtGB;
  return s;
}

// ---- a chart frame: svg, plot area, axes, grid, hover tooltip
function frame(parent, o) {
  const W = o.width || 620, H = o.height || 300;
  const m = Object.assign({ l: 58, r: 16, t: 12, b: 38 }, o.margin || {});
  const box = h("div", { class: "plot" }, parent);
  if (o.title) h("h3", {}, box, o.title);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" }, box);
  const f = { box, svg, W, H, m, x0: m.l, x1: W - m.r, y0: H - m.b, y1: m.t };
  f.grid = el("g", {}, svg); f.axes = el("g", { class: "axis" }, svg);
  f.plot = el("g", {}, svg); f.top = el("g", {}, svg);
  f.tip = h("div", { class: "tip" }, box);
  charts++;
  return f;
}
function drawAxes(f, x, y, o) {
  o = o || {};
  const xt = o.xticks || x.ticks(Math.max(3, Math.floor((f.x1 - f.x0) / 90)));
  for (const v of xt) {
    const px = x(v);
    if (px < f.x0 - 1 || px > f.x1 + 1) continue;
    el("line", { x1: px, x2: px, y1: f.y0, y2: f.y1, class: "gridline" }, f.grid);
    el("text", { x: px, y: f.y0 + 16, "text-anchor": "middle" }, f.axes,
       o.xfmt ? o.xfmt(v) : x.fmt(v));
  }
  for (const v of (o.yticks || y.ticks(5))) {
    const py = y(v);
    if (py > f.y0 + 1 || py < f.y1 - 1) continue;
    el("line", { x1: f.x0, x2: f.x1, y1: py, y2: py, class: "gridline" }, f.grid);
    el("text", { x: f.x0 - 7, y: py + 4, "text-anchor": "end" }, f.axes, o.yfmt ? o.yfmt(v) : y.fmt(v));
  }
  el("line", { x1: f.x0, x2: f.x1, y1: f.y0, y2: f.y0 }, f.axes);
  el("line", { x1: f.x0, x2: f.x0, y1: f.y0, y2: f.y1 }, f.axes);
  if (o.xlabel) el("text", { x: (f.x0 + f.x1) / 2, y: f.H - 4, "text-anchor": "middle" }, f.axes, o.xlabel);
  if (o.ylabel) el("text", { x: 12, y: (f.y0 + f.y1) / 2, "text-anchor": "middle",
                             transform: `rotate(-90 12 ${(f.y0 + f.y1) / 2})` }, f.axes, o.ylabel);
}
function path(pts, x, y) {
  let d = "";
  for (const [a, b] of pts) d += (d ? "L" : "M") + x(a).toFixed(1) + "," + y(b).toFixed(1);
  return d;
}
// lines: [[colour or null, text]], the first in bold; built as nodes, never as HTML
// text, so no value of the data is ever parsed as markup
function tipAt(f, evt, lines) {
  const br = f.box.getBoundingClientRect();
  f.tip.replaceChildren();
  lines.forEach(([c, text], i) => {
    if (i) h("br", {}, f.tip);
    if (c) { h("span", { class: "sw", style: `background:${c}` }, f.tip); f.tip.append(" "); }
    h(i ? "span" : "b", {}, f.tip, text);
  });
  f.tip.style.display = "block";
  let left = evt.clientX - br.left + 14;
  if (left + f.tip.offsetWidth > br.width) left = evt.clientX - br.left - f.tip.offsetWidth - 14;
  f.tip.style.left = left + "px"; f.tip.style.top = (evt.clientY - br.top - 10) + "px";
}
function paramText(p) { return Object.entries(p).map(([k, v]) => `${k.split(".").pop()}=${fmtNum(v)}`).join(" "); }

// ---- loss and val loss, one line per trial, toggled by the legend
function ema(pts, a) { let m = null; return pts.map(([s, v]) => [s, m = m === null ? v : a * v + (1 - a) * m]); }
function lossCharts() {
  const sec = document.getElementById("loss");
  const legend = h("div", { class: "legend" }, sec);
  const tools = h("div", { class: "tools" }, sec);
  const row = h("div", { class: "row" }, sec);
  let smooth = true;
  const all = h("button", {}, tools, "all"), none = h("button", {}, tools, "none"),
        top = h("button", {}, tools, "best 3");
  const sm = h("label", {}, tools); const cb = h("input", { type: "checkbox" }, sm);
  cb.checked = true; sm.append(" smooth training loss");
  const labels = [];
  D.trials.forEach(t => {
    const lab = h("label", { title: t.trial }, legend);
    const box = h("input", { type: "checkbox" }, lab); box.checked = true;
    h("span", { class: "sw", style: `background:${t.color}` }, lab);
    lab.append(t.short); h("span", { class: "params" }, lab, paramText(t.params));
    box.addEventListener("change", () => { t.on = box.checked; lab.classList.toggle("off", !t.on); draw(); });
    labels.push([t, box, lab]);
  });
  const set = pred => { for (const [t, box, lab] of labels) { t.on = box.checked = pred(t);
                                                            lab.classList.toggle("off", !t.on); } draw(); };
  all.onclick = () => set(() => true); none.onclick = () => set(() => false);
  const ranked = D.trials.filter(t => t.best_val_loss !== null).sort((a, b) => a.best_val_loss - b.best_val_loss);
  top.onclick = () => set(t => ranked.indexOf(t) >= 0 && ranked.indexOf(t) < 3);
  cb.onchange = () => { smooth = cb.checked; draw(); };
  const holder = [h("div", { class: "plot" }, row), h("div", { class: "plot" }, row)];
  function one(box, title, key, isTrain) {
    box.replaceChildren(); charts--;
    const f = frame(box, { title, width: 620, height: 300 });
    const on = D.trials.filter(t => t.on && t[key].length);
    const series = on.map(t => [t, isTrain && smooth ? ema(t[key], 0.25) : t[key]]);
    let xmax = -Infinity, ymin = Infinity, ymax = -Infinity;
    for (const [, pts] of series) for (const [s, v] of pts) {
      if (s > xmax) xmax = s; if (v < ymin) ymin = v; if (v > ymax) ymax = v; }
    const seen = xmax > -Infinity;
    const x = linear(0, seen ? xmax : most(D.trials.map(t => t.steps || 0), 1), f.x0, f.x1);
    const y = linear(seen ? ymin : 0, seen ? ymax : 1, f.y0, f.y1, 0.05);
    drawAxes(f, x, y, { xlabel: "step", ylabel: title.toLowerCase() });
    if (!series.length) el("text", { x: (f.x0 + f.x1) / 2, y: (f.y0 + f.y1) / 2, "text-anchor": "middle" },
                           f.plot, "no trial selected or no data yet");
    for (const [t, pts] of series) {
      if (isTrain && smooth) el("path", { d: path(t[key], x, y), fill: "none", stroke: t.color,
                                          "stroke-width": 1, opacity: 0.18 }, f.plot);
      el("path", { d: path(pts, x, y), fill: "none", stroke: t.color, "stroke-width": isTrain ? 1.8 : 2.2,
                   "stroke-linejoin": "round" }, f.plot);
      if (!isTrain) for (const [s, v] of pts)
        el("circle", { cx: x(s), cy: y(v), r: 3.2, fill: "#fff", stroke: t.color, "stroke-width": 1.8 }, f.plot);
    }
    const cross = el("line", { y1: f.y0, y2: f.y1, stroke: "#9aa3b5", "stroke-dasharray": "3 3", visibility: "hidden" }, f.top);
    f.svg.addEventListener("mousemove", evt => {
      const pt = f.svg.createSVGPoint(); pt.x = evt.clientX; pt.y = evt.clientY;
      const p = pt.matrixTransform(f.svg.getScreenCTM().inverse());
      if (p.x < f.x0 || p.x > f.x1 || !series.length) { cross.setAttribute("visibility", "hidden"); f.tip.style.display = "none"; return; }
      const step = x.lo + (p.x - f.x0) / (f.x1 - f.x0) * (x.hi - x.lo);
      const rows = series.map(([t, pts]) => { let best = null;
        for (const q of pts) if (best === null || Math.abs(q[0] - step) < Math.abs(best[0] - step)) best = q;
        return [t, best]; }).filter(r => r[1]).sort((a, b) => a[1][1] - b[1][1]);
      cross.setAttribute("x1", p.x); cross.setAttribute("x2", p.x); cross.setAttribute("visibility", "visible");
      tipAt(f, evt, [[null, `step ≈ ${Math.round(step)}`],
                     ...rows.map(([t, q]) => [t.color, `${t.short}: ${fmt(q[1])} @${q[0]}`])]);
    });
    f.svg.addEventListener("mouseleave", () => { cross.setAttribute("visibility", "hidden"); f.tip.style.display = "none"; });
  }
  function draw() { one(holder[0], "Training loss", "loss", true); one(holder[1], "Validation loss", "evals", false); }
  charts += 2; draw();
}

// ---- memory: per phase per step of one trial against its budget and prediction; all trials' peaks
function memoryCharts() {
  const sec = document.getElementById("memory");
  const tools = h("div", { class: "tools" }, sec);
  tools.append("trial ");
  const sel = h("select", {}, tools);
  const withMem = D.trials.filter(t => t.memory.length);
  withMem.forEach(t => h("option", { value: t.trial }, sel, `${t.short}  ${paramText(t.params)}`));
  const row = h("div", { class: "row" }, sec);
  const left = h("div", { class: "plot" }, row), right = h("div", { class: "plot" }, row);
  const PH = ["#3b6fd8", "#e4572e", "#2e9d5b", "#9b59b6", "#f2a51a", "#17a2b8", "#d6457f", "#7a8b2a"];
  function drawTrial() {
    left.replaceChildren(); charts--;
    const t = withMem.find(q => q.trial === sel.value) || withMem[0];
    const f = frame(left, { title: `Per-phase peak by step: ${t ? t.short : ""}`, width: 620, height: 310,
                            margin: { r: 120 } });
    if (!t) { el("text", { x: 300, y: 150, "text-anchor": "middle" }, f.plot, "no memory telemetry"); return; }
    const vals = t.memory.flatMap(m => m.peaks.flat().filter(v => v !== null));
    const pred = t.memory.map(m => m.predicted_gb).filter(v => v);
    const budget = most(t.memory.map(m => m.budget_gb || 0), 0);
    const top = most(pred, most(vals));
    // a budget far above every peak would squash the phases into one line: it is named instead
    const far = budget > 8 * top;
    const refs = far ? pred : pred.concat(budget ? [budget] : []);
    const lo = least(refs, least(vals)), hi = most(refs, most(vals));
    const y = hi / lo > 20 ? logScale(lo * 0.8, hi * 1.25, f.y0, f.y1)
                           : Object.assign(linear(0, hi * 1.12, f.y0, f.y1), { fmt: fmtGB });
    f.box.querySelector("h3").textContent = `Per-phase peak by step: ${t.short}` + (hi / lo > 20 ? " (log scale)" : "")
      + (far ? ` · budget ${fmtGB(budget)}, ${Math.round(budget / top).toLocaleString("en")}× this peak, is off the chart` : "");
    const steps = t.memory.flatMap(m => m.steps);
    const x = linear(least(steps) - 0.5, most(steps) + 0.5, f.x0, f.x1);
    drawAxes(f, x, y, { xlabel: "step", ylabel: "peak memory" });
    const phases = [...new Set(t.memory.flatMap(m => m.phases))];
    t.memory.forEach((m, k) => {
      m.phases.forEach((ph, j) => {
        const pts = m.steps.map((s, i) => [s, m.peaks[i][j]]).filter(p => p[1] !== null);
        el("path", { d: path(pts, x, y), fill: "none", stroke: PH[phases.indexOf(ph) % PH.length],
                     "stroke-width": 1.6, "stroke-dasharray": k < t.memory.length - 1 ? "4 3" : "" }, f.plot);
      });
      const s0 = x(least(m.steps) - 0.5), s1 = x(most(m.steps) + 0.5);
      for (const [v, c, name, dash] of [[m.predicted_gb, "#1d2330", "predicted", "6 4"], [m.budget_gb, "#d9443b", "budget", ""]]) {
        if (!v || (far && name === "budget")) continue;
        el("line", { x1: s0, x2: s1, y1: y(v), y2: y(v), stroke: c, "stroke-width": 1.6, "stroke-dasharray": dash }, f.plot);
        if (k === t.memory.length - 1)
          el("text", { x: f.x1 + 6, y: y(v) + 4, style: `fill:${c};font-weight:600` }, f.plot, `${name} ${fmtGB(v)}`);
      }
      if (t.memory.length > 1)
        el("text", { x: (s0 + s1) / 2, y: f.y1 + 12, "text-anchor": "middle" }, f.plot,
           `attempt ${m.attempt_no} · seg ${m.segment_size}` + (m.outcome && m.outcome !== "succeeded" ? ` · ${m.outcome}` : ""));
    });
    phases.forEach((ph, j) => {
      const yy = f.y0 - (phases.length - j) * 16 + 6;
      el("rect", { x: f.x1 + 8, y: yy - 8, width: 10, height: 10, rx: 2, fill: PH[j % PH.length] }, f.plot);
      el("text", { x: f.x1 + 24, y: yy + 1 }, f.plot, ph);
    });
  }
  sel.onchange = drawTrial;
  charts++; drawTrial();
  // every trial: measured peak (each attempt) against predicted and the node's budget
  const n = D.trials.length, H = Math.max(240, 80 + n * 26);
  const f = frame(right, { title: "Measured peak vs planner's prediction vs budget (log scale)", width: 620, height: H,
                           margin: { l: 64, t: 8, b: 62, r: 16 } });
  const vals = D.trials.flatMap(t => t.attempts.flatMap(a => [a.peak_gb, a.predicted_gb, a.budget_gb])).filter(v => v);
  const x = logScale(least(vals, 1e-3) * 0.7, most(vals, 1e-3) * 1.3, f.x0, f.x1);
  const band = (f.y0 - f.y1) / Math.max(1, n);
  const yAt = i => f.y1 + band * (i + 0.5);
  drawAxes(f, x, linear(0, 1, f.y0, f.y1), { yticks: [], xticks: x.ticks() });
  D.trials.forEach((t, i) => {
    el("text", { x: f.x0 - 8, y: yAt(i) + 4, "text-anchor": "end" }, f.plot, t.short);
    const as = t.attempts.filter(a => a.peak_gb || a.predicted_gb);
    as.forEach((a, k) => {
      const yy = yAt(i) + (as.length > 1 ? (k - (as.length - 1) / 2) * 7 : 0);
      if (a.peak_gb) {
        const r = el("rect", { x: f.x0, y: yy - 3.5, width: Math.max(1, x(a.peak_gb) - f.x0), height: 7, rx: 2,
                               fill: t.color, opacity: k === as.length - 1 ? 0.95 : 0.45 }, f.plot);
        el("title", {}, r, `${t.short} attempt ${a.attempt_no} on ${a.node} (seg ${a.segment_size}): peak ${fmtGB(a.peak_gb)}, predicted ${fmtGB(a.predicted_gb)}, budget ${fmtGB(a.budget_gb)}`);
      }
      if (a.predicted_gb) el("path", { d: `M${x(a.predicted_gb)},${yy - 7}v14`, stroke: "#1d2330", "stroke-width": 2 }, f.plot);
      if (a.budget_gb) el("path", { d: `M${x(a.budget_gb)},${yy - 8}v16`, stroke: "#d9443b", "stroke-width": 2.2 }, f.plot);
      if (a.outcome === "oom") el("text", { x: x(a.budget_gb || a.predicted_gb) - 6, y: yy + 4, "text-anchor": "end",
                                            style: "fill:#d9443b;font-weight:700;font-size:10px" }, f.plot, "OOM");
    });
  });
  const lx = f.x0 + 4, ly = f.y0 + 44;
  el("rect", { x: lx, y: ly - 8, width: 14, height: 7, fill: "#3b6fd8" }, f.plot);
  el("text", { x: lx + 18, y: ly - 1 }, f.plot, "measured peak");
  el("path", { d: `M${lx + 120},${ly - 10}v12`, stroke: "#1d2330", "stroke-width": 2 }, f.plot);
  el("text", { x: lx + 126, y: ly - 1 }, f.plot, "predicted");
  el("path", { d: `M${lx + 196},${ly - 10}v12`, stroke: "#d9443b", "stroke-width": 2.2 }, f.plot);
  el("text", { x: lx + 202, y: ly - 1 }, f.plot, "budget");
}

// ---- timeline: attempts per node, OOM and lost nodes marked
function timeline() {
  const sec = document.getElementById("timeline");
  const atts = D.trials.flatMap(t => t.attempts.map(a => Object.assign({ t }, a)));
  const nodes = [...new Set(atts.map(a => a.node))].sort();
  const lane = 48, H = 60 + nodes.length * lane;
  const f = frame(sec, { width: 1260, height: H, margin: { l: 70, r: 20, t: 8, b: 40 } });
  const t0 = least(atts.map(a => a.placed).filter(Boolean), D.sweep.created);
  const ends = atts.map(a => a.ended || D.generated);
  const t1 = most(ends, Math.max(t0 + 1, D.sweep.ended || 0));
  const x = linear(0, t1 - t0, f.x0, f.x1);
  const y = linear(0, nodes.length, f.y1, f.y0);
  drawAxes(f, x, y, { yticks: [], xfmt: fmtDur, xlabel: "time since the sweep was submitted" });
  nodes.forEach((n, i) => {
    const yy = f.y1 + i * lane;
    if (i % 2) el("rect", { x: f.x0, y: yy, width: f.x1 - f.x0, height: lane, fill: "#f8f9fb" }, f.grid);
    el("text", { x: f.x0 - 8, y: yy + lane / 2 + 4, "text-anchor": "end", style: "fill:#1d2330;font-weight:600" }, f.axes, n);
  });
  for (const a of atts) {
    const i = nodes.indexOf(a.node), yy = f.y1 + i * lane + 17;
    const s = (a.started || a.placed) - t0, e = (a.ended || D.generated) - t0;
    const bad = a.outcome && a.outcome !== "succeeded";
    const g = el("g", {}, f.plot);
    if (a.started && a.placed && a.started > a.placed)
      el("rect", { x: x(a.placed - t0), y: yy + 8, width: Math.max(1, x(a.started - t0) - x(a.placed - t0)),
                   height: lane - 33, fill: a.t.color, opacity: 0.25 }, g);
    el("rect", { x: x(s), y: yy, width: Math.max(2, x(e) - x(s)), height: lane - 21, rx: 4, fill: a.t.color,
                 opacity: bad ? 0.55 : 0.9, stroke: bad ? (a.outcome === "oom" ? "#d9443b" : "#e08a1e") : "none",
                 "stroke-width": bad ? 2 : 0, "stroke-dasharray": a.status !== "ended" ? "4 3" : "" }, g);
    if (x(e) - x(s) > 34)
      el("text", { x: x(s) + 6, y: yy + (lane - 21) / 2 + 4, style: "fill:#fff;font-weight:600" }, g,
         `${a.t.short}` + (x(e) - x(s) > 90 ? ` · seg ${a.segment_size}` : ""));
    if (a.outcome === "oom" || a.outcome === "node_lost") {
      const mx = x(e), my = yy - 2;
      if (a.outcome === "oom") el("path", { d: `M${mx},${my}l-5.5,-8h11z`, fill: "#d9443b" }, g);
      else el("path", { d: `M${mx - 4},${my - 9}l8,8m0,-8l-8,8`, stroke: "#e08a1e", "stroke-width": 2.4 }, g);
      el("text", { x: mx - 8, y: my - 2, "text-anchor": "end",
                   style: `fill:${a.outcome === "oom" ? "#d9443b" : "#c07012"};font-weight:700;font-size:10.5px` }, g,
         a.outcome === "oom" ? "OOM → re-plan smaller" : "node lost → resume");
    }
    el("title", {}, g, `${a.t.trial} attempt ${a.attempt_no} on ${a.node}: seg ${a.segment_size}, ` +
       `${a.outcome || a.status}${a.resume_step ? `, resumed at step ${a.resume_step}` : ""}` +
       `${a.message ? " — " + a.message : ""}; ${fmtDur(e - s)}`);
  }
}

// ---- each swept parameter against the trial's best val loss (final loss without one)
function paramCharts() {
  const sec = document.getElementById("params");
  const row = h("div", { class: "row" }, sec);
  const metric = t => t.best_val_loss !== null ? t.best_val_loss : t.final_loss;
  const pts = D.trials.filter(t => metric(t) !== null && metric(t) !== undefined);
  if (!D.params.length) { h("p", { class: "note" }, sec, "a single job: no swept parameter"); return; }
  for (const p of D.params) {
    const f = frame(row, { title: `${p} → best val loss`, width: 620, height: 300 });
    const vals = [...new Set(D.trials.map(t => t.params[p]))];
    const numeric = vals.every(v => typeof v === "number");
    const ys = pts.map(metric);
    const y = linear(least(ys), most(ys), f.y0, f.y1, 0.12);
    let x, opts = { xlabel: p, ylabel: "best val loss" };
    if (numeric && vals.length > 6) {
      const lo = least(vals), hi = most(vals);
      x = lo > 0 && hi / lo > 20 ? logScale(lo, hi, f.x0, f.x1) : linear(lo, hi, f.x0, f.x1, 0.08);
      if (lo > 0 && hi / lo > 20) opts.xfmt = fmtNum;
    } else {
      const cats = numeric ? vals.sort((a, b) => a - b) : vals.map(String).sort();
      const band = (f.x1 - f.x0) / cats.length;
      x = v => f.x0 + band * (cats.indexOf(numeric ? v : String(v)) + 0.5);
      x.fmt = fmtNum; opts.xticks = cats;
      opts.xfmt = v => numeric ? fmtNum(v) : String(v);
    }
    drawAxes(f, x, y, opts);
    const jit = {};
    for (const t of pts) {
      const v = t.params[p], key = String(v); jit[key] = (jit[key] || 0) + 1;
      const c = el("circle", { cx: x(v) + ((jit[key] - 1) % 5 - 2) * 3, cy: y(metric(t)), r: 6, fill: t.color,
                               opacity: 0.88, stroke: "#fff", "stroke-width": 1.5 }, f.plot);
      el("title", {}, c, `${t.short}: ${p}=${fmtNum(v)}, best val loss ${fmt(metric(t))}\n${paramText(t.params)}`);
    }
  }
}

// ---- the best adapters
function bestTable() {
  const sec = document.getElementById("best");
  const b = D.best;
  h("p", { class: "note" }, sec, b.source === "manifest"
    ? `from ${b.path} (what segctl gather exported)`
    : `segctl gather has not been pointed at here: the adapters segctl gather --best ${b.entries.length || "K"} would export, in its order`);
  if (!b.entries.length) { h("p", {}, sec, "no succeeded trial with an adapter yet"); return; }
  const tab = h("table", {}, sec), hr = h("tr", {}, h("thead", {}, tab));
  for (const c of ["#", "trial", "parameters", "best val loss", "final loss", "adapter", "step", "adapters.safetensors sha256", "checked"])
    h("th", { class: /loss|step/.test(c) ? "num" : "" }, hr, c);
  const body = h("tbody", {}, tab);
  b.entries.forEach((e, i) => {
    const t = D.trials.find(q => q.trial === e.trial), tr = h("tr", {}, body), m = e.metrics || {};
    h("td", { class: "medal" }, tr, i < 3 ? ["①", "②", "③"][i] : String(i + 1));
    const td = h("td", {}, tr); h("span", { class: "sw", style: `background:${t ? t.color : "#999"};margin-right:6px` }, td);
    td.append(t ? t.short : e.trial);
    h("td", {}, tr, paramText(e.params || {}));
    h("td", { class: "num" }, tr, fmt(m.best_val_loss !== undefined ? m.best_val_loss : m.val_loss));
    h("td", { class: "num" }, tr, fmt(m.final_loss));
    h("td", {}, tr, e.adapter || "");
    h("td", { class: "num" }, tr, e.step === null || e.step === undefined ? "–" : String(e.step));
    h("code", {}, h("td", {}, tr), ((e.files || {})["adapters.safetensors"] || "").slice(0, 16));
    h("td", { title: "every file against the sha256 its node recorded when it sent it" }, tr,
      e.verified === true ? "✓ node's sha256" : e.verified === false ? "no record" : "–");
  });
}

function trialTable() {
  const sec = document.getElementById("trials");
  const tab = h("table", {}, sec), hr = h("tr", {}, h("thead", {}, tab));
  for (const c of ["trial", "state", "parameters", "steps", "final loss", "best val loss", "peak", "predicted", "attempts", "message"])
    h("th", { class: /loss|steps|peak|predicted/.test(c) ? "num" : "" }, hr, c);
  const body = h("tbody", {}, tab);
  for (const t of D.trials) {
    const a = t.attempts[t.attempts.length - 1] || {}, tr = h("tr", {}, body);
    const td = h("td", {}, tr); h("span", { class: "sw", style: `background:${t.color};margin-right:6px` }, td); td.append(t.short);
    h("span", { class: `state s-${t.state}` }, h("td", {}, tr), t.state.toLowerCase());
    h("td", {}, tr, paramText(t.params));
    h("td", { class: "num" }, tr, String(t.steps || 0));
    h("td", { class: "num" }, tr, fmt(t.final_loss));
    h("td", { class: "num" }, tr, fmt(t.best_val_loss));
    h("td", { class: "num" }, tr, fmtGB(a.peak_gb));
    h("td", { class: "num" }, tr, fmtGB(a.predicted_gb));
    h("td", {}, tr, t.attempts.map(x => `${x.node}:${x.outcome || x.status}`).join(", "));
    h("td", {}, tr, t.message || "");
  }
}

for (const f of [lossCharts, memoryCharts, timeline, paramCharts, bestTable, trialTable]) {
  try { f(); } catch (e) { window.__record(`${f.name}: ${e && e.stack || e}`); }
}
document.documentElement.setAttribute("data-charts", String(charts));
