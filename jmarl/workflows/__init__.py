"""Sampling plans: who samples which prompt how many times, and what each sample earns.

Plans (`independent`, `tree` for AT-GRPO, `joint` for MAGRPO, `node_wise` for JoyAgents-R1,
`shared` for HACPO) drive an env through a `Sampler` and return host-side `SampleRecord`s plus
`EpisodeStats` and typed plan stats (`PlanStats`, extended per plan: `SharedStats`,
`NodeWiseStats`); the learner packs the records straight into the batches a method reads
(`jmarl.train.learner.learner_batch`). `PLANS` maps each name to its `Plan` (function, options dataclass and
what the learner needs to know about it); every options dataclass names its group size
`group_size`. `memory` holds JoyAgents-R1's per-agent memory (its threshold math included);
`expert_demonstrations` plays expert episodes with the plans' episode loop.
"""

from jmarl.workflows.base import (
    Completion,
    EpisodeStats,
    PlanResult,
    PlanStats,
    SampleRecord,
    Sampler,
    input_fields,
    plan_metrics,
    summarize,
)
from jmarl.workflows.episodes import expert_demonstrations
from jmarl.workflows.independent import IndependentOptions, sample_independent
from jmarl.workflows.joint import JointOptions, joint_sample_bound, sample_joint
from jmarl.workflows.memory import (
    Memory,
    MemoryEntry,
    MemoryGroupSizeWarning,
    MemoryOptions,
    MemoryPromptEnv,
    check_group_size,
    demonstration_memory,
    min_group_size_for_memory,
    update_memory,
)
from jmarl.workflows.node_wise import NodeGroup, NodeWiseOptions, NodeWiseStats, sample_node_wise
from jmarl.workflows.plans import PLANS, Plan, PlanContext, get_plan, make_options, run_plan
from jmarl.workflows.shared import SharedOptions, SharedStats, TextTokenizer, sample_shared
from jmarl.workflows.tree import TreeOptions, sample_tree

__all__ = [
    "PLANS",
    "Completion",
    "EpisodeStats",
    "IndependentOptions",
    "JointOptions",
    "Memory",
    "MemoryEntry",
    "MemoryGroupSizeWarning",
    "MemoryOptions",
    "MemoryPromptEnv",
    "NodeGroup",
    "NodeWiseOptions",
    "NodeWiseStats",
    "Plan",
    "PlanContext",
    "PlanResult",
    "PlanStats",
    "SampleRecord",
    "Sampler",
    "SharedOptions",
    "SharedStats",
    "TextTokenizer",
    "TreeOptions",
    "check_group_size",
    "demonstration_memory",
    "expert_demonstrations",
    "get_plan",
    "input_fields",
    "joint_sample_bound",
    "make_options",
    "min_group_size_for_memory",
    "plan_metrics",
    "run_plan",
    "sample_independent",
    "sample_joint",
    "sample_node_wise",
    "sample_shared",
    "sample_tree",
    "summarize",
    "update_memory",
]
