"""Evidence tables: each method against its baselines, mean +- std over seeds, held-out tasks.

    python scripts/evidence.py quickstart              # the quickstart task: single agent, shared, per-agent, independent
    python scripts/evidence.py writing                 # MAGRPO on Writing: components before/after, aligned vs cross
    python scripts/evidence.py hacpo                   # HACPO vs GSPO / GSPO 2x, two tiny models
    python scripts/evidence.py joyagents               # JoyAgents-R1 on Plan-Path: memory on/off, top-K vs all
    python scripts/evidence.py joyagents_read          # its memory on a model warm-started with memory lines
    python scripts/evidence.py real                    # SmolLM2-135M-Instruct: AT-GRPO vs GRPO (hours)
    python scripts/evidence.py hacpo_real              # SmolLM2 + Gemma 3 270M: HACPO vs GSPO (hours)
    python scripts/evidence.py real_recipe --seeds 0 1 2 3 4 5   # GRPO on SmolLM2, full vs LoRA (hours)
    python scripts/evidence.py real_hard real_methods --seeds 0 1 2 3 4 5   # a harder task; AT-GRPO vs GRPO
    python scripts/evidence.py hacpo --seeds 0 --steps 2 --no-readme   # a smoke run
    python scripts/evidence.py hacpo --render          # the table again from results/evidence_hacpo.json
    python scripts/evidence.py quickstart hacpo --jobs 2 --background   # detached, resumable

A table is data (`Table`): a base config with dotted overrides, named variants (more dotted
overrides), the cells to report (a variant and a key of the run's summary.json, or the last
logged value of a metric in metrics.jsonl) and the paired comparisons that decide its claims.
Every (variant, seed) is one
`python -m jmarl.run --config <config> seed=S output_dir=... <base overrides> <variant overrides>`
process. Every variant runs on the same seeds (8 by default), so a comparison is paired: the
difference variant - baseline on each seed, its mean, a 95% percentile bootstrap interval of that
mean and the exact two-sided sign-flip p-value; a claim "holds" when the interval is above 0 and
p < 0.05 ("reversed" below 0), else it is "undecided" at this scale.

Runs are resumable: a run that finished writes `evidence_run.json` (its argv and the code it
ran on) beside its summary, and a later invocation with the same command on the same code reuses
it, so an interrupted table continues where it stopped (`--background` detaches, logging to
<runs>/evidence.log). `--jobs N` runs N at once, each pinned to its share of the CPUs; the runs
share one XLA compilation cache. The script writes results/evidence_<table>.json (per-seed raw
numbers, mean, sample std, the paired statistics' inputs, the exact overrides, wall and CPU
times, each run's code, versions; rewritten after every run) and the table in docs/evidence.md
between `<!-- evidence:<table>:start -->` and `<!-- evidence:<table>:end -->`.

Provenance: each run's row records the code it ran on (`code_state`: the git commit, a dirty
flag for uncommitted changes to the tracked files a run executes or reads, jmarl/, configs/ and
pyproject.toml, and a hash of those changes). A finished run (in its run directory or the
previous result JSON) is reused only when its code is the current code, where commits that
differ only outside `RUN_PATHS` are one code (`run_tree`); otherwise it runs again, or with
`--reuse-other-commits` it is reused and the table says it mixes code. Comparisons pair a seed's
runs on the same code, by the same rule. The table's header names the runs' code ("mixed: a (n
runs), b (m runs)" when they differ), not the renderer's. Rows of result JSONs written before
runs recorded their code take the JSON's `versions.git_commit` (the checkout's commit when the
JSON was written), labelled as such. The notes under a table are functions of its result
(`Facts`): every figure they quote is computed from the JSON when the table is rendered.

Held-out: every run's summary.json holds the evaluation on the env's held-out seeds
(`jmarl.envs.eval_seed`) before RL (after the warm start: `before_eval_*`) and after it
(`eval_*`). To add a table, add a `Table` to `TABLES`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jmarl import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METRICS_PREFIX = "metrics:"  # a key read from the last logged value in metrics.jsonl
MEAN_PREFIX = "mean:"  # a key read as the mean of every logged value in metrics.jsonl
STEP_PREFIX = "step:"  # `step:<n>:<m>`: m as logged at training step n in metrics.jsonl


# ----------------------------------------------------------------------------------------------
# table definitions


@dataclass(frozen=True)
class Variant:
    """One configuration of a table: a name (used in paths and the JSON), a label (README) and
    dotted `key=value` overrides applied after the table's base overrides."""

    name: str
    label: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Line:
    """A row or a column of the README table. A cell's variant comes from whichever of its row
    and column names one; its key is `column.key + row.key` (e.g. column "before_eval_" + row
    "info/ratio"). Keys are summary.json fields, or `metrics:<name>` for the last logged value
    of <name> in metrics.jsonl."""

    label: str
    key: str = ""
    variant: str | None = None


@dataclass(frozen=True)
class Comparison:
    """A note under the table: does `variant` beat `baseline` on `key` (higher is better)?
    When it does not, `why` (the supported hypothesis) is printed with the numbers."""

    variant: str
    baseline: str
    key: str
    what: str
    why: str = ""
    baseline_key: str | None = None  # the baseline's key when it differs (e.g. before_eval_...)


@dataclass(frozen=True)
class Table:
    """A table: `config` + `base` overrides, its variants, rows x columns of cells, notes."""

    name: str
    title: str
    config: str
    base: tuple[str, ...]
    variants: tuple[Variant, ...]
    rows: tuple[Line, ...]
    columns: tuple[Line, ...]
    comparisons: tuple[Comparison, ...] = ()
    notes: tuple[Callable[["Facts"], str], ...] = ()  # each: the note's text from the result (see Facts)
    digits: int = 2
    steps_key: str = "train.steps"
    fields: tuple[str, ...] = field(default=())  # extra summary/metrics keys kept in the JSON
    # long runs (hours): a run stopped midway continues from its last checkpoint when the table is
    # run again on the same code (`prepare_run_dir`), instead of starting over
    resume: bool = False
    # the README's sentence on this table, rendered from its result between
    # `<!-- evidence:<table>:readme:start/end -->` in README.md (None: the table has none)
    headline: Callable[["Facts"], str] | None = None

    def cells(self) -> list[tuple[Line, Line, str, str]]:
        """(row, column, variant name, key) of every cell, row-major."""
        out = []
        for row in self.rows:
            for col in self.columns:
                variant = row.variant or col.variant
                if variant is None or (row.variant and col.variant):
                    raise ValueError(f"{self.name}: cell ({row.label}, {col.label}) needs exactly one variant")
                out.append((row, col, variant, col.key + row.key))
        return out

    def keys_of(self, variant: str) -> list[str]:
        """Every key any cell or comparison reads from `variant`'s runs, plus `fields`."""
        keys = [k for _, _, v, k in self.cells() if v == variant]
        keys += [c.key for c in self.comparisons if variant == c.variant]
        keys += [c.baseline_key or c.key for c in self.comparisons if variant == c.baseline]
        return list(dict.fromkeys(keys + list(self.fields)))


class Missing(Exception):
    """A note asked for a figure the result does not have (a smoke run, a partial table): the
    note is left out."""


class Facts:
    """What a note may quote, computed from a table's result dict: paired statistics of its
    comparisons, per-seed values, means and spreads, run times, the base overrides. Missing
    figures raise `Missing`, which leaves the note out rather than printing a stale number."""

    def __init__(self, table: "Table", result: dict[str, Any]):
        self.table = table
        self.result = result

    def pair(self, variant: str, baseline: str, key: str | None = None) -> dict[str, Any]:
        """`paired_stats` of the table's comparison of `variant` against `baseline` (on `key`
        when the table compares them on several keys), plus `wins`: seeds where the variant is
        higher."""
        found = [c for c in self.table.comparisons
                 if c.variant == variant and c.baseline == baseline and (key is None or c.key == key)]
        if len(found) != 1:
            raise Missing(f"comparison {variant} vs {baseline} {key or ''}")
        pairs = paired_values(self.result, found[0])
        stats = paired_stats(pairs)
        if stats is None:
            raise Missing(f"paired seeds of {variant} vs {baseline}")
        return stats | {"wins": sum(a > b for _, a, b in pairs)}

    def values(self, variant: str, key: str) -> dict[int, float]:
        """seed -> value of `key` in `variant`'s finished runs."""
        rows = self.result["variants"].get(variant, {}).get("runs", [])
        out = {r["seed"]: r["values"][key] for r in rows if r.get("values", {}).get(key) is not None}
        if not out:
            raise Missing(f"{variant} {key}")
        return out

    def mean(self, variant: str, key: str) -> float:
        return statistics.fmean(self.values(variant, key).values())

    def std(self, variant: str, key: str) -> float:
        vals = list(self.values(variant, key).values())
        if len(vals) < 2:
            raise Missing(f"a spread of {variant} {key}")
        return statistics.stdev(vals)

    def runs(self) -> list[dict[str, Any]]:
        return [r for v in self.result["variants"].values() for r in v["runs"]]

    def cpu_minutes(self) -> float:
        rows = self.runs()
        if not rows or any("cpu_seconds" not in r for r in rows):
            raise Missing("CPU seconds of every run")
        return sum(r["cpu_seconds"] for r in rows) / 60

    def override(self, key: str) -> str:
        """The value of a dotted key in the result's base overrides."""
        for o in self.result.get("base_overrides", []):
            k, _, v = o.partition("=")
            if k == key:
                return v
        raise Missing(f"base override {key}")

    def rl_steps(self) -> int:
        """RL steps per run: --steps, else the base overrides, else the table's config."""
        if self.result.get("steps_override") is not None:
            return int(self.result["steps_override"])
        try:
            return int(self.override(self.table.steps_key))
        except Missing:
            pass
        try:
            import yaml

            return int(yaml.safe_load((ROOT / self.result["config"]).read_text())["train"]["steps"])
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise Missing("RL steps") from e


def points(x: float) -> str:
    """A success-rate difference in percentage points, signed: "+8.3"."""
    return f"{100 * x:+.1f}"


def interval_points(stats: dict[str, Any]) -> str:
    lo, hi = stats["ci95"]
    return f"[{points(lo)}, {points(hi)}]"


def percent_range(values: Sequence[float]) -> str:
    """"2-22%" from success rates."""
    return f"{100 * min(values):.0f}-{100 * max(values):.0f}%"


def number_range(values: Sequence[float], digits: int = 2) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def listing(items: Sequence[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


QUIET = ("logging.progress=false", "logging.tensorboard=false", "logging.plots=false", "resume=false")


def _said(stats: dict[str, Any], digits: int = 2) -> str:
    """"-0.25 (interval [-0.41, -0.08], p = 0.039: reversed)" (raw units)."""
    lo, hi = stats["ci95"]
    return (f"{stats['difference']:+.{digits}f} (interval [{lo:+.{digits}f}, {hi:+.{digits}f}], "
            f"p = {stats['p']:.3f}: {stats['verdict']})")


def _said_points(stats: dict[str, Any], extra: str = "") -> str:
    """"+8.3 points (interval [+2.2, +14.5], p = 0.055: undecided)" (success rates); `extra` goes
    inside the parentheses."""
    return (f"{points(stats['difference'])} points (interval {interval_points(stats)}, p = {stats['p']:.3f}: "
            f"{stats['verdict']}{'; ' + extra if extra else ''})")


def _ahead_on(stats: dict[str, Any]) -> str:
    return f"ahead on {stats['wins']} of {stats['n']} seeds"


def _writing_note(f: Facts) -> str:
    aligned = f.pair("aligned", "aligned", "eval_team_reward")
    cross = f.pair("cross", "cross", "eval_team_reward")
    change = {c: f.mean("aligned", f"eval_info/{c}") - f.mean("aligned", f"before_eval_info/{c}")
              for c in WRITING_COMPONENTS}
    top = max(change, key=lambda c: abs(change[c]))
    rest = [c for c in WRITING_COMPONENTS if c != top]
    try:
        top_p = f", p = {f.pair('aligned', 'aligned', f'eval_info/{top}')['p']:.3f}"
    except Missing:
        top_p = ""
    raised = [name for name, st in (("aligned", aligned), ("cross", cross)) if st["verdict"] == "holds"]
    text = (
        f"MAGRPO {'raises' if raised else 'does not raise'} the writers' held-out team reward at this scale: "
        f"against the warm-started system it changes by {_said(aligned)} with aligned joint actions and by "
        f"{_said(cross)} with cross joint actions. With aligned joint actions the largest component change is "
        f"{top} ({f.mean('aligned', f'before_eval_info/{top}'):.2f} -> {f.mean('aligned', f'eval_info/{top}'):.2f}"
        f"{top_p}); {listing(rest)} change by at most {max(abs(change[c]) for c in rest):.2f}. So the paper's claim "
        f"(joint training improves the joint reward) is "
        f"{'reproduced with ' + listing(raised) + ' joint actions' if raised else 'not reproduced'} here."
    )
    if top == "transitions" and change[top] < 0 and not raised:
        gained = [c for c in rest if change[c] > 0]
        text += (f" A likely reason, not tested: transition words earn reward on few samples per group while the "
                 f"length terms vary on every sample, so {f.rl_steps()} updates on "
                 f"{f.mean('aligned', 'mean:rollout/samples'):.0f} samples per step follow the dense terms and lose "
                 f"the sparse one. The runs log no reward component per rollout, so only the held-out components "
                 f"speak to it" + (f": {listing(gained)} rose while {top} fell." if gained else "."))
    return text


WRITING_COMPONENTS = ("structure", "ratio", "diversity", "transitions", "overlap")
WRITING = Table(
    name="writing",
    title="MAGRPO on Writing (two writers, one joint reward): reward components on 64 held-out sources "
    "(sampled at temperature 1)",
    config="configs/magrpo/writing.yaml",
    base=(
        # CPU scale: a tiny model from scratch with the character tokenizer, shorter targets
        "model.path=null",
        "model.preset={model_type: qwen3, hidden_size: 64, intermediate_size: 128, num_layers: 2, "
        "num_heads: 4, num_kv_heads: 2, max_position_embeddings: 1024}",
        "tokenizer=char", "model.compute_dtype=float32", "model.remat=false",
        "env.options.concise_words=[3, 10]", "env.options.detailed_words=[10, 30]",
        "sampling.max_new_tokens=160", "sampling.max_prompt_len=256",
        "sampling.temperature=1.0", "sampling.top_p=1.0", "sampling.top_k=0",
        "optim.lr=1.0e-3", "workflow.num_tasks=4", "train.steps=40",
        # 200 warm-start steps (30 left transitions and overlap at 0 on every sample: nothing to learn there)
        "train.warm_start.steps=200", "train.warm_start.lr=3.0e-3", "train.warm_start.demos=8",
        # evaluated by sampling at the training temperature: greedy decoding of these tiny models
        # repeats one word (type-token ratio ~0.02), which scores 0 on most components
        "eval.every=0", "eval.greedy=false", "eval.num_episodes=64", "checkpoint.every=0",
    ),
    variants=(
        Variant("aligned", "aligned joint actions (G pairs)", ("workflow.options.joint_mode=aligned",)),
        Variant("cross", "cross joint actions (G^2 pairs)", ("workflow.options.joint_mode=cross",)),
    ),
    rows=tuple(Line(c, f"info/{c}") for c in WRITING_COMPONENTS)
    + (Line("team reward (sum)", "team_reward"), Line("success (team >= 4)", "success_rate")),
    columns=(
        Line("before RL (warm start)", "before_eval_", "aligned"),
        Line("after MAGRPO, aligned", "eval_", "aligned"),
        Line("after MAGRPO, cross", "eval_", "cross"),
    ),
    comparisons=(
        Comparison("aligned", "aligned", "eval_team_reward", "team reward: MAGRPO (aligned) vs the warm-started system",
                   baseline_key="before_eval_team_reward"),
        Comparison("cross", "cross", "eval_team_reward", "team reward: MAGRPO (cross) vs the warm-started system",
                   baseline_key="before_eval_team_reward"),
        Comparison("cross", "aligned", "eval_team_reward", "team reward: cross vs aligned joint actions"),
    ) + tuple(
        Comparison("aligned", "aligned", f"eval_info/{c}", f"{c}: MAGRPO (aligned) vs the warm start",
                   baseline_key=f"before_eval_info/{c}") for c in ("structure", "ratio", "transitions")
    ),
    notes=(_writing_note,),
    fields=("before_eval_team_reward", "eval_team_reward", "metrics:rollout/generated_total",
            "mean:rollout/team_reward", "mean:rollout/reward_std", "mean:rollout/samples"),
)


def hacpo_note(models: Sequence[str], start: str, doubled: bool) -> Callable[[Facts], str]:
    """The note under a HACPO table of `models` (the names under policies.models): each model
    against its own start (`start` names it: a warm start, the untrained model), against GSPO at the same generated rollouts and,
    when the table has that variant (`doubled`), against GSPO with twice the rollouts; the
    rollouts per step and the answers lost to re-tokenisation."""

    def note(f: Facts) -> str:
        key = "eval_{}/success_rate".format
        own = {m: f.pair("hacpo", "hacpo", key(m)) for m in models}
        same = {m: f.pair("hacpo", "gspo", key(m)) for m in models}
        steps = f.rl_steps()
        lossy = f.values("hacpo", "mean:plan/num_lossy")
        short = [m for m in models if same[m]["verdict"] != "holds"]
        text = (
            f"Against {start}: " + "; ".join(f"{m} {_said_points(own[m])}" for m in models) + ". "
            "Against GSPO at the same generated rollouts: " + "; ".join(
                f"{m} {_said_points(same[m], _ahead_on(same[m]))}" for m in models) + ". ")
        if doubled:
            double = {m: f.pair("hacpo", "gspo_2x", key(m)) for m in models}
            text += "Against GSPO with twice the rollouts: " + "; ".join(
                f"{m} {_said_points(double[m])}" for m in models) + ". "
        text += (
            "So the paper's claim (each member beats GSPO at the same rollouts) is "
            + (f"not reproduced for {listing(short)}" if short else "reproduced") + " at this scale. "
            f"Per RL step the two models generate {f.mean('hacpo', 'rollouts_generated') / steps:.0f} rollouts "
            "together ("
            + (f"{f.mean('gspo_2x', 'rollouts_generated') / steps:.0f} under GSPO 2x; " if doubled else "")
            + f"rollouts generated / {steps} steps); under HACPO each learner also trains on the other's "
            "rollouts, re-tokenised, and drops those whose text does not survive re-tokenisation: ")
        nonzero = sum(v > 0 for v in lossy.values())
        if nonzero:
            text += (f"{statistics.fmean(lossy.values()):.2f} per step on average (plan/num_lossy), nonzero on "
                     f"{nonzero} of {len(lossy)} seeds.")
        else:
            text += f"none on any of the {len(lossy)} seeds (plan/num_lossy)."
        return text

    return note


def hacpo_columns(models: Sequence[str]) -> tuple[Line, ...]:
    """A HACPO table's columns: each model's held-out success before and after, then the rollouts
    both models generated."""
    return tuple(Line(f"{m} {when}", f"{prefix}eval_{m}/success_rate") for m in models
                 for when, prefix in (("before", "before_"), ("after", ""))) + (
        Line("rollouts generated (both models)", "rollouts_generated"),)


# both HACPO tables' configs use G = 4: the 2x baseline generates 8 per policy and task
HACPO_VARIANTS = (
    Variant("hacpo", "HACPO (shared rollouts)", ("workflow.options.share=true",)),
    Variant("gspo", "GSPO alone (the same generated rollouts)", ("workflow.options.share=false",)),
    Variant("gspo_2x", "GSPO, 2x rollouts", ("workflow.options.share=false", "workflow.options.samples_per_policy=8")),
)
HACPO_MODELS = ("qwen", "llama")
HACPO = Table(
    name="hacpo",
    title="HACPO with two tiny heterogeneous models (qwen3-style + char tokenizer, llama-style + BPE) on "
    "4x4 Plan-Path, one step, verified reward: held-out greedy success per model on 128 episodes",
    config="configs/hacpo/plan_path_tiny.yaml",
    base=("checkpoint.every=0",),
    variants=HACPO_VARIANTS,
    rows=tuple(Line(v.label, variant=v.name) for v in HACPO_VARIANTS),
    columns=hacpo_columns(HACPO_MODELS),
    comparisons=tuple(
        Comparison("hacpo", base, f"eval_{m}/success_rate", f"{m}: HACPO vs {label}")
        for m in HACPO_MODELS for base, label in (("gspo", "GSPO alone, same rollouts"), ("gspo_2x", "GSPO, 2x rollouts"))
    ) + tuple(
        Comparison("hacpo", "hacpo", f"eval_{m}/success_rate", f"{m}: HACPO vs its warm start",
                   baseline_key=f"before_eval_{m}/success_rate") for m in HACPO_MODELS
    ),
    digits=3,
    notes=(hacpo_note(HACPO_MODELS, "its warm start", doubled=True),),
    fields=("success_before", "success_after", "mean:plan/num_lossy",
            "mean:hacpo/success_0", "mean:hacpo/success_1", "mean:rollout/reward_std"),
)


def _joyagents_note(f: Facts) -> str:
    warm = f.pair("top1", "top1", "success_after")
    top_vs_all = f.pair("top1", "all", "success_after")
    memory = f.pair("top1_memory", "top1", "success_after")
    samples = {v: f.mean(v, "mean:rollout/samples") for v in ("top1", "all")}
    names = [v.name for v in JOYAGENTS_VARIANTS]
    moved = [f.mean(v, "success_after") - f.mean(v, "success_before") for v in names]
    spread = [f.std(v, "success_after") for v in names]
    shown = [claim for claim, st in (("top-K beats all node groups", top_vs_all), ("the memory helps", memory))
             if st["verdict"] == "holds"]
    return (
        f"Top-1 node groups without memory against its warm start: {_said_points(warm)}. Training only the top-1 "
        f"node group per task against all of them (no memory): {_said_points(top_vs_all)}, with "
        f"{samples['top1']:.0f} against {samples['all']:.0f} samples per step "
        f"({samples['top1'] / samples['all']:.2f}x). "
        f"Memory against none (top-1): {_said_points(memory)}; the memory holds "
        f"{f.mean('top1_memory', 'metrics:memory/entries'):.0f} entries at the end on average. Of the paper's two "
        f"claims (top-K beats all node groups; the memory helps) "
        + (f"only {listing(shown)} is shown" if len(shown) == 1 else "both are shown" if shown else "neither is shown")
        + f" at this scale: {f.rl_steps()} RL steps from a {100 * f.mean('top1', 'success_before'):.0f}%-success warm "
        f"start move the mean success by {points(min(moved))} to {points(max(moved))} points, against a spread between "
        f"seeds (std after RL) of {100 * min(spread):.1f}-{100 * max(spread):.1f} points."
    )


# Step 1's rollouts see an empty memory, so step 1's update is the same with and without it and
# step 2 samples from equal parameters: its rollouts differ by the memory in the prompt alone.
MEMORY_PROBE = "step:2:rollout/success_rate"


def _joyagents_memory_note(f: Facts) -> str:
    probe = f.pair("top1_memory", "top1", MEMORY_PROBE)
    first = {v: f.values(v, "step:1:train/grad_norm") for v in ("top1_memory", "top1")}
    same = [s for s in first["top1"] if s in first["top1_memory"] and first["top1"][s] == first["top1_memory"][s]]
    higher = f"higher with it on {probe['wins']} of {probe['n']} seeds"
    text = (f"Why the memory lowers success here: step 1's rollouts see an empty memory, and its update is the "
            f"same with and without it (step 1's gradient norm equal in {len(same)} of {len(first['top1'])} seeds), so "
            f"step 2 samples from the same parameters in both variants and only the prompt differs: the memory "
            f"lengthens it from {f.mean('top1', 'step:2:rollout/prompt_length_mean'):.0f} to "
            f"{f.mean('top1_memory', 'step:2:rollout/prompt_length_mean'):.0f} tokens on average. Step 2's rollouts "
            f"succeed {100 * probe['variant_mean']:.1f}% of the time with the memory against "
            f"{100 * probe['baseline_mean']:.1f}% without: {_said_points(probe, higher)}.")
    if probe["verdict"] != "reversed":
        return text
    return text + (" So the memory costs success before any update has learned from it: the warm start's expert "
                   "demonstrations carry no memory lines, and the model it trains fails on prompts that begin with "
                   "them. Whether a model that has learned to read such prompts gains from the memory is not tested "
                   "here.")


JOYAGENTS_VARIANTS = (
    Variant("top1", "top-1 node group per task, no memory", ("workflow.options.top_k=1", "algo.options.use_memory=false")),
    Variant("all", "all node groups, no memory", ("workflow.options.top_k=1000", "algo.options.use_memory=false")),
    Variant("top1_memory", "top-1 node group, memory (JoyAgents-R1)", ("workflow.options.top_k=1",)),
)
JOYAGENTS = Table(
    name="joyagents",
    title="JoyAgents-R1 on the quickstart's Plan-Path (tool -> planner, 2 turns: up to 4 node groups per task, "
    "G = 8): held-out greedy success on 128 episodes",
    config="configs/quickstart.yaml",
    base=("algo.name=joyagents", "algo.options={}", "workflow.plan=node_wise", "workflow.group_size=8",
          "workflow.options={}", "workflow.num_tasks=8", "sampling.max_prompt_len=512", "train.steps=30",
          "checkpoint.every=0", "eval.every=0", "eval.num_episodes=128"),
    variants=JOYAGENTS_VARIANTS,
    rows=tuple(Line(v.label, variant=v.name) for v in JOYAGENTS_VARIANTS),
    columns=(
        Line("success before", "success_before"),
        Line("success after", "success_after"),
        Line("memory entries at end", "metrics:memory/entries"),
        Line("samples trained per step", "mean:rollout/samples"),
    ),
    comparisons=(
        Comparison("top1", "all", "success_after", "top-1 vs all node groups (no memory)"),
        Comparison("top1_memory", "top1", "success_after", "memory vs no memory (top-1)"),
        Comparison("top1", "top1", "success_after", "top-1, no memory vs its warm start", baseline_key="success_before"),
        Comparison("top1_memory", "top1", MEMORY_PROBE, "memory vs no memory in the prompt, same parameters (step 2's "
                   "rollouts)"),
    ),
    digits=3,
    notes=(_joyagents_note, _joyagents_memory_note),
    fields=("mean:rollout/success_rate", "mean:rollout/reward_std", "mean:memory/entries", "mean:rollout/samples",
            "mean:rollout/prompt_length_mean", "mean:rollout/prompt_length_max", "mean:rollout/prompt_truncated_fraction",
            "step:1:train/grad_norm", "step:1:rollout/prompt_length_mean", MEMORY_PROBE,
            "step:2:rollout/prompt_length_mean"),
)


def _joyagents_read_note(f: Facts) -> str:
    memory = f.pair("top1_memory", "top1", "success_after")
    probe = f.pair("top1_memory", "top1", MEMORY_PROBE)
    return (
        f"With a warm start that showed memory lines ahead of "
        f"{100 * float(f.override('train.warm_start.memory_share')):.0f}% of its demonstrations, the memory against "
        f"none (top-1): {_said_points(memory)}; the memory holds "
        f"{f.mean('top1_memory', 'metrics:memory/entries'):.0f} entries at the end on average. At equal parameters "
        f"(step 2's rollouts) the memory in the prompt moves success from {100 * probe['baseline_mean']:.1f}% to "
        f"{100 * probe['variant_mean']:.1f}%: {_said_points(probe)}. The paper's claim (the memory helps) is "
        + ("shown" if memory["verdict"] == "holds" else "not shown") + " at this scale."
    )


JOYAGENTS_READ = Table(
    name="joyagents_read",
    title="JoyAgents-R1's memory on a model warm-started to read it (Plan-Path as in the JoyAgents-R1 table; "
    "half the warm start's demonstrations prompted with memory lines): held-out greedy success on 128 episodes",
    config="configs/quickstart.yaml",
    base=JOYAGENTS.base + ("train.warm_start.memory_share=0.5",),
    variants=(JOYAGENTS_VARIANTS[0], JOYAGENTS_VARIANTS[2]),
    rows=tuple(Line(v.label, variant=v.name) for v in (JOYAGENTS_VARIANTS[0], JOYAGENTS_VARIANTS[2])),
    columns=JOYAGENTS.columns,
    comparisons=(
        Comparison("top1_memory", "top1", "success_after", "memory vs no memory (top-1)"),
        Comparison("top1_memory", "top1", MEMORY_PROBE, "memory vs no memory in the prompt, same parameters (step 2's "
                   "rollouts)"),
        Comparison("top1_memory", "top1_memory", "success_after", "top-1 with memory vs its warm start",
                   baseline_key="success_before"),
    ),
    digits=3,
    notes=(_joyagents_read_note,),
    fields=JOYAGENTS.fields,
)


def _quickstart_rl_note(f: Facts) -> str:
    warm = f.pair("per_agent", "per_agent", "success_after")
    before = f.values("per_agent", "success_before")
    text = (f"Per-agent AT-GRPO (the quickstart) against its own warm start: {_said_points(warm, _ahead_on(warm))}; "
            f"the warm start leaves the two-agent system at {percent_range(list(before.values()))} held-out "
            f"depending on the seed.")
    try:
        control = f.pair("per_agent", "supervised")
    except Missing:
        return text + " No control that spends the same steps on supervised training has run on this code."
    return text + (
        f" Against the control that spends the same {f.rl_steps()} steps on more supervised training instead: "
        f"{_said_points(control, _ahead_on(control))}, so the gain "
        + ("is RL's, not training longer's." if control["verdict"] == "holds"
           else "is not shown to exceed what more supervised training gives."))


def _quickstart_mas_note(f: Facts) -> str:
    others = (("single-agent GRPO", f.pair("per_agent", "single")),
              ("one shared policy", f.pair("per_agent", "shared")),
              ("independent sampling", f.pair("per_agent", "independent")))
    verdicts = {st["verdict"] for _, st in others}
    across = all(st["ci95"][0] < 0 < st["ci95"][1] for _, st in others)
    spread = [f.std(v, "success_after") for v in ("per_agent", "single", "shared", "independent")]
    single, per_agent = f.values("single", "success_after"), f.values("per_agent", "success_after")
    largest = max(abs(st["difference"]) for _, st in others)
    ahead = sorted((s for s in single if s in per_agent and single[s] > per_agent[s]),
                   key=lambda s: per_agent[s] - single[s])
    text = (
        f"Against {listing([w for w, _ in others])} the paired differences of per-agent AT-GRPO are "
        f"{listing([points(st['difference']) for _, st in others])} points"
        + (", each interval across 0" if across else "")
        + (f": {verdicts.pop()}" if len(verdicts) == 1 else "")
        + ", so the papers' claim (the multi-agent system with per-agent policies and tree sampling beats a single "
        f"agent) is {'reproduced' if others[0][1]['verdict'] == 'holds' else 'not reproduced'} here. "
        f"The spread between seeds after RL (std {number_range(spread)}) "
        + ("is as large as" if min(spread) >= largest else "compares with")
        + f" the paired differences (at most {largest:.2f} in size). The planner alone, trained by GRPO, ends "
        f"above per-agent AT-GRPO on {len(ahead)} of {len(single)} seeds"
    )
    if len(ahead) >= 2:
        a, b = sorted(ahead[:2])
        text += (f" (seeds {a} and {b}: {single[a]:.2f} and {single[b]:.2f} against "
                 f"{per_agent[a]:.2f} and {per_agent[b]:.2f})")
    return text + "."


def _cpu_note(f: Facts) -> str:
    return f"The {len(f.runs())} runs took {f.cpu_minutes():.0f} CPU-minutes in all."


def _row_utilization_note(f: Facts) -> str:
    means = []
    for v in QUICKSTART_VARIANTS:
        try:
            means.append((f.mean(v.name, "mean:rollout/row_utilization"), v.name.replace("_", "-")))
        except Missing:
            pass
    if not means:
        raise Missing("row utilization")
    return ("The static sampler's rollout/row_utilization on these runs (real rows / decoded rows, each run's mean "
            "over its steps: mean:rollout/row_utilization in the JSON): "
            + ", ".join(f"{m:.2f} {name}" for m, name in means) + "; the other decoded rows are padding.")


QUICKSTART_VARIANTS = (
    Variant("per_agent", "AT-GRPO, per-agent policies (the quickstart)", ()),
    Variant("shared", "AT-GRPO, one shared policy", ("policies.mode=shared", "policies.agent_to_policy={}")),
    Variant("independent", "multi-agent, independent (non-tree) sampling",
            ("workflow.plan=independent", "workflow.options={}")),
    Variant("single", "single agent (planner alone), GRPO",
            ("env.options.single_agent=true", "algo.name=grpo", "workflow.plan=independent",
             "workflow.options={}", "policies.mode=shared", "policies.agent_to_policy={}")),
    # the control for "RL improves on the warm start": the same number of steps spent on more
    # supervised training instead (the config's 300 warm-start steps + its 100 RL steps); train.steps
    # must be >= 1, so one RL step runs at lr 1e-12, below float32 resolution of the weights
    Variant("supervised", "multi-agent system, 100 more supervised steps instead of RL (control)",
            ("train.warm_start.steps=400", "train.steps=1", "optim.lr=1e-12")),
)
QUICKSTART = Table(
    name="quickstart",
    title="The quickstart task (5x5 Plan-Path): held-out greedy success on 128 episodes",
    config="configs/quickstart.yaml",
    base=("checkpoint.every=0", "eval.every=0", "eval.num_episodes=128"),
    variants=QUICKSTART_VARIANTS,
    rows=(
        Line("single agent, warm start only", "success_before", "single"),
        Line("single agent + GRPO", "success_after", "single"),
        Line("multi-agent system, warm start only (no RL)", "success_before", "per_agent"),
        Line("AT-GRPO, shared policy", "success_after", "shared"),
        Line("AT-GRPO, per-agent policies (the quickstart)", "success_after", "per_agent"),
        Line("multi-agent, independent (non-tree) sampling", "success_after", "independent"),
        Line("multi-agent system, 100 more supervised steps instead of RL (control)", "success_after", "supervised"),
    ),
    columns=(Line("held-out success"),),
    comparisons=(
        Comparison("per_agent", "per_agent", "success_after", "AT-GRPO per-agent vs its warm start",
                   baseline_key="success_before"),
        Comparison("per_agent", "single", "success_after", "AT-GRPO per-agent vs single-agent GRPO"),
        Comparison("per_agent", "independent", "success_after", "tree vs independent sampling"),
        Comparison("per_agent", "shared", "success_after", "per-agent vs shared policy"),
        Comparison("per_agent", "supervised", "success_after", "AT-GRPO vs 100 more supervised steps (control)"),
    ),
    digits=3,
    notes=(_quickstart_rl_note, _quickstart_mas_note, _cpu_note, _row_utilization_note),
    fields=("wall_seconds", "mean:rollout/success_rate", "mean:rollout/row_utilization"),
)

def _real_rl_note(f: Facts) -> str:
    parts = []
    for variant, what in (("at_grpo", "AT-GRPO (tool + reasoner, a LoRA adapter each)"),
                          ("grpo", "single-agent GRPO (the reasoner alone, one adapter)")):
        try:
            st = f.pair(variant, variant, "success_after")
        except Missing:
            continue
        parts.append(f"{what} against the untrained model: {_said_points(st, _ahead_on(st))}")
    if not parts:
        raise Missing("paired seeds")
    return "; ".join(parts) + "."


def _real_signal_note(f: Facts) -> str:
    rates = {v: f.mean(v, "mean:rollout/success_rate") for v in ("at_grpo", "grpo")}
    zero = sum(x == 0 for x in f.values("at_grpo", "mean:rollout/success_rate").values())
    return (f"Training episodes ended with the reasoner right on {rates['at_grpo']:.1%} of AT-GRPO's episodes and "
            f"{rates['grpo']:.1%} of GRPO's (rollout/success_rate, each run's mean over its steps; AT-GRPO on none "
            f"at all in {zero} of {len(f.values('at_grpo', 'mean:rollout/success_rate'))} runs). That is the final "
            "answer only: each candidate's reward is its own correctness (the tool's included), and these runs kept "
            "no count of the groups whose rewards differed, so they cannot say how many groups carried a learning "
            "signal; runs since log it (rollout/signal_group_fraction). Samples per step were not kept either.")


def time_note(variant: str, step: str, whose: str, parts: Sequence[tuple[str, str]]) -> Callable[[Facts], str]:
    """The note on a long table's step time: `step` (what one step of `variant` is) took T s on
    average, split into `parts` ((metric under time/, what it is)), and the share of `whose`
    completions cut at max_new_tokens; then the runs' CPU time."""

    def note(f: Facts) -> str:
        split = []
        for key, what in parts:
            try:
                split.append(f"{what} {f.mean(variant, 'mean:time/' + key):.0f} s")
            except Missing:
                pass
        if not split:
            raise Missing("time split")
        return (f"{step} on this CPU took {f.mean(variant, 'mean:time/step'):.0f} s on average: "
                + ", ".join(split) + " (each run's mean over its steps); "
                + f"{f.mean(variant, 'mean:rollout/truncated_fraction'):.0%} of {whose} completions were cut at "
                f"max_new_tokens. {_cpu_note(f)}")

    return note


REAL_VARIANTS = (
    Variant("at_grpo", "AT-GRPO, tool + reasoner, per-agent LoRA (configs/real/at_grpo_math.yaml)", ()),
    # the baseline at equal samples per step (configs/real/grpo_math.yaml as overrides of this config):
    # 2 tasks x 8 episodes x 2 turns of one agent, against 2 tasks x 2 turns x 2 agents x 4 candidates
    Variant("grpo", "single agent (the reasoner alone), GRPO, equal samples",
            ("env.options.agents=[reasoner]", "algo.name=grpo", "algo.options.normalize=std",
             "workflow.plan=independent", "workflow.group_size=8", "workflow.options={}",
             "policies.agent_to_policy={}")),
)
REAL = Table(
    name="real",
    title="A real model, SmolLM2-135M-Instruct, on easy math (difficulty 1): held-out greedy success on 32 problems",
    config="configs/real/at_grpo_math.yaml",
    base=("checkpoint.every=1", "checkpoint.keep=1", "eval.every=0"),
    variants=REAL_VARIANTS,
    rows=(
        Line("tool + reasoner, untrained", "success_before", "at_grpo"),
        Line("tool + reasoner + AT-GRPO, per-agent LoRA", "success_after", "at_grpo"),
        Line("reasoner alone, untrained", "success_before", "grpo"),
        Line("reasoner alone + GRPO (equal samples)", "success_after", "grpo"),
    ),
    columns=(Line("held-out success"),),
    comparisons=(
        Comparison("at_grpo", "at_grpo", "success_after", "AT-GRPO vs the untrained model",
                   baseline_key="success_before"),
        Comparison("grpo", "grpo", "success_after", "GRPO vs the untrained model", baseline_key="success_before"),
        Comparison("at_grpo", "grpo", "success_after", "AT-GRPO (two agents) vs single-agent GRPO, equal samples"),
    ),
    digits=3,
    notes=(_real_rl_note, _real_signal_note,
           time_note("at_grpo", "An AT-GRPO step", "its", (("generate", "generation"), ("env", "env steps"),
                                                          ("update", "scoring + update")))),
    fields=("wall_seconds", "mean:rollout/success_rate", "mean:time/step", "mean:time/generate", "mean:time/env",
            "mean:time/update", "mean:rollout/truncated_fraction"),
    resume=True,
)


REAL_PAIR_VARIANTS = HACPO_VARIANTS[:2]
REAL_PAIR_MODELS = ("smollm2", "gemma3")


def _real_pair_signal_note(f: Facts) -> str:
    """How much signal the real pair's runs had: each model's training rollout success and
    truncation, and how far an update moved each policy (mean over steps, seeds and variants;
    policy i is the i-th model under policies.models, the order of REAL_PAIR_MODELS)."""
    both = lambda key: statistics.fmean(f.mean(v.name, key) for v in REAL_PAIR_VARIANTS)  # noqa: E731
    success = [f"{m} {both(f'mean:hacpo/success_{i}'):.1%}" for i, m in enumerate(REAL_PAIR_MODELS)]
    cut = [f"{m} {both(f'mean:rollout/{m}/truncated_fraction'):.0%}" for m in REAL_PAIR_MODELS]
    moved = [f"{m} {both(f'mean:train/{m}/approx_kl'):.1e}" for m in REAL_PAIR_MODELS]
    return ("Training rollouts (temperature 1) succeeded on " + ", ".join(success) + " of each model's own "
            "samples (hacpo/success_i), and were cut at max_new_tokens for " + ", ".join(cut)
            + " (rollout/<model>/truncated_fraction). The approximate KL between the "
            "policy that sampled a step's rollouts and the updated one averaged " + ", ".join(moved)
            + " (train/<model>/approx_kl at the config's learning rate; both variants, each run's mean over "
            "its steps).")


_REAL_PAIR_TIME_NOTE = time_note("hacpo", "A HACPO step (both models)", "the",
                                 (("generate", "generation"), ("update", "scoring + update")))

REAL_PAIR = Table(
    name="hacpo_real",
    title="HACPO on a real heterogeneous pair, SmolLM2-135M-Instruct (llama, 49k vocabulary) and Gemma 3 270M "
    "(gemma3, 262k vocabulary), full fine-tuning on one-digit addition: held-out greedy success per model",
    config="configs/real/hacpo_math.yaml",
    # a checkpoint holds both models' float32 weights and Adam moments (about 5 GB): every other step
    base=("checkpoint.every=2", "checkpoint.keep=1", "eval.every=0"),
    variants=REAL_PAIR_VARIANTS,
    rows=tuple(Line(v.label, variant=v.name) for v in REAL_PAIR_VARIANTS),
    columns=hacpo_columns(REAL_PAIR_MODELS),
    comparisons=tuple(
        Comparison("hacpo", "gspo", f"eval_{m}/success_rate", f"{m}: HACPO vs GSPO alone, same rollouts")
        for m in REAL_PAIR_MODELS
    ) + tuple(
        Comparison("hacpo", "hacpo", f"eval_{m}/success_rate", f"{m}: HACPO vs the untrained model",
                   baseline_key=f"before_eval_{m}/success_rate") for m in REAL_PAIR_MODELS
    ) + tuple(
        Comparison("gspo", "gspo", f"eval_{m}/success_rate", f"{m}: GSPO alone vs the untrained model",
                   baseline_key=f"before_eval_{m}/success_rate") for m in REAL_PAIR_MODELS
    ),
    digits=3,
    notes=(hacpo_note(REAL_PAIR_MODELS, "the untrained model", doubled=False), _real_pair_signal_note,
           _REAL_PAIR_TIME_NOTE),
    fields=("wall_seconds", "mean:plan/num_lossy", "mean:rollout/reward_std", "mean:time/step", "mean:time/generate",
            "mean:time/update", "mean:rollout/truncated_fraction")
    + tuple(f"mean:hacpo/success_{i}" for i in range(len(REAL_PAIR_MODELS)))
    + tuple(f"mean:rollout/{m}/truncated_fraction" for m in REAL_PAIR_MODELS)
    + tuple(f"mean:train/{m}/approx_kl" for m in REAL_PAIR_MODELS),
    resume=True,
)

# the pair at the recipe's scale, on a task the untrained Gemma answers none of: HACPO against
# each model learning alone from as many samples as HACPO's update sees (its own and the other's).
# A cross sample's ratio outside the stepwise clip range [1 - delta + m * delta_step, 1] carries no
# gradient; the authors' code uses delta 0.2, the paper's table 0.8 for most pairs: both are run.
HACPO_WIDE = Variant("hacpo_wide", "HACPO, delta 0.8 (cross ratios clipped to [0.2, 1])",
                     ("workflow.options.share=true", "algo.options.delta=0.8"))
REAL_PAIR_ADD_VARIANTS = (HACPO_VARIANTS[0], HACPO_VARIANTS[2], HACPO_VARIANTS[1], HACPO_WIDE)
CROSS_KEYS = ("cross_clip_fraction", "cross_ratio_mean")


def _hacpo_delta(table: "Table", variant: str) -> float:
    """The stepwise clip's delta a HACPO variant of `table` runs with (its config with its overrides)."""
    from jmarl.config import load_config

    overrides = next(v.overrides for v in table.variants if v.name == variant)
    return float(load_config(ROOT / table.config, list(overrides)).algo.options["delta"])


def _cross_clip_note(f: Facts) -> str:
    """How many of each model's cross samples (the other model's rollouts) fell outside the
    stepwise clip range, where they carry no gradient, under each HACPO variant: each run's mean of
    train/<model>/cross_clip_fraction over its steps, averaged over the runs that logged it."""
    parts = []
    for variant in ("hacpo", "hacpo_wide"):
        delta = _hacpo_delta(f.table, variant)
        try:
            clipped = [f.values(variant, f"mean:train/{m}/cross_clip_fraction") for m in REAL_PAIR_MODELS]
            ratio = [f.mean(variant, f"mean:train/{m}/cross_ratio_mean") for m in REAL_PAIR_MODELS]
        except Missing:
            continue
        runs = min(len(c) for c in clipped)
        parts.append(f"with delta {delta:g} (range [{1 - delta:.1f}, 1] at the first mini-batch), "
                     + ", ".join(f"{m} {statistics.fmean(c.values()):.0%}" for m, c in zip(REAL_PAIR_MODELS, clipped))
                     + " (mean cross ratio " + " / ".join(f"{r:.2f}" for r in ratio)
                     + f"; {runs} run{'s' if runs != 1 else ''} per model)")
    what = ("A cross sample (the other model's rollout, re-tokenised) whose ratio exp(mean log-prob under the learner "
            "- mean log-prob under its source) falls outside the stepwise clip range carries no gradient. ")
    if not parts:
        return what + ("No HACPO run here kept the share of cross samples outside it "
                       "(train/<model>/cross_clip_fraction): each was made before the table kept that metric.")
    return (what + "Share of cross samples outside it (train/<model>/cross_clip_fraction, each run's mean over its "
            "steps): " + "; ".join(parts) + ". Runs made before the table kept this metric have no value here.")


def _hacpo_real_headline(f: Facts) -> str:
    """The README's sentence on the HACPO real pair: each model under HACPO at the paper's clip
    range (delta 0.8) against the same model learning alone with twice the rollouts (as many
    samples seen), paired over seeds; then HACPO at the authors' code's delta 0.2 where it has
    paired seeds."""
    key = "eval_{}/success_rate"
    gemma = f.pair("hacpo_wide", "gspo_2x", key.format("gemma3"))
    smol = f.pair("hacpo_wide", "gspo_2x", key.format("smollm2"))
    start = f.mean("hacpo_wide", "before_eval_gemma3/success_rate")
    text = (f"HACPO on the real pair (SmolLM2-135M-Instruct and Gemma 3 270M sharing their verified rollouts, full "
            f"fine-tuning, {f.rl_steps()} steps on two-operand addition, 128 held-out problems) against each model "
            f"learning alone with twice the rollouts, so that both see as many samples: at the paper's clip range "
            f"(delta {_hacpo_delta(f.table, 'hacpo_wide'):g}) Gemma 3, a base model that starts at {start:.1%}, "
            f"reaches **{gemma['variant_mean']:.1%} against {gemma['baseline_mean']:.1%} alone, "
            f"{points(gemma['difference'])} points** over {_paired_tail(f, gemma, 'HACPO higher')}; SmolLM2 reaches "
            f"{smol['variant_mean']:.1%} against {smol['baseline_mean']:.1%}, {_said_points(smol, _ahead_on(smol))}.")
    said = {"holds": "holds", "reversed": "is reversed", "undecided": "is undecided"}
    text += (f" So the paper's claim, that each model gains from the other's rollouts, {said[gemma['verdict']]} here "
             f"for Gemma 3, the weaker model, and {said[smol['verdict']]} for SmolLM2.")
    try:
        narrow = {m: f.pair("hacpo", "gspo_2x", key.format(m)) for m in ("smollm2", "gemma3")}
    except Missing:
        return text
    n = min(st["n"] for st in narrow.values())
    delta = _hacpo_delta(f.table, "hacpo")
    return (text + f" At the authors' code's delta {delta:g}, where a cross sample whose "
            f"ratio leaves [{1 - delta:.1f}, 1] carries no gradient, the difference is "
            f"{points(narrow['smollm2']['difference'])} points for SmolLM2 and {points(narrow['gemma3']['difference'])} "
            f"for Gemma 3 over {n} paired seeds.")


def _real_pair_add_rollout_note(f: Facts) -> str:
    """Each variant's training rollouts per model (own-sample success and the share cut at
    max_new_tokens, each run's mean over its steps, then over seeds), and across every run how a
    model's held-out success follows its rollouts' truncation (Pearson r over runs)."""
    parts, runs = [], {m: [] for m in REAL_PAIR_MODELS}
    for v in REAL_PAIR_ADD_VARIANTS:
        try:  # a variant counts only with every model's figures
            cut = {m: f.values(v.name, f"mean:rollout/{m}/truncated_fraction") for m in REAL_PAIR_MODELS}
            after = {m: f.values(v.name, f"eval_{m}/success_rate") for m in REAL_PAIR_MODELS}
            right = [f.mean(v.name, f"mean:hacpo/success_{i}") for i in range(len(REAL_PAIR_MODELS))]
        except Missing:
            continue
        for m in REAL_PAIR_MODELS:
            runs[m] += [(cut[m][s], after[m][s]) for s in cut[m].keys() & after[m].keys()]
        parts.append(f"{v.name}: " + ", ".join(f"{m} {r:.0%} right, {statistics.fmean(cut[m].values()):.0%} cut"
                                               for m, r in zip(REAL_PAIR_MODELS, right)))
    if not parts:
        raise Missing("training rollouts")
    text = ("Training rollouts (temperature 1; each model's own samples, hacpo/success_i and "
            "rollout/<model>/truncated_fraction, each run's mean over its steps, then over seeds): " + "; ".join(parts)
            + ".")
    linked = [f"{m} r = {statistics.correlation(*zip(*pairs)):+.2f} over {len(pairs)} runs"
              for m, pairs in runs.items() if len(pairs) >= 3 and len({c for c, _ in pairs}) > 1
              and len({a for _, a in pairs}) > 1]
    if linked:
        text += (" Across runs, held-out success against the share of the model's own rollouts cut (Pearson): "
                 + "; ".join(linked) + ".")
    return text


REAL_PAIR_ADD = dataclasses.replace(
    REAL_PAIR,
    name="hacpo_real_add",
    title="HACPO on the real pair at the recipe's scale, SmolLM2-135M-Instruct and Gemma 3 270M, full fine-tuning on "
    "two-operand addition (operands 0-49): held-out greedy success per model on 128 distinct problems",
    config="configs/real/hacpo_add.yaml",
    variants=REAL_PAIR_ADD_VARIANTS,
    notes=(hacpo_note(REAL_PAIR_MODELS, "the untrained model", doubled=True), _real_pair_add_rollout_note,
           _REAL_PAIR_TIME_NOTE, _cross_clip_note),
    rows=tuple(Line(v.label, variant=v.name) for v in REAL_PAIR_ADD_VARIANTS),
    comparisons=tuple(
        Comparison("hacpo", baseline, f"eval_{m}/success_rate", f"{m}: HACPO vs {label}")
        for baseline, label in (("gspo_2x", "GSPO alone, as many samples seen"),
                                ("gspo", "GSPO alone, as many samples generated"))
        for m in REAL_PAIR_MODELS
    ) + tuple(
        Comparison("hacpo_wide", baseline, f"eval_{m}/success_rate", f"{m}: HACPO delta 0.8 vs {label}")
        for baseline, label in (("gspo_2x", "GSPO alone, as many samples seen"), ("hacpo", "HACPO delta 0.2"))
        for m in REAL_PAIR_MODELS
    ) + tuple(
        Comparison(v.name, v.name, f"eval_{m}/success_rate", f"{m}: {v.name} vs the untrained model",
                   baseline_key=f"before_eval_{m}/success_rate") for v in REAL_PAIR_ADD_VARIANTS for m in REAL_PAIR_MODELS
    ),
    fields=REAL_PAIR.fields + tuple(f"mean:train/{m}/{k}" for m in REAL_PAIR_MODELS for k in CROSS_KEYS),
    headline=_hacpo_real_headline,
)

_LORA = ("policies.mode=lora", "policies.lora.rank=16", "policies.lora.alpha=32.0",
         "policies.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]")
RECIPE_VARIANTS = (
    Variant("full", "full fine-tuning, lr 1e-5 (configs/real/grpo_add_full.yaml)", ()),
    # one LoRA adapter on the frozen base, every linear layer, at two learning rates 5x apart:
    # the table reports both, so "LoRA at its best learning rate" is the better of the two
    Variant("lora", "LoRA rank 16 on every linear layer, lr 2e-4", _LORA + ("optim.lr=2.0e-4",)),
    Variant("lora_1e-3", "LoRA rank 16 on every linear layer, lr 1e-3", _LORA + ("optim.lr=1.0e-3",)),
)


def _recipe_rl_note(f: Facts) -> str:
    parts = []
    for v in RECIPE_VARIANTS:
        try:
            st = f.pair(v.name, v.name, "success_after")
        except Missing:
            continue
        parts.append(f"{v.label.split(' (')[0]} against the untrained model: {_said_points(st, _ahead_on(st))}")
    if not parts:
        raise Missing("paired seeds")
    return "; ".join(parts) + "."


def _recipe_headline(f: Facts) -> str:
    """The README's sentence on the recipe: full fine-tuning's paired gain, with its code."""
    st = f.pair("full", "full", "success_after")
    return (f"SmolLM2-135M-Instruct, single-agent GRPO, full fine-tuning, {f.rl_steps()} steps of 64 samples on "
            f"two-operand addition: held-out greedy success on 128 distinct problems **{st['baseline_mean']:.1%} -> "
            f"{st['variant_mean']:.1%}, {points(st['difference'])} points** over {_paired_tail(f, st, 'higher')}.")


def _paired_tail(f: Facts, st: dict[str, Any], higher: str) -> str:
    """A README sentence's "6 paired seeds (95% interval [...], <higher> on 6 of 6, sign-flip p =
    0.031: holds; code abc1234)"."""
    code = _code_short(f.result)
    return (f"{st['n']} paired seeds (95% interval {interval_points(st)}, {higher} on {st['wins']} of {st['n']}, "
            f"sign-flip p = {st['p']:.3f}: {st['verdict']}; code {code})")


def _code_short(result: dict[str, Any]) -> str:
    """A sentence's code: "abc1234"; "abc1234 and def5678, the same run code" for commits that
    differ only outside `RUN_PATHS`; "mixed: ..." (the header's list) otherwise."""
    summary = code_summary(result)
    labels = list(summary["runs"])
    if len(labels) == 1 or summary["mixed"] or not labels:
        return code_line(result).removeprefix("code: ")
    return f"{', '.join(labels[:-1])} and {labels[-1]}, the same run code"


def _recipe_signal_note(f: Facts) -> str:
    """What the recipe's rollouts carried, per variant: samples per step, the share of groups whose
    rewards differ (non-zero group advantage), rollout success and truncation, completion length."""
    parts = []
    for v in RECIPE_VARIANTS:
        try:
            parts.append(
                f"{v.name}: {f.mean(v.name, 'mean:rollout/samples'):.0f} samples a step, "
                f"{f.mean(v.name, 'mean:rollout/signal_group_fraction'):.0%} of groups with differing rewards, "
                f"rollout success {f.mean(v.name, 'mean:rollout/success_rate'):.0%}, "
                f"{f.mean(v.name, 'mean:rollout/truncated_fraction'):.0%} of completions cut at max_new_tokens, "
                f"{f.mean(v.name, 'mean:rollout/completion_length_mean'):.0f} tokens on average")
        except Missing:
            continue
    if not parts:
        raise Missing("rollout signal")
    return ("Training rollouts (temperature 1; each run's mean over its steps, then over seeds): " + "; ".join(parts)
            + ". A group whose rewards are all equal has zero advantage and moves nothing.")


REAL_RECIPE = Table(
    name="real_recipe",
    title="The recipe: SmolLM2-135M-Instruct, single-agent GRPO, on two-operand addition (operands 0-49): "
    "held-out greedy success on 128 distinct problems",
    config="configs/real/grpo_add_full.yaml",
    base=("checkpoint.every=2", "checkpoint.keep=1", "eval.every=0"),
    variants=RECIPE_VARIANTS,
    rows=tuple(Line(v.label, variant=v.name) for v in RECIPE_VARIANTS),
    columns=(Line("untrained", "success_before"), Line("after GRPO", "success_after")),
    comparisons=tuple(
        Comparison(v.name, v.name, "success_after", f"{v.name} vs the untrained model", baseline_key="success_before")
        for v in RECIPE_VARIANTS
    ) + tuple(Comparison("full", v.name, "success_after", f"full fine-tuning vs LoRA, {v.label.split(', ')[-1]}")
              for v in RECIPE_VARIANTS if v.name != "full"),
    digits=3,
    notes=(_recipe_rl_note, _recipe_signal_note,
           time_note("full", "A full fine-tuning step (64 samples)", "its",
                     (("generate", "generation"), ("update", "scoring + update")))),
    headline=_recipe_headline,
    fields=("wall_seconds", "mean:rollout/samples", "mean:rollout/signal_group_fraction", "mean:rollout/success_rate",
            "mean:train/logprob_diff_max", "mean:train/logprob_diff_mean", "mean:train/zero_gradient",
            "mean:rollout/truncated_fraction", "mean:rollout/completion_length_mean", "mean:time/step",
            "mean:time/generate", "mean:time/update", "metrics:rollout/success_rate",
            "metrics:rollout/truncated_fraction"),
    resume=True,
)

def _hard_headline(f: Facts) -> str:
    """The README's sentence on the recipe on the harder task: its paired change, whatever it is."""
    st = f.pair("full", "full", "success_after")
    return (f"The same recipe on generated math of difficulty 1 (two operations or a two-step word problem, 96 new "
            f"tokens): **{st['baseline_mean']:.1%} -> {st['variant_mean']:.1%}, {points(st['difference'])} points** "
            f"over {_paired_tail(f, st, 'higher')}.")


REAL_HARD = Table(
    name="real_hard",
    title="The recipe on a harder task: SmolLM2-135M-Instruct, single-agent GRPO, full fine-tuning, on generated "
    "math of difficulty 1 (two operations, or a two-step word problem): held-out greedy success on 128 problems",
    config="configs/real/grpo_add_full.yaml",
    # a worked answer needs more room than a sum: 96 new tokens
    base=("checkpoint.every=2", "checkpoint.keep=1", "eval.every=0", "env.options.tier=null",
          "env.options.difficulty=1", "sampling.max_new_tokens=96"),
    variants=(RECIPE_VARIANTS[0],),
    rows=(Line(RECIPE_VARIANTS[0].label, variant="full"),),
    columns=(Line("untrained", "success_before"), Line("after GRPO", "success_after")),
    comparisons=(Comparison("full", "full", "success_after", "GRPO vs the untrained model",
                            baseline_key="success_before"),),
    digits=3,
    notes=(_recipe_rl_note, _recipe_signal_note),
    headline=_hard_headline,
    fields=REAL_RECIPE.fields,
    resume=True,
)


METHOD_VARIANTS = (
    Variant("at_grpo", "AT-GRPO: tool + reasoner, a full copy each, tree sampling (configs/real/at_grpo_add.yaml)", ()),
    # the recipe's single agent on the same task, steps and samples a step (8 tasks x 8 samples)
    Variant("grpo", "GRPO: the reasoner alone, one policy, equal samples",
            ("env.options.agents=[reasoner]", "algo.name=grpo", "algo.options.normalize=std",
             "workflow.plan=independent", "workflow.group_size=8", "workflow.options={}", "policies.mode=shared",
             "policies.agent_to_policy={}")),
)


def _methods_samples_note(f: Facts) -> str:
    """Samples each variant's update saw per step, per policy, and the share of groups with signal."""
    parts = []
    for v in METHOD_VARIANTS:
        per = []
        for name in ("tool", "reasoner", "shared"):
            try:
                per.append(f"{name} {f.mean(v.name, f'mean:rollout/{name}/samples'):.0f}")
            except Missing:
                continue
        parts.append(f"{v.name} {f.mean(v.name, 'mean:rollout/samples'):.1f} samples a step ({', '.join(per)}), "
                     f"{f.mean(v.name, 'mean:rollout/signal_group_fraction'):.0%} of groups with differing rewards")
    return "Samples the update saw (each run's mean over its steps, then over seeds): " + "; ".join(parts) + "."


def _methods_headline(f: Facts) -> str:
    """The README's sentence on AT-GRPO against GRPO on the real model: the paired difference."""
    st = f.pair("at_grpo", "grpo", "success_after")
    return (f"AT-GRPO (tool + reasoner, a policy each) against GRPO (the reasoner alone) on the same model, task "
            f"and samples a step: both learn, and after {f.rl_steps()} steps held-out greedy success is "
            f"**{st['variant_mean']:.1%} against {st['baseline_mean']:.1%}, {points(st['difference'])} points** over "
            f"{_paired_tail(f, st, 'AT-GRPO higher')}.")


REAL_METHODS = Table(
    name="real_methods",
    title="AT-GRPO against single-agent GRPO on a real model at equal samples: SmolLM2-135M-Instruct, full "
    "fine-tuning, two-operand addition: held-out greedy success (the reasoner's answer) on 128 distinct problems",
    config="configs/real/at_grpo_add.yaml",
    base=("checkpoint.every=2", "checkpoint.keep=1", "eval.every=0"),
    variants=METHOD_VARIANTS,
    rows=tuple(Line(v.label, variant=v.name) for v in METHOD_VARIANTS),
    columns=(Line("untrained", "success_before"), Line("after RL", "success_after")),
    comparisons=tuple(
        Comparison(v.name, v.name, "success_after", f"{v.name} vs the untrained model", baseline_key="success_before")
        for v in METHOD_VARIANTS
    ) + (Comparison("at_grpo", "grpo", "success_after", "AT-GRPO (two agents) vs GRPO (one), equal samples"),),
    digits=3,
    notes=(_methods_samples_note,),
    headline=_methods_headline,
    fields=REAL_RECIPE.fields + ("mean:rollout/tool/samples", "mean:rollout/reasoner/samples",
                                 "mean:rollout/shared/samples", "mean:rollout/reasoner/signal_group_fraction",
                                 "mean:rollout/tool/signal_group_fraction"),
    resume=True,
)

TABLES: dict[str, Table] = {t.name: t for t in (QUICKSTART, WRITING, HACPO, JOYAGENTS, JOYAGENTS_READ, REAL, REAL_PAIR, REAL_PAIR_ADD, REAL_RECIPE, REAL_HARD, REAL_METHODS)}


# ----------------------------------------------------------------------------------------------
# running


def run_command(table: Table, variant: Variant, seed: int, out_dir: Path, steps: int | None) -> list[str]:
    """The `python -m jmarl.run ...` argv of one (variant, seed) run."""
    extra = [f"{table.steps_key}={steps}"] if steps is not None else []
    quiet = [("resume=true" if table.resume and q == "resume=false" else q) for q in QUIET]
    return [
        sys.executable, "-m", "jmarl.run", "--config", table.config, f"seed={seed}", f"output_dir={out_dir}",
        *quiet, *table.base, *variant.overrides, *extra,
    ]


def logged_metrics(path: Path) -> dict[str, list[float]]:
    """Every logged value of every metric in a metrics.jsonl file, in order; each value of a line
    that names its training step also under `step:<n>:<metric>`."""
    logged: dict[str, list[float]] = {}
    if not path.exists():
        return logged
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            step = entry.get("step")
            for k, v in entry.items():
                if isinstance(v, (int, float)):
                    logged.setdefault(k, []).append(float(v))
                    if isinstance(step, int) and k != "step":
                        logged.setdefault(f"{STEP_PREFIX}{step}:{k}", []).append(float(v))
    return logged


def read_value(summary: dict[str, Any], metrics: dict[str, list[float]], key: str) -> float | None:
    """A value of one run: summary[key]; `metrics:<m>`: the last logged value of m;
    `mean:<m>`: the mean of m over the run's log lines; `step:<n>:<m>`: m as logged at step n."""
    if key.startswith(STEP_PREFIX):
        values = metrics.get(key)
        return values[-1] if values else None
    if key.startswith(METRICS_PREFIX):
        values = metrics.get(key[len(METRICS_PREFIX):])
        return values[-1] if values else None
    if key.startswith(MEAN_PREFIX):
        values = metrics.get(key[len(MEAN_PREFIX):])
        return statistics.fmean(values) if values else None
    value = summary.get(key)
    return None if value is None else float(value)


def child_env(runs_root: Path) -> dict[str, str]:
    """The runs' environment: the repo on PYTHONPATH and a persistent XLA compilation cache shared
    by the runs (the variants and seeds compile the same programs; a user's JAX_COMPILATION_CACHE_DIR
    wins). Only the first run of a table pays for compilation."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(runs_root / "jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


RUN_RECORD = "evidence_run.json"  # in a run's output dir: its argv (sans interpreter), times and code
STARTED_RECORD = "evidence_started.json"  # in a resumable run's output dir: its argv, code and attempts

# The tracked paths a run executes or reads: the package and the configs (and the dependencies'
# pins). Other tracked files (tests, benchmarks, docs, the result JSONs this script rewrites after
# every run) change no run, and other people edit them in a shared checkout mid-table.
RUN_PATHS = ("jmarl", "configs", "pyproject.toml")


def code_state(root: Path = ROOT) -> dict[str, Any]:
    """The code a run in `root` runs on: {"commit": the short HEAD commit, "dirty": whether the
    tracked files a run executes or reads (`RUN_PATHS`) have uncommitted changes} and, when dirty,
    "diff": a hash of those changes (two dirty trees of one commit are the same code only when it
    matches). {} outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", *RUN_PATHS], cwd=root, capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    state: dict[str, Any] = {"commit": commit, "dirty": bool(diff)}
    if diff:
        state["diff"] = hashlib.sha256(diff).hexdigest()[:12]
    return state


def run_code(result: dict[str, Any] | None, row: dict[str, Any]) -> dict[str, Any]:
    """The code a result row ran on: its own record, or for a row written before runs recorded
    it, the result JSON's versions.git_commit (the checkout's commit when the JSON was written)
    marked "inferred"; {} when neither is known."""
    if row.get("commit"):
        own = {k: row[k] for k in ("commit", "dirty", "diff") if k in row}
        return own | {"inferred": True} if row.get("commit_inferred") else own
    commit = ((result or {}).get("versions") or {}).get("git_commit")
    return {"commit": commit, "inferred": True} if commit else {}


def same_code(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two `code_state`s are the same code: one commit, the same uncommitted changes."""
    return bool(a.get("commit")) and a.get("commit") == b.get("commit") and a.get("diff") == b.get("diff")


def equivalent_code(a: dict[str, Any], b: dict[str, Any], root: Path | None = None) -> bool:
    """`same_code`, or two commits between which nothing a run executes or reads changed
    (`RUN_PATHS`: commits of docs, tests or results only), with the same uncommitted changes."""
    if same_code(a, b):
        return True
    if not (a.get("commit") and b.get("commit")) or a.get("diff") != b.get("diff"):
        return False
    try:
        diff = subprocess.run(["git", "diff", "--quiet", a["commit"], b["commit"], "--", *RUN_PATHS],
                              cwd=root or ROOT, capture_output=True)
    except OSError:
        return False
    return diff.returncode == 0


def code_label(code: dict[str, Any], reused: bool = False) -> str:
    """How a table's header names one run's code."""
    if not code:
        return "not recorded"
    if code.get("inferred"):
        return (f"{code['commit']}{' or earlier' if reused else ''} (not recorded per run: the commit when the JSON "
                f"was written{'; these runs were reused then, so made on it or earlier code' if reused else ''})")
    return code["commit"] + (f" with uncommitted changes ({code['diff']})" if code.get("dirty") else "")


def code_summary(result: dict[str, Any]) -> dict[str, Any]:
    """{"runs": {code label: runs}, "mixed": the runs ran on different code (`_code_key`; commits
    that differ only outside `RUN_PATHS` are one code)} over a result's runs."""
    rows = [r for v in result["variants"].values() for r in v["runs"]]
    counts = collections.Counter(code_label(run_code(result, r), bool(r.get("reused"))) for r in rows)
    keys = {_code_key(run_code(result, r)) for r in rows}
    same = len(keys) == 1 and next(iter(keys))[0] is not None
    return {"runs": dict(counts), "mixed": len(counts) > 1 and not same}


def _runs(n: int) -> str:
    """"1 run", "3 runs"."""
    return f"{n} run{'' if n == 1 else 's'}"


def code_line(result: dict[str, Any]) -> str:
    """The header's "code: ..." of a result: its runs' commit(s), "mixed: a (n runs), b (m runs)"
    when they differ."""
    summary = code_summary(result)
    runs = summary["runs"]
    if not runs:
        return "code: no runs"
    if len(runs) == 1:
        return f"code: {next(iter(runs))}"
    line = ", ".join(f"{label} ({_runs(n)})" for label, n in runs.items())
    if not summary["mixed"]:
        return f"code: {line}, commits that differ only outside {', '.join(RUN_PATHS)} (the same code)"
    return "code: mixed: " + line


def machine_line(result: dict[str, Any]) -> str:
    """The header's machine: the one every run recorded (`provenance.machine`); else each
    machine with its number of runs, runs made before rows kept it counted as "not recorded",
    beside the machine that wrote the JSON. Runs of one code and seed on CPUs with different
    vector extensions give different numbers, so a table says where its runs ran."""
    rows = [r for v in result["variants"].values() for r in v["runs"]]
    counts = collections.Counter(r.get("machine") for r in rows)
    if len(counts) == 1 and None not in counts:
        return next(iter(counts))
    parts = [f"{m} ({_runs(n)})" for m, n in counts.items() if m is not None]
    if None in counts:
        written_on = (result.get(provenance.KEY) or {}).get("machine") or result["versions"]["machine"]
        parts.append(f"not recorded ({_runs(counts[None])}; the JSON was "
                     f"written on {written_on})")
    return "machines: " + ", ".join(parts)


def _row_of(table: Table, variant: Variant, seed: int, out_dir: Path, wall: float, cpu: float,
            code: int, ran_on: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result row of one finished run: its cell values (or its error), wall and CPU seconds,
    the code it ran on (`code_state`)."""
    row: dict[str, Any] = {"seed": seed, "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), **(ran_on or {})}
    if code != 0:
        row["error"] = f"exit status {code}"
        return row
    summary = json.loads((out_dir / "summary.json").read_text())
    if int(summary.get("attempts", 1)) > 1:
        # resumed: the trainer's own count covers every attempt (each up to its last checkpoint,
        # the last to its end), where this process saw the last attempt alone
        row.update(wall_seconds=round(float(summary["wall_seconds"]), 1), cpu_seconds=round(float(summary["cpu_seconds"]), 1),
                   attempts=int(summary["attempts"]))
    metrics = logged_metrics(out_dir / "metrics.jsonl")
    row["values"] = {k: read_value(summary, metrics, k) for k in table.keys_of(variant.name)}
    return row


def finished_row(table: Table, variant: Variant, seed: int, out_dir: Path, cmd: Sequence[str],
                 current: dict[str, Any] | None = None, *, other_code: bool = False,
                 passed: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The row of an earlier run of exactly this command that finished (resume), else None. A
    run's record is written only after it exits 0, so a run killed midway is rerun. A run made
    on code other than `current` (a `code_state`; `equivalent_code` counts as the same; a record
    without one counts as other code) is reused only with `other_code`; otherwise its code is
    appended to `passed`."""
    record = out_dir / RUN_RECORD
    if not record.exists():
        return None
    saved = json.loads(record.read_text())
    if saved.get("argv") != list(cmd[1:]) or not (out_dir / "summary.json").exists():
        return None
    ran_on = {k: saved[k] for k in ("commit", "dirty", "diff", "attempts", "machine") if k in saved}
    if not other_code and not equivalent_code(ran_on, current or {}):
        if passed is not None:
            passed.append(ran_on)
        return None
    row = _row_of(table, variant, seed, out_dir, saved["wall_seconds"], saved["cpu_seconds"], 0, ran_on)
    return row | {"argv": portable(cmd[1:]), "reused": True}


def _say_other_code(table: Table, variant: Variant, seed: int, ran_on: dict[str, Any],
                    current: dict[str, Any] | None) -> None:
    print(f"[evidence:{table.name}] {variant.name} seed {seed}: made on {code_label(ran_on)}, the code is now "
          f"{code_label(current or {})}: runs again (--reuse-other-commits keeps it)", flush=True)


def portable(argv: Sequence[str]) -> list[str]:
    """`argv` with this checkout's path written as "<repo>": how a result JSON names a run's
    command, so a later session (another machine, the same repo) can match it."""
    return [a.replace(str(ROOT), "<repo>") for a in argv]


def recorded_row(previous: dict[str, Any] | None, variant: Variant, seed: int, cmd: Sequence[str],
                 current: dict[str, Any] | None = None, *, other_code: bool = False,
                 passed: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The row of (variant, seed) in a previous result JSON if it ran exactly `cmd` and finished:
    a table resumes from its committed JSON when the run directories are gone (a new machine).
    Only a row made on the `current` code (or `equivalent_code`), unless `other_code` (otherwise
    its code is appended to `passed`); a row without its own record of the code gets the JSON's
    (`run_code`, kept in the row as "commit" with "commit_inferred")."""
    rows = ((previous or {}).get("variants", {}).get(variant.name) or {}).get("runs", [])
    for row in rows:
        if row.get("seed") == seed and "values" in row and row.get("argv") == portable(cmd[1:]):
            ran_on = run_code(previous, row)
            if not other_code and not equivalent_code(ran_on, current or {}):
                if passed is not None:
                    passed.append(ran_on)
                return None
            out = dict(row, reused=True)
            if ran_on.get("inferred"):
                out.update(commit=ran_on["commit"], commit_inferred=True)
            return out
    return None


Started = tuple[subprocess.Popen, list[str], Path, float, dict[str, Any]]  # process, argv, dir, start, code


def prepare_run_dir(out_dir: Path, cmd: Sequence[str], code: dict[str, Any]) -> int:
    """For a table whose runs resume: the attempt this start is (1 for a fresh run). An output
    dir whose started record names the same argv and the same code is kept, so the run continues
    from its last checkpoint; any other (another command, other code, no record) is emptied
    first, so a run never continues one made by something else."""
    record = out_dir / STARTED_RECORD
    saved = json.loads(record.read_text()) if record.exists() else {}
    if saved.get("argv") == list(cmd[1:]) and equivalent_code(saved.get("code") or {}, code):
        attempt = int(saved.get("attempts", 1)) + 1
    else:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        attempt = 1
    out_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"argv": list(cmd[1:]), "code": code, "attempts": attempt}, indent=1))
    return attempt


def start_run(table: Table, variant: Variant, seed: int, runs_root: Path, steps: int | None,
              cpus: Sequence[int] | None = None) -> Started:
    """Starts one (variant, seed) run in its own process (pinned to `cpus` when given), noting
    the code it starts on (the process imports it as it starts) and the machine (`machine`)."""
    out_dir = runs_root / table.name / variant.name / f"seed_{seed}"
    cmd = run_command(table, variant, seed, out_dir, steps)
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    ran_on = {**code_state(), "machine": provenance.machine()}
    if table.resume:
        attempt = prepare_run_dir(out_dir, cmd, ran_on)
        if attempt > 1:
            print(f"[evidence:{table.name}] {variant.name} seed {seed}: attempt {attempt}, continuing from its last "
                  "checkpoint", flush=True)
            ran_on = {**ran_on, "attempts": attempt}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(runs_root), preexec_fn=pin,
                            stdout=subprocess.DEVNULL if cpus is not None else None)
    return proc, cmd, out_dir, time.perf_counter(), ran_on


def finish_run(table: Table, variant: Variant, seed: int, started: Started, status: int, usage: Any) -> dict[str, Any]:
    """The row of a run that exited with wait status `status`; its record is written on success."""
    _, cmd, out_dir, t0, ran_on = started
    wall, cpu = time.perf_counter() - t0, usage.ru_utime + usage.ru_stime
    code = os.waitstatus_to_exitcode(status)
    row = _row_of(table, variant, seed, out_dir, wall, cpu, code, ran_on)
    if code == 0:
        row["argv"] = portable(cmd[1:])
        (out_dir / RUN_RECORD).write_text(json.dumps(
            {"argv": cmd[1:], "wall_seconds": row["wall_seconds"], "cpu_seconds": row["cpu_seconds"], **ran_on},
            indent=1))
    return row


def mean_std(values: Sequence[float]) -> dict[str, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def aggregate(table: Table, runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """variant -> key -> {mean, std, n} over the variant's successful runs."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for variant, rows in runs.items():
        ok = [r["values"] for r in rows if "values" in r]
        out[variant] = {}
        for key in table.keys_of(variant):
            vals = [v[key] for v in ok if v.get(key) is not None]
            if vals:
                out[variant][key] = mean_std(vals)
        walls = [r["wall_seconds"] for r in rows]
        if walls:
            out[variant]["wall_seconds"] = mean_std(walls)
    return out


def versions() -> dict[str, str]:
    """Python, platform and the versions of the packages a run depends on."""
    out = {"python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    for pkg in ("jax", "jaxlib", "flax", "optax", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    state = code_state()
    if state:  # the checkout when the JSON is written; each run's own code is in its row
        out["git_commit"] = state["commit"]
        out["git_dirty"] = state["dirty"]
    return out


def command_line(table_name: str, seeds: Sequence[int], steps: int | None) -> str:
    """The repo command that reproduces a table."""
    cmd = f"python scripts/evidence.py {table_name} --seeds {' '.join(map(str, seeds))}"
    return cmd + (f" --steps {steps}" if steps is not None else "")


def run_table(table: Table, seeds: Sequence[int], steps: int | None, runs_root: Path,
              on_run: Callable[[dict[str, Any]], None] | None = None, jobs: int = 1,
              previous: dict[str, Any] | None = None, *, reuse_other_commits: bool = False,
              only: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs every (variant, seed) not already finished on this code (in its run directory, or as
    a row of `previous`, the table's last result JSON; with `reuse_other_commits` also those
    made on other code, which the table then reports as mixed), seed-major (so a partial table
    has whole paired seeds), `jobs` processes at a time (each pinned to its own share of the CPUs
    when jobs > 1); the result JSON as a dict. `on_run(partial result)` is called after every run.
    With `only`, the other variants run nothing: their rows are kept from `previous` whatever
    code made them (the table then names each run's code)."""
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in table.variants}
    todo = []
    current = code_state()
    for seed in seeds:
        for variant in table.variants:
            out_dir = runs_root / table.name / variant.name / f"seed_{seed}"
            cmd = run_command(table, variant, seed, out_dir, steps)
            passed: list[dict[str, Any]] = []
            if only is not None and variant.name not in only:
                kept = recorded_row(previous, variant, seed, cmd, current, other_code=True, passed=passed)
                if kept is not None:
                    runs[variant.name].append(kept)
                continue
            done = (finished_row(table, variant, seed, out_dir, cmd, current, other_code=reuse_other_commits,
                                 passed=passed)
                    or recorded_row(previous, variant, seed, cmd, current, other_code=reuse_other_commits,
                                    passed=passed))
            if done is None and passed:
                _say_other_code(table, variant, seed, passed[0], current)
            if done is not None:
                runs[variant.name].append(done)
            else:
                todo.append((variant, seed))
    print(f"[evidence:{table.name}] {len(todo)} runs to go, {sum(map(len, runs.values()))} reused", flush=True)
    cpu_sets = _cpu_sets(jobs)
    free, running = list(range(len(cpu_sets))), {}
    while todo or running:
        while todo and free:
            slot = free.pop(0)
            variant, seed = todo.pop(0)
            proc_info = start_run(table, variant, seed, runs_root, steps, cpu_sets[slot] if jobs > 1 else None)
            running[proc_info[0].pid] = (slot, variant, seed, proc_info)
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:
            continue
        slot, variant, seed, proc_info = running.pop(pid)
        free.append(slot)
        row = finish_run(table, variant, seed, proc_info, status, usage)
        runs[variant.name].append(row)
        runs[variant.name].sort(key=lambda r: list(seeds).index(r["seed"]))
        print(f"[evidence:{table.name}] {variant.name} seed {seed}: {row.get('error', 'ok')}, "
              f"{row['wall_seconds']:.0f} s ({len(todo)} to start)", flush=True)
        if on_run is not None:
            on_run(_result(table, seeds, steps, runs, started, complete=False))
    return _result(table, seeds, steps, runs, started, complete=True)


def _cpu_sets(jobs: int) -> list[list[int]]:
    """The CPUs of each of `jobs` concurrent runs: this process's CPUs dealt out round-robin."""
    cpus = sorted(os.sched_getaffinity(0))
    jobs = max(1, min(jobs, len(cpus)))
    return [cpus[i::jobs] for i in range(jobs)]


def _result(table: Table, seeds: Sequence[int], steps: int | None, runs: dict[str, list[dict[str, Any]]],
            started: float, *, complete: bool) -> dict[str, Any]:
    """The result JSON of the runs so far."""
    result = {
        "complete": complete,
        "table": table.name,
        "title": table.title,
        "command": command_line(table.name, seeds, steps),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": table.config,
        "base_overrides": list(table.base),
        "steps_override": steps,
        "config_steps": config_steps(table),
        "seeds": list(seeds),
        "variants": {
            v.name: {"label": v.label, "overrides": list(v.overrides), "runs": runs.get(v.name, [])}
            for v in table.variants
        },
        "aggregate": aggregate(table, runs),
        "total_wall_seconds": round(time.perf_counter() - started, 1),
        "versions": versions(),
        provenance.KEY: provenance.record(command_line(table.name, seeds, steps)),
    }
    result["code"] = code_summary(result)  # the runs' code; "mixed" when they differ
    return result


# ----------------------------------------------------------------------------------------------
# the README table


def fmt_cell(stats: dict[str, float] | None, digits: int) -> str:
    """'mean ± std' (counts >= 10 without decimals), 'mean (1 seed)' when one run produced the
    value (a spread needs two), or 'n/a' when none did."""
    if stats is None:
        return "n/a"
    m, s = stats["mean"], stats["std"]
    whole = float(m).is_integer() and float(s).is_integer() and abs(m) >= 10
    mean = f"{m:,.0f}" if whole else f"{m:.{digits}f}"
    if stats.get("n") == 1:
        return f"{mean} (1 seed)"
    return f"{mean} ± {s:,.0f}" if whole else f"{mean} ± {s:.{digits}f}"


def paired_values(result: dict[str, Any], comparison: Comparison) -> list[tuple[int, float, float]]:
    """(seed, variant value, baseline value) for every seed where both runs produced their key
    on the same code (`run_code`, `_code_key`: the same `RUN_PATHS`, the same uncommitted changes), in seed order: the
    pairs of a paired comparison (same seed = same initialisation, tasks and sampling keys
    wherever the two configs agree). Runs on different code are not paired: a config or the
    library may have changed between them. Commits that change nothing a run reads (`run_tree`)
    are the same code."""
    def by_seed(variant: str, key: str) -> dict[int, tuple[float, tuple[Any, Any]]]:
        rows = result["variants"].get(variant, {}).get("runs", [])
        return {r["seed"]: (r["values"][key], _code_key(run_code(result, r)))
                for r in rows if r.get("values", {}).get(key) is not None}

    a = by_seed(comparison.variant, comparison.key)
    b = by_seed(comparison.baseline, comparison.baseline_key or comparison.key)
    return [(seed, a[seed][0], b[seed][0]) for seed in result["seeds"]
            if seed in a and seed in b and a[seed][1] == b[seed][1]]


def _seeds_with_both(result: dict[str, Any], comparison: Comparison) -> int:
    """Seeds where both sides of `comparison` have their value, whatever code made them."""
    def seeds(variant: str, key: str) -> set[int]:
        rows = result["variants"].get(variant, {}).get("runs", [])
        return {r["seed"] for r in rows if r.get("values", {}).get(key) is not None}

    return len(seeds(comparison.variant, comparison.key)
               & seeds(comparison.baseline, comparison.baseline_key or comparison.key))


def _code_key(code: dict[str, Any]) -> tuple[Any, Any]:
    """What two runs must share to be paired: the code their commit runs (`run_tree`: commits
    that differ only outside `RUN_PATHS` are one code) and their uncommitted changes."""
    commit = code.get("commit")
    return (run_tree(commit) if commit else None), code.get("diff")


@functools.lru_cache(maxsize=None)
def run_tree(commit: str, root: Path | None = None) -> str:
    """The git entries (object ids) of `RUN_PATHS` at `commit`, joined: equal for two commits exactly when
    nothing a run executes or reads differs between them. The commit itself where git cannot
    resolve it here (a result written in another clone), so such runs pair only with their own
    commit's."""
    try:
        out = subprocess.run(["git", "ls-tree", commit, "--", *RUN_PATHS], cwd=root or ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return commit
    return " ".join(out.split())


def bootstrap_interval(diffs: Sequence[float], *, level: float = 0.95, resamples: int = 10_000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `diffs` (seeds resampled with replacement;
    a fixed generator seed, so a table renders the same every time)."""
    d = np.asarray(diffs, float)
    means = d[np.random.default_rng(seed).integers(0, d.size, (resamples, d.size))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def sign_flip_p(diffs: Sequence[float], *, exact_up_to: int = 16, draws: int = 100_000) -> float:
    """Two-sided p-value of the paired sign-flip (permutation) test: under "no effect" each
    difference's sign is a coin flip; p = P(|mean of flipped diffs| >= |observed mean|). Exact
    over all 2^n sign patterns up to `exact_up_to` seeds, Monte Carlo beyond."""
    d = np.asarray(diffs, float)
    if d.size <= exact_up_to:
        signs = 1 - 2 * ((np.arange(2**d.size)[:, None] >> np.arange(d.size)) & 1)
    else:
        signs = np.random.default_rng(0).choice([-1.0, 1.0], (draws, d.size))
    flipped = np.abs((signs * d).mean(axis=1))
    return float(np.mean(flipped >= abs(d.mean()) - 1e-12))


def paired_stats(pairs: Sequence[tuple[int, float, float]]) -> dict[str, Any] | None:
    """Mean of each side, the mean paired difference, its 95% bootstrap interval, the sign-flip
    p-value and the verdict: "holds" when the interval is above 0 and p < 0.05, "reversed" when
    it is below 0 and p < 0.05, else "undecided" (the percentile bootstrap is too narrow with few
    seeds; with 3 seeds p cannot go below 0.25, so both must agree)."""
    if len(pairs) < 2:
        return None
    diffs = [a - b for _, a, b in pairs]
    lo, hi = bootstrap_interval(diffs)
    p = sign_flip_p(diffs)
    return {
        "n": len(pairs), "seeds": [s for s, _, _ in pairs],
        "variant_mean": statistics.fmean(a for _, a, _ in pairs),
        "baseline_mean": statistics.fmean(b for _, _, b in pairs),
        "difference": statistics.fmean(diffs), "ci95": [lo, hi], "p": p,
        "verdict": ("holds" if lo > 0 and p < 0.05 else "reversed" if hi < 0 and p < 0.05 else "undecided"),
    }


def comparison_lines(table: Table, result: dict[str, Any]) -> list[str]:
    """The paired-comparison table: one line per comparison over the seeds both sides have."""
    d = table.digits
    lines = ["| comparison | variant | baseline | paired difference | 95% bootstrap interval | sign-flip p | "
             "seeds | verdict |", "|---|---|---|---|---|---|---|---|"]
    for c in table.comparisons:
        stats = paired_stats(paired_values(result, c))
        if stats is None:
            if _seeds_with_both(result, c) >= 2:  # the values exist, on different code
                lines.append(f"| {c.what} | — | — | — | — | — | 0 | **not paired**: the two sides ran on "
                             "different code |")
            continue
        lo, hi = stats["ci95"]
        lines.append(f"| {c.what} | {stats['variant_mean']:.{d}f} | {stats['baseline_mean']:.{d}f} | "
                     f"{stats['difference']:+.{d}f} | [{lo:+.{d}f}, {hi:+.{d}f}] | {stats['p']:.3f} | "
                     f"{stats['n']} | **{stats['verdict']}** |")
    return lines if len(lines) > 2 else []


def per_seed_lines(table: Table, result: dict[str, Any]) -> list[str]:
    """Every seed's raw value of each (variant, key) a comparison reads, one row per seed."""
    cols = list(dict.fromkeys(
        [(c.variant, c.key) for c in table.comparisons] + [(c.baseline, c.baseline_key or c.key) for c in table.comparisons]))
    if not cols:
        return []
    rows = {v: {r["seed"]: r for r in result["variants"].get(v, {}).get("runs", [])} for v, _ in cols}
    labels = [f"{v} {k}" for v, k in cols]
    lines = ["| seed | " + " | ".join(labels) + " |", "|---|" + "---|" * len(cols)]
    for seed in result["seeds"]:
        cells = []
        for v, k in cols:
            run = rows[v].get(seed)
            value = None if run is None else run.get("values", {}).get(k)
            cells.append("—" if value is None else f"{value:.{table.digits}f}")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return lines


def markdown(table: Table, result: dict[str, Any]) -> str:
    """The README block of a table: caption, command, the table, per-cell note, comparisons."""
    agg = result["aggregate"]
    seeds = result["seeds"]
    steps = result["steps_override"]
    walls = [r["wall_seconds"] for v in result["variants"].values() for r in v["runs"]]
    cpus = [r["cpu_seconds"] for v in result["variants"].values() for r in v["runs"] if "cpu_seconds" in r]
    failed = [f"{name} seed {r['seed']}" for name, v in result["variants"].items() for r in v["runs"] if "error" in r]
    steps_text = _steps_in(table, steps, result.get("config_steps"))
    if code_summary(result)["mixed"]:
        steps_text += " (as the config read when the JSON was last written; runs on other code may have read others)"
    cpu_text = f", {sum(cpus) / 60:.0f} CPU-min" if len(cpus) == len(walls) else ""
    lines = [
        f"**{table.title}.** Mean ± sample std over seeds {', '.join(map(str, seeds))}; {steps_text}; "
        f"{result['date']}, {machine_line(result)}, jax {result['versions']['jax']}; "
        f"{len(walls)} runs, {sum(walls) / 60:.0f} min of run wall time{cpu_text}; {code_line(result)}.",
        "",
        f"Command: `{result['command']}` (config `{table.config}`, overrides in `results/evidence_{table.name}.json`)",
        "",
        "| | " + " | ".join(c.label for c in table.columns) + " |",
        "|---|" + "---|" * len(table.columns),
    ]
    for row in table.rows:
        cells = []
        for col in table.columns:
            variant = row.variant or col.variant
            cells.append(fmt_cell(agg.get(variant, {}).get(col.key + row.key), table.digits))
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    lines.append("")
    paired = comparison_lines(table, result)
    if paired:
        lines += ["Paired over seeds (variant minus baseline on the same seed; the interval is a 95% percentile "
                  "bootstrap of the mean difference, p the two-sided exact sign-flip test):", "", *paired, ""]
    lines += [f"- {text}" for text in note_texts(table, result)]
    if failed:
        lines.append(f"- Failed runs (left out of the means): {', '.join(failed)}.")
    if not result.get("complete", True):
        total = len(table.variants) * len(seeds)
        lines.append(f"- Incomplete: {len(walls)} of {total} runs finished; means are over the finished runs.")
    raw = per_seed_lines(table, result)
    if raw:
        lines += ["", "<details><summary>Per-seed values</summary>", "", *raw, "", "</details>"]
    return "\n".join(lines).rstrip() + "\n"


def note_texts(table: Table, result: dict[str, Any]) -> list[str]:
    """The table's notes computed from `result`; a note whose figures the result lacks is left out."""
    facts, out = Facts(table, result), []
    for note in table.notes:
        try:
            text = note(facts)
        except Missing as e:
            print(f"[evidence:{table.name}] a note left out: the result has no {e}", file=sys.stderr)
            continue
        if text:
            out.append(text)
    return out


def config_steps(table: Table) -> dict[str, str]:
    """The RL and warm-start step counts `table.config` sets now ({} when unreadable): recorded in
    a result, since the config may change after its runs."""
    try:
        import yaml

        cfg = yaml.safe_load((ROOT / table.config).read_text())
        return {"train.steps": str(cfg["train"]["steps"]),
                "train.warm_start.steps": str(cfg["train"].get("warm_start", {}).get("steps", 0))}
    except (OSError, KeyError, TypeError):
        return {}


def _steps_in(table: Table, steps: int | None = None, recorded: dict[str, str] | None = None) -> str:
    """The warm-start / RL step counts of the runs (--steps, the base overrides, the config's
    counts as recorded with the result, else as the config sets them now)."""
    found = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in table.base if o.startswith("train.")}
    if steps is not None:
        found["train.steps"] = f"{steps} (--steps)"
    for key, value in (recorded if recorded is not None else config_steps(table)).items():
        found.setdefault(key, value)
    return f"{found.get('train.warm_start.steps', '?')} warm-start steps then {found.get('train.steps', '?')} RL steps per run"


def replace_block(text: str, name: str, block: str) -> str:
    """`text` with the part between the table's README markers replaced by `block`."""
    start, end = f"<!-- evidence:{name}:start -->", f"<!-- evidence:{name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"README has no {start} ... {end} markers; add them where the table belongs")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block}{end}{tail}"


README = ROOT / "README.md"


def headline_text(table: Table, result: dict[str, Any]) -> str | None:
    """The table's README sentence from its result; None when it has none or lacks the figures."""
    if table.headline is None:
        return None
    try:
        return table.headline(Facts(table, result))
    except Missing:
        return None


def replace_headline(text: str, name: str, sentence: str) -> str:
    """README text with the sentence between the table's readme markers replaced."""
    return replace_block(text, f"{name}:readme", sentence + "\n")


def run_and_render(table: Table, args: argparse.Namespace) -> int:
    """Runs one table (or reads its JSON with --render), writes the JSON and its markdown block;
    0 when every run finished."""
    out = Path(args.out) if args.out else ROOT / "results" / f"evidence_{table.name}.json"
    if args.render:
        result = json.loads(out.read_text())
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        previous = json.loads(out.read_text()) if out.exists() else None
        save = lambda partial: out.write_text(json.dumps(partial, indent=2) + "\n")  # noqa: E731
        result = run_table(table, args.seeds, args.steps, ROOT / args.runs, on_run=save, jobs=args.jobs,
                           previous=previous, reuse_other_commits=args.reuse_other_commits, only=args.variants)
    block = markdown(table, result)
    result["markdown"] = block
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(block)
    print(f"wrote {out}")
    if not args.no_readme:
        readme = Path(args.readme)
        readme.write_text(replace_block(readme.read_text(), table.name, block))
        print(f"updated {readme}")
        sentence = headline_text(table, result)
        if sentence is not None:
            README.write_text(replace_headline(README.read_text(), table.name, sentence))
            print(f"updated {README}'s sentence on {table.name}")
    return 0 if all("values" in r for v in result["variants"].values() for r in v["runs"]) else 1


def start_in_background(argv: Sequence[str], runs_root: Path) -> int:
    """Re-runs this command without --background as a detached process logging to
    <runs>/evidence.log; rerunning the same command later resumes where it stopped."""
    runs_root.mkdir(parents=True, exist_ok=True)
    log = runs_root / "evidence.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), *[a for a in argv if a != "--background"]]
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"running in the background, pid {proc.pid}; progress: tail -f {log}\n"
          "after a stop, the same command resumes (finished runs are reused)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="+", choices=sorted(TABLES), metavar="table",
                        help=f"one or more of {', '.join(sorted(TABLES))}, run in order")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the table's)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each pinned to its share of the CPUs (wall times are then per share)")
    parser.add_argument("--background", action="store_true", help="detach; log to <runs>/evidence.log")
    parser.add_argument("--runs", default="runs/evidence", help="parent of the per-run output dirs")
    parser.add_argument("--out", default=None, help="result JSON of a single table (default results/evidence_<table>.json)")
    parser.add_argument("--readme", default="docs/evidence.md", help="markdown file whose table is rewritten")
    parser.add_argument("--no-readme", action="store_true", help="write the JSON only")
    parser.add_argument("--reuse-other-commits", action="store_true",
                        help="reuse finished runs made on other code too (the table then says it mixes code)")
    parser.add_argument("--variants", nargs="+", default=None, metavar="variant",
                        help="run only these variants; the others keep their rows from the result JSON")
    parser.add_argument("--render", action="store_true",
                        help="run nothing: re-render the README table (notes included) from the result JSON")
    args = parser.parse_args(argv)
    if args.out and len(args.tables) > 1:
        parser.error("--out names one table's JSON: give one table")
    if args.background:
        return start_in_background(sys.argv[1:] if argv is None else argv, ROOT / args.runs)
    return max(run_and_render(TABLES[name], args) for name in args.tables)


if __name__ == "__main__":
    sys.exit(main())
