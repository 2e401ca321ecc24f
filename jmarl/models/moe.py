"""Mixture-of-experts feed-forward (Qwen3-MoE), exact to transformers' `Qwen3MoeSparseMoeBlock`,
and its load-balancing loss (`load_balancing_loss_func`), as pure functions.

N = tokens (rows of a flattened [..., D] input), D = hidden size, E = experts, k = experts per
token (top-k), F = an expert's intermediate size.

    route:        router logits [N, E] -> float32 probabilities (softmax in float32), the top-k
                  experts int32[N, k] and their weights [N, k] (renormalised to sum to 1 when
                  norm_topk_prob; cast to the logits' dtype, as transformers does)
    expert_ffn:   every token through its k experts, as three grouped matrix products
                  (`jax.lax.ragged_dot`) over the N * k (token, expert) pairs sorted by expert,
                  then unsorted and summed with the routing weights. Dropless: no capacity,
                  every pair is computed
    router_stats: what the load-balancing loss needs of one layer, summed over its valid tokens
                  (`RouterStats`, additive over layers, so a layer scan carries it)
    load_balancing_loss: E * sum_e (fraction of assignments to e) * (mean probability of e)

The network module that holds the router and the stacked expert weights is
`jmarl.models.model.SparseMLP`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class RouterStats:
    """Per-expert sums of the mixture-of-experts layers that the load-balancing loss reads, over
    the valid (non-padding) tokens of every sparse layer run so far (transformers counts a token
    once per sparse layer): counts float32[E] (top-k assignments to each expert), probs
    float32[E] (router probabilities of each expert), rows float32[] (valid tokens). Sums, so
    layers and batches add (`plus`). Only probs carries a gradient."""

    counts: jax.Array
    probs: jax.Array
    rows: jax.Array

    @staticmethod
    def zeros(num_experts: int) -> "RouterStats":
        """Empty sums for `num_experts` experts (a dense layer's share)."""
        return RouterStats(jnp.zeros((num_experts,), jnp.float32), jnp.zeros((num_experts,), jnp.float32),
                           jnp.zeros((), jnp.float32))

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


def expert_ffn(
    x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """sum_j weights[n, j] * FFN_{experts[n, j]}(x[n]) for x [N, D], experts int[N, k], weights
    [N, k]; FFN_e(x) = (silu(x gate[e]) * (x up[e])) down[e] with gate, up [E, D, F] and down
    [E, F, D], all in one dtype (the compute dtype). -> [N, D] in x's dtype.

    The N * k (token, expert) pairs are sorted by expert (stable: by token within an expert),
    so the rows of each expert are contiguous and each projection is one grouped product
    `jax.lax.ragged_dot` over E groups of `bincount(experts)` rows; the outputs are put back in
    pair order, weighted, and the k of a token summed in float32."""
    n, k = experts.shape
    num_experts = gate.shape[0]
    flat = experts.reshape(-1)  # [N*k]: pair p = (token p // k, its (p % k)-th expert)
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]: rows of each group
    rows = jnp.take(x, order // k, axis=0)  # [N*k, D], expert-major
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)  # [N*k, F]
    y = jax.lax.ragged_dot(h, down, sizes)  # [N*k, D], expert-major
    position = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))  # inverse permutation
    y = jnp.take(y, position, axis=0).reshape(n, k, -1) * weights[..., None].astype(y.dtype)
    return jnp.sum(y.astype(jnp.float32), axis=1).astype(x.dtype)


def router_stats(probs: jax.Array, experts: jax.Array, valid: jax.Array | None = None) -> RouterStats:
    """One sparse layer's `RouterStats` from its float32 probabilities [N, E] and top-k experts
    int[N, k], over the tokens where valid bool[N] (None: all)."""
    n, num_experts = probs.shape
    w = jnp.ones((n,), jnp.float32) if valid is None else valid.reshape(n).astype(jnp.float32)
    k = experts.shape[-1]
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(w, k))
    return RouterStats(counts=jax.lax.stop_gradient(counts), probs=jnp.sum(probs * w[:, None], axis=0),
                       rows=jnp.sum(w))


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
