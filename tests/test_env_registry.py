import pytest

from jmarl import JmarlError
from jmarl.envs import EVAL_SEED_START, eval_seed, is_eval_seed, make, registered, train_seed


def test_registry_names():
    assert set(registered()) >= {"plan_path", "sokoban", "sudoku", "math", "writing", "router", "code"}


def test_unknown_env():
    with pytest.raises(JmarlError, match="unknown env 'nope'"):
        make("nope")


def test_seed_ranges_disjoint():
    assert not is_eval_seed(train_seed(EVAL_SEED_START - 1))
    assert is_eval_seed(eval_seed(0))
    with pytest.raises(JmarlError):
        train_seed(EVAL_SEED_START)
