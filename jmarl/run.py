"""Command line: `python -m jmarl.run --config X.yaml [key=value ...]`.

Loads and validates the config, then hands it to `jmarl.train.trainer.train`. A `JmarlError`
(a mistake the user can fix) is printed as one line `error: <message>` on stderr, exit 2.

Before the trainer starts JAX's backends, a run sets three process-wide things
(`jmarl.process.prepare_process`; neither `import jmarl` nor loading a config sets any): the CPU
host memory policy where JAX runs on the CPU alone (JMARL_KEEP_HOST_MEMORY=0: off), the
persistent compilation cache `train.compilation_cache` names ("auto" by default, so a resumed or
repeated run loads its compiled programs instead of compiling them again), and the code
sandbox's isolation policy `sandbox.isolation`.

The command line also keeps third-party notices a user cannot act on out of its output
(`jmarl.process.quiet_third_party`: transformers' advisory notices; jmarl runs its models in
JAX, torch is only a test and benchmark extra). Warnings of jmarl's own (`warnings.warn`, e.g.
MemoryGroupSizeWarning) and every other warning are still shown.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from jmarl.config import Config, dump_yaml, load_config
from jmarl.errors import JmarlError
from jmarl.process import prepare_process, quiet_third_party

_TRAINER = "jmarl.train.trainer"  # the module whose train(config) runs; tests swap in a fake


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
