"""The translation between `ModelConfig` and a Hugging Face `config.json`.

`config_from_hf` reads a config (a dict, a checkpoint directory or a config.json path) in both
styles transformers writes: `rope_theta` + `rope_scaling` (as in released checkpoints) and
`rope_parameters` (as transformers 5 writes it; Gemma 3's per layer type), with each family's
field names and defaults (Llama, Qwen2, Qwen3, Qwen3-MoE's experts, Gemma 3's sliding layers and
the text part of a multimodal Gemma 3 config). It refuses, with a `JmarlError` naming the key
and the fix, whatever a config asks that jmarl does not implement. `config_to_hf` writes the
dict back (both RoPE styles, `architectures` included), so that transformers 4 and 5 read it.

Depends on the schema (`jmarl.models.config`) and on the RoPE math (`jmarl.models.rope`, for
YaRN's attention factor), never the reverse.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from jmarl.errors import JmarlError
from jmarl.models.config import (FULL, SLIDING, SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, ModelConfig,
                                 gemma3_layer_types)
from jmarl.models.rope import yarn_mscale

# The `architectures` entry a saved config.json names, per model_type.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def config_from_hf(path_or_dict: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of a HF config (a dict, a checkpoint directory, or a config.json path).

    `overrides` set jmarl-only fields such as `param_dtype`, `compute_dtype`, `remat`.
    """
    hf = _read_hf_dict(path_or_dict)
    if hf.get("model_type") == "gemma3" and isinstance(hf.get("text_config"), Mapping):
        hf = dict(hf["text_config"], model_type="gemma3_text")  # the text part of a multimodal config
    model_type = hf.get("model_type")
    if model_type == "qwen2_moe" or hf.get("shared_expert_intermediate_size"):
        raise JmarlError(
            f"HF config ({model_type}) has a shared expert (Qwen2-MoE style: shared_expert_intermediate_size="
            f"{hf.get('shared_expert_intermediate_size')}), which jmarl does not implement; jmarl's mixture of "
            "experts is qwen3_moe (routed experts only)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise JmarlError(
            f"unsupported model_type {model_type!r} in the HF config; jmarl supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
        )
    except KeyError as missing:
        raise JmarlError(f"HF config is missing the required key {missing}") from None
    fields["num_kv_heads"] = int(hf.get("num_key_value_heads") or heads)
    fields["head_dim"] = int(hf.get("head_dim") or hidden // heads)
    fields["rms_norm_eps"] = float(hf.get("rms_norm_eps", 1e-6))
    fields["max_position_embeddings"] = int(hf.get("max_position_embeddings", 32768))
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    attention_bias = bool(hf.get("attention_bias", False))
    if model_type == "gemma3_text":
        fields.update(_gemma3_fields(hf, fields["num_layers"]))
        fields.update(overrides)
        return ModelConfig(**fields)
    fields["qkv_bias"] = model_type == "qwen2" or attention_bias
    fields["o_bias"] = model_type != "qwen2" and attention_bias
    fields["qk_norm"] = model_type in ("qwen3", "qwen3_moe")
    if model_type == "qwen3_moe":
        fields.update(_moe_fields(hf))
    if hf.get("mlp_bias"):
        raise JmarlError("HF config sets mlp_bias=True, which jmarl does not support")
    if hf.get("hidden_act", "silu") != "silu":
        raise JmarlError(f"HF config has hidden_act={hf['hidden_act']!r}; jmarl supports 'silu' only")
    if hf.get("use_sliding_window"):
        raise JmarlError("HF config enables use_sliding_window; jmarl supports full attention only")
    fields.update(_rope_fields(hf))
    for key in ("bos_token_id", "pad_token_id"):
        if isinstance(hf.get(key), int):
            fields[key] = hf[key]
    eos = hf.get("eos_token_id")
    if isinstance(eos, int):
        fields["eos_token_id"] = eos
    elif isinstance(eos, list) and eos:
        fields["eos_token_id"] = tuple(int(e) for e in eos)
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` dict of `config` (transformers 4 and 5 both read it)."""
    if config.is_gemma3:
        return _gemma3_to_hf(config)
    rope = _rope_to_hf(config)
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_type == "default" else dict(rope),
        "rope_parameters": rope,
        "torch_dtype": config.param_dtype,
        "dtype": config.param_dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    if config.model_type == "llama":
        hf["attention_bias"] = config.o_bias
        hf["mlp_bias"] = False
    elif config.model_type in ("qwen3", "qwen3_moe"):
        hf["attention_bias"] = config.o_bias
        hf["use_sliding_window"] = False
        if config.model_type == "qwen3_moe":
            hf.update(
                num_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=config.norm_topk_prob,
                decoder_sparse_step=config.decoder_sparse_step,
                mlp_only_layers=list(config.mlp_only_layers),
                router_aux_loss_coef=config.router_aux_loss_coef,
                output_router_logits=False,
            )
    else:
        hf["use_sliding_window"] = False
    return hf


def _read_hf_dict(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise JmarlError(f"HF config not found: {path} (expected a checkpoint directory with config.json)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise JmarlError(f"HF config {path} is not valid JSON: {err}") from None



def _gemma3_fields(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 3 text config beyond the common ones; JmarlError for
    anything it asks that jmarl does not implement."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise JmarlError(
                f"HF config sets {key}={hf[key]!r}: jmarl's gemma3_text does not implement logit soft-capping "
                f"(Gemma 2 style); set {key} to null (Gemma 3 checkpoints do)"
            )
    if hf.get("use_bidirectional_attention"):
        raise JmarlError("HF config sets use_bidirectional_attention=True (EmbeddingGemma); jmarl's gemma3_text "
                         "is causal only: set it to false")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise JmarlError(f"HF config has hidden_activation={act!r}; jmarl's gemma3_text supports 'gelu_pytorch_tanh' only")
    if hf.get("attention_bias"):
        raise JmarlError("HF config sets attention_bias=True, which jmarl's gemma3_text does not support")
    if float(hf.get("attention_dropout") or 0.0) != 0.0:
        raise JmarlError("HF config sets attention_dropout != 0, which jmarl does not implement; set it to 0.0")
    window = hf.get("sliding_window", 4096)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        layer_types = gemma3_layer_types(num_layers, int(hf.get("sliding_window_pattern", 6)))
    layer_types = tuple(layer_types)
    # RoPE per layer type: `rope_parameters` {sliding_attention: {...}, full_attention: {...}}
    # (transformers 5), else rope_theta + rope_scaling (full layers) and rope_local_base_freq
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and (SLIDING in params or FULL in params):
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
    else:
        full = dict(hf.get("rope_scaling") or {})
        if isinstance(params, Mapping):  # a flat rope_parameters: the full layers'
            full.update(params)
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local_type = local.get("rope_type", local.get("type", "default")) or "default"
    if local_type != "default":
        raise JmarlError(f"HF config scales the sliding layers' RoPE ({local_type!r}); jmarl supports scaling on "
                         "the full-attention layers only")
    fields = _rope_fields({"rope_parameters": full,
                           "max_position_embeddings": hf.get("max_position_embeddings", 131_072)})
    fields.update(
        qkv_bias=False, o_bias=False, qk_norm=True,
        sliding_window=None if window is None else int(window),
        layer_types=layer_types,
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131_072)),
    )
    for key, default in (("bos_token_id", 2), ("pad_token_id", 0)):
        value = hf.get(key, default)
        if isinstance(value, int):
            fields[key] = value
    eos = hf.get("eos_token_id", 1)
    if isinstance(eos, int):
        fields["eos_token_id"] = eos
    elif isinstance(eos, list) and eos:
        fields["eos_token_id"] = tuple(int(e) for e in eos)
    return fields


def _gemma3_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The HF `Gemma3TextConfig` dict of a gemma3_text ModelConfig: RoPE both as transformers 5's
    per-layer-type `rope_parameters` and as the older rope_theta / rope_scaling /
    rope_local_base_freq keys."""
    full = _rope_to_hf(c)
    local_theta = c.rope_theta if c.rope_local_theta is None else c.rope_local_theta
    layer_types = list(c.layer_types) if c.layer_types is not None else [FULL] * c.num_layers
    qpas = c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None else c.head_dim
    return {
        "architectures": [HF_ARCHITECTURES[c.model_type]],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": int(qpas) if float(qpas).is_integer() else qpas,
        "sliding_window": c.sliding_window,
        "layer_types": layer_types,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "rope_theta": c.rope_theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": None if c.rope_type == "default" else dict(full),
        "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local_theta}},
        "torch_dtype": c.param_dtype,
        "dtype": c.param_dtype,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id,
        "pad_token_id": c.pad_token_id,
    }


def _moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe config (transformers 5 writes num_experts as
    num_local_experts). Defaults are transformers' Qwen3MoeConfig's."""
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    return dict(
        num_experts=int(experts or 0),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _rope_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The HF `rope_parameters` dict of a config's (full-attention layers') RoPE."""
    rope: dict[str, Any] = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type == "linear":
        rope["factor"] = c.rope_factor
    elif c.rope_type == "llama3":
        rope.update(factor=c.rope_factor, low_freq_factor=c.rope_low_freq_factor,
                    high_freq_factor=c.rope_high_freq_factor,
                    original_max_position_embeddings=c.rope_original_max_position)
    elif c.rope_type == "yarn":
        rope.update(factor=c.rope_factor, original_max_position_embeddings=c.rope_original_max_position,
                    beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow, truncate=c.rope_truncate)
        if c.rope_attention_factor is not None:
            rope["attention_factor"] = c.rope_attention_factor
    return rope


def _rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE fields from either `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters")
    scaling = dict(params) if isinstance(params, Mapping) else dict(hf.get("rope_scaling") or {})
    theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise JmarlError(
            f"unsupported RoPE scaling type {rope_type!r} in the HF config; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        fields["rope_factor"] = float(scaling.get("factor", 1.0))
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = float(scaling.get("low_freq_factor", 1.0))
        fields["rope_high_freq_factor"] = float(scaling.get("high_freq_factor", 4.0))
        fields["rope_original_max_position"] = int(
            scaling.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        )
    if rope_type == "yarn":
        fields.update(_yarn_fields(hf, scaling))
    return fields


def _yarn_fields(hf: Mapping[str, Any], scaling: Mapping[str, Any]) -> dict[str, Any]:
    """The YaRN fields of a `rope_type: yarn` scaling dict, resolved as transformers'
    `_compute_yarn_parameters` resolves them: original_max_position_embeddings (a top-level key
    first, else the scaling's, else max_position_embeddings), factor (None: max positions /
    original), beta_fast / beta_slow (missing or 0: 32 / 1), truncate (default True), and the
    attention factor (given; else from DeepSeek's mscale / mscale_all_dim when both are set; else
    None: 0.1 ln(factor) + 1 at use)."""
    if float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise JmarlError("HF config sets partial_rotary_factor != 1, which jmarl's RoPE does not implement")
    original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    original = int(original or hf.get("max_position_embeddings", 32768))
    factor = scaling.get("factor")
    factor = float(hf.get("max_position_embeddings", 32768)) / original if factor is None else float(factor)
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        attention = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return dict(
        rope_factor=factor,
        rope_original_max_position=original,
        rope_beta_fast=float(scaling.get("beta_fast") or 32.0),
        rope_beta_slow=float(scaling.get("beta_slow") or 1.0),
        rope_truncate=bool(scaling.get("truncate", True)),
        rope_attention_factor=None if attention is None else float(attention),
    )

