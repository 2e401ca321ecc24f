"""What the CPU host memory policy (`jmarl.host_memory`) does to jmarl's GRPO iteration.

    python -m benchmarks.host_memory [--shapes cpu-small,cpu-medium] [--rounds 3] [--steps 8]

jmarl only. For each shape, `--rounds` x (policy off, policy on): a fresh process
(`JMARL_KEEP_HOST_MEMORY=0` / unset) builds the benchmark's GRPO trainer
(`benchmarks.iteration.jmarl_trainer`), runs 2 warm-up `rl_step`s and `--steps` timed ones, and
reports the medians of the trainer's `time/generate`, `time/update` and `time/step` and of the
minor page faults per step, and the process's peak resident memory (`peak_rss_mib`: the
policy's price, as freed memory stays with the process). Off and on alternate, so the machine's drift falls on both.
Writes `benchmarks/results/host_memory.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.common import results_end, results_header, write_checkpoint, write_json

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ("time/generate", "time/update", "time/step", "page_faults", "peak_rss_mib")
WARMUP = 2


def trainer_figures(shape: str, steps: int) -> dict[str, Any]:
    """In this process: medians over `steps` GRPO iterations (after WARMUP) of the per-step
    FIGURES, the process's peak resident set (MiB, Linux's ru_maxrss in KiB), and the policy this
    process runs under."""
    from benchmarks.iteration import jmarl_trainer
    from jmarl.host_memory import host_memory_policy

    rows = []
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(shape, os.path.join(d, "model"))
        trainer = jmarl_trainer(os.path.join(d, "model"), os.path.join(d, "out"), num_agents=1)
        for i in range(WARMUP + steps):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            metrics = trainer.rl_step()
            trainer.step += 1
            metrics["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if i >= WARMUP:
                rows.append(metrics)
    out: dict[str, Any] = {k: statistics.median(float(r[k]) for r in rows) for k in FIGURES if k != "peak_rss_mib"}
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["policy"] = host_memory_policy()
    return out


def run_child(shape: str, steps: int, policy_on: bool) -> dict[str, Any]:
    """`trainer_figures` in a fresh process with the policy on (the default) or off."""
    env = {k: v for k, v in os.environ.items() if k != "JMARL_KEEP_HOST_MEMORY"}
    if not policy_on:
        env["JMARL_KEEP_HOST_MEMORY"] = "0"
    out = subprocess.run([sys.executable, "-m", "benchmarks.host_memory", "--child", shape, "--steps", str(steps)],
                         env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(off: list[dict[str, Any]], on: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the median over rounds with the policy off and on, and on / off."""
    summary: dict[str, Any] = {}
    for k in FIGURES:
        a, b = statistics.median(r[k] for r in off), statistics.median(r[k] for r in on)
        summary[k] = {"off": a, "on": b, "on_over_off": b / a if a else None}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="cpu-small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--child", metavar="SHAPE", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "host_memory.json"))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(trainer_figures(args.child, args.steps)))
        return 0
    results: dict[str, Any] = {**results_header("benchmarks.host_memory", argv), "shapes": {}}
    for shape in args.shapes.split(","):
        off, on = [], []
        for r in range(args.rounds):
            off.append(run_child(shape, args.steps, False))
            on.append(run_child(shape, args.steps, True))
            print(f"[{shape} round {r}] off {off[-1]} on {on[-1]}", flush=True)
        summary = summarize(off, on)
        results["shapes"][shape] = {"off": off, "on": on, "summary": summary}
        print(f"[{shape}] " + ", ".join(f"{k} {v['off']:.4g} -> {v['on']:.4g}" for k, v in summary.items()), flush=True)
    results.update(results_end())
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from jmarl.host_memory import apply_on_cpu

    apply_on_cpu()  # jmarl's CPU host memory policy, before JAX starts (JMARL_KEEP_HOST_MEMORY=0: off)
    raise SystemExit(main())
