"""Multi-host start-up: `jax.distributed.initialize` when the config or the environment names
a cluster (every process then runs the same deterministic program over all processes' devices)."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from jmarl.errors import JmarlError

log = logging.getLogger(__name__)


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
