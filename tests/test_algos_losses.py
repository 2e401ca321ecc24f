"""Importance ratios, clipped surrogate, KL penalties and aggregation against the NumPy reference."""

from __future__ import annotations

import functools

import _np_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jmarl.algos import aggregate_loss, importance_ratio, kl_penalty, policy_loss
from jmarl.errors import JmarlError

N, T = 6, 5
SETTINGS = settings(max_examples=30, deadline=None)


def make_batch(seed: int, *, spread: float = 0.6, per_token_adv: bool = False):
    """Random log-probs, old log-probs (lp + U(-spread, spread)), advantages and a mask with an empty row."""
    rng = np.random.default_rng(seed)
    lp = rng.uniform(-4.0, -0.05, (N, T)).astype(np.float32)
    old = (lp + rng.uniform(-spread, spread, (N, T))).astype(np.float32)
    refp = (lp + rng.uniform(-1.0, 1.0, (N, T))).astype(np.float32)
    mask = rng.random((N, T)) < 0.7
    mask[0, 0] = True
    mask[-1] = False  # a padding row
    adv = rng.normal(size=(N, T) if per_token_adv else (N,)).astype(np.float32)
    return lp, old, refp, adv, mask


@functools.cache
def jitted_loss(ratio, aggregation, dual_clip, kl_kind, kl_coef, clip_low, clip_high):
    return jax.jit(
        functools.partial(
            policy_loss, ratio=ratio, aggregation=aggregation, dual_clip=dual_clip, kl_kind=kl_kind, kl_coef=kl_coef,
            clip_low=clip_low, clip_high=clip_high,
        )
    )


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    ratio=st.sampled_from(["token", "sequence", "sequence_token", "none"]),
    aggregation=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_sum"]),
    dual_clip=st.sampled_from([None, 3.0]),
    per_token_adv=st.booleans(),
    kl=st.sampled_from([None, ("k1", 0.1), ("k2", 0.05), ("k3", 0.04)]),
    clips=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4)]),
)
@pytest.mark.slow
def test_policy_loss_matches_reference(seed, ratio, aggregation, dual_clip, per_token_adv, kl, clips):
    lp, old, refp, adv, mask = make_batch(seed, per_token_adv=per_token_adv)
    kl_kind, kl_coef = kl if kl else ("k3", 0.0)
    f = jitted_loss(ratio, aggregation, dual_clip, kl_kind, kl_coef, *clips)
    got, metrics = f(lp, old, adv, mask, ref_logprobs=refp if kl else None)
    want, want_metrics = ref.policy_loss(
        lp, old, adv, mask, ratio=ratio, clip_low=clips[0], clip_high=clips[1], dual_clip=dual_clip,
        aggregation=aggregation, ref=refp if kl else None, kl_coef=kl_coef, kl_kind=kl_kind,
    )
    np.testing.assert_allclose(float(got), want, rtol=1e-4, atol=1e-5)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_matches_reference(kind):
    lp, _, refp, _, mask = make_batch(3)
    got = np.asarray(kl_penalty(lp, refp, mask, kind))
    want = np.array([[ref.kl(lp[i, j], refp[i, j], kind) if mask[i, j] else 0.0 for j in range(T)] for i in range(N)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if kind in ("k2", "k3"):
        assert np.all(got >= 0)


def test_clip_and_dual_clip_hand_worked():
    # one sequence, three tokens; log-ratios log(1.5), log(0.5), log(4.0); A = +1, -1, -1; clip 0.2/0.2, c = 3
    # token 0: A>0, rho 1.5 -> max(-1.5, -1.2) = -1.2 (clipped)
    # token 1: A<0, rho 0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    # token 2: A<0, rho 4.0 -> max(4.0, 1.2) = 4.0 -> dual clip caps at -c*A = 3.0
    # token_mean = (-1.2 + 0.8 + 3.0) / 3 = 0.866667
    old = np.zeros((1, 3), np.float32)
    lp = np.log(np.array([[1.5, 0.5, 4.0]], np.float32))
    adv = np.array([[1.0, -1.0, -1.0]], np.float32)
    mask = np.ones((1, 3), bool)
    loss, metrics = policy_loss(lp, old, adv, mask, dual_clip=3.0)
    np.testing.assert_allclose(float(loss), (-1.2 + 0.8 + 3.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["dual_clip_fraction"]), 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["ratio_mean"]), (1.5 + 0.5 + 4.0) / 3, rtol=1e-5)


def test_aggregations_hand_worked():
    # L = [[1, 2, x], [3, x, x], [x, x, x]] (x masked): token_mean = 6/3 = 2;
    # seq_mean_token_mean = mean(1.5, 3) = 2.25 (the empty row is padding, not counted);
    # seq_mean_token_sum_norm = 6 / (2 rows * T=3) = 1; seq_sum = mean(3, 3) = 3
    per_token = np.array([[1, 2, 9], [3, 9, 9], [9, 9, 9]], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
    expect = {"token_mean": 2.0, "seq_mean_token_mean": 2.25, "seq_mean_token_sum_norm": 1.0, "seq_sum": 3.0}
    for name, value in expect.items():
        np.testing.assert_allclose(float(aggregate_loss(per_token, mask, name)), value, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(float(aggregate_loss(per_token, mask, "seq_mean_token_sum_norm", norm_length=6)), 0.5)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dual=st.sampled_from([None, 3.0]))
def test_token_loss_gradient_is_minus_ratio_times_advantage_over_count(seed, dual):
    lp, old, _, adv, mask = make_batch(seed, spread=0.5)
    grad = np.asarray(
        jax.grad(lambda x: policy_loss(x, old, adv, mask, ratio="token", dual_clip=dual, aggregation="token_mean")[0])(lp)
    )
    rho = np.exp(lp.astype(np.float64) - old)
    a = np.broadcast_to(adv[:, None], (N, T))
    plain, capped = -rho * a, -np.clip(rho, 0.8, 1.2) * a
    clipped = capped > plain
    if dual is not None:
        clipped |= (a < 0) & (np.maximum(plain, capped) > -dual * a)
    count = mask.sum()
    expected = np.where(mask & ~clipped, -rho * a / count, 0.0)
    assume((mask & clipped).any() and (mask & ~clipped).any())  # both cases present (most seeds)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
    assert np.all(grad[mask & clipped] == 0.0)  # exactly zero where clipped


@pytest.mark.slow
def test_gspo_gradient_flows_through_the_sequence_mean():
    lp, old, _, adv, mask = make_batch(7, spread=0.05)
    rows = mask.any(axis=1).sum()
    counts = np.maximum(mask.sum(axis=1), 1)
    s = np.exp(np.array([(lp[i] - old[i])[mask[i]].mean() if mask[i].any() else 0.0 for i in range(N)]))

    def gspo(kind, clip):
        return jax.grad(lambda x: policy_loss(x, old, adv, mask, ratio=kind, clip_low=clip, clip_high=clip,
                                              aggregation="seq_mean_token_mean")[0])(lp)

    # Unclipped: d/dlp_{i,t} (-s_i A_i) = -s_i A_i / |y_i|, the same for every token of the row.
    expected = np.where(mask, (-s * adv / counts / rows)[:, None], 0.0)
    np.testing.assert_allclose(gspo("sequence", 10.0), expected, rtol=1e-5, atol=1e-7)
    # GSPO-token with per-sequence advantages has the same gradient (GSPO paper, eq. 11).
    np.testing.assert_allclose(gspo("sequence_token", 10.0), expected, rtol=1e-5, atol=1e-7)
    # With the GSPO clip (3e-4 / 4e-4) a whole sequence is clipped or not: its row gradient is 0 or the above.
    grad = np.asarray(gspo("sequence", 3e-4))
    inside = (s >= 1 - 3e-4) & (s <= 1 + 3e-4)
    clipped_rows = ~inside & (np.sign(s - 1) == np.sign(adv))  # ratio beyond the side that helps A
    assert clipped_rows[mask.any(axis=1)].any()
    np.testing.assert_array_equal(grad[clipped_rows], 0.0)
    np.testing.assert_allclose(grad[~clipped_rows], expected[~clipped_rows], rtol=1e-5, atol=1e-7)


def test_ratio_none_is_the_on_policy_policy_gradient():
    # MAGRPO: loss = mean_i(-A_i * sum_t lp_it) over non-empty rows; same gradient, value -mean_i A_i |y_i|.
    lp, old, _, adv, mask = make_batch(11)
    rows = mask.any(axis=1)

    def explicit(x):
        return jnp.sum(jnp.where(rows, -adv * jnp.sum(jnp.where(mask, x, 0.0), axis=1), 0.0)) / rows.sum()

    ours = lambda x: policy_loss(x, old, adv, mask, ratio="none", aggregation="seq_sum")[0]  # noqa: E731
    np.testing.assert_allclose(jax.grad(ours)(lp), jax.grad(explicit)(lp), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(ours(lp)), float(np.sum(-adv * mask.sum(1)) / rows.sum()), rtol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_sum"])
def test_padding_rows_do_not_change_the_loss(aggregation):
    lp, old, _, adv, mask = make_batch(5)
    pad = lambda x, v: np.concatenate([x, np.full((3,) + x.shape[1:], v, x.dtype)])  # noqa: E731
    a, _ = policy_loss(lp, old, adv, mask, aggregation=aggregation)
    b, _ = policy_loss(pad(lp, np.nan), pad(old, 0.0), pad(adv, 5.0), pad(mask, False), aggregation=aggregation)
    np.testing.assert_allclose(float(b), float(a), rtol=1e-6)


def test_importance_ratio_values():
    lp, old, _, _, mask = make_batch(2)
    tok = np.asarray(importance_ratio(lp, old, mask, "token"))
    np.testing.assert_allclose(tok[mask], np.exp(lp - old)[mask], rtol=1e-5)
    seq = np.asarray(importance_ratio(lp, old, mask, "sequence"))
    np.testing.assert_allclose(seq[0], np.exp((lp[0] - old[0])[mask[0]].mean()), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(importance_ratio(lp, old, mask, "sequence_token")), seq, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(importance_ratio(lp, old, mask, "none"))[mask], 1.0)
    huge = np.asarray(importance_ratio(np.full((1, 2), 100.0), np.zeros((1, 2)), np.ones((1, 2), bool)))
    np.testing.assert_allclose(huge, np.exp(20.0), rtol=1e-5)  # log-ratio clamped to 20


def test_unknown_options_raise():
    lp, old, _, adv, mask = make_batch(0)
    for kwargs, field in (({"ratio": "tok"}, "ratio"), ({"aggregation": "mean"}, "aggregation")):
        with pytest.raises(JmarlError, match=field):
            policy_loss(lp, old, adv, mask, **kwargs)
    with pytest.raises(JmarlError, match="kl_kind"):
        kl_penalty(lp, old, mask, "k4")
