"""`python -m jmarl.plan`: does a run fit in device memory? Its own programs, compiled for N devices.

    python -m jmarl.plan --config configs/at_grpo/plan_path.yaml --devices 8 --device-memory 80GiB
    python -m jmarl.plan --config X.yaml model.preset=qwen3-8b mesh.fsdp=8 --devices 8 --json plan.json

What the figures are. For each program the run executes, XLA's own memory analysis of the
compiled program (`compiled.memory_analysis()`), per device: `state` (argument buffers:
parameters, optimizer state, reference, KV cache, batch), `temporaries` (XLA's temp buffers:
activations, gradients, workspaces), `outputs`, `aliased` (outputs written into donated
arguments), `total` = state + temporaries + outputs - aliased, `resident` (device state of the
run that is not an argument of that program but stays in memory while it runs: the optimizer
state and reference during generation, the other policy groups, the old log-probs kept while
the reference scores) and `peak` = total + resident. A run fits when every program's peak fits
in the device memory less a headroom (default 10%).

What they are not. Host memory (rollouts, tokenizers, the Python heap) is not included; nor is
the allocator's fragmentation, nor what the runtime adds outside a program (collective
buffers, kernel workspaces, a second copy while an array is resharded): hence the headroom.
Simulated CPU devices (--devices) give the figures of XLA's CPU compiler (compiled without
LLVM's expensive passes, `CPU_FAST_COMPILE`: the same buffers, a faster compile); an accelerator's
compiler fuses differently and picks its own attention kernels, so its figures differ (the
trainer's own check before step 0 compiles for the real devices, see below).

The run's own programs. `Trainer(config, abstract=True)` builds the run exactly as training
does (policies, optimizer, jitted device functions, their shardings on the config's mesh:
`jmarl.sharding.shard_trainer`) with every array a `jax.ShapeDtypeStruct` (`jax.eval_shape`
over the initialisers: an 8B model plans on a laptop). Per policy group the plan lowers those
very jitted objects with abstract arguments carrying the run's shardings:

    sft_update  the warm-start update (only when train.warm_start.steps > 0), state donated
    generate    the sampler's program (prefill + decode, KV cache) for its largest call
    score       old log-probs over the step's batch (train.recompute_old_logprobs, or HACPO)
    score_ref   reference log-probs (only when a KL term keeps a reference)
    update      the RL update: mini-batches x grad-accum micro-batches, state donated

A model.path that exists is planned from its config.json (no weights are read); one that does
not exist but whose directory name is a preset's (checkpoints/Qwen3-1.7B -> qwen3-1.7b) with
that preset's shapes (a note says so); a preset name (model.preset=qwen3-8b) with its shapes.
Such models get the built-in char tokenizer when none is given: token ids do not change memory.

Shapes: upper bounds of what the trainer feeds in one step. E = workflow.num_tasks, T = turns
(the plan's max_turns, else the env's), K/G = workflow.group_size, a = the agents of the env's
turn order that map to one policy (the most over a group's policies), n = all of them.

    rows R per policy per step                           rows sharing a prompt s
    tree         E x T x K x a                           K (a node's candidates)
    independent  E x G x T x a                           1 (later turns' prompts differ)
    joint        E x G x a x (1 + B + .. + B^(T-1))      G (B = G aligned, G^n cross)
    node_wise    E x top_k x G (top_k_scope task)        G
    shared       E x sources x G (Trainer.rows_bound)    G (groups may be cut by lossy drops)

    N = next_pow2(R) rounded up to a multiple of parts = optim.minibatches x grad_accum
        (`learner.batch_rows`, as `learner_batch` pads)
    U = next_pow2(distinct prompts per micro-batch) <= N / parts: ceil((N / parts) / s), plus
        one where groups may straddle a micro-batch boundary (s does not divide N / parts, or
        the shared plan's lossy drops)
    C = bucket_length(sampling.max_new_tokens)
    packed rows (`packing.pack`), per micro-batch, with tokens <= U x max_prompt_len +
    (N / parts) x max_new_tokens and r = the devices that split the rows (`packed_bounds`):
        L     max(ROW_TOKENS, token_budget(one segment)), a segment being a prompt and its s
              continuations
        rows  2 x tokens / L + 1, rounded up to a multiple of r; M = rows x L

The update's batch is what `learner.score_batch` makes of that learner batch (traced by
`jax.eval_shape`: old/ref log-probs, advantages, masks). The warm start's batch: demos x the
env's max_turns x a rows per policy (the shared plan: x n), next_pow2, every row its own
prompt. Generation: the sampler calls of one step, each as rows per policy of the group:

    tree         E x K for the acting agent's policy (a parallel env: E x a x K), s = K
    independent  E x G (a parallel env: E x G x a), s = 1
    joint        E x B^(T-1) x a x G (the last turn's frontier), s = G
    node_wise    E x T x n x G re-runs for one policy, s = 1 (the G alternatives: s = G)
    shared       E x G per policy, s = G

Each call's layout (B = row_bucket(rows), prompt blocks, KV-cache capacity) comes from the
sampler's own host code on distinct prompts of max_prompt_len tokens
(`ModelSampler.generation_program`); the call with the largest arguments is compiled. With
`sampling.engine: continuous`, the engine's prefill and decode-chunk programs are planned instead
(`engine_programs`: its slots and prompt entries from sampling.kv_budget_bytes, its KV cache the
slots' generated tokens and the entries' shared prompts). As in
the run, only the parameters arrive sharded: the sampler's prompts and KV cache are host
values, which JAX replicates over the mesh's devices.
Caveats: a completion re-tokenised for another learner (the shared plan's cross samples) may
exceed C; two consecutive requests with the same prompt make the sampler give up its shared
prompt cache (more memory than planned).

Device memory: --device-memory, else train.device_memory, else the device's own
(`memory_stats()["bytes_limit"]`); simulated CPU devices have none, so without either the
figures are reported and no limit is checked. Exit 0 when every program fits (or nothing was
checked), 2 with one line on stderr when one does not (naming it, its peak, the limit and the
settings to change) or on bad input.

The trainer runs the same check before step 0 (`Trainer.check_memory` -> `check_trainer`) when
train.memory_check is "on", or "auto" on an accelerator, on the real devices and arrays.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jmarl.errors import JmarlError

log = logging.getLogger(__name__)

# what to change when a program does not fit
_ADVICE = {
    "update": "raise optim.minibatches or optim.grad_accum, shard more (mesh.fsdp), set model.remat=full, "
              "or lower sampling.max_prompt_len / max_new_tokens",
    "sft_update": "lower train.warm_start.demos, shard more (mesh.fsdp), set model.remat=full, "
                  "or lower sampling.max_prompt_len / max_new_tokens",
    "score": "lower workflow.num_tasks or workflow.group_size (the step's batch is scored at once), shard more "
             "(mesh.fsdp), or lower sampling.max_prompt_len / max_new_tokens",
    "generate": "lower workflow.num_tasks or workflow.group_size (rows per sampler call), "
                "sampling.max_new_tokens or sampling.max_prompt_len, or shard the parameters more (mesh.fsdp)",
}
_ADVICE["score_ref"] = _ADVICE["score"]
_ADVICE["engine_decode"] = _ADVICE["engine_prefill"] = (
    "lower sampling.kv_budget_bytes (fewer slots), sampling.max_new_tokens or sampling.max_prompt_len, "
    "or shard more (mesh.data / mesh.fsdp split the slots, mesh.fsdp the parameters)")


# ----------------------------------------------------------------------------------- figures
@dataclass(frozen=True)
class ProgramMemory:
    """XLA's memory analysis of one compiled program, bytes per device (see the module
    docstring), plus the run's resident device state while it runs and the bounds it was
    compiled for (`shapes`)."""

    program: str
    group: str
    state: int
    temporaries: int
    outputs: int
    aliased: int
    code: int
    resident: int
    compile_seconds: float
    shapes: dict[str, Any] = field(default_factory=dict)
    remat: str = "none"  # the group's layer remat policy (what the advice may suggest)

    @property
    def total(self) -> int:
        """Arguments + temporaries + outputs - aliased (donated) bytes."""
        return self.state + self.temporaries + self.outputs - self.aliased

    @property
    def peak(self) -> int:
        """total + resident: what the device holds while the program runs."""
        return self.total + self.resident

    @property
    def label(self) -> str:
        """'update of group 'per_agent''."""
        return f"{self.program} of group {self.group!r}"

    def to_json(self) -> dict[str, Any]:
        """Every figure in bytes (and the bounds), for --json."""
        out = dataclasses.asdict(self)
        out.update(total=self.total, peak=self.peak)
        return out


@dataclass(frozen=True)
class Program:
    """One program to compile: the run's jitted object, the abstract arguments to lower it
    with (carrying the run's shardings), the resident bytes per device and its bounds."""

    program: str
    group: str
    jitted: Any
    args: tuple
    resident: int
    shapes: dict[str, Any]
    remat: str = "none"


@dataclass(frozen=True)
class StepBounds:
    """Upper bounds of one RL step for one policy group (module docstring): `rows` samples of
    any one policy, `share` consecutive rows per prompt (`aligned`: groups of exactly `share`
    rows from row 0), the sampler `calls` (rows per policy of the group, share) and the
    warm-start rows of any one policy (`sft_rows`, 0: no warm start)."""

    rows: int
    share: int
    aligned: bool
    calls: tuple[tuple[tuple[int, ...], int], ...]
    sft_rows: int


def format_size(n: float) -> str:
    """Bytes as '93.1 GiB' / '12.0 MiB' / '3.0 KiB' / '12 B' (whole numbers without decimals)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------------- shapes
def step_bounds(trainer: Any, group: Any) -> StepBounds:
    """The module docstring's bounds for `group` of a (real or abstract) trainer."""
    from jmarl.workflows.base import resolve_max_turns

    cfg = trainer.config
    env = trainer.env
    plan = cfg.workflow.plan
    opts = trainer.step_plan_options()
    e = cfg.workflow.num_tasks
    agent_policy = trainer.policies.agent_policy
    order = [env.agents.index(a) for a in env.turn_order]
    ids = group.policy_ids
    agents_of = {p: sum(agent_policy[a] == p for a in order) for p in ids}
    a = max(agents_of.values())
    n = len(order)
    turns = resolve_max_turns(env, getattr(opts, "max_turns", None))

    def per_agent_calls(rows: int, share: int) -> list[tuple[tuple[int, ...], int]]:
        """One call per agent (a sequential env), or one per turn with every agent (parallel)."""
        if env.parallel:
            return [(tuple(rows * agents_of[p] for p in ids), share)]
        return [(tuple(rows if agent_policy[i] == p else 0 for p in ids), share) for i in order]

    if plan == "tree":
        k = opts.group_size
        rows, share, aligned, calls = e * turns * k * a, k, True, per_agent_calls(e * k, k)
    elif plan == "independent":
        g = opts.group_size
        rows, share, aligned, calls = e * g * turns * a, 1, True, per_agent_calls(e * g, 1)
    elif plan == "joint":
        g = opts.group_size
        branching = g if opts.joint_mode == "aligned" else g**n
        nodes = sum(branching**t for t in range(turns))
        frontier = e * branching ** (turns - 1)
        rows, share, aligned = e * g * a * nodes, g, True
        calls = [(tuple(frontier * agents_of[p] * g for p in ids), g)]
    elif plan == "node_wise":
        g = opts.group_size
        rows = (e if opts.top_k_scope == "task" else 1) * opts.top_k * g
        share, aligned = g, True
        calls = [(tuple(e * turns * agents_of[p] * g for p in ids), g)]
        calls += [(tuple(e * turns * n * g if q == p else 0 for q in ids), 1) for p in ids]
    elif plan == "shared":
        g = opts.samples_per_policy
        rows, share, aligned = trainer.rows_bound(), g, False
        calls = [(tuple(e * g for _ in ids), g)]
    else:
        raise JmarlError(
            f"workflow.plan {plan!r} has no memory plan; use one of tree, independent, joint, node_wise, shared"
        )
    sft = 0
    ws = cfg.train.warm_start
    if ws.steps > 0:
        sft = ws.demos * env.max_turns * (a if trainer.plan.routes_by_agent else n)
    return StepBounds(rows=rows, share=share, aligned=aligned, calls=tuple(dict.fromkeys(calls)), sft_rows=sft)


def prefixes_per_part(rows_per_part: int, share: int, aligned: bool) -> int:
    """U: a bound on the distinct prompts in one micro-batch of `rows_per_part` rows (a power of
    two; module docstring)."""
    from jmarl.rollouts import next_pow2

    if share <= 1:
        return next_pow2(rows_per_part)
    distinct = -(-rows_per_part // share) + (0 if aligned and rows_per_part % share == 0 else 1)
    return next_pow2(min(distinct, rows_per_part))


def packed_bounds(rows: int, prompts: int, share: int, prompt_len: int, new_tokens: int, rows_per_part: int
                  ) -> tuple[int, int, int]:
    """(R, L, M): bounds on the packed rows, their width and the predictions of one micro-batch
    of `rows` samples with at most `prompts` distinct prompts of <= prompt_len tokens and
    continuations of <= new_tokens (`jmarl.train.packing.pack`): L = ROW_TOKENS or the budget
    of the longest segment (a prompt and `share` continuations); first-fit leaves at most one
    row half empty or less, so T tokens take at most 2T / L + 1 rows; M = R x L."""
    from jmarl.train.packing import ROW_TOKENS, token_budget

    total = prompts * prompt_len + rows * new_tokens
    width = max(ROW_TOKENS, token_budget(prompt_len + max(share, 1) * new_tokens))
    packed_rows = -(-(2 * total // width + 1) // rows_per_part) * rows_per_part
    return packed_rows, width, packed_rows * width


# ----------------------------------------------------------------------------------- programs
def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs of a tree of arrays (their shardings kept) or ShapeDtypeStructs."""
    import jax

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def _bind(fn: Any, *args: Any) -> tuple[Any, tuple]:
    """(the jitted object a call of `fn` runs, abstract args with the shardings it places them
    with): a `ShardedFn` places its arguments first, a plain jitted function takes them as they are."""
    from jmarl.sharding import ShardedFn, put

    args = tuple(None if a is None else _abstract(a) for a in args)
    if not isinstance(fn, ShardedFn):
        return fn, args
    placed = tuple(a if sh is None or a is None else put(a, sh) for a, sh in zip(args, fn.arg_shardings(*args)))
    return fn.jitted, placed


def _leaves(tree: Any) -> list[Any]:
    import jax

    return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]


def _resident(run_state: Sequence[Any], args: Sequence[Any], extra: Any = None) -> int:
    """Bytes per device of the run's device state that is not among `args` (by identity),
    plus `extra` (arrays or ShapeDtypeStructs alive during the call)."""
    from jmarl.sharding import device_bytes

    taken = {id(x) for x in _leaves(args)}
    return device_bytes([x for x in run_state if id(x) not in taken]) + (0 if extra is None else device_bytes(extra))


def trainer_programs(trainer: Any) -> list[Program]:
    """Every program a step (and the warm start) of `trainer` runs, per policy group, with the
    bounds of the module docstring. `trainer` is real or abstract (`Trainer(config,
    abstract=True)`); nothing is compiled or allocated here."""
    import jax

    from jmarl.rollouts import bucket_length, next_pow2
    from jmarl.sharding import batch_shardings, device_bytes, put
    from jmarl.train.sampling import full_params_shapes
    from jmarl.train.learner import abstract_learner_batch, batch_rows, score_batch

    cfg = trainer.config
    s = cfg.sampling
    p_len, c_len = bucket_length(s.max_prompt_len), bucket_length(s.max_new_tokens)
    run_state = [x for g in trainer.policies.groups for x in _leaves((g.state, g.base, g.ref))]
    mesh = trainer.mesh
    out: list[Program] = []
    for group, fns in zip(trainer.policies.groups, trainer.fns):
        b = step_bounds(trainer, group)
        parts = trainer.parts

        def add(name: str, jitted: Any, args: tuple, resident: int, shapes: dict[str, Any]) -> None:
            out.append(Program(name, group.name, jitted, args, resident, shapes, remat=group.model_config.remat))

        # warm start
        if b.sft_rows:
            n_sft = next_pow2(b.sft_rows)
            packed_rows, width, preds = packed_bounds(n_sft, n_sft, 1, s.max_prompt_len, s.max_new_tokens,
                                                      trainer.rows_per_part(group))
            batch = abstract_learner_batch(group, n_sft, packed_rows, width, preds, c_len, sft=True)
            jitted, args = _bind(fns.sft_update, group.state, group.base, batch)
            add("sft_update", jitted, args, _resident(run_state, (group.state, group.base)),
                {"N": n_sft, "rows": packed_rows, "L": width, "M": preds, "C": c_len})

        # generation: of the step's sampler calls, the one with the largest arguments
        # the group's own leaves, placed as they are (LoRA: the base once, adapters attached
        # unmerged), so `_resident` does not count them twice
        params = full_params_shapes(group)
        if getattr(trainer.sampler.settings, "engine", "static") == "continuous":
            for name, jitted, args, shapes in engine_programs(trainer, group, b.calls, params):
                add(name, jitted, args, _resident(run_state, ()), shapes)  # the masters stay resident
        else:
            calls = [(trainer.sampler.generation_program(group, rows, share, params=_abstract(params)), rows, share)
                     for rows, share in b.calls]
            (program, args), rows, share = max(calls, key=lambda c: device_bytes(c[0][1]))
            add("generate", program, args, _resident(run_state, (params,)),
                {"rows": list(rows), "share": share, "prompts": list(args[2].shape[:-1]), "S": args[2].shape[-1],
                 "capacity": args[1].values[0].shape[-2]})

        # the step's batch
        n = batch_rows([b.rows], parts, trainer.rows_bound())
        u = prefixes_per_part(n // parts, b.share, b.aligned)
        r, width, preds = packed_bounds(n // parts, u, b.share, s.max_prompt_len, s.max_new_tokens,
                                        trainer.rows_per_part(group))
        host = abstract_learner_batch(group, n, parts * r, width, parts * preds, c_len)
        shapes = {"R": b.rows, "N": n, "parts": parts, "U": u, "rows": r, "L": width, "M": preds, "C": c_len}
        inputs = host.model_inputs()
        recompute, cross = trainer.config.train.recompute_old_logprobs, not trainer.plan.routes_by_agent
        scored = recompute or cross  # a plan that does not route by agent shares samples across policies
        old = jax.ShapeDtypeStruct(host.behavior_logprobs.shape, host.behavior_logprobs.dtype)  # on one device
        if scored:
            jitted, args = _bind(fns.score, group.state.params, group.base, inputs)
            add("score", jitted, args, _resident(run_state, (group.state.params, group.base)), shapes)
            if mesh.size > 1:  # the score's output: rows sharded like the batch
                old = put(old, batch_shardings(old, mesh, stacked=group.stacked))
        if group.ref is not None:  # the old log-probs wait on the device while the reference scores
            jitted, args = _bind(fns.score_ref, group.ref, inputs)
            add("score_ref", jitted, args, _resident(run_state, (group.ref,), old), shapes)
        device_state = trainer.method_device_state()

        def score(state, base, ref, batch, group=group, fns=fns):
            return score_batch(_replace(group, state=state, base=base, ref=ref), fns, batch, device_state,
                               recompute=recompute, cross=cross)

        batch = jax.eval_shape(score, group.state, group.base, group.ref, host)
        jitted, args = _bind(fns.update, group.state, group.base, batch)
        add("update", jitted, args, _resident(run_state, (group.state, group.base)), shapes)
    return out


def engine_programs(trainer: Any, group: Any, calls: Sequence[tuple[tuple[int, ...], int]], params: Any
                    ) -> list[tuple[str, Any, tuple, dict[str, Any]]]:
    """The continuous engine's prefill and decode-chunk programs (`sampling.engine: continuous`)
    for the largest engine run of the step's sampler `calls`: a stacked group runs one pass per
    policy (its rows), another group one pass of all rows; S slots and Q prompt entries as
    `jmarl.models.engine.run` picks them from `sampling.kv_budget_bytes` on the trainer's mesh
    for that call's completions per prompt, P = the bucket of max_prompt_len.
    [(name, jitted, abstract args, shapes)]."""
    from jmarl.models import engine as engine_lib
    from jmarl.rollouts import bucket_length, next_pow2

    s = trainer.sampler.settings
    tok = group.tokenizer
    rows, share = max(((max(r) if group.stacked else sum(r)), share) for r, share in calls)
    prompt_len = bucket_length(max(1, s.max_prompt_len), trainer.sampler.buckets)
    mesh = trainer.mesh
    slots, entries = engine_lib.planned_slots(group.model_config, prompt_len, s.max_new_tokens, rows, share,
                                              s.kv_budget_bytes, mesh, s.max_rows_per_call)
    max_prefill = engine_lib.prefill_prompts(group.model_config, prompt_len, s.kv_budget_bytes)
    programs = engine_lib.planned_programs(
        group.model_config, _abstract(params), slots=slots, entries=entries, prompt_len=prompt_len,
        max_new_tokens=s.max_new_tokens, chunk_steps=s.engine_chunk_steps, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, stop_tokens=s.stop_tokens(tok), pad_id=tok.pad_id, select=group.stacked, mesh=mesh,
        max_prefill=max_prefill)
    shapes = {"rows": rows, "share": share, "slots": slots, "entries": entries, "P": prompt_len,
              "G": engine_lib.generated_capacity(s.max_new_tokens)}
    u = next_pow2(min(slots, entries, max_prefill))
    return [(name, jitted, args, dict(shapes, U=u) if name == "engine_prefill" else dict(shapes))
            for name, jitted, args in programs]


def _replace(group: Any, **changes: Any) -> Any:
    return dataclasses.replace(group, **changes)


# XLA:CPU options that skip LLVM's expensive passes: the buffer assignment (hence every figure)
# is the same, the compile 2-3x faster. Used when the programs are compiled for CPU devices.
CPU_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def analyse(program: Program) -> ProgramMemory:
    """Lowers and compiles `program` (nothing runs) and reads XLA's memory analysis."""
    import jax

    t0 = time.perf_counter()
    from jmarl.sharding import mesh_context, mesh_of

    with mesh_context(mesh_of(program.args)):  # as the run traces it (`ShardedFn`, the sampler)
        lowered = program.jitted.lower(*program.args)
    options = CPU_FAST_COMPILE if jax.default_backend() == "cpu" else None
    stats = lowered.compile(compiler_options=options).memory_analysis()
    if stats is None:
        raise JmarlError(
            f"XLA gives no memory analysis for {program.program} on {jax.default_backend()}; plan on simulated "
            "CPU devices instead (python -m jmarl.plan --devices N) or set train.memory_check=off"
        )
    return ProgramMemory(
        program=program.program, group=program.group, state=int(stats.argument_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes), outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes), code=int(stats.generated_code_size_in_bytes),
        resident=int(program.resident), compile_seconds=time.perf_counter() - t0, shapes=dict(program.shapes),
        remat=program.remat,
    )


def plan_trainer(trainer: Any, progress: Callable[[str], None] | None = None) -> list[ProgramMemory]:
    """Compiles every program of `trainer` (`trainer_programs`) and returns their figures;
    `progress` gets a line before and after each compile."""
    programs = trainer_programs(trainer)
    figures = []
    for i, p in enumerate(programs, 1):
        if progress:
            progress(f"[{i}/{len(programs)}] compiling {p.program} of group {p.group!r} ...")
        got = analyse(p)
        figures.append(got)
        if progress:
            progress(f"      {format_size(got.peak)} peak per device, compiled in {got.compile_seconds:.1f} s")
    return figures


# ----------------------------------------------------------------------------------- limits
def device_memory_of(setting: str | int | float | None) -> tuple[int | None, str]:
    """(bytes per device, where it came from): `setting` ('80GiB', 16e9: `jmarl.config.parse_bytes`),
    else the first device's own `memory_stats()['bytes_limit']`, else (None, 'unknown')."""
    import jax

    from jmarl.config import parse_bytes

    if setting is not None:
        return parse_bytes(setting), "given"
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # backends without memory stats (CPU)
        stats = {}
    limit = stats.get("bytes_limit")
    return (int(limit), "the device") if limit else (None, "unknown")


def over_limit(figures: Sequence[ProgramMemory], device_memory: int, headroom: float) -> str | None:
    """The one-line message for the program with the largest peak over device_memory x
    (1 - headroom), or None when every program fits."""
    limit = device_memory * (1.0 - headroom)
    over = [f for f in figures if f.peak > limit]
    if not over:
        return None
    worst = max(over, key=lambda f: f.peak)
    advice = _ADVICE[worst.program]
    if worst.remat == "full":  # already keeps only each layer's input
        advice = advice.replace(" set model.remat=full,", "")
    return (
        f"{worst.label} needs {format_size(worst.peak)} per device, over {format_size(limit)} "
        f"({format_size(device_memory)} less {headroom:.0%} headroom): {advice}"
    )


def table(figures: Sequence[ProgramMemory], limit: float | None = None) -> str:
    """The per-device table, one row per program, in the unit of the largest peak; with a
    `limit` (bytes per device) a last column says whether each peak fits under it."""
    top = max((f.peak for f in figures), default=0)
    unit, size = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= s), ("B", 1))
    cols = ("state", "temporaries", "outputs", "aliased", "total", "resident", "peak")
    names = [f"{f.program} [{f.group}]" for f in figures]
    width = max([len(n) for n in names] + [len(f"per device ({unit})")])
    head = f"{'per device (' + unit + ')':<{width}}  " + "  ".join(f"{c:>11}" for c in cols)
    lines = [head + ("  fits" if limit is not None else "")]
    for name, f in zip(names, figures):
        values = (f.state, f.temporaries, f.outputs, f.aliased, f.total, f.resident, f.peak)
        row = f"{name:<{width}}  " + "  ".join(f"{v / size:>11.2f}" for v in values)
        lines.append(row + ("" if limit is None else "  yes" if f.peak <= limit else "  NO"))
    return "\n".join(lines)


def check_trainer(trainer: Any) -> list[ProgramMemory]:
    """The trainer's check before step 0: plans its programs on the real devices and arrays,
    logs the figures, raises JmarlError (the same one line as the CLI) when one does not fit
    in train.device_memory (else the device's own) less train.memory_headroom."""
    t = trainer.config.train
    figures = plan_trainer(trainer, progress=log.info)
    for line in table(figures).splitlines():
        log.info("%s", line)
    device_memory, _ = device_memory_of(t.device_memory)
    if device_memory is None:
        log.warning("memory check: the device reports no memory limit; set train.device_memory (e.g. 80GiB)")
        return figures
    message = over_limit(figures, device_memory, t.memory_headroom)
    if message:
        raise JmarlError(message)
    log.info("memory check: every program fits in %s less %.0f%% headroom", format_size(device_memory),
             100 * t.memory_headroom)
    return figures


# ----------------------------------------------------------------------------------- config
def _arch(model_config: Any) -> dict[str, Any]:
    """A model.preset mapping (`jmarl.config.ArchConfig` fields) of a `ModelConfig`."""
    from jmarl.config import ArchConfig

    names = {f.name for f in dataclasses.fields(ArchConfig)}
    return {k: v for k, v in dataclasses.asdict(model_config).items() if k in names}


def _gguf_file(path: str) -> str | None:
    """The local .gguf file `path` names: itself, or a registered model name's cached file
    (`jmarl.models.fetch`; planning downloads nothing); None otherwise."""
    from jmarl.models import fetch

    if path in fetch.MODELS and not os.path.exists(path):
        path = str(fetch.cached_path(path))
    return path if os.path.isfile(path) and path.lower().endswith(".gguf") else None


def resolve_models(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A config dict whose models the planner can build without reading weights, and notes
    saying what was substituted: an existing model.path -> its config.json's architecture (an
    `ArchConfig` mapping; its tokenizer still read from the directory), a missing one -> the
    preset its directory name matches (JmarlError when none does). A preset model without a
    usable tokenizer directory gets the char tokenizer (token ids do not change memory)."""
    from jmarl.config import check_preset_name
    from jmarl.models.config import ModelConfig
    from jmarl.models.presets import preset_for_checkpoint_name, preset_names

    data = copy.deepcopy(data)
    notes: list[str] = []

    def fix(holder: dict[str, Any], where: str, tok_key: str, tok_holder: dict[str, Any]) -> None:
        spec = holder.get("model")
        if not isinstance(spec, dict):
            return
        path, preset = spec.get("path"), spec.get("preset")
        tok = tok_holder.get(tok_key)
        if isinstance(preset, str):
            check_preset_name(preset, f"{where}.preset")
        elif path is not None and os.path.isdir(str(path)):
            spec["path"], spec["preset"] = None, _arch(ModelConfig.from_hf(str(path)))
            tok = str(path) if tok is None else tok
            notes.append(f"{where}.path {path}: planned from its config.json (no weights read)")
        elif path is not None and (gguf := _gguf_file(str(path))) is not None:
            from jmarl.models.gguf import load_gguf_config

            spec["path"], spec["preset"] = None, _arch(load_gguf_config(gguf))
            notes.append(f"{where}.path {path}: planned from its GGUF metadata (no weights read)")
        elif path is not None:
            name = preset_for_checkpoint_name(str(path))
            if name is None:
                raise JmarlError(
                    f"{where}.path {path!r} does not exist and its name matches no preset "
                    f"({', '.join(preset_names())}); point it at a local checkpoint or set {where}.preset to a preset name"
                )
            spec["path"], spec["preset"] = None, name
            notes.append(f"{where}.path {path} not found: planning with preset {name}'s shapes")
        else:
            return
        if tok is None or (tok != "char" and not os.path.isdir(str(tok))):
            tok = "char"
        tok_holder[tok_key] = tok

    fix(data, "model", "tokenizer", data)
    policies = data.get("policies")
    if isinstance(policies, dict) and isinstance(policies.get("models"), dict):
        for name, entry in policies["models"].items():
            if isinstance(entry, dict):
                fix(entry, f"policies.models.{name}.model", "tokenizer", entry)
    return data, notes


def load_plan_config(path: str, overrides: Sequence[str]) -> tuple[Any, list[str]]:
    """(validated Config, notes): the YAML file with its overrides, models resolved for planning."""
    from jmarl.config import apply_override, config_from_dict, read_yaml_file

    data = read_yaml_file(path)
    for override in overrides:
        data = apply_override(data, override)
    data, notes = resolve_models(data)
    return config_from_dict(data), notes


# ----------------------------------------------------------------------------------- CLI
def _use_devices(count: int | None) -> bool:
    """Simulates `count` CPU devices when JAX has not started yet (sets XLA_FLAGS and
    JAX_PLATFORMS); returns whether they are simulated. A JAX already started in this process
    must already have `count` devices."""
    if count is None:
        return False
    if count < 1:
        raise JmarlError(f"--devices must be >= 1, got {count}")
    started = "jax" in sys.modules and sys.modules["jax"]._src.xla_bridge.backends_are_initialized()
    if started:
        import jax

        if jax.device_count() != count or jax.default_backend() != "cpu":
            raise JmarlError(
                f"--devices {count}: JAX already runs here with {jax.device_count()} {jax.default_backend()} devices; "
                "run python -m jmarl.plan in a fresh process"
            )
        return True
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ warnings (SPMD resharding notes) stay off stderr
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jmarl.plan",
        description="Compile a run's programs for N devices and report XLA's memory per device.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  python -m jmarl.plan --config configs/at_grpo/plan_path.yaml --devices 8 --device-memory 80GiB\n"
            "  python -m jmarl.plan --config X.yaml model.preset=qwen3-8b mesh.fsdp=8 --devices 8 --json plan.json"
        ),
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="YAML run config")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="simulate N CPU devices (default: this machine's devices)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="memory per device, e.g. 80GiB (default: train.device_memory, else the device's)")
    parser.add_argument("--headroom", type=float, default=None,
                        help="fraction kept free (default: train.memory_headroom, else 0.1)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every figure (bytes) as JSON")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return parser


def run_plan(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """The CLI's work after parsing; raises JmarlError for bad input."""
    simulated = _use_devices(args.devices)
    config, notes = load_plan_config(args.config, args.overrides)
    for note in notes:
        say(f"note: {note}")
    import jax

    from jmarl.run import setup_compilation_cache

    setup_compilation_cache(config)  # train.compilation_cache: a repeated plan loads its programs

    from jmarl.sharding import axis_sizes, format_mesh, mesh_from_config
    from jmarl.train.trainer import Trainer

    devices = jax.devices()
    mesh = mesh_from_config(config.mesh, devices=devices)
    t = config.train
    headroom = args.headroom if args.headroom is not None else t.memory_headroom
    if not 0.0 <= headroom < 1.0:
        raise JmarlError(f"--headroom must be in [0, 1), got {headroom}")
    device_memory, source = device_memory_of(args.device_memory if args.device_memory is not None else t.device_memory)
    say(f"plan: {args.config} on {len(devices)} {jax.default_backend()} device(s)"
        f"{' (simulated)' if simulated else ''}, mesh {format_mesh(axis_sizes(mesh))}")
    t0 = time.perf_counter()
    trainer = Trainer(config, abstract=True)
    say(f"built the abstract run in {time.perf_counter() - t0:.1f} s; compiling its programs")
    figures = plan_trainer(trainer, progress=say)
    limit = None if device_memory is None else device_memory * (1.0 - headroom)
    say("")
    say(table(figures, limit))
    message = None
    if device_memory is None:
        say("no device memory limit was checked: pass --device-memory (e.g. 80GiB) or set train.device_memory")
    else:
        message = over_limit(figures, device_memory, headroom)
        worst = max(figures, key=lambda f: f.peak)
        say(f"device memory {format_size(device_memory)} ({source}) less {headroom:.0%} headroom: "
            f"{format_size(limit)} per device; largest peak {format_size(worst.peak)} ({worst.label}): "
            + ("does not fit" if message else "fits"))
    if args.json:
        doc = {
            "config": args.config, "overrides": list(args.overrides), "notes": notes,
            "devices": len(devices), "platform": jax.default_backend(), "simulated": simulated,
            "mesh": axis_sizes(mesh), "jax_version": jax.__version__,
            "device_memory": device_memory, "headroom": headroom,
            "limit": None if limit is None else int(limit),
            "fits": None if device_memory is None else message is None,
            "peak": max(f.peak for f in figures),
            "programs": [f.to_json() for f in figures],
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
        say(f"wrote {args.json}")
    if message:
        raise JmarlError(message)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 fits, 2 does not fit or bad input)."""
    from jmarl.run import quiet_third_party

    quiet_third_party()
    args = _parser().parse_intermixed_args(argv)
    try:
        return run_plan(args, lambda line: print(line, flush=True))
    except JmarlError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
