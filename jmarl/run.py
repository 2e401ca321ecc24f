"""Command line: `python -m jmarl.run --config X.yaml [key=value ...]`.

Loads and validates the config, then hands it to `jmarl.train.trainer.train`. A `JmarlError`
(a mistake the user can fix) is printed as one line `error: <message>` on stderr, exit 2.

Before the trainer starts JAX's backends, a run sets two process-wide things (`prepare_process`;
`import jmarl` sets neither): the CPU host memory policy where JAX runs on the CPU alone
(`jmarl.host_memory.apply_on_cpu`; JMARL_KEEP_HOST_MEMORY=0: off), and the persistent
compilation cache `train.compilation_cache` names (`jmarl.compile_cache`; "auto" by default, so a
resumed or repeated run loads its compiled programs instead of compiling them again).

The command line also keeps third-party notices a user cannot act on out of its output
(`quiet_third_party`: transformers' "PyTorch was not found" and its other advisory notices;
jmarl runs its models in JAX, torch is only a test and benchmark extra). Warnings of jmarl's own
(`warnings.warn`, e.g. MemoryGroupSizeWarning) and every other warning are still shown.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from jmarl import compile_cache, host_memory
from jmarl.config import Config, dump_yaml, load_config
from jmarl.errors import JmarlError

_TRAINER = "jmarl.train.trainer"


# Environment settings that silence third-party notices a user of the CLI cannot act on; set
# (unless the user set them) before anything imports the package that reads them.
QUIET_ENV = {
    # transformers' logger.warning_advice: "PyTorch was not found. Models won't be available ..."
    # on every import without torch, and its other advice-only notices
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def quiet_third_party() -> None:
    """Sets QUIET_ENV in os.environ where the user has not set the variable. Called by the
    command lines (`python -m jmarl.run`, `python -m jmarl.plan`), not by `import jmarl`."""
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
    setting = getattr(config.train, "compilation_cache", "auto")  # the field is new in jmarl.config
    setting = "auto" if setting is True else "off" if setting is False else str(setting)
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


def prepare_process(config: Config) -> tuple[str, str | None]:
    """What a run sets for the whole process before JAX starts its backends: the CPU host memory
    policy (`jmarl.host_memory.apply_on_cpu`: CPU-only JAX, unless JMARL_KEEP_HOST_MEMORY=0) and
    the compilation cache (`setup_compilation_cache`). Returns (host memory policy, cache
    directory or None) and prints them in one line when `logging.progress` is on."""
    policy = host_memory.apply_on_cpu()
    directory = setup_compilation_cache(config)
    if getattr(config.logging, "progress", True):
        print(f"compilation cache: {directory or 'off'} (train.compilation_cache); host memory policy: {policy}",
              flush=True)
    return policy, directory


def run_training(config: Config) -> object:
    """`prepare_process(config)`, then `jmarl.train.trainer.train(config)` (imported here, so
    --print-config stays light)."""
    from jmarl.sharding import maybe_initialize_distributed

    prepare_process(config)  # before anything starts JAX's backends
    maybe_initialize_distributed(config)  # multi-host: before anything touches devices
    try:
        trainer = importlib.import_module(_TRAINER)
    except ModuleNotFoundError as e:
        if e.name != _TRAINER:
            raise
        raise JmarlError(
            f"the trainer ({_TRAINER}) is not available in this checkout yet; "
            "the config is valid (check it with --print-config)"
        ) from None
    return trainer.train(config)


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
