"""Policies from the config: shared, per-agent (stacked), per-agent LoRA, heterogeneous.

Policies that share an architecture and tokenizer form one `PolicyGroup`, trained by one
compiled program: per-agent parameters (or LoRA adapters) are stacked on a leading policy axis
and the update is `jax.vmap`ped over it. Heterogeneous policies (different architectures or
tokenizers) form one group each. Policy ids are global: agent i's samples are learned by
policy `agent_policy[i]`, which lives in group `group_of[p]` at index `index_in_group[p]`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jmarl import models
from jmarl.config import ArchConfig, check_preset_name, routing_replay_refused
from jmarl.errors import JmarlError
from jmarl.models.config import resolve_remat  # model.remat resolves as a ModelConfig's remat does
from jmarl.models.hf_config import config_from_hf
from jmarl.models.presets import preset_config
from jmarl.train.lora import attach_lora, merge_lora
from jmarl.train.step import TrainState
from jmarl.models.tokenizer import use_chat_template

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
        """Parameters the model runs with; stacked [P, ...] when `stacked`. LoRA: the adapters
        attached to the base unmerged (`attach_lora`: nothing computed or copied), the base's
        leaves held once and unstacked, the adapters [P, ...] when `stacked` (the sampler's
        `policy_axes` tells them apart)."""
        trainable = self.state.params if trainable is None else trainable
        if self.lora_rank is None:
            return trainable
        return attach_lora(self.base, trainable, rank=self.lora_rank, alpha=self.lora_alpha)

    def index(self, policy_id: int) -> int:
        """Position of global `policy_id` on this group's policy axis."""
        return self.policy_ids.index(policy_id)

    def policy_params(self, policy_id: int) -> Params:
        """One policy's full parameters as plain arrays (unstacked; LoRA merged into real
        weights, W + (alpha / rank) A B: what an export writes)."""
        trainable = self.state.params
        if self.stacked:
            i = self.index(policy_id)
            trainable = jax.tree.map(lambda x: x[i], trainable)
        if self.lora_rank is None:
            return trainable
        return merge_lora(self.base, trainable, rank=self.lora_rank, alpha=self.lora_alpha)


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


def build_tokenizer(spec: str | None, model_path: str | None, chat_template: str | None = None) -> Any:
    """'char' -> the built-in CharTokenizer; a directory -> its HF tokenizer; a .gguf file (or a
    registered model name, `jmarl.models.fetch`) -> the tokenizer in its metadata; None ->
    model_path's. chat_template (`model.chat_template`): renders its prompts instead of its own."""
    tok = _tokenizer(spec, model_path)
    if chat_template is not None:
        tok = use_chat_template(tok, chat_template)
    return tok


def _tokenizer(spec: str | None, model_path: str | None) -> Any:
    if spec == "char":
        return models.CharTokenizer()
    path = spec or model_path
    if path is None:
        raise JmarlError("tokenizer: set tokenizer to 'char' or a local tokenizer directory (the model has no path)")
    if not os.path.exists(path) and path in models.fetch.MODELS:
        path = str(models.resolve_model(path))  # a registered model name: fetched once, then cached
    if _is_gguf(path):
        return models.load_gguf_tokenizer(path)
    return models.load_tokenizer(path)


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def build_model(
    model_cfg: Any, tokenizer: Any, rng: jax.Array, *, setting: str = "model", abstract: bool = False
) -> tuple[models.ModelConfig, Params]:
    """(model config, params) of a `ModelSpec`: loaded from `model_cfg.path`, or initialised
    randomly (`models.init`) from `model_cfg.preset` (a preset name: the published shapes of
    `jmarl.models.presets`; an `ArchConfig`: a built-in architecture).

    Parameters are stored in `param_dtype`, matmuls run in `compute_dtype`; `attention` is passed
    on and `remat` resolved (`resolve_remat`, on the real parameter count); `routing_replay` is
    set on the model config (refused, naming `<setting>.routing_replay`, on a model without
    experts). A preset takes the tokenizer's bos/eos/pad ids, and its vocabulary must hold the
    tokenizer's. `setting` is the dotted name of the spec in error messages (e.g.
    policies.models.qwen.model).

    abstract (under `jax.eval_shape`, `jmarl.train.build.build_policies(abstract=True)`): a
    checkpoint's architecture is read (config.json or the GGUF metadata), never its weights; the
    parameters are the traced `models.init` of that architecture, whose shapes and dtypes are
    the loaded tree's (`models.param_shapes`).
    """
    config, params = _build_model(model_cfg, tokenizer, rng, setting=setting, abstract=abstract)
    replay = getattr(model_cfg, "routing_replay", "off")
    if replay == "replay" and not config.is_moe:
        raise routing_replay_refused(setting, config.model_type)
    return config.replace(routing_replay=replay), params


def _build_model(
    model_cfg: Any, tokenizer: Any, rng: jax.Array, *, setting: str = "model", abstract: bool = False
) -> tuple[models.ModelConfig, Params]:
    """`build_model` before its routing replay setting."""
    numerics = dict(param_dtype=model_cfg.param_dtype, compute_dtype=model_cfg.compute_dtype,
                    attention=model_cfg.attention)
    if model_cfg.path is not None:
        path = model_cfg.path
        if not os.path.exists(path) and path in models.fetch.MODELS:
            path = str(models.resolve_model(path))  # a registered model name: fetched once, then cached
        params = None  # abstract: only the architecture is read; the parameters are traced below
        if _is_gguf(path):
            if abstract:
                config = models.load_gguf_config(path)
            else:
                config, params = models.load_gguf(
                    path, param_dtype=model_cfg.param_dtype, compute_dtype=model_cfg.compute_dtype
                )
        elif os.path.isdir(path):
            if abstract:
                config = config_from_hf(path)
            else:
                config, params = models.load_hf(path, dtype=model_cfg.param_dtype, compute_dtype=model_cfg.compute_dtype)
        else:
            raise JmarlError(
                f"{setting}.path {model_cfg.path!r} is not a directory or a .gguf file; point it at a local HF "
                f"checkpoint, a GGUF file or a registered model name ({', '.join(sorted(models.fetch.MODELS))})"
            )
        config = config.replace(**numerics)
        config = config.replace(remat=resolve_remat(model_cfg.remat, config.num_params()))
        return config, models.init(config, rng) if params is None else params
    if tokenizer is None:
        raise JmarlError(
            f"{setting}.preset: a preset model needs a tokenizer: set tokenizer=char or a local tokenizer directory"
        )
    tokens = dict(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    if isinstance(model_cfg.preset, str):
        config = preset_model_config(model_cfg.preset, tokenizer.vocab_size, setting=setting, **numerics, **tokens)
    else:
        config = arch_model_config(model_cfg.preset, tokenizer.vocab_size, setting=setting, **numerics, **tokens)
    config = config.replace(remat=resolve_remat(model_cfg.remat, config.num_params()))
    return config, models.init(config, rng)


def preset_model_config(
    name: str, tokenizer_vocab: int, *, setting: str = "model", **fields: Any
) -> models.ModelConfig:
    """The `ModelConfig` of preset `name` (`jmarl.models.presets`) with `fields` (numerics, token
    ids) set; JmarlError naming `<setting>.preset` when the name is unknown or the tokenizer's
    vocabulary (`tokenizer_vocab` ids) does not fit the preset's embedding."""
    key = check_preset_name(name, f"{setting}.preset")
    config = preset_config(key, **fields)
    if tokenizer_vocab > config.vocab_size:
        raise JmarlError(
            f"{setting}.preset: the tokenizer has {tokenizer_vocab} ids but preset {key!r} embeds "
            f"{config.vocab_size}; use a tokenizer that fits (char, or the checkpoint family's own)"
        )
    return config


def arch_model_config(
    arch: ArchConfig, tokenizer_vocab: int, *, setting: str = "model", **fields: Any
) -> models.ModelConfig:
    """The `ModelConfig` of a built-in architecture (`ArchConfig`; vocab_size None: the
    tokenizer's) with `fields` (numerics, token ids) set."""
    vocab = arch.vocab_size or tokenizer_vocab
    if vocab < tokenizer_vocab:
        raise JmarlError(
            f"{setting}.preset.vocab_size {vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab})"
        )
    return models.ModelConfig(
        model_type=arch.model_type,
        vocab_size=vocab,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_layers=arch.num_layers,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim or arch.hidden_size // arch.num_heads,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        qkv_bias=arch.model_type == "qwen2" if arch.qkv_bias is None else arch.qkv_bias,
        qk_norm=arch.model_type in ("qwen3", "qwen3_moe") if arch.qk_norm is None else arch.qk_norm,
        num_experts=arch.num_experts,
        num_experts_per_tok=arch.num_experts_per_tok,
        moe_intermediate_size=arch.moe_intermediate_size,
        norm_topk_prob=arch.norm_topk_prob,
        decoder_sparse_step=arch.decoder_sparse_step,
        **fields,
    )


def stack(trees: Sequence[Params]) -> Params:
    """[tree_0, tree_1, ...] -> one tree with a leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
