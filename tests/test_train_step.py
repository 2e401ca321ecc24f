"""The jitted update: mini-batches and accumulation vs a NumPy loop, non-finite skip, policy vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmarl import JmarlError
from jmarl.train.lora import init_lora, merge_lora
from jmarl.train.optim import learning_rate_schedule, make_optimizer
from jmarl.train.step import init_train_state, jit_update, make_update


def _loss(params, frozen, batch):
    pred = batch["x"] @ params["w"]
    return jnp.mean((pred - batch["y"]) ** 2), {}


def _batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32), "y": rng.normal(size=n).astype(np.float32)}


def _fresh(w):
    return {"w": jnp.array(w, jnp.float32)}


def test_minibatches_match_numpy_sgd():
    b = _batch()
    update = jit_update(make_update(_loss, optax.sgd(0.1), num_minibatches=2, grad_accum=2))
    state, metrics = update(init_train_state(_fresh(np.ones(3)), optax.sgd(0.1)), None, b)
    w = np.ones(3)
    for m in range(2):  # each update: mean of two equal micro-batch gradients = full-slice gradient
        xs, ys = b["x"][4 * m : 4 * m + 4], b["y"][4 * m : 4 * m + 4]
        w = w - 0.1 * 2 * xs.T @ (xs @ w - ys) / 4
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-5)
    assert int(state.step) == 2 and int(state.skipped) == 0


def test_epochs_pass_over_the_same_minibatches_again():
    """epochs=2 with 2 mini-batches is 4 SGD updates: slices 0, 1, then 0, 1 again (NumPy), each
    sample seen twice, not the batch cut into 4 pieces."""
    b = _batch()
    update = jit_update(make_update(_loss, optax.sgd(0.1), num_minibatches=2, epochs=2))
    state, _ = update(init_train_state(_fresh(np.ones(3)), optax.sgd(0.1)), None, b)
    w = np.ones(3)
    for m in (0, 1, 0, 1):
        xs, ys = b["x"][4 * m : 4 * m + 4], b["y"][4 * m : 4 * m + 4]
        w = w - 0.1 * 2 * xs.T @ (xs @ w - ys) / 4
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-5)
    assert int(state.step) == 4


def test_non_finite_minibatch_is_skipped():
    b = _batch()
    b["y"][0] = np.nan  # poisons mini-batch 0 only
    update = jit_update(make_update(_loss, optax.sgd(0.1), num_minibatches=2))
    state, _ = update(init_train_state(_fresh(np.ones(3)), optax.sgd(0.1)), None, b)
    xs, ys = b["x"][4:], b["y"][4:]
    w = np.ones(3) - 0.1 * 2 * xs.T @ (xs @ np.ones(3) - ys) / 4
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-5)
    assert int(state.step) == 1 and int(state.skipped) == 1


@pytest.mark.slow
def test_stacked_policies_equal_separate_runs():
    opt = make_optimizer(1e-2, total_steps=10, warmup_steps=2, schedule="cosine")
    b0, b1 = _batch(seed=1), _batch(seed=2)
    w0, w1 = np.ones(3), np.arange(3.0)
    single = jit_update(make_update(_loss, opt, num_minibatches=2))
    stacked = jit_update(make_update(_loss, opt, num_minibatches=2), stacked=True)
    s_stk = jax.tree.map(lambda a, c: jnp.stack([a, c]), init_train_state(_fresh(w0), opt), init_train_state(_fresh(w1), opt))
    s0, s1 = init_train_state(_fresh(w0), opt), init_train_state(_fresh(w1), opt)
    for _ in range(3):
        s_stk, _ = stacked(s_stk, None, jax.tree.map(lambda a, c: np.stack([a, c]), b0, b1))
        s0, _ = single(s0, None, b0)
        s1, _ = single(s1, None, b1)
    np.testing.assert_allclose(s_stk.params["w"][0], s0.params["w"], rtol=1e-6)
    np.testing.assert_allclose(s_stk.params["w"][1], s1.params["w"], rtol=1e-6)


def test_indivisible_batch_raises():
    with pytest.raises(JmarlError, match="pad it to a multiple of 3"):
        make_update(_loss, optax.sgd(0.1), num_minibatches=3)(
            init_train_state(_fresh(np.ones(3)), optax.sgd(0.1)), None, _batch(8)
        )


@pytest.mark.slow
def test_schedule_warmup_then_cosine():
    s = learning_rate_schedule(1.0, total_steps=12, warmup_steps=2, schedule="cosine")
    assert float(s(0)) == 0.0 and float(s(1)) == pytest.approx(0.5)
    assert float(s(2)) == pytest.approx(1.0) and float(s(12)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_lora_fresh_adapter_is_identity_and_only_targets_kernels():
    params = {
        "layers": {"q_proj": {"kernel": jnp.ones((2, 4, 6)), "bias": jnp.ones((2, 6))}, "mlp": {"kernel": jnp.ones((4, 4))}},
        "embed": {"embedding": jnp.ones((9, 4))},
    }
    ad = init_lora(params, jax.random.key(0), rank=2, target_modules=["q_proj"])
    assert ad["layers"]["q_proj"]["kernel"]["a"].shape == (2, 4, 2)
    assert ad["layers"]["q_proj"]["bias"] is None and ad["layers"]["mlp"]["kernel"] is None
    merged = merge_lora(params, ad, rank=2, alpha=4.0)
    jax.tree.map(np.testing.assert_array_equal, merged, params)
    ad = jax.tree.map(lambda x: x + 1.0, ad)  # A = a + 1, B = 1
    merged = merge_lora(params, ad, rank=2, alpha=4.0)
    a = np.asarray(ad["layers"]["q_proj"]["kernel"]["a"])
    expected = 1.0 + 2.0 * a @ np.ones((2, 2, 6))
    np.testing.assert_allclose(merged["layers"]["q_proj"]["kernel"], expected, rtol=1e-6)
    with pytest.raises(JmarlError, match="matched no kernel"):
        init_lora(params, jax.random.key(0), rank=2, target_modules=["nothing"])


def _learner_batch(n=8, t=4, seed=0):
    """A LearnerBatch whose micro-batches hold very different token counts."""
    from jmarl.batch import LearnerBatch

    rng = np.random.default_rng(seed)
    mask = np.zeros((n, t), bool)
    mask[: n // 2] = True  # the first half full rows ...
    mask[n // 2 :, 0] = True  # ... the second half one token each
    return LearnerBatch.loss_only(
        tokens=rng.normal(size=(n, t)).astype(np.float32), attention_mask=mask, loss_mask=mask,
        advantages=rng.normal(size=n).astype(np.float32), old_logprobs=np.zeros((n, t), np.float32),
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_sum"])
def test_gradient_accumulation_gives_the_whole_minibatch_mean(aggregation):
    """token_mean over a mini-batch of 4 + 4 rows with 16 and 4 tokens is sum / 20, not the mean of
    sum_a / 16 and sum_b / 4: the update hands the loss the mini-batch's counts (per micro-batch)."""
    from jmarl.algos.losses import policy_loss

    def loss_fn(params, frozen, batch):
        lp = params["w"] * batch.tokens
        loss, metrics = policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, ratio="none",
                                    aggregation=aggregation, norm_length=4, num_tokens=batch.num_tokens, num_rows=batch.num_rows)
        return loss, {"update_index": batch.update_index.astype(jnp.float32)}

    batch = _learner_batch()
    opt = optax.sgd(1.0)
    fresh = lambda: init_train_state({"w": jnp.array(0.3, jnp.float32)}, opt)  # noqa: E731  (the update donates it)
    whole = jit_update(make_update(loss_fn, opt, grad_accum=1))(fresh(), None, batch)[0]
    accumulated = jit_update(make_update(loss_fn, opt, grad_accum=2))(fresh(), None, batch)[0]
    np.testing.assert_allclose(accumulated.params["w"], whole.params["w"], rtol=1e-6)
    # by hand for token_mean: d/dw of -sum(A_i * x_it) / 20 over the masked tokens
    if aggregation == "token_mean":
        m = batch.loss_mask
        grad = -np.sum(np.where(m, batch.advantages[:, None] * batch.tokens, 0.0)) / m.sum()
        np.testing.assert_allclose(whole.params["w"], 0.3 - grad, rtol=1e-5)
    _, metrics = jit_update(make_update(loss_fn, opt, num_minibatches=2))(fresh(), None, batch)
    assert float(metrics["update_index"]) == pytest.approx(0.5)  # updates 0 and 1 of the step
    _, metrics = jit_update(make_update(loss_fn, opt, num_minibatches=2, epochs=2))(fresh(), None, batch)
    assert float(metrics["update_index"]) == pytest.approx(1.5)  # updates 0..3 over two passes
