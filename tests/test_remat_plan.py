"""model.remat "auto" chosen by the memory planner (`jmarl.train.remat_plan`): where the device's
memory is known, each group whose setting is auto keeps the least recompute (none, then dots,
then full) whose gradient programs fit; a policy set by hand is kept. A tiny two-layer model on
one CPU device, 128 + 64 tokens a sample: its update needs less memory under full remat."""

import json

import pytest
import yaml

from _tiny_models import TINY_PRESET
from jmarl.memory_check import cli
from jmarl.train import remat_plan
from jmarl.train.remat_plan import REMAT_ORDER, gradient_figures, plan_remat
from jmarl.train.trainer import Trainer

RUN = {
    "seed": 0,
    "env": {"name": "_toy_env:Letters"},
    "algo": {"name": "grpo"},
    "model": {"preset": dict(TINY_PRESET, num_layers=2)},
    "tokenizer": "char",
    "workflow": {"plan": "tree", "group_size": 4, "num_tasks": 2},
    "policies": {"mode": "shared"},
    "sampling": {"max_new_tokens": 64, "max_prompt_len": 128},
    "train": {"steps": 1, "memory_check": "on", "memory_headroom": 0.0},
    "logging": {"progress": False, "tensorboard": False, "plots": False},
}


def _trainer(tmp_path, **train) -> Trainer:
    path = tmp_path / "run.yaml"
    run = dict(RUN, output_dir=str(tmp_path / "out"), train=dict(RUN["train"], **train))
    path.write_text(yaml.safe_dump(run))
    config, _ = cli.load_config_for_check(str(path), [])
    return Trainer(config, abstract=True)


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    """The update's peak bytes per device under each remat policy."""
    trainer = _trainer(tmp_path_factory.mktemp("peaks"))
    out = {}
    for policy in REMAT_ORDER:
        trainer.set_remat(0, policy)
        figures = gradient_figures(trainer, 0)
        assert [f.program for f in figures] == ["update"] and figures[0].remat == policy
        out[policy] = figures[0].peak
    return out


@pytest.mark.slow
def test_full_remat_needs_less_memory_than_none(peaks):
    assert peaks["full"] < peaks["none"]


@pytest.mark.slow
def test_check_before_step_0_keeps_the_least_recompute_that_fits(tmp_path, peaks):
    limit = (peaks["full"] + peaks["none"]) // 2  # the update fits under full remat only (dots saves less)
    expected = next(p for p in REMAT_ORDER if peaks[p] <= limit)
    trainer = _trainer(tmp_path, device_memory=limit)
    assert trainer.config.model.remat == "auto" and trainer.policies.groups[0].model_config.remat == "none"
    before = trainer.fns[0]
    figures = trainer.check_memory()  # plans, then checks every program under the limit
    assert trainer.policies.groups[0].model_config.remat == expected != "none"
    assert trainer.fns[0] is not before  # the device functions were rebuilt for it
    update = next(f for f in figures if f.program == "update")
    assert update.remat == expected and update.peak == peaks[expected] <= limit


@pytest.mark.slow
def test_the_check_reuses_the_planners_figures(tmp_path, peaks, monkeypatch):
    """The programs the planner compiled for the chosen policy are not compiled again by the
    check: one compile per policy tried, plus the programs remat does not touch."""
    from jmarl.memory_check import figures as figures_lib

    compiled = []
    analyse = figures_lib.analyse
    monkeypatch.setattr(figures_lib, "analyse", lambda p: compiled.append((p.program, p.remat)) or analyse(p))
    monkeypatch.setattr(remat_plan, "analyse", figures_lib.analyse)
    trainer = _trainer(tmp_path, device_memory=peaks["none"])
    figures = trainer.check_memory()
    assert compiled.count(("update", "none")) == 1 and sum(p == "update" for p, _ in compiled) == 1
    assert len(compiled) == len(figures)  # each program compiled once in all


@pytest.mark.slow
def test_plan_keeps_none_when_it_fits_and_full_when_nothing_does(tmp_path, peaks):
    trainer = _trainer(tmp_path)
    lines = []
    assert plan_remat(trainer, peaks["none"], 0.0, progress=lines.append) == {"shared": "none"}
    assert len(lines) == 2 and "with remat none" in lines[0] and "within" in lines[0]
    lines.clear()
    assert plan_remat(trainer, peaks["full"] - 1, 0.0, progress=lines.append) == {"shared": "full"}
    assert [("over" in line) for line in lines[:3]] == [True, True, True]  # none, dots, full: none fits
    # the headroom counts: a limit the update fits in exactly, less 10%, does not hold it
    assert plan_remat(trainer, peaks["none"], 0.1, progress=lambda _: None) != {"shared": "none"}


def test_a_remat_set_by_hand_is_kept(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(dict(RUN, output_dir=str(tmp_path / "out"), model=dict(RUN["model"], remat="dots"))))
    config, _ = cli.load_config_for_check(str(path), [])
    trainer = Trainer(config, abstract=True)
    monkeypatch.setattr(remat_plan, "gradient_figures", lambda *a: pytest.fail("nothing to plan"))
    assert plan_remat(trainer, 1, 0.0) == {}
    assert trainer.policies.groups[0].model_config.remat == "dots"


@pytest.mark.slow
def test_memory_check_cli_plans_remat_and_records_it(tmp_path, peaks, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(dict(RUN, output_dir=str(tmp_path / "out"))))
    out = tmp_path / "plan.json"
    limit = (peaks["full"] + peaks["none"]) // 2
    assert cli.main(["--config", str(path), "--device-memory", str(limit), "--headroom", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["remat"] == {"shared": "full"} and doc["fits"] is True
    assert "model.remat auto: group 'shared' runs with remat full" in capsys.readouterr().out
