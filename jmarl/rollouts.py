"""The `Rollouts` pytree: the one structure that crosses from the host layer to the device layer.

N samples, each one (prompt, completion) pair that one agent produced at one node of one
episode. The learner lays each policy group's rows out as packed `LearnerBatch`es
(`jmarl.train.learner`), which is what a method's advantages and loss read; nothing past this
point parses text.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jmarl.errors import JmarlError
from jmarl.padding import as_routing, no_route

_INT_FIELDS = ("group", "env", "turn", "agent", "policy", "source_policy")


@struct.dataclass
class Rollouts:
    """N samples of prompt + completion tokens with their bookkeeping (see docs/architecture.md).

    tokens int32[N, T], loss_mask bool[N, T] (completion tokens trained on),
    attention_mask bool[N, T] (real tokens), behavior_logprobs f32[N, T] (log-prob of each
    token under the sampling policy; 0 outside the completion), reward f32[N], group int32[N],
    env/turn/agent int32[N], policy int32[N] (the learner), source_policy int32[N] (the
    generator), source_seq_logprob f32[N] (mean completion-token log-prob under the source),
    routing uint8/uint16[N, T, W] or None (routing replay: each token's recorded expert ids, the
    S x k of its sampler's sparse layers flattened, W the widest of the batch; the marker
    `jmarl.models.moe.no_route` of the dtype where a token has none, padding included).
    """

    tokens: jax.Array
    loss_mask: jax.Array
    attention_mask: jax.Array
    behavior_logprobs: jax.Array
    reward: jax.Array
    group: jax.Array
    env: jax.Array
    turn: jax.Array
    agent: jax.Array
    policy: jax.Array
    source_policy: jax.Array
    source_seq_logprob: jax.Array
    routing: jax.Array | None = None

    @property
    def num_samples(self) -> int:
        """N."""
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """T."""
        return int(self.tokens.shape[1])


def make_rollouts(
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    attention_mask: np.ndarray,
    reward: np.ndarray,
    group: np.ndarray,
    *,
    behavior_logprobs: np.ndarray | None = None,
    env: np.ndarray | None = None,
    turn: np.ndarray | None = None,
    agent: np.ndarray | None = None,
    policy: np.ndarray | None = None,
    source_policy: np.ndarray | None = None,
    source_seq_logprob: np.ndarray | None = None,
    routing: np.ndarray | None = None,
) -> Rollouts:
    """Builds validated `Rollouts` from host arrays; omitted bookkeeping fields default to 0.

    tokens/loss_mask/attention_mask/behavior_logprobs are [N, T]; routing (optional) [N, T, W]
    unsigned ids; every other field is [N]. `source_policy` defaults to `policy`;
    `source_seq_logprob` defaults to the masked mean of `behavior_logprobs`.
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2:
        raise JmarlError(f"Rollouts.tokens must be [N, T], got shape {tokens.shape}")
    n, t = tokens.shape

    def per_token(name: str, value, dtype) -> np.ndarray:
        arr = np.zeros((n, t), dtype) if value is None else np.asarray(value, dtype)
        if arr.shape != (n, t):
            raise JmarlError(f"Rollouts.{name} must have shape {(n, t)}, got {arr.shape}")
        return arr

    def per_sample(name: str, value, dtype) -> np.ndarray:
        arr = np.zeros((n,), dtype) if value is None else np.asarray(value, dtype)
        if arr.shape != (n,):
            raise JmarlError(f"Rollouts.{name} must have shape {(n,)}, got {arr.shape}")
        return arr

    loss_mask = per_token("loss_mask", loss_mask, bool)
    attention_mask = per_token("attention_mask", attention_mask, bool)
    if np.any(loss_mask & ~attention_mask):
        raise JmarlError("Rollouts.loss_mask is True on a padding token (attention_mask False)")
    behavior = per_token("behavior_logprobs", behavior_logprobs, np.float32)
    policy_arr = per_sample("policy", policy, np.int32)
    if routing is not None:
        routing = np.asarray(routing)
        if routing.ndim != 3 or routing.shape[:2] != (n, t) or routing.dtype.kind != "u":
            raise JmarlError(f"Rollouts.routing must be unsigned ids of shape {(n, t)} + (W,), got "
                             f"{routing.dtype} {routing.shape}")
    if source_seq_logprob is None:
        counts = np.maximum(loss_mask.sum(axis=1), 1)
        source_seq_logprob = (behavior * loss_mask).sum(axis=1) / counts
    return Rollouts(
        tokens=tokens,
        loss_mask=loss_mask,
        attention_mask=attention_mask,
        behavior_logprobs=behavior,
        reward=per_sample("reward", reward, np.float32),
        group=per_sample("group", group, np.int32),
        env=per_sample("env", env, np.int32),
        turn=per_sample("turn", turn, np.int32),
        agent=per_sample("agent", agent, np.int32),
        policy=policy_arr,
        source_policy=per_sample(
            "source_policy", policy_arr if source_policy is None else source_policy, np.int32
        ),
        source_seq_logprob=per_sample("source_seq_logprob", source_seq_logprob, np.float32),
        routing=routing,
    )


def pad_to(rollouts: Rollouts, *, num_samples: int | None = None, seq_len: int | None = None) -> Rollouts:
    """Pads to [num_samples, seq_len]: padding rows have empty masks, reward 0, group -1.

    Padding tokens are 0, masks False, log-probs 0. Group -1 marks a row that belongs to no
    group, so advantage functions give it 0.
    """
    n, t = rollouts.num_samples, rollouts.seq_len
    n2 = n if num_samples is None else num_samples
    t2 = t if seq_len is None else seq_len
    if n2 < n or t2 < t:
        raise JmarlError(f"cannot pad Rollouts of shape {(n, t)} down to {(n2, t2)}")

    def pad(x: jax.Array, fill) -> jax.Array:
        x = np.asarray(x)
        widths = [(0, n2 - n)] + ([(0, t2 - t)] if x.ndim >= 2 else []) + [(0, 0)] * max(x.ndim - 2, 0)
        return np.pad(x, widths, constant_values=fill)

    def fill(f: str) -> int:  # padding rows' value of field f
        return -1 if f == "group" else no_route(rollouts.routing.dtype) if f == "routing" else 0

    fields = {f: None if getattr(rollouts, f) is None else pad(getattr(rollouts, f), fill(f)) for f in _field_names()}
    return Rollouts(**fields)


def concat(parts: Sequence[Rollouts]) -> Rollouts:
    """Concatenates along N, right-padding every part to the longest T first."""
    if not parts:
        raise JmarlError("concat needs at least one Rollouts")
    t = max(p.seq_len for p in parts)
    parts = [pad_to(p, seq_len=t) for p in parts]
    routing = None
    if any(p.routing is not None for p in parts):  # one routing array: the widest, the others padded
        routing = np.concatenate([np.asarray(r) for r in as_routing(
            [None if p.routing is None else np.asarray(p.routing) for p in parts], [(p.num_samples, t) for p in parts])])
    return Rollouts(
        **{f: np.concatenate([np.asarray(getattr(p, f)) for p in parts]) for f in _field_names() if f != "routing"},
        routing=routing,
    )


def select(rollouts: Rollouts, index: np.ndarray) -> Rollouts:
    """The samples at `index` (int[M] or bool[N]), in that order."""
    return jax.tree.map(lambda x: x[index], rollouts)


def to_device(rollouts: Rollouts, sharding: jax.sharding.Sharding | None = None) -> Rollouts:
    """Moves every field to the device (optionally with a sharding on the leading axis)."""
    if sharding is None:
        return jax.tree.map(jnp.asarray, rollouts)
    return jax.device_put(rollouts, sharding)


def to_host(rollouts: Rollouts) -> Rollouts:
    """Copies every field to host NumPy arrays."""
    return jax.tree.map(np.asarray, jax.device_get(rollouts))


def _field_names() -> tuple[str, ...]:
    return tuple(f for f in Rollouts.__dataclass_fields__)
