"""The refusals `validate`, `plan`, `submit`, `train` and `tune` share: each exits
2 with one line naming where the user wrote what cannot run here (a model family
the engine refuses, packing it cannot do exactly, a tracker not installed).
Imports inside functions: see cli/__init__.py."""

from __future__ import annotations

from pathlib import Path

from . import _fail


def check_trackers(where, jobs) -> None:
    """Exit 2 naming the extra to install when a tracker of `report_to` is not
    installed here (refused now, not found missing mid-sweep)."""
    from segctl.orchestrator.trackers import missing
    trackers = {t.type: t for job in jobs for t in job.report_to}
    for line in missing(list(trackers.values())):
        _fail(f"{where}: {line}")


def check_families(where, models) -> None:
    """Exit 2 with the reason when a model folder holds an architecture the engine
    refuses (no weights are read). A folder that is not here is left to plan and
    submit, which need it."""
    from segctl.engine.model import ModelError, check_family
    for model in sorted(set(models)):
        if (Path(model) / "config.json").is_file():
            try:
                check_family(model)
            except ModelError as e:
                _fail(f"{where}: model: {e}")


def check_nodes(where, sweep, nodes) -> None:
    """Exit 2 when a trial asks for more nodes (`distributed.nodes`) than the
    cluster has that match the sweep's placement (`nodes`: the declared ones, or
    this machine alone without a cluster file), or over JACCL for more than it has
    cabled to each other: nothing is placed then."""
    from segctl.orchestrator.placement import mesh
    placement = dict(sweep.spec.placement)
    matching = [n for n in nodes if n.matches(placement)]
    have = [n.name for n in matching]
    which = f" matching placement {placement}" if placement else ""
    for t in sweep.trials:
        d = t.job.distributed
        if d.nodes > len(have):
            _fail(f"{where}: distributed.nodes: {d.nodes}: the cluster has {len(have)} "
                  f"node(s){which} ({', '.join(have) or 'none'}); a trial's ranks each take a "
                  "node of their own")
        if d.nodes > 1 and d.backend == "jaccl" and not mesh(matching, d.nodes):
            _fail(f"{where}: distributed.backend: jaccl: no {d.nodes} nodes of the "
                  f"cluster{which} are cabled to each other over RDMA (each names its device to "
                  "every other in the cluster file's nodes.*.rdma)")


def check_packing(spec: Path, sweep=None, jobs=None) -> None:
    """Exit 2 when a job asks `data.pack: true` of a model whose family the engine
    cannot pack exactly (PACKABLE_FAMILIES; config.json's model_type, or its
    text_config's), where the user wrote it: every trial of a sweep counts (its
    base or an axis may set it). `jobs` without `sweep`: job files named `spec`."""
    from segctl.orchestrator.planner import family_packs, model_types
    pairs = [(t.job, t) for t in sweep.trials] if sweep is not None else [(j, None) for j in jobs]
    packs: dict[str, bool] = {}   # model folder -> its verdict, read once per sweep
    for job, trial in pairs:
        if job.data.pack is not True or not (Path(job.model) / "config.json").is_file():
            continue   # a folder that is not here is left to plan and submit, which need it
        try:
            if job.model not in packs:
                packs[job.model] = family_packs(job.model)
            if packs[job.model]:
                continue
            types = model_types(job.model)
        except ValueError as e:
            _fail(f"{spec}: model: {e}")
        what = types[0] + (f" (text model {types[1]})" if types[1:] else "")
        _fail(f"{_pack_where(spec, sweep, trial)}: true: model type {what} cannot be packed "
              "exactly (use pack: auto, which trains it unpacked, or pack: false)")


def _pack_where(spec: Path, sweep, trial) -> str:
    """`file:line: key` of the data.pack a trial (or, without a sweep, the job file)
    has: its sweep axis, the sweep's inline job, or the base job file."""
    from segctl.schemas.yamlspec import line_of, load_yaml
    _, root = load_yaml(spec)
    if sweep is None:
        return f"{spec}:{line_of(root, ['data', 'pack'])}: data.pack"
    if "data.pack" in trial.params:
        if "data.pack" in sweep.spec.grid:
            value = trial.params["data.pack"]
            i = next((i for i, v in enumerate(sweep.spec.grid["data.pack"])
                      if v == value and type(v) is type(value)), None)   # 1 == True: the type too
            if i is None:
                return f"{spec}:{line_of(root, ['grid', 'data.pack'])}: grid.data.pack"
            return f"{spec}:{line_of(root, ['grid', 'data.pack', i])}: grid.data.pack[{i}]"
        return f"{spec}:{line_of(root, ['random', 'params', 'data.pack'])}: random.params.data.pack"
    if sweep.spec.job is not None:
        return f"{spec}:{line_of(root, ['job', 'data', 'pack'])}: job.data.pack"
    base = spec.parent / sweep.spec.base
    _, node = load_yaml(base)
    return f"{base}:{line_of(node, ['data', 'pack'])}: data.pack"
