"""Importance ratios, the clipped surrogate, KL penalties and loss aggregation (docs/algorithms.md section 1).

All per-token arrays are [N, T] with a bool loss mask [N, T] that selects completion tokens;
values outside the mask never reach a result (they may even be inf/nan). Rows whose mask is
empty (padding rows) are left out of every mean, so padding a batch does not change the loss.
Every function is `jax.jit`- and `jax.vmap`-able (vmap over a leading policy axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmarl.errors import JmarlError

RATIOS = ("token", "sequence", "sequence_token", "none")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_sum")
KL_KINDS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0

sg = jax.lax.stop_gradient


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise JmarlError(f"{name}={value!r} is not supported; choose one of {allowed}")


def masked_seq_mean(values: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Mean over the masked tokens of each row: values [N, T], mask [N, T] -> [N] (0 for empty rows)."""
    total = jnp.sum(jnp.where(loss_mask, values, 0.0), axis=-1)
    return total / jnp.maximum(jnp.sum(loss_mask, axis=-1), 1)


def masked_token_mean(values: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Mean over all masked tokens: [N, T], [N, T] -> scalar (0 if the mask is empty)."""
    return jnp.sum(jnp.where(loss_mask, values, 0.0)) / jnp.maximum(jnp.sum(loss_mask), 1)


def token_log_ratio(logprobs: jax.Array, old_logprobs: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """clamp(lp - lp_old, -20, 20) on masked tokens, 0 elsewhere: [N, T]."""
    diff = jnp.where(loss_mask, logprobs - old_logprobs, 0.0)
    return jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_ratio(
    logprobs: jax.Array, old_logprobs: jax.Array, loss_mask: jax.Array, kind: str = "token"
) -> jax.Array:
    """Importance ratio broadcast to tokens: f32[N, T] from log-probs [N, T] and mask [N, T].

    "token": exp(clamp(lp - lp_old, -20, 20)); "sequence" (GSPO): exp(mean_t(lp - lp_old)) per
    row, gradient through the mean; "sequence_token" (GSPO-token): sg[s_i] * exp(lp - sg[lp]);
    "none" (on-policy REINFORCE): exp(lp - sg[lp]), value 1 and gradient 1 per token.
    """
    _check("ratio", kind, RATIOS)
    if kind == "token":
        return jnp.exp(token_log_ratio(logprobs, old_logprobs, loss_mask))
    if kind == "none":
        return jnp.exp(jnp.where(loss_mask, logprobs - sg(logprobs), 0.0))
    seq_log_ratio = jnp.clip(
        masked_seq_mean(logprobs - old_logprobs, loss_mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    seq_ratio = jnp.exp(seq_log_ratio)[:, None]
    if kind == "sequence":
        return jnp.broadcast_to(seq_ratio, logprobs.shape)
    return sg(seq_ratio) * jnp.exp(jnp.where(loss_mask, logprobs - sg(logprobs), 0.0))


def clipped_surrogate(
    ratio: jax.Array,
    advantages: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO surrogate per token: (loss [N, T], clipped bool[N, T], dual_clipped bool[N, T]).

    loss = max(-rho*A, -clip(rho, 1-clip_low, 1+clip_high)*A); with `dual_clip` c > 1 the loss of
    negative-advantage tokens is further capped at -c*A. Where a clip is active the loss is a
    constant of the log-probs, so its gradient is exactly 0. `advantages` broadcasts against
    `ratio` (pass [N, 1] or [N, T]).
    """
    unclipped = -ratio * advantages
    clipped_value = sg(-jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages)
    clipped = clipped_value > unclipped
    loss = jnp.where(clipped, clipped_value, unclipped)
    if dual_clip is None:
        dual = jnp.zeros_like(clipped)
    else:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = jnp.where(dual, sg(cap), loss)
    return loss, clipped & ~dual, dual


def kl_penalty(
    logprobs: jax.Array, ref_logprobs: jax.Array, loss_mask: jax.Array, kind: str = "k3"
) -> jax.Array:
    """Per-token KL estimate to the reference policy f32[N, T] (0 outside the mask).

    k1 = lp - lp_ref; k2 = (lp - lp_ref)^2 / 2; k3 = exp(d) - d - 1 with d = clamp(lp_ref - lp, -20, 20).
    """
    _check("kl_kind", kind, KL_KINDS)
    diff = jnp.where(loss_mask, logprobs - ref_logprobs, 0.0)
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * jnp.square(diff)
    d = jnp.clip(-diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.where(loss_mask, jnp.exp(d) - d - 1.0, 0.0)


def _nonzero(count: jax.Array) -> jax.Array:
    """count where it is > 0, else 1 (an empty batch's loss is 0, not NaN); float32[]."""
    count = jnp.asarray(count, jnp.float32)
    return jnp.where(count > 0, count, 1.0)


def aggregate_loss(
    per_token: jax.Array,
    loss_mask: jax.Array,
    aggregation: str,
    *,
    norm_length: int | None = None,
    num_tokens: jax.Array | None = None,
    num_rows: jax.Array | None = None,
) -> jax.Array:
    """Reduces per-token losses [N, T] under mask [N, T] to a scalar.

    token_mean: sum(L*m) / n_tok; seq_mean_token_mean: sum_i(sum_t(L*m) / sum_t(m)) / n_rows;
    seq_mean_token_sum_norm (Dr.GRPO): sum(L*m) / (n_rows * norm_length), norm_length defaults
    to T; seq_sum: sum_i sum_t(L*m) / n_rows. n_tok and n_rows count the masked tokens and the
    rows with a non-empty mask of this batch, unless `num_tokens` / `num_rows` give them: under
    gradient accumulation the update passes the whole mini-batch's counts divided by the number
    of micro-batches, so the mean of the micro-batch losses is the mini-batch's exact mean.
    """
    _check("aggregation", aggregation, AGGREGATIONS)
    masked = jnp.where(loss_mask, per_token, 0.0)
    rows = jnp.sum(jnp.any(loss_mask, axis=-1)) if num_rows is None else num_rows
    rows = _nonzero(rows)
    if aggregation == "token_mean":
        tokens = jnp.sum(loss_mask) if num_tokens is None else num_tokens
        return jnp.sum(masked) / _nonzero(tokens)
    if aggregation == "seq_mean_token_mean":
        return jnp.sum(masked_seq_mean(per_token, loss_mask)) / rows
    if aggregation == "seq_mean_token_sum_norm":
        length = per_token.shape[-1] if norm_length is None else norm_length
        return jnp.sum(masked) / (rows * length)
    return jnp.sum(masked) / rows


def _per_token_advantages(advantages: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    advantages = jnp.asarray(advantages, jnp.float32)
    if advantages.ndim == len(shape) - 1:
        advantages = advantages[..., None]
    return jnp.broadcast_to(advantages, shape)


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    ratio: str = "token",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    norm_length: int | None = None,
    ref_logprobs: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    num_tokens: jax.Array | None = None,
    num_rows: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped policy-gradient loss: (scalar, metrics) from log-probs [N, T], advantages [N] or [N, T].

    Per token: clipped surrogate of `importance_ratio(kind=ratio)` (no clipping for ratio="none",
    which gives the on-policy -A * lp gradient; with aggregation="seq_sum" that is MAGRPO's
    -A * sum_t lp), plus kl_coef * kl_penalty(kl_kind) when `ref_logprobs` is given, reduced by
    `aggregate_loss` (with the mini-batch's counts `num_tokens` / `num_rows` when given). Metrics (scalars): loss, pg_loss, clip_fraction, dual_clip_fraction,
    ratio_mean, approx_kl (k3 estimate of KL(old || current) over masked tokens), ref_kl.
    """
    _check("ratio", ratio, RATIOS)
    loss_mask = jnp.asarray(loss_mask, bool)
    adv = _per_token_advantages(advantages, logprobs.shape)
    rho = importance_ratio(logprobs, old_logprobs, loss_mask, ratio)
    if ratio == "none":
        per_token = -rho * adv
        clipped = dual = jnp.zeros(logprobs.shape, bool)
    else:
        per_token, clipped, dual = clipped_surrogate(
            rho, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
        )
    counts = dict(norm_length=norm_length, num_tokens=num_tokens, num_rows=num_rows)
    pg_loss = aggregate_loss(per_token, loss_mask, aggregation, **counts)
    ref_kl = jnp.zeros((), jnp.float32)
    total = pg_loss
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, loss_mask, kl_kind)
        ref_kl = masked_token_mean(kl, loss_mask)
        if kl_coef != 0.0:
            total = pg_loss + kl_coef * aggregate_loss(kl, loss_mask, aggregation, **counts)
    log_ratio = token_log_ratio(logprobs, old_logprobs, loss_mask)
    metrics = {
        "loss": total,
        "pg_loss": pg_loss,
        "clip_fraction": masked_token_mean(clipped.astype(jnp.float32), loss_mask),
        "dual_clip_fraction": masked_token_mean(dual.astype(jnp.float32), loss_mask),
        "ratio_mean": masked_token_mean(sg(rho), loss_mask),
        "approx_kl": sg(masked_token_mean(jnp.exp(log_ratio) - 1.0 - log_ratio, loss_mask)),
        "ref_kl": sg(ref_kl),
    }
    return total, metrics
