"""Mixture-of-experts feed-forward (Qwen3-MoE), exact to transformers' `Qwen3MoeSparseMoeBlock`,
and its load-balancing loss (`load_balancing_loss_func`), as pure functions.

N = tokens (rows of a flattened [..., D] input), D = hidden size, E = experts, k = experts per
token (top-k), F = an expert's intermediate size.

    route:          router logits [N, E] -> float32 probabilities (softmax in float32), the
                    top-k experts int32[N, k] and their weights [N, k] (renormalised to sum to 1
                    when norm_topk_prob; cast to the logits' dtype, as transformers does)
    grouped_matmul: (`jmarl.models.grouped_matmul`) rows sorted by group [M, K] x per-group
                    weights [G, K, N] -> [M, N]
    expert_ffn:     every token through its k experts, as three grouped products over the N * k
                    (token, expert) pairs sorted by expert, then unsorted and summed with the
                    routing weights. Dropless: no capacity, every pair is computed
    expert_parallel_ffn: `expert_ffn` with the experts split over mesh axes (expert
                    parallelism, `jax.shard_map`): each device gathers its group's tokens and
                    routing, runs the pairs routed to its own experts, and the partial outputs
                    are reduce-scattered back to the tokens' devices. No expert weight moves.
                    Without a mesh, or with the experts not split, it is `expert_ffn` in
                    chunks (`chunked_expert_ffn`)
    router_stats:   what the load-balancing loss needs of one layer, summed over its valid
                    tokens (`RouterStats`, additive over layers, so a layer scan carries it)
    load_balancing_loss: E * sum_e (fraction of assignments to e) * (mean probability of e)
    route_replayed: routing replay (R3): the experts given (a rollout's recorded ids) instead of
                    the top-k, weighted by this router's own probabilities at them, so the
                    router keeps its gradient; `replay_route` falls back to the top-k for tokens
                    without a record and returns both choices (`routing_mismatch` compares them)
    routing_dtype / routing_bytes_per_token: how recorded expert ids are stored (uint8 for
                    E < 256, else uint16; the dtype's largest value marks "no record")

The network module that holds the router and the stacked expert weights is
`jmarl.models.layers.SparseMLP`.

Expert parallelism (docs/scaling.md, "Mixture of experts"): the logical axis "expert" of the
expert weights [E, D, F] is mapped to mesh axes by `jmarl.sharding.ShardingRules` (default:
fsdp, so each fsdp device holds E / fsdp whole experts instead of 1 / fsdp of every expert's D).
The tokens of a layer are rows over the mesh axes of "activation_batch" (data, fsdp), so the
devices that split the experts also split the tokens. Each device dispatches its rows in chunks
(`in_chunks`, at most PAIRS_PER_CHUNK pairs a chunk): it all-gathers a chunk's rows over the
expert axes it shares with the rows (fsdp: the chunk of every device of its fsdp group),
computes the pairs routed to its own experts, and a reduce-scatter sums the partial outputs
back onto the devices of the rows. The pairs buffer of a chunk is static and dropless: its
gathered rows x min(k, E / experts) (every gathered token could pick its k experts among this
device's). F split over "tensor" (the rule "mlp") adds a sum over tensor.

Why an all-gather of tokens rather than an all-to-all of (token, expert) pairs: both need the
same static dropless buffer on the receiving device (every pair of the group could be routed
to it), and the all-gather receives N_local x (x - 1) rows of D per device for x expert
devices where a balanced all-to-all receives N_local x k x (x - 1) / x: x / k times as many,
so no more while x <= k (Qwen3-MoE: k = 8), 8x more at x = 64 (the way back likewise, and in
float32). `jax.lax.ragged_all_to_all`, which would send only the routed pairs, is not
implemented by XLA:CPU, so nothing here could run or test it: it is the next step for large
x. Either moves tokens, not weights: FSDP on D instead (the rule expert -> ()) leaves XLA to
gather, or to partially sum over D, every expert of every layer (`benchmarks/moe.py` compiles
both).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from jmarl.models.grouped_matmul import grouped_matmul, varying_like
from jmarl.padding import no_route  # the marker of a token without recorded experts
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules

# The most (token, expert) pairs one device computes at once: a layer's rows are dispatched in
# chunks of at most this many pairs (`in_chunks`; 32,768 pairs of Qwen3-30B-A3B: 256 MiB of rows
# in float32), as the dense MLP runs in token chunks.
PAIRS_PER_CHUNK = 32768
ACTIVATION_AXES = ("activation_batch",)  # a layer's token rows (as `jmarl.models.layers.ACTIVATION_AXES`)
EXPERT_WEIGHT_AXES = ("expert", "embed", "mlp")  # gate/up [E, D, F] (`param_axes`, without "layers")


@struct.dataclass
class RouterStats:
    """Per-expert sums of the mixture-of-experts layers that the load-balancing loss reads, over
    the valid (non-padding) tokens of every sparse layer run so far (transformers counts a token
    once per sparse layer): counts float32[E] (top-k assignments to each expert: the experts the
    layer ran, the replayed ones under routing replay), probs float32[E] (router probabilities
    of each expert), rows float32[] (valid tokens). Routing replay adds two counts of (token,
    sparse layer) pairs: recorded float32[] (valid tokens that had a recorded routing) and
    mismatched float32[] (those whose own top-k set differs from the recorded one); both 0
    without replay. Sums, so layers and batches add (`plus`). Only probs carries a gradient."""

    counts: jax.Array
    probs: jax.Array
    rows: jax.Array
    recorded: jax.Array
    mismatched: jax.Array

    @staticmethod
    def zeros(num_experts: int) -> "RouterStats":
        """Empty sums for `num_experts` experts (a dense layer's share)."""
        zero = jnp.zeros((), jnp.float32)
        return RouterStats(jnp.zeros((num_experts,), jnp.float32), jnp.zeros((num_experts,), jnp.float32),
                           zero, zero, zero)

    def plus(self, other: "RouterStats") -> "RouterStats":
        """The sums of both."""
        return jax.tree.map(jnp.add, self, other)


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router logits [N, E] (the compute dtype) -> (probs float32[N, E], weights [N, k] in the
    logits' dtype, experts int32[N, k]): transformers' Qwen3MoeTopKRouter. The softmax runs in
    float32; the top k probabilities (largest first) are divided by their sum when `normalize`
    (norm_topk_prob), then cast to the logits' dtype."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights.astype(logits.dtype), experts.astype(jnp.int32)


# ---------------------------------------------------------------------------------- routing replay
def routing_dtype(num_experts: int) -> np.dtype:
    """The dtype recorded expert ids are stored in: uint8 while ids 0 .. E-1 leave its largest
    value (255) free to mean "no record" (E < 256), else uint16 (E < 65,536)."""
    return np.dtype(np.uint8) if num_experts < 256 else np.dtype(np.uint16)


def routing_bytes_per_token(num_sparse_layers: int, top_k: int, num_experts: int) -> int:
    """Bytes a recorded routing costs per token: one id per (sparse layer, expert slot), each of
    `routing_dtype(num_experts)` (Qwen3-30B-A3B: 48 x 8 x 1 = 384)."""
    return num_sparse_layers * top_k * routing_dtype(num_experts).itemsize


def is_recorded(ids: jax.Array) -> jax.Array:
    """bool[...]: which tokens of recorded ids [..., k] hold a routing (not the `no_route`
    marker of their dtype)."""
    return ids[..., 0] != no_route(ids.dtype)


def route_replayed(logits: jax.Array, experts: jax.Array, normalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routing replay: router logits [N, E] and given experts int[N, k] (a rollout's recorded
    ids) -> (probs float32[N, E], weights [N, k] in the logits' dtype, experts int32[N, k]), as
    `route` returns them but for the given experts instead of the top k: the weights are this
    router's own float32 probabilities at those experts, divided by their sum when `normalize`.
    So the layer runs the rollout's experts while the router still gets a gradient through the
    weights (and the load-balancing loss through probs). Given the top k itself, the same
    numbers as `route`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    experts = experts.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights.astype(logits.dtype), experts


def replay_route(logits: jax.Array, recorded: jax.Array, top_k: int, normalize: bool
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """`route_replayed` on the recorded ids [N, k] (`routing_dtype`) where a token has them and
    the router's own top k where it has none (`is_recorded`: the marker `no_route`) -> (probs
    float32[N, E], weights [N, k], experts int32[N, k] (what the layer runs), own int32[N, k]
    (the router's own top k), recorded bool[N])."""
    has = is_recorded(recorded)
    own = route(logits, top_k, normalize)[2]
    experts = jnp.where(has[:, None], recorded.astype(jnp.int32), own)
    probs, weights, experts = route_replayed(logits, experts, normalize)
    return probs, weights, experts, own, has


def routing_mismatch(own: jax.Array, experts: jax.Array) -> jax.Array:
    """bool[N]: whether the set of own int[N, k] differs from the set of experts int[N, k] (the
    k ids of a token are distinct, so equal sets are: every own id is among the experts)."""
    same = jnp.all(jnp.any(own[:, :, None] == experts[:, None, :], axis=-1), axis=-1)
    return ~same


# ---------------------------------------------------------------------------------- the experts
def expert_ffn(
    x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """sum_j weights[n, j] * FFN_{experts[n, j]}(x[n]) for x [N, D], experts int[N, k], weights
    [N, k]; FFN_e(x) = (silu(x gate[e]) * (x up[e])) down[e] with gate, up [E, D, F] and down
    [E, F, D], all in one dtype (the compute dtype). -> [N, D] in x's dtype.

    The N * k (token, expert) pairs are sorted by expert (stable: by token within an expert),
    so the rows of each expert are contiguous and each projection is one grouped product
    (`grouped_matmul`) over E groups of `bincount(experts)` rows; the outputs are put back in
    pair order, weighted, and the k of a token summed in float32."""
    n, k = experts.shape
    num_experts = gate.shape[0]
    flat = experts.reshape(-1)  # [N*k]: pair p = (token p // k, its (p % k)-th expert)
    order = varying_like(jnp.argsort(flat, stable=True), flat)  # pairs sorted by expert (typed as `flat`: see
    # `local_expert_ffn`)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]: rows of each group
    rows = jnp.take(x, order // k, axis=0)  # [N*k, D], expert-major
    h = jax.nn.silu(grouped_matmul(rows, gate, sizes)) * grouped_matmul(rows, up, sizes)  # [N*k, F]
    y = grouped_matmul(h, down, sizes)  # [N*k, D], expert-major
    position = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))  # inverse permutation
    y = jnp.take(y, position, axis=0).reshape(n, k, -1) * weights[..., None].astype(y.dtype)
    return jnp.sum(y.astype(jnp.float32), axis=1).astype(x.dtype)


def local_expert_ffn(
    x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
    first: jax.Array | int, capacity: int,
) -> jax.Array:
    """The share of `expert_ffn` that experts first .. first + El - 1 compute: for x [N, D],
    experts int[N, k] (global ids), weights [N, k] and those experts' gate, up [El, D, F], down
    [El, F, D], sum_j [experts[n, j] is one of them] weights[n, j] FFN_{experts[n, j]}(x[n])
    -> float32[N, D] (a partial sum: the other experts' shares, and with F split the other F
    shards', are added by the caller).

    The pairs routed here are sorted first (by expert, then token), the others after them; the
    first `capacity` pairs are computed (`capacity` >= the pairs that can be routed here, N x
    min(k, El): a token's k experts are distinct, so dropless), and added into their tokens'
    rows in float32."""
    n, k = experts.shape
    num_local = gate.shape[0]
    local = experts.reshape(-1) - first
    local = jnp.where((local >= 0) & (local < num_local), local, num_local)  # num_local: elsewhere
    # [C]: the pairs routed here first. In a `shard_map` that checks types, jnp.argsort's
    # result loses the mesh axes its keys vary over (JAX 0.10), and the backward pass would then
    # read one device's order on all of them: it is typed as varying like `local` again
    order = varying_like(jnp.argsort(local, stable=True), local)[:capacity]
    sizes = jnp.bincount(local, length=num_local).astype(jnp.int32)  # [El] (pairs elsewhere not counted)
    token = order // k
    rows = jnp.take(x, token, axis=0)  # [C, D], expert-major
    h = jax.nn.silu(grouped_matmul(rows, gate, sizes)) * grouped_matmul(rows, up, sizes)  # [C, F]
    y = grouped_matmul(h, down, sizes)  # [C, D]; rows past sum(sizes) are 0
    pair_weight = jnp.where(local[order] < num_local, weights.reshape(-1)[order], 0)
    y = y * pair_weight[:, None].astype(y.dtype)
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How `expert_parallel_ffn` splits a layer on a mesh (mesh axes of size > 1, each a tuple,
    outermost first): `tokens` split the token rows, `experts` the experts E, `hidden` an
    expert's F (a sum over them). `gathered` = experts that also split the rows (tokens gathered
    over them, outputs reduce-scattered), `summed` = the other expert axes and `hidden` (outputs
    summed over them: the tokens are already whole there). `local_experts` E / prod(experts).
    A device's rows are dispatched `chunk_rows` at a time; `capacity` is one chunk's pairs
    buffer: its gathered rows (chunk_rows x prod(gathered)) x min(k, local_experts)."""

    tokens: tuple[str, ...]
    experts: tuple[str, ...]
    hidden: tuple[str, ...]
    local_experts: int
    chunk_rows: int
    capacity: int

    @property
    def gathered(self) -> tuple[str, ...]:
        return tuple(a for a in self.tokens if a in self.experts)

    @property
    def summed(self) -> tuple[str, ...]:
        return tuple(a for a in self.experts if a not in self.tokens) + self.hidden


def _entry(spec: P, i: int) -> tuple[str, ...]:
    """The mesh axes of dimension i of a PartitionSpec, as a tuple."""
    if i >= len(spec) or spec[i] is None:
        return ()
    return (spec[i],) if isinstance(spec[i], str) else tuple(spec[i])


def expert_layout(
    sizes: Mapping[str, int], num_tokens: int, top_k: int, weight_shape: tuple[int, int, int],
    rules: ShardingRules = DEFAULT_RULES,
) -> ExpertLayout | None:
    """The `ExpertLayout` of a layer of `num_tokens` rows and experts gate [E, D, F] on a mesh of
    axis `sizes` by `rules` ("activation_batch" rows, the expert weights' ("expert", "embed",
    "mlp") as `rules.spec` fits them), or None when the experts are not split (no expert axis
    of size > 1 divides E): then `expert_ffn` runs as it is. An F axis that also splits the
    rows is not used for F (a sum over it would add different tokens). Chunks hold at most
    PAIRS_PER_CHUNK pairs (at least one row)."""
    weight_spec = rules.spec(EXPERT_WEIGHT_AXES, weight_shape, sizes)
    experts = _entry(weight_spec, 0)
    if not experts:
        return None
    tokens = _entry(rules.spec(ACTIVATION_AXES, (num_tokens,), sizes), 0)
    hidden = tuple(a for a in _entry(weight_spec, 2) if a not in tokens)
    local = weight_shape[0] // math.prod(sizes[a] for a in experts)
    local_rows = num_tokens // math.prod(sizes[a] for a in tokens)
    pairs_per_row = math.prod(sizes[a] for a in tokens if a in experts) * min(top_k, local)
    chunk = max(1, min(local_rows, PAIRS_PER_CHUNK // pairs_per_row))
    return ExpertLayout(tokens=tokens, experts=experts, hidden=hidden, local_experts=local, chunk_rows=chunk,
                        capacity=chunk * pairs_per_row)


def in_chunks(fn: Callable[..., jax.Array], rows: int, x: jax.Array, experts: jax.Array, weights: jax.Array,
              *, strided: bool = False) -> jax.Array:
    """fn(x, experts, weights) -> [n, ...] over `rows` rows at a time of x [N, D], experts
    [N, k], weights [N, k] (`jax.lax.map` of `jax.checkpoint(fn)`: one chunk's dispatch buffers
    alive at a time, in the forward pass and the backward, which recomputes each chunk from its
    rows). Chunk c holds rows c*rows .. (c+1)*rows - 1, or with `strided` the rows r with
    r % count == c (count = the number of chunks): rows that a mesh splits in contiguous blocks
    are then spread over its devices in every chunk, as the dense MLP's token chunks keep the
    batch axis whole. Padding rows (the last ones) get weight 0 and the k experts 0 .. k-1
    (distinct, as real rows' are, so no device receives more than min(k, its experts) pairs of
    a row). One call, unchunked, when N <= rows."""
    n, k = experts.shape
    if n <= rows:
        return fn(x, experts, weights)
    count = -(-n // rows)
    pad = count * rows - n
    x = jnp.pad(x, ((0, pad), (0, 0)))
    experts = jnp.concatenate([experts, jnp.broadcast_to(jnp.arange(k, dtype=experts.dtype), (pad, k))])
    weights = jnp.pad(weights, ((0, pad), (0, 0)))

    def split(a: jax.Array) -> jax.Array:  # [count * rows, ...] -> [count, rows, ...]
        if strided:
            return jnp.swapaxes(a.reshape((rows, count) + a.shape[1:]), 0, 1)
        return a.reshape((count, rows) + a.shape[1:])

    out = jax.lax.map(lambda c: jax.checkpoint(fn)(*c), tuple(split(a) for a in (x, experts, weights)))
    out = jnp.swapaxes(out, 0, 1) if strided else out
    return out.reshape((count * rows,) + out.shape[2:])[:n]


def chunked_expert_ffn(
    x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """`expert_ffn` in strided chunks of PAIRS_PER_CHUNK pairs (`in_chunks`): what a layer runs
    when its experts are not split (no mesh, or no expert axis that divides E)."""
    rows = max(1, PAIRS_PER_CHUNK // experts.shape[1])
    return in_chunks(lambda x, e, w: expert_ffn(x, e, w, gate, up, down), rows, x, experts, weights, strided=True)


def _axis_index(axes: tuple[str, ...], sizes: Mapping[str, int]) -> jax.Array:
    """This device's linear index over mesh `axes` (the first outermost, as a PartitionSpec
    entry splits a dimension), inside `shard_map`."""
    index = jnp.zeros((), jnp.int32)
    for a in axes:
        index = index * sizes[a] + jax.lax.axis_index(a)
    return index


def expert_parallel_ffn(
    x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
    rules: ShardingRules = DEFAULT_RULES,
) -> jax.Array:
    """`expert_ffn` (same arguments and result: x [N, D], experts int32[N, k], weights [N, k],
    gate, up [E, D, F], down [E, F, D] -> [N, D]) with the experts split over the mesh the
    program is traced under (`jax.set_mesh`) by `rules` (`expert_layout`): a `jax.shard_map`
    in which each device, for each chunk of its rows (`in_chunks`),

        1. all-gathers the chunk's rows, experts and weights over the expert axes that split
           the rows (fsdp with the default rules: the chunks of the fsdp group),
        2. computes the pairs routed to its E/x experts (`local_expert_ffn`, F/tensor of each),
        3. reduce-scatters the float32 partial outputs back over those axes,

    then sums them over the other expert axes and tensor. The expert weights stay where they
    are (the in_specs are their placement: E over the expert axes, F over tensor, D whole).
    Without a mesh, or when no expert axis splits E, it is `chunked_expert_ffn`. Equal to
    `expert_ffn` up to the order of the float32 sums."""
    mesh = jax.sharding.get_abstract_mesh()
    layout = None
    if not mesh.empty and mesh.size > 1:
        sizes = dict(mesh.shape)
        layout = expert_layout(sizes, x.shape[0], experts.shape[1], gate.shape, rules)
    if layout is None:
        return chunked_expert_ffn(x, experts, weights, gate, up, down)

    def spec(*entries: tuple[str, ...]) -> P:
        return P(*(None if not e else e[0] if len(e) == 1 else e for e in entries))

    rows, expert_w, expert_down = spec(layout.tokens), spec(layout.experts, (), layout.hidden), \
        spec(layout.experts, layout.hidden, ())

    def body(x, experts, weights, gate, up, down):
        first = _axis_index(layout.experts, sizes) * layout.local_experts

        def chunk(x, experts, weights):
            if layout.gathered:
                x, experts, weights = (jax.lax.all_gather(a, layout.gathered, axis=0, tiled=True)
                                       for a in (x, experts, weights))
            out = local_expert_ffn(x, experts, weights, gate, up, down, first, layout.capacity)
            if layout.gathered:
                out = jax.lax.psum_scatter(out, layout.gathered, scatter_dimension=0, tiled=True)
            return out

        out = in_chunks(chunk, layout.chunk_rows, x, experts, weights)
        if layout.summed:
            out = jax.lax.psum(out, layout.summed)
        return out.astype(x.dtype)

    # check_vma=False: under the stacked policies' vmap(spmd_axis_name="policy") JAX 0.10 types
    # some values of the batched body (scans, boolean masks) as varying over "policy" and others
    # not, and refuses them. Unchecked, the transposes are the ones this layer needs (all_gather
    # <-> psum_scatter, psum, and a sum over the axes an input is replicated on), as the tests'
    # gradients on several meshes, stacked or not, show
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, expert_w, expert_w, expert_down),
                         out_specs=rows, check_vma=False)(x, experts, weights, gate, up, down)


def router_stats(probs: jax.Array, experts: jax.Array, valid: jax.Array | None = None,
                 replayed: tuple[jax.Array, jax.Array] | None = None) -> RouterStats:
    """One sparse layer's `RouterStats` from its float32 probabilities [N, E] and the experts it
    ran int[N, k], over the tokens where valid bool[N] (None: all). replayed: (own int[N, k],
    recorded bool[N]) of `replay_route`: the recorded tokens and those whose own top k differs
    from the experts run are counted too."""
    n, num_experts = probs.shape
    w = jnp.ones((n,), jnp.float32) if valid is None else valid.reshape(n).astype(jnp.float32)
    k = experts.shape[-1]
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(w, k))
    zero = jnp.zeros((), jnp.float32)
    recorded, mismatched = zero, zero
    if replayed is not None:
        own, has = replayed
        on = w * has.reshape(n).astype(jnp.float32)
        recorded = jnp.sum(on)
        mismatched = jnp.sum(on * routing_mismatch(own, experts).astype(jnp.float32))
    return RouterStats(counts=jax.lax.stop_gradient(counts), probs=jnp.sum(probs * w[:, None], axis=0),
                       rows=jnp.sum(w), recorded=jax.lax.stop_gradient(recorded),
                       mismatched=jax.lax.stop_gradient(mismatched))


def mismatch_fraction(stats: RouterStats) -> jax.Array:
    """The fraction of recorded (token, sparse layer) pairs whose own top-k set differs from the
    recorded one (`RouterStats.mismatched / recorded`; 0 without a recorded pair)."""
    return stats.mismatched / jnp.maximum(stats.recorded, 1.0)


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """transformers' auxiliary load-balancing loss (Switch Transformer eqs. 4-6) of summed
    `RouterStats`: E * sum_e (counts_e / rows) * (probs_e / rows), a float32 scalar (0 for a
    model without experts: E = 0). Its minimum, top_k, is reached by uniform routing. A
    training loss adds `router_aux_loss_coef * load_balancing_loss(stats)`."""
    num_experts = stats.counts.shape[0]
    rows = jnp.maximum(stats.rows, 1.0)
    return num_experts * jnp.sum((stats.counts / rows) * (stats.probs / rows))


def load_balancing_loss_from_logits(router_logits: jax.Array, top_k: int, mask: jax.Array | None = None) -> jax.Array:
    """`load_balancing_loss` of stacked router logits [L, N, E] (one [N, E] per sparse layer, as
    transformers returns them with output_router_logits) over the tokens where mask bool[N] (the
    flattened [B, T] attention mask; None: all): transformers' `load_balancing_loss_func`. The
    softmax runs in float32."""
    def layer(logits: jax.Array) -> RouterStats:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        return router_stats(probs, jax.lax.top_k(probs, top_k)[1], mask)

    per_layer = jax.vmap(layer)(router_logits)
    return load_balancing_loss(jax.tree.map(lambda a: jnp.sum(a, axis=0), per_layer))
