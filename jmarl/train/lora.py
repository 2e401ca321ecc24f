"""LoRA adapters as a separate pytree over a frozen base: y = x W + (alpha / rank) * (x A) B.

Adapters live beside the base parameters, not inside them, so the base is the reference policy
for free and only the adapters are trained (and stacked on a leading policy axis for
per-agent LoRA). A kernel of shape [..., in, out] (leading axes such as a stacked-layer axis
are kept) gets A [..., in, rank] (random normal / sqrt(in)) and B [..., rank, out] (zeros), so
a fresh adapter leaves the model unchanged.

The model runs them unmerged (`attach_lora`): each adapted kernel's slot holds a
`jmarl.models.layers.LoraKernel` (W, A, B, scale) and every product is x W + s (x A) B, so the
frozen base is held once for all the adapters of a group (P per-agent adapters on an 8B base
cost P x the adapters, not P x 8B of merged weights), in sampling and in the update, and no
gradient is formed for W. `merge_lora` makes real merged weights where they are needed
(export to a Hugging Face directory).

Adapters are float32 whatever the base's dtype: they are what the optimizer updates, and
AdamW updates of bfloat16 weights mostly round away. The base may be stored in bfloat16 (it is
frozen). Unmerged, W, A and B are each cast to the compute dtype for their products; the merge
adds the adapter product in float32 and stores the result in the base's dtype.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jmarl.errors import JmarlError
from jmarl.models.layers import LoraKernel

Params = Any
KERNEL_NAMES = ("kernel", "weight")


def _path_names(path: tuple) -> tuple[str, ...]:
    names = []
    for p in path:
        name = getattr(p, "key", None)
        if name is None:
            name = getattr(p, "name", None)
        if name is None:
            name = getattr(p, "idx", p)
        names.append(str(name))
    return tuple(names)


def is_target(path: tuple, leaf: jax.Array, target_modules: Sequence[str]) -> bool:
    """Whether the leaf at `path` is a projection kernel named in `target_modules`."""
    names = _path_names(path)
    if not names or names[-1] not in KERNEL_NAMES or getattr(leaf, "ndim", 0) < 2:
        return False
    return any(t in names[:-1] for t in target_modules)


def init_lora(
    params: Params, rng: jax.Array, *, rank: int, target_modules: Sequence[str]
) -> Params:
    """Float32 adapters {'a', 'b'} for every targeted kernel (whatever the kernel's dtype), None
    elsewhere (same tree structure)."""
    if rank < 1:
        raise JmarlError(f"policies.lora.rank must be >= 1, got {rank}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(rng, max(len(leaves), 1))
    out, found = [], 0
    for (path, leaf), key in zip(leaves, keys):
        if not is_target(path, leaf, target_modules):
            out.append(None)
            continue
        found += 1
        *lead, d_in, d_out = leaf.shape
        a = jax.random.normal(key, (*lead, d_in, rank), jnp.float32) / jnp.sqrt(d_in)
        out.append({"a": a, "b": jnp.zeros((*lead, rank, d_out), jnp.float32)})
    if not found:
        raise JmarlError(
            f"policies.lora.target_modules {list(target_modules)} matched no kernel; "
            "name projection modules such as q_proj, k_proj, v_proj, o_proj, gate_proj, "
            "up_proj, down_proj"
        )
    return jax.tree_util.tree_unflatten(treedef, out)


def merge_lora(base: Params, adapters: Params, *, rank: int, alpha: float) -> Params:
    """W + (alpha / rank) * A @ B for every adapted kernel, added in float32 and stored in W's
    dtype; other leaves pass through."""
    scale = alpha / rank

    def merge(w, ad):
        if ad is None:
            return w
        a, b = ad["a"].astype(jnp.float32), ad["b"].astype(jnp.float32)
        delta = jnp.matmul(a, b) * scale
        return (w.astype(jnp.float32) + delta).astype(w.dtype)

    # `base` sets the structure: each of its leaves meets the adapter subtree at the same path
    # (None, or the {'a', 'b'} dict).
    return jax.tree.map(merge, base, adapters)


def attach_lora(base: Params, adapters: Params, *, rank: int, alpha: float) -> Params:
    """The parameters the model runs with for `adapters` on the frozen `base`, unmerged: every
    adapted kernel W [..., in, out] becomes `LoraKernel(W, A, B, alpha / rank)` (the model then
    computes x W + s (x A) B), other leaves are the base's own arrays. Nothing is computed or
    copied: W is the base's array. Adapters may carry a leading policy axis [P, ...] that the
    base does not (`policy_axes` of `jmarl.models.generation.layout` reads it); under `jax.vmap` over
    adapters with the base unmapped, each policy reads the one base."""
    scale = alpha / rank

    def attach(w, ad):
        if ad is None:
            return w
        return LoraKernel(w, ad["a"], ad["b"], scale)

    # `base` sets the structure: each of its leaves meets the adapter subtree at the same path
    return jax.tree.map(attach, base, adapters)

