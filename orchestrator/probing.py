"""Tune probes (`segctl tune`): which free node measures each queued node class,
and what a class's end means. Probes go before any pending trial (what they
measure plans the trials); a probe measures a whole node, so it takes only a node
nothing runs on. Pure: the controller (head.py) starts the probes on the agents
and writes the classes' states."""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

from segctl.schemas.defaults import DEFAULT_MLP_CHUNK
from segctl.schemas.records import NodeInfo, ProbeSpec, TuneState

from .measured import lora_keys_text
from .snapshot import Held


class Queued(NamedTuple):
    """A QUEUED class of a tune: its request, its points and how many are done."""
    tune: str
    node_class: str
    request: dict
    points: list
    done: int = 0


class ProbeOn(NamedTuple):
    """Start tune `tune`'s probe of `node_class` on `node` (it holds the node whole)."""
    tune: str
    node_class: str
    node: str
    spec: ProbeSpec


class NoNode(NamedTuple):
    """No node of the class is up: the class fails with `error`."""
    tune: str
    node_class: str
    error: str


def assign(queued: list[Queued], free: list[NodeInfo], nodes: Mapping[str, NodeInfo],
           held: Held) -> tuple[list[ProbeOn | NoNode], list[NodeInfo]]:
    """Each queued class gets a free node of its class that nothing runs on, in
    order (the oldest tune first); a class with no node of it up fails; one whose
    nodes are busy waits. Returns the decisions and the nodes left free."""
    out: list[ProbeOn | NoNode] = []
    for c in queued:
        node = next((n for n in free if n.node_class == c.node_class and not held.get(n.name)),
                    None)
        if node is None:
            if not any(n.node_class == c.node_class for n in nodes.values()):
                out.append(NoNode(c.tune, c.node_class, f"no node of class {c.node_class} is up"))
            continue
        out.append(ProbeOn(c.tune, c.node_class, node.name, probe_spec(c, node)))
        free = [n for n in free if n.name != node.name]
    return out, free


def probe_spec(c: Queued, node: NodeInfo) -> ProbeSpec:
    """What the node measures: the points after the `done` already filed (a probe
    walks its points in order, so after a head restart those are the ones left)."""
    req = c.request
    return ProbeSpec(model=req["model"], method=req["method"],
                     prefix_shared=req["prefix_shared"], lora=req["lora"],
                     head_chunk=req["head_chunk"], attn_block=req["attn_block"],
                     # a tune filed by an older head has no mlp_chunk
                     mlp_chunk=req.get("mlp_chunk", DEFAULT_MLP_CHUNK),
                     budget_gb=node.memory_gb, points=c.points[c.done:],
                     steps=req["steps"], pack_rows=req.get("pack_rows", 1),
                     # a tune filed by an older head packed wherever it had rows
                     pack=req.get("pack", "auto"))


def ended(error: Optional[str]) -> TuneState:
    """A class's state once its probe ended with `error` ('' or None: none;
    "cancelled": node/tune_runner.py's word for a cancel)."""
    error = error or ""
    return (TuneState.CANCELLED if error == TuneState.CANCELLED.value else
            TuneState.FAILED if error else TuneState.DONE)


def point_row(tune: str, request: dict, node_class: str, node: str, chip: str,
              budget_gb: float, event: dict) -> dict:
    """The plan table's row for one point a node measured (`event`, from
    node/tune_runner.py) under tune `tune`'s `request`."""
    lora = request["lora"]
    return dict(tune=tune, time=event["time"], model_name=request["model_name"],
                n_layers=request["n_layers"], method=request["method_key"],
                node_class=node_class, node=node, chip=chip, budget_gb=budget_gb,
                lora_rank=lora["rank"], lora_layers=lora["num_layers"],
                lora_keys=lora_keys_text(lora.get("keys")), head_chunk=request["head_chunk"],
                attn_block=request["attn_block"], seq_len=event["seq_len"],
                segment_size=event["segment_size"], fits=event["fits"], peak_gb=event["peak_gb"],
                phases=[label for label, _ in event["phases"]],
                phase_peaks=[peak for _, peak in event["phases"]],
                step_s=event.get("step_s"), steps=event["steps"],
                message=event.get("message", ""))
