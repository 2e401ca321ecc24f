"""Held-out success of an untrained checkpoint on every task jmarl ships, greedy and sampled.

    python scripts/base_success.py                           # SmolLM2-135M-Instruct, every task
    python scripts/base_success.py --tasks math_d1 router    # some tasks only
    python scripts/base_success.py --render                  # the table again from the JSON
    python scripts/base_success.py --table tiers --tasks add_small add_two_digit two_ops \
        --episodes 128 --max-new-tokens 48                   # a second table of other settings

Each cell (task, decoding) builds the trainer of the task's config with the model swapped in
(float32, one shared policy for every agent, no warm start) and runs its held-out evaluation
(`Trainer.evaluate`: the env's eval seeds, the model's own chat template) greedily or at
temperature 1. results/base_success_<model>.json is rewritten after every cell with the commit
the cell ran on, its settings, seconds and every eval/* figure; a cell already there for the same
code and settings is not run again, so an interrupted table continues where it stopped. The
table goes into docs/models.md between `<!-- base-success:<model>:start -->` and its `end` marker.
`--table NAME` keeps a table of other settings beside it (results/base_success_<model>_<NAME>.json,
markers `<!-- base-success:<model>:<NAME>:start -->`); a table lists the tasks it has cells of.
A checkpoint without a chat template (gemma3-270m) takes `--chat-template` (`model.chat_template`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from jmarl import provenance  # noqa: E402

# name -> (config, overrides, what the cell is)
TASKS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "math_d1": ("configs/at_grpo/math.yaml", ("env.options.difficulty=1",), "math, difficulty 1 (tool + reasoner)"),
    "math_d2": ("configs/at_grpo/math.yaml", ("env.options.difficulty=2",), "math, difficulty 2"),
    "math_d3": ("configs/at_grpo/math.yaml", ("env.options.difficulty=3",), "math, difficulty 3"),
    "math_d1_reasoner": ("configs/at_grpo/math.yaml", ("env.options.difficulty=1", "env.options.agents=[reasoner]"),
                         "math, difficulty 1, the reasoner alone"),
    "math_one_digit": ("configs/at_grpo/math.yaml",
                       ("env.options.agents=[solver]", "env.options.max_turns=1",
                        "env.options.path=configs/hacpo/data/one_digit.jsonl"),
                       "one-digit addition, one solver (HACPO's CPU task)"),
    "plan_path_4": ("configs/at_grpo/plan_path.yaml", ("env.options.size=4",), "Plan-Path 4x4 (tool + planner)"),
    "plan_path_5": ("configs/at_grpo/plan_path.yaml", ("env.options.size=5",), "Plan-Path 5x5"),
    "sudoku_4": ("configs/at_grpo/sudoku.yaml", ("env.options.size=4",), "Sudoku 4x4 (tool + planner)"),
    "router": ("configs/joyagents/router.yaml", (), "Router (master + sub-agents)"),
    "writing": ("configs/magrpo/writing.yaml", (), "Writing (two writers)"),
    "code": ("configs/at_grpo/code.yaml", (), "code (coder + tester)"),
    # the arithmetic tiers of the real-model recipe (one solver, one turn; 128+ distinct held-out problems)
    "add_small": ("configs/real/grpo_add_full.yaml", (), "two-operand addition, operands 0-49 (the recipe's task)"),
    "add_two_digit": ("configs/real/grpo_add_full.yaml", ("env.options.tier=add_two_digit",),
                      "two-operand addition, two-digit operands"),
    "two_ops": ("configs/real/grpo_add_full.yaml", ("env.options.tier=two_ops",), "two operations"),
    "add_small_4shot": ("configs/real/grpo_add_full.yaml", ("env.options.examples=4",),
                        "two-operand addition, operands 0-49, 4 solved examples in the prompt"),
    "two_ops_4shot": ("configs/real/grpo_add_full.yaml", ("env.options.tier=two_ops", "env.options.examples=4"),
                      "two operations, 4 solved examples in the prompt"),
}
DECODING = {"greedy": ("eval.greedy=true",), "t1": ("eval.greedy=false", "sampling.temperature=1.0")}


def settings_overrides(model: str, episodes: int, max_new_tokens: int, chat_template: str | None = None) -> list[str]:
    """The overrides every cell shares: the model (and its prompt format, `model.chat_template`,
    when given), float32, one shared policy, no warm start."""
    template = [] if chat_template is None else [f"model.chat_template={chat_template}"]
    return [f"model.path={model}", *template, "model.compute_dtype=float32", "model.param_dtype=float32",
            "policies.mode=shared", "policies.agent_to_policy={}", "train.warm_start.steps=0",
            f"eval.num_episodes={episodes}", f"sampling.max_new_tokens={max_new_tokens}",
            "sampling.max_prompt_len=1024", "mesh={}", "logging.tensorboard=false", "logging.plots=false",
            "logging.progress=false"]


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "jmarl", "configs"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_cell(config_path: str, overrides: list[str]) -> dict:
    """The held-out evaluation of an untrained trainer built from `config_path` + `overrides`."""
    from jmarl.config import load_config
    from jmarl.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        config = load_config(ROOT / config_path, [*overrides, f"output_dir={out}"])
        t0 = time.perf_counter()
        trainer = Trainer(config)
        built = time.perf_counter() - t0
        metrics = trainer.evaluate()
        seconds = time.perf_counter() - t0
    return {"metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
            "build_seconds": built, "seconds": seconds}


def render(result: dict) -> str:
    """The markdown table: success greedy / at T=1 per task, with 95% Wilson intervals."""
    cells = result["cells"]
    lines = [f"Held-out success of the untrained {result['model']} ({result['episodes']} episodes per cell, "
             f"at most {result['max_new_tokens']} new tokens per turn"
             + (f", prompts in the `{result['chat_template']}` chat template" if result.get("chat_template") else "")
             + "; `python scripts/base_success.py`, "
             f"commits {', '.join(sorted({c['commit'] for c in cells.values()}))}):", "",
             "| task | greedy [95% interval] | temperature 1 | seconds (greedy + T=1) |", "|---|---|---|---|"]
    for name, (_, _, what) in TASKS.items():
        if not any(f"{name}/{dec}" in cells for dec in DECODING):
            continue
        row = [what]
        secs = 0.0
        for dec in DECODING:
            cell = cells.get(f"{name}/{dec}")
            if cell is None:
                row.append("not run")
                continue
            p = cell["metrics"].get("eval/success_rate", float("nan"))
            lo, hi = wilson(p, result["episodes"])
            row.append(f"{100 * p:.1f}% [{100 * lo:.0f}-{100 * hi:.0f}]")
            secs += cell["seconds"]
        row.append(f"{secs:.0f}" if secs else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate p over n episodes."""
    if not n or math.isnan(p):
        return float("nan"), float("nan")
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def write_docs(table: str, model: str, docs: Path = ROOT / "docs" / "models.md", name: str | None = None) -> None:
    """`table` into `docs` between the markers `<!-- base-success:<model>[:<name>]:start/end -->`
    (appended under a heading of its own the first time)."""
    text = docs.read_text()
    key = model if name is None else f"{model}:{name}"
    start, end = f"<!-- base-success:{key}:start -->", f"<!-- base-success:{key}:end -->"
    if start not in text:
        title = model if name is None else f"{model} ({name})"
        text = text.rstrip("\n") + f"\n\n## Base success of {title}\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    docs.write_text(head + start + "\n" + table + "\n" + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--decoding", nargs="+", default=list(DECODING), choices=list(DECODING))
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--chat-template", default=None,
                        help="model.chat_template for a checkpoint without its own (e.g. gemma for gemma3-270m)")
    parser.add_argument("--render", action="store_true", help="only re-render the table from the JSON")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="start a new table when the settings differ")
    parser.add_argument("--table", default=None, help="a named table of its own settings beside the model's main one")
    args = parser.parse_args(argv)
    path = ROOT / "results" / f"base_success_{args.model}{'' if args.table is None else '_' + args.table}.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    same = (result.get("model"), result.get("episodes"), result.get("max_new_tokens"), result.get("chat_template")) == (
        args.model, args.episodes, args.max_new_tokens, args.chat_template)
    if not same and result.get("cells") and not args.fresh:
        sys.exit(f"{path} holds cells run with {result.get('episodes')} episodes, at most "
                 f"{result.get('max_new_tokens')} new tokens and chat template {result.get('chat_template')}; pass "
                 "those settings to continue it, or --fresh "
                 "to start a new table (its cells are then dropped)")
    if not same:
        result = {"model": args.model, "episodes": args.episodes, "max_new_tokens": args.max_new_tokens,
                  "chat_template": args.chat_template, "cells": {}}
    if not args.render:
        code = commit()
        shared = settings_overrides(args.model, args.episodes, args.max_new_tokens, args.chat_template)
        for name in args.tasks:
            config_path, task_overrides, _ = TASKS[name]
            for dec in args.decoding:
                key = f"{name}/{dec}"
                overrides = [*shared, *task_overrides, *DECODING[dec]]
                old = result["cells"].get(key)
                if old and old["commit"] == code and old["overrides"] == overrides:
                    continue
                print(f"[{key}] {config_path} ...", flush=True)
                cell = run_cell(config_path, overrides)
                cell.update(commit=code, config=config_path, overrides=overrides,
                            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
                result["cells"][key] = cell
                result[provenance.KEY] = provenance.record(["python", "scripts/base_success.py", *(argv or sys.argv[1:])])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=1) + "\n")
                print(f"[{key}] success {cell['metrics'].get('eval/success_rate', float('nan')):.3f} "
                      f"in {cell['seconds']:.0f} s", flush=True)
    table = render(result)
    print(table)
    if not args.no_docs:
        write_docs(table, args.model, name=args.table)


if __name__ == "__main__":
    main()
