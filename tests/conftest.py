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

# No persistent compilation cache in the test processes, nor in the runs they start (the CLI's
# "auto" follows JAX's switch): every cache write serialises the compiled XLA:CPU executable, and
# that serialisation crashed a worker with a segmentation fault about once per suite run from an
# empty cache (jax/_src/compilation_cache.py put_executable_and_time -> executable.serialize()).
# tests/test_compile_cache.py turns the cache on where it tests it.
import tempfile  # noqa: E402

os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

# A worker that dies of a fatal signal is reported by xdist with its test's name only. Each worker
# writes faulthandler's dump (every thread's Python stack) to a file of its own, and the controller
# prints any non-empty one, without the test runner's own frames, at the end of its summary.
import faulthandler  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_FAULTS = Path(tempfile.gettempdir()) / f"jmarl-test-faults-{os.getuid()}"
_RUNNER_FRAMES = ("/_pytest/", "/pluggy/", "/execnet/", "/xdist/", 'File "<string>"')
_DUMP_KEY = pytest.StashKey[object]()


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which points it at stderr
def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:  # the controller (or a run without xdist): forget an earlier session's dumps
        for old in _FAULTS.glob("*.txt"):
            old.unlink(missing_ok=True)
        return
    _FAULTS.mkdir(exist_ok=True)
    dump = open(_FAULTS / f"{worker}-{os.getpid()}.txt", "w")  # noqa: SIM115 - open for the process's life
    faulthandler.enable(file=dump, all_threads=True)
    config.stash[_DUMP_KEY] = dump


def pytest_terminal_summary(terminalreporter) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    for path in sorted(_FAULTS.glob("*.txt")):
        lines = [line for line in path.read_text(errors="replace").splitlines()
                 if line.strip() and not any(frame in line for frame in _RUNNER_FRAMES)]
        if lines:
            terminalreporter.write_sep("=", f"fatal error of xdist worker {path.stem}")
            terminalreporter.write_line("\n".join(lines[:40]))
