"""Packed attention as one fused Pallas kernel for GPUs (Triton), forward and backward.

The packed learner's mask (`attention.packed_attention`: a query sees the keys of its segment's
shared prompt and of its own branch, causally) is in no library kernel's API, and its `lax`
blockwise form runs on a GPU as data-dependent while loops: tens of thousands of small kernels a
step, each loop iteration waiting on the host for its condition (docs/benchmarks.md, the H200
profile). Here the same tiles are visited inside one kernel launch per pass:

- forward, grid (row, head, query tile): the key tiles of the tile's prompt and of its own
  branch up to the diagonal (the bounds `packed_tiles` uses, taken per row from the slots'
  run bounds), the mask applied inside each tile, an online softmax; out and the log-sum-exp;
- backward: dq with the same grid and tiles; dk and dv per query head with grid (row, head, key
  tile) over the query tiles that can see the key tile, summed over a key head's query heads
  outside the kernel (grouped-query attention).

A query that sees no key (a padding slot) gets 0 and no gradient, as in the split form. The
queries are scaled by 1/sqrt(head_dim) in their dtype before the kernel, as the dense form does.
Sliding windows (Gemma 3's local layers) are a mask on the tokens' positions inside each tile;
the tiles visited stay those of the unwindowed layout (a window's skipped tiles are not skipped). Exactness is tested on the
CPU with the kernels in the Pallas interpreter (`interpret=True`), against the dense form;
tests/test_packed_pallas.py also lowers the update for CUDA from the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jmarl.models.packed_tiles import slot_runs

BLOCK = 64  # query and key tile (slots); rows are padded to a multiple of it
_MASKED = -0.7 * float(np.finfo(np.float32).max)
_NO_KEYS_LSE = float(np.finfo(np.float32).max)  # a query that saw no key: exp(s - lse) = 0


_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar("packed_pallas_interpret", default=False)


def interpreting() -> bool:
    """Whether `attention.packed_attention` with impl "pallas" runs the kernels in the Pallas
    interpreter on any platform (inside `interpret_kernels`), rather than on CUDA only."""
    return _INTERPRET.get()


@contextlib.contextmanager
def interpret_kernels() -> Iterator[None]:
    """Trace impl "pallas" as the interpreted kernels on every platform: for exactness tests of
    a whole model on a CPU."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head_dim: a power of two from 16 up (Triton's dot)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _dot(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """a @ b (either transposed) accumulated in float32, as Triton's dot."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b).astype(jnp.float32)


def _allowed(seg_q, br_q, idx_q, seg_k, br_k, idx_k, low_q=None, pos_k=None):
    """bool[bq,bk]: key in the query's segment (not padding), on the prompt or the query's branch,
    at or before the query; with a sliding window (low_q, pos_k given), the key's position at
    least the query's lowest visible one."""
    ok = (seg_q[:, None] == seg_k[None, :]) & (seg_k > 0)[None, :]
    ok = ok & ((br_k == 0)[None, :] | (br_q[:, None] == br_k[None, :]))
    if low_q is not None:
        ok = ok & (pos_k[None, :] >= low_q[:, None])
    return ok & (idx_k[None, :] <= idx_q[:, None])


def _key_ranges(seg_start_ref, prompt_end_ref, own_start_ref, q_slice, i, block):
    """The two key-tile ranges of query tile i: its prompt's tiles below its own run's, and its
    own run's tiles up to the diagonal."""
    prompt_lo = jax.lax.div(jnp.min(seg_start_ref[q_slice]), block)
    prompt_hi = jax.lax.div(jnp.max(prompt_end_ref[q_slice]) + block - 1, block)
    own_lo = jax.lax.div(jnp.min(own_start_ref[q_slice]), block)
    diagonal = i + 1
    return (prompt_lo, jnp.minimum(jnp.minimum(prompt_hi, own_lo), diagonal)), (own_lo, diagonal)


def _forward_kernel(q_ref, k_ref, v_ref, seg_ref, br_ref, pos_ref, low_ref, start_ref, prompt_end_ref, own_ref, o_ref,
                    lse_ref, *, block: int, windowed: bool):
    i = pl.program_id(2)
    q_slice = pl.dslice(i * block, block)
    q = q_ref[...]
    seg_q, br_q = seg_ref[q_slice], br_ref[q_slice]
    low_q = low_ref[q_slice] if windowed else None
    idx_q = i * block + jnp.arange(block)

    def body(j, carry):
        acc, m, l = carry
        k_slice = pl.dslice(j * block, block)
        kb, vb = k_ref[k_slice, :], v_ref[k_slice, :]
        s = _dot(q, kb, trans_b=True)
        ok = _allowed(seg_q, br_q, idx_q, seg_ref[k_slice], br_ref[k_slice], j * block + jnp.arange(block), low_q,
                      pos_ref[k_slice] if windowed else None)
        s = jnp.where(ok, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        l = l * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + _dot(p.astype(vb.dtype), vb)
        return acc, m_new, l

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((block,), _MASKED, jnp.float32), jnp.zeros((block,), jnp.float32))
    (a_lo, a_hi), (b_lo, b_hi) = _key_ranges(start_ref, prompt_end_ref, own_ref, q_slice, i, block)
    carry = jax.lax.fori_loop(a_lo, a_hi, body, carry)
    acc, m, l = jax.lax.fori_loop(b_lo, b_hi, body, carry)
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe), _NO_KEYS_LSE)


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, br_ref, pos_ref, low_ref, start_ref, prompt_end_ref, own_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, block: int, windowed: bool):
    i = pl.program_id(2)
    q_slice = pl.dslice(i * block, block)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    seg_q, br_q = seg_ref[q_slice], br_ref[q_slice]
    low_q = low_ref[q_slice] if windowed else None
    idx_q = i * block + jnp.arange(block)

    def body(j, dq):
        k_slice = pl.dslice(j * block, block)
        kb, vb = k_ref[k_slice, :], v_ref[k_slice, :]
        s = _dot(q, kb, trans_b=True)
        ok = _allowed(seg_q, br_q, idx_q, seg_ref[k_slice], br_ref[k_slice], j * block + jnp.arange(block), low_q,
                      pos_ref[k_slice] if windowed else None)
        p = jnp.where(ok, jnp.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, vb, trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(kb.dtype), kb)

    (a_lo, a_hi), (b_lo, b_hi) = _key_ranges(start_ref, prompt_end_ref, own_ref, q_slice, i, block)
    dq = jax.lax.fori_loop(a_lo, a_hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = jax.lax.fori_loop(b_lo, b_hi, body, dq).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, seg_ref, br_ref, pos_ref, low_ref, visible_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, block: int, query_tiles: int, windowed: bool):
    j = pl.program_id(2)
    k_slice = pl.dslice(j * block, block)
    kb, vb = k_ref[...], v_ref[...]
    seg_k, br_k = seg_ref[k_slice], br_ref[k_slice]
    pos_k = pos_ref[k_slice] if windowed else None
    idx_k = j * block + jnp.arange(block)

    def body(i, carry):
        dk, dv = carry
        q_slice = pl.dslice(i * block, block)
        q, do = q_ref[q_slice, :], do_ref[q_slice, :]
        lse, delta = lse_ref[q_slice], delta_ref[q_slice]
        s = _dot(q, kb, trans_b=True)
        ok = _allowed(seg_ref[q_slice], br_ref[q_slice], i * block + jnp.arange(block), seg_k, br_k, idx_k,
                      low_ref[q_slice] if windowed else None, pos_k)
        p = jnp.where(ok, jnp.exp(s - lse[:, None]), 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        dp = _dot(do, vb, trans_b=True)
        ds = p * (dp - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    last = jax.lax.div(jnp.max(visible_ref[k_slice]) + block - 1, block)
    zeros = jnp.zeros(kb.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(j, jnp.minimum(last, query_tiles), body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(r_t_h_d: tuple[int, int, int, int], groups: int, block: int):
    """BlockSpecs over grid (row, head, tile): this tile of q-like [R,T,H,hd] arrays, whole rows
    of k/v [R,T,KV,hd] (head h reads key head h // groups), whole rows of the int metadata,
    and this tile of [R,H,T] statistics."""
    _, t, _, hd = r_t_h_d
    tile = pl.BlockSpec((None, block, None, hd), lambda r, h, i: (r, i, h, 0))
    row_q = pl.BlockSpec((None, t, None, hd), lambda r, h, i: (r, 0, h, 0))
    row_kv = pl.BlockSpec((None, t, None, hd), lambda r, h, i: (r, 0, h // groups, 0))
    tile_kv = pl.BlockSpec((None, block, None, hd), lambda r, h, i: (r, i, h // groups, 0))
    ids = pl.BlockSpec((None, t), lambda r, h, i: (r, 0))
    stat_tile = pl.BlockSpec((None, None, block), lambda r, h, i: (r, h, i))
    stat_row = pl.BlockSpec((None, None, t), lambda r, h, i: (r, h, 0))
    return dict(tile=tile, row_q=row_q, row_kv=row_kv, tile_kv=tile_kv, ids=ids,
                stat_tile=stat_tile, stat_row=stat_row)


def _compiler_params(head_dim: int):
    from jax.experimental.pallas import triton as plgpu

    params = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return params(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _forward(q, k, v, ids, bounds, block, interpret, windowed):
    r, t, h, hd = q.shape
    sp = _specs(q.shape, h // k.shape[2], block)
    return pl.pallas_call(
        functools.partial(_forward_kernel, block=block, windowed=windowed),
        grid=(r, h, t // block),
        in_specs=[sp["tile"], sp["row_kv"], sp["row_kv"]] + [sp["ids"]] * 7,
        out_specs=[sp["tile"], sp["stat_tile"]],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((r, h, t), jnp.float32)],
        compiler_params=None if interpret else _compiler_params(hd),
        interpret=interpret, name="packed_attention_forward",
    )(q, k, v, *ids, *bounds[:3])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _packed(q, k, v, ids, bounds, block, interpret, windowed):
    """ids: (segment, branch, positions, lowest visible position) int[R,T]; bounds: `slot_runs`."""
    return _forward(q, k, v, ids, bounds, block, interpret, windowed)[0]


def _packed_fwd(q, k, v, ids, bounds, block, interpret, windowed):
    out, lse = _forward(q, k, v, ids, bounds, block, interpret, windowed)
    return out, (q, k, v, ids, bounds, out, lse)


def _packed_bwd(block, interpret, windowed, residuals, d_out):
    q, k, v, ids, bounds, out, lse = residuals
    r, t, h, hd = q.shape
    kvh = k.shape[2]
    groups = h // kvh
    sp = _specs(q.shape, groups, block)
    delta = jnp.einsum("rthd,rthd->rht", out.astype(jnp.float32), d_out.astype(jnp.float32))
    do = d_out.astype(q.dtype)
    params = None if interpret else _compiler_params(hd)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block=block, windowed=windowed),
        grid=(r, h, t // block),
        in_specs=[sp["tile"], sp["row_kv"], sp["row_kv"]] + [sp["ids"]] * 7 + [sp["tile"], sp["stat_tile"], sp["stat_tile"]],
        out_specs=sp["tile"], out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params, interpret=interpret, name="packed_attention_dq",
    )(q, k, v, *ids, *bounds[:3], do, lse, delta)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block=block, query_tiles=t // block, windowed=windowed),
        grid=(r, h, t // block),
        in_specs=[sp["row_q"], sp["tile_kv"], sp["tile_kv"]] + [sp["ids"]] * 5 + [sp["row_q"], sp["stat_row"], sp["stat_row"]],
        out_specs=[sp["tile"], sp["tile"]],
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32)] * 2,
        compiler_params=params, interpret=interpret, name="packed_attention_dkv",
    )(q, k, v, *ids, bounds[3], do, lse, delta)
    per_key_head = lambda x: x.reshape(r, t, kvh, groups, hd).sum(axis=3)  # noqa: E731
    return dq, per_key_head(dk).astype(k.dtype), per_key_head(dv).astype(v.dtype), None, None


_packed.defvjp(_packed_fwd, _packed_bwd)


def packed_flash(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, branch: jax.Array, *,
                 positions: jax.Array | None = None, window: int | jax.Array | None = None, block: int = BLOCK,
                 interpret: bool = False) -> jax.Array:
    """`attention.packed_attention` on the fused kernel. q [R,T,H,hd], k/v [R,T,KV,hd],
    segment/branch int[R,T] -> [R,T,H,hd] in q's dtype; a query that sees no key gets 0.
    window (an int or a traced int32 scalar, with positions int[R,T]): query t also sees only
    keys less than `window` positions before its own. Rows are padded to a multiple of `block`
    (padding slots: segment 0). interpret: run the kernels in the Pallas interpreter (any
    backend; for tests)."""
    r, t, h, hd = q.shape
    if not supports(hd):
        raise ValueError(f"packed_flash takes head_dim a power of two >= 16, got {hd}")
    windowed = window is not None
    if windowed and positions is None:
        raise ValueError("packed_flash with a window needs the tokens' positions")
    tp = -(-t // block) * block
    pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    segment, branch = pad(jnp.asarray(segment, jnp.int32)), pad(jnp.asarray(branch, jnp.int32))
    pos = pad(jnp.asarray(positions, jnp.int32)) if windowed else jnp.zeros_like(segment)
    low = pos - jnp.asarray(window, jnp.int32) + 1 if windowed else pos  # the lowest position each query sees
    qs = (q * jnp.asarray(hd**-0.5, q.dtype)).astype(k.dtype)
    bounds = tuple(x.astype(jnp.int32) for x in slot_runs(segment, branch))
    out = _packed(pad(qs), pad(k), pad(v), (segment, branch, pos, low), bounds, block, interpret, windowed)
    return out[:, :t].astype(q.dtype)
