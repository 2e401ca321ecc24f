"""The training loop behind `python -m jmarl.run --config X.yaml`: one generic loop.

Per step (host layer, calling the device layer with fixed-shape batches):

    seeds -> sampling plan (env + ModelSampler) -> records -> method.after_plan
          -> per policy group (`jmarl.train.learn.learn`): packed LearnerBatch
          -> old / reference log-probs, advantages [device]
          -> jitted update over mini-batches (vmapped over stacked policies) [device]
          -> metrics (JSONL, TensorBoard, progress bar), checkpoint, evaluation

The method (`jmarl.algos.Method`) and the plan (`jmarl.workflows.Plan`) are values: the loop
calls their hooks and never branches on their names. Everything that decides a step's data is
a function of (config, step): task seeds are `train_seed(step * num_tasks + i)` and the step's
key is `fold_in(key(seed), step)`, so a run resumed from a checkpoint continues exactly where
the killed one would have gone; the method's state (HACPO's window, JoyAgents-R1's memory) is in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmarl import algos, envs, models, workflows
from jmarl import memory_check
from jmarl import sharding as sharding_lib
from jmarl.algos.method import MethodContext
from jmarl.config import Config, algo_options, dump_yaml, parse_bytes, plan_options
from jmarl.errors import JmarlError
from jmarl.memory_check import Program, ProgramMemory
from jmarl.sandbox import run_summary as sandbox_summary
from jmarl.sharding import to_host
from jmarl.train.build import build_policies, init_state
from jmarl.train.checkpoint import Checkpointer
from jmarl.train.evaluate import evaluate, step_info_metrics
from jmarl.train.host_loop import run_rollout
from jmarl.train.learn import LearnSettings, learn
from jmarl.train.learner import build_group_fns, policy_axis_size, sft_batch
from jmarl.train.metrics import (
    METRICS_FILE,
    MetricsLogger,
    before_summary,
    is_main_process,
    memory_metrics,
    results_table,
    rewind_metrics,
    rollout_length_metrics,
    signal_metrics,
    write_summary,
)
from jmarl.train.optim import make_optimizer
from jmarl.train.packing import shape_of
from jmarl.train.programs import trainer_programs
from jmarl.train.remat_plan import plan_remat
from jmarl.train.progress import ProgressBar, say
from jmarl.train.sampling import ModelSampler, encode_prompt
from jmarl.workflows import plan_metrics, summarize
from jmarl.workflows.plans import PlanContext, get_plan

log = logging.getLogger(__name__)


class Trainer:
    """Owns a run: env, plan, method, policies, sampler, compiled functions, logger, checkpoints."""

    def __init__(self, config: Config, *, abstract: bool = False):
        """abstract: build the run's device functions over `jax.ShapeDtypeStruct` states (sharded
        like the real ones) and write nothing: what `jmarl.memory_check` compiles; it cannot train."""
        self.config, self.abstract = config, abstract
        # what the run has cost: this attempt from here, earlier attempts from the checkpoint resumed
        self.attempt_started = (time.perf_counter(), _process_cpu_seconds())
        self.spent, self.attempts = {"wall_seconds": 0.0, "cpu_seconds": 0.0}, 1
        self.out = Path(config.output_dir)
        if not abstract:
            self.out.mkdir(parents=True, exist_ok=True)
        self.env = envs.make(config.env.name, **dict(config.env.options))
        self.method = algos.get_method(config.algo.name)
        self.plan = get_plan(config.workflow.plan)
        self.method.check_plan(self.plan)
        self.key = jax.random.key(config.seed)
        o = config.optim
        self.optimizer = make_optimizer(
            o.lr, total_steps=config.train.steps * o.epochs * o.minibatches, warmup_steps=o.warmup_steps,
            schedule=o.schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps, grad_clip=o.grad_clip,
        )
        ws = config.train.warm_start
        self.sft_optimizer = make_optimizer(ws.lr, total_steps=max(ws.steps, 1), grad_clip=o.grad_clip, weight_decay=0.0)
        algo_cfg = algo_options(config)
        self.need_ref = getattr(algo_cfg, "kl_coef", 0.0) > 0  # a reference policy for the KL term
        self.policies = build_policies(
            config, self.env.agents, jax.random.fold_in(self.key, 10**6), self.optimizer, need_ref=self.need_ref,
            abstract=abstract, routes_by_agent=self.plan.routes_by_agent,
        )
        names = self.policies.policy_names
        tokenizers = {p: self.policies.group_of(p).tokenizer for p in range(len(names))}
        self.plan_opts = self.plan.bind(plan_options(config), PlanContext(tokenizers=tokenizers))
        self.algo_cfg = algo_cfg
        context = MethodContext(num_policies=len(names), group_size=config.workflow.group_size, plan_options=self.plan_opts)
        self.method_state = self.method.init_state(self.algo_cfg, context)
        self.rollouts_generated = 0
        s = config.sampling
        self.temperature = s.temperature if s.temperature > 0 else 1.0
        self.parts = o.minibatches * o.grad_accum
        self.mesh = sharding_lib.mesh_from_config(config.mesh)
        self.sampler = ModelSampler(self.policies, s, mesh=self.mesh)  # rows and KV cache sharded over the mesh
        if config.train.router_aux_loss_coef > 0 and not any(g.model_config.is_moe for g in self.policies.groups):
            raise JmarlError(f"train.router_aux_loss_coef: {config.train.router_aux_loss_coef} weighs the router's "
                             "load-balancing loss of mixture-of-experts models, and no policy's model has experts; "
                             "set it to 0")
        self.fns = [self._group_fns(g) for g in self.policies.groups]
        if self.mesh.size > 1:
            log.info("sharded the policies over the mesh %s", sharding_lib.format_mesh(sharding_lib.axis_sizes(self.mesh)))
        self.checkpointer = None if abstract else Checkpointer(self.out / "checkpoints", keep=config.checkpoint.keep)
        self.step = 0
        self.warm_started = False
        # per policy group, the packed (rows, width) shapes its updates compiled for: a later step
        # takes one when it costs little more (`packing.row_shape`); checkpointed, so a resumed
        # run packs as the uninterrupted one did
        self.packed_shapes: list[set[tuple[int, int]]] = [set() for _ in self.policies.groups]
        self.resumed_step: int | None = None  # the checkpoint step `maybe_resume` restored
        # metrics.jsonl records up to the last step logged: what a checkpoint stores, so that a
        # resume rewinds the file to it (`jmarl.train.metrics.rewind_metrics`); None: unknown
        self.metrics_records: int | None = None

    def set_remat(self, group_index: int, policy: str) -> None:
        """Runs group `group_index` with layer remat `policy` (one of `REMAT_POLICIES`): its model
        config changed and its device functions rebuilt (`jmarl.train.remat_plan` chooses it)."""
        group = self.policies.groups[group_index]
        if group.model_config.remat == policy:
            return
        group.model_config = group.model_config.replace(remat=policy)
        self.fns[group_index] = self._group_fns(group)

    def _group_fns(self, group: Any) -> Any:
        """`group`'s device functions, built sharded on a mesh of several devices: its state,
        LoRA base and reference placed first (`jmarl.sharding.group_shardings` from its model's
        declared axes), then the updates and scoring passes built with those shardings."""
        o, mesh = self.config.optim, self.mesh
        shardings = None
        if mesh.size > 1:
            shardings = sharding_lib.group_shardings(models.param_axes(group.model_config), group.state, group.base,
                                                     group.ref, mesh, stacked=group.stacked)
            group.state, group.base, group.ref = sharding_lib.place_group(shardings, group.state, group.base, group.ref)
        return build_group_fns(
            group, self.method, self.algo_cfg, self.optimizer, self.sft_optimizer, temperature=self.temperature,
            minibatches=o.minibatches, grad_accum=o.grad_accum, epochs=o.epochs, mesh=mesh, shardings=shardings,
            router_aux_loss_coef=self.config.train.router_aux_loss_coef,
        )

    # ---- what the plan and the learner read each step

    def step_plan_options(self) -> Any:
        """The plan's options for this step, with the values the method feeds it (`plan_inputs`)."""
        return dataclasses.replace(self.plan_opts, **self.method.plan_inputs(self.algo_cfg, self.method_state))

    def rows_bound(self) -> int:
        """Samples per learner per step where the plan fixes them (`Plan.rows_per_policy`), else 0."""
        bound = self.plan.rows_per_policy
        return 0 if bound is None else int(bound(self.plan_opts, self.config.workflow.num_tasks))

    def rows_per_part(self, group: Any) -> int:
        """Packed rows per micro-batch: one per device that splits the group's rows (1 without a mesh)."""
        if self.mesh is None:
            return 1
        sizes = dict(self.mesh.shape)
        return int(np.prod([sizes[a] for a in sharding_lib.row_axes(self.mesh, stacked=group.stacked)], dtype=int))

    def method_device_state(self) -> Any:
        """What the method's advantages read of its state (`Method.device_state`)."""
        return self.method.device_state(self.algo_cfg, self.method_state)

    # ---- state for checkpoints

    def state_tree(self) -> dict[str, Any]:
        """Everything a resume needs that lives on the device: each group's train state and the
        KL reference of full-parameter groups (the warm start moves it; a LoRA reference is the base)."""
        return {"groups": [g.state for g in self.policies.groups],
                "refs": {str(i): g.ref for i, g in enumerate(self.policies.groups) if g.ref is not None and g.lora_rank is None}}

    def load_state_tree(self, tree: dict[str, Any]) -> None:
        for i, (g, st) in enumerate(zip(self.policies.groups, tree["groups"])):
            g.state, g.ref = st, tree.get("refs", {}).get(str(i), g.ref)

    def time_spent(self) -> dict[str, float]:
        """Wall and CPU seconds (this process's, JAX's threads included) the run has cost: the
        earlier attempts' up to their last checkpoint plus this attempt's so far."""
        now_cpu = _process_cpu_seconds()
        return {"wall_seconds": self.spent["wall_seconds"] + time.perf_counter() - self.attempt_started[0],
                "cpu_seconds": self.spent["cpu_seconds"] + now_cpu - self.attempt_started[1]}

    def save(self) -> None:
        meta = {
            "step": self.step, "warm_started": self.warm_started, "config": json.loads(json.dumps(_plain(self.config))),
            "method_state": self.method.state_to_json(self.method_state), "rollouts_generated": self.rollouts_generated,
            "packed_shapes": [sorted(map(list, shapes)) for shapes in self.packed_shapes],
            "metrics_records": self.metrics_records, "attempts": self.attempts, **self.time_spent(),
        }
        self.checkpointer.save(self.step, self.state_tree(), meta)
        self.checkpointer.wait()
        self.method.save_files(self.algo_cfg, self.method_state, self.out)

    def maybe_resume(self) -> bool:
        """With `resume`, restores the newest intact checkpoint (state, step, method state, the
        metrics position) and sets `resumed_step`; False when resume is off or there is none."""
        if not self.config.resume or self.checkpointer.latest_step() is None:
            return False
        restored = self.checkpointer.restore(self.state_tree())
        self.load_state_tree(restored.state)
        meta = restored.meta
        self.step = self.resumed_step = int(meta.get("step", restored.step))
        records = meta.get("metrics_records")
        self.metrics_records = None if records is None else int(records)
        self.warm_started = bool(meta.get("warm_started", True))
        if meta.get("method_state") is not None:
            self.method_state = self.method.state_from_json(self.algo_cfg, meta["method_state"])
        self.rollouts_generated = int(meta.get("rollouts_generated", 0))
        self.spent = {k: float(meta.get(k, 0.0)) for k in ("wall_seconds", "cpu_seconds")}
        self.attempts = int(meta.get("attempts", 1)) + 1
        for shapes, saved in zip(self.packed_shapes, meta.get("packed_shapes", [])):
            shapes.update((int(r), int(w)) for r, w in saved)
        log.info("resumed from step %d", self.step)
        return True

    # ---- warm start (supervised, on expert demonstrations)

    def demonstrations(self, seeds: list[int], memory_seeds: list[int] | None = None) -> list[tuple[int, str, str]]:
        """(policy id, prompt, expert text) for every agent step of the expert episodes (the
        episode loop of the plans); with `memory_seeds`, each prompt carries the memory lines
        retrieved from a memory of those seeds' expert episodes (`demonstration_memory`); with a
        plan that does not route by agent, every policy plays the one agent."""
        env = self.env
        if memory_seeds:
            env = workflows.MemoryPromptEnv(self.env, workflows.demonstration_memory(self.env, memory_seeds))
        demos = workflows.expert_demonstrations(env, seeds, self.policies.agent_policy)
        if self.plan.routes_by_agent:
            return demos
        return [(p, obs, text) for _, obs, text in demos for p in range(len(self.policies.policy_names))]

    def warm_start(self) -> None:
        ws, s = self.config.train.warm_start, self.config.sampling
        if ws.steps <= 0 or self.warm_started:
            return
        bar = ProgressBar(ws.steps, desc="warm start", enabled=self.config.logging.progress)
        known: list[set[tuple[int, int]]] = [set() for _ in self.policies.groups]  # as `packed_shapes`
        for i in range(ws.steps):
            seeds = [envs.train_seed(10**8 + i * ws.demos + j) for j in range(ws.demos)]
            shown = np.random.default_rng((self.config.seed, i)).random(ws.demos) < ws.memory_share
            demos = self.demonstrations([seed for seed, m in zip(seeds, shown) if not m])
            if shown.any():  # the memory: as many other episodes, a fresh draw each step
                memory_seeds = [envs.train_seed(2 * 10**8 + i * ws.demos + j) for j in range(ws.demos)]
                demos += self.demonstrations([seed for seed, m in zip(seeds, shown) if m], memory_seeds)
            for group, fns, shapes in zip(self.policies.groups, self.fns, known):
                tok = group.tokenizer
                rows = [(pid, encode_prompt(tok, prompt, s.max_prompt_len), tok.encode(text)[: s.max_new_tokens - 1] + [tok.eos_id])
                        for pid, prompt, text in demos if pid in group.policy_ids]
                batch = sft_batch(group, rows, self.rows_per_part(group), known=shapes)
                if batch is not None:
                    packed = shape_of(batch)
                    shapes.add((packed.rows, packed.width))
                    group.state, metrics = fns.sft_update(group.state, group.base, batch)
            bar.update({"nll": float(np.mean(jax.device_get(metrics["sft_nll"])))})
        bar.close()
        for g in self.policies.groups:  # a fresh optimizer state for RL (the warm start used its own)
            g.state = init_state(g.state.params, self.optimizer, g.stacked)
            if g.ref is not None and g.lora_rank is None:
                g.ref = jax.tree.map(jnp.copy, g.state.params)
        self.warm_started = True

    # ---- one RL step

    def rl_step(self) -> dict[str, float]:
        cfg = self.config
        t0 = time.perf_counter()
        key = jax.random.fold_in(self.key, self.step)
        seeds = [envs.train_seed(self.step * cfg.workflow.num_tasks + i) for i in range(cfg.workflow.num_tasks)]
        self.sampler.new_tokens = 0
        result, timings = run_rollout(self, seeds, key)  # time/generate, time/env, time/host + the sampler's stats
        metrics = {f"rollout/{k}": v for k, v in summarize(result.episodes).items()}
        # the method's state learns from the plan before any advantage (HACPO's window, the memory)
        self.method_state, method_metrics = self.method.after_plan(self.algo_cfg, self.method_state, result, self.step)
        metrics.update(method_metrics)
        generated = result.stats.num_generated
        self.rollouts_generated += generated
        metrics.update(plan_metrics(result.stats))  # plan/<name> for each number the plan reports
        metrics.update({"rollout/generated": float(generated), "rollout/generated_total": float(self.rollouts_generated),
                        "rollout/samples": float(len(result.records)), **timings,
                        "rollout/new_tokens_per_s": self.sampler.new_tokens / max(timings["time/generate"], 1e-9)})
        if not result.records:
            return metrics
        records = result.records
        rewards = np.asarray([r.reward for r in records], np.float64)
        finite = rewards[np.isfinite(rewards)]
        metrics["rollout/reward_mean"] = float(np.mean(finite)) if finite.size else float("nan")
        metrics["rollout/reward_std"] = float(np.std(finite)) if finite.size else float("nan")
        metrics["rollout/nonfinite_rewards"] = float(rewards.size - finite.size)
        metrics.update(step_info_metrics(records))
        names = self.policies.policy_names
        metrics.update(signal_metrics([r.group for r in records], [r.policy for r in records],
                                      [r.reward for r in records], names))
        metrics.update(rollout_length_metrics(
            records, names, cfg.sampling.max_new_tokens,
            eos_ids=[self.policies.group_of(p).tokenizer.eos_id for p in range(len(names))]))
        learned = []
        for group, fns, shapes in zip(self.policies.groups, self.fns, self.packed_shapes):
            prefix = "train/" if len(self.policies.groups) == 1 else f"train/{group.name}/"
            settings = LearnSettings(self.parts, self.rows_bound(), self.rows_per_part(group),
                                     policy_axis_size(self.mesh), cfg.train.recompute_old_logprobs, names, prefix)
            out = learn(group, fns, records, self.method_device_state(), settings, shapes)
            if out.updated:
                metrics.update(out.metrics)
                metrics["train/skipped_updates"] = (metrics.get("train/skipped_updates", 0.0)
                                                    + float(np.sum(jax.device_get(group.state.skipped))))
            learned.append(out)
        t_score = sum(x.score_seconds for x in learned)
        t_learn = t_score + sum(x.update_seconds for x in learned)
        metrics.update({"time/score": t_score, "time/update": t_learn, "time/step": time.perf_counter() - t0})
        sequence_tokens = sum(np.size(r.completion.prompt_tokens) + np.size(r.completion.completion_tokens)
                              for r in records)
        metrics["perf/train_tokens_per_s"] = float(sequence_tokens) / max(t_learn, 1e-9)
        real_tokens, token_slots = sum(x.real_tokens for x in learned), sum(x.token_slots for x in learned)
        if token_slots:
            metrics["learner/token_utilization"] = real_tokens / token_slots
            metrics["learner/real_tokens_per_s"] = real_tokens / max(t_learn - t_score, 1e-9)
        return metrics

    # ---- evaluation and export

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (`jmarl.train.evaluate`), on the env as the method shows it (`eval_env`)."""
        env = self.method.eval_env(self.algo_cfg, self.method_state, self.env)
        shown = self.config.logging.progress
        say(f"evaluating {self.config.eval.num_episodes} held-out episodes at step {self.step} ...", enabled=shown)
        t0 = time.perf_counter()
        out = evaluate(env, self.sampler, self.policies.agent_policy, self.policies.policy_names, self.config.eval,
                       jax.random.fold_in(self.key, -1 % (2**31)), routes_by_agent=self.plan.routes_by_agent,
                       max_turns=self.config.workflow.max_turns)
        say(f"evaluated in {time.perf_counter() - t0:.0f} s: held-out success {out.get('eval/success_rate', float('nan')):.3f}",
            enabled=shown)
        return out

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

    def programs(self) -> list[Program]:
        """Every program a step (and the warm start) runs, per policy group, with abstract
        arguments and the shapes they are compiled for (`jmarl.train.programs`); what the memory
        check compiles. Nothing is compiled or allocated here."""
        return trainer_programs(self)

    def check_memory(self) -> list[ProgramMemory]:
        """Before step 0: when train.memory_check is "on", or "auto" on an accelerator, compiles
        the run's programs for the real devices (`jmarl.memory_check`) and raises JmarlError,
        naming the program and the settings to change, when one would not fit in
        train.device_memory (else the device's own) less train.memory_headroom. Returns the
        per-program figures ([] when off)."""
        t = self.config.train
        if t.memory_check == "off" or (t.memory_check == "auto" and jax.default_backend() == "cpu"):
            return []
        limit = None if t.device_memory is None else parse_bytes(t.device_memory)
        device_memory, _ = memory_check.device_memory_of(limit)
        measured: dict = {}  # the planner's figures of the chosen policies: not compiled twice
        if device_memory is not None:  # model.remat auto: the least recompute that fits
            plan_remat(self, device_memory, t.memory_headroom, measured=measured)
        return memory_check.check(self.programs(), limit, t.memory_headroom, known=measured)

    def run(self) -> dict[str, Any]:
        cfg = self.config
        if self.abstract:
            raise JmarlError("this Trainer was built with abstract=True (for jmarl.memory_check); build Trainer(config) to train")
        self.check_memory()
        (self.out / "config.yaml").write_text(dump_yaml(cfg))
        resumed = self.maybe_resume()
        dropped = 0
        if resumed:  # what the interrupted run logged after its checkpoint is logged again below
            dropped = rewind_metrics(self.out, self.metrics_records, self.step)
        else:  # a fresh run into a used output_dir: do not append to the old run's curves
            (self.out / METRICS_FILE).unlink(missing_ok=True)
        if cfg.resume and is_main_process():
            print(resume_message(self.resumed_step, cfg.train.steps, self.checkpointer.directory, dropped), flush=True)
        logger = MetricsLogger(self.out, tensorboard=cfg.logging.tensorboard, plots=cfg.logging.plots,
                               purge_step=self.step + 1 if resumed else None)
        self.metrics_records = logger.records
        summary_path = self.out / "summary.json"
        before, before_fields = None, {}
        if resumed and summary_path.exists():
            previous = json.loads(summary_path.read_text())
            before = previous.get("success_before")
            before_fields = {k: v for k, v in previous.items() if k.startswith("before_")}
        if before is None:
            self.warm_start()
            before_metrics = self.evaluate()
            logger.log(0, before_metrics)  # the model RL starts from: step 0 of the evaluation curves
            self.metrics_records = logger.records
            before = before_metrics.get("eval/success_rate", 0.0)
            before_fields = before_summary(before_metrics)
            write_summary(self.out, {"success_before": before, "steps": self.step, **before_fields})
        bar = ProgressBar(cfg.train.steps, desc=f"{self.method.name} on {cfg.env.name}", initial=self.step, enabled=cfg.logging.progress)
        try:
            while self.step < cfg.train.steps:
                metrics = self.rl_step()
                metrics.update(memory_metrics(jax.local_devices()))
                self.step += 1
                if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                    metrics.update(self.evaluate())
                logger.log(self.step, metrics)
                self.metrics_records = logger.records  # not the final evaluation's: a resume redoes it
                bar.update({"reward": metrics.get("rollout/reward_mean", float("nan")),
                            "success": metrics.get("rollout/success_rate", float("nan")), **metrics})
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
            "success_before": before, "success_after": final.get("eval/success_rate", 0.0), "steps": self.step,
            **self.time_spent(), "attempts": self.attempts, "rollouts_generated": self.rollouts_generated,
            **{k.replace("perf/", ""): v for k, v in memory_metrics(jax.local_devices()).items()},
            **{k.replace("eval/", "eval_"): v for k, v in final.items()}, **before_fields, **sandbox_summary(),
        }
        write_summary(self.out, summary)
        self.checkpointer.close()
        print(results_table(summary, cfg, self.out), flush=True)
        return summary


def _process_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def resume_message(resumed_step: int | None, total_steps: int, checkpoints: Path, dropped: int) -> str:
    """The line a run with resume=true prints before training: the checkpoint step it continues
    from (None: it found none and starts fresh), what is left of `total_steps`, and how many
    metrics.jsonl records the interrupted run had written after that checkpoint (`dropped`)."""
    if resumed_step is None:
        return f"resume=true: no checkpoint in {checkpoints}; starting from step 0 (fresh run)"
    left = (f"continuing with step {resumed_step + 1} of {total_steps}" if resumed_step < total_steps
            else f"all {total_steps} steps done; final evaluation and export only")
    logged = f"; dropped {dropped} metrics.jsonl record(s) logged after it" if dropped else ""
    return f"resumed from the checkpoint of step {resumed_step} in {checkpoints}: {left}{logged}"


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
