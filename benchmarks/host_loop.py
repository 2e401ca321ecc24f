"""Host seconds per training step, with the device stubbed: the parallel host loop's figure.

    python -m benchmarks.host_loop [--quick] [--plans tree,independent] [--tokenizers bpe,char]
                                   [--device-s 0.05] [--repeats 2] [--profile]

The workload of issue 31: 1,024 episodes x 4 turns x 2 agents x K=4 with ~4k-token prompts.
The env is Sokoban (two sequential agents, tool then planner; `max_turns=4`) whose prompts
carry a ~4k-token per-task context ahead of the board (the stand-in for a long task prompt).
Plans: `tree` (1,024 tasks, one episode each, K=4 candidates per node: 8,192 requests and
32,768 completions and env steps) and `independent` (256 tasks x G=4 = 1,024 episodes, one
completion per node: 8,192 requests, 8,192 completions). `--quick`: 64 episodes.

The device is a `FakeSampler`: per `sample` call it tokenises the prompts as the real
sampler does (`jmarl.train.sampling.encode_prompts`, i.e. the tokenizer's `encode_batch`;
"before": `encode_prompt` one prompt at a time), left-pads them, sleeps `--device-s` (the fixed
fake device time) and returns plausible Sokoban completions (token ids and log-probs, text
decoded from the ids). A step is the plan run plus the learner's host batch of its records
(`policy_samples` and `pack` per policy, what `learner_batch` runs); host
seconds = its wall time minus the fake device time; each setting runs `--repeats` times,
alternating with the other, and the best run is reported (all are kept: the machine may be
shared). Two settings per plan:

- before: `workflow.env_workers=1` (serial env steps) and per-prompt encode (for `char`, its
  former per-character encode);
- after: `workflow.env_workers` default (min(8, CPUs)) and `encode_batch` (for BPE, segment-cached:
  `jmarl.models.token_cache`; a task's ~4k-token context is tokenised once per step, not once
  per turn and agent).

Tokenizers (each run in turn): `bpe`, the repo's byte-level BPE of
`configs/hacpo/tokenizers/byte_bpe` (~2.9 characters per token, ~5 ms per 4k-token prompt on
one core: the cost the issue quotes), and `char` (one token per character: tokenising is
nearly free, which isolates the rest of the host loop). The process runs under the CLI's host
memory policy (`jmarl.host_memory.apply_on_cpu`) and starts with one unrecorded full-size step,
so the measured steps reuse host memory as a training run's later steps do. Writes `benchmarks/results/host_loop.json` (with
`--quick`: `host_loop_quick.json`), each row with the split of the host seconds
(tokenise, env, learner_batch, the rest: plan bookkeeping and the sampler's host work) and,
with `--profile`, the top functions of a cProfile of one extra "after" run (not timed).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import time
from typing import Any, Sequence

import jax
import numpy as np

from benchmarks.common import results_end, results_header, write_json
from jmarl import envs, host_memory
from jmarl.models import CharTokenizer, load_tokenizer
from jmarl.padding import bucket_length
from jmarl.train.sampling import encode_prompt, encode_prompts, left_pad
from jmarl.padding import next_pow2
from jmarl.train.learner import policy_samples, records_by_policy
from jmarl.train.packing import pack
from jmarl.workflows import Completion
from jmarl.workflows.plans import run_plan
from jmarl.workflows.stepping import default_workers, host_loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
BPE_DIR = os.path.join(REPO, "configs", "hacpo", "tokenizers", "byte_bpe")
FILLER = ("Notes on the warehouse: boxes are heavy, walls do not move, a box pushed into a corner "
          "stays there. Plan the pushes before the walks and keep the goal squares free. ")


class LongPromptEnv:
    """An env whose every prompt starts with a per-task context of ~`context_chars` characters
    (the stand-in for a long task prompt); everything else is the wrapped env's."""

    def __init__(self, env: Any, context_chars: int) -> None:
        self.env = env
        self.context_chars = context_chars
        self.name = f"{env.name}+context"

    def context(self, seed: int) -> str:
        text = f"Task {seed}. " + FILLER * (self.context_chars // len(FILLER) + 1)
        return text[: self.context_chars]

    def observe(self, state: Any, agent: str) -> str:
        return self.context(state.seed) + "\n\n" + self.env.observe(state, agent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


def completion_pool(tokenizer: Any, size: int = 64, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """`size` plausible Sokoban completions: (token ids ending in eos, behaviour log-probs)."""
    rng = random.Random(seed)
    pool = []
    for _ in range(size):
        moves = " ".join(rng.choice("UDLR") for _ in range(rng.randint(1, 8)))
        text = rng.choice(["Actions: {m}", "I push the box toward the goal.\nActions: {m}", "{m}",
                           "The box is left of the goal, so: Actions: {m}"]).format(m=moves)
        ids = np.asarray(tokenizer.encode(text) + [tokenizer.eos_id], np.int32)
        pool.append((ids, -rng.uniform(0.1, 2.0) * np.ones(ids.size, np.float32)))
    return pool


class PerCharacterEncode:
    """"before" for the char tokenizer: its former `encode`, one dict lookup per character
    (the vectorised lookup is part of this change); everything else is the tokenizer's."""

    def __init__(self, tokenizer: CharTokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        unknown = self.tokenizer.piece_to_id[self.tokenizer.UNKNOWN_CHAR]
        return [self.tokenizer.piece_to_id.get(ch, unknown) for ch in text]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


class FakeSampler:
    """The device part stubbed (module docstring): host work as the real sampler's, a fixed
    sleep for the device. Counts its fake device seconds and its tokenising seconds."""

    def __init__(self, tokenizer: Any, device_s: float, *, batch_encode: bool, max_prompt_len: int = 16384):
        self.tokenizer = tokenizer
        self.device_s = device_s
        self.batch_encode = batch_encode
        self.max_prompt_len = max_prompt_len
        self.pool = completion_pool(tokenizer)
        self.rng = np.random.default_rng(0)
        self.device_seconds = self.encode_seconds = 0.0
        self.calls = self.prompt_tokens = 0

    def sample(self, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array) -> list[list[Completion]]:
        del rng
        t0 = time.perf_counter()
        texts = [prompt for _, prompt in requests]
        if self.batch_encode:
            ids = encode_prompts(self.tokenizer, texts, self.max_prompt_len)
        else:
            tok = PerCharacterEncode(self.tokenizer) if isinstance(self.tokenizer, CharTokenizer) else self.tokenizer
            ids = [encode_prompt(tok, t, self.max_prompt_len) for t in texts]
        self.encode_seconds += time.perf_counter() - t0
        self.prompt_tokens += sum(len(p) for p in ids)
        arrays = [np.asarray(p, np.int32) for p in ids]  # one array per request, shared by its n completions
        left_pad(arrays, len(arrays), bucket_length(max(p.size for p in arrays)), self.tokenizer.pad_id)
        time.sleep(self.device_s)
        self.device_seconds += self.device_s
        self.calls += 1
        picks = self.rng.integers(len(self.pool), size=(len(requests), n))
        out = []
        for prompt, row in zip(arrays, picks):
            completions = []
            for k in row:
                tokens, logprobs = self.pool[int(k)]
                text = self.tokenizer.decode(tokens)
                completions.append(Completion(text, prompt, tokens, logprobs))
            out.append(completions)
        return out


def workload(plan: str, episodes: int, k: int) -> tuple[int, dict[str, Any]]:
    """(number of tasks, plan options) for `episodes` episodes with group size `k`."""
    if plan == "tree":
        return episodes, {"group_size": k}
    if plan == "independent":
        return episodes // k, {"group_size": k}
    raise SystemExit(f"host_loop: no workload for plan {plan!r}; use tree or independent")


def one_step(plan: str, env: Any, tokenizer: Any, *, episodes: int, k: int, device_s: float, after: bool,
             profile: bool = False) -> dict[str, Any]:
    """One step (plan + the learner's packed batch) -> its host seconds and their split."""
    num_tasks, options = workload(plan, episodes, k)
    seeds = [envs.train_seed(i) for i in range(num_tasks)]
    sampler = FakeSampler(tokenizer, device_s, batch_encode=after)
    workers = None if after else 1
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    with host_loop(workers=workers) as clock:
        result = run_plan(plan, env, seeds, (0, 1), sampler, jax.random.key(0), **options)
    t_plan = time.perf_counter() - t0
    mine = records_by_policy(result.records, (0, 1))
    size = next_pow2(max(len(m) for m in mine.values()))
    batches = pack([policy_samples(m, p, size) for p, m in mine.items()])
    if profiler:
        profiler.disable()
    total = time.perf_counter() - t0
    host = total - sampler.device_seconds
    row = {
        "plan": plan, "setting": "after" if after else "before",
        "env_workers": workers or default_workers(), "encode": "encode_batch" if after else "encode per prompt",
        "tasks": num_tasks, "episodes": len(result.episodes), "sampler_calls": sampler.calls,
        "completions": len(result.records), "prompt_tokens": sampler.prompt_tokens,
        "packed_shape": [len(batches), *np.shape(batches[0]["packed_tokens"])],
        "wall_s": total, "fake_device_s": sampler.device_seconds, "host_s": host,
        "split_s": {
            "tokenise": sampler.encode_seconds, "env": clock.seconds, "learner_batch": total - t_plan,
            "rest": t_plan - sampler.device_seconds - sampler.encode_seconds - clock.seconds,
        },
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
        row["profile_top_tottime"] = [line for line in text.getvalue().splitlines() if line.strip()][-22:]
    del batches, result
    return row


def make_tokenizer(name: str) -> Any:
    return load_tokenizer(BPE_DIR) if name == "bpe" else CharTokenizer()


def long_prompt_env(tokenizer: Any, prompt_tokens: int, turns: int) -> tuple[LongPromptEnv, int]:
    """Sokoban with a per-task context sized so that a prompt is ~`prompt_tokens` tokens of
    `tokenizer`; and the measured token count of one prompt."""
    env0 = envs.make("sokoban", max_turns=turns)
    probe = LongPromptEnv(env0, 20_000).observe(env0.reset(0), "tool")
    chars_per_token = len(probe) / len(tokenizer.encode(probe))
    base = len(tokenizer.encode(env0.observe(env0.reset(0), "planner")))  # the board and instructions
    env = LongPromptEnv(env0, int(max(prompt_tokens - base, 0) * chars_per_token))
    return env, len(tokenizer.encode(env.observe(env0.reset(0), "planner")))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 episodes instead of 1,024")
    ap.add_argument("--plans", default="tree,independent")
    ap.add_argument("--tokenizers", default="bpe,char", help="comma-separated: bpe, char")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--device-s", type=float, default=0.05, help="fake device seconds per sampler call")
    ap.add_argument("--repeats", type=int, default=2, help="runs per setting (before/after alternating); best kept")
    ap.add_argument("--profile", action="store_true", help="cProfile one extra 'after' run per plan")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    header = results_header("benchmarks.host_loop", argv)  # date and load average at the start
    policy = host_memory.apply_on_cpu()  # as the CLI: freed host memory is kept for the next step
    episodes, k, turns = (64 if args.quick else 1024), 4, 4
    plans = args.plans.split(",")
    # warm-up: one step at full size, so that the measured steps reuse its host memory (a
    # training run's steady state) instead of paying first-touch page faults
    char = make_tokenizer("char")
    one_step(plans[0], long_prompt_env(char, args.prompt_tokens, turns)[0], char, episodes=episodes, k=k,
             device_s=0.0, after=True)
    rows, workload_tokens = [], {}
    for tok_name in args.tokenizers.split(","):
        tokenizer = make_tokenizer(tok_name)
        env, workload_tokens[tok_name] = long_prompt_env(tokenizer, args.prompt_tokens, turns)
        for plan in plans:
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for _ in range(args.repeats):  # before, after, before, after: drift falls on both
                for after in (False, True):
                    runs[after].append(one_step(plan, env, tokenizer, episodes=episodes, k=k,
                                                device_s=args.device_s, after=after))
            for after in (False, True):
                row = min(runs[after], key=lambda r: r["host_s"])  # best of the repeats
                row["tokenizer"] = tok_name
                row["host_s_all"] = [r["host_s"] for r in runs[after]]
                if args.profile and after:  # a separate run: profiling slows Python code down
                    profiled = one_step(plan, env, tokenizer, episodes=episodes, k=k, device_s=args.device_s,
                                        after=True, profile=True)
                    row["profile_top_tottime"] = profiled["profile_top_tottime"]
                rows.append(row)
                print(f"{tok_name:4s} {plan:12s} {row['setting']:6s} host {row['host_s']:7.2f} s "
                      f"(all {', '.join(f'{h:.2f}' for h in row['host_s_all'])}; fake device "
                      f"{row['fake_device_s']:.2f} s) split " +
                      ", ".join(f"{key} {v:.2f}" for key, v in row["split_s"].items()), flush=True)
    results = {
        **header,
        "workload": {"episodes": episodes, "turns": turns, "agents": 2, "k": k, "env": "sokoban (sequential)",
                     "prompt_tokens": workload_tokens, "fake_device_s_per_call": args.device_s,
                     "goal_host_s": 10.0, "host_memory_policy": policy},
        **results_end(),
        "rows": rows,
    }
    name = "host_loop_quick.json" if args.quick else "host_loop.json"
    write_json(args.out or os.path.join(RESULTS, name), results)
    return results


if __name__ == "__main__":
    main()
