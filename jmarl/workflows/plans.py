"""Sampling plans by name, for config-driven use: `run_plan("tree", env, ..., num_candidates=4)`.

Plans: independent, tree (AT-GRPO), joint (MAGRPO), node_wise (JoyAgents-R1), shared (HACPO).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from jmarl.errors import JmarlError
from jmarl.workflows.base import PlanResult, Sampler
from jmarl.workflows.independent import IndependentOptions, sample_independent
from jmarl.workflows.joint import JointOptions, sample_joint
from jmarl.workflows.node_wise import NodeWiseOptions, sample_node_wise
from jmarl.workflows.shared import SharedOptions, sample_shared
from jmarl.workflows.tree import TreeOptions, sample_tree

# name -> (plan function, its options dataclass)
PLANS: dict[str, tuple[Callable[..., PlanResult], type]] = {
    "independent": (sample_independent, IndependentOptions),
    "tree": (sample_tree, TreeOptions),
    "joint": (sample_joint, JointOptions),
    "node_wise": (sample_node_wise, NodeWiseOptions),
    "shared": (sample_shared, SharedOptions),
}


def make_options(name: str, **options: Any) -> Any:
    """The options dataclass of plan `name` built from keyword options (validated)."""
    if name not in PLANS:
        raise JmarlError(f"unknown sampling plan {name!r}; known plans: {', '.join(sorted(PLANS))}")
    cls = PLANS[name][1]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise JmarlError(
            f"unknown option(s) {unknown} for sampling plan {name!r}; "
            f"its options are {sorted(known)}"
        )
    return cls(**options)


def run_plan(
    name: str,
    env: Any,
    seeds: Sequence[int],
    agent_policy: Sequence[int],
    sampler: Sampler,
    rng: jax.Array,
    **options: Any,
) -> PlanResult:
    """Runs sampling plan `name` (a key of `PLANS`) with keyword options."""
    plan_options = make_options(name, **options)
    return PLANS[name][0](env, seeds, agent_policy, sampler, rng, plan_options)
