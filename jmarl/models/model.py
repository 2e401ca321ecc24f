"""One decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 3) in Flax NNX, behind a pure API.

The NNX modules below define the network; the public functions (`init`, `apply`,
`jmarl.models.logprobs.token_logprobs`, and the KV-cache pair `prefill` / `decode_step` of `jmarl.models.decode`) take
the parameters as a plain nested dict of arrays and rebuild the modules inside the trace with
`nnx.merge`, so every function is pure and `jax.jit` / `jax.vmap` / `jax.grad`-able over the
parameters. The KV cache's layout is `jmarl.models.kv_cache` (its logical axes are declared here,
`cache_axes`); the attention over it, `jmarl.models.cached_attention`.

Parameter paths (stable; LoRA keys on them) and, in `param_axes`, each parameter's logical axis
names (which `jmarl.sharding.ShardingRules` maps to mesh axes). L = layers, D = hidden, V = vocab,
Hq = num_heads * head_dim, Hkv = num_kv_heads * head_dim, F = intermediate size:

    embed/embedding                 [V, D]
    layers/attn_norm/scale          [L, D]
    layers/attn/q_proj/kernel       [L, D, Hq]     (+ bias [L, Hq] when qkv_bias or o_bias)
    layers/attn/k_proj/kernel       [L, D, Hkv]    (+ bias)
    layers/attn/v_proj/kernel       [L, D, Hkv]    (+ bias)
    layers/attn/o_proj/kernel       [L, Hq, D]     (+ bias [L, D] when o_bias)
    layers/attn/q_norm/scale        [L, head_dim]  (Qwen3 and Gemma 3 only; also k_norm)
    layers/mlp_norm/scale           [L, D]
    layers/mlp/{gate,up}_proj/kernel [L, D, F];  layers/mlp/down_proj/kernel [L, F, D]
    layers/{attn,mlp}_post_norm/scale [L, D]       (Gemma 3 only: norms of the attention / MLP outputs)
    layers/moe/router/kernel        [L, D, E]      (Qwen3-MoE sparse layers, E = num_experts)
    layers/moe/experts/{gate,up}_proj [L, E, D, Fe]; layers/moe/experts/down_proj [L, E, Fe, D]
                                                   (Fe = moe_intermediate_size)
    final_norm/scale                [D]
    lm_head/kernel                  [D, V]         (absent when embeddings are tied)

A layer has `mlp` (dense) or `moe` (mixture of experts, `SparseMLP`), as `config.sparse_layers()`
says. A model that mixes the two kinds (`config.has_mixed_mlps`; no released Qwen3-MoE does) keeps
one stacked layer structure, so each layer holds both, the unused one zeros: the layer scans
carry a per-layer flag that runs only the used one (`jax.lax.cond`); a caller that does not pass
the kind (the decode step) runs both and adds them (`DecoderLayer.feed_forward`).

The model by concept, one module each: the layers (`jmarl.models.layers`: norms, linear maps,
unmerged LoRA kernels, attention, dense and mixture-of-experts MLPs, one decoder layer), the
layer stack and its remat (`jmarl.models.layer_scan`), rotary embeddings (`jmarl.models.rope`),
the log-prob heads (`jmarl.models.logprobs`); this module holds the `Transformer` (embedding,
stacked layers, final norm, head, and the two layouts it runs: right-padded rows, packed rows), the logical axes of every
array it defines, and the pure API. Token positions are `cumsum(attention_mask) - 1`, so left-
and right-padded batches are exact.

Gemma 3 (`config.is_gemma3`): embeddings times sqrt(D) (in the compute dtype), RMSNorms
x * (1 + w) (scales initialised to 0), "sandwich" norms (input, post-attention, pre- and
post-feed-forward), a GeGLU MLP (tanh GELU), q/k norms, scores scaled by
query_pre_attn_scalar ** -0.5 (a factor on the queries when it is not head_dim). Sliding-window
layers: the layer scan carries a per-layer flag beside each layer's parameters (`layer_kind`),
which picks that layer's window (W, or `attention.NO_WINDOW`) and RoPE tables (local theta, or
the global one); the decode step's Python loop over layers (`jmarl.models.decode`) picks them
statically.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmarl.errors import JmarlError
from jmarl.models import attention as attention_lib
from jmarl.models import moe as moe_lib
from jmarl.models.config import ModelConfig
from jmarl.models.kv_cache import KVCache
from jmarl.models.layer_scan import (UNROLL_MAX_LAYERS, decoder_step, empty_router_stats, layer_kind,
                                     packed_step, split_xs, per_layer_routing, scan_layers)
from jmarl.models.layers import (DecoderLayer, LoraKernel, make_linear, make_norm, normal_init, batch_sharded, cast_kernel,
                                 dense)
from jmarl.models.rope import rope_tables
from jmarl.sharding.rules import is_axes

Params = dict[str, Any]


class Transformer(nnx.Module):
    """Embedding, L stacked decoder layers (leading axis L), final norm, LM head."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.config = c
        self.embed = nnx.Embed(
            c.vocab_size,
            c.hidden_size,
            dtype=jnp.dtype(c.compute_dtype),
            param_dtype=jnp.dtype(c.param_dtype),
            embedding_init=normal_init(),
            rngs=rngs,
        )

        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(layer_rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(c, layer_rngs)

        self.layers = make_layers(rngs)
        self.final_norm = make_norm(c, c.hidden_size)
        self.lm_head = None if c.tie_word_embeddings else make_linear(c, c.hidden_size, c.vocab_size, False, rngs)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens int[...] -> embeddings [..., D] in the compute dtype. Gemma 3: times sqrt(D),
        the factor rounded to float32 and then to the compute dtype first (as HF's
        Gemma3TextScaledWordEmbedding: bf16 makes sqrt(1152) = 33.94 into 34.0)."""
        x = self.embed(tokens)
        if self.config.is_gemma3:
            x = x * jnp.asarray(np.float32(self.config.hidden_size**0.5)).astype(x.dtype)
        return x

    def local_rope(self, positions: jax.Array, num_positions: int | None = None) -> tuple[jax.Array, jax.Array] | None:
        """(cos, sin) float32[B,T,hd] of the sliding-window layers (`rope_tables` with local=True)
        for positions int[B,T]; None when no layer has a window."""
        if not self.config.has_sliding_window:
            return None
        return rope_tables(self.config, positions, num_positions, local=True)

    def layer_xs(self, layer_state: Any, routing: jax.Array | None = None) -> Any:
        """What the layer scan runs over: the stacked layer state, paired, when the layers differ,
        with a dict of int32[L] per-layer flags: "sliding" (the sliding-window layers) and
        "sparse" (the mixture-of-experts layers of a model that mixes them with dense ones).
        routing: recorded expert ids [..., S, k] of the S sparse layers (routing replay), given
        to each layer as "replay" [L, ..., k] (`per_layer_routing`). `split_xs` unpacks one step's."""
        c = self.config
        flags = {}
        if c.has_sliding_window:
            flags["sliding"] = jnp.asarray(np.array(c.sliding_layers(), np.int32))
        if c.has_mixed_mlps:
            flags["sparse"] = jnp.asarray(np.array(c.sparse_layers(), np.int32))
        if routing is not None:
            flags["replay"] = per_layer_routing(c, routing)
        return (layer_state, flags) if flags else layer_state

    def head_master(self) -> jax.Array | LoraKernel:
        """The output projection [D, V] as stored (float32 masters; the embedding when tied; a
        `LoraKernel` when the head is adapted)."""
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def head_kernel(self) -> jax.Array | LoraKernel:
        """The output projection [D, V] in the compute dtype (the embedding when tied)."""
        dtype = jnp.dtype(self.config.compute_dtype)
        if self.lm_head is None:
            return self.embed.embedding[...].astype(dtype).T
        return cast_kernel(self.lm_head.kernel[...], dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., D] (final-normed) -> float32 logits [..., V]."""
        dtype = jnp.dtype(self.config.compute_dtype)
        return dense(h.astype(dtype), self.head_kernel(), preferred_element_type=jnp.float32)

    def hidden(
        self, tokens: jax.Array, attention_mask: jax.Array, *, return_kv: bool = False, last_only: bool = False,
        router_stats: bool = False, record_routing: bool = False,
    ) -> tuple[jax.Array, ...]:
        """tokens/mask [B,T] -> (final-normed hidden [B,T,D], (keys, values) [L,B,T,KV,hd] or None).
        router_stats (not with return_kv / last_only): the second item is the mixture-of-experts
        layers' `moe.RouterStats` over the real tokens instead (E = 0 without experts).
        record_routing (a model with experts; not with router_stats): a third item, the experts
        each token ran in each sparse layer, int32[B,T,S,k] (S = the sparse layers, in order;
        what routing replay records): every layer then runs every token, last_only included.

        Any padding: each row's real tokens are moved to its front (`compaction`), the layers run
        on right-padded rows (the layout every attention form takes), and the hidden states and
        keys/values are put back in the input's slots. last_only: the hidden state of each row's
        last real token only, [B,1,D] (a prefill). The last layer then computes its keys and
        values for every slot but its attention, output projection and MLP for that token alone,
        which is all it depends on."""
        c = self.config
        dest, lengths = compaction(attention_mask)
        b, t = tokens.shape
        cos, sin = rope_tables(c, jnp.arange(t, dtype=jnp.int32)[None], t)
        local = self.local_rope(jnp.arange(t, dtype=jnp.int32)[None], t)  # None without sliding windows
        window = c.sliding_window if local is not None else None

        def attend(q, k, v, window=None):
            out = attention_lib.attention(q, k, v, lengths, causal=True, impl=c.attention, window=window)
            return out, ((k, v) if return_kv else None)

        last = jnp.maximum(lengths - 1, 0)[:, None, None]  # [B,1,1]: the last real token's slot

        def pick_last(a: jax.Array) -> jax.Array:
            return jnp.take_along_axis(a, last.reshape((b, 1) + (1,) * (a.ndim - 2)), axis=1)

        def attend_last(q, k, v):
            out = attention_lib.attention(pick_last(q), k, v, lengths, causal=False, impl=c.attention)
            return out, ((k, v) if return_kv else None)

        layer_def, layer_state = nnx.split(self.layers)
        unroll = c.num_layers <= UNROLL_MAX_LAYERS
        x = self.embed_tokens(compact_rows(tokens, dest))
        xs = self.layer_xs(layer_state)
        if record_routing and (router_stats or not c.is_moe):
            raise JmarlError("Transformer.hidden: record_routing is for a model with experts, without router_stats")
        if not last_only and not return_kv and not record_routing:  # the differentiated path: layers rematerialised as configured
            stats = router_stats and c.is_moe
            step = functools.partial(decoder_step, layer_def, c.attention, window=window, stats=stats)
            consts = (cos, sin, lengths) if local is None else (cos, sin, lengths, local)
            carry = (x, moe_lib.RouterStats.zeros(c.num_experts)) if stats else x
            carry = scan_layers(step, carry, xs, consts, remat=c.remat, policy=c.remat_policy(), unroll=unroll)
            x, aux = carry if stats else (carry, empty_router_stats(router_stats))
            return restore_rows(self.final_norm(x), dest), aux
        if router_stats:
            raise JmarlError("Transformer.hidden: router_stats is for the scoring path (no return_kv / last_only)")

        def body(x, xs_i):
            state, flags = split_xs(xs_i)
            cos_i, sin_i, window_i = layer_kind(flags, cos, sin, local, window)
            attend_i = attend if window_i is None else functools.partial(attend, window=window_i)
            layer = nnx.merge(layer_def, state)
            x, kv, _, experts = layer.run(batch_sharded(x), cos_i, sin_i, attend_i, sparse=flags.get("sparse"),
                                          record=record_routing)
            return x, ((kv, experts) if record_routing else kv)

        if not last_only or local is not None or record_routing:
            # (with sliding windows, or recording each token's experts, a prefill runs every layer
            # on every token, then keeps the last)
            x, kv = jax.lax.scan(body, x, xs, unroll=unroll)
            kv, experts = kv if record_routing else (kv, None)
            kv = None if kv is None else jax.tree.map(lambda a: restore_rows(a, dest, axis=2), kv)
            h = self.final_norm(pick_last(x)) if last_only else restore_rows(self.final_norm(x), dest)
            if not record_routing:
                return h, kv
            # [L, B, T, k] in compacted slots -> the input's slots, the sparse layers' -> [B, T, S, k]
            experts = restore_rows(experts, dest, axis=2)[np.flatnonzero(c.sparse_layers())]
            return h, kv, jnp.moveaxis(experts, 0, 2)
        def body_at(x, i):  # layer i read from the stack in the loop: no copy of the first L-1 layers
            return body(x, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs))

        x, kv = jax.lax.scan(body_at, x, jnp.arange(c.num_layers - 1), unroll=unroll)
        last_layer = nnx.merge(layer_def, jax.tree.map(lambda a: a[-1], layer_state))
        x, kv_last = last_layer(batch_sharded(x), cos, sin, attend_last, pick_last, sparse=c.sparse_layers()[-1])
        if return_kv:
            kv = jax.tree.map(lambda a, b: restore_rows(jnp.concatenate([a, b[None]]), dest, axis=2), kv, kv_last)
        return self.final_norm(x), kv

    def hidden_packed(self, tokens: jax.Array, positions: jax.Array, segment: jax.Array, branch: jax.Array, *,
                      router_stats: bool = False, routing: jax.Array | None = None
                      ) -> jax.Array | tuple[jax.Array, moe_lib.RouterStats]:
        """Packed rows -> final-normed hidden [R,T,D]. tokens, positions (each token's place in
        its own sequence, for RoPE), segment and branch int[R,T] as `attention.packed_attention`
        takes them: a prompt's tokens run once, and each of its continuations attends to them
        and to itself, as if every continuation ran after its own copy of the prompt.
        router_stats: (hidden, the `moe.RouterStats` over the slots of segment != 0, each prompt
        counted once). routing: recorded expert ids [R,T,S,k] of the S sparse layers
        (`moe.routing_dtype`, `moe.no_route` where a slot has none): routing replay, each sparse
        layer runs a slot's recorded experts (`SparseMLP`)."""
        c = self.config
        t = tokens.shape[1]
        positions = positions.astype(jnp.int32)
        cos, sin = rope_tables(c, positions, t)
        layer_def, layer_state = nnx.split(self.layers)
        local = self.local_rope(positions, t)
        window = c.sliding_window if local is not None else None
        stats = router_stats and c.is_moe
        step = functools.partial(packed_step, layer_def, c.attention, window=window, stats=stats)
        consts = (cos, sin, segment, branch) if local is None else (cos, sin, segment, branch, local, positions)
        unroll = c.num_layers <= UNROLL_MAX_LAYERS
        x = self.embed_tokens(tokens)
        carry = (x, moe_lib.RouterStats.zeros(c.num_experts)) if stats else x
        carry = scan_layers(step, carry, self.layer_xs(layer_state, routing if c.is_moe else None), consts,
                            remat=c.remat, policy=c.remat_policy(), unroll=unroll)
        if not router_stats:
            return self.final_norm(carry)
        x, aux = carry if stats else (carry, empty_router_stats(True))
        return self.final_norm(x), aux


# ---------------------------------------------------------------------------------- helpers
def compaction(attention_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """mask bool[B,T] -> (dest int32[B,T], lengths int32[B]): the slot each token takes when
    each row's real tokens are moved, in order, to its front (padding after them), and the
    number of real tokens. A permutation of each row: attention over the compacted rows is the
    attention over the original ones, and their positions are the slots."""
    mask = attention_mask.astype(bool)
    real = jnp.cumsum(mask.astype(jnp.int32), axis=-1)
    lengths = real[:, -1]
    pads = jnp.cumsum((~mask).astype(jnp.int32), axis=-1)
    return jnp.where(mask, real - 1, lengths[:, None] + pads - 1), lengths


def compact_rows(tokens: jax.Array, dest: jax.Array) -> jax.Array:
    """tokens [B,T] moved to their compacted slots: out[b, dest[b, t]] = tokens[b, t]."""
    b = tokens.shape[0]
    return jnp.zeros_like(tokens).at[jnp.arange(b)[:, None], dest].set(tokens, unique_indices=True)


def restore_rows(x: jax.Array, dest: jax.Array, axis: int = 1) -> jax.Array:
    """A compacted array back in the input's slots: out[.., b, t, ..] = x[.., b, dest[b, t], ..],
    with B, T at axes axis-1, axis."""
    index = dest.reshape((1,) * (axis - 1) + dest.shape + (1,) * (x.ndim - axis - 1))
    return jnp.take_along_axis(x, index, axis=axis)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """int32[B,T]: index of each token among the real tokens of its row (0 on leading pads)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


@functools.lru_cache(maxsize=32)
def _skeleton(config: ModelConfig) -> tuple[Any, Any]:
    """(graphdef, abstract state) of a `Transformer` with this config; no arrays allocated."""
    abstract = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0)))
    return nnx.split(abstract)


def bind(config: ModelConfig, params: Params) -> Transformer:
    """The NNX `Transformer` holding `params` (use inside a trace; modules are not pytrees)."""
    graphdef, abstract = _skeleton(config)
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def param_shapes(config: ModelConfig) -> Params:
    """The params pytree of `jax.ShapeDtypeStruct`s for this config."""
    return nnx.to_pure_dict(_skeleton(config)[1])


# ---------------------------------------------------------------------------------- logical axes
# Logical axis names of every array the model defines, declared here once; callers hand them to
# `jmarl.sharding` (`param_specs(param_axes(config), ...)`, `cache_specs(cache_axes(cache), ...)`),
# whose `ShardingRules` map them to mesh axes (the dependency runs one way: models -> sharding).
# Parameters: `param_axes` (LoRA factors: `jmarl.sharding.specs.lora_axes` derives them from the
# kernel's). A stacked policy axis [P, ...] in front of any of them is "policy". Batch rows are the
# sharding layer's convention (`jmarl.sharding.rules.BATCH_AXES`), not declared here.
CACHE_KEY_AXES = ("batch", "kv_heads", "head_dim", "cache_len")  # KVCache.keys[i] [B, KV, hd, C]
CACHE_VALUE_AXES = ("batch", "kv_heads", "cache_len", "head_dim")  # KVCache.values[i] [B, KV, C, hd]


def _linear_axes(d_in: str, d_out: str, bias: str | None) -> dict[str, tuple[str, ...]]:
    """kernel [in, out] (+ bias [out] named `bias` when there is one)."""
    return {"kernel": (d_in, d_out), **({} if bias is None else {"bias": (bias,)})}


def param_axes(config: ModelConfig) -> dict[str, Any]:
    """The logical axis names of every parameter: the tree of `param_shapes(config)` with, in
    place of each array, a tuple of one name per axis (the stacked layer axis is "layers").

        embed/embedding [V, D]                ("vocab", "embed")
        attn/{q,k,v}_proj/kernel [D, Hq|Hkv]  ("embed", "q_heads"|"kv_heads"); bias ("q_heads"|"kv_heads",)
        attn/o_proj/kernel [Hq, D]            ("q_heads", "embed");              bias ("embed_bias",)
        mlp/{gate,up}_proj/kernel [D, F]      ("embed", "mlp");  mlp/down_proj/kernel ("mlp", "embed")
        moe/router/kernel [D, E]              ("embed", "expert")
        moe/experts/{gate,up}_proj [E, D, Fe] ("expert", "embed", "mlp");  down_proj ("expert", "mlp", "embed")
        lm_head/kernel [D, V]                 ("embed", "vocab")
        */scale (RMSNorms, q/k norms)         ("norm",)
    """
    c = config
    in_bias = c.qkv_bias or c.o_bias
    attn: dict[str, Any] = {
        "q_proj": _linear_axes("embed", "q_heads", "q_heads" if in_bias else None),
        "k_proj": _linear_axes("embed", "kv_heads", "kv_heads" if in_bias else None),
        "v_proj": _linear_axes("embed", "kv_heads", "kv_heads" if in_bias else None),
        "o_proj": _linear_axes("q_heads", "embed", "embed_bias" if c.o_bias else None),
    }
    if c.qk_norm:
        attn.update(q_norm={"scale": ("norm",)}, k_norm={"scale": ("norm",)})
    layer: dict[str, Any] = {"attn_norm": {"scale": ("norm",)}, "attn": attn, "mlp_norm": {"scale": ("norm",)}}
    kinds = c.sparse_layers()
    if not all(kinds):
        layer["mlp"] = {
            "gate_proj": _linear_axes("embed", "mlp", None),
            "up_proj": _linear_axes("embed", "mlp", None),
            "down_proj": _linear_axes("mlp", "embed", None),
        }
    if any(kinds):
        layer["moe"] = {
            "router": _linear_axes("embed", "expert", None),
            "experts": {"gate_proj": ("expert", "embed", "mlp"), "up_proj": ("expert", "embed", "mlp"),
                        "down_proj": ("expert", "mlp", "embed")},
        }
    if c.is_gemma3:
        layer.update(attn_post_norm={"scale": ("norm",)}, mlp_post_norm={"scale": ("norm",)})
    tree: dict[str, Any] = {
        "embed": {"embedding": ("vocab", "embed")},
        "layers": jax.tree.map(lambda axes: ("layers",) + axes, layer, is_leaf=is_axes),
        "final_norm": {"scale": ("norm",)},
    }
    if not c.tie_word_embeddings:
        tree["lm_head"] = _linear_axes("embed", "vocab", None)
    return tree


def cache_axes(cache: KVCache, *, stacked: bool = False) -> KVCache:
    """A `KVCache` of logical axis tuples, one per buffer of `cache` (keys [(P,) B, KV, hd, C],
    values [(P,) B, KV, C, hd]; "policy" in front when `stacked`)."""
    lead = ("policy",) if stacked else ()
    return KVCache(keys=tuple(lead + CACHE_KEY_AXES for _ in cache.keys),
                   values=tuple(lead + CACHE_VALUE_AXES for _ in cache.values))


# ---------------------------------------------------------------------------------- public API
def init(config: ModelConfig, rng: jax.Array) -> Params:
    """Random parameters (normal(0, 0.02) weights, unit norm scales, zero biases) as a dict. A
    model that mixes dense and mixture-of-experts layers gets zeros in each layer's unused
    feed-forward (`unused_mlps_zeroed`)."""
    model = Transformer(config, nnx.Rngs(params=rng))
    return unused_mlps_zeroed(config, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def unused_mlps_zeroed(config: ModelConfig, params: Params) -> Params:
    """params with the feed-forward a layer does not run set to zeros: the experts of the dense
    layers and the dense MLP of the sparse ones, when the model mixes both (`has_mixed_mlps`);
    params unchanged otherwise. Those slots are never read (their gradient is zero)."""
    if not config.has_mixed_mlps:
        return params
    sparse = np.array(config.sparse_layers())

    def zeroed(tree: Any, keep: np.ndarray) -> Any:
        return jax.tree.map(lambda a: a * jnp.asarray(keep, a.dtype).reshape((-1,) + (1,) * (a.ndim - 1)), tree)

    layers = dict(params["layers"], mlp=zeroed(params["layers"]["mlp"], ~sparse),
                  moe=zeroed(params["layers"]["moe"], sparse))
    return {**params, "layers": layers}


def apply(config: ModelConfig, params: Params, tokens: jax.Array, attention_mask: jax.Array, *,
          with_router_stats: bool = False) -> jax.Array | tuple[jax.Array, moe_lib.RouterStats]:
    """Logits float32[B,T,V] for tokens int[B,T] with attention_mask bool[B,T] (any padding side).
    with_router_stats: (logits, `moe.RouterStats` of the mixture-of-experts layers over the real
    tokens; `moe.load_balancing_loss` of it is transformers' aux_loss)."""
    model = bind(config, params)
    h, stats = model.hidden(tokens, attention_mask, router_stats=with_router_stats)
    return (model.logits(h), stats) if with_router_stats else model.logits(h)


def expert_routing(config: ModelConfig, params: Params, tokens: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """int32[B,T,S,k]: the experts each token of tokens int[B,T] (attention_mask bool[B,T], any
    padding side) is routed to in each of the S sparse layers of a plain forward (the router's
    top k, as `apply` runs them): what the sampler records for routing replay."""
    if not config.is_moe:
        raise JmarlError(f"expert_routing: model_type {config.model_type!r} has no mixture-of-experts layer")
    return bind(config, params).hidden(tokens, attention_mask, record_routing=True)[2]
