"""PartitionSpecs of the arrays a run places: parameters (plain, stacked [P, ...], LoRA adapters
as {'a', 'b'} dicts or attached `LoraKernel`s), optimizer states, batches, KV caches, and the
micro-batch constraint, each from logical axes and one `ShardingRules`.

The axes come in as arguments: the caller passes the tree of logical-axis tuples the model
declares (`param_specs(jmarl.models.param_axes(config), params, mesh)`,
`cache_specs(jmarl.models.model.cache_axes(cache), cache, mesh)`); batch rows are
`rules.BATCH_AXES`. This module, like all of `jmarl.sharding`, does not import the model.

A leaf whose trailing dict-key path is a parameter path gets that parameter's declared axes; a
LoRA factor `{kernel}/a`, `{kernel}/b` those that `lora_axes` derives from the kernel's (the
adapters' tree layout is this module's). A leaf with one axis more than declared carries a
leading stacked policy axis ("policy"); a LoRA base held once beside stacked adapters has none.
Optimizer-state leaves are matched by the same trailing path (optax states mirror the parameter
tree), so `adam.mu['layers']['attn']['q_proj']['kernel']` is sharded like the kernel.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl.sharding.mesh import axis_sizes
from jmarl.sharding.rules import BATCH_AXES, DEFAULT_RULES, ShardingRules, is_axes

Params = Any
Axes = tuple[str | None, ...]
_LORA_FACTORS = ("a", "b")  # a LoRA adapter {kernel}/a [in, r], {kernel}/b [r, out] (`lora_axes`)
_LORA_KERNEL_FIELDS = ("w",) + _LORA_FACTORS  # `jmarl.models.layers.LoraKernel`'s array fields


def lora_axes(kernel_axes: tuple[str, ...], factor: str) -> tuple[str, ...]:
    """The axes of a LoRA factor of a kernel with `kernel_axes` [..., in, out]: "a" [..., in, r]
    keeps the kernel's `in` axis, "b" [..., r, out] its `out` axis; r is "lora_rank". The shape of
    any low-rank factor pair, so it lives with the adapters' tree layout, not in the model."""
    if factor == "a":
        return kernel_axes[:-1] + ("lora_rank",)
    return kernel_axes[:-2] + ("lora_rank", kernel_axes[-1])


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


def _declared_axes(axes: Any) -> dict[tuple[str, ...], tuple[str, ...]]:
    """Parameter path -> its declared logical axes (unstacked), from a tree of axis tuples."""
    flat = jax.tree_util.tree_flatten_with_path(axes, is_leaf=is_axes)[0]
    for path, leaf in flat:
        if not is_axes(leaf):
            raise TypeError(f"axes: a tree of logical-axis tuples (e.g. jmarl.models.param_axes(config)) was "
                            f"expected, got {type(leaf).__name__} at {jax.tree_util.keystr(path) or 'its root'}")
    return {_dict_names(path): leaf for path, leaf in flat}


def _leaf_axes(names: tuple[str, ...], declared: Mapping[tuple[str, ...], tuple[str, ...]]) -> tuple[str, ...] | None:
    """The declared axes of the parameter (or its LoRA factor 'a'/'b') that the dict-key path
    `names` ends with, or None for a leaf that is no parameter (a step counter)."""
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
    axes: Any,
    tree: Any,
    mesh: Mesh | Mapping[str, int] | None = None,
    *,
    stacked: bool | None = None,
    rules: ShardingRules = DEFAULT_RULES,
) -> Any:
    """PartitionSpecs for any tree holding a model's parameters: params, LoRA adapters, a
    `TrainState` (optimizer moments included), stacked on a leading policy axis or not. `axes`:
    the model's declared parameter axes, a tree of logical-axis tuples (unstacked, no LoRA
    factors: `jmarl.models.param_axes(config)`).

    Parameter leaves get their declared axes (see the module docstring). Other leaves (step
    counters, optax counts) are replicated, or sharded on "policy" along their leading axis when
    `stacked` (a vmapped state [P]); `stacked=None` reads that from the parameters (a leading
    axis of the size of the parameters' extra axis). With a mesh (or axis sizes) the specs are
    fitted to it."""
    declared = _declared_axes(axes)
    sizes = None if mesh is None else axis_sizes(mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    shapes = [tuple(getattr(leaf, "shape", ())) for _, leaf in flat]
    leaf_decl = [_leaf_axes(_dict_names(path), declared) for path, _ in flat]
    per_leaf = [None if a is None else _with_policy(a, len(s)) for a, s in zip(leaf_decl, shapes)]
    counter_lead = _counter_lead(stacked, shapes, per_leaf)
    specs = []
    for shape, declared_axes, leaf_axes in zip(shapes, leaf_decl, per_leaf):
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
    axes: Any,
    params: Params,
    mesh: Mesh | Mapping[str, int] | None = None,
    *,
    rules: ShardingRules = DEFAULT_RULES,
) -> Params:
    """PartitionSpec per parameter (also LoRA adapters, stacked trees) of a model whose declared
    parameter axes are `axes` (`jmarl.models.param_axes(config)`; see `tree_specs`)."""
    return tree_specs(axes, params, mesh, rules=rules)


# ---------------------------------------------------------------------------------- batches, caches
def batch_spec(
    shape: Sequence[int], mesh: Mesh | Mapping[str, int], *, stacked: bool = False, rules: ShardingRules = DEFAULT_RULES
) -> P:
    """The spec of one batch array [N, ...] (logical axes "batch", then unnamed; [P, N, ...]
    with `stacked`: "policy" in front). Default rules: rows on ("data", "fsdp"), and without a
    policy axis the "policy" devices split rows too."""
    return rules.spec((("policy",) if stacked else ()) + BATCH_AXES, shape, axis_sizes(mesh))


def cache_specs(
    axes: Any, cache: Any, mesh: Mesh | Mapping[str, int], *, rules: ShardingRules = DEFAULT_RULES
) -> Any:
    """Specs of a KV cache (arrays or ShapeDtypeStructs) from `axes`, the same tree with a
    logical-axis tuple per buffer (`jmarl.models.model.cache_axes(cache, stacked=...)`: keys
    [(P,) B, KV, hd, C], values [(P,) B, KV, C, hd]). Default rules: rows like the batch,
    key/value heads on "tensor", a leading "policy" axis on "policy"."""
    sizes = axis_sizes(mesh)
    return jax.tree.map(lambda a, x: rules.spec(a, x.shape, sizes), axes, cache, is_leaf=is_axes)


def microbatch_rows(mesh: Mesh, *, stacked: bool, rules: ShardingRules = DEFAULT_RULES) -> Callable[[Any], Any]:
    """A constraint for a batch split into micro-batches, leaves [M, A, rows, ...] (logical axes
    None, None, "batch"): each micro-batch's rows spread over the batch's mesh axes. With
    `stacked` the policy axis is vmapped away (sharded on "policy" by vmap's spmd_axis_name), so
    the rows do not take it. Without it, rows sharded as one [N] axis of contiguous blocks leave
    each micro-batch on a few devices, which then hold a whole micro-batch's activations."""
    sizes = axis_sizes(mesh)

    def constrain(x: jax.Array) -> jax.Array:
        spec = rules.spec((None, None) + BATCH_AXES, x.shape, sizes, stacked=stacked)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return lambda tree: jax.tree.map(constrain, tree)


def row_axes(mesh: Mesh | None, *, stacked: bool, rules: ShardingRules = DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes of size > 1 that split a batch's rows (the logical "batch" axis; unstacked:
    with the spare policy axis too): () without a mesh."""
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
