"""Sharding: device meshes, logical axes mapped to mesh axes by one rules object, placing trees,
sharded updates, multi-host start-up.

JAX is the distributed engine: a `jax.sharding.Mesh` with four named axes, `PartitionSpec`s
from the logical axes the model declares, `jax.jit` with in/out shardings, and
`jax.distributed` across hosts. The same code runs on one CPU, 8 simulated CPU devices, a GPU
host or a TPU pod slice.

Mesh axes (device-grid order, `tensor` innermost so it lands on the fastest links):

    data    batch rows (pure data parallelism: parameters replicated)
    policy  the stacked per-agent policy axis [P, ...] (per-agent policies / LoRA adapters)
    fsdp    batch rows AND parameter/gradient/optimizer-state shards (ZeRO-3 style)
    tensor  attention heads / MLP hidden units / vocabulary (Megatron-style tensor parallelism)

Sharding is declared once. The model names the axes of every array it defines
(`jmarl.models.model.param_axes`: embedding ("vocab", "embed"), q/k/v kernels ("embed",
"q_heads"/"kv_heads"), o_proj ("q_heads", "embed"), gate/up ("embed", "mlp"), down ("mlp",
"embed"), lm_head ("embed", "vocab"), norms ("norm",), the stacked layer axis "layers";
`cache_axes`: the KV cache ("batch", "kv_heads", "head_dim", "cache_len"); a layer's input rows
"activation_batch"); the callers pass these axis trees in (`param_specs(param_axes(config),
params, mesh)`), so this package never imports `jmarl.models` (the dependency runs one way:
models -> sharding). Its own conventions: batch rows "batch" (`rules.BATCH_AXES`), LoRA factors
with "lora_rank" (`specs.lora_axes`), a stacked policy axis "policy". One `ShardingRules` maps
logical axes to mesh axes; the defaults (`DEFAULT_RULES`, table in `jmarl.sharding.rules`) give
the layout below, and every function that makes specs takes `rules=` for a user's own:

    embed/embedding [V, D]               (tensor, fsdp)
    attn/{q,k,v}_proj/kernel [D, H]      (fsdp, tensor)     bias [H] (tensor)
    attn/o_proj/kernel [H, D]            (tensor, fsdp)     bias [D] replicated
    mlp/{gate,up}_proj/kernel [D, F]     (fsdp, tensor)
    mlp/down_proj/kernel [F, D]          (tensor, fsdp)
    moe/experts/{gate,up}_proj [E, D, Fe] (fsdp, -, tensor)  down_proj [E, Fe, D] (fsdp, tensor, -):
                                         whole experts over fsdp (expert parallelism: the layer
                                         sends tokens to them, `jmarl.models.moe.expert_parallel_ffn`)
    moe/router/kernel [D, E]             (fsdp, -): a mesh axis shards one dimension at most
    lm_head/kernel [D, V]                (fsdp, tensor)
    */scale (RMSNorm, q/k norms)         replicated;  the layer axis L: not sharded
    LoRA {kernel}/a [in, r], {kernel}/b [r, out]: a keeps the kernel's `in` axis, b its `out` axis
    (adapters as trained, {'a', 'b'} dicts, or attached: a `LoraKernel`'s w is placed like the
    kernel, its a and b like those; a base held once beside stacked adapters has no policy axis)
    batch rows [N, ...]                  (data, fsdp) [+ policy when no policy axis is stacked]
    KV cache [B, KV, ...]                rows like the batch, KV heads on tensor

An axis that does not divide a dimension is dropped for that dimension (the array is then
replicated along it), so every spec is valid for every model size and mesh. Optimizer state
leaves are matched to parameters by the trailing dict-key path (optax states mirror the
parameter tree), so `adam.mu['layers']['attn']['q_proj']['kernel']` is sharded like the kernel.

    mesh = make_mesh(fsdp=4, tensor=2)
    params = shard_params(models.param_axes(config), params, mesh)   # a notebook: two lines

Modules, one per concern: `mesh` (meshes), `rules` (`ShardingRules`: logical axes -> specs),
`specs` (specs of parameter / state / batch / cache trees), `placement` (put, shard_*,
device_bytes, to_host), `calls` (`ShardedFn`, `sharded_jit`, `sharded_update`, a policy group's
`GroupShardings` with `group_shardings` / `place_group`, `mesh_context`), `distributed` (multi-host start-up). Sampling on a mesh is the sampler's own:
`jmarl.models.generate(..., GenerationSpec(..., mesh=mesh))` shards the KV cache and prompt rows; place the
parameters with `shard_params` first.

Memory: `python -m jmarl.memory_check --config X.yaml --devices 8 --device-memory 80GiB` compiles the run's
own programs for a mesh and reports XLA's per-device figures (`jmarl.memory_check`).
"""

from jmarl.sharding.calls import (
    GroupShardings,
    ShardedFn,
    group_shardings,
    mesh_context,
    mesh_of,
    place_group,
    sharded_jit,
    sharded_update,
)
from jmarl.sharding.distributed import maybe_initialize_distributed
from jmarl.sharding.mesh import MESH_AXES, axis_sizes, format_mesh, make_mesh, mesh_from_config, parse_mesh
from jmarl.sharding.placement import (
    batch_shardings,
    device_bytes,
    put,
    shard_batch,
    shard_params,
    shard_train_state,
    shardings,
    to_host,
    train_state_shardings,
)
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules, is_axes
from jmarl.sharding.specs import (batch_spec, cache_specs, microbatch_rows, param_specs, policy_axis, row_axes,
                                  tree_specs)

__all__ = [
    "DEFAULT_RULES",
    "GroupShardings",
    "MESH_AXES",
    "ShardedFn",
    "ShardingRules",
    "axis_sizes",
    "batch_shardings",
    "batch_spec",
    "cache_specs",
    "device_bytes",
    "format_mesh",
    "group_shardings",
    "is_axes",
    "make_mesh",
    "maybe_initialize_distributed",
    "mesh_context",
    "mesh_from_config",
    "mesh_of",
    "microbatch_rows",
    "param_specs",
    "parse_mesh",
    "place_group",
    "policy_axis",
    "put",
    "row_axes",
    "shard_batch",
    "shard_params",
    "shard_train_state",
    "sharded_jit",
    "sharded_update",
    "shardings",
    "to_host",
    "train_state_shardings",
    "tree_specs",
]
