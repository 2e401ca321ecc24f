"""GRPO (single-agent baseline): group-normalised advantages + token-ratio clipped surrogate.

Also the base of the other single-agent presets (`dr_grpo`, `dapo`, `gspo`), which change only
defaults. The uniform method interface (every method module has it):
`Config`, `advantages(cfg, rewards, groups, *, num_groups, ...)`,
`keep_mask(cfg, rewards, groups, *, num_groups)` and
`loss(cfg, logprobs, old_logprobs, advantages, loss_mask, *, ref_logprobs=None, ...)`.
"""

from dataclasses import dataclass
from typing import Any

import jax

from jmarl.algos import _checks
from jmarl.algos.advantages import BASELINES, NORMALIZERS, filter_groups, group_advantages
from jmarl.algos.losses import AGGREGATIONS, KL_KINDS, RATIOS, policy_loss


def validate_policy_fields(cfg: Any) -> None:
    """Checks the advantage / ratio / clip / aggregation / KL / filter fields a config has."""
    has = lambda name: hasattr(cfg, name)  # noqa: E731
    if has("num_generations"):
        _checks.check_int(cfg, "num_generations", low=1)
    for name, allowed in (
        ("baseline", BASELINES),
        ("normalize", NORMALIZERS),
        ("ratio", RATIOS),
        ("aggregation", AGGREGATIONS),
        ("kl_kind", KL_KINDS),
    ):
        if has(name):
            _checks.check_choice(cfg, name, allowed)
    if has("ddof"):
        _checks.check_int(cfg, "ddof", low=0)
    if has("eps"):
        _checks.check_range(cfg, "eps", low=0.0, low_inclusive=False)
    if has("clip_high"):
        _checks.check_range(cfg, "clip_high", low=0.0)
    if has("clip_low"):
        _checks.check_range(cfg, "clip_low", low=0.0, high=1.0, high_inclusive=False)
    if has("dual_clip"):
        _checks.check_range(cfg, "dual_clip", low=1.0, low_inclusive=False, allow_none=True)
    if has("norm_length"):
        _checks.check_int(cfg, "norm_length", low=1, allow_none=True)
    if has("kl_coef"):
        _checks.check_range(cfg, "kl_coef", low=0.0)
    if has("drop_zero_variance"):
        _checks.check_bool(cfg, "drop_zero_variance")
    for name in ("drop_low_variance_frac", "drop_low_mean_frac"):
        if has(name):
            _checks.check_range(cfg, name, low=0.0, high=1.0)


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO defaults: token ratio, clip 0.2/0.2, std-normalised mean baseline, seq_mean_token_mean, no KL."""

    num_generations: int = 8
    baseline: str = "mean"
    normalize: str = "std"
    ddof: int = 1
    eps: float = 1e-6
    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: str = "seq_mean_token_mean"
    norm_length: int | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    drop_zero_variance: bool = False
    drop_low_variance_frac: float = 0.0
    drop_low_mean_frac: float = 0.0

    def __post_init__(self) -> None:
        validate_policy_fields(self)


Config = GRPOConfig


def advantages(cfg: GRPOConfig, rewards: jax.Array, groups: jax.Array, *, num_groups: int) -> jax.Array:
    """Group advantages f32[N] from rewards f32[N], group ids int[N] (-1 = padding)."""
    return group_advantages(
        rewards,
        groups,
        num_groups=num_groups,
        baseline=cfg.baseline,
        normalize=cfg.normalize,
        ddof=cfg.ddof,
        eps=cfg.eps,
    )


def keep_mask(cfg: GRPOConfig, rewards: jax.Array, groups: jax.Array, *, num_groups: int) -> jax.Array:
    """Samples that survive the configured group filters: bool[N] (AND it into the loss mask)."""
    return filter_groups(
        rewards,
        groups,
        num_groups=num_groups,
        drop_zero_variance=cfg.drop_zero_variance,
        drop_low_variance_frac=cfg.drop_low_variance_frac,
        drop_low_mean_frac=cfg.drop_low_mean_frac,
        ddof=cfg.ddof,
    )


def loss(
    cfg: GRPOConfig,
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    ref_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar loss and metrics from log-probs f32[N, T], advantages f32[N] (or [N, T]), mask bool[N, T]."""
    return policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        ratio=cfg.ratio,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        aggregation=cfg.aggregation,
        norm_length=cfg.norm_length,
        ref_logprobs=ref_logprobs,
        kl_coef=cfg.kl_coef,
        kl_kind=cfg.kl_kind,
    )
