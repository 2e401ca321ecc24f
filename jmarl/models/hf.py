"""Hugging Face checkpoint interop: `load_hf` / `save_hf` for safetensors checkpoints.

Reads `config.json` plus `model.safetensors` or a sharded `model.safetensors.index.json`.
Tensor files are memory-mapped (no full read into memory first): each tensor is copied once,
from the mapped file into its slot of the stacked jmarl parameter, then handed to JAX. The
safetensors format is read and written here directly (8-byte header length, JSON header, raw
little-endian data), so bfloat16 works through `ml_dtypes` although NumPy has no bfloat16.
HF stores linear weights as [out, in]; jmarl kernels are [in, out] (transposed on the way).

Qwen3-MoE: a sparse layer's router is `mlp.gate.weight` [E, D] and expert e's projections are
`mlp.experts.{e}.{gate,up,down}_proj.weight` (the released checkpoints' layout, which
transformers 5 also writes: it fuses them only in memory); jmarl stacks them [E, D, Fe] /
[E, Fe, D]. A checkpoint with transformers 5's fused in-memory names (`mlp.experts.gate_up_proj`
[E, 2 Fe, D], `mlp.experts.down_proj` [E, D, Fe]) loads too.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jmarl.errors import JmarlError
from jmarl.models.config import ModelConfig
from jmarl.models.hf_config import config_from_hf, config_to_hf
from jmarl.models.model import Params, param_shapes

_SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}

# (jmarl path under layers/, HF name under model.layers.{i}., is a [out, in] linear weight)
_LAYER_TENSORS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("attn_norm", "scale"), "input_layernorm.weight", False),
    (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", True),
    (("attn", "q_proj", "bias"), "self_attn.q_proj.bias", False),
    (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", True),
    (("attn", "k_proj", "bias"), "self_attn.k_proj.bias", False),
    (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", True),
    (("attn", "v_proj", "bias"), "self_attn.v_proj.bias", False),
    (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", True),
    (("attn", "o_proj", "bias"), "self_attn.o_proj.bias", False),
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", False),
)
# the dense MLP of a layer (every layer but the sparse ones of a Qwen3-MoE model)
_MLP_TENSORS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", True),
)
# a Qwen3-MoE sparse layer: the router, then expert e's projections (HF name "mlp.experts.{e}." + name)
_ROUTER_TENSOR: tuple[tuple[str, ...], str, bool] = (("moe", "router", "kernel"), "mlp.gate.weight", True)
_EXPERT_TENSORS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("moe", "experts", "gate_proj"), "gate_proj.weight", True),
    (("moe", "experts", "up_proj"), "up_proj.weight", True),
    (("moe", "experts", "down_proj"), "down_proj.weight", True),
)
# Gemma 3: post_attention_layernorm normalises the attention's output; the MLP's input norm is
# pre_feedforward_layernorm and its output norm post_feedforward_layernorm.
_GEMMA3_LAYER_TENSORS: tuple[tuple[tuple[str, ...], str, bool], ...] = tuple(
    entry for entry in _LAYER_TENSORS if entry[0] != ("mlp_norm", "scale")
) + (
    (("attn_post_norm", "scale"), "post_attention_layernorm.weight", False),
    (("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", False),
    (("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight", False),
)
_TOP_TENSORS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("embed", "embedding"), "model.embed_tokens.weight", False),
    (("final_norm", "scale"), "model.norm.weight", False),
    (("lm_head", "kernel"), "lm_head.weight", True),
)


# ------------------------------------------------------------------------------ safetensors
def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Memory-mapped, read-only arrays of one .safetensors file, by tensor name."""
    if not os.path.isfile(path):
        raise JmarlError(f"safetensors file not found: {path}")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if data.size < 8:
        raise JmarlError(f"{path} is not a safetensors file (shorter than its header)")
    header_len = int.from_bytes(data[:8].tobytes(), "little")
    try:
        header = json.loads(data[8 : 8 + header_len].tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise JmarlError(f"{path} is not a safetensors file (unreadable header)") from None
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise JmarlError(f"tensor {name} in {path} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        tensors[name] = data[base + start : base + end].view(dtype).reshape(info["shape"])
    return tensors


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes arrays (any of the safetensors dtypes, bfloat16 included) to one .safetensors file."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _DTYPE_NAMES:
            raise JmarlError(f"cannot write tensor {name} of dtype {arr.dtype} to safetensors")
        header[name] = {
            "dtype": _DTYPE_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        arrays[name] = arr
        offset += arr.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for arr in arrays.values():
            f.write(arr.tobytes())


def _checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (single file or sharded index), memory-mapped."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return read_safetensors(single)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise JmarlError(f"checkpoint shard {shard} listed in {index} is missing")
            tensors.update(read_safetensors(shard_path))
        return tensors
    raise JmarlError(
        f"no weights in {path}: expected model.safetensors or model.safetensors.index.json "
        "(PyTorch .bin checkpoints are not supported; re-save with safe_serialization=True)"
    )


Index = int | tuple[int, int] | None


def _tensor_specs(config: ModelConfig) -> Iterator[tuple[tuple[str, ...], str, bool, Index]]:
    """(jmarl path, HF name, transposed, index) for every checkpoint tensor of `config`; index is
    where it sits in the jmarl array: None (all of it), a layer i (row i of a stacked [L, ...]
    parameter) or (layer, expert) (an expert's slice of a stacked [L, E, ...] one). A layer's
    dense MLP is listed for the layers that run it, its router and experts for the sparse ones."""
    shapes = param_shapes(config)

    def exists(path: tuple[str, ...]) -> bool:
        node: Any = shapes
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return False
            node = node[key]
        return True

    for path, name, transposed in _TOP_TENSORS:
        if exists(path):
            yield path, name, transposed, None
    for path, name, transposed in (_GEMMA3_LAYER_TENSORS if config.is_gemma3 else _LAYER_TENSORS):
        if exists(("layers",) + path):
            for i in range(config.num_layers):
                yield ("layers",) + path, f"model.layers.{i}.{name}", transposed, i
    sparse = config.sparse_layers()
    dense_layers = [i for i in range(config.num_layers) if not sparse[i]]
    sparse_layers = [i for i in range(config.num_layers) if sparse[i]]
    for path, name, transposed in _MLP_TENSORS:
        for i in dense_layers:
            yield ("layers",) + path, f"model.layers.{i}.{name}", transposed, i
    path, name, transposed = _ROUTER_TENSOR
    for i in sparse_layers:
        yield ("layers",) + path, f"model.layers.{i}.{name}", transposed, i
    for path, name, transposed in _EXPERT_TENSORS:
        for i in sparse_layers:
            for e in range(config.num_experts):
                yield ("layers",) + path, f"model.layers.{i}.mlp.experts.{e}.{name}", transposed, (i, e)


def _unfused_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` with transformers 5's fused in-memory expert tensors (`mlp.experts.gate_up_proj`
    [E, 2 Fe, D]: gate rows first, `mlp.experts.down_proj` [E, D, Fe]) also under the released
    per-expert names (views, no copy)."""
    out = dict(tensors)
    for name, value in tensors.items():
        prefix, _, kind = name.rpartition(".mlp.experts.")
        if kind == "gate_up_proj":
            f = value.shape[1] // 2
            for e in range(value.shape[0]):
                out.setdefault(f"{prefix}.mlp.experts.{e}.gate_proj.weight", value[e, :f])
                out.setdefault(f"{prefix}.mlp.experts.{e}.up_proj.weight", value[e, f:])
        elif kind == "down_proj":
            for e in range(value.shape[0]):
                out.setdefault(f"{prefix}.mlp.experts.{e}.down_proj.weight", value[e])
    return out


def place(host: dict, path: Any, value: np.ndarray, index: Index, full_shape: tuple[int, ...], dtype: Any) -> None:
    """Puts one checkpoint tensor into the host parameter tree: a copy at `path`, or (`index`
    given: a layer, or (layer, expert)) that slice of the stacked array there, allocated (zeros:
    slots no tensor fills, such as a mixed model's unused feed-forward, stay 0) at its first."""
    if index is None:
        _set(host, path, np.array(value, dtype=dtype))  # a copy, not a view of a mapped file
        return
    if not _has(host, path):
        _set(host, path, np.zeros(full_shape, dtype))
    _get(host, path)[index] = value


def _index_depth(index: Index) -> int:
    """How many leading axes of the stacked array `index` picks (0, 1 or 2)."""
    return 0 if index is None else 1 if isinstance(index, int) else len(index)


def _has(tree: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ------------------------------------------------------------------------------ public API
def load_hf(
    path: str | os.PathLike, dtype: Any = None, *, compute_dtype: Any = None
) -> tuple[ModelConfig, Params]:
    """Loads a HF Llama/Qwen2/Qwen3/Qwen3-MoE/Gemma 3 (text) checkpoint directory -> (config, params).

    `dtype` (e.g. "bfloat16") sets how the parameters are stored AND, unless `compute_dtype` is
    given, the dtype the matmuls run in; by default both are the dtype the checkpoint stores its
    embedding in (bfloat16 for most released checkpoints). `compute_dtype` sets only the compute
    dtype. Training needs float32 storage (AdamW updates of bfloat16 weights mostly round away,
    and `jmarl.train.step.init_train_state` refuses them): load with
    `load_hf(path, "float32", compute_dtype="bfloat16")`, or `load_hf(path, "float32")` then
    `config.replace(compute_dtype="bfloat16")`. bfloat16 storage suits inference and a frozen
    LoRA base.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise JmarlError(f"checkpoint directory not found: {path}")
    config = config_from_hf(path)
    tensors = _checkpoint_tensors(path)
    if config.is_moe:
        tensors = _unfused_experts(tensors)
    if config.is_gemma3 and "model.embed_tokens.weight" not in tensors and any("language_model" in n for n in tensors):
        raise JmarlError(
            f"{path} is a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration); jmarl loads the "
            "text-only gemma3_text layout: save its language model as a Gemma3ForCausalLM checkpoint first"
        )
    embed = tensors.get("model.embed_tokens.weight")
    if dtype is None:
        dtype = embed.dtype if embed is not None else np.float32
    dtype_name = np.dtype(dtype).name
    compute_name = dtype_name if compute_dtype is None else np.dtype(compute_dtype).name
    config = config.replace(param_dtype=dtype_name, compute_dtype=compute_name)
    shapes = param_shapes(config)
    target = np.dtype(dtype)
    host: dict = {}
    for path_, name, transposed, index in _tensor_specs(config):
        full_shape = _get(shapes, path_).shape
        shape = full_shape[_index_depth(index):]
        hf_shape = tuple(reversed(shape)) if transposed else tuple(shape)
        if name not in tensors:
            raise JmarlError(f"checkpoint {path} is missing tensor {name} (expected shape {list(hf_shape)})")
        src = tensors[name]
        if tuple(src.shape) != hf_shape:
            raise JmarlError(
                f"tensor {name} in {path} has shape {list(src.shape)}, expected {list(hf_shape)} "
                "for this config.json"
            )
        place(host, path_, src.T if transposed else src, index, full_shape, target)
    params = jax.tree.map(jnp.asarray, host)
    return config, params


def save_hf(path: str | os.PathLike, config: ModelConfig, params: Params) -> None:
    """Writes config.json + model.safetensors that `transformers.AutoModelForCausalLM` loads."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    host = jax.tree.map(np.asarray, jax.device_get(params))
    tensors: dict[str, np.ndarray] = {}
    dtype = np.dtype(_get(host, ("embed", "embedding")).dtype)
    for path_, name, transposed, index in _tensor_specs(config):
        value = _get(host, path_)
        value = value if index is None else value[index]
        tensors[name] = np.ascontiguousarray(value.T if transposed else value)
    hf = config_to_hf(config)
    hf["torch_dtype"] = hf["dtype"] = dtype.name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
