"""Sampling plans (independent, tree, joint) and their records in the learner's batch, on a toy env with scripted policies.

`CounterEnv`: agents add the integer they write to a running total; the target is the seed.
An agent's local reward is value / 10; the team reward is 1 when its step makes the total hit
the target exactly, which solves (ends) the episode. The state records every action taken, in
order, so a leaked branch shows up in the next prompt. Prompts are "agent|t<turn>|<history>",
history entries "<turn><agent><value>".

`ScriptedSampler`: deterministic policies. `fn(policy, agent, turn, history, index)` gives the
text; index = occurrence * n + j for the j-th of n samples of the occurrence-th repeat of a
request in one call (so repeated prompts get distinct samples). Tokens are char codes
(+1000 * policy for the prompt, so routing is visible in the tokens); completions end with the
stop token 1; the log-prob of completion token c is -0.1 * (c + 1) - policy.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import jax
import numpy as np
import pytest

from jmarl import JmarlError
from jmarl.envs.base import StepResult
from jmarl.envs.base import make as make_env
from jmarl.padding import next_pow2
from jmarl.train.learner import policy_samples, records_by_policy
from jmarl.train.packing import pack
from jmarl.workflows import (
    PLANS,
    Completion,
    IndependentOptions,
    JointOptions,
    NodeWiseOptions,
    Plan,
    PlanContext,
    SampleRecord,
    SharedOptions,
    TreeOptions,
    expert_demonstrations,
    get_plan,
    input_fields,
    joint_sample_bound,
    make_options,
    run_plan,
    sample_independent,
    sample_joint,
    sample_tree,
    summarize,
)
from jmarl.workflows.base import assert_identical_prompts
from jmarl.workflows.episodes import ExpertActor, SamplerActor, choose_first, run_episodes

STOP = 1


@dataclass(frozen=True)
class CounterState:
    seed: int
    turn: int
    total: int
    history: tuple[str, ...]
    solved: bool
    out_of_turns: bool


@dataclass(frozen=True)
class CounterEnv:
    parallel: bool = False
    max_turns: int = 2
    agents: tuple[str, ...] = ("a", "b")
    turn_order: tuple[str, ...] = ("a", "b")
    name: str = "counter"

    def reset(self, seed: int) -> CounterState:
        return CounterState(seed, 0, 0, (), False, False)

    def observe(self, state: CounterState, agent: str) -> str:
        return f"{agent}|t{state.turn}|{','.join(state.history)}"

    def step(self, state: CounterState, agent: str, text: str) -> tuple[CounterState, StepResult]:
        value = int(text) if text.strip().isdigit() and len(text) < 6 else 0
        total = state.total + value
        solved = total == state.seed
        new = replace(
            state,
            total=total,
            history=state.history + (f"{state.turn}{agent}{value}",),
            solved=solved,
        )
        return new, StepResult(value / 10, 1.0 if solved else 0.0, solved)

    def end_turn(self, state: CounterState) -> CounterState:
        return replace(state, turn=state.turn + 1, out_of_turns=state.turn + 1 >= self.max_turns)

    def done(self, state: CounterState) -> bool:
        return state.solved or state.out_of_turns

    def success(self, state: CounterState) -> bool:
        return state.solved

    def solution(self, seed: int):
        return None

    def expert_text(self, state: CounterState, agent: str) -> str:
        return str(max(state.seed - state.total, 0))


def parse_prompt(prompt: str) -> tuple[str, int, tuple[str, ...]]:
    agent, turn, history = prompt.split("|")
    return agent, int(turn[1:]), tuple(h for h in history.split(",") if h)


def encode(text: str) -> np.ndarray:
    return np.array([ord(c) for c in text], np.int32)


TextFn = Callable[[int, str, int, tuple[str, ...], int], str]


class ScriptedSampler:
    def __init__(self, fn: TextFn):
        self.fn = fn
        self.calls: list[tuple[list[tuple[int, str]], int]] = []
        self.keys: list[np.ndarray] = []

    def sample(self, requests, n, rng):
        self.calls.append((list(requests), n))
        self.keys.append(np.asarray(jax.random.key_data(rng)))
        seen: Counter = Counter()
        out = []
        for policy, prompt in requests:
            occurrence = seen[(policy, prompt)]
            seen[(policy, prompt)] += 1
            agent, turn, history = parse_prompt(prompt)
            row = []
            for j in range(n):
                text = self.fn(policy, agent, turn, history, occurrence * n + j)
                completion = np.concatenate([encode(text), [STOP]]).astype(np.int32)
                row.append(
                    Completion(
                        text=text,
                        prompt_tokens=encode(prompt) + 1000 * policy,
                        completion_tokens=completion,
                        logprobs=logprobs(completion.size, policy),
                    )
                )
            out.append(row)
        return out


def logprobs(size: int, policy: int) -> np.ndarray:
    return (-0.1 * (np.arange(size) + 1) - policy).astype(np.float32)


def table_fn(table: dict[tuple[str, int], list[int]]) -> TextFn:
    """Text = table[(agent, turn)][index], cyclic: the same for every policy and history."""

    def fn(policy, agent, turn, history, index):
        row = table[(agent, turn)]
        return str(row[index % len(row)])

    return fn


KEY = jax.random.key(0)

# The tree test script (target 9, K=3), hand-worked in test_tree_sequential_hand_worked:
# turn 0: a writes 1|3|2, b writes 4|1|0; turn 1: a writes 2|0|1, b writes 0|0|0.
TREE_TABLE = {("a", 0): [1, 3, 2], ("b", 0): [4, 1, 0], ("a", 1): [2, 0, 1], ("b", 1): [0, 0, 0]}


def by_group(records):
    groups: dict[int, list[SampleRecord]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    return groups


def rewards(records):
    return [round(r.reward, 6) for r in records]


# ---------------------------------------------------------------- tree (AT-GRPO)


def test_tree_sequential_hand_worked():
    sampler = ScriptedSampler(table_fn(TREE_TABLE))
    out = sample_tree(CounterEnv(), [9], (0, 1), sampler, KEY, TreeOptions(group_size=3))
    # turn 0 a: totals 1,3,2 -> scores .1,.3,.2 -> 3 continues (total 3)
    # turn 0 b: totals 7,4,3 -> scores .4,.1,0 -> 4 continues (total 7); end of turn 0
    # turn 1 a: totals 9,7,8 -> scores .2+1,0,.1 -> 2 solves; b does not act
    assert len(out.records) == 9
    assert [r.group for r in out.records] == [0] * 3 + [1] * 3 + [2] * 3
    assert [(r.turn, r.agent) for r in out.records[::3]] == [(0, 0), (0, 1), (1, 0)]
    assert rewards(out.records) == [0.1, 0.3, 0.2, 0.4, 0.1, 0.0, 1.2, 0.0, 0.1]
    chosen = [k for k, r in enumerate(out.records) if r.info["chosen"]]
    assert chosen == [1, 3, 6]
    assert [r.prompt for r in out.records[::3]] == ["a|t0|", "b|t0|0a3", "a|t1|0a3,0b4"]
    assert [r.policy for r in out.records] == [0] * 3 + [1] * 3 + [0] * 3
    assert all(r.source_policy == r.policy for r in out.records)
    assert all(int(r.completion.prompt_tokens[0]) // 1000 == r.policy for r in out.records)
    # one sampler call per agent position (sequential), K samples of one request each
    assert [(len(req), n) for req, n in sampler.calls] == [(1, 3), (1, 3), (1, 3)]
    assert [req[0][0] for req, _ in sampler.calls] == [0, 1, 0]
    (ep,) = out.episodes
    assert ep.success and ep.num_turns == 2 and ep.team_reward == 1.0
    assert ep.agent_rewards == pytest.approx((0.5, 0.4))


def test_tree_parallel_turn_semantics():
    sampler = ScriptedSampler(table_fn(TREE_TABLE))
    opts = TreeOptions(group_size=3)
    out = sample_tree(CounterEnv(parallel=True), [9], (0, 0), sampler, KEY, opts)
    # both agents observe the turn-start state and are sampled in one call per turn
    assert [[p for _, p in req] for req, _ in sampler.calls] == [
        ["a|t0|", "b|t0|"],
        ["a|t1|0a3,0b4", "b|t1|0a3,0b4"],
    ]
    # b's candidates are scored on their own branches of the state after a's chosen action
    # (total 3): distinct rewards, not copies of one broadcast state
    assert rewards(out.records) == [0.1, 0.3, 0.2, 0.4, 0.1, 0.0, 1.2, 0.0, 0.1]
    assert [r.prompt for r in out.records[::3]] == ["a|t0|", "b|t0|", "a|t1|0a3,0b4"]
    # a solved the task in turn 1: b's already-sampled turn-1 completions are discarded
    assert [(r.turn, r.agent) for r in out.records[::3]] == [(0, 0), (0, 1), (1, 0)]
    assert out.episodes[0].success
    # target 7: only b's candidate 4 on top of a's chosen 3 solves (on the turn-start state,
    # total 0, none would); the episode ends in turn 0
    sampler = ScriptedSampler(table_fn(TREE_TABLE))
    out = sample_tree(CounterEnv(parallel=True), [7], (0, 0), sampler, KEY, opts)
    assert rewards(out.records) == [0.1, 0.3, 0.2, 1.4, 0.1, 0.0]
    assert len(sampler.calls) == 1 and out.episodes[0].success and out.episodes[0].num_turns == 1


@pytest.mark.parametrize(
    "options, expected",
    [
        # path, gamma 1: node rewards + chosen later scores (.4 + 1.2 and 1.2)
        (dict(), [1.7, 1.9, 1.8, 1.6, 1.3, 1.2, 1.2, 0.0, 0.1]),
        # path, gamma .5: .4 (same turn) + .5 * 1.2 = 1.0; .5 * 1.2 = .6
        (dict(gamma=0.5), [1.1, 1.3, 1.2, 1.0, 0.7, 0.6, 1.2, 0.0, 0.1]),
        # agent scope: a gets its own turn-1 score 1.2, b has no later node
        (dict(return_scope="agent"), [1.3, 1.5, 1.4, 0.4, 0.1, 0.0, 1.2, 0.0, 0.1]),
    ],
)
def test_tree_return_to_go(options, expected):
    opts = TreeOptions(group_size=3, reward_mode="return_to_go", **options)
    out = sample_tree(CounterEnv(), [9], (0, 1), ScriptedSampler(table_fn(TREE_TABLE)), KEY, opts)
    assert rewards(out.records) == pytest.approx(expected)


def test_tree_alpha_and_first_selection():
    opts = TreeOptions(group_size=3, alpha=0.0, select="first")
    out = sample_tree(CounterEnv(), [9], (0, 1), ScriptedSampler(table_fn(TREE_TABLE)), KEY, opts)
    # "first": a1, b4 (total 5), then a2 (7), b0 (7): 4 nodes; alpha 0: reward = local only
    prompts = [r.prompt for r in out.records[::3]]
    assert prompts == ["a|t0|", "b|t0|0a1", "a|t1|0a1,0b4", "b|t1|0a1,0b4,1a2"]
    assert rewards(out.records[:3]) == [0.1, 0.3, 0.2]
    assert not out.episodes[0].success and out.episodes[0].num_turns == 2


def _hash_fn(policy, agent, turn, history, index):
    # deterministic pseudo-random small values that depend on the whole prompt
    h = sum(ord(c) * (i + 7) for i, c in enumerate(f"{agent}{turn}{history}{index}"))
    return str(h % 5)


@pytest.mark.parametrize("parallel", [False, True])
def test_tree_best_continues_and_branches_do_not_leak(parallel):
    env = CounterEnv(parallel=parallel, max_turns=3)
    seeds = [30, 31, 32, 30]  # unreachable targets: 3 full turns; two tasks share a seed
    opts = TreeOptions(group_size=4)
    out = sample_tree(env, seeds, (0, 1), ScriptedSampler(_hash_fn), KEY, opts)
    assert len(out.records) == len(seeds) * 3 * 2 * 4
    groups = by_group(out.records)
    assert sorted(groups) == list(range(len(seeds) * 3 * 2))
    keys = {(g[0].env, g[0].turn, g[0].agent) for g in groups.values()}
    assert len(keys) == len(groups)  # (task, turn, agent) <-> group, tasks 0 and 3 never merge
    for task in range(len(seeds)):
        nodes = [g for g in groups.values() if g[0].env == task]
        nodes.sort(key=lambda g: (g[0].turn, g[0].agent))
        assert [len(g) for g in nodes] == [4] * 6
        history: list[str] = []
        turn_start: list[str] = []
        for g in nodes:
            agent, turn, seen = parse_prompt(g[0].prompt)
            assert len({r.prompt for r in g}) == 1
            # the prompt holds exactly the chosen ancestors' actions (turn start if parallel)
            assert list(seen) == (turn_start if parallel else history)
            scores = [r.reward for r in g]
            best = int(np.argmax(scores))
            assert [r.info["chosen"] for r in g] == [k == best for k in range(4)]
            for r in g:  # each candidate's reward is its own step on the shared parent
                value = int(r.completion.text)
                assert r.reward == pytest.approx(value / 10)
            history.append(f"{turn}{'ab'[g[0].agent]}{g[best].completion.text}")
            if g[0].agent == 1:
                turn_start = list(history)
    assert all(not e.success and e.num_turns == 3 for e in out.episodes)


def test_tree_sampled_selection_follows_softmax():
    env = CounterEnv(max_turns=1, agents=("a",), turn_order=("a",))
    fn = table_fn({("a", 0): [0, 1]})  # local rewards 0 and .1
    opts = TreeOptions(group_size=2, select="sampled", select_temperature=0.1 / np.log(3))
    out = sample_tree(env, [50] * 400, (0,), ScriptedSampler(fn), KEY, opts)
    chosen = np.array([r.info["chosen"] for r in out.records]).reshape(400, 2)
    assert (chosen.sum(1) == 1).all()
    # P(candidate 1) = softmax([0, .1] / T)[1] = 3 / 4
    assert abs(chosen[:, 1].mean() - 0.75) < 0.07
    again = sample_tree(env, [50] * 400, (0,), ScriptedSampler(fn), KEY, opts)
    assert [r.info["chosen"] for r in again.records] == [r.info["chosen"] for r in out.records]


# ---------------------------------------------------------------- independent


IND_TABLE = {("a", 0): [3, 1], ("b", 0): [4], ("a", 1): [2], ("b", 1): [0]}


def test_independent_hand_worked():
    sampler = ScriptedSampler(table_fn(IND_TABLE))
    opts = IndependentOptions(group_size=2)
    out = sample_independent(CounterEnv(), [9], (0, 1), sampler, KEY, opts)
    # episode 0: a3 b4 | a2 -> total 9 solved (team 1; a .3+.2, b .4)
    # episode 1: a1 b4 | a2 b0 -> total 7 (team 0; a .1+.2, b .4+0)
    assert [r.prompt for r in out.records] == [
        "a|t0|", "b|t0|0a3", "a|t1|0a3,0b4",
        "a|t0|", "b|t0|0a1", "a|t1|0a1,0b4", "b|t1|0a1,0b4,1a2",
    ]
    assert rewards(out.records) == [1.5, 1.4, 1.5, 0.3, 0.4, 0.3, 0.4]
    assert [r.group for r in out.records] == [0, 1, 0, 0, 1, 0, 1]
    assert [r.policy for r in out.records] == [0, 1, 0, 0, 1, 0, 1]
    assert [(len(req), n) for req, n in sampler.calls] == [(2, 1), (2, 1), (2, 1), (1, 1)]
    assert sampler.calls[0][0] == [(0, "a|t0|"), (0, "a|t0|")]  # G repeats at turn 0
    e0, e1 = out.episodes
    assert (e0.success, e0.team_reward, e0.num_turns) == (True, 1.0, 2)
    assert (e1.success, e1.team_reward, e1.num_turns) == (False, 0.0, 2)
    assert e1.agent_rewards == pytest.approx((0.3, 0.4))
    assert summarize(out.episodes)["success_rate"] == 0.5


def test_independent_options():
    sampler = ScriptedSampler(table_fn(IND_TABLE))
    opts = IndependentOptions(group_size=2, group_by="task_turn_agent", local_weight=0.0)
    out = sample_independent(CounterEnv(), [9], (0, 0), sampler, KEY, opts)
    assert [r.group for r in out.records] == [0, 1, 2, 0, 1, 2, 3]
    assert rewards(out.records) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert all(r.policy == 0 for r in out.records)


def test_independent_single_agent_grpo_groups():
    env = CounterEnv(max_turns=1, agents=("a",), turn_order=("a",))
    fn = table_fn({("a", 0): [2, 5, 1, 5]})
    opts = IndependentOptions(group_size=4)
    out = sample_independent(env, [5, 6], (0,), ScriptedSampler(fn), KEY, opts)
    assert len(out.records) == 8
    assert [r.group for r in out.records] == [0] * 4 + [1] * 4
    assert_identical_prompts(out.records)  # one turn: every group shares one prompt
    # target 5: hits for 5 (team 1 + .5); target 6: none
    assert rewards(out.records) == [0.2, 1.5, 0.1, 1.5, 0.2, 0.5, 0.1, 0.5]


# ---------------------------------------------------------------- joint (MAGRPO)

JOINT_TABLE = {("a", 0): [1, 2], ("b", 0): [3, 4], ("a", 1): [5, 0], ("b", 1): [1, 2]}


def test_joint_aligned_hand_worked():
    env = CounterEnv(parallel=True)
    sampler = ScriptedSampler(table_fn(JOINT_TABLE))
    out = sample_joint(env, [6], (0, 1), sampler, KEY, JointOptions(group_size=2))
    # root: (a1, b3) total 4, r 0 -> child; (a2, b4) total 6 solved, r 1, leaf
    # child (history 0a1,0b3): (a5, b1) total 10, r 0; (a0, b2) total 6 solved, r 1
    # root returns: 0 + mean(0, 1) = .5 and 1
    assert [(r.turn, r.agent, r.prompt) for r in out.records[::2]] == [
        (0, 0, "a|t0|"), (0, 1, "b|t0|"), (1, 0, "a|t1|0a1,0b3"), (1, 1, "b|t1|0a1,0b3"),
    ]
    assert [r.completion.text for r in out.records] == ["1", "2", "3", "4", "5", "0", "1", "2"]
    assert rewards(out.records) == [0.5, 1.0, 0.5, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert [r.group for r in out.records] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.policy for r in out.records] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [[p for _, p in req] for req, _ in sampler.calls] == [
        ["a|t0|", "b|t0|"], ["a|t1|0a1,0b3", "b|t1|0a1,0b3"],
    ]
    # leaves: root's solved joint action, then the child's two
    assert [(e.success, e.team_reward, e.num_turns) for e in out.episodes] == [
        (True, 1.0, 1), (False, 0.0, 2), (True, 1.0, 2),
    ]
    agent_rewards = [e.agent_rewards for e in out.episodes]
    np.testing.assert_allclose(agent_rewards, [(0.2, 0.4), (0.6, 0.4), (0.1, 0.5)])
    gamma = sample_joint(env, [6], (0, 1), ScriptedSampler(table_fn(JOINT_TABLE)), KEY,
                         JointOptions(group_size=2, gamma=0.5))
    assert rewards(gamma.records)[:4] == [0.25, 1.0, 0.25, 1.0]


def test_joint_cross_hand_worked():
    env = CounterEnv(parallel=True)
    out = sample_joint(env, [6], (0, 0), ScriptedSampler(table_fn(JOINT_TABLE)), KEY,
                       JointOptions(group_size=2, joint_mode="cross"))
    # root joint actions (a1,b3) 4, (a1,b4) 5, (a2,b3) 5, (a2,b4) 6 solved: r = 0, 0, 0, 1
    # each of the 3 children has exactly one of its 4 joint actions solving: mean .25
    # Q = [.25, .25, .25, 1]; a's "1" is in joints 0, 1 -> sum .5; a's "2" in 2, 3 -> 1.25
    assert len(out.records) == 4 + 3 * 4
    root = out.records[:4]
    assert rewards(root) == [0.5, 1.25, 0.5, 1.25]
    child_histories = sorted({r.prompt.split("|")[2] for r in out.records if r.turn == 1})
    assert child_histories == ["0a1,0b3", "0a1,0b4", "0a2,0b3"]
    first_child = [r for r in out.records if r.prompt.endswith("|0a1,0b3")]
    # total 4: (a5,b1) 10, (a5,b2) 11, (a0,b1) 5, (a0,b2) 6 solved
    assert rewards(first_child) == [0.0, 1.0, 0.0, 1.0]
    mean = sample_joint(env, [6], (0, 0), ScriptedSampler(table_fn(JOINT_TABLE)), KEY,
                        JointOptions(group_size=2, joint_mode="cross", cross_aggregate="mean"))
    assert rewards(mean.records[:4]) == [0.25, 0.625, 0.25, 0.625]
    assert len(out.episodes) == 1 + 3 * 4


def test_joint_early_stop_and_local_weight():
    env = CounterEnv(parallel=True)
    stop = sample_joint(env, [6], (0, 1), ScriptedSampler(table_fn(JOINT_TABLE)), KEY,
                        JointOptions(group_size=2, early_stop_threshold=0.5))
    assert rewards(stop.records) == [0.0, 1.0, 0.0, 1.0]  # mean root reward .5: no children
    local = sample_joint(env, [6], (0, 1), ScriptedSampler(table_fn(JOINT_TABLE)), KEY,
                         JointOptions(group_size=2, local_weight=1.0, max_turns=1))
    assert rewards(local.records) == [0.1, 1.2, 0.3, 1.4]


def _reference_joint(env, fn, state, turn, g, mode, gamma, max_turns):
    """Recursive re-implementation: (samples [(turn, agent, prompt, text, return)], mean Q)."""
    agents = env.turn_order
    prompts = {a: env.observe(state, a) for a in agents}
    texts = {a: [fn(0, a, turn, parse_prompt(prompts[a])[2], i) for i in range(g)] for a in agents}
    joints = [(i,) * len(agents) for i in range(g)] if mode == "aligned" else list(
        itertools.product(range(g), repeat=len(agents)))
    samples, q = [], []
    for picks in joints:
        s, team = state, 0.0
        for a, i in zip(agents, picks):
            if env.done(s):
                break
            s, res = env.step(s, a, texts[a][i])
            team += res.team_reward
        if not env.done(s):
            s = env.end_turn(s)
        if not env.done(s) and turn + 1 < max_turns:
            child_samples, child_q = _reference_joint(
                env, fn, s, turn + 1, g, mode, gamma, max_turns
            )
            samples += child_samples
            team += gamma * child_q
        q.append(team)
    for pos, a in enumerate(agents):
        for i in range(g):
            ret = sum(q[j] for j, picks in enumerate(joints) if picks[pos] == i)
            samples.append((turn, a, prompts[a], texts[a][i], round(ret, 6)))
    return samples, float(np.mean(q))


@pytest.mark.parametrize("mode, g, turns", [("aligned", 3, 3), ("cross", 2, 3)])
def test_joint_matches_recursive_reference(mode, g, turns):
    env = CounterEnv(parallel=True, max_turns=turns)
    sampler = ScriptedSampler(_hash_fn)
    out = sample_joint(env, [7], (0, 1), sampler, KEY,
                       JointOptions(group_size=g, joint_mode=mode, gamma=0.9))
    expected, _ = _reference_joint(env, _hash_fn, env.reset(7), 0, g, mode, 0.9, turns)
    got = [
        (r.turn, "ab"[r.agent], r.prompt, r.completion.text, round(r.reward, 6))
        for r in out.records
    ]
    assert sorted(got) == sorted(expected)
    assert len(sampler.calls) <= turns  # one call per turn (all nodes of the turn)
    for group in by_group(out.records).values():
        assert len(group) == g and len({(r.prompt, r.agent) for r in group}) == 1
    # every child's history is its parent's history plus exactly one joint action
    for r in out.records:
        history = parse_prompt(r.prompt)[2]
        assert [h[0] for h in history] == [str(t) for t in range(r.turn) for _ in "ab"]


@pytest.mark.parametrize("mode, g, turns", [("aligned", 2, 1), ("aligned", 3, 3), ("cross", 2, 2)])
def test_joint_sample_count_formula(mode, g, turns):
    env = CounterEnv(parallel=True, max_turns=turns)
    seeds = [1000, 1001]  # unreachable targets: every branch runs all turns
    out = sample_joint(env, seeds, (0, 1), ScriptedSampler(_hash_fn), KEY,
                       JointOptions(group_size=g, joint_mode=mode))
    branching = g if mode == "aligned" else g**2
    nodes = len(seeds) * sum(branching**t for t in range(turns))  # hand formula
    assert len(out.records) == joint_sample_bound(len(seeds), 2, g, turns, mode) == 2 * g * nodes
    assert out.num_groups == 2 * nodes
    assert len(out.episodes) == len(seeds) * branching**turns


# ---------------------------------------------------------------- records -> the learner's batch


def test_records_pack_straight_into_the_learner_batch():
    """Each policy's records as the learner packs them (`policy_samples`, `pack`): the
    completion ids, their behaviour log-probs and the per-sample fields placed once per sample;
    every completion token predicted from the slot before it in a packed row holding the
    prompt, then the completion; each distinct prompt of a micro-batch packed once; the plan's
    groups numbered from 0 in order of first appearance, padding samples -1."""
    out = sample_tree(CounterEnv(), [9, 8], (0, 1), ScriptedSampler(table_fn(TREE_TABLE)), KEY,
                      TreeOptions(group_size=3))
    for pid in (0, 1):
        mine = [r for r in out.records if r.policy == pid]
        size = next_pow2(len(mine) + 1)  # at least one padding sample
        (b,) = pack([policy_samples(mine, pid, size)])
        flat = b["packed_tokens"].reshape(-1)
        for i, r in enumerate(mine):
            prompt, comp = r.completion.prompt_tokens, r.completion.completion_tokens
            c = comp.size
            assert comp[-1] == STOP
            np.testing.assert_array_equal(b["tokens"][i, :c], comp)
            assert (b["tokens"][i, c:] == 0).all()
            assert b["loss_mask"][i].sum() == b["attention_mask"][i].sum() == c
            np.testing.assert_allclose(b["behavior_logprobs"][i, :c], r.completion.logprobs)
            slots = b["pred_slot"][i, :c]
            assert (slots >= 0).all() and (b["pred_slot"][i, c:] == -1).all()
            np.testing.assert_array_equal(b["pred_target"][slots], comp)
            source = b["pred_source"][slots]
            assert flat[source[0]] == prompt[-1]
            np.testing.assert_array_equal(flat[source[1:]], comp[:-1])
            assert (b["reward"][i], b["agent"][i], b["source_policy"][i], b["learner"][i]) == (
                np.float32(r.reward), r.agent, r.source_policy, pid)
            assert b["source_seq_logprob"][i] == pytest.approx(r.completion.logprobs.mean())
        first: dict[int, int] = {}
        want = [first.setdefault(r.group, len(first)) for r in mine]
        assert b["group"].tolist() == want + [-1] * (size - len(mine))
        prompts = {r.completion.prompt_tokens.tobytes(): r.completion.prompt_tokens.size for r in mine}
        prompt_slots = (b["packed_segment"] > 0) & (b["packed_branch"] == 0)
        assert prompt_slots.sum() == sum(prompts.values())  # each distinct prompt once
        assert (b["packed_segment"] > 0).sum() == sum(prompts.values()) + sum(r.completion.completion_tokens.size
                                                                             for r in mine)


def test_the_learner_batch_refuses_bad_records():
    env = CounterEnv(max_turns=1, agents=("a",), turn_order=("a",))
    sampler = ScriptedSampler(table_fn(TREE_TABLE))
    (r,) = sample_tree(env, [9], (0,), sampler, KEY, TreeOptions(group_size=1)).records
    c = r.completion
    short = Completion(c.text, c.prompt_tokens, c.completion_tokens, np.zeros(1))
    bad = SampleRecord(**{**r.__dict__, "completion": short})
    with pytest.raises(JmarlError, match="log-probs"):
        policy_samples([bad], 0, 1)
    other_policy = SampleRecord(**{**r.__dict__, "policy": 1})
    with pytest.raises(JmarlError, match="one learner policy"):
        records_by_policy([r, other_policy], (0, 1))
    with pytest.raises(JmarlError, match="do not fit"):
        policy_samples([r, r], 0, 1)
    other_prompt = SampleRecord(**{**r.__dict__, "prompt": "a|t0|x"})
    with pytest.raises(JmarlError, match="identical prompt"):
        assert_identical_prompts([r, other_prompt])


# ---------------------------------------------------------------- errors and plumbing


def test_plan_errors():
    sampler = ScriptedSampler(table_fn(TREE_TABLE))
    with pytest.raises(JmarlError, match="agent_policy has 1 entries"):
        sample_tree(CounterEnv(), [9], (0,), sampler, KEY)
    with pytest.raises(JmarlError, match="tree.select"):
        TreeOptions(select="greedy")
    with pytest.raises(JmarlError, match="group_size"):
        JointOptions(group_size=0)
    with pytest.raises(JmarlError, match="sequential"):
        sample_joint(CounterEnv(parallel=False), [9], (0, 0), sampler, KEY)
    with pytest.raises(JmarlError, match="max_samples"):
        sample_joint(CounterEnv(parallel=True, max_turns=4), [9], (0, 0), sampler, KEY,
                     JointOptions(group_size=4, joint_mode="cross", max_samples=1000))
    with pytest.raises(JmarlError, match="unknown sampling plan"):
        run_plan("beam", CounterEnv(), [9], (0, 0), sampler, KEY)
    with pytest.raises(JmarlError, match="unknown option"):
        run_plan("tree", CounterEnv(), [9], (0, 0), sampler, KEY, k=3)

    class ShortSampler:
        def sample(self, requests, n, rng):
            return [[] for _ in requests]

    with pytest.raises(JmarlError, match="sampler returned"):
        sample_tree(CounterEnv(), [9], (0, 0), ShortSampler(), KEY)


def test_run_plan_by_name_and_fresh_keys():
    sampler = ScriptedSampler(table_fn(TREE_TABLE))
    out = run_plan("tree", CounterEnv(), [9], (0, 1), sampler, KEY, group_size=3)
    direct = sample_tree(CounterEnv(), [9], (0, 1), ScriptedSampler(table_fn(TREE_TABLE)), KEY,
                         TreeOptions(group_size=3))
    assert rewards(out.records) == rewards(direct.records)
    keys = [k.tobytes() for k in sampler.keys]
    assert len(set(keys)) == len(keys) == 3  # every sampler call gets its own key


# ---------------------------------------------------------------- the plan registry


def test_plans_are_values_with_one_group_size_name():
    assert set(PLANS) == {"independent", "tree", "joint", "node_wise", "shared"}
    options = {"independent": IndependentOptions, "tree": TreeOptions, "joint": JointOptions,
               "node_wise": NodeWiseOptions, "shared": SharedOptions}
    for name, plan in PLANS.items():
        assert isinstance(plan, Plan) and plan.name == name and get_plan(name) is plan
        assert plan.options is options[name]
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.name = "other"
        fields = {f.name: f for f in dataclasses.fields(plan.options)}
        # every plan calls its G / K `group_size`, validated under that name
        assert "group_size" in fields and fields["group_size"].default >= 1
        assert not {"num_episodes", "num_candidates", "num_samples", "num_alternatives"} & set(fields)
        with pytest.raises(JmarlError, match=f"{name}: group_size must be >= 1"):
            plan.options(group_size=0)
        assert make_options(name, group_size=3).group_size == 3
        if name != "shared":  # shared is single-step: no turn cap
            assert "max_turns" in fields and not fields["max_turns"].metadata.get("input")
        if name == "shared":
            continue
        # the plans that route by agent take their options as they are and fix no row bound
        assert plan.routes_by_agent and plan.rows_per_policy is None
        opts = plan.options()
        assert plan.bind(opts, PlanContext(tokenizers={0: None})) is opts
    assert {n: input_fields(p.options) for n, p in PLANS.items()} == {
        "independent": (), "tree": (), "joint": (), "node_wise": ("base_sampler", "memory", "query_fn"),
        "shared": ("num_policies", "tokenizers")}
    with pytest.raises(JmarlError, match="unknown sampling plan 'beam'; choose one of independent, joint"):
        get_plan("beam")


def test_workflows_do_not_import_the_algorithms():
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in sorted((root / "jmarl" / "workflows").glob("*.py")):
        text = path.read_text()
        assert "jmarl.algos" not in text and "from jmarl import algos" not in text, path.name
    code = ("import sys, jmarl.workflows; "
            "bad = [m for m in sys.modules if m == 'jmarl.algos' or m.startswith('jmarl.algos.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# ---------------------------------------------------------------- expert demonstrations


def reference_demonstrations(env, seeds, agent_policy, max_turns=None):
    """The turn loop `Trainer.demonstrations` ran before it called `expert_demonstrations`
    (without its `shared` expansion to every policy), kept as the reference."""
    out = []
    for seed in seeds:
        state = env.reset(seed)
        for _ in range(env.max_turns if max_turns is None else max_turns):
            start = state
            for agent in env.turn_order:
                obs = env.observe(start if env.parallel else state, agent)
                text = env.expert_text(state, agent)
                out.append((agent_policy[env.agents.index(agent)], obs, text))
                state, _ = env.step(state, agent, text)
                if env.done(state):
                    break
            if env.done(state):
                break
            state = env.end_turn(state)
            if env.done(state):
                break
    return out


@dataclass(frozen=True)
class SlowCounterEnv(CounterEnv):
    """CounterEnv whose expert adds at most 3 per step, so episodes take several steps; in a
    parallel turn the expert's text depends on the earlier agents' actions of the turn."""

    def expert_text(self, state: CounterState, agent: str) -> str:
        return str(min(max(state.seed - state.total, 0), 3))


def test_expert_demonstrations_match_the_reference_loop_on_the_toy_envs():
    from _toy_env import Letters

    cases = [
        (Letters(), (0, 1), range(5)),
        (Letters(max_turns=2), (1, 0), [3, 3, 10]),
        (SlowCounterEnv(), (0, 1), [0, 2, 3, 5, 9, 20]),
        (SlowCounterEnv(parallel=True, max_turns=3), (0, 1), [0, 2, 3, 5, 9, 20]),
        (SlowCounterEnv(max_turns=4), (0, 0), [7, 14]),
        (CounterEnv(parallel=True), (1, 0), [4, 9]),
    ]
    for env, policy, seeds in cases:
        want = reference_demonstrations(env, list(seeds), policy)
        assert expert_demonstrations(env, seeds, policy) == want, env
        assert expert_demonstrations(env, [], policy) == []
    # the cap: the first turn only
    env = SlowCounterEnv(parallel=True, max_turns=3)
    got = expert_demonstrations(env, [5, 20], (0, 1), max_turns=1)
    assert got == reference_demonstrations(env, [5, 20], (0, 1), max_turns=1)
    # parallel: b observes the turn-start state but acts on the running one (5 - 3 left)
    assert got == [(0, "a|t0|", "3"), (1, "b|t0|", "2"), (0, "a|t0|", "3"), (1, "b|t0|", "3")]
    with pytest.raises(JmarlError, match="agent_policy has 1 entries"):
        expert_demonstrations(env, [9], (0,))


def test_expert_demonstrations_match_the_reference_loop_on_plan_path():
    for options in ({}, {"max_turns": 1}, {"single_agent": True}):
        env = make_env("plan_path", **options)
        policy = tuple(range(len(env.agents)))
        seeds = list(range(8))
        want = reference_demonstrations(env, seeds, policy)
        assert len(want) >= len(seeds)
        assert expert_demonstrations(env, seeds, policy) == want


def test_sampler_actor_keeps_the_plans_loop():
    # a sampler and its SamplerActor drive the loop identically (same calls, keys and nodes)
    runs = []
    for env in (CounterEnv(), CounterEnv(parallel=True)):
        for wrap in (lambda s: s, SamplerActor):
            sampler = ScriptedSampler(table_fn(TREE_TABLE))
            traces = run_episodes(env, [(0, 9), (1, 4)], (0, 1), wrap(sampler), KEY,
                                  num_candidates=2, score=lambda res: float(res.local_reward),
                                  choose=choose_first, max_turns=2)
            runs.append((sampler.calls, [k.tobytes() for k in sampler.keys],
                         [[(n.turn, n.agent, n.prompt, n.chosen, n.scores) for n in t.nodes]
                          for t in traces]))
    assert runs[0] == runs[1] and runs[2] == runs[3]
    # parallel: one sampler call per turn; the expert is asked per agent position instead
    assert len(runs[2][0]) == 2 and ExpertActor(CounterEnv()).per_turn is False


def test_demonstration_memory_holds_each_expert_step_of_its_agent():
    from jmarl.workflows import MemoryOptions, demonstration_memory

    env = make_env("plan_path", size=5, max_turns=2, prompt_style="compact")
    seeds = [3, 4, 5]
    steps = expert_demonstrations(env, seeds, range(len(env.agents)))
    memory = demonstration_memory(env, seeds)
    for i, agent in enumerate(env.agents):
        want = [(prompt, text) for a, prompt, text in steps if a == i]
        got = [(e.query, e.strategy) for e in memory.entries(agent)]
        assert got == list(dict.fromkeys(want)) and got  # admit skips an exact repeat
        assert all(e.reward == 1.0 and e.baseline == 0.0 for e in memory.entries(agent))
    # capacity keeps the newest entries
    small = demonstration_memory(env, seeds, MemoryOptions(capacity=1))
    assert [e.strategy for e in small.entries(env.agents[0])] == [[t for a, _, t in steps if a == 0][-1]]
