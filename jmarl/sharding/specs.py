"""PartitionSpecs of the arrays a run places: parameters (plain, stacked [P, ...], LoRA adapters
as {'a', 'b'} dicts or attached `LoraKernel`s), optimizer states, batches, KV caches, and the
micro-batch constraint, each from the logical axes the model declares and one `ShardingRules`.

A leaf whose trailing dict-key path is a parameter path gets that parameter's declared axes
(`jmarl.models.model.param_axes`; a LoRA factor `{kernel}/a`, `{kernel}/b` those of
`lora_axes`). A leaf with one axis more than declared carries a leading stacked policy axis
("policy"); a LoRA base held once beside stacked adapters has none. Optimizer-state leaves are
matched by the same trailing path (optax states mirror the parameter tree), so
`adam.mu['layers']['attn']['q_proj']['kernel']` is sharded like the kernel.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl.sharding.mesh import axis_sizes
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules

Params = Any
Axes = tuple[str | None, ...]
_LORA_FACTORS = ("a", "b")  # a LoRA adapter {kernel}/a [in, r], {kernel}/b [r, out] (`lora_axes`)
_LORA_KERNEL_FIELDS = ("w",) + _LORA_FACTORS  # `jmarl.models.model.LoraKernel`'s array fields


# ---------------------------------------------------------------------------------- parameter trees
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
def _declared_axes(config: Any) -> dict[tuple[str, ...], tuple[str, ...]]:
    """Parameter path -> its declared logical axes (unstacked), for `config`'s model."""
    from jmarl.models.model import is_axes, param_axes

    flat = jax.tree_util.tree_flatten_with_path(param_axes(config), is_leaf=is_axes)[0]
    return {_dict_names(path): axes for path, axes in flat}


def _leaf_axes(names: tuple[str, ...], declared: Mapping[tuple[str, ...], tuple[str, ...]]) -> tuple[str, ...] | None:
    """The declared axes of the parameter (or its LoRA factor 'a'/'b') that the dict-key path
    `names` ends with, or None for a leaf that is no parameter (a step counter)."""
    from jmarl.models.model import lora_axes

    factor = names[-1] if names and names[-1] in _LORA_FACTORS else None
    base = names[:-1] if factor else names
    for start in range(len(base)):
        axes = declared.get(base[start:])
        if axes is not None:
            return axes if factor is None else lora_axes(axes, factor)
    return None


def _with_policy(axes: tuple[str, ...], ndim: int) -> Axes | None:
    """A parameter's axes for a leaf of `ndim` axes: as declared, "policy" in front of them for
    one axis more (a stacked [P, ...] leaf), None (replicated) for any other shape."""
    if ndim == len(axes):
        return axes
    return ("policy",) + axes if ndim == len(axes) + 1 else None


def tree_specs(
    config: Any,
    tree: Any,
    mesh: Mesh | Mapping[str, int] | None = None,
    *,
    stacked: bool | None = None,
    rules: ShardingRules = DEFAULT_RULES,
) -> Any:
    """PartitionSpecs for any tree holding `config`'s parameters: params, LoRA adapters, a
    `TrainState` (optimizer moments included), stacked on a leading policy axis or not.

    Parameter leaves get their declared axes (see the module docstring). Other leaves (step
    counters, optax counts) are replicated, or sharded on "policy" along their leading axis when
    `stacked` (a vmapped state [P]); `stacked=None` reads that from the parameters (a leading
    axis of the size of the parameters' extra axis). With a mesh (or axis sizes) the specs are
    fitted to it."""
    declared = _declared_axes(config)
    sizes = None if mesh is None else axis_sizes(mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    shapes = [tuple(getattr(leaf, "shape", ())) for _, leaf in flat]
    axes = [_leaf_axes(_dict_names(path), declared) for path, _ in flat]
    per_leaf = [None if a is None else _with_policy(a, len(s)) for a, s in zip(axes, shapes)]
    counter_lead = _counter_lead(stacked, shapes, per_leaf)
    specs = []
    for shape, declared_axes, leaf_axes in zip(shapes, axes, per_leaf):
        if declared_axes is None:  # not a parameter
            leaf_axes = ("policy",) if shape and counter_lead(shape) else ()
        specs.append(rules.spec(leaf_axes or (), shape, sizes))
    return jax.tree_util.tree_unflatten(treedef, specs)


def _counter_lead(
    stacked: bool | None, shapes: Sequence[tuple[int, ...]], per_leaf: Sequence[Axes | None]
) -> Callable[[tuple[int, ...]], bool]:
    """Whether a non-parameter leaf of a shape has a leading policy axis: every one of ndim >= 1
    when `stacked`, none when not; with `stacked` None, those whose leading size is the one
    size of the parameters' stacked axes (the fallback for callers that do not say)."""
    if stacked is not None:
        return lambda shape: bool(stacked)
    sizes = {s[0] for s, a in zip(shapes, per_leaf) if a is not None and a[:1] == ("policy",)}
    num_policies = sizes.pop() if len(sizes) == 1 else None
    return lambda shape: num_policies is not None and shape[0] == num_policies


def param_specs(
    config: Any,
    params: Params,
    mesh: Mesh | Mapping[str, int] | None = None,
    *,
    rules: ShardingRules = DEFAULT_RULES,
) -> Params:
    """PartitionSpec per parameter of `config`'s model (also LoRA adapters, stacked trees)."""
    return tree_specs(config, params, mesh, rules=rules)


# ---------------------------------------------------------------------------------- batches, caches
def batch_spec(
    shape: Sequence[int], mesh: Mesh | Mapping[str, int], *, stacked: bool = False, rules: ShardingRules = DEFAULT_RULES
) -> P:
    """The spec of one batch array [N, ...] (logical axes "batch", then unnamed; [P, N, ...]
    with `stacked`: "policy" in front). Default rules: rows on ("data", "fsdp"), and without a
    policy axis the "policy" devices split rows too."""
    from jmarl.models.model import BATCH_AXES

    return rules.spec((("policy",) if stacked else ()) + BATCH_AXES, shape, axis_sizes(mesh))


def cache_specs(
    cache: Any, mesh: Mesh | Mapping[str, int], *, stacked: bool = False, rules: ShardingRules = DEFAULT_RULES
) -> Any:
    """Specs of a `KVCache` (keys [(P,) B, KV, hd, C], values [(P,) B, KV, C, hd]; its declared
    `cache_axes`). Default rules: rows like the batch, key/value heads on "tensor", a leading
    policy axis on "policy" when `stacked`."""
    from jmarl.models.model import cache_axes, is_axes

    sizes = axis_sizes(mesh)
    axes = jax.tree.leaves(cache_axes(cache, stacked=stacked), is_leaf=is_axes)
    leaves, treedef = jax.tree.flatten(cache)
    return jax.tree.unflatten(treedef, [rules.spec(a, x.shape, sizes) for a, x in zip(axes, leaves)])


def microbatch_rows(mesh: Mesh, *, stacked: bool, rules: ShardingRules = DEFAULT_RULES) -> Callable[[Any], Any]:
    """A constraint for a batch split into micro-batches, leaves [M, A, rows, ...] (logical axes
    None, None, "batch"): each micro-batch's rows spread over the batch's mesh axes. With
    `stacked` the policy axis is vmapped away (sharded on "policy" by vmap's spmd_axis_name), so
    the rows do not take it. Without it, rows sharded as one [N] axis of contiguous blocks leave
    each micro-batch on a few devices, which then hold a whole micro-batch's activations."""
    from jmarl.models.model import BATCH_AXES

    sizes = axis_sizes(mesh)

    def constrain(x: jax.Array) -> jax.Array:
        spec = rules.spec((None, None) + BATCH_AXES, x.shape, sizes, stacked=stacked)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return lambda tree: jax.tree.map(constrain, tree)


def row_axes(mesh: Mesh | None, *, stacked: bool, rules: ShardingRules = DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes of size > 1 that split a batch's rows (the logical "batch" axis; unstacked:
    with the spare policy axis too): () without a mesh."""
    from jmarl.models.model import BATCH_AXES

    if mesh is None:
        return ()
    sizes = axis_sizes(mesh)
    return tuple(a for a in rules.mesh_axes(BATCH_AXES[0], stacked=stacked) if sizes.get(a, 1) > 1)


def policy_axis(mesh: Mesh | None, rules: ShardingRules = DEFAULT_RULES) -> str | tuple[str, ...] | None:
    """The mesh axes that shard a stacked policy axis (for vmap's spmd_axis_name): default
    'policy' when the mesh's policy axis is > 1, else None."""
    if mesh is None:
        return None
    sizes = axis_sizes(mesh)
    axes = tuple(a for a in rules.mesh_axes("policy") if sizes.get(a, 1) > 1)
    return None if not axes else axes[0] if len(axes) == 1 else axes
