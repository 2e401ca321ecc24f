"""`ModelConfig`: the schema of a decoder-only LM (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 3).

One frozen, hashable dataclass, so it can be a static argument of `jax.jit` and a cache key: its
fields, their validation, and what follows from them alone (sparse and sliding layers, parameter
count, remat policy). Its neighbours depend on it, never the reverse: the translation from and
to a Hugging Face `config.json` is `jmarl.models.hf_config`, the RoPE frequencies and their
scaling (linear, Llama 3, YaRN) are `jmarl.models.rope`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jmarl.errors import JmarlError

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# How attention is computed (`jmarl.models.attention`): auto picks per platform when the program
# is lowered (cuDNN flash on GPU, Pallas splash on TPU, blockwise elsewhere; dense for short
# sequences); the others force one form (a kernel falls back to blockwise for shapes it refuses);
# pallas: the packed learner's fused kernel on CUDA GPUs (jmarl.models.packed_pallas).
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "xla", "cudnn", "splash", "blockwise", "pallas")
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
    default 0.1 ln(factor) + 1; see `jmarl.models.rope.inv_frequencies` and `rope_attention_scaling`).
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
    No shared expert (Qwen2-MoE style): refused by `jmarl.models.hf_config.config_from_hf`. `routing_replay` (one of
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


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's interleaving (HF `sliding_window_pattern`): pattern - 1 sliding layers, then one
    full layer, repeated; layer i is full iff (i + 1) % pattern == 0."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
