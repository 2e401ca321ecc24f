"""Sharded calls: jitted functions whose arguments are placed on the mesh before each call
(`ShardedFn`, `sharded_jit`, `sharded_update`), the mesh context programs are traced under, and
a policy group's shardings (`GroupShardings`: where its state, LoRA base and reference live,
`group_shardings`, `place_group`), from which the learner builds its device functions sharded."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl.sharding.placement import batch_shardings, put, shardings, train_state_shardings
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules
from jmarl.sharding.specs import param_specs


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh of the first leaf of `tree` (arrays or ShapeDtypeStructs) with a NamedSharding."""
    for leaf in jax.tree.leaves(tree):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding):
            return sh.mesh
    return None


def mesh_context(mesh: Mesh | None) -> Any:
    """`jax.set_mesh(mesh)` for a mesh of several devices (programs traced inside see it: see
    `jmarl.models.layers.batch_sharded`), else a no-op context."""
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


@dataclass(frozen=True)
class GroupShardings:
    """Where one policy group's arrays live on `mesh`: its train state (`state`), its LoRA base
    (`frozen`, None without one) and its reference parameters (`ref`, None without; the base
    itself when a LoRA policy's reference is its base); `stacked`: whether its arrays carry a
    leading policy axis; `rules` place its batches."""

    mesh: Mesh
    state: Any
    frozen: Any
    ref: Any
    stacked: bool
    rules: ShardingRules = DEFAULT_RULES


def group_shardings(axes: Any, state: Any, base: Any, ref: Any, mesh: Mesh, *, stacked: bool,
                    rules: ShardingRules = DEFAULT_RULES) -> GroupShardings:
    """The shardings of one policy group's train state, LoRA base and reference from `axes`, the
    declared parameter axes of its model (`jmarl.models.param_axes(config)`); arrays or
    ShapeDtypeStructs."""
    state_sh = train_state_shardings(axes, state, mesh, stacked=stacked, rules=rules)
    frozen_sh = None if base is None else shardings(mesh, param_specs(axes, base, mesh, rules=rules))
    if ref is None:
        ref_sh = None
    elif ref is base:  # LoRA: the base is the reference
        ref_sh = frozen_sh
    else:
        ref_sh = shardings(mesh, param_specs(axes, ref, mesh, rules=rules))
    return GroupShardings(mesh=mesh, state=state_sh, frozen=frozen_sh, ref=ref_sh, stacked=stacked, rules=rules)


def place_group(sh: GroupShardings, state: Any, base: Any, ref: Any) -> tuple[Any, Any, Any]:
    """(state, base, ref) placed with `sh` (a LoRA policy's reference stays its base, placed
    once); an abstract group's ShapeDtypeStructs get the shardings attached."""
    placed_base = None if base is None else put(base, sh.frozen)
    if ref is None:
        placed_ref = None
    elif ref is base:
        placed_ref = placed_base
    else:
        placed_ref = put(ref, sh.ref)
    return put(state, sh.state), placed_base, placed_ref
