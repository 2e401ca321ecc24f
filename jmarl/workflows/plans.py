"""Sampling plans by name, for config-driven use: `run_plan("tree", env, ..., group_size=4)`.

Plans: independent, tree (AT-GRPO), joint (MAGRPO), node_wise (JoyAgents-R1), shared (HACPO).

A plan is one value, a `Plan`: its name, its function, its options dataclass and what the
learner side needs to know about it (whether samples are routed to the policy of their agent,
how to fill the options' run inputs from a `PlanContext`, a bound on one learner's samples per
step, the step's shape bounds for the memory check). `get_plan` also loads your own `Plan`
given as `package.module:NAME`. Every options dataclass names its group size `group_size` and marks its run inputs
(fields the run fills in, not user settings) with the field metadata `{"input": True}`
(`jmarl.workflows.base.input_fields`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax

from jmarl.errors import JmarlError
from jmarl.registry import lookup
from jmarl.workflows.base import PlanResult, Sampler
from jmarl.workflows.bounds import BoundsContext, PlanBounds
from jmarl.workflows.independent import IndependentOptions, independent_bounds, sample_independent
from jmarl.workflows.joint import JointOptions, joint_bounds, sample_joint
from jmarl.workflows.node_wise import NodeWiseOptions, node_wise_bounds, sample_node_wise
from jmarl.workflows.shared import SharedOptions, sample_shared, shared_bounds, shared_rows
from jmarl.workflows.tree import TreeOptions, sample_tree, tree_bounds


@dataclass(frozen=True)
class PlanContext:
    """What the run knows that a plan's options may need: tokenizers maps every policy id
    (0..n-1) to its tokenizer."""

    tokenizers: Mapping[int, Any]


def _keep(options: Any, context: PlanContext) -> Any:
    """The default `Plan.bind`: the options as they are."""
    del context
    return options


@dataclass(frozen=True)
class Plan:
    """One sampling plan.

    name: its registry key (or the `package.module:NAME` it was loaded as); run: `(env, seeds,
    agent_policy, sampler, rng, options) -> PlanResult`; options: its options dataclass;
    routes_by_agent: whether a sample goes to the policy of the agent that produced it (False
    for `shared`: every policy answers every prompt of the one agent); bind: `(options,
    context) -> options` with the run inputs filled in from the `PlanContext`;
    rows_per_policy: `(options, num_tasks) -> int`, a bound on one learner's samples per step
    the learner pads to, or None where the plan fixes none; bounds: `(options, BoundsContext)
    -> PlanBounds`, the step's shape bounds the memory check compiles for
    (`jmarl.workflows.bounds`), or None: the plan runs, its memory cannot be checked.
    """

    name: str
    run: Callable[..., PlanResult]
    options: type
    routes_by_agent: bool = True
    bind: Callable[[Any, PlanContext], Any] = _keep
    rows_per_policy: Callable[[Any, int], int] | None = None
    bounds: Callable[[Any, BoundsContext], PlanBounds] | None = None


def _bind_shared(options: SharedOptions, context: PlanContext) -> SharedOptions:
    """Every policy of the run is a learner: num_policies and tokenizers from the context."""
    tokenizers = dict(context.tokenizers)
    return dataclasses.replace(options, num_policies=len(tokenizers), tokenizers=tokenizers)


PLANS: dict[str, Plan] = {
    plan.name: plan
    for plan in (
        Plan("independent", sample_independent, IndependentOptions, bounds=independent_bounds),
        Plan("tree", sample_tree, TreeOptions, bounds=tree_bounds),
        Plan("joint", sample_joint, JointOptions, bounds=joint_bounds),
        Plan("node_wise", sample_node_wise, NodeWiseOptions, bounds=node_wise_bounds),
        Plan(
            "shared",
            sample_shared,
            SharedOptions,
            routes_by_agent=False,
            bind=_bind_shared,
            rows_per_policy=shared_rows,
            bounds=shared_bounds,
        ),
    )
}


def get_plan(name: str) -> Plan:
    """The plan `name`: a key of `PLANS`, or `package.module:NAME` naming a `Plan` value (your
    own plan, as `algo.name` takes your own method); a `JmarlError` naming the choices otherwise."""
    return lookup(name, PLANS, Plan, public="jmarl.workflows.Plan", setting="workflow.plan",
                  unknown="unknown sampling plan", build="jmarl.workflows.Plan(name=..., run=..., options=...)")


def make_options(name: str, **options: Any) -> Any:
    """The options dataclass of plan `name` built from keyword options (validated)."""
    cls = get_plan(name).options
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
    return get_plan(name).run(env, seeds, agent_policy, sampler, rng, plan_options)
