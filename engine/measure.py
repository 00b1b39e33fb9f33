"""Probe runs for `segctl tune`: what one training step really needs at a given
(sequence length, segment size), measured rather than estimated.

One process loads the model once and walks the points. Each point gets a fresh
optimizer and a synthetic row of exactly `seq_len` tokens (random ids: memory
and time do not depend on which tokens), then a few steps through the same
`measured_step` a training run takes, under the same memory guard. A point the
guard stops is a measured "does not fit", reported like any other point.
A tune for a job whose micro-batch goes together (`pack_rows` > 1) measures that
many rows instead, the point's length in all, run as the job would run them
here: packed into one sequence, or side by side (unpadded where the family
allows), as engine/train decides on this device (`row_layout`).
"""

from __future__ import annotations

import math
import random
import statistics

import mlx.core as mx

from segctl.schemas import events as ev
from segctl.schemas.job import JobSpec
from segctl.schemas.records import ProbeSpec

from .data import Example, PreferenceExample
from .model import apply_lora, load_model, model_parts
from .optim import make_optimizer
from .settings import StepMemory
from .step import on_gpu
from .train import OOMError, measured_step, packing, side_by_side, unpadding


def run_probes(spec: ProbeSpec, emit, clock) -> None:
    """Emit one `Probe` event per point, in the spec's order. Raises ModelError
    for a model folder it cannot load."""
    model, tokenizer = load_model(spec.model)
    lora = spec.lora
    apply_lora(model, rank=lora.rank, scale=lora.scale, dropout=lora.dropout,
               num_layers=lora.num_layers, keys=lora.keys)
    parts = model_parts(model, check=False)
    vocab = len(tokenizer.get_vocab())   # ids any row of this model's data could hold
    method = (dict(method=spec.method, prefix_shared=spec.prefix_shared)
              if spec.method != "sft" else dict(method="sft"))
    model.train()
    layout = row_layout(spec, parts)
    for seq_len, segment_size in spec.points:
        rng = random.Random(spec.seed * 7919 + seq_len)
        if layout:   # the rows of one step, seq_len tokens in all
            k = min(spec.pack_rows, max(1, seq_len // 8))
            example = [synthetic_row(spec.method, seq_len // k + (i < seq_len % k), vocab,
                                     spec.prefix_shared, rng) for i in range(k)]
            # room for the whole micro-batch in one sequence or one side-by-side
            # group, a GPU's rounding of the rows' lengths included
            pack = dict(layout, pack_length=seq_len + 32 * k)
        else:
            example = synthetic_row(spec.method, seq_len, vocab, spec.prefix_shared, rng)
            pack = None
        mx.random.seed(spec.seed)
        optimizer = make_optimizer(1e-5)
        peaks: dict[str, float] = {}
        seconds: list[float] = []
        fits, message, peak = True, "", 0.0
        for step in range(1, spec.steps + 1):
            try:
                m = measured_step(model, optimizer, example, parts=parts, step=step,
                                  budget=spec.budget_gb,
                                  memory=StepMemory(segment_size=segment_size,
                                                    head_chunk=spec.head_chunk,
                                                    attn_block=spec.attn_block,
                                                    mlp_chunk=spec.mlp_chunk,
                                                    grad_checkpoint=False,
                                                    fused=bool(segment_size) and on_gpu()),  # as a job runs
                                  grad_clip=1.0, method=method, pack=pack)
            except OOMError as e:
                fits, message = False, str(e)
                peak = max(peak, e.peak_gb)
                break
            for label, p in m.phases:
                peaks[label] = max(peaks.get(label, 0.0), p)
            peak = max(peak, m.peak_gb)
            seconds.append(m.seconds)
            del m
        del optimizer
        mx.clear_cache()
        timed = seconds[1:] or seconds
        emit(ev.Probe(time=clock(), seq_len=seq_len, segment_size=segment_size, fits=fits,
                      peak_gb=round(peak, 6) if fits else math.ceil(peak * 1e6) / 1e6,
                      phases=list(peaks.items()),
                      step_s=round(statistics.median(timed), 6) if fits and timed else None,
                      steps=len(seconds), message=message))


def row_layout(spec: ProbeSpec, parts) -> dict:
    """How a job of the probe's micro-batch runs its rows on this device and model
    (engine/train.packing and side_by_side, whose job this builds): the
    loss_and_grads keywords `pack`, `side` and `ragged`; {} for one row a step."""
    if spec.pack_rows == 1:
        return {}
    job = JobSpec(model=spec.model, method=spec.method, data={"train": "-", "pack": spec.pack},
                  train={"iters": 1, "batch_size": spec.pack_rows}, lora=spec.lora)
    pack = packing(job, parts)[0]
    side = side_by_side(job, parts)
    if not pack and not side:
        return {}
    return dict(pack=pack, side=side, ragged=unpadding(side, parts)[0])


def synthetic_row(method: str, seq_len: int, vocab: int, prefix_shared: bool, rng: random.Random):
    """A row that puts exactly `seq_len` tokens through the layers (the planner's
    sequence length, orchestrator/planner.row_tokens): SFT every token supervised
    (the most the loss head can be asked to read: the planner's worst case), ORPO
    and DPO a third each of prompt, chosen and rejected (prefix-shared) or a prompt
    and two responses of half the length each (two branches)."""
    def ids(n):
        return [rng.randrange(3, vocab) for _ in range(n)]
    if method in ("orpo", "dpo"):
        if prefix_shared:
            response = max(1, seq_len // 3)
            prompt = seq_len - 2 * response
        else:
            prompt = max(1, seq_len // 2)
            response = seq_len - prompt
        return PreferenceExample(prompt=ids(prompt), chosen=ids(response), rejected=ids(response))
    return Example(ids=ids(seq_len), prompt_len=0)
