"""`jmarl.host_memory`: by default (on glibc) a CPU program's temporary buffer is the same
memory every run (no page faults after the first), because JAX runs the program on the calling
thread and glibc keeps large freed blocks in the heap; JMARL_KEEP_HOST_MEMORY=0 leaves JAX and
the allocator alone, and the buffer faults in again every run."""

import os
import subprocess
import sys

import jax
import pytest

from jmarl import host_memory

ROWS = 32 * 2**20  # the program's temporary: a cumulative sum of 32M float32 (128 MiB, 32768 pages)

PROGRAM = f"""
import resource, sys
if sys.argv[1] == "jax-first":
    import jax.numpy
    jax.numpy.ones(2).block_until_ready()   # JAX's CPU backend starts before jmarl is imported
import jmarl, jax, jax.numpy as jnp
from jmarl import host_memory
program = jax.jit(lambda v: jnp.cumsum(v * 2.0)[::4096].sum())
v = jnp.ones(({ROWS},), jnp.float32)
program(v).block_until_ready(); program(v).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
program(v).block_until_ready()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(host_memory.host_memory_policy().replace(" ", "-"), jax.config.values["{host_memory.JAX_DISPATCH_FLAG}"], faults)
"""


def _run(keep: str | None, *, order: str = "jmarl-first", **env_extra: str) -> tuple[str, bool, int]:
    """(policy, JAX async dispatch flag, page faults of the third run of a program with a 128 MiB
    temporary) in a fresh Python with JMARL_KEEP_HOST_MEMORY set to `keep` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in (host_memory.ENV_VAR, host_memory.JAX_DISPATCH_FLAG.upper())}
    env.update(env_extra)
    if keep is not None:
        env[host_memory.ENV_VAR] = keep
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", PROGRAM, order], env=env, cwd=root, capture_output=True, text=True,
                         check=True)
    policy, asynchronous, faults = out.stdout.split()
    return policy, asynchronous == "True", int(faults)


glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="the policy is glibc's mallopt; this C library has none")
needs_inline_dispatch = pytest.mark.skipif(host_memory.JAX_DISPATCH_FLAG not in jax.config.values,
                                           reason="this JAX has no jax_cpu_enable_async_dispatch to run programs inline")
PAGES = ROWS * 4 // 4096


@glibc_only
@needs_inline_dispatch
def test_by_default_a_programs_buffer_is_reused_without_page_faults():
    policy, asynchronous, faults = _run(None)
    assert (policy, asynchronous) == ("kept", False) and faults < PAGES // 50


@glibc_only
def test_switched_off_jax_and_the_allocator_are_left_alone():
    """The temporary is a fresh mapping on a JAX worker thread that faults in again every run."""
    policy, asynchronous, faults = _run("0")
    assert (policy, asynchronous) == ("default", True) and faults > PAGES // 2


@glibc_only
@needs_inline_dispatch
@pytest.mark.parametrize("case", ["jax-first", "async-asked"])
def test_dispatch_half_needs_jmarl_first_and_respects_the_environment(case):
    """JAX started before jmarl, or JAX_CPU_ENABLE_ASYNC_DISPATCH=1 in the environment: programs
    stay on JAX's worker thread and the policy says 'heap only'. The page faults are not asserted
    here: they depend on which glibc arena the worker thread was given (its own: a fresh mmap
    every run; a shared main arena: the heap, no faults), which varies from run to run and
    machine to machine (a CI run saw 3 faults; MALLOC_ARENA_MAX=4 flips between the two here)."""
    if case == "jax-first":
        policy, asynchronous, _ = _run(None, order="jax-first")
    else:
        policy, asynchronous, _ = _run(None, JAX_CPU_ENABLE_ASYNC_DISPATCH="1")
    assert (policy, asynchronous) == ("heap-only", True)


def test_unknown_setting_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv(host_memory.ENV_VAR, "maybe")
    with pytest.warns(RuntimeWarning, match="JMARL_KEEP_HOST_MEMORY='maybe' is not understood; set it to 0"):
        assert host_memory.requested() is True
    for value, expected in (("1", True), ("on", True), ("", True), ("0", False), ("off", False)):
        monkeypatch.setenv(host_memory.ENV_VAR, value)
        assert host_memory.requested() is expected
