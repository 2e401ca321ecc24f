"""scripts/base_success.py: the cells' shared settings, the table and where it goes in the docs
(no model runs here; the cells themselves are `Trainer.evaluate`, tested with the trainer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _scripts import load_script
from jmarl.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    return load_script("base_success")


def test_every_cell_builds_a_valid_config_with_a_chat_template(script):
    """Each task's config + the shared overrides (a registered model, its chat template) validate."""
    shared = script.settings_overrides("smollm2-135m-instruct", 16, 64, chat_template="gemma")
    assert "model.chat_template=gemma" in shared
    assert not any("chat_template" in o for o in script.settings_overrides("smollm2-135m-instruct", 16, 64))
    for name, (config_path, overrides, _) in script.TASKS.items():
        for decoding in script.DECODING.values():
            config = load_config(ROOT / config_path, [*shared, *overrides, *decoding, "output_dir=/tmp/x"])
            assert config.model.chat_template == "gemma", name
    one_digit = load_config(ROOT / script.TASKS["math_one_digit"][0], [*shared, *script.TASKS["math_one_digit"][1]])
    assert one_digit.env.options["agents"] == ["solver"] and one_digit.env.options["max_turns"] == 1


def test_table_names_the_template_and_goes_under_each_models_markers(script, tmp_path):
    result = {"model": "gemma3-270m", "episodes": 4, "max_new_tokens": 64, "chat_template": "gemma", "cells": {
        "math_one_digit/greedy": {"metrics": {"eval/success_rate": 0.25}, "seconds": 10.0, "commit": "abc1234"}}}
    table = script.render(result)
    assert "untrained gemma3-270m (4 episodes per cell, at most 64 new tokens per turn, prompts in the `gemma` " \
           "chat template" in table
    assert "| one-digit addition, one solver (HACPO's CPU task) | 25.0% [5-70] | not run | 10 |" in table
    docs = tmp_path / "models.md"
    docs.write_text("# Models\n\n<!-- base-success:other:start -->\nold\n<!-- base-success:other:end -->\n\ntail\n")
    script.write_docs(table, "gemma3-270m", docs)
    script.write_docs("new", "other", docs)
    text = docs.read_text()
    assert "<!-- base-success:other:start -->\nnew\n<!-- base-success:other:end -->\n\ntail\n" in text
    assert text.endswith("## Base success of gemma3-270m\n\n<!-- base-success:gemma3-270m:start -->\n" + table
                         + "\n<!-- base-success:gemma3-270m:end -->\n")


def test_a_table_lists_only_its_tasks_and_a_named_table_has_its_own_markers(script, tmp_path):
    """A table's rows are the tasks it has cells of; `--table NAME` writes between its own markers
    and leaves the model's main table as it was."""
    result = {"model": "m", "episodes": 128, "max_new_tokens": 48, "cells": {
        "add_small/t1": {"metrics": {"eval/success_rate": 0.5}, "seconds": 3.0, "commit": "abc1234"}}}
    table = script.render(result)
    assert "| two-operand addition, operands 0-49 (the recipe's task) | not run | 50.0% [41-59] | 3 |" in table
    assert "Plan-Path" not in table and "two operations" not in table
    docs = tmp_path / "models.md"
    docs.write_text("<!-- base-success:m:start -->\nmain\n<!-- base-success:m:end -->\n")
    script.write_docs(table, "m", docs, name="tiers")
    text = docs.read_text()
    assert text.startswith("<!-- base-success:m:start -->\nmain\n<!-- base-success:m:end -->\n")
    assert text.endswith("## Base success of m (tiers)\n\n<!-- base-success:m:tiers:start -->\n" + table
                         + "\n<!-- base-success:m:tiers:end -->\n")
