"""A method written outside jmarl trains from a YAML config through the CLI, jmarl untouched."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from _tiny_models import TINY_PRESET

pytestmark = pytest.mark.slow  # a whole training run through the CLI, in a subprocess

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# REINFORCE with a group-mean baseline: a config, an advantage and a loss, and the Method value.
MODULE = '''
import dataclasses

import jax
import jax.numpy as jnp

from jmarl.algos import Method


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float = 1.0
    kl_coef: float = 0.0


def advantages(cfg, batch, state):
    seg = jnp.where(batch.group >= 0, batch.group, batch.num_samples)
    count = jax.ops.segment_sum(jnp.ones_like(batch.reward), seg, batch.num_samples + 1)
    mean = jax.ops.segment_sum(batch.reward, seg, batch.num_samples + 1) / jnp.maximum(count, 1.0)
    return cfg.scale * (batch.reward - mean[seg])


def loss(cfg, logprobs, batch):
    summed = jnp.sum(jnp.where(batch.loss_mask, logprobs, 0.0), axis=-1)
    rows = jnp.maximum(jnp.sum(jnp.any(batch.loss_mask, axis=-1)), 1)
    value = -jnp.sum(batch.advantages * summed) / rows
    return value, {"loss": value, "mean_advantage": jnp.mean(batch.advantages)}


REINFORCE = Method(name="reinforce", config=Config, advantages=advantages, loss=loss)
'''


def test_a_users_method_trains_through_the_cli(tmp_path):
    (tmp_path / "my_method.py").write_text(textwrap.dedent(MODULE))
    out = tmp_path / "run"
    config = {
        "seed": 0, "output_dir": str(out),
        "env": {"name": "_toy_env:Letters"},
        "algo": {"name": "my_method:REINFORCE", "options": {"scale": 2.0}},
        "model": {"preset": TINY_PRESET},
        "tokenizer": "char",
        "workflow": {"plan": "independent", "group_size": 4, "num_tasks": 2},
        "sampling": {"max_new_tokens": 8, "max_prompt_len": 64},
        "optim": {"lr": 1.0e-2}, "train": {"steps": 2}, "eval": {"num_episodes": 2},
        "logging": {"progress": False, "plots": False, "tensorboard": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(TESTS), str(ROOT)]), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "jmarl.run", "--config", str(path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in steps] == [1, 2]
    assert all("train/mean_advantage" in x for x in steps)  # the user's own metric, from the user's loss
    assert any(x["train/grad_norm"] > 0 for x in steps)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    # a setting the method does not have is refused with the one CLI error line
    bad = subprocess.run([sys.executable, "-m", "jmarl.run", "--config", str(path), "algo.options.clip_high=0.3"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "algo.options.clip_high" in bad.stderr and "Traceback" not in bad.stderr
