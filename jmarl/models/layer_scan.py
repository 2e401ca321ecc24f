"""The layer stack: one `jax.lax.scan` over the stacked decoder layers, with per-layer flags
(sliding window, dense or sparse MLP, recorded experts), for the two layouts the model runs
(right-padded rows, packed rows), and the remat that bounds its memory. Another layout builds
its own step from the same pieces (`split_xs`, `layer_kind`, `run_layer`; e.g. the packing
benchmark's shared-prefix baseline, `benchmarks.shared_prefix_model`) and runs it with `scan_layers`.

Shallow models run the scan unrolled (`UNROLL_MAX_LAYERS`), deeper ones rolled, so compile time
stays flat in depth. `config.remat` wraps each layer in `jax.checkpoint` with its policy; "full"
is a custom VJP that saves only each layer's input (`_scan_full_remat`), and for LoRA keeps the
frozen base out of the saved residuals (`split_frozen` / `join_frozen`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmarl.models import attention as attention_lib
from jmarl.models import moe as moe_lib
from jmarl.models.config import ModelConfig
from jmarl.models.layers import AttendFn, batch_sharded, is_lora

# Models with at most this many layers run them as straight-line code (`scan(unroll=True)`):
# no stacked per-layer residual buffers to zero-fill and copy (~10% of a CPU train step at
# 4 layers). Deeper models keep the rolled scan, so their compile time stays flat in depth.
UNROLL_MAX_LAYERS = 8


def split_xs(xs: Any) -> tuple[Any, dict[str, jax.Array]]:
    """One scan step's slice of `Transformer.layer_xs`: (layer state, per-layer flags; {} when
    the layers do not differ)."""
    return xs if isinstance(xs, tuple) else (xs, {})


def layer_kind(flags: dict[str, jax.Array], cos: jax.Array, sin: jax.Array,
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


def empty_router_stats(wanted: bool) -> moe_lib.RouterStats | None:
    """What a forward without experts answers for its router stats: empty ones (E = 0, a loss of
    0) when they were asked for, else None."""
    return moe_lib.RouterStats.zeros(0) if wanted else None


def run_layer(layer_def: Any, state: Any, flags: dict[str, jax.Array], x: jax.Array, cos: jax.Array,
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


def decoder_step(layer_def: Any, impl: str, carry: Any, xs: Any, consts: tuple,
                  window: int | None = None, stats: bool = False) -> Any:
    """One decoder layer on right-padded rows: x [B,T,D] -> [B,T,D]; consts = (cos, sin, lengths)
    (+ the sliding layers' (cos, sin) with sliding windows: `layer_kind`). stats: the carry is
    (x, `moe.RouterStats`), the layer's stats over the real tokens added."""
    cos, sin, lengths = consts[:3]
    state, flags = split_xs(xs)
    cos, sin, window_i = layer_kind(flags, cos, sin, consts[3] if len(consts) > 3 else None, window)

    def attend(q, k, v):
        return attention_lib.attention(q, k, v, lengths, causal=True, impl=impl, window=window_i), None

    x, acc = carry if stats else (carry, None)
    valid = (jnp.arange(x.shape[1])[None] < lengths[:, None]) if stats else None
    x, _, layer_stats = run_layer(layer_def, state, flags, x, cos, sin, attend, valid)
    return (x, acc.plus(layer_stats)) if stats else x


def packed_step(layer_def: Any, impl: str, carry: Any, xs: Any, consts: tuple,
                 window: int | None = None, stats: bool = False) -> Any:
    """One decoder layer on packed rows: x [R,T,D] -> [R,T,D]; consts = (cos, sin, segment, branch)
    (+ the sliding layers' (cos, sin) and the positions int[R,T] with sliding windows). stats:
    the carry is (x, `moe.RouterStats`), the layer's stats over the slots of segment != 0 added."""
    cos, sin, segment, branch = consts[:4]
    local, positions = consts[4:] if len(consts) > 4 else (None, None)
    state, flags = split_xs(xs)
    cos, sin, window_i = layer_kind(flags, cos, sin, local, window)

    def attend(q, k, v):
        return attention_lib.packed_attention(q, k, v, segment, branch, impl=impl, window=window_i,
                                              positions=positions), None

    x, acc = carry if stats else (carry, None)
    x, _, layer_stats = run_layer(layer_def, state, flags, x, cos, sin, attend, (segment != 0) if stats else None)
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
