"""Sampling plans: who samples which prompt how many times, and what each sample earns.

Plans (`independent`, `tree` for AT-GRPO, `joint` for MAGRPO, `node_wise` for JoyAgents-R1,
`shared` for HACPO) drive an env through a `Sampler` and return host-side `SampleRecord`s plus
`EpisodeStats` (and plan stats); `build_rollouts` turns the records into the `Rollouts` batch
the algorithms consume. `memory` holds JoyAgents-R1's per-agent memory; `shared` holds HACPO's
capability window.
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
from jmarl.workflows.memory import (
    Memory,
    MemoryEntry,
    MemoryOptions,
    update_memory,
)
from jmarl.workflows.node_wise import NodeGroup, NodeWiseOptions, sample_node_wise
from jmarl.workflows.plans import PLANS, make_options, run_plan
from jmarl.workflows.shared import (
    CapabilityWindow,
    SharedOptions,
    TextTokenizer,
    capabilities,
    mode_switches,
    sample_shared,
    update_capabilities,
)
from jmarl.workflows.tree import TreeOptions, sample_tree

__all__ = [
    "PLANS",
    "CapabilityWindow",
    "Completion",
    "EpisodeStats",
    "IndependentOptions",
    "JointOptions",
    "Memory",
    "MemoryEntry",
    "MemoryOptions",
    "NodeGroup",
    "NodeWiseOptions",
    "PlanResult",
    "SampleRecord",
    "Sampler",
    "SharedOptions",
    "TextTokenizer",
    "TreeOptions",
    "build_rollouts",
    "capabilities",
    "joint_sample_bound",
    "make_options",
    "mode_switches",
    "run_plan",
    "sample_independent",
    "sample_joint",
    "sample_node_wise",
    "sample_shared",
    "sample_tree",
    "summarize",
    "update_capabilities",
    "update_memory",
]
