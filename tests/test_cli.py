"""CLI: one-line errors with exit status 2, --print-config round trip, overrides, trainer hand-off."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jmarl import run as cli
from jmarl.config import config_from_dict, load_config, parse_yaml

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = "configs/quickstart.yaml"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m jmarl.run ARGS` in a fresh process from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "jmarl.run", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((QUICKSTART, "train.stpes=3"), "unknown key 'train.stpes' — did you mean 'train.steps'?"),
        ((QUICKSTART, "train.steps=ten"), "train.steps: expected int, got str 'ten'"),
        ((QUICKSTART, "optim.lr=-1e-3"), "optim.lr: must be > 0.0, got -0.001"),
        ((QUICKSTART, "workflow.group_size=1"), "workflow.group_size: must be >= 2, got 1"),
        (("configs/no_such.yaml",), "config file not found: configs/no_such.yaml"),
        ((QUICKSTART, "train.steps"), "bad override 'train.steps': expected key=value, e.g. train.steps=10"),
        ((QUICKSTART, "algo.name=grpoo"),
         "algo.name: unknown algorithm 'grpoo'; choose one of at_grpo, dapo, dr_grpo, grpo, gspo, hacpo, "
         "joyagents, magrpo (or give your own Method as 'package.module:NAME') — did you mean 'grpo'?"),
        ((QUICKSTART, "algo.options.alpha=0.5"), "algo.options.alpha is a sampling setting: set workflow.options.alpha"),
        ((QUICKSTART, "env.name=sokobn"),
         "env.name: unknown env 'sokobn'; registered envs: code, math, plan_path, router, sokoban, sudoku, "
         "writing — did you mean 'sokoban'?"),
    ],
    ids=["unknown-key", "wrong-type", "negative-lr", "group-size", "missing-file", "override-syntax",
         "unknown-algo", "misplaced-setting", "unknown-env"],
)
def test_user_errors_are_one_line_with_status_2(args, message):
    result = run_cli("--config", *args)
    assert result.returncode == 2
    assert result.stderr == f"error: {message}\n"
    assert "Traceback" not in result.stdout + result.stderr


def test_unparsable_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\ntrain: {steps: 3\n")
    result = run_cli("--config", str(bad))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: cannot parse config file {bad} at line 3")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_print_config_round_trips_with_overrides(tmp_path):
    overrides = ["train.steps=7", "policies.mode=per_agent", "algo.options.clip_high=0.28", "optim.lr=2e-5",
                 "env.options.size=6", "logging.plots=false"]
    result = run_cli("--config", QUICKSTART, *overrides[:3], "--print-config", *overrides[3:])  # any order
    assert result.returncode == 0, result.stderr
    printed = config_from_dict(parse_yaml(result.stdout, "stdout"))
    expected = load_config(ROOT / QUICKSTART, overrides)
    assert printed == expected
    assert printed.train.steps == 7 and printed.algo.options["clip_high"] == 0.28
    assert printed.optim.lr == 2e-5 and printed.env.options["size"] == 6 and printed.logging.plots is False
    assert printed != load_config(ROOT / QUICKSTART)
    # The printed YAML is itself a config file giving the same Config.
    saved = tmp_path / "printed.yaml"
    saved.write_text(result.stdout)
    assert load_config(saved) == expected


def test_help_and_missing_config_argument():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "--print-config" in result.stdout and "key=value" in result.stdout
    result = run_cli()
    assert result.returncode == 2  # argparse's usage error
    assert "--config" in result.stderr


# In-process: the hand-off to the trainer and what is not caught.


def _fake_trainer(tmp_path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "_TRAINER", name)
    sys.modules.pop(name, None)


def test_trainer_receives_the_validated_config(tmp_path, monkeypatch):
    _fake_trainer(tmp_path, monkeypatch, "jmarl_fake_trainer_ok",
                  "SEEN = []\ndef train(config):\n    SEEN.append(config)\n    return {'ok': 1}\n")
    assert cli.main(["--config", str(ROOT / QUICKSTART), "train.steps=3"]) == 0
    seen = sys.modules["jmarl_fake_trainer_ok"].SEEN
    assert seen == [load_config(ROOT / QUICKSTART, ["train.steps=3"])]


def test_trainer_errors_other_than_jmarl_errors_propagate(tmp_path, monkeypatch, capsys):
    _fake_trainer(tmp_path, monkeypatch, "jmarl_fake_trainer_user",
                  "from jmarl.errors import JmarlError\n"
                  "def train(config):\n    raise JmarlError('model path /m does not exist')\n")
    assert cli.main(["--config", str(ROOT / QUICKSTART)]) == 2
    assert capsys.readouterr().err == "error: model path /m does not exist\n"
    _fake_trainer(tmp_path, monkeypatch, "jmarl_fake_trainer_bug",
                  "def train(config):\n    raise ValueError('bug')\n")
    with pytest.raises(ValueError, match="bug"):
        cli.main(["--config", str(ROOT / QUICKSTART)])
    # A trainer whose own import fails is a bug in the code, not 'trainer not available'.
    _fake_trainer(tmp_path, monkeypatch, "jmarl_fake_trainer_dep", "import jmarl_no_such_dependency\n")
    with pytest.raises(ModuleNotFoundError, match="jmarl_no_such_dependency"):
        cli.main(["--config", str(ROOT / QUICKSTART)])


# Makes `torch` look absent (importlib.util.find_spec and import), as on a machine with jmarl's
# own dependencies only: transformers then prints its "PyTorch was not found" notice on import.
_HIDE_TORCH = '''
import importlib.abc, importlib.util, sys
_find_spec = importlib.util.find_spec
def _no_torch(name):
    return name == "torch" or name.startswith("torch.")
def find_spec(name, package=None):
    return None if _no_torch(name) else _find_spec(name, package)
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if _no_torch(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
importlib.util.find_spec = find_spec
sys.meta_path.insert(0, _Finder())
'''


@pytest.mark.slow
def test_cli_prints_no_third_party_notice_but_real_warnings(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_HIDE_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "JAX_PLATFORMS": "cpu",
           "JMARL_KEEP_HOST_MEMORY": "perhaps"}  # not understood: jmarl's own warning, still shown
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    notice = "PyTorch was not found"
    bare = subprocess.run([sys.executable, "-c", "import transformers"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert notice in bare.stderr  # the notice the CLI must keep out (torch is hidden here)

    # A tokenizer directory transformers fails to read: the run imports transformers, then stops
    # with its one error line, before any compilation.
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text('{"tokenizer_class": ')
    run = subprocess.run(
        [sys.executable, "-m", "jmarl.run", "--config", QUICKSTART, f"output_dir={tmp_path / 'run'}",
         f"tokenizer={tokenizer}", "train.compilation_cache=off", "logging.progress=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert f"error: could not load the tokenizer in {tokenizer}" in run.stderr
    assert notice not in run.stderr and "[transformers]" not in run.stderr
    assert "JMARL_KEEP_HOST_MEMORY='perhaps' is not understood" in run.stderr  # real warnings still shown
