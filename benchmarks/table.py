"""The markdown table of a suite's results (docs/benchmarks.md), written between `<!-- bench:<suite>:start -->` and
`<!-- bench:<suite>:end -->` (everything between the markers is replaced; nothing else moves).

    python -m benchmarks.table benchmarks/results/cpu.json docs/benchmarks.md
    python -m benchmarks.table other-host/cpu.json docs/benchmarks.md --marker cpu-other-host

`--marker NAME` writes between `<!-- bench:NAME:start/end -->` instead of the suite's own markers
(a second host's run of the same suite, beside the first).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

# docs/benchmarks.md "What to beat": row name -> (minimum jmarl / baseline ratio, what is compared).
TARGETS: dict[str, tuple[float, str]] = {
    "train_step_vs_torch_eager": (1.3, "train step (GRPO loss + backward + AdamW), tokens/s vs PyTorch eager"),
    "train_step_vs_torch_compile": (1.3, "train step, tokens/s vs `torch.compile`"),
    "generation_vs_hf_generate": (2.5, "generation, new tokens/s vs HF `generate`, batch 64"),
    "generation_small_batch_vs_hf_generate": (4.0, "generation, new tokens/s vs HF `generate`, batch 8"),
    "grpo_iteration_vs_trl": (2.0, "whole GRPO iteration, completions/s vs TRL `GRPOTrainer`"),
    "magrpo_iteration_vs_comlrl": (3.0, "whole MAGRPO iteration (2 agents), completions/s vs CoMLRL"),
    "train_step_mfu": (0.4, "train step model FLOPs utilisation (bf16)"),
}
# The train step must also reach this fraction of the measured matmul peak, in the FLOP/s it
# executes (with prompt sharing that is less than the dense model FLOP/s of its tokens).
PEAK_FRACTION_TARGET = 0.8


def peak_fraction(row: dict[str, Any]) -> float | None:
    """The fraction of the matmul peak a train-step row runs at: executed FLOP/s where the row
    has them (shared-prefix steps), else model FLOP/s."""
    return row.get("jmarl_executed_fraction_of_peak", row.get("jmarl_fraction_of_peak"))


def _markers(suite: str) -> tuple[str, str]:
    return f"<!-- bench:{suite}:start -->", f"<!-- bench:{suite}:end -->"


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    x = float(x)
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def row_ratio(row: dict[str, Any]) -> float | None:
    """The ratio the table quotes: the median of the paired ratios (else the ratio of medians)."""
    return row.get("paired_ratio_median", row.get("ratio"))


def target_met(row: dict[str, Any]) -> bool | None:
    """Whether a row reaches its docs/benchmarks.md target (None: no target for this row)."""
    target = TARGETS.get(row["name"])
    if target is None:
        return None
    value = row.get("mfu") if row["name"] == "train_step_mfu" else row_ratio(row)
    if value is None:
        return None
    ok = value >= target[0]
    if row["name"] == "train_step_vs_torch_eager" and peak_fraction(row) is not None:
        ok = ok and peak_fraction(row) >= PEAK_FRACTION_TARGET
    return ok


def render_table(results: dict[str, Any]) -> str:
    """Markdown for a suite's results dict (as `benchmarks.run` writes it)."""
    lines = []
    machine = results.get("machine", {})
    vers = results.get("versions", {})
    peak = results.get("matmul_peak", {}).get("matmul_peak_flops")
    desc = machine.get("cpu_model") or machine.get("processor", "?")
    detail = [f"family {machine['cpu_family']} model {machine['cpu_model_number']}"] if "cpu_family" in machine else []
    detail += [machine["vector_isa"]] if "vector_isa" in machine else []
    desc += f" ({', '.join(detail)})" if detail else ""
    head = (f"Suite `{results.get('suite')}`{' (quick)' if results.get('quick') else ''}, {results.get('created', '?')}: "
            f"{desc}, {machine.get('cpu_count', '?')} cores, devices {', '.join(machine.get('jax_devices', []))}; "
            f"jax {vers.get('jax', '?')}, torch {vers.get('torch', '?')}, transformers {vers.get('transformers', '?')}, "
            f"trl {vers.get('trl', '-')}, comlrl {vers.get('comlrl', '-')}.")
    if peak:
        head += f" Measured matmul peak (XLA, {results['matmul_peak'].get('dtype', 'float32')}): {peak / 1e9:,.0f} GFLOP/s."
    git = results.get("git") or {}
    if git.get("commit"):
        head += (f" Code: commit {git['commit']}{' with uncommitted changes' if git.get('dirty') else ''}"
                 f"{' (' + git['note'] + ')' if git.get('note') else ''}.")
    lines += [head, "", f"Command: `{results.get('command', 'python -m benchmarks.run')}`", ""]
    lines.append("| benchmark | shape | metric | jmarl | baseline | jmarl / baseline (median of pairs) | target | reached |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for row in results.get("rows", []):
        target = TARGETS.get(row["name"])
        met = target_met(row)
        jm = _fmt(row.get("jmarl"))
        if row.get("jmarl_executed_fraction_of_peak") is not None:
            jm += (f" ({row['jmarl_flops'] / 1e9:,.0f} model GFLOP/s; executes {row['jmarl_executed_flops'] / 1e9:,.0f}, "
                   f"{100 * row['jmarl_executed_fraction_of_peak']:.0f}% of peak)")
        elif row.get("jmarl_fraction_of_peak") is not None:
            jm += f" ({row['jmarl_flops'] / 1e9:,.0f} GFLOP/s, {100 * row['jmarl_fraction_of_peak']:.0f}% of peak)"
        if row.get("mfu") is not None:
            jm += f" (MFU {100 * row['mfu']:.0f}%)"
        spread = ""
        if row.get("jmarl_min") is not None and row.get("baseline_min") is not None:
            spread = f" [{_fmt(row['jmarl_min'])}-{_fmt(row['jmarl_max'])} vs {_fmt(row['baseline_min'])}-{_fmt(row['baseline_max'])}]"
        ratio = row_ratio(row)
        tgt = "-" if target is None else (f">= {100 * target[0]:.0f}% MFU" if row["name"] == "train_step_mfu" else f">= {target[0]}x")
        if row["name"] == "train_step_vs_torch_eager":
            tgt += f", >= {100 * PEAK_FRACTION_TARGET:.0f}% of peak"
        lines.append(
            f"| `{row['name']}` | {row.get('size', '-')} | {row.get('metric', '-')} | {jm} | {_fmt(row.get('baseline'))} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'}{spread} | {tgt} | {'-' if met is None else ('yes' if met else 'no')} |"
        )
    for err in results.get("errors", []):
        lines.append(f"| `{err.get('name', '?')}` | {err.get('size', '-')} | not reported: {err.get('error', '?')} | | | | | |")
    lines += ["", "Ranges in brackets: min-max over the repeats (jmarl vs baseline). Compile / warm-up time is in the JSON "
              "(`jmarl_compile_s`, `baseline_first_call_s`), not in these figures."]
    policies = sorted({row["baseline_host_memory"] for row in results.get("rows", []) if "baseline_host_memory" in row})
    if policies:
        lines[-1] += (f" The PyTorch side ran in a process of its own, host memory policy {', '.join(policies)}"
                      f"{' (glibc defaults, as its users run it)' if policies == ['default'] else ''}; jmarl's side "
                      f"{machine.get('host_memory_policy', '?')}.")
    return "\n".join(lines)


def replace_between_markers(text: str, suite: str, table: str) -> str:
    """`text` with the part between the suite's markers replaced by `table` (markers kept)."""
    start, end = _markers(suite)
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"markers {start} ... {end} not found; add them to the README where the table goes")
    return pattern.sub(lambda m: f"{start}\n{table}\n{end}", text, count=1)


def update_readme(path: str, results: dict[str, Any], marker: str | None = None) -> None:
    """Rewrites the table of `results['suite']` (between the markers of `marker` where given) in
    the README at `path`."""
    with open(path) as f:
        text = f.read()
    text = replace_between_markers(text, marker or results["suite"], render_table(results))
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    marker = None
    if len(argv) == 4 and argv[2] == "--marker":
        argv, marker = argv[:2], argv[3]
    if len(argv) != 2:
        raise SystemExit("usage: python -m benchmarks.table RESULTS.json MARKDOWN.md [--marker NAME]")
    with open(argv[0]) as f:
        results = json.load(f)
    update_readme(argv[1], results, marker)
    print(f"updated the {marker or results['suite']} table in {argv[1]}")


if __name__ == "__main__":
    main()
