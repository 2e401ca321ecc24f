"""AT-GRPO (Zhao et al., arXiv 2510.11062; PettingLLMs): agent- and turn-wise grouped GRPO.

The sampling is the `tree` plan (`jmarl.workflows.tree`): at every (env, turn, agent) node K
candidates are sampled from one identical prompt, and that node is the GRPO group; a
candidate's reward is local + alpha * team reward, immediate or return-to-go; the chosen
candidate continues the episode. Those are sampling settings (workflow.group_size = K,
workflow.options.alpha / select / reward_mode / gamma). What remains for the learner is GRPO's
math with AT-GRPO's loss defaults as its released code runs them: std-normalised group
advantage, PPO clip 0.2/0.2, `token_mean`, no KL. The dual clip (c = 3 in verl) is off: the
paper does not mention it and PettingLLMs' verl fork has it commented out (docs/fidelity.md);
`dual_clip: 3.0` turns it on (the quickstart does).

Paper training defaults (for the trainer config): 1 epoch, grad clip 1.0, AdamW wd 0.01,
lr 1e-6, 128 envs per step, temperature 1.0 train / greedy eval.
"""

from dataclasses import dataclass

from jmarl.algos.method import GroupPolicyConfig, group_policy_method


@dataclass(frozen=True)
class ATGRPOConfig(GroupPolicyConfig):
    """AT-GRPO loss defaults (the released code): clip 0.2/0.2, no dual clip, token_mean, no KL."""

    aggregation: str = "token_mean"


Config = ATGRPOConfig
METHOD = group_policy_method("at_grpo", ATGRPOConfig, default_plan="tree")
