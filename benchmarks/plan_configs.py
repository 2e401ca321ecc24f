"""Per-device memory of the paper-scale configs and of the presets at 1, 8 and 64 devices, by
`python -m jmarl.memory_check` (XLA's compiled memory analysis on simulated CPU devices).

    python -m benchmarks.plan_configs [--out benchmarks/results/plan] [--only NAME ...]

Each row runs `python -m jmarl.memory_check --config X --devices N --device-memory 80GiB --json ...` in
its own process (the device count is fixed when JAX starts) and records its JSON, with the
command, the UTC date it started and the git commit; the table gives each run's largest peak per
device (program and figure), the headroom left of 80 GiB, and whether it fits with the plan's 10%
margin. Rows: the paper configs on 8 devices, the Qwen3 presets on 1, 8 and 64, Gemma 3 4B on 1 and
27B on 8 and 64, Qwen3-30B-A3B (experts split over fsdp) on 8, 64 and 256 (`MOE`), and four LoRA agents on
one Qwen3-1.7B base on one device (docs/scaling.md, "Per-agent LoRA"), planned on this checkout
and, for the merged column, on the package of commit 8c0b154 (`MERGED_LORA`: the last one whose
`attach_lora` merged each adapter into a full weight copy; the current code has no merged mode):
its files are exported with `git archive` into a temporary directory, the checkout's config
copied beside them (it postdates that commit), and the plan command runs there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO_ROOT, git_state, utc_now
from jmarl import provenance

PAPER_CONFIGS = (
    "at_grpo/plan_path", "at_grpo/sokoban", "at_grpo/sudoku", "at_grpo/math", "at_grpo/code",
    "grpo/plan_path", "dr_grpo/plan_path", "dapo/plan_path", "gspo/plan_path",
    "magrpo/writing", "magrpo/code", "hacpo/math", "joyagents/router",
)
# (name, config file, devices, overrides[, commit]): the presets on the AT-GRPO Plan-Path run (2 policies)
SCALING = tuple(
    (f"{preset}@{devices}", "configs/at_grpo/plan_path.yaml", devices,
     (f"model.preset={preset}", "model.path=null", "tokenizer=char"))
    for preset in ("qwen3-1.7b", "qwen3-8b") for devices in (1, 8, 64)
) + tuple(
    # Gemma 3: a 262k vocabulary and 5 sliding-window layers in 6, on the same run
    (f"{preset}@{devices}", "configs/at_grpo/plan_path.yaml", devices,
     (f"model.preset={preset}", "model.path=null", "tokenizer=char"))
    for preset, devices in (("gemma3-4b", 1), ("gemma3-27b", 8), ("gemma3-27b", 64))
) + tuple(
    # ... and the settings the plan's error points to that make each fit
    (f"{preset}@{devices}+{tag}", "configs/at_grpo/plan_path.yaml", devices,
     (f"model.preset={preset}", "model.path=null", "tokenizer=char", *settings))
    for preset, devices, tag, settings in (
        ("gemma3-4b", 1, "lora", ("policies.mode=lora", "optim.grad_accum=8", "workflow.num_tasks=16")),
        ("gemma3-27b", 8, "lora", ("policies.mode=lora", "optim.grad_accum=16", "sampling.max_rows_per_call=128")),
        ("gemma3-27b", 64, "accum4", ("optim.grad_accum=4",)),
        # what fills the one-device update: its temporaries against the micro-batch's tokens
        ("qwen3-1.7b", 1, "accum2", ("optim.grad_accum=2",)),
        ("qwen3-1.7b", 1, "accum4", ("optim.grad_accum=4",)),
    )
)
# Qwen3-30B-A3B (128 experts, top-8) on the same AT-GRPO run, experts split over fsdp (expert
# parallelism, docs/scaling.md "Mixture of experts"): two full policies on 64 and 256 devices
# (256: data=2 x fsdp=128, since fsdp must divide the 128 experts; and fsdp=256 as configured,
# where it cannot, so the experts are FSDP-sharded on D: the comparison), on 8 devices the two
# full policies (their float32 parameters and Adam moments alone are 85 GiB a device) and LoRA
# adapters on one base, as configured and with the micro-batches halved (what the plan's error
# names first)
MOE_CONFIG = "benchmarks/configs/at_grpo_qwen3_30b_a3b.yaml"
MOE = tuple((name, MOE_CONFIG, devices, settings) for name, devices, settings in (
    ("qwen3-30b-a3b@8", 8, ()),
    ("qwen3-30b-a3b@8+lora", 8, ("policies.mode=lora",)),
    ("qwen3-30b-a3b@8+lora,accum2", 8, ("policies.mode=lora", "optim.grad_accum=2")),
    ("qwen3-30b-a3b@64", 64, ()),
    ("qwen3-30b-a3b@256", 256, ("mesh.data=2", "mesh.fsdp=128")),
    ("qwen3-30b-a3b@256+fsdp256", 256, ()),
))
LORA_CONFIG = "benchmarks/configs/lora_4agents_qwen3_1.7b.yaml"
MERGED_LORA = "8c0b154"  # the last commit whose attach_lora merged every adapter into a weight copy
LORA = (("lora_4agents_qwen3_1.7b", LORA_CONFIG, 1, ()),
        ("lora_4agents_qwen3_1.7b_merged", LORA_CONFIG, 1, (), MERGED_LORA))
DEVICE_MEMORY = "80GiB"


def plan(config: str, devices: int, overrides: tuple[str, ...], out: Path, commit: str | None = None) -> dict:
    """Runs the plan command for one row (`config`: the config file) on this checkout, or with
    `commit` on that commit's files (module docstring); returns its JSON record plus the exit
    code, the command, the UTC date it started and the code it planned with."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    with tempfile.TemporaryDirectory() as tmp:
        if commit is None:
            where, code = REPO_ROOT, git_state()
        else:
            where, code = tmp, {"commit": commit, "dirty": False, "config_from": git_state()}
            archive = subprocess.run(["git", "archive", commit], cwd=REPO_ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            os.makedirs(os.path.join(tmp, os.path.dirname(config)), exist_ok=True)
            shutil.copy(os.path.join(REPO_ROOT, config), os.path.join(tmp, config))
        # the memory check's command: jmarl.memory_check, jmarl.plan on commits before it was named so
        module = "jmarl.memory_check" if os.path.isdir(os.path.join(where, "jmarl", "memory_check")) else "jmarl.plan"
        cmd = [sys.executable, "-m", module, "--config", config, *overrides,
               "--devices", str(devices), "--device-memory", DEVICE_MEMORY, "--json", str(out)]
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=where)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=where)
    if not out.exists():
        raise SystemExit(f"{' '.join(cmd)} wrote no JSON (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    record = json.loads(out.read_text())
    record["exit_code"] = proc.returncode
    record["command"] = f"python -m {module} " + " ".join(cmd[3:-2])
    record["date"] = started
    record["git"] = code
    # what made the figure: the memory check on this checkout, or on a clean copy of `commit`
    record[provenance.KEY] = provenance.record(record["command"])
    if commit is not None:
        record[provenance.KEY].update(commit=commit, dirty=False, diff=None)
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
    rows = [(c, f"configs/{c}.yaml", 8, ()) for c in PAPER_CONFIGS] + list(SCALING) + list(MOE) + list(LORA)
    lines = ["| run | devices | mesh | largest peak per device | headroom of 80 GiB | fits (plan exit 0) |",
             "|---|---|---|---|---|---|"]
    for name, config, devices, overrides, *commit in rows:
        if args.only and name not in args.only:
            continue
        print(f"planning {name} on {devices} devices ...", file=sys.stderr, flush=True)
        record = plan(config, devices, overrides, Path(args.out) / (name.replace("/", "_") + ".json"), *commit)
        lines.append(row(name, record))
        print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
