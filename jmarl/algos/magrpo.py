"""MAGRPO (Liu et al., arXiv 2508.04652; CoMLRL): cooperative agents, one joint reward.

The sampling is the `joint` plan (`jmarl.workflows.joint`): each agent samples G completions
at a node, joint actions combine one completion per agent (aligned or cross), a completion's
return aggregates those of its joint actions, and multi-turn trees back returns up with gamma:
sampling settings (workflow.group_size = G, workflow.options.joint_mode / cross_aggregate /
gamma / early_stop_threshold). Group = the G sibling completions of one agent at one node.

The learner: advantage = (return - baseline) (mean: MAGRPO, none: MAREINFORCE, max: MAReMax,
loo: MARLOO) divided by the group's population std clamped at 1e-6 (CoMLRL: ddof 0,
eps_mode "floor"); loss: on-policy -A * sum_t lp over completion tokens (ratio "none",
`seq_sum`), KL optional; padding after EOS is masked (CoMLRL sums it, which is a bug).

Sampling defaults of the paper (for the sampler config): lr 5e-6, temperature 0.6, top_p 0.6,
top_k 50.
"""

from dataclasses import dataclass

from jmarl.algos.method import GroupPolicyConfig, group_policy_method


@dataclass(frozen=True)
class MAGRPOConfig(GroupPolicyConfig):
    """MAGRPO defaults (CoMLRL): mean baseline, population std floored at 1e-6, on-policy seq_sum loss."""

    ddof: int = 0
    eps_mode: str = "floor"
    ratio: str = "none"
    aggregation: str = "seq_sum"


Config = MAGRPOConfig
METHOD = group_policy_method("magrpo", MAGRPOConfig, default_plan="joint")
