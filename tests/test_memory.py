"""JoyAgents-R1 memory rules (jmarl's realisation): similarity, scores, admission, eviction,
capacity, retrieval order, update_memory and JSON persistence, against hand-worked numbers."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from jmarl import JmarlError
from jmarl.workflows import NodeWiseStats, PlanResult
from jmarl.workflows.memory import (
    Memory,
    MemoryEntry,
    MemoryOptions,
    admit,
    entry_scores,
    evict,
    format_entry,
    group_thresholds,
    load,
    mark_used,
    retrieve,
    save,
    similarity,
    update_memory,
    with_memory_context,
)


def reference_cosine(a: str, b: str, n: int = 3) -> float:
    """Independent re-implementation: cosine of character n-gram count vectors."""

    def grams(t):
        t = " ".join(t.lower().split())
        if 0 < len(t) < n:
            return Counter([t])
        return Counter(t[i : i + n] for i in range(len(t) - n + 1))

    ga, gb = grams(a), grams(b)
    keys = sorted(set(ga) | set(gb))
    va, vb = [ga[k] for k in keys], [gb[k] for k in keys]
    na, nb = math.hypot(*va) if va else 0, math.hypot(*vb) if vb else 0
    return sum(x * y for x, y in zip(va, vb)) / (na * nb) if na and nb else 0.0


def test_similarity_hand_worked():
    assert similarity("abcd", "abce") == pytest.approx(0.5)  # {abc, bcd} . {abc, bce}
    assert similarity("AB  cd", "ab cd") == pytest.approx(1.0)  # case and spaces normalised
    assert similarity("aaaa", "aaa") == pytest.approx(1.0)  # counts (2) vs (1): parallel
    assert similarity("ab", "ab") == 1.0 and similarity("abab", "ab") == 0.0
    assert similarity("", "abc") == 0.0 and similarity("   ", "abc") == 0.0
    pairs = [("capital of France", "the capital of Spain"), ("x|q7|mem=", "x|q8|mem="),
             ("boiling point", "capital of France")]
    for a, b in pairs:
        assert similarity(a, b) == pytest.approx(reference_cosine(a, b))
        assert similarity(a, b) == pytest.approx(similarity(b, a))


def entry(i, query="q", strategy=None, reward=1.0, baseline=0.0, step=0, uses=0):
    return MemoryEntry(i, query, strategy or f"s{i}", reward, baseline, step, uses)


def test_entry_scores_hand_worked():
    mem = Memory(banks=(("x", (entry(0, reward=1.0, baseline=0.5, step=0),
                               entry(1, reward=0.2, baseline=0.4, step=8))),))
    # exp(-(10 - 0) / 10) + 0.5 and exp(-(10 - 8) / 10) - 0.2
    assert entry_scores(mem, "x", 10) == pytest.approx([math.exp(-1) + 0.5, math.exp(-0.2) - 0.2])
    weighted = Memory(MemoryOptions(tau=5.0, time_weight=2.0, reward_weight=0.5), mem.banks)
    assert entry_scores(weighted, "x", 10) == pytest.approx(
        [2 * math.exp(-2) + 0.25, 2 * math.exp(-0.4) - 0.1])
    assert entry_scores(mem, "nobody", 3).shape == (0,)


def test_admit_ids_duplicates_and_immutability():
    m0 = Memory()
    m1 = admit(m0, "x", "q1", "do A", reward=1.0, baseline=0.2, step=3)
    m2 = admit(m1, "y", "q1", "do B", reward=0.5, baseline=0.0, step=3)
    assert m0.entries("x") == () and m0.next_id == 0  # the old value is untouched
    assert m2.entries("x") == (MemoryEntry(0, "q1", "do A", 1.0, 0.2, 3, 0),)
    assert m2.entries("y") == (MemoryEntry(1, "q1", "do B", 0.5, 0.0, 3, 0),)
    assert admit(m2, "x", "q1", "do A", reward=2.0, baseline=0.0, step=9) == m2  # duplicate


def test_capacity_drops_lowest_score_older_first_on_ties():
    m = Memory(MemoryOptions(capacity=2))
    m = admit(m, "x", "qa", "A", reward=1.0, baseline=0.0, step=0)
    m = admit(m, "x", "qb", "B", reward=0.1, baseline=0.0, step=0)
    # at step 5: A exp(-.5) + 1 = 1.61, B exp(-.5) + .1 = .71, C 1 + .5 = 1.5 -> B goes
    m = admit(m, "x", "qc", "C", reward=0.5, baseline=0.0, step=5)
    assert [e.strategy for e in m.entries("x")] == ["A", "C"]
    # D scores 1 - .5 = .5, the lowest: D itself is not kept (its id is used up)
    m = admit(m, "x", "qd", "D", reward=0.0, baseline=0.5, step=5)
    assert [e.strategy for e in m.entries("x")] == ["A", "C"] and m.next_id == 4
    one = Memory(MemoryOptions(capacity=1))
    one = admit(one, "x", "q", "E", reward=0.0, baseline=0.0, step=3)
    one = admit(one, "x", "q", "F", reward=0.0, baseline=0.0, step=3)  # equal scores
    assert [e.strategy for e in one.entries("x")] == ["F"]  # the older (E) goes first


def test_retrieval_order_top_m_and_threshold():
    es = (
        entry(0, "capital of France", reward=1.0, baseline=0.5),
        entry(1, "capital of France", reward=1.0, baseline=0.0),
        entry(2, "capital of Spain"),
        entry(3, "boiling point of water"),
        entry(4, "zzzz"),
    )
    mem = Memory(MemoryOptions(top_m=3), (("qa", es),))
    sims = [similarity("capital of France", e.query) for e in es]
    assert sims[0] == sims[1] == pytest.approx(1.0) and 1 > sims[2] > sims[3] > 0 == sims[4]
    # most similar first; the tie between 0 and 1 goes to the larger reward - baseline
    assert [e.id for e in retrieve(mem, "qa", "capital of France")] == [1, 0, 2]
    wide = Memory(MemoryOptions(top_m=10), mem.banks)
    assert [e.id for e in retrieve(wide, "qa", "capital of France")] == [1, 0, 2, 3]  # not 4
    strict = Memory(MemoryOptions(top_m=10, min_similarity=0.99), mem.banks)
    assert [e.id for e in retrieve(strict, "qa", "capital of France")] == [1, 0]
    assert retrieve(Memory(MemoryOptions(top_m=0), mem.banks), "qa", "capital of France") == ()
    assert retrieve(mem, "math", "capital of France") == ()
    assert format_entry(es[2]) == "query: capital of Spain | strategy: s2"
    assert format_entry(entry(9, "q", "x" * 500), strategy_limit=10) == (
        "query: q | strategy: xxxxxxx...")
    assert format_entry(entry(9, "a  b\n" * 100, "s")) == f"query: {('a b ' * 30)[:117]}... | strategy: s"


def test_evict_and_mark_used():
    mem = Memory(banks=(("x", (entry(0), entry(1), entry(2))),), next_id=3)
    gone = evict(mem, "x", [0, 99])
    assert [e.id for e in gone.entries("x")] == [1, 2] and len(mem.entries("x")) == 3
    assert evict(mem, "x", [0, 1, 2]).banks == ()  # empty banks disappear
    used = mark_used(mem, "x", [0, 0, 2])
    assert [e.uses for e in used.entries("x")] == [2, 0, 1]


def test_group_thresholds_hand_worked():
    # [0]*5 + [1]: mu = 1/6; sigma (ddof 1) = sqrt(1/6); (ddof 0) = sqrt(5/36)
    up1, lo1 = group_thresholds([0, 0, 0, 0, 0, 1], 1.96, 1)
    sigma1 = math.sqrt(1 / 6)
    assert (up1, lo1) == pytest.approx((1 / 6 + 1.96 * sigma1, 1 / 6 - 1.96 * sigma1))
    up0, _ = group_thresholds([0, 0, 0, 0, 0, 1], 1.96, 0)
    assert up0 == pytest.approx(1 / 6 + 1.96 * math.sqrt(5 / 36))
    assert group_thresholds([0.5] * 4, 1.96, 1) == (math.inf, -math.inf)
    assert group_thresholds([1.0], 1.96, 1) == (math.inf, -math.inf)


def group(agent, query, rewards, memory_ids=()):
    return SimpleNamespace(agent_name=agent, query=query, rewards=tuple(rewards),
                           texts=tuple(f"{query}-s{i}" for i in range(len(rewards))),
                           memory_ids=tuple(memory_ids))


def node_wise_result(groups):
    """An empty `node_wise` plan result that reports `groups` as its node groups."""
    stats = NodeWiseStats(num_generated=0, num_base=0, num_alternatives=0, num_reruns=0,
                          num_groups=len(groups), num_selected=0, node_groups=tuple(groups))
    return PlanResult((), (), stats)


def test_update_memory_admits_evicts_and_counts_uses():
    mem = Memory(banks=(("x", (entry(0, "old"), entry(1, "older"))),), next_id=2)
    result = node_wise_result((
        group("x", "q1", [0, 0, 0, 0, 0, 1], memory_ids=(0,)),  # z = 2.04 > 1.96: admit s5
        group("x", "q2", [1, 1, 1, 1, 1, 0], memory_ids=(1,)),  # z = -2.04: evict entry 1
        group("m", "q3", [0.5] * 6, memory_ids=()),  # sigma 0: nothing
        group("m", "q4", [0, 0, 0, 0, 1], memory_ids=()),  # G = 5: z = 1.79, nothing (ddof 1)
    ))
    new = update_memory(mem, result, step=7)
    assert new.entries("x") == (
        MemoryEntry(0, "old", "s0", 1.0, 0.0, 0, 1),
        MemoryEntry(2, "q1", "q1-s5", 1.0, pytest.approx(1 / 6), 7, 0),
    )
    assert new.entries("m") == () and new.next_id == 3
    # with ddof 0 the G = 5 outlier clears the threshold: sigma = .4, z = 2.0
    mem0 = Memory(MemoryOptions(ddof=0), mem.banks, mem.next_id)
    new0 = update_memory(mem0, result, step=7)
    assert [e.strategy for e in new0.entries("m")] == ["q4-s4"]
    # a higher z admits nothing and evicts nothing
    strict = update_memory(Memory(MemoryOptions(z=2.1), mem.banks, 2), result, step=7)
    assert [(e.id, e.uses) for e in strict.entries("x")] == [(0, 1), (1, 1)]


@dataclass(frozen=True)
class WithContext:
    memory_context: dict = field(default_factory=dict)
    other: int = 0


@dataclass(frozen=True)
class WithoutContext:
    other: int = 0


def test_with_memory_context():
    s = WithContext({"a": ("keep",)})
    t = with_memory_context(s, "b", ["e1", "e2"])
    assert t.memory_context == {"a": ("keep",), "b": ("e1", "e2")} and s.memory_context == {
        "a": ("keep",)}
    plain = WithoutContext()
    assert with_memory_context(plain, "b", ["e"]) is plain
    assert with_memory_context("state", "b", ["e"]) == "state"


def test_json_round_trip_save_load(tmp_path):
    mem = Memory(MemoryOptions(capacity=8, top_m=2, tau=4.0))
    mem = admit(mem, "qa", "Qui a écrit Hamlet ?", "ANSWER: Shakespeare", reward=1.1,
                baseline=0.3, step=2)
    mem = admit(mem, "master", "route me", "ROUTE: qa", reward=0.9, baseline=0.1, step=3)
    mem = mark_used(mem, "qa", [0])
    assert Memory.from_json(mem.to_json()) == mem
    path = tmp_path / "ckpt" / "memory.json"
    save(mem, path)
    assert load(path) == mem
    text = path.read_text(encoding="utf-8")
    assert "écrit" in text and '\n  "agents"' in text  # human-readable, indented
    data = json.loads(text)
    assert data["format"] == "jmarl.memory" and data["options"]["tau"] == 4.0
    assert data["agents"]["qa"][0]["uses"] == 1 and sorted(data["agents"]) == ["master", "qa"]
    with pytest.raises(JmarlError, match="malformed memory JSON"):
        Memory.from_json('{"format": "other"}')
    with pytest.raises(JmarlError, match="malformed memory JSON"):
        Memory.from_json("not json")
    with pytest.raises(JmarlError, match="not found"):
        load(tmp_path / "missing.json")
    with pytest.raises(JmarlError, match="capacity"):
        MemoryOptions(capacity=0)
    with pytest.raises(JmarlError, match="tau"):
        MemoryOptions(tau=0.0)
