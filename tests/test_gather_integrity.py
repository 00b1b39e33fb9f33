"""What leaves the lab is what the nodes sent: each node records the
sha256 of every adapter file it sends (the attempt's `adapter` event); `segctl
gather` checks every file it exports against that record and `segctl report
--gathered` checks an exported folder the same way: a flipped byte in the stores,
or a gathered file changed afterwards, is refused with exit 1 and one line naming
the trial and file, nothing written. And the one-line refusals of `gather --out` to
a symbolic link, `report --out` into a missing folder and `report --gathered` with
a deeply nested manifest.

The stores are a real sweep's: the head's controller places two trials of the demo
sweep, each runs as a real attempt (node/attempt.py, a fresh engine process) whose
events reach the head as an agent sends them (only Ray is left out, as in
tests/test_head_isolation.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from segctl.orchestrator.stores import Stores
from segctl.schemas import store_rows as sr
from segctl.schemas.states import TrialState
from tests.conftest import assert_one_line_error, segctl


@pytest.fixture(scope="module")
def finished(demo_dir, tmp_path_factory):
    """{home, sweep, trials: {trial: kind exported}} of a finished two-trial sweep:
    one trial without a validation set (its last adapter is exported), one with
    (its best eval's)."""
    from segctl.orchestrator.submit import prepare
    from segctl.schemas.sweep import load_sweep
    from tests.test_head_isolation import World, run_placed, small

    base = tmp_path_factory.mktemp("integrity")
    payload = small(prepare(load_sweep(demo_dir / "sweep.yaml"), {}), "s", n=2)
    last, best = (t["job"] for t in payload["trials"])
    last["train"].update(iters=3, eval_every=0, checkpoint_every=0)
    last["data"]["valid"] = None
    best["train"].update(iters=4, eval_every=2, val_batches=1, checkpoint_every=0)
    world = World(names=("a", "b"))
    c = world.controller(base / "home")
    sid = c.submit(payload)
    world.turns(c, 1)
    run_placed(world, c, base / "work")
    world.turns(c, 2)
    trials = [t["id"] for t in c.state.trials(sid)]
    assert [t["state"] for t in c.state.trials(sid)] == [TrialState.SUCCEEDED] * 2
    c.state.close()
    return dict(home=base / "home", sweep=sid, trials=dict(zip(trials, ("last", "best"))))


def copy_of(finished, tmp_path) -> Path:
    """The stores to damage: a copy, so the other tests see them whole."""
    home = tmp_path / "home"
    shutil.copytree(finished["home"], home)
    return home


def env(home: Path) -> dict:
    return {"SEGCTL_HOME": home, "SEGCTL_CLUSTER": None}


def adapter_node(home: Path, trial: str, kind: str) -> Path:
    return home / sr.adapter_group(trial) if kind == "last" else \
        home / sr.ADAPTERS_ZARR / trial / "best_adapter"


def flip_byte(path: Path, at: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[at] ^= 0x01
    path.write_bytes(bytes(blob))


def node_sent(home: Path, trial: str, kind: str) -> dict:
    """What the node's `adapter` event says, read from the attempt's telemetry."""
    attrs = json.loads((adapter_node(home, trial, kind) / "zarr.json").read_text())["attributes"]
    [e] = [e for e in Stores(home).events(attrs["attempt"]) if e.get("event") == "adapter"]
    return e["sha256"] if kind == "last" else e["best_sha256"]


def nothing_left(folder: Path, keep: set[str]) -> None:
    assert {p.name for p in folder.iterdir()} == keep, sorted(p.name for p in folder.iterdir())


# ==================================================================== integrity

def test_gather_exports_what_the_nodes_sent_owner_only(finished, tmp_path):
    out = tmp_path / "out"
    old = os.umask(0)   # the CLI inherits it: modes must not depend on it
    try:
        proc = segctl("gather", finished["sweep"], "--out", out, env=env(finished["home"]))
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert {m["trial"]: m["adapter"] for m in manifest} == finished["trials"]
    for m in manifest:
        sent = node_sent(finished["home"], m["trial"], m["adapter"])
        assert m["verified"] is True and m["files"] == sent, m
        for name, digest in sent.items():
            assert hashlib.sha256((out / m["trial"] / name).read_bytes()).hexdigest() == digest
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for p in out.rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p

    page = tmp_path / "r.html"
    proc = segctl("report", finished["sweep"], "--gathered", out, "--out", page,
                  env=env(finished["home"]))
    assert proc.returncode == 0, proc.stderr
    assert manifest[0]["files"]["adapters.safetensors"][:16] in page.read_text()   # in its data


@pytest.mark.parametrize("where", ["tensor bytes", "metadata"])
def test_a_flipped_byte_in_the_stores_is_refused(finished, tmp_path, where):
    home = copy_of(finished, tmp_path)
    trial = next(t for t, k in finished["trials"].items() if k == "best")
    node = adapter_node(home, trial, "best")
    if where == "tensor bytes":   # the packed data: one chunk, its bytes as stored
        [chunk] = [p for p in (node / "data").rglob("*") if p.is_file() and p.name != "zarr.json"]
        flip_byte(chunk, chunk.stat().st_size // 2)
        expect = [trial, "adapters.safetensors", "not what its node sent"]
    else:   # its zarr.json: `{` becomes `z`, the node's metadata cannot be read
        flip_byte(node / "zarr.json", 0)
        expect = [trial, "zarr.json", "cannot be read"]
    out = tmp_path / "export" / "out"
    assert_one_line_error(segctl("gather", finished["sweep"], "--out", out, env=env(home)),
                          *expect, code=1)
    nothing_left(tmp_path / "export", set())   # no out, no half-built folder beside it
    # the report lists what gather would export: it refuses the same way
    page = tmp_path / "r.html"
    assert_one_line_error(segctl("report", finished["sweep"], "--out", page, env=env(home)),
                          *expect, code=1)
    assert not page.exists()


def test_a_gathered_file_changed_afterwards_is_refused(finished, tmp_path):
    out = tmp_path / "out"
    assert segctl("gather", finished["sweep"], "--out", out,
                  env=env(finished["home"])).returncode == 0
    trial = next(iter(finished["trials"]))
    target = out / trial / "adapters.safetensors"
    target.chmod(0o600)
    flip_byte(target, target.stat().st_size - 3)
    page = tmp_path / "r.html"
    report = lambda: segctl("report", finished["sweep"], "--gathered", out, "--out", page,
                            env=env(finished["home"]))
    assert_one_line_error(report(), trial, "adapters.safetensors", "manifest.json", code=1)
    # a manifest edited to match the changed file: the node's record still says no
    manifest = json.loads((out / "manifest.json").read_text())
    entry = next(m for m in manifest if m["trial"] == trial)
    entry["files"]["adapters.safetensors"] = hashlib.sha256(target.read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(report(), trial, "adapters.safetensors", "node", code=1)
    # and a file gone
    target.unlink()
    assert_one_line_error(report(), trial, "adapters.safetensors", code=1)
    assert not page.exists()


# ==================================================================== one-line refusals

def test_gather_out_to_a_symbolic_link_is_one_line(finished, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    for name, target in (("to-empty", tmp_path / "elsewhere"), ("dangling", tmp_path / "nope")):
        link = tmp_path / name
        link.symlink_to(target)
        assert_one_line_error(segctl("gather", finished["sweep"], "--out", link,
                                     env=env(finished["home"])), str(link), "symbolic link")
        assert link.is_symlink() and os.readlink(link) == str(target)
    nothing_left(tmp_path / "elsewhere", set())
    nothing_left(tmp_path, {"elsewhere", "to-empty", "dangling"})


def test_report_out_into_a_missing_folder_is_one_line(finished, tmp_path):
    page = tmp_path / "no" / "such" / "r.html"
    assert_one_line_error(segctl("report", finished["sweep"], "--out", page,
                                 env=env(finished["home"])), str(page.parent), "does not exist")
    nothing_left(tmp_path, set())


@pytest.mark.parametrize("manifest, expect", [
    ("[" * 100_000 + "]" * 100_000, "nested deeper than"),          # past the decoder's recursion
    (json.dumps([{"trial": "x", "params": {"p": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}]),
     "nested deeper than"),
    (json.dumps([{"trial": "../../etc", "params": {}}]), "entry 0: trial"),
    (json.dumps([{"trial": "x", "params": {}, "metrics": {}, "adapter": "last", "step": 1,
                  "files": {"adapters.safetensors": "../x"}}]), "entry 0: files"),
])
def test_report_gathered_bad_manifest_is_one_line(finished, tmp_path, manifest, expect):
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "manifest.json").write_text(manifest)
    page = tmp_path / "r.html"
    assert_one_line_error(segctl("report", finished["sweep"], "--gathered", folder, "--out", page,
                                 env=env(finished["home"])), "manifest.json", expect)
    assert not page.exists()
