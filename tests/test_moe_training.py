"""Qwen3-MoE through the trainer: a tiny mixture-of-experts policy samples, trains with the router's
load-balancing loss (train.router_aux_loss_coef) and exports a checkpoint transformers loads; the
loss term is exactly the weight times `moe.load_balancing_loss` of the micro-batch's tokens."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jmarl import models
from jmarl.config import load_config
from jmarl.errors import JmarlError
from jmarl.models import moe
from jmarl.train import trainer as trainer_mod
from jmarl.train.learner import learner_batch, score_batch
from jmarl.train.packing import packed_logprobs
from jmarl.workflows import run_plan

MOE_PRESET = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
              "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4, "num_experts_per_tok": 2,
              "norm_topk_prob": True}
BASE = {
    "seed": 0,
    "env": {"name": "_toy_env:Letters"},
    "algo": {"name": "grpo"},
    "model": {"preset": MOE_PRESET},
    "tokenizer": "char",
    "workflow": {"plan": "independent", "group_size": 4, "num_tasks": 2},
    "sampling": {"max_new_tokens": 8, "max_prompt_len": 64},
    "optim": {"lr": 1.0e-2},
    "train": {"steps": 2, "router_aux_loss_coef": 0.01},
    "eval": {"num_episodes": 2},
    "checkpoint": {"every": 0},
    "logging": {"progress": False},
}


def _config(tmp_path: Path, **train):
    data = json.loads(json.dumps(BASE))
    data["train"].update(train)
    data["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


@pytest.mark.slow
def test_a_moe_policy_trains_with_the_router_loss_and_exports_for_transformers(tmp_path):
    import torch
    import transformers

    cfg = _config(tmp_path)
    trainer_mod.train(cfg)
    out = Path(cfg.output_dir)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in trained] == [1, 2]
    # the top-2 of 4 minimum of the loss is 2 (uniform routing); a random router sits above it
    assert all(np.isfinite(x["train/loss"]) and x["train/router_aux_loss"] >= 2.0 - 1e-4 for x in trained)

    export = out / "export" / "shared"
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    config, params = models.load_hf(export)
    tokens = np.array([[5, 9, 33, 40, 2, 7]], np.int32)
    ours = np.asarray(models.apply(config, params, tokens, np.ones_like(tokens, bool)))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


@pytest.mark.slow
def test_the_router_term_is_its_weight_times_the_load_balancing_loss(tmp_path):
    """The update's loss with the router term minus the method's loss alone (the same batch,
    weights and old log-probs) is router_aux_loss_coef x load_balancing_loss of the packed batch."""
    coef = 0.25
    trainer = trainer_mod.Trainer(_config(tmp_path, router_aux_loss_coef=coef))
    group, fns = trainer.policies.groups[0], trainer.fns[0]
    t = trainer
    result = run_plan("independent", t.env, [0, 1], t.policies.agent_policy, t.sampler, jax.random.key(4), group_size=4)
    batch, _ = learner_batch(group, result.records, trainer.parts)
    batch = score_batch(group, fns, batch, trainer.method_device_state(), recompute=True, cross=False)
    params = group.state.params
    lp, stats = packed_logprobs(group.model_config, params, batch, trainer.temperature, with_router_stats=True)
    method_loss, _ = trainer.method.loss(trainer.algo_cfg, lp, batch)
    aux = moe.load_balancing_loss(stats)
    _, metrics = fns.update(group.state, group.base, batch)
    metrics = jax.device_get(metrics)
    np.testing.assert_allclose(float(np.mean(metrics["router_aux_loss"])), float(aux), rtol=1e-5)
    np.testing.assert_allclose(float(np.mean(metrics["loss"])), float(method_loss) + coef * float(aux), rtol=1e-4,
                               atol=1e-6)


def test_a_router_weight_without_experts_is_refused(tmp_path):
    data = json.loads(json.dumps(BASE))
    data["model"]["preset"] = {k: v for k, v in MOE_PRESET.items()
                               if k not in ("model_type", "num_experts", "num_experts_per_tok",
                                            "moe_intermediate_size", "norm_topk_prob")} | {"model_type": "qwen3"}
    data["output_dir"] = str(tmp_path / "run")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(JmarlError, match="train.router_aux_loss_coef.*no policy's model has experts"):
        trainer_mod.Trainer(load_config(tmp_path / "run.yaml"))


@pytest.mark.parametrize("preset, message", [
    ({"model_type": "qwen3", "num_experts": 4}, "are for model_type qwen3_moe"),
    ({"model_type": "qwen3_moe"}, "a qwen3_moe architecture needs num_experts >= 1"),
    ({**MOE_PRESET, "num_experts_per_tok": 5}, "num_experts_per_tok <= num_experts"),
])
def test_a_built_in_architectures_expert_fields_are_checked(tmp_path, preset, message):
    data = json.loads(json.dumps(BASE))
    data["model"]["preset"] = preset
    data["train"]["router_aux_loss_coef"] = 0.0
    data["output_dir"] = str(tmp_path / "run")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(JmarlError, match=message):
        load_config(tmp_path / "run.yaml")
