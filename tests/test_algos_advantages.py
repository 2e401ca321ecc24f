"""Group advantages, group statistics and group filters against the NumPy reference."""

from __future__ import annotations

import functools

import _np_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jmarl.algos import filter_groups, group_advantages, group_stats, top_k_groups
from jmarl.errors import JmarlError

N, G = 10, 4
SETTINGS = settings(max_examples=25, deadline=None)

# Rewards from a small set, so that ties, constant groups and singletons are common.
rewards_st = hnp.arrays(np.float32, (N,), elements=st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 0.25]))
groups_st = hnp.arrays(np.int32, (N,), elements=st.integers(-1, G - 1))


@functools.cache
def jitted_advantages(baseline, normalize, ddof):
    return jax.jit(functools.partial(group_advantages, num_groups=G, baseline=baseline, normalize=normalize, ddof=ddof))


@SETTINGS
@given(
    rewards=rewards_st,
    groups=groups_st,
    baseline=st.sampled_from(["mean", "max", "loo", "none"]),
    normalize=st.sampled_from(["std", "none"]),
    ddof=st.sampled_from([0, 1]),
)
def test_group_advantages_match_reference(rewards, groups, baseline, normalize, ddof):
    got = jitted_advantages(baseline, normalize, ddof)(rewards, groups)
    want = ref.group_advantages(rewards, groups, G, baseline, normalize, ddof)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_group_advantages_hand_worked():
    # group 0: rewards (1, 0, 1): mean 2/3, std(ddof=1) = sqrt(((1/3)^2*2 + (2/3)^2)/2) = sqrt(1/3)
    # -> A = (1/3)/0.57735 = 0.57735, (-2/3)/0.57735 = -1.1547
    # group 1: (2, 2) constant -> 0; group 2: singleton -> 0; padding row -> 0
    rewards = np.array([1.0, 0.0, 1.0, 2.0, 2.0, 5.0, 7.0], np.float32)
    groups = np.array([0, 0, 0, 1, 1, 2, -1], np.int32)
    got = group_advantages(rewards, groups, num_groups=3)
    np.testing.assert_allclose(got, [0.57735, -1.1547, 0.57735, 0, 0, 0, 0], atol=1e-4)
    # max baseline (ReMax), no normalisation: r - max = (0, -1, 0)
    got = group_advantages(rewards, groups, num_groups=3, baseline="max", normalize="none")
    np.testing.assert_allclose(got, [0, -1, 0, 0, 0, 0, 0], atol=1e-6)
    # leave-one-out: 1 - (0+1)/2 = 0.5, 0 - (1+1)/2 = -1
    got = group_advantages(rewards, groups, num_groups=3, baseline="loo", normalize="none")
    np.testing.assert_allclose(got, [0.5, -1, 0.5, 0, 0, 0, 0], atol=1e-6)


@SETTINGS
@given(rewards=rewards_st, groups=groups_st, shift=st.floats(-50, 50), baseline=st.sampled_from(["mean", "max", "loo"]))
def test_shift_leaves_std_normalised_advantages_unchanged(rewards, groups, shift, baseline):
    f = jitted_advantages(baseline, "std", 1)
    np.testing.assert_allclose(f(rewards + np.float32(shift), groups), f(rewards, groups), atol=2e-4)


@SETTINGS
@given(rewards=rewards_st, groups=groups_st, seed=st.integers(0, 2**31 - 1), baseline=st.sampled_from(["mean", "max", "loo", "none"]))
def test_permuting_samples_permutes_advantages(rewards, groups, seed, baseline):
    perm = np.random.default_rng(seed).permutation(N)
    f = jitted_advantages(baseline, "std", 1)
    np.testing.assert_allclose(f(rewards[perm], groups[perm]), np.asarray(f(rewards, groups))[perm], atol=1e-5)


jitted_stats = jax.jit(functools.partial(group_stats, num_groups=G))


@SETTINGS
@given(rewards=rewards_st, groups=groups_st)
def test_group_stats_match_numpy(rewards, groups):
    stats = jax.tree.map(np.asarray, jitted_stats(rewards, groups))
    for g in range(G):
        vals = rewards[groups == g].astype(np.float64)
        assert stats.count[g] == len(vals)
        if len(vals):
            np.testing.assert_allclose(stats.mean[g], vals.mean(), atol=1e-5)
            np.testing.assert_allclose(stats.max[g], vals.max())
            np.testing.assert_allclose(stats.min[g], vals.min())
        if len(vals) >= 2:
            np.testing.assert_allclose(stats.std[g], vals.std(ddof=1), atol=1e-5)


@functools.cache
def jitted_filter(zero, var_frac, mean_frac, variance_rank="std"):
    return jax.jit(
        functools.partial(
            filter_groups, num_groups=G, drop_zero_variance=zero, drop_low_variance_frac=var_frac,
            drop_low_mean_frac=mean_frac, variance_rank=variance_rank,
        )
    )


@SETTINGS
@given(
    rewards=rewards_st,
    groups=groups_st,
    zero=st.booleans(),
    var_frac=st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]),
    mean_frac=st.sampled_from([0.0, 0.3, 0.5, 0.75]),
    variance_rank=st.sampled_from(["std", "range_normalised"]),
)
def test_filter_groups_match_reference(rewards, groups, zero, var_frac, mean_frac, variance_rank):
    got = jitted_filter(zero, var_frac, mean_frac, variance_rank)(rewards, groups)
    want = ref.filter_groups(rewards, groups, G, zero, var_frac, mean_frac, variance_rank=variance_rank)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_filter_groups_hand_worked():
    # group 0 (1, 0): var 0.5, mean 0.5; group 1 (3, 3): constant, mean 3; group 2 (0, 4): var 8, mean 2
    rewards = np.array([1, 0, 3, 3, 0, 4, 9], np.float32)
    groups = np.array([0, 0, 1, 1, 2, 2, -1], np.int32)
    keep = filter_groups(rewards, groups, num_groups=3, drop_zero_variance=True)
    np.testing.assert_array_equal(keep, [1, 1, 0, 0, 1, 1, 0])
    # lowest-variance third of 3 groups: floor(1/3 * 3) = 1 group -> group 1 (variance 0)
    keep = filter_groups(rewards, groups, num_groups=3, drop_low_variance_frac=1 / 3)
    np.testing.assert_array_equal(keep, [1, 1, 0, 0, 1, 1, 0])
    # lowest-mean 2/3 -> floor(2) groups: group 0 (0.5) and group 2 (2)
    keep = filter_groups(rewards, groups, num_groups=3, drop_low_mean_frac=2 / 3)
    np.testing.assert_array_equal(keep, [0, 0, 1, 1, 0, 0, 0])
    with pytest.raises(JmarlError, match="drop_low_mean_frac"):
        filter_groups(rewards, groups, num_groups=3, drop_low_mean_frac=1.5)


@functools.cache
def jitted_top_k(k):
    return jax.jit(functools.partial(top_k_groups, num_groups=G, k=k))


@SETTINGS
@given(rewards=rewards_st, groups=groups_st, k=st.integers(1, G))
def test_top_k_groups_match_reference(rewards, groups, k):
    keep, selected = jitted_top_k(k)(rewards, groups)
    np.testing.assert_array_equal(np.asarray(keep), ref.top_k_groups(rewards, groups, G, k))
    assert int(selected.sum()) == min(k, len(set(groups[groups >= 0].tolist())))


# Issue 44's case: group [0, .5, .5] and group [0, 0, .5, .5] both have variance 1/12 (std
# 0.28867513), computed from different sums; with either id assignment the tie goes by id.
TIE_REWARDS = np.array([0, 0.5, 0.5, 0, 0, 0, 0, 0, 0.5, 0.5], np.float32)
TIE_GROUPS = np.array([1, 1, 1, -1, -1, -1, 0, 0, 0, 0], np.int32)
TIE_GROUPS_SWAPPED = np.where(TIE_GROUPS >= 0, 1 - TIE_GROUPS, TIE_GROUPS).astype(np.int32)


@pytest.mark.parametrize("groups", [TIE_GROUPS, TIE_GROUPS_SWAPPED], ids=["issue", "swapped_ids"])
def test_exact_variance_tie_goes_to_the_lower_group_id(groups):
    keep, selected = jitted_top_k(1)(TIE_REWARDS, groups)
    np.testing.assert_array_equal(np.asarray(selected), [True, False, False, False])  # group 0 kept
    np.testing.assert_array_equal(np.asarray(keep), groups == 0)
    np.testing.assert_array_equal(np.asarray(keep), ref.top_k_groups(TIE_REWARDS, groups, G, 1))
    keep = jitted_filter(False, 0.5, 0.0)(TIE_REWARDS, groups)  # floor(.5 * 2) = 1 group dropped
    np.testing.assert_array_equal(np.asarray(keep), groups == 1)  # group 0 dropped
    np.testing.assert_array_equal(np.asarray(keep), ref.filter_groups(TIE_REWARDS, groups, G, var_frac=0.5))


@pytest.mark.parametrize("first", [0, 1])
def test_exact_range_normalised_tie_goes_to_the_lower_group_id(first):
    # [0, 1]: (1/4) / 1^2 and [0, 0, .5, .5]: (1/16) / .5^2, both 1/4: group 0 is dropped
    rewards = np.array([0, 1, 0, 0, 0.5, 0.5], np.float32)
    groups = np.array([first] * 2 + [1 - first] * 4, np.int32)
    keep = jitted_filter(False, 0.5, 0.0, "range_normalised")(rewards, groups)
    np.testing.assert_array_equal(np.asarray(keep), groups == 1)
    np.testing.assert_array_equal(
        np.asarray(keep), ref.filter_groups(rewards, groups, G, var_frac=0.5, variance_rank="range_normalised")
    )


def test_exact_mean_tie_goes_to_the_lower_group_id():
    # group 0 [1, 0, .5] and group 1 [.5, .5] both have mean .5; group 2 [2, 2] is higher.
    rewards = np.array([0.5, 1, 0.5, 0, 0.5, 2, 2], np.float32)
    groups = np.array([1, 0, 1, 0, 0, 2, 2], np.int32)
    keep = jitted_filter(False, 0.0, 0.5)(rewards, groups)  # floor(.5 * 3) = 1 group dropped
    np.testing.assert_array_equal(np.asarray(keep), groups != 0)
    np.testing.assert_array_equal(np.asarray(keep), ref.filter_groups(rewards, groups, G, mean_frac=0.5))


def test_member_order_does_not_decide_a_tie():
    # The same three rewards in other orders: a mean-centred float32 std of [0, .5, 2] and of
    # [0, 2, .5] differs in the last bit (summation order), the ranking key does not, so the
    # tie goes to group 0 whichever group holds which order.
    for order in ([0, 2, 0.5], [2, 0, 0.5], [0.5, 2, 0]):
        rewards = np.array([0, 0.5, 2, *order], np.float32)
        groups = np.array([0, 0, 0, 1, 1, 1], np.int32)
        _, selected = top_k_groups(rewards, groups, num_groups=2, k=1)
        np.testing.assert_array_equal(np.asarray(selected), [True, False])
        _, selected = top_k_groups(rewards, 1 - groups, num_groups=2, k=1)
        np.testing.assert_array_equal(np.asarray(selected), [True, False])


@SETTINGS
@given(rewards=rewards_st, groups=groups_st, k=st.integers(1, G), seed=st.integers(0, 2**31 - 1))
def test_permuting_samples_permutes_the_top_k_and_filter_masks(rewards, groups, k, seed):
    perm = np.random.default_rng(seed).permutation(N)
    keep, _ = jitted_top_k(k)(rewards, groups)
    permuted, _ = jitted_top_k(k)(rewards[perm], groups[perm])
    np.testing.assert_array_equal(np.asarray(permuted), np.asarray(keep)[perm])
    filt = jitted_filter(False, 0.5, 0.3)
    permuted = filt(rewards[perm], groups[perm])
    np.testing.assert_array_equal(np.asarray(permuted), np.asarray(filt(rewards, groups))[perm])


def test_unknown_options_raise():
    with pytest.raises(JmarlError, match="baseline"):
        group_advantages(jnp.zeros(2), jnp.zeros(2, jnp.int32), num_groups=1, baseline="median")
    with pytest.raises(JmarlError, match="normalize"):
        group_advantages(jnp.zeros(2), jnp.zeros(2, jnp.int32), num_groups=1, normalize="mad")
