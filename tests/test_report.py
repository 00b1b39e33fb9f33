"""Seeing a sweep: `segctl status --watch` (JSON lines when piped, a live table with
step bars and ETAs on a terminal, Ctrl-C quits with 0) and `segctl report` (one
self-contained HTML page, opened in a real headless Chromium). The stores are a real
sweep's (tests/sweepworld.py: the head's controller, the real engine per attempt, one
real out-of-memory re-plan and one lost node)."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import time

import pytest

from segctl.orchestrator import report, views
from segctl.orchestrator.stores import Stores
from segctl.schemas.states import AttemptStatus, Outcome, SweepState, TrialState
from tests.conftest import assert_one_line_error, cli_env, segctl
from tests.sweepworld import ITERS, run_sweep

pytestmark = pytest.mark.slow   # one real 4-trial sweep (6 engine processes), ~35 s


@pytest.fixture(scope="module")
def swept(demo_dir, tmp_path_factory):
    """The sweep run to the end, and the watch's snapshots taken while it ran."""
    base = tmp_path_factory.mktemp("look")
    home = base / "home"
    memo, snaps, mid = report.new_memo(), [], []

    def watch(sid):   # what `status --watch` and `report` would show, read from the stores mid-run
        db = report.open_db(home)
        try:
            snaps.append(report.progress(db, Stores(home), sid, memo))
        finally:
            db.close()
        if not mid and any(t["state"] == TrialState.RUNNING and (t["step"] or 0) > 5
                           for t in snaps[-1][0]["trials"]):
            mid.append((snaps[-1][0], report.collect(home, sid)))
    info = run_sweep(demo_dir, home, base / "work", on_batch=watch)
    return dict(info, home=home, env={"SEGCTL_HOME": home, "SEGCTL_CLUSTER": None}, snaps=snaps,
                mid=mid)


# ==================================================================== status --watch

def test_watch_piped_prints_json_snapshots_and_stops(swept):
    proc = segctl("status", swept["sweep"], "--watch", "--count", "3", "--interval", "0.1",
                  env=swept["env"])
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(l) for l in proc.stdout.splitlines()]
    assert len(lines) == 3 and lines[0]["time"] < lines[1]["time"] < lines[2]["time"]
    [sw] = lines[-1]["sweeps"]
    assert sw["sweep"] == swept["sweep"] and sw["state"] == SweepState.DONE
    assert [t["trial"] for t in sw["trials"]] == swept["trials"]
    assert sw["totals"]["steps"] == sw["totals"]["total_steps"] == 4 * ITERS
    assert sw["totals"]["states"] == {TrialState.SUCCEEDED: 4} and sw["totals"]["eta_s"] is None
    by = {t["trial"]: t for t in sw["trials"]}
    assert by[swept["oom"]]["attempts"] == [Outcome.OOM, Outcome.SUCCEEDED]
    assert by[swept["lost"]]["attempts"] == [Outcome.NODE_LOST, Outcome.SUCCEEDED]
    assert all((t["step"], t["iters"]) == (ITERS, ITERS) for t in sw["trials"])

    # --until-done: a finished sweep is one snapshot
    done = segctl("status", "--watch", "--until-done", env=swept["env"])
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1, done.stderr


def test_watch_of_an_unknown_sweep_is_one_line(swept):
    assert_one_line_error(segctl("status", "nope-1", "--watch", env=swept["env"]), "nope-1")


def _as_from_a_terminal() -> None:
    """Ctrl-C at its default in the child, as a terminal's shell starts a command: a
    test run started in the background (`make test &`) has it ignored, and the child
    would inherit that (Python installs its handler only over the default)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_watch_quits_on_ctrl_c_with_0_piped_and_on_a_terminal(swept):
    cmd = [sys.executable, "-m", "segctl.orchestrator.cli", "status", swept["sweep"], "--watch",
           "--interval", "0.2"]
    env = cli_env() | {"SEGCTL_HOME": str(swept["home"])}
    env.pop("SEGCTL_CLUSTER", None)
    piped = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, preexec_fn=_as_from_a_terminal)
    json.loads(piped.stdout.readline())   # it is watching
    piped.send_signal(signal.SIGINT)
    out, err = piped.communicate(timeout=60)
    assert piped.returncode == 0 and "Traceback" not in err, err

    # on a terminal: the live table, and the cursor shown again when it quits
    main, sub = pty.openpty()
    live = subprocess.Popen(cmd, stdin=sub, stdout=sub, stderr=sub, env=env | {"COLUMNS": "160"},
                            start_new_session=True, preexec_fn=_as_from_a_terminal)
    os.close(sub)
    seen = b""
    deadline = time.time() + 60
    while b"Ctrl-C to quit" not in seen and time.time() < deadline:
        if select.select([main], [], [], 1)[0]:
            seen += os.read(main, 65536)
    assert b"Ctrl-C to quit" in seen and "━".encode() in seen, seen[-2000:]
    os.killpg(live.pid, signal.SIGINT)   # what the terminal sends on Ctrl-C
    assert live.wait(timeout=60) == 0
    while select.select([main], [], [], 0.5)[0]:
        try:
            chunk = os.read(main, 65536)
        except OSError:   # the other end closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    assert b"Traceback" not in seen and seen.rstrip().endswith(b"\x1b[?25h"), seen[-500:]


def test_a_frame_shows_step_bars_eta_and_totals(swept):
    """One frame of the live table, rendered from a snapshot taken while trials ran."""
    running = [(s, t) for snap in swept["snaps"] for s in snap for t in s["trials"]
               if t["state"] == TrialState.RUNNING and t["eta_s"] is not None and 0 < t["step"] < ITERS]
    assert running, "no snapshot caught a running trial with a step rate"
    sw, t = running[len(running) // 2]
    assert t["rate"] > 0 and t["eta_s"] == pytest.approx((ITERS - t["step"]) / t["rate"], abs=0.1)
    assert sw["totals"]["eta_s"] is not None and sw["totals"]["rate"] >= t["rate"]
    console = views.Console(file=io.StringIO(), width=180, record=True)
    console.print(views.watch_view([sw]))
    text = console.export_text()
    row = next(l for l in text.splitlines() if f" {t['short']} " in l)
    assert "━" in row and f"{t['step']}/{ITERS}" in row and views.duration(t["eta_s"]) in row
    assert f"ETA {views.duration(sw['totals']['eta_s'])}" in text
    assert f"{sw['totals']['steps']}/{4 * ITERS} steps" in text


# ==================================================================== report

def test_report_data_is_the_sweeps(swept, tmp_path):
    data = report.collect(swept["home"], swept["sweep"])
    by = {t["trial"]: t for t in data["trials"]}
    assert list(by) == swept["trials"] and data["params"] == ["train.learning_rate", "lora.rank"]
    for t in data["trials"]:
        assert [s for s, _ in t["loss"]] == list(range(1, ITERS + 1)), t["trial"]
        assert [s for s, _ in t["evals"]] == list(range(5, ITERS + 1, 5))
        assert t["best_val_loss"] == pytest.approx(min(v for _, v in t["evals"]), abs=1e-6)
        m = t["memory"][-1]
        assert m["phases"] and len(m["steps"]) == len(m["peaks"]) and m["budget_gb"] == 8.0
        assert m["predicted_gb"] > 0
    oom, ok = by[swept["oom"]]["attempts"]
    assert oom["outcome"] == Outcome.OOM and ok["segment_size"] < oom["segment_size"]
    lost, resumed = by[swept["lost"]]["attempts"]
    assert lost["outcome"] == Outcome.NODE_LOST and resumed["resume_step"] == 24
    # the best adapters: ranked as gather ranks them, until gather has run
    ranked = [e["trial"] for e in data["best"]["entries"]]
    assert data["best"]["source"] == "ranking" and ranked == sorted(
        by, key=lambda k: by[k]["best_val_loss"])
    out = tmp_path / "best"
    g = segctl("gather", swept["sweep"], "--out", out, "--best", "2", env=swept["env"])
    assert g.returncode == 0, g.stderr
    gathered = report.collect(swept["home"], swept["sweep"], gathered=out)["best"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert gathered["source"] == "manifest" and gathered["entries"] == manifest
    assert manifest == data["best"]["entries"][:2]   # the same entries, files' sha256 too
    # each file checked against the sha256 its node recorded (resumed trials included)
    assert all(e["verified"] for e in manifest) and stat.S_IMODE(out.stat().st_mode) == 0o700


def test_report_while_trials_run_reads_their_staged_telemetry(swept):
    """Before an attempt is sealed its steps are only in staging.db: the report has them."""
    assert swept["mid"], "no report was taken while a trial ran"
    snap, data = swept["mid"][0]
    by = {t["trial"]: t for t in data["trials"]}
    running = [t for t in snap["trials"] if t["state"] == TrialState.RUNNING and (t["step"] or 0) > 5]
    assert running
    for t in running:
        steps = [s for s, _ in by[t["trial"]]["loss"]]
        assert steps[:t["step"]] == list(range(1, t["step"] + 1)), t["trial"]
        assert by[t["trial"]]["attempts"][-1]["status"] != AttemptStatus.ENDED
    assert data["sweep"]["state"] == SweepState.RUNNING and "<" not in report.render(data).split(
        'id="report-data" type="application/json">')[1].split("</script>")[0]


def test_report_refuses_bad_input_in_one_line(swept, tmp_path):
    assert_one_line_error(segctl("report", "nope-1", "--out", tmp_path / "r.html",
                                 env=swept["env"]), "nope-1")
    (tmp_path / "g").mkdir()
    (tmp_path / "g/manifest.json").write_text("{not json")
    assert_one_line_error(segctl("report", swept["sweep"], "--gathered", tmp_path / "g",
                                 "--out", tmp_path / "r.html", env=swept["env"]),
                          "manifest.json")
    assert not (tmp_path / "r.html").exists()


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)
# Headless in a container: no zygote (its forked children never answer there), no /dev/shm limits.
HEADLESS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-zygote",
            "--disable-dev-shm-usage", "--hide-scrollbars", "--virtual-time-budget=5000"]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (make install adds it on "
                                              "Debian/Ubuntu as root)")
def test_report_opens_in_headless_chromium(swept, tmp_path):
    from PIL import Image
    page = tmp_path / "report.html"
    proc = segctl("report", swept["sweep"], "--out", page, env=swept["env"])
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in text and "<link" not in text and " src=" not in text  # all inline

    dom = subprocess.run([CHROMIUM, *HEADLESS, "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    head = html[:html.index(">", html.index("<html")) + 1]
    assert "data-errors" not in head, head   # the page records any script error there
    assert 'data-charts="7"' in head, head   # 2 loss, 2 memory, 1 timeline, 2 parameters
    assert f'<span id="trial-count">{len(swept["trials"])}</span>' in html
    assert html.count("<path") > 20 and html.count("<circle") >= 4 * 6 + 4   # drawn

    shot = tmp_path / "report.png"
    run = subprocess.run([CHROMIUM, *HEADLESS, "--window-size=1400,2600",
                          f"--screenshot={shot}", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 2600)
    # the loss charts' band: many colours (lines, antialiasing), not an empty card
    band = img.crop((0, 380, 1400, 720))
    assert len(band.getcolors(1 << 20)) > 300
    assert len(img.getcolors(1 << 20)) > 1000


def dump_dom(page, timeout=120) -> str:
    """The page's DOM once its script ran, from headless Chromium (without the
    OpenBLAS preload the tests run under: it breaks Chromium)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    dom = subprocess.run([CHROMIUM, *HEADLESS, "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=timeout, env=env)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def head_of(dom: str) -> str:
    return dom[:dom.index(">", dom.index("<html")) + 1]


# What a client holding the head's token could put in a sweep's fields (the head
# took `retries` unchecked): each, if parsed as markup, would set the page's title.
HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"
SCRIPTED = "</script><script>document.title='pwned'</script><!--"


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary")
def test_hostile_stored_fields_render_inert(swept, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(swept["home"], home)
    db = sqlite3.connect(home / "state.db")
    with db:
        spec = json.loads(db.execute("SELECT spec FROM sweeps WHERE id = ?",
                                     (swept["sweep"],)).fetchone()[0])
        spec.update(retries=HOSTILE, concurrency=SCRIPTED, scheduler={"type": HOSTILE})
        db.execute("UPDATE sweeps SET spec = ?, name = ? WHERE id = ?",
                   (json.dumps(spec), HOSTILE, swept["sweep"]))
        db.execute("UPDATE trials SET message = ?, params = ? WHERE sweep = ?",
                   (SCRIPTED, json.dumps({HOSTILE: HOSTILE, "lr": SCRIPTED}), swept["sweep"]))
        db.execute("UPDATE attempts SET node = ?, message = ?, chip = ? WHERE sweep = ?",
                   (HOSTILE, SCRIPTED, HOSTILE, swept["sweep"]))
    db.close()
    page = tmp_path / "r.html"
    proc = segctl("report", swept["sweep"], "--out", page, env={"SEGCTL_HOME": home,
                                                                 "SEGCTL_CLUSTER": None})
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    assert "<img" not in text and "</script><script>" not in text and "<!--" not in text
    assert "retries &lt;img src=x onerror=&quot;document.title=" in text   # shown, as text

    dom = dump_dom(page)
    head = head_of(dom)
    assert "data-errors" not in head and 'data-charts="' in head, head
    assert "<title>segctl report:" in dom and "pwned</title>" not in dom
    assert "<img" not in dom and dom.count("<script") == 3   # ours: catch, data, plot
    assert "&lt;img src=x onerror=" in dom   # the node names, messages, params: as text


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary")
def test_three_hundred_trials_of_a_thousand_points_draw(swept, tmp_path):
    """Past ~240,000 points `Math.max(...xs)` overflowed the stack: the charts take
    their extrema in loops. The page is the real sweep's report with its trials
    multiplied to 300, each with 1,000 loss points: 300,000 in the loss chart."""
    data = report.collect(swept["home"], swept["sweep"])
    real = data["trials"]
    trials = []
    for i in range(300):
        t = json.loads(json.dumps(real[i % len(real)]))
        t["trial"], t["short"] = f"{swept['sweep']}-t{i:04d}", f"t{i:04d}"
        t["params"] = {"train.learning_rate": 1e-5 * (1 + i), "lora.rank": 4 << (i % 3)}
        t["loss"] = [[s, round(3.0 / (1 + s / 200) + (i % 7) * 0.01, 6)] for s in range(1, 1001)]
        t["evals"] = [[s, round(3.2 / (1 + s / 200) + (i % 5) * 0.01, 6)]
                      for s in range(100, 1001, 100)]
        t["steps"], t["best_val_loss"] = 1000, t["evals"][-1][1]
        trials.append(t)
    data["trials"] = trials
    page = tmp_path / "big.html"
    page.write_text(report.render(data))

    tic = time.perf_counter()
    dom = dump_dom(page, timeout=180)
    seconds = time.perf_counter() - tic
    head = head_of(dom)
    assert "data-errors" not in head, head[:3000]
    assert 'data-charts="7"' in head, head
    assert '<span id="trial-count">300</span>' in dom
    assert dom.count("<path") > 2 * 300   # every trial's loss line (raw and smoothed)
    assert seconds < 120, seconds


def test_the_start_line_names_the_layers_kept_whole():
    e = dict(event="start", time=0, train_rows=3, mode="segmented", segment_size=1,
             total_steps=2, whole_rows={"Block": "the row-wise probe raised X: y"})
    first, second = views.engine_line(e).splitlines()
    assert first.endswith("start: 3 rows, segmented segment_size 1, 2 steps")
    assert second.endswith("Block runs whole rows (more memory on long rows): "
                           "the row-wise probe raised X: y")
    assert "\n" not in views.engine_line(dict(e, whole_rows=None))


def test_the_start_line_says_how_rows_run_side_by_side():
    e = dict(event="start", time=0, train_rows=3, mode="segmented", segment_size=4, fused=True,
             total_steps=2, side_by_side=True, unpadded=True)
    assert views.engine_line(e).endswith(
        "start: 3 rows, segmented segment_size 4 (fused), rows side by side unpadded, 2 steps")
    assert "rows side by side padded," in views.engine_line(dict(e, unpadded=False))
