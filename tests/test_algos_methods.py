"""Method modules: configs, the uniform interface, MAGRPO, AT-GRPO, HACPO and JoyAgents pieces."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
import warnings

import _np_reference as ref
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jmarl.algos import CONFIGS, METHODS, at_grpo, dapo, get_method, hacpo, joyagents, magrpo
from jmarl.errors import JmarlError
from jmarl.workflows import memory as jmemory

SETTINGS = settings(max_examples=20, deadline=None)


# ------------------------------------------------------------------------------ configs


def test_configs_cover_every_method_and_are_typed_frozen_with_defaults():
    assert set(CONFIGS) == {"grpo", "dr_grpo", "dapo", "gspo", "magrpo", "at_grpo", "hacpo", "joyagents"}
    for name, cls in CONFIGS.items():
        cfg = cls()
        assert METHODS[name].Config is cls
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            # real (not string) annotations, so a config loader can read them off dataclasses.fields
            assert isinstance(field.type, (type, types.UnionType)), (name, field.name, field.type)
            assert hints[field.name] == field.type
            assert field.default is not dataclasses.MISSING, (name, field.name)
            assert isinstance(field.default, field.type), (name, field.name)  # the default has the declared type
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.eps = 1.0  # type: ignore[misc]


def test_config_defaults_follow_the_papers():
    grpo, dr, dp, gs = (CONFIGS[n]() for n in ("grpo", "dr_grpo", "dapo", "gspo"))
    assert (grpo.ratio, grpo.clip_low, grpo.clip_high, grpo.normalize, grpo.aggregation) == (
        "token", 0.2, 0.2, "std", "seq_mean_token_mean")
    assert (dr.normalize, dr.aggregation) == ("none", "seq_mean_token_sum_norm")
    assert (dp.clip_low, dp.clip_high, dp.aggregation, dp.drop_zero_variance) == (0.2, 0.28, "token_mean", True)
    assert (gs.ratio, gs.clip_low, gs.clip_high, gs.aggregation) == ("sequence", 3e-4, 4e-4, "seq_mean_token_mean")
    ma = CONFIGS["magrpo"]()
    assert (ma.num_generations, ma.joint_mode, ma.joint_aggregate, ma.gamma, ma.baseline, ma.aggregation) == (
        4, "aligned", "sum", 1.0, "mean", "seq_sum")
    at = CONFIGS["at_grpo"]()
    assert (at.num_candidates, at.alpha, at.reward_mode, at.dual_clip, at.aggregation, at.kl_coef) == (
        4, 1.0, "immediate", 3.0, "token_mean", 0.0)
    ha = CONFIGS["hacpo"]()
    assert (ha.num_generations, ha.capability_window, ha.alpha, ha.delta, ha.delta_step, ha.clip_low, ha.clip_high) == (
        8, 5, 1.0, 0.2, 0.025, 3e-4, 4e-4)
    jo = CONFIGS["joyagents"]()
    assert (jo.top_k_groups, jo.memory_z, jo.memory_time_weight, jo.memory_reward_weight) == (2, 1.96, 1.0, 1.0)


@pytest.mark.parametrize(
    "method, field, value",
    [
        ("grpo", "clip_low", -0.1),
        ("grpo", "clip_high", -0.2),
        ("grpo", "baseline", "median"),
        ("grpo", "aggregation", "mean"),
        ("grpo", "dual_clip", 0.5),
        ("grpo", "kl_kind", "k4"),
        ("dapo", "drop_low_mean_frac", 1.5),
        ("gspo", "ratio", "seq"),
        ("dr_grpo", "eps", 0.0),
        ("magrpo", "joint_mode", "product"),
        ("magrpo", "joint_aggregate", "max"),
        ("magrpo", "num_generations", 1),
        ("magrpo", "gamma", 1.5),
        ("at_grpo", "reward_mode", "discounted"),
        ("at_grpo", "continue_with", "worst"),
        ("at_grpo", "alpha", -1.0),
        ("hacpo", "delta", 2.0),
        ("hacpo", "omega_min", 0.0),
        ("hacpo", "capability_window", 0),
        ("joyagents", "top_k_groups", 0),
        ("joyagents", "memory_z", -1.0),
    ],
)
def test_out_of_range_config_values_raise_naming_the_field(method, field, value):
    with pytest.raises(JmarlError, match=field):
        CONFIGS[method](**{field: value})


def test_get_method_unknown_name():
    assert get_method("hacpo") is hacpo
    with pytest.raises(JmarlError, match="ppo2.*choose one of"):
        get_method("ppo2")


# ------------------------------------------------------------------------------ uniform interface


def small_batch(seed=0, n=8, t=5):
    rng = np.random.default_rng(seed)
    lp = rng.uniform(-3, -0.1, (n, t)).astype(np.float32)
    old = (lp + rng.uniform(-0.3, 0.3, (n, t))).astype(np.float32)
    refp = (lp + rng.uniform(-0.3, 0.3, (n, t))).astype(np.float32)
    mask = rng.random((n, t)) < 0.8
    mask[:, 0] = True
    rewards = rng.integers(0, 2, n).astype(np.float32)
    groups = np.repeat(np.arange(n // 4), 4).astype(np.int32)
    return lp, old, refp, mask, rewards, groups


def method_extras(name, n=8):
    """Per-sample extras for methods whose functions need them (HACPO)."""
    if name != "hacpo":
        return {}, {}
    source = np.tile([0, 0, 1, 1], n // 4).astype(np.int32)
    adv_extra = {"source": source, "capability": np.array([0.6, 0.3], np.float32), "learner": 0}
    loss_extra = {"is_cross": source != 0, "discrepancy": np.where(source != 0, 0.5, 1.0).astype(np.float32)}
    return adv_extra, loss_extra


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_method_runs_through_the_uniform_interface(name):
    module, cfg = METHODS[name], CONFIGS[name]()
    lp, old, refp, mask, rewards, groups = small_batch()
    adv_extra, loss_extra = method_extras(name)
    adv = module.advantages(cfg, rewards, groups, num_groups=2, **adv_extra)
    keep = module.keep_mask(cfg, rewards, groups, num_groups=2)
    assert adv.shape == (8,) and keep.shape == (8,) and keep.dtype == bool
    value, metrics = module.loss(cfg, lp, old, adv, mask & np.asarray(keep)[:, None], ref_logprobs=refp, **loss_extra)
    assert value.shape == () and np.isfinite(float(value))
    assert {"loss", "pg_loss", "clip_fraction", "ratio_mean", "approx_kl"} <= set(metrics)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "at_grpo", "joyagents"])
def test_clipped_presets_equal_the_reference_with_their_defaults(name):
    module, cfg = METHODS[name], CONFIGS[name](kl_coef=0.05)
    lp, old, refp, mask, rewards, groups = small_batch(seed=4)
    adv = module.advantages(cfg, rewards, groups, num_groups=2)
    np.testing.assert_allclose(
        adv, ref.group_advantages(rewards, groups, 2, cfg.baseline, cfg.normalize, cfg.ddof), rtol=1e-5, atol=1e-6
    )
    got, _ = module.loss(cfg, lp, old, adv, mask, ref_logprobs=refp)
    want, _ = ref.policy_loss(
        lp, old, np.asarray(adv), mask, ratio=cfg.ratio, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip, aggregation=cfg.aggregation, ref=refp, kl_coef=0.05, kl_kind=cfg.kl_kind,
    )
    np.testing.assert_allclose(float(got), want, rtol=1e-4, atol=1e-6)


def test_dapo_keep_mask_drops_zero_variance_groups():
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 0], np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
    np.testing.assert_array_equal(dapo.keep_mask(dapo.Config(), rewards, groups, num_groups=2), [0, 0, 0, 0, 1, 1, 1, 1])


def test_magrpo_loss_is_minus_advantage_times_summed_logprob():
    cfg = magrpo.Config()
    lp, old, _, mask, _, _ = small_batch(seed=2)
    adv = np.linspace(-1, 1, 8).astype(np.float32)
    got, _ = magrpo.loss(cfg, lp, old, adv, mask)
    want, _ = ref.policy_loss(lp, old, adv, mask, ratio="none", aggregation="seq_sum")
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


# ------------------------------------------------------------------------------ MAGRPO


@pytest.mark.parametrize("mode", ["aligned", "cross"])
@pytest.mark.parametrize("n, g", [(2, 2), (2, 4), (3, 3)])
def test_joint_action_index_matches_reference(mode, n, g):
    got = magrpo.joint_action_index(n, g, mode)
    np.testing.assert_array_equal(got, np.array(ref.joint_actions(n, g, mode)))
    assert got.shape == ((g, n) if mode == "aligned" else (g**n, n))


@SETTINGS
@given(
    shape=st.sampled_from([(2, 2), (2, 3), (3, 2)]),
    mode=st.sampled_from(["aligned", "cross"]),
    aggregate=st.sampled_from(["sum", "mean"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_completion_returns_match_reference(shape, mode, aggregate, seed):
    n, g = shape
    joint = magrpo.joint_action_index(n, g, mode)
    joint_returns = np.random.default_rng(seed).normal(size=(3, joint.shape[0])).astype(np.float32)  # 3 nodes
    got = np.asarray(magrpo.completion_returns(joint_returns, joint, num_generations=g, aggregate=aggregate))
    for node in range(3):
        want = ref.completion_returns(joint_returns[node], joint.tolist(), g, aggregate)
        np.testing.assert_allclose(got[node], want, rtol=1e-5, atol=1e-6)


def test_completion_returns_hand_worked():
    # two agents, G=2, cross: joint actions (0,0), (0,1), (1,0), (1,1) with rewards 1, 2, 3, 4
    # agent 0: completion 0 is in (0,0),(0,1) -> sum 3, mean 1.5; completion 1 -> 3+4 = 7, mean 3.5
    # agent 1: completion 0 is in (0,0),(1,0) -> 1+3 = 4, mean 2; completion 1 -> 2+4 = 6, mean 3
    joint = magrpo.joint_action_index(2, 2, "cross")
    r = np.array([1, 2, 3, 4], np.float32)
    np.testing.assert_allclose(magrpo.completion_returns(r, joint, num_generations=2), [[3, 7], [4, 6]])
    np.testing.assert_allclose(magrpo.completion_returns(r, joint, num_generations=2, aggregate="mean"), [[1.5, 3.5], [2, 3]])
    # aligned: each completion is in exactly one joint action, so its return is that reward
    aligned = magrpo.joint_action_index(2, 2, "aligned")
    np.testing.assert_allclose(magrpo.completion_returns(r[:2], aligned, num_generations=2), [[1, 2], [1, 2]])


def test_tree_returns_hand_worked():
    # turn 0: joint actions 0 (r=1) and 1 (r=0); joint action 0's child node has 2 (r=0) and 3 (r=1),
    # joint action 1's child node has 4 (r=1) and 5 (r=1), joint action 4 was continued: 6 (r=2), 7 (r=0).
    # gamma 0.9: R4 = 1 + 0.9 * 1 = 1.9; R0 = 1 + 0.9 * 0.5 = 1.45; R1 = 0 + 0.9 * (1.9 + 1) / 2 = 1.305
    rewards = np.array([1, 0, 0, 1, 1, 1, 2, 0], np.float32)
    parent = np.array([-1, -1, 0, 0, 1, 1, 4, 4], np.int32)
    got = magrpo.tree_returns(rewards, parent, gamma=0.9, max_depth=2)
    np.testing.assert_allclose(got, [1.45, 1.305, 0, 1, 1.9, 1, 2, 0], rtol=1e-6)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), gamma=st.sampled_from([1.0, 0.9, 0.5]))
def test_tree_returns_match_recursive_reference(seed, gamma):
    rng = np.random.default_rng(seed)
    parent = [-1, -1, -1]  # a random 3-level tree over 12 joint actions, parents precede children
    for j in range(3, 12):
        parent.append(int(rng.integers(0, j)) if rng.random() < 0.9 else -1)
    depth = lambda j: 0 if parent[j] < 0 else 1 + depth(parent[j])  # noqa: E731
    rewards = rng.normal(size=12).astype(np.float32)
    got = magrpo.tree_returns(rewards, np.array(parent), gamma=gamma, max_depth=max(map(depth, range(12))))
    np.testing.assert_allclose(got, ref.tree_returns(rewards.astype(np.float64), parent, gamma), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ AT-GRPO


def test_at_grpo_group_ids_hand_worked_and_injective():
    # (env 1, turn 2, agent 1) with 3 turns and 2 agents -> (1 * 3 + 2) * 2 + 1 = 11
    ids = at_grpo.group_ids(np.array([1, 0, -1, 0]), np.array([2, 0, 0, 3]), np.array([1, 0, 0, 0]), num_turns=3, num_agents=2)
    np.testing.assert_array_equal(ids, [11, 0, -1, -1])
    env, turn, agent = np.meshgrid(np.arange(4), np.arange(3), np.arange(2), indexing="ij")
    all_ids = np.asarray(at_grpo.group_ids(env.ravel(), turn.ravel(), agent.ravel(), num_turns=3, num_agents=2))
    np.testing.assert_array_equal(np.sort(all_ids), np.arange(24))


def test_at_grpo_mixed_reward_and_advantage_per_node():
    # local (1, 0, 0.5, 0.5) + 2 * team (0, 1, 0, 0) = (1, 2, 0.5, 0.5); one node of K=4
    r = at_grpo.mixed_reward(np.array([1, 0, 0.5, 0.5]), np.array([0, 1, 0, 0]), alpha=2.0)
    np.testing.assert_allclose(r, [1, 2, 0.5, 0.5])
    adv = at_grpo.advantages(at_grpo.Config(), r, np.zeros(4, np.int32), num_groups=1)
    np.testing.assert_allclose(adv, ref.group_advantages(np.asarray(r), [0] * 4, 1), rtol=1e-5)


def test_returns_to_go_hand_worked():
    # chain 0 -> 2 -> 3 (continued candidates), 1 not continued; gamma 0.5:
    # G3 = 4, G2 = 2 + 0.5 * 4 = 4, G0 = 1 + 0.5 * 4 = 3, G1 = 7
    got = at_grpo.returns_to_go(np.array([1, 7, 2, 4.0]), np.array([2, -1, 3, -1]), gamma=0.5, max_steps=2)
    np.testing.assert_allclose(got, [3, 7, 4, 4])


def test_at_grpo_node_rewards_immediate_and_return_to_go():
    # local (1, 0, 0.5) + 0.5 * team (2, 2, 0) = (2, 1, 0.5); sample 0 is continued by sample 2.
    local, team, nxt = np.array([1, 0, 0.5]), np.array([2, 2, 0]), np.array([2, -1, -1])
    immediate = at_grpo.node_rewards(at_grpo.Config(alpha=0.5), local, team)
    np.testing.assert_allclose(immediate, [2, 1, 0.5])
    # return-to-go with gamma 0.9: G0 = 2 + 0.9 * 0.5 = 2.45
    cfg = at_grpo.Config(alpha=0.5, reward_mode="return_to_go", gamma=0.9)
    np.testing.assert_allclose(at_grpo.node_rewards(cfg, local, team, next_index=nxt), [2.45, 1, 0.5], rtol=1e-6)
    with pytest.raises(JmarlError, match="next_index"):
        at_grpo.node_rewards(cfg, local, team)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), gamma=st.sampled_from([1.0, 0.8]))
def test_returns_to_go_match_reference(seed, gamma):
    rng = np.random.default_rng(seed)
    nxt = [int(rng.integers(j + 1, 10)) if j < 9 and rng.random() < 0.6 else -1 for j in range(10)]
    rewards = rng.normal(size=10).astype(np.float32)
    got = at_grpo.returns_to_go(rewards, np.array(nxt), gamma=gamma, max_steps=9)
    np.testing.assert_allclose(got, ref.returns_to_go(rewards.astype(np.float64), nxt, gamma), rtol=1e-5, atol=1e-5)


def test_choose_candidate():
    rewards = np.array([[0.0, 1.0, 1.0, 0.5], [2.0, 0.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(at_grpo.choose_candidate(rewards, mode="best"), [1, 0])  # first of the ties
    np.testing.assert_array_equal(at_grpo.choose_candidate(rewards, mode="first"), [0, 0])
    key = jax.random.key(0)
    picks = at_grpo.choose_candidate(np.zeros((500, 4)), mode="sampled", key=key)
    assert set(np.asarray(picks).tolist()) == {0, 1, 2, 3}
    np.testing.assert_array_equal(picks, at_grpo.choose_candidate(np.zeros((500, 4)), mode="sampled", key=key))
    with pytest.raises(JmarlError, match="key"):
        at_grpo.choose_candidate(rewards, mode="sampled")


# ------------------------------------------------------------------------------ HACPO


def test_hacpo_two_agents_hand_worked():
    # Capabilities P = (0.6, 0.3): omega^{0,1} = 0.6/0.3 = 2, omega^{1,0} = 0.3/0.6 = 0.5.
    cap = np.array([0.6, 0.3], np.float32)
    np.testing.assert_allclose(hacpo.capability_ratio(cap), [[1, 2], [0.5, 1]], rtol=1e-6)
    # Clipping of omega to [0.1, 10]: 0.9/0.05 = 18 -> 10, 0.05/0.9 = 0.0556 -> 0.1
    np.testing.assert_allclose(hacpo.capability_ratio(np.array([0.9, 0.05])), [[1, 10], [0.1, 1]], rtol=1e-6)

    # One prompt (group 0), G=2 per agent: agent 0 answered (1, 0), agent 1 answered (1, 1).
    rewards = np.array([1, 0, 1, 1], np.float32)
    source = np.array([0, 0, 1, 1], np.int32)
    groups = np.zeros(4, np.int32)
    # sigma = std_ddof1(1, 0, 1, 1) = sqrt(((0.25^2) * 3 + 0.75^2) / 3) = sqrt(0.25) = 0.5; + 1e-6
    sigma = 0.5 + 1e-6
    # Learner 0: mu = (1*1 + 1*0 + 2*1 + 2*1) / 4 = 1.25 > max reward 1 -> fall back to own mean (1 + 0)/2 = 0.5
    a0 = hacpo.capability_advantages(rewards, groups, source, cap, 0, num_groups=1)
    np.testing.assert_allclose(a0, (rewards - 0.5) / sigma, rtol=1e-6)  # (1, -1, 1, 1) * 0.999998
    # Same learner with max_reward = 2: 1.25 <= 2, no fallback -> A = (r - 1.25) / 0.5 = (-0.5, -2.5, -0.5, -0.5)
    a0_max2 = hacpo.capability_advantages(rewards, groups, source, cap, 0, num_groups=1, max_reward=2.0)
    np.testing.assert_allclose(a0_max2, np.array([-0.5, -2.5, -0.5, -0.5]) * 0.5 / sigma, rtol=1e-6)
    # Learner 1: mu = (0.5*1 + 0.5*0 + 1*1 + 1*1) / 4 = 0.625 <= 1 -> A = (r - 0.625) / 0.5 = (0.75, -1.25, 0.75, 0.75)
    a1 = hacpo.capability_advantages(rewards, groups, source, cap, 1, num_groups=1)
    np.testing.assert_allclose(a1, np.array([0.75, -1.25, 0.75, 0.75]) * 0.5 / sigma, rtol=1e-6)
    # A second prompt where learner 0 keeps its weighted baseline: rewards agent 0 (0, 0), agent 1 (1, 0):
    # mu = (0 + 0 + 2*1 + 2*0) / 4 = 0.5 <= 1; sigma = std_ddof1(0, 0, 1, 0) = 0.5 -> A = (-1, -1, 1, -1)
    a0b = hacpo.capability_advantages(np.array([0, 0, 1, 0], np.float32), groups, source, cap, 0, num_groups=1)
    np.testing.assert_allclose(a0b, np.array([-1, -1, 1, -1]) * 0.5 / sigma, rtol=1e-6)

    # Discrepancy coefficients: learner 0 on agent 1's answers uses omega^{1,0} = 0.5, on its own 1;
    # learner 1 on agent 0's answers uses omega^{0,1} = 2.
    np.testing.assert_allclose(hacpo.discrepancy_coefficients(cap, source, 0), [1, 1, 0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(hacpo.discrepancy_coefficients(cap, source, 1), [2, 2, 1, 1], rtol=1e-6)

    # Stepwise clip bounds with delta 0.2, delta_step 0.025: m=0 -> [0.8, 1]; m=1 -> [0.825, 1]; m=2 -> [0.85, 1]
    for m, low in ((0, 0.8), (1, 0.825), (2, 0.85)):
        lo, hi = hacpo.stepwise_clip_bounds(m, delta=0.2, delta_step=0.025)
        np.testing.assert_allclose([float(lo), float(hi)], [low, 1.0], rtol=1e-6)
    # the lower bound never passes 1: m=10 -> min(1.05, 1) = 1
    np.testing.assert_allclose(float(hacpo.stepwise_clip_bounds(10)[0]), 1.0)

    # Cross ratio s = exp(mean lp_learner - source_seq_logprob) = 0.82 (source mean log-prob 0, learner
    # tokens all log 0.82). alpha = 1: s~ = c * sg(c) -> value c^2, d s~ / d(mean lp) = c * c (inside the clip).
    mask = np.ones((1, 3), bool)
    lp = np.full((1, 3), np.log(0.82), np.float32)
    for m, c in ((0, 0.82), (1, 0.825), (2, 0.85)):  # m=0 inside [0.8, 1]; m=1, 2 clipped up to the bound
        s = hacpo.cross_ratio(lp, mask, np.zeros(1, np.float32), m)
        np.testing.assert_allclose(s, [c * c], rtol=1e-5)  # 0.6724, 0.680625, 0.7225
    grad = jax.grad(lambda x: hacpo.cross_ratio(x, mask, np.zeros(1), 0)[0])(lp)
    np.testing.assert_allclose(grad, np.full((1, 3), 0.82 * 0.82 / 3), rtol=1e-5)  # d mean / d lp_t = 1/3
    grad_clipped = jax.grad(lambda x: hacpo.cross_ratio(x, mask, np.zeros(1), 1)[0])(lp)
    np.testing.assert_array_equal(grad_clipped, 0.0)

    # Combined loss for learner 0 at m=0: a self sample with lp == lp_old (s = 1, inside the GSPO clip),
    # A = 1 -> -1; a cross sample from agent 1 with s = 0.82, omega = 0.5, A = 1 -> -(0.82^2) * 0.5 = -0.3362.
    # seq_mean_token_mean = (-1 - 0.3362) / 2 = -0.6681
    lp2 = np.concatenate([np.full((1, 3), -1.0, np.float32), lp])
    loss, metrics = hacpo.loss(
        hacpo.Config(), lp2, np.full((2, 3), -1.0, np.float32), np.ones(2, np.float32), np.ones((2, 3), bool),
        is_cross=np.array([False, True]), source_seq_logprob=np.array([-1.0, 0.0], np.float32),
        discrepancy=np.array([1.0, 0.5], np.float32), minibatch_index=0,
    )
    np.testing.assert_allclose(float(loss), (-1 - 0.3362) / 2, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["cross_ratio_mean"]), 0.82, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["cross_fraction"]), 0.5)


def test_capability_window_is_immutable_and_keeps_the_last_k_steps():
    w0 = hacpo.CapabilityWindow(size=3)
    w = w0
    for step in ([0.0, 1.0], [0.5, 1.0], [1.0, 0.0], [1.0, 0.5]):
        w = hacpo.update_capabilities(w, step)
    assert w0.history == ()  # the original value is untouched
    # last 3 steps: agent 0 (0.5 + 1 + 1)/3 = 0.8333, agent 1 (1 + 0 + 0.5)/3 = 0.5
    np.testing.assert_allclose(hacpo.capabilities(w), [2.5 / 3, 0.5], rtol=1e-6)
    with pytest.raises(JmarlError, match="agents"):
        hacpo.update_capabilities(w, [0.5])
    with pytest.raises(JmarlError, match="empty"):
        hacpo.capabilities(w0)


def test_success_rate():
    # agent 0: rewards (1, 0, 1) -> 2/3; agent 1: (0, 0) -> 0; the padding row (-1) is ignored
    got = hacpo.success_rate(np.array([1, 0, 1, 0, 0, 1.0]), np.array([0, 0, 0, 1, 1, -1]), num_agents=2)
    np.testing.assert_allclose(got, [2 / 3, 0], rtol=1e-6)


@SETTINGS
@given(
    rewards=hnp.arrays(np.float32, (8,), elements=st.sampled_from([0.0, 1.0])),
    groups=hnp.arrays(np.int32, (8,), elements=st.integers(-1, 1)),
    source=hnp.arrays(np.int32, (8,), elements=st.integers(0, 2)),
    cap=hnp.arrays(np.float32, (3,), elements=st.sampled_from([0.0, 0.05, 0.3, 0.5, 0.9, 1.0])),
    learner=st.integers(0, 2),
    max_reward=st.sampled_from([None, 1.0, 2.0]),
)
def test_capability_advantages_match_reference(rewards, groups, source, cap, learner, max_reward):
    got = hacpo_adv(max_reward)(rewards, groups, source, cap, learner)
    want = ref.capability_advantages(rewards, groups, source, cap, learner, 2, max_reward=max_reward)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@functools.cache
def hacpo_adv(max_reward):
    return jax.jit(functools.partial(hacpo.capability_advantages, num_groups=2, max_reward=max_reward))


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(0, 3), stepwise=st.booleans(), alpha=st.sampled_from([1.0, 0.5]))
def test_hacpo_loss_matches_reference(seed, m, stepwise, alpha):
    rng = np.random.default_rng(seed)
    lp, old, _, mask, _, _ = small_batch(seed)
    lp = (old + rng.uniform(-3e-4, 3e-4, old.shape)).astype(np.float32)  # self ratios near the GSPO clip
    adv = rng.normal(size=8).astype(np.float32)
    is_cross = rng.random(8) < 0.5
    src = (np.array([old[i][mask[i]].mean() for i in range(8)]) + rng.uniform(-0.3, 0.1, 8)).astype(np.float32)
    weight = rng.choice([0.5, 1.0, 2.0], 8).astype(np.float32)
    cfg = hacpo.Config(stepwise_clip=stepwise, alpha=alpha)
    got, _ = hacpo_loss(cfg)(lp, old, adv, mask, is_cross=is_cross, source_seq_logprob=src, discrepancy=weight, minibatch_index=m)
    want = ref.hacpo_loss(lp, old, adv, mask, is_cross, src, weight, m, alpha=alpha, stepwise=stepwise)
    np.testing.assert_allclose(float(got), want, rtol=1e-4, atol=1e-6)


def test_hacpo_kl_applies_to_self_samples_only():
    lp, old, refp, mask, _, _ = small_batch(seed=9)
    adv = np.linspace(-1, 1, 8).astype(np.float32)
    is_cross = np.arange(8) % 2 == 1
    base, _ = hacpo.loss(hacpo.Config(), lp, old, adv, mask, is_cross=is_cross)
    with_kl, metrics = hacpo.loss(hacpo.Config(kl_coef=0.5), lp, old, adv, mask, ref_logprobs=refp, is_cross=is_cross)
    # k3 per token, averaged per self sequence; cross rows contribute 0 but count in the sequence mean
    k3 = [np.mean([ref.kl(lp[i, j], refp[i, j], "k3") for j in range(5) if mask[i, j]]) if not is_cross[i] else 0.0
          for i in range(8)]
    np.testing.assert_allclose(float(with_kl) - float(base), 0.5 * np.mean(k3), rtol=1e-4)
    self_tokens = mask & ~is_cross[:, None]
    want_ref_kl = sum(ref.kl(lp[i, j], refp[i, j], "k3") for i, j in zip(*np.nonzero(self_tokens))) / self_tokens.sum()
    np.testing.assert_allclose(float(metrics["ref_kl"]), want_ref_kl, rtol=1e-5)


@functools.cache
def hacpo_loss(cfg):
    return jax.jit(functools.partial(hacpo.loss, cfg))


# ------------------------------------------------------------------------------ JoyAgents


def test_joyagents_memory_thresholds_hand_worked():
    # a node group of 8 rewards (0,0,0,0,0,0,0,5): mu = 0.625, sigma_ddof1 = sqrt((7 * 0.625^2 + 4.375^2) / 7)
    # = sqrt((2.734375 + 19.140625) / 7) = sqrt(3.125) = 1.76777; mu + 1.96 sigma = 4.0898 < 5 -> admitted
    rewards = np.array([0, 0, 0, 0, 0, 0, 0, 5], np.float32)
    groups = np.zeros(8, np.int32)
    upper, lower = joyagents.memory_thresholds(rewards, groups, num_groups=1)
    np.testing.assert_allclose(upper[0], 0.625 + 1.96 * math.sqrt(3.125), rtol=1e-6)
    np.testing.assert_allclose(lower[0], 0.625 - 1.96 * math.sqrt(3.125), rtol=1e-6)
    np.testing.assert_array_equal(joyagents.admission_mask(rewards, groups, num_groups=1), [0] * 7 + [1])
    # mirrored: one -5 among zeros: mu - 1.96 sigma = -4.0898 > -5 -> its retrieved entries are evicted
    np.testing.assert_array_equal(joyagents.eviction_mask(-rewards, groups, num_groups=1), [0] * 7 + [1])
    # a group of 4 cannot pass 1.96 sigma: max z = (4 - 1) / sqrt(4) = 1.5
    assert not joyagents.admission_mask(np.array([0, 0, 0, 5.0]), np.zeros(4, np.int32), num_groups=1).any()


def test_joyagents_entry_score_and_memory_bookkeeping():
    # score = 1 * exp(-0.1 * age) + 1 * reward_gap: age 0, gap 0.5 -> 1.5; age 10, gap 1 -> e^-1 + 1 = 1.3679
    np.testing.assert_allclose(joyagents.entry_score(np.array([0, 10]), np.array([0.5, 1.0])), [1.5, math.exp(-1) + 1], rtol=1e-6)
    # the bookkeeping lives in the one memory store (jmarl.workflows.memory), which scores with
    # this entry_score: decay 0.1 per step = tau 10 steps
    opts = jmemory.MemoryOptions(capacity=2, tau=10.0, top_m=3)
    mem = jmemory.Memory(opts)
    for q, gap in (("a", 0.5), ("b", 1.0)):
        mem = jmemory.admit(mem, "x", q, "s-" + q, reward=gap, baseline=0.0, step=0)
    assert [x.query for x in mem.entries("x")] == ["a", "b"]
    np.testing.assert_allclose(jmemory.entry_scores(mem, "x", 10), [math.exp(-1) + 0.5, math.exp(-1) + 1], rtol=1e-6)
    # at step 10: a scores e^-1 + 0.5 = 0.868, b e^-1 + 1 = 1.368, new c (step 10, gap 0.2) 1 + 0.2 = 1.2 -> a dropped
    mem2 = jmemory.admit(mem, "x", "c", "s-c", reward=0.2, baseline=0.0, step=10)
    assert [x.query for x in mem2.entries("x")] == ["b", "c"] and len(mem.entries("x")) == 2
    b_id = mem2.entries("x")[0].id
    assert [x.query for x in jmemory.evict(mem2, "x", [b_id]).entries("x")] == ["c"]
    assert jmemory.evict(mem2, "x", [99]) == mem2  # unknown ids: nothing to evict
    # retrieval: most similar first, ties by lower id (equal reward gaps)
    big = jmemory.Memory(jmemory.MemoryOptions(capacity=8, top_m=3))
    for q in ("zzzz qqqq", "the quick fox", "the quick fox jumps", "the quick fox"):
        big = jmemory.admit(big, "x", q, "s" + str(len(big.entries("x"))), reward=1.0, baseline=0.0, step=0)
    assert [e.id for e in jmemory.retrieve(big, "x", "the quick fox")] == [1, 3, 2]
    assert jmemory.Memory.from_json(mem2.to_json()) == mem2
    with pytest.raises(JmarlError, match="malformed memory"):
        jmemory.Memory.from_json('{"format": "jmarl.memory", "agents": {"x": [{"query": "x"}]}}')


def test_joyagents_memory_math_has_one_implementation():
    # the store calls the algorithm's threshold math instead of re-implementing it
    assert not any(hasattr(joyagents, name) for name in ("Memory", "MemoryEntry", "admit", "evict", "retrieve"))
    rewards = [0, 0, 0, 0, 0, 0, 0, 5.0]
    upper, lower = joyagents.memory_thresholds(np.array(rewards, np.float32), np.zeros(8, np.int32), num_groups=1)
    assert jmemory.group_thresholds(rewards, 1.96, 1) == pytest.approx((float(upper[0]), float(lower[0])))


def test_joyagents_group_size_too_small_for_the_memory_warns():
    # Samuelson: one sample of G is at most (G - 1) / sqrt(G) sigmas away: 1.79 at G = 5, 2.04 at G = 6
    assert joyagents.min_group_size_for_memory(1.96, 1) == 6
    assert joyagents.min_group_size_for_memory(1.96, 0) == 5  # sqrt(G - 1) > 1.96 from G = 5
    assert joyagents.Config().num_generations == 8
    with pytest.warns(joyagents.MemoryGroupSizeWarning, match="group_size >= 6"):
        joyagents.Config(num_generations=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        joyagents.Config(num_generations=6)
        joyagents.Config(num_generations=4, use_memory=False)  # no memory: any G >= 2
        joyagents.Config(num_generations=4, memory_z=1.0)  # (4 - 1) / 2 = 1.5 > 1
    # and it is exact: at G = 6 an outlier is admitted, at G = 5 never
    for g, admitted in ((6, True), (5, False)):
        r = np.zeros(g, np.float32)
        r[-1] = 1.0
        assert bool(joyagents.admission_mask(r, np.zeros(g, np.int32), num_groups=1).any()) == admitted


def test_joyagents_top_k_node_groups_and_reward():
    cfg = joyagents.Config()  # top-2
    # group variances: g0 (0,1) 0.5, g1 (0,0) 0, g2 (0,4) 8, g3 (1,2) 0.5 -> top-2: g2, then g0 (tie with g3, lower id)
    rewards = np.array([0, 1, 0, 0, 0, 4, 1, 2], np.float32)
    groups = np.repeat(np.arange(4), 2).astype(np.int32)
    np.testing.assert_array_equal(joyagents.keep_mask(cfg, rewards, groups, num_groups=4), [1, 1, 0, 0, 1, 1, 0, 0])
    np.testing.assert_allclose(joyagents.total_reward(np.array([1.0]), np.array([0.5]), np.array([2.0]), cost_weight=0.1), [1.3])
