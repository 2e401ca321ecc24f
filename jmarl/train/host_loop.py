"""The rollout phase of a training step, timed: the plan run under the host loop's settings.

`run_rollout(trainer, seeds, key)` runs the trainer's sampling plan with its env stepped by
`jmarl.workflows.stepping` (`workflow.env_workers` threads) and returns the plan's result and
the step's rollout timings:

- time/generate: seconds inside `sampler.sample` (the sampler's own figure where its
  `take_stats()` reports one, else measured around its calls here);
- time/env: seconds stepping envs (`step_all`);
- time/host: the rest of the rollout phase (observing, prompt building, the plan's bookkeeping);
- time/rollout: the whole phase;
plus whatever else the sampler's `take_stats()` reports (rollout/row_utilization, ...).
The trainer adds time/update (scoring + update) after the learner phase.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax

from jmarl.workflows.base import Completion, PlanResult
from jmarl.workflows.stepping import host_loop


class TimedSampler:
    """A sampler that adds the seconds spent in the wrapped sampler's `sample` to `seconds`;
    every other attribute is the wrapped sampler's."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.seconds = 0.0

    def sample(self, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array) -> list[list[Completion]]:
        start = time.perf_counter()
        try:
            return self.sampler.sample(requests, n, rng)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


def sampler_stats(sampler: Any) -> dict[str, float]:
    """`sampler.take_stats()` as floats (the figures since its last call), {} without it."""
    take = getattr(sampler, "take_stats", None)
    if take is None:
        return {}
    return {str(k): float(v) for k, v in dict(take()).items()}


def timed_rollout(
    sampler: Any, run: Any, env_workers: int | None
) -> tuple[PlanResult, dict[str, float]]:
    """`run(timed sampler)` (a plan call) under `host_loop(env_workers)` -> (its result, the
    rollout metrics of the module docstring)."""
    sampler_stats(sampler)  # drop what calls before this step (evaluation, warm start) left
    timed = TimedSampler(sampler)
    start = time.perf_counter()
    with host_loop(workers=env_workers) as clock:
        result = run(timed)
    total = time.perf_counter() - start
    metrics = sampler_stats(sampler)
    metrics.setdefault("time/generate", timed.seconds)
    metrics["time/env"] = clock.seconds
    metrics["time/host"] = max(total - metrics["time/generate"] - clock.seconds, 0.0)
    metrics["time/rollout"] = total
    return result, metrics


def run_rollout(trainer: Any, seeds: Sequence[int], key: jax.Array) -> tuple[PlanResult, dict[str, float]]:
    """The trainer's plan on `seeds` with this step's plan options -> (result, rollout metrics)."""
    options = trainer.step_plan_options()
    return timed_rollout(
        trainer.sampler,
        lambda sampler: trainer.plan.run(trainer.env, seeds, trainer.policies.agent_policy, sampler, key, options),
        trainer.config.workflow.env_workers,
    )
