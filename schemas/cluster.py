"""The cluster spec (`cluster.yaml`): the head, the planner's knobs and the
nodes of the fleet, as `segctl cluster up` / `segctl submit --cluster` read it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

# (schemas.cluster.DEFAULT_MARGIN and DEFAULT_MAX_TRIALS are these, for those who import them here)
from .defaults import DEFAULT_MARGIN, DEFAULT_MAX_TRIALS, DEFAULT_PORT, DEFAULT_SCALE, DEFAULT_STORES
from .errors import SpecError
from .limits import (
    HOST_PATTERN,
    LABEL_KEY_PATTERN,
    LABEL_PATTERN,
    MAX_HOST_CHARS,
    MAX_LABEL_CHARS,
    MAX_MEMORY_GB,
    MAX_PORT,
    MAX_TRIALS_PER_NODE,
    NODE_NAME_PATTERN,
    RDMA_DEVICE_PATTERN,
    check_path,
)
from .yamlspec import first_problems, line_of, load_yaml, not_a_mapping, problem

# Node labels become Ray node labels; these come from the node itself (NodeInfo.matches).
RESERVED_LABELS = ("chip", "name", "os")


class Strict(BaseModel):
    # `labels: {rack: 2}` means the label "2"
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)


def _label_key(key: str) -> str:
    if not re.fullmatch(LABEL_KEY_PATTERN, key):
        raise ValueError(f"label key '{key}': use lowercase letters, digits, '.', '_', '-' "
                         "(starting with a letter or digit)")
    if key in RESERVED_LABELS:
        raise ValueError(f"label key '{key}' is reserved ({', '.join(RESERVED_LABELS)} come from the node)")
    return _label(key)


def _label(value: str) -> str:
    """A value that becomes a Ray node label (node name, chip, label key or value)."""
    if len(value) > MAX_LABEL_CHARS or not re.fullmatch(LABEL_PATTERN, value):
        raise ValueError(f"'{value[:80]}' is not a Ray label: at most {MAX_LABEL_CHARS} letters, "
                         "digits, '.', '_', '-', starting and ending with a letter or digit")
    return value


def _host(value: str) -> str:
    """An ssh target or address: handed to ssh and Ray, so never an option (-o...)."""
    if len(value) > MAX_HOST_CHARS or not re.fullmatch(HOST_PATTERN, value):
        raise ValueError(f"'{value[:80]}' is not a host: at most {MAX_HOST_CHARS} letters, digits "
                         "and '_.@:%+-[]', starting with a letter, digit, '_' or '['")
    return value


def _rdma_device(value: str) -> str:
    """An RDMA device name as `ibv_devices` lists it (macOS: rdma_en2, rdma_en3...)."""
    if not re.fullmatch(RDMA_DEVICE_PATTERN, value):
        raise ValueError(f"'{value[:80]}' is not an RDMA device name (as ibv_devices lists them: "
                         "rdma_en3, say)")
    return value


Label = Annotated[str, AfterValidator(_label)]
Host = Annotated[str, AfterValidator(_host)]


class HeadSpec(Strict):
    address: Host = Field("auto", description="the head's address nodes join; auto = this machine's")
    port: int = Field(DEFAULT_PORT, ge=1, le=MAX_PORT, description="Ray GCS port")
    stores: Annotated[str, AfterValidator(check_path)] = Field(
        DEFAULT_STORES, description="stores root on the head (state.db, telemetry/, memory.zarr, "
                                 "adapters.zarr)")


class PlannerSpec(Strict):
    margin: float = Field(DEFAULT_MARGIN, ge=0, lt=1, description="fraction of a node's budget kept free")
    scale: float = Field(DEFAULT_SCALE, gt=0, description="multiplies the analytic peak estimate")


class NodeSpec(Strict):
    name: Label = Field(pattern=NODE_NAME_PATTERN, description="unique in the cluster")
    host: Optional[Host] = Field(None, description="ssh target (user@host allowed); "
                                                   "required unless local")
    local: bool = Field(False, description="run as a real Ray node process on this machine")
    chip: Label = Field("unknown", description="e.g. m2-ultra")
    memory_gb: float = Field(gt=0, le=MAX_MEMORY_GB, description="training budget on the node")
    max_trials: int = Field(DEFAULT_MAX_TRIALS, ge=1, le=MAX_TRIALS_PER_NODE,
                            description="trials it runs at once, each under its own memory "
                                        "guard, as long as their predicted peaks fit memory_gb")
    labels: dict[Annotated[str, AfterValidator(_label_key)], Label] = Field(
        {}, description="extra node labels a sweep's placement can ask for")
    rdma: dict[Label, Annotated[str, AfterValidator(_rdma_device)]] = Field(
        {}, description="for distributed.backend jaccl: peer node name -> this Mac's RDMA "
                        "device whose Thunderbolt 5 cable goes to it (e.g. rdma_en3)")


class ClusterSpec(Strict):
    head: HeadSpec = HeadSpec()
    planner: PlannerSpec = PlannerSpec()
    nodes: list[NodeSpec] = Field([], description="at least one")


def load_cluster(path: str | Path) -> ClusterSpec:
    """Validate a cluster file; raise SpecError with every problem. `head.stores`
    comes back absolute (`~` expanded, relative to the file's folder)."""
    path = Path(path)
    data, root = load_yaml(path)
    if not isinstance(data, dict):
        raise SpecError([not_a_mapping(path, data)])
    problems = []
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as e:
        problems += [problem(path, ClusterSpec, root, err) for err in e.errors()]
        spec = None
    problems += _cross_checks(path, data, root)
    if problems:
        # in file order, whichever check found them
        in_order = sorted(problems, key=lambda p: int(p.removeprefix(f"{path}:").split(":")[0]))
        raise SpecError(first_problems(path, in_order))
    assert spec is not None   # else pydantic's problems were raised above
    stores = Path(os.path.expanduser(spec.head.stores))
    stores = (path.resolve().parent / stores).resolve()
    return spec.model_copy(update={"head": spec.head.model_copy(update={"stores": str(stores)})})


def _cross_checks(path: Path, data: dict, root) -> list[str]:
    """Checks across fields, on the raw data so they run even when some field is
    bad (every problem in one go); each points at the line to fix."""
    nodes = data.get("nodes")
    if nodes is None or nodes == []:
        line = line_of(root, ["nodes"]) if "nodes" in data else 1
        return [f"{path}:{line}: nodes: a cluster needs at least one node"]
    if not isinstance(nodes, list):
        return []  # pydantic said so
    problems: list[str] = []
    seen: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            continue
        name = node.get("name")
        if isinstance(name, (str, int)) and not isinstance(name, bool):
            if str(name) in seen:
                problems.append(f"{path}:{line_of(root, ['nodes', i, 'name'])}: nodes.{i}.name: "
                                f"'{name}' is already the name of nodes.{seen[str(name)]}")
            else:
                seen[str(name)] = i
        if node.get("host") is None and node.get("local") is not True:
            problems.append(f"{path}:{line_of(root, ['nodes', i])}: nodes.{i}.host: "
                            f"required key is missing (or set local: true)")
    names = {str(n.get("name")) for n in nodes if isinstance(n, dict)}
    for i, node in enumerate(nodes):
        rdma = node.get("rdma") if isinstance(node, dict) else None
        for peer in rdma if isinstance(rdma, dict) else ():
            where = f"{path}:{line_of(root, ['nodes', i, 'rdma', peer])}: nodes.{i}.rdma.{peer}"
            if str(peer) == str(node.get("name")):
                problems.append(f"{where}: a node has no cable to itself")
            elif str(peer) not in names:
                problems.append(f"{where}: no node of the cluster is named '{peer}'")
    return problems
