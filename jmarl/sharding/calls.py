"""Sharded calls: jitted functions whose arguments are placed on the mesh before each call
(`ShardedFn`, `sharded_jit`, `sharded_update`), the mesh context programs are traced under, and
`shard_trainer`, which puts a trainer's states and device functions on its config's mesh."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl.sharding.mesh import axis_sizes, format_mesh, mesh_from_config
from jmarl.sharding.placement import batch_shardings, put, shardings, train_state_shardings
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules
from jmarl.sharding.specs import param_specs

log = logging.getLogger(__name__)


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
    if mesh is None or mesh.size == 1:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


class ShardedFn:
    """A jitted function whose arguments are placed on the mesh before each call.

    `arg_shardings(*args)` gives, per argument, a sharding tree (or None: keep the argument's
    own placement); `__call__` places the arguments with them (a no-op for arrays already
    there, so host numpy batches work) and calls `jitted`. `jmarl.memory_check` lowers `jitted` with
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
    rules: ShardingRules = DEFAULT_RULES,
) -> ShardedFn:
    """`fn` jitted on `mesh`: argument i is placed with `fixed[i]` (a sharding tree, or None to
    keep its placement), except the arguments in `batch_argnums`, whose arrays ([N, ...], or
    [P, N, ...] with `stacked`) are placed by `rules` (`batch_shardings`: default rows on
    data/fsdp) from each call's shapes. out_shardings None: XLA propagates them from the inputs."""
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
            (None if a is None else batch_shardings(a, mesh, stacked=stacked, rules=rules)) if i in batch_argnums else fixed[i]
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
    rules: ShardingRules = DEFAULT_RULES,
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
    go to `jax.jit` (XLA options such as {"xla_backend_optimization_level": 0}). `rules` place
    the batch when its shardings are derived.
    """
    fn = update_fn
    if vmap_policies:
        fn = jax.vmap(update_fn, in_axes=(0, 0 if frozen_stacked else None, 0))
    replicated = NamedSharding(mesh, P())
    return sharded_jit(
        fn, mesh, (state_shardings, frozen_shardings, batch_shardings_),
        batch_argnums=(2,) if batch_shardings_ is None else (), stacked=stacked,
        out_shardings=(state_shardings, replicated), donate_argnums=(0,) if donate else (),
        compiler_options=compiler_options, rules=rules,
    )


def shard_trainer(trainer: Any, param_axes: Callable[[Any], Any], *, rules: ShardingRules = DEFAULT_RULES) -> Mesh:
    """Puts a `jmarl.train.trainer.Trainer` on the mesh of its config: every policy group's
    train state, LoRA base and reference parameters are sharded by `rules` from their declared
    axes, `param_axes(group.model_config)` (the caller passes the model's declaration,
    `jmarl.models.param_axes`), and its device functions run through `ShardedFn`s: the RL and
    warm-start updates (`sharded_update`, state donated) and the scoring passes, with batch rows
    placed by the rules (default data/fsdp). A one-device mesh (the default config) changes
    nothing. An abstract trainer (`Trainer(config, abstract=True)`, `jax.ShapeDtypeStruct`
    states) gets the shardings attached instead. Returns the mesh."""
    mesh = mesh_from_config(trainer.config.mesh)
    if mesh.size == 1:
        return mesh
    for group, fns in zip(trainer.policies.groups, trainer.fns):
        _shard_group(group, fns, mesh, param_axes(group.model_config), rules)
    log.info("sharded the policies over the mesh %s", format_mesh(axis_sizes(mesh)))
    return mesh


def _shard_group(group: Any, fns: Any, mesh: Mesh, axes: Any, rules: ShardingRules) -> None:
    """One policy group's state, LoRA base and reference placed on `mesh` (`axes`: its model's
    declared parameter axes), its device functions (`GroupFns`) replaced by sharded ones. The
    group says whether its policies are stacked."""
    stacked = group.stacked
    ref_is_base = group.ref is not None and group.ref is group.base  # LoRA: the base is the reference
    state_sh = train_state_shardings(axes, group.state, mesh, stacked=stacked, rules=rules)
    group.state = put(group.state, state_sh)
    frozen_sh = None
    if group.base is not None:
        frozen_sh = shardings(mesh, param_specs(axes, group.base, mesh, rules=rules))
        group.base = put(group.base, frozen_sh)
    ref_sh = None
    if group.ref is not None:
        ref_sh = shardings(mesh, param_specs(axes, group.ref, mesh, rules=rules))
        group.ref = group.base if ref_is_base else put(group.ref, ref_sh)
    batch = dict(stacked=stacked, rules=rules)
    fns.update = sharded_update(fns.update, mesh, state_sh, frozen_shardings=frozen_sh, **batch)
    fns.sft_update = sharded_update(fns.sft_update, mesh, state_sh, frozen_shardings=frozen_sh, **batch)
    fns.score = sharded_jit(fns.score, mesh, (state_sh.params, frozen_sh, None), batch_argnums=(2,), **batch)
    fns.score_ref = sharded_jit(fns.score_ref, mesh, (ref_sh, None), batch_argnums=(1,), **batch)
