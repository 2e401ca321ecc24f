"""Method values: configs and their one home per setting, the registry, the uniform interface on a
`LearnerBatch`, every option live, MAGRPO's reference std, HACPO's pieces."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

import _np_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jmarl.algos import METHODS, Method, MethodContext, dapo, get_method, hacpo, magrpo
from jmarl.algos.method import finite_advantages
from jmarl.batch import LearnerBatch
from jmarl.errors import JmarlError
from jmarl.workflows.base import PlanResult, PlanStats
from jmarl.workflows.shared import SharedOptions, SharedStats

SETTINGS = settings(max_examples=20, deadline=None)
NAMES = sorted(METHODS)


# ------------------------------------------------------------------------------ configs


def test_methods_cover_every_method_and_configs_are_typed_frozen_with_defaults():
    assert set(METHODS) == {"grpo", "dr_grpo", "dapo", "gspo", "magrpo", "at_grpo", "hacpo", "joyagents"}
    for name, method in METHODS.items():
        assert isinstance(method, Method) and method.name == name
        cls = method.config
        cfg = cls()
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            # real (not string) annotations, so a config loader can read them off dataclasses.fields
            assert isinstance(field.type, (type, types.UnionType)), (name, field.name, field.type)
            assert hints[field.name] == field.type
            assert field.default is not dataclasses.MISSING, (name, field.name)
            assert isinstance(field.default, field.type), (name, field.name)  # the default has the declared type
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.eps = 1.0  # type: ignore[misc]


def test_method_configs_hold_loss_settings_only():
    sampling = {"num_generations", "num_candidates", "num_turns", "turn_order", "continue_with", "alpha_team",
                "reward_mode", "gamma", "joint_mode", "joint_aggregate", "early_stop_reward", "top_k_groups", "group_size"}
    for name, method in METHODS.items():
        fields = {f.name for f in dataclasses.fields(method.config)}
        assert not fields & sampling, (name, fields & sampling)
        assert {"ddof", "eps", "aggregation", "norm_length", "kl_coef", "kl_kind"} <= fields  # the shared LossConfig


def test_config_defaults_follow_the_papers():
    grpo, dr, dp, gs = (METHODS[n].config() for n in ("grpo", "dr_grpo", "dapo", "gspo"))
    assert (grpo.ratio, grpo.clip_low, grpo.clip_high, grpo.normalize, grpo.aggregation) == (
        "token", 0.2, 0.2, "std", "seq_mean_token_mean")
    assert (dr.normalize, dr.aggregation) == ("none", "seq_mean_token_sum_norm")
    assert (dp.clip_low, dp.clip_high, dp.aggregation, dp.drop_zero_variance) == (0.2, 0.28, "token_mean", True)
    assert (gs.ratio, gs.clip_low, gs.clip_high, gs.aggregation) == ("sequence", 3e-4, 4e-4, "seq_mean_token_mean")
    ma = METHODS["magrpo"].config()
    assert (ma.baseline, ma.ddof, ma.eps_mode, ma.ratio, ma.aggregation) == ("mean", 0, "floor", "none", "seq_sum")
    at = METHODS["at_grpo"].config()
    assert (at.dual_clip, at.aggregation, at.kl_coef) == (None, "token_mean", 0.0)  # the released code: no dual clip
    ha = METHODS["hacpo"].config()
    assert (ha.capability_window, ha.alpha, ha.delta, ha.delta_step, ha.clip_low, ha.clip_high) == (5, 1.0, 0.2, 0.025, 3e-4, 4e-4)
    jo = METHODS["joyagents"].config()
    assert (jo.memory_z, jo.memory_time_weight, jo.memory_reward_weight) == (1.96, 1.0, 1.0)
    defaults = {name: (m.default_plan, m.default_group_size) for name, m in METHODS.items()}
    assert defaults["at_grpo"] == ("tree", 4) and defaults["magrpo"] == ("joint", 4)
    assert defaults["hacpo"] == ("shared", 8) and defaults["joyagents"] == ("node_wise", 8)
    assert defaults["grpo"] == ("independent", 4)


@pytest.mark.parametrize(
    "method, field, value",
    [
        ("grpo", "clip_low", -0.1),
        ("grpo", "clip_high", -0.2),
        ("grpo", "baseline", "median"),
        ("grpo", "aggregation", "mean"),
        ("grpo", "dual_clip", 0.5),
        ("grpo", "kl_kind", "k4"),
        ("grpo", "eps_mode", "clamp"),
        ("grpo", "variance_rank", "var"),
        ("dapo", "drop_low_mean_frac", 1.5),
        ("gspo", "ratio", "seq"),
        ("dr_grpo", "eps", 0.0),
        ("dr_grpo", "norm_length", 0),
        ("magrpo", "normalize", "groupwise"),
        ("hacpo", "delta", 2.0),
        ("hacpo", "omega_min", 0.0),
        ("hacpo", "capability_window", 0),
        ("joyagents", "memory_z", -1.0),
    ],
)
def test_out_of_range_config_values_raise_naming_the_field(method, field, value):
    with pytest.raises(JmarlError, match=field):
        METHODS[method].config(**{field: value})


def test_get_method_names_and_module_paths():
    assert get_method("hacpo") is hacpo.METHOD
    assert get_method("jmarl.algos.gspo:METHOD") is METHODS["gspo"]  # package.module:NAME (tests/test_custom_method.py: your own)
    with pytest.raises(JmarlError, match="ppo2.*choose one of"):
        get_method("ppo2")
    with pytest.raises(JmarlError, match="cannot be imported"):
        get_method("no_such_module:X")
    with pytest.raises(JmarlError, match="not a jmarl.algos.Method"):
        get_method("tests.test_algos_methods:NAMES")


# ------------------------------------------------------------------------------ the uniform interface


def learner_batch(seed=0, n=8, t=5, learner=0):
    """A LearnerBatch with the loss fields filled (the model fields are unused placeholders)."""
    rng = np.random.default_rng(seed)
    lp = rng.uniform(-3, -0.1, (n, t)).astype(np.float32)
    old = (lp + rng.uniform(-0.3, 0.3, (n, t))).astype(np.float32)
    refp = (lp + rng.uniform(-0.3, 0.3, (n, t))).astype(np.float32)
    mask = rng.random((n, t)) < 0.8
    mask[:, 0] = True
    batch = LearnerBatch.loss_only(
        tokens=np.zeros((n, t), np.int32), attention_mask=mask, loss_mask=mask, behavior_logprobs=old,
        reward=rng.integers(0, 2, n).astype(np.float32), group=np.repeat(np.arange(n // 4), 4).astype(np.int32),
        agent=np.zeros(n, np.int32), learner=np.full(n, learner, np.int32),
        source_policy=np.tile([0, 0, 1, 1], n // 4).astype(np.int32),
        source_seq_logprob=np.array([old[i][mask[i]].mean() for i in range(n)], np.float32),
        old_logprobs=old, ref_logprobs=refp,
    )
    return lp, batch


def shared_result(rates):
    """An empty `shared` plan result that reports the per-policy success `rates`."""
    stats = SharedStats(num_generated=0, share=True, samples_per_policy=4, num_records=0, num_lossy=0, success_rate=tuple(rates),
                        reward_mean=tuple(rates))
    return PlanResult((), (), stats)


def device_state(method, cfg):
    state = method.init_state(cfg, MethodContext(num_policies=2, group_size=4))
    if method is hacpo.METHOD:
        state, _ = method.after_plan(cfg, state, shared_result((0.6, 0.3)), 0)
    return method.device_state(cfg, state)


def prepared(method, cfg, batch):
    adv = finite_advantages(method.advantages(cfg, batch, device_state(method, cfg)), batch.reward)
    keep = method.keep_mask(cfg, batch)
    return batch.replace(advantages=adv, loss_mask=batch.loss_mask & keep[:, None])


@pytest.mark.parametrize("name", NAMES)
def test_every_method_runs_through_the_uniform_interface(name):
    method = METHODS[name]
    cfg = method.config()
    lp, batch = learner_batch()
    batch = prepared(method, cfg, batch)
    assert batch.advantages.shape == (8,)
    value, metrics = jax.jit(lambda lp, b: method.loss(cfg, lp, b))(lp, batch)
    assert value.shape == () and np.isfinite(float(value))
    assert {"loss", "pg_loss", "clip_fraction", "ratio_mean", "approx_kl"} <= set(metrics)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "at_grpo", "joyagents"])
def test_clipped_presets_equal_the_reference_with_their_defaults(name):
    method = METHODS[name]
    cfg = method.config(kl_coef=0.05, norm_length=7)
    lp, batch = learner_batch(seed=4)
    adv = method.advantages(cfg, batch, None)
    np.testing.assert_allclose(
        adv, ref.group_advantages(batch.reward, batch.group, 8, cfg.baseline, cfg.normalize, cfg.ddof), rtol=1e-5, atol=1e-6
    )
    got, _ = method.loss(cfg, lp, batch.replace(advantages=adv))
    want, _ = ref.policy_loss(
        lp, batch.old_logprobs, np.asarray(adv), batch.loss_mask, ratio=cfg.ratio, clip_low=cfg.clip_low,
        clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, aggregation=cfg.aggregation, ref=batch.ref_logprobs,
        kl_coef=0.05, kl_kind=cfg.kl_kind, norm_length=7,
    )
    np.testing.assert_allclose(float(got), want, rtol=1e-4, atol=1e-6)


def test_dr_grpo_loss_does_not_depend_on_padding():
    """Dr.GRPO divides by N x a constant (the run's completion budget, `norm_length`): the same
    samples padded to width 5 or 10 give the same loss (with norm_length None it would halve)."""
    from jmarl.algos import dr_grpo

    lp, batch = learner_batch(seed=5)
    batch = batch.replace(advantages=np.linspace(-1, 1, 8).astype(np.float32))
    pad = lambda x, fill=0: np.concatenate([x, np.full(x.shape, fill, x.dtype)], axis=1)  # noqa: E731
    wide = batch.replace(loss_mask=pad(batch.loss_mask, False), old_logprobs=pad(batch.old_logprobs), ref_logprobs=None)
    cfg = dr_grpo.Config(norm_length=16)
    narrow_loss = float(dr_grpo.METHOD.loss(cfg, lp, batch.replace(ref_logprobs=None))[0])
    np.testing.assert_allclose(float(dr_grpo.METHOD.loss(cfg, pad(lp), wide)[0]), narrow_loss, rtol=1e-6)
    unset = dr_grpo.Config()  # norm_length None: the width, which the config layer never leaves in a run
    ratio = float(dr_grpo.METHOD.loss(unset, pad(lp), wide)[0]) / float(dr_grpo.METHOD.loss(unset, lp, batch.replace(ref_logprobs=None))[0])
    np.testing.assert_allclose(ratio, 0.5, rtol=1e-5)


def test_dapo_keep_mask_drops_zero_variance_groups():
    _, batch = learner_batch()
    batch = batch.replace(reward=np.array([1, 1, 1, 1, 0, 1, 0, 0], np.float32), group=np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32))
    np.testing.assert_array_equal(dapo.METHOD.keep_mask(dapo.Config(), batch), [0, 0, 0, 0, 1, 1, 1, 1])


def test_overlong_penalty_is_dapos_soft_punishment_worked_by_hand():
    """Eq. 13 of the DAPO paper with L_max = 10, L_cache = 4: nothing up to 6 tokens, then a
    quarter point a token, -1 at and past the budget (TRL: 90 of 100 with a cache of 20 -> -0.5)."""
    lengths = np.array([3, 6, 7, 8, 10, 12])
    np.testing.assert_allclose(dapo.overlong_penalty(lengths, 10, 4), [0, 0, -0.25, -0.5, -1.0, -1.0])
    np.testing.assert_allclose(dapo.overlong_penalty(lengths, 10, 4, factor=0.5), [0, 0, -0.125, -0.25, -0.5, -0.5])
    np.testing.assert_allclose(dapo.overlong_penalty(np.array([90]), 100, 20), [-0.5])
    np.testing.assert_array_equal(dapo.overlong_penalty(lengths, 10, 0), np.zeros(6))


def test_dapo_shapes_the_reward_by_length_and_filters_on_the_task_reward():
    """With overlong_buffer set, a group of equal task rewards and different lengths gets the
    advantages of the shaped reward (shorter ahead), and dynamic sampling still drops it."""
    _, batch = learner_batch()
    lengths = np.array([2, 3, 4, 5, 2, 2, 5, 5])
    mask = np.arange(5)[None, :] < lengths[:, None]
    batch = batch.replace(loss_mask=mask, reward=np.array([1, 1, 1, 1, 0, 1, 0, 1], np.float32),
                          group=np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32))
    cfg = dapo.Config(overlong_buffer=2, overlong_limit=5, overlong_factor=1.0)
    shaped = batch.reward + np.array([0, 0, -0.5, -1.0, 0, 0, -1.0, -1.0], np.float32)
    np.testing.assert_allclose(dapo.METHOD.advantages(cfg, batch, None),
                               ref.group_advantages(shaped, batch.group, 8, "mean", "std", 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dapo.METHOD.keep_mask(cfg, batch), [0, 0, 0, 0, 1, 1, 1, 1])
    plain = dapo.Config()
    np.testing.assert_allclose(dapo.METHOD.advantages(plain, batch, None)[:4], np.zeros(4), atol=1e-6)
    with pytest.raises(JmarlError, match="overlong_buffer = 6 is more than overlong_limit"):
        dapo.Config(overlong_buffer=6, overlong_limit=5)


def test_magrpo_advantage_is_the_references_population_std_floored():
    # CoMLRL: returns (0, 1, 1, 0): mean 0.5, population std 0.5 -> A = (-1, 1, 1, -1); jmarl's old
    # default (ddof 1, std + eps) gave +-0.866 = sqrt(3/4), a 13% smaller step.
    _, batch = learner_batch()
    batch = batch.replace(reward=np.array([0, 1, 1, 0, 2, 2, 2, 2], np.float32))
    adv = magrpo.METHOD.advantages(magrpo.Config(), batch, None)
    np.testing.assert_allclose(adv, [-1, 1, 1, -1, 0, 0, 0, 0], rtol=1e-6)
    old = magrpo.METHOD.advantages(magrpo.Config(ddof=1, eps_mode="add"), batch, None)
    np.testing.assert_allclose(np.abs(np.asarray(old)[:4]), np.sqrt(0.75), rtol=1e-5)


def test_magrpo_loss_is_minus_advantage_times_summed_logprob():
    lp, batch = learner_batch(seed=2)
    batch = batch.replace(advantages=np.linspace(-1, 1, 8).astype(np.float32))
    got, _ = magrpo.METHOD.loss(magrpo.Config(), lp, batch)
    want, _ = ref.policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, ratio="none", aggregation="seq_sum")
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


# ------------------------------------------------------------------------------ every option is live

# field -> a value (or values: the first that is not the default) to change it to; fields that act
# only under another setting get it too
ALTERNATIVES: dict[str, tuple[object, dict]] = {
    "ddof": ((0, 1), {"normalize": "std"}),
    "eps": (0.5, {"normalize": "std"}),
    "aggregation": (("seq_sum", "token_mean"), {}),
    "norm_length": (3, {"aggregation": "seq_mean_token_sum_norm"}),
    "kl_coef": (0.5, {}),
    "kl_kind": ("k1", {"kl_coef": 0.5}),
    "baseline": ("max", {}),
    "normalize": (("batch", "std"), {}),
    "eps_mode": (("floor", "add"), {"eps": 0.5, "normalize": "std"}),
    "ratio": (("sequence", "token"), {"clip_low": 0.9, "clip_high": 5.0}),
    "clip_low": (0.01, {"ratio": "token"}),
    "clip_high": (0.01, {"ratio": "token"}),
    "dual_clip": (1.01, {"ratio": "token", "clip_low": 0.9, "clip_high": 5.0}),
    "drop_zero_variance": ((True, False), {}),
    "drop_low_variance_frac": (0.5, {}),
    "drop_low_mean_frac": (0.5, {}),
    "variance_rank": ("range_normalised", {"drop_low_variance_frac": 0.4}),
    "capability_window": (1, {}),
    "alpha": (0.3, {}),
    "delta": (0.05, {}),
    "delta_step": (0.2, {}),
    "omega_min": (0.6, {}),
    "omega_max": (1.5, {}),
    "max_reward": (0.5, {}),
    "capability_baseline": (False, {}),
    "discrepancy": (False, {}),
    "stepwise_clip": (False, {}),
    "overlong_buffer": (3, {"overlong_limit": 6}),
    "overlong_factor": (0.5, {"overlong_buffer": 3, "overlong_limit": 6}),
    "overlong_limit": (4, {"overlong_buffer": 3}),
}
# JoyAgents-R1's memory settings change the memory, not the loss (tested in test_trainer_hetero)
MEMORY_FIELDS = {"memory_z", "memory_time_weight", "memory_reward_weight", "memory_decay", "memory_top_m",
                 "memory_capacity", "use_memory"}


def liveness_batch():
    """A batch on which every loss setting shows: groups of mixed rewards and variances, ratios far
    from 1 both ways, padding tokens, a reference, and another policy's samples."""
    lp, batch = learner_batch(seed=11, n=20, t=6)
    rng = np.random.default_rng(3)
    old = (lp + rng.uniform(-1.5, 1.5, lp.shape)).astype(np.float32)
    reward = np.array([0, 1, 1, 1, 0, 10, 10, 10, 0, .5, .5, 1, 0, .1, 0, 0, 1, 1, 1, 1], np.float32)
    mask = batch.loss_mask
    source = np.array([lp[i][mask[i]].mean() + 0.1 for i in range(lp.shape[0])], np.float32)  # cross ratios ~0.9
    return lp, batch.replace(old_logprobs=old, reward=reward, source_seq_logprob=source)


def outcome(method, cfg, lp, batch, window=((0.6, 0.3),)):
    state = method.init_state(cfg, MethodContext(num_policies=2, group_size=4))
    for rates in window:
        state, _ = method.after_plan(cfg, state, shared_result(rates), 0)
    b = batch.replace(advantages=finite_advantages(method.advantages(cfg, batch, method.device_state(cfg, state)), batch.reward))
    b = b.replace(loss_mask=b.loss_mask & method.keep_mask(cfg, b)[:, None], update_index=jnp.asarray(1))
    loss, metrics = method.loss(cfg, lp, b)
    grad = jax.grad(lambda x: method.loss(cfg, x, b)[0])(lp)
    return np.concatenate([np.ravel(b.advantages), np.ravel(b.loss_mask).astype(np.float32), [float(loss)], np.ravel(grad)])


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_option_of_every_method_changes_what_runs(name):
    method = METHODS[name]
    lp, batch = liveness_batch()
    fields = [f.name for f in dataclasses.fields(method.config) if f.name not in MEMORY_FIELDS]
    for field in fields:
        value, context = ALTERNATIVES[field]
        context = {k: v for k, v in context.items() if k in fields}
        base = method.config(**context)
        values = value if isinstance(value, tuple) else (value,)
        value = next(v for v in values if v != getattr(base, field))
        changed = dataclasses.replace(base, **{field: value})
        if field == "capability_window":  # only a window of several steps shows it
            window = ((0.6, 0.3), (0.1, 0.9))
            a, b = outcome(method, base, lp, batch, window), outcome(method, changed, lp, batch, window)
        else:
            a, b = outcome(method, base, lp, batch), outcome(method, changed, lp, batch)
        assert not np.allclose(a, b, equal_nan=True), f"{name}: algo.options.{field}={value!r} changes nothing"


# ------------------------------------------------------------------------------ HACPO


@pytest.mark.slow
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
    # the learner given per row gives the same
    np.testing.assert_allclose(hacpo.capability_advantages(rewards, groups, source, cap, np.zeros(4, np.int32), num_groups=1), a0)
    # Same learner with max_reward = 2: 1.25 <= 2, no fallback -> A = (r - 1.25) / 0.5 = (-0.5, -2.5, -0.5, -0.5)
    a0_max2 = hacpo.capability_advantages(rewards, groups, source, cap, 0, num_groups=1, max_reward=2.0)
    np.testing.assert_allclose(a0_max2, np.array([-0.5, -2.5, -0.5, -0.5]) * 0.5 / sigma, rtol=1e-6)
    # Learner 1: mu = (0.5*1 + 0.5*0 + 1*1 + 1*1) / 4 = 0.625 <= 1 -> A = (r - 0.625) / 0.5 = (0.75, -1.25, 0.75, 0.75)
    a1 = hacpo.capability_advantages(rewards, groups, source, cap, 1, num_groups=1)
    np.testing.assert_allclose(a1, np.array([0.75, -1.25, 0.75, 0.75]) * 0.5 / sigma, rtol=1e-6)

    # Discrepancy coefficients: learner 0 on agent 1's answers uses omega^{1,0} = 0.5, on its own 1;
    # learner 1 on agent 0's answers uses omega^{0,1} = 2.
    np.testing.assert_allclose(hacpo.discrepancy_coefficients(cap, source, 0), [1, 1, 0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(hacpo.discrepancy_coefficients(cap, source, 1), [2, 2, 1, 1], rtol=1e-6)

    # The method's advantage is their product (the cross loss reads only omega * A).
    _, batch = learner_batch(n=4, learner=0)
    batch = batch.replace(reward=rewards, group=groups, source_policy=source)
    got = hacpo.METHOD.advantages(hacpo.Config(), batch, jnp.asarray(cap))
    np.testing.assert_allclose(got, (rewards - 0.5) / sigma * np.array([1, 1, 0.5, 0.5]), rtol=1e-6)

    # Stepwise clip bounds with delta 0.2, delta_step 0.025: m=0 -> [0.8, 1]; m=1 -> [0.825, 1]; m=2 -> [0.85, 1]
    for m, low in ((0, 0.8), (1, 0.825), (2, 0.85)):
        lo, hi = hacpo.stepwise_clip_bounds(m, delta=0.2, delta_step=0.025)
        np.testing.assert_allclose([float(lo), float(hi)], [low, 1.0], rtol=1e-6)
    np.testing.assert_allclose(float(hacpo.stepwise_clip_bounds(10)[0]), 1.0)  # never past 1

    # Cross ratio s = exp(mean lp_learner - source_seq_logprob) = 0.82; alpha = 1: s~ = c * sg(c)
    mask = np.ones((1, 3), bool)
    lp = np.full((1, 3), np.log(0.82), np.float32)
    for m, c in ((0, 0.82), (1, 0.825), (2, 0.85)):  # m=0 inside [0.8, 1]; m=1, 2 clipped up to the bound
        np.testing.assert_allclose(hacpo.cross_ratio(lp, mask, np.zeros(1, np.float32), m), [c * c], rtol=1e-5)
    grad = jax.grad(lambda x: hacpo.cross_ratio(x, mask, np.zeros(1), 0)[0])(lp)
    np.testing.assert_allclose(grad, np.full((1, 3), 0.82 * 0.82 / 3), rtol=1e-5)  # d mean / d lp_t = 1/3
    np.testing.assert_array_equal(jax.grad(lambda x: hacpo.cross_ratio(x, mask, np.zeros(1), 1)[0])(lp), 0.0)

    # Combined loss for learner 0 at m=0: a self sample with lp == lp_old (s = 1), A = 1 -> -1; a cross
    # sample from agent 1 with s = 0.82, omega * A = 0.5 -> -(0.82^2) * 0.5 = -0.3362; mean -0.6681.
    lp2 = np.concatenate([np.full((1, 3), -1.0, np.float32), lp])
    loss, metrics = hacpo.loss(
        hacpo.Config(), lp2, np.full((2, 3), -1.0, np.float32), np.ones(2, np.float32), np.ones((2, 3), bool),
        is_cross=np.array([False, True]), source_seq_logprob=np.array([-1.0, 0.0], np.float32),
        discrepancy=np.array([1.0, 0.5], np.float32), minibatch_index=0,
    )
    np.testing.assert_allclose(float(loss), (-1 - 0.3362) / 2, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["cross_ratio_mean"]), 0.82, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["cross_fraction"]), 0.5)
    # the same through the method on a LearnerBatch: the weight folded into the advantage
    _, b = learner_batch(n=2)
    b = b.replace(loss_mask=np.ones((2, 3), bool), old_logprobs=np.full((2, 3), -1.0, np.float32), ref_logprobs=None,
                  advantages=np.array([1.0, 0.5], np.float32), source_policy=np.array([0, 1], np.int32),
                  source_seq_logprob=np.array([-1.0, 0.0], np.float32), update_index=jnp.asarray(0))
    np.testing.assert_allclose(float(hacpo.METHOD.loss(hacpo.Config(), lp2, b)[0]), (-1 - 0.3362) / 2, rtol=1e-5)


def test_naive_sharing_is_not_a_plan_option():
    # naive sharing is algo.options (the three switches off), never an option of the shared plan
    assert "naive" not in {f.name for f in dataclasses.fields(SharedOptions)}
    with pytest.raises(JmarlError, match="algo.options.capability_baseline/discrepancy/stepwise_clip: false"):
        SharedOptions(mode="naive")


def test_hacpo_reads_the_shared_plans_success_rates_only():
    cfg = hacpo.Config()
    state = hacpo.METHOD.init_state(cfg, MethodContext(num_policies=2, group_size=4))
    state, metrics = hacpo.METHOD.after_plan(cfg, state, shared_result((0.5, 0.25)), 0)
    assert metrics["hacpo/success_0"] == 0.5 and metrics["hacpo/success_1"] == 0.25
    with pytest.raises(JmarlError, match="SharedStats.*workflow.plan: shared"):
        hacpo.METHOD.after_plan(cfg, state, PlanResult((), (), PlanStats(num_generated=0)), 1)


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
    state = hacpo.HACPOState(w, 2)
    assert hacpo.HACPOState.from_json(state.to_json()) == state


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
    _, batch = learner_batch(seed)
    old, mask = batch.old_logprobs, batch.loss_mask
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
    lp, batch = learner_batch(seed=9)
    old, refp, mask = batch.old_logprobs, batch.ref_logprobs, batch.loss_mask
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
