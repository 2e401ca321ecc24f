"""Per-device memory of the paper-scale configs and of the presets at 1, 8 and 64 devices, by
`python -m jmarl.plan` (XLA's compiled memory analysis on simulated CPU devices).

    python -m benchmarks.plan_configs [--out benchmarks/results/plan] [--only NAME ...]

Each row runs `python -m jmarl.plan --config X --devices N --device-memory 80GiB --json ...` in
its own process (the device count is fixed when JAX starts) and records its JSON; the table
gives each run's largest peak per device (program and figure), the headroom left of 80 GiB,
and whether it fits with the plan's 10% margin.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PAPER_CONFIGS = (
    "at_grpo/plan_path", "at_grpo/sokoban", "at_grpo/sudoku", "at_grpo/math", "at_grpo/code",
    "grpo/plan_path", "dr_grpo/plan_path", "dapo/plan_path", "gspo/plan_path",
    "magrpo/writing", "magrpo/code", "hacpo/math", "joyagents/router",
)
# (name, config, devices, overrides): the presets on the AT-GRPO Plan-Path run (2 policies)
SCALING = tuple(
    (f"{preset}@{devices}", "at_grpo/plan_path", devices, (f"model.preset={preset}", "model.path=null", "tokenizer=char"))
    for preset in ("qwen3-1.7b", "qwen3-8b") for devices in (1, 8, 64)
)
DEVICE_MEMORY = "80GiB"


def plan(config: str, devices: int, overrides: tuple[str, ...], out: Path) -> dict:
    """Runs the plan command for one row; returns its JSON record plus the exit code."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "jmarl.plan", "--config", f"configs/{config}.yaml", *overrides,
           "--devices", str(devices), "--device-memory", DEVICE_MEMORY, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if not out.exists():
        raise SystemExit(f"{' '.join(cmd)} wrote no JSON (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    record = json.loads(out.read_text())
    record["exit_code"] = proc.returncode
    record["command"] = "python -m jmarl.plan " + " ".join(cmd[3:-2])
    out.write_text(json.dumps(record, indent=2))
    return record


def row(name: str, record: dict) -> str:
    """One markdown row: the largest peak per device and where it is."""
    gib = 2.0**30
    top = max(record["programs"], key=lambda p: p["peak"])
    limit = 80 * gib
    headroom = 100.0 * (1 - top["peak"] / limit)
    mesh = ",".join(f"{k}={v}" for k, v in record["mesh"].items() if v != 1) or "1 device"
    return (f"| {name} | {record['devices']} | {mesh} | {top['peak'] / gib:.1f} GiB ({top['program']}) | "
            f"{headroom:.0f}% | {'yes' if record['exit_code'] == 0 else 'no'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_configs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/plan")
    parser.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    args = parser.parse_args(argv)
    rows = [(c, c, 8, ()) for c in PAPER_CONFIGS] + list(SCALING)
    lines = ["| run | devices | mesh | largest peak per device | headroom of 80 GiB | fits (plan exit 0) |",
             "|---|---|---|---|---|---|"]
    for name, config, devices, overrides in rows:
        if args.only and name not in args.only:
            continue
        print(f"planning {name} on {devices} devices ...", file=sys.stderr, flush=True)
        record = plan(config, devices, overrides, Path(args.out) / (name.replace("/", "_") + ".json"))
        lines.append(row(name, record))
        print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
