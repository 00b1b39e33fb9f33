"""Run a named set of bench.engine configurations, each in its own process (mlx-lm's
grad_checkpoint patches a class for the whole process), side by side in one run.

    python -m bench.suite cpu   > bench/results/cpu.jsonl
    python -m bench.suite h200 2048,8192 >> bench/results/h200.jsonl
    python -m bench.suite cpu-orpo | h200-orpo | cpu-gemma4 | h200-gemma4
    python -m bench.suite cpu-windows --baseline /tmp/segctl-before > bench/results/cpu-windows.jsonl
    python -m bench.suite cpu-long  > bench/results/cpu-long.jsonl     # CPU scale (see LLAMA_CPU)
    python -m bench.suite h200-long > bench/results/h200-long.jsonl    # Llama-3.1-8B QLoRA to 128K
    python -m bench.suite mac 8192  > bench/results/mac.jsonl          # Apple Silicon, >= 32 GB
    python -m bench.suite table bench/results/mac.jsonl               # the table again

The long plans (cpu-long, h200-long, mac) pass --mlp-chunk and --offload, which
bench.engine puts in the step's StepMemory.
The mac plan then runs bench.throughput's configurations (training tokens per
second on a length mix) and bench.merge (whether compile merges a block's
recompute with its forward), each printing its own rows and, at the end, table.

Each row is printed as it lands; a configuration that fails prints a row with
"error" instead of stopping the suite. When the plan is done, a table of its rows
goes to stderr (stdout stays JSON): per model shape and length, each
configuration's peak, step time and tokens per GB, with its peak and step as a
ratio of mlx-lm grad_checkpoint's in the same run where the plan has that row
(mlx-lm-lora's, in the ORPO plans). `python -m bench.suite table ROWS.jsonl`
prints the same table from saved rows.

`--baseline DIR` (a checkout of another commit, e.g. `git archive HEAD | tar -x -C
DIR`) runs every configuration again right after this tree's, with DIR's own
bench.engine and engine; each row is tagged `code`: "this" or "baseline".
Compare only configurations that both trees' bench_model build alike
(gemma3_text is new since ae9b9b3).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.jsonl import read_rows

CPU = dict(arch="qwen3", layers=8, dim=256, vocab=32000, dtype="float32", steps=3)
QWEN3_06B = dict(arch="qwen3", layers=28, dim=1024, vocab=151936, dtype="bfloat16", steps=3)
# Llama-3.1-8B's shape (untied, GQA 32/8 heads of 128), base model quantized to 4 bits:
# QLoRA as Mac users run it.
LLAMA_8B = dict(arch="llama", layers=32, dim=4096, intermediate=14336, heads=32, kv_heads=8,
                head_dim=128, vocab=128256, tie=False, rope_theta=500000.0, quantize=4,
                dtype="bfloat16", steps=2)
# the same structure at CPU scale. MLX's CPU quantized matmul is ~100x slower than its
# dense one (mlx 0.32: 512 x 512 -> 32000 takes 5.3 s against 0.06 s): ~75 s a step at
# 2048 on 2 cores quantized, so the CPU rows keep the base weights in fp32.
LLAMA_CPU = dict(arch="llama", layers=4, dim=512, intermediate=1792, heads=8, kv_heads=2,
                 head_dim=64, vocab=32000, tie=False, quantize=0, dtype="float32", steps=2)

COMPARE = [
    dict(impl="mlx-lm", mode="plain"),
    dict(impl="mlx-lm", mode="checkpoint"),
    dict(impl="segctl", mode="plain"),
    dict(impl="segctl", mode="checkpoint"),
    dict(impl="segctl", mode="segmented", segment_size=1, phases=True),
    dict(impl="segctl", mode="segmented", segment_size=2),
    dict(impl="segctl", mode="segmented", segment_size=4),
]

# Blockwise attention backward against MLX's whole-matrix one, side by side.
BLOCKED = [
    dict(impl="mlx-lm", mode="checkpoint"),
    dict(impl="segctl", mode="segmented", segment_size=1),
    dict(impl="segctl", mode="segmented", segment_size=1, attn_block=1024, phases=True),
    dict(impl="segctl", mode="segmented", segment_size=2, attn_block=1024),
    dict(impl="segctl", mode="segmented", segment_size=1, attn_block=4096),
]

# ORPO, one preference pair (prompt = seq/2, chosen and rejected seq/2 each): mlx-lm-lora's
# trainer step against ours two-branch and prefix-shared at the job defaults.
ORPO = dict(method="orpo")
ORPO_COMPARE = [
    dict(ORPO, impl="mlx-lm-lora", mode="plain"),
    dict(ORPO, impl="mlx-lm-lora", mode="checkpoint"),
    dict(ORPO, impl="segctl", mode="segmented", segment_size=1, attn_block=2048, phases=True),
    dict(ORPO, impl="segctl", mode="segmented", segment_size=1, attn_block=2048,
         prefix_shared=True, phases=True),
    dict(ORPO, impl="segctl", mode="segmented", segment_size=2, attn_block=2048),
    dict(ORPO, impl="segctl", mode="segmented", segment_size=2, attn_block=2048,
         prefix_shared=True),
]
ORPO_PLAIN = [dict(ORPO, impl="segctl", mode="plain"),
              dict(ORPO, impl="segctl", mode="plain", prefix_shared=True)]

# Gemma-4-E2B-like (bench.engine.gemma4_config): 35 layers, 20 of them reading donor K/V.
GEMMA4_E2B = dict(arch="gemma4_text", layers=35, dim=1536, vocab=262144, dtype="bfloat16", steps=3)
GEMMA4_CPU = dict(arch="gemma4_text", layers=10, dim=256, vocab=32000, dtype="float32", steps=3)
GEMMA4_COMPARE = [
    dict(impl="mlx-lm", mode="plain"),
    dict(impl="mlx-lm", mode="checkpoint"),
    dict(impl="segctl", mode="segmented", segment_size=1, attn_block=2048, phases=True),
    dict(impl="segctl", mode="segmented", segment_size=2, attn_block=2048),
    dict(impl="segctl", mode="segmented", segment_size=5, attn_block=2048),
]

# Sliding-window layers: mlx-lm's grad_checkpoint against ours at the job defaults;
# on the CPU ours against a baseline checkout (--baseline) whose window layers take
# dense [L, L] masks.
GEMMA4_WIN_CPU = dict(arch="gemma4_text", layers=10, dim=256, vocab=32000, dtype="float32",
                      steps=2)
# gpt-oss-20b-like (bench.engine.gpt_oss_config), base weights (experts included) in 4 bits.
GPT_OSS_20B = dict(arch="gpt_oss", layers=24, dim=2880, vocab=201088, quantize=4,
                   dtype="bfloat16", steps=1)
GEMMA3_4B = dict(arch="gemma3_text", layers=34, dim=2560, vocab=262144, dtype="bfloat16",
                 steps=3)
WINDOWS = [dict(impl="mlx-lm", mode="checkpoint"),
           dict(impl="segctl", mode="segmented", segment_size=1, attn_block=2048, phases=True)]

# Long context: mlx-lm's checkpointed step against ours with the MLP in row chunks
# (mlp_chunk) and the segment boundaries offloaded to disk (offload).
OFFLOAD_DIR = "/tmp/segctl-offload"
MLX_CKPT = dict(impl="mlx-lm", mode="checkpoint")
SEG_1K = dict(impl="segctl", mode="segmented", segment_size=1, attn_block=1024, phases=True)


def _seg(mlp_chunk: int, offload: bool = False) -> dict:
    return dict(SEG_1K, mlp_chunk=mlp_chunk, **({"offload": OFFLOAD_DIR} if offload else {}))


def _cost(cfg: dict) -> float:
    """Rough step FLOPs (matmuls + causal attention), to run the cheapest rows first;
    offloading (disk traffic) sorts after the same row without it."""
    d, n = cfg["dim"], cfg["layers"]
    heads, kv = cfg.get("heads", max(1, d // 64)), cfg.get("kv_heads", max(1, d // 128))
    hd, inter = cfg.get("head_dim", 64), cfg.get("intermediate", 3 * d)
    per_layer = 2 * d * heads * hd + 2 * d * kv * hd + 3 * d * inter
    L = cfg["seq"]
    flops = 6 * L * (n * per_layer + cfg["vocab"] * d) + 6 * n * L * L * heads * hd
    return flops * (1.01 if cfg.get("offload") else 1.0)


def _by_cost(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=_cost)  # stable: ties keep their listed order


PLANS = {
    "cpu-long": _by_cost([dict(LLAMA_CPU, seq=seq, **c) for seq in (2048, 8192)
                          for c in (MLX_CKPT, _seg(0), _seg(1024), _seg(1024, offload=True))]),
    # What one lent H200 session of a few minutes measures, most wanted first.
    "h200-long": [dict(LLAMA_8B, seq=8192, **MLX_CKPT), dict(LLAMA_8B, seq=8192, **_seg(4096)),
                  dict(LLAMA_8B, seq=32768, **_seg(4096)),
                  dict(LLAMA_8B, seq=32768, **_seg(4096, offload=True)),
                  dict(QWEN3_06B, seq=65536, **_seg(4096), steps=1),
                  dict(LLAMA_8B, seq=65536, **_seg(4096, offload=True), steps=1),
                  dict(LLAMA_8B, seq=131072, **dict(_seg(4096, offload=True), attn_block=2048),
                       steps=1)],
    "h200-long-all": _by_cost(
        [dict(LLAMA_8B, seq=seq, **MLX_CKPT) for seq in (8192, 16384)] +
        [dict(LLAMA_8B, seq=seq, **_seg(m)) for seq in (8192, 16384, 32768) for m in (0, 4096)] +
        [dict(LLAMA_8B, seq=seq, **_seg(4096, offload=True)) for seq in (32768, 65536, 131072)] +
        [dict(QWEN3_06B, seq=32768, **MLX_CKPT)] +
        [dict(QWEN3_06B, seq=seq, **_seg(4096)) for seq in (32768, 65536)] +
        [dict(QWEN3_06B, seq=65536, **_seg(4096, offload=True))]),
    # The h200-long rows that fit a Mac with 32 GB or more of unified memory. On Apple
    # Silicon this runs on Metal as is (mlx's default device there).
    "mac": _by_cost(
        [dict(LLAMA_8B, seq=8192, **c) for c in (MLX_CKPT, _seg(4096))] +
        [dict(LLAMA_8B, seq=32768, **c) for c in (_seg(4096), _seg(4096, offload=True))] +
        [dict(QWEN3_06B, seq=32768, **c) for c in (MLX_CKPT, _seg(4096))]),
    # Long rows of the families whose attention is not plain (sinks, K/V donors),
    # tile by tile: most wanted first. (gpt-oss's 64 heads: 256-row blocks at 64K,
    # though its rows at 1024 and 256 peaked alike, results/h100-long-families.jsonl.)
    # A gpt-oss row at 64K takes ~7 minutes, a fresh machine's first row minutes more.
    # gpt-oss's rows with the optimizer's state made first (`--optimizer-state`): a
    # LoRA on each of its 32 experts a layer is 0.9 GB of moments that a first step
    # alone never holds. Gemma-4 at 32K to 128K, the boundaries on disk; and at 32K
    # in memory, where the planner is furthest over (bench/README.md).
    "gpu-long-families": [dict(GPT_OSS_20B, seq=65536, optimizer_state=True,
                               **dict(_seg(4096, offload=True), attn_block=256)),
                          dict(GEMMA4_E2B, seq=131072, **_seg(4096, offload=True), steps=1),
                          dict(GPT_OSS_20B, seq=32768, optimizer_state=True,
                               **dict(_seg(4096, offload=True), attn_block=512)),
                          dict(GEMMA4_E2B, seq=32768, **_seg(4096), steps=1),
                          *(dict(GEMMA4_E2B, seq=seq, **_seg(4096, offload=True), steps=1)
                            for seq in (32768, 49152, 65536, 98304)),
                          dict(GEMMA4_E2B, seq=32768, **MLX_CKPT, steps=1),
                          dict(GPT_OSS_20B, seq=32768, **MLX_CKPT)],
    # Gemma-4's kinds of layer apart (bench/README, "Long rows of every family"): the
    # same shape with the sharers' MLP as wide as the others', then with no layer
    # reading a donor's K/V, then with no per-layer inputs either, kept whole as the
    # model's own layers are (--no-rows); on disk, and at 32K in memory, where the
    # model's own last layer (a sharer) is the peak.
    "gpu-gemma4-kinds": [dict(GEMMA4_E2B, seq=seq, **_seg(4096, offload=disk), steps=1,
                              rows=False, **variant)
                         for variant in (dict(double_mlp=False), dict(kv_shared=0),
                                         dict(kv_shared=0, layer_input=0))
                         for seq, disk in ((32768, False), (32768, True), (131072, True))
                         if seq < 131072 or "kv_shared" in variant],
    # gpt-oss's 64K row at its own shape with 2 layers: on a fresh machine MLX builds
    # its CUDA kernels (minutes) here, so that the whole-model row (the first of
    # gpu-long-families, ~420 s a step) fits in the next 600-s call on that machine.
    "gpu-gpt-oss-warm": [dict(GPT_OSS_20B, layers=2, seq=65536, optimizer_state=True,
                              **dict(_seg(4096, offload=True), attn_block=256))],
    # Which layers run rows apart on this device (a row's `rows`, `tokenwise`,
    # `whole_rows`): gpt-oss's on CUDA once ran whole. Two layers, a minute.
    "gpu-rows-probe": [dict(GPT_OSS_20B, layers=2, seq=8192,
                            **dict(_seg(4096, offload=True), attn_block=512))],
    "cpu-orpo": [dict(CPU, seq=1024, **c) for c in ORPO_COMPARE + ORPO_PLAIN],
    "cpu-gemma4": [dict(GEMMA4_CPU, seq=1024, **c) for c in GEMMA4_COMPARE],
    # (mlx-lm-lora plain and segment size 2 two-branch are in h200-orpo-v0-densemask.jsonl)
    "h200-orpo": [dict(QWEN3_06B, seq=seq, **c) for seq in (2048, 8192)
                  for c in ORPO_COMPARE[1:4] + ORPO_COMPARE[5:]],
    "h200-gemma4": [dict(GEMMA4_E2B, seq=seq, **c) for seq in (2048, 8192)
                    for c in GEMMA4_COMPARE[:4]],
    "cpu": [dict(CPU, seq=1024, **c) for c in COMPARE + BLOCKED[2:4]],
    "cpu-windows": [dict(GEMMA4_WIN_CPU, seq=seq, impl="segctl", mode="segmented",
                         segment_size=1, attn_block=block)
                    for seq, block in ((1024, 0), (2048, 0), (2048, 1024), (4096, 1024))],
    "h200-windows": [dict(GEMMA4_E2B, seq=8192, **c) for c in WINDOWS] +
                    [dict(GEMMA3_4B, seq=seq, **c) for seq in (8192, 16384) for c in WINDOWS],
    # the job defaults (segment_size 1, head_chunk 512, attn_block 2048) vs mlx-lm
    "h200-default": [dict(QWEN3_06B, seq=seq, **c) for seq in (2048, 8192, 16384)
                     for c in (dict(impl="mlx-lm", mode="checkpoint"),
                               dict(impl="segctl", mode="segmented", segment_size=1,
                                    attn_block=2048))],
    "h200-blocked": [dict(QWEN3_06B, seq=seq, **c) for seq in (2048, 8192, 16384) for c in BLOCKED],
    "h200": [dict(QWEN3_06B, seq=seq, **c) for seq in (2048, 8192, 16384)
             for c in COMPARE if not (c["impl"] == "segctl" and c["mode"] in ("plain", "checkpoint")
                                      and seq > 2048)],
}


# Plans that also measure training throughput on a length mix (bench.throughput, its
# own configurations, a process each): its rows follow the plan's.
THROUGHPUT = {
    # three timed passes, the median's tokens/s: a Mac's pass of 32 rows is short
    "mac": ["--shape", "qwen3-0.6b", "--warm-pass", "--passes", "3"],
}

# Plans that also ask whether compile merges a block's recompute with its forward
# (bench.merge, in this process): its rows follow the throughput rows.
MERGE = {
    "mac": ["--shape", "qwen3-0.6b", "--layers", "4", "--rows", "4", "--tokens", "2048"],
}


# bench.engine flags that are argparse.BooleanOptionalAction: False renders --no-FLAG
# (elsewhere False means "leave the flag out").
NEGATABLE = {"tie", "rows", "double_mlp"}


def argv_of(cfg: dict) -> list[str]:
    out = []
    for k, v in cfg.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            if k in NEGATABLE:
                out.append("--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


def main(plan: str, seqs: list[int] | None = None, baseline: str | None = None) -> list[dict]:
    rows = []
    for cfg in PLANS[plan]:
        if seqs and cfg["seq"] not in seqs:
            continue
        for code, tree in [("this", None)] + ([("baseline", baseline)] if baseline else []):
            # `-m` puts the working directory first on sys.path: the tree's own code runs.
            tic = time.time()
            proc = subprocess.run([sys.executable, "-m", "bench.engine", *argv_of(cfg)],
                                  capture_output=True, text=True, cwd=tree)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            if proc.returncode == 0 and lines:
                row = json.loads(lines[-1])
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                row = dict(cfg, error=tail[0], rc=proc.returncode)
            if baseline:
                row["code"] = code
            row["wall_s"] = round(time.time() - tic, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if plan in THROUGHPUT and not seqs:
        from bench import throughput
        rows += throughput.main(throughput.parse(THROUGHPUT[plan]))   # prints its rows
    if plan in MERGE and not seqs:
        from bench import merge
        rows += merge.main(MERGE[plan])   # prints its rows
    return rows


# ---------------------------------------------------------------- the table

_SHAPE_KEYS = ("arch", "layers", "dim", "dtype", "seq")


def _shape(row: dict) -> str:
    quant = f", {row['quantize']}-bit base" if row.get("quantize") else ""
    return (f"{row['arch']} {row['layers']} x {row['dim']}{quant}, {row['dtype']}, "
            f"{row['seq']} tokens")


def _label(row: dict) -> str:
    """A configuration in words: who ran it and with what."""
    if row.get("impl", "segctl") != "segctl":
        mode = {"checkpoint": "grad_checkpoint"}.get(row["mode"], row["mode"])
        words = [f"{row['impl']} {mode}"]
    elif row.get("mode", "segmented") == "segmented":
        words = [f"ours, segment {row.get('segment_size') or 1}"]
        if row.get("attn_block"):
            words.append(f"attn_block {row['attn_block']}")
        words.append(f"mlp_chunk {row['mlp_chunk']}" if row.get("mlp_chunk") else "MLP whole")
        if row.get("offload"):
            words.append("offload disk")
    else:
        words = [f"ours, {row['mode']}"]
    if row.get("method", "sft") != "sft":
        words.insert(0, row["method"])
    if row.get("prefix_shared"):
        words.append("prefix-shared")
    code = f" ({row['code']})" if row.get("code") else ""
    return ", ".join(words) + code


def _num(x) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else ""


def _ratio(mine, base) -> str:
    return f"{mine / base:.2f}x" if mine and base else ""


def table(rows: list[dict]) -> str:
    """The rows as Markdown tables, one per model shape and length, in the order
    they came; ratios against that group's mlx-lm (or mlx-lm-lora) grad_checkpoint
    row of the same code (this tree's or --baseline's). bench.throughput's and
    bench.merge's rows (the mac plan's) follow in their own tables."""
    from bench import merge, throughput
    rates = [r for r in rows if r.get("bench") == "throughput"]
    merges = [r for r in rows if r.get("bench") == "merge"]
    rows = [r for r in rows if r.get("bench") not in ("throughput", "merge")]
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(_shape(row), []).append(row)
    out = []
    for shape, group in groups.items():
        out += [f"{shape}:", "",
                "| configuration | peak GB | step s | tokens/GB | peak vs mlx-lm "
                "| step vs mlx-lm |", "|---|---|---|---|---|---|"]
        for row in group:
            base = next((b for b in group if b.get("impl") in ("mlx-lm", "mlx-lm-lora")
                         and b.get("mode") == "checkpoint" and "error" not in b
                         and b.get("code") == row.get("code")), None)
            if "error" in row:
                out.append(f"| {_label(row)} | failed: {row['error']} | | | | |")
                continue
            peak, step = row.get("peak_gb"), row.get("step_s")
            if base is row:
                ratios = ["1", "1"]
            elif base is None:
                ratios = ["", ""]
            else:
                ratios = [_ratio(peak, base["peak_gb"]), _ratio(step, base["step_s"])]
            cells = [_label(row), _num(peak), _num(step), str(row.get("tokens_per_gb") or ""),
                     *ratios]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if rates:
        out.append(throughput.table(rates))
    if merges:
        out.append(merge.table(merges))
    return "\n".join(out)


def _read_rows(path: str) -> list[dict]:
    """A JSON-lines file of suite rows (bench.engine's, and the mac plan's
    bench.throughput and bench.merge rows)."""
    def why_not(row):
        if row.get("bench") in ("throughput", "merge"):
            return None
        missing = [k for k in _SHAPE_KEYS if k not in row]
        return f"not a bench.engine row (no {', '.join(missing)})" if missing else None
    return read_rows(path, "bench.suite table", why_not)


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def cli(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.suite",
        description="Run a plan of bench.engine configurations, a process each: JSON rows on "
                    "stdout, then a table of them on stderr. `table FILE` prints the table "
                    "of saved rows.")
    p.add_argument("plan", nargs="?", default="cpu",
                   help=f"one of: {', '.join(PLANS)}; or `table`")
    p.add_argument("seqs", nargs="?", default=None,
                   help="only these lengths, comma-separated (for `table`: the rows' file)")
    p.add_argument("--baseline", metavar="DIR",
                   help="a checkout of another commit: each configuration runs there too")
    args = p.parse_args(argv)
    if args.plan == "table":
        if not args.seqs:
            p.error("table: which file? python -m bench.suite table ROWS.jsonl")
        print(table(_read_rows(args.seqs)))
        return
    if args.plan not in PLANS:
        p.error(f"unknown plan {args.plan!r} (one of: {', '.join(PLANS)})")
    try:
        seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else None
    except ValueError:
        p.error(f"seqs: {args.seqs!r} is not a comma-separated list of lengths")
    rows = main(args.plan, seqs, args.baseline)
    if rows:
        print(table(rows), file=sys.stderr)


if __name__ == "__main__":
    cli()
