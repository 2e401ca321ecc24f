"""The jitted policy update: mini-batches, gradient accumulation, non-finite skip, policy vmap.

A loss function has the signature `loss_fn(trainable, frozen, batch) -> (loss, metrics)`:
`trainable` is what the optimizer updates (full parameters, or LoRA adapters), `frozen` what it
does not (None, or the LoRA base), `batch` a pytree of arrays with a leading sample axis N. A
`jmarl.batch.LearnerBatch` micro-batch arrives with `update_index` (the index m of the optimizer
update within the step) and the mini-batch's counts `num_tokens` / `num_rows` (its trained
tokens and rows divided by the number of micro-batches) filled in, so that a loss normalised by
them is the exact mean over the whole mini-batch under gradient accumulation.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jmarl.batch import LearnerBatch
from jmarl.errors import JmarlError

Params = Any
Batch = dict[str, jax.Array]

# loss metrics reported from the step's first optimizer update alone (mean over its micro-batches):
# they compare the learner with the policy that sampled the batch, which later updates have moved
FIRST_UPDATE_METRICS = frozenset({"logprob_diff_max", "logprob_diff_mean"})
LossFn = Callable[[Params, Params, Batch], tuple[jax.Array, dict[str, jax.Array]]]


@struct.dataclass
class TrainState:
    """What one policy's optimizer carries: trainable params, optax state, counters (int32[])."""

    params: Params
    opt_state: optax.OptState
    step: jax.Array
    skipped: jax.Array


def low_precision_leaves(params: Params) -> list[tuple[str, str]]:
    """(path, dtype name) of every floating-point leaf of `params` narrower than float32."""
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        dtype = jnp.dtype(dtype)
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            found.append((jax.tree_util.keystr(path), dtype.name))
    return found


def init_train_state(
    params: Params, optimizer: optax.GradientTransformation, *, allow_low_precision: bool = False
) -> TrainState:
    """A fresh state: optimizer initialised on `params` (the trainable tree), counters at 0.

    Trainable floating-point leaves must be float32 (or wider): AdamW updates of bfloat16/float16
    weights are mostly below their resolution and round away, so such a tree is refused with a
    JmarlError unless `allow_low_precision=True` (benchmarks that measure bf16 throughput, say).
    Keep float32 master parameters and compute in bfloat16 (`ModelConfig.compute_dtype`).
    """
    if not allow_low_precision:
        low = low_precision_leaves(params)
        if low:
            path, dtype = low[0]
            raise JmarlError(
                f"init_train_state: {len(low)} trainable parameter(s) are stored below float32 (first: "
                f"{path or 'params'} is {dtype}), and optimizer updates below their resolution round away; "
                "keep float32 master parameters and compute in bfloat16 (model.param_dtype=float32 "
                "model.compute_dtype=bfloat16; for a ModelConfig, param_dtype='float32', "
                "compute_dtype='bfloat16'), or pass allow_low_precision=True"
            )
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
    )


def _all_finite(tree: Params) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _any_nonzero(tree: Params) -> jax.Array:
    leaves = [jnp.any(x != 0) for x in jax.tree.leaves(tree)]
    return jnp.any(jnp.stack(leaves)) if leaves else jnp.array(False)


def split_minibatches(batch: Batch, num_minibatches: int, grad_accum: int) -> Batch:
    """[R, ...] -> [num_minibatches, grad_accum, R / (num_minibatches * grad_accum), ...] for
    every leaf: consecutive blocks of rows form the micro-batches. Leaves may have different row
    counts R (the N samples; a shared-prefix batch's prefixes, laid out per micro-batch)."""
    parts = num_minibatches * grad_accum
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        if x.shape[0] % parts:
            raise JmarlError(
                f"batch field {jax.tree_util.keystr(path)} has {x.shape[0]} rows, which do not split "
                f"into {num_minibatches} mini-batches x {grad_accum} accumulation steps; pad it to a "
                f"multiple of {parts}"
            )
    return jax.tree.map(
        lambda x: x.reshape(num_minibatches, grad_accum, x.shape[0] // parts, *x.shape[1:]), batch
    )


def minibatch_fields(mb: Batch, index: jax.Array, grad_accum: int) -> Callable[[Batch], Batch]:
    """A function that fills a micro-batch of mini-batch `mb` ([grad_accum, rows, ...] leaves)
    with `update_index` and the mini-batch's counts per micro-batch (trained tokens and rows,
    summed over the mini-batch and divided by grad_accum), when it is a `LearnerBatch`."""
    if not isinstance(mb, LearnerBatch):
        return lambda micro_batch: micro_batch
    mask = mb.loss_mask
    num_tokens = jnp.sum(mask, dtype=jnp.float32) / grad_accum
    num_rows = jnp.sum(jnp.any(mask, axis=-1), dtype=jnp.float32) / grad_accum
    return lambda micro_batch: micro_batch.replace(update_index=index, num_tokens=num_tokens, num_rows=num_rows)


def make_update(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    num_minibatches: int = 1,
    grad_accum: int = 1,
    epochs: int = 1,
    constrain: Callable[[Batch], Batch] | None = None,
) -> Callable[[TrainState, Params, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """A pure `update(state, frozen, batch) -> (state, metrics)` for one policy (not jitted).

    The batch is cut into `num_minibatches` optimizer updates, each averaging the gradients of
    `grad_accum` equal micro-batches; `epochs` passes go over the same mini-batches (in the
    same order), `epochs x num_minibatches` updates in all, numbered by `update_index`. An update
    whose loss or gradient is not finite is skipped: parameters and optimizer state stay as they
    were and `skipped` counts it. An update whose gradient is exactly zero (every advantage 0 and
    no other loss term) is not applied either, so that no signal moves nothing: AdamW would
    otherwise move the parameters by its momentum and decay them (metric `zero_gradient`, the
    fraction of such updates).
    Metrics are averaged over mini-batches, except `FIRST_UPDATE_METRICS`, which are the first
    update's (before any parameter moved); `grad_norm` is the global norm before clipping.
    `constrain` maps the split batch [minibatches, grad_accum, rows, ...] to itself (a sharding
    constraint: `jmarl.sharding.microbatch_rows`).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def update(state: TrainState, frozen: Params, batch: Batch):
        def grads_of(params, micro_batch):
            (loss, metrics), grads = grad_fn(params, frozen, micro_batch)
            return grads, loss, metrics

        def minibatch_update(state: TrainState, mb_and_index):
            mb, index = mb_and_index
            fill = minibatch_fields(mb, index, grad_accum)
            shapes = jax.eval_shape(grads_of, state.params, fill(jax.tree.map(lambda x: x[0], mb)))
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def micro(acc, micro_batch):
                return jax.tree.map(jnp.add, acc, grads_of(state.params, fill(micro_batch))), None

            summed, _ = jax.lax.scan(micro, zeros, mb)
            grads, loss, metrics = jax.tree.map(lambda x: x / grad_accum, summed)

            finite = jnp.isfinite(loss) & _all_finite(grads)
            signal = _any_nonzero(grads)
            apply = finite & signal
            updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
            new_params = optax.apply_updates(state.params, updates)
            keep = lambda new, old: jnp.where(apply, new, old)  # noqa: E731
            new_state = TrainState(
                params=jax.tree.map(keep, new_params, state.params),
                opt_state=jax.tree.map(keep, new_opt, state.opt_state),
                step=state.step + apply.astype(jnp.int32),
                skipped=state.skipped + (~finite).astype(jnp.int32),
            )
            metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                           zero_gradient=(finite & ~signal).astype(jnp.float32))
            return new_state, metrics

        mbs = split_minibatches(batch, num_minibatches, grad_accum)
        if constrain is not None:  # e.g. spread every micro-batch's rows over the mesh
            mbs = constrain(mbs)
        def epoch(state: TrainState, e: jax.Array):
            indices = e * num_minibatches + jnp.arange(num_minibatches, dtype=jnp.int32)
            return jax.lax.scan(minibatch_update, state, (mbs, indices))

        state, metrics = jax.lax.scan(epoch, state, jnp.arange(epochs, dtype=jnp.int32))
        return state, {k: m[0, 0] if k in FIRST_UPDATE_METRICS else jnp.mean(m, axis=(0, 1)) for k, m in metrics.items()}

    return update


def vmap_update(update, *, stacked: bool = False, frozen_stacked: bool = False, policy_axis: str | None = None):
    """`update` itself, or with `stacked` vmapped over a leading policy axis: `frozen_stacked`
    says whether the frozen tree (LoRA base) is per policy too or shared; `policy_axis`: the mesh
    axis the stacked policy axis is sharded on (vmap's spmd_axis_name)."""
    if not stacked:
        return update
    return jax.vmap(update, in_axes=(0, 0 if frozen_stacked else None, 0), spmd_axis_name=policy_axis)


def jit_update(update, *, stacked: bool = False, frozen_stacked: bool = False, policy_axis: str | None = None):
    """`vmap_update(update, ...)` jitted with the state donated."""
    fn = vmap_update(update, stacked=stacked, frozen_stacked=frozen_stacked, policy_axis=policy_axis)
    return jax.jit(fn, donate_argnums=(0,))
