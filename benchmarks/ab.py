"""jmarl's train step on two commits, interleaved on one machine: did a change make it slower?

    python -m benchmarks.ab --base REV [--head REV] [--shape cpu-small] [--rounds 5] [--steps 9]

A single run of the CPU suite cannot tell a change of a few percent from the machine's own
drift (docs/benchmarks.md, "Regression check across a refactor"): both sides of its paired rows
move together, but two runs minutes apart differ by more than that. Here each commit is checked
out into a temporary git worktree, and the two are timed in alternating child processes, round
by round (base, head, base, head, ...), each child importing jmarl and the benchmark code of its
own checkout: it writes the shape's checkpoint, builds the packed GRPO batch and jits the update
exactly as `benchmarks.train_step` does, runs two untimed steps, then times `--steps` steps and
reports their median. Per round, the ratio head / base of the two medians; the result is their
median, range, and how many rounds head was the slower, in
benchmarks/results/regression/ab_<base>_<head>.json (with the provenance record).

The child's code uses only what both ends must have (`benchmarks.train_step.jmarl_step`,
`benchmarks.common.write_checkpoint`, `benchmarks.parity.make_batch`, `jmarl.models.load_hf`):
a base older than those gives a clear error from its child.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "regression"

CHILD = """
import os, statistics, sys, tempfile
sys.path.insert(0, os.getcwd())
import jmarl
assert os.path.realpath(jmarl.__file__).startswith(os.path.realpath(os.getcwd())), jmarl.__file__
from benchmarks.common import GROUP_SIZE, NEW_TOKENS, NUM_PROMPTS, PROMPT_LEN, write_checkpoint
from benchmarks.parity import make_batch
from benchmarks.train_step import jmarl_step
from jmarl.models import load_hf
shape, steps = sys.argv[1], int(sys.argv[2])
with tempfile.TemporaryDirectory() as d:
    write_checkpoint(shape, d, tokenizer=False)
    config, params = load_hf(d)
    batch = make_batch(config.vocab_size, NUM_PROMPTS * GROUP_SIZE, PROMPT_LEN, NEW_TOKENS, group_size=GROUP_SIZE)
    run, _ = jmarl_step(config, params, batch)
    run(0), run(1)
    times = [run(i) for i in range(steps)]
print("AB_SECONDS", statistics.median(times), int(batch.tokens.size))
"""


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The short commit of `rev` in this repository (JmarlError if git does not know it)."""
    try:
        return _git("rev-parse", "--short", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        from jmarl.errors import JmarlError

        raise JmarlError(f"benchmarks.ab: git knows no commit {rev!r} in {ROOT}") from None


def time_step(checkout: Path, shape: str, steps: int) -> tuple[float, int]:
    """(median seconds of one train step, tokens per step) measured in a child process whose
    working directory, and so whose jmarl and benchmarks, are `checkout`'s."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD, shape, str(steps)], cwd=checkout, env=env,
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("AB_SECONDS ")]
    if proc.returncode != 0 or not lines:
        from jmarl.errors import JmarlError

        raise JmarlError(f"benchmarks.ab: the train step in {checkout} failed (exit {proc.returncode}):\n"
                         + proc.stderr[-2000:])
    _, seconds, tokens = lines[-1].split()
    return float(seconds), int(tokens)


def summarize(base: list[float], head: list[float]) -> dict[str, Any]:
    """Per-round ratios head / base of the step seconds (> 1: head slower), their median and
    range, and the rounds in which head was slower."""
    ratios = [h / b for b, h in zip(base, head, strict=True)]
    return {"ratios": ratios, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds_head_slower": sum(r > 1 for r in ratios), "rounds": len(ratios)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit before the change")
    parser.add_argument("--head", default="HEAD", help="the commit after it (default HEAD)")
    parser.add_argument("--shape", default="cpu-small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=9, help="timed steps per child (their median counts)")
    parser.add_argument("--out", type=Path, help="the result file (default benchmarks/results/regression/ab_<base>_<head>.json)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    sys.path.insert(0, str(ROOT))
    from jmarl import provenance

    base, head = resolve(args.base), resolve(args.head)
    record = provenance.record("python -m benchmarks.ab " + " ".join(argv if argv is not None else sys.argv[1:]))
    seconds: dict[str, list[float]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp:
        checkouts = {rev: Path(tmp) / rev for rev in (base, head)}
        for rev, path in checkouts.items():
            _git("worktree", "add", "--detach", "--force", str(path), rev)
        try:
            for r in range(args.rounds):
                for side, rev in (("base", base), ("head", head)):
                    s, tokens = time_step(checkouts[rev], args.shape, args.steps)
                    seconds[side].append(s)
                    print(f"[ab round {r + 1}/{args.rounds}] {side} {rev}: {s:.4f} s a step ({tokens / s:,.0f} tokens/s)",
                          flush=True)
        finally:
            for path in checkouts.values():
                _git("worktree", "remove", "--force", str(path))
    summary = summarize(seconds["base"], seconds["head"])
    result = {"base": base, "head": head, "shape": args.shape, "steps": args.steps,
              "base_seconds": seconds["base"], "head_seconds": seconds["head"], "tokens_per_step": tokens, **summary,
              provenance.KEY: record}
    out = args.out or OUT / f"ab_{base}_{head}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[ab] {args.shape} train step, head {head} / base {base}: median {summary['ratio_median']:.3f}x the "
          f"time (range {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}; head slower in "
          f"{summary['rounds_head_slower']} of {summary['rounds']} rounds) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
