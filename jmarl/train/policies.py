"""Policies from the config: shared, per-agent (stacked), per-agent LoRA, heterogeneous.

Policies that share an architecture and tokenizer form one `PolicyGroup`, trained by one
compiled program: per-agent parameters (or LoRA adapters) are stacked on a leading policy axis
and the update is `jax.vmap`ped over it. Heterogeneous policies (different architectures or
tokenizers) form one group each. Policy ids are global: agent i's samples are learned by
policy `agent_policy[i]`, which lives in group `group_of[p]` at index `index_in_group[p]`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jmarl import models
from jmarl.errors import JmarlError
from jmarl.train.lora import merge_lora
from jmarl.train.step import TrainState

Params = Any


@dataclass
class PolicyGroup:
    """Policies of one architecture: one model config, one tokenizer, one compiled update.

    state.params holds the trainable tree: full parameters, or LoRA adapters over `base`;
    stacked on a leading axis of size len(policy_ids) when `stacked`. `ref` is the frozen
    reference (full parameters, stacked like the policies) or None when no KL is used.
    """

    name: str
    model_config: models.ModelConfig
    tokenizer: Any
    policy_ids: tuple[int, ...]
    stacked: bool
    lora_rank: int | None
    lora_alpha: float
    base: Params | None
    state: TrainState | None
    ref: Params | None

    def full_params(self, trainable: Params | None = None) -> Params:
        """Parameters the model runs with (LoRA merged); stacked [P, ...] when `stacked`."""
        trainable = self.state.params if trainable is None else trainable
        if self.lora_rank is None:
            return trainable
        merge = lambda ad: merge_lora(self.base, ad, rank=self.lora_rank, alpha=self.lora_alpha)  # noqa: E731
        return jax.vmap(merge)(trainable) if self.stacked else merge(trainable)

    def index(self, policy_id: int) -> int:
        """Position of global `policy_id` on this group's policy axis."""
        return self.policy_ids.index(policy_id)

    def policy_params(self, policy_id: int) -> Params:
        """One policy's full parameters (unstacked)."""
        full = self.full_params()
        if not self.stacked:
            return full
        i = self.index(policy_id)
        return jax.tree.map(lambda x: x[i], full)


@dataclass
class PolicySet:
    """Every policy of a run, the agent -> policy routing, and the groups that hold them."""

    policy_names: tuple[str, ...]
    agent_policy: tuple[int, ...]
    groups: list[PolicyGroup]

    def group_of(self, policy_id: int) -> PolicyGroup:
        """The group holding global `policy_id`."""
        for g in self.groups:
            if policy_id in g.policy_ids:
                return g
        raise JmarlError(f"no policy with id {policy_id}")


def build_tokenizer(spec: str | None, model_path: str | None) -> Any:
    """'char' -> the built-in CharTokenizer; a directory -> its HF tokenizer; None -> model_path's."""
    if spec == "char":
        return models.CharTokenizer()
    path = spec or model_path
    if path is None:
        raise JmarlError("tokenizer: set tokenizer to 'char' or a local tokenizer directory (the model has no path)")
    return models.load_tokenizer(path)


def build_model(model_cfg: Any, tokenizer: Any, rng: jax.Array) -> tuple[models.ModelConfig, Params]:
    """(model config, params): loaded from `model_cfg.path` or initialised from `model_cfg.preset`."""
    numerics = dict(param_dtype=model_cfg.param_dtype, compute_dtype=model_cfg.compute_dtype, remat=model_cfg.remat)
    if model_cfg.path is not None:
        if not os.path.isdir(model_cfg.path):
            raise JmarlError(f"model.path {model_cfg.path!r} is not a directory; point it at a local HF checkpoint")
        config, params = models.load_hf(model_cfg.path, dtype=model_cfg.param_dtype)
        return dataclasses.replace(config, **numerics), params
    p = model_cfg.preset
    vocab = p.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise JmarlError(
            f"model.preset.vocab_size {vocab} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})"
        )
    config = models.ModelConfig(
        model_type=p.model_type,
        vocab_size=vocab,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_layers=p.num_layers,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim or p.hidden_size // p.num_heads,
        rms_norm_eps=p.rms_norm_eps,
        rope_theta=p.rope_theta,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=p.tie_word_embeddings,
        qkv_bias=p.model_type == "qwen2" if p.qkv_bias is None else p.qkv_bias,
        qk_norm=p.model_type == "qwen3" if p.qk_norm is None else p.qk_norm,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        **numerics,
    )
    return config, models.init(config, rng)


def stack(trees: Sequence[Params]) -> Params:
    """[tree_0, tree_1, ...] -> one tree with a leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
