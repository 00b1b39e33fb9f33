"""The memory planner: a trial's peak memory, predicted from the model's shape
before anything runs, and the segment size a node's budget allows.

`predict_gb` adds up what the engine keeps alive during one step (engine/step.py,
engine/attention.py, engine/train.py): the weights and the LoRA optimizer state
for the whole step, the segment boundaries, and on top of them the largest of the
transients (a layer's forward, one loss-head chunk, one segment's backward). The
multipliers are fitted to the engine's own measured peaks on a 2-core x86-64 CPU
(`python -m bench.planner_fit [--long]`, rows in bench/results/planner-*.jsonl) so
that every measured row sits at or under its prediction: 1.006-1.26 on short rows,
1.010-1.092 on rows longer than an attention block, 1.018-1.096 on held-out shapes.

MLX's attention is unfused whenever gradients are traced (CPU always; Metal too:
"it's faster for training on Metal to use the unfused SDPA"), so a layer's
forward holds its [heads, L, L] scores for a moment, or one block's
[heads, attn_block, L] on a row longer than a block (the step's masks cut every
pass of attention into blocks there). MLX on CUDA fuses it: some rows past 32K
tokens were over-predicted up to 2x there, while gpt-oss's and Gemma-4's long
rows on an H100 are within 10%, Gemma-4's planned kind of layer by kind
(bench/README.md); a fleet corrects a systematic error with the planner's `scale`.

`plan` turns predictions into a decision against a node's budget:
`memory.segment_size: auto` gets the fastest size whose prediction stays under
the budget less a margin. Where `segctl tune` measured the model on the node's
class (orchestrator/measured.py), the measured model predicts instead of this
estimate, and its measured step times say which size is fastest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# re-exported: the planner's callers read a model's facts through it
from segctl.orchestrator.model_facts import LayerKind
from segctl.orchestrator.model_facts import ModelInfo as ModelInfo
from segctl.orchestrator.model_facts import model_info as model_info
from segctl.orchestrator.model_facts import shape_facts as shape_facts
from segctl.schemas.defaults import (
    ATTN_KEY_TILE,
    ATTN_TILED_ABOVE,
    DEFAULT_ATTN_BLOCK,
    DEFAULT_HEAD_CHUNK,
    DEFAULT_MARGIN,
    DEFAULT_MLP_CHUNK,
)
from segctl.schemas.families import (
    PACKABLE_FAMILIES,
    ROWWISE_FAMILIES,
    SINKS_FAMILIES,
    TILED_FAMILIES,
)
from segctl.schemas.job import JobSpec
from segctl.schemas.limits import read_model_config
from segctl.schemas.records import Plan

GB = 1e9
F32 = 4  # LoRA parameters, their grads and AdamW moments, and the loss head's logits are fp32

# Multipliers fitted to the engine's measured peaks (bench/planner_fit.py) so that
# every measured row is at or under its prediction; each is a count of arrays.
LORA_COPIES = 7.5        # fp32 LoRA-sized arrays: values, grads, clipped grads, 2 AdamW moments,
                         # and the new values the update computes before the old ones go
SAVED_WIDTH = 1.25       # a layer's per-token activations (_layer_width) that vjp keeps
TRANSIENT_WIDTH = 0.5    # ... that a layer's forward or backward adds while it runs
SAVED_SCORES = 1.0       # [heads, L, L] attention matrices a layer keeps for its backward (probs)
BACKWARD_SCORES = 3.25   # ... that its backward adds: d(probs), d(scores), their product
FORWARD_SCORES = 1.8     # ... that its unfused forward holds at once: scores, probs
MASK_BYTES = 2.0         # bytes per [L, L] entry of the causal mask unfused attention builds
HEAD_COPIES = 3.8        # fp32 [tokens, vocab] matrices the head holds: logits, exp, cotangent
PLAIN_HEAD_EXTRA = 3.5   # more fp32 [L, vocab] copies in plain mode: the model's own forward's
                         # logits, the read rows gathered from them, and their unchunked
                         # cross-entropy and its backward
HALF_BYTES = 2.75        # bytes an activation entry costs in a bf16/fp16 model (see _peak_bytes)
HELD_STATES = 3          # [L, hidden] arrays a segmented step holds beside its boundaries (dh,
                         # the head's pieces of it, the allocator's slack)
STORED_OPS = 2           # [L, hidden]-sized values a layer's backward in pieces keeps besides
                         # its attention inputs: the MLP's input and output

# One query block of the blocked attention backward, in arrays of the model's dtype
# (measured alone, every row under its prediction: bench/planner_fit.py --block):
BLOCK_SCORES = 3.0       # [heads, attn_block, keys]: probabilities, their gradient, the scores'
BLOCK_MASK = 1.0         # [attn_block, keys] causal masks, each a boolean and its additive form
BLOCK_KEYS = 2.0         # fp32 [heads, keys, head_dim] (in any dtype): K and V spread over the
                         # query heads, or their gradients before they are summed per K/V head
BLOCK_QUERIES = 3.6      # [heads, attn_block, head_dim]: the block's q, dO, dq and their copies

# Rows longer than an attention block (fitted with bench/planner_fit.py --long):
HALF_SCORE_BYTES = 2.15  # bytes per entry of a forward block's scores in a bf16/fp16 model
STORED_Q = 4.8           # [L, heads x head_dim] arrays alive through attention's backward in
                         # pieces: q, o, dO, dq, their joins and the allocator's rounding
ROW_WIDTH = 5.1          # a chunk's per-token activations (_layer_width) that a chunk's vjp
                         # holds in a layer's backward rows apart
PASS_WIDTH = 1.6         # ... that one vjp pass of a layer's backward in passes holds, whole-row,
PASS_MLP = 3.9           # ... and of its MLP's share: the MLP's values and gradients at once
PASS_HALF_BYTES = 3.4    # bytes per entry of a pass in a bf16/fp16 model
LAYER_INPUT_VALUES = 3   # hidden-wide values per token a layer with a per-layer input adds (its
                         # projection, norm, residual): fitted on Gemma-4 rows on an H100

TIME_TIE = 0.10          # measured step times this close count as equal (auto takes the larger size)
DISK_GBPS = 2.0          # boundaries written and read back per second with memory.offload disk:
                         # a Mac's SSD does several GB/s; the planner's time term is its cost

@dataclass(frozen=True)
class RowLengths:
    """A job's train and valid rows as the planner needs them, read once: the
    row_tokens of the rows that run as one stream (the ones the engine packs),
    longest first, and the longest of those that run as two branches (ORPO, DPO
    without a shared prefix: each runs alone, packed or not)."""
    streams: tuple[int, ...]
    branched: int = 0

    @property
    def longest(self) -> int:
        return max(self.streams[:1] + (self.branched,))


def row_lengths(job: JobSpec) -> RowLengths:
    """The row lengths of the job's train/valid rows, after its truncation/skip
    rules. Loads the tokenizer, not the weights."""
    from mlx_lm.utils import load_tokenizer

    from segctl.engine.data import load_dataset

    folder = Path(job.model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: not a model folder (no config.json)")
    eos = read_model_config(folder).get("eos_token_id")
    try:
        tokenizer = load_tokenizer(folder, eos_token_ids=eos)
    except Exception as e:  # a broken tokenizer is the user's folder, not our bug
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{folder}: cannot load tokenizer: {msg}") from None
    d = job.data
    opts: dict[str, Any] = dict(method=job.method, mask_prompt=d.mask_prompt,
                                max_seq_length=d.max_seq_length, overlong=d.overlong)
    streams, branched = [], 0
    for path in (d.train, d.valid):
        for ex in load_dataset(path, tokenizer, **opts).examples if path else ():
            if one_stream(ex, job):
                streams.append(row_tokens(ex, job))
            else:
                branched = max(branched, row_tokens(ex, job))
    return RowLengths(tuple(sorted(streams, reverse=True)), branched)


def longest_row(job: JobSpec, lengths: RowLengths | None = None) -> int:
    """Tokens in the longest train/valid row, after the job's truncation/skip rules:
    the longest sequence one row puts through the layers (`lengths`: the job's
    row_lengths, else they are read)."""
    return (lengths or row_lengths(job)).longest


def step_tokens(job: JobSpec, lengths: RowLengths | None = None, *,
                batch_size: int | None = None, packable: bool | None = None) -> int:
    """The most tokens a step puts through the layers at once, the seq_len its plan
    must hold. One row a micro-batch: the longest row. Packed, the engine puts each
    micro-batch's rows (batch_size of them) into sequences of at most pack_length
    tokens, a longer row alone, so the most is the longer of pack_length and the
    longest row, and at most the batch_size longest rows together. Rows not
    packed (all of them unpacked, two-branch rows packed) run side by side where
    LoRA dropout is off (engine/train.side_by_side): at most pack_length tokens of
    [sequences, longest], a longer row alone; with dropout, one after the other.
    pack auto packs on a CPU and runs rows side by side on a GPU: either fits.
    `batch_size` overrides the job's (the largest batch that fits); `packable`
    (family_packs of the job's model) is read from config.json when not given. On
    several nodes a micro-batch holds at most a rank's share of the step's rows.
    A model whose rows do not batch exactly runs them one after the other, which
    holds less than planned here."""
    lengths = lengths or row_lengths(job)
    b = job.train.batch_size if batch_size is None else batch_size
    # a rank of a job on several nodes runs its share of the step's rows (on as few
    # as its min_nodes, where a retry may go)
    fewest = job.distributed.min_nodes or job.distributed.nodes
    b = min(b, -(-b * job.train.grad_accumulation // fewest))
    if b <= 1:
        return lengths.longest
    cap = max(job.data.pack_length or job.data.max_seq_length, lengths.longest)
    side = job.lora.dropout == 0
    one = lengths.streams[0] if lengths.streams else 0
    packed = min(cap, sum(lengths.streams[:b]))
    beside = max(one, min(cap, b * one)) if side else one
    if job.data.pack is True:
        one = packed
    elif packs(job, packable):
        # auto: packed on a CPU, side by side on a GPU (engine/train.packing); the
        # node's device decides, so the plan holds either
        one = max(packed, beside)
    else:
        one = beside
    branched = lengths.branched
    if side and branched:
        # a preference row's two branches side by side, beside others if they fit
        branched = max(branched, min(cap, 2 * b * branched) if 2 * branched <= cap else 0)
    return max(one, branched)


def packs(job: JobSpec, packable: bool | None = None) -> bool:
    """Whether the engine packs the job's rows: pack true; auto only where that is
    exact (the family packs, PACKABLE_FAMILIES, and lora.dropout is 0: a packed
    sequence draws other dropout masks than its rows apart), else it trains
    unpacked. `packable`: family_packs(job.model), read when not given."""
    if job.data.pack is False:
        return False
    if job.data.pack is True:
        return True
    if job.lora.dropout > 0:
        return False
    return family_packs(job.model) if packable is None else packable


def model_types(model_dir: str) -> list[str]:
    """config.json's model_type, then its text_config's where a multimodal wrapper
    nests one (the wrapper's type says nothing of how its text layers pack)."""
    config = read_model_config(model_dir)
    types = [str(config.get("model_type", "?"))]
    text = config.get("text_config")
    if isinstance(text, dict) and text.get("model_type"):
        types.append(str(text["model_type"]))
    return types


def family_packs(model_dir: str) -> bool:
    """Whether the engine packs this model's rows exactly, from its family
    (schemas/families.py's PACKABLE_FAMILIES, mlx-lm's module names): the wrapper's
    type or its text model's, as mlx-lm maps it to a module (mistral runs as llama)."""
    from mlx_lm.utils import MODEL_REMAPPING
    return any(t in PACKABLE_FAMILIES or MODEL_REMAPPING.get(t) in PACKABLE_FAMILIES
               for t in model_types(model_dir))


def one_stream(example, job: JobSpec) -> bool:
    """Whether a row runs as one stream (SFT; ORPO, DPO prefix-shared where its two
    prompts tokenise alike), the rows the engine packs; else as two branches."""
    return job.method == "sft" or (job.prefix_shared and example.rejected_prompt is None)


def row_tokens(example, job: JobSpec) -> int:
    """The longest sequence one row puts through the layers: SFT its tokens; ORPO
    and DPO prefix-shared prompt + chosen + rejected, two-branch the longer branch."""
    if job.method == "sft":
        return len(example.ids)
    p, c, r = len(example.prompt), len(example.chosen), len(example.rejected)
    if one_stream(example, job):
        return p + c + r
    return max(p + c, len(example.rejected_prompt or example.prompt) + r)


def method_key(job: JobSpec) -> str:
    """What the estimate (and a tune's measurements) need of the method: sft, orpo
    or dpo (two branches), orpo-shared or dpo-shared."""
    if job.method == "sft":
        return "sft"
    return f"{job.method}-shared" if job.prefix_shared else job.method


# ---------------------------------------------------------------- the estimate

def predict_gb(info: ModelInfo, *, seq_len: int, segment_size: int, lora_rank: int = 8,
               lora_layers: int = -1, head_chunk: int = DEFAULT_HEAD_CHUNK, attn_block: int = DEFAULT_ATTN_BLOCK,
               grad_checkpoint: bool = False, method: str = "sft", mlp_chunk: int = DEFAULT_MLP_CHUNK,
               offload: bool = False, dropout: float = 0.0) -> float:
    """Predicted peak GB of one training step on rows of up to `seq_len` tokens
    (`dropout`: the LoRA dropout, under which no layer runs rows apart).

    Two maxima keep the answer usable for planning: a data set's longest row is
    `seq_len` but its other rows are shorter, and a row just short enough to
    skip the blocked attention backward can need more than a longer one, so the
    worst length up to `seq_len` counts; and a larger segment is never predicted
    to need less than a smaller one (on very deep models fewer boundaries could
    outweigh a layer's activations; the smaller size's figure stands then), so
    the OOM path's "smaller is safer" holds.
    """
    if segment_size < 0:
        raise ValueError(f"segment_size must be >= 0, got {segment_size}")
    return _curve(info, seq_len, min(segment_size, info.n_layers), lora_rank, lora_layers,
                  head_chunk, attn_block, grad_checkpoint, method, mlp_chunk, offload,
                  dropout == 0)[-1]


def offload_seconds(info: ModelInfo, *, seq_len: int, segment_size: int,
                    method: str = "sft") -> float:
    """What memory.offload disk adds to a step, at most: every boundary written once
    and read back once, at DISK_GBPS. The engine overlaps that traffic with the
    compute, so the cost measured is lower: at 32K on the 8B shape this gives
    8.6 s (+38% of a 22 s step on an H100) where +0.1 s and +0.9 s (+0.5%, +4.2%)
    were measured (bench/README.md)."""
    streams = 2 if method in ("orpo", "dpo") else 1
    boundaries = streams * math.ceil(info.n_layers / max(segment_size, 1))
    return 2 * boundaries * seq_len * info.hidden * info.act_bytes / (DISK_GBPS * GB)


def _curve(info: ModelInfo, seq_len: int, top: int, lora_rank: int, lora_layers: int,
           head_chunk: int, attn_block: int, grad_checkpoint: bool, method: str,
           mlp_chunk: int = DEFAULT_MLP_CHUNK, offload: bool = False,
           rows: bool = True) -> list[float]:
    """Predicted GB for segment sizes 1..top (index s-1), each at least the one
    before; [plain] when top is 0."""
    streams = {"sft": 1, "orpo-shared": 1, "orpo": 2, "dpo-shared": 1, "dpo": 2}.get(method)
    if streams is None:
        raise ValueError(f"method {method!r}: expected sft, orpo, orpo-shared, dpo or dpo-shared")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    n_lora = info.n_layers if lora_layers < 0 else min(lora_layers, info.n_layers)
    lengths = [seq_len]
    if top and 0 < attn_block < seq_len - 1:
        lengths.append(attn_block + 1)  # the longest row the blocked backward leaves alone
    if top and 0 < mlp_chunk < seq_len:
        lengths.append(mlp_chunk)       # ... and the MLP's chunks

    def worst(s):
        return max(_peak_bytes(info, L, s, lora_rank, n_lora, head_chunk, attn_block,
                               grad_checkpoint, streams, mlp_chunk, offload, rows, kind)
                   for L in lengths for kind in _kinds(info, s, 0 < mlp_chunk < L)) / GB

    if top == 0:
        return [worst(0)]
    out: list[float] = []
    for s in range(1, top + 1):
        out.append(max(worst(s), out[-1] if out else 0.0))
    return out


def _kinds(info: ModelInfo, s: int, chunked: bool) -> list:
    """The layers to plan a segmented step by: each kind of a model whose layers
    differ (ModelInfo.kinds), else the one kind (None: the widest layer, as the
    fields give it). A kind whose MLP runs in chunks is planned at the narrowest
    MLP: its chunks' work runs between the layer's passes, and on an H100 a
    Gemma-4 K/V sharer's double-wide MLP moved no layer's peak (bench/README.md,
    "Long rows of every family")."""
    if not info.kinds or s == 0:
        return [None]
    narrow = min(k.intermediate for k in info.kinds)
    return [k._replace(intermediate=narrow) if chunked else k for k in info.kinds]


def _layer_width(info: ModelInfo, own_kv: bool = True) -> int:
    """Values per token a decoder layer keeps for its backward: its input and both
    norm outputs and the residual (4 x hidden), and LAYER_INPUT_VALUES more with a
    per-layer input; q, k, v before and after norm/RoPE and the attention output
    (3 x (heads + kv_heads) x head_dim; a layer reading a donor's K/V makes none);
    the MLP's gate, up, activation and product (`_mlp_width`)."""
    hidden = 4 + (LAYER_INPUT_VALUES if info.layer_input else 0)
    kv = info.kv_heads if own_kv else 0
    return hidden * info.hidden + 3 * (info.heads + kv) * info.head_dim + _mlp_width(info)


def _mlp_width(info: ModelInfo) -> int:
    """Values per token of the MLP's gate, up, activation and product: each expert's
    a token goes through in a mixture of experts."""
    return 4 * (info.intermediate * max(info.experts_per_tok, 1) + info.shared)


def _lora_params(info: ModelInfo, rank: int, n_layers: int) -> int:
    """rank x (in + out) for each of q, k, v, o, gate, up, down in the LoRA layers;
    in a mixture of experts, gate, up and down of every expert and of the shared
    ones, and the router."""
    q, kv = info.heads * info.head_dim, info.kv_heads * info.head_dim
    mlp = 3 * (info.hidden + info.intermediate) * max(info.experts, 1)
    if info.shared:
        mlp += 3 * (info.hidden + info.shared)
    router = info.hidden + info.experts if info.experts else 0
    per_layer = (4 * info.hidden + 2 * q + 2 * kv + mlp + router) * rank
    return per_layer * n_layers


def _peak_bytes(info: ModelInfo, L: int, s: int, rank: int, n_lora: int, head_chunk: int,
                attn_block: int, grad_checkpoint: bool, streams: int = 1,
                mlp_chunk: int = 0, offload: bool = False, rows: bool = True,
                kind: LayerKind | None = None) -> float:
    """Peak bytes of one step on a row of L tokens at segment size s (0: plain);
    `rows`: a family of ROWWISE_FAMILIES runs its layers rows apart; `kind`: the
    backward of that kind's last layer (None: of any layer, planned as the widest),
    with the boundaries of the segments before it held.

    ORPO two-branch (streams 2) keeps both branches' boundaries, dh and head
    gradients through the step (plain: both forwards' activations), with each
    segment's transients one branch at a time. Prefix-shared ORPO is one stream
    of L = P + C + R tokens (its attention, two causal calls, is less than L's).

    DPO has ORPO's shape plus its reference forward (the adapter off, no
    gradient), which runs before the step's own forward, one layer's forward and
    one head chunk at a time over the same streams, with only the resident state
    and a hidden state or two alive: less than the step's forward phase, which
    holds the boundaries on top of the same layer forward. It adds a forward's
    time, not memory, so DPO is planned as ORPO is."""
    n = info.n_layers
    # Bytes per activation entry. Half precision costs more than its 2 bytes:
    # MLX's softmax runs in fp32 and CPU matmuls go through fp32 copies.
    a = info.act_bytes if info.act_bytes >= F32 else HALF_BYTES

    # Alive through the whole step: the frozen weights, and the LoRA parameters
    # with their grads and AdamW moments (fp32 whatever the model's dtype).
    resident = info.weight_bytes + LORA_COPIES * F32 * _lora_params(info, rank, n_lora)
    # Per-layer inputs (Gemma-4): every layer's, for every token, made once a stream.
    resident += streams * L * n * info.layer_input * info.act_bytes
    # What follows is one layer's: the kind's heads and MLP, its own K/V or a donor's.
    own_kv = kind is None or bool(kind.own_kv)
    if kind is not None:
        info = dataclasses.replace(info, head_dim=kind.head_dim, intermediate=kind.intermediate)
    # One [L, hidden] hidden state: a segment boundary, dh, a recomputed layer input.
    # Stored, it is the model's dtype (`state`); being computed, it costs `a`.
    hidden_state = L * info.hidden * a
    state = L * info.hidden * info.act_bytes
    # One [heads, L, L] attention matrix, with the [L, L] causal mask built beside it.
    scores = (info.heads * a + MASK_BYTES) * L * L
    # A row longer than a block: every pass of a layer takes its attention in blocks
    # of attn_block query rows (the step's masks cut it so, engine/step.py), so the
    # scores alive at once are one block's, and no [L, L] mask is built.
    blocked = 0 < attn_block < L - 1
    sa = a if a >= F32 else HALF_SCORE_BYTES   # a forward block's scores, in half precision
    block_scores = info.heads * attn_block * L * sa if blocked else scores
    # A decoder layer's per-token activations (projections, norms, MLP).
    width = L * _layer_width(info, own_kv) * a
    # What a layer under vjp keeps for its backward; what running its backward or
    # its forward adds while it runs.
    layer_saved = SAVED_WIDTH * width + SAVED_SCORES * scores
    layer_backward = TRANSIENT_WIDTH * width + BACKWARD_SCORES * scores
    layer_forward = TRANSIENT_WIDTH * width + FORWARD_SCORES * block_scores
    # The loss head per (token, vocab) entry: fp32 logits, exp and cotangent; a
    # half-precision model also holds the logits and their cotangent in its dtype.
    head_entry = HEAD_COPIES * F32 + (2 * info.act_bytes if info.act_bytes < F32 else 0)

    if s == 0:
        # Plain autodiff: every layer's activations (grad_checkpoint: every layer's
        # input and one layer recomputed), then the whole [L, vocab] cross-entropy
        # or one layer's backward on top.
        head = L * info.vocab * (head_entry + PLAIN_HEAD_EXTRA * F32)
        kept = n * hidden_state + layer_saved if grad_checkpoint else n * layer_saved
        return (resident + streams * (2 * hidden_state + kept)
                + max(streams * head, layer_backward))

    # Segmented: the n/s + 1 boundaries, dh and the head's pieces of it live
    # through the step; on top of them the largest of one layer's forward, one
    # head chunk, and one segment's backward. With the boundaries on disk, the one
    # a segment works on is in memory (twice as it arrives: read, then copied into
    # MLX), and one more in flight (being written in the forward, read ahead in the
    # backward: engine/offload.py); one more for the allocator's slack, fitted.
    # In memory, a kind's backward holds the boundaries up to its last layer's segment.
    held = 4 if offload else math.ceil(n / s)
    held_back = held if offload or kind is None else math.ceil(kind.upto / s)
    boundaries = streams * (held + HELD_STATES) * state
    boundaries_back = streams * (held_back + HELD_STATES) * state
    # Attention's query-sized ([L, heads x head_dim]) values, stored, and its K/V
    # entries per head.
    qo = L * info.heads * info.head_dim * info.act_bytes
    kv = L * info.kv_heads * info.head_dim
    head = min(head_chunk, L) * info.vocab * head_entry
    pieces = 0 < attn_block < L - 1 or 0 < mlp_chunk < L
    if 0 < mlp_chunk < L:
        # The MLP runs mlp_chunk rows at a time, forward and backward: its share of
        # a layer's activations is a chunk's; the layer's backward in pieces keeps
        # the MLP's input, output and cotangents whole (engine/layer.py).
        mlp = _mlp_width(info) * a
        width = width - L * mlp + mlp_chunk * mlp + STORED_OPS * hidden_state
        layer_forward = TRANSIENT_WIDTH * width + FORWARD_SCORES * block_scores
    if pieces:
        # A layer's backward in pieces (engine/rows.py, engine/layer.py) runs in
        # phases, measured one by one (bench/planner_fit.py --phases): attention's
        # backward, blocked (block_backward) or whole, with q, o, dO, dq and their
        # joins (STORED_Q) and K, V with their fp32 gradient sums alive beside it;
        # and before and after it, the vjps of the layer's other work. Never both
        # at once: the larger phase counts, on top of the segment's layer inputs.
        block = block_backward(info, L, attn_block) if blocked else \
            (SAVED_SCORES + BACKWARD_SCORES) * scores
        attention = STORED_Q * qo + kv_grad_sums(info, L) + block
    if pieces and rows and info.model_type in ROWWISE_FAMILIES and 0 < mlp_chunk < L:
        # engine/rows.py: every row-wise op of the layer (norms, projections and
        # their LoRA, RoPE, residuals, the MLP) runs mlp_chunk rows at a time; only
        # q, k, v, the attention output, their gradients (dk, dv summed in fp32),
        # the layer's input and its input gradient are whole-row.
        chunk_width = mlp_chunk * _layer_width(info, own_kv) * a
        # The chunks' outputs and input gradients are joined at the end: two
        # [L, hidden] copies for a moment, in the forward and the backward; so
        # are dO's chunks and dq's blocks (q, o, dO, dq and one join: 5 x [L, q]).
        layer_forward = (2 * (qo + 2 * kv * info.act_bytes) + qo + 2 * state
                         + TRANSIENT_WIDTH * chunk_width + FORWARD_SCORES * block_scores)
        # A chunk's vjp, counted at the model's dtype (fitted so: its half-precision
        # premium is in ROW_WIDTH).
        chunk_vjp = ROW_WIDTH * mlp_chunk * _layer_width(info, own_kv) * info.act_bytes
        segment = s * state + max(attention, chunk_vjp)
    elif pieces:
        # A layer's backward in passes (engine/layer.py): each pass a vjp of the
        # layer's own work with its attention (blocked) standing in, the MLP whole
        # unless chunked. The MLP's share (its four [rows, intermediate]
        # activations) is held more than twice over, its gradients beside its
        # values; the rest less. In half precision a pass costs nearly what it does
        # in fp32 (PASS_HALF_BYTES): the CPU's matmuls go through fp32 copies.
        pa = a if a >= F32 else PASS_HALF_BYTES
        mlp_part = (mlp_chunk if 0 < mlp_chunk < L else L) * _mlp_width(info) * pa
        passes = PASS_WIDTH * (width * pa / a - mlp_part) + PASS_MLP * mlp_part
        if blocked:
            segment = s * state + max(attention, passes)
        else:   # attention whole is inside the passes' vjp
            segment = s * state + attention + passes
    else:
        # The segment's s layers under one vjp, then the backward of each.
        segment = s * layer_saved + layer_backward
    return resident + max(boundaries + max(layer_forward, head), boundaries_back + segment)


def kv_grad_sums(info: ModelInfo, L: int) -> float:
    """Bytes of attention's K and V gradients summed in fp32 over the query blocks,
    with their cast back to the model's dtype at the end."""
    return 2 * L * info.kv_heads * info.head_dim * (F32 + info.act_bytes)


def block_backward(info: ModelInfo, L: int, attn_block: int) -> float:
    """Bytes one query block of the blocked attention backward adds beside its inputs
    and the fp32 dK, dV sums (engine/attention.py): its scores and their gradients,
    the causal mask, the block's K and V spread over the query heads with their
    gradients, and its q, dO and dq. The last block, over every key, is the
    largest. Past ATTN_TILED_ABOVE tokens (at any length with attention sinks,
    SINKS_FAMILIES) the keys go a tile at a time, with the tile's dK, dV in fp32
    beside the row's sums, in a family whose every layer does (TILED_FAMILIES);
    any other holds the block's scores over every key."""
    tiled = ((L > ATTN_TILED_ABOVE or info.model_type in SINKS_FAMILIES)
             and info.model_type in TILED_FAMILIES)
    keys = ATTN_KEY_TILE if tiled else L
    b, h, hd = info.act_bytes, info.heads, info.head_dim
    return (BLOCK_SCORES * h * attn_block * keys * b + BLOCK_MASK * attn_block * keys * (1 + b)
            + BLOCK_KEYS * h * keys * hd * F32 + BLOCK_QUERIES * h * attn_block * hd * b
            + (2 * L * info.kv_heads * hd * F32 if tiled else 0))


# ---------------------------------------------------------------- the decision

def plan(info: ModelInfo, job: JobSpec, *, seq_len: int, budget_gb: float,
         margin: float = DEFAULT_MARGIN,
         scale: float = 1.0, below: int | None = None, measured=None) -> Plan:
    """The segment size (and, with memory.offload auto, whether the boundaries go to
    disk) for `job` on a node with `budget_gb`; see `_plan`. auto keeps them in
    memory where that fits and takes the disk only where it alone fits: the
    disk costs time (`offload_seconds`), never memory."""
    how = job.memory.offload
    if how != "auto":
        return _plan(info, job, seq_len=seq_len, budget_gb=budget_gb, margin=margin,
                     scale=scale, below=below, measured=measured, offload=how == "disk")
    kept = _plan(info, job, seq_len=seq_len, budget_gb=budget_gb, margin=margin, scale=scale,
                 below=below, measured=measured, offload=False)
    if kept.fits:
        return kept
    disk = _plan(info, job, seq_len=seq_len, budget_gb=budget_gb, margin=margin, scale=scale,
                 below=below, measured=measured, offload=True)
    if not disk.fits:
        return kept
    cost = offload_seconds(info, seq_len=seq_len, segment_size=disk.segment_size,
                           method=method_key(job))
    return disk.model_copy(update={"reason": f"offload auto: boundaries on disk (~{cost:.2g} s "
                                             f"a step at {DISK_GBPS:g} GB/s); {disk.reason}"})


def _plan(info: ModelInfo, job: JobSpec, *, seq_len: int, budget_gb: float,
          margin: float, scale: float, below: int | None, measured, offload: bool) -> Plan:
    """The segment size for `job` on a node with `budget_gb`: a fixed size as the job
    gives it; `auto`: the fastest that fits; `below` (after an OOM at that size): the
    fastest smaller one that fits. Fits when the prediction <= budget x (1 - margin).

    `measured` (a measured.MemoryModel of this model, method and node class, from
    `segctl tune`) predicts where it covers the row length; the analytic estimate
    (times `scale`) does otherwise. With measured step times "fastest" is the
    probed size measured fastest; without, the largest size (the fewest recomputes)."""
    limit = budget_gb * (1 - margin)
    mem = job.memory
    if offload:   # the probes kept their boundaries in memory: the estimate speaks here
        measured = None
    gap = measured.gap(seq_len) if measured is not None else None
    use = measured if measured is not None and gap is None else None
    if use is not None:
        source = f"measured (tune {use.tune})" if use.tune else "measured"
    elif measured is not None:
        source = f"analytic (measured model: {gap})"
    else:
        source = "analytic (not tuned)"

    def curve(top: int) -> list[float]:
        if use is None:
            return [scale * gb for gb in _curve(
                info, seq_len, top, job.lora.rank, job.lora.num_layers, mem.head_chunk,
                mem.attn_block, mem.grad_checkpoint, method_key(job), mem.mlp_chunk, offload,
                job.lora.dropout == 0)]
        out: list[float] = []
        for size in range(1, max(top, 1) + 1):
            out.append(max(use.predict(seq_len, size) + _lora_delta_gb(info, job, use),
                           out[-1] if out else 0.0))
        return out

    def predicted(size: int) -> float:
        if size == 0 and use is not None:   # plain autodiff is never probed
            return scale * _curve(info, seq_len, 0, job.lora.rank, job.lora.num_layers,
                                  mem.head_chunk, mem.attn_block, mem.grad_checkpoint,
                                  method_key(job), mem.mlp_chunk)[-1]
        return curve(min(size, info.n_layers))[-1]

    def answer(size: int, fits: bool, reason: str, gb: float | None = None) -> Plan:
        gb = predicted(size) if gb is None else gb
        return Plan(segment_size=size, predicted_gb=round(gb, 4), budget_gb=budget_gb,
                    fits=fits, reason=f"{reason}; {source}",
                    source="measured" if use is not None and size else "analytic",
                    offload=offload and size > 0)

    room = f"budget {budget_gb:g} GB less {margin:.0%} margin"
    if below is not None and below < 1:
        raise ValueError(f"below must be >= 1, got {below}")
    if below == 1:
        return answer(1, False, "already at segment_size 1: no smaller size to try")
    if below is None and mem.segment_size != "auto":
        size = mem.segment_size
        gb = predicted(size)
        what = "plain autodiff (segment_size 0)" if size == 0 else f"segment_size {size}"
        verdict = "fits" if gb <= limit else "does not fit"
        return answer(size, gb <= limit, f"{what} as the job asks: {verdict}, needs {gb:.3g} GB, "
                                         f"{room}", gb)

    top = info.n_layers if below is None else min(below - 1, info.n_layers)
    after = "" if below is None else f"after out of memory at segment_size {below}: "
    gbs = curve(top)
    fitting = [size for size in range(top, 0, -1) if gbs[size - 1] <= limit]
    if not fitting:
        gb = gbs[0]
        return answer(1, False, f"{after}does not fit: needs {gb:.3g} GB at segment_size 1, {room}",
                      gb)
    size = fitting[0]   # largest first: the fewest recomputes
    times = {s: use.step_s(seq_len, s) for s in fitting} if use is not None else {}
    times = {s: t for s, t in times.items() if t is not None}   # the sizes that were probed
    if times:
        # the fastest measured; a size within TIME_TIE of it counts as as fast
        # (a few timed steps are that noisy), and the larger of those wins
        best = min(times.values())
        size = next(s for s in times if times[s] <= best * (1 + TIME_TIE))
        which = f"segment_size {size} is the fastest that fits (~{times[size]:.3g} s/step)"
    elif size == info.n_layers:
        which = f"segment_size {size} (all layers in one segment) fits"
    else:
        which = f"segment_size {size} of {info.n_layers} layers is the largest that fits"
    gb = gbs[size - 1]
    return answer(size, True, f"{after}{which}: needs {gb:.3g} GB, {room}", gb)


def _lora_delta_gb(info: ModelInfo, job: JobSpec, model) -> float:
    """What the job's LoRA (rank, layers) holds beyond the LoRA the probes ran with:
    its parameters, grads and AdamW moments (LORA_COPIES of them)."""
    def params(rank, layers):
        n = info.n_layers if layers < 0 else min(layers, info.n_layers)
        return _lora_params(info, rank, n)
    extra = params(job.lora.rank, job.lora.num_layers) - params(model.lora_rank, model.lora_layers)
    return LORA_COPIES * F32 * extra / GB


def model_key(info: ModelInfo) -> str:
    """The plan table's name for a model: its planner facts (shape, dtype, weight
    bytes) decide its memory, so two copies of one model share their measurements."""
    blob = json.dumps(info.to_dict(), sort_keys=True).encode()
    return f"{info.model_type}-{info.n_layers}x{info.hidden}-{hashlib.sha256(blob).hexdigest()[:10]}"


def tune_key(job: JobSpec, node_class: str) -> tuple:
    """measured.match_key of the probes that fit `job` on `node_class`."""
    from .measured import lora_keys_text
    mem = job.memory
    return (method_key(job), node_class, mem.head_chunk, mem.attn_block,
            lora_keys_text(job.lora.keys))
