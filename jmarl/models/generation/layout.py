"""Where generation's parameters and KV caches lie: policy selection, the compute-dtype cast,
and the caches' placement on a mesh, for both engines.

Parameters: `generation_params` casts the floating leaves to the compute dtype once per call;
`policy_axes` / `select_policy` find and take one policy of parameters stacked over policies
(per-agent LoRA adapters [P, ...] over one shared base: the base read once, not P merged copies);
`prepare_params` does both, as the engine's programs run it.

Static sampler on a mesh (`generation_shardings`, `placed_on_mesh`): the KV cache and the prompt
rows are sharded over the batch axes (data, fsdp), key/value heads over tensor, a stacked policy
axis over policy, so each device decodes its own rows; params keep whatever placement they have.

Engine on a mesh (`Layout`, `make_layout`): the slot axis of the slots' cache and of every
per-slot field, and the entry axis of the pool, are sharded like activation rows (the mesh axes
of an unstacked "batch" in `jmarl.sharding.ShardingRules`, default data, fsdp and policy; S and Q
multiples of their product D, the budget being per device), the caches' key/value heads like
"kv_heads" (tensor). The host keeps every slot on the device of the entry it reads: slots
d S/D .. and entries d Q/D .. lie on device d, a request's completions on another device take an
entry there (its prompt prefilled again), so each device gathers only from its own part of the
pool. The parameters stay as the caller placed them; FSDP-sharded weights are gathered (already
in the compute dtype) once at the top of each prefill / decode-chunk program (`gathered`), so the
decode loop reads gathered weights instead of gathering them at every step. The programs are
jitted with the state's shardings in and out (and the state donated), so the caches stay sharded
between calls (`jmarl.models.generation.engine_programs.state_shardings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl import sharding
from jmarl.models.config import ModelConfig
from jmarl.models.kv_cache import KVCache, empty_cache
from jmarl.models.layers import is_lora
from jmarl.models.model import CACHE_KEY_AXES, Params, cache_axes, param_shapes
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules
from jmarl.sharding.specs import row_axes


def generation_params(config: ModelConfig, params: Params) -> Params:
    """The parameters generation reads: floating leaves in the compute dtype, cast once per call
    (every layer casts its weights to it before use, so the numbers are the same; float32
    masters are then not read, nor gathered over an FSDP mesh, at every decode step). The cast
    is per leaf, so params of any layout (one policy, stacked over policies, LoRA adapters over
    a shared base) keep their shapes and structure."""
    dtype = jnp.dtype(config.compute_dtype)
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def policy_axes(config: ModelConfig, params: Params) -> Params:
    """The policy axis of each leaf of params stacked over policies (a `jax.vmap` in_axes tree,
    params' structure): 0 where a leaf has one axis more than `config`'s parameter at its path,
    None where it has not (held once for every policy: the base of per-agent LoRA adapters,
    whose `LoraKernel`s then have w None and a, b 0)."""

    def axes(shape: jax.ShapeDtypeStruct, leaf: Any) -> Any:
        stacked = lambda x: 0 if x.ndim > len(shape.shape) else None  # noqa: E731
        return jax.tree.map(stacked, leaf) if is_lora(leaf) else stacked(leaf)

    return jax.tree.map(axes, param_shapes(config), params)


def select_policy(config: ModelConfig, params: Params, policy: jax.Array) -> Params:
    """Policy `policy`'s parameters (int32 scalar) of params stacked over policies: its slice of
    each stacked leaf (read in place), the shared leaves as they are (`policy_axes`)."""
    return jax.tree.map(lambda p, axis: p if axis is None else jax.lax.dynamic_index_in_dim(p, policy, keepdims=False),
                        params, policy_axes(config, params))


def prepare_params(config: ModelConfig, params: Params, policy: jax.Array | None) -> Params:
    """The parameters a program generates with: policy `policy`'s (int32) of params stacked over
    policies (None: params as they are), cast to the compute dtype (`generation_params`)."""
    if policy is not None:
        params = select_policy(config, params, policy)
    return generation_params(config, params)


def generation_shardings(config: ModelConfig, mesh: Any, stacked: bool, batch_shape: tuple[int, ...], capacity: int,
                         prompts: tuple) -> tuple[Any, tuple]:
    """(KV cache shardings, shardings of the prompt arrays) of a generation call on `mesh`: cache
    and prompt rows over the batch axes (data, fsdp), key/value heads over tensor, a stacked
    policy axis over policy. None for an absent prompt array."""
    abstract = jax.eval_shape(lambda: empty_cache(config, batch_shape, capacity, windowed=True))
    cache_sh = sharding.shardings(mesh, sharding.cache_specs(cache_axes(abstract, stacked=stacked), abstract, mesh))
    prompt_sh = tuple(
        None if x is None else jax.sharding.NamedSharding(mesh, sharding.batch_spec(np.shape(x), mesh, stacked=stacked))
        for x in prompts)
    return cache_sh, prompt_sh


def placed_on_mesh(config: ModelConfig, mesh: Any, stacked: bool, batch_shape: tuple[int, ...], capacity: int,
                   prompts: tuple) -> tuple[KVCache, tuple]:
    """An empty KV cache created sharded on `mesh` and the prompt arrays placed there (see
    `generation_shardings`): every device holds and decodes only its rows."""
    cache_sh, prompt_sh = generation_shardings(config, mesh, stacked, batch_shape, capacity, prompts)
    cache = jax.jit(lambda: empty_cache(config, batch_shape, capacity, windowed=True), out_shardings=cache_sh)()
    placed = tuple(None if x is None else sharding.put(np.asarray(x), sh) for x, sh in zip(prompts, prompt_sh))
    return cache, placed


@dataclass(frozen=True)
class Layout:
    """How the engine lies on a mesh: `rows` the mesh axes of the slot axis (default data, fsdp,
    policy: those of size > 1), `heads` the mesh axis (or axes) of the cache's key/value heads ("tensor"
    or None), `gather` one NamedSharding (or None: left as it is) per parameter leaf (treedef
    `params_def`): the leaf's own sharding without the row axes (FSDP shards: the weights one
    program call reads, gathered once)."""

    mesh: Any
    rows: tuple[str, ...]
    heads: str | tuple[str, ...] | None
    params_def: Any = None
    gather: tuple = ()

    @property
    def row_devices(self) -> int:
        sizes = dict(self.mesh.shape)
        return int(np.prod([sizes[a] for a in self.rows])) if self.rows else 1

    def row_spec(self) -> P:
        return P(None if not self.rows else self.rows[0] if len(self.rows) == 1 else self.rows)

    def cache_spec(self) -> P:
        return P(*self.row_spec(), self.heads) if self.heads else self.row_spec()


def _without(spec: P, dropped: tuple[str, ...]) -> P:
    """`spec` with the mesh axes `dropped` taken out of every entry."""
    out = []
    for entry in spec:
        axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        axes = [a for a in axes if a not in dropped]
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*out)


def make_layout(config: ModelConfig, mesh: Any, params: Params | None = None,
                rules: ShardingRules = DEFAULT_RULES, select: bool = False) -> Layout | None:
    """The engine's layout on `mesh` (None without a mesh of several devices) by `rules`: the
    slot axis on the mesh axes of an unstacked "batch" of size > 1 (default data, fsdp and the
    spare policy axis: a run decodes one policy, whose weights are gathered over the slot axes
    like FSDP shards; S is rounded up to their product, so none is dropped), the cache's heads on those of "kv_heads"
    that divide num_kv_heads (default tensor). `params` (the generation parameters, placed)
    give the gathered shardings of the weights; with `select`, params stacked over policies
    whose one policy a program selects (`select_policy`): the gathered shardings are those of
    the selected slices (a stacked leaf's spec without its policy entry)."""
    if mesh is None or mesh.size <= 1:
        return None
    sizes = dict(mesh.shape)
    # the engine serves one policy per run, so a stacked run's "policy" devices split its slots too
    rows = row_axes(mesh, stacked=False, rules=rules)
    heads_spec = rules.spec(CACHE_KEY_AXES[1:2], (config.num_kv_heads,), sizes)
    heads = heads_spec[0] if len(heads_spec) else None
    if params is None:
        return Layout(mesh, rows, heads)
    leaves, treedef = jax.tree.flatten(params)
    stacked = [False] * len(leaves)
    if select:
        stacked = [a == 0 for a in jax.tree.leaves(policy_axes(config, params), is_leaf=lambda a: a is None)]

    def gathered(leaf, policy_axis: bool):
        sh = getattr(leaf, "sharding", None)
        if not isinstance(sh, NamedSharding) or sh.mesh != mesh:
            return None
        return NamedSharding(mesh, _without(P(*sh.spec[1:]) if policy_axis else sh.spec, rows))

    return Layout(mesh, rows, heads, treedef, tuple(gathered(leaf, s) for leaf, s in zip(leaves, stacked)))


def gathered(layout: Layout | None, params: Params) -> Params:
    """params constrained to their fsdp-gathered shardings (inside a program: one gather per call)."""
    if layout is None or not layout.gather:
        return params
    leaves, treedef = jax.tree.flatten(params)
    leaves = [x if sh is None else jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(leaves, layout.gather)]
    return jax.tree.unflatten(treedef, leaves)


def row_devices(layout: Layout | None) -> int:
    """D: the devices the slots (and pool entries) are split over."""
    return 1 if layout is None else layout.row_devices
