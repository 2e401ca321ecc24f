"""Whole RL iterations (generate, reward, score, update), completions/s: jmarl's trainer vs TRL's
`GRPOTrainer` (single-agent GRPO) and vs CoMLRL's `MAGRPOTrainer` (two agents).

    python -m benchmarks.iteration [--shape cpu-small|cpu-medium|smollm2] [--which grpo|magrpo|all]
        [--repeats 5] [--new-tokens 64] [--prompts 8] [--out results.json]

Same checkpoint and tokenizer on every side (`benchmarks.common.write_checkpoint`: a random shape
with the char tokenizer, or `smollm2`, SmolLM2-135M-Instruct with its own tokenizer and ChatML
template; every side loads the tokenizer from the checkpoint's `TOKENIZER_SUBDIR`), same prompts
under that tokenizer's chat template and the same reward (`benchmarks.workload`), 8 prompts x 8
completions per policy per iteration, 64 new tokens, temperature 1, no top-k / top-p, AdamW lr
1e-6 with weight decay 0.01 and grad-norm clip 1.0, one optimizer step per policy per iteration,
no KL. Prompts are 64 tokens under the char tokenizer (48 under SmolLM2's, system prompt
included; `prompt_len` in the row, counted with the checkpoint's tokenizer).

New tokens: every completion has exactly that many on both sides: the baselines get
`min_new_tokens` = new tokens, jmarl `sampling.ignore_eos` (a real model ends most answers early,
and a side that stops at EOS would do less work). Each row records the completion lengths both
sides produced over the timed repeats (`jmarl_completion_tokens_mean`;
`baseline_completion_tokens_mean` for TRL, from its `completions/mean_length` log), which show it.

jmarl: `jmarl.train.trainer.Trainer.rl_step` (ModelSampler -> plan -> records -> packed batch -> advantages ->
jitted update) with `train.recompute_old_logprobs=false` (TRL with one iteration per generation
likewise takes the old log-probs as the detached current ones; neither side runs an extra
scoring pass). GRPO: `independent` plan, group 8. MAGRPO: `joint` plan (aligned), two
per-agent policies stacked in one program.

Pairing: each baseline runs in a process of its own, out of the box (`benchmarks.baseline_process`).
TRL runs `trainer.train()` for warm-up + repeats steps there; a callback waits for the parent's
run request before each step and reports the step's seconds (`on_step_begin` -> `on_step_end`:
generation, reward, loss, backward, AdamW) after it, and the parent runs one jmarl iteration
between TRL steps, so the two alternate A B A B; TRL's first step is excluded. CoMLRL: each
repeat is one `trainer.train()` over 8 prompts (one epoch: 8 x 2 x 8 completions, one update
per agent), alternated with one jmarl iteration.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from typing import Any

from benchmarks.baseline_process import BaselineProcess, Channel, SelfDriven
from benchmarks.common import (GROUP_SIZE, LR, NEW_TOKENS, NUM_PROMPTS, PROMPT_LEN, TOKENIZER_SUBDIR, known_shapes,
                               make_row, paired_times, results_end, results_header, timed, weights_of,
                               write_checkpoint, write_json)
from benchmarks.workload import comlrl_reward, templated_prompts, trl_reward


def jmarl_trainer(checkpoint: str, out_dir: str, *, num_agents: int, new_tokens: int = NEW_TOKENS,
                  num_prompts: int = NUM_PROMPTS, group_size: int = GROUP_SIZE):
    """A jmarl `Trainer` on the benchmark task: GRPO (1 agent) or MAGRPO (2 agents)."""
    from jmarl.config import config_from_dict
    from jmarl.train.trainer import Trainer

    multi = num_agents > 1
    data = {
        "seed": 0,
        "output_dir": out_dir,
        "env": {"name": "benchmarks.workload:BenchTask", "options": {"num_agents": num_agents}},
        "algo": {"name": "magrpo" if multi else "grpo"},
        "model": {"path": checkpoint},
        "tokenizer": os.path.join(checkpoint, TOKENIZER_SUBDIR),
        "workflow": {"plan": "joint" if multi else "independent", "group_size": group_size, "num_tasks": num_prompts},
        "policies": {"mode": "per_agent" if multi else "shared"},
        "sampling": {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                     "max_prompt_len": PROMPT_LEN, "ignore_eos": True},
        "optim": {"lr": LR, "weight_decay": 0.01, "grad_clip": 1.0},
        "train": {"steps": 10**6, "recompute_old_logprobs": False},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }
    return Trainer(config_from_dict(data))


def jmarl_runner(trainer, lengths: dict[int, float] | None = None) -> Any:
    """run(i) -> seconds of one `rl_step` (it returns host metrics, so it has finished);
    `lengths[i]`, where given, gets run i's mean completion length in tokens (stop token
    included; `rollout/completion_length_mean`)."""

    def run(i: int) -> float:
        metrics: dict[str, float] = {}
        seconds = timed(lambda: metrics.update(trainer.rl_step()))
        trainer.step += 1
        if lengths is not None:
            lengths[i] = metrics["rollout/completion_length_mean"]
        return seconds

    return run


def _prepare(shape: str, workdir: str, *, num_agents: int, new_tokens: int, num_prompts: int = NUM_PROMPTS):
    """(checkpoint dir, jmarl iteration runner, its first and warm call seconds, the runner's
    completion lengths by run index)."""
    ckpt = os.path.join(workdir, "model")
    write_checkpoint(shape, ckpt)
    trainer = jmarl_trainer(ckpt, os.path.join(workdir, "jmarl"), num_agents=num_agents, new_tokens=new_tokens,
                            num_prompts=num_prompts)
    lengths: dict[int, float] = {}
    run_jmarl = jmarl_runner(trainer, lengths)
    first, warm = run_jmarl(0), run_jmarl(1)
    return ckpt, run_jmarl, first, warm, lengths


def timed_mean(lengths: dict[int, float]) -> float | None:
    """The mean of the timed repeats' values (run indices >= 100, `paired_times`), or None."""
    timed_values = [v for i, v in lengths.items() if i >= 100]
    return sum(timed_values) / len(timed_values) if timed_values else None


def prompt_tokens(checkpoint: str) -> int:
    """Token count of the workload's templated prompt (seed 0) under the checkpoint's tokenizer."""
    tok = _tokenizer(checkpoint)
    return len(tok(templated_prompts(tok, [0])[0]).input_ids)


def _tokenizer(checkpoint: str):
    """The checkpoint's tokenizer (`TOKENIZER_SUBDIR`), padding on the left (as both PyTorch
    trainers need)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(checkpoint, TOKENIZER_SUBDIR))
    tok.padding_side = "left"
    return tok


TRL_LOG = "step_logs.jsonl"  # in TRL's output_dir: one line per step of what its trainer logged


def trl_trainer(checkpoint: str, output_dir: str, steps: int, new_tokens: int, num_prompts: int = NUM_PROMPTS) -> SelfDriven:
    """Baseline-process setup: TRL's `GRPOTrainer` for `steps` steps on the benchmark task; each
    step (`on_step_begin` -> `on_step_end`: generation, reward, loss, backward, AdamW) waits for a
    run request and replies with its seconds. Each step's log (`completions/mean_length` among
    it) is appended to `output_dir/TRL_LOG` (`trl_completion_lengths` reads it)."""
    import json

    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = _tokenizer(checkpoint)
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, beta=0.0,
        loss_type="grpo", num_generations=GROUP_SIZE, per_device_train_batch_size=num_prompts * GROUP_SIZE,
        gradient_accumulation_steps=1, max_completion_length=new_tokens,
        generation_kwargs={"min_new_tokens": new_tokens}, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=LR, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant",
        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=0, dataloader_num_workers=0,
    )

    def serve(channel: Channel) -> None:
        class Pair(transformers.TrainerCallback):
            def on_step_begin(self, *a, **k):
                channel.next_run()
                self.start = time.perf_counter()

            def on_step_end(self, *a, **k):
                channel.reply(time.perf_counter() - self.start)

            def on_log(self, args, state, control, logs=None, **k):
                os.makedirs(output_dir, exist_ok=True)
                with open(os.path.join(output_dir, TRL_LOG), "a") as f:
                    f.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")

        prompts = templated_prompts(tok, range(num_prompts * steps))
        trl = GRPOTrainer(model=checkpoint, reward_funcs=[trl_reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[Pair()])
        trl.train()

    return SelfDriven(serve)


def trl_completion_lengths(output_dir: str) -> dict[int, float]:
    """TRL's mean completion length in tokens (EOS included) by step (1-based), from the
    `TRL_LOG` its baseline process wrote in `output_dir` ({} when it logged none)."""
    import json

    path = os.path.join(output_dir, TRL_LOG)
    if not os.path.exists(path):
        return {}
    out = {}
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            if "completions/mean_length" in entry:
                out[int(entry["step"])] = float(entry["completions/mean_length"])
    return out


def bench_grpo_vs_trl(shape: str, repeats: int, *, new_tokens: int = NEW_TOKENS,
                      baseline_host_memory: str = "default", num_prompts: int = NUM_PROMPTS) -> dict[str, Any]:
    """The `grpo_iteration_vs_trl` row (TRL in a `BaselineProcess`; its first step is the warm-up);
    `num_prompts` x GROUP_SIZE completions per iteration on both sides."""
    with tempfile.TemporaryDirectory() as d:
        ckpt, run_jmarl, first, warm, jmarl_lengths = _prepare(shape, d, num_agents=1, new_tokens=new_tokens,
                                                               num_prompts=num_prompts)
        trl_dir = os.path.join(d, "trl")
        with BaselineProcess("benchmarks.iteration:trl_trainer", host_memory=baseline_host_memory, checkpoint=ckpt,
                             output_dir=trl_dir, steps=repeats + 1, new_tokens=new_tokens,
                             num_prompts=num_prompts) as trl:
            paired = paired_times(run_jmarl, trl.run, repeats, jmarl_warmed=(first, warm))
        trl_lengths = [v for step, v in trl_completion_lengths(trl_dir).items() if step > 1]  # step 1: warm-up
        prompt_len = prompt_tokens(ckpt)
    completions = float(num_prompts * GROUP_SIZE)
    row = make_row("grpo_iteration_vs_trl", "completions_per_s", shape, completions, paired,
                   completions_per_iteration=completions, prompt_len=prompt_len, new_tokens=new_tokens,
                   jmarl_completion_tokens_mean=timed_mean(jmarl_lengths),
                   baseline_completion_tokens_mean=sum(trl_lengths) / len(trl_lengths) if trl_lengths else None,
                   jmarl_ignores_eos=True, group_size=GROUP_SIZE, weights=weights_of(shape),
                   baseline_impl="trl.GRPOTrainer (eager torch, HF generate)",
                   baseline_host_memory=trl.info["host_memory_policy"])
    _report(row)
    return row


def _report(row: dict[str, Any]) -> None:
    lengths = f"jmarl {row['jmarl_completion_tokens_mean']}"
    if row.get("baseline_completion_tokens_mean") is not None:
        lengths += f", baseline {row['baseline_completion_tokens_mean']}"
    print(f"[{row['name']} {row['size']}] jmarl {row['jmarl']:.1f} completions/s, baseline {row['baseline']:.1f}, "
          f"ratio {row['paired_ratio_median']:.2f} (jmarl compile {row['jmarl_compile_s']:.0f}s); "
          f"mean completion tokens: {lengths}", flush=True)


def pad_outside_prompts(tok, prompts: list[str]) -> None:
    """Makes `tok`'s pad token one that no prompt in `prompts` holds: CoMLRL takes a prompt to end
    at its first pad token (and a completion likewise), and a tokenizer whose pad is its EOS
    (SmolLM2: `<|im_end|>`) has it inside every chat-templated prompt, which would cut the prompt
    there and leave every completion empty. The unknown token stands in; prompts of equal length
    (the workload's) are never padded, so only where CoMLRL looks for the end changes."""
    from jmarl.errors import JmarlError

    used = {i for p in prompts for i in tok(p).input_ids}
    if tok.pad_token_id not in used:
        return
    if tok.unk_token is None or tok.unk_token_id in used:
        raise JmarlError(f"the tokenizer's pad token {tok.pad_token!r} occurs in the chat-templated prompts and it "
                         f"has no unknown token outside them to pad with instead; CoMLRL would cut every prompt "
                         f"at the pad token")
    tok.pad_token = tok.unk_token


def comlrl_runner(checkpoint: str, new_tokens: int):
    """Baseline-process setup: run(i) -> seconds of one CoMLRL `MAGRPOTrainer.train()` over 8 new
    prompts (one epoch: 8 x 2 x 8 completions, one update per agent), two agents on the checkpoint."""
    import transformers
    from comlrl.trainers.reinforce.magrpo import MAGRPOConfig, MAGRPOTrainer
    from datasets import Dataset

    tok = _tokenizer(checkpoint)
    pad_outside_prompts(tok, templated_prompts(tok, range(NUM_PROMPTS)))
    args = MAGRPOConfig(
        num_train_epochs=1, agent_learning_rate=LR, num_agents=2, num_generations=GROUP_SIZE,
        max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, top_k=0, num_turns=1,
        early_termination_threshold=None, eval_interval=0, eval_num_samples=0,
        rollout_buffer_size=NUM_PROMPTS, train_batch_size=NUM_PROMPTS, logging_steps=1,
    )
    models = [transformers.AutoModelForCausalLM.from_pretrained(checkpoint) for _ in range(2)]
    seed_base = [0]

    def run(i: int) -> float:
        seeds = range(seed_base[0], seed_base[0] + NUM_PROMPTS)
        seed_base[0] += NUM_PROMPTS
        data = Dataset.from_dict({"prompt": templated_prompts(tok, seeds)})
        baseline = MAGRPOTrainer(agents=models, num_agents=2, tokenizer=tok, train_dataset=data,
                                 reward_func=comlrl_reward, args=args)
        baseline.verbose = False
        start = time.perf_counter()
        baseline.train(min_new_tokens=new_tokens)
        seconds = time.perf_counter() - start
        del baseline, data
        gc.collect()  # untimed: this side builds a trainer per iteration; free it before the next
        return seconds

    return run


def bench_magrpo_vs_comlrl(shape: str, repeats: int, *, new_tokens: int = NEW_TOKENS,
                           baseline_host_memory: str = "default") -> dict[str, Any]:
    """The `magrpo_iteration_vs_comlrl` row (completions of both agents per second; CoMLRL in a
    `BaselineProcess`)."""
    with tempfile.TemporaryDirectory() as d:
        ckpt, run_jmarl, first, warm, jmarl_lengths = _prepare(shape, d, num_agents=2, new_tokens=new_tokens)
        with BaselineProcess("benchmarks.iteration:comlrl_runner", host_memory=baseline_host_memory, checkpoint=ckpt,
                             new_tokens=new_tokens) as comlrl:
            paired = paired_times(run_jmarl, comlrl.run, repeats, jmarl_warmed=(first, warm))
        prompt_len = prompt_tokens(ckpt)
    completions = float(2 * NUM_PROMPTS * GROUP_SIZE)
    # CoMLRL logs no completion lengths; `min_new_tokens` = `max_new_tokens` fixes them at new_tokens
    row = make_row("magrpo_iteration_vs_comlrl", "completions_per_s", shape, completions, paired,
                   completions_per_iteration=completions, agents=2, prompt_len=prompt_len, new_tokens=new_tokens,
                   jmarl_completion_tokens_mean=timed_mean(jmarl_lengths), baseline_min_new_tokens=new_tokens,
                   jmarl_ignores_eos=True, group_size=GROUP_SIZE, weights=weights_of(shape),
                   baseline_impl="comlrl MAGRPOTrainer (eager torch, HF generate)",
                   baseline_host_memory=comlrl.info["host_memory_policy"])
    _report(row)
    return row


def main(argv: list[str] | None = None) -> None:
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=known_shapes(), default="cpu-small")
    parser.add_argument("--which", choices=["grpo", "magrpo", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--prompts", type=int, default=NUM_PROMPTS,
                        help=f"prompts per GRPO iteration, {GROUP_SIZE} completions each (default {NUM_PROMPTS}; "
                        "smollm2: TRL's step on 64 completions needs ~18 GB)")
    parser.add_argument("--out", default=None, help="also write the rows, with the command, date, machine and "
                        "commit, to this JSON file")
    args = parser.parse_args(argv)
    header = results_header("benchmarks.iteration", argv)
    rows = []
    if args.which in ("grpo", "all"):
        rows.append(bench_grpo_vs_trl(args.shape, args.repeats, new_tokens=args.new_tokens, num_prompts=args.prompts))
    if args.which in ("magrpo", "all"):
        rows.append(bench_magrpo_vs_comlrl(args.shape, args.repeats, new_tokens=args.new_tokens))
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("_seconds")}, indent=1))
    if args.out:
        write_json(args.out, {**header, "rows": rows, **results_end()})


if __name__ == "__main__":
    from jmarl.host_memory import apply_on_cpu

    apply_on_cpu()  # jmarl's CPU host memory policy, before JAX starts (JMARL_KEEP_HOST_MEMORY=0: off)
    main()
