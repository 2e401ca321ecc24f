"""A persistent XLA compilation cache for runs: a resumed or repeated run loads its compiled
programs from disk instead of compiling them again.

`python -m jmarl.run` turns it on from `train.compilation_cache` (`directory_for`): "auto" (the
default) uses `default_directory()`, "off" leaves JAX's settings alone, anything else is the
directory. `enable(directory)` sets JAX's `jax_compilation_cache_dir` and drops its thresholds
(minimum compile time 0 s, no minimum entry size), so every program is cached, however quick to
compile or small.

"auto" picks, in order: $JMARL_COMPILATION_CACHE; a cache directory JAX is already given
(JAX_COMPILATION_CACHE_DIR, `jax_compilation_cache_dir`); $XDG_CACHE_HOME/jmarl/jax, else
~/.cache/jmarl/jax; where no home directory is known, <output_dir>/jax_cache. With JAX's own
switch off (JAX_ENABLE_COMPILATION_CACHE=false) "auto" is "off".

The cache is trusted code: do not share its directory with users you do not trust (JAX's
warning: whoever can write there can make the process run their code). Entries are keyed by the
program, the JAX/XLA version and the devices, so a JAX upgrade or another machine only misses.
"""

from __future__ import annotations

import os

from jmarl.errors import JmarlError

ENV_VAR = "JMARL_COMPILATION_CACHE"
SETTING = "train.compilation_cache"
_DIR_FLAG = "jax_compilation_cache_dir"
_ENABLE_FLAG = "jax_enable_compilation_cache"
# Cache every program: JAX's defaults skip those compiled in under 1 s. -1 also keeps JAX from
# raising the minimum entry size for the cache's filesystem.
_THRESHOLDS = {"jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": -1}


def default_directory(output_dir: str | None = None) -> str:
    """The per-user cache directory: $JMARL_COMPILATION_CACHE if set, else
    $XDG_CACHE_HOME/jmarl/jax, else ~/.cache/jmarl/jax; where no home directory is known (~ does
    not expand) and output_dir is given, <output_dir>/jax_cache. `~` in the result is expanded;
    nothing is created."""
    chosen = os.environ.get(ENV_VAR, "").strip()
    if chosen:
        return os.path.expanduser(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return os.path.join(os.path.expanduser(xdg), "jmarl", "jax")
    home = os.path.expanduser("~")
    if home == "~" and output_dir is not None:
        return os.path.join(output_dir, "jax_cache")
    return os.path.join(home, ".cache", "jmarl", "jax")


def jax_directory() -> str | None:
    """The cache directory JAX is already given (JAX_COMPILATION_CACHE_DIR or
    `jax.config.update("jax_compilation_cache_dir", ...)`), None when none."""
    import jax

    value = jax.config.values.get(_DIR_FLAG) if hasattr(jax.config, "values") else getattr(jax.config, _DIR_FLAG, None)
    return value or None


def directory_for(setting: str, output_dir: str | None = None) -> str | None:
    """The directory `train.compilation_cache` = setting means, None for "off": "auto" ->
    $JMARL_COMPILATION_CACHE if set, else the directory JAX is already given if any
    (`jax_directory`), else `default_directory(output_dir)` (None where JAX's own switch,
    JAX_ENABLE_COMPILATION_CACHE, is off); anything else is a path (~ expanded)."""
    setting = str(setting).strip()
    if setting == "off":
        return None
    if setting == "auto":
        if not _jax_cache_switched_on():  # JAX_ENABLE_COMPILATION_CACHE=false: the user said no
            return None
        if not os.environ.get(ENV_VAR, "").strip():
            given = jax_directory()
            if given:
                return given
        return default_directory(output_dir)
    if not setting:
        raise JmarlError(f"{SETTING}: must be 'auto', 'off' or a directory path, got ''")
    return os.path.expanduser(setting)


def enable(directory: str) -> str:
    """Creates `directory` and makes JAX cache every compiled program there from now on
    (`jax_compilation_cache_dir`, no minimum compile time or entry size); returns its absolute
    path. Call it before the programs are compiled: a program compiled earlier in the process is
    not written back. Raises JmarlError when the directory cannot be created or written."""
    import jax

    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise JmarlError(
            f"{SETTING}: cannot create the compilation cache directory {path} ({e.strerror or e}); "
            f"set {SETTING}=<a writable directory>, {ENV_VAR}=<a writable directory>, or {SETTING}=off"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise JmarlError(
            f"{SETTING}: the compilation cache directory {path} is not writable; "
            f"set {SETTING}=<a writable directory>, {ENV_VAR}=<a writable directory>, or {SETTING}=off"
        )
    previous, was_on = jax_directory(), _jax_cache_switched_on()
    for name, value in _THRESHOLDS.items():
        if name in jax.config.values:
            jax.config.update(name, value)
    if _ENABLE_FLAG in jax.config.values:
        jax.config.update(_ENABLE_FLAG, True)
    jax.config.update(_DIR_FLAG, path)
    if not was_on or (previous and os.path.abspath(previous) != path):
        _reset_jax_cache()  # JAX decides once whether and where to cache: let it decide again
    return path


def _jax_cache_switched_on() -> bool:
    """JAX's own switch for the persistent cache (`jax_enable_compilation_cache`, default on)."""
    import jax

    return bool(jax.config.values.get(_ENABLE_FLAG, True))


def _reset_jax_cache() -> None:
    """Makes JAX open its cache directory again on the next compile (a no-op where this JAX has
    no `reset_cache`)."""
    try:
        from jax.experimental.compilation_cache import compilation_cache
    except ImportError:
        return
    reset = getattr(compilation_cache, "reset_cache", None)
    if reset is not None:
        reset()
