"""The default of every knob that more than one package spells out, in one
place: the specs' Field defaults (schemas/job.py, schemas/cluster.py) are these
names, and so are the keyword defaults of the functions that take the same knob
(engine, planner, CLI). Stdlib only: the engine imports it where only MLX is
installed."""

from __future__ import annotations

import os
from pathlib import Path

# ------------------------------------------------------------------ job.yaml

DEFAULT_MAX_SEQ_LENGTH = 2048   # data.max_seq_length: tokens per row at most
DEFAULT_HEAD_CHUNK = 512        # memory.head_chunk: token positions per loss-head chunk
DEFAULT_ATTN_BLOCK = 2048       # memory.attn_block: query rows per attention-backward block
DEFAULT_MLP_CHUNK = 4096        # memory.mlp_chunk: rows per MLP chunk on long rows
# Not a job knob: rows side by side are cut into the groups that cost the fewest
# padded tokens plus this many a group, what one more pass through the layers
# costs beside its tokens (~0.07 s a segmented pass of a short row against ~15K
# tokens/s on an H100 at Qwen3-0.6B's shape, bench/README)
SIDE_PASS_TOKENS = 1024
# Not job knobs: on rows longer than ATTN_TILED_ABOVE tokens a query block's
# attention backward runs ATTN_KEY_TILE keys at a time (engine/attention.py
# tiled_vjp); the planner models the same.
ATTN_KEY_TILE = 4096
ATTN_TILED_ABOVE = 32768

# ------------------------------------------------------------------ cluster.yaml

DEFAULT_PORT = 6379             # head.port: Ray's GCS port
DEFAULT_STORES = "~/.segctl"    # head.stores, and $SEGCTL_HOME when unset
DEFAULT_MARGIN = 0.15           # planner.margin: fraction of a node's budget kept free
DEFAULT_SCALE = 1.0             # planner.scale: multiplies the analytic peak estimate
# Trials a node of a cluster file runs at once unless its entry says otherwise:
# small trials share a machine (the planner still keeps their predicted peaks
# within its budget).
DEFAULT_MAX_TRIALS = 2
# ... and one started by hand (`segctl node start`), or whose labels do not say.
DEFAULT_NODE_MAX_TRIALS = 1

# A node agent forwards an attempt's telemetry at least every TELEMETRY_FLUSH_S
# while it comes. A batch costs the head the same (a Ray call, two small SQLite
# transactions) whatever its size, so the head lengthens that interval for a large
# fleet: all its running attempts together send about TELEMETRY_CALLS_PER_S batches
# a second (500 nodes: every 2.5 s).
TELEMETRY_FLUSH_S = 0.5
TELEMETRY_CALLS_PER_S = 200


def segctl_home() -> Path:
    """The stores of a machine without a cluster file: $SEGCTL_HOME, else DEFAULT_STORES."""
    return Path(os.environ.get("SEGCTL_HOME") or DEFAULT_STORES).expanduser()


def stores_root(spec) -> Path:
    """Where the stores live: cluster `spec`'s head.stores, else segctl_home(). Here,
    not in orchestrator/fleet.py, so that the read-only commands import no more than
    they read with."""
    if spec is not None and spec.head.stores:
        return Path(spec.head.stores).expanduser()
    return segctl_home()
