"""Row utilization of the static sampler on whole training runs (real rows / decoded rows).

    python -m benchmarks.row_utilization [--steps N] [--seeds 0 1] [--variants quickstart independent]
                                         [--overrides KEY=VALUE ...]

Runs `configs/quickstart.yaml` (per-agent AT-GRPO, tree sampling: a call per agent-turn of
E active episodes x K candidates, fewer rows once episodes end) and its `independent` variant
(`workflow.plan=independent`: each episode samples K trajectories) with the static sampler,
the config's warm start and steps (`--steps` overrides the RL steps), periodic evaluation and
checkpoints off, and reads `rollout/row_utilization` of every RL step from the run's
metrics.jsonl (`--overrides`: config overrides applied last, e.g. a shorter run for a smoke
test; recorded in the results). A call's rows are padded to `jmarl.padding.row_bucket` (four
buckets per doubling); the other padding, a stacked group's idle policy, is not decoded (a call
of one policy decodes that policy alone). Writes `benchmarks/results/row_utilization.json` with the
per-step values, their mean and minimum per run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks.common import results_end, results_header, write_json

VARIANTS = {
    "quickstart": [],
    "independent": ["workflow.plan=independent", "workflow.options={}"],
}


def run_variant(name: str, seed: int, steps: int | None, out_dir: str, extra: list[str] | None = None) -> dict:
    """Trains one variant and returns its per-step row utilization (`extra`: config overrides
    applied after the benchmark's own)."""
    from jmarl.config import load_config
    from jmarl.train.trainer import Trainer

    overrides = VARIANTS[name] + [
        f"seed={seed}", f"output_dir={out_dir}", "eval.every=0", "checkpoint.every=0",
        "logging.tensorboard=false", "logging.plots=false", "logging.progress=false",
    ] + ([f"train.steps={steps}"] if steps else []) + list(extra or [])
    start = time.perf_counter()
    Trainer(load_config("configs/quickstart.yaml", overrides)).run()
    seconds = time.perf_counter() - start
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    values = [r["rollout/row_utilization"] for r in rows if "rollout/row_utilization" in r]
    return {"variant": name, "seed": seed, "overrides": VARIANTS[name], "steps": len(values), "seconds": seconds,
            "mean": sum(values) / len(values), "min": min(values), "per_step": values}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides applied last (default: none)")
    args = parser.parse_args(argv)
    header = results_header("benchmarks.row_utilization", argv)  # date and load average at the start

    runs = []
    for name in args.variants:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                run = run_variant(name, seed, args.steps, tmp, args.overrides)
            runs.append(run)
            print(f"{name} seed {seed}: row utilization mean {run['mean']:.3f}, min {run['min']:.3f} "
                  f"over {run['steps']} RL steps ({run['seconds']:.0f} s)")
    result = {**header, **results_end(), "config": "configs/quickstart.yaml",
              "overrides": args.overrides, "runs": runs}
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "row_utilization.json")
    write_json(out, result)
    return result


if __name__ == "__main__":
    main()
