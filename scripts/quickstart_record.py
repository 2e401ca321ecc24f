"""The README's quickstart output, recorded from a real run and checked against the README.

    python scripts/quickstart_record.py            # run the quickstart as a new user does, record it
    python scripts/quickstart_record.py --readme   # ... and write its closing lines into README.md
    python scripts/quickstart_record.py --check    # run nothing: exit 1 if README.md differs from the record

The run compiles every program itself, as a newcomer's first run does: it is given an empty
compilation cache ($JMARL_COMPILATION_CACHE set to a fresh directory; a later run with the cache
warm is faster). A record (results/quickstart_output.json) holds the exact command, the commit it ran on (with a
dirty flag for uncommitted changes to the library, configs or pyproject.toml), the UTC date and load average when it
started, the machine, the package versions, the wall seconds and every line the command printed
to stdout. The README quotes the lines from "held-out success on" to the end verbatim; `--check`
(and tests/scripts/test_readme_figures.py) refuse a README whose quoted block differs from the record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jmarl import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "results" / "quickstart_output.json"
README = ROOT / "README.md"
COMMAND = ("python", "-m", "jmarl.run", "--config", "configs/quickstart.yaml")
BLOCK_START = "held-out success on "  # the first line of the closing block the README quotes
RUN_PATHS = ("jmarl", "configs", "pyproject.toml")  # what the run executes or reads


def git_state(root: Path = ROOT) -> dict[str, object]:
    """The checkout's HEAD commit and whether the tracked files the run executes or reads
    (`RUN_PATHS`) differ from it ("unknown" outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *RUN_PATHS], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip() != ""
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty": None}
    return {"commit": commit, "dirty": dirty}


def machine() -> str:
    """Architecture, CPU model, CPU count and Python of this machine."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{platform.machine()}, {model or 'unknown CPU'}, {os.cpu_count()} CPUs, "
            f"{platform.python_implementation()} {platform.python_version()}")


def closing_block(stdout: str) -> list[str]:
    """The lines of `stdout` from the last "held-out success on ..." line to the end (the
    before/after table a run prints when it finishes); [] when there is none."""
    lines = stdout.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(BLOCK_START)]
    return lines[starts[-1]:] if starts else []


def readme_block(text: str) -> list[str]:
    """The lines of the README's fenced code block that quotes the quickstart's closing block."""
    fences = text.split("```")
    for body in fences[1::2]:  # the insides of fenced blocks
        lines = body.split("\n")[1:]  # after the fence's info string
        if lines and lines[0].startswith(BLOCK_START):
            return _strip(lines)
    return []


def _strip(lines: list[str]) -> list[str]:
    """Lines without trailing blank ones."""
    out = list(lines)
    while out and not out[-1].strip():
        out.pop()
    return out


def check_readme(readme_text: str, record: dict) -> list[str]:
    """The differences between the README's quoted quickstart output and the record ([] if equal)."""
    quoted, recorded = _strip(readme_block(readme_text)), _strip(record["closing_block"])
    if not quoted:
        return [f"README has no fenced block starting with {BLOCK_START!r}"]
    if quoted == recorded:
        return []
    diffs = [f"line {i + 1}: README {a!r} != record {b!r}"
             for i, (a, b) in enumerate(zip(quoted, recorded)) if a != b]
    if len(quoted) != len(recorded):
        diffs.append(f"README quotes {len(quoted)} lines, the record has {len(recorded)}")
    return diffs


def replace_readme_block(readme_text: str, lines: list[str]) -> str:
    """`readme_text` with the quoted quickstart block replaced by `lines`."""
    fences = readme_text.split("```")
    for i in range(1, len(fences), 2):
        head, *body = fences[i].split("\n")
        if body and body[0].startswith(BLOCK_START):
            fences[i] = "\n".join([head, *lines, ""])
            return "```".join(fences)
    raise SystemExit(f"README has no fenced block starting with {BLOCK_START!r}")


def record_run(overrides: list[str]) -> dict:
    """Runs the quickstart command (plus `overrides`) from the repo root as a user does and
    returns its record; raises SystemExit when the run fails or prints no closing block."""
    started = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()
    state = git_state()
    cmd = [sys.executable, *COMMAND[1:], *overrides]
    with tempfile.TemporaryDirectory(prefix="jmarl-cold-cache-") as cache:
        env = {**os.environ, "JMARL_COMPILATION_CACHE": cache}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the quickstart exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    block = closing_block(proc.stdout)
    if not block:
        raise SystemExit(f"the quickstart printed no line starting with {BLOCK_START!r}:\n{proc.stdout[-4000:]}")
    return {
        "command": " ".join([*COMMAND, *overrides]),
        "commit": state["commit"],
        "dirty": state["dirty"],
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_at_start": [round(x, 2) for x in load],
        "machine": machine(),
        "versions": {p: metadata.version(p) for p in ("jax", "jaxlib", "flax", "optax", "numpy")},
        "compilation_cache": "empty at the start (a first run: every program compiled)",
        "wall_seconds": round(wall, 1),
        "stdout": proc.stdout.splitlines(),
        "closing_block": block,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="run nothing: compare README.md with the record")
    parser.add_argument("--readme", action="store_true", help="after the run, write its closing block into README.md")
    parser.add_argument("--record", default=str(RECORD), help="the record's path")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="passed on to the run (a record with overrides is not the README's command)")
    args = parser.parse_args(argv)
    path = Path(args.record)
    if args.check:
        diffs = check_readme(README.read_text(), json.loads(path.read_text()))
        for d in diffs:
            print(d)
        print("README's quickstart output differs from the record" if diffs else "README matches the record")
        return 1 if diffs else 0
    record = record_run(args.overrides)
    record[provenance.KEY] = provenance.record(["python", "scripts/quickstart_record.py", *(argv or sys.argv[1:])])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(record["closing_block"]))
    print(f"recorded {path} (commit {record['commit']}{', dirty' if record['dirty'] else ''})")
    if args.readme:
        if args.overrides:
            raise SystemExit("--readme quotes the plain command only: drop the overrides")
        README.write_text(replace_readme_block(README.read_text(), record["closing_block"]))
        print(f"updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
