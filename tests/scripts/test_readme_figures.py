"""The README's quickstart figures are the recorded ones: the quoted closing output equals the
record `scripts/quickstart_record.py` made by running the README's command, and the over-seeds
sentence quotes results/evidence_quickstart.json."""

import json
import re
from pathlib import Path

from _scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RECORD = json.loads((ROOT / "results" / "quickstart_output.json").read_text())
EVIDENCE = json.loads((ROOT / "results" / "evidence_quickstart.json").read_text())



quickstart_record = load_script("quickstart_record")
evidence = load_script("evidence")


def test_record_is_the_readme_command_on_committed_code():
    assert RECORD["command"] == "python -m jmarl.run --config configs/quickstart.yaml"
    assert "python -m jmarl.run --config configs/quickstart.yaml" in README
    assert RECORD["dirty"] is False and re.fullmatch(r"[0-9a-f]{7,40}", RECORD["commit"])
    assert quickstart_record.closing_block("\n".join(RECORD["stdout"])) == RECORD["closing_block"]


def test_readme_quotes_the_recorded_output():
    assert quickstart_record.check_readme(README, RECORD) == []


def test_check_refuses_a_readme_with_other_figures():
    changed = README.replace(RECORD["closing_block"][2], RECORD["closing_block"][2].replace("%", "0%"), 1)
    assert changed != README
    assert quickstart_record.check_readme(changed, RECORD)
    assert quickstart_record.check_readme(README.replace("held-out success on", "success on"), RECORD)


def test_replace_block_round_trips():
    lines = ["held-out success on x (1 episodes, greedy)", "  after warm start   1.0%"]
    text = quickstart_record.replace_readme_block(README, lines)
    assert quickstart_record.readme_block(text) == lines
    assert quickstart_record.replace_readme_block(text, RECORD["closing_block"]) == README


def test_seeds_sentence_quotes_the_evidence_table():
    """'over seeds 0-7 ... **A% -> B%, +C points**' is the per-agent variant's mean success before
    and after RL in the committed evidence JSON, and the quoted p its sign-flip p-value."""
    found = re.search(r"over\s+seeds (\d+)-(\d+).*?\*\*([\d.]+)% -> ([\d.]+)%, \+([\d.]+) points\*\*", README, re.S | re.I)
    assert found, "README: no 'over seeds a-b ... **x% -> y%, +z points**' sentence"
    runs = [r for r in EVIDENCE["variants"]["per_agent"]["runs"] if "values" in r]
    assert len({(r.get("commit"), r.get("diff")) for r in runs}) == 1, "the quoted runs ran on different code"
    seeds = [r["seed"] for r in runs]
    assert seeds == list(range(int(found[1]), int(found[2]) + 1))
    before = sum(r["values"]["success_before"] for r in runs) / len(runs)
    after = sum(r["values"]["success_after"] for r in runs) / len(runs)
    assert f"{100 * before:.1f}" == found[3] and f"{100 * after:.1f}" == found[4]
    assert f"{100 * (after - before):.1f}" == found[5]
    p = re.search(r"sign-flip p = ([\d.]+)", README[found.end():found.end() + 400])
    assert p, "README: the seeds sentence gives no sign-flip p"
    diffs = [r["values"]["success_after"] - r["values"]["success_before"] for r in runs]
    assert f"{evidence.sign_flip_p(diffs):.3f}".rstrip("0") == p[1].rstrip("0")

    control = re.search(r"more supervised training instead reaches ([\d.]+)%,\s+so RL's own lead is \+([\d.]+) points",
                        README)
    assert control, "README: no 'more supervised training instead reaches x%, so RL's own lead is +y points'"
    by_seed = {r["seed"]: r["values"]["success_after"] for r in runs}
    supervised = [r for r in EVIDENCE["variants"]["supervised"]["runs"] if "values" in r]
    assert sorted(r["seed"] for r in supervised) == seeds
    assert {(r.get("commit"), r.get("diff")) for r in supervised} == {(runs[0].get("commit"), runs[0].get("diff"))}
    reached = sum(r["values"]["success_after"] for r in supervised) / len(supervised)
    lead = sum(by_seed[r["seed"]] - r["values"]["success_after"] for r in supervised) / len(supervised)
    assert f"{100 * reached:.1f}" == control[1] and f"{100 * lead:.1f}" == control[2]


def test_every_table_sentence_in_the_readme_is_its_rendered_result():
    """A table with a README sentence (`Table.headline`) has it between its readme markers, equal
    to what the committed result renders; an edited figure fails here."""
    for name, table in evidence.TABLES.items():
        if table.headline is None:
            continue
        result = json.loads((ROOT / "results" / f"evidence_{name}.json").read_text())
        sentence = evidence.headline_text(table, result)
        assert sentence, f"{name}: its result renders no README sentence"
        start, end = f"<!-- evidence:{name}:readme:start -->", f"<!-- evidence:{name}:readme:end -->"
        assert start in README and end in README, f"README has no {start} ... {end} markers"
        assert README.split(start, 1)[1].split(end, 1)[0].strip() == sentence
        assert evidence.replace_headline(README, name, sentence) == README
        edited = README.replace(sentence, sentence.replace("%", "0%", 1))
        assert edited.split(start, 1)[1].split(end, 1)[0].strip() != sentence
