"""The `node_wise` plan (JoyAgents-R1) on a toy hierarchical env with scripted policies.

`HierEnv` (a miniature Router): the master "m" writes "x"/"y" (route to that sub-agent, local
-0.1) or "F<answer>" (final: team 1 if the answer is the seed, ends the episode); only the
master and the routed sub-agent are active (`is_active`). A sub-agent's prompt shows only the
task ("<agent>|q<seed>|mem=..."), not the master's text; its answer goes to the master's next
prompt ("m|t<turn>|<agent>:<answer>,...|mem=..."). Episodes end at a final or after 2 turns.

`HierSampler`: with n = 1 (base trajectory, re-runs) a fixed policy of the prompt: the master
routes to x in turn 0 and answers the last result in turn 1; x answers the seed, y "5";
with n = G the alternatives come from `ALTS[(agent, turn)]`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Mapping

import jax
import numpy as np
import pytest

from jmarl import JmarlError
from jmarl.envs.base import StepResult
from jmarl.workflows import (
    Completion,
    Memory,
    MemoryEntry,
    NodeWiseOptions,
    NodeWiseStats,
    PlanResult,
    PlanStats,
    plan_metrics,
    run_plan,
    sample_node_wise,
    update_memory,
)
from jmarl.workflows import memory as jmemory

KEY = jax.random.key(0)


@dataclass(frozen=True)
class HierState:
    seed: int
    turn: int = 0
    route: str | None = None
    results: tuple[str, ...] = ()
    final: str | None = None
    finished: bool = False
    memory_context: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class HierEnv:
    agents: tuple[str, ...] = ("m", "x", "y")
    max_turns: int = 2
    parallel: bool = False
    name: str = "hier"

    @property
    def turn_order(self):
        return self.agents

    def reset(self, seed):
        return HierState(seed)

    def is_active(self, state, agent):
        return not state.finished and (agent == "m" or state.route == agent)

    def observe(self, state, agent):
        mem = ";".join(state.memory_context.get(agent, ()))
        if agent == "m":
            return f"m|t{state.turn}|{','.join(state.results)}|mem={mem}"
        return f"{agent}|q{state.seed}|mem={mem}"

    def step(self, state, agent, text):
        if not self.is_active(state, agent):
            return state, StepResult(0.0, 0.0, state.finished)
        if agent == "m":
            if text.startswith("F"):
                won = text[1:] == str(state.seed)
                return replace(state, final=text[1:], finished=True), StepResult(
                    0.0, 1.0 if won else 0.0, True)
            if text[:1] in self.agents[1:]:
                return replace(state, route=text[:1]), StepResult(-0.1, 0.0, False)
            return state, StepResult(-0.05, 0.0, False)
        new = replace(state, route=None, results=state.results + (f"{agent}:{text}",))
        return new, StepResult(0.0, 0.0, False)

    def end_turn(self, state):
        turn = state.turn + 1
        return replace(state, turn=turn, route=None,
                       finished=state.finished or turn >= self.max_turns)

    def done(self, state):
        return state.finished

    def success(self, state):
        return state.final == str(state.seed)


ALTS = {("m", 0): ["x", "y", "F7"], ("x", None): ["7", "3", "7"], ("m", 1): ["F7", "F7", "x"]}


def greedy(prompt):
    agent, where, *rest = prompt.split("|")
    if agent == "m":
        results = rest[0].split(",") if rest[0] else []
        return "x" if where == "t0" else "F" + (results[-1].split(":")[1] if results else "")
    return where[1:] if agent == "x" else "5"


class HierSampler:
    def __init__(self, alts=ALTS, greedy_fn=greedy):
        self.alts, self.greedy_fn = alts, greedy_fn
        self.calls = []

    def sample(self, requests, n, rng):
        self.calls.append((list(requests), n))
        out = []
        for policy, prompt in requests:
            agent, where = prompt.split("|")[:2]
            turn = int(where[1:]) if agent == "m" else None
            texts = ([self.greedy_fn(prompt)] if n == 1
                     else [self.alts[(agent, turn)][j % len(self.alts[(agent, turn)])]
                           for j in range(n)])
            out.append([
                Completion(t, np.array([ord(c) for c in prompt], np.int32) + 1000 * policy,
                           np.array([ord(c) for c in t] + [1], np.int32),
                           np.full(len(t) + 1, -0.5, np.float32))
                for t in texts
            ])
        return out

    @property
    def num_completions(self):
        return sum(len(req) * n for req, n in self.calls)


def test_node_wise_hand_worked():
    sampler = HierSampler()
    out = sample_node_wise(HierEnv(), [7], (0, 1, 2), sampler, KEY,
                           NodeWiseOptions(group_size=3))
    groups = out.stats.node_groups
    # base: m routes to x (-0.1), x answers 7, y is inactive, m writes F7 (team 1): total 0.9
    (ep,) = out.episodes
    assert ep.success and ep.team_reward == 1.0 and ep.num_turns == 2
    assert ep.agent_rewards == pytest.approx((-0.1, 0.0, 0.0))
    assert [(g.turn, g.agent_name) for g in groups] == [(0, "m"), (0, "x"), (1, "m")]
    assert [g.prompt for g in groups] == ["m|t0||mem=", "x|q7|mem=", "m|t1|x:7|mem="]
    # (0, m): "x" keeps everything (0.9); "y" -> y re-run "5", m re-run "F5" (-0.1); "F7" (1.0)
    # (0, x): "7" -> m reused (0.9); "3" -> m re-run "F3" (-0.1)
    # (1, m): "F7", "F7" (0.9); "x" -> x re-run (turn 1), out of turns: -0.1 - 0.1 = -0.2
    hand = [(0.9, -0.1, 1.0), (0.9, -0.1, 0.9), (0.9, 0.9, -0.2)]
    for g, rewards in zip(groups, hand):
        assert g.rewards == pytest.approx(rewards)
        assert g.variance == pytest.approx(np.var(rewards))
    # hand variances: 0.74/3 = .2467, 2/9 = .2222, 0.8067/3 = .2689 -> top-2 = nodes 2 and 0
    assert [round(g.variance, 4) for g in groups] == [0.2467, 0.2222, 0.2689]
    assert [g.selected for g in groups] == [True, False, True]
    assert [g.group for g in groups] == [0, None, 1]
    # downstream nodes: reused where the prompt is unchanged, re-run where it changed
    assert groups[0].downstream == (
        ((0, "x", "reused"), (1, "m", "reused")),
        ((0, "y", "rerun"), (1, "m", "rerun")),
        (),
    )
    assert groups[1].downstream == (
        ((1, "m", "reused"),), ((1, "m", "rerun"),), ((1, "m", "reused"),))
    assert groups[2].downstream == ((), (), ((1, "x", "rerun"),))
    # records: only the selected groups, G each, routed to their agent's policy
    assert [(r.group, r.turn, r.agent, r.policy) for r in out.records] == (
        [(0, 0, 0, 0)] * 3 + [(1, 1, 0, 0)] * 3)
    assert [r.reward for r in out.records] == pytest.approx([0.9, -0.1, 1.0, 0.9, 0.9, -0.2])
    assert [r.info["reruns"] for r in out.records] == [0, 2, 0, 0, 0, 1]
    assert [r.completion.text for r in out.records] == ["x", "y", "F7", "F7", "F7", "x"]
    # count: B = 3 base + G * B = 9 alternatives + 4 re-runs
    assert (out.stats.num_base, out.stats.num_alternatives, out.stats.num_reruns) == (
        3, 9, 4)
    assert out.stats.num_generated == 16 == sampler.num_completions
    # typed stats; the trainer logs their numbers as plan/<name> (not the node groups)
    assert isinstance(out.stats, NodeWiseStats) and out.stats.num_groups == 3 and out.stats.num_selected == 2
    assert plan_metrics(out.stats) == {
        "plan/num_generated": 16.0, "plan/num_base": 3.0, "plan/num_alternatives": 9.0, "plan/num_reruns": 4.0,
        "plan/num_groups": 3.0, "plan/num_selected": 2.0}
    # the re-run requests are exactly the changed prompts
    reruns = [p for req, n in sampler.calls[4:] for _, p in req]
    assert sorted(reruns) == sorted(["y|q7|mem=", "m|t1|y:5|mem=", "m|t1|x:3|mem=", "x|q7|mem="])
    assert [r.group for r in out.records] == [0, 0, 0, 1, 1, 1]


def test_sub_agent_count_does_not_change_cost():
    # the same episodes with 1 or 4 extra (never routed) sub-agents: the same 16 samples
    small = sample_node_wise(HierEnv(), [7], (0, 1, 2), HierSampler(), KEY,
                             NodeWiseOptions(group_size=3))
    env = HierEnv(agents=("m", "x", "y", "z", "w", "v"))
    big = sample_node_wise(env, [7], (0, 1, 2, 3, 4, 5), HierSampler(), KEY,
                           NodeWiseOptions(group_size=3))
    assert big.stats.num_generated == small.stats.num_generated == 16
    assert [r.reward for r in big.records] == pytest.approx([r.reward for r in small.records])


@dataclass(frozen=True)
class ChainState:
    history: tuple[str, ...] = ()
    turn: int = 0
    over: bool = False


@dataclass(frozen=True)
class ChainEnv:
    """n agents act once each in order; every prompt holds the whole history; reward = value."""

    agents: tuple[str, ...] = ("a", "b")
    parallel: bool = False
    max_turns: int = 1
    name: str = "chain"

    @property
    def turn_order(self):
        return self.agents

    def reset(self, seed):
        return ChainState()

    def observe(self, state, agent):
        return f"{agent}|t{state.turn}|{','.join(state.history)}"

    def step(self, state, agent, text):
        value = int(text) if text.isdigit() else 0
        return replace(state, history=state.history + (text,)), StepResult(value, 0.0, False)

    def end_turn(self, state):
        return replace(state, turn=state.turn + 1, over=state.turn + 1 >= self.max_turns)

    def done(self, state):
        return state.over

    def success(self, state):
        return False


class ChainSampler(HierSampler):
    """n = 1: "0"; n = G: "1", "2", ..., "G" (all differ from the base, so every later prompt
    changes and is re-run)."""

    def sample(self, requests, n, rng):
        self.calls.append((list(requests), n))
        texts = ["0"] if n == 1 else [str(j + 1) for j in range(n)]
        return [[Completion(t, np.array([ord(c) for c in p], np.int32), np.array([1], np.int32),
                            np.zeros(1, np.float32)) for t in texts] for _, p in requests]


@pytest.mark.parametrize("num_agents, g, turns", [(1, 2, 1), (2, 3, 1), (3, 2, 1), (4, 3, 1),
                                                  (2, 2, 2)])
def test_sample_count_formula(num_agents, g, turns):
    agents = tuple("abcd"[:num_agents])
    sampler = ChainSampler()
    seeds = [0, 1]
    out = sample_node_wise(ChainEnv(agents=agents, max_turns=turns), seeds, (0,) * num_agents,
                           sampler, KEY, NodeWiseOptions(group_size=g, top_k=2))
    b = num_agents * turns  # base nodes per task
    reruns = g * b * (b - 1) // 2  # every later node of every alternative is re-run
    per_task = b + g * b + reruns
    assert out.stats.num_reruns == len(seeds) * reruns
    assert out.stats.num_generated == len(seeds) * per_task == sampler.num_completions
    assert len(out.records) == len(seeds) * min(2, b) * g
    # reward of alternative j at node i: its own value j + 1, later re-runs "0", earlier base "0"
    for grp in out.stats.node_groups:
        assert grp.rewards == tuple(float(j + 1) for j in range(g))
        assert all(kind == "rerun" for d in grp.downstream for *_, kind in d)


def test_top_k_scope_batch_base_sampler_and_registry():
    # two identical tasks: batch scope keeps the 2 highest-variance groups of the whole batch
    # (the tie between the tasks goes to the earlier task)
    out = sample_node_wise(HierEnv(), [7, 7], (0, 1, 2), HierSampler(), KEY,
                           NodeWiseOptions(group_size=3, top_k=2, top_k_scope="batch"))
    chosen = [(g.task, g.node) for g in out.stats.node_groups if g.selected]
    assert chosen == [(0, 2), (1, 2)]
    per_task = sample_node_wise(HierEnv(), [7, 7], (0, 1, 2), HierSampler(), KEY,
                                NodeWiseOptions(group_size=3, top_k=1))
    assert [(g.task, g.node) for g in per_task.stats.node_groups if g.selected] == [
        (0, 2), (1, 2)]
    assert [r.group for r in per_task.records] == [0, 0, 0, 1, 1, 1]
    # the base trajectory and re-runs come from base_sampler; the alternatives from the sampler
    base = HierSampler(greedy_fn=lambda p: "F7" if p.startswith("m|t0") else greedy(p))
    plan = HierSampler()
    out = sample_node_wise(HierEnv(), [7], (0, 1, 2), plan, KEY,
                           NodeWiseOptions(group_size=3, base_sampler=base))
    assert out.stats.num_base == 1 and plan.calls == [([(0, "m|t0||mem=")], 3)]
    (only,) = out.stats.node_groups
    # "x" re-runs x ("7") and m at turn 1 ("F7"); "y" re-runs y ("5") and m ("F5")
    assert only.downstream == (((0, "x", "rerun"), (1, "m", "rerun")),
                               ((0, "y", "rerun"), (1, "m", "rerun")), ())
    assert only.rewards == pytest.approx((0.9, -0.1, 1.0))
    assert base.num_completions == 1 + 4 == 1 + out.stats.num_reruns
    by_name = run_plan("node_wise", HierEnv(), [7], (0, 1, 2), HierSampler(), KEY,
                       group_size=3)
    direct = sample_node_wise(HierEnv(), [7], (0, 1, 2), HierSampler(), KEY,
                              NodeWiseOptions(group_size=3))
    assert [r.reward for r in by_name.records] == [r.reward for r in direct.records]


def test_memory_is_retrieved_into_prompts_and_updated():
    entry = MemoryEntry(id=4, query="x|q7|mem=", strategy="answer the seed", reward=1.0,
                        baseline=0.5, step=0)
    other = MemoryEntry(id=5, query="zzzz", strategy="unrelated", reward=1.0, baseline=0.5,
                        step=0)
    memory = Memory(banks=(("x", (entry, other)),), next_id=6)
    sampler = HierSampler()
    out = sample_node_wise(HierEnv(), [7], (0, 1, 2), sampler, KEY,
                           NodeWiseOptions(group_size=3, memory=memory))
    groups = out.stats.node_groups
    shown = "x|q7|mem=query: x|q7|mem= | strategy: answer the seed"
    assert groups[1].prompt == shown and groups[1].memory_ids == (4,)
    assert groups[1].query == "x|q7|mem="  # the query is the prompt without memory
    assert groups[0].memory_ids == () and groups[0].prompt == "m|t0||mem="
    # the alternatives at x saw the same prompt as the base (reused downstream as before)
    assert groups[1].downstream[0] == ((1, "m", "reused"),)
    # G = 3 cannot clear 1.96 standard deviations: only uses change
    after = update_memory(memory, out, step=1)
    assert [e.uses for e in after.entries("x")] == [1, 0]
    assert after.entries("m") == ()
    with pytest.raises(JmarlError, match="node groups"):
        update_memory(memory, PlanResult((), (), PlanStats(num_generated=0)), step=1)


def test_node_wise_errors():
    with pytest.raises(JmarlError, match="sequential"):
        sample_node_wise(HierEnv(parallel=True), [7], (0, 1, 2), HierSampler(), KEY)
    with pytest.raises(JmarlError, match="group_size"):
        NodeWiseOptions(group_size=0)
    with pytest.raises(JmarlError, match="top_k_scope"):
        NodeWiseOptions(top_k_scope="global")
    with pytest.raises(JmarlError, match="agent_policy"):
        sample_node_wise(HierEnv(), [7], (0,), HierSampler(), KEY)


def test_memory_admission_and_eviction_from_node_groups():
    # G = 6; x's alternatives "7" once and "3" five times: rewards .9 and -.1 x 5 (m re-runs
    # "F3"): mu = 1/15, sigma (ddof 1) = sqrt(1/6), z of .9 = 2.04 > 1.96 -> "7" admitted
    alts = {**ALTS, ("x", None): ["7", "3", "3", "3", "3", "3"]}
    out = sample_node_wise(HierEnv(), [7], (0, 1, 2), HierSampler(alts), KEY,
                           NodeWiseOptions(group_size=6, memory=Memory()))
    x_group = out.stats.node_groups[1]
    assert x_group.rewards == pytest.approx((0.9,) + (-0.1,) * 5)
    memory = update_memory(Memory(), out, step=3)
    (admitted,) = memory.entries("x")
    assert (admitted.query, admitted.strategy, admitted.step) == ("x|q7|mem=", "7", 3)
    assert admitted.reward == pytest.approx(0.9) and admitted.baseline == pytest.approx(1 / 15)
    assert memory.entries("m") == ()  # the master groups have no 1.96-sigma outlier
    # next step the entry is retrieved into x's prompt; a low outlier there evicts it
    alts = {**ALTS, ("x", None): ["3", "7", "7", "7", "7", "7"]}
    out = sample_node_wise(HierEnv(), [7], (0, 1, 2), HierSampler(alts), KEY,
                           NodeWiseOptions(group_size=6, memory=memory))
    x_group = out.stats.node_groups[1]
    assert x_group.memory_ids == (admitted.id,)
    assert x_group.prompt == "x|q7|mem=query: x|q7|mem= | strategy: 7"
    assert x_group.rewards == pytest.approx((-0.1,) + (0.9,) * 5)
    assert update_memory(memory, out, step=4).entries("x") == ()


# ---------------------------------------------------------------- the memory's threshold math


def test_memory_thresholds_hand_worked():
    # a node group of 8 rewards (0,0,0,0,0,0,0,5): mu = 0.625, sigma_ddof1 = sqrt((7 * 0.625^2 + 4.375^2) / 7)
    # = sqrt((2.734375 + 19.140625) / 7) = sqrt(3.125) = 1.76777; mu + 1.96 sigma = 4.0898 < 5 -> admitted
    rewards = np.array([0, 0, 0, 0, 0, 0, 0, 5], np.float32)
    groups = np.zeros(8, np.int32)
    upper, lower = jmemory.memory_thresholds(rewards, groups, num_groups=1)
    np.testing.assert_allclose(upper[0], 0.625 + 1.96 * math.sqrt(3.125), rtol=1e-6)
    np.testing.assert_allclose(lower[0], 0.625 - 1.96 * math.sqrt(3.125), rtol=1e-6)
    np.testing.assert_array_equal(jmemory.admission_mask(rewards, groups, num_groups=1), [0] * 7 + [1])
    # mirrored: one -5 among zeros: mu - 1.96 sigma = -4.0898 > -5 -> its retrieved entries are evicted
    np.testing.assert_array_equal(jmemory.eviction_mask(-rewards, groups, num_groups=1), [0] * 7 + [1])
    # a group of 4 cannot pass 1.96 sigma: max z = (4 - 1) / sqrt(4) = 1.5
    assert not jmemory.admission_mask(np.array([0, 0, 0, 5.0]), np.zeros(4, np.int32), num_groups=1).any()


def test_memory_masks_per_group():
    # group 0: the 8 rewards above (admits its 5); group 1: one -5 among seven 0s (evicts);
    # group 2: all equal (nothing); rows with group -1 (padding) belong to no group
    rewards = np.array([0] * 7 + [5] + [0] * 7 + [-5] + [2] * 8 + [100, -100], np.float64)
    groups = np.array([0] * 8 + [1] * 8 + [2] * 8 + [-1, -1])
    up = jmemory.admission_mask(rewards, groups, num_groups=3)
    down = jmemory.eviction_mask(rewards, groups, num_groups=3)
    assert np.flatnonzero(up).tolist() == [7] and np.flatnonzero(down).tolist() == [15]
    upper, lower = jmemory.memory_thresholds(rewards, groups, num_groups=3)
    assert upper[16] == lower[16] == 2.0  # sigma 0: mu +- 0, but max == min admits nothing
    assert (upper[24:] == np.inf).all() and (lower[24:] == -np.inf).all()
    # ddof 0 (population sigma): one outlier among G reaches sqrt(G - 1): 2 at G = 5 > 1.96
    five = np.array([0, 0, 0, 0, 1.0])
    assert jmemory.admission_mask(five, np.zeros(5, int), num_groups=1, ddof=0).tolist() == [0, 0, 0, 0, 1]
    assert not jmemory.admission_mask(five, np.zeros(5, int), num_groups=1, ddof=1).any()
    # a group of at most ddof members has no sigma: no thresholds, nothing admitted or evicted
    upper, lower = jmemory.memory_thresholds(np.array([1.0, 4.0]), np.zeros(2, int), num_groups=1, ddof=2)
    assert upper.tolist() == [np.inf, np.inf] and lower.tolist() == [-np.inf, -np.inf]
    # totals equal up to float64 rounding noise are equal rewards (no spurious outlier)
    noisy = np.array([0.3] * 7 + [0.1 + 0.2])
    assert not jmemory.admission_mask(noisy, np.zeros(8, int), num_groups=1).any()
    with pytest.raises(JmarlError, match="3 rewards but 2 group ids"):
        jmemory.admission_mask(np.zeros(3), np.zeros(2, int), num_groups=1)


def test_entry_score_and_memory_bookkeeping():
    # score = 1 * exp(-age / 10) + 1 * reward_gap: age 0, gap 0.5 -> 1.5; age 10, gap 1 -> e^-1 + 1 = 1.3679
    np.testing.assert_allclose(jmemory.entry_score(np.array([0, 10]), np.array([0.5, 1.0])), [1.5, math.exp(-1) + 1], rtol=1e-6)
    np.testing.assert_allclose(
        jmemory.entry_score(np.array([5]), np.array([2.0]), tau=5.0, time_weight=2.0, reward_weight=0.5),
        [2 * math.exp(-1) + 1.0], rtol=1e-12)
    # the store scores its entries with it: tau 10 steps
    opts = jmemory.MemoryOptions(capacity=2, tau=10.0, top_m=3)
    mem = jmemory.Memory(opts)
    for q, gap in (("a", 0.5), ("b", 1.0)):
        mem = jmemory.admit(mem, "x", q, "s-" + q, reward=gap, baseline=0.0, step=0)
    assert [x.query for x in mem.entries("x")] == ["a", "b"]
    np.testing.assert_allclose(jmemory.entry_scores(mem, "x", 10), [math.exp(-1) + 0.5, math.exp(-1) + 1], rtol=1e-6)
    # at step 10: a scores e^-1 + 0.5 = 0.868, b e^-1 + 1 = 1.368, new c (step 10, gap 0.2) 1 + 0.2 = 1.2 -> a dropped
    mem2 = jmemory.admit(mem, "x", "c", "s-c", reward=0.2, baseline=0.0, step=10)
    assert [x.query for x in mem2.entries("x")] == ["b", "c"] and len(mem.entries("x")) == 2
    b_id = mem2.entries("x")[0].id
    assert [x.query for x in jmemory.evict(mem2, "x", [b_id]).entries("x")] == ["c"]
    assert jmemory.evict(mem2, "x", [99]) == mem2  # unknown ids: nothing to evict


def test_group_thresholds_is_memory_thresholds_of_one_group():
    rewards = [0, 0, 0, 0, 0, 0, 0, 5.0]
    upper, lower = jmemory.memory_thresholds(np.array(rewards, np.float32), np.zeros(8, np.int32), num_groups=1)
    assert jmemory.group_thresholds(rewards, 1.96, 1) == pytest.approx((float(upper[0]), float(lower[0])))
    assert jmemory.group_thresholds([1.0, 1.0, 1.0], 1.96, 1) == (math.inf, -math.inf)


def test_group_size_too_small_for_the_memory_warns():
    # Samuelson: one sample of G is at most (G - 1) / sqrt(G) sigmas away: 1.79 at G = 5, 2.04 at G = 6
    assert jmemory.min_group_size_for_memory(1.96, 1) == 6
    assert jmemory.min_group_size_for_memory(1.96, 0) == 5  # sqrt(G - 1) > 1.96 from G = 5
    assert NodeWiseOptions().group_size == 8
    with pytest.warns(jmemory.MemoryGroupSizeWarning, match="group_size >= 6"):
        jmemory.check_group_size(jmemory.MemoryOptions(), 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jmemory.check_group_size(jmemory.MemoryOptions(), 6)
        jmemory.check_group_size(jmemory.MemoryOptions(), NodeWiseOptions().group_size)
        jmemory.check_group_size(jmemory.MemoryOptions(z=1.0), 4)  # (4 - 1) / 2 = 1.5 > 1
        jmemory.check_group_size(jmemory.MemoryOptions(ddof=0), 5)
    # and it is exact: at G = 6 an outlier is admitted, at G = 5 never
    for g, admitted in ((6, True), (5, False)):
        r = np.zeros(g, np.float32)
        r[-1] = 1.0
        assert bool(jmemory.admission_mask(r, np.zeros(g, np.int32), num_groups=1).any()) == admitted


def test_equal_rewards_in_any_order_tie_and_the_earlier_task_wins():
    """A group's variance does not depend on its members' order (np.var's does, in the last bit:
    [2, -1, 0, 2, .25] and a permutation differ), so equal rewards tie and the rule decides."""
    from jmarl.workflows.node_wise import NodeGroup, _select, order_free_variance

    rewards = (2.0, -1.0, 0.0, 2.0, 0.25)
    rng = np.random.default_rng(0)
    perms = [tuple(rng.permutation(rewards)) for _ in range(200)]
    assert len({order_free_variance(p) for p in perms}) == 1
    assert order_free_variance(rewards) == pytest.approx(np.var(rewards), rel=1e-15)
    assert order_free_variance((0.1, 0.2, 0.7)) == pytest.approx(np.var((0.1, 0.2, 0.7)), rel=1e-14)

    def group(task: int, node: int, values: tuple[float, ...]) -> NodeGroup:
        return NodeGroup(task=task, seed=task, node=node, turn=0, agent=0, agent_name="a", prompt="", query="",
                         memory_ids=(), texts=("",) * len(values), rewards=values, downstream=(),
                         mean=float(np.mean(values)), variance=order_free_variance(values), selected=False,
                         group=None)

    for a, b in zip(perms, perms[1:]):
        groups = [group(1, 0, a), group(0, 1, b), group(0, 0, (0.0,) * 5)]
        assert _select(groups, 1, "batch") == {1}  # the tie goes to the earlier task
        assert _select(groups, 1, "task") == {0, 1}
