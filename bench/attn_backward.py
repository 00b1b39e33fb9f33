"""The blocked attention backward alone at long context: one JSON row per repeat.

    python -m bench.attn_backward --seq 128000 --block 256 [--reps 2] [--tile 4096]

q, k, v and the output's cotangent of one layer (Llama-3.1-8B's attention: 32
query heads over 8 K/V heads of 128, bf16) at random, then
`engine.attention.blocked_grads` under the engine's causal BlockMask of `block`
rows, as a layer's backward calls it: each block through MLX's attention
backward (`--tile 0`), or over more than `--tile` keys tile by tile
(`attention.tiled_vjp`, with the attention's output computed first). A row: seconds, MLX's active, cache and
peak memory after it, and on an NVIDIA GPU the device memory in use
(nvidia-smi), which also counts what CUDA's memory pool keeps after MLX frees it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time

import segctl  # noqa: F401  (sets MLX's CUDA attention cache sizes before MLX loads)

# isort: split
import mlx.core as mx

from segctl.engine import attention


def _device_used_gb() -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return round(float(out[0]) / 1024, 3) if out else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.attn_backward", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--tile", type=int, default=0,
                   help="keys per tile of the tiled backward (0: MLX's backward per block)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a = p.parse_args(argv)
    ks = mx.random.split(mx.random.key(0), 4)
    shape = lambda h: (1, h, a.seq, a.head_dim)
    dtype = getattr(mx, a.dtype)
    q, k, v, do = (mx.random.normal(shape(h), key=key).astype(dtype)
                   for h, key in zip((a.heads, a.kv_heads, a.kv_heads, a.heads), ks))
    mask, scale = attention.BlockMask(rows=a.block), a.head_dim ** -0.5
    delta = None
    if a.tile:   # at any length, not only past the engine's ATTN_TILED_ABOVE
        attention.ATTN_KEY_TILE, attention.ATTN_TILED_ABOVE = a.tile, 0
        with attention.eager_blocks():
            out = attention.attend(q, k, v, scale, mask)
        delta = (do.astype(mx.float32) * out.astype(mx.float32)).sum(-1)
        del out
    mx.eval(q, k, v, do, delta)
    mx.reset_peak_memory()
    for rep in range(a.reps):
        row = dict(seq=a.seq, block=a.block, tile=a.tile, heads=a.heads, kv_heads=a.kv_heads,
                   head_dim=a.head_dim, dtype=a.dtype, rep=rep, device=str(mx.default_device()))
        tic = time.perf_counter()
        try:
            out = attention.blocked_grads(q, k, v, do, mask, scale, a.block, delta=delta)
            mx.eval(out)
            del out
        except RuntimeError as e:
            row["error"] = str(e).splitlines()[0][:200]
        row.update(seconds=round(time.perf_counter() - tic, 3),
                   active_gb=round(mx.get_active_memory() / 1e9, 3),
                   cache_gb=round(mx.get_cache_memory() / 1e9, 3),
                   peak_gb=round(mx.get_peak_memory() / 1e9, 3),
                   device_used_gb=_device_used_gb())
        print(json.dumps(row), flush=True)
        if "error" in row:
            break


if __name__ == "__main__":
    main()
