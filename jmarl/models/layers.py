"""The network's layers in Flax NNX: norms, linear maps (plain or unmerged LoRA), attention,
dense and mixture-of-experts MLPs, and one decoder layer. `jmarl.models.model` stacks the
decoder layers and holds the embedding and the head; `jmarl.models.layer_scan` runs the stack.

LoRA runs unmerged: an adapted kernel's slot may hold a `LoraKernel` (base W, adapter A, B and
scale s; `jmarl.train.lora.attach_lora`), and every product with it is x W + s (x A) B, the
frozen W read in place and never copied per adapter.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jmarl.errors import JmarlError
from jmarl.models import moe as moe_lib
from jmarl.models.config import ModelConfig
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules
from jmarl.models.rope import apply_rope

# Elements of one [tokens, intermediate] block of the feed-forward layer above which it runs in
# chunks of tokens (see `MLP`): 4,096 tokens at Qwen3-1.7B's 6,144; tiny models never chunk.
MLP_CHUNK_ELEMENTS = 4096 * 6144

# attend(q [B,T,H,hd], k [B,T,KV,hd], v [B,T,KV,hd]) -> (out [B,T,H,hd], aux)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]
# the logical axis of a layer's input rows x [B, ...] (the other axes left to XLA); declared with
# the model's other axes (`jmarl.models.model.param_axes`)
ACTIVATION_AXES = ("activation_batch",)


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


def normal_init(stddev: float = 0.02):
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


def make_norm(c: ModelConfig, dim: int) -> RMSNorm:
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


def make_linear(c: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs) -> Linear:
    return Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=jnp.dtype(c.compute_dtype),
        param_dtype=jnp.dtype(c.param_dtype),
        kernel_init=normal_init(),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE (+ Qwen2 q/k/v biases, + Qwen3 / Gemma 3 q/k RMSNorm,
    + Gemma 3's query_pre_attn_scalar as a factor on the rotated queries)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        hq, hkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        in_bias = c.qkv_bias or c.o_bias
        self.q_proj = make_linear(c, c.hidden_size, hq, in_bias, rngs)
        self.k_proj = make_linear(c, c.hidden_size, hkv, in_bias, rngs)
        self.v_proj = make_linear(c, c.hidden_size, hkv, in_bias, rngs)
        self.o_proj = make_linear(c, hq, c.hidden_size, c.o_bias, rngs)
        self.q_norm = make_norm(c, c.head_dim) if c.qk_norm else None
        self.k_norm = make_norm(c, c.head_dim) if c.qk_norm else None
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
        self.gate_proj = make_linear(c, c.hidden_size, c.intermediate_size, False, rngs)
        self.up_proj = make_linear(c, c.hidden_size, c.intermediate_size, False, rngs)
        self.down_proj = make_linear(c, c.intermediate_size, c.hidden_size, False, rngs)
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
        init, dtype = normal_init(), jnp.dtype(c.param_dtype)
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
        self.router = make_linear(c, c.hidden_size, c.num_experts, False, rngs)
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
        self.attn_norm = make_norm(c, c.hidden_size)
        self.attn = Attention(c, rngs)
        self.mlp_norm = make_norm(c, c.hidden_size)
        self.mlp = None if all(kinds) else MLP(c, rngs)
        self.moe = SparseMLP(c, rngs) if any(kinds) else None
        self.num_experts = c.num_experts
        self.attn_post_norm = make_norm(c, c.hidden_size) if c.is_gemma3 else None
        self.mlp_post_norm = make_norm(c, c.hidden_size) if c.is_gemma3 else None

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
