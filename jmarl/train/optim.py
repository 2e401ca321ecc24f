"""Optimizer construction: AdamW with warm-up, a decay schedule and global-norm clipping."""

from __future__ import annotations

from typing import Literal

import optax

from jmarl.errors import JmarlError


def learning_rate_schedule(
    lr: float,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: Literal["constant", "cosine", "linear"] = "constant",
) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then constant, cosine or linear decay to 0."""
    if lr < 0:
        raise JmarlError(f"optim.lr must be >= 0, got {lr}")
    decay_steps = max(total_steps - warmup_steps, 1)
    if schedule == "constant":
        after = optax.constant_schedule(lr)
    elif schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps)
    elif schedule == "linear":
        after = optax.linear_schedule(lr, 0.0, decay_steps)
    else:
        raise JmarlError(f"optim.schedule must be constant, cosine or linear, got {schedule!r}")
    if warmup_steps <= 0:
        return after
    warmup = optax.linear_schedule(0.0, lr, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def make_optimizer(
    lr: float,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: Literal["constant", "cosine", "linear"] = "constant",
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    grad_clip: float | None = 1.0,
) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) behind optional global-norm gradient clipping."""
    sched = learning_rate_schedule(
        lr, total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule
    )
    adamw = optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if grad_clip is None or grad_clip <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)
