"""Runs the quickstart for several seeds and tabulates held-out success before/after RL.

    python scripts/quickstart_seeds.py                       # seeds 0 1 2 -> results/quickstart_seeds.json
    python scripts/quickstart_seeds.py --seeds 0 1 --out /tmp/qs.json train.steps=10
    python scripts/quickstart_seeds.py --jobs 3             # all seeds at once (timings then shared)

Each seed is one `python -m jmarl.run --config configs/quickstart.yaml seed=S
output_dir=runs/quickstart_seeds/seed_S [overrides]` in its own process (so the wall and CPU
seconds reported are those of a user's run, compilation included). The JSON holds per seed
success_before (after the warm start), success_after, their difference, wall and CPU seconds,
and the mean / sample std over seeds of each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("success_before", "success_after", "improvement", "wall_seconds", "cpu_seconds")


def start_seed(seed: int, config: str, out_root: Path, overrides: list[str]) -> subprocess.Popen:
    """Starts one quickstart run (seed `seed`) in a child process."""
    cmd = [sys.executable, "-m", "jmarl.run", "--config", config, f"seed={seed}",
           f"output_dir={out_root / f'seed_{seed}'}", "resume=false", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def finish_seed(seed: int, proc: subprocess.Popen, started: float, out_root: Path) -> dict[str, float]:
    """Waits for the run; its summary plus wall and CPU (user + system) seconds of that process."""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:  # recorded, so the other seeds' results are still written (-9: killed, e.g. out of memory)
        return {"seed": seed, "error": f"exit status {code}", "wall_seconds": round(wall, 1),
                "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1)}
    summary = json.loads((out_root / f"seed_{seed}" / "summary.json").read_text())
    return {
        "seed": seed,
        "success_before": summary["success_before"],
        "success_after": summary["success_after"],
        "improvement": summary["success_after"] - summary["success_before"],
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
    }


def run_seeds(seeds: list[int], config: str, out_root: Path, overrides: list[str], jobs: int) -> list[dict]:
    """Runs the seeds, `jobs` at a time, in order; one result row per seed."""
    rows, pending = [], list(seeds)
    while pending:
        batch, pending = pending[:jobs], pending[jobs:]
        running = [(s, start_seed(s, config, out_root, overrides), time.perf_counter()) for s in batch]
        rows += [finish_seed(s, proc, t0, out_root) for s, proc, t0 in running]
    return rows


def aggregate(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean and sample standard deviation (0 for one row) of every field over the rows."""
    out = {}
    rows = [r for r in rows if "error" not in r]
    if not rows:
        return out
    for f in FIELDS:
        values = [r[f] for r in rows]
        out[f] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--runs", default="runs/quickstart_seeds", help="parent of the per-seed output dirs")
    parser.add_argument("--out", default="results/quickstart_seeds.json")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (1: the timings of a lone run)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="passed on to every run")
    args = parser.parse_args(argv)
    rows = run_seeds(args.seeds, args.config, ROOT / args.runs, args.overrides, max(1, args.jobs))
    result = {
        "command": f"python -m jmarl.run --config {args.config} seed=S " + " ".join(args.overrides),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
                   f"{platform.python_version()}",
        "jobs": max(1, args.jobs),
        "seeds": rows,
        "aggregate": aggregate(rows),
    }
    path = ROOT / args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'seed':>4}  {'before':>7}  {'after':>7}  {'change':>7}  {'wall s':>7}  {'cpu s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['seed']:>4}  failed: {r['error']}")
            continue
        print(f"{r['seed']:>4}  {r['success_before']:7.3f}  {r['success_after']:7.3f}  {r['improvement']:+7.3f}  "
              f"{r['wall_seconds']:7.0f}  {r['cpu_seconds']:7.0f}")
    a = result["aggregate"]
    if not a:
        print(f"every run failed; wrote {path}")
        return 1
    print(f"mean  {a['success_before']['mean']:7.3f}  {a['success_after']['mean']:7.3f}  "
          f"{a['improvement']['mean']:+7.3f}  (std of change {a['improvement']['std']:.3f}); wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
