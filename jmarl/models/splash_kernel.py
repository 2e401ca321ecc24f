"""Pallas splash attention (TPU) as a `packed_split.PartKernel`: both parts of the packed
learner's attention on the splash kernels, forward and backward, exact.

Shapes (as every PartKernel): q [R,T,H,hd], k/v [R,T,KV,hd] (H a multiple of KV), q_ids /
k_ids int[R,T] (`packed_split.own_ids` / `prompt_ids`: query t sees key s iff the ids are
equal) -> forward (out [R,T,H,hd], lse [R,T,H]) float32; backward, given the MERGED out and lse
and d_out [R,T,H,hd] -> (dq [R,T,H,hd], dk, dv [R,T,KV,hd]) float32.

Choices (read from the installed `jax.experimental.pallas.ops.tpu.splash_attention`):

    layout     splash takes one sequence head-major, q [H,W,hd] and k/v [KV,W,hd]; the packed
               rows R are a `jax.vmap` over it. W is T rounded up to a multiple of 128 (the
               kernel's lane width, below which its segment ids cannot be tiled); the extra
               slots carry the "none" ids and are cut off again.
    scale      splash does not scale the logits: q is multiplied by 1/sqrt(hd) before the
               kernel, and its dq by 1/sqrt(hd) after.
    GQA        splash's MHA entry point (`make_splash_mha_single_device`, is_mqa False) takes
               KV key/value heads for H query heads, query head h reading key head h // (H/KV)
               (the grouping of `packed_split._scores`); its dkv kernel sums the H/KV query
               heads' shares. K/V are not repeated.
    masks      own part: CausalMask + SegmentIds(q_ids, k_ids); prompt part: FullMask +
               SegmentIds. Blocks: the largest of 512, 256, 128 dividing W, the same for the
               forward, dq and dkv kernels (splash skips the key blocks its static mask
               empties, i.e. above the causal diagonal; segment ids mask within a block).
    no key     splash requires no fully masked query row, and does not check it: such a row
               scores every key at the mask value, so the kernel returns the AVERAGE of the
               values of the blocks it visits and an lse of about mask_value + log(keys), and
               its backward, p = exp(mask_value - lse), would give those keys weight ~1. The
               prompt part's prompt and padding queries are such rows. So after the forward a
               query with no key in the part (`has_key`) gets out 0 and lse MASKED_LSE, and
               before the backward its lse is set to 0 and its d_out to 0, which gives every
               masked score p = exp(mask_value) = 0 and the query no gradient.
    backward   the kernel's own `_splash_attention_bwd` (its dkv and dq kernels) with the
               residuals (q, k, v, segment ids, no sinks, out, logsumexp, its dq and dkv mask
               infos) built here from the MERGED out and lse: FlashAttention-2's backward under
               the whole softmax, this part's keys' share (`packed_split.PartKernel`). Splash's
               own VJP is never used (it refuses save_residuals=True). A private function: it
               is called by keyword and its residual tuple built with or without `sinks`, as
               the installed module's `SplashResidualsType` says (checked on JAX 0.10.2 only).
    windows    a window W (a traced int32 scalar: the layer scan passes the model's window on
               sliding layers and NO_WINDOW elsewhere) is chosen among at run time by
               `lax.switch`: W >= T (no key is that far back in a row) -> the splash kernels
               unwindowed; own part with W == `local_window` (the model's static window, given
               when the kernel is made) -> splash with LocalMask((W - 1, 0)): inside a run
               positions are consecutive, so positions[t] - positions[s] < W is t - s < W;
               any other window, and the prompt part on every windowed layer -> the dense
               `packed_split.reference_part`. The prompt part's window is aligned to each
               continuation's start (positions, not slots), which no static splash mask
               expresses (a mask function sees slot indices only).

Importable without a TPU: splash is imported when a kernel is first built; `interpret=True`
runs the same kernels in the Pallas interpreter on any backend (slow: for tests).
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jmarl.errors import JmarlError
from jmarl.models import packed_split as ps

LANES = 128  # splash's segment ids and key blocks come in multiples of this
BLOCKS = (512, 256, 128)


def _splash() -> tuple[Any, Any]:
    """The installed splash kernel and mask modules."""
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
    except ImportError as err:
        raise JmarlError("the splash part kernel needs jax.experimental.pallas.ops.tpu.splash_attention "
                         f"({err}); install a JAX with Pallas TPU ops, or use packed_split.reference_kernel") from err
    return kernel_lib, mask_lib


def width_for(t: int) -> int:
    """Slots T -> the kernel's width W: T rounded up to a multiple of LANES."""
    return -(-t // LANES) * LANES


def block_for(width: int, block: int | None = None) -> int:
    """The splash block for width W: `block` if given (it must divide W and be a multiple of
    LANES), else the largest of BLOCKS dividing W."""
    if block is not None:
        if width % block or block % LANES:
            raise JmarlError(f"splash block {block} must be a multiple of {LANES} dividing the width {width}")
        return block
    return next(b for b in BLOCKS if width % b == 0)


@functools.lru_cache(maxsize=None)
def _kernel(width: int, heads: int, causal: bool, local: int | None, block: int, interpret: bool) -> Any:
    """A splash MHA kernel over one head-major sequence of `width` slots, `heads` query heads,
    returning its residuals (out and logsumexp). local: a causal left window of `local` keys
    (the query's own included)."""
    kernel_lib, mask_lib = _splash()
    shape = (width, width)
    if local is not None:
        mask = mask_lib.LocalMask(shape, window_size=(local - 1, 0), offset=0)
    else:
        mask = mask_lib.CausalMask(shape) if causal else mask_lib.FullMask(shape)
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # its mask tables become constants, also when first built inside a trace (the kernel is cached)
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mha_single_device(mask_lib.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                                        save_residuals=True, interpret=interpret)


def has_key(q_ids: jax.Array, k_ids: jax.Array, *, causal: bool) -> jax.Array:
    """q_ids/k_ids int[R,T] -> bool[R,T]: whether query t sees at least one key (an equal id,
    at a slot <= t with causal). Sorts each row's key ids once: O(T log T), no [T,T] array."""
    t = k_ids.shape[1]

    def row(qi: jax.Array, ki: jax.Array) -> jax.Array:
        order = jnp.argsort(ki, stable=True)  # equal ids keep their slot order: the first is the earliest
        ids = ki[order]
        at = jnp.clip(jnp.searchsorted(ids, qi, side="left", method="sort"), 0, t - 1)  # no loop
        seen = ids[at] == qi
        return seen & (order[at] <= jnp.arange(t)) if causal else seen

    return jax.vmap(row)(q_ids, k_ids)


def _head_major(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, k_ids: jax.Array, width: int
                ) -> tuple[jax.Array, ...]:
    """[R,T,H,hd] q (scaled by 1/sqrt(hd)), [R,T,KV,hd] k/v, int[R,T] ids -> [R,H,W,hd],
    [R,KV,W,hd], int[R,W]: splash's layout, the slots past T given the "none" ids."""
    t, hd = q.shape[1], q.shape[-1]
    extra = width - t
    heads = lambda x: jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # noqa: E731
    ids = lambda x, fill: jnp.pad(x, ((0, 0), (0, extra)), constant_values=fill)  # noqa: E731
    return (heads(q * jnp.asarray(hd**-0.5, q.dtype)), heads(k), heads(v),
            ids(q_ids, ps.NO_QUERY), ids(k_ids, ps.NO_KEY))


def _seq_major(x: jax.Array, t: int) -> jax.Array:
    """[R,H,W,...] -> [R,T,H,...] float32 (the first T slots)."""
    return jnp.moveaxis(x[:, :, :t], 1, 2).astype(jnp.float32)


def splash_part(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, k_ids: jax.Array, *, causal: bool,
                local: int | None = None, block: int | None = None, interpret: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """One part on the splash forward kernel (no window beyond `local`, see the module
    docstring): -> (out [R,T,H,hd], lse [R,T,H]) float32; a query with no key gets out 0 and
    lse MASKED_LSE."""
    kernel_lib, _ = _splash()
    t, h = q.shape[1], q.shape[2]
    width = width_for(t)
    kernel = _kernel(width, h, causal, local, block_for(width, block), interpret)

    def one(qr, kr, vr, qi, ki):  # [H,W,hd], [KV,W,hd], [KV,W,hd], int[W], int[W]
        out, (lse,) = kernel(qr, kr, vr, segment_ids=kernel_lib.SegmentIds(q=qi, kv=ki))
        return out, lse

    out, lse = jax.vmap(one)(*_head_major(q, k, v, q_ids, k_ids, width))
    seen = has_key(q_ids, k_ids, causal=causal)[..., None]  # [R,T,1]
    return (jnp.where(seen[..., None], _seq_major(out, t), 0.0),
            jnp.where(seen, _seq_major(lse, t), ps.MASKED_LSE))


def splash_part_backward(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, k_ids: jax.Array, *,
                         causal: bool, out: jax.Array, lse: jax.Array, d_out: jax.Array, local: int | None = None,
                         block: int | None = None, interpret: bool = False
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One part's FlashAttention-2 backward on splash's dq and dkv kernels, fed the merged out
    [R,T,H,hd] and lse [R,T,H] and d_out [R,T,H,hd] -> (dq [R,T,H,hd], dk, dv [R,T,KV,hd])
    float32: this part's keys' share of the gradient (`packed_split.reference_part_backward`)."""
    kernel_lib, _ = _splash()
    t, h, hd = q.shape[1], q.shape[2], q.shape[3]
    width = width_for(t)
    kernel = _kernel(width, h, causal, local, block_for(width, block), interpret)
    opts = kernel.kwargs
    # a query with no key here: every score is masked; lse 0 and d_out 0 make it weigh nothing
    seen = has_key(q_ids, k_ids, causal=causal)[..., None]
    lse = jnp.where(seen, lse.astype(jnp.float32), 0.0)
    d_out = jnp.where(seen[..., None], d_out, 0.0)
    qh, kh, vh, qi, ki = _head_major(q, k, v, q_ids, k_ids, width)
    pad = lambda x: jnp.moveaxis(jnp.pad(x, [(0, 0), (0, width - t)] + [(0, 0)] * (x.ndim - 2)), 2, 1)  # noqa: E731
    oh, lh, doh = pad(out.astype(jnp.float32)), pad(lse), pad(d_out.astype(jnp.float32))

    bwd = kernel_lib._splash_attention_bwd
    params = inspect.signature(bwd).parameters
    static = {name: opts.get(name) for name in params if name not in ("res", "do")}
    static["save_residuals"], static["residual_checkpoint_name"] = False, None
    # the residual tuple as the installed splash defines it (sinks: JAX releases that have them)
    with_sinks = len(typing.get_args(kernel_lib.SplashResidualsType)) == 9

    def one(qr, kr, vr, qir, kir, o, l, do):
        head = (qr, kr, vr, kernel_lib.SegmentIds(q=qir, kv=kir)) + ((None,) if with_sinks else ())
        res = head + (o, l, kernel.dq_mask_info, kernel.dkv_mask_info)
        grads = bwd(**static, res=res, do=do)  # (mask infos, dq, dk, dv, ...)
        return grads[3:6]

    dq, dk, dv = jax.vmap(one)(qh, kh, vh, qi, ki, oh, lh, doh)
    return _seq_major(dq, t) * hd**-0.5, _seq_major(dk, t), _seq_major(dv, t)


def _windowed(t: int, causal: bool, window: jax.Array, local_window: int | None,
              splash: Callable[[int | None], Any], reference: Callable[[], Any]) -> Any:
    """The branch for a traced window (see the module docstring): splash unwindowed when
    window >= T, splash with LocalMask when the own part's window is `local_window`, else
    the dense reference."""
    branches = [lambda: splash(None), reference]
    index = jnp.where(window >= t, 0, 1)
    if causal and local_window is not None and local_window < t:
        branches.append(lambda: splash(local_window))
        index = jnp.where(window == local_window, 2, index)
    return jax.lax.switch(index, branches)


def _forward(q, k, v, q_ids, k_ids, *, causal, positions=None, window=None, local_window=None, block=None,
             interpret=False):
    """PartKernel.forward (module docstring)."""
    splash = lambda local: splash_part(q, k, v, q_ids, k_ids, causal=causal, local=local, block=block,  # noqa: E731
                                       interpret=interpret)
    if window is None:
        return splash(None)
    reference = lambda: ps.reference_part(q, k, v, q_ids, k_ids, causal=causal, positions=positions,  # noqa: E731
                                          window=window)
    return _windowed(q.shape[1], causal, jnp.asarray(window, jnp.int32), local_window, splash, reference)


def _backward(q, k, v, q_ids, k_ids, *, causal, positions=None, window=None, out, lse, d_out, local_window=None,
              block=None, interpret=False):
    """PartKernel.backward (module docstring)."""
    splash = lambda local: splash_part_backward(  # noqa: E731
        q, k, v, q_ids, k_ids, causal=causal, out=out, lse=lse, d_out=d_out, local=local, block=block,
        interpret=interpret)
    if window is None:
        return splash(None)
    reference = lambda: ps.reference_part_backward(  # noqa: E731
        q, k, v, q_ids, k_ids, causal=causal, positions=positions, window=window, out=out, lse=lse, d_out=d_out)
    return _windowed(q.shape[1], causal, jnp.asarray(window, jnp.int32), local_window, splash, reference)


@functools.lru_cache(maxsize=None)
def splash_kernel(*, local_window: int | None = None, block: int | None = None,
                  interpret: bool = False) -> ps.PartKernel:
    """The splash PartKernel (one object per settings, so jit caches keyed on it hold).
    local_window: the model's static sliding window (own part on LocalMask when a layer's
    window equals it); block: the splash block (default: the largest of 512/256/128 dividing
    the width); interpret: run the kernels in the Pallas interpreter (tests off TPU)."""
    if local_window is not None and local_window < 1:
        raise JmarlError(f"splash local_window must be >= 1, got {local_window}")
    opts = dict(local_window=local_window, block=block, interpret=interpret)
    return ps.PartKernel(functools.partial(_forward, **opts), functools.partial(_backward, **opts))


def packed_splash_or(blockwise: Callable, q, k, v, segment, branch, *, extra: tuple) -> jax.Array:
    """`packed_attention` split into its two parts on the splash kernels (TPU) where they apply
    (head_dim a multiple of 64; no window, or a layer whose window reaches past the row),
    else `blockwise(q, k, v, segment, branch)`."""
    if q.shape[-1] % 64:
        return blockwise(q, k, v, segment, branch)
    def split(q, k, v, segment, branch):
        return ps.split_attention(q, k, v, segment, branch, kernel=splash_kernel()
                                            ).astype(q.dtype)

    if not extra:
        return split(q, k, v, segment, branch)
    # a window >= T hides no key of a row (positions differ by < T): such layers take splash
    return jax.lax.cond(extra[1] >= q.shape[1], split, blockwise, q, k, v, segment, branch)
