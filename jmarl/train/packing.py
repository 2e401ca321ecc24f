"""The learner's batch layout: real tokens only, packed into rows of a fixed width.

A GRPO group's samples share their prompt, and their completions differ in length. The learner
packs each micro-batch into R rows of L slots (`pack`): every distinct prompt once,
followed by the continuations that extend it (one "segment" per prompt), and padding only at
the end of a row. In attention (`jmarl.models.attention.packed_attention`) a continuation sees
its prompt and itself, never its siblings, so the log-probs and gradients are those of running
each sample alone, while the prompt's work is divided by the group size and no slot is spent
on padding a continuation to the longest of the batch.

The LM head runs over M prediction slots (one per continuation token that has a token before
it, the rest padding), gathered from the packed hidden states; `pred_slot` maps them back to the per-sample
[N, C] arrays the loss reads, which keep their meaning (and normalisers) unchanged.

Host side (NumPy). The input is one `Samples` per learner: sample i is a prompt (token ids)
and the continuation that extends it (the tokens trained on), with per-token and per-sample
fields. Output fields:

    packed_tokens, packed_positions  int32[parts * R, L]  tokens; each token's place in its own
                                                          sequence (prompt + continuation)
    packed_segment, packed_branch    int32[parts * R, L]  segment id (0 = padding; from 1 per
                                                          row), branch (0 = prompt, b = the b-th
                                                          continuation of the segment)
    pred_source, pred_target         int32[parts * M]     flat slot (r * L + t) whose hidden
                                                          state predicts, and the predicted token
    pred_slot                        int32[N, C]          the prediction of continuation token
                                                          j of sample n, -1 = none
    tokens, attention_mask           [N, C]               continuations, right-padded
    loss_mask                        bool[N, C]           the continuation's tokens (and a given
                                                          per-token loss_mask)
    each per-token field             [N, C]               (behavior_logprobs) right-padded with 0
    each per-sample field            [N]                  as given
    packed_routing            [parts * R, L, S, k]        routing replay: each slot's recorded
                                                          experts, laid out as packed_tokens
                                                          (the marker `moe.no_route` in padding
                                                          and where none was recorded; a
                                                          prompt's from the first of its
                                                          samples that has them)

pred_source and pred_slot index the whole batch; read inside a micro-batch they are taken
modulo its size, as `packed_logprobs` does.

Micro-batch m holds samples [m * N/parts, (m+1) * N/parts), packed rows [m * R, (m+1) * R) and
predictions [m * M, (m+1) * M). L is fixed (ROW_TOKENS, or the `token_budget` of a longer
segment; narrower when every row is shorter), M = R x L and C a length bucket, so steps reuse a
few compiled programs (mostly one per row count). [N] fields pass through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.batch import PACKED_FIELDS
from jmarl.errors import JmarlError
from jmarl.models.attention import PACKED_DENSE_MAX
from jmarl.models.config import ModelConfig
from jmarl.models.logprobs import packed_token_logprobs
from jmarl.models.model import Params
from jmarl.padding import DEFAULT_LENGTH_BUCKETS, bucket_length, no_route, row_bucket

MIN_BUDGET = 64
# the width of a packed row (wider when a segment is longer)
ROW_TOKENS = 1024


def token_budget(tokens: int, minimum: int = MIN_BUDGET) -> int:
    """A packed row's width L for `tokens` tokens: the smallest of minimum, then m x 2^k with m
    in 8..15 (64, 72, 80, ..., 120, 128, 144, ...), so a row wastes at most 1/9 of its slots and
    a run compiles for a few widths."""
    n = max(tokens, minimum)
    step = max(1 << max(0, n.bit_length() - 4), 1)
    return int(-(-n // step) * step)


class Routing(NamedTuple):
    """The recorded experts of N samples (routing replay): per_sample[i] uint[P_i + C_i, S, k]
    for the prompt and continuation tokens of sample i, or None where none was recorded; (S, k)
    the learner model's sparse layers and top k, dtype its `moe.routing_dtype`."""

    per_sample: Sequence[np.ndarray | None]
    shape: tuple[int, int]
    dtype: Any


@dataclass(frozen=True)
class Samples:
    """N samples of one learner, as `pack` reads them: sample i is the prompt ids prompts[i]
    (int32[P_i]) followed by its continuation continuations[i] (int32[C_i], the tokens trained
    on; empty for a padding sample, which packs nothing). per_token[name][i]: one value per
    continuation token ([C_i]; e.g. behavior_logprobs, or a loss_mask narrower than the
    continuation); per_sample[name]: one value per sample ([N]); routing: `Routing` (routing
    replay) or None."""

    prompts: Sequence[np.ndarray]
    continuations: Sequence[np.ndarray]
    per_token: Mapping[str, Sequence[np.ndarray]] = field(default_factory=dict)
    per_sample: Mapping[str, np.ndarray] = field(default_factory=dict)
    routing: Routing | None = None

    @property
    def num_samples(self) -> int:
        """N."""
        return len(self.prompts)


def split_prompts(tokens: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each row of [N, T] arrays: (prompt token ids, column indices of its continuation):
    the prompt is the row's real tokens before its first loss token (all of them when it has
    none), the continuation the rest of its real tokens."""
    out = []
    for tok, real, loss in zip(tokens, attention_mask.astype(bool), loss_mask.astype(bool)):
        cols = np.flatnonzero(real)
        trained = np.flatnonzero(loss[cols])
        first = int(trained[0]) if trained.size else cols.size
        out.append((tok[cols[:first]].astype(np.int32), cols[first:]))
    return out


def plain_samples(batch: Mapping[str, np.ndarray]) -> Samples:
    """`Samples` from sequences laid out whole in [N, T] rows (as a test or a benchmark writes
    them): tokens, attention_mask and loss_mask [N, T] (`split_prompts`); every other [N, T]
    field cut to the continuations (per-token, loss_mask included), every [N] field per sample,
    "routing" [N, T, S, k] (routing replay) the real tokens' recorded experts."""
    tokens = np.asarray(batch["tokens"])
    n, t = tokens.shape
    split = split_prompts(tokens, np.asarray(batch["attention_mask"]), np.asarray(batch["loss_mask"]))
    per_token = {k: [np.asarray(x)[i, cols] for i, (_, cols) in enumerate(split)]
                 for k, x in batch.items() if k not in ("tokens", "attention_mask", "routing") and np.shape(x) == (n, t)}
    per_sample = {k: np.asarray(x) for k, x in batch.items() if np.shape(x) == (n,)}
    routing = None
    if batch.get("routing") is not None:
        rec = np.asarray(batch["routing"])
        real = np.asarray(batch["attention_mask"], bool)
        routing = Routing([rec[i, np.flatnonzero(real[i])] for i in range(n)], rec.shape[2:], rec.dtype)
    return Samples([p for p, _ in split], [tokens[i, cols].astype(np.int32) for i, (_, cols) in enumerate(split)],
                   per_token, per_sample, routing)


def _segments(samples: Samples, start: int, stop: int) -> list[tuple[np.ndarray, list[int]]]:
    """The samples [start, stop) of a micro-batch -> [(prompt, [indices of the samples
    continuing it])] in first-seen order; samples without a continuation are left out (nothing
    of theirs is predicted)."""
    seen: dict[bytes, int] = {}
    out: list[tuple[np.ndarray, list[int]]] = []
    for i in range(start, stop):
        if not samples.continuations[i].size:
            continue
        prompt = samples.prompts[i]
        key = prompt.tobytes()
        if key not in seen:
            seen[key] = len(out)
            out.append((prompt, []))
        out[seen[key]][1].append(i)
    return out


def _first_fit(sizes: Sequence[int], width: int) -> list[int]:
    """Segments of `sizes` tokens (each <= width) -> the row each goes to: longest first into
    the first row with room (first-fit decreasing), a new row when none has. The search for a
    row is one vectorised scan of the open rows' loads, so thousands of segments (a
    long-prompt batch: one row each) cost milliseconds, not an O(n * rows) Python loop."""
    load = np.zeros(len(sizes) + 1, np.int64)  # at most one row per segment
    rows = 0
    where = [0] * len(sizes)
    for s in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        room = np.flatnonzero(load[:rows] <= width - sizes[s])
        r = int(room[0]) if room.size else rows
        rows = max(rows, r + 1)
        where[s] = r
        load[r] += sizes[s]
    return where


def _fullest_row(sizes: Sequence[int], where: Sequence[int]) -> int:
    """Tokens in the fullest row of segments `sizes` placed in rows `where` (0 when empty)."""
    if not len(sizes):
        return 0
    return int(np.bincount(np.asarray(where), weights=np.asarray(sizes, np.float64)).max())


# a known shape is taken over the cheapest one when it costs at most this much more
KNOWN_SHAPE_SLACK = 1.1


def _rows_at(sizes: Sequence[Sequence[int]], width: int, rows_per_part: int) -> int:
    """Rows of `width` slots the fullest micro-batch of segment `sizes` needs (first-fit
    decreasing), rounded up to a multiple of rows_per_part."""
    rows = max([1] + [max(_first_fit(s, width), default=-1) + 1 for s in sizes])
    return -(-rows // rows_per_part) * rows_per_part


def _widths(low: int, high: int) -> list[int]:
    """The candidate row widths in [low, high]: `row_bucket` values (four per doubling) above
    the widths where packed attention switches to dense scores (so a narrower row never changes
    attention's form, and the memory plan of ROW_TOKENS-wide rows still bounds it), and `high`."""
    out, w = {high}, max(low, PACKED_DENSE_MAX + 1)
    while w < high:
        out.add(row_bucket(w))
        w = row_bucket(w) + 1
    return sorted(out)


def row_shape(sizes: Sequence[Sequence[int]], width: int, rows_per_part: int = 1,
              known: Collection[tuple[int, int]] = ()) -> tuple[int, int]:
    """(R, L) for micro-batches of segments of `sizes` tokens each (one list per micro-batch,
    of every batch that is stacked with it; each <= width).

    The baseline is `width`-wide rows narrowed to the fullest row's `row_bucket`. Narrower
    widths (`_widths`, each >= the longest segment) need more rows; the shape with the fewest
    slots R x L wins (ties: the wider). A shape of `known` (those compiled before) that holds
    the segments is taken instead when its slots are within KNOWN_SHAPE_SLACK of the best and
    no more than the baseline's, so shapes repeat across steps. No choice exceeds the
    baseline's slots: the memory plan, made for `width`-wide rows, bounds every one."""
    rows = _rows_at(sizes, width, 1)
    where = [(_first_fit(s, width), s) for s in sizes]
    fullest = max([1] + [_fullest_row(s, w) for w, s in where])
    base_width = min(width, max(MIN_BUDGET, row_bucket(fullest)))
    base = (-(-rows // rows_per_part) * rows_per_part, base_width)
    longest = max([1] + [max(s, default=1) for s in sizes])
    options = [base] + [(_rows_at(sizes, w, rows_per_part), w) for w in _widths(longest, width) if w < base_width]
    best = min(options, key=lambda o: (o[0] * o[1], -o[1]))
    cap = base[0] * base[1]
    holds = [k for k in known if k[0] * k[1] <= min(cap, KNOWN_SHAPE_SLACK * best[0] * best[1])
             and k[1] >= longest and _rows_at(sizes, k[1], rows_per_part) <= k[0]]
    return min(holds, key=lambda k: (k[0] * k[1], -k[1])) if holds else best


class PackShape(NamedTuple):
    """The static shape of a packed batch: R rows and M predictions per micro-batch, rows of L
    slots, continuations of C tokens."""

    rows: int
    width: int
    predictions: int
    length: int


def shape_of(batch: Any, parts: int = 1) -> PackShape:
    """The `PackShape` of a packed batch of `parts` micro-batches (a dict or `LearnerBatch`;
    any leading policy axis)."""
    get = batch.__getitem__ if isinstance(batch, Mapping) else lambda name: getattr(batch, name)
    rows, width = np.shape(get("packed_tokens"))[-2:]
    return PackShape(int(rows) // parts, int(width), int(np.shape(get("pred_source"))[-1]) // parts,
                     int(np.shape(get("pred_slot"))[-1]))


def pack(
    batches: Sequence[Samples], parts: int = 1, rows_per_part: int = 1, width: int = ROW_TOKENS,
    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, known: Collection[tuple[int, int]] = (),
) -> list[dict[str, np.ndarray]]:
    """`Samples` (N of each a multiple of `parts`) -> the packed layout of the module docstring,
    with R, L, M and C common to all of them (so the results stack, e.g. one per policy of a
    stacked group).

    L starts at `width`, or the `token_budget` of the longest segment when one is longer; R and
    L are then chosen by `row_shape` (the fewest slots R x L over a few narrower widths, a
    shape in `known` when it costs little more), R a multiple of `rows_per_part` (one per data
    shard). M = R x L (a micro-batch never predicts more tokens than its rows hold).

    So a run compiles for a few shapes rather than one per change of length, and rows are full
    but for the last one: attention skips the tiles outside a segment, so a row costs about
    what its segments hold, and several rows per micro-batch keep attention's tiles batched."""
    plans = []  # per batch, per micro-batch: (segments, their sizes)
    longest_rest, longest_segment = 1, 1
    for b in batches:
        n = b.num_samples
        if n % parts:
            raise JmarlError(f"batch of {n} samples does not split into {parts} micro-batches")
        per_part = n // parts
        micro = []
        for m in range(parts):
            segments = _segments(b, m * per_part, (m + 1) * per_part)
            sizes = [p.size + sum(b.continuations[i].size for i in idx) for p, idx in segments]
            longest_segment = max([longest_segment] + sizes)
            micro.append((segments, sizes))
        longest_rest = max([longest_rest] + [c.size for c in b.continuations])
        plans.append(micro)
    width = max(width, token_budget(longest_segment))
    rows, width = row_shape([sizes for micro in plans for _, sizes in micro], width, rows_per_part, known)
    c_len = bucket_length(longest_rest, buckets)
    return [_fill(b, [(segments, _first_fit(sizes, width)) for segments, sizes in micro], parts, rows, width, c_len)
            for b, micro in zip(batches, plans)]


def _fill(b: Samples, micro: list, parts: int, rows: int, width: int, c_len: int) -> dict[str, np.ndarray]:
    """One batch's packed arrays (see `pack`): micro[m] = (segments, the row of each)."""
    n, m_len = b.num_samples, rows * width
    packed = {k: np.zeros((parts * rows, width), dtype) for k, dtype in PACKED_FIELDS.items()}
    routing = b.routing
    if routing is not None:
        marker = no_route(routing.dtype)  # no recorded experts
        packed["packed_routing"] = np.full((parts * rows, width) + tuple(routing.shape), marker, routing.dtype)
    source = np.zeros((parts * m_len,), np.int32)
    target = np.zeros((parts * m_len,), np.int32)
    pred_slot = np.full((n, c_len), -1, np.int32)
    for m, (segments, where) in enumerate(micro):
        fill = [0] * rows  # next free slot of each row
        next_id = [1] * rows
        k = 0  # next prediction of this micro-batch
        for (prompt, members), r in zip(segments, where):
            row, at = m * rows + r, fill[r]
            seg = next_id[r]
            p = prompt.size
            packed["packed_tokens"][row, at:at + p] = prompt
            packed["packed_positions"][row, at:at + p] = np.arange(p)
            packed["packed_segment"][row, at:at + p] = seg
            if routing is not None and p:  # the prompt's experts: the first sample that recorded them
                src = next((routing.per_sample[i] for i in members if routing.per_sample[i] is not None), None)
                if src is not None:
                    packed["packed_routing"][row, at:at + p] = src[:p]
            last_prompt = row * width + at + p - 1
            at += p
            for branch, i in enumerate(members, start=1):
                toks = b.continuations[i]
                c = toks.size
                packed["packed_tokens"][row, at:at + c] = toks
                packed["packed_positions"][row, at:at + c] = p + np.arange(c)
                packed["packed_segment"][row, at:at + c] = seg
                packed["packed_branch"][row, at:at + c] = branch
                if routing is not None and routing.per_sample[i] is not None:
                    packed["packed_routing"][row, at:at + c] = routing.per_sample[i][p:p + c]
                src = row * width + at + np.arange(-1, c - 1)
                src[0] = last_prompt
                first = 0 if p else 1  # with no prompt the first token has nothing before it
                count = c - first
                source[m * m_len + k:m * m_len + k + count] = src[first:]
                target[m * m_len + k:m * m_len + k + count] = toks[first:]
                pred_slot[i, first:c] = m * m_len + k + np.arange(count)
                k += count
                at += c
            fill[r], next_id[r] = at, seg + 1
    valid = np.arange(c_len)[None, :] < np.array([c.size for c in b.continuations], np.int64)[:, None]
    out: dict[str, np.ndarray] = {**packed, "pred_source": source, "pred_target": target, "pred_slot": pred_slot,
                                  "tokens": _right_padded(b.continuations, c_len, np.int32), "attention_mask": valid}
    for key, values in b.per_token.items():
        out[key] = _right_padded(values, c_len)
    out["loss_mask"] = valid & out["loss_mask"].astype(bool) if "loss_mask" in out else valid
    out.update({key: np.asarray(x) for key, x in b.per_sample.items()})
    return out


def _right_padded(values: Sequence[np.ndarray], length: int, dtype: Any = None) -> np.ndarray:
    """[N, length]: row i holds values[i] ([C_i], C_i <= length) then zeros (of values' dtype)."""
    dtype = dtype or (np.asarray(values[0]).dtype if len(values) else np.float32)
    out = np.zeros((len(values), length), dtype)
    for i, v in enumerate(values):
        out[i, :np.size(v)] = v
    return out


def packed_logprobs(config: ModelConfig, params: Params, batch: Any, temperature: float | jax.Array = 1.0, *,
                    with_router_stats: bool = False) -> jax.Array | tuple[jax.Array, Any]:
    """float32[N, C]: the continuation token log-probs of a packed (micro-)batch, a
    `LearnerBatch` or a dict (reads `jmarl.batch.MODEL_INPUTS`); 0 where a token has no
    prediction. with_router_stats: (log-probs, the mixture-of-experts layers' `moe.RouterStats`
    over the packed real tokens) from the same forward pass. A batch with `packed_routing`
    (routing replay) runs each slot's recorded experts (`packed_token_logprobs`' routing)."""
    get = batch.get if isinstance(batch, Mapping) else lambda name: getattr(batch, name, None)
    tokens = get("packed_tokens")
    out = packed_token_logprobs(
        config, params, tokens, get("packed_positions"), get("packed_segment"), get("packed_branch"),
        get("pred_source") % tokens.size, get("pred_target"), temperature, with_router_stats=with_router_stats,
        routing=get("packed_routing"),
    )
    lp, stats = out if with_router_stats else (out, None)
    slot = get("pred_slot")
    lp = jnp.where(slot >= 0, lp[jnp.maximum(slot, 0) % lp.shape[0]], 0.0)
    return (lp, stats) if with_router_stats else lp


def token_utilization(batch: Any) -> tuple[int, int]:
    """(real tokens, token slots) of a packed batch's rows (host arrays; any leading axes)."""
    segment = np.asarray(batch["packed_segment"] if isinstance(batch, Mapping) else batch.packed_segment)
    return int(np.count_nonzero(segment)), int(segment.size)


def policy_token_utilization(batch: Any, stacked: bool) -> list[tuple[int, int]]:
    """(real tokens, token slots) of each policy of a packed batch: one entry per index of a
    stacked batch's policy axis, else one for the whole batch."""
    segment = np.asarray(batch["packed_segment"] if isinstance(batch, Mapping) else batch.packed_segment)
    per = segment if stacked else segment[None]
    return [(int(np.count_nonzero(s)), int(s.size)) for s in per]
