"""The training loop behind `python -m jmarl.run --config X.yaml`.

Per step (host layer, calling the device layer with fixed-shape batches):

    seeds -> sampling plan (env + ModelSampler) -> records -> Rollouts
          -> per policy group: old / reference log-probs [device] -> advantages [device]
          -> jitted update over mini-batches (vmapped over stacked policies) [device]
          -> metrics (JSONL, TensorBoard, progress bar), checkpoint, evaluation

Everything that decides a step's data is a function of (config, step): task seeds are
`train_seed(step * num_tasks + i)` and the step's key is `fold_in(key(seed), step)`, so a run
resumed from a checkpoint continues exactly where the killed one would have gone.

Algorithm state kept across steps (HACPO's capability window, JoyAgents-R1's memory, the
rollout count) is an `AlgoState` (`jmarl.train.algo_state`), updated right after each step's
plan and saved in the checkpoint metadata (the memory also as output_dir/memory.json).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmarl import algos, envs, models
from jmarl import sharding as sharding_lib
from jmarl.config import Config, agent_policy_map, algo_options, dump_yaml, plan_options
from jmarl.errors import JmarlError
from jmarl.rollouts import Rollouts, next_pow2, select
from jmarl.sharding import shard_trainer, to_host
from jmarl.train.algo_state import (
    AlgoState,
    after_plan,
    hacpo_batch_fn,
    hacpo_inputs,
    hacpo_mode_config,
    init_algo_state,
    node_wise_group_size,
    node_wise_options,
    shared_options,
)
from jmarl.train.checkpoint import Checkpointer
from jmarl.train.lora import attach_lora, init_lora
from jmarl.train.metrics import METRICS_FILE, MetricsLogger, write_summary
from jmarl.train.optim import make_optimizer
from jmarl.train.policies import PolicyGroup, PolicySet, build_model, build_tokenizer, stack
from jmarl.train.progress import ProgressBar
from jmarl.train.sampling import ModelSampler, SamplingSettings, encode_prompt
from jmarl.train.shared_prefix import MODEL_INPUTS, shared_prefix_logprobs, to_shared_prefix
from jmarl.train.step import TrainState, init_train_state, jit_update, make_update, split_minibatches
from jmarl.workflows import PLANS, build_rollouts, run_plan, summarize
from jmarl.workflows import memory as memory_store

log = logging.getLogger(__name__)

# sampling plans the trainer runs (shared: HACPO, every policy answers every prompt;
# node_wise: JoyAgents-R1, the plan keeps only the top-K node groups)
TRAINER_PLANS = ("independent", "tree", "joint", "shared", "node_wise")


# ----------------------------------------------------------------------------------------------
# building the run


def build_policies(
    config: Config, agents: Sequence[str], rng: jax.Array, optimizer, *, need_ref: bool, abstract: bool = False
) -> PolicySet:
    """The run's policies (see `jmarl.train.policies`), optimizer states initialised.

    abstract: every device array (parameters, optimizer states, references) is a
    `jax.ShapeDtypeStruct`, built by `jax.eval_shape` over the same code: nothing is allocated
    (what `jmarl.plan` compiles against). A model loaded from model.path would still be read
    from disk; the planner swaps checkpoints for their architecture first (`jmarl.plan`)."""
    if not abstract:
        return _build_policies(config, agents, rng, optimizer, need_ref=need_ref)
    built: dict[str, PolicySet] = {}

    def arrays():
        built["set"] = _build_policies(config, agents, rng, optimizer, need_ref=need_ref)
        return [(g.base, g.state, None if g.ref is g.base else g.ref) for g in built["set"].groups]

    shapes = jax.eval_shape(arrays)
    policies = built["set"]
    for group, (base, state, ref) in zip(policies.groups, shapes):
        ref_is_base = group.ref is not None and group.ref is group.base
        group.base, group.state = base, state
        group.ref = base if ref_is_base else ref
    return policies


def _build_policies(config: Config, agents: Sequence[str], rng: jax.Array, optimizer, *, need_ref: bool) -> PolicySet:
    pc = config.policies
    names, agent_policy = _policy_map(config, tuple(agents))
    ids = tuple(range(len(names)))
    groups: list[PolicyGroup] = []
    if pc.mode == "heterogeneous":
        for pid, name in zip(ids, names):
            entry = pc.models[name]
            tok = build_tokenizer(entry.tokenizer or config.tokenizer, entry.model.path)
            mcfg, params = build_model(entry.model, tok, jax.random.fold_in(rng, pid))
            groups.append(_group(name, mcfg, tok, (pid,), params, optimizer, need_ref=need_ref))
        return PolicySet(names, agent_policy, groups)

    tok = build_tokenizer(config.tokenizer, config.model.path)
    mcfg, params = build_model(config.model, tok, rng)
    if pc.mode == "lora":
        adapters = [
            init_lora(params, jax.random.fold_in(rng, 1000 + p), rank=pc.lora.rank, target_modules=pc.lora.target_modules)
            for p in ids
        ]
        stacked = len(ids) > 1
        trainable = stack(adapters) if stacked else adapters[0]
        group = PolicyGroup(
            name="lora", model_config=mcfg, tokenizer=tok, policy_ids=ids, stacked=stacked,
            lora_rank=pc.lora.rank, lora_alpha=pc.lora.alpha, base=params,
            state=init_state(trainable, optimizer, stacked), ref=params if need_ref else None,
        )
        return PolicySet(names, agent_policy, [group])
    # shared / per_agent: every policy starts from the same weights
    return PolicySet(names, agent_policy, [_group(pc.mode, mcfg, tok, ids, params, optimizer, need_ref=need_ref)])


def _policy_map(config: Config, agents: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(policy names, agent -> policy); the `shared` plan does not route by agent: every policy
    of `policies.models` answers every prompt, so its single agent maps to policy 0."""
    if config.workflow.plan != "shared":
        return agent_policy_map(config.policies, agents)
    if config.policies.mode != "heterogeneous" or len(config.policies.models) < 2:
        raise JmarlError(
            "workflow.plan 'shared' (HACPO) trains two or more different models: set policies.mode="
            "heterogeneous and give each one under policies.models.<name>"
        )
    return tuple(config.policies.models), (0,) * len(agents)


def _group(name, mcfg, tok, ids, params, optimizer, *, need_ref: bool) -> PolicyGroup:
    stacked = len(ids) > 1
    trainable = stack([params] * len(ids)) if stacked else params
    ref = jax.tree.map(jnp.copy, trainable) if need_ref else None
    return PolicyGroup(
        name=name, model_config=mcfg, tokenizer=tok, policy_ids=ids, stacked=stacked, lora_rank=None,
        lora_alpha=0.0, base=None, state=init_state(trainable, optimizer, stacked), ref=ref,
    )


def init_state(trainable, optimizer, stacked: bool) -> TrainState:
    """A fresh `TrainState`; with `stacked`, one per policy along the leading axis."""
    if stacked:
        return jax.vmap(lambda p: init_train_state(p, optimizer))(trainable)
    return init_train_state(trainable, optimizer)


# ----------------------------------------------------------------------------------------------
# device functions of one policy group (built once, jitted once)


@dataclass
class GroupFns:
    """The compiled functions of one `PolicyGroup`."""

    update: Any
    score: Any  # (trainable, frozen, model inputs) -> logprobs [N, C], vmapped when stacked
    score_ref: Any  # (ref params, model inputs) -> logprobs [N, C]
    sft_update: Any


def _merge(group: PolicyGroup):
    if group.lora_rank is None:
        return lambda trainable, frozen: trainable
    return lambda trainable, frozen: attach_lora(frozen, trainable, rank=group.lora_rank, alpha=group.lora_alpha)


def build_group_fns(group: PolicyGroup, method, algo_cfg, optimizer, sft_optimizer, *, temperature: float, minibatches: int, grad_accum: int, mesh=None) -> GroupFns:
    """Update, scoring and warm-start functions for `group`, jitted (vmapped over stacked policies).

    Scoring runs the step's batch one micro-batch at a time (the update's split), so its memory
    is a micro-batch's, not the step's. With a mesh of several devices, every micro-batch's rows
    are spread over the batch axes (`jmarl.sharding.microbatch_rows`)."""
    mcfg = group.model_config
    merge = _merge(group)
    is_hacpo = method is algos.hacpo

    def logprobs_of(trainable, frozen, batch):
        return shared_prefix_logprobs(mcfg, merge(trainable, frozen), batch, temperature)

    def loss_fn(trainable, frozen, batch, m):
        lp = logprobs_of(trainable, frozen, batch)
        extras = {}
        if is_hacpo:
            extras = dict(
                is_cross=batch["is_cross"], source_seq_logprob=batch["source_seq_logprob"],
                discrepancy=batch["discrepancy"], minibatch_index=m,
            )
        return method.loss(
            algo_cfg, lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
            ref_logprobs=batch.get("ref_logprobs"), **extras,
        )

    def sft_loss(trainable, frozen, batch, m):
        lp = logprobs_of(trainable, frozen, batch)
        mask = batch["loss_mask"]
        nll = -jnp.sum(lp * mask) / jnp.maximum(jnp.sum(mask), 1)
        return nll, {"sft_nll": nll}

    frozen_stacked = False  # the LoRA base is shared by every policy of the group
    spread = None if mesh is None or mesh.size == 1 else sharding_lib.microbatch_rows(mesh, stacked=group.stacked)
    axis = sharding_lib.policy_axis(mesh)
    update = jit_update(
        make_update(loss_fn, optimizer, num_minibatches=minibatches, grad_accum=grad_accum, constrain=spread),
        stacked=group.stacked, frozen_stacked=frozen_stacked, policy_axis=axis,
    )
    sft_update = jit_update(make_update(sft_loss, sft_optimizer), stacked=group.stacked, frozen_stacked=frozen_stacked,
                            policy_axis=axis)
    parts = minibatches * grad_accum

    def per_microbatch(fn):
        """fn(params, batch) -> [rows, C] run over the update's micro-batches in turn."""
        def scored(params, batch):
            mbs = split_minibatches(batch, parts, 1)
            mbs = mbs if spread is None else spread(mbs)
            out = jax.lax.map(lambda mb: fn(params, jax.tree.map(lambda x: x[0], mb)), mbs)
            return out.reshape(-1, *out.shape[2:])
        return scored

    score_one = per_microbatch(lambda tf, batch: logprobs_of(tf[0], tf[1], batch))
    score = jax.jit(jax.vmap(lambda t, f, b: score_one((t, f), b), in_axes=(0, None, 0), spmd_axis_name=axis)
                    if group.stacked else lambda t, f, b: score_one((t, f), b))

    ref_logprobs = per_microbatch(lambda params, batch: shared_prefix_logprobs(mcfg, params, batch, temperature))

    ref_axes = (None if group.lora_rank is not None else 0, 0)
    score_ref = jax.jit(jax.vmap(ref_logprobs, in_axes=ref_axes, spmd_axis_name=axis) if group.stacked else ref_logprobs)
    return GroupFns(update=update, score=score, score_ref=score_ref, sft_update=sft_update)


# ----------------------------------------------------------------------------------------------
# batches


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# the fields of `policy_batch`: name -> (one value per token, padding value, dtype)
POLICY_FIELDS: dict[str, tuple[bool, Any, Any]] = {
    "tokens": (True, 0, np.int32),
    "attention_mask": (True, False, np.bool_),
    "loss_mask": (True, False, np.bool_),
    "behavior_logprobs": (True, 0.0, np.float32),
    "reward": (False, 0.0, np.float32),
    "group": (False, -1, np.int32),
    "source_policy": (False, 0, np.int32),
    "source_seq_logprob": (False, 0.0, np.float32),
    "agent": (False, 0, np.int32),
}
# the fields `to_shared_prefix` adds: name -> dtype (prefix_tokens/mask [parts * U, P], prefix_rows [N])
PREFIX_FIELDS: dict[str, Any] = {"prefix_tokens": np.int32, "prefix_mask": np.bool_, "prefix_rows": np.int32}


def policy_batch(rollouts: Rollouts, policy_id: int, size: int) -> dict[str, np.ndarray]:
    """One policy's samples as host arrays padded to `size` rows; groups renumbered from 0.

    Padding rows have empty masks and group -1 (they belong to no group). Fields: `POLICY_FIELDS`.
    """
    sel = select(rollouts, np.asarray(rollouts.policy) == policy_id)
    n = sel.num_samples
    _, group = np.unique(np.asarray(sel.group), return_inverse=True)
    values = {k: group.reshape(-1) if k == "group" else getattr(sel, k) for k in POLICY_FIELDS}

    def pad(x, fill, dtype):
        x = np.asarray(x, dtype)
        out = np.full((size, *x.shape[1:]), fill, dtype)
        out[:n] = x
        return out

    return {k: pad(values[k], fill, dtype) for k, (_, fill, dtype) in POLICY_FIELDS.items()}


def batch_rows(counts: Sequence[int], parts: int, min_rows: int = 0) -> int:
    """N, the rows of a group batch: the most samples of any policy (or `min_rows`, a bound
    known from the plan) rounded up to a power of two, then to a multiple of `parts`."""
    return _round_up(next_pow2(max(max(counts, default=0), min_rows, 1)), parts)


def group_batch(group: PolicyGroup, rollouts: Rollouts, parts: int, min_rows: int = 0) -> tuple[dict[str, np.ndarray], list[int]]:
    """The group's batch in the shared-prefix layout (`jmarl.train.shared_prefix`): [P, N, ...]
    when stacked, else [N, ...]; N a power of two x parts (`batch_rows`).

    `min_rows`: a bound on any policy's samples per step known from the plan (0: none); N is
    then fixed across steps, so the update is compiled once per sequence-length bucket.
    """
    counts = [int(np.sum(np.asarray(rollouts.policy) == p)) for p in group.policy_ids]
    size = batch_rows(counts, parts, min_rows)
    batches = to_shared_prefix([policy_batch(rollouts, p, size) for p in group.policy_ids], parts)
    if group.stacked:
        return {k: np.stack([b[k] for b in batches]) for k in batches[0]}, counts
    return batches[0], counts


# the fields of a warm-start batch before `to_shared_prefix` (`Trainer._sft_batch`)
SFT_FIELDS: tuple[str, ...] = ("tokens", "attention_mask", "loss_mask")


def abstract_group_batch(
    group: PolicyGroup, rows: int, prefixes: int, prefix_len: int, length: int, *, sft: bool = False
) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes `group_batch` gives for N = `rows` samples per policy, `prefixes` (parts x U)
    distinct-prompt slots of `prefix_len` (P) tokens and continuations of `length` (C) tokens:
    [N, C] per-token fields, [N] per-sample fields, prefix_tokens/mask [parts x U, P],
    prefix_rows [N]; a leading policy axis [P, ...] when the group is stacked. sft: the
    fields of a warm-start batch (`Trainer._sft_batch`: SFT_FIELDS and the prefix fields)."""
    lead = (len(group.policy_ids),) if group.stacked else ()
    out = {
        k: jax.ShapeDtypeStruct(lead + ((rows, length) if per_token else (rows,)), dtype)
        for k, (per_token, _, dtype) in POLICY_FIELDS.items()
        if not sft or k in SFT_FIELDS
    }
    for k, dtype in PREFIX_FIELDS.items():
        shape = (rows,) if k == "prefix_rows" else (prefixes, prefix_len)
        out[k] = jax.ShapeDtypeStruct(lead + shape, dtype)
    return out


# ----------------------------------------------------------------------------------------------
# the trainer


class Trainer:
    """Owns a run: env, policies, sampler, compiled functions, logger and checkpoints."""

    def __init__(self, config: Config, *, abstract: bool = False):
        """abstract: build the run's device functions over `jax.ShapeDtypeStruct` states (sharded
        like the real ones) and write nothing: what `jmarl.plan` compiles; such a trainer
        cannot train."""
        self.config = config
        self.abstract = abstract
        self.out = Path(config.output_dir)
        if not abstract:
            self.out.mkdir(parents=True, exist_ok=True)
        self.env = envs.make(config.env.name, **dict(config.env.options))
        self.method = algos.get_method(config.algo.name)
        self.algo_cfg = algo_options(config)
        self.plan_fn = PLANS[config.workflow.plan][0]
        self.plan_opts = plan_options(config)
        if config.workflow.plan not in TRAINER_PLANS:
            raise JmarlError(
                f"workflow.plan {config.workflow.plan!r} is not wired into the trainer yet; "
                f"use one of {sorted(TRAINER_PLANS)}"
            )
        if config.workflow.plan == "shared":
            if self.method is not algos.hacpo:
                raise JmarlError(f"workflow.plan 'shared' needs algo.name hacpo (its cross samples), got {config.algo.name!r}")
            self.algo_cfg = hacpo_mode_config(self.algo_cfg, self.plan_opts.mode)
        if config.workflow.plan == "node_wise":
            explicit = "num_alternatives" in config.workflow.options
            self.plan_opts = node_wise_group_size(self.plan_opts, config.workflow.group_size, explicit=explicit)
        self.key = jax.random.key(config.seed)
        o = config.optim
        self.optimizer = make_optimizer(
            o.lr, total_steps=config.train.steps * o.epochs * o.minibatches, warmup_steps=o.warmup_steps,
            schedule=o.schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps, grad_clip=o.grad_clip,
        )
        ws = config.train.warm_start
        self.sft_optimizer = make_optimizer(ws.lr, total_steps=max(ws.steps, 1), grad_clip=o.grad_clip, weight_decay=0.0)
        self.need_ref = getattr(self.algo_cfg, "kl_coef", 0.0) > 0
        self.policies = build_policies(
            config, self.env.agents, jax.random.fold_in(self.key, 10**6), self.optimizer, need_ref=self.need_ref,
            abstract=abstract,
        )
        if config.workflow.plan == "shared":
            tokenizers = {p: self.policies.group_of(p).tokenizer for p in range(len(self.policies.policy_names))}
            self.plan_opts = shared_options(self.plan_opts, tokenizers)
        self.algo_state: AlgoState = init_algo_state(config.algo.name, self.algo_cfg, config.workflow.plan)
        s = config.sampling
        self.temperature = s.temperature if s.temperature > 0 else 1.0
        self.sampler = ModelSampler(
            self.policies,
            SamplingSettings(s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.max_prompt_len, s.max_rows_per_call),
        )
        self.parts = o.minibatches * o.epochs * o.grad_accum
        run_mesh = sharding_lib.mesh_from_config(config.mesh)
        self.fns = [
            build_group_fns(
                g, self.method, self.algo_cfg, self.optimizer, self.sft_optimizer, temperature=self.temperature,
                minibatches=o.minibatches * o.epochs, grad_accum=o.grad_accum, mesh=run_mesh,
            )
            for g in self.policies.groups
        ]
        self.mesh = shard_trainer(self)  # config.mesh: shard states, run updates with in/out shardings
        self.sampler.mesh = self.mesh  # generation rows and KV cache sharded over the same mesh
        self.checkpointer = None if abstract else Checkpointer(self.out / "checkpoints", keep=config.checkpoint.keep)
        self.step = 0
        self.warm_started = False

    # ---- state for checkpoints

    def state_tree(self) -> dict[str, Any]:
        """Everything a resume needs that lives on the device."""
        return {"groups": [g.state for g in self.policies.groups]}

    def load_state_tree(self, tree: dict[str, Any]) -> None:
        for g, st in zip(self.policies.groups, tree["groups"]):
            g.state = st

    def save(self) -> None:
        meta = {
            "step": self.step, "warm_started": self.warm_started, "config": json.loads(json.dumps(_plain(self.config))),
            "algo_state": self.algo_state.to_meta(),
        }
        self.checkpointer.save(self.step, self.state_tree(), meta)
        self.checkpointer.wait()
        if self.algo_state.memory is not None:  # readable copy of JoyAgents-R1's memory
            memory_store.save(self.algo_state.memory, self.out / "memory.json")

    def maybe_resume(self) -> bool:
        if not self.config.resume or self.checkpointer.latest_step() is None:
            return False
        restored = self.checkpointer.restore(self.state_tree())
        self.load_state_tree(restored.state)
        self.step = int(restored.meta.get("step", restored.step))
        self.warm_started = bool(restored.meta.get("warm_started", True))
        if "algo_state" in restored.meta:
            self.algo_state = AlgoState.from_meta(restored.meta["algo_state"])
        log.info("resumed from step %d", self.step)
        return True

    # ---- warm start (supervised, on expert demonstrations)

    def demonstrations(self, seeds: Sequence[int]) -> list[tuple[int, str, str]]:
        """(policy id, prompt, expert text) for every agent step of the expert episodes."""
        env, out = self.env, []
        for seed in seeds:
            state = env.reset(seed)
            for _ in range(env.max_turns):
                start = state
                for agent in env.turn_order:
                    obs = env.observe(start if env.parallel else state, agent)
                    text = env.expert_text(state, agent)
                    out.append((self.policies.agent_policy[env.agents.index(agent)], obs, text))
                    state, _ = env.step(state, agent, text)
                    if env.done(state):
                        break
                if env.done(state):
                    break
                state = env.end_turn(state)
                if env.done(state):
                    break
        if self.config.workflow.plan == "shared":  # every policy plays the one agent
            out = [(p, obs, text) for _, obs, text in out for p in range(len(self.policies.policy_names))]
        return out

    def warm_start(self) -> None:
        ws = self.config.train.warm_start
        if ws.steps <= 0 or self.warm_started:
            return
        bar = ProgressBar(ws.steps, desc="warm start", enabled=self.config.logging.progress)
        for i in range(ws.steps):
            seeds = [envs.train_seed(10**8 + i * ws.demos + j) for j in range(ws.demos)]
            demos = self.demonstrations(seeds)
            for gi, (group, fns) in enumerate(zip(self.policies.groups, self.fns)):
                batch = self._sft_batch(group, [d for d in demos if d[0] in group.policy_ids])
                if batch is None:
                    continue
                group.state, metrics = fns.sft_update(group.state, group.base, batch)
            bar.update({"nll": float(np.mean(jax.device_get(metrics["sft_nll"])))})
        bar.close()
        # a fresh optimizer state for RL (the warm start used its own optimizer)
        for g in self.policies.groups:
            g.state = init_state(g.state.params, self.optimizer, g.stacked)
            if g.ref is not None:
                g.ref = jax.tree.map(jnp.copy, g.full_params()) if g.lora_rank is None else g.ref
        self.warm_started = True

    def _sft_batch(self, group: PolicyGroup, demos) -> dict[str, np.ndarray] | None:
        if not demos:
            return None
        tok = group.tokenizer
        max_prompt = self.config.sampling.max_prompt_len
        rows = []
        for pid, prompt, text in demos:
            p = encode_prompt(tok, prompt, max_prompt)
            c = tok.encode(text)[: self.config.sampling.max_new_tokens - 1] + [tok.eos_id]
            rows.append((group.index(pid), p, c))
        from jmarl.rollouts import bucket_length

        t = bucket_length(max(len(p) + len(c) for _, p, c in rows))
        per = [[r for r in rows if r[0] == i] for i in range(len(group.policy_ids))]
        size = next_pow2(max(len(x) for x in per))

        def arrays(rs):
            tokens = np.zeros((size, t), np.int32)
            attn = np.zeros((size, t), bool)
            loss = np.zeros((size, t), bool)
            for j, (_, p, c) in enumerate(rs):
                tokens[j, : len(p) + len(c)] = p + c
                attn[j, : len(p) + len(c)] = True
                loss[j, len(p) : len(p) + len(c)] = True
            return {"tokens": tokens, "attention_mask": attn, "loss_mask": loss}

        if group.stacked:
            parts = to_shared_prefix([arrays(x) for x in per])
            return {k: np.stack([p[k] for p in parts]) for k in parts[0]}
        return to_shared_prefix([arrays(rows)])[0]

    # ---- one RL step

    def rl_step(self) -> dict[str, float]:
        cfg = self.config
        t0 = time.perf_counter()
        key = jax.random.fold_in(self.key, self.step)
        seeds = [envs.train_seed(self.step * cfg.workflow.num_tasks + i) for i in range(cfg.workflow.num_tasks)]
        self.sampler.new_tokens = 0
        result = self.plan_fn(self.env, seeds, self.policies.agent_policy, self.sampler, key, self._step_plan_options())
        t_gen = time.perf_counter() - t0
        metrics: dict[str, float] = {f"rollout/{k}": v for k, v in summarize(result.episodes).items()}
        # HACPO: this step's success rates enter the capability window before any advantage;
        # JoyAgents-R1: the memory learns from this step's node groups
        self.algo_state, algo_metrics = after_plan(self.algo_state, result, self.step)
        metrics.update(algo_metrics)
        metrics["rollout/samples"] = float(len(result.records))
        metrics["time/generate"] = t_gen
        metrics["rollout/new_tokens_per_s"] = self.sampler.new_tokens / max(t_gen, 1e-9)
        if not result.records:
            return metrics
        rollouts = build_rollouts(result.records, pad_id=self.policies.groups[0].tokenizer.pad_id)
        rewards = np.asarray(rollouts.reward)
        metrics["rollout/reward_mean"] = float(np.mean(rewards[np.isfinite(rewards)])) if np.isfinite(rewards).any() else float("nan")
        metrics["rollout/reward_std"] = float(np.std(rewards[np.isfinite(rewards)])) if np.isfinite(rewards).any() else float("nan")
        metrics["rollout/nonfinite_rewards"] = float(np.sum(~np.isfinite(rewards)))

        t_score = t_update = 0.0
        for gi, (group, fns) in enumerate(zip(self.policies.groups, self.fns)):
            batch, counts = group_batch(group, rollouts, self.parts, self._rows_bound())
            if not any(counts):
                continue
            t1 = time.perf_counter()
            batch = jax.block_until_ready(self._score(group, fns, batch))
            t_score += time.perf_counter() - t1
            t2 = time.perf_counter()
            group.state, m = fns.update(group.state, group.base, batch)
            m = jax.device_get(m)
            t_update += time.perf_counter() - t2
            for k, v in m.items():
                metrics[f"train/{k}" if len(self.policies.groups) == 1 else f"train/{group.name}/{k}"] = float(np.mean(v))
            metrics["train/skipped_updates"] = metrics.get("train/skipped_updates", 0.0) + float(np.sum(jax.device_get(group.state.skipped)))
        metrics["time/score"] = t_score
        metrics["time/update"] = t_update
        metrics["time/step"] = time.perf_counter() - t0
        tokens = float(np.sum(np.asarray(rollouts.attention_mask)))
        metrics["perf/train_tokens_per_s"] = tokens / max(t_score + t_update, 1e-9)
        return metrics

    def _rows_bound(self) -> int:
        """Samples per learner per step where the plan fixes them, else 0. shared: tasks x
        policies x G when sharing (hacpo, naive; lossy cross samples dropped make it an upper
        bound), tasks x G (gspo) or tasks x 2G (gspo_2x) otherwise."""
        if self.config.workflow.plan == "shared":
            opts = self.plan_opts
            sources = opts.num_policies if opts.shares else 1
            return self.config.workflow.num_tasks * sources * opts.samples_per_policy
        return 0

    def _step_plan_options(self) -> Any:
        """The plan's options for this step (node_wise: the current memory injected)."""
        if self.config.workflow.plan == "node_wise" and self.method is algos.joyagents:
            top_k_set = "top_k" in self.config.workflow.options
            return node_wise_options(self.plan_opts, self.algo_cfg, self.algo_state, top_k_set=top_k_set)
        return self.plan_opts

    def _score(self, group: PolicyGroup, fns: GroupFns, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Adds old/ref log-probs, advantages and the keep filter to a group's batch.

        HACPO: advantages, discrepancy weights, the keep filter and is_cross come from one
        jitted function over the learner's mixed groups; cross samples (whose behaviour
        log-probs under the learner are unknown) are always scored by the learner.
        """
        cfg = self.config
        inputs = {k: batch[k] for k in MODEL_INPUTS}
        hacpo_terms = None
        if self.method is algos.hacpo:
            capability = algos.hacpo.capabilities(self.algo_state.capability)
            fn = hacpo_batch_fn(self.algo_cfg, batch["reward"].shape[-1], group.stacked)
            adv, weight, keep, is_cross = fn(*hacpo_inputs(batch, group.policy_ids, group.stacked, capability))
            hacpo_terms = {
                "is_cross": is_cross, "discrepancy": weight,
                "source_seq_logprob": jnp.asarray(batch["source_seq_logprob"]),
            }
        else:
            adv, keep = self._advantages(batch["reward"], batch["group"], stacked=group.stacked)
        if cfg.train.recompute_old_logprobs or hacpo_terms is not None:
            old = fns.score(group.state.params, group.base, inputs)
            if not cfg.train.recompute_old_logprobs:
                old = jnp.where(hacpo_terms["is_cross"][..., None], old, jnp.asarray(batch["behavior_logprobs"]))
        else:
            old = jnp.asarray(batch["behavior_logprobs"])
        out = dict(inputs, old_logprobs=old)
        if group.ref is not None:
            out["ref_logprobs"] = fns.score_ref(group.ref, inputs)
        out["advantages"] = adv
        out["loss_mask"] = jnp.asarray(batch["loss_mask"]) & keep[..., None]
        if hacpo_terms is not None:
            out.update(hacpo_terms)
        return out

    def _advantages(self, reward: np.ndarray, group: np.ndarray, *, stacked: bool):
        n = reward.shape[-1]
        # node_wise: the plan already kept only the top-K node groups of each task
        keep_all = self.config.workflow.plan == "node_wise"
        fn = _advantage_fn(self.method, self.algo_cfg, n, stacked, keep_all)
        return fn(jnp.asarray(reward), jnp.asarray(group))

    # ---- evaluation

    def evaluate(self) -> dict[str, float]:
        """Greedy success on held-out seeds (and pass@k when eval.pass_k > 1).

        With the `shared` plan (HACPO) every policy is evaluated on its own: eval/<policy>/...,
        and eval/<metric> is the mean over the policies.
        """
        if self.config.workflow.plan != "shared":
            return self._evaluate(self.policies.agent_policy)
        out: dict[str, float] = {}
        per = []
        for pid, name in enumerate(self.policies.policy_names):
            got = self._evaluate((pid,) * len(self.env.agents))
            per.append(got)
            out.update({k.replace("eval/", f"eval/{name}/", 1): v for k, v in got.items()})
        for k in per[0]:
            if all(k in g for g in per):
                out[k] = float(np.mean([g[k] for g in per]))
        return out

    def _evaluate(self, agent_policy: Sequence[int]) -> dict[str, float]:
        ec = self.config.eval
        seeds = [envs.eval_seed(i) for i in range(ec.num_episodes)]
        key = jax.random.fold_in(self.key, -1 % (2**31))
        saved = self.sampler.settings
        out: dict[str, float] = {}
        try:
            if ec.greedy:
                self.sampler.settings = dataclasses.replace(saved, temperature=0.0)
            env = self._eval_env()
            res = run_plan("independent", env, seeds, agent_policy, self.sampler, key, num_episodes=1, max_turns=self.config.workflow.max_turns)
            out.update({f"eval/{k}": v for k, v in summarize(res.episodes).items()})
            out.update({f"eval/info/{k}": v for k, v in step_info_means(res.records).items()})
            if ec.pass_k > 1:
                self.sampler.settings = saved
                res = run_plan("independent", env, seeds, agent_policy, self.sampler, key, num_episodes=ec.pass_k, max_turns=self.config.workflow.max_turns)
                solved = {}
                for e in res.episodes:
                    solved[e.env] = solved.get(e.env, False) or e.success
                out[f"eval/pass@{ec.pass_k}"] = float(np.mean(list(solved.values())))
        finally:
            self.sampler.settings = saved
        return out

    def _eval_env(self) -> Any:
        """The env evaluation plays: with a JoyAgents-R1 memory, prompts carry the retrieved
        entries as in training (`memory.MemoryPromptEnv`); the run's env otherwise."""
        if self.algo_state.memory is None:
            return self.env
        return memory_store.MemoryPromptEnv(self.env, self.algo_state.memory)

    # ---- export

    def export(self, directory: str | Path | None = None) -> list[Path]:
        """Writes every policy as a Hugging Face directory (config.json + safetensors + tokenizer)."""
        root = Path(directory or self.out / "export")
        paths = []
        for pid, name in enumerate(self.policies.policy_names):
            group = self.policies.group_of(pid)
            path = root / name
            models.save_hf(path, group.model_config, to_host(group.policy_params(pid)))
            tok = group.tokenizer
            save_tok = getattr(tok, "save", None) or getattr(tok, "save_pretrained", None) or getattr(getattr(tok, "hf", None), "save_pretrained", None)
            if save_tok is not None:
                save_tok(str(path))
            paths.append(path)
        return paths

    # ---- the loop

    def check_memory(self) -> list[Any]:
        """Before step 0: when train.memory_check is "on", or "auto" on an accelerator, compiles
        the run's programs for the real devices (`jmarl.plan`), logs their per-device figures
        and raises JmarlError, naming the program and the settings to change, when one would not
        fit in train.device_memory (else the device's own) less train.memory_headroom. Returns
        the per-program figures ([] when the check is off: it then costs nothing)."""
        mode = self.config.train.memory_check
        if mode == "off" or (mode == "auto" and jax.default_backend() == "cpu"):
            return []
        from jmarl import plan

        return plan.check_trainer(self)

    def run(self) -> dict[str, Any]:
        cfg = self.config
        if self.abstract:
            raise JmarlError("this Trainer was built with abstract=True (for jmarl.plan); build Trainer(config) to train")
        t_start = time.perf_counter()
        self.check_memory()
        (self.out / "config.yaml").write_text(dump_yaml(cfg))
        resumed = self.maybe_resume()
        if not resumed:  # a fresh run into a used output_dir: do not append to the old run's curves
            (self.out / METRICS_FILE).unlink(missing_ok=True)
        logger = MetricsLogger(self.out, tensorboard=cfg.logging.tensorboard, plots=cfg.logging.plots)
        summary_path = self.out / "summary.json"
        before, before_fields = None, {}
        if resumed and summary_path.exists():
            previous = json.loads(summary_path.read_text())
            before = previous.get("success_before")
            before_fields = {k: v for k, v in previous.items() if k.startswith("before_")}
        if before is None:
            self.warm_start()
            before_metrics = self.evaluate()
            before = before_metrics.get("eval/success_rate", 0.0)
            before_fields = before_summary(before_metrics)
            write_summary(self.out, {"success_before": before, "steps": self.step, **before_fields})
        bar = ProgressBar(cfg.train.steps, desc=f"{cfg.algo.name} on {cfg.env.name}", initial=self.step, enabled=cfg.logging.progress)
        try:
            while self.step < cfg.train.steps:
                metrics = self.rl_step()
                self.step += 1
                if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                    metrics.update(self.evaluate())
                logger.log(self.step, metrics)
                bar.update({"reward": metrics.get("rollout/reward_mean", float("nan")), "success": metrics.get("rollout/success_rate", float("nan"))})
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save()
            final = self.evaluate()
            logger.log(self.step, final)
        finally:
            bar.close()
            logger.close()
        self.save()
        self.export()
        summary = {
            "success_before": before,
            "success_after": final.get("eval/success_rate", 0.0),
            "steps": self.step,
            "wall_seconds": time.perf_counter() - t_start,
            "rollouts_generated": self.algo_state.rollouts_generated,
            **{k.replace("eval/", "eval_"): v for k, v in final.items()},
            **before_fields,
        }
        write_summary(self.out, summary)
        self.checkpointer.close()
        print(results_table(summary, cfg, self.out), flush=True)
        return summary


def step_info_means(records: Sequence[Any]) -> dict[str, float]:
    """Mean of each numeric env step-info value (`record.info["env_info"]`, e.g. Writing's
    reward components) over the records that report it; {} when none does."""
    values: dict[str, list[float]] = {}
    for r in records:
        for k, v in r.info.get("env_info", {}).items():
            values.setdefault(k, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in values.items()}


def before_summary(metrics: dict[str, float]) -> dict[str, float]:
    """The held-out evaluation before RL (after any warm start) as summary.json fields:
    eval/<metric> -> before_eval_<metric> (eval/info/<key> -> before_eval_info/<key>)."""
    return {k.replace("eval/", "before_eval_", 1): float(v) for k, v in metrics.items() if k.startswith("eval/")}


def results_table(summary: dict[str, Any], config: Config, out: Path) -> str:
    """The before/after table printed at the end of a run (held-out greedy success)."""
    before, after = float(summary["success_before"]), float(summary["success_after"])
    start = "after warm start" if config.train.warm_start.steps > 0 else "initial model"
    rows = [
        (start, f"{100 * before:5.1f}%"),
        (f"after {summary['steps']} {config.algo.name} steps", f"{100 * after:5.1f}%"),
        ("change", f"{100 * (after - before):+5.1f} points"),
    ]
    width = max(len(r[0]) for r in rows)
    title = f"held-out success on {config.env.name} ({config.eval.num_episodes} episodes, "
    title += "greedy)" if config.eval.greedy else "sampled)"
    lines = [title] + [f"  {name:<{width}}  {value}" for name, value in rows]
    lines.append(f"  wall time {summary.get('wall_seconds', 0.0):.0f} s; outputs in {out}: summary.json, "
                 "metrics.jsonl, plots/, checkpoints/, export/")
    return "\n".join(lines)


def _advantage_fn(method, algo_cfg, n: int, stacked: bool, keep_all: bool = False):
    key = (method.__name__, algo_cfg, n, stacked, keep_all)
    if key not in _ADV_CACHE:
        def one(reward, group):
            # a non-finite reward must not pass as "no signal": its advantage is NaN, so the
            # update's non-finite guard skips (and counts) the mini-batch that holds it
            adv = method.advantages(algo_cfg, reward, group, num_groups=n)
            adv = jnp.where(jnp.isfinite(reward), adv, jnp.nan)
            if keep_all:
                keep = algos.filter_groups(reward, group, num_groups=n)
            else:
                keep = method.keep_mask(algo_cfg, reward, group, num_groups=n)
            return adv, keep

        _ADV_CACHE[key] = jax.jit(jax.vmap(one) if stacked else one)
    return _ADV_CACHE[key]


_ADV_CACHE: dict[Any, Any] = {}


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def train(config: Config) -> dict[str, Any]:
    """Runs training as configured; returns the summary written to output_dir/summary.json."""
    return Trainer(config).run()
