"""Group-relative advantages and group filters (docs/algorithms.md section 1).

Groups are arbitrary int ids in [0, num_groups); id -1 (or any id outside that range) marks a
padding row that belongs to no group (`jmarl.train.learner.policy_samples` pads with -1). Every statistic is a
segment reduction, so any grouping (per prompt, per (env, turn, agent), per tree node) is one
call with static shapes, and every function is `jax.jit`- and `jax.vmap`-able. The options that
reproduce verl's, TRL's, CoMLRL's and PettingLLMs' numbers (`eps_mode`, `normalize="batch"`,
`variance_rank`) are listed in docs/fidelity.md.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.errors import JmarlError

BASELINES = ("mean", "max", "loo", "none")
NORMALIZERS = ("std", "batch", "none")
EPS_MODES = ("add", "floor")
VARIANCE_RANKS = ("std", "range_normalised")


class GroupStats(NamedTuple):
    """Per-group statistics, each [num_groups] (empty groups: count 0, everything else 0)."""

    count: jax.Array
    sum: jax.Array
    mean: jax.Array
    std: jax.Array
    max: jax.Array
    min: jax.Array


def _segments(groups: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
    """Segment ids [N] with invalid rows sent to a spare segment `num_groups`; valid mask [N]."""
    groups = jnp.asarray(groups)
    valid = (groups >= 0) & (groups < num_groups)
    return jnp.where(valid, groups, num_groups).astype(jnp.int32), valid


def _segment_var(
    values: jax.Array, seg: jax.Array, valid: jax.Array, mean: jax.Array, count: jax.Array, ddof: int
) -> jax.Array:
    """Variance [S] of values f32[N] per segment about `mean` [S], divided by max(count - ddof, 1)."""
    sq_dev = jnp.where(valid, jnp.square(values - mean[seg]), 0.0)
    return jax.ops.segment_sum(sq_dev, seg, num_segments=mean.shape[0]) / jnp.maximum(count - ddof, 1.0)


def _stats(values: jax.Array, seg: jax.Array, valid: jax.Array, num_groups: int, ddof: int) -> GroupStats:
    """GroupStats over num_groups + 1 segments (the last one collects padding rows)."""
    n_seg = num_groups + 1
    values = jnp.where(valid, values, 0.0)
    count = jax.ops.segment_sum(valid.astype(values.dtype), seg, num_segments=n_seg)
    total = jax.ops.segment_sum(values, seg, num_segments=n_seg)
    mean = total / jnp.maximum(count, 1.0)
    var = _segment_var(values, seg, valid, mean, count, ddof)
    nonempty = count > 0
    high = jnp.where(nonempty, jax.ops.segment_max(values, seg, num_segments=n_seg), 0.0)
    low = jnp.where(nonempty, jax.ops.segment_min(values, seg, num_segments=n_seg), 0.0)
    return GroupStats(count, total, mean, jnp.sqrt(var), high, low)


def group_stats(values: jax.Array, groups: jax.Array, *, num_groups: int, ddof: int = 1) -> GroupStats:
    """Count, sum, mean, std (with `ddof`), max and min of values f32[N] per group -> [num_groups] each."""
    values = jnp.asarray(values, jnp.float32)
    seg, valid = _segments(groups, num_groups)
    full = _stats(values, seg, valid, num_groups, ddof)
    return GroupStats(*(x[:num_groups] for x in full))


def _batch_std(values: jax.Array, valid: jax.Array, ddof: int) -> jax.Array:
    """Scalar std (with `ddof`) of the valid entries of values f32[N]; 0 when there are none."""
    count = jnp.sum(valid.astype(values.dtype))
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(count, 1.0)
    sq_dev = jnp.where(valid, jnp.square(values - mean), 0.0)
    return jnp.sqrt(jnp.sum(sq_dev) / jnp.maximum(count - ddof, 1.0))


def _scale(centered: jax.Array, std: jax.Array, eps: float, eps_mode: str) -> jax.Array:
    """centered f32[N] / (std + eps) with eps_mode "add", / max(std, eps) with "floor"; std [N] or scalar."""
    if eps_mode == "floor":
        return centered / jnp.maximum(std, eps)
    return centered / (std + eps)


def _check_choice(func: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise JmarlError naming the option and its choices when value is not one of them."""
    if value not in choices:
        raise JmarlError(f"{func} {name}={value!r}; choose one of {choices}")


def group_advantages(
    rewards: jax.Array,
    groups: jax.Array,
    *,
    num_groups: int,
    baseline: str = "mean",
    normalize: str = "std",
    ddof: int = 1,
    eps: float = 1e-6,
    eps_mode: str = "add",
) -> jax.Array:
    """Group-relative advantages f32[N] from rewards f32[N] and group ids int[N].

    A_i = (r_i - b_g(i)) / (s + eps) with eps_mode "add" (default), or / max(s, eps) with
    "floor" (CoMLRL's MAGRPO). The scale s is the group's std with `normalize="std"`, the std of
    every valid (non-padding) reward of the batch with "batch" (TRL's scale_rewards="batch"; the
    baseline stays per group), and there is no division with "none". Both stds use `ddof`.
    Baselines: "mean" (group mean), "max" (group max, ReMax), "loo" (mean of the other members),
    "none" (0). A singleton group, a group whose rewards are all equal, and a padding row
    (group -1) get advantage 0.
    """
    _check_choice("group_advantages", "baseline", baseline, BASELINES)
    _check_choice("group_advantages", "normalize", normalize, NORMALIZERS)
    _check_choice("group_advantages", "eps_mode", eps_mode, EPS_MODES)
    rewards = jnp.asarray(rewards, jnp.float32)
    seg, valid = _segments(groups, num_groups)
    stats = _stats(rewards, seg, valid, num_groups, ddof)
    count = stats.count[seg]
    if baseline == "mean":
        base = stats.mean[seg]
    elif baseline == "max":
        base = stats.max[seg]
    elif baseline == "loo":
        base = (stats.sum[seg] - rewards) / jnp.maximum(count - 1.0, 1.0)
    else:
        base = jnp.zeros_like(rewards)
    centered = rewards - base
    if normalize == "std":
        centered = _scale(centered, stats.std[seg], eps, eps_mode)
    elif normalize == "batch":
        centered = _scale(centered, _batch_std(rewards, valid, ddof), eps, eps_mode)
    informative = valid & (count >= 2) & (stats.max[seg] > stats.min[seg])
    return jnp.where(informative, centered, 0.0)


def _rank_within_present(key: jax.Array, present: jax.Array) -> jax.Array:
    """Rank int[G] of each group by ascending key (ties: lower id first); absent groups last."""
    order = jnp.argsort(jnp.where(present, key, jnp.inf), stable=True)
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _lowest_fraction(key: jax.Array, present: jax.Array, frac: float) -> jax.Array:
    """bool[G]: the floor(frac * #present) present groups with the lowest key."""
    num_groups = key.shape[0]
    # floor(frac * n) for every possible n, computed exactly on the host (frac is static).
    table = jnp.asarray(np.floor(frac * np.arange(num_groups + 1)).astype(np.int32))
    num_drop = table[jnp.sum(present.astype(jnp.int32))]
    return present & (_rank_within_present(key, present) < num_drop)


def _scaled_square_deviations(rewards: jax.Array, seg: jax.Array, valid: jax.Array, stats: GroupStats) -> jax.Array:
    """sum_i (n * r_i - S)^2 per segment [G + 1] (n: count, S: sum) = n^2 * sum_i (r_i - mean)^2.

    No division enters, so for rewards that are short binary fractions (0, 0.25, 0.5, 1, ...) every
    term and the sum are exact in float32, whatever the order of the group's members.
    """
    scaled_dev = jnp.where(valid, stats.count[seg] * rewards - stats.sum[seg], 0.0)
    return jax.ops.segment_sum(jnp.square(scaled_dev), seg, num_segments=stats.count.shape[0])


def _variance_key(rewards: jax.Array, seg: jax.Array, valid: jax.Array, stats: GroupStats, ddof: int) -> jax.Array:
    """Ranking key [G + 1]: the variance with `ddof`, as one division sum (n r - S)^2 / (n^2 max(n - ddof, 1)).

    Same order as the std; groups with mathematically equal variances get bit-identical keys
    whenever the sums are exact (see `_scaled_square_deviations`), so their tie goes by group id.
    """
    n = jnp.maximum(stats.count, 1.0)
    denominator = n * n * jnp.maximum(stats.count - ddof, 1.0)
    return _scaled_square_deviations(rewards, seg, valid, stats) / denominator


def _range_normalised_variance(rewards: jax.Array, seg: jax.Array, valid: jax.Array, stats: GroupStats) -> jax.Array:
    """PettingLLMs' key [G + 1]: population variance (ddof 0) / (max - min)^2, 0 where max == min.

    One division sum (n r - S)^2 / (n^3 (max - min)^2), so equal keys are bit-identical whenever
    the sums are exact (see `_scaled_square_deviations`).
    """
    n = jnp.maximum(stats.count, 1.0)
    spread = stats.max - stats.min
    denominator = n * n * n * jnp.square(jnp.where(spread > 0, spread, 1.0))
    return jnp.where(spread > 0, _scaled_square_deviations(rewards, seg, valid, stats) / denominator, 0.0)


def filter_groups(
    rewards: jax.Array,
    groups: jax.Array,
    *,
    num_groups: int,
    drop_zero_variance: bool = False,
    drop_low_variance_frac: float = 0.0,
    drop_low_mean_frac: float = 0.0,
    ddof: int = 1,
    variance_rank: str = "std",
) -> jax.Array:
    """Per-sample keep mask bool[N] from rewards f32[N] and group ids int[N] (static shapes).

    Each filter is decided on the full set of non-empty groups and the kept samples are those
    that pass all of them: `drop_zero_variance` drops groups whose rewards are all equal
    (singletons included; DAPO dynamic sampling); `drop_low_variance_frac` drops the
    floor(frac * #groups) groups with the lowest reward spread, ranked by `variance_rank`:
    "std" (the std with `ddof`, ranked through the variance) or "range_normalised"
    (PettingLLMs: population variance / (max - min)^2, 0 for a group whose rewards are all
    equal; `ddof` does not enter); `drop_low_mean_frac` the floor(frac * #groups) with the
    lowest mean reward. Padding rows (group -1) are never kept.

    Tie rule (every ranking here and in `top_k_groups`): groups with equal float32 keys rank by
    group id, the lower id first, so the lower id is dropped first. Each key is one float32
    division of sums formed without dividing (the mean S / n; the variance
    sum (n r - S)^2 / (n^2 max(n - ddof, 1)); the range-normalised variance
    sum (n r - S)^2 / (n^3 (max - min)^2)), so for rewards that are short binary fractions
    (0, 0.25, 0.5, 1, ...) the key is the exact value rounded once: mathematically equal keys are
    bit-identical, whatever the group sizes and the order of the members.
    """
    _check_choice("filter_groups", "variance_rank", variance_rank, VARIANCE_RANKS)
    fractions = {"drop_low_variance_frac": drop_low_variance_frac, "drop_low_mean_frac": drop_low_mean_frac}
    for name, frac in fractions.items():
        if not 0.0 <= frac <= 1.0:
            raise JmarlError(f"filter_groups {name}={frac!r} must lie in [0, 1]")
    rewards = jnp.asarray(rewards, jnp.float32)
    seg, valid = _segments(groups, num_groups)
    full = _stats(rewards, seg, valid, num_groups, ddof)
    stats = GroupStats(*(x[:num_groups] for x in full))
    present = stats.count > 0
    drop = jnp.zeros((num_groups,), bool)
    if drop_zero_variance:
        drop = drop | (present & (stats.max <= stats.min))
    if drop_low_variance_frac > 0.0:
        if variance_rank == "range_normalised":
            spread_key = _range_normalised_variance(jnp.where(valid, rewards, 0.0), seg, valid, full)[:num_groups]
        else:
            spread_key = _variance_key(rewards, seg, valid, full, ddof)[:num_groups]
        drop = drop | _lowest_fraction(spread_key, present, drop_low_variance_frac)
    if drop_low_mean_frac > 0.0:
        drop = drop | _lowest_fraction(stats.mean, present, drop_low_mean_frac)
    drop_full = jnp.concatenate([drop, jnp.ones((1,), bool)])
    return valid & ~drop_full[seg]


def top_k_groups(
    rewards: jax.Array, groups: jax.Array, *, num_groups: int, k: int, ddof: int = 1
) -> tuple[jax.Array, jax.Array]:
    """The k non-empty groups with the highest reward variance: (keep bool[N], selected bool[G]).

    Groups rank by the variance with `ddof` (the same order as the std), computed as in
    `filter_groups`: mathematically equal variances of short-binary-fraction rewards give
    bit-identical keys, and equal keys go to the lower group id. With fewer than k non-empty
    groups all of them are selected. Padding rows are never kept.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    seg, valid = _segments(groups, num_groups)
    full = _stats(rewards, seg, valid, num_groups, ddof)
    present = full.count[:num_groups] > 0
    variance = _variance_key(rewards, seg, valid, full, ddof)[:num_groups]
    selected = present & (_rank_within_present(-variance, present) < k)
    selected_full = jnp.concatenate([selected, jnp.zeros((1,), bool)])
    return valid & selected_full[seg], selected
