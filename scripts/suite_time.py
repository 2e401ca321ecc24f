"""How long the test suite takes on this machine, from a cold and a warm compilation cache.

    python scripts/suite_time.py --tier all --cache DIR    # DIR new or empty: a cold run
    python scripts/suite_time.py --tier all --cache DIR    # again, the same DIR: a warm run
    python scripts/suite_time.py --tier fast --cache DIR2  # the fast tier (-m "not slow")

Runs the README's test command (`python -m pytest -n 2`; the fast tier adds `-m "not slow"`)
with TMPDIR=DIR. The tests' XLA compilation cache (tests/conftest.py: one folder under the
temporary directory, shared by both xdist workers) then starts empty when DIR holds none
("cold", as on a fresh machine) and holds an earlier run's programs when it does ("warm"). The run's wall time, its outcome
counts and its 25 slowest tests (pytest's --durations) go into results/suite_time/<tier>_<cold|warm>.json,
with the provenance record (tests/ counted as code too); the README's suite figures render from
those files (scripts/figures.py). The record also keeps each test file's total seconds, from the
durations file tests/conftest.py writes at the end of every run (jmarl-test-durations-<time>.json
in the temporary directory; any run leaves one, CI's too), and the CPU time the run used (its
processes' user + system seconds) against what the machine's cores offered over the wall time:
near 1 when the cores are the bound, lower when workers waited (on subprocesses, sleeps or I/O):

    python scripts/suite_time.py --files /tmp/jmarl-test-durations-<time>.json   # costliest files
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jmarl import provenance  # noqa: E402

RESULTS = ROOT / "results" / "suite_time"
COMMANDS = {"all": ["-m", "pytest", "-n", "2"], "fast": ["-m", "pytest", "-m", "not slow", "-n", "2"]}
DURATION = re.compile(r"^(?P<seconds>[0-9.]+)s (?P<phase>setup|call|teardown)\s+(?P<test>\S.*)$")
SUMMARY = re.compile(r"^=+ (?P<counts>.*?) in (?P<seconds>[0-9.]+)s")
FAILED = re.compile(r"^(?:FAILED|ERROR) (?P<test>\S+)")
COUNT = re.compile(r"(?P<n>\d+) (?P<what>passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def is_cold(cache: Path) -> bool:
    """Whether `cache` holds no test compilation cache yet (conftest's jmarl-test-jax-cache-*)."""
    return not any(p.is_dir() and any(p.iterdir()) for p in cache.glob("jmarl-test-jax-cache-*"))


def parse(output: str) -> dict[str, Any]:
    """The outcome counts, pytest's own seconds, the slowest tests and the failed or erroring
    tests (pytest's short summary) of a pytest run's output."""
    slowest, counts, pytest_seconds, failed = [], {}, None, []
    for line in output.splitlines():
        if m := FAILED.match(line.strip()):
            failed.append(m["test"])
        elif m := DURATION.match(line.strip()):
            slowest.append({"seconds": float(m["seconds"]), "phase": m["phase"], "test": m["test"].strip()})
        elif (m := SUMMARY.match(line.strip())) and COUNT.search(m["counts"]):
            counts = {c["what"]: int(c["n"]) for c in COUNT.finditer(m["counts"])}
            pytest_seconds = float(m["seconds"])
    return {"counts": counts, "pytest_seconds": pytest_seconds, "slowest": slowest, "failed": failed}


def newest_durations(directory: Path) -> Path | None:
    """The newest durations file tests/conftest.py wrote into `directory`, if any."""
    found = sorted(directory.glob("jmarl-test-durations-*.json"))
    return found[-1] if found else None


def file_totals(durations: dict[str, Any], most: int = 25) -> list[dict[str, Any]]:
    """The `most` costliest test files of a durations record: file, seconds (setup + call +
    teardown of its tests, summed over both workers) and its number of tests."""
    counts: dict[str, int] = {}
    for nodeid in durations["tests"]:
        counts[nodeid.split("::")[0]] = counts.get(nodeid.split("::")[0], 0) + 1
    ranked = sorted(durations["files"].items(), key=lambda kv: -kv[1])[:most]
    return [{"file": name, "seconds": seconds, "tests": counts.get(name, 0)} for name, seconds in ranked]


def cpu_use(cpu_seconds: float, wall_seconds: float, cores: int) -> dict[str, float | int]:
    """The run's CPU seconds and the share of the cores' capacity over its wall time they were."""
    return {"cpu_seconds": cpu_seconds, "cores": cores,
            "core_utilization": cpu_seconds / (wall_seconds * cores) if wall_seconds > 0 else 0.0}


def children_cpu_seconds() -> float:
    """User + system seconds of this process's waited-for descendants so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(tier: str, cache: Path) -> dict[str, Any]:
    """Runs the tier's command with TMPDIR=`cache`, echoing its output; its record."""
    cache.mkdir(parents=True, exist_ok=True)
    cold = is_cold(cache)
    cmd = [sys.executable, *COMMANDS[tier]]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["TMPDIR"] = str(cache.resolve())
    record = provenance.record("python " + " ".join(COMMANDS[tier][:2]) + " " + " ".join(
        f'"{a}"' if " " in a else a for a in COMMANDS[tier][2:]))
    record.update(provenance.code_state(ROOT, (*provenance.WATCHED_PATHS, "tests")))
    start, cpu_start = time.perf_counter(), children_cpu_seconds()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    proc.wait()
    wall = time.perf_counter() - start
    cpu = cpu_use(children_cpu_seconds() - cpu_start, wall, os.cpu_count() or 1)
    durations = newest_durations(cache)
    files = file_totals(json.loads(durations.read_text())) if durations else []
    return {"tier": tier, "cache": "cold" if cold else "warm", "exit_code": proc.returncode,
            "wall_seconds": wall, "wall_minutes": wall / 60, **cpu, **parse("".join(lines)), "costliest_files": files,
            provenance.KEY: record}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=sorted(COMMANDS), default="all")
    parser.add_argument("--cache", type=Path,
                        help="the temporary directory of the run (new or empty: a cold run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder of the result files")
    parser.add_argument("--files", type=Path, metavar="DURATIONS_JSON",
                        help="print the costliest test files of a durations file and exit (runs nothing)")
    args = parser.parse_args(argv)
    if args.files is not None:
        rows = file_totals(json.loads(args.files.read_text()), most=40)
        total = sum(json.loads(args.files.read_text())["files"].values())
        for row in rows:
            print(f"{row['seconds']:8.1f} s {row['seconds'] / total:6.1%} {row['tests']:5d} tests  {row['file']}")
        print(f"{total:8.1f} s in all (both workers' seconds)")
        return 0
    if args.cache is None:
        parser.error("--cache DIR is required to run the suite")
    result = run(args.tier, args.cache)
    out = args.out / f"{result['tier']}_{result['cache']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[suite_time] {result['tier']} tier, {result['cache']} cache: {result['wall_seconds']:.0f} s, "
          f"{result['core_utilization']:.0%} of {result['cores']} cores, {result['counts']}, exit {result['exit_code']} -> {out}")
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
