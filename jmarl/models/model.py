"""One decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 3) in Flax NNX, behind a pure API.

The NNX modules below define the network; the public functions (`init`, `apply`,
`token_logprobs`, and the KV-cache pair `prefill` / `decode_step` of `jmarl.models.decode`) take
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

LoRA runs unmerged: an adapted kernel's slot may hold a `LoraKernel` (base W, adapter A, B and
scale s; `jmarl.train.lora.attach_lora`), and every product with it is x W + s (x A) B, the
frozen W read in place and never copied per adapter. Plain kernels run the same program as before.

Decoder layers are stacked on a leading axis and run with `jax.lax.scan` (unrolled for shallow
models, rolled beyond `_UNROLL_MAX_LAYERS` so compile time does not grow with depth);
`config.remat` wraps each layer in `jax.checkpoint` with its policy. Dense layers multiply 2-D [rows, D] views.
Token positions are `cumsum(attention_mask) - 1`, so left- and right-padded batches are exact.

Gemma 3 (`config.is_gemma3`): embeddings times sqrt(D) (in the compute dtype), RMSNorms
x * (1 + w) (scales initialised to 0), "sandwich" norms (input, post-attention, pre- and
post-feed-forward), a GeGLU MLP (tanh GELU), q/k norms, scores scaled by
query_pre_attn_scalar ** -0.5 (a factor on the queries when it is not head_dim). Sliding-window
layers: the layer scan carries a per-layer flag beside each layer's parameters (`_layer_kind`),
which picks that layer's window (W, or `attention.NO_WINDOW`) and RoPE tables (local theta, or
the global one); the decode step's Python loop over layers (`jmarl.models.decode`) picks them
statically.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jmarl.errors import JmarlError
from jmarl.models import attention as attention_lib
from jmarl.models import moe as moe_lib
from jmarl.models.config import ModelConfig
from jmarl.models.kv_cache import KVCache
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules, is_axes

Params = dict[str, Any]
# Models with at most this many layers run them as straight-line code (`scan(unroll=True)`):
# no stacked per-layer residual buffers to zero-fill and copy (~10% of a CPU train step at
# 4 layers). Deeper models keep the rolled scan, so their compile time stays flat in depth.
_UNROLL_MAX_LAYERS = 8
# Elements of one [tokens, intermediate] block of the feed-forward layer above which it runs in
# chunks of tokens (see `MLP`): 4,096 tokens at Qwen3-1.7B's 6,144; tiny models never chunk.
MLP_CHUNK_ELEMENTS = 4096 * 6144
# Upper bound on the elements of one fp32 [B, chunk, V] logits block in `token_logprobs`.
_LOGPROB_CHUNK_ELEMENTS = 1 << 24

# attend(q [B,T,H,hd], k [B,T,KV,hd], v [B,T,KV,hd]) -> (out [B,T,H,hd], aux)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


# ---------------------------------------------------------------------------------- modules
def _normal(stddev: float = 0.02):
    return nnx.initializers.normal(stddev)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis, computed in float32 (as HF does).

    unit_offset (Gemma): x / rms(x) * (1 + scale), the product in float32 too and cast last (as
    HF's Gemma3RMSNorm), the scale initialised to 0."""

    def __init__(self, dim: int, eps: float, param_dtype: Any, unit_offset: bool = False):
        self.scale = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), param_dtype))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def _norm(c: ModelConfig, dim: int) -> RMSNorm:
    """The config's RMSNorm over `dim` (Gemma's 1 + w form for gemma3_text)."""
    return RMSNorm(dim, c.rms_norm_eps, jnp.dtype(c.param_dtype), unit_offset=c.is_gemma3)


@struct.dataclass
class LoraKernel:
    """A projection kernel run with a low-rank adapter, unmerged: x -> x W + scale * (x A) B.

    w [..., in, out]: the frozen base kernel (any float dtype; no gradient flows to it);
    a [..., in, r], b [..., r, out]: the adapter (float32 when trained); scale = alpha / r
    (static). Leading axes (the stacked layer axis L, a policy axis) are shared by w, a and b,
    except that a policy axis may be on a and b alone (one base for every adapter). It sits in
    the params tree where the kernel sits, so the layer scan and the decode loop slice it like
    any kernel."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """The base kernel's shape [..., in, out]."""
        return self.w.shape

    @property
    def dtype(self) -> Any:
        """The base kernel's dtype."""
        return self.w.dtype

    def __getitem__(self, index: Any) -> "LoraKernel":
        """`kernel[...]` (how NNX reads a parameter): itself; other indices index w, a and b alike."""
        return self if index is Ellipsis else jax.tree.map(lambda x: x[index], self)


def is_lora(x: Any) -> bool:
    """Whether `x` is a `LoraKernel` (an `is_leaf` for tree maps that stop at one)."""
    return isinstance(x, LoraKernel)


def cast_kernel(kernel: jax.Array | LoraKernel, dtype: Any) -> jax.Array | LoraKernel:
    """A kernel [in, out] (an array, or a `LoraKernel` whose w, a and b are each cast, w's
    gradient stopped: the base is frozen) in `dtype`."""
    if is_lora(kernel):
        return LoraKernel(jax.lax.stop_gradient(kernel.w).astype(dtype), kernel.a.astype(dtype),
                          kernel.b.astype(dtype), kernel.scale)
    return kernel.astype(dtype)


def dense(x: jax.Array, kernel: jax.Array | LoraKernel, preferred_element_type: Any = None) -> jax.Array:
    """x [..., in] @ kernel [in, out] -> [..., out], operands in the compute dtype (`cast_kernel`).
    A `LoraKernel`: x W + scale * (x A) B, the low-rank path through the [..., r] product x A
    (W + scale A B is never formed)."""
    if not is_lora(kernel):
        return jnp.dot(x, kernel, preferred_element_type=preferred_element_type)
    low = jnp.dot(x, kernel.a) * kernel.scale  # [..., r], in x's dtype
    return (jnp.dot(x, kernel.w, preferred_element_type=preferred_element_type)
            + jnp.dot(low, kernel.b, preferred_element_type=preferred_element_type))


class Linear(nnx.Linear):
    """`nnx.Linear` that multiplies a 2-D view of its input: x [..., d_in] -> [..., d_out].

    Flattening the leading axes first gives XLA one plain [rows, d_in] x [d_in, d_out] matrix
    product whose weight gradient X^T dY needs no transposed copy of a 3-D activation (on CPU
    that copy cost more than the product itself)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:-1]
        if is_lora(self.kernel.get_raw_value()):
            y = self._lora(x.reshape(-1, x.shape[-1]))
        else:
            y = super().__call__(x.reshape(-1, x.shape[-1]))
        return y.reshape(*lead, y.shape[-1])

    def _lora(self, x: jax.Array) -> jax.Array:
        """x [rows, in] -> [rows, out] through a `LoraKernel`: x W + scale (x A) B (+ bias), in
        the layer's compute dtype."""
        dtype = self.dtype or x.dtype
        x = x.astype(dtype)
        y = dense(x, cast_kernel(self.kernel[...], dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)[None, :]
        return y


def _linear(c: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs) -> Linear:
    return Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=jnp.dtype(c.compute_dtype),
        param_dtype=jnp.dtype(c.param_dtype),
        kernel_init=_normal(),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE (+ Qwen2 q/k/v biases, + Qwen3 / Gemma 3 q/k RMSNorm,
    + Gemma 3's query_pre_attn_scalar as a factor on the rotated queries)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        hq, hkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        in_bias = c.qkv_bias or c.o_bias
        self.q_proj = _linear(c, c.hidden_size, hq, in_bias, rngs)
        self.k_proj = _linear(c, c.hidden_size, hkv, in_bias, rngs)
        self.v_proj = _linear(c, c.hidden_size, hkv, in_bias, rngs)
        self.o_proj = _linear(c, hq, c.hidden_size, c.o_bias, rngs)
        self.q_norm = _norm(c, c.head_dim) if c.qk_norm else None
        self.k_norm = _norm(c, c.head_dim) if c.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        # every attention form scales by head_dim ** -0.5: this factor makes it query_pre_attn_scalar ** -0.5
        self.q_factor = c.attention_scale_factor()

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, attend: AttendFn):
        """x [B,T,D], cos/sin [B,T,hd] -> (out [B,T,D], whatever `attend` returns beside)."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.q_factor is not None:
            q = q * jnp.asarray(self.q_factor, q.dtype)
        out, aux = attend(q, k, v)  # out [B, T', H, hd]: T' = T, or fewer (the last) queries
        return self.o_proj(out.reshape(b, out.shape[1], self.num_heads * self.head_dim)), aux


def _activation(name: str, x: jax.Array) -> jax.Array:
    """The gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU, HF gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True) if name == "gelu_tanh" else jax.nn.silu(x)


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act silu (SwiGLU) or tanh GELU (Gemma's GeGLU).

    When its [tokens, F] intermediates exceed MLP_CHUNK_ELEMENTS it runs MLP_CHUNK_ELEMENTS / F
    tokens at a time, in chunks of the token axis (`jax.lax.map` under `jax.checkpoint`): the
    same numbers, but only one chunk's intermediates are alive, in the forward pass and the
    gradient (at 64k tokens and F = 6144 those are 0.75 GiB each)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.gate_proj = _linear(c, c.hidden_size, c.intermediate_size, False, rngs)
        self.up_proj = _linear(c, c.hidden_size, c.intermediate_size, False, rngs)
        self.down_proj = _linear(c, c.intermediate_size, c.hidden_size, False, rngs)
        self.activation = "gelu_tanh" if c.is_gemma3 else "silu"

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B,T,D] (or [T,D]) -> [B,T,D]."""
        rows = int(np.prod(x.shape[:-1]))
        chunk_rows = max(MLP_CHUNK_ELEMENTS // self.gate_proj.out_features, 1)
        if rows <= chunk_rows or x.ndim < 3:
            return self.down_proj(_activation(self.activation, self.gate_proj(x)) * self.up_proj(x))
        # chunks along the token axis: the batch axis (sharded over the mesh) stays whole in each
        # chunk, so every device keeps its own rows
        b, t, d = x.shape
        n = min(t, -(-rows // chunk_rows))
        size = -(-t // n)
        weights = (self.gate_proj.kernel[...], self.up_proj.kernel[...], self.down_proj.kernel[...])
        dtype, activation = self.gate_proj.dtype, self.activation
        chunks = jnp.pad(x, ((0, 0), (0, n * size - t), (0, 0))).reshape(b, n, size, d).swapaxes(0, 1)

        @jax.checkpoint
        def chunk(x_c: jax.Array) -> jax.Array:  # [B, size, D]
            gate, up, down = (cast_kernel(w, dtype) for w in weights)
            x_c = x_c.astype(dtype)
            return dense(_activation(activation, dense(x_c, gate)) * dense(x_c, up), down)

        out = jax.lax.map(chunk, chunks)  # [n, B, size, D]
        return out.swapaxes(0, 1).reshape(b, n * size, -1)[:, :t]


class Experts(nnx.Module):
    """E SwiGLU experts, their weights stacked on a leading expert axis: gate_proj, up_proj
    [E, D, Fe] and down_proj [E, Fe, D] (plain parameters, not `Linear`s: LoRA does not adapt
    them). Called on the routed tokens (`moe.expert_parallel_ffn`: `moe.expert_ffn`, or with the
    experts split over the mesh's expert axes, tokens dispatched to them)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        init, dtype = _normal(), jnp.dtype(c.param_dtype)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), dtype))
        self.dtype = jnp.dtype(c.compute_dtype)

    def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        """x [N,D], experts int32[N,k], weights [N,k] -> [N,D] in the compute dtype."""
        gate, up, down = (w[...].astype(self.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        return moe_lib.expert_parallel_ffn(x.astype(self.dtype), experts, weights, gate, up, down)


class SparseMLP(nnx.Module):
    """Qwen3-MoE's sparse feed-forward (transformers' Qwen3MoeSparseMoeBlock): a router [D, E]
    picks each token's top-k experts (`moe.route`), whose SwiGLU outputs are summed with the
    routing weights (`moe.expert_ffn`). No shared expert. Routing replay: given a token's
    recorded experts, it runs those instead, weighted by its own router (`moe.replay_route`)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.router = _linear(c, c.hidden_size, c.num_experts, False, rngs)
        self.experts = Experts(c, rngs)
        self.top_k, self.normalize = c.num_experts_per_tok, c.norm_topk_prob

    def __call__(self, x: jax.Array, valid: jax.Array | None = None, replay: jax.Array | None = None
                 ) -> tuple[jax.Array, moe_lib.RouterStats | None, jax.Array]:
        """x [..., D] -> (out [..., D], the layer's `RouterStats` over the tokens where valid
        bool[...] is True or None when valid is None, the experts each token ran int32[..., k]).
        replay: recorded expert ids [..., k] (`moe.routing_dtype`; `moe.no_route` where a token
        has none): those tokens run their recorded experts (`moe.replay_route`) and the stats
        count where the router's own top k differs."""
        rows = x.reshape(-1, x.shape[-1])
        logits = self.router(rows)
        replayed = None
        if replay is None:
            probs, weights, experts = moe_lib.route(logits, self.top_k, self.normalize)
        else:
            probs, weights, experts, own, has = moe_lib.replay_route(
                logits, replay.reshape(-1, self.top_k), self.top_k, self.normalize)
            replayed = (own, has)
        out = self.experts(rows, experts, weights).reshape(x.shape)
        stats = None if valid is None else moe_lib.router_stats(probs, experts, valid, replayed)
        return out, stats, experts.reshape(x.shape[:-1] + (self.top_k,))


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). Gemma 3 adds a norm on each
    branch's output: x + post(attn(norm(x))), then x + post(mlp(norm(x))). Qwen3-MoE's sparse
    layers run `SparseMLP` (`moe`) in place of the dense `mlp`; a model that mixes both kinds
    holds both in every layer and is told which runs (`sparse`)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        kinds = c.sparse_layers()
        self.attn_norm = _norm(c, c.hidden_size)
        self.attn = Attention(c, rngs)
        self.mlp_norm = _norm(c, c.hidden_size)
        self.mlp = None if all(kinds) else MLP(c, rngs)
        self.moe = SparseMLP(c, rngs) if any(kinds) else None
        self.num_experts = c.num_experts
        self.attn_post_norm = _norm(c, c.hidden_size) if c.is_gemma3 else None
        self.mlp_post_norm = _norm(c, c.hidden_size) if c.is_gemma3 else None

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, attend: AttendFn,
                 pick: Callable[[jax.Array], jax.Array] | None = None, *,
                 sparse: bool | jax.Array | None = None):
        """x [B,T,D] -> (x [B,T',D], aux from `attend`). T' = T unless `attend` answers only some
        queries (a prefill's last layer): `pick` then selects the same slots of the residual
        stream [B,T,D] -> [B,T',D], and the rest of the layer runs on those only. `sparse`: see
        `feed_forward`."""
        x, aux, _, _ = self.run(x, cos, sin, attend, pick, sparse=sparse)
        return x, aux

    def run(self, x: jax.Array, cos: jax.Array, sin: jax.Array, attend: AttendFn,
            pick: Callable[[jax.Array], jax.Array] | None = None, *,
            sparse: bool | jax.Array | None = None, valid: jax.Array | None = None,
            replay: jax.Array | None = None, record: bool = False):
        """`__call__` that also returns the layer's `RouterStats` over the tokens where valid
        bool[B,T] is True and, with `record`, the experts each token ran: (x, aux, stats,
        experts); stats is None when valid is None or the model has no experts, zeros for a
        dense layer of a mixed model; experts int32[B,T',k] (zeros for a dense layer of a mixed
        model), None without `record` or experts. replay: recorded expert ids [B,T,k] the layer
        runs instead of its top k (`SparseMLP`; ignored by a dense layer)."""
        h, aux = self.attn(self.attn_norm(x), cos, sin, attend)
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        x = (x if pick is None else pick(x)) + h
        m, stats, experts = self.feed_forward(self.mlp_norm(x), sparse, valid, replay, record)
        if self.mlp_post_norm is not None:
            m = self.mlp_post_norm(m)
        return x + m, aux, stats, experts

    def feed_forward(self, x: jax.Array, sparse: bool | jax.Array | None = None, valid: jax.Array | None = None,
                     replay: jax.Array | None = None, record: bool = False
                     ) -> tuple[jax.Array, moe_lib.RouterStats | None, jax.Array | None]:
        """x [B,T,D] -> (the dense MLP's or the experts' output [B,T,D], `RouterStats` or None,
        with `record` the experts each token ran int32[B,T,k], zeros from a dense layer of a
        mixed model; else None, as without experts: no such output in the program). A layer
        holding both (a mixed model) runs the experts where
        `sparse` is True: a Python bool picks statically, a traced bool / int scalar (the layer
        scan's flag) through `jax.lax.cond`. Without `sparse` (a caller that does not know the
        layer's kind) it runs both and adds them: the unused one is zeros (`init`, `load_hf`
        and training keep it so: it gets no gradient), whose output is exactly 0, so the sum is
        the used one's output; router stats then need `sparse`. replay: see `SparseMLP`."""
        if self.moe is None:
            return self.mlp(x), None, None

        def sparse_ff(x: jax.Array) -> tuple[jax.Array, moe_lib.RouterStats | None, jax.Array | None]:
            out, stats, experts = self.moe(x, valid, replay)
            return out, stats, (experts if record else None)

        if self.mlp is None:
            return sparse_ff(x)
        if sparse is None:
            if valid is not None:
                raise JmarlError("DecoderLayer.feed_forward: router stats of a model that mixes dense and "
                                 "mixture-of-experts layers need the layer's kind (sparse=...)")
            out, _, experts = sparse_ff(x)
            return self.mlp(x) + out, None, experts

        def dense(x: jax.Array) -> tuple[jax.Array, moe_lib.RouterStats | None, jax.Array | None]:
            stats = None if valid is None else moe_lib.RouterStats.zeros(self.num_experts)
            return self.mlp(x), stats, (jnp.zeros(x.shape[:-1] + (self.moe.top_k,), jnp.int32) if record else None)

        if isinstance(sparse, (bool, np.bool_)):
            return sparse_ff(x) if sparse else dense(x)
        return jax.lax.cond(jnp.asarray(sparse) > 0, sparse_ff, dense, x)


class Transformer(nnx.Module):
    """Embedding, L stacked decoder layers (leading axis L), final norm, LM head."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.config = c
        self.embed = nnx.Embed(
            c.vocab_size,
            c.hidden_size,
            dtype=jnp.dtype(c.compute_dtype),
            param_dtype=jnp.dtype(c.param_dtype),
            embedding_init=_normal(),
            rngs=rngs,
        )

        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(layer_rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(c, layer_rngs)

        self.layers = make_layers(rngs)
        self.final_norm = _norm(c, c.hidden_size)
        self.lm_head = None if c.tie_word_embeddings else _linear(c, c.hidden_size, c.vocab_size, False, rngs)

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
        to each layer as "replay" [L, ..., k] (`per_layer_routing`). `_split_xs` unpacks one step's."""
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
        unroll = c.num_layers <= _UNROLL_MAX_LAYERS
        x = self.embed_tokens(compact_rows(tokens, dest))
        xs = self.layer_xs(layer_state)
        if record_routing and (router_stats or not c.is_moe):
            raise JmarlError("Transformer.hidden: record_routing is for a model with experts, without router_stats")
        if not last_only and not return_kv and not record_routing:  # the differentiated path: layers rematerialised as configured
            stats = router_stats and c.is_moe
            step = functools.partial(_decoder_step, layer_def, c.attention, window=window, stats=stats)
            consts = (cos, sin, lengths) if local is None else (cos, sin, lengths, local)
            carry = (x, moe_lib.RouterStats.zeros(c.num_experts)) if stats else x
            carry = scan_layers(step, carry, xs, consts, remat=c.remat, policy=c.remat_policy(), unroll=unroll)
            x, aux = carry if stats else (carry, _empty_router_stats(router_stats))
            return restore_rows(self.final_norm(x), dest), aux
        if router_stats:
            raise JmarlError("Transformer.hidden: router_stats is for the scoring path (no return_kv / last_only)")

        def body(x, xs_i):
            state, flags = _split_xs(xs_i)
            cos_i, sin_i, window_i = _layer_kind(flags, cos, sin, local, window)
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

    def hidden_prefixed(
        self, prefix_tokens: jax.Array, prefix_mask: jax.Array, rows: jax.Array, tokens: jax.Array, mask: jax.Array,
        *, router_stats: bool = False,
    ) -> tuple[jax.Array, ...]:
        """Shared prefixes [U,P] (any padding), rows int[N] into them, continuations [N,C] (any
        padding) -> (final-normed hidden of each prefix's last real token [U,D], final-normed
        hidden of the continuations [N,C,D]). Each layer runs the U prefixes, then the N
        continuations attending to their prefix's keys/values (read in place through `rows`,
        never copied per row) and to themselves (causally). router_stats: a third item, the
        `moe.RouterStats` over the real tokens (each prefix counted once)."""
        c = self.config
        p, t = prefix_tokens.shape[1], tokens.shape[1]
        if c.window_exceeded(p + t):
            raise JmarlError(
                f"the shared-prefix layout does not implement sliding-window attention: prefixes of {p} plus "
                f"continuations of {t} slots exceed sliding_window={c.sliding_window}; score these sequences with "
                "token_logprobs or the packed layout (packed_token_logprobs), which are exact"
            )
        p_dest, prefix_len = compaction(prefix_mask)
        s_dest, own_len = compaction(mask)
        p_positions = jnp.arange(p, dtype=jnp.int32)[None]
        p_cos, p_sin = rope_tables(c, p_positions, p)
        s_positions = prefix_len[rows][:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        s_cos, s_sin = rope_tables(c, s_positions, p + t)

        layer_def, layer_state = nnx.split(self.layers)
        stats = router_stats and c.is_moe
        step = functools.partial(_prefixed_step, layer_def, c.attention, stats=stats)
        consts = (p_cos, p_sin, s_cos, s_sin, prefix_len, own_len, rows.astype(jnp.int32))
        if c.has_sliding_window:  # no window to apply (checked above), only the local layers' RoPE
            consts = consts + (self.local_rope(p_positions, p) + self.local_rope(s_positions, p + t),)
        carry = (self.embed_tokens(compact_rows(prefix_tokens, p_dest)), self.embed_tokens(compact_rows(tokens, s_dest)))
        if stats:
            carry = carry + (moe_lib.RouterStats.zeros(c.num_experts),)
        unroll = c.num_layers <= _UNROLL_MAX_LAYERS
        carry = scan_layers(step, carry, self.layer_xs(layer_state), consts, remat=c.remat, policy=c.remat_policy(),
                            unroll=unroll)
        xp, xs = carry[:2]
        last = jnp.maximum(prefix_len - 1, 0)[:, None, None]
        xp_last = jnp.take_along_axis(xp, last, axis=1)[:, 0]
        out = (self.final_norm(xp_last), restore_rows(self.final_norm(xs), s_dest))
        if not router_stats:
            return out
        return out + (carry[2] if stats else _empty_router_stats(True),)


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
        step = functools.partial(_packed_step, layer_def, c.attention, window=window, stats=stats)
        consts = (cos, sin, segment, branch) if local is None else (cos, sin, segment, branch, local, positions)
        unroll = c.num_layers <= _UNROLL_MAX_LAYERS
        x = self.embed_tokens(tokens)
        carry = (x, moe_lib.RouterStats.zeros(c.num_experts)) if stats else x
        carry = scan_layers(step, carry, self.layer_xs(layer_state, routing if c.is_moe else None), consts,
                            remat=c.remat, policy=c.remat_policy(), unroll=unroll)
        if not router_stats:
            return self.final_norm(carry)
        x, aux = carry if stats else (carry, _empty_router_stats(True))
        return self.final_norm(x), aux


# ---------------------------------------------------------------------------------- layer stack
def _split_xs(xs: Any) -> tuple[Any, dict[str, jax.Array]]:
    """One scan step's slice of `Transformer.layer_xs`: (layer state, per-layer flags; {} when
    the layers do not differ)."""
    return xs if isinstance(xs, tuple) else (xs, {})


def _layer_kind(flags: dict[str, jax.Array], cos: jax.Array, sin: jax.Array,
                local: tuple[jax.Array, jax.Array] | None, window: int | None
                ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One scanned layer's (cos, sin, window). Without sliding windows (local None) the tables
    as given and no window. With them, local is the sliding layers' (cos, sin) and
    flags["sliding"] says whether this layer is one: a flagged layer takes those and `window`,
    the others the global tables and `attention.NO_WINDOW` (traced, so one rolled scan serves
    both kinds)."""
    if local is None:
        return cos, sin, None
    on = flags["sliding"] > 0
    window_i = jnp.where(on, jnp.int32(window), jnp.int32(attention_lib.NO_WINDOW))
    return jnp.where(on, local[0], cos), jnp.where(on, local[1], sin), window_i


def _empty_router_stats(wanted: bool) -> moe_lib.RouterStats | None:
    """What a forward without experts answers for its router stats: empty ones (E = 0, a loss of
    0) when they were asked for, else None."""
    return moe_lib.RouterStats.zeros(0) if wanted else None


def _run_layer(layer_def: Any, state: Any, flags: dict[str, jax.Array], x: jax.Array, cos: jax.Array,
               sin: jax.Array, attend: AttendFn, valid: jax.Array | None) -> tuple[jax.Array, Any, Any]:
    """One decoder layer (`DecoderLayer.run`) on x [B,T,D]: -> (x, attend's aux, router stats or
    None); `valid` bool[B,T] asks for the stats over those tokens; the layer's recorded expert
    ids flags["replay"] [B,T,k], when the scan carries them, are replayed (`SparseMLP`)."""
    layer = nnx.merge(layer_def, state)
    x, aux, stats, _ = layer.run(batch_sharded(x), cos, sin, attend, sparse=flags.get("sparse"), valid=valid,
                                 replay=flags.get("replay"))
    return x, aux, stats


def per_layer_routing(config: ModelConfig, routing: jax.Array) -> jax.Array:
    """Recorded expert ids [..., S, k] of the S sparse layers -> [L, ..., k], one slice per
    layer for the layer scan: sparse layer j's at its layer index; a dense layer of a mixed
    model gets a copy of a neighbour's, which it ignores."""
    sparse = np.array(config.sparse_layers())
    if sparse.all():
        return jnp.moveaxis(routing, -2, 0)
    index = np.maximum(np.cumsum(sparse) - 1, 0)  # layer i -> the sparse layers before it, counting itself
    return jnp.moveaxis(jnp.take(routing, jnp.asarray(index), axis=-2), -2, 0)


def _decoder_step(layer_def: Any, impl: str, carry: Any, xs: Any, consts: tuple,
                  window: int | None = None, stats: bool = False) -> Any:
    """One decoder layer on right-padded rows: x [B,T,D] -> [B,T,D]; consts = (cos, sin, lengths)
    (+ the sliding layers' (cos, sin) with sliding windows: `_layer_kind`). stats: the carry is
    (x, `moe.RouterStats`), the layer's stats over the real tokens added."""
    cos, sin, lengths = consts[:3]
    state, flags = _split_xs(xs)
    cos, sin, window_i = _layer_kind(flags, cos, sin, consts[3] if len(consts) > 3 else None, window)

    def attend(q, k, v):
        return attention_lib.attention(q, k, v, lengths, causal=True, impl=impl, window=window_i), None

    x, acc = carry if stats else (carry, None)
    valid = (jnp.arange(x.shape[1])[None] < lengths[:, None]) if stats else None
    x, _, layer_stats = _run_layer(layer_def, state, flags, x, cos, sin, attend, valid)
    return (x, acc.plus(layer_stats)) if stats else x


def _prefixed_step(layer_def: Any, impl: str, carry: tuple, xs: Any, consts: tuple, stats: bool = False) -> tuple:
    """One decoder layer of the shared-prefix layout: the U prefixes [U,P,D], then the N
    continuations [N,C,D] attending to their prefix's keys/values and to themselves. stats: the
    carry has a third item, the `moe.RouterStats` (prefixes and continuations added)."""
    p_cos, p_sin, s_cos, s_sin, prefix_len, own_len, rows = consts[:7]
    state, flags = _split_xs(xs)
    if len(consts) > 7:  # sliding-window layers: their own RoPE (no window: sequences within it)
        p_local, s_local = consts[7][:2], consts[7][2:]
        s_cos, s_sin, _ = _layer_kind(flags, s_cos, s_sin, s_local, 0)
        p_cos, p_sin, _ = _layer_kind(flags, p_cos, p_sin, p_local, 0)
    xp, xs_ = carry[0], carry[1]
    p_valid = (jnp.arange(xp.shape[1])[None] < prefix_len[:, None]) if stats else None
    s_valid = (jnp.arange(xs_.shape[1])[None] < own_len[:, None]) if stats else None

    def attend_prefix(q, k, v):
        return attention_lib.attention(q, k, v, prefix_len, causal=True, impl=impl), (k, v)

    xp, (kp, vp), p_stats = _run_layer(layer_def, state, flags, xp, p_cos, p_sin, attend_prefix, p_valid)

    def attend_continuation(q, k, v):
        return attention_lib.prefixed_attention(q, k, v, own_len, kp, vp, prefix_len, rows, impl=impl), None

    xs_, _, s_stats = _run_layer(layer_def, state, flags, xs_, s_cos, s_sin, attend_continuation, s_valid)
    if not stats:
        return xp, xs_
    return xp, xs_, carry[2].plus(p_stats).plus(s_stats)


def _packed_step(layer_def: Any, impl: str, carry: Any, xs: Any, consts: tuple,
                 window: int | None = None, stats: bool = False) -> Any:
    """One decoder layer on packed rows: x [R,T,D] -> [R,T,D]; consts = (cos, sin, segment, branch)
    (+ the sliding layers' (cos, sin) and the positions int[R,T] with sliding windows). stats:
    the carry is (x, `moe.RouterStats`), the layer's stats over the slots of segment != 0 added."""
    cos, sin, segment, branch = consts[:4]
    local, positions = consts[4:] if len(consts) > 4 else (None, None)
    state, flags = _split_xs(xs)
    cos, sin, window_i = _layer_kind(flags, cos, sin, local, window)

    def attend(q, k, v):
        return attention_lib.packed_attention(q, k, v, segment, branch, impl=impl, window=window_i,
                                              positions=positions), None

    x, acc = carry if stats else (carry, None)
    x, _, layer_stats = _run_layer(layer_def, state, flags, x, cos, sin, attend, (segment != 0) if stats else None)
    return (x, acc.plus(layer_stats)) if stats else x


def scan_layers(step: Callable, carry: Any, layers: Any, consts: Any, *, remat: str, policy: Any, unroll: bool) -> Any:
    """carry -> step(... step(step(carry, layers[0], consts), layers[1], consts) ...): the layer
    stack as one `jax.lax.scan` over the stacked layer parameters (leading axis L).

    remat "none": every activation kept for the backward pass; "full": only each layer's input
    kept, the layer recomputed in the backward pass (`_scan_full_remat`); other names: per-layer
    `jax.checkpoint` with `policy`."""
    if remat == "full":
        return _scan_full_remat(step, carry, layers, consts, unroll)
    body = lambda c, p: (step(c, p, consts), None)  # noqa: E731
    if remat != "none":
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, carry, layers, unroll=unroll)[0]


def _as_bits(x: jax.Array) -> jax.Array:
    """16-bit floats as their raw uint16 words (other arrays unchanged)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating) else x


def _from_bits(bits: jax.Array, like: jax.Array) -> jax.Array:
    """Inverse of `_as_bits` for an array of `like`'s dtype."""
    return jax.lax.bitcast_convert_type(bits, like.dtype) if bits.dtype == jnp.uint16 and like.dtype != jnp.uint16 else bits


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def _scan_full_remat(step: Callable, carry: Any, layers: Any, consts: Any, unroll: bool) -> Any:
    """`scan_layers` with full rematerialisation, its backward written out: the forward scan saves
    each layer's input, the reverse scan recomputes that layer (`jax.vjp`) and back-propagates.
    The saved inputs are kept as raw 16-bit words when they are bf16/f16: XLA:CPU, which has no
    bf16 arithmetic, would otherwise convert the whole [L, ...] stack of saved inputs to float32
    at once before the backward loop (2 x the stack's size more memory); accelerators are unaffected."""
    return jax.lax.scan(lambda c, p: (step(c, p, consts), None), carry, layers, unroll=unroll)[0]


def _scan_full_remat_fwd(step, carry, layers, consts, unroll):
    def body(c, p):
        return step(c, p, consts), jax.tree.map(_as_bits, c)

    out, saved = jax.lax.scan(body, carry, layers, unroll=unroll)
    return out, (saved, layers, consts)


def _scan_full_remat_bwd(step, unroll, residuals, d_out):
    saved, layers, consts = residuals
    if any(is_lora(x) for x in jax.tree.leaves(layers, is_leaf=is_lora)):
        return _scan_full_remat_bwd_lora(step, unroll, saved, layers, consts, d_out)

    def body(d_carry, xs):
        bits, p = xs
        c = jax.tree.map(_from_bits, bits, d_carry)
        _, vjp = jax.vjp(lambda c_, p_: step(c_, p_, consts), c, p)
        d_c, d_p = vjp(d_carry)
        return d_c, d_p

    d_carry, d_layers = jax.lax.scan(body, d_out, (saved, layers), reverse=True, unroll=unroll)
    return d_carry, d_layers, None


def _scan_full_remat_bwd_lora(step, unroll, saved, layers, consts, d_out):
    """`_scan_full_remat_bwd` for layers holding `LoraKernel`s: the reverse scan back-propagates
    to everything but their frozen bases, which get no cotangent (None: zero), so no [in, out]
    gradient per base kernel is computed or stacked (under a vmap over adapters, one per adapter)."""
    trainable, frozen = split_frozen(layers)

    def body(d_carry, xs):
        bits, p, f = xs
        c = jax.tree.map(_from_bits, bits, d_carry)
        _, vjp = jax.vjp(lambda c_, p_: step(c_, join_frozen(p_, f), consts), c, p)
        return vjp(d_carry)

    d_carry, d_trainable = jax.lax.scan(body, d_out, (saved, trainable, frozen), reverse=True, unroll=unroll)
    return d_carry, d_trainable, None


def split_frozen(tree: Any) -> tuple[Any, Any]:
    """(tree with each `LoraKernel`'s base w replaced by None, the tree of those bases alone:
    None everywhere else). `join_frozen` puts them back."""
    trainable = jax.tree.map(lambda x: x.replace(w=None) if is_lora(x) else x, tree, is_leaf=is_lora)
    frozen = jax.tree.map(lambda x: x.w if is_lora(x) else None, tree, is_leaf=is_lora)
    return trainable, frozen


def join_frozen(trainable: Any, frozen: Any) -> Any:
    """The inverse of `split_frozen`: each `LoraKernel` of `trainable` gets its base back."""
    return jax.tree.map(lambda x, w: x.replace(w=w) if is_lora(x) else x, trainable, frozen, is_leaf=is_lora)


_scan_full_remat.defvjp(_scan_full_remat_fwd, _scan_full_remat_bwd)


# ---------------------------------------------------------------------------------- helpers
def batch_sharded(x: jax.Array, rules: ShardingRules = DEFAULT_RULES) -> jax.Array:
    """x [B, ...] constrained to rows over the mesh axes of the logical axis "activation_batch"
    (default rules: data, fsdp) when a program is traced under a mesh (`jax.set_mesh`, as the
    trainer, the sampler and `jmarl.memory_check` do); unchanged otherwise. Applied to each layer's input
    in training, scoring and prefill (not in the one-token decode step): keeps XLA's partitioner
    from gathering a whole batch's activations onto every device under FSDP (it then gathers each
    layer's weights instead)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    rows = rules.spec(ACTIVATION_AXES, x.shape[:1], dict(mesh.shape))
    if not rows:
        return x
    spec = jax.sharding.PartitionSpec(rows[0], *([jax.sharding.PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


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


ROPE_TABLE_MAX_BYTES = 4 << 20


def rope_tables(
    config: ModelConfig, positions: jax.Array, num_positions: int | None = None, *, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """positions int[B,T] -> (cos, sin) float32[B,T,head_dim] (HF `rotate_half` layout). local:
    the sliding-window layers' tables (`ModelConfig.inv_frequencies(local=True)`).

    num_positions: a static bound on the positions (each < num_positions). Given, and the two
    tables [num_positions, head_dim] within ROPE_TABLE_MAX_BYTES, cos and sin are computed once
    per position at trace time and gathered: computed in the program instead, XLA fuses them into
    every consumer and evaluates them again for each head of each layer (on CPU, cos and sin then
    take most of the time of the fusions that apply the rotation). Both are multiplied by
    `config.rope_attention_scaling` (YaRN's attention factor; 1 otherwise), as transformers does."""
    inv_freq = config.inv_frequencies(local=True) if local else config.inv_frequencies()
    scale = config.rope_attention_scaling(local)
    if num_positions is not None and 2 * num_positions * config.head_dim * 4 <= ROPE_TABLE_MAX_BYTES:
        cos, sin = _cos_sin(np, np.arange(num_positions, dtype=np.float32), inv_freq, scale)
        return jnp.take(cos, positions, axis=0, mode="clip"), jnp.take(sin, positions, axis=0, mode="clip")
    return _cos_sin(jnp, positions.astype(jnp.float32), inv_freq, scale)


def _cos_sin(xp: Any, positions: Any, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[Any, Any]:
    """float32 positions [...] -> (cos, sin) [..., head_dim] times `scale` (in float32), with
    `xp` NumPy or jax.numpy."""
    angles = positions[..., None] * xp.asarray(inv_freq)
    angles = xp.concatenate([angles, angles], axis=-1)
    if scale == 1.0:
        return xp.cos(angles), xp.sin(angles)
    factor = np.float32(scale)
    return xp.cos(angles) * factor, xp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B,T,N,hd] by cos/sin [B,T,hd]."""
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


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
ACTIVATION_AXES = ("activation_batch",)  # a layer's input x [B, ...]: rows named, the other axes left to XLA
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


def token_logprobs(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
    with_router_stats: bool = False,
) -> jax.Array | tuple[jax.Array, moe_lib.RouterStats]:
    """float32[B,T]: out[:, t] = log p(tokens[:, t] | tokens[:, :t]) under softmax(logits / T).

    out[:, t] is 0 where token t is padding or has no real token before it (so out[:, 0] = 0).
    The full-vocabulary log-softmax is computed `chunk_size` positions at a time (by default as
    many as keep a [B, chunk, V] float32 block under 2**24 elements) and recomputed in the
    backward pass, so memory stays O(B * chunk * V) for the forward and the gradient.
    with_router_stats: (out, `moe.RouterStats` over the real tokens), from the same forward pass,
    differentiable: a loss adds `config.router_aux_loss_coef * moe.load_balancing_loss(stats)`.
    """
    model = bind(config, params)
    h, stats = model.hidden(tokens, attention_mask, router_stats=with_router_stats)
    b, t = tokens.shape
    if t == 1:
        out = jnp.zeros((b, t), jnp.float32)
        return (out, stats) if with_router_stats else out
    lp = chunked_logprobs(model.head_master(), h[:, :-1], tokens[:, 1:], temperature, chunk_size=chunk_size,
                          compute_dtype=config.compute_dtype)
    out = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp], axis=1)
    mask = attention_mask.astype(bool)
    has_context = mask & (positions_from_mask(attention_mask) > 0)
    out = jnp.where(has_context, out, 0.0)
    return (out, stats) if with_router_stats else out


def prefix_token_logprobs(
    config: ModelConfig,
    params: Params,
    prefix_tokens: jax.Array,
    prefix_mask: jax.Array,
    rows: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
    with_router_stats: bool = False,
) -> jax.Array | tuple[jax.Array, moe_lib.RouterStats]:
    """float32[N,C]: out[n, j] = log p(tokens[n, j] | prefix rows[n], tokens[n, :j]) under
    softmax(logits / T), for U shared prefixes prefix_tokens/prefix_mask [U,P] (left-padded: each
    real prefix ends in slot P-1), rows int[N] in [0, U), and continuations tokens/mask [N,C]
    (right-padded).

    The same numbers as `token_logprobs` on the N concatenated rows (prefix rows[n] + tokens[n]),
    at the cost of running each distinct prefix once: a GRPO group's G samples share their
    prompt, so its forward (and backward) pass runs once per group instead of G times. The
    continuation attends to its prefix's keys/values (gathered per row; their gradients sum
    over the rows that share them). out is 0 where mask is False or no real token precedes.
    with_router_stats: (out, `moe.RouterStats` over the real tokens, each prefix counted once).
    """
    model = bind(config, params)
    rows = rows.astype(jnp.int32)
    prefix_last, h, *stats = model.hidden_prefixed(prefix_tokens, prefix_mask, rows, tokens, mask,
                                                   router_stats=with_router_stats)
    h_in = jnp.concatenate([prefix_last[rows][:, None], h[:, :-1]], axis=1)  # [N, C, D]
    lp = chunked_logprobs(model.head_master(), h_in, tokens, temperature, chunk_size=chunk_size,
                          compute_dtype=config.compute_dtype)
    prefix_len = jnp.sum(prefix_mask.astype(jnp.int32), axis=-1)[rows]
    mask = mask.astype(bool)
    has_context = mask & (prefix_len[:, None] + jnp.cumsum(mask.astype(jnp.int32), axis=-1) > 1)
    out = jnp.where(has_context, lp, 0.0)
    return (out, stats[0]) if with_router_stats else out


def packed_token_logprobs(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segment: jax.Array,
    branch: jax.Array,
    source: jax.Array,
    target: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
    with_router_stats: bool = False,
    routing: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, moe_lib.RouterStats]:
    """float32[M]: out[m] = log p(target[m] | the sequence up to packed slot source[m]) under
    softmax(logits / T), for packed rows tokens/positions/segment/branch int[R,T]
    (`Transformer.hidden_packed`) and M predictions source int[M] (flat slots, r * T + t) and
    target int[M]. A prompt's last slot is the source of each of its continuations' first
    token, so the LM head runs over the M predictions, not over padded [N, C] slots.
    with_router_stats: (out, `moe.RouterStats` over the packed slots of segment != 0: a prompt
    counted once, not once per continuation). routing: recorded expert ids [R,T,S,k] of each
    slot in the S sparse layers (routing replay; `moe.no_route` where a slot has none): the
    experts run there instead of the router's top k, weighted by the router (`moe.replay_route`);
    the stats then count the recorded pairs whose own top k differs (`moe.mismatch_fraction`)."""
    model = bind(config, params)
    h = model.hidden_packed(tokens, positions, segment, branch, router_stats=with_router_stats, routing=routing)
    h, stats = h if with_router_stats else (h, None)
    h = h.reshape(-1, h.shape[-1])[source.astype(jnp.int32)]
    lp = chunked_logprobs(model.head_master(), h[None], target.astype(jnp.int32)[None], temperature,
                          chunk_size=chunk_size, compute_dtype=config.compute_dtype)
    return (lp[0], stats) if with_router_stats else lp[0]


def chunked_logprobs(
    kernel: jax.Array | LoraKernel,
    h: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
    compute_dtype: str | None = None,
) -> jax.Array:
    """float32[B,n]: log softmax(h @ kernel / T)[targets] for hidden h [B,n,D], kernel [D,V],
    targets int[B,n]. The full-vocabulary log-softmax runs `chunk_size` positions at a time (by
    default as many as keep a [B, chunk, V] float32 block under 2**24 elements) and is
    recomputed in the backward pass, so memory stays O(B * chunk * V). `compute_dtype`: the
    dtype of the product (default: the kernel's); the kernel is cast inside each chunk, so its
    gradient accumulates over the chunks in the kernel's own dtype (float32 masters), not in
    the compute dtype."""
    b, n, _ = h.shape
    v = kernel.shape[-1]
    if chunk_size is None:
        chunk_size = max(1, min(n, _LOGPROB_CHUNK_ELEMENTS // (b * v)))
    num_chunks = -(-n // chunk_size)
    pad = num_chunks * chunk_size - n
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h_chunks = h.reshape(b, num_chunks, chunk_size, -1).swapaxes(0, 1)
    target_chunks = targets.reshape(b, num_chunks, chunk_size).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_logprobs(h_c: jax.Array, t_c: jax.Array) -> jax.Array:
        dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else kernel.dtype
        logits = dense(h_c.astype(dtype), cast_kernel(kernel, dtype), preferred_element_type=jnp.float32) / temperature
        picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1)

    lp = jax.lax.map(lambda xs: chunk_logprobs(*xs), (h_chunks, target_chunks))
    return lp.swapaxes(0, 1).reshape(b, -1)[:, :n]
