"""Placing trees on a mesh: NamedShardings from spec trees, `put` (multi-host aware; abstract
leaves get the sharding attached), parameters / train states / batches placed by the rules,
bytes per device, and copies back to the host."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules
from jmarl.sharding.specs import batch_spec, param_specs, tree_specs

Params = Any


def shardings(mesh: Mesh, specs: Any) -> Any:
    """NamedSharding per PartitionSpec of a spec tree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def put(tree: Any, sharding_tree: Any) -> Any:
    """Places every leaf with its sharding. In a multi-host run a host (numpy or local) value
    must be the same on every process; each process then fills its own shards from it. A
    `jax.ShapeDtypeStruct` leaf (an abstract state, as `jmarl.memory_check` builds) gets the sharding
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


def shard_params(axes: Any, params: Params, mesh: Mesh, *, rules: ShardingRules = DEFAULT_RULES) -> Params:
    """`params` (or LoRA adapters, stacked or not) placed on `mesh` by `rules` (`param_specs`;
    `axes`: the model's declared parameter axes, `jmarl.models.param_axes(config)`)."""
    return put(params, shardings(mesh, param_specs(axes, params, mesh, rules=rules)))


def train_state_shardings(
    axes: Any, state: Any, mesh: Mesh, *, stacked: bool | None = None, rules: ShardingRules = DEFAULT_RULES
) -> Any:
    """NamedShardings of a `TrainState` (optimizer state sharded like its parameters, whose
    declared axes are `axes`; `stacked`: whether its counters carry a policy axis, None: read
    from the parameters; see `tree_specs`)."""
    return shardings(mesh, tree_specs(axes, state, mesh, stacked=stacked, rules=rules))


def shard_train_state(
    axes: Any, state: Any, mesh: Mesh, *, stacked: bool | None = None, rules: ShardingRules = DEFAULT_RULES
) -> Any:
    """A `TrainState` placed on `mesh`: params, optimizer moments, counters."""
    return put(state, train_state_shardings(axes, state, mesh, stacked=stacked, rules=rules))


def batch_shardings(batch: Any, mesh: Mesh, *, stacked: bool = False, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """NamedSharding per batch array (see `batch_spec`)."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, batch_spec(np.shape(x), mesh, stacked=stacked, rules=rules)), batch)


def shard_batch(batch: Any, mesh: Mesh, *, stacked: bool = False, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """A dict of [N, ...] (or [P, N, ...] with `stacked`) arrays placed by the rules' "batch"
    (and "policy") axes: default rows on data/fsdp."""
    return put(batch, batch_shardings(batch, mesh, stacked=stacked, rules=rules))


def to_host(tree: Any) -> Any:
    """Numpy copies of every leaf, gathering the shards of other processes when needed."""
    from jax.experimental import multihost_utils

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(fetch, tree)
