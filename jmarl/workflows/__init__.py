"""Sampling plans: who samples which prompt how many times, and what each sample earns.

Plans (`independent`, `tree` for AT-GRPO, `joint` for MAGRPO) drive an env through a
`Sampler` and return host-side `SampleRecord`s plus `EpisodeStats`; `build_rollouts` turns the
records into the `Rollouts` batch the algorithms consume.
"""

from jmarl.workflows.base import (
    Completion,
    EpisodeStats,
    PlanResult,
    SampleRecord,
    Sampler,
    summarize,
)
from jmarl.workflows.build import build_rollouts
from jmarl.workflows.independent import IndependentOptions, sample_independent
from jmarl.workflows.joint import JointOptions, joint_sample_bound, sample_joint
from jmarl.workflows.plans import PLANS, make_options, run_plan
from jmarl.workflows.tree import TreeOptions, sample_tree

__all__ = [
    "PLANS",
    "Completion",
    "EpisodeStats",
    "IndependentOptions",
    "JointOptions",
    "PlanResult",
    "SampleRecord",
    "Sampler",
    "TreeOptions",
    "build_rollouts",
    "joint_sample_bound",
    "make_options",
    "run_plan",
    "sample_independent",
    "sample_joint",
    "sample_tree",
    "summarize",
]
