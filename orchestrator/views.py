"""What the CLI shows people: tables of trials, nodes and ports, log lines, the
one-line summaries commands end with. Programs get `--json` instead; nothing here
is parsed back. Every function takes plain records (dicts, the schemas' types)
and returns text or a rich renderable; the commands (orchestrator/cli/) print."""

from __future__ import annotations

import sys
import time

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from segctl.schemas.states import Outcome, SweepState, TrialState

# An attempt's outcome in the attempts column (the others as they are).
SHORT = {Outcome.SUCCEEDED: "ok", Outcome.NODE_LOST: "lost", Outcome.INTERRUPTED: "intr",
         Outcome.CANCELLED: "cancel"}
STATE_STYLE = {TrialState.SUCCEEDED: "green", TrialState.FAILED: "red", TrialState.CANCELLED: "dim",
               TrialState.RUNNING: "cyan", TrialState.PLACED: "cyan", TrialState.OOM: "yellow",
               TrialState.NODE_LOST: "yellow",
               TrialState.PENDING: "default",   # not "": "[]PENDING[/]" is a markup error
               TrialState.STOPPED: "magenta"}


def console() -> Console:
    """A terminal gets its own width; a pipe or file gets wide lines instead of
    rich's 80 columns, so tables stay readable in logs."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def _num(x, fmt):
    return "" if x is None else format(x, fmt)


def trials_table(sweep: dict) -> "TrialsTable":
    """A sweep's title line and one line per trial in aligned columns; the last
    column (params, or the trial's message) wraps under itself."""
    counts: dict = {}
    for t in sweep["trials"]:
        counts[t["state"]] = counts.get(t["state"], 0) + 1
    summary = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))
    about = [sweep["state"].lower()]
    if sweep.get("owner"):
        about.append(f"owner {sweep['owner']}")
    if sweep.get("priority"):
        about.append(f"priority {sweep['priority']}")
    if sweep.get("share", 1.0) != 1.0:
        about.append(f"share {sweep['share']:g}")
    head = ("trial", "state", "node", "seg", "step", "loss", "peak GB", "val loss", "attempts")
    rows, notes = [], []
    for t in sweep["trials"]:
        a = t["attempts"][-1] if t["attempts"] else {}
        outcomes = ",".join(SHORT.get(x["outcome"], x["outcome"] or x["status"])
                            for x in t["attempts"])
        note = t["message"] or " ".join(f"{k}={v}" for k, v in t["params"].items())
        reason = t.get("pending_reason") or ""   # why it is still PENDING, as the head last found it
        short = t["trial"][len(sweep["sweep"]) + 1:] if t["trial"].startswith(sweep["sweep"]) else t["trial"]
        rows.append((short, t["state"], a.get("node") or "", _num(a.get("segment_size"), "d"),
                     _num(a.get("step"), "d"), _num(a.get("loss"), ".4f"),
                     _num(a.get("peak_gb"), ".3f"), _num(t["val_loss"], ".4f"), outcomes))
        notes.append((reason + "  " + note, len(reason)) if reason else (note, 0))
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    return TrialsTable(f"{sweep['sweep']} ({', '.join(about)}): {summary}",
                       "  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  params / message",
                       [(r[0].ljust(widths[0]) + "  ", r[1].ljust(widths[1]),
                         "  " + "  ".join(c.ljust(w) for c, w in zip(r[2:], widths[2:])) + "  ",
                         *note) for r, note in zip(rows, notes)])


class TrialsTable:
    """trials_table's lines, laid out by hand for the console's width: rich's own
    wrapping of 20,000 lines took seconds; these are segments, wrapped only where a
    line is too long (its last column, at spaces, under itself)."""

    def __init__(self, title: str, header: str, rows: list[tuple[str, str, str, str, int]]):
        self.title, self.header, self.rows = title, header, rows   # row: left, state, mid, note, styled

    def __rich_console__(self, console, options):
        from rich.segment import Segment
        from rich.style import Style
        styles = {s: Style.parse(v) for s, v in STATE_STYLE.items()}
        reason_style, nl = Style.parse("yellow"), Segment.line()
        yield Text(self.title, style="italic")   # rich wraps these two
        yield Text(self.header, style="bold")
        width = options.max_width
        for left, state, mid, note, styled in self.rows:
            indent = len(left) + len(state) + len(mid)
            if width - indent < 20:   # a narrow terminal: rich wraps the whole line
                yield Text.assemble(left, (state, styles.get(state.strip(), "")), mid,
                                    (note[:styled], reason_style), note[styled:])
                continue
            yield Segment(left)
            yield Segment(state, styles.get(state.strip()))
            yield Segment(mid)
            for i, (a, b) in enumerate(_cut(note, width - indent)):
                if i:
                    yield nl
                    yield Segment(" " * indent)
                if a < styled:
                    yield Segment(note[a:min(b, styled)], reason_style)
                if b > styled:
                    yield Segment(note[max(a, styled):b])
            yield nl


def _cut(s: str, width: int) -> list[tuple[int, int]]:
    """(start, end) pieces of `s` of at most `width` characters, broken at spaces
    (a word longer than `width` is cut)."""
    out, a = [], 0
    while len(s) - a > width:
        b = s.rfind(" ", a + 1, a + width + 1)
        b = b if b > a else a + width
        out.append((a, b))
        a = b + 1 if s[b:b + 1] == " " else b
    out.append((a, len(s)))
    return out


def duration(seconds) -> str:
    """H:MM:SS (or "-" when not known)."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def watch_view(sweeps: list[dict]) -> Group:
    """One frame of `segctl status --watch`: per sweep (orchestrator/report.progress)
    its trials with a step bar and the time left, and the sweep's totals."""
    from rich.progress_bar import ProgressBar
    parts: list = []
    for sw in sweeps:
        tot = sw["totals"]
        counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(tot["states"].items()))
        table = Table(title=f"{sw['sweep']} ({sw['state'].lower()}): {counts}",
                      title_justify="left", expand=False)
        for col in ("trial", "state", "node", "progress", "step", "loss", "val loss",
                    "steps/s", "ETA", "attempts"):
            table.add_column(col, no_wrap=True)
        table.add_column("params / message", ratio=1)
        for t in sw["trials"]:
            iters, step = t["iters"], t["step"] or 0
            bar = (ProgressBar(total=iters, completed=min(step, iters), width=16,
                               finished_style="green",
                               complete_style="green" if t["state"] == TrialState.SUCCEEDED
                               else "cyan")
                   if iters else "")
            note = t["message"] or " ".join(f"{k}={v}" for k, v in t["params"].items())
            outcomes = ",".join(SHORT.get(x, x) for x in t["attempts"])
            table.add_row(t["short"], Text(t["state"], style=STATE_STYLE.get(t["state"], "")),
                          t["node"] or "", bar, f"{step}/{iters or '?'}", _num(t["loss"], ".4f"),
                          _num(t["val_loss"], ".4f"), _num(t["rate"], ".2f"),
                          duration(t["eta_s"]) if t["eta_s"] is not None else "",
                          outcomes, note)
        total = tot["total_steps"] or 0
        line = Table.grid(padding=(0, 1))
        line.add_row("[bold]sweep[/]",
                     ProgressBar(total=total or 1, completed=tot["steps"], width=40,
                                 finished_style="green"),
                     f"{tot['steps']}/{total} steps",
                     f"{tot['rate']:.2f} steps/s" if tot["rate"] else "",
                     f"ETA {duration(tot['eta_s'])}" if sw["state"] == SweepState.RUNNING
                     else f"{sw['state'].lower()}",
                     f"best val loss {tot['best_val_loss']:.4f}"
                     if tot["best_val_loss"] is not None else "")
        parts += [table, line]
    if not sweeps:
        parts.append("no sweeps yet: segctl submit SWEEP.yaml")
    parts.append(f"[dim]{time.strftime('%H:%M:%S')}  Ctrl-C to quit[/]")
    return Group(*parts)


def sweep_end_line(sid: str, sw: dict, root) -> str:
    """How a followed sweep ended (`submit`, `resume`): trials succeeded, stopped by
    its asha scheduler, and where the stores are."""
    stopped = sum(t["state"] == TrialState.STOPPED for t in sw["trials"])
    succeeded = sum(t["state"] == TrialState.SUCCEEDED for t in sw["trials"])
    return (f"sweep {sid} {sw['state'].lower()}: {succeeded} of {len(sw['trials'])} trials "
            f"succeeded" + (f", {stopped} stopped early (asha)" if stopped else "")
            + f"; stores in {root}")


def resolved_line(memory, plan, offload: str, budget_gb: float) -> str:
    """What `segctl train` made of a job's `auto` memory settings (`memory`, as
    written) on this machine: the planner's `plan` under `budget_gb`."""
    return (f"segment_size {memory.segment_size} -> {plan.segment_size}, offload "
            f"{memory.offload} -> {offload} (predicted peak {plan.predicted_gb:.2f} GB "
            f"of {budget_gb:g} GB, {plan.source})")


def fleet_up_line(info: dict, stores) -> str:
    """`segctl cluster up`: the head's address, the nodes up, the stores."""
    names = list(info.get("nodes") or {})
    if (info.get("head") or {}).get("node"):
        names.insert(0, f"{info['head']['node']} (on the head)")
    return (f"fleet up: head {info.get('address')}; nodes: {', '.join(names) or 'none'}; "
            f"stores {stores}")


def nodes_table(nodes: list[dict]) -> Table:
    table = Table(title="fleet", title_justify="left")
    for col in ("node", "chip", "memory GB", "os", "state", "trial", "labels"):
        table.add_column(col)
    for n in nodes:
        state = "down" if not n["alive"] else ("busy" if n.get("trial") else "free")
        table.add_row(n["name"], n["chip"], f"{n['memory_gb']:g}", n["os"], state,
                      n.get("trial") or "", " ".join(f"{k}={v}" for k, v in n["labels"].items()))
    return table


def check_nodes_table(report: dict) -> Table:
    """`segctl cluster check`'s nodes, the head first: a version or token unlike
    the head's is marked red."""
    from segctl.node.link import PACKAGES
    table = Table(title="cluster check: nodes", title_justify="left")
    for col in ("node", "ssh", *PACKAGES, "token", "memory GB", "chip", "address"):
        table.add_column(col)
    head = report["head"]

    def cell(value, same: bool) -> str:
        return str(value or "-") if same else f"[red]{value or 'none'}[/red]"

    for n in [dict(head, name="(head)", target="this machine", reachable=True)] + report["nodes"]:
        if not n["reachable"]:
            table.add_row(n["name"], f"[red]no: {n['target']}[/red]", *[""] * (len(PACKAGES) + 4))
            continue
        table.add_row(n["name"], "-" if n["name"] == "(head)" else "yes",
                      *[cell(n["versions"].get(p), n["versions"].get(p) == head["versions"].get(p))
                        for p in PACKAGES],
                      cell(n["token"], n["token"] == head["token"] and n["token"] is not None),
                      f"{n['memory_gb']:g}", n["chip"], n.get("address") or "-")
    return table


def check_pairs_table(pairs: list[dict]) -> Table:
    """`segctl cluster check`'s links, a pair a row: a sending to b's fleet address."""
    table = Table(title="cluster check: links (a -> b's fleet address)", title_justify="left")
    for col in ("a -> b", "address", "leaves a by", "latency ms", "MB/s", "note"):
        table.add_column(col)
    for p in pairs:
        if p.get("error"):
            table.add_row(f"{p['a']} -> {p['b']}", p["address"] or "-", "", "", "",
                          f"[red]{p['error']}[/red]")
            continue
        table.add_row(f"{p['a']} -> {p['b']}", p["address"], f"{p['interface']} ({p['kind']})",
                      f"{p['rtt_ms']:.3f}", f"{p['mb_per_s']:.0f}",
                      f"[yellow]{p['faster']} is faster[/yellow]" if p.get("faster") else "")
    return table


def ports_table(nodes: list[dict]) -> Table:
    """Per Ray node of `segctl cluster status`: the TCP ports its processes listen
    on, grouped by process and the address each is bound to."""
    table = Table(title="listening (TCP)", title_justify="left")
    for col in ("node", "address", "process", "pid", "bound to", "ports"):
        table.add_column(col)
    for n in nodes:
        if n.get("error"):
            table.add_row(n["name"], n["address"] or "", f"[red]{n['error']}[/]", "", "", "")
        by: dict = {}
        for p in n["listening"]:
            by.setdefault((p["process"], p["pid"], p["address"]), []).append(str(p["port"]))
        for (proc, pid, bound), nums in sorted(by.items(), key=lambda kv: int(kv[1][0])):
            table.add_row(n["name"], n["address"] or "", proc, str(pid),
                          "every interface" if bound == "*" else bound, ", ".join(nums))
    return table


def lab_hosts(lab) -> list[dict]:
    """`segctl lab up --json`: each host of the lab (segctl.lab.Lab) as a record."""
    return [{"name": h.name, "address": h.address, "home": str(h.home), "sshd_pid": h.sshd_pid}
            for h in lab.hosts]


def lab_lines(lab) -> list[str]:
    """`segctl lab up`: a line per host, then how to reach one."""
    return ([f"{h.name}  {h.address}  home {h.home}  sshd pid {h.sshd_pid}" for h in lab.hosts]
            + [f"ssh -F {lab.ssh_config} h1 CMD   (or PATH={lab.root / 'bin'}:$PATH ssh h1 CMD)"])


def plan_table(rows: list[dict]) -> Table:
    classes = sorted({c for r in rows for c in r["classes"]})
    table = Table(title="plan: segment size and predicted peak per node class",
                  title_justify="left")
    table.add_column("trial")
    table.add_column("params")
    table.add_column("tokens")
    for c in classes:
        table.add_column(c)
    for r in rows:
        cells = []
        for c in classes:
            p = r["classes"][c]
            cells.append(f"seg {p['segment_size']}, {p['predicted_gb']:.3f} GB, {p['source']}"
                         if p["fits"] else f"[red]does not fit[/] ({p['reason']})")
        table.add_row(r["trial"], " ".join(f"{k}={v}" for k, v in r["params"].items()),
                      str(r["seq_len"]), *cells)
    return table


def tune_start_line(req: dict, lengths: list[int], sizes: list[int], todo: int,
                    reused: int) -> str:
    """What `segctl tune` is about to measure (its request, `tune.request`'s)."""
    return (f"tuning {req['model_name']} ({req['method_key']}) on {len(req['classes'])} node "
            f"class(es): {len(lengths)} lengths x {len(sizes)} sizes; {todo} point(s) to "
            f"measure, {reused} reused from the plan table")


def tune_progress(status: dict) -> str:
    """One line per status change of a tune."""
    parts = []
    for cls, c in status["classes"].items():
        where = f" on {c['node']}" if c["node"] else ""
        extra = f" ({c['fits']} fit)" if c["done"] else ""
        err = f": {c['error']}" if c["error"] else ""
        parts.append(f"{cls}{where}: {c['state']} {c['done']}/{c['total']}{extra}{err}")
    return f"{status['tune']}: " + "; ".join(parts)


def tune_table(rep: dict) -> Table:
    """Per node class and sequence length: what `auto` plans from the measurements,
    and the measured peak at every probed segment size."""
    sizes = sorted({p["segment_size"] for c in rep["classes"] for p in c["points"]})
    table = Table(title=f"tune of {rep['model_key']} ({rep['method']}): best segment size per "
                        f"node class and length (fits the budget less {rep['margin']:.0%})",
                  title_justify="left")
    for col in ("node class", "tokens", "best seg", "predicted GB", "step s", "planner"):
        table.add_column(col, no_wrap=True)
    for s in sizes:
        table.add_column(f"seg {s} measured GB", no_wrap=True)
    for c in rep["classes"]:
        for p in c["plans"]:
            cells = []
            for s in sizes:
                m = next((x for x in c["points"]
                          if x["seq_len"] == p["seq_len"] and x["segment_size"] == s), None)
                cells.append("" if m is None else f"{m['peak_gb']:.4g}" if m["fits"]
                             else f"[red]>{c['budget_gb']:g}[/] (stopped)")
            best = (str(p["segment_size"]) if p["fits"] else "[red]does not fit[/]")
            table.add_row(c["node_class"], str(p["seq_len"]), best, f"{p['predicted_gb']:.4g}",
                          _num(p["step_s"], ".3g"), p["source"], *cells)
    return table


def tune_notes(rep: dict) -> list[str]:
    lines = []
    for c in rep["classes"]:
        h = c["held_out"]
        if h["n"]:
            lines.append(f"{c['node_class']}: held-out error over {h['n']} probes (each predicted "
                         f"from the others): max {h['max_abs_error']:.1%}, mean "
                         f"{h['mean_abs_error']:.1%}")
        elif not c["fitted"]:
            lines.append(f"{c['node_class']}: too few probes fit the budget to fit a model "
                         f"(needs 4 at 2+ lengths and 2+ sizes): plans stay analytic")
    for cls, err in rep.get("failed", {}).items():
        lines.append(f"{cls}: {err}")
    lines.append(f"{rep['tune']}: {rep['measured']} point(s) measured, {rep['reused']} reused, "
                 f"{rep['seconds']:.0f} s; plot {rep['plot']}")
    return lines


def transition_line(e: dict) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
    who = e["trial"] or e["sweep"]
    frm = f"{e['from_state']} -> " if e["from_state"] else ""
    return f"{when} {who}: {frm}{e['to_state']}: {e['reason']}"


def engine_line(e: dict) -> str:
    kind = e.get("event")
    when = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
    if kind == "step":
        pref = ""
        if e.get("margin") is not None:  # ORPO / DPO: margin, accuracy, which way it ran
            pref = (f", margin {e['margin']:+.3f}, acc {e['accuracy']:.0f}"
                    + ("" if e.get("prefix_shared") else ", two-branch"))
        return (f"{when}   step {e['step']}: loss {e['loss']:.4f}{pref}, "
                f"{e['tokens_per_s']:.0f} tok/s, "
                f"peak {e['peak_gb']:.3f} GB (active {e['active_gb']:.3f}, cache {e['cache_gb']:.3f})")
    if kind == "eval":
        return f"{when}   eval at step {e['step']}: val loss {e['val_loss']:.4f}"
    if kind == "start":
        return (f"{when}   start: {e['train_rows']} rows, {e['mode']} segment_size "
                f"{e['segment_size']}" + (" (fused)" if e.get("fused") else "")
                + (", rows side by side " + ("unpadded" if e.get("unpadded") else "padded")
                   if e.get("side_by_side") else "")
                + f", {e['total_steps']} steps"
                + (f", resumed at step {e['resumed_from']}" if e.get("resumed_from") else "")
                + "".join(f"\n{when}   {cls} runs whole rows (more memory on long rows): {why}"
                          for cls, why in (e.get("whole_rows") or {}).items()))
    if kind == "checkpoint":
        return f"{when}   checkpoint at step {e['step']} (shipped to the head)"
    if kind == "end":
        f = lambda x: "-" if x is None else f"{x:.4f}"
        return f"{when}   end: final loss {f(e['final_loss'])}, val loss {f(e['val_loss'])}"
    if kind == "error":
        return f"{when}   error ({e['kind']}): {e['message']}"
    if kind == "adapter":   # what the node sent, so the stored adapter can be checked against it
        return f"{when}   adapter sent: " + ", ".join(
            f"{name} sha256 {digest[:12]}" for name, digest in sorted(e["sha256"].items()))
    if kind == "phase":
        top = max(e["phases"], key=lambda p: p[1]) if e["phases"] else ("-", 0)
        return f"{when}   phases of step {e['step']}: highest {top[1]:.3f} GB at {top[0]}"
    return f"{when}   {e}"
