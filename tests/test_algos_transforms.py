"""`jax.jit` and `jax.vmap` over a leading policy axis give the numbers of an eager per-policy loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmarl.algos import METHODS
from jmarl.batch import LearnerBatch

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
    method = METHODS[name]
    cfg = method.config(kl_coef=0.01)
    n, t = batch["lp"].shape
    lb = LearnerBatch.loss_only(
        tokens=jnp.zeros((n, t), jnp.int32), attention_mask=batch["mask"], loss_mask=batch["mask"],
        reward=batch["rewards"], group=batch["groups"], agent=jnp.zeros(n, jnp.int32),
        learner=jnp.full((n,), learner, jnp.int32), source_policy=batch["source"], source_seq_logprob=batch["src_lp"],
        old_logprobs=batch["old"], ref_logprobs=batch["ref"], update_index=jnp.asarray(1, jnp.int32),
    )
    adv = method.advantages(cfg, lb, CAPABILITY if name == "hacpo" else None)
    lb = lb.replace(advantages=adv, loss_mask=lb.loss_mask & method.keep_mask(cfg, lb)[:, None])
    (value, metrics), grad = jax.value_and_grad(lambda lp: method.loss(cfg, lp, lb), has_aux=True)(batch["lp"])
    return adv, value, metrics, grad


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(METHODS))
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
