"""Held-out evaluation: greedy (or sampled) success on evaluation seeds, and pass@k.

Episodes are played by the `independent` plan, one per seed, on `envs.eval_seed(i)` (never a
training seed). A plan that does not route by agent (`shared`: every policy answers every
prompt) is evaluated one policy at a time: eval/<policy>/<metric>, and eval/<metric> is the
mean over the policies.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jmarl import envs
from jmarl.config import EvalConfig
from jmarl.workflows import run_plan, summarize


def step_info_values(records: Sequence[Any]) -> dict[str, np.ndarray]:
    """Each numeric env step-info value (`record.info["env_info"]`, e.g. Writing's reward
    components): f64[n_k], over the n_k records that report key k; {} when none does."""
    values: dict[str, list[float]] = {}
    for r in records:
        for k, v in r.info.get("env_info", {}).items():
            values.setdefault(k, []).append(float(v))
    return {k: np.asarray(v, np.float64) for k, v in values.items()}


def step_info_means(records: Sequence[Any]) -> dict[str, float]:
    """Mean of each numeric env step-info value over the records that report it."""
    return {k: float(np.mean(v)) for k, v in step_info_values(records).items()}


def step_info_metrics(records: Sequence[Any]) -> dict[str, float]:
    """rollout/info/<k>: the mean of each step-info value over a step's samples, and
    rollout/info_nonzero/<k>: the share of them where it is not 0 (how sparse a reward
    component is)."""
    out: dict[str, float] = {}
    for k, v in step_info_values(records).items():
        out[f"rollout/info/{k}"] = float(np.mean(v))
        out[f"rollout/info_nonzero/{k}"] = float(np.mean(v != 0))
    return out


def evaluate_agents(
    env: Any, sampler: Any, agent_policy: Sequence[int], ec: EvalConfig, key: jax.Array, *, max_turns: int | None
) -> dict[str, float]:
    """eval/<metric> of the agents routed by `agent_policy` on ec.num_episodes held-out seeds
    (eval/pass@k with ec.pass_k > 1: sampled at the sampler's own temperature)."""
    seeds = [envs.eval_seed(i) for i in range(ec.num_episodes)]
    saved = sampler.settings
    out: dict[str, float] = {}
    try:
        if ec.greedy:
            sampler.settings = dataclasses.replace(saved, temperature=0.0)
        res = run_plan("independent", env, seeds, agent_policy, sampler, key, group_size=1, max_turns=max_turns)
        out.update({f"eval/{k}": v for k, v in summarize(res.episodes).items()})
        out.update({f"eval/info/{k}": v for k, v in step_info_means(res.records).items()})
        if ec.pass_k > 1:
            sampler.settings = saved
            res = run_plan("independent", env, seeds, agent_policy, sampler, key, group_size=ec.pass_k, max_turns=max_turns)
            solved: dict[int, bool] = {}
            for e in res.episodes:
                solved[e.env] = solved.get(e.env, False) or e.success
            out[f"eval/pass@{ec.pass_k}"] = float(np.mean(list(solved.values())))
    finally:
        sampler.settings = saved
    return out


def evaluate(
    env: Any, sampler: Any, agent_policy: Sequence[int], policy_names: Sequence[str], ec: EvalConfig, key: jax.Array,
    *, routes_by_agent: bool, max_turns: int | None,
) -> dict[str, float]:
    """The run's evaluation metrics (see the module docstring)."""
    if routes_by_agent:
        return evaluate_agents(env, sampler, agent_policy, ec, key, max_turns=max_turns)
    out: dict[str, float] = {}
    per = []
    for pid, name in enumerate(policy_names):
        got = evaluate_agents(env, sampler, (pid,) * len(agent_policy), ec, key, max_turns=max_turns)
        per.append(got)
        out.update({k.replace("eval/", f"eval/{name}/", 1): v for k, v in got.items()})
    for k in per[0]:
        if all(k in g for g in per):
            out[k] = float(np.mean([g[k] for g in per]))
    return out
