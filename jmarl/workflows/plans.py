"""Sampling plans by name, for config-driven use: `run_plan("tree", env, ..., group_size=4)`.

Plans: independent, tree (AT-GRPO), joint (MAGRPO), node_wise (JoyAgents-R1), shared (HACPO).

A plan is one value, a `Plan`: its name, its function, its options dataclass and what the
learner side needs to know about it (whether samples are routed to the policy of their agent,
how to fill the options' run inputs from a `PlanContext`, a bound on one learner's samples per
step). Every options dataclass names its group size `group_size` and marks its run inputs
(fields the run fills in, not user settings) with the field metadata `{"input": True}`
(`jmarl.workflows.base.input_fields`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax

from jmarl.errors import JmarlError
from jmarl.workflows.base import PlanResult, Sampler
from jmarl.workflows.independent import IndependentOptions, sample_independent
from jmarl.workflows.joint import JointOptions, sample_joint
from jmarl.workflows.node_wise import NodeWiseOptions, sample_node_wise
from jmarl.workflows.shared import SharedOptions, sample_shared
from jmarl.workflows.tree import TreeOptions, sample_tree


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

    name: its registry key; run: `(env, seeds, agent_policy, sampler, rng, options) ->
    PlanResult`; options: its options dataclass; routes_by_agent: whether a sample goes to the
    policy of the agent that produced it (False for `shared`: every policy answers every
    prompt of the one agent); bind: `(options, context) -> options` with the run inputs filled
    in from the `PlanContext`; rows_per_policy: `(options, num_tasks) -> int`, a bound on one
    learner's samples per step, or None where the plan fixes none.
    """

    name: str
    run: Callable[..., PlanResult]
    options: type
    routes_by_agent: bool = True
    bind: Callable[[Any, PlanContext], Any] = _keep
    rows_per_policy: Callable[[Any, int], int] | None = None


def _bind_shared(options: SharedOptions, context: PlanContext) -> SharedOptions:
    """Every policy of the run is a learner: num_policies and tokenizers from the context."""
    tokenizers = dict(context.tokenizers)
    return dataclasses.replace(options, num_policies=len(tokenizers), tokenizers=tokenizers)


def _shared_rows(options: SharedOptions, num_tasks: int) -> int:
    """tasks x policies x G when sharing (hacpo, naive; dropped lossy cross samples make it an
    upper bound), tasks x G (gspo) or tasks x 2G (gspo_2x) otherwise."""
    sources = options.num_policies if options.shares else 1
    return num_tasks * sources * options.samples_per_policy


PLANS: dict[str, Plan] = {
    plan.name: plan
    for plan in (
        Plan("independent", sample_independent, IndependentOptions),
        Plan("tree", sample_tree, TreeOptions),
        Plan("joint", sample_joint, JointOptions),
        Plan("node_wise", sample_node_wise, NodeWiseOptions),
        Plan(
            "shared",
            sample_shared,
            SharedOptions,
            routes_by_agent=False,
            bind=_bind_shared,
            rows_per_policy=_shared_rows,
        ),
    )
}


def get_plan(name: str) -> Plan:
    """The plan registered as `name`; a `JmarlError` naming the known plans otherwise."""
    if name not in PLANS:
        raise JmarlError(f"unknown sampling plan {name!r}; known plans: {', '.join(sorted(PLANS))}")
    return PLANS[name]


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
