"""`segctl gather`: a sweep's adapters out of the stores, one mlx-lm adapter folder
per trial plus a manifest, ready for `mlx_lm.load(model, adapter_path=OUT/<trial>)`.
Each trial's folder holds its best eval's adapter where the stores have one (it had
a validation set), else its last; the manifest says which, and from which step.

Every file is checked before it is written: its sha256 must be the one its node
recorded when it sent the adapter (the attempt's `adapter` event in the stores), so
a damaged store is refused (Mismatch) instead of exported with a manifest vouching
for it. The manifest's `verified` says whether the stores had that record (stores
from before nodes recorded it have not). `report --gathered` checks the exported
folder the same way (read_gathered).

The whole folder is built next to `out` (0700, its files 0600, like the stores) and
renamed into place at the end, so a crash or an error leaves either nothing or the
finished folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from segctl.schemas.atomic import fsync_dir
from segctl.schemas.errors import UserError
from segctl.schemas.limits import load_json
from segctl.schemas.names import EXIT_INTERNAL
from segctl.schemas.states import TrialState

from .stores import ADAPTER_KINDS, Stores, _safe

ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class Mismatch(UserError):
    """An adapter's bytes are not what its node sent: the stores (or a gathered
    folder) are damaged. Not bad input: the CLI exits 1 with this one line."""

    exit_code = EXIT_INTERNAL


def gather(stores: Stores, trials: list[dict], out: Path, best: int | None = None,
           metric: str = "val_loss") -> Path:
    """Export the SUCCEEDED trials that have an adapter (the `best` K by `metric`,
    lowest first, when given). `trials`: [{trial, state, params, metrics}].
    Returns `out`; raises ValueError (one line) when `out` is a link or not new or
    empty, when no trial qualifies or it cannot be written; Mismatch when a file in
    the stores is not what its node sent. Nothing is left behind on either."""
    out = Path(out)
    if out.is_symlink():   # the rename would fail on it, or land where the link points
        raise ValueError(f"{out}: is a symbolic link (gather writes a new folder there)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not empty (gather writes a new folder)")
    chosen = pick(stores, trials, best, metric)
    if not chosen:
        raise ValueError("no succeeded trial with an adapter in the stores to gather")

    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.gather-", dir=out.parent))
        os.chmod(tmp, 0o700)   # whatever the umask
        manifest = []
        for t in chosen:
            entry, files = checked_entry(stores, t)   # before any of its bytes are written
            folder = tmp / t["trial"]
            folder.mkdir(mode=0o700)
            os.chmod(folder, 0o700)
            for name, blob in files.items():
                _write(folder / name, blob)
            fsync_dir(folder)
            manifest.append(entry)
        _write(tmp / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
        fsync_dir(tmp)   # every entry in place before the folder is renamed in
        os.replace(tmp, out)   # an empty `out` is replaced; a non-empty one was refused above
        tmp = None
        fsync_dir(out.parent)  # the rename itself survives a power cut
    except OSError as e:
        raise ValueError(f"{out}: cannot write there ({e.strerror or e})") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def checked_entry(stores: Stores, t: dict) -> tuple[dict, dict[str, bytes]]:
    """A trial's manifest entry and the files of the adapter gather exports for it,
    each file checked against the sha256 its node recorded; Mismatch (naming the
    trial and file) where one differs or cannot be read."""
    trial = t["trial"]
    kind, info = exported(stores, trial)
    if info is None:   # a succeeded trial has its adapter stored: the stores lost it
        raise Mismatch(f"trial {trial}: the stores hold no adapter for it; nothing was exported")
    try:
        files = stores.adapter_files(trial, kind)
        sent = stores.adapter_sha256(trial, kind)
    except (OSError, ValueError, KeyError) as e:   # a damaged node: its metadata unreadable
        raise Mismatch(f"trial {trial}: its {kind} adapter in the stores cannot be read "
                       f"({type(e).__name__}: {e}); nothing was exported") from None
    digests = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    for name, digest in digests.items():
        if sent is not None and sent.get(name) != digest:
            raise Mismatch(f"trial {trial}: {name} of its {kind} adapter in the stores is not "
                           f"what its node sent (sha256 {digest[:12]}…, the node's "
                           f"{str(sent.get(name))[:12]}…): the stores are damaged; "
                           "nothing was exported")
    metrics = dict(t.get("metrics") or {})
    if kind == "best":
        metrics["best_val_loss"] = info["val_loss"]
    # strict JSON: a loss that went to NaN is written as null
    metrics = {k: None if isinstance(v, float) and not math.isfinite(v) else v
               for k, v in metrics.items()}
    return ({"trial": trial, "params": t.get("params") or {}, "metrics": metrics,
             "adapter": kind, "step": info["step"], "files": digests,
             "verified": sent is not None}, files)


def read_gathered(stores: Stores, folder: Path) -> list[dict]:
    """The entries of the manifest.json `gather` wrote to `folder`, each checked:
    its files hash to the manifest's sha256, and that is the one its node recorded
    where the stores still hold the trial's adapter. ValueError (one line, naming
    the manifest): not a manifest gather writes; Mismatch: a file that differs or
    is missing."""
    path = Path(folder) / "manifest.json"
    try:
        raw = load_json(path.read_bytes())   # strict JSON, nesting bounded
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a list of entries, each with a trial")
    entries = []
    for i, item in enumerate(raw):
        try:
            entries.append(_manifest_entry(item))
        except ValueError as err:
            raise ValueError(f"{path}: entry {i}: {err}") from None
    for entry in entries:
        _check_files(stores, Path(folder), entry)
    return entries


def _plain_name(v) -> bool:
    """Whether `v` can name a trial in the stores (raises ValueError saying why not)."""
    _safe("trial", v)
    return True


def _manifest_entry(e) -> dict:
    """One manifest entry as gather writes it (only its keys: nothing else of the
    file reaches a report); ValueError saying which key is wrong."""
    if not isinstance(e, dict):
        raise ValueError("expected an object with a trial")
    checks = {
        "trial": _plain_name,
        "params": lambda v: isinstance(v, dict),   # a swept value may be a list (lora.keys)
        "metrics": lambda v: isinstance(v, dict) and all(
            isinstance(x, (int, float, type(None))) for x in v.values()),
        "adapter": lambda v: v in ADAPTER_KINDS,
        "step": lambda v: v is None or type(v) is int,
        "files": lambda v: isinstance(v, dict) and set(v) == set(ADAPTER_FILES) and all(
            isinstance(d, str) and _SHA256.fullmatch(d) for d in v.values()),
        "verified": lambda v: isinstance(v, bool),
    }
    out = {}
    for key, ok in checks.items():
        if key not in e:
            if key == "verified":   # manifests from before gather checked the node's sha256
                continue
            raise ValueError(f"{key}: missing")
        if not ok(e[key]):   # _safe raises its own one line for a bad trial name
            v = e[key]   # shown only when short: a nested one may not even print
            shown = repr(v)[:80] if isinstance(v, (str, int, float)) else f"a {type(v).__name__}"
            raise ValueError(f"{key}: {shown} is not what gather writes there")
        out[key] = e[key]
    return out


def _check_files(stores: Stores, folder: Path, e: dict) -> None:
    trial, kind = e["trial"], e["adapter"]
    sent = stores.adapter_sha256(trial, kind) if stores.has_adapter(trial, kind) else None
    for name, digest in e["files"].items():
        path = folder / trial / name
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise Mismatch(f"trial {trial}: {path} is not a plain file")
            got = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as err:
            raise Mismatch(f"trial {trial}: {path}: {err.strerror or err}") from None
        if got != digest:
            raise Mismatch(f"trial {trial}: {path} does not match its sha256 in "
                           "manifest.json: it changed after gather wrote it")
        if sent is not None and sent.get(name) != digest:
            raise Mismatch(f"trial {trial}: {name}: manifest.json's sha256 is not the one its "
                           "node recorded when it sent the adapter")


def pick(stores: Stores, trials: list[dict], best: int | None, metric: str) -> list[dict]:
    """The trials to export: succeeded, with an adapter; ranked by `metric` (missing
    or not a number sorts last; val_loss is the best eval's where the trial's best
    adapter is exported) and cut to `best` when given, else in the order given."""
    ok = [t for t in trials
          if t.get("state") == TrialState.SUCCEEDED and stores.has_adapter(t["trial"])]
    if best is None:
        return ok

    def key(t):
        v = (t.get("metrics") or {}).get(metric)
        # the adapters' metadata is read only where a best one may change the value:
        # a sweep has thousands of trials, and that is a file or two each
        if metric == "val_loss" and stores.has_adapter(t["trial"], "best"):
            kind, info = exported(stores, t["trial"])
            if kind == "best" and info["val_loss"] is not None:
                v = info["val_loss"]
        missing = not isinstance(v, (int, float)) or math.isnan(v)
        return (missing, 0.0 if missing else v)
    return sorted(ok, key=key)[:best]


def exported(stores: Stores, trial: str) -> tuple[str, dict | None]:
    """Which of the trial's adapters gather exports ("best" or "last") and its
    {attempt, step, val_loss}: the best eval's when the stores have one from the
    same attempt as the last (an older attempt's, left by a run that failed after
    it was stored, is not this trial's result)."""
    info = {}
    for kind in ADAPTER_KINDS:
        try:
            info[kind] = stores.adapter_info(trial, kind)
        except (OSError, ValueError) as e:   # its metadata file damaged
            raise Mismatch(f"trial {trial}: its {kind} adapter's zarr.json in the stores cannot "
                           f"be read ({type(e).__name__}: {e})") from None
    last, best = info["last"], info["best"]
    if best is not None and last is not None and best["attempt"] == last["attempt"]:
        return "best", best
    return "last", last


def _write(path: Path, blob: bytes) -> None:
    """A new file, 0600 whatever the umask, never through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with open(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
