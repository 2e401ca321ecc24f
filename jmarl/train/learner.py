"""The learner side of a step: `LearnerBatch`es from sample records, and a policy group's device functions.

Host side: `learner_batch` packs a step's `SampleRecord`s straight into one group's batch (each
policy's records as `packing.Samples`: a prompt and its completion as sampled, log-probs and
per-sample fields placed once, padded to N samples, a power of two times the update's parts,
in the packed layout of `jmarl.train.packing`, stacked [P, ...] for stacked policies); `sft_batch` does the same for
warm-start demonstrations. Device side, per `PolicyGroup` (jitted once, vmapped over stacked policies):
`score` (log-probs under the current policy, micro-batch by micro-batch), `score_ref`,
`prepare` (the method's advantages and keep mask) and the two updates (RL and warm start).
Nothing here branches on a method's or a plan's name: the method is a `jmarl.algos.Method`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmarl import sharding as sharding_lib
from jmarl.algos.method import Method, finite_advantages
from jmarl.batch import PACKED_FIELDS, PRED_FIELDS, SAMPLE_FIELDS, LearnerBatch
from jmarl.errors import JmarlError
from jmarl.models import moe as moe_lib
from jmarl.padding import next_pow2
from jmarl.train.lora import attach_lora
from jmarl.train.policies import PolicyGroup
from jmarl.train.packing import Routing, Samples, pack, packed_logprobs
from jmarl.workflows.base import SampleRecord
from jmarl.train.step import jit_update, make_update, split_minibatches, vmap_update

# the fields of a warm-start batch before the shared-prefix layout
SFT_FIELDS: tuple[str, ...] = ("tokens", "attention_mask", "loss_mask")


# ---------------------------------------------------------------------------------- host batches


def batch_rows(counts: Sequence[int], parts: int, min_rows: int = 0) -> int:
    """N, the rows of a group batch: the most samples of any policy (or `min_rows`, a bound
    known from the plan) rounded up to a power of two, then to a multiple of `parts`."""
    n = next_pow2(max(max(counts, default=0), min_rows, 1))
    return -(-n // parts) * parts


def records_by_policy(records: Sequence[SampleRecord], policy_ids: Sequence[int]) -> dict[int, list[SampleRecord]]:
    """The records of each learner policy, in order. A group must belong to one learner (its
    advantages are normalised within that learner's batch): a JmarlError otherwise."""
    policy_of_group: dict[int, int] = {}
    mine: dict[int, list[SampleRecord]] = {p: [] for p in policy_ids}
    for r in records:
        if policy_of_group.setdefault(r.group, r.policy) != r.policy:
            raise JmarlError(f"group {r.group} holds samples for policies {policy_of_group[r.group]} and {r.policy}; "
                             "a group must belong to one learner policy (a sampling plan's bug)")
        if r.policy in mine:
            mine[r.policy].append(r)
    return mine


def _flat(x: Any, dtype: Any) -> np.ndarray:
    return np.asarray(x, dtype).reshape(-1)


def own_routing(record: SampleRecord, policy_id: int, config: Any) -> np.ndarray | None:
    """The experts `record` recorded for its prompt and completion tokens, [P + C, S, k] in
    `moe.routing_dtype(E)` of the learner's model `config` (S sparse layers, top k), for routing
    replay; None when it recorded none or another policy sampled it (another model's routing is
    not this one's to replay: the learner routes those tokens itself). Recorded ids beyond this
    model's S x k per token mean another model sampled it: a JmarlError."""
    given = record.completion.routing
    if given is None or record.source_policy != policy_id:
        return None
    given = np.asarray(given)
    tokens = np.size(record.completion.prompt_tokens) + np.size(record.completion.completion_tokens)
    if given.shape[0] != tokens:
        raise JmarlError(f"a sample's routing covers {given.shape[0]} tokens but it has {tokens} (prompt + completion); "
                         "the sampler records one routing per token")
    width = config.num_sparse_layers * config.num_experts_per_tok
    flat = given.reshape(tokens, -1)
    if flat.shape[1] < width:
        raise JmarlError(f"a sample's routing holds {flat.shape[1]} expert ids per token, and policy {policy_id}'s model "
                         f"records {width} ({config.num_sparse_layers} sparse layers x top-{config.num_experts_per_tok}): "
                         "it was not sampled by this model")
    dtype = moe_lib.routing_dtype(config.num_experts)
    flat = flat[:, :width]
    out = np.where(flat == moe_lib.no_route(flat.dtype), moe_lib.no_route(dtype), flat).astype(dtype)
    return out.reshape(tokens, config.num_sparse_layers, config.num_experts_per_tok)


def policy_samples(records: Sequence[SampleRecord], policy_id: int, size: int, config: Any = None) -> Samples:
    """One learner policy's records as `size` `Samples` (records first, then padding samples
    with no tokens and group -1): prompt and completion ids as sampled, each completion token's
    behaviour log-prob, and per sample reward, group (the plan's groups numbered from 0 in
    order of first appearance: a batch's group ids index its N rows), agent, source_policy,
    source_seq_logprob (the record's for a cross sample, else the mean completion log-prob) and
    learner = policy_id. A model that replays routing (`config.replays_routing`) gets its own
    samples' recorded experts (`own_routing`), every step, so its programs keep one signature."""
    if len(records) > size:
        raise JmarlError(f"{len(records)} samples of policy {policy_id} do not fit a batch of {size} rows")
    prompts = [_flat(r.completion.prompt_tokens, np.int32) for r in records]
    completions = [_flat(r.completion.completion_tokens, np.int32) for r in records]
    logprobs = [_flat(r.completion.logprobs, np.float32) for r in records]
    for i, (c, lp) in enumerate(zip(completions, logprobs)):
        if c.shape != lp.shape:
            raise JmarlError(f"a sample of policy {policy_id} has {c.size} completion tokens but {lp.size} log-probs; "
                             "the sampler must return one behaviour log-prob per completion token")
    pad = size - len(records)
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    numbering: dict[int, int] = {}
    group = [numbering.setdefault(r.group, len(numbering)) for r in records] + [-1] * pad

    def per_sample(values: list, dtype: Any) -> np.ndarray:
        return np.asarray(values + [0] * pad, dtype)

    routing = None
    if config is not None and config.replays_routing:
        routing = Routing([own_routing(r, policy_id, config) for r in records] + [None] * pad,
                          (config.num_sparse_layers, config.num_experts_per_tok), moe_lib.routing_dtype(config.num_experts))
    return Samples(
        prompts=prompts + [empty_i] * pad,
        continuations=completions + [empty_i] * pad,
        per_token={"behavior_logprobs": logprobs + [empty_f] * pad},
        per_sample={
            "reward": per_sample([r.reward for r in records], np.float32),
            "group": np.asarray(group, np.int32),
            "agent": per_sample([r.agent for r in records], np.int32),
            "source_policy": per_sample([r.source_policy for r in records], np.int32),
            "source_seq_logprob": per_sample([_seq_logprob(r, lp) for r, lp in zip(records, logprobs)], np.float32),
            "learner": np.full((size,), policy_id, np.int32),
        },
        routing=routing,
    )


def _seq_logprob(record: SampleRecord, logprobs: np.ndarray) -> float:
    """The source's mean completion log-prob: the record's (a cross sample, whose log-probs are
    not the source's), else the mean of its log-probs (0 for an empty completion)."""
    if record.source_seq_logprob is not None:
        return float(record.source_seq_logprob)
    return float(logprobs.mean()) if logprobs.size else 0.0


def _stacked(group: PolicyGroup, parts: list[dict[str, np.ndarray]]) -> LearnerBatch:
    if group.stacked:
        return LearnerBatch(**{k: np.stack([p[k] for p in parts]) for k in parts[0]})
    return LearnerBatch(**parts[0])


def learner_batch(
    group: PolicyGroup, records: Sequence[SampleRecord], parts: int, min_rows: int = 0, rows_per_part: int = 1,
    known: Collection[tuple[int, int]] = (),
) -> tuple[LearnerBatch, list[int]]:
    """The group's `LearnerBatch` (host arrays) from a step's sample records, and each of its
    policies' sample count. N is a power of two times `parts` (`batch_rows`); `min_rows`, a
    bound on any policy's samples per step known from the plan (0: none), fixes N across steps;
    each micro-batch packs into R rows of L slots, R a multiple of `rows_per_part` (one per data
    shard), (R, L) the fewest slots of a few widths or a shape of `known` (the group's earlier
    steps) that costs little more, so the update compiles for a few shapes (`packing.pack`,
    `packing.row_shape`). Records of policies outside the group are ignored."""
    mine = records_by_policy(records, group.policy_ids)
    counts = [len(mine[p]) for p in group.policy_ids]
    size = batch_rows(counts, parts, min_rows)
    samples = [policy_samples(mine[p], p, size, group.model_config) for p in group.policy_ids]
    return _stacked(group, pack(samples, parts, rows_per_part, known=known)), counts


def sft_batch(
    group: PolicyGroup, rows: Sequence[tuple[int, Sequence[int], Sequence[int]]], rows_per_part: int = 1,
    known: Collection[tuple[int, int]] = (),
) -> LearnerBatch | None:
    """A warm-start batch from (policy id, prompt token ids, completion token ids) rows (the
    completion trained on), padded per policy to a power of two and packed into a multiple of
    `rows_per_part` rows (a shape of `known` where it costs little more); None without rows."""
    if not rows:
        return None
    per = [[(np.asarray(p, np.int32).reshape(-1), np.asarray(c, np.int32).reshape(-1)) for pid, p, c in rows
            if pid == policy] for policy in group.policy_ids]
    size = next_pow2(max(len(x) for x in per))
    empty = np.zeros(0, np.int32)

    def samples(pairs: list) -> Samples:
        pad = [(empty, empty)] * (size - len(pairs))
        return Samples([p for p, _ in pairs + pad], [c for _, c in pairs + pad])

    return _stacked(group, pack([samples(x) for x in per], rows_per_part=rows_per_part, known=known))


def abstract_learner_batch(
    group: PolicyGroup, rows: int, packed_rows: int, width: int, predictions: int, length: int, *, sft: bool = False
) -> LearnerBatch:
    """The shapes `learner_batch` gives for N = `rows` samples per policy, `packed_rows`
    (parts x R) rows of `width` (L) slots, `predictions` (parts x M) predictions and
    continuations of `length` (C) tokens, as `jax.ShapeDtypeStruct`s; a leading policy axis when
    the group is stacked. sft: the fields of `sft_batch` only."""
    lead = (len(group.policy_ids),) if group.stacked else ()
    out = {
        k: jax.ShapeDtypeStruct(lead + ((rows, length) if per_token else (rows,)), dtype)
        for k, (per_token, dtype) in SAMPLE_FIELDS.items()
        if not sft or k in SFT_FIELDS
    }
    for k, dtype in PACKED_FIELDS.items():
        out[k] = jax.ShapeDtypeStruct(lead + (packed_rows, width), dtype)
    for k, dtype in PRED_FIELDS.items():
        out[k] = jax.ShapeDtypeStruct(lead + (predictions,), dtype)
    out["pred_slot"] = jax.ShapeDtypeStruct(lead + (rows, length), np.int32)
    config = group.model_config
    if config.replays_routing and not sft:
        out["packed_routing"] = jax.ShapeDtypeStruct(
            lead + (packed_rows, width, config.num_sparse_layers, config.num_experts_per_tok),
            moe_lib.routing_dtype(config.num_experts))
    return LearnerBatch(**out)


# ---------------------------------------------------------------------------------- device functions


@dataclass
class GroupFns:
    """The compiled functions of one `PolicyGroup`."""

    update: Any  # (state, frozen, LearnerBatch) -> (state, metrics)
    score: Any  # (trainable, frozen, model inputs) -> logprobs [N, C], vmapped when stacked
    score_ref: Any  # (ref params, model inputs) -> logprobs [N, C]
    sft_update: Any
    prepare: Any  # (LearnerBatch, method device state) -> LearnerBatch with advantages, keep in loss_mask


def model_params(group: PolicyGroup):
    """(trainable, frozen) -> what the model runs with: the trainable tree, or for LoRA the
    adapters attached to the frozen base (`attach_lora`)."""
    if group.lora_rank is None:
        return lambda trainable, frozen: trainable
    return lambda trainable, frozen: attach_lora(frozen, trainable, rank=group.lora_rank, alpha=group.lora_alpha)


def build_group_fns(
    group: PolicyGroup, method: Method, cfg: Any, optimizer, sft_optimizer, *, temperature: float,
    minibatches: int, grad_accum: int, epochs: int = 1, mesh=None,
    shardings: sharding_lib.GroupShardings | None = None, router_aux_loss_coef: float = 0.0,
) -> GroupFns:
    """Update, scoring, advantage and warm-start functions for `group`, jitted (vmapped over
    stacked policies). Scoring runs the step's batch one micro-batch at a time (the update's
    split), so its memory is a micro-batch's. With a mesh of several devices every
    micro-batch's rows are spread over the batch axes (`jmarl.sharding.microbatch_rows`), and
    with the group's `shardings` the updates and scoring passes are built sharded
    (`ShardedFn`s: in/out shardings on its mesh, the state donated, batches placed by its rules).
    router_aux_loss_coef > 0 (a mixture-of-experts model): both losses add that weight times the
    router's load-balancing loss over the micro-batch's real tokens (`moe.load_balancing_loss`),
    reported as `router_aux_loss`. Routing replay (a batch with `packed_routing`): every pass
    over the batch (update, scoring, reference scoring) runs the recorded experts, and the RL
    update reports `routing_mismatch`, the fraction of recorded (token, sparse layer) pairs
    whose own top k differs from the recorded one (`moe.mismatch_fraction`)."""
    mcfg = group.model_config
    params_of = model_params(group)
    aux_coef = router_aux_loss_coef if mcfg.is_moe else 0.0

    def logprobs_of(trainable, frozen, batch):
        return packed_logprobs(mcfg, params_of(trainable, frozen), batch, temperature)

    def with_router_aux(loss_of):
        """loss_of(trainable, frozen, batch, log-probs) -> (loss, metrics), plus the router's
        load-balancing term when aux_coef > 0 and the routing mismatch of a replayed batch."""
        def loss(trainable, frozen, batch: LearnerBatch):
            replayed = batch.packed_routing is not None
            if not aux_coef and not replayed:
                return loss_of(trainable, frozen, batch, logprobs_of(trainable, frozen, batch))
            lp, stats = packed_logprobs(mcfg, params_of(trainable, frozen), batch, temperature, with_router_stats=True)
            value, metrics = loss_of(trainable, frozen, batch, lp)
            if replayed:
                metrics = {**metrics, "routing_mismatch": moe_lib.mismatch_fraction(stats)}
            if not aux_coef:
                return value, metrics
            aux = moe_lib.load_balancing_loss(stats)
            return value + aux_coef * aux, {**metrics, "router_aux_loss": aux}
        return loss

    @with_router_aux
    def rl_loss(trainable, frozen, batch: LearnerBatch, lp):
        value, metrics = method.loss(cfg, lp, batch)
        return value, {**metrics, **sampler_agreement(lp, batch)}

    @with_router_aux
    def sft_loss(trainable, frozen, batch: LearnerBatch, lp):
        mask = batch.loss_mask
        nll = -jnp.sum(lp * mask) / jnp.maximum(jnp.sum(mask), 1)
        return nll, {"sft_nll": nll}

    spread = None if mesh is None or mesh.size == 1 else sharding_lib.microbatch_rows(mesh, stacked=group.stacked)
    axis = sharding_lib.policy_axis(mesh)
    jit = dict(stacked=group.stacked, frozen_stacked=False, policy_axis=axis)  # the LoRA base is shared
    rl_update = make_update(rl_loss, optimizer, num_minibatches=minibatches, grad_accum=grad_accum, epochs=epochs, constrain=spread)
    sft_step = make_update(sft_loss, sft_optimizer)
    if shardings is None:
        update, sft_update = jit_update(rl_update, **jit), jit_update(sft_step, **jit)
    else:
        sh = shardings
        on_mesh = dict(frozen_shardings=sh.frozen, stacked=sh.stacked, rules=sh.rules)
        update = sharding_lib.sharded_update(vmap_update(rl_update, **jit), sh.mesh, sh.state, **on_mesh)
        sft_update = sharding_lib.sharded_update(vmap_update(sft_step, **jit), sh.mesh, sh.state, **on_mesh)
    parts = minibatches * grad_accum

    def per_microbatch(fn):
        """fn(params, batch) -> [rows, C] run over the update's micro-batches in turn."""
        def scored(params, batch):
            mbs = split_minibatches(batch, parts, 1)
            mbs = mbs if spread is None else spread(mbs)
            out = jax.lax.map(lambda mb: fn(params, jax.tree.map(lambda x: x[0], mb)), mbs)
            return out.reshape(-1, *out.shape[2:])
        return scored

    def vmapped(fn, in_axes):
        return jax.vmap(fn, in_axes=in_axes, spmd_axis_name=axis) if group.stacked else fn

    def scoring(fn, fixed):
        """`fn` jitted, or sharded on the group's mesh: arguments placed by `fixed`, the last
        one (the batch) by the rules."""
        if shardings is None:
            return jax.jit(fn)
        return sharding_lib.sharded_jit(fn, shardings.mesh, fixed, batch_argnums=(len(fixed) - 1,),
                                        stacked=shardings.stacked, rules=shardings.rules)

    score_one = per_microbatch(lambda tf, batch: logprobs_of(tf[0], tf[1], batch))
    score = scoring(vmapped(lambda t, f, b: score_one((t, f), b), (0, None, 0)),
                    (None, None, None) if shardings is None else (shardings.state.params, shardings.frozen, None))
    ref_logprobs = per_microbatch(lambda params, batch: packed_logprobs(mcfg, params, batch, temperature))
    score_ref = scoring(vmapped(ref_logprobs, (None if group.lora_rank is not None else 0, 0)),
                        (None, None) if shardings is None else (shardings.ref, None))

    def prepare_one(batch: LearnerBatch, state: Any) -> LearnerBatch:
        advantages = finite_advantages(method.advantages(cfg, batch, state), batch.reward)
        keep = method.keep_mask(cfg, batch)
        return batch.replace(advantages=advantages, loss_mask=batch.loss_mask & keep[..., None])

    prepare = jax.jit(vmapped(prepare_one, (0, None)))
    return GroupFns(update=update, score=score, score_ref=score_ref, sft_update=sft_update, prepare=prepare)


def sampler_agreement(logprobs: jax.Array, batch: LearnerBatch) -> dict[str, jax.Array]:
    """How far the learner's log-probs are from the sampler's on the tokens the sampler drew.

    logprobs: float[N, C] the learner's, batch.behavior_logprobs float[N, C] the sampler's; only a
    policy's own samples (source_policy == learner) on trained tokens count. Returns
    `logprob_diff_max` and `logprob_diff_mean` of |learner - sampler| (0 without such tokens).
    The update reports them for its first optimizer update (`FIRST_UPDATE_METRICS`), where the
    learner's parameters are still the sampler's: a gap there is a mismatch between the two
    programs (tokenisation, masks, positions, numerics), not learning."""
    if batch.behavior_logprobs is None:
        return {}
    own = batch.loss_mask & (batch.source_policy == batch.learner)[:, None]
    gap = jnp.where(own, jnp.abs(jax.lax.stop_gradient(logprobs) - batch.behavior_logprobs), 0.0)
    count = jnp.maximum(jnp.sum(own), 1)
    return {"logprob_diff_max": jnp.max(gap, initial=0.0), "logprob_diff_mean": jnp.sum(gap) / count}


def active_policies(counts: Sequence[int], stacked: bool, multiple: int = 1) -> np.ndarray | None:
    """int32[P'] positions on a stacked group's policy axis that a step scores and updates: the
    policies with samples (counts[i] > 0), plus as many without, lowest first, as make P' a
    multiple of `multiple` (the mesh's policy-axis size). None when that is every policy, or the
    group is not stacked: the whole stack runs. The others are left exactly as they were (no
    optimizer step, as with one optimizer per agent), and no rows are computed for them."""
    if not stacked:
        return None
    active = [i for i, c in enumerate(counts) if c]
    idle = [i for i, c in enumerate(counts) if not c]
    while len(active) % max(multiple, 1) and idle:
        active.append(idle.pop(0))
    if len(active) == len(counts):
        return None
    return np.asarray(sorted(active), np.int32)


def policy_axis_size(mesh: Any) -> int:
    """How many ways the mesh splits a stacked policy axis (1 without a mesh or policy axis)."""
    axis = sharding_lib.policy_axis(mesh)
    if axis is None:
        return 1
    sizes = sharding_lib.axis_sizes(mesh)
    return int(np.prod([sizes[a] for a in ((axis,) if isinstance(axis, str) else axis)]))


@jax.jit
def _take(tree: Any, index: jax.Array) -> Any:
    """Every leaf's entries at `index` of its leading (policy) axis."""
    return jax.tree.map(lambda a: a[index], tree)


@partial(jax.jit, donate_argnums=(0,))
def _put(tree: Any, index: jax.Array, part: Any) -> Any:
    """`tree` with the entries at `index` of every leaf's leading axis replaced by `part`'s."""
    return jax.tree.map(lambda a, p: a.at[index].set(p), tree, part)


def restrict(group: PolicyGroup, batch: LearnerBatch, index: np.ndarray) -> tuple[PolicyGroup, LearnerBatch]:
    """A stacked group and its step's batch cut to the policies at `index` (`active_policies`):
    a view whose state (and stacked reference) holds those policies only, and the batch's
    [P', ...] host arrays. `merge` writes the view's updated state back."""
    index_dev = jnp.asarray(index)
    ref = group.ref if group.ref is None or group.lora_rank is not None else _take(group.ref, index_dev)
    view = dataclasses.replace(group, policy_ids=tuple(group.policy_ids[i] for i in index),
                               state=_take(group.state, index_dev), ref=ref)
    return view, jax.tree.map(lambda a: np.asarray(a)[index], batch)


def merge(group: PolicyGroup, index: np.ndarray, state: Any) -> None:
    """Writes the state of a `restrict` view (policies at `index`) back into `group.state`."""
    group.state = _put(group.state, jnp.asarray(index), state)


def score_batch(
    group: PolicyGroup, fns: GroupFns, batch: LearnerBatch, method_state: Any, *, recompute: bool, cross: bool
) -> LearnerBatch:
    """The update's batch: old log-probs, reference log-probs when the group has a reference,
    then the method's advantages and keep mask (`prepare`, given the method's device state).

    Old log-probs are the sampler's behaviour log-probs, or with `recompute` the current
    policy's scores; with `cross` (the batch holds samples another policy generated, whose
    behaviour log-probs under the learner are unknown) those samples take the scores. Works on
    abstract batches too (`jmarl.memory_check`)."""
    inputs = batch.model_inputs()
    old = jnp.asarray(batch.behavior_logprobs)
    if recompute or cross:
        scored = fns.score(group.state.params, group.base, inputs)
        own = jnp.asarray(batch.source_policy == batch.learner)
        old = scored if recompute else jnp.where(own[..., None], old, scored)
    ref = None if group.ref is None else fns.score_ref(group.ref, inputs)
    return fns.prepare(batch.replace(old_logprobs=old, ref_logprobs=ref), method_state)
