"""A step without learning signal moves nothing, and the learner agrees with its sampler.

Every method, full fine-tuning (stacked per-agent copies) and LoRA: when every group's samples
earn the same reward, the group-relative advantages are all zero, the gradient is exactly zero,
and the update leaves every parameter and the optimizer state bit-identical. AdamW with weight
decay would otherwise shrink the weights (and, after an earlier step, carry them on by its
momentum), so the test runs with weight decay and after a step that had signal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_trainer import _config
from jmarl.algos import METHODS, MethodContext, hacpo
from jmarl.config import load_config
from jmarl.train import trainer as trainer_mod
from jmarl.train.learner import build_group_fns, learner_batch, sampler_agreement, score_batch
from jmarl.workflows import run_plan
from jmarl.workflows.base import PlanResult
from jmarl.workflows.shared import SharedStats


def _device_state(method, cfg):
    state = method.init_state(cfg, MethodContext(num_policies=2, group_size=4))
    if method is hacpo.METHOD:  # HACPO reads the policies' success rates from a shared plan
        stats = SharedStats(num_generated=0, share=True, samples_per_policy=4, num_records=0, num_lossy=0, success_rate=(0.6, 0.3),
                            reward_mean=(0.6, 0.3))
        state, _ = method.after_plan(cfg, state, PlanResult((), (), stats), 0)
    return method.device_state(cfg, state)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per_agent", "lora"])
def test_a_step_whose_advantages_are_all_zero_changes_no_parameter(tmp_path, mode):
    overrides = ["optim.weight_decay=0.1", f"policies.mode={mode}"] + (["policies.lora.rank=2"] if mode == "lora" else [])
    t = trainer_mod.Trainer(load_config(_config(tmp_path, mode), overrides))
    group = t.policies.groups[0]
    result = run_plan("independent", t.env, [0, 1], t.policies.agent_policy, t.sampler, jax.random.key(3), group_size=4)
    batch, counts = learner_batch(group, result.records, t.parts)
    assert counts == [8, 8]
    real = np.asarray(batch.group) >= 0
    flat = batch.replace(reward=np.where(real, 0.5, np.asarray(batch.reward)).astype(np.float32))
    for name, method in sorted(METHODS.items()):
        cfg = method.config()
        fns = build_group_fns(group, method, cfg, t.optimizer, t.sft_optimizer, temperature=t.temperature,
                              minibatches=1, grad_accum=1)
        state = _device_state(method, cfg)
        # a step with signal first, so that Adam's moments are non-zero
        moved, metrics = fns.update(jax.tree.map(jnp.array, group.state), group.base,
                                    score_batch(group, fns, batch, state, recompute=True, cross=False))
        assert not np.asarray(metrics["zero_gradient"]).any(), name
        scored = score_batch(group, fns, flat, state, recompute=True, cross=False)
        assert not np.asarray(scored.advantages)[real].any(), name
        before = _leaves(moved)
        after, metrics = fns.update(moved, group.base, scored)
        for x, y in zip(before, _leaves(after)):
            np.testing.assert_array_equal(x, y, err_msg=name)
        assert np.asarray(metrics["zero_gradient"]).all(), name


def test_sampler_agreement_counts_own_trained_tokens_only():
    from jmarl.batch import LearnerBatch

    lp = np.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], np.float32)
    behavior = np.array([[-1.5, -2.0, -9.0], [-5.0, -5.0, -5.0]], np.float32)
    mask = np.array([[True, True, False], [True, True, True]])
    batch = LearnerBatch.loss_only(tokens=np.zeros((2, 3), np.int32), attention_mask=mask, loss_mask=mask,
                                   behavior_logprobs=behavior, learner=np.zeros(2, np.int32),
                                   source_policy=np.array([0, 1], np.int32))
    got = sampler_agreement(jnp.asarray(lp), batch)
    # row 1 is another policy's sample and token (0, 2) is not trained: |(-1) - (-1.5)|, |(-2) - (-2)|
    assert float(got["logprob_diff_max"]) == pytest.approx(0.5)
    assert float(got["logprob_diff_mean"]) == pytest.approx(0.25)
