"""Command line: `python -m jmarl.run --config X.yaml [key=value ...]`.

Loads and validates the config, then hands it to `jmarl.train.trainer.train`. A `JmarlError`
(a mistake the user can fix) is printed as one line `error: <message>` on stderr, exit 2.

Before the trainer starts JAX's backends, a run sets three process-wide things (`prepare_process`;
neither `import jmarl` nor loading a config sets any): the CPU host memory policy where JAX runs
on the CPU alone (`jmarl.host_memory.apply_on_cpu`; JMARL_KEEP_HOST_MEMORY=0: off), the
persistent compilation cache `train.compilation_cache` names (`jmarl.compile_cache`; "auto" by
default, so a resumed or repeated run loads its compiled programs instead of compiling them
again), and the code sandbox's isolation policy `sandbox.isolation` (`setup_sandbox`).

The command line also keeps third-party notices a user cannot act on out of its output
(`quiet_third_party`: transformers' "PyTorch was not found" and its other advisory notices;
jmarl runs its models in JAX, torch is only a test and benchmark extra). Warnings of jmarl's own
(`warnings.warn`, e.g. MemoryGroupSizeWarning) and every other warning are still shown.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Sequence

from jmarl import compile_cache, host_memory
from jmarl.config import Config, dump_yaml, load_config
from jmarl.errors import JmarlError

_TRAINER = "jmarl.train.trainer"  # the module whose train(config) runs; tests swap in a fake

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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jmarl.run",
        description="Train LLM agents with multi-agent RL from a YAML config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  python -m jmarl.run --config configs/quickstart.yaml\n"
            "  python -m jmarl.run --config configs/quickstart.yaml train.steps=10 optim.lr=1e-5\n"
            "  python -m jmarl.run --config configs/at_grpo/plan_path.yaml model.path=/models/Qwen3-1.7B "
            "--print-config"
        ),
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="YAML run config (see configs/)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the merged, validated config as YAML and exit"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, values parsed as YAML (train.steps=10)",
    )
    return parser


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
    from jmarl import sandbox
    from jmarl.envs import base

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


def run_training(config: Config) -> object:
    """`prepare_process(config)`, then `jmarl.train.trainer.train(config)` (imported here, so
    --print-config stays light)."""
    from jmarl.sharding import maybe_initialize_distributed

    prepare_process(config)  # before anything starts JAX's backends
    maybe_initialize_distributed(config)  # multi-host: before anything touches devices
    return importlib.import_module(_TRAINER).train(config)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    quiet_third_party()
    args = _parser().parse_intermixed_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(dump_yaml(config))
            return 0
        run_training(config)
    except JmarlError as e:
        message = " ".join(str(e).split("\n"))
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
