"""The central stores' tables: the Arrow schema of each Parquet dataset under
`<stores root>/telemetry/`, and where things live in the zarr stores.

Pure data. Every file of a dataset is written with exactly these schemas, so a
reader (pyarrow.dataset, pandas, duckdb) sees one schema across attempts, even
when a column is empty in one of them. Times are unix seconds, memory is GB
(1e9 bytes), as the engine reports them. The `sweep` column comes from the hive
partition folder (`sweep=<id>`), not from the files.
"""

from __future__ import annotations

import pyarrow as pa

# One row per optimizer step of an attempt (the engine's `step` event).
STEPS = pa.schema([
    ("trial", pa.string()),
    ("attempt", pa.int64()),          # global attempt id (state.db)
    ("step", pa.int64()),
    ("loss", pa.float64()),
    ("tokens", pa.int64()),           # supervised tokens in the step
    ("seconds", pa.float64()),
    ("tokens_per_s", pa.float64()),
    ("lr", pa.float64()),
    ("grad_norm", pa.float64()),
    ("peak_gb", pa.float64()),
    ("active_gb", pa.float64()),
    ("cache_gb", pa.float64()),
    ("time", pa.float64()),
    ("margin", pa.float64()),         # ORPO / DPO, else null: ORPO chosen minus rejected mean
                                      # log p; DPO chosen minus rejected reward
    ("accuracy", pa.float64()),       # ORPO / DPO: 1.0 when chosen beat rejected
    ("prefix_shared", pa.bool_()),    # ORPO / DPO: false = the step ran two branches
    ("chosen_reward", pa.float64()),  # DPO only: beta * (log p - reference log p) of chosen
    ("rejected_reward", pa.float64()),  # DPO only: the same of rejected
    ("rows", pa.int64()),             # rows in the step (batch_size x grad_accumulation)
    ("sequences", pa.int64()),        # sequences they ran as (fewer when packed)
    ("seq_tokens", pa.int64()),       # tokens of those sequences (tokens_per_s counts supervised)
    ("pack_efficiency", pa.float64()),  # packed: seq_tokens / (sequences x pack_length)
    # A job on several nodes: a row per rank and step. This rank, its share of the
    # step's rows, and its all_sum's seconds and bytes; null on one node.
    ("rank", pa.int64()),
    ("rank_rows", pa.int64()),
    ("allreduce_s", pa.float64()),
    ("allreduce_bytes", pa.int64()),
])

# One row per evaluation (the engine's `eval` event).
EVALS = pa.schema([
    ("trial", pa.string()),
    ("attempt", pa.int64()),
    ("step", pa.int64()),
    ("val_loss", pa.float64()),
    ("val_tokens", pa.int64()),
    ("seconds", pa.float64()),
    ("time", pa.float64()),
])

# One row per attempt, written when it ends (from the head's record of it).
ATTEMPTS = pa.schema([
    ("trial", pa.string()),
    ("attempt", pa.int64()),
    ("attempt_no", pa.int64()),       # 1, 2, ... within the trial
    ("node", pa.string()),
    ("chip", pa.string()),
    ("segment_size", pa.int64()),
    ("predicted_gb", pa.float64()),
    ("budget_gb", pa.float64()),
    ("outcome", pa.string()),         # schemas.records.OUTCOMES
    ("message", pa.string()),
    ("started", pa.float64()),
    ("ended", pa.float64()),
    ("steps", pa.int64()),
    ("peak_gb", pa.float64()),
    ("final_loss", pa.float64()),
    ("val_loss", pa.float64()),
])

# dataset name (folder under telemetry/) -> schema
TABLES = {"steps": STEPS, "evals": EVALS, "attempts": ATTEMPTS}

# The segment-size plan table: one row per probe point of `segctl tune`, under
# telemetry/plan/model=<model key>/ (hive-partitioned by the model's planner
# facts, orchestrator/planner.model_key). A re-measured point adds a newer row;
# readers take the latest row of each point.
PLAN = pa.schema([
    ("tune", pa.string()),            # the tune run that measured it
    ("time", pa.float64()),
    ("model_name", pa.string()),      # the model folder as the user named it
    ("n_layers", pa.int64()),
    ("method", pa.string()),          # sft | orpo[-shared] | dpo[-shared] (planner.method_key)
    ("node_class", pa.string()),      # chip/<budget>GB
    ("node", pa.string()),
    ("chip", pa.string()),
    ("budget_gb", pa.float64()),
    ("lora_rank", pa.int64()),
    ("lora_layers", pa.int64()),
    ("lora_keys", pa.string()),       # JSON list, "" = every linear
    ("head_chunk", pa.int64()),
    ("attn_block", pa.int64()),
    ("seq_len", pa.int64()),
    ("segment_size", pa.int64()),
    ("fits", pa.bool_()),             # False: the memory guard stopped it
    ("peak_gb", pa.float64()),        # highest step peak (not fitting: the peak it was stopped at)
    ("phases", pa.list_(pa.string())),
    ("phase_peaks", pa.list_(pa.float64())),   # each phase's own peak, highest over the steps
    ("step_s", pa.float64()),         # median seconds per step after the first
    ("steps", pa.int64()),
    ("message", pa.string()),
])
PLAN_TABLE = "plan"

# The engine event whose rows fill a table (the attempts row comes from the head).
TABLE_EVENT = {"steps": "step", "evals": "eval"}

# Paths under the stores root.
STAGING_DB = "staging.db"
TELEMETRY = "telemetry"
MEMORY_ZARR = "memory.zarr"       # <sweep>/<trial>/attempt-<id>: float32 [steps, phases]
ADAPTERS_ZARR = "adapters.zarr"   # <trial>/adapter/data, <trial>/checkpoints/step-NNNNNNN/data (packed)
TEMP = ".staging"                 # temp builds, renamed into place; no reader lists it
KEEP_CHECKPOINTS = 3


def telemetry_file(table: str, sweep: str, attempt: int) -> str:
    """Path of one attempt's file of a dataset, relative to the stores root."""
    return f"{TELEMETRY}/{table}/sweep={sweep}/attempt-{attempt}.parquet"


def plan_file(model_key: str, tune: str, node: str, seq_len: int, segment_size: int) -> str:
    """Path of one probe point's row, relative to the stores root."""
    return (f"{TELEMETRY}/{PLAN_TABLE}/model={model_key}/"
            f"{tune}-{node}-L{seq_len}-s{segment_size}.parquet")


def memory_array(sweep: str, trial: str, attempt: int) -> str:
    return f"{MEMORY_ZARR}/{sweep}/{trial}/attempt-{attempt}"


def checkpoint_group(trial: str, step: int) -> str:
    return f"{ADAPTERS_ZARR}/{trial}/checkpoints/step-{step:07d}"


def adapter_group(trial: str) -> str:
    return f"{ADAPTERS_ZARR}/{trial}/adapter"
