"""`jax.jit` and `jax.vmap` over a leading policy axis give the numbers of an eager per-policy loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmarl.algos import CONFIGS, METHODS, at_grpo, magrpo

P, N, T, NUM_GROUPS = 3, 8, 6, 2


def stacked_batch(seed=0):
    """Per-policy batches stacked on a leading axis of size P."""
    rng = np.random.default_rng(seed)
    lp = rng.uniform(-3, -0.1, (P, N, T)).astype(np.float32)
    old = (lp + rng.uniform(-0.4, 0.4, lp.shape)).astype(np.float32)
    refp = (lp + rng.uniform(-0.4, 0.4, lp.shape)).astype(np.float32)
    mask = rng.random((P, N, T)) < 0.8
    mask[:, :, 0] = True
    mask[:, -1] = False  # a padding row per policy
    rewards = rng.choice([0.0, 0.5, 1.0], (P, N)).astype(np.float32)
    groups = np.tile(np.array([0, 0, 0, 1, 1, 1, 1, -1], np.int32), (P, 1))
    source = np.tile(np.array([0, 1, 2, 0, 1, 2, 0, 0], np.int32), (P, 1))
    src_lp = (rng.uniform(-2, -0.5, (P, N))).astype(np.float32)
    return dict(lp=lp, old=old, ref=refp, mask=mask, rewards=rewards, groups=groups, source=source, src_lp=src_lp)


CAPABILITY = np.array([0.7, 0.4, 0.2], np.float32)


def per_policy(name, learner, batch):
    """Advantages, loss, metrics and the loss gradient for one policy's batch (learner = its index)."""
    module, cfg = METHODS[name], CONFIGS[name](kl_coef=0.01)
    adv_extra, loss_extra = {}, {}
    if name == "hacpo":
        adv_extra = dict(source=batch["source"], capability=CAPABILITY, learner=learner)
        loss_extra = dict(
            is_cross=batch["source"] != learner,
            source_seq_logprob=batch["src_lp"],
            discrepancy=module.discrepancy(cfg, CAPABILITY, batch["source"], learner),
            minibatch_index=1,
        )
    adv = module.advantages(cfg, batch["rewards"], batch["groups"], num_groups=NUM_GROUPS, **adv_extra)
    mask = batch["mask"] & module.keep_mask(cfg, batch["rewards"], batch["groups"], num_groups=NUM_GROUPS)[:, None]

    def loss_fn(lp):
        return module.loss(cfg, lp, batch["old"], adv, mask, ref_logprobs=batch["ref"], **loss_extra)

    (value, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(batch["lp"])
    return adv, value, metrics, grad


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_jit_and_vmap_over_policies_match_an_eager_loop(name):
    batch = stacked_batch(seed=len(name))
    with jax.disable_jit():
        eager = [per_policy(name, p, jax.tree.map(lambda x: x[p], batch)) for p in range(P)]
    eager = jax.tree.map(lambda *xs: np.stack(xs), *eager)
    vmapped = jax.jit(jax.vmap(functools.partial(per_policy, name)))(jnp.arange(P), batch)
    jitted_one = jax.jit(functools.partial(per_policy, name))(1, jax.tree.map(lambda x: x[1], batch))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), jax.tree.map(np.asarray, vmapped), eager)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b[1], rtol=2e-5, atol=1e-6), jax.tree.map(np.asarray, jitted_one), eager
    )
    assert np.any(eager[3] != 0)  # the gradient is not trivially zero


def test_magrpo_and_at_grpo_helpers_vmap_over_policies():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(P, 8)).astype(np.float32)
    parent = np.array([-1, -1, 0, 0, 1, 1, 4, 4], np.int32)
    tree = jax.jit(jax.vmap(functools.partial(magrpo.tree_returns, gamma=0.9, max_depth=2), in_axes=(0, None)))
    expected = np.stack([np.asarray(magrpo.tree_returns(r, parent, gamma=0.9, max_depth=2)) for r in rewards])
    np.testing.assert_allclose(tree(rewards, parent), expected, rtol=1e-6)
    nxt = np.array([2, -1, 3, -1, 5, 6, -1, -1], np.int32)
    rtg = jax.jit(jax.vmap(functools.partial(at_grpo.returns_to_go, gamma=0.5, max_steps=3), in_axes=(0, None)))
    expected = np.stack([np.asarray(at_grpo.returns_to_go(r, nxt, gamma=0.5, max_steps=3)) for r in rewards])
    np.testing.assert_allclose(rtg(rewards, nxt), expected, rtol=1e-6)
    joint = magrpo.joint_action_index(2, 2, "cross")
    comp = jax.jit(jax.vmap(functools.partial(magrpo.completion_returns, num_generations=2), in_axes=(0, None)))
    expected = np.stack([np.asarray(magrpo.completion_returns(r[:4], joint, num_generations=2)) for r in rewards])
    np.testing.assert_allclose(comp(rewards[:, :4], joint), expected, rtol=1e-6)
