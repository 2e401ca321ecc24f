"""Math: generated problems, JSONL loading and splits, agreement, rewards, the program path."""

import json
import random
from fractions import Fraction

import pytest

from jmarl import JmarlError
from jmarl.envs import eval_seed, make
from jmarl.envs.common import is_eval_item
from jmarl.envs.math import MathState, Problem, final_answer_of, generate_problem


def _state(answer="12"):
    return MathState(seed=0, problem=Problem("What is 3 * 4?", answer))


def _eval_expression(question: str) -> Fraction:
    """Independent evaluation of a generated 'Compute <expr>.' question (Python's own parser)."""
    expr = question.removeprefix("Compute ").removesuffix(".")
    return Fraction(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - our own generated text


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_generated_arithmetic_answers_are_exact(difficulty):
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        p = generate_problem(rng, difficulty)
        if p.question.startswith("Compute "):
            assert _eval_expression(p.question) == Fraction(p.answer)
            assert len(p.explanation.splitlines()) == difficulty + 1  # one line per operation
            checked += 1
        else:
            assert p.answer.lstrip("-").isdigit() and p.explanation
    assert checked > 50


def test_word_problem_answers_follow_their_steps():
    rng = random.Random(1)
    for _ in range(200):
        p = generate_problem(rng, 2)
        if not p.question.startswith("Compute "):
            last = p.explanation.splitlines()[-1]
            assert last.endswith(f"= {p.answer}")


def test_two_agents_agree_on_correct_answer():
    env = make("math")
    s, r = env.step(_state(), "tool", "```\nno python here\n``` so \\boxed{12}")
    # tool correct: local 1; the turn is not complete yet: team 0, not done
    assert (r.local_reward, r.team_reward, r.done) == (1.0, 0.0, False)
    assert "tool: 12" in env.observe(s, "reasoner")
    s, r = env.step(s, "reasoner", "3 * 4 = 12. #### 12.0")
    # reasoner correct (12.0 == 12): local 1; both agree and are right: team 1; done
    assert (r.local_reward, r.team_reward, r.done) == (1.0, 1.0, True)
    assert env.done(s) and env.success(s)


def test_disagreement_continues_and_wrong_agreement_ends_unsuccessfully():
    env = make("math", max_turns=2)
    s, _ = env.step(_state(), "tool", "\\boxed{12}")
    s, r = env.step(s, "reasoner", "I get 13")
    # disagreement: reasoner wrong -> local 0, team 0, the episode goes on
    assert (r.local_reward, r.team_reward, r.done) == (0.0, 0.0, False)
    s = env.end_turn(s)
    assert not env.done(s)
    s, r = env.step(s, "tool", "13")
    assert r.local_reward == 0.0
    s, r = env.step(s, "reasoner", "\\boxed{13}")
    # both say 13 (wrong): agreement ends the episode, no team bonus, no success
    assert r.done and r.team_reward == 0.0 and env.done(s) and not env.success(s)


def test_out_of_turns_and_missing_answers():
    env = make("math", max_turns=1)
    s, r = env.step(_state(), "tool", "")
    assert r.local_reward == 0.0 and r.info["answer"] is None
    s, r = env.step(s, "reasoner", "\\boxed{12}")
    assert not r.done  # no agreement (the tool gave no answer)
    s = env.end_turn(s)
    assert env.done(s) and env.success(s)  # the final answerer (reasoner) was right


def test_parallel_option_and_single_agent_mode():
    env = make("math", parallel=True)
    assert env.parallel and env.turn_order == ("tool", "reasoner")
    solo = make("math", agents=["solver"])
    assert solo.agents == ("solver",)
    s, r = solo.step(_state(), "solver", "\\boxed{12}")
    # single agent: verified 0/1 reward, no team term, done after its one answer
    assert (r.local_reward, r.team_reward, r.done) == (1.0, 0.0, True) and solo.success(s)
    _, r = solo.step(_state(), "solver", "\\boxed{11}")
    assert (r.local_reward, r.team_reward, r.done) == (0.0, 0.0, True)
    assert "\\boxed" in solo.observe(_state(), "solver")
    with pytest.raises(JmarlError):
        make("math", agents=("a", "a"))
    with pytest.raises(JmarlError):
        solo.step(_state(), "tool", "1")


def test_tool_program_path():
    env = make("math", program_timeout_s=2.0)
    s, r = env.step(_state(), "tool", "```python\nx = 3 * 4\nprint(f'answer {x}')\n```")
    assert r.info["source"] == "program ok" and r.info["answer"] == "12" and r.local_reward == 1.0
    _, r = env.step(_state(), "tool", "```python\n1/0\n```\n\\boxed{12}")
    # a failing program gives no answer (the text outside it is not used): reward 0
    assert r.info["source"] == "program error" and r.local_reward == 0.0
    _, r = env.step(_state(), "reasoner", "```python\nprint(99)\n```\n\\boxed{12}")
    # only the tool agent runs programs; the reasoner's boxed answer counts
    assert r.info["source"] == "direct" and r.local_reward == 1.0


def test_final_answer_of_dataset_fields():
    assert final_answer_of("She has 5 + 3 = 8 apples.\n#### 8") == "8"
    assert final_answer_of("So $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert final_answer_of(42) == "42"


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_jsonl_loader_and_split(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
            for i in range(200)]
    rows.append({"problem": "Simplify 2/4.", "solution": "It is $\\boxed{\\frac{1}{2}}$."})
    path = tmp_path / "gsm.jsonl"
    _write_jsonl(path, rows)
    env = make("math", path=str(path))
    train = [env.reset(s).problem for s in range(300)]
    held = [env.reset(eval_seed(s)).problem for s in range(50)]
    assert not any(is_eval_item(p.question) for p in train)
    assert all(is_eval_item(p.question) for p in held)
    assert not {p.question for p in train} & {p.question for p in held}
    assert len({p.question for p in train}) + len({p.question for p in held}) == 201
    p = next(p for p in train + held if p.question == "What is 7 + 7?")
    assert p.answer == "14" and p.explanation == "7 + 7 = 14"
    s = env.reset(0)
    s, _ = env.step(s, "tool", env.expert_text(s, "tool"))
    s, r = env.step(s, "reasoner", env.expert_text(s, "reasoner"))
    assert env.success(s) and r.team_reward == 1.0


def test_jsonl_eval_path_and_errors(tmp_path):
    train_path, eval_path = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    _write_jsonl(train_path, [{"question": "A?", "answer": "1"}, {"question": "B?", "answer": "2"}])
    _write_jsonl(eval_path, [{"question": "B?", "answer": "2"}, {"question": "C?", "answer": "3"}])
    env = make("math", path=str(train_path), eval_path=str(eval_path))
    assert {env.reset(s).problem.question for s in range(4)} == {"A?"}  # B? is held out
    assert {env.reset(eval_seed(s)).problem.question for s in range(4)} == {"B?", "C?"}
    with pytest.raises(JmarlError, match="not found"):
        make("math", path=str(tmp_path / "missing.jsonl")).reset(0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x", "answer": "1"}\nnot json\n')
    with pytest.raises(JmarlError, match="bad.jsonl:2"):
        make("math", path=str(bad)).reset(0)
    _write_jsonl(bad, [{"text": "no question field"}])
    with pytest.raises(JmarlError, match="question field"):
        make("math", path=str(bad)).reset(0)
    with pytest.raises(JmarlError, match="eval_path"):
        make("math", eval_path=str(eval_path))


@pytest.mark.parametrize("tier", ["add_small", "add_two_digit", "two_ops"])
def test_arithmetic_tiers_have_128_distinct_exact_held_out_problems_disjoint_from_training(tier):
    env = make("math", tier=tier, agents=("solver",), max_turns=1)
    held = [env.reset(eval_seed(i)).problem for i in range(128)]
    assert len({p.question for p in held}) == 128
    train = [env.reset(i).problem for i in range(300)]
    assert not {p.question for p in held} & {p.question for p in train}
    assert all(is_eval_item(p.question) for p in held) and not any(is_eval_item(p.question) for p in train)
    for p in held + train:
        assert Fraction(p.answer) == _eval_expression(p.question)
    assert len({p.question for p in train}) > 200  # training draws cover the tier, not a few items
    state, result = env.step(env.reset(eval_seed(0)), "solver", f"so \\boxed{{{held[0].answer}}}")
    assert result.local_reward == 1.0 and env.success(state)


def test_arithmetic_tier_options_are_checked():
    with pytest.raises(JmarlError, match="tier must be one of"):
        make("math", tier="calculus")
    with pytest.raises(JmarlError, match="either tier"):
        make("math", tier="add_small", path="x.jsonl")


def test_solved_examples_open_every_prompt_and_are_training_problems():
    env = make("math", tier="add_small", agents=("solver",), max_turns=1, examples=3)
    prompts = [env.observe(env.reset(s), "solver") for s in (eval_seed(0), eval_seed(1), 5)]
    block = env.examples_block()
    assert all(p.startswith(block) for p in prompts) and block.count("\\boxed{") == 3
    for line in (x for x in block.splitlines() if x.startswith("Problem: ")):
        assert not is_eval_item(line.removeprefix("Problem: "))
    assert make("math", tier="add_small", agents=("solver",)).observe(env.reset(5), "solver").startswith("Problem:")
    with pytest.raises(JmarlError, match="examples must be"):
        make("math", examples=20)
