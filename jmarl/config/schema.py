"""The run config's schema: one frozen dataclass per section (`Config` holds them), each
field's default and range next to it, checks across fields in `_validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from jmarl.config.convert import _field, _join, _suggest, parse_bytes
from jmarl.errors import JmarlError


# algo.name: a registered method (`jmarl.algos.METHODS`) or `package.module:NAME` for your own
AlgoName = str
# workflow.plan: a registered sampling plan (`jmarl.workflows.PLANS`) or `package.module:NAME`
PlanName = str
DType = Literal["float32", "bfloat16", "float16"]
# model.remat: auto = where the device memory is known (the memory check), the least recompute
# whose gradient programs fit (`jmarl.train.remat_plan`); else "full" from
# `jmarl.models.config.REMAT_AUTO_MIN_PARAMS` (1e8) parameters up, "none" below
# (`jmarl.models.config.resolve_remat`, the rule a ModelConfig applies too); the others as
# `jmarl.models.config.REMAT_POLICIES` (true = full, false = none).
RematName = Literal["auto", "none", "full", "dots"]
# model.attention: `jmarl.models.config.ATTENTION_IMPLS` (auto picks per platform).
AttentionName = Literal["auto", "xla", "cudnn", "splash", "blockwise", "pallas"]
# model.routing_replay: `jmarl.models.config.ROUTING_REPLAY` (YAML's off/false: "off"; true: "replay").
RoutingReplayName = Literal["off", "replay"]


@dataclass(frozen=True)
class ArchConfig:
    """A built-in decoder-only architecture built from scratch (tests, CPU quickstart).

    Field names follow `jmarl.models.ModelConfig` (and Hugging Face's config.json). None
    means: vocab_size from the tokenizer; head_dim = hidden_size // num_heads; qkv_bias and
    qk_norm as the family has them (qwen2: q/k/v biases; qwen3 and qwen3_moe: q/k norms).
    qwen3_moe: every `decoder_sparse_step`-th layer a mixture of `num_experts` SwiGLU experts of
    `moe_intermediate_size`, `num_experts_per_tok` of them per token (see ModelConfig).
    """

    model_type: Literal["qwen3", "qwen2", "llama", "qwen3_moe"] = "qwen3"
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
    num_experts: int = _field(0, ge=0)
    num_experts_per_tok: int = _field(0, ge=0)
    moe_intermediate_size: int = _field(0, ge=0)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = _field(1, ge=1)

    def _validate(self, path: str) -> None:
        moe = (self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size)
        if self.model_type == "qwen3_moe" and not (self.num_experts >= 1 and 1 <= self.num_experts_per_tok
                                                   <= self.num_experts and self.moe_intermediate_size >= 1):
            raise JmarlError(f"{path}: a qwen3_moe architecture needs num_experts >= 1, 1 <= num_experts_per_tok "
                             f"<= num_experts and moe_intermediate_size >= 1; got {moe}")
        if self.model_type != "qwen3_moe" and any(moe):
            raise JmarlError(f"{path}: num_experts, num_experts_per_tok and moe_intermediate_size are for "
                             f"model_type qwen3_moe; got {self.model_type!r}")
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
    # how prompts are rendered: None = the tokenizer's own chat template; plain ("role: content"
    # lines), gemma (Gemma's turns, for a base Gemma checkpoint without a template) or Jinja text
    chat_template: str | None = None
    compute_dtype: DType = "float32"  # dtype of the matmuls (norms/softmax/log-probs stay f32)
    param_dtype: DType = "float32"  # storage dtype (float32 for trained parameters)
    # recompute activations in the backward pass: auto (full from 1e8 parameters up, else none),
    # none, full (keep each layer's input only), dots (also keep matmul outputs); true = full
    remat: bool | RematName = "auto"
    attention: AttentionName = "auto"  # attention kernel; auto: per platform (jmarl.models.attention)
    # mixture-of-experts models only (qwen3_moe): replay = the sampler records each token's
    # experts and the learner runs those (routing replay, docs/scaling.md "Mixture of experts");
    # off = the learner routes itself. (YAML reads off as false: both accepted.)
    routing_replay: bool | RoutingReplayName = "off"

    def __post_init__(self) -> None:
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if isinstance(self.routing_replay, bool):
            object.__setattr__(self, "routing_replay", "replay" if self.routing_replay else "off")

    def _validate(self, path: str) -> None:
        from jmarl.models.tokenizer import CHAT_TEMPLATES, is_chat_template

        if self.chat_template is not None and not is_chat_template(self.chat_template):
            raise JmarlError(
                f"{_join(path or 'model', 'chat_template')}: {self.chat_template!r} is neither a template name "
                f"({', '.join(CHAT_TEMPLATES)}) nor Jinja text; set one of those or remove it to use the "
                "tokenizer's own")
        if (self.path is None) == (self.preset is None):
            raise JmarlError(
                f"{path or 'model'}: set exactly one of {_join(path, 'path')} (a local Hugging Face "
                f"checkpoint) or {_join(path, 'preset')} (a preset name or a built-in architecture); to "
                f"switch on the command line, set the other one to null (e.g. {_join(path, 'preset')}=null)"
            )
        if isinstance(self.preset, str):
            check_preset_name(self.preset, _join(path or "model", "preset"))
        if self.routing_replay == "replay" and self.preset is not None:  # a checkpoint's: when it is loaded
            model_type = _preset_model_type(self.preset)
            if model_type != "qwen3_moe":
                raise routing_replay_refused(path or "model", model_type)


def _preset_model_type(preset: str | ArchConfig) -> str:
    """The model_type of a preset name or an `ArchConfig`."""
    if isinstance(preset, ArchConfig):
        return preset.model_type
    from jmarl.models.presets import preset_config

    return preset_config(check_preset_name(preset)).model_type


def routing_replay_refused(path: str, model_type: str) -> JmarlError:
    """The error for `<path>.routing_replay: replay` on a model without experts."""
    return JmarlError(
        f"{_join(path, 'routing_replay')}: replay replays the experts a mixture-of-experts model's sampler chose, "
        f"and this {model_type} model has no expert layer; set {_join(path, 'routing_replay')}: off (or use a "
        "qwen3_moe model)")


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
    # consecutive calls, which bounds the KV cache (see python -m jmarl.memory_check); null: one call
    max_rows_per_call: int | None = _field(None, ge=1)
    # static: one fixed batch per call (every row keeps its slot until the longest ends);
    # continuous: the slot engine (jmarl.models.generation.engine): a finished row's slot takes the next
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
    # Share of the demonstration episodes whose prompts carry memory lines, retrieved (as
    # JoyAgents-R1's memory shows them) from a memory of other expert episodes' steps: a model
    # that RL will prompt with its memory first learns to read past it. 0: plain prompts only.
    memory_share: float = _field(0.0, ge=0.0, le=1.0)


@dataclass(frozen=True)
class TrainConfig:
    """The RL loop: steps and KL regularisation. With kl_coef > 0 the KL term is to a frozen
    copy of the policy RL starts from (after the warm start, if any; a LoRA policy's reference
    is its base); with kl_coef = 0 no reference is built or scored."""

    steps: int = _field(100, ge=1)
    kl_coef: float = _field(0.0, ge=0.0)
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    # Mixture-of-experts policies (Qwen3-MoE): weight of the router's load-balancing loss added
    # to the RL and warm-start losses (transformers' router_aux_loss_coef, e.g. 0.001); 0 = off,
    # as transformers' default output_router_logits=False.
    router_aux_loss_coef: float = _field(0.0, ge=0.0)
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
    """The code sandbox (`jmarl.sandbox`, docs/sandbox.md) that runs model-written programs."""

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
                _check_routing_replay(entry.model, self.sampling, f"policies.models.{name}.model")
        else:
            if self.model is None:
                raise JmarlError("missing required key 'model': set model.path or model.preset")
            _check_tokenizer(self.model, self.tokenizer, "")
            _check_master_dtype(self.model, self.policies.mode, "model")
            _check_routing_replay(self.model, self.sampling, "model")


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


def _check_routing_replay(model: ModelSpec, sampling: SamplingConfig, path: str) -> None:
    """Routing replay needs the static sampler: the continuous engine records no experts."""
    if model.routing_replay == "replay" and sampling.engine != "static":
        raise JmarlError(
            f"{path}.routing_replay: replay needs each token's experts recorded by the sampler, and "
            f"sampling.engine: {sampling.engine} does not record them; set sampling.engine: static or "
            f"{path}.routing_replay: off")


def _check_tokenizer(model: ModelSpec, tokenizer: str | None, path: str) -> None:
    """A preset model has no tokenizer of its own: one must be named."""
    if tokenizer is None and model.path is None:
        key = _join(path, "tokenizer")
        raise JmarlError(
            f"{key}: a preset model needs a tokenizer: set {key}=char or a local tokenizer directory"
        )
