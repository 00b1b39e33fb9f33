"""What memory.offload disk costs a step, side by side in one process: one model,
one row, the same step with its boundaries in memory and on disk in the ways a
discrete GPU may move them (engine/offload.py), in turn. One JSON row per step.

    python -m bench.offload --seq 32768                    # the 8B 4-bit shape (GPU)
    python -m bench.offload --seq 2048 --layers 4 --dim 256 \\
        --vocab 1024 --dtype float32 --no-quantize          # a CPU-sized check

Variants: "memory" keeps the boundaries in memory; "copies", the engine's path,
keeps them on disk, and on a discrete GPU copies their bytes out of and back into
device memory through a small page-locked buffer; "faults" keeps them on disk
with the copies off, as a driver that refuses them leaves it: on CUDA, MLX's
managed memory then moves each boundary between device and host a page fault at
a time. On unified memory (a Mac, the CPU) there is nothing to copy and both disk
variants are one path. Every step computes the same thing (steps do not update
the model): `max_rel` is the largest relative difference of its gradients'
squared norms and its loss from the first step's (0 on the CPU; on CUDA the
backward's reductions do not repeat bit for bit, ~1e-3). `write_wait_s` /
`read_wait_s`: how long the step waited for the disk; `append_s` / `pop_s`: how
long its thread spent handing boundaries over, those waits included.

--check N first round-trips N boundaries of the step's size through the engine's
disk path and prints one row: whether every bit came back (`equal`), and whether
the copies stayed on (`copies_off`: the driver's refusal, where one came).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import segctl  # noqa: F401 (first: it sizes MLX's CUDA attention caches before MLX loads)

# isort: split
import mlx.core as mx

from bench.engine import _device_name, bench_model
from segctl.engine import offload as offload_mod
from segctl.engine.data import Example
from segctl.engine.model import model_parts
from segctl.engine.settings import StepMemory
from segctl.engine.step import loss_and_grads

# variant: whether a discrete GPU's copies are on ("memory" writes no file)
VARIANTS = {"memory": True, "faults": False, "copies": True}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--arch", default="llama")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", type=int, default=4)
    p.add_argument("--no-quantize", dest="quantize", action="store_const", const=0)
    p.add_argument("--rounds", type=int, default=2, help="times each variant runs, interleaved")
    p.add_argument("--dir", default=None, help="the scratch folder (default: a temporary one)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="first round-trip N random boundaries through the disk and compare bits")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (of {', '.join(VARIANTS)})")
    big = args.dim == 4096   # the Llama-3.1-8B shape; otherwise the generic one
    model = bench_model(args.arch, args.layers, args.dim, args.vocab, args.dtype,
                        intermediate=args.intermediate or (14336 if big else None),
                        heads=32 if big else None, kv_heads=8 if big else None,
                        head_dim=128 if big else None, tie=False if big else None,
                        quantize=args.quantize)
    parts = model_parts(model, check=False)
    mx.random.seed(123)
    ids = mx.random.randint(0, args.vocab, (args.seq,)).tolist()
    example = Example(ids, args.seq // 2)
    scratch = args.dir or tempfile.mkdtemp(prefix="segctl-bench-offload-")
    copies = offload_mod._device_copies()
    first = None
    try:
        if args.check and not check_round_trip(args, scratch, copies):
            sys.exit("offload check: a boundary came back with other bits")
        # a first step (kernel builds), then the variants in turn, `rounds` times
        for n, variant in enumerate(variants[-1:] + variants * args.rounds):
            offload_mod._DEVICE_COPIES[:] = [copies if VARIANTS[variant] else None]
            clock, metrics = [], {}
            mx.clear_cache()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            loss, grads = loss_and_grads(model, example,
                                         memory=StepMemory(segment_size=1, head_chunk=512,
                                                           attn_block=1024, mlp_chunk=4096,
                                                           offload=None if variant == "memory" else scratch),
                                         parts=parts,
                                         on_phase=lambda label: clock.append((label, time.perf_counter())),
                                         metrics=metrics)
            mx.eval(loss, grads)
            step_s = time.perf_counter() - t0
            peak = mx.get_peak_memory() / 1e9
            sums = {k: mx.sum(v.astype(mx.float32) ** 2).item() for k, v in grads.items()}
            sums["loss"] = loss.item()
            if first is None:
                first = sums
            max_rel = max(abs(v - first[k]) / max(abs(first[k]), 1e-30) for k, v in sums.items())
            labels = [label for label, _ in clock]
            h = labels.index("head")
            print(json.dumps({
                "bench": "offload", "step": n,
                "variant": f"first step (builds, {variant})" if n == 0 else variant,
                "seq": args.seq, "arch": args.arch, "layers": args.layers, "dim": args.dim,
                "dtype": args.dtype, "quantize": args.quantize, "copies_here": copies is not None,
                "step_s": round(step_s, 3), "fwd_s": round(clock[h - 1][1] - t0, 3),
                "head_s": round(clock[h][1] - clock[h - 1][1], 3),
                "bwd_s": round(clock[-1][1] - clock[h][1], 3), "peak_gb": round(peak, 4),
                **{f"{key}_s": round(metrics.get(f"offload_{key}_s", 0.0), 6)
                   for key in ("write_wait", "read_wait", "append", "pop")},
                "loss": loss.item(), "max_rel": float(f"{max_rel:.3g}"),
                "device": str(mx.default_device()), "device_name": _device_name(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S")}), flush=True)
    finally:   # the engine's copier as it was
        offload_mod._DEVICE_COPIES[:] = [copies]
        if not args.dir:
            os.rmdir(scratch)


def check_round_trip(args, scratch: str, copies) -> bool:
    """N random [1, seq, dim] boundaries appended, then popped: one row saying
    whether every bit came back, and how long the writes and reads took. True
    if every bit did."""
    dtype = getattr(mx, args.dtype)
    unsigned = offload_mod._UNSIGNED[dtype.size][0]
    sent = [mx.random.normal((1, args.seq, args.dim), key=mx.random.key(i)).astype(dtype)
            for i in range(args.check)]
    mx.eval(sent)
    with offload_mod.Boundaries(scratch, copies=copies) as stack:
        t0 = time.perf_counter()
        for h in sent:
            stack.append(h)
        stack.settle()
        t1 = time.perf_counter()
        back = [stack.pop() for _ in sent][::-1]
        mx.eval(back)
        t2 = time.perf_counter()
    equal = all(mx.array_equal(a.view(unsigned), b.view(unsigned)).item()
                for a, b in zip(sent, back))
    print(json.dumps({
        "bench": "offload-check", "boundaries": args.check, "seq": args.seq, "dim": args.dim,
        "dtype": args.dtype, "gb": round(sum(h.nbytes for h in sent) / 1e9, 4),
        "equal": equal, "copies_here": copies is not None,
        "copies_off": copies.off if copies is not None else None,
        "write_s": round(t1 - t0, 4), "read_s": round(t2 - t1, 4),
        "device": str(mx.default_device()), "device_name": _device_name(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S")}), flush=True)
    return equal


if __name__ == "__main__":
    sys.exit(main())
