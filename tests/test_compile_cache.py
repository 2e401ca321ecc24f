"""`jmarl.compile_cache`: where "auto" puts the persistent compilation cache, what `enable` sets,
and a run done twice: the second compiles nothing (every program comes from the cache)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from _processes import one_device_xla_flags
from jmarl import compile_cache
from jmarl import process as cli
from jmarl.errors import JmarlError

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes", "jax_enable_compilation_cache")


@pytest.fixture
def jax_cache_settings():
    """Puts JAX's cache settings (and its open cache) back as they were after the test."""
    saved = {name: jax.config.values[name] for name in FLAGS if name in jax.config.values}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compile_cache._reset_jax_cache()


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_directory() == str(tmp_path / "xdg" / "jmarl" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_directory("runs/x") == str(tmp_path / "home" / ".cache" / "jmarl" / "jax")
    monkeypatch.setattr(os.path, "expanduser", lambda p: p)  # no home directory known: ~ stays ~
    assert compile_cache.default_directory("runs/x") == os.path.join("runs/x", "jax_cache")
    monkeypatch.undo()
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_directory() == str(tmp_path / "mine")  # the jmarl variable wins


def test_directory_for_each_setting(monkeypatch, tmp_path, jax_cache_settings):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.directory_for("off") is None
    assert compile_cache.directory_for("~/xla") == os.path.join(os.path.expanduser("~"), "xla")
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.directory_for("auto") == str(tmp_path / "xdg" / "jmarl" / "jax")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "given"))  # JAX_COMPILATION_CACHE_DIR
    assert compile_cache.directory_for("auto") == str(tmp_path / "given")
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "mine"))
    assert compile_cache.directory_for("auto") == str(tmp_path / "mine")
    jax.config.update("jax_enable_compilation_cache", False)  # JAX_ENABLE_COMPILATION_CACHE=false
    assert compile_cache.directory_for("auto") is None
    assert compile_cache.directory_for(str(tmp_path / "explicit")) == str(tmp_path / "explicit")
    with pytest.raises(JmarlError, match="train.compilation_cache: must be 'auto', 'off' or a directory path"):
        compile_cache.directory_for(" ")


def test_enable_caches_every_program_in_the_directory(tmp_path, jax_cache_settings):
    jax.config.update("jax_enable_compilation_cache", False)
    path = compile_cache.enable(str(tmp_path / "a" / "b"))
    assert path == str(tmp_path / "a" / "b") and os.path.isdir(path)
    values = jax.config.values
    assert values["jax_compilation_cache_dir"] == path and values["jax_enable_compilation_cache"] is True
    assert values["jax_persistent_cache_min_compile_time_secs"] == 0
    assert values["jax_persistent_cache_min_entry_size_bytes"] in (0, -1)
    x = jax.numpy.arange(7.0)
    jax.jit(lambda v: v * 3.0 + 1.25)(x).block_until_ready()  # a program compiled in no time, tiny
    assert os.listdir(path), "the program was not written to the cache"


def test_enable_names_the_setting_when_the_directory_cannot_be_made(tmp_path, capsys, jax_cache_settings):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(JmarlError, match=r"train.compilation_cache: cannot create the compilation cache directory "
                                         r".*a_file/cache.*; set train.compilation_cache=<a writable directory>"):
        compile_cache.enable(str(blocker / "cache"))
    config = SimpleNamespace(train=SimpleNamespace(compilation_cache=str(blocker / "cache")), output_dir=str(tmp_path))
    with pytest.raises(JmarlError, match="cannot create"):  # asked for explicitly: the run stops
        cli.setup_compilation_cache(config)
    # "auto": a warning, and the run goes on without a cache
    config.train.compilation_cache = "auto"
    os.environ[compile_cache.ENV_VAR] = str(blocker / "cache")
    try:
        assert cli.setup_compilation_cache(config) is None
    finally:
        del os.environ[compile_cache.ENV_VAR]
    assert "running without a compilation cache" in capsys.readouterr().err
    config.train.compilation_cache = "off"
    assert cli.setup_compilation_cache(config) is None


# A run of the CLI with a listener on JAX's persistent-cache events (misses: programs compiled and
# written to the cache; hits: programs loaded from it).
WRAPPER = """
import collections, json, sys
import jax.monitoring
counts = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **kwargs: counts.update([event]))
from jmarl.run import main
status = main(sys.argv[1:])
print("CACHE_EVENTS " + json.dumps({k.rsplit("/", 1)[-1]: v for k, v in counts.items() if "compilation_cache" in k}))
sys.exit(status)
"""
TINY_RUN = ["--config", "configs/quickstart.yaml", "train.steps=1", "train.warm_start.steps=0",
            "workflow.num_tasks=1", "workflow.group_size=2", "eval.num_episodes=1", "model.preset.num_layers=1",
            "sampling.max_new_tokens=4", "logging.tensorboard=false", "logging.plots=false"]


def _tiny_run(cache: Path, out: Path) -> tuple[dict[str, int], str]:
    jax_own = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")  # tests/conftest.py's: the run must set its own
    env = {k: v for k, v in os.environ.items() if k not in jax_own}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=one_device_xla_flags(), **{compile_cache.ENV_VAR: str(cache)})
    result = subprocess.run([sys.executable, "-c", WRAPPER, *TINY_RUN, f"output_dir={out}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("CACHE_EVENTS ")][-1]
    return json.loads(line.split(" ", 1)[1]), result.stdout


@pytest.mark.slow
def test_a_second_run_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    first, printed = _tiny_run(cache, tmp_path / "run1")
    assert f"compilation cache: {cache} (train.compilation_cache)" in printed
    assert first.get("cache_misses", 0) > 5 and first.get("cache_hits", 0) == 0
    entries = set(os.listdir(cache))
    assert len(entries) >= first["cache_misses"]
    second, _ = _tiny_run(cache, tmp_path / "run2")
    assert second.get("cache_misses", 0) == 0, second  # nothing compiled again
    assert second["cache_hits"] == second["compile_requests_use_cache"] == first["compile_requests_use_cache"]
    assert set(os.listdir(cache)) == entries
