"""What a generation call is asked and what it returns, the same for both engines.

`GenerationSpec`: the settings of a call that stay the same from call to call, taken by the
static sampler (`jmarl.models.generation.static.generate` / `generate_stacked`) and by the
continuous engine (`jmarl.models.generation.engine.run` / `start`); its options are checked once,
when it is made (`check_options`). The per-call data (prompts, completions per prompt, key,
per-request limits, policy) are the calls' arguments.

Results: `Generation` (the static sampler's [..., B, N] arrays), `EngineResult` and `EngineStats`
(the engine's completions per request and its counters).

Log-probs (both engines): every sampled token's log-prob is under softmax(logits / temperature)
BEFORE top-k/top-p truncation, i.e. exactly what `jmarl.models.token_logprobs(...,
temperature=T)` gives when re-scoring the same tokens. That is the behaviour-policy probability
the importance ratio pi_new / pi_old needs: the learner scores tokens without truncation, so the
samplers report the same quantity. With temperature 0 (greedy, argmax) the log-probs are taken
under temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import numpy as np
from flax import struct

from jmarl.errors import JmarlError
from jmarl.padding import DEFAULT_LENGTH_BUCKETS

DEFAULT_CHUNK_STEPS = 8  # the engine's decode steps between two refills of its slots


def check_options(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    """Raises JmarlError unless max_new_tokens >= 1, temperature >= 0 (0: greedy), top_p in
    (0, 1] (1: off) and top_k >= 0 (0: off)."""
    if int(max_new_tokens) < 1:
        raise JmarlError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise JmarlError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise JmarlError(f"top_p must be in (0, 1], got {top_p}")
    if int(top_k) < 0:
        raise JmarlError(f"top_k must be >= 0 (0 = off), got {top_k}")


@struct.dataclass
class Generation:
    """The static sampler's completions (`static.generate` / `generate_stacked`). tokens
    int32[..., B, N] (pad_id after a stop), logprobs float32[..., B, N] (0 where masked), mask
    bool[..., B, N] (True up to and including the stop token), lengths int32[..., B] (number of
    True in mask).

    Routing replay (`ModelConfig.replays_routing`; None otherwise: nothing is recorded): the
    experts each token ran in each of the S sparse layers, ids in `moe.routing_dtype`:
    routing [..., B, N, S, k] of the generated tokens (token i's as the decode step that read
    it ran them; the marker `moe.no_route` where none did: a row's last token, which no step
    reads, and the slots after it), prompt_routing [..., U, S_p, S, k] of the U prefilled
    prompts (left-aligned to S_p slots, real tokens last, as the static sampler lays them out) and
    prompt_row int32[..., B], the prompt of each row."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array
    routing: jax.Array | None = None
    prompt_routing: jax.Array | None = None
    prompt_row: jax.Array | None = None


@dataclass
class EngineStats:
    """Counters of one or more engine runs."""

    rows: int = 0  # completions served
    slot_steps: int = 0  # S x decode steps run
    busy_slot_steps: int = 0  # slot-steps of a slot still generating
    chunks: int = 0  # decode calls that ran at least one step (a fused run's drain included)
    grouped_chunks: int = 0  # of them, those whose slots read their prompts in groups (`decode_slots`'s group_size)
    fused: int = 0  # runs served by one program (`fused_program`): every completion fit the slots at once
    prefills: int = 0  # prefill calls (a fused run's included)
    prompts_prefilled: int = 0  # pool entries filled (a request served on several devices: once per device)
    requests: int = 0
    queue_wait_chunks: int = 0  # sum over requests of the chunks run before its first completion started
    entry_waits: int = 0  # refills that left slots free because no pool entry was
    slots: int = 0  # S of the last run
    entries: int = 0  # Q of the last run
    slots_per_device: int = 0  # slots each device holds (the cache's shard along the slot axis), largest seen

    def add(self, other: "EngineStats") -> None:
        for name in ("rows", "slot_steps", "busy_slot_steps", "chunks", "grouped_chunks", "fused", "prefills",
                     "prompts_prefilled", "requests", "queue_wait_chunks", "entry_waits"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.slots = other.slots
        self.entries = other.entries
        self.slots_per_device = other.slots_per_device


@dataclass
class EngineResult:
    """completions[r][j] = (tokens int32[L], logprobs float32[L]) of completion j of request r."""

    completions: list[list[tuple[np.ndarray, np.ndarray]]]
    stats: EngineStats = field(default_factory=EngineStats)


@dataclass(frozen=True)
class GenerationSpec:
    """How a generation call decodes, for either engine. Made once per run (the trainer builds it
    from the run's `sampling` section, `jmarl.train.sampling.generation_spec`); its sampling
    options are checked when it is made (`check_options`: JmarlError).

    Sampling (both engines):
      max_new_tokens   N, the most tokens a completion generates (>= 1; an engine request's
                       `limits` entry may lower it); also the engine slots' cache capacity
                       G = max(N - 1, 1).
      temperature      softmax temperature (>= 0; 0: greedy argmax, log-probs under
                       temperature 1). Default 1.0.
      top_p            nucleus mass kept before sampling, in (0, 1] (1: off). Default 1.0.
      top_k            the most likely tokens kept before sampling (0: off). Default 0.
      stop_tokens      token ids that end a completion (the stop token is kept). Default ().
      pad_id           token id of the prompts' left padding and of the programs' unused
                       output positions. Default 0.
      buckets          prompt-length buckets (tokens): the prompts are left-padded to the
                       bucket of the longest one (`jmarl.padding.bucket_length`).
    Placement (both engines):
      mesh             a `jax.sharding.Mesh` (None: one device): rows (static) or slots and
                       pool entries (engine) are sharded over its batch axes, cache heads over
                       tensor (`jmarl.models.generation.layout`); the engine's budget is per
                       device. Parameters are used as the caller placed them.
    Capacity (the continuous engine only; the static sampler ignores them):
      kv_budget_bytes  bytes per device for the slots' and the pool's KV caches
                       (`budget.slots_for_budget`; None: `budget.default_kv_budget`, a quarter of
                       the device's memory limit, 1 GiB on CPU). Also caps a prefill call
                       (`budget.prefill_prompts`).
      num_slots        S, slots in all (over the mesh's row devices); None: the most the budget
                       holds (`budget.plan_slots`).
      num_entries      Q, prompt-pool entries in all; None: `budget.entries_for` the slots.
      max_slots        the most slots, rounded down to a power of two (`sampling.max_rows_per_call`:
                       rows in flight; the queue is not split). None: no cap.
      max_prefill      the most prompts one prefill call runs (None: `budget.prefill_prompts` of
                       the budget; a larger refill runs several calls).
      chunk_steps      K, decode steps per program call between two refills of the slots.
                       Default `DEFAULT_CHUNK_STEPS`.
      shrink           once the queue is empty and at most a quarter of the slots are busy,
                       move the busy rows to a state of fewer slots (per device: next_pow2 of
                       its busiest part), so a run's long tail decodes only a few rows per step.

    stop_tokens and buckets are kept as tuples of ints (the spec is hashable)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: Sequence[int] = ()
    pad_id: int = 0
    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS
    mesh: Any = None
    kv_budget_bytes: int | None = None
    num_slots: int | None = None
    num_entries: int | None = None
    max_slots: int | None = None
    max_prefill: int | None = None
    chunk_steps: int = DEFAULT_CHUNK_STEPS
    shrink: bool = True

    def __post_init__(self) -> None:
        check_options(self.max_new_tokens, self.temperature, self.top_p, self.top_k)
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0

    def program_sampling(self) -> tuple[bool, int, bool, tuple[int, ...]]:
        """(greedy, top_k, use_top_p, stop_tokens): the sampling settings the programs are
        compiled for (temperature and top_p themselves are traced arguments)."""
        return bool(self.greedy), int(self.top_k), float(self.top_p) < 1.0, self.stop_tokens
