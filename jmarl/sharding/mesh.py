"""Device meshes: four named axes (device-grid order, `tensor` innermost so it lands on the
fastest links), built from sizes or a config's `mesh:` section, and parsed/printed as text.

    data    batch rows (pure data parallelism: parameters replicated)
    policy  the stacked per-agent policy axis [P, ...] (per-agent policies / LoRA adapters)
    fsdp    batch rows AND parameter/gradient/optimizer-state shards (ZeRO-3 style)
    tensor  attention heads / MLP hidden units / vocabulary (Megatron-style tensor parallelism)
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jmarl.errors import JmarlError

MESH_AXES: tuple[str, ...] = ("data", "policy", "fsdp", "tensor")


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
