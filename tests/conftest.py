"""Shared fixtures: tiny real models written in Hugging Face layout by our own
demo code and loaded through mlx-lm's loader, and a runner for the real CLI."""

from __future__ import annotations

import contextlib
import os
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


# `make test-fast` (the inner loop, under 2 minutes on 2 cores) leaves out what
# starts Ray fleets or a lab (`fleet`), and (`slow`) the walk over every model
# family and the longest single tests, each of which has a quicker test of the
# same thing left in: engine exactness (test_step, test_windows, test_long's
# equal-plain tests, the ORPO/DPO gradient tests), the planner (test_planner),
# specs and CLI errors (test_spec, test_hostile in-process, test_fuzz_specs,
# test_train_cli's bad inputs), the stores (test_stores), the head's decisions
# (test_head_isolation, test_controller), a CLI run whose adapter mlx-lm loads
# (test_qlora, test_stores). `make test` runs everything. The lanes are marks on
# the tests: `pytestmark = pytest.mark.fleet` (or `slow`) in a module, else
# `@pytest.mark.slow` on a test with its time on 2 idle cores beside it
# (tests/test_lanes.py checks that what starts Ray or a lab is marked `fleet`).


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on a fleet (a fixture that holds a stores folder) carries the
    tail of the fleet's logs (the head's, each node's `ray start`): a failure seen
    once in CI then says what the head did."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for value in getattr(item, "funcargs", {}).values():
        stores = value.get("stores") if isinstance(value, dict) else None
        if isinstance(stores, Path):
            for log in sorted((stores / "logs").glob("*.log")):
                lines = log.read_text(errors="replace").splitlines()[-40:]
                report.sections.append((f"fleet log {log.name} (last lines)", "\n".join(lines)))


def cpu_seconds() -> float:
    """CPU seconds this process and the children it has waited for have spent. A
    test that bounds a cost reads this, not the wall clock: the suite's three lanes
    share 2 cores, and a worker's wall time there is mostly waiting for one (CI once
    saw a refusal of 0.2 s of CPU take 19 s of wall time while a fleet started beside it)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if Path(OPENBLAS).exists():
        env.setdefault("LD_PRELOAD", OPENBLAS)
    return env


def segctl(*args, cwd=None, timeout=300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `segctl` CLI in a fresh process (stdout is a pipe, so events are JSON).
    `env` adds to (or, with None values, removes from) the environment."""
    full = cli_env()
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = str(v)
    return subprocess.run([sys.executable, "-m", "segctl.orchestrator.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=full, timeout=timeout)


def assert_one_line_error(proc, *fragments, code=2):
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert err.count("\n") == 0, err
    for f in fragments:
        assert f in err, (f, err)
    return err


@contextlib.contextmanager
def locked(path: Path):
    """An SQLite file held by another connection's exclusive lock, as another
    process holding it would, for the duration of the block."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def free_earlier_arrays() -> None:
    """A peak measured in this process counts every live array: free what earlier
    tests left in reference cycles (models and their closures) before measuring."""
    import gc
    gc.collect()


def probe_fresh(spec, tmp: Path) -> list[dict]:
    """Probe events for `spec` (a ProbeSpec) measured the way a node measures them:
    in a fresh `segctl.node.worker --probe` process, so the peaks hold this model alone
    and not whatever arrays earlier tests left alive in the test process."""
    import json
    spec_file = tmp / f"probe-{os.getpid()}-{id(spec)}.json"
    spec_file.write_text(spec.model_dump_json())
    # The worker exits when its stdin closes (its parent is gone): keep it open.
    with open(spec_file.with_suffix(".err"), "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "segctl.node.worker", "--probe",
                                 str(spec_file)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, env=cli_env(), cwd=ROOT)
        out = proc.stdout.read()
        proc.stdin.close()
        err.seek(0)
        assert proc.wait(timeout=600) == 0, (proc.returncode, out[-2000:], err.read()[-2000:])
    return [e for e in map(json.loads, out.splitlines()) if e.get("event") == "probe"]


# Families whose tiny random instance amplifies float32 rounding: a forward that
# rounds differently (its MLP in chunks of rows, one ulp away from the whole row's
# matmul; prefix-shared against two-branch attention) turns that into 1e-4 to 5e-4
# of gradient. They are compared in float64, where the same steps agree to ~3e-7
# (against ~3e-3 at float32, and whatever the chunking), so a wrong step still shows.
WIDE = {"gemma4", "gemma4_text"}


def step_kw(**kw) -> dict:
    """loss_and_grads' keywords from a flat dict: the memory ones (segment_size,
    head_chunk, ...) gathered into its `memory`, the others as they are. For tests
    that sweep a table of settings."""
    import dataclasses

    from segctl.engine.settings import StepMemory
    names = {f.name for f in dataclasses.fields(StepMemory)}
    memory = {k: kw.pop(k) for k in list(kw) if k in names}
    return {**kw, "memory": StepMemory(**memory)} if memory else kw


def random_lora(model, *, dropout: float = 0.0):
    """Put rank-4 LoRA on every linear of `model` with every adapter weight drawn at
    random (seed the generator first): LoRA's B starts at zero, which would make
    every A gradient zero, so this makes every gradient a real, non-trivial number."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from segctl.engine.model import apply_lora
    apply_lora(model, rank=4, scale=2.0, dropout=dropout)
    model.load_weights([(n, 0.05 * mx.random.normal(v.shape))
                        for n, v in tree_flatten(model.trainable_parameters())], strict=False)
    mx.eval(model.parameters())
    return model


def letter_model(root: Path, n_train: int, n_valid: int, words: tuple[int, int]) -> None:
    """ROOT/model (qwen3, 4 layers x 64) and ROOT/data/{train,valid}.jsonl of long
    prompt/completion rows: letters counting on from a start letter, `words`
    letters each (one token per letter), so a segment's activations dominate
    the peak."""
    import json
    import random
    import string

    from segctl.engine.demo import write_model

    def rows(n, seed):
        r = random.Random(seed)
        out = []
        for _ in range(n):
            s, k = r.randrange(26), r.randrange(*words)
            out.append({"prompt": f"after {string.ascii_lowercase[s]}", "completion": " ".join(
                string.ascii_lowercase[(s + i) % 26] for i in range(k))})
        return out
    train, valid = rows(n_train, 1), rows(n_valid, 2)
    write_model(root / "model", "qwen3", corpus=[f"{r['prompt']} {r['completion']}" for r in train],
                seed=1, layers=4, hidden=64)
    (root / "data").mkdir()
    for name, rs in (("train", train), ("valid", valid)):
        (root / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))


def edit_job(path: Path, **sections) -> Path:
    """Rewrite keys of a job file: edit_job(p, train={"iters": 4}, output="x")."""
    job = yaml.safe_load(path.read_text())
    for key, val in sections.items():
        if isinstance(val, dict):
            job.setdefault(key, {}).update(val)
        else:
            job[key] = val
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """One `segctl init-demo` per test session (qwen3), shared read-only."""
    d = tmp_path_factory.mktemp("demo") / "demo"
    proc = segctl("init-demo", d)
    assert proc.returncode == 0, proc.stderr
    return d


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> folder of a 5-layer random model in Hugging Face layout (gemma4_text: 6
    layers, layers 3 and 5 reading layer 1's K/V and layer 4 layer 2's)."""
    from segctl.engine.demo import demo_examples, write_model
    corpus = [f"{r['prompt']} {r['completion']}" for r in demo_examples(200, 1)]
    out = {}
    for arch in ("llama", "qwen3", "minicpm"):
        extra = ({"layer_types": ["sliding_attention", "full_attention"] * 2 + ["full_attention"],
                  "sliding_window": 8} if arch == "llama" else None)
        out[arch] = write_model(tmp_path_factory.mktemp(arch) / "model", arch, corpus=corpus,
                                seed=3, layers=5, hidden=64, extra_config=extra)
    out["gemma4_text"] = write_model(tmp_path_factory.mktemp("gemma4") / "model", "gemma4_text",
                                     corpus=corpus, seed=3, layers=6, hidden=64)
    return out
