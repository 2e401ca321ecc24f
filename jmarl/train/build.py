"""Building a run's policies: models, tokenizers, optimizer states and references (`PolicySet`).

Modes (policies.mode): shared (one policy), per_agent (one full model per policy, stacked),
lora (one frozen base, one adapter per policy, stacked), heterogeneous (each policy its own
architecture and tokenizer, one group each).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jmarl.config import Config, agent_policy_map
from jmarl.errors import JmarlError
from jmarl.train.lora import init_lora
from jmarl.train.policies import PolicyGroup, PolicySet, build_model, build_tokenizer, stack
from jmarl.train.step import TrainState, init_train_state


def build_policies(
    config: Config, agents: Sequence[str], rng: jax.Array, optimizer, *, need_ref: bool, abstract: bool = False,
    routes_by_agent: bool = True,
) -> PolicySet:
    """The run's policies (see `jmarl.train.policies`), optimizer states initialised.

    abstract: every device array (parameters, optimizer states, references) is a
    `jax.ShapeDtypeStruct`, built by `jax.eval_shape` over the same code: nothing is allocated
    (what `jmarl.memory_check` compiles against), and a model.path checkpoint's weights are not
    read, only its architecture (`build_model(abstract=True)`)."""
    if not abstract:
        return _build_policies(config, agents, rng, optimizer, need_ref=need_ref, routes_by_agent=routes_by_agent)
    built: dict[str, PolicySet] = {}

    def arrays():
        built["set"] = _build_policies(config, agents, rng, optimizer, need_ref=need_ref, routes_by_agent=routes_by_agent,
                                       abstract=True)
        return [(g.base, g.state, None if g.ref is g.base else g.ref) for g in built["set"].groups]

    shapes = jax.eval_shape(arrays)
    policies = built["set"]
    for group, (base, state, ref) in zip(policies.groups, shapes):
        ref_is_base = group.ref is not None and group.ref is group.base
        group.base, group.state = base, state
        group.ref = base if ref_is_base else ref
    return policies


def _build_policies(config: Config, agents: Sequence[str], rng: jax.Array, optimizer, *, need_ref: bool,
                    routes_by_agent: bool, abstract: bool = False) -> PolicySet:
    pc = config.policies
    names, agent_policy = _policy_map(config, tuple(agents), routes_by_agent)
    ids = tuple(range(len(names)))
    groups: list[PolicyGroup] = []
    if pc.mode == "heterogeneous":
        for pid, name in zip(ids, names):
            entry = pc.models[name]
            tok = build_tokenizer(entry.tokenizer or config.tokenizer, entry.model.path, entry.model.chat_template)
            mcfg, params = build_model(entry.model, tok, jax.random.fold_in(rng, pid), abstract=abstract)
            groups.append(_group(name, mcfg, tok, (pid,), params, optimizer, need_ref=need_ref))
        return PolicySet(names, agent_policy, groups)

    tok = build_tokenizer(config.tokenizer, config.model.path, config.model.chat_template)
    mcfg, params = build_model(config.model, tok, rng, abstract=abstract)
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


def _policy_map(config: Config, agents: tuple[str, ...], routes_by_agent: bool) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(policy names, agent -> policy). A plan that does not route by agent (`shared`) has every
    policy of `policies.models` answer every prompt, so every agent maps to policy 0."""
    if routes_by_agent:
        return agent_policy_map(config.policies, agents)
    if config.policies.mode != "heterogeneous" or len(config.policies.models) < 2:
        raise JmarlError(
            f"workflow.plan {config.workflow.plan!r} has every policy answer every prompt, so it trains two "
            "or more different models: set policies.mode=heterogeneous and give each one under "
            "policies.models.<name>"
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
