"""GGUF checkpoints (llama.cpp's format) as a jmarl input: `load_gguf` -> (ModelConfig, params).

The file's header is parsed by `jmarl.models.gguf_file` (memory-mapped, no torch, well under a
second even for a 262,144-word vocabulary) and every weight is dequantised with the `gguf`
package's `gguf.quants.dequantize` to float32, so the result is the same config
and parameter tree `jmarl.models.hf.load_hf` gives for the Hugging Face checkpoint the GGUF was
converted from (up to the quantisation error the file itself carries). Export after training
stays a Hugging Face directory: `save_hf(dir, config, params)`.

How llama.cpp's converter (`convert_hf_to_gguf.py`) stores a llama / qwen2 / qwen3 / gemma3 model,
and what is undone here:

* hyperparameters are metadata keys `<arch>.block_count`, `<arch>.attention.head_count`, ...;
  numbers stored as float32 (rms eps, rope base) are read back as the shortest decimal that
  rounds to the same float32 (1e-06, not 9.99999997e-07), as config.json spells them;
* tensors are renamed (`blk.{i}.attn_q.weight` for `model.layers.{i}.self_attn.q_proj.weight`)
  and stored in ggml order (shape reversed; the data is HF's [out, in] row-major);
* for architecture "llama" only, the rows of the q and k projections (weights and biases) are
  permuted from HF's rotate-half RoPE layout to ggml's interleaved one
  (`LlamaModel.permute`); `_unpermute` inverts it exactly;
* Llama 3 RoPE scaling is not metadata but a tensor `rope_freqs.weight` (one divisor per
  frequency); factor, low/high frequency factors and the original context are fitted back to it
  and checked to reproduce it;
* tied embeddings: the file simply has no `output.weight`.

Gemma 3 text (architecture "gemma3", loaded as jmarl's `gemma3_text`; `Gemma3ForCausalLM`'s
tensors, or the language model of a multimodal checkpoint, whose vision tower goes to a separate
mmproj file):

* every RMSNorm weight (`*norm.weight`: the four per-layer norms, q/k norms, the final norm) is
  stored as 1 + w (Gemma's norms scale by 1 + w): 1 is subtracted in float32, as transformers'
  GGUF loader does, so w is HF's; HF's `post_attention_layernorm` / `pre_feedforward_layernorm` /
  `post_feedforward_layernorm` are `post_attention_norm` / `ffn_norm` / `post_ffw_norm`;
* `gemma3.attention.sliding_window` is the window (absent: no sliding layer, all attend fully);
  the interleaving is `gemma3.attention.sliding_window_pattern` if the file has it (a period, or
  one bool per layer), else llama.cpp's fixed period of 6 (five sliding layers, then one full);
  `gemma3.rope.freq_base` is the full layers' RoPE base and the sliding layers' is
  `gemma3.rope.freq_base_swa` if present, else llama.cpp's fixed 10000; linear RoPE scaling
  (Gemma 3 4B and up) is `gemma3.rope.scaling.*` on the full layers only;
* the query scale is not stored: `gemma3.attention.scale` if present, else llama.cpp's rule
  (1 / sqrt(hidden / heads) for the 62-layer 27B, 1 / sqrt(head_dim) otherwise), which gives
  the released configs' `query_pre_attn_scalar`;
* the embedding keeps only the tokenizer's rows (262,144 of the checkpoint's 262,208), so the
  vocabulary is the file's; logit soft-capping (`gemma3.final_logit_softcapping`) is refused.

The tokenizer a GGUF file describes: `jmarl.models.gguf_tokenizer`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.errors import JmarlError
from jmarl.models.config import FULL, SLIDING, ModelConfig, gemma3_layer_types
from jmarl.models.gguf_file import GGUFFormatError, read_gguf
from jmarl.models.hf import _get, _tensor_specs, place
from jmarl.models.model import Params, param_shapes
from jmarl.models.rope import inv_frequencies

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma3")
# ggml tensor types whose values `gguf.quants.dequantize` recovers (names of GGMLQuantizationType;
# ones the installed gguf package does not know are left out).
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
)

# HF name (under model.layers.{i}. for layer tensors) -> GGUF name (under blk.{i}.)
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 3's layer tensors beyond / instead of the ones above (its post_attention_layernorm
# normalises the attention output; the MLP's input norm is pre_feedforward_layernorm).
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# llama.cpp's Gemma 3 constants, used when the file does not state them (llama-model.cpp)
_GEMMA3_SWA_PERIOD = 6
_GEMMA3_SWA_ROPE_BASE = 10000.0
# Tensors the converter writes that carry no parameter (read for the config instead).
_CONFIG_TENSORS = ("rope_freqs.weight",)
_MISSING = object()


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise JmarlError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    return gguf


def gguf_name(hf_name: str, model_type: str = "llama") -> str:
    """The llama.cpp tensor name of a HF tensor name of a `model_type` model (llama, qwen2, qwen3
    or gemma3_text; KeyError if none)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    layer_names = _GEMMA3_LAYER_NAMES if model_type == "gemma3_text" else _LAYER_NAMES
    prefix, _, rest = hf_name.partition(".layers.")
    layer, _, suffix = rest.partition(".")
    if prefix != "model" or not layer.isdigit() or suffix not in layer_names:
        raise KeyError(hf_name)
    return f"blk.{layer}.{layer_names[suffix]}"


# ------------------------------------------------------------------------------ reading
def open_gguf(path: str | os.PathLike) -> "GGUFFile":
    """The `GGUFFile` of `path`, shared by calls on the same unchanged file (`load_gguf`,
    `load_gguf_tokenizer` and `gguf_chat_template` each open it)."""
    path = os.fspath(path)
    try:
        stat = os.stat(path)
    except OSError:
        raise JmarlError(f"GGUF file not found: {path}") from None
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _OPEN:
        while len(_OPEN) >= 2:
            _OPEN.pop(next(iter(_OPEN)))
        _OPEN[key] = GGUFFile(path)
    return _OPEN[key]


_OPEN: dict[tuple, "GGUFFile"] = {}


class GGUFFile:
    """One opened GGUF file: metadata values on demand, tensors by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise JmarlError(f"GGUF file not found: {self.path}")
        try:
            self.contents = read_gguf(self.path)
        except GGUFFormatError as err:
            raise JmarlError(f"{self.path} is not a readable GGUF file: {err}") from None
        self.tensors = self.contents.tensors

    def value(self, key: str, default: Any = _MISSING) -> Any:
        """The metadata value of `key` (str, int, float, bool or a list of them)."""
        if key not in self.contents.metadata:
            if default is _MISSING:
                raise JmarlError(f"GGUF file {self.path} lacks the metadata key {key!r}")
            return default
        return self.contents.metadata[key]

    def type_name(self, name: str) -> str:
        return self._type(name).name

    def _type(self, name: str) -> Any:
        """The `gguf.GGMLQuantizationType` of tensor `name`."""
        type_id = self.tensors[name].type_id
        try:
            return _gguf().GGMLQuantizationType(type_id)
        except ValueError:
            raise _type_error(self.path, name, f"#{type_id} (unknown to the gguf package)") from None

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s stored data as the gguf package's dequantiser takes it: plain types as
        their NumPy dtype, quantised ones as uint8 rows of blocks (reversed ggml shape)."""
        gguf = _gguf()
        entry, kind = self.tensors[name], self._type(name)
        dims = tuple(reversed(entry.shape))
        n = int(np.prod(entry.shape, dtype=np.int64))
        plain = _PLAIN_TYPES.get(kind.name)
        if plain is not None:
            dtype, count = np.dtype(plain), n
        else:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            dtype, count, dims = np.dtype(np.uint8), n * size // block, gguf.quants.quant_shape_to_byte_shape(dims, kind)
        end = entry.offset + dtype.itemsize * count
        if end > self.contents.data.size:
            raise JmarlError(f"tensor {name} in {self.path} runs past the end of the file (truncated download?)")
        return self.contents.data[entry.offset : end].view(dtype).reshape(dims)

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` dequantised to float32, in HF (row-major, reversed ggml) shape."""
        gguf = _gguf()
        kind = self._type(name)
        shape = tuple(reversed(self.tensors[name].shape))
        try:
            values = gguf.quants.dequantize(self.raw(name), kind)
        except NotImplementedError:
            raise _type_error(self.path, name, kind.name) from None
        return np.asarray(values, np.float32).reshape(shape)


# ggml types stored as plain NumPy values (the rest are blocks of bytes)
_PLAIN_TYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


def _type_error(path: str, name: str, type_name: str) -> JmarlError:
    return JmarlError(
        f"tensor {name} in {path} is stored as ggml type {type_name}, which jmarl cannot dequantise; "
        f"supported types: {', '.join(_supported_types())}. Re-quantise the model to one of them "
        "(e.g. llama.cpp's llama-quantize ... Q8_0) or convert the HF checkpoint instead"
    )


def _supported_types() -> tuple[str, ...]:
    known = _gguf().GGMLQuantizationType.__members__
    return tuple(t for t in SUPPORTED_TENSOR_TYPES if t in known)


# ------------------------------------------------------------------------------ config
def _int_hparam(f: GGUFFile, arch: str, key: str, default: Any = _MISSING) -> Any:
    value = f.value(f"{arch}.{key}", default)
    if isinstance(value, list):  # per-layer lists (hybrid models): jmarl needs them uniform
        if len(set(value)) != 1:
            raise JmarlError(f"GGUF file {f.path}: {arch}.{key} differs between layers ({value}); "
                             "jmarl supports uniform layers only")
        value = value[0]
    return value


def _gguf_config(f: GGUFFile) -> tuple[ModelConfig, bool]:
    """(the ModelConfig of the file, whether q/k rows are in llama.cpp's permuted order)."""
    arch = f.value("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise JmarlError(
            f"GGUF file {f.path} holds architecture {arch!r}; jmarl loads {', '.join(SUPPORTED_ARCHITECTURES)} "
            "GGUF files (other families: load their HF checkpoint if it is one of those)"
        )
    t = f.tensors
    for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
                 "blk.0.ffn_gate.weight"):
        if name not in t:
            raise JmarlError(f"GGUF file {f.path} lacks tensor {name}, which every {arch} model has")
    hidden, vocab = (int(d) for d in t["token_embd.weight"].shape)
    num_layers = int(_int_hparam(f, arch, "block_count"))
    num_heads = int(_int_hparam(f, arch, "attention.head_count"))
    num_kv_heads = int(_int_hparam(f, arch, "attention.head_count_kv", num_heads))
    q_out, k_out = int(t["blk.0.attn_q.weight"].shape[1]), int(t["blk.0.attn_k.weight"].shape[1])
    head_dim = q_out // num_heads
    declared = _int_hparam(f, arch, "attention.key_length", None)
    if q_out % num_heads or (declared is not None and int(declared) != head_dim) or k_out != num_kv_heads * head_dim:
        raise JmarlError(
            f"GGUF file {f.path}: attention shapes (q {q_out}, k {k_out} outputs) do not fit "
            f"{num_heads} heads / {num_kv_heads} kv heads (key_length {declared})"
        )
    rotary = _int_hparam(f, arch, "rope.dimension_count", None)
    if rotary is not None and int(rotary) != head_dim:
        raise JmarlError(f"GGUF file {f.path} rotates {rotary} of {head_dim} head dimensions; "
                         "jmarl supports full-width RoPE only")
    embedding_length = int(_int_hparam(f, arch, "embedding_length", hidden))
    if embedding_length != hidden:
        raise JmarlError(f"GGUF file {f.path}: embedding_length {embedding_length} but token_embd is {hidden} wide")
    if f"blk.{num_layers - 1}.attn_q.weight" not in t or f"blk.{num_layers}.attn_q.weight" in t:
        raise JmarlError(f"GGUF file {f.path}: block_count is {num_layers} but the blk.* tensors disagree")
    if "blk.0.ffn_up.bias" in t or "blk.0.ffn_down.bias" in t:
        raise JmarlError(f"GGUF file {f.path} has MLP biases, which jmarl does not support")
    if arch == "gemma3":
        return _gemma3_config(f, hidden, vocab, num_layers, num_heads, num_kv_heads, head_dim), False

    q_bias, o_bias = "blk.0.attn_q.bias" in t, "blk.0.attn_output.bias" in t
    if arch == "qwen2":
        if not q_bias or o_bias:
            raise JmarlError(f"GGUF file {f.path}: a qwen2 model has q/k/v biases and no output bias")
        qkv_bias, out_bias = True, False
    else:
        if q_bias != o_bias:
            raise JmarlError(
                f"GGUF file {f.path}: {arch} with biases on {'q/k/v only' if q_bias else 'the output only'}; "
                "jmarl supports attention biases on all four projections or none"
            )
        qkv_bias = out_bias = q_bias
    qk_norm = arch == "qwen3"
    if qk_norm != ("blk.0.attn_q_norm.weight" in t):
        raise JmarlError(f"GGUF file {f.path}: q/k norms {'missing from' if qk_norm else 'present in'} a {arch} model")

    fields: dict[str, Any] = dict(
        model_type=arch,
        **_shape_fields(f, arch, hidden, vocab, num_layers, num_heads, num_kv_heads, head_dim, context=32768),
        qkv_bias=qkv_bias,
        o_bias=out_bias,
        qk_norm=qk_norm,
    )
    fields.update(_rope_fields(f, arch, head_dim))
    fields.update(_token_ids(f))
    return ModelConfig(**fields), arch == "llama"


def _token_ids(f: GGUFFile) -> dict[str, Any]:
    """bos / eos (with the end-of-turn token, if another) / pad ids from the tokenizer metadata."""
    fields: dict[str, Any] = {}
    bos = f.value("tokenizer.ggml.bos_token_id", None)
    eos = f.value("tokenizer.ggml.eos_token_id", None)
    eot = f.value("tokenizer.ggml.eot_token_id", None)
    pad = f.value("tokenizer.ggml.padding_token_id", None)
    if bos is not None:
        fields["bos_token_id"] = int(bos)
    if eos is not None:
        fields["eos_token_id"] = int(eos) if eot in (None, eos) else (int(eos), int(eot))
    if pad is not None:
        fields["pad_token_id"] = int(pad)
    return fields


def _shape_fields(f: GGUFFile, arch: str, hidden: int, vocab: int, num_layers: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, *, context: int) -> dict[str, Any]:
    """The ModelConfig fields every architecture reads alike: sizes (the MLP's from its gate
    tensor [D, F]), the norms' epsilon, the context length (`context` when the file has none)
    and whether the head is tied (no `output.weight`)."""
    t = f.tensors
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(t["blk.0.ffn_gate.weight"].shape[1]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(f.value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(_int_hparam(f, arch, "context_length", context)),
        tie_word_embeddings="output.weight" not in t,
    )


def _gemma3_config(f: GGUFFile, hidden: int, vocab: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> ModelConfig:
    """The gemma3_text ModelConfig of a llama.cpp "gemma3" file (shapes already checked)."""
    arch, t = "gemma3", f.tensors
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = f.value(f"{arch}.{key}", None)
        if cap:
            raise JmarlError(f"GGUF file {f.path} sets {arch}.{key}={cap}: jmarl's gemma3_text does not "
                             "implement logit soft-capping")
    biases = sorted(n for n in t if n.startswith("blk.0.") and n.endswith(".bias"))
    if biases:
        raise JmarlError(f"GGUF file {f.path}: a gemma3 model with biases ({', '.join(biases)}), "
                         "which jmarl's gemma3_text does not support")
    for name in ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "blk.0.post_attention_norm.weight",
                 "blk.0.ffn_norm.weight", "blk.0.post_ffw_norm.weight"):
        if name not in t:
            raise JmarlError(f"GGUF file {f.path} lacks tensor {name}, which every gemma3 model has")

    window = _int_hparam(f, arch, "attention.sliding_window", None)
    window = int(window) if window else None  # absent or 0: llama.cpp runs every layer fully
    pattern = f.value(f"{arch}.attention.sliding_window_pattern", None)
    if window is None:
        layer_types = (FULL,) * num_layers
    elif pattern is None or isinstance(pattern, (int, float)):
        period = _GEMMA3_SWA_PERIOD if pattern is None else int(pattern)
        if period < 1:
            raise JmarlError(f"GGUF file {f.path}: {arch}.attention.sliding_window_pattern is {pattern}")
        layer_types = gemma3_layer_types(num_layers, period)
    elif isinstance(pattern, list) and len(pattern) == num_layers:
        layer_types = tuple(SLIDING if flag else FULL for flag in pattern)
    else:
        raise JmarlError(f"GGUF file {f.path}: {arch}.attention.sliding_window_pattern {pattern!r} is neither "
                         f"a period nor one flag per layer ({num_layers})")

    scale = f.value(f"{arch}.attention.scale", None)
    if scale:
        query_scalar = float(_nice(1.0 / float(scale) ** 2))
    elif num_layers == 62:  # llama.cpp's LLM_TYPE_27B: 1 / sqrt(n_embd / n_head)
        query_scalar = float(hidden // num_heads)
    else:
        query_scalar = float(head_dim)

    fields: dict[str, Any] = dict(
        model_type="gemma3_text",
        **_shape_fields(f, arch, hidden, vocab, num_layers, num_heads, num_kv_heads, head_dim, context=131072),
        qkv_bias=False,
        o_bias=False,
        qk_norm=True,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=float(f.value(f"{arch}.rope.freq_base_swa", _GEMMA3_SWA_ROPE_BASE)),
        query_pre_attn_scalar=query_scalar,
    )
    fields.update(_rope_fields(f, arch, head_dim, default_theta=1_000_000.0))
    fields.update(_token_ids(f))
    return ModelConfig(**fields)


def _rope_fields(f: GGUFFile, arch: str, head_dim: int, default_theta: float = 10000.0) -> dict[str, Any]:
    theta = float(f.value(f"{arch}.rope.freq_base", default_theta))
    fields: dict[str, Any] = {"rope_theta": theta, "rope_type": "default"}
    scaling = f.value(f"{arch}.rope.scaling.type", "none")
    linear = f.value(f"{arch}.rope.scale_linear", None)  # older files
    if scaling == "linear" or (scaling == "none" and linear is not None):
        factor = float(f.value(f"{arch}.rope.scaling.factor", linear if linear is not None else 1.0))
        if factor != 1.0:
            fields.update(rope_type="linear", rope_factor=factor)
    elif scaling != "none":
        raise JmarlError(
            f"GGUF file {f.path} uses RoPE scaling {scaling!r}; jmarl supports none, linear and Llama 3's"
        )
    if "rope_freqs.weight" in f.tensors:
        if fields["rope_type"] != "default":
            raise JmarlError(f"GGUF file {f.path} has both rope_freqs.weight and {scaling} RoPE scaling")
        divisors = f.array("rope_freqs.weight").reshape(-1)
        if divisors.shape != (head_dim // 2,):
            raise JmarlError(f"GGUF file {f.path}: rope_freqs.weight has {divisors.size} entries, "
                             f"expected {head_dim // 2}")
        fields.update(_llama3_fit(divisors, theta, head_dim, f.path))
    return fields


def _llama3_fit(divisors: np.ndarray, theta: float, head_dim: int, path: str) -> dict[str, Any]:
    """Llama 3 RoPE parameters whose scaled frequencies equal base / `divisors` (llama.cpp's
    rope_freqs tensor: 1 at high frequencies, `factor` at low ones, a blend in between).

    In the blend, 1 / divisor = (1 - s) / factor + s with s = old_len / wavelength / (high - low)
    - low / (high - low), linear in the frequency: two blended frequencies fix its slope and
    intercept, and low = 1 (Llama 3's value) fixes the rest. With fewer, Llama 3's low = 1 and
    high = 4 are assumed and the original context is solved for (or, with no blended frequency,
    is 8192, the converter's own default, if that fits, else the middle of the range that fits).
    The fitted config is checked to reproduce the file's frequencies."""
    d = divisors.astype(np.float64)
    if np.allclose(d, 1.0, rtol=0, atol=1e-7):
        return {}
    if np.allclose(d, d[0], rtol=1e-6, atol=0):
        candidates = [{"rope_type": "linear", "rope_factor": _nice(d[0])}]
    else:
        factor = _nice(float(d.max()))
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float64)
        per_wave = inv_freq / (2 * math.pi)  # 1 / wavelength
        blended = (d > 1 + 1e-6) & (d < factor * (1 - 1e-6))
        smooth = (1.0 / d[blended] - 1.0 / factor) / (1.0 - 1.0 / factor)
        candidates = []
        if blended.sum() >= 2:
            slope, intercept = np.polyfit(per_wave[blended], smooth, 1)  # s = slope * x + intercept
            if intercept < 0:
                span = -1.0 / intercept  # high - low with low = 1
                candidates.append((1.0, _nice(1.0 + span), int(round(slope * span))))
        if blended.sum() >= 1:
            x, s = per_wave[blended][0], smooth[0]
            candidates.append((1.0, 4.0, int(round((s * 3.0 + 1.0) / x))))
        else:
            # every frequency is either kept or fully scaled: any context between the wavelengths
            # of the last kept and first scaled frequencies fits (with low 1, high 4)
            # (kept: wavelength < old_len / 4; scaled: wavelength > old_len)
            kept, scaled = per_wave[d <= 1 + 1e-6], per_wave[d >= factor * (1 - 1e-6)]
            lo = 4.0 / kept.min() if kept.size else 1.0  # old_len must exceed this ...
            hi = 1.0 / scaled.max() if scaled.size else math.inf  # ... and stay below this
            candidates.append((1.0, 4.0, 8192))
            if math.isfinite(hi):
                candidates.append((1.0, 4.0, int(round(math.sqrt(lo * hi)))))
        candidates = [
            {"rope_type": "llama3", "rope_factor": factor, "rope_low_freq_factor": low,
             "rope_high_freq_factor": high, "rope_original_max_position": old}
            for low, high, old in candidates
        ]
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    target = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32) / divisors.astype(np.float32)
    for fields in candidates:
        probe = ModelConfig(model_type="llama", vocab_size=2, hidden_size=head_dim, intermediate_size=2,
                            num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta,
                            **fields)
        if np.allclose(inv_frequencies(probe), target, rtol=1e-5, atol=0):
            return fields
    raise JmarlError(
        f"GGUF file {path}: its rope_freqs.weight (RoPE frequency divisors {np.round(d, 4).tolist()}) "
        "matches no RoPE scaling jmarl supports (none, linear, llama3)"
    )


def _nice(x: float) -> float:
    """`x` rounded to 6 significant digits (a factor of 8 stored as 7.9999995 reads back as 8.0)."""
    return float(f"{x:.6g}")


# ------------------------------------------------------------------------------ weights
def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute(w, n_head, n_head)` on the rows (dim 0) of a
    q/k weight or bias: back from ggml's interleaved RoPE pairs to HF's rotate-half halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str | os.PathLike, *, param_dtype: Any = None, compute_dtype: Any = None
) -> tuple[ModelConfig, Params]:
    """Loads a llama/qwen2/qwen3/gemma3 GGUF file -> (config, params), the tree `load_hf` gives.

    Every tensor is dequantised to float32 (which holds each quantised value exactly);
    `param_dtype` (default "float32") is how the parameters are stored and, unless
    `compute_dtype` is given, the dtype the matmuls run in. Training needs float32 storage (see
    `load_hf`). Raises JmarlError for other architectures and for ggml types jmarl cannot
    dequantise (`SUPPORTED_TENSOR_TYPES`).
    """
    f = open_gguf(path)
    config, permuted = _gguf_config(f)
    try:
        dtype_name = jnp.dtype(param_dtype if param_dtype is not None else "float32").name
        compute_name = dtype_name if compute_dtype is None else jnp.dtype(compute_dtype).name
    except TypeError as err:
        raise JmarlError(f"load_gguf: {err}; use float32, bfloat16 or float16") from None
    config = config.replace(param_dtype=dtype_name, compute_dtype=compute_name)
    target = jnp.dtype(dtype_name)
    specs = list(_tensor_specs(config))
    names = {spec[1]: gguf_name(spec[1], config.model_type) for spec in specs}
    unexpected = sorted(set(f.tensors) - set(names.values()) - set(_CONFIG_TENSORS))
    if unexpected:
        raise JmarlError(
            f"GGUF file {f.path} has tensors a {config.model_type} model of this shape does not: "
            f"{', '.join(unexpected[:6])}{' ...' if len(unexpected) > 6 else ''}"
        )
    supported = set(_supported_types())
    for name in names.values():
        if name in f.tensors and f.type_name(name) not in supported:
            raise _type_error(f.path, name, f.type_name(name))

    shapes = param_shapes(config)
    host: dict = {}
    for path_, hf_name, transposed, layer in specs:
        name = names[hf_name]
        full_shape = _get(shapes, path_).shape
        shape = full_shape if layer is None else full_shape[1:]
        hf_shape = tuple(reversed(shape)) if transposed else tuple(shape)
        if name not in f.tensors:
            raise JmarlError(f"GGUF file {f.path} lacks tensor {name} (expected shape {list(hf_shape)})")
        value = f.array(name)
        if tuple(value.shape) != hf_shape:
            raise JmarlError(
                f"tensor {name} in {f.path} has shape {list(value.shape)} (HF order), expected {list(hf_shape)}"
            )
        if permuted and (".attn_q." in name or ".attn_k." in name):
            value = _unpermute(value, config.num_heads if ".attn_q." in name else config.num_kv_heads)
        if config.is_gemma3 and name.endswith("norm.weight"):
            value = value - np.float32(1.0)  # stored as 1 + w (Gemma's RMSNorm scales by 1 + w)
        place(host, path_, value.T if transposed else value, layer, full_shape, target)
    params = jax.tree.map(jnp.asarray, host)
    return config, params


def load_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a GGUF file (float32 parameters), without reading its weights."""
    return _gguf_config(open_gguf(path))[0]
