"""What a run sets for its whole process before JAX starts its backends (`prepare_process`).

Used by the command lines (`python -m jmarl.run`, `python -m jmarl.memory_check`) and by a
notebook that builds a `Trainer` itself; neither `import jmarl` nor loading a config sets any of
it: the CPU host memory policy (`jmarl.host_memory.apply_on_cpu`), the persistent compilation
cache `train.compilation_cache` names (`jmarl.compile_cache`), the code sandbox's isolation
policy `sandbox.isolation`, and quiet third-party notices (`quiet_third_party`).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from jmarl import compile_cache, host_memory, sandbox
from jmarl.config import Config
from jmarl.envs import base
from jmarl.errors import JmarlError

# Environment settings that silence third-party notices a user of the CLI cannot act on; set
# (unless the user set them) before anything imports the package that reads them.
QUIET_ENV = {
    # transformers' logger.warning_advice: "PyTorch was not found. Models won't be available ..."
    # on every import without torch, and its other advice-only notices
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def quiet_third_party() -> None:
    """Sets QUIET_ENV in os.environ where the user has not set the variable. Called by the
    command lines (`python -m jmarl.run`, `python -m jmarl.memory_check`), not by `import jmarl`."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)


def setup_compilation_cache(config: Config) -> str | None:
    """Turns on the persistent compilation cache `train.compilation_cache` names
    (`jmarl.compile_cache.directory_for`); returns its directory, None when off. A directory set
    explicitly that cannot be used is a JmarlError; the "auto" one only warns (on stderr) and
    the run goes on without a cache."""
    setting = str(config.train.compilation_cache)  # the config reads true/false as "auto"/"off"
    directory = compile_cache.directory_for(setting, config.output_dir)
    if directory is None:
        return None
    try:
        return compile_cache.enable(directory)
    except JmarlError as e:
        if setting != "auto":
            raise
        print(f"warning: {e}; running without a compilation cache", file=sys.stderr, flush=True)
        return None


def setup_sandbox(config: Config) -> None:
    """Sets the code sandbox's isolation policy to `sandbox.isolation`; for an env that runs
    model-written programs (one with a program or test timeout: the tool agents, the code task),
    checks the isolation level now, so that a refused level stops the run before it starts."""
    sandbox.set_isolation_policy(config.sandbox.isolation)
    cls = base.env_class(config.env.name)
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if fields & {"program_timeout_s", "test_timeout_s"}:
        sandbox.require_isolation(log=False)


def prepare_process(config: Config) -> tuple[str, str | None]:
    """What a run sets for the whole process before JAX starts its backends: the CPU host memory
    policy (`jmarl.host_memory.apply_on_cpu`: CPU-only JAX, unless JMARL_KEEP_HOST_MEMORY=0), the
    code sandbox's policy (`setup_sandbox`) and the compilation cache
    (`setup_compilation_cache`). Returns (host memory policy, cache directory or None) and prints
    them in one line when `logging.progress` is on. A notebook that builds a `Trainer` itself
    calls this first to run with the same settings as the command line."""
    policy = host_memory.apply_on_cpu()
    setup_sandbox(config)
    directory = setup_compilation_cache(config)
    if config.logging.progress:
        print(f"compilation cache: {directory or 'off'} (train.compilation_cache); host memory policy: {policy}",
              flush=True)
    return policy, directory
