"""The continuous engine's memory budget: how many slots and prompt-pool entries a run gets.

The budget (bytes per device): a slot costs `slot_bytes` (layers x 2 x kv_heads x head_dim x G x
dtype bytes, G = max(N - 1, 1) the positions of its generated tokens, N = max_new_tokens), a pool
entry `entry_bytes` (the same for P tokens, P the prompt bucket, plus its float32 logits); both
caches are windowed (`jmarl.models.kv_cache`): a sliding-window layer counts min(G, W) and
min(P, W) tokens, the window it keeps (its slot's ring, its entry's last prompt slots). With
requests of n completions each, Q = `entries_for`(S, n) = min(S, ceil(2 S / n)): room for twice
the requests the slots can serve at once. The engine runs S = the largest power of two whose
slots and entries fit `kv_budget_bytes` (no more than the rows asked for, rounded up to a power
of two). A call whose single slot and entry do not fit is refused. One prefill call runs at most
`prefill_prompts` prompts, whose keys/values fit a quarter of the budget: a larger refill runs
several calls.

`planned_slots` / `planned_prefill` give what a run with a `GenerationSpec` picks, for the
memory planner (`jmarl.train.programs`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jmarl.errors import JmarlError
from jmarl.models.config import ModelConfig
from jmarl.models.generation.layout import make_layout, row_devices
from jmarl.models.generation.spec import GenerationSpec
from jmarl.models.kv_cache import layer_capacities
from jmarl.padding import next_pow2

CPU_DEFAULT_KV_BUDGET = 1 << 30  # 1 GiB when the device reports no memory limit (CPU)
DEVICE_KV_FRACTION = 0.25  # of the device's memory limit, when it reports one
PREFILL_BUDGET_SHARE = 4  # one prefill call's prompts hold at most 1/4 of the KV budget in keys/values


def kv_bytes(config: ModelConfig, tokens: int, windowed: bool = False) -> int:
    """KV-cache bytes of one row of `tokens` tokens: 2 x kv_heads x head_dim x dtype bytes x the
    slots of each layer, `tokens` (layers x `tokens` in all) or with `windowed` min(tokens, W)
    on the sliding-window layers (`jmarl.models.kv_cache.layer_capacities`)."""
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    return 2 * config.num_kv_heads * config.head_dim * itemsize * sum(layer_capacities(config, tokens, windowed))


def generated_capacity(max_new_tokens: int) -> int:
    """G: the cache positions of a slot's own tokens (the last sampled token is never written)."""
    return max(int(max_new_tokens) - 1, 1)


def slot_bytes(config: ModelConfig, max_new_tokens: int) -> int:
    """Bytes of one slot: the KV cache of its G generated tokens (windowed: at most W of them
    on the sliding-window layers)."""
    return kv_bytes(config, generated_capacity(max_new_tokens), windowed=True)


def entry_bytes(config: ModelConfig, prompt_len: int) -> int:
    """Bytes of one pool entry: the KV cache of a prompt of `prompt_len` tokens (windowed: its
    last W on the sliding-window layers) and its float32 next-token logits."""
    return kv_bytes(config, prompt_len, windowed=True) + 4 * config.vocab_size


def entries_for(slots: int, share: int) -> int:
    """Q for `slots` slots when every request asks `share` completions: min(slots, ceil(2 x slots
    / share)), room for twice the requests the slots serve at once (a request whose siblings
    ended keeps its entry while its last completion decodes)."""
    return max(1, min(int(slots), -(-2 * int(slots) // max(int(share), 1))))


def engine_bytes(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int) -> int:
    """Bytes of `slots` slots and `entries` pool entries."""
    return slots * slot_bytes(config, max_new_tokens) + entries * entry_bytes(config, prompt_len)


def default_kv_budget(device: Any = None) -> int:
    """Bytes per device for the KV cache when `sampling.kv_budget_bytes` is None: a quarter of
    the device's memory limit when it reports one (accelerators), else 1 GiB (CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    limit = stats.get("bytes_limit")
    return int(limit * DEVICE_KV_FRACTION) if limit else CPU_DEFAULT_KV_BUDGET


def slots_for_budget(config: ModelConfig, prompt_len: int, max_new_tokens: int, budget: int, rows: int,
                     share: int = 1) -> tuple[int, int]:
    """(S, Q): S the largest power of two whose slots and `entries_for`(S, share) entries fit
    `budget` bytes, and no more than next_pow2(rows). Raises JmarlError when not even one slot
    and one entry fit."""
    need = engine_bytes(config, 1, 1, prompt_len, max_new_tokens)
    if need > budget:
        raise JmarlError(
            f"one generation row needs {need} bytes of KV cache ({prompt_len} prompt tokens, {max_new_tokens} new "
            f"tokens) but sampling.kv_budget_bytes is {budget}: raise sampling.kv_budget_bytes or lower "
            "sampling.max_prompt_len / sampling.max_new_tokens"
        )
    slots, most = 1, next_pow2(max(int(rows), 1))
    while slots < most and engine_bytes(config, 2 * slots, entries_for(2 * slots, share), prompt_len,
                                        max_new_tokens) <= budget:
        slots *= 2
    return slots, entries_for(slots, share)


def prefill_prompts(config: ModelConfig, prompt_len: int, kv_budget_bytes: int | None = None) -> int:
    """The most prompts one prefill call runs: the largest power of two whose keys/values
    (`kv_bytes` of `prompt_len` tokens each) fit a quarter of the per-device budget (None:
    `default_kv_budget`), at least 1. A prefill holds its prompts' keys/values for every layer
    until they are stored in the pool, so more prompts at once would put that much more than the
    budget on top of it; a larger refill runs several prefill calls."""
    budget = default_kv_budget() if kv_budget_bytes is None else int(kv_budget_bytes)
    fit = budget // (PREFILL_BUDGET_SHARE * kv_bytes(config, prompt_len))
    return 1 << (max(int(fit), 1).bit_length() - 1)


def planned_prefill(config: ModelConfig, prompt_len: int, spec: GenerationSpec) -> int:
    """The most prompts one prefill call of `engine.run` runs: `spec.max_prefill` (at least 1), else
    `prefill_prompts` of the spec's budget."""
    if spec.max_prefill is not None:
        return max(int(spec.max_prefill), 1)
    return prefill_prompts(config, prompt_len, spec.kv_budget_bytes)


def plan_slots(config: ModelConfig, prompt_len: int, max_new_tokens: int, rows: int, share: int, row_devices: int,
               kv_budget_bytes: int | None = None, num_slots: int | None = None, num_entries: int | None = None,
               max_slots: int | None = None) -> tuple[int, int]:
    """(S, Q), slots and pool entries of a run of `rows` completions of requests asking `share`
    each, over `row_devices` devices (both multiples of it): `num_slots` if given, else from
    the per-device `kv_budget_bytes` (None: `default_kv_budget`; see `slots_for_budget`); then
    at most `max_slots` (rounded down to a power of two); Q = `num_entries` if given, else
    `entries_for` the slots of one device."""
    d = int(row_devices)
    if num_slots is None:
        budget = default_kv_budget() if kv_budget_bytes is None else int(kv_budget_bytes)
        per_device, _ = slots_for_budget(config, prompt_len, max_new_tokens, budget, -(-int(rows) // d), share)
        num_slots = per_device * d
    per_device = -(-cap_slots(int(num_slots), max_slots) // d)
    entries = entries_for(per_device, share) if num_entries is None else -(-int(num_entries) // d)
    return per_device * d, max(entries, 1) * d


def group_size(config: ModelConfig, counts: Sequence[int]) -> int:
    """G of the grouped prompt layout (`engine_programs.decode_slots`): the completions per request when every
    request asks the same number, else 0 (a gather per slot). 0 for models with sliding-window
    layers: the slots of a group sit at different positions (one that stopped keeps its last),
    so each sees its own window of the shared prompt (`decode.window_block_mask`, per row),
    whereas the group attention takes one prompt mask per group."""
    if any(config.sliding_layers()) or not counts or min(counts) != max(counts):
        return 0
    return int(counts[0])


def cap_slots(slots: int, max_slots: int | None) -> int:
    """`slots`, at most `max_slots` rounded down to a power of two (None: no cap)."""
    return slots if max_slots is None else min(slots, 1 << (max(int(max_slots), 1).bit_length() - 1))


def planned_slots(config: ModelConfig, prompt_len: int, rows: int, share: int, spec: GenerationSpec) -> tuple[int, int]:
    """(S, Q) as `engine.run` with `spec` picks them for a run of `rows` completions, `share` per
    request, of prompts of `prompt_len` tokens (their bucket)."""
    layout = make_layout(config, spec.mesh)
    return plan_slots(config, prompt_len, spec.max_new_tokens, rows, share, row_devices(layout), spec.kv_budget_bytes,
                      spec.num_slots, spec.num_entries, spec.max_slots)
