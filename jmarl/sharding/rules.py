"""One rules object: logical axis names -> mesh axes -> a `PartitionSpec` for an array's shape.

Logical axes are tuples of names, one per array axis (`is_axes`). The model declares those of
its own arrays (`jmarl.models.model.param_axes`, `cache_axes`, `ACTIVATION_AXES`) and callers
pass them in (`param_specs(param_axes(config), params, mesh)`); batch rows follow a convention
of this module (`BATCH_AXES`), LoRA factors one of `jmarl.sharding.specs` (`lora_axes`). No
module of `jmarl.sharding` imports the model.
`ShardingRules` says which mesh axes shard each logical axis. The defaults (`DEFAULT_RULES`):

    logical axis        mesh axes         what it names
    batch               (data, fsdp)      rows of a batch, prompt or KV-cache array, the rollout engine's
                                          slots (+ policy when no policy axis is stacked: spare policy
                                          devices split rows)
    activation_batch    (data, fsdp)      rows of a layer's input
    policy              policy            the stacked per-agent axis [P, ...]
    vocab               tensor            vocabulary (embedding rows, LM head columns)
    embed               fsdp              the hidden size D of a weight matrix (ZeRO-3 shards)
    q_heads, kv_heads   tensor            attention heads (x head_dim in kernels; KV heads in the cache)
    mlp                 tensor            feed-forward units F (an expert's Fe too)
    expert              fsdp              the experts E of a mixture-of-experts layer (expert
                                          parallelism: each fsdp device holds E / fsdp whole experts,
                                          and `jmarl.models.moe.expert_parallel_ffn` sends tokens to
                                          them; the experts' D then stays whole, see below)
    layers, norm, embed_bias, head_dim, lora_rank, cache_len      replicated

An axis that does not divide a dimension is dropped for that dimension (the last one first; the
array is then replicated along it), and so is an axis of size 1, so every spec is valid for every
model size and mesh. A mesh axis shards one dimension of an array at most: the first dimension
that keeps it wins (an expert weight [E, D, Fe] puts fsdp on E, so D is whole; the router [D, E]
puts it on D). When fsdp does not divide E (fsdp=256 and 128 experts) E is replicated and D takes
fsdp: plain FSDP, no expert parallelism (choose an fsdp that divides E, e.g. data=2, fsdp=128).
`ShardingRules(mlp=())` (or `DEFAULT_RULES.replace(mlp=())`) is a user's own rules: every
function that makes specs takes `rules=` (the model's own constraints inside a program, the
layer inputs' rows and the expert dispatch, read `DEFAULT_RULES`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from jax.sharding import PartitionSpec as P

from jmarl.errors import JmarlError

MeshAxes = tuple[str, ...]
# A batch / prompt array [N, ...] (rollouts, prompts, the learner's micro-batches): rows named,
# the other axes replicated. A convention of this layer (`batch_spec`, `microbatch_rows`,
# `row_axes`), not a model declaration: the model declares its parameters, KV cache and
# activations; batches are its callers' (trainer, sampler, rollout engine).
BATCH_AXES = ("batch",)


def is_axes(x: Any) -> bool:
    """Whether `x` is a tuple of logical axis names (an `is_leaf` for trees of them)."""
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> the mesh axes that shard it (a tuple, outermost first; () replicated).

    Every logical axis the model declares is a field, so a rule for an unknown name is a
    TypeError and a typo in a declaration is a JmarlError. `policy_spare` lists the logical axes
    that also take the "policy" rule's mesh axes when an array carries no stacked policy axis.
    A string value is read as a one-axis tuple, None as ()."""

    batch: MeshAxes = ("data", "fsdp")
    activation_batch: MeshAxes = ("data", "fsdp")
    policy: MeshAxes = ("policy",)
    vocab: MeshAxes = ("tensor",)
    embed: MeshAxes = ("fsdp",)
    q_heads: MeshAxes = ("tensor",)
    kv_heads: MeshAxes = ("tensor",)
    mlp: MeshAxes = ("tensor",)
    expert: MeshAxes = ("fsdp",)
    layers: MeshAxes = ()
    norm: MeshAxes = ()
    embed_bias: MeshAxes = ()
    head_dim: MeshAxes = ()
    lora_rank: MeshAxes = ()
    cache_len: MeshAxes = ()
    policy_spare: tuple[str, ...] = ("batch",)

    def __post_init__(self) -> None:
        for name in self.logical_axes():
            value = getattr(self, name)
            axes = () if value is None else (value,) if isinstance(value, str) else tuple(value)
            object.__setattr__(self, name, axes)

    @classmethod
    def logical_axes(cls) -> tuple[str, ...]:
        """Every logical axis name the rules map."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "policy_spare")

    def replace(self, **rules: MeshAxes | str | None) -> "ShardingRules":
        """These rules with some logical axes mapped anew, e.g. `replace(mlp=())`."""
        return dataclasses.replace(self, **rules)

    def mesh_axes(self, name: str | None, *, stacked: bool = False) -> MeshAxes:
        """The mesh axes of logical axis `name` (None: an unnamed axis, replicated). `stacked`:
        the array carries a policy axis, so the `policy_spare` axes do not take its mesh axes."""
        if name is None:
            return ()
        if name not in self.logical_axes():
            raise JmarlError(f"unknown logical axis {name!r}; ShardingRules maps {', '.join(self.logical_axes())}")
        axes = getattr(self, name)
        if not stacked and name in self.policy_spare:
            axes = axes + tuple(a for a in self.policy if a not in axes)
        return axes

    def spec(
        self,
        logical: Sequence[str | None],
        shape: Sequence[int],
        mesh_sizes: Mapping[str, int] | None = None,
        *,
        stacked: bool = False,
    ) -> P:
        """The PartitionSpec of an array of `shape` whose axes are named `logical` (one name per
        axis). With `mesh_sizes` (axis name -> size) it is fitted to that mesh (see `fit`).
        The array counts as stacked when `stacked` or when one of its axes is "policy"."""
        stacked = stacked or "policy" in logical
        return fit([self.mesh_axes(name, stacked=stacked) for name in logical], shape, mesh_sizes)


DEFAULT_RULES = ShardingRules()


def fit(entries: Sequence[MeshAxes], shape: Sequence[int], sizes: Mapping[str, int] | None) -> P:
    """A PartitionSpec for `shape` from per-dim mesh axes (a tuple each, () replicated).

    With `sizes`, axes of size 1 are dropped and so are axes whose product would not divide
    the dimension (last axis first), so the spec is valid on that mesh. A mesh axis already
    used by an earlier dimension is dropped (a spec may use an axis once)."""
    out: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for axes_, dim in zip(entries, shape):
        axes = [a for a in axes_ if a not in used]
        if sizes is not None:
            axes = [a for a in axes if sizes.get(a, 1) > 1]
            while axes and dim % math.prod(sizes[a] for a in axes):
                axes.pop()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:
        out.pop()
    return P(*out)
