"""Tasks as immutable-state multi-agent environments (see docs/environments.md)."""

from jmarl.envs.base import (
    EVAL_SEED_START,
    Env,
    StepResult,
    eval_seed,
    is_eval_seed,
    make,
    registered,
    train_seed,
)

__all__ = [
    "EVAL_SEED_START",
    "Env",
    "StepResult",
    "eval_seed",
    "is_eval_seed",
    "make",
    "registered",
    "train_seed",
]
