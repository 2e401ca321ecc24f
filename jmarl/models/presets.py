"""Published model shapes by name (`model.preset: qwen3-1.7b`), randomly initialised.

A preset is the architecture of a released checkpoint (its HF `config.json` fields) without the
weights: any config can be planned (`python -m jmarl.memory_check`) and smoke-run at its real size on a
machine that has no checkpoint. Token ids are the instruct checkpoints'.
"""

from __future__ import annotations

from typing import Any

from jmarl.errors import JmarlError
from jmarl.models.config import ModelConfig, gemma3_layer_types

_QWEN3 = dict(
    model_type="qwen3", vocab_size=151936, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
    max_position_embeddings=40960, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=(151645, 151643),
    pad_token_id=151643,
)
# Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B config.json): every layer sparse, 128 experts,
# the top 8 per token with their probabilities renormalised, no shared expert, untied head.
_QWEN3_MOE = dict(
    _QWEN3, model_type="qwen3_moe", num_kv_heads=4, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.001, tie_word_embeddings=False,
)
_LLAMA32 = dict(
    model_type="llama", vocab_size=128256, num_kv_heads=8, rope_theta=500000.0, rope_type="llama3",
    rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000,
    eos_token_id=(128001, 128008, 128009),
)
# Gemma 3 (google/gemma-3-270m, gemma-3-1b config.json): 5 sliding-window layers (512 tokens,
# RoPE theta 1e4) then 1 global layer (theta 1e6), head_dim 256, one KV head, tied embeddings.
_GEMMA3 = dict(
    model_type="gemma3_text", vocab_size=262144, num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6,
    rope_local_theta=1e4, sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=(1, 106), pad_token_id=0,
)
# The text part of Gemma 3 4B, 12B and 27B (gemma-3-*-it config.json, text_config): a 1024-token
# window, linear RoPE scaling x8 on the global layers, 262,208 embedding rows (the image tokens'
# included), 128k positions.
_GEMMA3_LARGE = dict(_GEMMA3, vocab_size=262208, sliding_window=1024, rope_type="linear", rope_factor=8.0,
                     max_position_embeddings=131072)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_layers=48, num_heads=32),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_layers=94, num_heads=64),
    "llama3.2-1b": dict(_LLAMA32, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                        head_dim=64),
    "llama3.2-3b": dict(_LLAMA32, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
                        head_dim=128),
    "llama3.1-8b": dict(_LLAMA32, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        head_dim=128, rope_factor=8.0, tie_word_embeddings=False),
    "gemma3-270m": dict(_GEMMA3, hidden_size=640, intermediate_size=2048, num_layers=18,
                        layer_types=gemma3_layer_types(18, 6)),
    "gemma3-1b": dict(_GEMMA3, hidden_size=1152, intermediate_size=6912, num_layers=26,
                      layer_types=gemma3_layer_types(26, 6)),
    "gemma3-4b": dict(_GEMMA3_LARGE, hidden_size=2560, intermediate_size=10240, num_layers=34, num_heads=8,
                      num_kv_heads=4, head_dim=256, query_pre_attn_scalar=256, layer_types=gemma3_layer_types(34, 6)),
    "gemma3-12b": dict(_GEMMA3_LARGE, hidden_size=3840, intermediate_size=15360, num_layers=48, num_heads=16,
                       num_kv_heads=8, head_dim=256, query_pre_attn_scalar=256, layer_types=gemma3_layer_types(48, 6)),
    "gemma3-27b": dict(_GEMMA3_LARGE, hidden_size=5376, intermediate_size=21504, num_layers=62, num_heads=32,
                       num_kv_heads=16, head_dim=128, query_pre_attn_scalar=168,
                       layer_types=gemma3_layer_types(62, 6)),
}


def preset_names() -> tuple[str, ...]:
    """The preset names, smallest first within each family."""
    return tuple(PRESETS)


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of preset `name` (case-insensitive), with jmarl-only fields such as
    param_dtype / compute_dtype / remat / attention set by `overrides`. Unknown name: JmarlError."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise JmarlError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return ModelConfig(**dict(PRESETS[key], **overrides))


def preset_for_checkpoint_name(path: str) -> str | None:
    """The preset whose name matches a checkpoint directory's name ('checkpoints/Qwen3-1.7B' ->
    'qwen3-1.7b', 'Llama-3.2-1B-Instruct' -> 'llama3.2-1b'), or None."""
    import os

    base = os.path.basename(os.path.normpath(path)).lower().replace("meta-", "").replace("-instruct", "")
    base = base.replace("llama-3", "llama3").replace("gemma-3", "gemma3")
    base = base[:-3] if base.startswith("gemma3") and base.endswith("-it") else base  # gemma-3-1b-it
    return base if base in PRESETS else None
