"""Test setup: CPU only, 8 simulated devices (set before JAX is imported)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests that run the CLI in this process must not switch glibc's allocator for every later test of
# the worker (`jmarl.host_memory`); the policy's own tests set this variable for their subprocesses.
os.environ.setdefault("JMARL_KEEP_HOST_MEMORY", "0")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# A persistent XLA compilation cache per xdist worker (shared with the subprocesses its tests
# start): tiny-model runs compile the same programs many times. Not one for both workers: JAX
# writes an entry in place, without a lock, so one worker could read the other's half-written one.
import tempfile  # noqa: E402

_worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"jmarl-test-jax-cache-{_worker}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
