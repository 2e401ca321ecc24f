"""Host-side algorithm state the trainer carries between steps, and the HACPO device function.

- HACPO (`shared` plan): the capability window (`jmarl.algos.hacpo.CapabilityWindow`, the last
  K steps' per-policy success rates), pushed with the plan's `stats["success_rate"]` before
  advantages are computed.
- JoyAgents-R1 (`node_wise` plan): the per-agent memory (`jmarl.workflows.memory.Memory`),
  retrieved into the prompts of the step (`node_wise_options`) and updated after it
  (`update_memory`).
- Both: the number of rollouts generated so far (what the HACPO baselines are compared at).

`AlgoState` is an immutable value; `to_meta` / `from_meta` (JSON-able dict) store it in the
checkpoint metadata, so a resumed run continues with the same window and memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.algos import hacpo, joyagents
from jmarl.errors import JmarlError
from jmarl.workflows import memory as memory_store
from jmarl.workflows.base import PlanResult
from jmarl.workflows.node_wise import NodeWiseOptions
from jmarl.workflows.shared import SharedOptions, mode_switches


@dataclass(frozen=True)
class AlgoState:
    """What the trainer's algorithm keeps across steps (None where the algorithm has none).

    capability: HACPO's capability window; memory: JoyAgents-R1's memory; rollouts_generated:
    completions sampled by the training plans so far (not counting evaluation).
    """

    capability: hacpo.CapabilityWindow | None = None
    memory: memory_store.Memory | None = None
    rollouts_generated: int = 0

    def to_meta(self) -> dict[str, Any]:
        """A JSON-able dict for the checkpoint metadata."""
        return {
            "capability": None if self.capability is None else self.capability.to_json(),
            "memory": None if self.memory is None else self.memory.to_json(),
            "rollouts_generated": int(self.rollouts_generated),
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "AlgoState":
        """The state written by `to_meta`."""
        try:
            cap, mem = meta.get("capability"), meta.get("memory")
            return cls(
                capability=None if cap is None else hacpo.CapabilityWindow.from_json(cap),
                memory=None if mem is None else memory_store.Memory.from_json(mem),
                rollouts_generated=int(meta.get("rollouts_generated", 0)),
            )
        except (AttributeError, TypeError, ValueError) as err:
            raise JmarlError(f"malformed algorithm state in the checkpoint metadata ({err})") from None


def memory_options(cfg: joyagents.JoyAgentsConfig) -> memory_store.MemoryOptions:
    """The memory store's rules from JoyAgents-R1's options (tau = 1 / memory_decay)."""
    return memory_store.MemoryOptions(
        capacity=cfg.memory_capacity,
        top_m=cfg.memory_top_m,
        z=cfg.memory_z,
        ddof=cfg.ddof,
        tau=1.0 / cfg.memory_decay if cfg.memory_decay > 0 else float("inf"),
        time_weight=cfg.memory_time_weight,
        reward_weight=cfg.memory_reward_weight,
    )


def init_algo_state(algo_name: str, algo_cfg: Any, plan: str) -> AlgoState:
    """The state at step 0: an empty window (hacpo) or an empty memory (joyagents with memory,
    on the node_wise plan, whose node groups feed it)."""
    if algo_name == "hacpo":
        return AlgoState(capability=hacpo.CapabilityWindow(size=algo_cfg.capability_window))
    if algo_name == "joyagents" and algo_cfg.use_memory and plan == "node_wise":
        return AlgoState(memory=memory_store.Memory(memory_options(algo_cfg)))
    return AlgoState()


def hacpo_mode_config(cfg: hacpo.HACPOConfig, mode: str) -> hacpo.HACPOConfig:
    """`cfg` with the plan mode's mechanism switches applied (a switch is on only if both the
    algorithm option and the mode leave it on: naive sharing turns all three off)."""
    switches = mode_switches(mode)
    return dataclasses.replace(cfg, **{k: bool(getattr(cfg, k)) and on for k, on in switches.items()})


def shared_options(options: SharedOptions, tokenizers: Mapping[int, Any]) -> SharedOptions:
    """The `shared` plan's options with one learner per policy and each policy's tokenizer."""
    return dataclasses.replace(options, num_policies=len(tokenizers), tokenizers=dict(tokenizers))


def node_wise_group_size(options: NodeWiseOptions, group_size: int, *, explicit: bool) -> NodeWiseOptions:
    """The `node_wise` plan's options with G = workflow.group_size (the algorithm's
    num_generations), unless workflow.options.num_alternatives is set, which must then agree."""
    if explicit and options.num_alternatives != group_size:
        raise JmarlError(
            f"workflow.options.num_alternatives ({options.num_alternatives}) and workflow.group_size "
            f"({group_size}) disagree; set only workflow.group_size"
        )
    return dataclasses.replace(options, num_alternatives=group_size)


def node_wise_options(options: NodeWiseOptions, cfg: joyagents.JoyAgentsConfig, state: AlgoState, *, top_k_set: bool) -> NodeWiseOptions:
    """The `node_wise` plan's options for this step: the current memory injected into prompts
    and, unless workflow.options.top_k is given, the algorithm's `top_k_groups`."""
    if top_k_set and options.top_k != cfg.top_k_groups:
        raise JmarlError(
            f"workflow.options.top_k ({options.top_k}) and algo.options.top_k_groups "
            f"({cfg.top_k_groups}) disagree; set only algo.options.top_k_groups"
        )
    return dataclasses.replace(options, top_k=cfg.top_k_groups, memory=state.memory)


def after_plan(state: AlgoState, result: PlanResult, step: int) -> tuple[AlgoState, dict[str, float]]:
    """The state after a step's plan (window pushed / memory updated, rollouts counted), and
    metrics: hacpo/capability_<p>, memory/entries, rollout/generated(_total)."""
    generated = int(result.stats.get("num_generated", len(result.records)))
    metrics = {"rollout/generated": float(generated)}
    if "num_lossy" in result.stats:  # shared plan: cross samples whose text did not round-trip
        metrics["rollout/lossy_cross_samples"] = float(result.stats["num_lossy"])
    capability, mem = state.capability, state.memory
    if capability is not None:
        capability = hacpo.update_capabilities(capability, result.stats["success_rate"])
        for p, value in enumerate(hacpo.capabilities(capability)):
            metrics[f"hacpo/capability_{p}"] = float(value)
        for p, value in enumerate(result.stats["success_rate"]):
            metrics[f"hacpo/success_{p}"] = float(value)
    if mem is not None:
        mem = memory_store.update_memory(mem, result, step)
        metrics["memory/entries"] = float(sum(len(es) for _, es in mem.banks))
    total = state.rollouts_generated + generated
    metrics["rollout/generated_total"] = float(total)
    return AlgoState(capability=capability, memory=mem, rollouts_generated=total), metrics


def hacpo_batch_fn(cfg: hacpo.HACPOConfig, num_groups: int, stacked: bool):
    """One jitted function over a learner's mixed groups:

    (reward f32[N], group int32[N], source int32[N], learner int32[], capability f32[n]) ->
    (advantages f32[N] (NaN where the reward is not finite), discrepancy weights f32[N],
    keep bool[N], is_cross bool[N]); vmapped over a leading policy axis when `stacked`
    (learner int32[P], capability shared).
    """

    def one(reward, group, source, learner, capability):
        adv = hacpo.advantages(cfg, reward, group, num_groups=num_groups, source=source, capability=capability, learner=learner)
        adv = jnp.where(jnp.isfinite(reward), adv, jnp.nan)
        weight = hacpo.discrepancy(cfg, capability, source, learner)
        keep = hacpo.keep_mask(cfg, reward, group, num_groups=num_groups)
        return adv, weight, keep, source != learner

    key = (cfg, num_groups, stacked)
    if key not in _HACPO_CACHE:
        _HACPO_CACHE[key] = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, 0, None)) if stacked else one)
    return _HACPO_CACHE[key]


_HACPO_CACHE: dict[Any, Any] = {}


def hacpo_inputs(batch: Mapping[str, np.ndarray], policy_ids: tuple[int, ...], stacked: bool, capability: np.ndarray):
    """The arguments of `hacpo_batch_fn` from a group batch (see `trainer.group_batch`)."""
    learner = np.asarray(policy_ids if stacked else policy_ids[0], np.int32)
    return (
        jnp.asarray(batch["reward"]), jnp.asarray(batch["group"]), jnp.asarray(batch["source_policy"]),
        jnp.asarray(learner), jnp.asarray(capability, jnp.float32),
    )
