"""The programs a run compiles, with the shapes they are compiled for: what the memory check
(`jmarl.memory_check`) analyses. `trainer_programs(trainer)` lists, per policy group, the very
jitted objects the run calls, with abstract arguments carrying the run's shardings:

    sft_update  the warm-start update (only when train.warm_start.steps > 0), state donated
    generate    the sampler's program (prefill + decode, KV cache) for its largest call
    score       old log-probs over the step's batch (train.recompute_old_logprobs, or HACPO)
    score_ref   reference log-probs (only when a KL term keeps a reference)
    update      the RL update: mini-batches x grad-accum micro-batches, state donated

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
        rows  min(2 x tokens / L + 1, U) (a row holds at least one segment), rounded up to a
              multiple of r; M = rows x L

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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import jax

from jmarl.errors import JmarlError
from jmarl.memory_check import Program
from jmarl.models.generation import budget, engine
from jmarl.padding import bucket_length, next_pow2
from jmarl.sharding import ShardedFn, batch_shardings, device_bytes, put
from jmarl.train.learner import abstract_learner_batch, batch_rows, score_batch
from jmarl.train.packing import ROW_TOKENS, token_budget
from jmarl.train.sampling import full_params_shapes, generation_spec
from jmarl.workflows.base import resolve_max_turns
from jmarl.workflows.bounds import BoundsContext, PlanBounds

@dataclass(frozen=True)
class StepBounds(PlanBounds):
    """The plan's bounds for one policy group (`PlanBounds`: rows, share, aligned, sampler
    calls) and the warm-start rows of any one policy (`sft_rows`, 0: no warm start)."""

    sft_rows: int = 0


def step_bounds(trainer: Any, group: Any) -> StepBounds:
    """The bounds of one step of `group` of a (real or abstract) trainer: what its plan
    declares (`Plan.bounds`) with the step's options, and the warm start's rows: demos x the
    env's max_turns x a (a plan that does not route by agent: x n)."""
    plan, env = trainer.plan, trainer.env
    if plan.bounds is None:
        raise JmarlError(
            f"workflow.plan {plan.name!r} declares no step bounds (Plan.bounds), so the memory check cannot size "
            "its programs; give the Plan a bounds function (jmarl.workflows.bounds) or set train.memory_check=off"
        )
    opts = trainer.step_plan_options()
    ctx = BoundsContext(
        num_tasks=trainer.config.workflow.num_tasks,
        turns=resolve_max_turns(env, getattr(opts, "max_turns", None)),
        order=tuple(env.agents.index(a) for a in env.turn_order),
        agent_policy=tuple(trainer.policies.agent_policy),
        policy_ids=tuple(group.policy_ids),
        parallel=bool(env.parallel),
    )
    bounds = plan.bounds(opts, ctx)
    ws = trainer.config.train.warm_start
    sft = ws.demos * env.max_turns * (ctx.max_agents if plan.routes_by_agent else ctx.num_agents) if ws.steps > 0 else 0
    return StepBounds(rows=bounds.rows, share=bounds.share, aligned=bounds.aligned,
                      calls=tuple(dict.fromkeys(bounds.calls)), sft_rows=sft)


def prefixes_per_part(rows_per_part: int, share: int, aligned: bool) -> int:
    """U: a bound on the distinct prompts in one micro-batch of `rows_per_part` rows (a power of
    two; module docstring)."""
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
    row half empty or less, so T tokens take at most 2T / L + 1 rows, and a row holds at least
    one segment (a distinct prompt with its continuations), so there are at most `prompts`
    rows: R = min(2T / L + 1, prompts), rounded up to a multiple of `rows_per_part`; M = R x L."""
    total = prompts * prompt_len + rows * new_tokens
    width = max(ROW_TOKENS, token_budget(prompt_len + max(share, 1) * new_tokens))
    needed = min(2 * total // width + 1, max(prompts, 1))
    packed_rows = -(-needed // rows_per_part) * rows_per_part
    return packed_rows, width, packed_rows * width


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs of a tree of arrays (their shardings kept) or ShapeDtypeStructs."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def _bind(fn: Any, *args: Any) -> tuple[Any, tuple]:
    """(the jitted object a call of `fn` runs, abstract args with the shardings it places them
    with): a `ShardedFn` places its arguments first, a plain jitted function takes them as they are."""
    args = tuple(None if a is None else _abstract(a) for a in args)
    if not isinstance(fn, ShardedFn):
        return fn, args
    placed = tuple(a if sh is None or a is None else put(a, sh) for a, sh in zip(args, fn.arg_shardings(*args)))
    return fn.jitted, placed


def _leaves(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]


def _resident(run_state: Sequence[Any], args: Sequence[Any], extra: Any = None) -> int:
    """Bytes per device of the run's device state that is not among `args` (by identity),
    plus `extra` (arrays or ShapeDtypeStructs alive during the call)."""
    taken = {id(x) for x in _leaves(args)}
    return device_bytes([x for x in run_state if id(x) not in taken]) + (0 if extra is None else device_bytes(extra))


def trainer_programs(trainer: Any) -> list[Program]:
    """Every program a step (and the warm start) of `trainer` runs, per policy group, with the
    bounds of the module docstring. `trainer` is real or abstract (`Trainer(config,
    abstract=True)`); nothing is compiled or allocated here."""
    cfg = trainer.config
    s = cfg.sampling
    c_len = bucket_length(s.max_new_tokens)
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
        if trainer.sampler.settings.engine == "continuous":
            for name, jitted, args, shapes in engine_programs(trainer, group, b.calls, params):
                add(name, jitted, args, _resident(run_state, ()), shapes)  # the masters stay resident
        else:
            calls = [(trainer.sampler.generation_program(group, rows, share, params=_abstract(params)), rows, share)
                     for rows, share in b.calls]
            (program, args), rows, share = max(calls, key=lambda c: device_bytes(c[0][1]))
            shapes = {"rows": list(rows), "share": share, "prompts": list(args[2].shape[:-1]), "S": args[2].shape[-1],
                      "capacity": args[1].capacity}
            if min(args[1].capacities) < args[1].capacity:  # the sliding layers' rings (a windowed cache)
                shapes["window_capacity"] = min(args[1].capacities)
            add("generate", program, args, _resident(run_state, (params,)), shapes)

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
    `jmarl.models.generation.engine.run` picks them with the sampler's `generation_spec`
    (sampling.kv_budget_bytes, on the trainer's mesh) for that call's completions per prompt,
    P = the bucket of max_prompt_len.
    [(name, jitted, abstract args, shapes)]."""

    s = trainer.sampler.settings
    spec = generation_spec(s, group.tokenizer, trainer.mesh, trainer.sampler.buckets)
    rows, share = max(((max(r) if group.stacked else sum(r)), share) for r, share in calls)
    prompt_len = bucket_length(max(1, s.max_prompt_len), spec.buckets)
    slots, entries = budget.planned_slots(group.model_config, prompt_len, rows, share, spec)
    max_prefill = budget.planned_prefill(group.model_config, prompt_len, spec)
    programs = engine.planned_programs(group.model_config, _abstract(params), spec, slots=slots, entries=entries,
                                       prompt_len=prompt_len, select=group.stacked)
    shapes = {"rows": rows, "share": share, "slots": slots, "entries": entries, "P": prompt_len,
              "G": budget.generated_capacity(s.max_new_tokens)}
    u = next_pow2(min(slots, entries, max_prefill))
    return [(name, jitted, args, dict(shapes, U=u) if name == "engine_prefill" else dict(shapes))
            for name, jitted, args in programs]


def _replace(group: Any, **changes: Any) -> Any:
    return dataclasses.replace(group, **changes)
