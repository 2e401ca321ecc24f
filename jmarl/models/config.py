"""`ModelConfig`: the static description of a decoder-only LM (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 3).

One frozen, hashable dataclass, so it can be a static argument of `jax.jit` and a cache key.
`ModelConfig.from_hf` reads a Hugging Face `config.json` in both styles: `rope_theta` +
`rope_scaling` (as in released checkpoints) and `rope_parameters` (as transformers 5 writes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

from jmarl.errors import JmarlError

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# How attention is computed (`jmarl.models.attention`): auto picks per platform when the program
# is lowered (cuDNN flash on GPU, Pallas splash on TPU, blockwise elsewhere; dense for short
# sequences); the others force one form (a kernel falls back to blockwise for shapes it refuses).
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "xla", "cudnn", "splash", "blockwise")
# Routing replay of mixture-of-experts models (`ModelConfig.routing_replay`, a run's
# model.routing_replay): off, or replay (the sampler records each token's experts, the learner runs them).
ROUTING_REPLAY: tuple[str, ...] = ("off", "replay")
# Layer rematerialisation (`jax.checkpoint` around each decoder layer): none keeps every
# activation for the backward pass; full keeps only each layer's input and recomputes the rest;
# dots also keeps the outputs of the dense layers' matrix products (more memory, less recompute).
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots")
# remat "auto" (the default, in a ModelConfig and in a run's model.remat) is "full" from this many
# parameters up (real sizes, whose per-layer activations would not fit) and "none" below (tiny
# models, where remat only costs time).
REMAT_AUTO_MIN_PARAMS = 100_000_000
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Gemma 3's per-layer attention kinds (HF `layer_types`): a sliding layer attends to the
# `sliding_window` most recent positions (itself included), a full layer to every earlier one.
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of one decoder-only transformer.

    Family switches: `qkv_bias` (Qwen2: biases on q/k/v), `o_bias` (Llama/Qwen3
    `attention_bias=True`: biases on q/k/v/o), `qk_norm` (Qwen3: RMSNorm over each head of q and
    k before RoPE). `rope_type` is "default", "linear", "llama3" (with `rope_factor`,
    `rope_low_freq_factor`, `rope_high_freq_factor`, `rope_original_max_position`) or "yarn"
    (`rope_factor`, `rope_original_max_position`, `rope_beta_fast`, `rope_beta_slow`,
    `rope_truncate`, and `rope_attention_factor`: the factor on cos/sin, None for transformers'
    default 0.1 ln(factor) + 1; see `inv_frequencies` and `rope_attention_scaling`).
    `param_dtype` is how parameters are stored, `compute_dtype` how matmuls run; norms,
    softmax and log-probs always run in float32. `remat` is what each layer keeps for the
    backward pass: one of REMAT_POLICIES, True ("full"), False ("none") or "auto" (the default:
    "full" from REMAT_AUTO_MIN_PARAMS parameters up, else "none"; see `resolve_remat`). It is
    resolved when the config is built, so `remat` always holds one of REMAT_POLICIES; a
    `replace` that changes the shape keeps the resolved policy unless it passes remat="auto"
    again. `attention` is one of ATTENTION_IMPLS (see `jmarl.models.attention`).

    Gemma 3 (`model_type="gemma3_text"`, `is_gemma3`): embeddings scaled by sqrt(hidden_size),
    RMSNorms x * (1 + w), norms before and after attention and the MLP, a GeGLU MLP (tanh GELU),
    q/k RMSNorm, scores scaled by `query_pre_attn_scalar ** -0.5`. `sliding_window` W (None: every
    layer attends to all earlier tokens) with `layer_types` (one of SLIDING / FULL per layer): a
    sliding layer's query at position t sees keys at positions t - W < s <= t and rotates by
    RoPE of theta `rope_local_theta` (no scaling); full layers use `rope_theta` and `rope_type`.

    Qwen3-MoE (`model_type="qwen3_moe"`: Qwen3's attention, q/k norms included): layer i is a
    sparse mixture-of-experts layer iff i is not in `mlp_only_layers`, `num_experts` > 0 and
    (i + 1) % `decoder_sparse_step` == 0 (transformers' rule; `sparse_layers`), else a dense
    SwiGLU MLP of `intermediate_size`. A sparse layer routes each token to its
    `num_experts_per_tok` most probable experts (SwiGLU MLPs of `moe_intermediate_size`; the
    top-k probabilities renormalised to sum to 1 when `norm_topk_prob`; `jmarl.models.moe`).
    `router_aux_loss_coef` is the weight transformers gives the load-balancing loss in training.
    No shared expert (Qwen2-MoE style): refused by `from_hf`. `routing_replay` (one of
    ROUTING_REPLAY; "replay" needs experts): "replay" makes the sampler record each token's
    experts (`jmarl.models.generation.spec.Generation.routing`) and the learner run them
    (`jmarl.models.moe.replay_route`); a training setting, not written to config.json.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool | str = "auto"
    attention: str = "auto"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    routing_replay: str = "off"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise JmarlError(
                f"unsupported model_type {self.model_type!r}; jmarl supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise JmarlError(
                f"unsupported RoPE scaling type {self.rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise JmarlError(f"ModelConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise JmarlError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise JmarlError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self._check_moe()
        self._check_routing_replay()
        object.__setattr__(self, "remat", resolve_remat(self.remat, self.num_params(), setting="ModelConfig.remat"))
        if self.attention not in ATTENTION_IMPLS:
            raise JmarlError(f"ModelConfig.attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._check_sliding_window()

    def _check_moe(self) -> None:
        """Validates the mixture-of-experts fields (a list of mlp_only_layers becomes a tuple)."""
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers or ()))
        if self.model_type != "qwen3_moe":
            if self.num_experts:
                raise JmarlError(f"ModelConfig.num_experts is for model_type qwen3_moe only, not {self.model_type!r}")
            return
        if self.num_experts < 0 or self.decoder_sparse_step < 1:
            raise JmarlError(
                f"ModelConfig: num_experts must be >= 0 and decoder_sparse_step >= 1, got {self.num_experts} "
                f"and {self.decoder_sparse_step}"
            )
        if self.is_moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise JmarlError(
                f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.is_moe and self.moe_intermediate_size < 1:
            raise JmarlError(f"ModelConfig.moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")

    def _check_routing_replay(self) -> None:
        """Validates routing_replay: one of ROUTING_REPLAY, "replay" on a model with experts only."""
        if self.routing_replay not in ROUTING_REPLAY:
            raise JmarlError(f"ModelConfig.routing_replay must be one of {ROUTING_REPLAY}, got {self.routing_replay!r}")
        if self.routing_replay == "replay" and not self.is_moe:
            raise JmarlError(f"ModelConfig.routing_replay='replay' replays mixture-of-experts routing, and this "
                             f"{self.model_type} model has no expert layer; set routing_replay='off'")

    def _check_sliding_window(self) -> None:
        """Validates sliding_window / layer_types (a list becomes a tuple, hashable)."""
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.is_gemma3:
            if self.qkv_bias or self.o_bias:
                raise JmarlError("gemma3_text has no attention biases: set qkv_bias and o_bias to False")
            object.__setattr__(self, "qk_norm", True)  # Gemma 3 always normalises q and k
        if self.sliding_window is None:
            return
        if self.model_type != "gemma3_text":
            raise JmarlError(f"ModelConfig.sliding_window is supported for gemma3_text only, not {self.model_type!r}")
        if int(self.sliding_window) < 1:
            raise JmarlError(f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.layer_types is None or len(self.layer_types) != self.num_layers:
            raise JmarlError(
                f"ModelConfig.layer_types must list one of {SLIDING!r} / {FULL!r} per layer ({self.num_layers}) "
                f"when sliding_window is set, got {self.layer_types!r}; build it with gemma3_layer_types(num_layers, 6)"
            )
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise JmarlError(f"ModelConfig.layer_types: unknown layer types {bad}; supported: {SLIDING!r}, {FULL!r}")

    # ----------------------------------------------------------------------------- derived
    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_gemma3(self) -> bool:
        """Gemma 3 numerics: scaled embeddings, (1 + w) norms, sandwich norms, GeGLU MLP."""
        return self.model_type == "gemma3_text"

    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it is a mixture-of-experts layer (transformers' Qwen3MoeDecoderLayer
        rule: not in mlp_only_layers, num_experts > 0, (i + 1) % decoder_sparse_step == 0)."""
        if self.model_type != "qwen3_moe" or self.num_experts <= 0:
            return (False,) * self.num_layers
        return tuple(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_layers))

    @property
    def is_moe(self) -> bool:
        """Whether some layer is a mixture-of-experts layer (`sparse_layers`)."""
        return any(self.sparse_layers())

    @property
    def replays_routing(self) -> bool:
        """Whether the sampler records each token's experts and the learner replays them
        (routing_replay "replay"; only a model with experts has it)."""
        return self.routing_replay == "replay"

    @property
    def num_sparse_layers(self) -> int:
        """How many layers are mixture-of-experts layers (`sparse_layers`)."""
        return sum(self.sparse_layers())

    @property
    def has_mixed_mlps(self) -> bool:
        """Whether the layers mix dense MLPs and mixture-of-experts layers: each layer then holds
        both, the one it does not use zeros (`jmarl.models.layers.DecoderLayer.feed_forward`)."""
        kinds = set(self.sparse_layers())
        return len(kinds) == 2

    @property
    def has_sliding_window(self) -> bool:
        """Whether some layer attends through a sliding window (`sliding_layers`)."""
        return self.sliding_window is not None and SLIDING in (self.layer_types or ())

    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it attends through the sliding window (all False without one)."""
        if self.sliding_window is None or self.layer_types is None:
            return (False,) * self.num_layers
        return tuple(kind == SLIDING for kind in self.layer_types)

    def window_exceeded(self, length: int) -> bool:
        """Whether a sequence of `length` tokens reaches past the sliding window (below or at W a
        sliding layer sees every earlier token, as a full one does)."""
        return self.has_sliding_window and length > int(self.sliding_window)

    def attention_scale_factor(self) -> float | None:
        """The factor that turns attention's 1/sqrt(head_dim) into 1/sqrt(query_pre_attn_scalar)
        (applied to the queries), or None when they are equal (no multiply at all)."""
        if self.query_pre_attn_scalar is None or float(self.query_pre_attn_scalar) == float(self.head_dim):
            return None
        return float(np.sqrt(np.float64(self.head_dim)) / np.sqrt(np.float64(self.query_pre_attn_scalar)))

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (e.g. `param_dtype="bfloat16"`, `remat=True`)."""
        return dataclasses.replace(self, **changes)

    def remat_policy(self) -> Any:
        """The `jax.checkpoint` policy of `remat` (None for "full": save nothing but the layer
        input); only meaningful when remat != "none"."""
        import jax

        return {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}.get(self.remat)

    def num_params(self) -> int:
        """Total parameter count, as transformers counts it (a model with `has_mixed_mlps`
        stores more: each layer holds a dense MLP and the experts, one of them unused)."""
        d, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d
        attn += (q + 2 * kv) * (self.qkv_bias or self.o_bias) + d * self.o_bias
        attn += 2 * hd * self.qk_norm
        layer = attn + (4 if self.is_gemma3 else 2) * d
        sparse = sum(self.sparse_layers())
        dense_mlp = 3 * d * self.intermediate_size
        sparse_mlp = d * self.num_experts + 3 * d * self.moe_intermediate_size * self.num_experts
        mlps = (self.num_layers - sparse) * dense_mlp + sparse * sparse_mlp
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * layer + mlps + d + head

    def inv_frequencies(self, local: bool = False) -> np.ndarray:
        """RoPE inverse frequencies float32[head_dim // 2], scaled as `rope_type` says. local: those
        of the sliding-window layers (theta `rope_local_theta`, never scaled)."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / self.head_dim
        if local:
            theta = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
            return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
        inv_freq = (1.0 / (np.float32(self.rope_theta) ** exponents)).astype(np.float32)
        if self.rope_type == "linear":
            return (inv_freq / np.float32(self.rope_factor)).astype(np.float32)
        if self.rope_type == "llama3":
            return _llama3_scaled(inv_freq, self)
        if self.rope_type == "yarn":
            return _yarn_inv_freq(self)
        return inv_freq

    def rope_attention_scaling(self, local: bool = False) -> float:
        """The factor transformers puts on RoPE's cos and sin (its `attention_scaling`): YaRN's
        attention factor (`rope_attention_factor`, by default 0.1 ln(factor) + 1 for factor > 1),
        1.0 for every other type and for the sliding-window layers (local)."""
        if local or self.rope_type != "yarn":
            return 1.0
        if self.rope_attention_factor is not None:
            return float(self.rope_attention_factor)
        return yarn_mscale(self.rope_factor)

    # ----------------------------------------------------------------------------- HF interop
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Reads a HF config (a dict, a checkpoint directory, or a config.json path).

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
            return cls(**fields)
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
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict (transformers 4 and 5 both read it)."""
        if self.is_gemma3:
            return _gemma3_to_hf(self)
        rope = _rope_to_hf(self)
        hf: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_type == "default" else dict(rope),
            "rope_parameters": rope,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            hf["attention_bias"] = self.o_bias
            hf["mlp_bias"] = False
        elif self.model_type in ("qwen3", "qwen3_moe"):
            hf["attention_bias"] = self.o_bias
            hf["use_sliding_window"] = False
            if self.model_type == "qwen3_moe":
                hf.update(
                    num_experts=self.num_experts,
                    num_experts_per_tok=self.num_experts_per_tok,
                    moe_intermediate_size=self.moe_intermediate_size,
                    norm_topk_prob=self.norm_topk_prob,
                    decoder_sparse_step=self.decoder_sparse_step,
                    mlp_only_layers=list(self.mlp_only_layers),
                    router_aux_loss_coef=self.router_aux_loss_coef,
                    output_router_logits=False,
                )
        else:
            hf["use_sliding_window"] = False
        return hf


def resolve_remat(remat: bool | str, num_params: int, *, setting: str = "model.remat") -> str:
    """The layer remat policy (one of REMAT_POLICIES) of a remat setting for a model of
    `num_params` parameters: True -> "full", False -> "none", "auto" -> "full" from
    REMAT_AUTO_MIN_PARAMS (1e8) parameters up, else "none"; a policy name as given. Anything
    else: JmarlError naming `setting` (e.g. model.remat, ModelConfig.remat)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat == "auto":
        return "full" if num_params >= REMAT_AUTO_MIN_PARAMS else "none"
    if remat not in REMAT_POLICIES:
        raise JmarlError(f"{setting}: must be auto, {', '.join(REMAT_POLICIES)}, true or false; got {remat!r}")
    return remat


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


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's interleaving (HF `sliding_window_pattern`): pattern - 1 sliding layers, then one
    full layer, repeated; layer i is full iff (i + 1) % pattern == 0."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


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
        "architectures": [_HF_ARCHITECTURES[c.model_type]],
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context `factor` (transformers' `get_mscale`):
    0.1 * mscale * ln(factor) + 1, or 1 when factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(config: ModelConfig) -> np.ndarray:
    """YaRN inverse frequencies float32[head_dim // 2], transformers' `_compute_yarn_parameters`
    step by step in float32: the frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those that turn more than beta_fast
    times are kept (extrapolated), and a linear ramp over the dimensions blends the two between."""
    dim, base = config.head_dim, float(config.rope_theta)
    original = config.rope_original_max_position

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(config.rope_factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)  # 1: extrapolated (kept), 0: interpolated
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend in between."""
    factor = np.float32(config.rope_factor)
    low, high = np.float32(config.rope_low_freq_factor), np.float32(config.rope_high_freq_factor)
    old_len = np.float32(config.rope_original_max_position)
    wavelen = np.float32(2 * math.pi) / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)
