"""`jmarl.host_memory`: `import jmarl` changes nothing in the process (JAX's CPU dispatch and
glibc's allocator stay as they are, and a CPU program's temporary buffer faults in again every
run); the command line and the benchmarks apply the policy with `apply_on_cpu()` where JAX runs
on the CPU alone, after which (on glibc) the buffer is the same memory every run, because JAX
runs the program on the calling thread and glibc keeps large freed blocks in the heap. On an
accelerator host (JAX_PLATFORMS naming another platform, or an accelerator plugin installed)
`apply_on_cpu()` leaves everything alone, and JMARL_KEEP_HOST_MEMORY=0 opts out."""

import os
import subprocess
import sys

import jax
import pytest

from jmarl import host_memory

ROWS = 32 * 2**20  # the program's temporary: a cumulative sum of 32M float32 (128 MiB, 32768 pages)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = f"""
import resource, sys
order, how = sys.argv[1], sys.argv[2]
if order == "jax-first":
    import jax.numpy
    jax.numpy.ones(2).block_until_ready()   # JAX's CPU backend starts before the policy is applied
import jmarl, jax, jax.numpy as jnp
from jax._src import xla_bridge
from jmarl import host_memory
if how == "apply":
    host_memory.apply_on_cpu()
elif how == "apply-with-plugin":   # as if a CUDA plugin were installed
    host_memory.accelerator_plugins = lambda: ["jax_cuda12_plugin"]
    host_memory.apply_on_cpu()
elif how == "cli":                 # the command line's path up to the trainer
    from jmarl import process as run
    from jmarl.config import load_config
    run.prepare_process(load_config("configs/quickstart.yaml"))  # cache: $JMARL_COMPILATION_CACHE
started = xla_bridge.backends_are_initialized()
if how.startswith("apply") and order == "jmarl-first":
    assert not started, "deciding CPU-only started JAX's backends"
if sys.argv[3] == "no-run":        # JAX_PLATFORMS names a platform this machine lacks: do not start JAX
    print(host_memory.host_memory_policy().replace(" ", "-"), jax.config.values["{host_memory.JAX_DISPATCH_FLAG}"], -1)
    raise SystemExit(0)
program = jax.jit(lambda v: jnp.cumsum(v * 2.0)[::4096].sum())
v = jnp.ones(({ROWS},), jnp.float32)
program(v).block_until_ready(); program(v).block_until_ready()
faults = []
for _ in range(3):   # the steady state: the fewest of three runs, so one stray run that faults in again does not decide
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    program(v).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = min(faults)
print(host_memory.host_memory_policy().replace(" ", "-"), jax.config.values["{host_memory.JAX_DISPATCH_FLAG}"], faults)
"""


def _run(how: str, keep: str | None = None, *, order: str = "jmarl-first", platforms: str | None = "cpu",
         measure: bool = True, **env_extra: str) -> tuple[str, bool, int]:
    """(policy, JAX async dispatch flag, the fewest page faults of runs 3-5 of a program with a
    128 MiB temporary; -1 when not measured) in a fresh Python that imports jmarl and then does `how`
    ("import": nothing more; "apply": `apply_on_cpu()`; "apply-with-plugin": that with an
    accelerator plugin seen as installed; "cli": `jmarl.process.prepare_process`), with
    JMARL_KEEP_HOST_MEMORY set to `keep` and JAX_PLATFORMS to `platforms` (None: unset)."""
    drop = (host_memory.ENV_VAR, host_memory.JAX_DISPATCH_FLAG.upper(), "JAX_PLATFORMS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    if keep is not None:
        env[host_memory.ENV_VAR] = keep
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    out = subprocess.run([sys.executable, "-c", PROGRAM, order, how, "run" if measure else "no-run"], env=env,
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    policy, asynchronous, faults = out.stdout.split()[-3:]
    return policy, asynchronous == "True", int(faults)


glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="the policy is glibc's mallopt; this C library has none")
needs_inline_dispatch = pytest.mark.skipif(host_memory.JAX_DISPATCH_FLAG not in jax.config.values,
                                           reason="this JAX has no jax_cpu_enable_async_dispatch to run programs inline")
PAGES = ROWS * 4 // 4096


@pytest.mark.slow
def test_import_jmarl_changes_nothing():
    """Neither JAX's dispatch (its default: async) nor the allocator: the temporary is a fresh
    mapping on a JAX worker thread that faults in again every run."""
    policy, asynchronous, faults = _run("import")
    assert (policy, asynchronous) == ("default", True)
    if host_memory._glibc() is not None:
        assert faults > PAGES // 2


@pytest.mark.slow
@glibc_only
@needs_inline_dispatch
@pytest.mark.parametrize("how", ["apply", "cli"])
def test_on_cpu_the_cli_keeps_a_programs_buffer_without_page_faults(how, tmp_path):
    policy, asynchronous, faults = _run(how, JMARL_COMPILATION_CACHE=str(tmp_path))
    assert (policy, asynchronous) == ("kept", False) and faults < PAGES // 50


@glibc_only
@pytest.mark.slow
def test_switched_off_jax_and_the_allocator_are_left_alone():
    """JMARL_KEEP_HOST_MEMORY=0: `apply_on_cpu()` does nothing; the buffer faults in every run."""
    policy, asynchronous, faults = _run("apply", "0")
    assert (policy, asynchronous) == ("default", True) and faults > PAGES // 2


@pytest.mark.parametrize("platforms", ["cuda", "tpu", "cuda,cpu"])
def test_a_non_cpu_platform_is_left_alone_without_starting_jax(platforms):
    """JAX_PLATFORMS naming an accelerator (absent here: JAX is never started, which would fail):
    nothing applied, and the decision started no backend (asserted in the program)."""
    assert _run("apply", platforms=platforms, measure=False) == ("default", True, -1)


@pytest.mark.slow
def test_an_installed_accelerator_plugin_is_left_alone_unless_jax_platforms_says_cpu():
    assert _run("apply-with-plugin", platforms=None, measure=False) == ("default", True, -1)
    expected = ("kept" if host_memory.JAX_DISPATCH_FLAG in jax.config.values else "heap-only") \
        if host_memory._glibc() else "default"
    assert _run("apply-with-plugin", platforms="cpu", measure=False)[0] == expected


def test_cpu_only_decision(monkeypatch):
    assert host_memory.names_cpu_only("cpu") and host_memory.names_cpu_only(" CPU ")
    assert not any(host_memory.names_cpu_only(p) for p in ("", "cuda", "cuda,cpu", "tpu", "rocm", "cpu,gpu"))
    monkeypatch.setattr(host_memory, "_jax_backends_started", lambda: False)
    monkeypatch.setattr(host_memory, "accelerator_plugins", lambda: [])
    for platforms, expected in (("cpu", True), ("cuda", False), ("", True)):
        monkeypatch.setattr(host_memory, "platforms_setting", lambda p=platforms: p)
        assert host_memory.cpu_only() is expected
    monkeypatch.setattr(host_memory, "accelerator_plugins", lambda: ["libtpu"])
    assert host_memory.cpu_only() is False  # nothing set, a plugin installed
    monkeypatch.setattr(host_memory, "platforms_setting", lambda: "cpu")
    assert host_memory.cpu_only() is True  # JAX_PLATFORMS=cpu wins over an installed plugin
    # This environment: JAX_PLATFORMS=cpu (tests/conftest.py) and no plugin in the test venv.
    monkeypatch.undo()
    assert host_memory.platforms_setting() == "cpu" and host_memory.cpu_only() is True


def test_accelerator_plugins_finds_modules_and_entry_points(monkeypatch):
    import importlib.metadata
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "jax_cuda12_plugin" else real(name, *a))
    assert "jax_cuda12_plugin" in host_memory.accelerator_plugins()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    entry = importlib.metadata.EntryPoint(name="xla_rocm7", value="jax_rocm7_plugin", group="jax_plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [entry] if group == "jax_plugins" else [])
    assert host_memory.accelerator_plugins() == ["jax_rocm7_plugin"]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    assert host_memory.accelerator_plugins() == []


@pytest.mark.slow
@glibc_only
@needs_inline_dispatch
@pytest.mark.parametrize("case", ["jax-first", "async-asked"])
def test_dispatch_half_needs_to_come_first_and_respects_the_environment(case):
    """JAX started before `apply_on_cpu()`, or JAX_CPU_ENABLE_ASYNC_DISPATCH=1 in the environment:
    programs stay on JAX's worker thread and the policy says 'heap only'. The page faults are not
    asserted here: they depend on which glibc arena the worker thread was given (its own: a fresh
    mmap every run; a shared main arena: the heap, no faults), which varies from run to run and
    machine to machine (a CI run saw 3 faults; MALLOC_ARENA_MAX=4 flips between the two here)."""
    if case == "jax-first":
        policy, asynchronous, _ = _run("apply", order="jax-first")
    else:
        policy, asynchronous, _ = _run("apply", JAX_CPU_ENABLE_ASYNC_DISPATCH="1")
    assert (policy, asynchronous) == ("heap-only", True)


def test_unknown_setting_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv(host_memory.ENV_VAR, "maybe")
    with pytest.warns(RuntimeWarning, match="JMARL_KEEP_HOST_MEMORY='maybe' is not understood; set it to 0"):
        assert host_memory.requested() is True
    for value, expected in (("1", True), ("on", True), ("", True), ("0", False), ("off", False)):
        monkeypatch.setenv(host_memory.ENV_VAR, value)
        assert host_memory.requested() is expected
