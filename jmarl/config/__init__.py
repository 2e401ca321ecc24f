"""Run configuration: typed frozen dataclasses, YAML files, dotted overrides, clear errors.

A run is described by one `Config`. It is read from a YAML file, then `key=value` overrides
from the command line are applied (`train.steps=10`, `policies.mode=per_agent`), then the
merged dict is validated into frozen dataclasses by `from_dict`. Every mistake a user can make
(unknown key, wrong type, value out of range, unknown algorithm or env, missing file) raises
`JmarlError` with the dotted key and the fix.

    config = load_config("configs/quickstart.yaml", ["train.steps=10"])
    print(dump_yaml(config))

The modules, one role each: `schema` (the sections as dataclasses), `convert` (typed
conversion of plain values, generic: `from_dict`, `parse_bytes`), `resolve` (options checked
against the method, plan and env registries) and `load` (YAML, overrides, dumping). Loading a
config has no side effect: what a run sets for its process is `jmarl.process.prepare_process`.
"""

from jmarl.config.convert import (  # noqa: F401
    BYTES_FORMS,
    from_dict,
    parse_bytes,
    to_dict,
)
from jmarl.config.schema import (  # noqa: F401
    AlgoConfig,
    AlgoName,
    ArchConfig,
    AttentionName,
    CheckpointConfig,
    Config,
    DType,
    DistributedConfig,
    EnvConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    MeshConfig,
    ModelSpec,
    OptimConfig,
    PlanName,
    PoliciesConfig,
    PolicyModel,
    RematName,
    RoutingReplayName,
    SamplingConfig,
    SandboxConfig,
    TrainConfig,
    WarmStartConfig,
    WorkflowConfig,
    agent_policy_map,
    check_preset_name,
    routing_replay_refused,
)
from jmarl.config.resolve import (  # noqa: F401
    algo_options,
    method_named,
    plan_options,
    validate_options,
)
from jmarl.config.load import (  # noqa: F401
    apply_override,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    parse_yaml,
    read_yaml_file,
)

__all__ = [
    "AlgoConfig",
    "AlgoName",
    "ArchConfig",
    "AttentionName",
    "BYTES_FORMS",
    "CheckpointConfig",
    "Config",
    "DType",
    "DistributedConfig",
    "EnvConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "MeshConfig",
    "ModelSpec",
    "OptimConfig",
    "PlanName",
    "PoliciesConfig",
    "PolicyModel",
    "RematName",
    "RoutingReplayName",
    "SamplingConfig",
    "SandboxConfig",
    "TrainConfig",
    "WarmStartConfig",
    "WorkflowConfig",
    "agent_policy_map",
    "algo_options",
    "apply_override",
    "check_preset_name",
    "config_from_dict",
    "config_to_dict",
    "dump_yaml",
    "from_dict",
    "load_config",
    "method_named",
    "parse_bytes",
    "parse_yaml",
    "plan_options",
    "read_yaml_file",
    "routing_replay_refused",
    "to_dict",
    "validate_options",
]
