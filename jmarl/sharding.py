"""Sharding: device meshes, partition rules, sharded updates and sampling, multi-host.

JAX is the distributed engine: a `jax.sharding.Mesh` with four named axes, `PartitionSpec`s
derived from parameter paths, `jax.jit` with in/out shardings, and `jax.distributed` across
hosts. The same code runs on one CPU, 8 simulated CPU devices, a GPU host or a TPU pod slice.

Mesh axes (device-grid order, `tensor` innermost so it lands on the fastest links):

    data    batch rows (pure data parallelism: parameters replicated)
    policy  the stacked per-agent policy axis [P, ...] (per-agent policies / LoRA adapters)
    fsdp    batch rows AND parameter/gradient/optimizer-state shards (ZeRO-3 style)
    tensor  attention heads / MLP hidden units / vocabulary (Megatron-style tensor parallelism)

Partition rules (for the trailing axes of each parameter; leading axes such as the stacked
layer axis L are not sharded, a stacked policy axis P is sharded on `policy`):

    embed/embedding [V, D]               (tensor, fsdp)
    attn/{q,k,v}_proj/kernel [D, H]      (fsdp, tensor)     bias [H] (tensor)
    attn/o_proj/kernel [H, D]            (tensor, fsdp)     bias [D] replicated
    mlp/{gate,up}_proj/kernel [D, F]     (fsdp, tensor)
    mlp/down_proj/kernel [F, D]          (tensor, fsdp)
    lm_head/kernel [D, V]                (fsdp, tensor)
    */scale (RMSNorm, q/k norms)         replicated
    LoRA {kernel}/a [in, r], {kernel}/b [r, out]: a keeps the kernel's `in` axis, b its `out` axis
    (adapters as trained, {'a', 'b'} dicts, or attached: a `LoraKernel`'s w is placed like the
    kernel, its a and b like those; a base held once beside stacked adapters has no policy axis)

An axis that does not divide a dimension is dropped for that dimension (the array is then
replicated along it), so every spec is valid for every model size and mesh. Optimizer state
leaves are matched to parameters by the trailing dict-key path (optax states mirror the
parameter tree), so `adam.mu['layers']['attn']['q_proj']['kernel']` is sharded like the kernel.

    mesh = make_mesh(fsdp=4, tensor=2)
    params = shard_params(config, params, mesh)        # a notebook shards a model in two lines

Memory: `python -m jmarl.plan --config X.yaml --devices 8 --device-memory 80GiB` compiles the run's
own programs for a mesh and reports XLA's per-device figures (`jmarl.plan`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl.errors import JmarlError

log = logging.getLogger(__name__)

Params = Any
MESH_AXES: tuple[str, ...] = ("data", "policy", "fsdp", "tensor")
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")

# trailing-axis rules keyed by (module name, parameter name); None = not sharded
_IN_OUT = ("fsdp", "tensor")  # kernels [D, X]: input on fsdp, output on tensor
_OUT_IN = ("tensor", "fsdp")  # kernels [X, D]
_RULES: dict[tuple[str, str], tuple[Any, ...]] = {
    ("embed", "embedding"): ("tensor", "fsdp"),
    ("lm_head", "kernel"): _IN_OUT,
    **{(m, "kernel"): _IN_OUT for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")},
    **{(m, "kernel"): _OUT_IN for m in ("o_proj", "down_proj")},
    **{(m, "bias"): ("tensor",) for m in ("q_proj", "k_proj", "v_proj")},
    ("o_proj", "bias"): (None,),
}
_LORA_LEAVES = ("a", "b")
_LORA_KERNEL_FIELDS = ("w",) + _LORA_LEAVES  # `jmarl.models.model.LoraKernel`'s array fields


# ---------------------------------------------------------------------------------- meshes
def make_mesh(
    data: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    policy: int = 1,
    *,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """A `Mesh` with axes ("data", "policy", "fsdp", "tensor") of the given sizes.

    One axis may be -1: it takes all devices the other axes leave (`data=-1`: pure data
    parallelism over whatever is left, `fsdp=-1`: parameters sharded over it). The product may
    be smaller than the number of devices (the first devices are used), never larger. `devices`
    defaults to `jax.devices()` (all processes' devices in a multi-host run). Axes are `Auto`,
    so code without sharding annotations runs unchanged and XLA propagates the input shardings.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": int(data), "fsdp": int(fsdp), "tensor": int(tensor), "policy": int(policy)}
    for name, size in sizes.items():
        if size < 1 and size != -1:
            raise JmarlError(f"mesh.{name} must be >= 1 (or -1: all remaining devices), got {size}")
    filled = [name for name, size in sizes.items() if size == -1]
    if len(filled) > 1:
        raise JmarlError(f"mesh: only one axis may be -1 (all remaining devices), got {', '.join(filled)}")
    if filled:
        others = math.prod(size for name, size in sizes.items() if name != filled[0])
        if len(devices) % others:
            raise JmarlError(
                f"mesh.{filled[0]}=-1: {len(devices)} devices do not split into the other axes' product {others}; "
                "choose axis sizes whose product divides the device count"
            )
        sizes[filled[0]] = len(devices) // others
    rest = sizes["fsdp"] * sizes["tensor"] * sizes["policy"]
    total = sizes["data"] * rest
    if total > len(devices):
        raise JmarlError(
            f"the mesh {format_mesh(sizes)} needs {total} devices but only {len(devices)} are available; "
            "lower mesh.* (an axis of -1 uses whatever the other axes leave)"
        )
    grid = np.asarray(devices[:total], dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def mesh_from_config(mesh_cfg: Any, *, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh of a `jmarl.config.MeshConfig` (the `mesh:` section of a run config)."""
    return make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor, mesh_cfg.policy, devices=devices)


def axis_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    """Axis name -> size for a mesh (or a dict of sizes, as the memory planner uses)."""
    if isinstance(mesh, Mesh):
        return dict(mesh.shape)
    return {a: int(mesh.get(a, 1)) for a in MESH_AXES}


def format_mesh(sizes: Mapping[str, int]) -> str:
    """'data=2,fsdp=4' (axes of size 1 left out; '1 device' when all are)."""
    text = ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if sizes.get(a, 1) != 1)
    return text or "1 device"


def parse_mesh(text: str) -> dict[str, int]:
    """'fsdp=4,tensor=2' -> {'data': 1, 'policy': 1, 'fsdp': 4, 'tensor': 2}."""
    sizes = {a: 1 for a in MESH_AXES}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or not value.lstrip("-").isdigit():
            raise JmarlError(f"mesh {text!r}: expected axis=size pairs over {', '.join(MESH_AXES)}, e.g. fsdp=4,tensor=2")
        sizes[name] = int(value)
    return sizes


# ---------------------------------------------------------------------------------- partition rules
def _dict_names(path: tuple) -> tuple[str, ...]:
    """The trailing run of dict keys of a pytree path (optax/TrainState wrappers stripped). A
    path that ends in a field of an attached LoRA kernel (`LoraKernel` in the kernel's slot)
    reads as the kernel's own path for w and as the adapter's ({kernel}/a, {kernel}/b) for a, b."""
    names: list[str] = []
    field = _lora_kernel_field(path)
    if field is not None:
        path = path[:-1]
        names = [] if field == "w" else [field]
    for key in reversed(path):
        if not isinstance(key, jax.tree_util.DictKey):
            break
        names.append(str(key.key))
    return tuple(reversed(names))


def _lora_kernel_field(path: tuple) -> str | None:
    """'w', 'a' or 'b' when `path` ends in that field of a `LoraKernel` held under a dict key
    (an attached adapter in a kernel's slot), else None."""
    if len(path) < 2 or not isinstance(path[-2], jax.tree_util.DictKey):
        return None
    last = path[-1]
    return last.name if isinstance(last, jax.tree_util.GetAttrKey) and last.name in _LORA_KERNEL_FIELDS else None


@functools.lru_cache(maxsize=32)
def _model_ndims(config: Any) -> dict[tuple[str, ...], int]:
    """Parameter path -> number of axes of the unstacked parameter, for `config`'s model."""
    from jmarl.models import param_shapes

    flat = jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]
    return {_dict_names(path): len(leaf.shape) for path, leaf in flat}


def _match(names: tuple[str, ...], ndims: Mapping[tuple[str, ...], int]) -> tuple[tuple[str, ...], str | None] | None:
    """(parameter path, LoRA leaf 'a'/'b' or None) that `names` ends with, or None."""
    lora = names[-1] if names and names[-1] in _LORA_LEAVES else None
    base = names[:-1] if lora else names
    for start in range(len(base)):
        if base[start:] in ndims:
            return base[start:], lora
    return None


def _trailing_rule(param_path: tuple[str, ...], lora: str | None) -> tuple[Any, ...]:
    """The mesh axes of the trailing dims of a parameter (or of its LoRA factor)."""
    rule = _RULES.get(param_path[-2:]) if len(param_path) >= 2 else None
    if rule is None:
        return ()  # norms (scale) and anything unknown: replicated
    if lora == "a":  # [in, rank]
        return (rule[0], None)
    if lora == "b":  # [rank, out]
        return (None, rule[-1])
    return rule


def _fit(entries: Sequence[Any], shape: Sequence[int], sizes: Mapping[str, int] | None) -> P:
    """A PartitionSpec for `shape` from per-dim axis entries (None, 'axis' or a tuple of axes).

    With `sizes`, axes of size 1 are dropped and so are axes whose product would not divide
    the dimension (last axis first), so the spec is valid on that mesh."""
    out = []
    for entry, dim in zip(entries, shape):
        axes = [] if entry is None else ([entry] if isinstance(entry, str) else list(entry))
        if sizes is not None:
            axes = [a for a in axes if sizes.get(a, 1) > 1]
            while axes and dim % math.prod(sizes[a] for a in axes):
                axes.pop()
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def tree_specs(config: Any, tree: Any, mesh: Mesh | Mapping[str, int] | None = None) -> Any:
    """PartitionSpecs for any tree holding `config`'s parameters: params, LoRA adapters, a
    `TrainState` (optimizer moments included), stacked on a leading policy axis or not.

    A leaf whose trailing dict-key path is a parameter path gets that parameter's rule; one
    axis more than the parameter means a leading policy axis ("policy"). Other leaves (step
    counters, optax counts) are replicated, or sharded on "policy" along a leading axis of the
    stacked size. With a mesh (or axis sizes) the specs are fitted to it (see `_fit`)."""
    ndims = _model_ndims(config)
    sizes = None if mesh is None else axis_sizes(mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    matches = [_match(_dict_names(path), ndims) for path, _ in flat]
    stacked_sizes = {
        leaf.shape[0]
        for (_, leaf), m in zip(flat, matches)
        if m is not None and len(leaf.shape) == ndims[m[0]] + 1
    }
    num_policies = stacked_sizes.pop() if len(stacked_sizes) == 1 else None
    specs = []
    for (_, leaf), m in zip(flat, matches):
        shape = tuple(getattr(leaf, "shape", ()))
        if m is None:
            lead = ("policy",) if num_policies is not None and shape[:1] == (num_policies,) else ()
            specs.append(_fit(lead, shape, sizes))
            continue
        expected = ndims[m[0]]
        if len(shape) not in (expected, expected + 1):
            specs.append(P())  # an unexpected shape: replicate rather than guess
            continue
        rule = _trailing_rule(*m)
        lead = (None,) * (len(shape) - len(rule))
        if len(shape) == expected + 1:
            lead = ("policy",) + lead[1:]
        specs.append(_fit(lead + rule, shape, sizes))
    return jax.tree_util.tree_unflatten(treedef, specs)


def param_specs(config: Any, params: Params, mesh: Mesh | Mapping[str, int] | None = None) -> Params:
    """PartitionSpec per parameter of `config`'s model (also LoRA adapters, stacked trees)."""
    return tree_specs(config, params, mesh)


def batch_spec(shape: Sequence[int], mesh: Mesh | Mapping[str, int], *, stacked: bool = False) -> P:
    """The spec of one batch array: rows on ("data", "fsdp"); [P, N, ...] with `stacked`
    (policy axis on "policy"). Without a policy axis, "policy" devices split rows too."""
    if stacked:
        return _fit(("policy", BATCH_AXES), shape, axis_sizes(mesh))
    return _fit((BATCH_AXES + ("policy",),), shape, axis_sizes(mesh))


def cache_specs(cache: Any, mesh: Mesh | Mapping[str, int], *, stacked: bool = False) -> Any:
    """Specs of a `KVCache` (keys [.., B, KV, hd, C], values [.., B, KV, C, hd]): rows like the
    batch, key/value heads on "tensor", a leading policy axis on "policy" when `stacked`."""
    sizes = axis_sizes(mesh)
    rows = ("policy", BATCH_AXES) if stacked else (BATCH_AXES + ("policy",),)
    return jax.tree.map(lambda x: _fit(rows + ("tensor",), x.shape, sizes), cache)


def microbatch_rows(mesh: Mesh, *, stacked: bool) -> Callable[[Any], Any]:
    """A constraint for a batch split into micro-batches, leaves [M, A, rows, ...]: each
    micro-batch's rows spread over the batch axes (data, fsdp; and policy unless the policies are
    stacked, where a vmapped policy axis is sharded on "policy"). Without it, rows sharded as one
    [N] axis of contiguous blocks leave each micro-batch on a few devices, which then hold a
    whole micro-batch's activations."""
    sizes = axis_sizes(mesh)
    axes = BATCH_AXES if stacked else BATCH_AXES + ("policy",)

    def constrain(x: jax.Array) -> jax.Array:
        spec = _fit((None, None, axes), x.shape, sizes)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return lambda tree: jax.tree.map(constrain, tree)


def policy_axis(mesh: Mesh | None) -> str | None:
    """'policy' when the mesh shards stacked policies (its policy axis > 1), else None."""
    return "policy" if mesh is not None and axis_sizes(mesh).get("policy", 1) > 1 else None


# ---------------------------------------------------------------------------------- placing arrays
def shardings(mesh: Mesh, specs: Any) -> Any:
    """NamedSharding per PartitionSpec of a spec tree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def put(tree: Any, sharding_tree: Any) -> Any:
    """Places every leaf with its sharding. In a multi-host run a host (numpy or local) value
    must be the same on every process; each process then fills its own shards from it. A
    `jax.ShapeDtypeStruct` leaf (an abstract state, as `jmarl.plan` builds) gets the sharding
    attached instead: nothing is allocated."""

    def place(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, tree, sharding_tree)


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of `tree` (arrays or `jax.ShapeDtypeStruct`s): each leaf counted
    by its shard shape under its sharding (the whole array without one: a single device). The
    partition rules shard evenly, so every device of a leaf's mesh holds the same. A leaf object
    that occurs several times (a LoRA base that is also the reference) is counted once."""
    total, seen = 0, set()
    for leaf in jax.tree.leaves(tree):
        if id(leaf) in seen or not hasattr(leaf, "shape"):
            continue
        seen.add(id(leaf))
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize  # also typed PRNG keys
    return total


def shard_params(config: Any, params: Params, mesh: Mesh) -> Params:
    """`params` (or LoRA adapters, stacked or not) placed on `mesh` by the partition rules."""
    return put(params, shardings(mesh, param_specs(config, params, mesh)))


def train_state_shardings(config: Any, state: Any, mesh: Mesh) -> Any:
    """NamedShardings of a `TrainState` (optimizer state sharded like its parameters)."""
    return shardings(mesh, tree_specs(config, state, mesh))


def shard_train_state(config: Any, state: Any, mesh: Mesh) -> Any:
    """A `TrainState` placed on `mesh`: params, optimizer moments, counters."""
    return put(state, train_state_shardings(config, state, mesh))


def batch_shardings(batch: Any, mesh: Mesh, *, stacked: bool = False) -> Any:
    """NamedSharding per batch array (see `batch_spec`)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(np.shape(x), mesh, stacked=stacked)), batch)


def shard_batch(batch: Any, mesh: Mesh, *, stacked: bool = False) -> Any:
    """A dict of [N, ...] (or [P, N, ...] with `stacked`) arrays placed with rows on data/fsdp."""
    return put(batch, batch_shardings(batch, mesh, stacked=stacked))


def to_host(tree: Any) -> Any:
    """Numpy copies of every leaf, gathering the shards of other processes when needed."""
    from jax.experimental import multihost_utils

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(fetch, tree)


# ---------------------------------------------------------------------------------- sharded calls
def mesh_of(tree: Any) -> Mesh | None:
    """The mesh of the first leaf of `tree` (arrays or ShapeDtypeStructs) with a NamedSharding."""
    for leaf in jax.tree.leaves(tree):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding):
            return sh.mesh
    return None


def mesh_context(mesh: Mesh | None) -> Any:
    """`jax.set_mesh(mesh)` for a mesh of several devices (programs traced inside see it: see
    `jmarl.models.model.batch_sharded`), else a no-op context."""
    import contextlib

    if mesh is None or mesh.size == 1:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


class ShardedFn:
    """A jitted function whose arguments are placed on the mesh before each call.

    `arg_shardings(*args)` gives, per argument, a sharding tree (or None: keep the argument's
    own placement); `__call__` places the arguments with them (a no-op for arrays already
    there, so host numpy batches work) and calls `jitted`. `jmarl.plan` lowers `jitted` with
    abstract arguments that carry these same shardings, so the planned program is the one the
    run executes.
    """

    def __init__(self, jitted: Callable, shardings_of: Callable[..., tuple]):
        self.jitted = jitted
        self._shardings_of = shardings_of

    def arg_shardings(self, *args: Any) -> tuple:
        """One sharding tree (or None) per argument of a call with `args`."""
        return self._shardings_of(*args)

    def __call__(self, *args: Any) -> Any:
        shardings_ = self.arg_shardings(*args)
        placed = tuple(a if sh is None or a is None else put(a, sh) for a, sh in zip(args, shardings_))
        with mesh_context(mesh_of(shardings_)):
            return self.jitted(*placed)


def sharded_jit(
    fn: Callable,
    mesh: Mesh,
    fixed: Sequence[Any],
    *,
    batch_argnums: Sequence[int] = (),
    stacked: bool = False,
    out_shardings: Any = None,
    donate_argnums: Sequence[int] = (),
    compiler_options: Mapping[str, Any] | None = None,
) -> ShardedFn:
    """`fn` jitted on `mesh`: argument i is placed with `fixed[i]` (a sharding tree, or None to
    keep its placement), except the arguments in `batch_argnums`, whose arrays ([N, ...], or
    [P, N, ...] with `stacked`) get their rows on data/fsdp (`batch_shardings`) from each
    call's shapes. out_shardings None: XLA propagates them from the inputs."""
    batch_argnums = tuple(batch_argnums)
    kwargs: dict[str, Any] = dict(
        in_shardings=tuple(None if i in batch_argnums else sh for i, sh in enumerate(fixed)),
        donate_argnums=tuple(donate_argnums),
        compiler_options=None if compiler_options is None else dict(compiler_options),
    )
    if out_shardings is not None:
        kwargs["out_shardings"] = out_shardings
    jitted = jax.jit(fn, **kwargs)

    def shardings_of(*args):
        return tuple(
            (None if a is None else batch_shardings(a, mesh, stacked=stacked)) if i in batch_argnums else fixed[i]
            for i, a in enumerate(args)
        )

    return ShardedFn(jitted, shardings_of)


def sharded_update(
    update_fn: Callable,
    mesh: Mesh,
    state_shardings: Any,
    batch_shardings_: Any = None,
    *,
    frozen_shardings: Any = None,
    stacked: bool = False,
    vmap_policies: bool = False,
    frozen_stacked: bool = False,
    donate: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
) -> ShardedFn:
    """`update(state, frozen, batch) -> (state, metrics)` jitted with in/out shardings on `mesh`.

    update_fn: from `jmarl.train.step.make_update` (per policy; `vmap_policies=True` vmaps it
    over a stacked policy axis like `jit_update` does), or an already vmapped/jitted update.
    state_shardings: `train_state_shardings(...)`; the new state comes out with the same ones
    and the old state is donated. batch_shardings_: a sharding tree/prefix for the batch, or
    None to derive them from each batch's shapes (`batch_shardings`, `stacked` says whether
    batch arrays carry a leading policy axis). frozen_shardings: for the frozen tree (the LoRA
    base), None to keep its placement. Inputs are placed before the call (a no-op when they
    already are), so host numpy batches work. Metrics come back replicated. compiler_options
    go to `jax.jit` (XLA options such as {"xla_backend_optimization_level": 0}).
    """
    fn = update_fn
    if vmap_policies:
        fn = jax.vmap(update_fn, in_axes=(0, 0 if frozen_stacked else None, 0))
    replicated = NamedSharding(mesh, P())
    return sharded_jit(
        fn, mesh, (state_shardings, frozen_shardings, batch_shardings_),
        batch_argnums=(2,) if batch_shardings_ is None else (), stacked=stacked,
        out_shardings=(state_shardings, replicated), donate_argnums=(0,) if donate else (),
        compiler_options=compiler_options,
    )


def shard_trainer(trainer: Any) -> Mesh:
    """Puts a `jmarl.train.trainer.Trainer` on the mesh of its config: every policy group's
    train state, LoRA base and reference parameters are sharded by the partition rules, and its
    device functions run through `ShardedFn`s: the RL and warm-start updates (`sharded_update`,
    state donated) and the scoring passes, with batch rows on data/fsdp. A one-device mesh (the
    default config) changes nothing. An abstract trainer (`Trainer(config, abstract=True)`,
    `jax.ShapeDtypeStruct` states) gets the shardings attached instead. Returns the mesh."""
    mesh = mesh_from_config(trainer.config.mesh)
    if mesh.size == 1:
        return mesh
    for group, fns in zip(trainer.policies.groups, trainer.fns):
        config = group.model_config
        ref_is_base = group.ref is not None and group.ref is group.base  # LoRA: the base is the reference
        group.state = shard_train_state(config, group.state, mesh)
        state_sh = train_state_shardings(config, group.state, mesh)
        frozen_sh = None
        if group.base is not None:
            frozen_sh = shardings(mesh, param_specs(config, group.base, mesh))
            group.base = put(group.base, frozen_sh)
        ref_sh = None
        if group.ref is not None:
            ref_sh = shardings(mesh, param_specs(config, group.ref, mesh))
            group.ref = group.base if ref_is_base else put(group.ref, ref_sh)
        stacked = group.stacked
        fns.update = sharded_update(fns.update, mesh, state_sh, frozen_shardings=frozen_sh, stacked=stacked)
        fns.sft_update = sharded_update(fns.sft_update, mesh, state_sh, frozen_shardings=frozen_sh, stacked=stacked)
        fns.score = sharded_jit(fns.score, mesh, (state_sh.params, frozen_sh, None), batch_argnums=(2,), stacked=stacked)
        fns.score_ref = sharded_jit(fns.score_ref, mesh, (ref_sh, None), batch_argnums=(1,), stacked=stacked)
    log.info("sharded the policies over the mesh %s", format_mesh(axis_sizes(mesh)))
    return mesh


# ---------------------------------------------------------------------------------- sharded sampling
def generate(
    config: Any,
    params: Params,
    prompt_tokens: Any,
    prompt_mask: Any,
    rng: jax.Array,
    mesh: Mesh,
    *,
    stacked: bool = False,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
) -> Any:
    """`jmarl.models.generate` (or `generate_stacked` with `stacked`) on `mesh`: parameters
    sharded by the partition rules, prompt rows and the KV cache sharded on data/fsdp (cache
    heads on tensor, policies on policy). prompt_tokens/mask [B, S] ([P, B, S] stacked) ->
    `Generation` with [(P,) B, max_new_tokens] fields, the same tokens as unsharded."""
    from jmarl.models import model as model_lib
    from jmarl.models import sampler
    from jmarl.rollouts import DEFAULT_LENGTH_BUCKETS, bucket_length

    sampler._check_options(max_new_tokens, temperature, top_p, top_k)
    tokens = np.asarray(prompt_tokens)
    mask = np.asarray(prompt_mask).astype(bool)
    if tokens.ndim != (3 if stacked else 2) or tokens.shape != mask.shape:
        raise JmarlError(f"prompt_tokens/prompt_mask must be {'[P, B, S]' if stacked else '[B, S]'}; got {tokens.shape}, {mask.shape}")
    length = bucket_length(max(int(mask.sum(axis=-1).max(initial=0)), 1), DEFAULT_LENGTH_BUCKETS)
    tokens, mask = sampler.left_align(tokens, mask, length, pad_id)
    greedy = float(temperature) == 0.0
    program = sampler._program(
        config, stacked, int(max_new_tokens), greedy, int(top_k), float(top_p) < 1.0,
        tuple(int(t) for t in stop_tokens), int(pad_id),
    )
    params = shard_params(config, params, mesh)
    prompts = shard_batch({"tokens": tokens, "mask": mask}, mesh, stacked=stacked)
    capacity = length + int(max_new_tokens) - 1
    abstract = jax.eval_shape(lambda: model_lib.empty_cache(config, tokens.shape[:-1], capacity))
    cache_sh = shardings(mesh, cache_specs(abstract, mesh, stacked=stacked))
    cache = jax.jit(lambda: model_lib.empty_cache(config, tokens.shape[:-1], capacity), out_shardings=cache_sh)()
    temp = jnp.float32(1.0 if greedy else temperature)
    generation, _ = program(params, cache, prompts["tokens"], prompts["mask"], None, rng, temp, jnp.float32(top_p))
    return generation


# ---------------------------------------------------------------------------------- multi-host
def _cluster_in_environment() -> str | None:
    """The name of the multi-process launcher found in the environment, or None."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "TPU pod"
    return None


def maybe_initialize_distributed(cfg: Any) -> bool:
    """Calls `jax.distributed.initialize` as the config's `distributed:` section says; must run
    before anything touches devices (`jmarl.run` calls it first). Returns True when this is
    (now) a multi-process run. Accepts a `Config` or its `DistributedConfig`.

    initialize 'auto' (default): only when `coordinator_address` is set or the environment
    names a cluster (JAX_COORDINATOR_ADDRESS, SLURM with several tasks, Open MPI, a multi-host
    TPU slice). 'always': unconditionally (JAX detects TPU pods / SLURM itself). 'never': no.
    """
    dist = getattr(cfg, "distributed", cfg)
    if jax.distributed.is_initialized():
        return True
    mode = getattr(dist, "initialize", "auto")
    address = getattr(dist, "coordinator_address", None)
    if mode == "never":
        return False
    found = _cluster_in_environment()
    if mode == "auto" and address is None and found is None:
        return False
    kwargs = {
        k: v
        for k, v in (
            ("coordinator_address", address),
            ("num_processes", getattr(dist, "num_processes", None)),
            ("process_id", getattr(dist, "process_id", None)),
        )
        if v is not None
    }
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:
        raise JmarlError(
            f"jax.distributed.initialize({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed "
            f"({found or 'config'}): {str(e).splitlines()[0] if str(e) else type(e).__name__}; check "
            "distributed.coordinator_address / num_processes / process_id"
        ) from e
    log.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return True
