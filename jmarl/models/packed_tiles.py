"""Which slots and tiles of packed rows a query may read (`jmarl.models.attention.packed_attention`).

Packed rows (segment int[R,T]: 0 = padding, else a run id; branch int[R,T]: 0 = the segment's
prompt, b > 0 its b-th continuation) are made of runs of equal ids; the blockwise kernel visits,
for each query tile, only the key tiles of its segment's prompt and of its own branch onward
(`packed_tiles`), so a continuation's siblings cost nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def run_bounds(new_run: jax.Array, ends_run: jax.Array) -> tuple[jax.Array, jax.Array]:
    """new_run/ends_run bool[R,T] (a run starts / ends at this slot) -> (start, end) int[R,T]:
    the first slot of each slot's run and one past its last."""
    t = new_run.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), new_run.shape)
    start = jax.lax.cummax(jnp.where(new_run, idx, 0), axis=1)
    end = jax.lax.cummin(jnp.where(ends_run, idx + 1, t), axis=1, reverse=True)
    return start, end


def runs_of(ids: tuple[jax.Array, ...], pad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(start, end) int[R,T] of the runs of slots on which every array of `ids` [R,T] stays
    equal; a padding slot (pad bool[R,T]) is a run of its own."""
    r = pad.shape[0]
    change = functools.reduce(jnp.logical_or, [x[:, 1:] != x[:, :-1] for x in ids])
    edge = jnp.ones((r, 1), bool)
    return run_bounds(jnp.concatenate([edge, change], axis=1) | pad, jnp.concatenate([change, edge], axis=1) | pad)


def segment_bounds(segment: jax.Array) -> tuple[jax.Array, jax.Array]:
    """segment int[R,T] -> (start, end) int[R,T]: the first slot of each slot's run of equal
    non-zero ids and one past its last; a padding slot (0) is a run of its own."""
    return runs_of((segment,), segment == 0)


def slot_runs(segment: jax.Array, branch: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """segment/branch int[R,W] -> four int[R,W]: for each slot, the first slot of its segment, one
    past its segment's prompt, the first slot of its own run (prompt or branch), and one past
    the last query that can see it as a key (its segment's end for a prompt slot, its branch's
    end otherwise). A padding slot is a run of its own that only itself reads."""
    w = segment.shape[1]
    idx = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), segment.shape)
    pad = segment == 0
    seg_start, seg_end = runs_of((segment,), pad)
    own_start, own_end = runs_of((segment, branch), pad)
    first = lambda x: jnp.take_along_axis(x, seg_start, axis=1)  # noqa: E731  the segment's first slot's value
    prompt_end = jnp.where(first(branch) == 0, first(own_end), seg_start)
    visible_until = jnp.where(pad, idx + 1, jnp.where(branch == 0, seg_end, own_end))
    return seg_start, prompt_end, own_start, visible_until


def packed_tiles(
    segment: jax.Array, branch: jax.Array, bq: int, bk: int, nq: int, nk: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The tiles the packed blockwise kernel visits. segment/branch int[R,W] (W >= nq*bq and
    nk*bk) -> (prompt_lo, prompt_hi, own_lo) int[nq] and query_hi int[nk]. Query tile i reads
    key tiles [prompt_lo, prompt_hi) (the prompt of the segment its first query lies in) and
    [own_lo, its diagonal) (that query's own branch onward: every later query's branch and, in
    a later segment, its prompt): a continuation's siblings are skipped, so a group of G
    continuations costs about G tiles each rather than G^2 / 2. Key tile j is read by query
    tiles [j*bk // bq, query_hi[j]): up to the end of its keys' segment for a prompt key, of
    its branch otherwise. Each bound is the loosest over the R rows."""
    seg_start, prompt_end, own_start, visible_until = slot_runs(segment, branch)
    q0 = jnp.arange(nq) * bq
    prompt_lo = jnp.min(seg_start[:, q0], axis=0) // bk
    prompt_hi = -(-jnp.max(prompt_end[:, q0], axis=0) // bk)
    own_lo = jnp.min(own_start[:, q0], axis=0) // bk
    per_key_tile = visible_until[:, : nk * bk].reshape(-1, nk, bk).max(axis=(0, 2))
    query_hi = jnp.minimum(-(-per_key_tile // bq), nq)
    return prompt_lo, prompt_hi, own_lo, query_hi
