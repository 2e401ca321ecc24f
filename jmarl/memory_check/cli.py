"""`python -m jmarl.memory_check`: does a run fit in device memory? Its own programs, compiled for N devices.

    python -m jmarl.memory_check --config configs/at_grpo/plan_path.yaml --devices 8 --device-memory 80GiB
    python -m jmarl.memory_check --config X.yaml model.preset=qwen3-8b mesh.fsdp=8 --devices 8 --json plan.json

What the figures are and are not: `jmarl.memory_check`'s docstring. The command line
builds `Trainer(config, abstract=True)`, the run exactly as training builds it with every array
a `jax.ShapeDtypeStruct`, and analyses `trainer.programs()`. A model.path that exists is
analysed from its config.json or GGUF metadata (no weights are read), any architecture jmarl
loads; one that does not exist but whose
directory name is a preset's (checkpoints/Qwen3-1.7B -> qwen3-1.7b) with that preset's shapes
(a note says so); a preset name (model.preset=qwen3-8b) with its shapes. Such models get the
built-in char tokenizer when none is given: token ids do not change memory.

Exit 0 when every program fits (or nothing was checked), 2 with one line on stderr when one
does not (naming it, its peak, the limit and the settings to change) or on bad input.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
from typing import Any, Callable, Sequence

from jmarl.config import (
    apply_override,
    check_preset_name,
    config_from_dict,
    parse_bytes,
    read_yaml_file,
)
from jmarl.errors import JmarlError
from jmarl.memory_check.figures import analyse_all, device_memory_of, format_size, over_limit, table
from jmarl.process import quiet_third_party, setup_compilation_cache


def _gguf_file(path: str) -> str | None:
    """The local .gguf file `path` names: itself, or a registered model name's cached file
    (`jmarl.models.fetch`; planning downloads nothing); None otherwise."""
    from jmarl.models import fetch

    if path in fetch.MODELS and not os.path.exists(path):
        path = str(fetch.cached_path(path))
    return path if os.path.isfile(path) and path.lower().endswith(".gguf") else None


def resolve_models(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A config dict whose models the planner can build without reading weights, and notes
    saying what was done: an existing model.path (a checkpoint directory, a GGUF file, a cached
    registered model) is kept, and the abstract trainer reads only its architecture
    (`jmarl.train.policies.build_model(abstract=True)`); a missing one -> the preset its
    directory name matches (JmarlError when none does). A preset model without a usable
    tokenizer directory gets the char tokenizer (token ids do not change memory)."""
    from jmarl.models.presets import preset_for_checkpoint_name, preset_names

    data = copy.deepcopy(data)
    notes: list[str] = []

    def fix(holder: dict[str, Any], where: str, tok_key: str, tok_holder: dict[str, Any]) -> None:
        spec = holder.get("model")
        if not isinstance(spec, dict):
            return
        path, preset = spec.get("path"), spec.get("preset")
        tok = tok_holder.get(tok_key)
        if isinstance(preset, str):
            check_preset_name(preset, f"{where}.preset")
        elif path is not None and os.path.isdir(str(path)):
            notes.append(f"{where}.path {path}: planned from its config.json (no weights read)")
            return
        elif path is not None and (gguf := _gguf_file(str(path))) is not None:
            spec["path"] = gguf
            notes.append(f"{where}.path {path}: planned from its GGUF metadata (no weights read)")
            return
        elif path is not None:
            name = preset_for_checkpoint_name(str(path))
            if name is None:
                raise JmarlError(
                    f"{where}.path {path!r} does not exist and its name matches no preset "
                    f"({', '.join(preset_names())}); point it at a local checkpoint or set {where}.preset to a preset name"
                )
            spec["path"], spec["preset"] = None, name
            notes.append(f"{where}.path {path} not found: planning with preset {name}'s shapes")
        else:
            return
        if tok is None or (tok != "char" and not os.path.isdir(str(tok))):
            tok = "char"
        tok_holder[tok_key] = tok

    fix(data, "model", "tokenizer", data)
    policies = data.get("policies")
    if isinstance(policies, dict) and isinstance(policies.get("models"), dict):
        for name, entry in policies["models"].items():
            if isinstance(entry, dict):
                fix(entry, f"policies.models.{name}.model", "tokenizer", entry)
    return data, notes


def load_config_for_check(path: str, overrides: Sequence[str]) -> tuple[Any, list[str]]:
    """(validated Config, notes): the YAML file with its overrides, models resolved for planning."""
    data = read_yaml_file(path)
    for override in overrides:
        data = apply_override(data, override)
    data, notes = resolve_models(data)
    return config_from_dict(data), notes


def _use_devices(count: int | None) -> bool:
    """Simulates `count` CPU devices when JAX has not started yet (sets XLA_FLAGS and
    JAX_PLATFORMS); returns whether they are simulated. A JAX already started in this process
    must already have `count` devices."""
    if count is None:
        return False
    if count < 1:
        raise JmarlError(f"--devices must be >= 1, got {count}")
    started = "jax" in sys.modules and sys.modules["jax"]._src.xla_bridge.backends_are_initialized()
    if started:
        import jax

        if jax.device_count() != count or jax.default_backend() != "cpu":
            raise JmarlError(
                f"--devices {count}: JAX already runs here with {jax.device_count()} {jax.default_backend()} devices; "
                "run python -m jmarl.memory_check in a fresh process"
            )
        return True
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ warnings (SPMD resharding notes) stay off stderr
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jmarl.memory_check",
        description="Compile a run's programs for N devices and report XLA's memory per device.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  python -m jmarl.memory_check --config configs/at_grpo/plan_path.yaml --devices 8 --device-memory 80GiB\n"
            "  python -m jmarl.memory_check --config X.yaml model.preset=qwen3-8b mesh.fsdp=8 --devices 8 --json plan.json"
        ),
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="YAML run config")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="simulate N CPU devices (default: this machine's devices)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="memory per device, e.g. 80GiB (default: train.device_memory, else the device's)")
    parser.add_argument("--headroom", type=float, default=None,
                        help="fraction kept free (default: train.memory_headroom, else 0.1)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every figure (bytes) as JSON")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return parser


def run_check(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """The CLI's work after parsing; raises JmarlError for bad input."""
    simulated = _use_devices(args.devices)
    config, notes = load_config_for_check(args.config, args.overrides)
    for note in notes:
        say(f"note: {note}")
    import jax

    setup_compilation_cache(config)  # train.compilation_cache: a repeated plan loads its programs

    from jmarl.sharding import axis_sizes, format_mesh, mesh_from_config
    from jmarl.train.remat_plan import plan_remat
    from jmarl.train.trainer import Trainer

    devices = jax.devices()
    mesh = mesh_from_config(config.mesh, devices=devices)
    t = config.train
    headroom = args.headroom if args.headroom is not None else t.memory_headroom
    if not 0.0 <= headroom < 1.0:
        raise JmarlError(f"--headroom must be in [0, 1), got {headroom}")
    setting = args.device_memory if args.device_memory is not None else t.device_memory
    device_memory, source = device_memory_of(None if setting is None else parse_bytes(setting))
    say(f"memory check: {args.config} on {len(devices)} {jax.default_backend()} device(s)"
        f"{' (simulated)' if simulated else ''}, mesh {format_mesh(axis_sizes(mesh))}")
    t0 = time.perf_counter()
    trainer = Trainer(config, abstract=True)
    say(f"built the abstract run in {time.perf_counter() - t0:.1f} s; compiling its programs")
    measured: dict = {}  # the planner's figures of the chosen policies: not compiled twice
    if device_memory is not None:  # model.remat auto: the least recompute that fits (jmarl.train.remat_plan)
        plan_remat(trainer, device_memory, headroom, progress=say, measured=measured)
    figures = analyse_all(trainer.programs(), progress=say, known=measured)
    limit = None if device_memory is None else device_memory * (1.0 - headroom)
    say("")
    say(table(figures, limit))
    message = None
    if device_memory is None:
        say("no device memory limit was checked: pass --device-memory (e.g. 80GiB) or set train.device_memory")
    else:
        message = over_limit(figures, device_memory, headroom)
        worst = max(figures, key=lambda f: f.peak)
        say(f"device memory {format_size(device_memory)} ({source}) less {headroom:.0%} headroom: "
            f"{format_size(limit)} per device; largest peak {format_size(worst.peak)} ({worst.label}): "
            + ("does not fit" if message else "fits"))
    if args.json:
        doc = {
            "config": args.config, "overrides": list(args.overrides), "notes": notes,
            "devices": len(devices), "platform": jax.default_backend(), "simulated": simulated,
            "mesh": axis_sizes(mesh), "jax_version": jax.__version__,
            "remat": {g.name: g.model_config.remat for g in trainer.policies.groups},
            "device_memory": device_memory, "headroom": headroom,
            "limit": None if limit is None else int(limit),
            "fits": None if device_memory is None else message is None,
            "peak": max(f.peak for f in figures),
            # the program of the largest peak, and the fraction of the device's memory it leaves
            "peak_program": max(figures, key=lambda f: f.peak).program,
            "left": None if device_memory is None else 1.0 - max(f.peak for f in figures) / device_memory,
            "programs": [f.to_json() for f in figures],
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
        say(f"wrote {args.json}")
    if message:
        raise JmarlError(message)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 fits, 2 does not fit or bad input)."""
    quiet_third_party()
    args = _parser().parse_intermixed_args(argv)
    try:
        return run_check(args, lambda line: print(line, flush=True))
    except JmarlError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
