"""Test setup: CPU only, 8 simulated devices (set before JAX is imported)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] != "cpu":  # GPUs default float32 matmuls to TF32; the parity bounds are float32's
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# Most tests' programs are tiny and compile-bound: LLVM's optimisation of the generated CPU code cost
# 35-45% of such a test's time and changes no float semantics (XLA's own HLO passes and fusion still
# run, and fast-math stays off). Measured with a cold cache on 2 cores: test_sampler.py 335 s ->
# 192 s. The tests' subprocess runs of a whole training are compile-bound too and get the same flags
# (`_processes.one_device_xla_flags`).
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in _flags:
    _flags = (_flags + " --xla_backend_optimization_level=0").strip()
# XLA:CPU's MLIR fusion emitters took half of what remained of a tiny program's compile time; the
# elemental emitters they replace compute the same HLO (test_lora.py and test_sampler.py with a cold
# cache: 277 s -> 138 s, every test passing). XLA:CPU also splits a program's LLVM module into up to
# 32 parts to generate code on several threads; with both cores already running a test worker the
# split only adds work: one part per program cut a config test's backend compile time from
# 15.2-15.7 s to 12.0-12.5 s (cold cache, 2 busy cores), the generated code being the same. A JAX
# whose XLA no longer knows a flag would abort on it, so each is added only where a child process
# accepts it (probed once, by the controller).
_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def _xla_accepts(flags: str) -> bool:
    """Whether a fresh CPU JAX process starts with XLA_FLAGS=`flags` (unknown flags abort XLA)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return probe.returncode == 0


if os.environ["JAX_PLATFORMS"] == "cpu" and os.environ.get("JMARL_TEST_COMPILE_FLAGS_PROBED") != "1":
    os.environ["JMARL_TEST_COMPILE_FLAGS_PROBED"] = "1"  # the xdist workers inherit the answer
    _wanted = [f for f in _COMPILE_FLAGS if f.split("=")[0] not in _flags]
    if _wanted and _xla_accepts(" ".join([_flags, *_wanted])):
        _flags = " ".join([_flags, *_wanted])
    else:  # one of them unknown to this XLA: keep the ones it accepts
        for _flag in _wanted:
            if _xla_accepts(f"{_flags} {_flag}"):
                _flags = f"{_flags} {_flag}"
os.environ["XLA_FLAGS"] = _flags
# Under xdist every core already runs a worker: torch's and OpenBLAS's own thread pools (one thread
# a core by default) then oversubscribe the machine. Each worker gets its share of the cores
# (set before torch or numpy is imported here). Measured on 2 cores beside one busy process: the
# SmolLM2 GGUF test's transformers forward over 1,100 tokens 12 s -> 7 s, 32 greedy tokens
# 10-18 s -> 3 s, the test 121 s -> 99 s.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_share))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests that run the CLI in this process must not switch glibc's allocator for every later test of
# the worker (`jmarl.host_memory`); the policy's own tests set this variable for their subprocesses.
os.environ.setdefault("JMARL_KEEP_HOST_MEMORY", "0")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# One persistent XLA compilation cache for the session (the xdist workers inherit the controller's
# setting, and the subprocesses their tests start inherit theirs): tiny-model runs compile the same
# programs many times, in both workers. JAX writes an entry in place, without a lock; a worker that
# reads one the other is still writing fails to decompress it, and JAX warns and compiles instead.
import tempfile  # noqa: E402

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jmarl-test-jax-cache-main"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

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


# Every test's seconds, kept by the controller: at the session's end they are written with a
# per-file total to jmarl-test-durations-<UTC time>.json in the temporary directory, so that what
# a whole run (CI's included) spent where can be read afterwards; `scripts/suite_time.py` reads the
# newest of them into its record, and `python scripts/suite_time.py --files FILE` prints its costliest files.
_DURATIONS: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        _DURATIONS.setdefault(report.nodeid, {})[report.when] = round(report.duration, 3)


def pytest_sessionfinish(session, exitstatus) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is not None or not _DURATIONS:
        return
    import json
    import time

    files: dict[str, float] = {}
    for nodeid, phases in _DURATIONS.items():
        name = nodeid.split("::")[0]
        files[name] = round(files.get(name, 0.0) + sum(phases.values()), 3)
    record = {"exit_status": int(exitstatus), "tests": _DURATIONS,
              "files": dict(sorted(files.items(), key=lambda kv: -kv[1]))}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (Path(tempfile.gettempdir()) / f"jmarl-test-durations-{stamp}.json").write_text(json.dumps(record, indent=1))


# Every compiled XLA:CPU executable a worker keeps alive holds about three memory mappings of its
# own, and JAX keeps every executable its tests compiled: one process reached ~54k mappings after two
# test files, and at the kernel's vm.max_map_count (65530 by default) the next mmap fails and XLA
# segfaults while compiling or serialising. Past _MAX_MAPPINGS, JAX's in-memory caches are
# dropped after the test (programs then come back from the persistent cache above).
_MAX_MAPPINGS = 50_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


def drop_jax_caches_past(limit: int) -> bool:
    """Drops JAX's in-memory caches (and the executables only they hold) when this process holds
    more than `limit` memory mappings; whether it did."""
    if _mappings() <= limit:
        return False
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    return True


@pytest.fixture(autouse=True)
def _bounded_memory_mappings():
    yield
    drop_jax_caches_past(_MAX_MAPPINGS)


# ---------------------------------------------------------------------------------- tiny models, meshes
# The builders live in tests/_tiny_models.py; these fixtures share what they build within a session
# (one per xdist worker). What they share is read-only: each checks at the session's end that no test
# changed it.
def _files(path: str) -> dict[str, tuple[int, int]]:
    """Each file under `path` (relative name) -> (size, modification time in ns)."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            stat = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), path)] = (stat.st_size, stat.st_mtime_ns)
    return out


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """`tiny_hf_checkpoint(family, seed=0, **overrides)` -> the directory of a tiny random HF
    checkpoint (`_tiny_models.make_tiny_checkpoint`: the model and the CharTokenizer), written
    once per session for each family, seed and resulting HF config (overrides that spell the
    default share it) and shared by every test that asks for it. Read it only: a test that writes
    into the directory makes its own with `make_tiny_checkpoint(tmp_path, ...)`."""
    from _tiny_models import hf_config, make_tiny_checkpoint

    written: dict[tuple, tuple[str, dict]] = {}

    def checkpoint(family: str, seed: int = 0, **overrides) -> str:
        key = (family, seed, hf_config(family, **overrides).to_json_string())
        if key not in written:
            path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}"), family, seed, **overrides)
            written[key] = (path, _files(path))
        return written[key][0]

    yield checkpoint
    changed = [path for path, files in written.values() if _files(path) != files]
    assert not changed, f"a test wrote into a shared tiny checkpoint (write into a fresh one instead): {changed}"


@pytest.fixture(scope="session")
def tiny_qwen3_model():
    """(config, params) of the default `_tiny_models.tiny_qwen3()`, parameters initialised from
    key 0, built once per session for the tests that only read them (a test that changes a leaf
    builds a new tree: `{**params, ...}`, `jax.tree.map`; donating them to a program deletes them)."""
    import jax

    from _tiny_models import tiny_qwen3
    from jmarl import models

    config = tiny_qwen3()
    params = jax.jit(models.init, static_argnums=0)(config, jax.random.key(0))
    leaves, structure = jax.tree.flatten(params)
    yield config, params
    now, now_structure = jax.tree.flatten(params)
    assert now_structure == structure and all(a is b for a, b in zip(now, leaves)), \
        "a test replaced a leaf of the shared tiny_qwen3_model parameters (build a new tree instead)"
    assert not any(leaf.is_deleted() for leaf in leaves), \
        "a test donated the shared tiny_qwen3_model parameters to a program (pass a copy instead)"


@pytest.fixture(scope="session")
def mesh():
    """`mesh(**axes)` -> `jmarl.sharding.make_mesh(**axes)` over this process's devices (8
    simulated CPU ones here); the test is skipped, saying what it needs, where the process has fewer
    devices than the axes' sizes (an axis of -1, all remaining devices, counts as one)."""
    import math

    import jax

    from jmarl import sharding

    def make(**axes: int):
        needed = math.prod(size for size in axes.values() if size != -1)
        if needed > jax.device_count():
            pytest.skip(f"the mesh {axes} needs {needed} devices; this process has {jax.device_count()}")
        return sharding.make_mesh(**axes)

    return make
