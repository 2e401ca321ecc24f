"""Writing: reward components by hand, the parallel turn, corpus and JSONL sources."""

import json

import pytest

from jmarl import JmarlError
from jmarl.envs import eval_seed, make
from jmarl.envs.writing import WritingState, range_score, words, writing_reward

SOURCE = "The red fox jumps over the lazy river bank."
CONCISE = "Fox jumps river"
DETAILED = "First the fox ran. Moreover the fox jumps over the river"
SMALL = {"concise_words": (2, 4), "detailed_words": (6, 10), "ratio_range": (2, 3),
         "transitions_target": 2}


def test_range_score():
    assert range_score(3, (2, 4)) == 1.0
    assert range_score(1, (2, 4)) == 0.5  # below: 1 / 2
    assert range_score(5, (2, 4)) == 0.75  # above: 1 - (5 - 4) / 4
    assert range_score(9, (2, 4)) == 0.0  # far above: clipped at 0


def test_components_by_hand():
    c = writing_reward(SOURCE, CONCISE, DETAILED, **SMALL)
    # concise: 3 words in [2, 4] -> 1; detailed: first the fox ran moreover the fox jumps over
    # the river = 11 words > 10 -> 1 - 1/10 = 0.9; structure = (1 + 0.9) / 2 = 0.95
    assert c["structure"] == pytest.approx(0.95)
    # ratio 11 / 3 = 3.667 > 3 -> 1 - (3.667 - 3) / 3 = 0.7778
    assert c["ratio"] == pytest.approx(1 - (11 / 3 - 3) / 3)
    # diversity: concise 3/3 = 1; detailed 8 distinct / 11 = 0.7273; mean 0.8636
    assert c["diversity"] == pytest.approx((1 + 8 / 11) / 2)
    # transitions in the detailed part: "first", "moreover" -> 2 / 2 = 1
    assert c["transitions"] == 1.0
    # content words (>= 4 letters, not stop words) of the summary: jumps, river, first, moreover
    # ("over" is a stop word, "fox"/"ran" too short); in the source: jumps, river -> 2 / 4
    assert c["overlap"] == pytest.approx(0.5)


def test_degenerate_parts():
    c = writing_reward(SOURCE, "", "", **SMALL)
    assert c == {"structure": 0.0, "ratio": 0.0, "diversity": 0.0, "transitions": 0.0,
                 "overlap": 0.0}
    assert words("It's 3 o'clock, well-known!") == ["it's", "3", "o'clock", "well-known"]


def test_parallel_turn_scores_the_pair():
    env = make("writing", **SMALL)
    assert env.parallel and env.turn_order == ("concise", "detailed")
    state = WritingState(seed=0, source=SOURCE)
    s, r = env.step(state, "concise", CONCISE)
    # first writer: local = its own length score (3 words in [2, 4] -> 1); pair not scored yet
    assert (r.local_reward, r.team_reward, r.done) == (1.0, 0.0, False)
    assert "The concise writer" not in env.observe(state, "detailed")  # parallel view
    s, r = env.step(s, "detailed", DETAILED)
    # second writer: local = 0.9 (11 words, range [6, 10]); team = sum of the five components
    expected = writing_reward(SOURCE, CONCISE, DETAILED, **SMALL)
    assert r.local_reward == pytest.approx(0.9)
    assert r.team_reward == pytest.approx(0.95 + (1 - (11 / 3 - 3) / 3) + (1 + 8 / 11) / 2
                                          + 1.0 + 0.5)
    assert {k: r.info[k] for k in expected} == pytest.approx(expected)
    s = env.end_turn(s)
    assert env.done(s)
    # success threshold 4.0: 0.95 + 0.778 + 0.864 + 1 + 0.5 = 4.09
    assert env.success(s)
    assert not make("writing", success_threshold=4.5, **SMALL).success(s)


def test_two_turns_show_the_partner_part():
    env = make("writing", max_turns=2)
    s = env.reset(0)
    s, _ = env.step(s, "concise", "short part")
    s, _ = env.step(s, "detailed", "long part")
    s = env.end_turn(s)
    assert not env.done(s)
    assert "The detailed writer's latest part: long part" in env.observe(s, "concise")


def test_corpus_and_jsonl(tmp_path):
    env = make("writing")
    texts = {env.reset(s).source for s in range(50)}
    assert len(texts) == 50 and all(60 <= len(words(t)) <= 160 for t in texts)
    path = tmp_path / "docs.jsonl"
    rows = [{"text": f"Document number {i} talks about topic {i}. It has two sentences."}
            for i in range(100)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    env = make("writing", path=str(path))
    train = {env.reset(s).source for s in range(200)}
    held = {env.reset(eval_seed(s)).source for s in range(30)}
    assert not train & held and len(train) + len(held) == 100
    with pytest.raises(JmarlError, match="not found"):
        make("writing", path=str(tmp_path / "nope.jsonl")).reset(0)
    path.write_text(json.dumps({"title": "no text"}))
    with pytest.raises(JmarlError, match="text field"):
        make("writing", path=str(path)).reset(0)
    with pytest.raises(JmarlError, match="concise_words"):
        make("writing", concise_words=(5, 2))
