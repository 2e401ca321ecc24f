"""Config: generic validation, YAML + overrides, schema checks, options registries, configs/."""

import dataclasses
import math
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import pytest

import jmarl.algos
import jmarl.workflows
from jmarl import config as C
from jmarl.config import convert
from jmarl.config import (
    Config,
    algo_options,
    apply_override,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    from_dict,
    load_config,
    parse_yaml,
    plan_options,
)
from jmarl.envs import base as env_base
from jmarl.errors import JmarlError

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((ROOT / "configs").rglob("*.yaml"))

MINIMAL = {
    "env": {"name": "plan_path"},
    "algo": {"name": "grpo"},
    "model": {"preset": {"num_layers": 1}},
    "tokenizer": "char",
}


def make(**sections: Any) -> Config:
    """A validated Config from MINIMAL with some sections replaced."""
    return config_from_dict({**MINIMAL, **sections})


# ------------------------------------------------------------------------------ from_dict


@dataclass(frozen=True)
class Inner:
    rate: float = convert._field(0.5, ge=0.0, le=1.0)
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outer:
    name: str
    count: int = convert._field(1, ge=1)
    mode: Literal["a", "bb"] = "a"
    limit: int | None = None
    flag: bool = False
    pair: tuple[int, float] = (0, 0.0)
    items: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)
    maybe: Inner | None = None
    either: bool | Literal["x", "yy"] | Inner = False

    def _validate(self, path: str) -> None:
        if self.limit is not None and self.limit < self.count:
            raise JmarlError(f"{path}.limit must be >= {path}.count")


def test_from_dict_builds_nested_and_converts():
    got = from_dict(
        Outer,
        {"name": "x", "count": 3, "mode": "bb", "limit": None, "flag": True, "pair": [1, 2],
         "items": [4, 5], "extra": {"k": [1]}, "inner": {"rate": 1, "tags": ["p", "q"]},
         "maybe": {}},
        "root",
    )
    assert got == Outer(name="x", count=3, mode="bb", limit=None, flag=True, pair=(1, 2.0),
                        items=[4, 5], extra={"k": [1]}, inner=Inner(rate=1.0, tags=("p", "q")),
                        maybe=Inner())
    assert type(got.inner.rate) is float and type(got.pair[1]) is float  # int accepted for float
    assert from_dict(Outer, {"name": "y"}) == Outer(name="y")
    assert [from_dict(Outer, {"name": "y", "either": v}).either for v in (True, "yy", {"rate": 0.25})] == [
        True, "yy", Inner(rate=0.25)]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"name": "x", "cuont": 2}, "unknown key 'root.cuont' — did you mean 'root.count'?"),
        ({"name": "x", "inner": {"rte": 0.1}},
         "unknown key 'root.inner.rte' — did you mean 'root.inner.rate'?"),
        ({"name": "x", "zzz": 1}, "unknown key 'root.zzz'; valid keys under 'root': name, count, mode"),
        ({}, "missing required key 'root.name'"),
        ({"name": 5}, "root.name: expected str, got int 5"),
        ({"name": "x", "count": 2.5}, "root.count: expected int, got float 2.5"),
        ({"name": "x", "count": True}, "root.count: expected int, got bool True"),
        ({"name": "x", "inner": {"rate": False}}, "root.inner.rate: expected float, got bool False"),
        ({"name": "x", "flag": 1}, "root.flag: expected bool, got int 1"),
        ({"name": "x", "flag": "yes please"}, "root.flag: expected bool, got str 'yes please'"),
        ({"name": "x", "mode": "b"}, "root.mode: must be one of 'a', 'bb'; got 'b' — did you mean 'bb'?"),
        ({"name": "x", "limit": "3"}, "root.limit: expected int, got str '3'"),
        ({"name": "x", "pair": [1]}, "root.pair: expected a list of 2 items, got 1"),
        ({"name": "x", "items": [1, "2"]}, r"root.items\[1\]: expected int, got str '2'"),
        ({"name": "x", "items": 3}, "root.items: expected list, got int 3"),
        ({"name": "x", "extra": [1]}, "root.extra: expected mapping, got list"),
        ({"name": "x", "inner": 3}, "root.inner: expected a mapping"),
        ({"name": "x", "count": 0}, "root.count: must be >= 1, got 0"),
        ({"name": "x", "inner": {"rate": 1.5}}, r"root.inner.rate: must be >= 0.0 and <= 1.0, got 1.5"),
        ({"name": "x", "inner": {"rate": math.nan}}, "root.inner.rate: must be >= 0.0 and <= 1.0, got nan"),
        ({"name": "x", "count": 3, "limit": 2}, "root.limit must be >= root.count"),
        # a union reports the error of the one option of the value's kind (choice or section)
        ({"name": "x", "either": "y"}, "root.either: must be one of 'x', 'yy'; got 'y' — did you mean 'yy'?"),
        ({"name": "x", "either": {"rate": 2}}, "root.either.rate: must be >= 0.0 and <= 1.0, got 2"),
        ({"name": "x", "either": {"rte": 2}}, "unknown key 'root.either.rte' — did you mean 'root.either.rate'?"),
        ({"name": "x", "either": 3},
         "root.either: expected bool or one of 'x', 'yy' or mapping .section., got int 3"),
    ],
)
def test_from_dict_errors_name_the_key(data, message):
    with pytest.raises(JmarlError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        from_dict(Outer, data, "root")


def test_yaml_reads_exponents_without_a_dot_as_floats():
    assert parse_yaml("a: 1e-6\nb: -2E+3\nc: 1.5\nd: .inf\ne: 7\nf: 1_000\ng: '1e-6'\nh: 1.0e-3", "t") == {
        "a": 1e-6, "b": -2000.0, "c": 1.5, "d": math.inf, "e": 7, "f": 1000, "g": "1e-6", "h": 1e-3}
    message = r"cannot parse t at line 2, column 4: found character .@. that cannot start any token"
    with pytest.raises(JmarlError, match=message):
        parse_yaml("a: 1\nb: @x\n", "t")


# ------------------------------------------------------------------------------ overrides and files


def test_overrides_set_nested_values_parsed_as_yaml():
    data = {"train": {"steps": 5}, "env": {"name": "x"}}
    out = apply_override(data, "train.steps=10")
    out = apply_override(out, "algo.clip_high=0.28")
    out = apply_override(out, "policies.lora.target_modules=[q_proj, v_proj]")
    out = apply_override(out, "model.path=null")
    out = apply_override(out, "logging.plots=false")
    out = apply_override(out, "env.options.expr=a=b")  # only the first '=' splits
    out = apply_override(out, "tokenizer=")  # empty value: null
    assert out == {
        "train": {"steps": 10},
        "env": {"name": "x", "options": {"expr": "a=b"}},
        "algo": {"clip_high": 0.28},
        "policies": {"lora": {"target_modules": ["q_proj", "v_proj"]}},
        "model": {"path": None},
        "logging": {"plots": False},
        "tokenizer": None,
    }
    assert data == {"train": {"steps": 5}, "env": {"name": "x"}}  # input untouched


@pytest.mark.parametrize("bad", ["train.steps", "=3", "train..steps=3", ".steps=1", "train.=1"])
def test_bad_override_syntax(bad):
    with pytest.raises(JmarlError, match=f"bad override '{bad}': expected key=value, e.g. train.steps=10"):
        apply_override({}, bad)


def test_override_through_a_value_is_an_error():
    with pytest.raises(JmarlError, match="'train.steps' is a value, not a section"):
        apply_override({"train": {"steps": 3}}, "train.steps.x=1")


def test_load_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(JmarlError, match=f"config file not found: {tmp_path / 'nope.yaml'}"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(JmarlError, match=f"cannot parse config file {bad} at line 3"):
        load_config(bad)
    top_list = tmp_path / "list.yaml"
    top_list.write_text("- 1\n- 2\n")
    with pytest.raises(JmarlError, match=f"config file {top_list}: the top level must be a mapping"):
        load_config(top_list)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(JmarlError, match=f"cannot read config file {binary}"):
        load_config(binary)


def test_load_config_applies_overrides_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(dump_yaml(make()))
    config = load_config(path, ["train.steps=7", "optim.lr=2e-5", "train.steps=9", "policies.mode=per_agent"])
    assert config.train.steps == 9 and config.optim.lr == 2e-5 and config.policies.mode == "per_agent"
    base = make()
    assert dataclasses.replace(config, train=base.train, optim=base.optim, policies=base.policies) == base


# ------------------------------------------------------------------------------ the schema


def test_defaults_and_plan_from_algorithm():
    assert make().workflow.plan == "independent"
    for algo, plan in [("at_grpo", "tree"), ("magrpo", "joint"), ("joyagents", "node_wise")]:
        assert make(algo={"name": algo}).workflow.plan == plan
    assert make(algo={"name": "at_grpo"}, workflow={"plan": "independent"}).workflow.plan == "independent"
    config = make(algo={"name": "hacpo"}, workflow={"group_size": 8})
    assert config.workflow.plan == "shared" and config.workflow.group_size == 8


def test_group_size_defaults_to_the_algorithms_own():
    """G comes from the method when workflow.group_size is not given: JoyAgents-R1 and HACPO use 8
    (so JoyAgents' memory, which needs G >= 6 at z = 1.96, works out of the box), the rest 4; an
    explicit group size always wins. The memory warns, when the run builds it, if G is too small."""
    from jmarl.algos import MethodContext, joyagents
    from jmarl.workflows.memory import MemoryGroupSizeWarning

    assert make().workflow.group_size == 4
    for algo, g in [("grpo", 4), ("magrpo", 4), ("at_grpo", 4), ("hacpo", 8), ("joyagents", 8)]:
        assert make(algo={"name": algo}).workflow.group_size == g
        assert make(algo={"name": algo}, workflow={"num_tasks": 2}).workflow.group_size == g
    joy = make(algo={"name": "joyagents"})
    assert plan_options(joy).group_size == 8
    assert make(algo={"name": "joyagents"}, workflow={"group_size": 6}).workflow.group_size == 6

    def memory(group_size):
        config = make(algo={"name": "joyagents"}, workflow={"group_size": group_size})
        context = MethodContext(num_policies=1, group_size=group_size, plan_options=plan_options(config))
        return joyagents.METHOD.init_state(algo_options(config), context)

    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryGroupSizeWarning)
        assert memory(8) is not None
    with pytest.warns(MemoryGroupSizeWarning, match="group_size >= 6"):
        memory(4)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"optim": {"lr": -1e-3}}, "optim.lr: must be > 0.0, got -0.001"),
        ({"workflow": {"group_size": 1}}, "workflow.group_size: must be >= 2, got 1"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p: must be > 0.0 and <= 1.0, got 1.5"),
        ({"optim": {"b2": 1.0}}, "optim.b2: must be >= 0.0 and < 1.0, got 1.0"),
        ({"train": {"steps": 0}}, "train.steps: must be >= 1, got 0"),
        ({"checkpoint": {"keep": 0}}, "checkpoint.keep: must be >= 1, got 0"),
        ({"seed": -1}, "seed: must be >= 0, got -1"),
        ({"mesh": {"data": 0}}, "mesh.data: must be >= 1, or -1 for all remaining devices"),
        ({"mesh": {"tensor": -2}}, "mesh.tensor: must be >= -1, got -2"),
        ({"mesh": {"data": -1, "fsdp": -1}}, "mesh: only one axis may be -1"),
        ({"algo": {"name": "grpoo"}},
         "algo.name: unknown algorithm 'grpoo'; choose one of at_grpo, dapo, dr_grpo, grpo, gspo, hacpo, joyagents, magrpo "
         r"\(or give your own Method as 'package.module:NAME'\) — did you mean 'grpo'\?"),
        ({"env": {"name": "sokobn"}},
         "env.name: unknown env 'sokobn'; registered envs: .* — did you mean 'sokoban'?"),
        ({"optim": {"schedule": "cosin"}}, "optim.schedule: .* did you mean 'cosine'?"),
        ({"train": {"kl_coef": 0.1, "ref_policy": "initial"}},
         r"train.ref_policy is no longer a setting: the KL reference is always a frozen copy .* remove the key"),
        ({"train": {"ref_policy": "none"}}, r"train.ref_policy is no longer a setting: .*ref_policy: none meant train.kl_coef: 0\)$"),
        ({"train": {"kl_beta": 0.1}}, r"train.kl_beta is no longer a setting: the KL weight is train.kl_coef .*rename the key$"),
        ({"eval": {"pass_k": 4}}, "eval.pass_k = 4 needs sampling: set eval.greedy=false"),
        ({"model": {"preset": {}, "path": "/m"}}, "model: set exactly one of model.path"),
        ({"model": {}}, "model: set exactly one of model.path"),
        ({"model": {"preset": {"num_heads": 4, "num_kv_heads": 3}}},
         "model.preset.num_heads .4. must be a multiple"),
        ({"model": {"preset": {"hidden_size": 30, "num_heads": 4}}},
         "model.preset.hidden_size .30. must be divisible"),
        ({"model": {"preset": {"hidden_size": 36, "num_heads": 4}}}, "model.preset.head_dim: must be even"),
        ({"model": {"preset": "qwen3-9b"}}, "model.preset: unknown preset 'qwen3-9b'; presets: qwen3-0.6b, "),
        ({"model": {"preset": {}, "remat": "yes"}}, "model.remat: must be one of 'auto', 'none', 'full', 'dots'"),
        ({"model": {"preset": {}, "chat_template": "gema"}},
         "model.chat_template: 'gema' is neither a template name .plain, gemma. nor Jinja text"),
        ({"model": {"preset": {}, "param_dtype": "bfloat16"}},
         "model.param_dtype: bfloat16 parameters barely train with AdamW"),
        ({"tokenizer": None}, "tokenizer: a preset model needs a tokenizer"),
        ({"workflow": {"plan": "tree", "grop_size": 3}},
         "unknown key 'workflow.grop_size' — did you mean 'workflow.group_size'?"),
        ({"policies": {"agent_to_policy": {"tool": "a", "planner": "b"}}},
         "policies.agent_to_policy: mode 'shared' trains one policy"),
        ({"algo": {"name": "at_grpo"},
          "policies": {"mode": "heterogeneous", "models": {"a": {"model": {"path": "/m"}}}}},
         "model: with policies.mode=heterogeneous"),
        ({"algo": {"name": "at_grpo"}, "policies": {"mode": "heterogeneous"}},
         "policies.models: mode 'heterogeneous' needs one model entry per policy"),
        ({"algo": {"name": "hacpo"}, "workflow": {"plan": "tree"}},
         "workflow.plan: 'tree' cannot train algo.name 'hacpo': it needs plan 'shared'"),
        ({"policies": {"models": {"a": {"model": {"path": "/m"}}}}},
         "policies.models: only used with mode 'heterogeneous'"),
    ],
)
def test_schema_errors(sections, message):
    with pytest.raises(JmarlError, match="^" + message):
        make(**sections)


def test_missing_sections_are_reported():
    with pytest.raises(JmarlError, match="missing required key 'env'"):
        config_from_dict({"algo": {"name": "grpo"}})
    with pytest.raises(JmarlError, match="missing required key 'model': set model.path or model.preset"):
        config_from_dict({"env": {"name": "plan_path"}, "algo": {"name": "grpo"}})


def test_heterogeneous_policies():
    hetero = {
        "mode": "heterogeneous",
        "agent_to_policy": {"solver": "qwen"},
        "models": {
            "qwen": {"model": {"path": "/m/qwen"}},
            "tiny": {"model": {"preset": {}}, "tokenizer": "char"},
        },
    }
    config = config_from_dict({"env": {"name": "math"}, "algo": {"name": "hacpo"}, "policies": hetero})
    assert config.model is None
    assert config.policies.models["tiny"].model.preset == C.ArchConfig()
    with pytest.raises(JmarlError, match="policies.models.tiny.tokenizer: a preset model needs a tokenizer"):
        config_from_dict({"env": {"name": "math"}, "algo": {"name": "hacpo"},
                          "policies": {**hetero,
                                       "models": {**hetero["models"], "tiny": {"model": {"preset": {}}}}}})
    with pytest.raises(JmarlError, match=r"policies \['qwen'\] have no entry in policies.models"):
        config_from_dict({"env": {"name": "math"}, "algo": {"name": "hacpo"},
                          "policies": {**hetero, "models": {"tiny": hetero["models"]["tiny"]}}})


def test_dump_yaml_round_trips():
    config = make(
        algo={"name": "dapo", "options": {"clip_high": 0.28}},
        policies={"mode": "lora", "agent_to_policy": {"tool": "t", "planner": "p"},
                  "lora": {"target_modules": ["q_proj"]}},
        optim={"lr": 1e-7, "grad_clip": None},
        env={"name": "plan_path", "options": {"size": 5}},
        mesh={"data": -1},
    )
    text = dump_yaml(config)
    assert config_from_dict(parse_yaml(text, "dump")) == config
    assert config_to_dict(config)["policies"]["lora"]["target_modules"] == ["q_proj"]


# ------------------------------------------------------------------------------ options and their homes


def test_algo_options_validated_and_filled_from_the_run():
    config = make(algo={"name": "grpo", "options": {"clip_high": 0.28}}, workflow={"group_size": 6},
                  train={"kl_coef": 0.05}, sampling={"max_new_tokens": 48})
    opts = algo_options(config)
    assert (opts.clip_high, opts.kl_coef, opts.kl_kind) == (0.28, 0.05, "k3")
    assert opts.norm_length == 48  # the completion budget: a constant of the run, never the padded width
    assert algo_options(make(algo={"name": "dr_grpo", "options": {"norm_length": 7}})).norm_length == 7
    shaped = algo_options(make(algo={"name": "dapo", "options": {"overlong_buffer": 16}}, sampling={"max_new_tokens": 48}))
    assert (shaped.overlong_buffer, shaped.overlong_limit) == (16, 48)  # DAPO's L_max: the completion budget
    with pytest.raises(JmarlError, match="overlong_buffer = 64 is more than overlong_limit"):
        algo_options(make(algo={"name": "dapo", "options": {"overlong_buffer": 64}}, sampling={"max_new_tokens": 48}))
    assert plan_options(config).group_size == 6
    tree = make(algo={"name": "at_grpo"}, workflow={"group_size": 3, "max_turns": 2, "options": {"select": "first"}})
    opts = plan_options(tree)
    assert (opts.group_size, opts.max_turns, opts.select) == (3, 2, "first")
    assert plan_options(make(algo={"name": "at_grpo"})).group_size == 4


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"algo": {"name": "grpo", "options": {"clip_hihg": 0.3}}},
         "unknown key 'algo.options.clip_hihg' — did you mean 'algo.options.clip_high'?"),
        ({"algo": {"name": "grpo", "options": {"clip_high": "big"}}},
         "algo.options.clip_high: expected float"),
        ({"algo": {"name": "grpo", "options": {"normalize": "max"}}},
         "algo.options: GRPOConfig.normalize = 'max' is not supported"),
        ({"algo": {"name": "grpo", "options": {"kl_coef": 0.1}}}, "algo.options.kl_coef is a run setting: set train.kl_coef"),
        ({"algo": {"name": "at_grpo", "options": {"alpha": 0.5}}},
         "algo.options.alpha is a sampling setting: set workflow.options.alpha"),
        ({"algo": {"name": "magrpo", "options": {"joint_mode": "cross"}}},
         "algo.options.joint_mode is a sampling setting: set workflow.options.joint_mode"),
        ({"algo": {"name": "magrpo", "options": {"gamma": 0.9}}},
         "algo.options.gamma is a sampling setting: set workflow.options.gamma"),
        ({"algo": {"name": "at_grpo", "options": {"num_candidates": 2}}}, "algo.options.num_candidates is the group size: set workflow.group_size"),
        ({"algo": {"name": "joyagents", "options": {"top_k_groups": 3}}}, "algo.options.top_k_groups is a sampling setting: set workflow.options.top_k"),
        ({"algo": {"name": "at_grpo", "options": {"continue_with": "best"}}}, "algo.options.continue_with is a sampling setting: set workflow.options.select"),
        ({"algo": {"name": "no_such:METHOD"}}, "algo.name: algo.name 'no_such:METHOD' cannot be imported"),
        ({"algo": {"name": "at_grpo"}, "workflow": {"options": {"selct": "best"}}},
         "unknown key 'workflow.options.selct' — did you mean 'workflow.options.select'?"),
        ({"algo": {"name": "at_grpo"}, "workflow": {"options": {"num_candidates": 2}}},
         "workflow.options.num_candidates is the group size: set workflow.group_size"),
        ({"algo": {"name": "at_grpo"}, "workflow": {"options": {"group_size": 2}}},
         "workflow.options.group_size is the group size: set workflow.group_size"),
        ({"algo": {"name": "at_grpo"}, "workflow": {"options": {"dual_clip": 2.0}}},
         "workflow.options.dual_clip is a loss setting: set algo.options.dual_clip"),
        ({"algo": {"name": "joyagents"}, "workflow": {"options": {"memory": None}}},
         "workflow.options.memory is set by the run, not by the config"),
    ],
)
def test_options_errors(sections, message):
    with pytest.raises(JmarlError, match="^" + message):
        make(**sections)


def _method_and_plan_settings():
    from jmarl.workflows.plans import PLANS

    for name, method in sorted(jmarl.algos.METHODS.items()):
        plan = PLANS[method.default_plan].options
        loss = {f.name for f in dataclasses.fields(method.config)}
        sampling = {f.name for f in dataclasses.fields(plan) if not f.metadata.get("input")} - {"group_size", "max_turns"}
        yield name, sorted(sampling - loss), sorted(loss - sampling - {"kl_coef", "kl_kind"})


@pytest.mark.parametrize("name, sampling, loss", list(_method_and_plan_settings()))
def test_every_setting_given_in_the_other_section_names_its_home(name, sampling, loss):
    """For each method with its plan: each of the plan's settings given in algo.options, and each
    of the method's settings given in workflow.options, exits naming the section it belongs to."""
    assert sampling and loss
    for key in sampling:
        with pytest.raises(JmarlError, match=f"^algo.options.{key} is a sampling setting: set workflow.options.{key}$"):
            make(algo={"name": name, "options": {key: None}}, workflow={"group_size": 8})
    for key in loss:
        with pytest.raises(JmarlError, match=f"^workflow.options.{key} is a loss setting: set algo.options.{key}$"):
            make(algo={"name": name}, workflow={"group_size": 8, "options": {key: None}})


@dataclass(frozen=True)
class ToyEnv:
    size: int = 5
    wall_prob: float = 0.2
    agents: tuple[str, ...] = ("tool", "planner")

    def __post_init__(self):
        if self.size < 1:
            raise JmarlError(f"toy: size must be >= 1, got {self.size}")


def test_env_options_checked_against_the_env_dataclass(monkeypatch):
    module = types.ModuleType("jmarl_test_toy_env")
    module.ToyEnv = ToyEnv
    monkeypatch.setitem(sys.modules, "jmarl_test_toy_env", module)
    monkeypatch.setitem(env_base._REGISTRY, "toy", "jmarl_test_toy_env:ToyEnv")
    config = make(env={"name": "toy", "options": {"size": 7, "wall_prob": 0, "agents": ["solver"]}})
    assert config.env.options == {"size": 7, "wall_prob": 0, "agents": ["solver"]}
    message = "^unknown key 'env.options.szie' — did you mean 'env.options.size'"
    with pytest.raises(JmarlError, match=message):
        make(env={"name": "toy", "options": {"szie": 7}})
    with pytest.raises(JmarlError, match="^env.options.size: expected int, got str 'big'"):
        make(env={"name": "toy", "options": {"size": "big"}})
    message = "^unknown key 'env.options.colour'; env 'toy' takes: size, wall_prob, agents$"
    with pytest.raises(JmarlError, match=message):
        make(env={"name": "toy", "options": {"colour": 1}})
    # The env is built, and the agent -> policy map is checked against its agents.
    with pytest.raises(JmarlError, match="^env.options: toy: size must be >= 1, got 0"):
        make(env={"name": "toy", "options": {"size": 0}})
    with pytest.raises(JmarlError, match="unknown agent 'planer'; the env's agents are tool, planner"):
        make(env={"name": "toy"}, policies={"mode": "per_agent", "agent_to_policy": {"tool": "a", "planer": "b"}})
    with pytest.raises(JmarlError, match=r"agents \['solver'\] have no policy"):
        make(env={"name": "toy", "options": {"agents": ["tool", "solver"]}},
             policies={"mode": "per_agent", "agent_to_policy": {"tool": "a"}})


# ------------------------------------------------------------------------------ configs/


def test_configs_directory_is_complete():
    names = {str(p.relative_to(ROOT / "configs")) for p in CONFIG_FILES}
    assert names >= {
        "quickstart.yaml", "at_grpo/plan_path.yaml", "at_grpo/sokoban.yaml", "at_grpo/sudoku.yaml",
        "at_grpo/math.yaml", "at_grpo/code.yaml", "magrpo/writing.yaml", "magrpo/code.yaml",
        "grpo/plan_path.yaml", "dr_grpo/plan_path.yaml", "dapo/plan_path.yaml", "gspo/plan_path.yaml",
        "hacpo/math.yaml", "joyagents/router.yaml",
    }


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_file_validates_and_round_trips(path):
    """Loads (options checked against jmarl.algos/workflows/envs where they exist) and round-trips."""
    config = load_config(path)
    assert config_from_dict(parse_yaml(dump_yaml(config), "dump")) == config
    rel = path.relative_to(ROOT / "configs")
    if rel.parent == Path("real"):  # real/<algo>_<task or recipe>.yaml: a real pretrained model, CPU-sized
        assert rel.stem.startswith(f"{config.algo.name}_")
        assert config.output_dir == f"runs/real/{rel.stem}"
        specs = [config.model] if config.model else [entry.model for entry in config.policies.models.values()]
        assert all(spec.path and not spec.preset for spec in specs) and config.tokenizer is None
    elif rel.parent != Path("."):  # <algo>/<task>.yaml
        assert config.algo.name == rel.parent.name
        assert config.env.name == rel.stem.removesuffix("_tiny")  # <task>_tiny.yaml: a CPU-sized variant
        assert config.output_dir == f"runs/{rel.parent.name}/{rel.stem}"


def test_quickstart_is_cpu_sized():
    config = load_config(ROOT / "configs" / "quickstart.yaml")
    assert config.algo.name == "at_grpo" and config.workflow.plan == "tree"
    assert config.env.name == "plan_path" and config.tokenizer == "char"
    assert config.model.preset is not None and config.model.path is None
    assert config.train.warm_start.steps > 0
    assert set(config.policies.agent_to_policy) == {"tool", "planner"}
    assert config.mesh.axes() == {"data": 1, "fsdp": 1, "tensor": 1, "policy": 1}


@dataclass(frozen=True)
class Abstract:
    seq: Sequence[int] = ()
    table: Mapping[str, float] = field(default_factory=dict)


def test_abstract_sequence_and_mapping_annotations():
    assert from_dict(Abstract, {"seq": [1, 2], "table": {"a": 1}}) == Abstract(seq=(1, 2), table={"a": 1.0})
    with pytest.raises(JmarlError, match=r"^seq\[0\]: expected int, got str 'x'"):
        from_dict(Abstract, {"seq": ["x"]})
    with pytest.raises(JmarlError, match="^table.a: expected float, got str 'y'"):
        from_dict(Abstract, {"table": {"a": "y"}})


def test_agent_policy_map():
    agents = ("tool", "planner", "critic")
    shared = C.PoliciesConfig()
    assert C.agent_policy_map(shared, agents) == (("shared",), (0, 0, 0))
    own = C.PoliciesConfig(mode="per_agent")
    assert C.agent_policy_map(own, agents) == (("tool", "planner", "critic"), (0, 1, 2))
    two = C.PoliciesConfig(mode="lora", agent_to_policy={"critic": "b", "tool": "a", "planner": "b"})
    assert C.agent_policy_map(two, agents) == (("a", "b"), (0, 1, 1))
    hetero = C.PoliciesConfig(
        mode="heterogeneous",
        agent_to_policy={"tool": "llama", "planner": "qwen", "critic": "qwen"},
        models={"qwen": C.PolicyModel(C.ModelSpec(path="/q")), "llama": C.PolicyModel(C.ModelSpec(path="/l"))},
    )
    assert C.agent_policy_map(hetero, agents) == (("qwen", "llama"), (1, 0, 0))
    with pytest.raises(JmarlError, match=r"agents \['critic'\] have no policy"):
        C.agent_policy_map(C.PoliciesConfig(mode="per_agent", agent_to_policy={"tool": "a", "planner": "b"}), agents)
    with pytest.raises(JmarlError, match="unknown agent 'planer'; the env's agents are .* did you mean 'planner'"):
        C.agent_policy_map(C.PoliciesConfig(mode="per_agent", agent_to_policy={"planer": "a"}), agents)
