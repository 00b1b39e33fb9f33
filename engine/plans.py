"""What a step computes: its rows as *loss plans*, independent of how the layers run.

Every loss here is a small function of a few sums of per-position log-probs: SFT
is -(sum over the response)/count; ORPO needs the chosen and rejected response
sums (and the chosen sequence's for `nll_scope: full`); DPO the same response sums
and the reference model's, which are constants. So a step is described as
*streams* (token sequences run through the layers: one for SFT and prefix-shared
ORPO / DPO, two for two branches), each with the hidden rows the head reads, the
tokens they predict and which sums each row counts toward. A step over several
rows is a list of `LossPlan`s whose losses add up (packed sequences, rows side
by side, or rows alone). engine/step.py runs them: plain autodiff, or segmented.
(The memory planner's `Plan`, orchestrator/planner.py, is another thing: what a
step holds.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from segctl.schemas.defaults import SIDE_PASS_TOKENS
from segctl.schemas.errors import UserError

from . import rows as rowwise
from .data import Example, PreferenceExample
from .model import ModelParts
from .ragged import TAIL_ALIGN, Ragged


class StepError(UserError, ValueError):
    """An example the loss cannot be computed on (e.g. no supervised tokens)."""


def has_rope(parts) -> bool:
    # Positions are set through each attention's `rope`; a family that keeps its
    # RoPE elsewhere cannot restart the rejected response, so it runs two-branch.
    return all(rowwise.ropes(layer) for layer in parts.layers)


@dataclass
class Stream:
    """One token sequence through the layers, and what the head reads from it."""
    ids: list[int]                      # input tokens
    rows: list[int]                     # hidden rows the head reads
    targets: list[int]                  # the token each row predicts
    member: mx.array                    # [rows, sums]: 1.0 where a row counts toward a sum
    runs: list | None = None            # RoPE runs [(first, end, position of first)]
    block: tuple[int, int] | None = None   # prefix-shared: (prompt length, first rejected row)
    # packed: (start, end, prompt, split) of each row in it (attention.BlockMask.units)
    units: tuple = ()
    # side by side: `batch` sequences of len(ids) // batch tokens each, one after
    # another in ids (rows index that flat layout), `pad` of the tokens padding
    batch: int = 1
    pad: int = 0
    # ragged: rows one after another, unpadded, attended as a padded batch (engine/ragged.py)
    ragged: Ragged | None = None
    contiguous: bool = field(init=False)

    def __post_init__(self):
        r = self.rows
        self.contiguous = r == list(range(r[0], r[0] + len(r))) if r else True

    @property
    def masked(self) -> bool:
        """Whether its attention is not the model's own causal mask."""
        return self.block is not None or bool(self.units) or self.ragged is not None

    @property
    def span(self) -> int:
        """Tokens one of its sequences attends over: its length, a ragged stream's width."""
        return self.ragged.width if self.ragged else self.length

    @property
    def shape(self) -> tuple[int, ...]:
        """What a compiled function of its layers depends on (engine/fused.py):
        [sequences, length], and a ragged stream's layout."""
        return (self.batch, self.length, *(self.ragged.shape if self.ragged else ()))

    @property
    def length(self) -> int:
        """Tokens of one of its sequences (all of them but side by side)."""
        return len(self.ids) // self.batch

    @property
    def tokens(self) -> int:
        """Its real tokens, padding left out."""
        return len(self.ids) - self.pad

    def array(self) -> mx.array:
        """ids as the layers take them: [batch, length]."""
        return mx.array(self.ids, dtype=mx.int32).reshape(self.batch, self.length)


@dataclass
class RowPlan:
    """One row's share of a step: its streams (one, or a chosen and a rejected
    branch) and its loss as a function of its own sums, not yet divided by the
    step's weight. SFT: minus the summed log p of its response, weight its
    supervised tokens; ORPO and DPO: the row's loss, weight 1. So a step's loss,
    the sum of its rows' losses over the sum of their weights, is mlx-lm's
    token-weighted mean for SFT and the mean of the rows' losses for ORPO and DPO.
    linear: the loss is linear in the sums (SFT's), so its gradient with respect
    to them is known before they are (engine/step.py's fused kept layers)."""
    streams: list[Stream]
    loss: Callable[[mx.array, mx.array | None], mx.array]  # (its sums, reference sums) -> loss
    weight: int
    report: Callable[[mx.array, mx.array | None], dict] = lambda s, ref: {}
    linear: bool = False

    @property
    def sums(self) -> int:
        """How many sums its streams feed (every stream of a row has them all)."""
        return self.streams[0].member.shape[1]


@dataclass
class LossPlan:
    """Streams run together, and the loss of their sums: one row, or rows packed
    into one stream. A step is one or more plans whose losses (and so gradients)
    add up: each is already divided by the whole step's weight."""
    streams: list[Stream]
    loss: Callable[[mx.array], mx.array]   # sums -> this plan's part of the step's loss
    weight: int                            # its rows' weight (validation weighs rows by it)
    report: Callable[[mx.array], list] = lambda sums: []   # a dict per row
    rows: int = 1
    linear: bool = False   # every row's loss linear in its sums (RowPlan.linear)


def make_plan(example, method: str, parts: ModelParts, *, prefix_shared: bool = False,
              lambda_: float = 0.1, nll_scope: str = "response", beta: float = 0.1,
              reference: Callable[[list[Stream]], mx.array] | None = None) -> LossPlan:
    """The plan of one row as a step of its own. `reference` (DPO): streams -> the
    reference model's sums over them (`reference_sums` bound to the model); it runs
    here, once, before the step."""
    row = row_plan(example, method, parts, prefix_shared=prefix_shared, lambda_=lambda_,
                   nll_scope=nll_scope, beta=beta)
    return _join([row], row.streams, row.weight, method, reference)


def make_plans(batch: list, method: str, parts: ModelParts, *, pack: bool = False,
               side: bool = False, ragged: int = 0, pack_length: int = 0, micro: int = 0,
               align: int = 1, pass_tokens: int = SIDE_PASS_TOKENS,
               prefix_shared: bool = False, lambda_: float = 0.1, nll_scope: str = "response",
               beta: float = 0.1,
               reference: Callable[[list[Stream]], mx.array] | None = None) -> list[LossPlan]:
    """The plans of a step over the rows of `batch`. With `pack`, the rows of each
    micro-batch (`micro` rows; 0: all) that run as one stream go into as few
    sequences of at most `pack_length` tokens as first-fit by length gives (a row
    longer than that runs alone). With `side`, the micro-batch's rows that are
    not packed and take the model's own causal mask (SFT rows, both branches of a
    preference row) run side by side (`side_groups`), a group at most
    `pack_length` tokens of [sequences, longest], its length rounded up to a
    multiple of `align` (a row longer runs alone, a preference row's branches one
    after the other), each further group weighed as `pass_tokens` more; with
    `ragged` too, such a group runs unpadded (`ragged_stream`) wherever it has
    padding and its longest is at most `ragged` tokens. The other rows run alone.
    Every plan's loss is divided by the weight of the whole batch, so the plans'
    losses and gradients add up to the step's."""
    rows = [row_plan(ex, method, parts, prefix_shared=prefix_shared, lambda_=lambda_,
                     nll_scope=nll_scope, beta=beta) for ex in batch]
    total = sum(r.weight for r in rows)
    groups: list[tuple[str, list[RowPlan]]] = []
    micro = micro or len(rows)
    for lo in range(0, len(rows), micro):
        left = rows[lo:lo + micro]
        if pack:
            bins = first_fit([r for r in left if len(r.streams) == 1],
                             lambda r: len(r.streams[0].ids), pack_length)
            left = [r for r in left if len(r.streams) > 1]
        if side:
            groups += [("side" if _side_tokens(g, align) <= pack_length else "alone", g)
                       for g in side_groups([r for r in left if _causal(r)], pack_length,
                                            align, pass_tokens)]
            left = [r for r in left if not _causal(r)]
        groups += [("alone", [r]) for r in left]
        if pack:
            groups += [("packed", g) for g in bins]
    plans = []
    for layout, group in groups:
        if layout == "side" and sum(len(r.streams) for r in group) > 1:
            # unpadded where the group has padding and runs whole (its width at most
            # `ragged`): decided from the lengths, so only one of the two is built
            lengths = [len(s.ids) for r in group for s in r.streams]
            width = _aligned(max(lengths), align)
            unpadded = width <= ragged and len(lengths) * width > sum(lengths)
            streams = [(ragged_stream if unpadded else side_stream)(group, align)]
        elif layout == "packed" and len(group) > 1:
            streams = [packed_stream([r.streams[0] for r in group])]
        else:
            streams = group[0].streams
        plans.append(_join(group, streams, total, method, reference))
    return plans


def _causal(row: RowPlan) -> bool:
    return not any(s.masked for s in row.streams)


def _side_tokens(group: list[RowPlan], align: int = 1) -> int:
    """Tokens of the group side by side: its sequences x the longest (rounded up to
    a multiple of `align`)."""
    streams = [s for r in group for s in r.streams]
    return len(streams) * _aligned(max(len(s.ids) for s in streams), align)


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def side_groups(rows: list[RowPlan], capacity: int, align: int = 1,
                pass_tokens: int = SIDE_PASS_TOKENS) -> list[list[RowPlan]]:
    """Rows to run side by side: sorted by length, longest first, cut into the groups
    that cost the fewest tokens, padding included, plus `pass_tokens` a group (what
    one more pass through the layers costs beside its tokens), each group at most
    `capacity` tokens of [sequences, longest] (a row that alone exceeds it, or
    any row when capacity is 0, is a group of its own)."""
    longest = lambda r: max(len(s.ids) for s in r.streams)
    order = sorted(rows, key=longest, reverse=True)   # stable: ties keep order
    best = [0.0] + [math.inf] * len(order)   # best[i]: the cheapest cut of order[:i]
    cut = [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        seqs = 0
        for j in range(i - 1, -1, -1):   # the group order[j:i], order[j] its longest
            seqs += len(order[j].streams)
            tokens = seqs * _aligned(longest(order[j]), align)
            if j < i - 1 and tokens > capacity:
                break   # an earlier j only adds rows and length
            if best[j] + tokens + pass_tokens < best[i]:
                best[i], cut[i] = best[j] + tokens + pass_tokens, j
    groups, i = [], len(order)
    while i:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]


def side_stream(group: list[RowPlan], align: int = 1) -> Stream:
    """One stream of the group's streams side by side, each padded at its end to the
    longest (rounded up to a multiple of `align`): the padding comes after every
    real token of its sequence, so under a causal mask no real token sees it, and
    the head reads none of it. Each row keeps its own sums (its streams' member
    columns, side by side)."""
    width = _aligned(max(len(s.ids) for r in group for s in r.streams), align)
    ids, rows, targets, member = _beside(group, width)
    return Stream(ids, rows, targets, member, batch=len(ids) // width,
                  pad=len(ids) - sum(len(s.ids) for r in group for s in r.streams))


def ragged_stream(group: list[RowPlan], align: int = 1) -> Stream:
    """side_stream's rows with no padding: their tokens one after another, attended
    as the padded batch side_stream runs (engine/ragged.py); off the CPU (`align`
    > 1) the tokens round up to a multiple of TAIL_ALIGN x align, the extra ones
    of no row, so that a run's shapes repeat."""
    ids, rows, targets, member = _beside(group, 0)
    lengths = tuple(len(s.ids) for r in group for s in r.streams)
    tail = _aligned(len(ids), TAIL_ALIGN * align) - len(ids) if align > 1 else 0
    return Stream(ids + [ids[-1]] * tail, rows, targets, member, pad=tail,
                  ragged=Ragged(lengths, _aligned(max(lengths), align), tail))


def _beside(group: list[RowPlan], width: int) -> tuple[list, list, list, mx.array]:
    """(ids, rows, targets, member) of the group's streams one after another, each
    padded at its end to `width` tokens (0: not padded)."""
    cols = _sum_cuts(group)
    ids: list = []
    rows, targets, members = [], [], []
    for k, r in enumerate(group):
        for s in r.streams:
            rows += [len(ids) + i for i in s.rows]
            ids += s.ids + [s.ids[-1]] * (width - len(s.ids) if width else 0)
            targets += s.targets
            members.append(mx.pad(s.member, [(0, 0), (cols[k], cols[-1] - cols[k + 1])]))
    return ids, rows, targets, mx.concatenate(members)


def first_fit(items: list, size: Callable, capacity: int) -> list[list]:
    """Bins of `items` whose sizes add up to at most `capacity` each: first fit,
    longest first (an item larger than `capacity` gets a bin of its own). Items
    keep their order within a bin; bins come in the order they were opened."""
    bins: list[list] = []
    room: list[int] = []
    for item in sorted(items, key=size, reverse=True):   # sorted() is stable: ties keep order
        n = size(item)
        k = next((b for b, left in enumerate(room) if n <= left), None)
        if k is None:
            bins.append([item])
            room.append(capacity - n)
        else:
            bins[k].append(item)
            room[k] -= n
    return bins


def packed_stream(streams: list[Stream]) -> Stream:
    """One stream of several rows' streams side by side: their rows attend only to
    themselves (`units`), positions restart at each (`runs`), each keeps its own
    sums (the member matrix is block-diagonal)."""
    ids: list = []
    rows, targets, runs, units, members = [], [], [], [], []
    width = sum(s.member.shape[1] for s in streams)
    col = 0
    for s in streams:
        at, n, k = len(ids), len(s.ids), s.member.shape[1]
        ids += s.ids
        rows += [at + r for r in s.rows]
        targets += s.targets
        runs += [(at + a, at + b, p) for a, b, p in (s.runs or [(0, n, 0)])]
        units.append((at, at + n, *(s.block or (0, None))))
        members.append(mx.pad(s.member, [(0, 0), (col, width - col - k)]))
        col += k
    return Stream(ids, rows, targets, mx.concatenate(members), runs, None, tuple(units))


def _sum_cuts(group: list[RowPlan]) -> list[int]:
    """Where each row's sums start among the group's, side by side, and the end."""
    cuts = [0]
    for r in group:
        cuts.append(cuts[-1] + r.sums)
    return cuts


def _join(group: list[RowPlan], streams: list[Stream], total: int, method: str,
          reference) -> LossPlan:
    """The plan of `group`'s rows over `streams` (their sums side by side, in the
    group's order), its loss divided by `total`."""
    cuts = _sum_cuts(group)
    ref = None
    if method == "dpo":
        if reference is None:
            raise ValueError("method dpo needs the reference model's sums (reference=)")
        ref = reference(streams)

    def own(x, k):
        return None if x is None else x[cuts[k]:cuts[k + 1]]

    def loss(sums):
        return sum(r.loss(own(sums, k), own(ref, k)) for k, r in enumerate(group)) / total

    def report(sums):
        return [r.report(own(sums, k), own(ref, k)) for k, r in enumerate(group)]

    return LossPlan(streams, loss, sum(r.weight for r in group), report, len(group),
                    all(r.linear for r in group))


def row_plan(example, method: str, parts: ModelParts, *, prefix_shared: bool = False,
             lambda_: float = 0.1, nll_scope: str = "response", beta: float = 0.1) -> RowPlan:
    if method == "sft":
        if not isinstance(example, Example):
            raise StepError(f"method sft takes an Example, got {type(example).__name__}")
        return _sft_row(example)
    if method in ("orpo", "dpo"):
        if not isinstance(example, PreferenceExample):
            raise StepError(f"method {method} takes a PreferenceExample, "
                            f"got {type(example).__name__}")
        if method == "orpo":
            return _orpo_row(example, parts, prefix_shared, lambda_, nll_scope)
        return _dpo_row(example, parts, prefix_shared, beta)
    raise StepError(f"unknown method {method!r} (expected sft, orpo or dpo)")


def _sft_row(ex: Example) -> RowPlan:
    n = len(ex.ids)
    start = max(0, ex.prompt_len - 1)
    m = n - 1 - start
    if m <= 0:
        raise StepError(f"example of {n} tokens with prompt_len {ex.prompt_len} "
                        "has no response tokens to supervise")
    rows = list(range(start, n - 1))
    stream = Stream(ex.ids[:-1], rows, ex.ids[start + 1:], mx.ones((m, 1)))
    return RowPlan([stream], lambda s, ref: -s[0], m, linear=True)


def _orpo_row(ex: PreferenceExample, parts, prefix_shared, lambda_, nll_scope) -> RowPlan:
    """ORPO: NLL of the chosen response plus lambda x softplus(-log odds ratio) of the
    length-normalised chosen and rejected log-probs, on `_preference_streams`' sums."""
    if nll_scope not in ("response", "full"):
        raise StepError(f"nll_scope must be response or full, got {nll_scope!r}")
    full = nll_scope == "full"
    streams, shared = _preference_streams(ex, parts, prefix_shared, full)
    nc, nr, nf = len(ex.chosen), len(ex.rejected), len(ex.prompt) + len(ex.chosen) - 1

    def loss(s, ref):
        lw, lr = s[0] / nc, s[1] / nr
        log_odds = (lw - lr) - (_log1mexp(lw) - _log1mexp(lr))
        nll = -s[2] / nf if full else -lw
        return nll + lambda_ * mx.logaddexp(0.0, -log_odds)

    def report(s, ref):
        lw, lr = (s[0] / nc).item(), (s[1] / nr).item()
        log_odds = (lw - lr) - (_log1mexp(mx.array(lw)) - _log1mexp(mx.array(lr))).item()
        return {"margin": lw - lr, "accuracy": float(lw > lr), "log_odds": log_odds,
                "nll": (-s[2] / nf).item() if full else -lw, "prefix_shared": shared}

    return RowPlan(streams, loss, 1, report)


def _log1mexp(x):
    return mx.log(mx.maximum(1.0 - mx.exp(x), 1e-7))


def _dpo_row(ex: PreferenceExample, parts, prefix_shared, beta) -> RowPlan:
    """DPO's sigmoid loss on `_preference_streams`' sums: softplus(-(rw - rr)) with
    the rewards rw = beta * (lw - lw_ref), rr = beta * (lr - lr_ref), where lw, lr
    are the SUMS of log p over the chosen and rejected response tokens (the
    sequence log-likelihoods DPO is defined on, not ORPO's length-normalised
    means) and lw_ref, lr_ref the reference model's over the same streams,
    computed once before the step: constants of the loss."""
    streams, shared = _preference_streams(ex, parts, prefix_shared, full=False)

    def rewards(s, ref):
        return beta * (s[0] - ref[0]), beta * (s[1] - ref[1])

    def loss(s, ref):
        rw, rr = rewards(s, ref)
        return mx.logaddexp(0.0, -(rw - rr))

    def report(s, ref):
        rw, rr = (x.item() for x in rewards(s, ref))
        return {"margin": rw - rr, "accuracy": float(rw > rr), "chosen_reward": rw,
                "rejected_reward": rr, "prefix_shared": shared}

    return RowPlan(streams, loss, 1, report)


def step_report(reports: list[dict]) -> dict:
    """The step's figures from its rows': means of the numbers; prefix_shared only
    when every row ran so."""
    if not reports or not reports[0]:
        return {}
    out = {}
    for key in reports[0]:
        values = [r[key] for r in reports]
        out[key] = all(values) if isinstance(values[0], bool) else sum(values) / len(values)
    return out


def _preference_streams(ex: PreferenceExample, parts, prefix_shared: bool,
                        full: bool) -> tuple[list[Stream], bool]:
    """The streams of a preference row, and whether they are one prefix-shared
    pass (else a chosen and a rejected branch). Sums: 0 chosen response, 1
    rejected response, 2 the whole chosen sequence (with `full`; else empty)."""
    p, c, r = list(ex.prompt), list(ex.chosen), list(ex.rejected)
    rp = ex.rejected_prompt
    rp = p if rp is None else list(rp)
    if not p or not rp:
        raise StepError("preference example has an empty prompt: the first response token "
                        "would have nothing to be predicted from")
    if not c or not r:
        raise StepError("preference example has an empty "
                        f"{'chosen' if not c else 'rejected'} response")
    nc, nr = len(c), len(r)
    shared = prefix_shared and rp == p and has_rope(parts)
    P = len(p)
    first = 0 if full else P - 1
    chosen_rows = list(range(first, P + nc - 1))
    chosen_member = [[float(t >= P - 1), 0.0, float(full)] for t in chosen_rows]
    if not shared:
        seq_c, seq_r, R = p + c, rp + r, len(rp)
        streams = [Stream(seq_c[:-1], chosen_rows, seq_c[first + 1:], mx.array(chosen_member)),
                   Stream(seq_r[:-1], list(range(R - 1, R + nr - 1)), r,
                          mx.array([[0.0, 1.0, 0.0]] * nr))]
        return streams, False

    # One pass over [prompt | chosen | rejected]: rejected rows do not see chosen
    # columns and restart at position P, so each response row sees exactly what
    # it sees in its own branch. Row P-1 predicts both chosen[0] and rejected[0].
    seq = p + c + r
    L = len(seq) - 1
    rej_rows = [P - 1] + list(range(P + nc, P + nc + nr - 1))
    runs = [(0, P + nc, 0)] + ([(P + nc, L, P)] if L > P + nc else [])
    stream = Stream(seq[:-1], chosen_rows + rej_rows, seq[first + 1:P + nc] + r,
                    mx.array(chosen_member + [[0.0, 1.0, 0.0]] * nr), runs, (P, P + nc))
    return [stream], True
