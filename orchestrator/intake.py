"""What a submission brings to the head: the payload, checked again where it lands
by the schema code the CLI ran (a caller holding the token need not have used the
CLI), and the data files, kept under the stores' inputs/ by their sha256 and
checked against it whenever they are read. No Ray, no state.db."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from pydantic import ValidationError

from segctl.schemas.atomic import write_atomic
from segctl.schemas.cluster import PlannerSpec
from segctl.schemas.limits import (
    MAX_NAME_CHARS,
    MAX_SWEEP_NAME_CHARS,
    NAME_PATTERN,
    error_line,
    one_line,
    path_problem,
)
from segctl.schemas.private import private_dir
from segctl.schemas.sweep import check_expanded

from . import planner


def check_payload(payload) -> dict:
    """What the CLI validated, checked again where it lands, by the same schema code
    (schemas/sweep.py's check_expanded: every key of the sweep, every trial's job,
    the scheduler against the trials; the planner's knobs as cluster.yaml's): a caller
    holding the token but not using the CLI must not get into state.db a value a
    placement turn cannot compare or plan with. Returns the sweep and its trials as
    the head records them, every value as its schema reads it. Raises ValueError
    with one line."""
    if not isinstance(payload, dict):
        raise ValueError(f"a submission is a mapping, not {type(payload).__name__}")
    name, path, spec = payload.get("name"), payload.get("path"), payload.get("spec")
    if not isinstance(name, str) or len(name) > MAX_SWEEP_NAME_CHARS or not re.fullmatch(
            NAME_PATTERN, name):
        raise ValueError(f"sweep name {str(name)[:80]!r} is not a plain name of at most "
                         f"{MAX_SWEEP_NAME_CHARS} characters")
    if not isinstance(path, str) or path_problem(path):
        raise ValueError(f"path: {path_problem(path) if isinstance(path, str) else 'expected a string'}")
    if not isinstance(spec, dict):
        raise ValueError(f"spec: expected a mapping, got {type(spec).__name__}")
    try:
        knobs = PlannerSpec.model_validate(spec.get("planner") or {})
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(one_line(f"planner.{'.'.join(map(str, err['loc']))}: "
                                  f"{err['msg']}")) from None
    # the sweep is recorded under the name checked above, whatever its spec says
    sweep_keys = {k: v for k, v in spec.items() if k != "planner"} | {"name": name}
    trials = payload.get("trials")
    sweep = check_expanded(sweep_keys, trials)
    assert isinstance(trials, list)   # check_expanded refused anything else
    blobs = payload.get("blobs")
    if not isinstance(blobs, dict) or not all(isinstance(b, bytes) for b in blobs.values()):
        raise ValueError("blobs: expected a mapping of sha256 -> bytes")
    out, seen = [], set()
    for raw, t in zip(trials, sweep.trials):
        try:
            if not re.fullmatch(NAME_PATTERN, t.name) or len(f"{name}-{t.name}") > MAX_NAME_CHARS:
                raise ValueError(f"trial name {t.name[:80]!r} is not a plain name")
            if t.name in seen:
                raise ValueError("a second trial of this name")
            seen.add(t.name)
            try:
                info = planner.ModelInfo.from_dict(raw.get("model_info"))
            except Exception as e:
                raise ValueError(f"model_info: {e}") from None
            seq_len = raw.get("seq_len")
            if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
                raise ValueError(f"seq_len: expected a whole number >= 1, got {str(seq_len)[:80]!r}")
            inputs = raw.get("inputs")
            if not isinstance(inputs, dict) or "train.jsonl" not in inputs or \
                    set(inputs) - {"train.jsonl", "valid.jsonl"} or \
                    any(sha not in blobs for sha in inputs.values()):
                raise ValueError("inputs: expected {train.jsonl: sha256[, valid.jsonl: sha256]} "
                                 "of files among the blobs sent")
            try:
                json.dumps(t.params, allow_nan=False)   # kept in state.db as JSON
            except (TypeError, ValueError) as e:
                raise ValueError(f"params: not plain JSON ({e})") from None
        except Exception as e:
            why = one_line(str(e)) if isinstance(e, ValueError) else error_line(e)
            raise ValueError(f"trial {t.name[:80]!r}: {why}") from None
        out.append(dict(index=t.index, name=t.name, params=t.params,
                        job=t.job.model_dump(mode="json"), model_info=info.to_dict(),
                        seq_len=seq_len, inputs=dict(inputs)))
    recorded = sweep.spec.model_dump(mode="json")
    if "owner" not in spec:   # the head's own user would be no one's answer to "who"
        recorded.pop("owner")
    recorded["planner"] = knobs.model_dump()
    return dict(name=name, path=path, spec=recorded, trials=out)


def keep_inputs(folder: Path, blobs: dict[str, bytes]) -> None:
    """Keep a submission's data files in `folder` (made private), each under its
    sha256, once every one is checked against its name."""
    for sha, blob in blobs.items():
        if hashlib.sha256(blob).hexdigest() != sha:
            raise ValueError(f"input {sha[:12]} arrived damaged")
    inputs = private_dir(folder)   # copies of people's training data
    for sha, blob in blobs.items():
        write_input(inputs / sha, blob)


def write_input(path: Path, blob: bytes) -> None:
    """Keep a data file under its sha256 (its name). A copy already there is trusted
    only if its bytes still hash to its name; otherwise it is replaced atomically
    (two submits of the same file at once each write aside under a name of their own)."""
    if path.exists() and sha256_of(path) == path.name:
        return
    write_atomic(path, blob, mode=0o600)


def read_input(path: Path) -> bytes:
    """A data file kept under its sha256, checked: the head never ships rotten bytes."""
    blob = path.read_bytes()
    if hashlib.sha256(blob).hexdigest() != path.name:
        raise ValueError(f"{path}: the head's copy of this data file is damaged; submit again")
    return blob


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


