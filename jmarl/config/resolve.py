"""Options validated against registries in other packages (imported lazily): the method's
`algo.options`, the sampling plan's `workflow.options`, the env's `env.options`, the method/plan
pairing and the agent -> policy map. A setting given in the wrong section exits naming its home.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from jmarl.config.convert import _convert, _suggest, from_dict
from jmarl.config.schema import Config, agent_policy_map
from jmarl.errors import JmarlError


# Settings that have their home elsewhere: name -> (what it is, where to set it). Given in
# algo.options or workflow.options they exit with that home's name instead of being ignored.
_GROUP_SIZE_NAMES = ("group_size", "num_generations", "num_candidates", "num_episodes", "num_samples", "num_alternatives")
_HOMES: dict[str, tuple[str, str]] = {
    **{name: ("the group size", "workflow.group_size") for name in _GROUP_SIZE_NAMES},
    "num_turns": ("a sampling setting", "workflow.max_turns"),
    "max_turns": ("a sampling setting", "workflow.max_turns"),
    "top_k_groups": ("a sampling setting", "workflow.options.top_k"),
    "continue_with": ("a sampling setting", "workflow.options.select"),
    "joint_aggregate": ("a sampling setting", "workflow.options.cross_aggregate"),
    "early_stop_reward": ("a sampling setting", "workflow.options.early_stop_threshold"),
    "turn_order": ("the env's", "env.name (the env decides its turn order)"),
    "cost_weight": ("a reward setting", "env.options (the router env's call_cost / token_cost)"),
    "kl_coef": ("a run setting", "train.kl_coef"),
    "kl_kind": ("a run setting", "train.kl_kind"),
}


def _method(config: Config) -> Any:
    return method_named(config.algo.name)


def method_named(name: str) -> Any:
    """The `jmarl.algos.Method` algo.name names; JmarlError naming algo.name otherwise."""
    from jmarl import algos

    try:
        return algos.get_method(name)
    except JmarlError as e:
        hint = _suggest(name, sorted(algos.METHODS)) if ":" not in name else None
        raise JmarlError(f"algo.name: {e}" + (f" — did you mean {hint!r}?" if hint else "")) from None


def _plan_registry() -> Mapping[str, Any]:
    from jmarl.workflows.plans import PLANS

    return PLANS


def plan_named(name: str) -> Any:
    """The `jmarl.workflows.Plan` workflow.plan names (a registered plan or your own as
    `package.module:NAME`); JmarlError naming workflow.plan otherwise."""
    from jmarl.workflows.plans import get_plan

    try:
        return get_plan(name)
    except JmarlError as e:
        hint = _suggest(name, sorted(_plan_registry())) if ":" not in name else None
        message = str(e).removeprefix("workflow.plan ")
        raise JmarlError(f"workflow.plan: {message}" + (f" — did you mean {hint!r}?" if hint else "")) from None


def _settings(cls: type) -> set[str]:
    """The user settings of an options dataclass (fields not marked as run inputs)."""
    return {f.name for f in dataclasses.fields(cls) if f.init and not f.metadata.get("input")}


def _check_homes(config: Config, section: str, options: Mapping[str, Any], own: set[str], other: tuple[str, set[str]]) -> None:
    """Raises for a key of `section`.options that is not one of `own` settings but has a home:
    the other section's settings (`other` = (its prefix, its settings)), or `_HOMES`."""
    other_prefix, other_names = other
    for key in options:
        if key in own:
            continue
        dotted = f"{section}.options.{key}"
        if key in _HOMES:
            what, home = _HOMES[key]
            raise JmarlError(f"{dotted} is {what}: set {home}")
        if key in other_names:
            what = "a sampling setting" if other_prefix == "workflow" else "a loss setting"
            raise JmarlError(f"{dotted} is {what}: set {other_prefix}.options.{key}")


def _all_plan_settings() -> set[str]:
    return set().union(*(_settings(p.options) for p in _plan_registry().values()))


def algo_options(config: Config) -> Any:
    """The method's typed options (`Method.config`) from algo.options, with the run-level values
    filled in: kl_coef/kl_kind from train.kl_coef/kl_kind, and norm_length and overlong_limit
    (when the method has them and algo.options does not set them) from sampling.max_new_tokens,
    the completion budget: a length that is a constant of the run, never the padded batch width."""
    method = _method(config)
    cls = method.config
    own = _settings(cls)
    opts = dict(config.algo.options)
    _check_homes(config, "algo", opts, own - {"kl_coef", "kl_kind"}, ("workflow", _all_plan_settings() - own))
    if "kl_coef" in own:
        opts["kl_coef"] = config.train.kl_coef
    if "kl_kind" in own:
        opts["kl_kind"] = config.train.kl_kind
    for length in ("norm_length", "overlong_limit"):
        if length in own and opts.get(length) is None:
            opts[length] = config.sampling.max_new_tokens
    return from_dict(cls, opts, "algo.options")


def plan_options(config: Config) -> Any:
    """The sampling plan's typed options from workflow.options, with group_size from
    workflow.group_size and max_turns from workflow.max_turns. Run inputs (fields marked
    `input`, e.g. the memory or the tokenizers) are refused: the run sets them."""
    cls = plan_named(config.workflow.plan).options
    own = _settings(cls) - {"group_size", "max_turns"}
    opts = dict(config.workflow.options)
    inputs = {f.name for f in dataclasses.fields(cls) if f.metadata.get("input")}
    for key in opts:
        if key in inputs:
            raise JmarlError(f"workflow.options.{key} is set by the run, not by the config; remove it")
    try:
        loss_settings = _settings(_method(config).config)
    except JmarlError:
        loss_settings = set()
    _check_homes(config, "workflow", opts, own, ("algo", loss_settings - own))
    opts["group_size"] = config.workflow.group_size
    if "max_turns" in _settings(cls):
        opts["max_turns"] = config.workflow.max_turns
    return from_dict(cls, opts, "workflow.options")


def validate_options(config: Config) -> None:
    """Checks the method/plan pairing, algo, workflow and env options (and the agent map)."""
    method = _method(config)
    method.check_plan(plan_named(config.workflow.plan))
    if config.policies.mode == "heterogeneous" and not method.multi_agent:
        raise JmarlError(
            f"policies.mode: 'heterogeneous' needs a multi-agent algorithm, algo.name is {config.algo.name!r}"
        )
    algo_options(config)
    plan_options(config)
    _validate_env(config)


def _validate_env(config: Config) -> None:
    """Checks env options against the env's dataclass, builds the env and checks the agent map.

    An env class that is not a dataclass declares no options to check.
    """
    from jmarl.envs import base

    env = config.env
    cls = base.env_class(env.name)
    if not dataclasses.is_dataclass(cls):
        return
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # annotations that cannot be resolved: check names only
        hints = {}
    for key, value in env.options.items():
        dotted = f"env.options.{key}"
        if key not in names:
            hint = _suggest(str(key), names)
            if hint:
                raise JmarlError(f"unknown key {dotted!r} — did you mean 'env.options.{hint}'?")
            raise JmarlError(f"unknown key {dotted!r}; env {env.name!r} takes: {', '.join(names)}")
        if key in hints:
            _convert(hints[key], value, dotted)
    try:
        built = base.make(env.name, **env.options)
    except JmarlError as e:
        raise JmarlError(f"env.options: {e}") from None
    if plan_named(config.workflow.plan).routes_by_agent:  # else every policy answers every prompt
        agent_policy_map(config.policies, tuple(built.agents))
