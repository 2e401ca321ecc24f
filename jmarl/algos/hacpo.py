"""HACPO (Zhang et al., arXiv 2603.02604): heterogeneous agents sharing rollouts, built on GSPO.

n agents answer the same prompts; learner k trains on its own G rollouts ("self" samples) and
on every other agent's rollouts for that prompt ("cross" samples). Rewards are verified 0/1.
1. Capability P^j: agent j's mean success rate over the last K steps (`CapabilityWindow`, a
   host-side immutable value updated by `update_capabilities` before advantages are computed;
   the trainer keeps it as algorithm state and saves it with checkpoints via `to_json`).
2. Capability-aware advantage (`capability_advantages`): omega^{k,j} = clip(P^k / P^j, 0.1, 10),
   baseline mu^k = mean over the mixed group of omega^{k,source} * r; if mu^k exceeds the maximum
   reward it falls back to learner k's own mean; A = (r - mu^k) / (std_ddof1 + 1e-6).
3. Discrepancy coefficient (`discrepancy_coefficients`): a cross sample from agent j is weighted
   by omega^{j,k} = clip(P^j / P^k, 0.1, 10).
4./5. Cross ratio s = exp(mean lp_k(y) - mean lp_j,old(y)) (`source_seq_logprob`, taken at
   rollout), clipped stepwise to [1 - delta + m * delta_step, 1] for mini-batch m, then
   s~ = c * sg(c)^alpha (`cross_ratio`).
Loss: self samples GSPO min(s*A, clip(s, 1-3e-4, 1+4e-4)*A); cross samples s~ * omega^{j,k} * A;
`seq_mean_token_mean`; optional k3 KL on self samples (the authors' code uses 0.001; off here).
The paper's table lists delta = 0.8 for most pairs; the default is the code's 0.2.
Ablation switches: `capability_baseline`, `discrepancy`, `stepwise_clip` (all False = naive
sharing: plain mean baseline, weight 1, cross samples treated like self GSPO samples). Naive
sharing samples exactly as HACPO, so it is these settings (`algo.options`), not a plan mode.
"""

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.algos import _checks
from jmarl.algos.advantages import _segments, _stats
from jmarl.algos.method import LossConfig, Method, MethodContext
from jmarl.batch import LearnerBatch
from jmarl.algos.losses import (
    LOG_RATIO_CLAMP,
    aggregate_loss,
    clipped_surrogate,
    kl_penalty,
    masked_seq_mean,
    masked_token_mean,
)
from jmarl.errors import JmarlError
from jmarl.workflows.base import PlanResult
from jmarl.workflows.shared import SharedStats

sg = jax.lax.stop_gradient


@dataclass(frozen=True)
class HACPOConfig(LossConfig):
    """HACPO defaults (authors' code): K=5, alpha 1, delta 0.2, delta_step 0.025, GSPO clip 3e-4/4e-4.

    The group size G is workflow.group_size (8 by default for HACPO); whether the policies share
    their samples is the `shared` plan's workflow.options.share (false, with samples_per_policy
    G or 2G: the paper's GSPO baselines). Naive sharing (the paper's ablation) is share: true
    with the three mechanism switches below set to False.
    """

    capability_window: int = 5
    alpha: float = 1.0
    delta: float = 0.2
    delta_step: float = 0.025
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    omega_min: float = 0.1
    omega_max: float = 10.0
    max_reward: float | None = None
    capability_baseline: bool = True
    discrepancy: bool = True
    stepwise_clip: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _checks.check_int(self, "capability_window", low=1)
        _checks.check_range(self, "alpha", low=0.0)
        _checks.check_range(self, "delta", low=0.0, high=1.0)
        _checks.check_range(self, "delta_step", low=0.0)
        _checks.check_range(self, "clip_low", low=0.0, high=1.0, high_inclusive=False)
        _checks.check_range(self, "clip_high", low=0.0)
        _checks.check_range(self, "omega_min", low=0.0, high=1.0, low_inclusive=False)
        _checks.check_range(self, "omega_max", low=1.0)
        _checks.check_range(self, "max_reward", allow_none=True)
        for name in ("capability_baseline", "discrepancy", "stepwise_clip"):
            _checks.check_bool(self, name)


Config = HACPOConfig


# ---------------------------------------------------------------- capability tracking (host)


@dataclass(frozen=True)
class CapabilityWindow:
    """Per-policy success rates of the last `size` steps: history[s][j], the newest step last.

    HACPO's algorithm state (a host-side immutable value): `update_capabilities` returns a new
    window, `capabilities(w)[j]` is P^j, `to_json`/`from_json` save it with checkpoints.
    """

    size: int = 5
    history: tuple[tuple[float, ...], ...] = field(default=())

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise JmarlError(f"CapabilityWindow.size must be an int >= 1, got {self.size!r}")

    def to_json(self) -> str:
        """The window as a JSON string (saved in checkpoint metadata)."""
        return json.dumps({"size": self.size, "history": [list(row) for row in self.history]})

    @classmethod
    def from_json(cls, text: str) -> "CapabilityWindow":
        """The window written by `to_json`."""
        try:
            data = json.loads(text)
            rows = tuple(tuple(float(x) for x in row) for row in data["history"])
            window = cls(size=int(data["size"]))
        except (KeyError, TypeError, ValueError) as err:
            raise JmarlError(
                f"malformed capability window JSON ({err}); expected {{'size': int, "
                "'history': [[float, ...], ...]}"
            ) from None
        for row in rows:
            window = update_capabilities(window, row)
        return window


def update_capabilities(window: CapabilityWindow, success: Sequence[float]) -> CapabilityWindow:
    """A new window with this step's per-policy success fractions f[n] (each in [0, 1]) appended;
    steps older than the last `size` are dropped."""
    row = tuple(float(x) for x in np.asarray(success, np.float64).reshape(-1))
    if window.history and len(row) != len(window.history[0]):
        raise JmarlError(
            f"update_capabilities got success fractions for {len(row)} agents but the window "
            f"tracks {len(window.history[0])}"
        )
    if not row or any(not 0.0 <= x <= 1.0 for x in row):
        raise JmarlError(f"success fractions must be a non-empty list in [0, 1], got {row}")
    return CapabilityWindow(window.size, (window.history + (row,))[-window.size :])


def capabilities(window: CapabilityWindow) -> np.ndarray:
    """P f32[n]: each policy's mean success fraction over the steps in the window."""
    if not window.history:
        raise JmarlError(
            "the capability window is empty: call update_capabilities with this step's success "
            "fractions before computing advantages"
        )
    return np.mean(np.asarray(window.history, np.float64), axis=0).astype(np.float32)


def success_rate(rewards: jax.Array, agent: jax.Array, *, num_agents: int) -> jax.Array:
    """Fraction of rewards > 0 per agent f32[num_agents] from rewards f32[N], agent int[N] (-1 = padding)."""
    seg, valid = _segments(agent, num_agents)
    hits = jax.ops.segment_sum((valid & (jnp.asarray(rewards) > 0)).astype(jnp.float32), seg, num_agents + 1)
    counts = jax.ops.segment_sum(valid.astype(jnp.float32), seg, num_agents + 1)
    return (hits / jnp.maximum(counts, 1.0))[:num_agents]


# ---------------------------------------------------------------- per-sample math (device)


def capability_ratio(capability: jax.Array, *, omega_min: float = 0.1, omega_max: float = 10.0) -> jax.Array:
    """omega f32[n, n] with omega[k, j] = clip(P^k / P^j, omega_min, omega_max) from P f32[n].

    P^j = 0 gives omega_max when P^k > 0 and 1 when both are 0.
    """
    p = jnp.asarray(capability, jnp.float32)
    num, den = p[:, None], p[None, :]
    ratio = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, omega_max, 1.0))
    return jnp.clip(ratio, omega_min, omega_max)


def capability_advantages(
    rewards: jax.Array,
    groups: jax.Array,
    source: jax.Array,
    capability: jax.Array,
    learner: jax.Array | int,
    *,
    num_groups: int,
    omega_min: float = 0.1,
    omega_max: float = 10.0,
    max_reward: float | None = None,
    ddof: int = 1,
    eps: float = 1e-6,
) -> jax.Array:
    """Learner k's advantages f32[N] over mixed groups, from rewards f32[N], prompt groups int[N],
    source agent int[N], capabilities P f32[n] and the learner index k (int[] or int[N], may be traced).

    mu^k_g = (1/|g|) sum_{i in g} omega^{k, source_i} r_i; if mu^k_g > max reward (`max_reward`,
    or the group's highest reward when None) it is replaced by the mean of the learner's own
    samples in g (the plain group mean if it has none). A_i = (r_i - mu) / (std_g + eps);
    singleton / all-equal groups and padding rows (group -1) get 0.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    source = jnp.asarray(source, jnp.int32)
    seg, valid = _segments(groups, num_groups)
    stats = _stats(rewards, seg, valid, num_groups, ddof)
    n_seg = num_groups + 1
    omega = capability_ratio(capability, omega_min=omega_min, omega_max=omega_max)
    weight = omega[learner, jnp.clip(source, 0, omega.shape[0] - 1)]
    weighted = jax.ops.segment_sum(jnp.where(valid, weight * rewards, 0.0), seg, n_seg)
    mu = weighted / jnp.maximum(stats.count, 1.0)
    own = valid & (source == learner)
    own_count = jax.ops.segment_sum(own.astype(jnp.float32), seg, n_seg)
    own_sum = jax.ops.segment_sum(jnp.where(own, rewards, 0.0), seg, n_seg)
    own_mean = jnp.where(own_count > 0, own_sum / jnp.maximum(own_count, 1.0), stats.mean)
    ceiling = stats.max if max_reward is None else jnp.full_like(stats.max, max_reward)
    baseline = jnp.where(mu > ceiling, own_mean, mu)
    adv = (rewards - baseline[seg]) / (stats.std[seg] + eps)
    informative = valid & (stats.count[seg] >= 2) & (stats.max[seg] > stats.min[seg])
    return jnp.where(informative, adv, 0.0)


def discrepancy_coefficients(
    capability: jax.Array,
    source: jax.Array,
    learner: jax.Array | int,
    *,
    omega_min: float = 0.1,
    omega_max: float = 10.0,
) -> jax.Array:
    """omega^{source_i, k} = clip(P^source / P^k, omega_min, omega_max) per sample f32[N] (1 on self samples)."""
    omega = capability_ratio(capability, omega_min=omega_min, omega_max=omega_max)
    source = jnp.clip(jnp.asarray(source, jnp.int32), 0, omega.shape[0] - 1)
    return omega[source, learner]


def stepwise_clip_bounds(
    minibatch_index: jax.Array | int, *, delta: float = 0.2, delta_step: float = 0.025
) -> tuple[jax.Array, jax.Array]:
    """(low, high) scalars for the cross ratio at mini-batch m: (min(1 - delta + m * delta_step, 1), 1)."""
    m = jnp.asarray(minibatch_index, jnp.float32)
    return jnp.minimum(1.0 - delta + m * delta_step, 1.0), jnp.ones((), jnp.float32)


def cross_log_ratio(logprobs: jax.Array, loss_mask: jax.Array, source_seq_logprob: jax.Array) -> jax.Array:
    """clamp(mean_t lp_learner - source_seq_logprob, -20, 20) f32[N] from lp [N, T], mask [N, T], source f32[N]."""
    diff = masked_seq_mean(logprobs, loss_mask) - jnp.asarray(source_seq_logprob, jnp.float32)
    return jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def cross_ratio(
    logprobs: jax.Array,
    loss_mask: jax.Array,
    source_seq_logprob: jax.Array,
    minibatch_index: jax.Array | int,
    *,
    delta: float = 0.2,
    delta_step: float = 0.025,
    alpha: float = 1.0,
) -> jax.Array:
    """Stepwise-clipped exponential cross ratio s~ f32[N]: c * sg(c)^alpha, c = clip(s, low_m, 1).

    s = exp(mean_t lp_learner(y) - source_seq_logprob) from lp [N, T], mask [N, T], source f32[N].
    """
    s = jnp.exp(cross_log_ratio(logprobs, loss_mask, source_seq_logprob))
    low, high = stepwise_clip_bounds(minibatch_index, delta=delta, delta_step=delta_step)
    c = jnp.clip(s, low, high)
    return c * sg(c) ** alpha


# ---------------------------------------------------------------- uniform method interface


def advantages(
    cfg: HACPOConfig,
    rewards: jax.Array,
    groups: jax.Array,
    *,
    num_groups: int,
    source: jax.Array,
    capability: jax.Array,
    learner: jax.Array | int,
) -> jax.Array:
    """Learner's capability-aware advantages f32[N] (plain mean baseline if `capability_baseline` is off)."""
    if not cfg.capability_baseline:
        capability = jnp.ones_like(jnp.asarray(capability, jnp.float32))
    return capability_advantages(
        rewards,
        groups,
        source,
        capability,
        learner,
        num_groups=num_groups,
        omega_min=cfg.omega_min,
        omega_max=cfg.omega_max,
        max_reward=cfg.max_reward,
        ddof=cfg.ddof,
        eps=cfg.eps,
    )


def discrepancy(
    cfg: HACPOConfig, capability: jax.Array, source: jax.Array, learner: jax.Array | int
) -> jax.Array:
    """Per-sample weight f32[N] for the learner (all ones if `discrepancy` is off)."""
    weight = discrepancy_coefficients(
        capability, source, learner, omega_min=cfg.omega_min, omega_max=cfg.omega_max
    )
    return weight if cfg.discrepancy else jnp.ones_like(weight)


def loss(
    cfg: HACPOConfig,
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    ref_logprobs: jax.Array | None = None,
    is_cross: jax.Array | None = None,
    source_seq_logprob: jax.Array | None = None,
    discrepancy: jax.Array | None = None,
    minibatch_index: jax.Array | int = 0,
    num_tokens: jax.Array | None = None,
    num_rows: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Combined self + cross loss and metrics.

    logprobs/old_logprobs f32[N, T] (the learner's tokens), advantages f32[N], loss_mask bool[N, T],
    is_cross bool[N] (sample generated by another agent; default none), source_seq_logprob f32[N]
    (mean source log-prob at rollout; default the masked mean of old_logprobs), discrepancy
    f32[N] (omega^{j,k}; default 1), minibatch_index m (scalar). Self samples: GSPO clipped
    surrogate with ratio exp(mean_t(lp - lp_old)); cross samples: -s~ * omega * A.
    num_tokens/num_rows: the mini-batch's counts per micro-batch (`aggregate_loss`).
    """
    loss_mask = jnp.asarray(loss_mask, bool)
    adv = jnp.asarray(advantages, jnp.float32)
    n = logprobs.shape[0]
    is_cross = jnp.zeros((n,), bool) if is_cross is None else jnp.asarray(is_cross, bool)
    if source_seq_logprob is None:
        source_seq_logprob = masked_seq_mean(old_logprobs, loss_mask)
    weight = jnp.ones((n,), jnp.float32) if discrepancy is None else jnp.asarray(discrepancy, jnp.float32)

    self_log_ratio = jnp.clip(
        masked_seq_mean(logprobs - old_logprobs, loss_mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    self_ratio = jnp.exp(self_log_ratio)
    self_loss, self_clipped, _ = clipped_surrogate(
        self_ratio, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high
    )

    raw_cross = jnp.exp(cross_log_ratio(logprobs, loss_mask, source_seq_logprob))
    low, high = stepwise_clip_bounds(minibatch_index, delta=cfg.delta, delta_step=cfg.delta_step)
    if cfg.stepwise_clip:
        s_tilde = cross_ratio(
            logprobs, loss_mask, source_seq_logprob, minibatch_index,
            delta=cfg.delta, delta_step=cfg.delta_step, alpha=cfg.alpha,
        )
        cross_loss = -s_tilde * weight * adv
        cross_clipped = (raw_cross < low) | (raw_cross > high)
    else:
        cross_loss, cross_clipped, _ = clipped_surrogate(
            raw_cross, weight * adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high
        )

    per_seq = jnp.where(is_cross, cross_loss, self_loss)
    per_token = jnp.broadcast_to(per_seq[:, None], logprobs.shape)
    counts = dict(norm_length=cfg.norm_length, num_tokens=num_tokens, num_rows=num_rows)
    pg_loss = aggregate_loss(per_token, loss_mask, cfg.aggregation, **counts)
    self_mask = loss_mask & ~is_cross[:, None]
    ref_kl = jnp.zeros((), jnp.float32)
    total = pg_loss
    if ref_logprobs is not None:
        kl = jnp.where(self_mask, kl_penalty(logprobs, ref_logprobs, loss_mask, cfg.kl_kind), 0.0)
        ref_kl = masked_token_mean(kl, self_mask)
        if cfg.kl_coef != 0.0:
            total = pg_loss + cfg.kl_coef * aggregate_loss(kl, loss_mask, cfg.aggregation, **counts)

    rows = jnp.any(loss_mask, axis=-1)
    self_rows, cross_rows = rows & ~is_cross, rows & is_cross

    def row_mean(x, sel):
        return jnp.sum(jnp.where(sel, x, 0.0)) / jnp.maximum(jnp.sum(sel), 1)

    metrics = {
        "loss": total,
        "pg_loss": pg_loss,
        "clip_fraction": row_mean(self_clipped.astype(jnp.float32), self_rows),
        "cross_clip_fraction": row_mean(cross_clipped.astype(jnp.float32), cross_rows),
        "ratio_mean": row_mean(sg(self_ratio), self_rows),
        "cross_ratio_mean": row_mean(sg(raw_cross), cross_rows),
        "cross_fraction": jnp.sum(cross_rows) / jnp.maximum(jnp.sum(rows), 1),
        "approx_kl": sg(row_mean(jnp.exp(self_log_ratio) - 1.0 - self_log_ratio, self_rows)),
        "ref_kl": sg(ref_kl),
    }
    return total, metrics


# ---------------------------------------------------------------- the method value


def learner_advantages(cfg: HACPOConfig, batch: LearnerBatch, capability: jax.Array) -> jax.Array:
    """The learner's capability-aware advantages times each sample's discrepancy weight
    omega^{source, learner} (1 on self samples): f32[N]. The cross loss -s~ * omega * A (and
    the clipped form of naive sharing) only ever reads the product, so it is the advantage
    the loss receives. capability: P f32[n] (`device_state`)."""
    adv = advantages(cfg, batch.reward, batch.group, num_groups=batch.num_samples, source=batch.source_policy,
                     capability=capability, learner=batch.learner)
    return adv * discrepancy(cfg, capability, batch.source_policy, batch.learner)


def learner_loss(cfg: HACPOConfig, logprobs: jax.Array, batch: LearnerBatch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`loss` on a learner batch: cross samples are those another policy generated; m is the
    update's index within the step (`batch.update_index`)."""
    index = jnp.zeros((), jnp.int32) if batch.update_index is None else batch.update_index
    return loss(
        cfg, logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, ref_logprobs=batch.ref_logprobs,
        is_cross=batch.is_cross(), source_seq_logprob=batch.source_seq_logprob, minibatch_index=index,
        num_tokens=batch.num_tokens, num_rows=batch.num_rows,
    )


@dataclass(frozen=True)
class HACPOState:
    """HACPO's state across steps: the capability window of `num_policies` policies."""

    window: CapabilityWindow
    num_policies: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the checkpoint metadata keeps it)."""
        return {"window": self.window.to_json(), "num_policies": self.num_policies}

    @classmethod
    def from_json(cls, data: Any) -> "HACPOState":
        """The state written by `to_json`."""
        try:
            return cls(CapabilityWindow.from_json(data["window"]), int(data["num_policies"]))
        except (KeyError, TypeError, ValueError) as err:
            raise JmarlError(f"malformed HACPO state in the checkpoint metadata ({err})") from None


def init_window(cfg: HACPOConfig, context: MethodContext) -> HACPOState:
    """An empty capability window of `capability_window` steps over the run's policies."""
    return HACPOState(CapabilityWindow(size=cfg.capability_window), context.num_policies)


def shared_success(result: PlanResult) -> tuple[float, ...]:
    """The step's per-policy success rates (`SharedStats.success_rate`) of a `shared` plan
    result; raises a `JmarlError` for another plan's result."""
    if not isinstance(result.stats, SharedStats):
        raise JmarlError(
            f"HACPO reads the shared plan's per-policy success rates (SharedStats), but the plan "
            f"reported {type(result.stats).__name__}; use workflow.plan: shared"
        )
    return result.stats.success_rate


def push_success(cfg: HACPOConfig, state: HACPOState, result: PlanResult, step: int) -> tuple[HACPOState, dict[str, float]]:
    """The window with this step's per-policy success rates (the plan's `stats.success_rate`)
    pushed, before any advantage of the step; metrics hacpo/capability_<p>, hacpo/success_<p>."""
    success = shared_success(result)
    window = update_capabilities(state.window, success)
    metrics = {f"hacpo/capability_{p}": float(v) for p, v in enumerate(capabilities(window))}
    metrics.update({f"hacpo/success_{p}": float(v) for p, v in enumerate(success)})
    return HACPOState(window, state.num_policies), metrics


def window_capabilities(cfg: HACPOConfig, state: HACPOState) -> jax.Array:
    """P f32[n], what `learner_advantages` reads; equal capabilities (ones) while the window is
    empty (never during training, where the step's rates are pushed first; `jmarl.memory_check`
    compiles with it)."""
    if not state.window.history:
        return jnp.ones((state.num_policies,), jnp.float32)
    return jnp.asarray(capabilities(state.window), jnp.float32)


METHOD = Method(
    name="hacpo", config=HACPOConfig, advantages=learner_advantages, loss=learner_loss,
    default_plan="shared", default_group_size=8, plans=("shared",),
    init_state=init_window, after_plan=push_success, device_state=window_capabilities,
    state_to_json=HACPOState.to_json, state_from_json=lambda cfg, data: HACPOState.from_json(data),
)
