"""The sweep spec (`sweep.yaml`): one base job and the values to vary, expanded
into trials, each a fully resolved, validated JobSpec.

Trials are the grid's cross product combined with each random draw. Every
trial's job is validated, and a problem is reported where the user wrote the
thing: a varied value at its line in the sweep file, anything else at its line
in the base job (the base file, or the sweep file's `job:` mapping).
"""

from __future__ import annotations

import copy
import functools
import getpass
import itertools
import math
import os
import random
import re
from pathlib import Path
from typing import Annotated, Any, Callable, Mapping, NamedTuple, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import SpecError
from .job import JobSpec, PathStr, ReportTo, resolve_trackers
from .limits import (
    MAX_EXPANDED_BYTES,
    MAX_JOB_BYTES,
    MAX_LIST_ITEMS,
    MAX_NAME_CHARS,
    MAX_PRIORITY,
    MAX_PROBLEMS,
    MAX_RETRIES,
    MAX_SWEEP_NAME_CHARS,
    MAX_TRIALS,
    NAME_PATTERN,
    json_bytes,
    one_line,
    path_problem,
)
from .search import RandomSpec, SchedulerSpec
from .yamlspec import (
    did_you_mean,
    first_problems,
    line_of,
    load_yaml,
    mlx_lm_says,
    node_at,
    not_a_mapping,
    problem,
    problem_line,
)

# Job keys holding paths: resolved against the folder of the file that wrote them.
PATH_KEYS = ("model", "data.train", "data.valid")
MAX_SHARE = 1_000_000.0   # a sweep's share: a weight, only its ratio to the others' counts
OWNER_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.@-]*$"   # OS user names, also user@domain ones
# Job keys a sweep decides itself, so they cannot be varied.
SET_BY_FLEET = {"name": "set by the sweep (sweep name + trial name)",
                "output": "set by the fleet (trial adapters land in the stores)",
                "report_to": "set for the whole sweep (report_to at the sweep's top level or in "
                             "its base job)"}


def submitter() -> str:
    """The submitting OS user's name, as an `owner` (characters it cannot hold as '-')."""
    try:
        name = getpass.getuser()
    except Exception:   # no login name in the environment nor in the password database
        name = ""
    name = re.sub(r"[^A-Za-z0-9_.@-]", "-", name).lstrip(".@-")[:MAX_NAME_CHARS]
    return name or "unknown"


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_SWEEP_NAME_CHARS,
                      description="sweep name; trial names are derived from it")
    base: Optional[PathStr] = Field(None, description="job file, relative to this sweep file")
    job: Optional[dict[str, Any]] = Field(None, description="the job inline, instead of base")
    # an axis longer than MAX_TRIALS is too many trials on its own
    grid: dict[str, Annotated[list[Any], Field(min_length=1, max_length=MAX_TRIALS)]] = Field(
        {}, max_length=MAX_LIST_ITEMS, description="dotted job key -> values; the full cross product")
    random: Optional[RandomSpec] = None
    concurrency: Optional[int] = Field(None, ge=1, le=MAX_TRIALS,
                                       description="trials running at once at most; null = no cap")
    retries: int = Field(3, ge=0, le=MAX_RETRIES,
                         description="extra attempts per trial after oom or a lost node")
    placement: dict[str, str] = Field({}, max_length=MAX_LIST_ITEMS,
                                      description="node labels a trial needs (all must match)")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
                          description="higher is scheduled first (across sweeps)")
    share: float = Field(1.0, gt=0, le=MAX_SHARE,
                         description="its weight among running sweeps of equal priority: a free "
                                     "node goes to the one with the fewest running attempts per "
                                     "share")
    owner: str = Field(default_factory=submitter, pattern=OWNER_PATTERN,
                       max_length=MAX_NAME_CHARS,
                       description="who submitted it (shown by status); default: the submitting "
                                   "OS user's name")
    scheduler: Optional[SchedulerSpec] = Field(
        None, description="early stopping across trials (asha); null = every trial runs to the end")
    report_to: Optional[ReportTo] = Field(
        None, description="trackers every trial streams to (a run per trial, grouped per sweep); "
                          "or report_to in the base job")

    @field_validator("share", mode="before")
    @classmethod
    def _not_a_bool(cls, v):
        if isinstance(v, bool):   # YAML's yes/no: a number that was meant to be written
            raise ValueError("expected a number > 0, not a boolean")
        return v


class TrialSpec(BaseModel):
    index: int
    name: str
    params: dict[str, Any] = Field(description="dotted job key -> value this trial varies")
    job: JobSpec


class Sweep(BaseModel):
    spec: SweepSpec
    path: str
    trials: list[TrialSpec]


class Origin(NamedTuple):
    """Where a varied value was written: file, line, and the key as the user sees it."""
    path: Path
    line: int
    key: str


class Base(NamedTuple):
    """The base job as written, and where: its file, its YAML node, the key
    prefix it sits under ("job." when inline) and the folder its paths are from."""
    data: dict
    path: Path
    node: Any
    prefix: str
    folder: Path


def job_keys(model: type[BaseModel] = JobSpec, prefix: str = "") -> list[str]:
    """Every dotted key of a job leaf value: 'model', 'train.learning_rate', ..."""
    keys = []
    for name, field in model.model_fields.items():
        sub, name = field.annotation, field.alias or name  # as written in YAML: orpo.lambda
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += job_keys(sub, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def set_dotted(d: dict, key: str, value) -> None:
    """d['a']['b'] = value for key 'a.b', creating missing mappings. Raises
    TypeError when a non-mapping is in the way (the base job's own error)."""
    *parents, last = key.split(".")
    for part in parents:
        d = d.setdefault(part, {})
        if not isinstance(d, dict):
            raise TypeError(f"{part} is not a mapping")
    d[last] = value


def load_sweep(path: str | Path) -> Sweep:
    """Validate a sweep file, its base job and every trial; raise SpecError
    with every problem found (nothing is run or written)."""
    path = Path(path)
    data, root = load_yaml(path)
    return _validate(path, data, root)


def single_job_sweep(path: str | Path) -> Sweep:
    """A job file submitted on its own: a sweep of one trial, named after the job."""
    path = Path(path)
    data, _ = load_yaml(path)
    name = data.get("name") if isinstance(data, dict) else None
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", str(name or path.stem)).lstrip("-_.") or "job"
    name = name[:MAX_SWEEP_NAME_CHARS]
    return _validate(path, {"name": name, "base": path.name}, None)


def _validate(path: Path, data, root) -> Sweep:
    if not isinstance(data, dict):
        raise SpecError([not_a_mapping(path, data)])
    problems = _Problems()
    try:
        spec: SweepSpec | None = SweepSpec.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            problems.add_later(path, problem_line(root, err),
                               functools.partial(problem, path, SweepSpec, root, err))
        spec = _salvage(data, e.errors())
    given = {k for k, v in data.items() if v is not None}
    base = _base_job(spec, path, root, problems, given) if spec else None
    if spec is None or base is None:
        raise SpecError(problems.in_order(path))
    if spec.report_to is not None and base.data.get("report_to") is not None:
        problems.add(f"{path}:{line_of(root, ['report_to'])}: report_to: also in the base job "
                     f"({base.path}); give it in one place")

    # counted from the axes, before any trial is built (32^6 would not fit in memory)
    count = math.prod(len(v) for v in spec.grid.values()) * (spec.random.samples if spec.random else 1)
    if count > MAX_TRIALS:
        where = "grid" if spec.grid else "random"
        problems.add(f"{path}:{line_of(root, [where])}: {where}: {count} trials is more than "
                     f"{MAX_TRIALS}; split the sweep")
        raise SpecError(problems.in_order(path, base.path))
    if too_big := _oversized(spec, base, path, root, count):   # before any trial is built
        problems.add(too_big)
        raise SpecError(problems.in_order(path, base.path))
    points = _grid_points(spec, path, root, problems)
    draws = _random_draws(spec, path, root, problems)

    cross: list[Any] = []
    trials, checked, weight = [], 0, 0
    for index, (point, draw) in enumerate(itertools.product(points, draws)):
        if len(problems.lines) > MAX_PROBLEMS:   # more than are shown: the rest would repeat them
            problems.stopped = f" (checking stopped at trial t{index:03d} of {count})"
            break
        checked += 1
        name = f"t{index:03d}"
        varied = {**point, **draw}
        trial = _trial(spec, base, index, name, varied, path.parent, problems, cross)
        if trial is None:
            continue
        trials.append(trial)
        # weighed as built too: the estimate left out defaults and resolved paths
        size = len(trial.job.model_dump_json().encode())
        if size > MAX_JOB_BYTES:
            problems.add(f"{_base_where(base, path, root)}: trial {name}'s job is {size} bytes as "
                         f"JSON, more than {MAX_JOB_BYTES}", dedupe=("job bytes",))
        weight += size
        if weight > MAX_EXPANDED_BYTES:
            problems.add(f"{_axes_where(spec, base, path, root)}: the trials' jobs pass "
                         f"{MAX_EXPANDED_BYTES} bytes as JSON at trial {name}; split the sweep "
                         "or shorten its job")
            break
    _report_cross(cross, checked, base, problems)
    if spec.scheduler is not None:
        for trial in trials:
            _check_scheduler(spec.scheduler, trial, path, root, problems)
    if problems.lines:
        raise SpecError(problems.in_order(path, base.path))
    return Sweep(spec=spec, path=str(path.resolve()), trials=trials)


def check_expanded(spec: object, trials: object) -> Sweep:
    """A sweep that arrives already expanded (what the head receives: the sweep's
    keys and each trial's resolved job) held to the models and rules a sweep file
    is held to: every key of SweepSpec, each trial (TrialSpec: its job a JobSpec),
    at most MAX_TRIALS of them, and the scheduler against every trial. Returns it
    as those models read it; raises ValueError with the first problem, one line
    (`key: message`, worded as for a file)."""
    if not isinstance(spec, dict):
        raise ValueError(f"spec: expected a mapping, got {type(spec).__name__}")
    try:
        sweep = SweepSpec.model_validate(spec)
    except ValidationError as e:
        raise ValueError(_unplaced(problem("-", SweepSpec, None, e.errors()[0]))) from None
    if not isinstance(trials, list) or not 1 <= len(trials) <= MAX_TRIALS:
        raise ValueError(f"trials: expected a list of 1 to {MAX_TRIALS} trials")
    # weighed before the models read them: a caller past the CLI sends what it likes
    sizes = [json_bytes(t.get("job")) if isinstance(t, dict) else 0 for t in trials]
    if max(sizes) > MAX_JOB_BYTES:
        raise ValueError(f"trials: a trial's job is {max(sizes):,} bytes as JSON, more than "
                         f"{MAX_JOB_BYTES:,}")
    if sum(sizes) > MAX_EXPANDED_BYTES:
        raise ValueError(f"trials: the trials' jobs are {sum(sizes):,} bytes as JSON, more "
                         f"than {MAX_EXPANDED_BYTES:,}")
    out = []
    for t in trials:
        name = str(t.get("name"))[:80] if isinstance(t, dict) else "?"
        if not isinstance(t, dict):
            raise ValueError(f"trials: expected a mapping per trial, got {type(t).__name__}")
        try:
            out.append(TrialSpec.model_validate({k: t.get(k) for k in TrialSpec.model_fields}))
        except ValidationError as e:
            raise ValueError(f"trial {name!r}: "
                             f"{_unplaced(problem('-', TrialSpec, None, e.errors()[0]))}") from None
    if sweep.scheduler is not None:
        problems = _Problems()
        for trial in out:
            _check_scheduler(sweep.scheduler, trial, Path("-"), None, problems)
        if problems.lines:
            first = problems.lines[0]
            assert isinstance(first, str)   # _check_scheduler adds lines, not _Later ones
            raise ValueError(_unplaced(first))
    return Sweep(spec=sweep, path="-", trials=out)


def _unplaced(line: str) -> str:
    """A problem line of a spec that came as data, not from a file: without the
    `-:1: ` where a file's name and line would be."""
    return one_line(line.removeprefix("-:1: "))


# ------------------------------------------------------------------ the parts


class _Later(NamedTuple):
    path: Path
    line: int
    make: Callable[[], str]


class _Problems:
    """Problem lines in order, each once (every trial repeats the base's own)."""

    def __init__(self):
        self.lines: list[str | _Later] = []
        self._seen: set = set()
        self.stopped = ""   # why checking stopped short, said after "and N more problems"

    def in_order(self, *paths: Path) -> list[str]:
        """By file (in the order given), then line; at most MAX_PROBLEMS of them,
        then "and N more problems"."""
        def where(line: str | _Later):
            if isinstance(line, _Later):
                return paths.index(line.path) if line.path in paths else len(paths), line.line
            for i, p in enumerate(paths):
                if line.startswith(f"{p}:"):
                    return i, int(line[len(f"{p}:"):].split(":")[0])
            return len(paths), 0
        made = lambda line: line.make() if isinstance(line, _Later) else line
        return first_problems(paths[0], sorted(self.lines, key=where), made, more=self.stopped)

    def add(self, line: str, dedupe=None) -> None:
        key = dedupe if dedupe is not None else line
        if key not in self._seen:
            self._seen.add(key)
            self.lines.append(line)

    def add_later(self, path: Path, line: int, make: Callable[[], str]) -> None:
        """A problem at `path`:`line` whose text is made only if it is shown: its
        hint costs a fuzzy match, and a file may have 40,000 unknown keys."""
        self.lines.append(_Later(path, line, make))

    def add_once(self, key, make: Callable[[], str]) -> None:
        """add(make()), make called only the first time `key` comes: a problem of the
        base job comes once per trial, and its line costs a fuzzy match."""
        if key not in self._seen:
            self._seen.add(key)
            self.add(make())

    def extend(self, lines) -> None:
        for line in lines:
            self.add(line)


def _salvage(data: dict, errors: Sequence[Mapping[str, Any]]) -> SweepSpec | None:
    """The sweep without its bad parts (a grid key, a random parameter, else the
    whole top-level key), so the base job and the trials are checked too and
    every problem comes out in one go."""
    kept = copy.deepcopy({k: v for k, v in data.items() if k in SweepSpec.model_fields})
    for _ in range(3):
        for err in errors:
            loc = err["loc"]
            grid, rand = kept.get("grid"), kept.get("random")
            params = rand.get("params") if isinstance(rand, dict) else None
            if loc[:1] == ("grid",) and len(loc) > 1 and isinstance(grid, dict):
                grid.pop(loc[1], None)
            elif loc[:2] == ("random", "params") and len(loc) > 2 and isinstance(params, dict):
                params.pop(loc[2], None)
            elif loc:
                kept.pop(loc[0], None)
        kept.setdefault("name", "sweep")
        try:
            return SweepSpec.model_validate(kept)
        except ValidationError as e:
            errors = e.errors()
    return None


def _base_job(spec: SweepSpec, path: Path, root, problems: _Problems, given: set) -> Base | None:
    if spec.base is not None and spec.job is not None:
        problems.add(f"{path}:{line_of(root, ['job'])}: job: give either base or job, not both")
        return None
    if spec.job is not None:
        return Base(spec.job, path, node_at(root, ["job"]), "job.", path.resolve().parent)
    if spec.base is None:
        if not given & {"base", "job"}:   # else its own problem is reported already
            problems.add(f"{path}:1: base: required key is missing (or give the job inline as job:)")
        return None
    file = Path(os.path.normpath(path.parent / spec.base))
    if message := _missing("base", str(file.resolve())):
        problems.add(f"{path}:{line_of(root, ['base'])}: base: {message}")
        return None
    try:
        data, node = load_yaml(file)
    except SpecError as e:
        problems.extend(e.problems)
        return None
    if not isinstance(data, dict):
        problems.add(not_a_mapping(file, data))
        return None
    return Base(data, file, node, "", file.resolve().parent)


def _check_key(key: str, where: str, path: Path, line: int, problems: _Problems) -> bool:
    if key in SET_BY_FLEET:
        problems.add(f"{path}:{line}: {where}: {SET_BY_FLEET[key]}")
        return False
    keys = _variable_keys()
    if key not in keys:
        hint = mlx_lm_says(_first_unknown(key, keys))
        problems.add(f"{path}:{line}: {where}: unknown job key" + (hint or did_you_mean(key, keys)))
        return False
    return True


@functools.cache
def _variable_keys() -> list[str]:
    """The job keys a sweep may vary (made once: a grid may have MAX_LIST_ITEMS keys)."""
    return [k for k in job_keys() if k not in SET_BY_FLEET]


def _oversized(spec: SweepSpec, base: Base, path: Path, root, count: int) -> str | None:
    """Why the trials' jobs would be too large, or None: estimated before any is
    built, as the base job as written plus the largest value of each varied key
    (an 880 KB sweep made 2.2 MB trials, 22 GB in all)."""
    varied: dict[tuple[str, ...], int] = {
        ("grid", key): max(map(json_bytes, values)) for key, values in spec.grid.items()}
    for key, dist in (spec.random.params.items() if spec.random else ()):
        # a drawn float is at most 24 characters
        varied[("random", "params", key)] = max(map(json_bytes, dist.choice)) if dist.choice else 24
    own = json_bytes(base.data) + json_bytes([t.model_dump(mode="json") for t in spec.report_to or []])
    each = own + sum(varied.values())
    if each > MAX_JOB_BYTES:
        loc = max(varied, key=lambda k: varied[k], default=None)
        where = (f"{path}:{line_of(root, loc)}: {'.'.join(loc)}" if loc and varied[loc] > own
                 else _base_where(base, path, root))
        return (f"{where}: a trial's job would be about {each} bytes as JSON, more than "
                f"{MAX_JOB_BYTES}")
    if count * each > MAX_EXPANDED_BYTES:
        return (f"{_axes_where(spec, base, path, root)}: {count} trials of about {each} bytes of "
                f"job each are about {count * each} bytes as JSON, more than {MAX_EXPANDED_BYTES}; "
                "split the sweep or shorten its job")
    return None


def _base_where(base: Base, path: Path, root) -> str:
    """`file:line: key` of the base job as a whole: the sweep's `job:` or the base file."""
    if base.prefix:
        return f"{path}:{line_of(root, ['job'])}: job"
    return f"{base.path}:1: (the base job)"


def _axes_where(spec: SweepSpec, base: Base, path: Path, root) -> str:
    """`file:line: key` of what multiplies the trials: the grid, else random."""
    for axis in ("grid", "random"):
        if getattr(spec, axis):
            return f"{path}:{line_of(root, [axis])}: {axis}"
    return _base_where(base, path, root)


def _first_unknown(key: str, keys: list[str]) -> str:
    """The part of a dotted key that is no job key at its place: `train.grad_accumulation_steps`
    -> grad_accumulation_steps, `lora_parameters.rank` -> lora_parameters (what an
    mlx-lm config's key is looked up by)."""
    known = {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 2)}
    parts = key.split(".")
    return next((p for i, p in enumerate(parts) if ".".join(parts[:i + 1]) not in known),
                parts[-1])


def _grid_points(spec, path, root, problems) -> list[dict[str, tuple[Any, Origin]]]:
    """The grid's cross product: key -> (value, where it was written)."""
    axes = []
    for key, values in spec.grid.items():
        if not _check_key(key, f"grid.{key}", path, line_of(root, ["grid", key]), problems):
            continue
        axes.append([(key, v, Origin(path, line_of(root, ["grid", key, i]), f"grid.{key}[{i}]"))
                     for i, v in enumerate(values)])
    return [{k: (v, o) for k, v, o in combo} for combo in itertools.product(*axes)]


def _random_draws(spec, path, root, problems) -> list[dict[str, tuple[Any, Origin]]]:
    """`samples` draws, sample by sample, each parameter in file order, from one
    Random(seed): the same file gives the same trials."""
    if spec.random is None:
        return [{}]
    params = {}
    for key, dist in spec.random.params.items():
        line = line_of(root, ["random", "params", key])
        if not _check_key(key, f"random.params.{key}", path, line, problems):
            continue
        if key in spec.grid:
            problems.add(f"{path}:{line}: random.params.{key}: also in grid; vary a key in one place")
            continue
        params[key] = (dist, Origin(path, line, f"random.params.{key}"))
    rng = random.Random(spec.random.seed)
    return [{key: (dist.draw(rng), origin) for key, (dist, origin) in params.items()}
            for _ in range(spec.random.samples)]


def _trial(spec, base: Base, index, name, varied, sweep_dir, problems, cross) -> TrialSpec | None:
    data = copy.deepcopy(base.data)
    for key, (value, _) in varied.items():
        try:
            set_dotted(data, key, value)
        except TypeError:
            pass  # the base has a non-mapping there; its own error says so
    data["name"] = f"{spec.name}-{name}"
    data["output"] = None  # the fleet decides where trial adapters land
    if spec.report_to is not None:   # the sweep's, its dirs taken from the sweep file's folder
        data["report_to"] = [t.model_dump(mode="json")
                             for t in resolve_trackers(spec.report_to, sweep_dir.resolve())]

    # Paths first, from the raw job, so a missing file shows even when the job has
    # other problems too.
    paths, ok = {}, True
    for key in PATH_KEYS:
        value = _get_dotted(data, key)
        if not isinstance(value, str):
            continue  # absent, or the job's own error says what is wrong
        folder = sweep_dir.resolve() if key in varied else base.folder  # where it was written
        paths[key] = str((folder / value).resolve())
        message = _missing(key, paths[key])
        if message:
            ok = False
            if key in varied:
                o = varied[key][1]
                problems.add(f"{o.path}:{o.line}: {o.key}: {message}")
            else:
                problems.add(f"{base.path}:{line_of(base.node, key.split('.'))}: {base.prefix}{key}: {message}")
    try:
        job = JobSpec.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            _report(err, base, varied, name, problems, cross)
        return None
    if not ok:
        return None
    job = job.model_copy(update={
        "model": paths["model"],
        "report_to": resolve_trackers(job.report_to, base.folder),
        "data": job.data.model_copy(update={"train": paths["data.train"],
                                            "valid": paths.get("data.valid")}),
    })
    params = {key: _as_trained(value, job, key) for key, (value, _) in varied.items()}
    return TrialSpec(index=index, name=name, params=params, job=job)


def _report(err, base: Base, varied, trial, problems: _Problems, cross: list) -> None:
    """A trial job's validation error, at the line where the user wrote its cause."""
    dotted = ".".join(str(p) for p in err["loc"])
    for key, (value, o) in varied.items():
        if dotted == key or dotted.startswith(key + "."):
            return _report_varied(o, _message(err), value, trial, problems)
    if any(not dotted or key.startswith(dotted + ".") for key in varied):
        cross.append((err, varied, trial))  # a check across fields, some of them varied
        return
    problems.add_once(("base", err["loc"], err["msg"]),
                      lambda: problem(base.path, JobSpec, base.node, err, base.prefix))


def _report_cross(cross: list, trials: int, base: Base, problems: _Problems) -> None:
    """A cross-field error (e.g. grad_checkpoint vs a varied segment_size) that
    every trial has is the base's; one only some trials have is their varied
    value's (the first varied key under the checked field)."""
    failing: dict = {}
    for err, _, trial in cross:
        failing.setdefault((err["loc"], err["msg"]), set()).add(trial)
    for err, varied, trial in cross:
        if len(failing[(err["loc"], err["msg"])]) == trials:
            problems.add(problem(base.path, JobSpec, base.node, err, base.prefix))
            continue
        dotted = ".".join(str(p) for p in err["loc"])
        key = next(k for k in varied if not dotted or k.startswith(dotted + "."))
        value, o = varied[key]
        _report_varied(o, _message(err), value, trial, problems)


def _message(err: Mapping[str, Any]) -> str:
    return err["msg"].removeprefix("Value error, ")


def _report_varied(o: Origin, msg: str, value, trial: str, problems: _Problems) -> None:
    if o.key.startswith("random."):
        # each draw differs: say which value failed, once per parameter and message
        drew = f"{value:.6g}" if isinstance(value, float) else repr(value)
        problems.add(f"{o.path}:{o.line}: {o.key}: {msg} (drew {drew} for trial {trial})",
                     dedupe=(o, msg))
    else:
        problems.add(f"{o.path}:{o.line}: {o.key}: {msg}")


def _check_scheduler(sch: SchedulerSpec, trial: TrialSpec, path: Path, root,
                     problems: _Problems) -> None:
    """Every trial must run max_steps and evaluate at every rung: the head decides on
    the evals it receives, so a trial without one at a rung would never be judged."""
    train = trial.job.train
    where = lambda key: f"{path}:{line_of(root, ['scheduler', key])}: scheduler.{key}"
    if trial.job.data.valid is None:
        problems.add(f"{where('metric')}: asha needs data.valid (it compares val_loss)")
    if not train.eval_every or sch.grace_steps % train.eval_every:
        problems.add(f"{where('grace_steps')}: asha needs train.eval_every to divide grace_steps "
                     f"({sch.grace_steps}) so every trial evaluates at every rung; "
                     f"train.eval_every is {train.eval_every}",
                     dedupe=("eval_every", train.eval_every))
    if train.iters != sch.max_steps:
        have = "epochs" if train.iters is None else f"train.iters {train.iters}"
        problems.add(f"{where('max_steps')}: must equal train.iters of every trial; trial "
                     f"{trial.name} has {have}", dedupe=("max_steps",))


def _get_dotted(d: Any, key: str):
    for part in key.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def _missing(key: str, value: str) -> str:
    p = Path(value)
    if problem := path_problem(value):
        return problem
    try:
        if key == "model":
            if not p.is_dir():
                return f"model folder not found: {p}"
            if not (p / "config.json").is_file():
                return f"no config.json in {p} (expected a Hugging Face model folder)"
            return ""
        return "" if p.is_file() else f"file not found: {p}"
    except OSError as e:  # a name the file system refuses
        return f"cannot use {p}: {e.strerror or e}"


def _as_trained(value, job: JobSpec, key: str):
    """The varied value as written, except a number YAML read as a string
    (PyYAML reads `1e-4` as a string) is recorded as the number trained with."""
    if not isinstance(value, str):
        return value
    trained: Any = job
    for part in key.split("."):
        fields = type(trained).model_fields
        trained = getattr(trained, next((n for n, f in fields.items() if f.alias == part), part))
    return trained if isinstance(trained, (int, float)) and not isinstance(trained, bool) else value
