"""The packing benchmark's baseline, the learner's previous shared-prefix batch layout
(`benchmarks.shared_prefix_layout`): exact fields on a hand-made batch, and the same
log-probs, loss and gradients as the plain [N, T] layout through `make_update`'s micro-batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmarl import algos, models
from jmarl.errors import JmarlError
from jmarl.train.optim import make_optimizer
from benchmarks.shared_prefix_layout import shared_prefix_logprobs, split_prompts, to_shared_prefix
from test_packing import TINY, _plain  # the same tiny model and plain batches as the packed layout's tests
from jmarl.train.step import init_train_state, make_update, split_minibatches

def test_layout_by_hand():
    plain = _plain([([5, 6, 7], [8, 9]), ([5, 6, 7], [10]), ([5, 6], [11, 12, 13]), ([], [])], t=6)
    (out,) = to_shared_prefix([plain], parts=2, buckets=(4,))
    # micro-batch 0 (rows 0-1) has one distinct prompt, micro-batch 1 two ([5, 6] and the empty
    # prompt of the padding row): U = 2 prefixes per micro-batch, P = C = 4
    np.testing.assert_array_equal(out["prefix_rows"], [0, 0, 2, 3])
    np.testing.assert_array_equal(out["prefix_tokens"], [[0, 5, 6, 7], [0, 0, 0, 0], [0, 0, 5, 6], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["prefix_mask"], [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["tokens"], [[8, 9, 0, 0], [10, 0, 0, 0], [11, 12, 13, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["attention_mask"], out["loss_mask"])
    np.testing.assert_array_equal(out["loss_mask"].sum(1), [2, 1, 3, 0])
    np.testing.assert_allclose(out["behavior_logprobs"][0, :2], [-0.8, -0.9])
    np.testing.assert_allclose(out["behavior_logprobs"][2, :3], [-0.7, -0.8, -0.9])
    np.testing.assert_array_equal(out["reward"], plain["reward"])  # [N] fields pass through
    with pytest.raises(JmarlError, match="does not split into 3"):
        to_shared_prefix([plain], parts=3)


def _random_rows(rng) -> list[tuple[list[int], list[int]]]:
    """Three GRPO groups (sizes 3, 3, 1) with prompts of different lengths, a padding row."""
    rows = []
    for size, plen in ((3, 7), (3, 4), (1, 9)):
        prompt = rng.integers(3, 64, plen).tolist()
        rows += [(prompt, rng.integers(3, 64, int(rng.integers(1, 6))).tolist()) for _ in range(size)]
    return rows + [([], [])]


@pytest.mark.slow
def test_same_logprobs_loss_and_gradients_as_the_plain_layout():
    rng = np.random.default_rng(0)
    params = models.init(TINY, jax.random.key(0))
    plain = _plain(_random_rows(rng), t=16)
    plain["old_logprobs"] = plain.pop("behavior_logprobs")
    plain["advantages"] = rng.normal(size=8).astype(np.float32)
    (shared,) = to_shared_prefix([plain], parts=2, buckets=(8, 16))
    # micro-batch 1 holds 3 distinct prompts (two groups and the padding row): U = 4 each
    assert shared["prefix_tokens"].shape == (2 * 4, 16) and shared["tokens"].shape == (8, 8)

    # log-probs of every continuation token, whole batch and per micro-batch (rows modulo U)
    full = np.asarray(models.token_logprobs(TINY, params, plain["tokens"], plain["attention_mask"], 0.8))
    split = split_prompts(plain["tokens"], plain["attention_mask"], plain["loss_mask"])
    lp = np.asarray(shared_prefix_logprobs(TINY, params, shared, 0.8))
    micro = split_minibatches(shared, 1, 2)
    lp_micro = np.concatenate([
        np.asarray(shared_prefix_logprobs(TINY, params, jax.tree.map(lambda x: x[0, m], micro), 0.8)) for m in range(2)
    ])
    for i, (_, cols) in enumerate(split):
        np.testing.assert_allclose(lp[i, : cols.size], full[i, cols], atol=1e-5)
        np.testing.assert_allclose(lp_micro[i, : cols.size], full[i, cols], atol=1e-5)
        assert np.all(lp[i, cols.size:] == 0)

    # one GRPO update with 2 accumulation steps: same loss, gradient norm and new parameters
    cfg = algos.grpo.GRPOConfig()
    optimizer = make_optimizer(1e-3, total_steps=10, grad_clip=1.0)

    def plain_loss(p, frozen, b):
        lp = models.token_logprobs(TINY, p, b["tokens"], b["attention_mask"])
        return algos.policy_loss(lp, b["old_logprobs"], b["advantages"], b["loss_mask"], aggregation=cfg.aggregation)

    def shared_loss(p, frozen, b):
        return algos.policy_loss(shared_prefix_logprobs(TINY, p, b), b["old_logprobs"], b["advantages"], b["loss_mask"], aggregation=cfg.aggregation)

    results = []
    for loss_fn, batch in ((plain_loss, plain), (shared_loss, shared)):
        update = jax.jit(make_update(loss_fn, optimizer, grad_accum=2))
        results.append(update(init_train_state(params, optimizer), None, jax.tree.map(jnp.asarray, batch)))
    (s_plain, m_plain), (s_shared, m_shared) = results
    assert float(m_plain["grad_norm"]) > 0
    np.testing.assert_allclose(m_shared["loss"], m_plain["loss"], rtol=1e-5)
    np.testing.assert_allclose(m_shared["grad_norm"], m_plain["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s_shared.params, s_plain.params)
