"""`shared` (HACPO): several policies answer the same prompts and every learner trains on all.

Used by HACPO and its baselines. n policies (ids 0..n-1, possibly different architectures and
tokenizers) each sample G completions of every task's prompt; the task is single-agent and
single-step (e.g. `make("math", agents=("solver",))`, verified 0/1 reward). Each completion is
applied to its own copy of the reset state; its reward is
`local_weight * local_reward + team_weight * team_reward` of that one step (defaults 1, 1).

Routing. Every completion goes to every learner k:
- self sample (k == source j): the source's own prompt and completion tokens and its behaviour
  log-probs, as sampled.
- cross sample (k != j): the completion TEXT re-tokenised with learner k's tokenizer
  (`tokenizers[k].encode(text)`, plus k's `eos_id` when the source's completion ended with the
  source tokenizer's `eos_id`); the prompt tokens are learner k's own prompt tokens for that
  task (what the sampler rendered with k's chat template for k's self samples), so all n*G
  samples of the group share one prompt. It carries `source_policy = j` and
  `source_seq_logprob` = the source's mean completion-token log-prob at rollout. Its
  behaviour log-probs under the learner are unknown: they are left 0 and the sample is marked
  by `policy != source_policy` (and `info["cross"]`); the trainer scores the learner's
  log-probs. Where `tokenizers[k] is tokenizers[j]` the source tokens are reused verbatim.
  Re-tokenisation must round-trip (`decode(encode(text)) == text`); a cross sample whose
  text does not is dropped (`lossy="drop"`, default, counted in `stats.num_lossy`) or kept.

Groups. One group per (task, learner): the mixed group of all n*G responses to the task's
prompt for learner k (`policy = k`). Records are ordered task, learner, source, sample.

Sharing. `share: true` (HACPO): every learner gets all n*S samples of a task; `share: false`
(the paper's GSPO baselines): each learns from its own S. `samples_per_policy` S: completions
each policy generates per task (0: G, the group size; 2G is the paper's "GSPO with twice the
rollouts"). Rollouts generated per step (`stats.num_generated`): E * n * S for E tasks;
training records: E * n * n * S (sharing) or E * n * S. Naive sharing (the paper's ablation)
samples exactly as `share: true`: it is the HACPO method's setting
(`algo.options.capability_baseline/discrepancy/stepwise_clip: false`), not an option here.

Capability (HACPO step 1). `stats.success_rate` holds, per policy, the fraction of its own
generations this step with reward > 0. The learner pushes it into HACPO's capability window
(the algorithm's state, not the plan's) before computing advantages; this plan only reports
the rates.

Run inputs. `num_policies` and `tokenizers` are filled by the run (the `shared` `Plan`'s
`bind`: every policy of the run, with its tokenizer), not set by the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from jmarl.errors import JmarlError
from jmarl.workflows.base import (
    Completion,
    EpisodeStats,
    GroupIds,
    PlanResult,
    PlanStats,
    SampleRecord,
    Sampler,
    assert_identical_prompts,
    call_sampler,
    check_agent_policy,
    check_choice,
    input_field,
)
from jmarl.workflows.bounds import BoundsContext, PlanBounds
from jmarl.workflows.stepping import step_all

__all__ = [
    "SharedOptions", "SharedStats", "TextTokenizer", "retokenize", "sample_shared", "seq_logprob",
]

# the former `mode` option's values -> the options that say what they meant
FORMER_MODES = {
    "hacpo": "share: true",
    "gspo": "share: false",
    "gspo_2x": "share: false, samples_per_policy: twice the group size",
    "naive": "share: true, with algo.options.capability_baseline/discrepancy/stepwise_clip: false (HACPO's "
    "naive-sharing ablation)",
}


@runtime_checkable
class TextTokenizer(Protocol):
    """What the `shared` plan needs from a policy's tokenizer (a subset of jmarl.models').

    encode(text) -> ids without special tokens; decode(ids) -> text (special tokens skipped);
    eos_id: the token that ends a completion (the sampler's stop token).
    """

    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`."""
        ...


@dataclass(frozen=True)
class SharedOptions:
    """Options of the `shared` plan (see the module docstring).

    group_size: G >= 1; share: whether learners receive each other's samples; samples_per_policy:
    S, completions each policy generates per task (0: G); team_weight/local_weight: reward weights; lossy: "drop" | "keep" for cross
    samples whose text does not round-trip through the learner's tokenizer. Run inputs
    (metadata `{"input": True}`): num_policies: n >= 1 (policy ids 0..n-1, which is how HACPO's
    capability vector P is indexed); tokenizers: policy id -> `TextTokenizer`, needed by the
    sharing modes.
    """

    group_size: int = 8
    num_policies: int = input_field(2)
    share: bool = True
    samples_per_policy: int = 0
    tokenizers: Mapping[int, Any] | None = input_field(None)
    team_weight: float = 1.0
    local_weight: float = 1.0
    lossy: str = "drop"
    mode: str | None = None  # the former option: refused, naming what replaces it

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise JmarlError(f"shared: group_size must be >= 1, got {self.group_size}")
        if self.num_policies < 1:
            raise JmarlError(f"shared: num_policies must be >= 1, got {self.num_policies}")
        if self.mode is not None:
            instead = FORMER_MODES.get(self.mode, "share: true or false, and samples_per_policy")
            raise JmarlError(f"option shared.mode={self.mode!r} is gone: say what it meant with {instead}")
        if not isinstance(self.share, bool):
            raise JmarlError(f"shared: share must be true or false, got {self.share!r}")
        if not isinstance(self.samples_per_policy, int) or self.samples_per_policy < 0:
            raise JmarlError(f"shared: samples_per_policy must be an int >= 0 (0: group_size), got "
                             f"{self.samples_per_policy!r}")
        check_choice("shared.lossy", self.lossy, ("drop", "keep"))

    @property
    def per_policy(self) -> int:
        """S, the completions each policy generates per task: `samples_per_policy`, or G when 0."""
        return self.samples_per_policy or self.group_size


@dataclass(frozen=True, kw_only=True)
class SharedStats(PlanStats):
    """The `shared` plan's step report (`PlanStats` plus the fields below).

    num_generated: E * n * S, every policy's own completions; share: whether the learners got
    each other's samples; samples_per_policy: S; num_records: the training records routed to all learners (lossy
    cross samples dropped); num_lossy: cross samples whose text did not round-trip through the
    learner's tokenizer (dropped or kept, per `lossy`); success_rate: per policy (indexed by
    policy id), the fraction of its own completions with reward > 0 (what HACPO's capability
    window takes); reward_mean: per policy, the mean reward of its own completions.
    """

    share: bool
    samples_per_policy: int
    num_records: int
    num_lossy: int
    success_rate: tuple[float, ...]
    reward_mean: tuple[float, ...]


def shared_rows(options: SharedOptions, num_tasks: int) -> int:
    """One learner's samples per step: tasks x policies x S when sharing (dropped lossy cross
    samples make it an upper bound), else tasks x S (S: `SharedOptions.per_policy`)."""
    sources = options.num_policies if options.share else 1
    return num_tasks * sources * options.per_policy


def shared_bounds(options: SharedOptions, ctx: BoundsContext) -> PlanBounds:
    """Rows `shared_rows` per policy, S per prompt (groups may be cut by lossy drops); one call
    of E x S rows per policy."""
    g = options.per_policy
    return PlanBounds(rows=shared_rows(options, ctx.num_tasks), share=g, aligned=False,
                      calls=((tuple(ctx.num_tasks * g for _ in ctx.policy_ids), g),))


def sample_shared(
    env: Any,
    seeds: Sequence[int],
    agent_policy: Sequence[int],
    sampler: Sampler,
    rng: jax.Array,
    options: SharedOptions = SharedOptions(),
) -> PlanResult:
    """G completions per policy per seed -> self and cross records grouped per (task, learner).

    `agent_policy` is validated like every plan's (one entry for the env's single agent); the
    learners are policies 0..num_policies-1, each playing that agent.
    """
    check_agent_policy(env, agent_policy)
    if options.share and options.num_policies > 1:
        missing = [p for p in range(options.num_policies) if p not in (options.tokenizers or {})]
        if missing:
            raise JmarlError(
                "shared: share=true re-tokenises completions for every learner but "
                f"no tokenizer is given for policies {missing}; pass tokenizers="
                "{policy id: tokenizer} for all policies 0..num_policies-1"
            )
    if len(env.turn_order) != 1:
        raise JmarlError(
            f"the shared plan runs single-agent tasks, but env {env.name!r} has turn_order "
            f"{env.turn_order}; use e.g. make('math', agents=('solver',))"
        )
    agent_name = env.turn_order[0]
    agent = env.agents.index(agent_name)
    n, g = options.num_policies, options.per_policy
    states = [env.reset(int(s)) for s in seeds]
    prompts = [env.observe(state, agent_name) for state in states]
    requests = [(j, prompt) for prompt in prompts for j in range(n)]
    answers = call_sampler(sampler, requests, g, rng)

    rewards = np.zeros((len(seeds), n, g), np.float64)
    episodes: list[EpisodeStats] = []
    stepped = iter(step_all(env, [
        (state, agent_name, completion.text)
        for e, state in enumerate(states)
        for j in range(n)
        for completion in answers[e * n + j]
    ]))
    for e, (seed, state) in enumerate(zip(seeds, states)):
        for j in range(n):
            for i, completion in enumerate(answers[e * n + j]):
                final, res = next(stepped)
                rewards[e, j, i] = options.local_weight * float(
                    res.local_reward
                ) + options.team_weight * float(res.team_reward)
                episodes.append(
                    EpisodeStats(
                        env=e,
                        seed=int(seed),
                        success=bool(env.success(final)),
                        team_reward=float(res.team_reward),
                        agent_rewards=tuple(
                            float(res.local_reward) if a == agent else 0.0
                            for a in range(len(env.agents))
                        ),
                        num_turns=1,
                    )
                )

    groups = GroupIds()
    records: list[SampleRecord] = []
    num_lossy = 0
    for e, prompt in enumerate(prompts):
        for k in range(n):
            own_prompt_tokens = answers[e * n + k][0].prompt_tokens
            sources = range(n) if options.share else (k,)
            for j in sources:
                for i, completion in enumerate(answers[e * n + j]):
                    if j == k:
                        routed, lossless = completion, True
                    else:
                        routed, lossless = retokenize(
                            completion,
                            own_prompt_tokens,
                            options.tokenizers[j],
                            options.tokenizers[k],
                        )
                    if not lossless:
                        num_lossy += 1
                        if options.lossy == "drop":
                            continue
                    records.append(
                        SampleRecord(
                            prompt=prompt,
                            completion=routed,
                            reward=float(rewards[e, j, i]),
                            group=groups((e, k)),
                            env=e,
                            turn=0,
                            agent=agent,
                            policy=k,
                            source_policy=j,
                            info={"cross": j != k, "lossless": lossless},
                            source_seq_logprob=None if j == k else seq_logprob(completion),
                        )
                    )
    assert_identical_prompts(records)
    success = tuple(float(np.mean(rewards[:, j] > 0)) if seeds else 0.0 for j in range(n))
    stats = SharedStats(
        num_generated=len(seeds) * n * g,
        share=options.share,
        samples_per_policy=g,
        num_records=len(records),
        num_lossy=num_lossy,
        success_rate=success,
        reward_mean=tuple(float(rewards[:, j].mean()) if seeds else 0.0 for j in range(n)),
    )
    return PlanResult(records=tuple(records), episodes=tuple(episodes), stats=stats)


def seq_logprob(completion: Completion) -> float:
    """Mean log-prob of a completion's tokens under the policy that sampled it (0 if empty)."""
    lp = np.asarray(completion.logprobs, np.float64).reshape(-1)
    return float(lp.mean()) if lp.size else 0.0


def retokenize(
    completion: Completion,
    learner_prompt_tokens: np.ndarray,
    source_tokenizer: Any,
    learner_tokenizer: Any,
) -> tuple[Completion, bool]:
    """A source's completion as the learner sees it, and whether its text round-trips.

    Returns a `Completion` with the same text, prompt tokens int32[P] = the learner's own
    rendering of the prompt, completion tokens int32[C'] = the learner's encoding of the text
    (+ the learner's eos_id if the source's last token was its eos_id; the source tokens
    themselves when both policies use the same tokenizer object) and log-probs f32[C'] = 0
    (unknown behaviour log-probs of a cross sample).
    """
    source_tokens = np.asarray(completion.completion_tokens, np.int32).reshape(-1)
    if learner_tokenizer is source_tokenizer:
        tokens, lossless = source_tokens, True
    else:
        ids = [int(t) for t in learner_tokenizer.encode(completion.text)]
        lossless = learner_tokenizer.decode(ids) == completion.text
        stopped = source_tokens.size > 0 and int(source_tokens[-1]) == int(source_tokenizer.eos_id)
        if stopped:
            ids.append(int(learner_tokenizer.eos_id))
        tokens = np.asarray(ids, np.int32)
    routed = Completion(
        text=completion.text,
        prompt_tokens=np.asarray(learner_prompt_tokens, np.int32),
        completion_tokens=tokens,
        logprobs=np.zeros(tokens.shape, np.float32),
    )
    return routed, lossless
