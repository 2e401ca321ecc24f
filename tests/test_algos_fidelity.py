"""The reference-matching options of the group advantages and filters (docs/fidelity.md).

eps_mode "floor" (CoMLRL's MAGRPO: A / max(std, eps)), normalize "batch" (TRL's
scale_rewards="batch": the baseline per group, the std over the whole batch) and
variance_rank "range_normalised" (PettingLLMs: var_ddof0 / (max - min)^2). Every expected number
below is worked by hand from those formulas; the property tests compare with a loop-based
float64 reference written here from the same formulas.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jmarl.algos.advantages import EPS_MODES, NORMALIZERS, VARIANCE_RANKS, filter_groups, group_advantages
from jmarl.errors import JmarlError

N, G = 10, 4
SETTINGS = settings(max_examples=25, deadline=None)
rewards_st = hnp.arrays(np.float32, (N,), elements=st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 0.25, 10.0]))
groups_st = hnp.arrays(np.int32, (N,), elements=st.integers(-1, G - 1))

# The MAGRPO example: one group of returns [0, 1, 1, 0]; mean 0.5, |r - mean| = 0.5,
# sum of squares 1.0, so std = sqrt(1/4) = 0.5 (ddof 0) or sqrt(1/3) = 0.577350 (ddof 1).
MAGRPO_RETURNS = np.array([0.0, 1.0, 1.0, 0.0], np.float32)
SIGNS = np.array([-1.0, 1.0, 1.0, -1.0])


def one_group(rewards: np.ndarray, **kw) -> np.ndarray:
    return np.asarray(group_advantages(rewards, np.zeros(len(rewards), np.int32), num_groups=1, **kw))


# ------------------------------------------------------------------------------ eps_mode


@pytest.mark.parametrize(
    ("ddof", "eps_mode", "magnitude"),
    [
        (0, "floor", 1.0),  # 0.5 / max(0.5, 1e-6): CoMLRL's numbers
        (0, "add", 0.5 / (0.5 + 1e-6)),  # 0.999998
        (1, "add", 0.5 / (math.sqrt(1 / 3) + 1e-6)),  # 0.866024: jmarl's GRPO default
        (1, "floor", 0.5 / math.sqrt(1 / 3)),  # 0.866025
    ],
)
def test_magrpo_example_under_both_eps_modes_and_ddofs(ddof, eps_mode, magnitude):
    got = one_group(MAGRPO_RETURNS, ddof=ddof, eps_mode=eps_mode)
    np.testing.assert_allclose(got, magnitude * SIGNS, rtol=1e-6)


def test_floor_and_add_differ_where_eps_is_comparable_to_the_std():
    # ddof 0, std 0.5. eps 0.5: add 0.5 / 1.0 = 0.5, floor 0.5 / max(0.5, 0.5) = 1.
    # eps 1.0: add 0.5 / 1.5 = 1/3, floor 0.5 / max(0.5, 1.0) = 0.5.
    for eps, add, floor in ((0.5, 0.5, 1.0), (1.0, 1 / 3, 0.5)):
        np.testing.assert_allclose(one_group(MAGRPO_RETURNS, ddof=0, eps=eps), add * SIGNS, rtol=1e-6)
        got = one_group(MAGRPO_RETURNS, ddof=0, eps=eps, eps_mode="floor")
        np.testing.assert_allclose(got, floor * SIGNS, rtol=1e-6)


def test_floor_clamps_a_std_below_eps():
    # returns [0, 1e-7], ddof 0: mean 5e-8, std 5e-8 < eps = 1e-6.
    # floor: +-5e-8 / 1e-6 = +-0.05; add: +-5e-8 / (5e-8 + 1e-6) = +-0.047619.
    r = np.array([0.0, 1e-7], np.float32)
    np.testing.assert_allclose(one_group(r, ddof=0, eps_mode="floor"), [-0.05, 0.05], rtol=1e-4)
    np.testing.assert_allclose(one_group(r, ddof=0), [-0.05 / 1.05, 0.05 / 1.05], rtol=1e-4)


# ------------------------------------------------------------------------------ normalize="batch"

# groups: 0 -> [0, 2] (mean 1), 1 -> [4, 6] (mean 5), 2 -> [3, 3] (constant), and a padding row
# (group -1) whose reward 100 must not enter any statistic. Valid rewards 0 2 4 6 3 3: mean 3,
# squared deviations 9 1 1 9 0 0 = 20, so the batch std is sqrt(20/5) = 2 (ddof 1) or
# sqrt(20/6) = 1.825742 (ddof 0). Centred on the group means: -1 1 -1 1 0 0.
BATCH_REWARDS = np.array([0, 2, 4, 6, 3, 3, 100], np.float32)
BATCH_GROUPS = np.array([0, 0, 1, 1, 2, 2, -1], np.int32)
BATCH_SIGNS = np.array([-1, 1, -1, 1, 0, 0, 0], np.float64)


@pytest.mark.parametrize(
    ("ddof", "eps", "eps_mode", "magnitude"),
    [
        (1, 1e-6, "floor", 0.5),  # 1 / max(2, 1e-6)
        (1, 1e-4, "add", 1 / (2 + 1e-4)),  # 0.499975: TRL's numbers (Bessel std + 1e-4)
        (0, 1e-6, "floor", 1 / math.sqrt(20 / 6)),  # 0.547723
    ],
)
def test_batch_scaled_advantages_hand_worked(ddof, eps, eps_mode, magnitude):
    got = group_advantages(
        BATCH_REWARDS, BATCH_GROUPS, num_groups=3, normalize="batch", ddof=ddof, eps=eps, eps_mode=eps_mode
    )
    np.testing.assert_allclose(np.asarray(got), magnitude * BATCH_SIGNS, rtol=1e-6, atol=1e-7)


def test_batch_scale_differs_from_group_scale():
    # per group: std of [0, 2] and of [4, 6] is sqrt(2) (ddof 1) -> +-1/sqrt(2) = 0.707107
    got = group_advantages(BATCH_REWARDS, BATCH_GROUPS, num_groups=3, eps_mode="floor")
    np.testing.assert_allclose(np.asarray(got), BATCH_SIGNS / math.sqrt(2), rtol=1e-6)


def test_batch_scale_of_uniform_groups_is_zero_not_nan():
    # every group constant: batch std sqrt(((1-1.5)^2 * 2 + (2-1.5)^2 * 2) / 3) > 0, numerators 0;
    # one constant group alone: batch std 0, still 0 (no 0/0) in both eps modes
    r = np.array([1, 1, 2, 2], np.float32)
    g = np.array([0, 0, 1, 1], np.int32)
    for eps_mode in EPS_MODES:
        np.testing.assert_array_equal(group_advantages(r, g, num_groups=2, normalize="batch", eps_mode=eps_mode), 0)
        np.testing.assert_array_equal(one_group(np.ones(3, np.float32), normalize="batch", eps_mode=eps_mode), 0)


# ------------------------------------------------------------------------------ variance_rank

# group 0 [0,1,1,1]: mean .75, var0 = (.5625 + 3 * .0625) / 4 = .1875, range 1 -> .1875, std1 .5
# group 1 [0,10,10,10]: the same x10 -> var0 / range^2 = 18.75 / 100 = .1875, std1 5
# group 2 [0,.5,.5,1]: mean .5, var0 = (.25 + .25) / 4 = .125, range 1 -> .125, std1 .408
# group 3 [0,.1]: var0 = .0025, range .1 -> .25, std1 .0707
# floor(.25 * 4) = 1 group dropped: the lowest std is group 3, the lowest var / range^2 group 2.
FOUR_REWARDS = np.array([0, 1, 1, 1, 0, 10, 10, 10, 0, 0.5, 0.5, 1, 0, 0.1, 7], np.float32)
FOUR_GROUPS = np.array([0] * 4 + [1] * 4 + [2] * 4 + [3] * 2 + [-1], np.int32)


def kept_groups(keep: jax.Array, groups: np.ndarray) -> set[int]:
    return {int(g) for g, k in zip(groups, np.asarray(keep)) if k}


def test_four_group_example_drops_group_3_by_std_and_group_2_by_range_normalised_variance():
    by_std = filter_groups(FOUR_REWARDS, FOUR_GROUPS, num_groups=4, drop_low_variance_frac=0.25)
    assert kept_groups(by_std, FOUR_GROUPS) == {0, 1, 2}
    for ddof in (0, 1):
        by_range = filter_groups(
            FOUR_REWARDS, FOUR_GROUPS, num_groups=4, drop_low_variance_frac=0.25,
            variance_rank="range_normalised", ddof=ddof,
        )
        assert kept_groups(by_range, FOUR_GROUPS) == {0, 1, 3}
    assert not bool(by_range[-1])  # the padding row


def test_range_normalised_uses_the_population_variance_whatever_ddof():
    # group 0 [0,0,1] (n 3): var0 = (1/9 + 1/9 + 4/9) / 3 = 2/9 = .2222; with ddof 1 it would be 1/3.
    # group 1 [0,1] x 5 (n 10): var0 = .25; with ddof 1 it would be .25 * 10/9 = .2778.
    # PettingLLMs (ddof 0) drops group 0; a ddof-1 key would drop group 1.
    r = np.array([0, 0, 1] + [0, 1] * 5, np.float32)
    g = np.array([0] * 3 + [1] * 10, np.int32)
    for ddof in (0, 1):
        keep = filter_groups(
            r, g, num_groups=2, drop_low_variance_frac=0.5, variance_rank="range_normalised", ddof=ddof
        )
        assert kept_groups(keep, g) == {1}


def test_range_normalised_ties_and_zero_range():
    # group 0 [0,10] and group 1 [0,1] both have var0 / range^2 = .25: the tie goes to the lower
    # id (the std ranking would drop group 1, std .707 < 7.07). Group 2 [3,3] (range 0) and the
    # singleton group 3 have key 0 and go first.
    r = np.array([0, 10, 0, 1, 3, 3, 5], np.float32)
    g = np.array([0, 0, 1, 1, 2, 2, 3], np.int32)
    ranked = functools.partial(filter_groups, r, g, num_groups=4, variance_rank="range_normalised")
    assert kept_groups(ranked(drop_low_variance_frac=0.5), g) == {0, 1}
    assert kept_groups(ranked(drop_low_variance_frac=0.75), g) == {1}
    assert kept_groups(filter_groups(r, g, num_groups=4, drop_low_variance_frac=0.75), g) == {0}


# ------------------------------------------------------------------------------ validation, defaults


def test_option_tuples_and_defaults():
    assert NORMALIZERS == ("std", "batch", "none")
    assert EPS_MODES == ("add", "floor")
    assert VARIANCE_RANKS == ("std", "range_normalised")
    # the defaults are the historical behaviour: (r - mean) / (std_ddof1 + 1e-6), ranked by std
    np.testing.assert_allclose(one_group(MAGRPO_RETURNS), 0.5 / (math.sqrt(1 / 3) + 1e-6) * SIGNS, rtol=1e-6)
    default = filter_groups(FOUR_REWARDS, FOUR_GROUPS, num_groups=4, drop_low_variance_frac=0.25)
    explicit = filter_groups(FOUR_REWARDS, FOUR_GROUPS, num_groups=4, drop_low_variance_frac=0.25, variance_rank="std")
    np.testing.assert_array_equal(default, explicit)


def test_unknown_new_option_values_raise_naming_option_and_choices():
    r, g = jnp.zeros(2), jnp.zeros(2, jnp.int32)
    with pytest.raises(JmarlError, match=r"eps_mode='clamp'.*'add', 'floor'"):
        group_advantages(r, g, num_groups=1, eps_mode="clamp")
    with pytest.raises(JmarlError, match=r"normalize='global'.*'std', 'batch', 'none'"):
        group_advantages(r, g, num_groups=1, normalize="global")
    with pytest.raises(JmarlError, match=r"variance_rank='var'.*'std', 'range_normalised'"):
        filter_groups(r, g, num_groups=1, variance_rank="var")


# ------------------------------------------------------------------------------ jit and vmap


def test_jit_and_vmap_over_a_policy_axis():
    adv = jax.jit(functools.partial(group_advantages, num_groups=4, normalize="batch", eps_mode="floor", ddof=0))
    keep = jax.jit(
        functools.partial(filter_groups, num_groups=4, drop_low_variance_frac=0.25, variance_rank="range_normalised")
    )
    # two policies: the four-group example and a permuted, rescaled copy (each its own batch std)
    perm = np.random.default_rng(0).permutation(len(FOUR_REWARDS))
    rewards = np.stack([FOUR_REWARDS, 3 * FOUR_REWARDS[perm]])
    groups = np.stack([FOUR_GROUPS, FOUR_GROUPS[perm]])
    vmapped_adv, vmapped_keep = jax.vmap(adv)(rewards, groups), jax.vmap(keep)(rewards, groups)
    for p in range(2):
        np.testing.assert_allclose(vmapped_adv[p], adv(rewards[p], groups[p]), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(vmapped_keep[p], keep(rewards[p], groups[p]))
    np.testing.assert_array_equal(vmapped_keep[1], np.asarray(vmapped_keep[0])[perm])


# ------------------------------------------------------------------------------ property tests


def loop_advantages(rewards, groups, num_groups, normalize, ddof, eps, eps_mode):
    """float64 loops: mean baseline; the group's or the batch's std; padding rows excluded."""
    valid = [i for i in range(len(groups)) if 0 <= groups[i] < num_groups]

    def std(vals):
        mean = sum(vals) / len(vals)
        return math.sqrt(sum((v - mean) ** 2 for v in vals) / max(len(vals) - ddof, 1))

    batch_std = std([float(rewards[i]) for i in valid]) if valid else 0.0
    out = np.zeros(len(rewards))
    for g in range(num_groups):
        idx = [i for i in valid if groups[i] == g]
        vals = [float(rewards[i]) for i in idx]
        if len(vals) < 2 or max(vals) == min(vals):
            continue
        s = std(vals) if normalize == "std" else batch_std
        for i in idx:
            a = float(rewards[i]) - sum(vals) / len(vals)
            if normalize != "none":
                a = a / max(s, eps) if eps_mode == "floor" else a / (s + eps)
            out[i] = a
    return out


def loop_range_keys(rewards, groups, num_groups):
    """{group: float64 var_ddof0 / range^2 (0 for range 0)} over the non-empty groups."""
    keys = {}
    for g in range(num_groups):
        vals = [float(rewards[i]) for i in range(len(groups)) if groups[i] == g]
        if vals:
            spread = max(vals) - min(vals)
            keys[g] = float(np.var(vals)) / spread**2 if spread > 0 else 0.0
    return keys


@functools.cache
def jitted_advantages(normalize, ddof, eps_mode):
    return jax.jit(functools.partial(group_advantages, num_groups=G, normalize=normalize, ddof=ddof, eps_mode=eps_mode))


@SETTINGS
@given(
    rewards=rewards_st,
    groups=groups_st,
    normalize=st.sampled_from(NORMALIZERS),
    ddof=st.sampled_from([0, 1]),
    eps_mode=st.sampled_from(EPS_MODES),
)
def test_advantages_match_loop_reference(rewards, groups, normalize, ddof, eps_mode):
    got = jitted_advantages(normalize, ddof, eps_mode)(rewards, groups)
    want = loop_advantages(rewards, groups, G, normalize, ddof, 1e-6, eps_mode)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@SETTINGS
@given(rewards=rewards_st, groups=groups_st, frac=st.sampled_from([0.25, 0.5, 0.75, 1.0]))
def test_range_normalised_filter_drops_the_lowest_keys(rewards, groups, frac):
    # Groups of one shape share a key (any [x, x, y] has 2/9), which float32 and float64 may
    # round apart, so rather than one tie order this checks the defining property: the right
    # number of groups is dropped and none of them has a larger key than a kept one.
    keep = np.asarray(
        filter_groups(rewards, groups, num_groups=G, drop_low_variance_frac=frac, variance_rank="range_normalised")
    )
    keys = loop_range_keys(rewards, groups, G)
    dropped = {g for g in keys if not keep[groups == g].any()}
    kept = set(keys) - dropped
    assert all(keep[groups == g].all() for g in kept)
    assert not keep[groups < 0].any()
    assert len(dropped) == int(math.floor(frac * len(keys)))
    if dropped and kept:
        assert max(keys[g] for g in dropped) <= min(keys[g] for g in kept) + 1e-6
