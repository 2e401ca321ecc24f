"""Figures in README.md and docs/*.md rendered from the result files they come from.

    python scripts/figures.py            # rewrite every marked figure from its result file
    python scripts/figures.py --check    # write nothing: list the figures that differ, exit 1 if any

A figure in the prose is marked inline with the result file and a Python format string over it:

    the engine is <!-- fig benchmarks/results/engine.json {ratio:.2f}x -->5.74x<!-- /fig --> faster

The text between the two comments is `format_string.format(**data)` of the JSON file (a path
from the repository root): top-level keys by name, nested ones by `str.format`'s indexing
(`{workload[requests]}`, `{rows[0][wall_s]:.1f}`), so a figure is a value of its file, formatted,
and nothing else (a figure that needs arithmetic is a value the result file stores). Byte counts
take a unit conversion before the format: `{peak!G:.1f}` is the bytes in GiB (2**30), `!M` in
MiB (2**20). The comments
do not show in rendered Markdown. tests/scripts/test_figures.py re-renders every file and fails
on any difference, so a figure edited by hand, or a result file re-run without re-rendering,
fails the suite. The evidence tables and the quickstart's closing block have their own renderers
(scripts/evidence.py --render, scripts/quickstart_record.py --readme).
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the files whose figures are rendered
DOCUMENTS = ("README.md", "docs/*.md")
MARKER = re.compile(r"<!-- fig (?P<file>\S+) (?P<format>.+?) -->(?P<text>.*?)<!-- /fig -->", re.S)


class FigureError(Exception):
    """A marker whose result file or value cannot be read."""


@dataclass(frozen=True)
class Figure:
    """One marked figure: where it is (document, line), its result file and format, the text it
    shows and the text its result renders."""

    document: str
    line: int
    file: str
    format: str
    shown: str
    rendered: str


class _Formatter(string.Formatter):
    """`str.format` with two more conversions of a byte count: !G (GiB) and !M (MiB)."""

    UNITS = {"G": 2**30, "M": 2**20}

    def convert_field(self, value, conversion):
        if conversion in self.UNITS:
            return float(value) / self.UNITS[conversion]
        return super().convert_field(value, conversion)


_FORMATTER = _Formatter()


@lru_cache(maxsize=None)
def _load(path: str, root: Path) -> dict:
    file = root / path
    if not file.is_file():
        raise FigureError(f"{path}: no such result file")
    return json.loads(file.read_text())


def render_value(file: str, fmt: str, root: Path = ROOT) -> str:
    """`fmt.format(**data)` of the JSON result file `file` (relative to `root`)."""
    data = _load(file, root)
    try:
        return _FORMATTER.format(fmt, **data)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise FigureError(f"{file}: cannot render {fmt!r}: {type(e).__name__}: {e}") from None


def figures(text: str, document: str = "", root: Path = ROOT) -> list[Figure]:
    """Every marked figure of a document's text, with what it shows and what it renders."""
    out = []
    for m in MARKER.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out.append(Figure(document, line, m["file"], m["format"], m["text"],
                          render_value(m["file"], m["format"], root)))
    return out


def render(text: str, root: Path = ROOT) -> str:
    """The text with every marked figure replaced by its rendering (markers kept)."""
    def one(m: re.Match) -> str:
        value = render_value(m["file"], m["format"], root)
        return f"<!-- fig {m['file']} {m['format']} -->{value}<!-- /fig -->"
    return MARKER.sub(one, text)


def documents(root: Path = ROOT) -> list[Path]:
    """The files whose figures are rendered (`DOCUMENTS`), sorted."""
    return sorted({p for pattern in DOCUMENTS for p in root.glob(pattern)})


def stale(root: Path = ROOT) -> list[Figure]:
    """The marked figures, over every document, whose shown text differs from their rendering."""
    return [f for doc in documents(root) for f in figures(doc.read_text(), str(doc.relative_to(root)), root)
            if f.shown != f.rendered]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a figure differs")
    args = parser.parse_args(argv)
    try:
        if args.check:
            bad = stale()
            for f in bad:
                print(f"{f.document}:{f.line}: shows {f.shown!r}, {f.file} renders {f.rendered!r}")
            return 1 if bad else 0
        count = 0
        for doc in documents():
            text = doc.read_text()
            new = render(text)
            count += len(MARKER.findall(text))
            if new != text:
                doc.write_text(new)
                print(f"rewrote {doc.relative_to(ROOT)}")
        print(f"{count} figures rendered")
        return 0
    except FigureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
