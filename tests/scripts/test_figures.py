"""Every marked figure in README.md and docs/*.md is its result file rendered
(`scripts/figures.py`): a figure edited by hand, or a result re-run without re-rendering, fails."""

import json

import pytest

from _scripts import load_script

figures = load_script("figures")


def test_every_marked_figure_is_its_result_rendered():
    marked = [f for doc in figures.documents() for f in figures.figures(doc.read_text(), doc.name)]
    assert marked, "no marked figure in README.md or docs/"
    assert [f"{f.document}:{f.line}: {f.shown!r} != {f.rendered!r}" for f in figures.stale()] == []


def test_a_figure_edited_by_hand_differs_and_rendering_restores_it():
    readme = (figures.ROOT / "README.md").read_text()
    first = figures.MARKER.search(readme)
    assert first, "README.md has no marked figure"
    edited = readme[:first.start("text")] + "9" + readme[first.start("text"):]
    (figure,) = [f for f in figures.figures(edited) if f.line == readme.count("\n", 0, first.start()) + 1][:1]
    assert figure.shown != figure.rendered
    assert figures.render(edited) == readme


def test_values_by_name_and_index_with_their_format(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"ratio": 5.7444, "rows": [{"wall_s": 36.71}], "w": {"n": 512}}))
    text = ("a <!-- fig r.json {ratio:.2f}x -->?<!-- /fig --> b <!-- fig r.json {rows[0][wall_s]:.1f} s -->"
            "old<!-- /fig --> c <!-- fig r.json {w[n]:,} requests -->512 requests<!-- /fig -->")
    got = figures.figures(text, root=tmp_path)
    assert [f.rendered for f in got] == ["5.74x", "36.7 s", "512 requests"]
    assert [f.shown == f.rendered for f in got] == [False, False, True]
    assert figures.render(text, root=tmp_path).count("5.74x") == 1


def test_byte_counts_convert_to_gib_and_mib_before_the_format(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"peak": 59_700_000_000, "kv": 3 * 2**20, "left": 0.305}))
    text = ("<!-- fig r.json {peak!G:.1f} GiB -->?<!-- /fig --> <!-- fig r.json {kv!M:.0f} MiB -->?<!-- /fig -->"
            " <!-- fig r.json {left:.0%} -->?<!-- /fig -->")
    assert [f.rendered for f in figures.figures(text, root=tmp_path)] == ["55.6 GiB", "3 MiB", "30%"]
    with pytest.raises(figures.FigureError, match="ValueError"):  # an unknown conversion names itself
        figures.render("<!-- fig r.json {peak!X} -->1<!-- /fig -->", root=tmp_path)


def test_a_missing_file_or_value_is_an_error_naming_it(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"ratio": 1.0}))
    with pytest.raises(figures.FigureError, match="no such result file"):
        figures.render("<!-- fig nope.json {x} -->1<!-- /fig -->", root=tmp_path)
    with pytest.raises(figures.FigureError, match="KeyError"):
        figures.render("<!-- fig r.json {speed:.1f} -->1<!-- /fig -->", root=tmp_path)
