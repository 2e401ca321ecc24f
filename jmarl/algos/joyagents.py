"""JoyAgents-R1 (Han et al., arXiv 2506.19846): hierarchical agents, node-wise sampling, memory.

The paper publishes only the recipe; everything below is jmarl's own realization of it.
- Node-wise Monte Carlo sampling is the `node_wise` plan (`jmarl.workflows.node_wise`): one
  base trajectory; at each agent node G alternatives while every other node keeps its base
  action; each node is a group whose rewards are the final outcomes (the router env's
  accuracy + format - cost). Marginal-benefit selection, the top-K node groups by reward
  variance that produce gradients, is the plan's `top_k` (workflow.options.top_k): the other
  groups never reach the learner.
- Advantage and loss: GRPO's (std-normalised mean baseline, token ratio clip 0.2/0.2,
  `seq_mean_token_mean`, no KL).
- Adaptive memory: this method's state, a `jmarl.workflows.memory.Memory` (entries, retrieval,
  admission mu + z sigma, eviction mu - z sigma, scores, JSON) fed to the plan's prompts each
  step (`plan_inputs`) and to evaluation (`eval_env`), updated from the step's node groups
  (`after_plan`) and saved in the checkpoint metadata. Its rules are the `memory_*` options.
  A sample of a group of G is at most (G - 1) / sqrt(G) sigmas from the mean, so with
  z = 1.96 nothing is admitted for G <= 5: the default G is 8, and the run warns
  (`MemoryGroupSizeWarning`) when G is too small for z.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jmarl.algos import _checks
from jmarl.algos.method import GroupPolicyConfig, MethodContext, group_policy_method
from jmarl.workflows import memory as memory_store
from jmarl.workflows.base import PlanResult


@dataclass(frozen=True)
class JoyAgentsConfig(GroupPolicyConfig):
    """JoyAgents-R1 defaults (jmarl's realization): GRPO's loss and a memory with z 1.96, 3
    entries retrieved, 64 per agent, score weights 1/1 and time decay 0.1 per step.

    use_memory: whether agents keep, retrieve and update a memory; memory_decay: time decay
    per step of an entry's score (tau = 1 / decay).
    """

    memory_z: float = 1.96
    memory_time_weight: float = 1.0
    memory_reward_weight: float = 1.0
    memory_decay: float = 0.1
    memory_top_m: int = 3
    memory_capacity: int = 64
    use_memory: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _checks.check_range(self, "memory_z", low=0.0)
        _checks.check_range(self, "memory_time_weight", low=0.0)
        _checks.check_range(self, "memory_reward_weight", low=0.0)
        _checks.check_range(self, "memory_decay", low=0.0)
        _checks.check_int(self, "memory_top_m", low=0)
        _checks.check_int(self, "memory_capacity", low=1)
        _checks.check_bool(self, "use_memory")


Config = JoyAgentsConfig


def memory_options(cfg: JoyAgentsConfig) -> memory_store.MemoryOptions:
    """The memory store's rules from the options (tau = 1 / memory_decay)."""
    return memory_store.MemoryOptions(
        capacity=cfg.memory_capacity, top_m=cfg.memory_top_m, z=cfg.memory_z, ddof=cfg.ddof,
        tau=1.0 / cfg.memory_decay if cfg.memory_decay > 0 else float("inf"),
        time_weight=cfg.memory_time_weight, reward_weight=cfg.memory_reward_weight,
    )


def init_memory(cfg: JoyAgentsConfig, context: MethodContext) -> memory_store.Memory | None:
    """An empty memory when it is on and the plan retrieves one into its prompts (its options
    take a `memory`, as node_wise's do); warns when the group size cannot admit anything."""
    takes_memory = hasattr(context.plan_options, "memory")
    if not (cfg.use_memory and takes_memory):
        return None
    options = memory_options(cfg)
    memory_store.check_group_size(options, context.group_size)
    return memory_store.Memory(options)


def learn_memory(cfg: JoyAgentsConfig, memory: Any, result: PlanResult, step: int) -> tuple[Any, dict[str, float]]:
    """The memory after this step's node groups, and the metric memory/entries."""
    if memory is None:
        return None, {}
    memory = memory_store.update_memory(memory, result, step)
    return memory, {"memory/entries": float(sum(len(es) for _, es in memory.banks))}


def memory_plan_inputs(cfg: JoyAgentsConfig, memory: Any) -> dict[str, Any]:
    """The plan's `memory` option for this step (retrieved into its prompts)."""
    return {} if memory is None else {"memory": memory}


def memory_eval_env(cfg: JoyAgentsConfig, memory: Any, env: Any) -> Any:
    """Evaluation prompts carry the retrieved entries as in training."""
    return env if memory is None else memory_store.MemoryPromptEnv(env, memory)


METHOD = group_policy_method(
    "joyagents", JoyAgentsConfig, default_plan="node_wise", default_group_size=8,
    init_state=init_memory, after_plan=learn_memory, plan_inputs=memory_plan_inputs, eval_env=memory_eval_env,
    state_to_json=lambda memory: None if memory is None else memory.to_json(),
    state_from_json=lambda cfg, data: None if data is None else memory_store.Memory.from_json(data),
    save_files=lambda cfg, memory, directory: None if memory is None else memory_store.save(memory, Path(directory) / "memory.json"),
)
MemoryGroupSizeWarning = memory_store.MemoryGroupSizeWarning
