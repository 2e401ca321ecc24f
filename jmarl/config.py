"""Run configuration: typed frozen dataclasses, YAML files, dotted overrides, clear errors.

A run is described by one `Config`. It is read from a YAML file, then `key=value` overrides
from the command line are applied (`train.steps=10`, `policies.mode=per_agent`), then the
merged dict is validated into frozen dataclasses by `from_dict`. Every mistake a user can make
(unknown key, wrong type, value out of range, unknown algorithm or env, missing file) raises
`JmarlError` with the dotted key and the fix.

    config = load_config("configs/quickstart.yaml", ["train.steps=10"])
    print(dump_yaml(config))

Ranges are declared next to the field (`_field(0.0, ge=0.0)`), checks that involve several
fields live in a `_validate(self, path)` method of the dataclass; `from_dict` runs both.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import importlib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar

import yaml

from jmarl.errors import JmarlError

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# YAML: a safe loader that also reads `1e-6` as a float (YAML 1.1 insists on `1.0e-6`).
# --------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader whose float resolver also accepts exponents without a dot (1e-6)."""


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _ch in "-+0123456789.":
    _Loader.yaml_implicit_resolvers[_ch] = [
        (tag, rx)
        for tag, rx in _Loader.yaml_implicit_resolvers.get(_ch, [])
        if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str) -> Any:
    """Parses YAML `text`; `source` names where it came from in the error message."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JmarlError(f"cannot parse {source}{where}: {problem}") from None


# --------------------------------------------------------------------------------------------
# Generic validation: from_dict(cls, data, path)
# --------------------------------------------------------------------------------------------


def _field(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None, factory=None):
    """A dataclass field with an allowed range (ge/gt/le/lt) checked by `from_dict`."""
    meta = {"range": (ge, gt, le, lt)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    """A readable name for a type annotation."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (tuple, list, collections.abc.Sequence):
        return "list"
    if origin in (dict, collections.abc.Mapping):
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping (section)"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _wrong_type(path: str, tp: Any, value: Any) -> JmarlError:
    return JmarlError(
        f"{path or 'config'}: expected {_type_name(tp)}, got {type(value).__name__} {_show(value)}"
    )


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else ""


def _check_range(path: str, value: Any, bounds: tuple) -> None:
    ge, gt, le, lt = bounds
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    parts, ok = [], True
    if ge is not None:
        parts.append(f">= {ge}")
        ok &= value >= ge
    if gt is not None:
        parts.append(f"> {gt}")
        ok &= value > gt
    if le is not None:
        parts.append(f"<= {le}")
        ok &= value <= le
    if lt is not None:
        parts.append(f"< {lt}")
        ok &= value < lt
    if isinstance(value, float) and math.isnan(value):
        ok = False
    if not ok:
        raise JmarlError(f"{path}: must be {' and '.join(parts)}, got {value!r}")


def _same_kind(tp: Any, value: Any) -> bool:
    """Whether `value` is of the kind annotation `tp` takes (a mapping for a section or a dict,
    a list for a sequence, a string for a str or a string Literal, ...), whatever its contents."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return any(type(value) is type(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(_same_kind(a, value) for a in typing.get_args(tp))
    if origin in (tuple, list, collections.abc.Sequence):
        return isinstance(value, (list, tuple))
    if origin in (dict, collections.abc.Mapping) or dataclasses.is_dataclass(tp):
        return isinstance(value, Mapping)
    if tp in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Validates `value` against annotation `tp` and converts it (lists -> tuples, int -> float)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        hint = _suggest(str(value), [str(a) for a in args]) if isinstance(value, str) else ""
        msg = f"{path}: must be one of {', '.join(repr(a) for a in args)}; got {_show(value)}"
        raise JmarlError(msg + (f" — did you mean {hint!r}?" if hint else ""))
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_null = [a for a in args if a is not type(None)]
        errors = []
        for option in non_null:
            try:
                return _convert(option, value, path)
            except JmarlError as e:
                errors.append(e)
        if len(non_null) == 1:
            raise errors[0]
        # The one option of the value's kind (a mapping for a section, a string for a choice)
        # explains best what is wrong with it; with none or several, name every option.
        fitting = [e for option, e in zip(non_null, errors) if _same_kind(option, value)]
        if len(fitting) == 1:
            raise fitting[0]
        raise _wrong_type(path, tp, value)
    if origin in (tuple, list, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise _wrong_type(path, tp, value)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis) and args:
            if len(value) != len(args):
                raise JmarlError(f"{path}: expected a list of {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise _wrong_type(path, tp, value)
        ktp, vtp = args if args else (Any, Any)
        return {
            _convert(ktp, k, f"{path} key"): _convert(vtp, v, _join(path, str(k))) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _wrong_type(path, tp, value)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong_type(path, tp, value)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _wrong_type(path, tp, value)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _wrong_type(path, tp, value)
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise _wrong_type(path, tp, value)
        return value
    return value


# Keys older configs may hold that are no longer settings: dotted key -> why, and what to do.
_REMOVED_KEYS: dict[str, str] = {
    "train.ref_policy": (
        "the KL reference is always a frozen copy of the policy RL starts from (the warm-started "
        "one; a LoRA policy's base), and none is built when train.kl_beta is 0; remove the key "
        "(ref_policy: none meant train.kl_beta: 0)"
    ),
}


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Builds dataclass `cls` from a plain dict, validating every key on the way.

    Checks: unknown keys (with a did-you-mean suggestion; a removed key, `_REMOVED_KEYS`, with
    what replaced it), missing required keys, types
    (nested dataclasses, Literal choices, Optional, tuples/lists, dicts; int accepted for float,
    bool never accepted as a number), declared ranges, then `self._validate(path)` (checks across
    fields) if the class defines it.
    `path` is the dotted prefix used in error messages.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise JmarlError(
            f"{path or 'config'}: expected a mapping (section), got {type(data).__name__} {_show(data)}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations in a foreign dataclass: check what we can
        hints = {name: (Any if isinstance(f.type, str) else f.type) for name, f in fields.items()}
    for key in data:
        if key not in fields:
            dotted = _join(path, str(key))
            if dotted in _REMOVED_KEYS:
                raise JmarlError(f"{dotted} is no longer a setting: {_REMOVED_KEYS[dotted]}")
            hint = _suggest(str(key), list(fields))
            if hint:
                raise JmarlError(f"unknown key {dotted!r} — did you mean {_join(path, hint)!r}?")
            where = f"under {path!r}" if path else "at the top level"
            raise JmarlError(f"unknown key {dotted!r}; valid keys {where}: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        dotted = _join(path, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise JmarlError(f"missing required key {dotted!r}")
            continue
        value = _convert(hints[name], data[name], dotted)
        if "range" in f.metadata:
            _check_range(dotted, value, f.metadata["range"])
        kwargs[name] = value
    try:
        obj = cls(**kwargs)
    except JmarlError as e:  # a dataclass that validates itself in __post_init__
        raise JmarlError(f"{path or 'config'}: {e}") from None
    validate = getattr(obj, "_validate", None)
    if callable(validate):
        validate(path)
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists/scalars (tuples become lists), for YAML/JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------
# Sizes in bytes
# --------------------------------------------------------------------------------------------

# Size suffixes (case-insensitive): SI powers of 1000 and binary powers of 1024.
_BYTE_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([-+]?[0-9]+))?\s*([a-z]*)\s*$", re.IGNORECASE)
BYTES_FORMS = (
    "a whole number of bytes (17179869184), a number with an exponent (16e9) or with a unit: "
    "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), case-insensitive, "
    "e.g. 80GiB, 80GB, 1.5GiB"
)


def parse_bytes(text: str | int | float) -> int:
    """A positive size in bytes from `text`: "80GiB" (80 * 2**30), "80GB" (80e9), "16e9", "512 MiB",
    "1.5gib", or a number (an int, or a float with a whole number of bytes such as YAML's 16e9).

    Suffixes are case-insensitive: B, KB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB powers
    of 1024. A fractional byte count is rounded to the nearest byte. Anything else (no number, an
    unknown unit, zero, a negative or non-finite size, a bool) raises JmarlError listing the forms.
    """
    def bad(why: str) -> JmarlError:
        return JmarlError(f"cannot read {text!r} as a size in bytes ({why}); write {BYTES_FORMS}")

    if isinstance(text, bool):
        raise bad("a boolean is not a size")
    if isinstance(text, (int, float)):
        value = float(text)
    elif isinstance(text, str):
        match = _BYTES_RE.match(text)
        if match is None:
            raise bad("expected a number and an optional unit")
        number, exponent, unit = match.groups()
        if unit.lower() not in _BYTE_UNITS:
            hint = _suggest(unit, ["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"])
            raise bad(f"unknown unit {unit!r}" + (f", did you mean {hint!r}?" if hint else ""))
        try:
            value = float(number) * 10.0 ** int(exponent or 0) * _BYTE_UNITS[unit.lower()]
        except OverflowError:
            value = math.inf
    else:
        raise bad(f"expected a string or a number, got {type(text).__name__}")
    if not math.isfinite(value) or value < 1:
        raise bad("must be at least 1 byte")
    return int(round(value))


# --------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------

# algo.name: a registered method (`jmarl.algos.METHODS`) or `package.module:NAME` for your own
AlgoName = str
PlanName = Literal["independent", "tree", "joint", "node_wise", "shared"]
DType = Literal["float32", "bfloat16", "float16"]
# model.remat: auto = "full" from `jmarl.models.config.REMAT_AUTO_MIN_PARAMS` (1e8) parameters
# up, else "none" (`jmarl.models.config.resolve_remat`, the rule a ModelConfig applies too); the
# others as `jmarl.models.config.REMAT_POLICIES` (true = full, false = none).
RematName = Literal["auto", "none", "full", "dots"]
# model.attention: `jmarl.models.config.ATTENTION_IMPLS` (auto picks per platform).
AttentionName = Literal["auto", "xla", "cudnn", "splash", "blockwise"]


@dataclass(frozen=True)
class ArchConfig:
    """A built-in decoder-only architecture built from scratch (tests, CPU quickstart).

    Field names follow `jmarl.models.ModelConfig` (and Hugging Face's config.json). None
    means: vocab_size from the tokenizer; head_dim = hidden_size // num_heads; qkv_bias and
    qk_norm as the family has them (qwen2: q/k/v biases; qwen3: q/k norms).
    """

    model_type: Literal["qwen3", "qwen2", "llama"] = "qwen3"
    vocab_size: int | None = _field(None, ge=2)
    hidden_size: int = _field(64, ge=1)
    intermediate_size: int = _field(128, ge=1)
    num_layers: int = _field(2, ge=1)
    num_heads: int = _field(4, ge=1)
    num_kv_heads: int = _field(2, ge=1)
    head_dim: int | None = _field(None, ge=2)
    max_position_embeddings: int = _field(2048, ge=8)
    rope_theta: float = _field(10000.0, gt=0.0)
    rms_norm_eps: float = _field(1e-6, gt=0.0)
    tie_word_embeddings: bool = True
    qkv_bias: bool | None = None
    qk_norm: bool | None = None

    def _validate(self, path: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise JmarlError(
                f"{path}.num_heads ({self.num_heads}) must be a multiple of "
                f"{path}.num_kv_heads ({self.num_kv_heads})"
            )
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % self.num_heads:
                raise JmarlError(
                    f"{path}.hidden_size ({self.hidden_size}) must be divisible by {path}.num_heads "
                    f"({self.num_heads}), or set {path}.head_dim"
                )
            head_dim = self.hidden_size // self.num_heads
        if head_dim % 2:
            raise JmarlError(f"{path}.head_dim: must be even (rotary embeddings), got {head_dim}")


@dataclass(frozen=True)
class ModelSpec:
    """Which network to train: a local Hugging Face checkpoint (`path`) or a built-in `preset`.

    `preset` is either the name of a published shape (`qwen3-1.7b`, see
    `jmarl.models.presets.PRESETS`; randomly initialised at its real size) or an `ArchConfig`
    mapping (a small architecture built from scratch). The trainer turns the spec into a
    `jmarl.models.ModelConfig` (`jmarl.train.policies.build_model`). Trained parameters are
    stored in float32 (`param_dtype`) and multiplied in `compute_dtype`; only a frozen LoRA base
    may be stored in bfloat16/float16 (`Config` checks this).
    """

    # a local HF directory (config.json + safetensors), a .gguf file, or a registered model name
    # (`python -m jmarl.models.fetch --list`; fetched once into $JMARL_CACHE)
    path: str | None = None
    preset: str | ArchConfig | None = None  # a preset name (qwen3-1.7b) or an ArchConfig mapping
    compute_dtype: DType = "float32"  # dtype of the matmuls (norms/softmax/log-probs stay f32)
    param_dtype: DType = "float32"  # storage dtype (float32 for trained parameters)
    # recompute activations in the backward pass: auto (full from 1e8 parameters up, else none),
    # none, full (keep each layer's input only), dots (also keep matmul outputs); true = full
    remat: bool | RematName = "auto"
    attention: AttentionName = "auto"  # attention kernel; auto: per platform (jmarl.models.attention)

    def __post_init__(self) -> None:
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")

    def _validate(self, path: str) -> None:
        if (self.path is None) == (self.preset is None):
            raise JmarlError(
                f"{path or 'model'}: set exactly one of {_join(path, 'path')} (a local Hugging Face "
                f"checkpoint) or {_join(path, 'preset')} (a preset name or a built-in architecture); to "
                f"switch on the command line, set the other one to null (e.g. {_join(path, 'preset')}=null)"
            )
        if isinstance(self.preset, str):
            check_preset_name(self.preset, _join(path or "model", "preset"))


def check_preset_name(name: str, setting: str = "model.preset") -> str:
    """The canonical (lower-case) preset name of `name`; an unknown name is a JmarlError naming
    `setting`, listing the presets, with a did-you-mean."""
    from jmarl.models.presets import preset_names

    names = preset_names()
    key = name.strip().lower()
    if key in names:
        return key
    hint = _suggest(key, names)
    msg = (
        f"{setting}: unknown preset {name!r}; presets: {', '.join(names)} (or a mapping of "
        f"architecture fields such as {{model_type: qwen3, hidden_size: 64, num_layers: 2}}, or "
        f"set {setting.rpartition('.')[0] or 'model'}.path to a local checkpoint)"
    )
    raise JmarlError(msg + (f" — did you mean {hint!r}?" if hint else ""))


@dataclass(frozen=True)
class EnvConfig:
    """The task: a registered env name and the options passed to `jmarl.envs.make`."""

    name: str = "plan_path"
    options: dict[str, Any] = _field(factory=dict)

    def _validate(self, path: str) -> None:
        from jmarl.envs import registered

        names = registered()
        if self.name not in names and ":" not in self.name:
            hint = _suggest(self.name, names)
            msg = f"{_join(path, 'name')}: unknown env {self.name!r}; registered envs: {', '.join(names)}"
            raise JmarlError(msg + (f" — did you mean {hint!r}?" if hint else ""))


@dataclass(frozen=True)
class WorkflowConfig:
    """How episodes are sampled: the plan, the group size and how many tasks per step."""

    plan: PlanName = "independent"  # filled from the algorithm when not given (`Method.default_plan`)
    group_size: int = _field(4, ge=2)  # G / K per group (>= 2); from the algorithm when not given (`Method.default_group_size`)
    num_tasks: int = _field(8, ge=1)  # tasks (env seeds) per training step
    max_turns: int | None = _field(None, ge=1)  # None: the env's own limit
    options: dict[str, Any] = _field(factory=dict)  # plan-specific options
    env_workers: int | None = _field(None, ge=1)  # threads stepping a turn's env branches; None: min(8, CPUs); 1: serial


@dataclass(frozen=True)
class AlgoConfig:
    """The learning rule: a registered name or `package.module:NAME`, and its options (the
    method's options dataclass: loss and advantage settings only)."""

    name: AlgoName = "grpo"
    options: dict[str, Any] = _field(factory=dict)


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (policies.mode = lora): one adapter per policy on a frozen base."""

    rank: int = _field(8, ge=1)
    alpha: float = _field(16.0, gt=0.0)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def _validate(self, path: str) -> None:
        if not self.target_modules:
            raise JmarlError(f"{path}.target_modules: must name at least one module, e.g. [q_proj, v_proj]")


@dataclass(frozen=True)
class PolicyModel:
    """One policy of a heterogeneous run: its own network and tokenizer."""

    model: ModelSpec
    tokenizer: str | None = None  # None: the tokenizer in model.path


@dataclass(frozen=True)
class PoliciesConfig:
    """Who trains what: the agent -> policy map and how the policies are parameterised.

    shared: one policy for every agent; per_agent: one full copy per policy (stacked on a
    policy axis); lora: one adapter per policy on a frozen base; heterogeneous: different
    networks per policy, given in `models`. An empty `agent_to_policy` means: every agent its
    own policy named after it (shared: one policy named 'shared').
    """

    mode: Literal["shared", "per_agent", "lora", "heterogeneous"] = "shared"
    agent_to_policy: dict[str, str] = _field(factory=dict)
    lora: LoraConfig = _field(factory=LoraConfig)
    models: dict[str, PolicyModel] = _field(factory=dict)

    def _validate(self, path: str) -> None:
        used = set(self.agent_to_policy.values())
        if self.mode == "shared" and len(used) > 1:
            raise JmarlError(
                f"{_join(path, 'agent_to_policy')}: mode 'shared' trains one policy but the map names "
                f"{sorted(used)}; use mode per_agent, lora or heterogeneous"
            )
        if self.mode == "heterogeneous":
            if not self.models:
                raise JmarlError(
                    f"{_join(path, 'models')}: mode 'heterogeneous' needs one model entry per policy"
                )
            missing = sorted(used - set(self.models))
            if missing:
                raise JmarlError(
                    f"{_join(path, 'agent_to_policy')}: policies {missing} have no entry in "
                    f"{_join(path, 'models')}"
                )
        elif self.models:
            raise JmarlError(
                f"{_join(path, 'models')}: only used with mode 'heterogeneous' (mode is {self.mode!r})"
            )


@dataclass(frozen=True)
class SamplingConfig:
    """Generation settings for training rollouts."""

    max_new_tokens: int = _field(64, ge=1)
    temperature: float = _field(1.0, ge=0.0)  # 0: greedy
    top_p: float = _field(1.0, gt=0.0, le=1.0)
    top_k: int = _field(0, ge=0)  # 0: off
    max_prompt_len: int = _field(512, ge=1)
    # rows (completions) per device call at most: a plan's larger request is generated in
    # consecutive calls, which bounds the KV cache (see python -m jmarl.plan); null: one call
    max_rows_per_call: int | None = _field(None, ge=1)
    # static: one fixed batch per call (every row keeps its slot until the longest ends);
    # continuous: the slot engine (jmarl.models.engine): a finished row's slot takes the next
    # queued completion, rows in flight capped by kv_budget_bytes (docs/scaling.md, "Rollout engine")
    engine: Literal["static", "continuous"] = "static"
    # KV-cache bytes per device for the continuous engine's slots and shared prompt entries:
    # "4GiB", "4e9", an int (`parse_bytes`); null: a quarter of the device's memory limit, 1 GiB on CPU
    kv_budget_bytes: str | int | None = None
    engine_chunk_steps: int = _field(8, ge=1)  # decode steps between two refills of the engine's slots
    # true: a completion runs to max_new_tokens even past the tokenizer's EOS (vLLM's ignore_eos),
    # for benchmarks against fixed-length baselines; training leaves it false
    ignore_eos: bool = False

    def _validate(self, path: str) -> None:
        if self.kv_budget_bytes is not None:
            try:
                parse_bytes(self.kv_budget_bytes)
            except JmarlError as e:
                raise JmarlError(f"{_join(path, 'kv_budget_bytes')}: {e}; or null for the device's default") from None

    def kv_budget(self) -> int | None:
        """kv_budget_bytes in bytes (None: the engine derives it from the device)."""
        return None if self.kv_budget_bytes is None else parse_bytes(self.kv_budget_bytes)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup and a schedule, gradient clipping and mini-batching."""

    lr: float = _field(1e-6, gt=0.0)
    warmup_steps: int = _field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = _field(0.01, ge=0.0)
    b1: float = _field(0.9, ge=0.0, lt=1.0)
    b2: float = _field(0.999, ge=0.0, lt=1.0)
    eps: float = _field(1e-8, gt=0.0)
    grad_clip: float | None = _field(1.0, gt=0.0)  # global-norm clip; null: off
    epochs: int = _field(1, ge=1)  # passes over each step's rollouts
    minibatches: int = _field(1, ge=1)  # optimizer updates per epoch
    grad_accum: int = _field(1, ge=1)  # micro-batches accumulated per update


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised steps on expert demonstrations (`env.expert_text`) before RL; steps 0: off."""

    steps: int = _field(0, ge=0)
    lr: float = _field(1e-4, gt=0.0)
    demos: int = _field(16, ge=1)  # demonstration episodes per warm-start step


@dataclass(frozen=True)
class TrainConfig:
    """The RL loop: steps and KL regularisation. With kl_beta > 0 the KL term is to a frozen
    copy of the policy RL starts from (after the warm start, if any; a LoRA policy's reference
    is its base); with kl_beta = 0 no reference is built or scored."""

    steps: int = _field(100, ge=1)
    kl_beta: float = _field(0.0, ge=0.0)
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    recompute_old_logprobs: bool = True  # score rollouts with the training forward pass
    warm_start: WarmStartConfig = _field(factory=WarmStartConfig)
    # Before step 0 the trainer compiles its programs and checks that they fit device memory:
    # auto = on for accelerators, off on CPU. (YAML reads on/off as true/false: both accepted.)
    memory_check: bool | Literal["auto", "on", "off"] = "auto"
    # Bytes per device for that check and for the plan command: "80GiB", "80GB", "16e9", an int
    # (see `parse_bytes`; `device_memory_bytes()` reads it); None: read from the device.
    device_memory: str | int | float | None = None
    # Fraction of device memory the memory check keeps free (fragmentation, runtime buffers).
    memory_headroom: float = _field(0.1, ge=0.0, lt=1.0)
    # Persistent XLA compilation cache: "auto" (a per-user directory, see
    # `jmarl.compile_cache.directory_for`), "off", or a directory path. (YAML's off/false: "off".)
    compilation_cache: str | bool = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.memory_check, bool):
            object.__setattr__(self, "memory_check", "on" if self.memory_check else "off")
        if isinstance(self.compilation_cache, bool):
            object.__setattr__(self, "compilation_cache", "auto" if self.compilation_cache else "off")

    def _validate(self, path: str) -> None:
        if self.device_memory is not None:
            try:
                parse_bytes(self.device_memory)
            except JmarlError as e:
                raise JmarlError(f"{_join(path, 'device_memory')}: {e}; or null to read it from the device") from None
        if not self.compilation_cache.strip():
            raise JmarlError(
                f"{_join(path, 'compilation_cache')}: must be 'auto', 'off' or a directory path, got ''"
            )

    def device_memory_bytes(self) -> int | None:
        """`device_memory` in bytes (None: read it from the device)."""
        return None if self.device_memory is None else parse_bytes(self.device_memory)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation on eval seeds (disjoint from training seeds)."""

    every: int = _field(0, ge=0)  # steps between evaluations; 0: only at the end
    num_episodes: int = _field(32, ge=1)
    pass_k: int = _field(1, ge=1)
    greedy: bool = True

    def _validate(self, path: str) -> None:
        if self.pass_k > 1 and self.greedy:
            raise JmarlError(
                f"{_join(path, 'pass_k')} = {self.pass_k} needs sampling: set {_join(path, 'greedy')}=false "
                f"or {_join(path, 'pass_k')}=1"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints under <output_dir>/checkpoints."""

    every: int = _field(0, ge=0)  # steps between saves; 0: only at the end
    keep: int = _field(3, ge=1)  # most recent checkpoints kept


@dataclass(frozen=True)
class LoggingConfig:
    """What is written to <output_dir> besides metrics.jsonl and summary.json."""

    tensorboard: bool = True
    plots: bool = True
    progress: bool = True


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes (see `jmarl.sharding.make_mesh`); one axis may be -1: all
    remaining devices (data -1: data parallel, fsdp -1: parameters sharded over them).

    The product may be smaller than the device count (the mesh then uses the first devices),
    never larger. The default (all 1) runs unsharded on one device.
    """

    data: int = _field(1, ge=-1)
    fsdp: int = _field(1, ge=-1)
    tensor: int = _field(1, ge=-1)
    policy: int = _field(1, ge=-1)

    def _validate(self, path: str) -> None:
        for name, size in self.axes().items():
            if size == 0:
                raise JmarlError(f"{_join(path, name)}: must be >= 1, or -1 for all remaining devices")
        filled = [name for name, size in self.axes().items() if size == -1]
        if len(filled) > 1:
            raise JmarlError(f"{path or 'mesh'}: only one axis may be -1 (all remaining devices), got {', '.join(filled)}")

    def axes(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "policy": self.policy}


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host runs: how `jax.distributed.initialize` is called before any device is used.

    initialize: 'auto' initializes when a coordinator is given here or the environment names one
    (JAX_COORDINATOR_ADDRESS, a multi-task SLURM/Open MPI job, a multi-host TPU slice); 'always'
    calls it even without (a TPU pod finds its peers itself); 'never' runs single-process.
    """

    initialize: Literal["auto", "always", "never"] = "auto"
    coordinator_address: str | None = None  # host:port of process 0; None: from the environment
    num_processes: int | None = _field(None, ge=1)
    process_id: int | None = _field(None, ge=0)

    def _validate(self, path: str) -> None:
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise JmarlError(
                f"{_join(path, 'process_id')}: must be < num_processes ({self.num_processes}), got {self.process_id}"
            )
        if self.coordinator_address is not None and self.initialize == "never":
            raise JmarlError(f"{_join(path, 'initialize')}: 'never' contradicts coordinator_address; remove one")


@dataclass(frozen=True)
class SandboxConfig:
    """The code sandbox (`jmarl.envs.sandbox`, docs/sandbox.md) that runs model-written programs."""

    # strict: refuse to run model-written code where the sandbox cannot keep it off this user's
    # files (no namespaces: level 'rlimits'); allow_weak: run it there anyway (the run logs the level)
    isolation: Literal["strict", "allow_weak"] = "strict"


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run: what to train (model, policies), on what (env, workflow), how (algo, optim)."""

    seed: int = _field(0, ge=0)
    output_dir: str = "runs/default"
    resume: bool = False  # continue from the latest checkpoint in output_dir
    env: EnvConfig
    algo: AlgoConfig
    model: ModelSpec | None = None  # every policy's network (heterogeneous: policies.models)
    tokenizer: str | None = None  # 'char', a tokenizer directory or .gguf file; None: model.path's
    workflow: WorkflowConfig = _field(factory=WorkflowConfig)
    policies: PoliciesConfig = _field(factory=PoliciesConfig)
    sampling: SamplingConfig = _field(factory=SamplingConfig)
    optim: OptimConfig = _field(factory=OptimConfig)
    train: TrainConfig = _field(factory=TrainConfig)
    eval: EvalConfig = _field(factory=EvalConfig)
    checkpoint: CheckpointConfig = _field(factory=CheckpointConfig)
    logging: LoggingConfig = _field(factory=LoggingConfig)
    mesh: MeshConfig = _field(factory=MeshConfig)
    distributed: DistributedConfig = _field(factory=DistributedConfig)
    sandbox: SandboxConfig = _field(factory=SandboxConfig)

    def _validate(self, path: str) -> None:
        if self.policies.mode == "heterogeneous":
            if self.model is not None or self.tokenizer is not None:
                raise JmarlError(
                    "model: with policies.mode=heterogeneous each policy's network and tokenizer are given "
                    "under policies.models.<policy>; remove the top-level model/tokenizer"
                )
            for name, entry in self.policies.models.items():
                _check_tokenizer(entry.model, entry.tokenizer, f"policies.models.{name}")
                _check_master_dtype(entry.model, self.policies.mode, f"policies.models.{name}.model")
        else:
            if self.model is None:
                raise JmarlError("missing required key 'model': set model.path or model.preset")
            _check_tokenizer(self.model, self.tokenizer, "")
            _check_master_dtype(self.model, self.policies.mode, "model")
        if self.algo.name == "hacpo" and self.workflow.plan != "shared":
            raise JmarlError(
                f"workflow.plan: hacpo shares rollouts between agents and needs plan 'shared', "
                f"got {self.workflow.plan!r}"
            )
        if self.policies.mode == "heterogeneous" and self.algo.name in ("grpo", "dr_grpo", "dapo", "gspo"):
            raise JmarlError(
                "policies.mode: 'heterogeneous' needs a multi-agent algorithm, "
                f"algo.name is {self.algo.name!r}"
            )


def agent_policy_map(policies: PoliciesConfig, agents: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(policy names, the policy index of each of `agents`) for plans that route samples by agent.

    shared: one policy (named by the map, else 'shared'). per_agent / lora: the map, or with an
    empty map every agent its own policy named after it. heterogeneous: the policies are the
    keys of `policies.models` and every agent must be mapped (the `shared` plan of HACPO does
    not route by agent: every policy answers every prompt).
    """
    mapping = policies.agent_to_policy
    for agent in mapping:
        if agent not in agents:
            hint = _suggest(agent, agents)
            msg = f"policies.agent_to_policy: unknown agent {agent!r}; the env's agents are {', '.join(agents)}"
            raise JmarlError(msg + (f" — did you mean {hint!r}?" if hint else ""))
    if policies.mode == "shared":
        names = tuple(sorted(set(mapping.values()))) or ("shared",)
        return names, (0,) * len(agents)
    if policies.mode == "heterogeneous":
        names = tuple(policies.models)
    elif mapping:
        names = tuple(dict.fromkeys(mapping[a] for a in agents if a in mapping))
    else:
        return tuple(agents), tuple(range(len(agents)))
    missing = [a for a in agents if a not in mapping]
    if missing:
        raise JmarlError(
            f"policies.agent_to_policy: agents {missing} have no policy; map every agent "
            f"({', '.join(agents)}) to a policy"
        )
    return names, tuple(names.index(mapping[a]) for a in agents)


def _check_master_dtype(model: ModelSpec, mode: str, path: str) -> None:
    """Trained parameters are stored in float32: AdamW updates of bfloat16/float16 weights are
    mostly rounded away (at lr 1e-6 about 2% of the weights change at all). Only a frozen LoRA
    base (mode lora; its float32 adapters are what trains) may be stored in low precision."""
    if model.param_dtype == "float32" or mode == "lora":
        return
    lora = "" if mode == "heterogeneous" else (
        f" (or policies.mode=lora to train float32 adapters on a frozen {model.param_dtype} base)"
    )
    raise JmarlError(
        f"{path}.param_dtype: {model.param_dtype} parameters barely train with AdamW (most updates "
        f"round away), and policies.mode={mode} trains them; keep float32 master parameters and "
        f"compute in bfloat16: {path}.param_dtype=float32 {path}.compute_dtype=bfloat16{lora}"
    )


def _check_tokenizer(model: ModelSpec, tokenizer: str | None, path: str) -> None:
    """A preset model has no tokenizer of its own: one must be named."""
    if tokenizer is None and model.path is None:
        key = _join(path, "tokenizer")
        raise JmarlError(
            f"{key}: a preset model needs a tokenizer: set {key}=char or a local tokenizer directory"
        )


# --------------------------------------------------------------------------------------------
# Options validated against registries in other packages (imported lazily)
# --------------------------------------------------------------------------------------------


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
    "kl_coef": ("a run setting", "train.kl_beta"),
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
    filled in: kl_coef/kl_kind from train.kl_beta/kl_kind, and norm_length (when the method has
    it and algo.options does not set it) from sampling.max_new_tokens, the completion budget:
    a length normaliser that is a constant of the run, never the padded batch width."""
    method = _method(config)
    cls = method.config
    own = _settings(cls)
    opts = dict(config.algo.options)
    _check_homes(config, "algo", opts, own - {"kl_coef", "kl_kind"}, ("workflow", _all_plan_settings() - own))
    if "kl_coef" in own:
        opts["kl_coef"] = config.train.kl_beta
    if "kl_kind" in own:
        opts["kl_kind"] = config.train.kl_kind
    if "norm_length" in own and opts.get("norm_length") is None:
        opts["norm_length"] = config.sampling.max_new_tokens
    return from_dict(cls, opts, "algo.options")


def plan_options(config: Config) -> Any:
    """The sampling plan's typed options from workflow.options, with group_size from
    workflow.group_size and max_turns from workflow.max_turns. Run inputs (fields marked
    `input`, e.g. the memory or the tokenizers) are refused: the run sets them."""
    plans = _plan_registry()
    if config.workflow.plan not in plans:
        raise JmarlError(f"workflow.plan: {config.workflow.plan!r} is not a plan; choose one of {', '.join(sorted(plans))}")
    cls = plans[config.workflow.plan].options
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
    """Checks algo, workflow and env options (and the agent map)."""
    algo_options(config)
    plan_options(config)
    _validate_env(config)


def _validate_env(config: Config) -> None:
    """Checks env options against the env's dataclass, builds the env and checks the agent map.

    Skipped while the env's module is not in this checkout.
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
    if _plan_registry()[config.workflow.plan].routes_by_agent:  # else every policy answers every prompt
        agent_policy_map(config.policies, tuple(built.agents))


# --------------------------------------------------------------------------------------------
# Loading, overrides, dumping
# --------------------------------------------------------------------------------------------


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    """The mapping in YAML file `path` (an empty file is {})."""
    p = Path(path)
    if not p.is_file():
        raise JmarlError(f"config file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JmarlError(f"cannot read config file {p}: {e}") from None
    data = parse_yaml(text, f"config file {p}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JmarlError(
            f"config file {p}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def apply_override(data: dict[str, Any], override: str) -> dict[str, Any]:
    """A copy of `data` with one `dotted.key=value` override applied (value parsed as YAML)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise JmarlError(f"bad override {override!r}: expected key=value, e.g. train.steps=10")
    value = parse_yaml(text, f"override {override!r}") if text.strip() else None
    parts = key.split(".")
    out = dict(data)
    node = out
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            raise JmarlError(
                f"bad override {override!r}: {'.'.join(parts[: i + 1])!r} is a value, not a section"
            )
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = value
    return out


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Validates a merged config dict into a `Config` (fills `workflow.plan` and
    `workflow.group_size` from the method's defaults where they are not given)."""
    data = dict(data)
    algo = data.get("algo")
    workflow = data.get("workflow")
    name = algo.get("name", "grpo") if isinstance(algo, Mapping) else "grpo" if algo is None else None
    if isinstance(name, str) and (workflow is None or isinstance(workflow, Mapping)):
        method = method_named(name)
        defaults = {"plan": method.default_plan, "group_size": method.default_group_size}
        data["workflow"] = {**defaults, **(workflow or {})}
    config = from_dict(Config, data)
    _apply_sandbox(config)
    validate_options(config)
    return config


def _apply_sandbox(config: Config) -> None:
    """Sets the sandbox's isolation policy; for an env that runs model-written programs, checks
    the isolation level now, so that a refused level stops the run before it starts (the level
    is logged when the first program runs)."""
    from jmarl.envs import base, sandbox

    sandbox.set_isolation_policy(config.sandbox.isolation)
    try:
        cls = base.env_class(config.env.name)
    except Exception:  # an unknown env is reported by validate_options
        return
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if fields & {"program_timeout_s", "test_timeout_s"}:  # the tool agents, the code task
        sandbox.require_isolation(log=False)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Reads YAML file `path` (None: start from {}), applies `key=value` overrides, validates."""
    data = read_yaml_file(path) if path is not None else {}
    for override in overrides:
        data = apply_override(data, override)
    return config_from_dict(data)


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as plain dicts/lists/scalars (what `dump_yaml` writes)."""
    return to_dict(config)


def dump_yaml(config: Config) -> str:
    """The config as YAML text; `load_config` on it gives an equal `Config`."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)
