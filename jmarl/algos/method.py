"""A learning rule as one value (`Method`), the loss settings every method shares, and the registry.

A method is what its module builds once (optax's `GradientTransformation` is the model): its
options dataclass (`config`), three pure device functions over a `jmarl.batch.LearnerBatch`

    advantages(cfg, batch, state) -> f32[N]      (state: `device_state(cfg, method_state)`)
    keep_mask(cfg, batch) -> bool[N]             (samples that enter the loss)
    loss(cfg, logprobs f32[N, C], batch) -> (scalar, metrics)

and, where it keeps state across steps, hooks the trainer calls by name and never by method:
`init_state`, `after_plan` (after each step's sampling plan), `device_state`, `plan_inputs`
(values it feeds the plan's options each step), `eval_env`, the JSON form of the state the checkpoint metadata keeps, and
`save_files` (readable copies of the state written beside each checkpoint).

`algo.name` is a registered name (`jmarl.algos.METHODS`) or `package.module:NAME` for your own
`Method` (as `env.name` takes `package.module:Class`).

Settings have one home each. Loss and advantage settings live in the method's options
(`LossConfig`, `GroupPolicyConfig` for the GRPO family, which every such method extends);
sampling settings (the group size `workflow.group_size`, K, alpha, gamma, joint mode, the
continuation rule, turns) live with the sampling plan (`workflow.options`).
"""


import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from jmarl.algos import _checks
from jmarl.algos.advantages import BASELINES, NORMALIZERS, filter_groups, group_advantages
from jmarl.algos.losses import AGGREGATIONS, KL_KINDS, RATIOS, policy_loss
from jmarl.batch import LearnerBatch
from jmarl.errors import JmarlError
from jmarl.registry import lookup

EPS_MODES = ("add", "floor")
VARIANCE_RANKS = ("std", "range_normalised")


@dataclass(frozen=True)
class LossConfig:
    """Settings every method's loss shares.

    ddof/eps: the group std's degrees of freedom and epsilon; aggregation: how per-token losses
    reduce (`jmarl.algos.losses.aggregate_loss`); norm_length: the constant length of
    `seq_mean_token_sum_norm` (None: the run's completion budget, sampling.max_new_tokens);
    kl_coef/kl_kind: the KL penalty to the reference policy (set by train.kl_coef/kl_kind).
    """

    ddof: int = 1
    eps: float = 1e-6
    aggregation: str = "seq_mean_token_mean"
    norm_length: int | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"

    def __post_init__(self) -> None:
        _checks.check_int(self, "ddof", low=0)
        _checks.check_range(self, "eps", low=0.0, low_inclusive=False)
        _checks.check_choice(self, "aggregation", AGGREGATIONS)
        _checks.check_int(self, "norm_length", low=1, allow_none=True)
        _checks.check_range(self, "kl_coef", low=0.0)
        _checks.check_choice(self, "kl_kind", KL_KINDS)


@dataclass(frozen=True)
class GroupPolicyConfig(LossConfig):
    """The GRPO family's settings (GRPO's defaults): group advantages, group filters, the ratio
    and its clip.

    baseline: mean | max | loo | none; normalize: std (the group's) | batch (the std of the
    learner's whole batch, TRL's scale_rewards="batch") | none; eps_mode: add (A / (std + eps))
    | floor (A / max(std, eps), CoMLRL); ratio: token | sequence (GSPO) | sequence_token | none
    (on-policy, no clip); clip_low/clip_high/dual_clip: the PPO clip; drop_zero_variance /
    drop_low_variance_frac / drop_low_mean_frac: group filters; variance_rank: std |
    range_normalised (PettingLLMs: var / range^2) for drop_low_variance_frac.
    """

    baseline: str = "mean"
    normalize: str = "std"
    eps_mode: str = "add"
    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    drop_zero_variance: bool = False
    drop_low_variance_frac: float = 0.0
    drop_low_mean_frac: float = 0.0
    variance_rank: str = "std"

    def __post_init__(self) -> None:
        super().__post_init__()
        _checks.check_choice(self, "baseline", BASELINES)
        _checks.check_choice(self, "normalize", NORMALIZERS)
        _checks.check_choice(self, "eps_mode", EPS_MODES)
        _checks.check_choice(self, "ratio", RATIOS)
        _checks.check_range(self, "clip_low", low=0.0, high=1.0, high_inclusive=False)
        _checks.check_range(self, "clip_high", low=0.0)
        _checks.check_range(self, "dual_clip", low=1.0, low_inclusive=False, allow_none=True)
        _checks.check_bool(self, "drop_zero_variance")
        for name in ("drop_low_variance_frac", "drop_low_mean_frac"):
            _checks.check_range(self, name, low=0.0, high=1.0)
        _checks.check_choice(self, "variance_rank", VARIANCE_RANKS)


# ---------------------------------------------------------------- the GRPO family's functions


def group_policy_advantages(cfg: GroupPolicyConfig, batch: LearnerBatch, state: Any = None) -> jax.Array:
    """Group-relative advantages f32[N] of `batch.reward` over `batch.group` (`group_advantages`)."""
    return group_advantages(
        batch.reward, batch.group, num_groups=batch.num_samples, baseline=cfg.baseline,
        normalize=cfg.normalize, ddof=cfg.ddof, eps=cfg.eps, eps_mode=cfg.eps_mode,
    )


def group_policy_keep_mask(cfg: GroupPolicyConfig, batch: LearnerBatch) -> jax.Array:
    """bool[N]: the samples that survive the configured group filters (`filter_groups`)."""
    return filter_groups(
        batch.reward, batch.group, num_groups=batch.num_samples, drop_zero_variance=cfg.drop_zero_variance,
        drop_low_variance_frac=cfg.drop_low_variance_frac, drop_low_mean_frac=cfg.drop_low_mean_frac,
        ddof=cfg.ddof, variance_rank=cfg.variance_rank,
    )


def group_policy_loss(cfg: GroupPolicyConfig, logprobs: jax.Array, batch: LearnerBatch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped policy loss (`policy_loss`) of log-probs f32[N, C] on `batch`'s old
    log-probs, advantages and loss mask, normalised by the mini-batch's counts."""
    return policy_loss(
        logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, ratio=cfg.ratio,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, aggregation=cfg.aggregation,
        norm_length=cfg.norm_length, ref_logprobs=batch.ref_logprobs, kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind,
        num_tokens=batch.num_tokens, num_rows=batch.num_rows,
    )


def every_sample(cfg: Any, batch: LearnerBatch) -> jax.Array:
    """bool[N]: every non-padding sample (no group filter)."""
    return (batch.group >= 0) & (batch.group < batch.num_samples)


# ---------------------------------------------------------------- the method value


@dataclass(frozen=True)
class MethodContext:
    """What a method's `init_state` may read about the run: the number of policies, the group
    size (workflow.group_size) and the sampling plan's options."""

    num_policies: int
    group_size: int
    plan_options: Any = None


def _no_state(cfg: Any, context: MethodContext) -> None:
    return None


def _no_update(cfg: Any, state: Any, result: Any, step: int) -> tuple[Any, dict[str, float]]:
    return state, {}


def _nothing(cfg: Any, state: Any) -> None:
    return None


def _no_inputs(cfg: Any, state: Any) -> Mapping[str, Any]:
    return {}


def _same_env(cfg: Any, state: Any, env: Any) -> Any:
    return env


def _no_files(cfg: Any, state: Any, directory: Any) -> None:
    return None


def _json_none(state: Any) -> None:
    return None


def _from_json_none(cfg: Any, data: Any) -> None:
    return None


@dataclass(frozen=True)
class Method:
    """A learning rule (see the module docstring). Only `name`, `config`, `advantages` and
    `loss` are required; every hook defaults to "no state, nothing to do"."""

    name: str
    config: type
    advantages: Callable[[Any, LearnerBatch, Any], jax.Array]
    loss: Callable[[Any, jax.Array, LearnerBatch], tuple[jax.Array, dict[str, jax.Array]]]
    keep_mask: Callable[[Any, LearnerBatch], jax.Array] = every_sample
    default_plan: str = "independent"
    default_group_size: int = 4
    plans: tuple[str, ...] | None = None  # the plans it learns from (None: any plan that routes by agent)
    multi_agent: bool = True  # False: a single-agent baseline, refused with policies.mode heterogeneous
    init_state: Callable[[Any, MethodContext], Any] = _no_state
    after_plan: Callable[[Any, Any, Any, int], tuple[Any, dict[str, float]]] = _no_update  # (cfg, state, PlanResult, step)
    device_state: Callable[[Any, Any], Any] = _nothing  # (cfg, state) -> the arrays `advantages` reads
    plan_inputs: Callable[[Any, Any], Mapping[str, Any]] = _no_inputs  # (cfg, state) -> plan option values
    eval_env: Callable[[Any, Any, Any], Any] = _same_env  # (cfg, state, env) -> the env evaluation plays
    state_to_json: Callable[[Any], Any] = _json_none
    state_from_json: Callable[[Any, Any], Any] = _from_json_none  # (cfg, data) -> state
    save_files: Callable[[Any, Any, Any], None] = _no_files  # (cfg, state, output_dir): readable copies at each checkpoint

    def __post_init__(self) -> None:
        if not (isinstance(self.config, type) and dataclasses.is_dataclass(self.config)):
            raise JmarlError(f"method {self.name!r}: config must be a dataclass type, got {self.config!r}")

    def check_plan(self, plan: Any) -> None:
        """JmarlError unless this method can learn from the samples of `plan` (a
        `jmarl.workflows.Plan`): one of `plans`, or by default any plan that routes prompts by agent."""
        if self.plans is None and plan.routes_by_agent:
            return
        if self.plans is not None and plan.name in self.plans:
            return
        fits = f"plan {', '.join(map(repr, self.plans))}" if self.plans is not None else "a plan that routes by agent"
        raise JmarlError(f"workflow.plan: {plan.name!r} cannot train algo.name {self.name!r}: it needs {fits}")


def group_policy_method(name: str, config: type, **hooks: Any) -> Method:
    """A GRPO-family method: group advantages, group filters and the clipped policy loss."""
    return Method(
        name=name, config=config, advantages=group_policy_advantages, loss=group_policy_loss,
        keep_mask=group_policy_keep_mask, **hooks,
    )


# ---------------------------------------------------------------- registry


def load_method(name: str, registry: Mapping[str, Method]) -> Method:
    """The method `name`: a key of `registry`, or `package.module:NAME` naming a `Method` value."""
    return lookup(name, registry, Method, public="jmarl.algos.Method", setting="algo.name",
                  unknown="unknown algorithm", build="jmarl.algos.Method(name=..., config=..., advantages=..., loss=...)")


def finite_advantages(advantages: jax.Array, reward: jax.Array) -> jax.Array:
    """NaN where the reward is not finite (so the update's non-finite guard skips that
    mini-batch instead of training on it as "no signal"), `advantages` elsewhere: f32[N]."""
    return jnp.where(jnp.isfinite(reward), advantages, jnp.nan)
