"""Grouped matrix products: rows sorted by group times each group's own weights, exact and
differentiable, on every platform.

    grouped_matmul: x [M, K] (rows sorted by group) x w [G, K, N] per-group weights, sizes
                    int32[G] -> [M, N]. One `jax.lax.ragged_dot` on GPU/TPU; on CPU, where
                    ragged_dot lowers to a dense product over every group (an [M, G x K] masked
                    copy of the rows), a loop over row tiles that touches only each tile's own
                    groups (`tiled_grouped_matmul`, with its own gradient)

What a mixture-of-experts layer (`jmarl.models.moe`) runs its (token, expert) pairs through.
Inside a `shard_map` with type checks, loop carries and cotangents are typed by the mesh axes
they vary over (`varying_like`, `_summed_like`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Rows per tile of the CPU grouped product: the loop's steps are [TILE, K] x [K, N] products.
GROUPED_TILE = 128


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """x [M, K] whose rows are sorted by group (group g: the sizes[g] rows after groups < g),
    w [G, K, N], sizes int32[G] (sum <= M) -> [M, N] in x's dtype: row r of group g is x[r] w[g];
    rows past sum(sizes) are 0. `jax.lax.ragged_dot`, chosen per platform when the program is
    lowered: XLA's ragged-dot instruction on GPU/TPU; on CPU `tiled_grouped_matmul` (XLA:CPU
    lowers ragged_dot to one dense product over every group, through an [M, G x K] copy of the
    rows, which at Qwen3-30B-A3B's G = 128 is 128x the work and the memory)."""
    x, w, sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)
    return jax.lax.platform_dependent(x, w, sizes, cpu=tiled_grouped_matmul, default=ragged_grouped_matmul)


def _broadcast(a: jax.Array, batched: bool, size: int) -> jax.Array:
    """a with a leading batch axis of `size` (a itself when it has one)."""
    return a if batched else jnp.broadcast_to(a, (size,) + a.shape)


@jax.custom_batching.custom_vmap
def _ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot` that vmaps with any of its arguments unbatched."""
    return jax.lax.ragged_dot(x, w, sizes)


@_ragged_dot.def_vmap
def _ragged_dot_vmap(size: int, batched: list[bool], x: jax.Array, w: jax.Array, sizes: jax.Array):
    # ragged_dot's own batching rule takes only arguments all batched on axis 0 (JAX 0.10): an
    # unbatched one (a LoRA base shared by the stacked policies: w) is broadcast, one layer's
    # experts at a time
    args = [_broadcast(a, b, size) for a, b in zip((x, w, sizes), batched)]
    return jax.vmap(jax.lax.ragged_dot)(*args), True


@jax.custom_batching.custom_vmap
def _ragged_dot_grads(x: jax.Array, w: jax.Array, sizes: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of `jax.lax.ragged_dot(x, w, sizes)` for the output cotangent dy."""
    return jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)[1](dy)


@_ragged_dot_grads.def_vmap
def _ragged_dot_grads_vmap(size: int, batched: list[bool], x: jax.Array, w: jax.Array, sizes: jax.Array,
                           dy: jax.Array):
    args = [_broadcast(a, b, size) for a, b in zip((x, w, sizes, dy), batched)]
    dx, dw = jax.vmap(lambda x, w, s, d: jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, s), x, w)[1](d))(*args)
    if not batched[1]:  # w is shared by the batch: its cotangent sums over it
        return (dx, jnp.sum(dw, axis=0)), (True, False)
    return (dx, dw), (True, True)


@jax.custom_vjp
def ragged_grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """`grouped_matmul` as `jax.lax.ragged_dot` (the GPU/TPU form), in a form that vmaps with w
    unbatched (ragged_dot's own rule refuses it): the stacked policies' update and scoring vmap
    the layers over one shared LoRA base. Same numbers and gradients as ragged_dot."""
    return _ragged_dot(x, w, sizes)


def _ragged_fwd(x: jax.Array, w: jax.Array, sizes: jax.Array):
    return _ragged_dot(x, w, sizes), (x, w, sizes)


def _ragged_bwd(res, dy: jax.Array):
    x, w, sizes = res
    dx, dw = _ragged_dot_grads(x, w, sizes, dy)
    return _summed_like(dx, x), _summed_like(dw, w), None


ragged_grouped_matmul.defvjp(_ragged_fwd, _ragged_bwd)


def _work_items(sizes: jax.Array, num_tiles: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The (row tile, group) pairs that hold rows, for rows sorted by group in `num_tiles` tiles
    of `tile` rows: (tile int32[W], group int32[W], count int32[]): the first `count` items are
    the pairs, in row order; W = num_tiles + G - 1 is the most there can be (each group spans
    its tiles; consecutive groups share at most one)."""
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    count = jnp.where(sizes > 0, (ends - 1) // tile - first + 1, 0)  # tiles group g spans
    item_ends = jnp.cumsum(count)
    i = jnp.arange(num_tiles + g - 1, dtype=jnp.int32)
    # the group of item i: how many groups end at or before it (a [W, G] comparison, no loop)
    group = jnp.minimum(jnp.sum(item_ends[None, :] <= i[:, None], axis=1), g - 1).astype(jnp.int32)
    tiles = jnp.clip(first[group] + i - (item_ends - count)[group], 0, num_tiles - 1).astype(jnp.int32)
    return tiles, group, item_ends[-1].astype(jnp.int32)


def _row_mask(sizes: jax.Array, tile_index: jax.Array, group: jax.Array, tile: int) -> jax.Array:
    """bool[tile]: which rows of tile `tile_index` belong to `group`."""
    ends = jnp.cumsum(sizes)
    rows = tile_index * tile + jnp.arange(tile)
    return (rows >= ends[group] - sizes[group]) & (rows < ends[group])


def _tiles(x: jax.Array, tile: int) -> jax.Array:
    """x [M, K] -> [ceil(M / tile), tile, K], zero rows appended."""
    t = -(-x.shape[0] // tile)
    return jnp.pad(x, ((0, t * tile - x.shape[0]), (0, 0))).reshape(t, tile, x.shape[1])


def varying_like(zeros: jax.Array, *refs: jax.Array) -> jax.Array:
    """`zeros` typed as varying over every manual mesh axis that one of `refs` varies over, so a
    loop carry started from it has the type of the carry the body makes (inside a `shard_map`
    that checks types; elsewhere nothing varies and `zeros` is returned as it is)."""
    vma = frozenset().union(*(_varying_axes(r) for r in refs))
    missing = tuple(sorted(vma - _varying_axes(zeros)))
    return jax.lax.pcast(zeros, missing, to="varying") if missing else zeros


def _summed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent `ct` summed over the manual mesh axes it varies over and `primal` does not
    (inside `shard_map` the primal was implicitly broadcast over them: the transpose sums), so
    it has the primal's type."""
    extra = tuple(sorted(_varying_axes(ct) - _varying_axes(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


def _varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes `x` varies over (its type's `vma`; `manual_axis_type.varying` in the
    JAX versions that renamed it)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(aval, "vma", ()))


def _grouped_forward(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """`grouped_matmul` as a loop over the (tile, group) work items that hold rows: each step one
    [tile, K] x [K, N] product (float32 accumulation), whose rows of that group are written into
    the tile's output. The work is the rows' M' x K x N (M' = sum(sizes), in whole tiles) plus at
    most G - 1 extra tile products; the memory the output. Not differentiable itself (a loop of
    data-dependent length): `tiled_grouped_matmul` gives its gradient."""
    x, w, sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)
    m = x.shape[0]
    tile = max(1, min(GROUPED_TILE, m))
    xt = _tiles(x, tile)
    tiles, groups, count = _work_items(sizes, xt.shape[0], tile)

    def step(i: jax.Array, out: jax.Array) -> jax.Array:
        ti, gi = tiles[i], groups[i]
        y = jnp.dot(xt[ti], w[gi], preferred_element_type=jnp.float32).astype(out.dtype)
        keep = _row_mask(sizes, ti, gi, tile)[:, None]
        return jax.lax.dynamic_update_index_in_dim(out, jnp.where(keep, y, out[ti]), ti, 0)

    out0 = varying_like(jnp.zeros((xt.shape[0], tile, w.shape[2]), x.dtype), x, w, sizes)
    return jax.lax.fori_loop(0, count, step, out0).reshape(-1, w.shape[2])[:m]


def _grouped_weight_grad(x: jax.Array, dy: jax.Array, sizes: jax.Array, num_groups: int) -> jax.Array:
    """sum over the rows r of group g of x[r]^T dy[r], for x [M, K], dy [M, N] sorted by group
    -> float32[G, K, N] (the weight gradient of `grouped_matmul`), by the same work items."""
    m = x.shape[0]
    tile = max(1, min(GROUPED_TILE, m))
    xt, dyt = _tiles(x, tile), _tiles(dy, tile)
    tiles, groups, count = _work_items(sizes, xt.shape[0], tile)

    def step(i: jax.Array, dw: jax.Array) -> jax.Array:
        ti, gi = tiles[i], groups[i]
        rows = jnp.where(_row_mask(sizes, ti, gi, tile)[:, None], xt[ti], 0)
        return dw.at[gi].add(jnp.dot(rows.T, dyt[ti], preferred_element_type=jnp.float32))

    dw0 = varying_like(jnp.zeros((num_groups, x.shape[1], dy.shape[1]), jnp.float32), x, dy, sizes)
    return jax.lax.fori_loop(0, count, step, dw0)


@jax.custom_vjp
def tiled_grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """`grouped_matmul` by row tiles (`_grouped_forward`), with the grouped backward written
    out: dx = grouped_matmul(dy, w^T), dw = per-group x^T dy (`_grouped_weight_grad`), so the
    backward keeps only x and w (no per-step residuals of the loop)."""
    return _grouped_forward(x, w, sizes)


def _tiled_fwd(x: jax.Array, w: jax.Array, sizes: jax.Array):
    return _grouped_forward(x, w, sizes), (x, w, sizes)


def _tiled_bwd(res, dy: jax.Array):
    x, w, sizes = res
    dx = _grouped_forward(dy.astype(x.dtype), jnp.swapaxes(w, 1, 2), sizes)
    dw = _grouped_weight_grad(x, dy.astype(x.dtype), sizes, w.shape[0])
    return _summed_like(dx, x), _summed_like(dw, w).astype(w.dtype), None


tiled_grouped_matmul.defvjp(_tiled_fwd, _tiled_bwd)
