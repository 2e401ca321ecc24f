"""The Code env: rewards against hand-computed values, problem sets, parsing, episode flow."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from jmarl.envs import code_problems
from jmarl.envs.base import EVAL_SEED_START, Env, eval_seed, make
from jmarl.envs.code import Code, CodeState, extract_code, parse_tests
from jmarl.envs.code_harness import ProgramCheck, run_tests
from jmarl.errors import JmarlError

ABSDIFF_TESTS = [
    "assert absdiff(3, 5) == 2",
    "assert absdiff(5, 3) == 2",
    "assert absdiff(-1, -4) == 3",
    "assert absdiff(7, 7) == 0",
]
RECORDS = [
    {"task_id": 11, "text": "Return the absolute difference of two integers.",
     "code": "def absdiff(a, b):\n    return abs(a - b)\n", "test_list": ABSDIFF_TESTS},
    {"task_id": "HumanEval/900",
     "prompt": "def double_all(xs):\n    \"\"\"Return xs with every element doubled.\"\"\"\n",
     "canonical_solution": "    return [2 * x for x in xs]\n",
     "test": "METADATA = {}\n\n\ndef check(candidate):\n    assert candidate([]) == []\n"
             "    assert candidate([1, 2]) == [2, 4]\n    assert candidate([-3]) == [-6]\n",
     "entry_point": "double_all"},
    {"problem_id": 4000, "question": "Read two integers and print their sum.",
     "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)\n"]),
     "input_output": json.dumps({"inputs": ["1 2\n", "10 -3\n", "0 0\n"],
                                 "outputs": ["3\n", "7\n", "0\n"]})},
    {"problem_id": 4001, "question": "Multiply two integers.", "starter_code": "def mul(a, b):",
     "solutions": ["def mul(a, b):\n    return a * b\n"],
     "input_output": {"fn_name": "mul", "inputs": [[2, 3], [4, 5]], "outputs": [[6], [20]]}},
]


# Reads the harness's nonce from its frames and reports every test as passed, then exits.
FORGER = """import os, sys
def absdiff(a, b):
    frame = sys._getframe(1)
    while frame is not None:
        if 'nonce' in frame.f_locals:
            nonce = frame.f_locals['nonce']
            for i in range(4):
                os.write(1, f'{nonce} {i} PASS\\n'.encode())
            os._exit(0)
        frame = frame.f_back
    return -1"""


def fenced(code: str) -> str:
    return f"Here is my answer:\n```python\n{code}\n```\nDone."


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("code") / "problems.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    return str(path)


def seed_of(env: Code, task_id: str) -> int:
    """A seed (train or eval) whose problem is `task_id`."""
    for seed in [*range(8), *(eval_seed(i) for i in range(8))]:
        try:
            if env.problem(seed).task_id == task_id:
                return seed
        except JmarlError:  # an empty split
            continue
    raise AssertionError(f"no seed gives {task_id}")


def act(env: Code, state: CodeState, agent: str, code: str):
    return env.step(state, agent, fenced(code))


# -------------------------------------------------------------------------------- parsing


def test_extract_code_variants():
    assert extract_code("```python\nx = 1\n```") == "x = 1\n"
    assert extract_code("a\n```py\nx = 1\n```\nb\n```python\ny = 2\n```") == "x = 1\n\ny = 2\n"
    assert extract_code("text\n```\nz = 3\n```") == "z = 3\n"
    assert extract_code("```python\nw = 4\nstill open") == "w = 4\nstill open"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"
    assert extract_code(b"\xff```python\nq = 1\n```") == "q = 1\n"
    assert extract_code(None) == "" and extract_code("a\x00b") == "ab"


def test_parse_tests_keeps_setup_and_protects_the_function():
    code = ("import math\n"
            "def absdiff(a, b):\n    return 0\n"  # would replace the coder's function: dropped
            "def helper(x):\n    return x\n"
            "print('noise')\n"
            "assert absdiff(1, 2) == 1\n"
            "def test_two():\n    assert absdiff(2, 2) == 0\n")
    tests = parse_tests(code, {"absdiff"}, 10_000)
    assert len(tests) == 2
    assert tests[0] == "import math\ndef helper(x):\n    return x\nassert absdiff(1, 2) == 1"
    assert tests[1].endswith("test_two()") and "return 0" not in tests[1]
    assert parse_tests("assert (", {"f"}, 10_000) == ()
    assert len(parse_tests("\n".join(["assert 1 == 1"] * 50), set(), 10_000)) == 20


def test_value_checks_keep_expected_values_out_of_the_sandbox():
    from jmarl.envs.code_harness import _value_check

    c = _value_check("assert f(1) == [2, 3]")
    assert (c.source, c.kind, c.expected) == ("__value__ = f(1)", "loose", [2, 3])
    c = _value_check("assert 'x' == g()")
    assert (c.source, c.kind, c.expected) == ("__value__ = g()", "loose", "x")
    c = _value_check("candidate = f\nassert _same(candidate(2), (1, None))")
    assert (c.source, c.kind, c.expected) == ("candidate = f\n__value__ = candidate(2)",
                                              "strict", (1, None))
    c = _value_check("assert _same_lines(run_program('1'), '2\\n')")
    assert (c.kind, c.expected) == ("lines", "2\n")
    for test in ("assert abs(f(1) - 2) < 1e-6", "assert f(1) == g(1)", "x = 1", "assert ("):
        assert _value_check(test).kind == "assert" and _value_check(test).source == test
    # Strict vs loose comparison, and the forger against value and assert checks.
    program = "def f(x):\n    return True\n"
    [result] = run_tests([ProgramCheck(program, ("assert f(0) == 1", "assert _same(f(0), 1)",
                                                 "assert f(0) is not None"))])
    assert result == (True, False, True)
    forged = FORGER.replace("absdiff", "f")
    [result] = run_tests([ProgramCheck(forged, ("assert f(1, 1) == 0", "assert f(1, 1) != 5",
                                                "assert f(1, 1) == 0", "assert f(2, 1) == 1"))])
    # Only the test judged inside the harness (index 1) can be forged; value checks cannot.
    assert result == (False, True, False, False)


# ------------------------------------------------------------------------ built-in problems


def test_builtin_problems_split_by_hash_and_are_deterministic():
    train = [code_problems.builtin_problem(s, want_eval=False, eval_fraction=0.2)
             for s in range(300)]
    held = [code_problems.builtin_problem(s, want_eval=True, eval_fraction=0.2)
            for s in range(300)]
    train_ids, held_ids = {p.task_id for p in train}, {p.task_id for p in held}
    assert train_ids.isdisjoint(held_ids)
    assert all(code_problems.is_eval_identity(i, 0.2) for i in held_ids)
    assert not any(code_problems.is_eval_identity(i, 0.2) for i in train_ids)
    assert len(train_ids) > 100 and len(held_ids) > 50
    env = Code()
    assert env.reset(7) == env.reset(7)
    assert env.reset(eval_seed(3)).problem.task_id in {
        code_problems.builtin_problem(EVAL_SEED_START + 3, want_eval=True,
                                      eval_fraction=0.2).task_id}
    assert {p.task_id.split("(")[0] for p in train} == {
        f"builtin:{n}" for n in code_problems.TEMPLATE_NAMES}



def test_num_problems_keeps_the_first_problems_of_each_split(jsonl):
    env = Code(num_problems=2)
    train = [code_problems.builtin_problem(s, want_eval=False, eval_fraction=0.2).task_id
             for s in range(2)]
    held = [code_problems.builtin_problem(EVAL_SEED_START + s, want_eval=True,
                                          eval_fraction=0.2).task_id for s in range(2)]
    assert [env.problem(s).task_id for s in range(6)] == train * 3
    assert [env.problem(eval_seed(i)).task_id for i in range(5)] == (held * 3)[:5]
    assert set(train).isdisjoint(held)
    assert all(code_problems.is_eval_identity(i, 0.2) for i in held)
    assert env.problem(0) == Code().problem(0) and env.problem(1) == Code().problem(1)
    # a file: the split's first N problems, in file order
    full, cut = Code(path=jsonl), Code(path=jsonl, num_problems=1)
    assert {cut.problem(s).task_id for s in range(8)} == {full.problem(0).task_id}
    assert cut.problem(5) == full.problem(0)
    with pytest.raises(JmarlError, match="num_problems"):
        Code(num_problems=0)
    with pytest.raises(JmarlError, match="num_problems"):
        Code(num_problems=True)


@pytest.mark.parametrize("variant", ["coder_tester", "helper_main"])
def test_compact_prompt_is_one_line_then_the_problem_and_feedback(variant):
    full = Code(variant=variant, max_turns=2)
    compact = Code(variant=variant, max_turns=2, prompt_style="compact")
    state = full.reset(4)
    description = state.problem.description
    entry = state.problem.entry_point
    for agent in full.agents:
        short, long = compact.observe(state, agent), full.observe(state, agent)
        head, body = short.split("\n\n", 1)
        assert "\n" not in head and "```python" in head and entry in head
        assert body == description  # the problem, unchanged
        assert long.startswith("You ") and f"Problem:\n{description}" in long
        assert len(short) < len(long) - 80
    for agent in full.agents:  # the experts' turn, then the feedback shown in turn 2
        state, _ = full.step(state, agent, full.expert_text(state, agent))
    state = dataclasses.replace(full.end_turn(state), finished=False)
    assert state.feedback
    for agent in full.agents:
        assert compact.observe(state, agent).endswith("\n\n" + state.feedback)
        assert state.feedback in full.observe(state, agent)
    with pytest.raises(JmarlError, match="prompt_style"):
        Code(prompt_style="short")

def test_builtin_references_pass_and_wrong_programs_fail():
    # One problem per template; every reference (single and aux + main) passes every hidden
    # test, and a program returning None fails at least one.
    chosen = {}
    for s in range(200):
        p = code_problems.builtin_problem(s, want_eval=False, eval_fraction=0.2)
        chosen.setdefault(p.entry_point, p)
    assert len(chosen) == len(code_problems.TEMPLATE_NAMES)
    jobs = []
    for p in chosen.values():
        assert len(p.tests) == code_problems.NUM_HIDDEN_TESTS and len(p.examples) == 2
        jobs.append(ProgramCheck(p.reference, p.tests + p.examples))
        jobs.append(ProgramCheck(p.aux_reference + "\n\n" + p.main_reference, p.tests))
        jobs.append(ProgramCheck(f"def {p.entry_point}(*args):\n    return None\n", p.tests))
    results = run_tests(jobs)
    for i, p in enumerate(chosen.values()):
        single, joint, wrong = results[3 * i : 3 * i + 3]
        assert all(single) and len(single) == len(p.tests) + 2, p.task_id
        assert all(joint), p.task_id
        assert not all(wrong), p.task_id


# ---------------------------------------------------------------------- coder + tester rewards


def test_coder_rewards_hand_computed(jsonl):
    env = make("code", path=jsonl)
    state = env.reset(seed_of(env, "11"))
    cases = {
        "def absdiff(a, b):\n    return abs(a - b)": 1.0,  # correct
        "def absdiff(a, b):\n    return b - a": 0.5,  # passes tests 1 and 4 of 4
        "def absdiff(a, b)\n    return abs(a - b)": 0.0,  # does not compile
        "def absdiff(a, b):\n    return a - b\n": 0.75,  # fails only absdiff(3, 5)
        # hostile: exits before the harness reports, fakes reports, loops, claims equality
        "import os\nos._exit(0)": 0.0,
        "import sys\nsys.exit(0)": 0.0,
        "for i in range(4):\n    print(i, 'PASS')\ndef absdiff(a, b):\n    return -1": 0.0,
        "while True:\n    pass": 0.0,
        "class E:\n    def __eq__(self, o):\n        return True\n"
        "def absdiff(a, b):\n    return E()": 0.0,
        "_eq = lambda a, b: True\ndef absdiff(a, b):\n    return None": 0.0,
        FORGER: 0.0,
    }
    for code, expected in cases.items():
        new, result = act(env, state, "coder", code)
        assert math.isclose(result.local_reward, expected), (code, result)
        assert math.isclose(result.team_reward, expected)
        assert result.info["hidden_pass_ratio"] == expected and result.info["hidden_tests"] == 4
        assert result.info["syntax_ok"] == (code != "def absdiff(a, b)\n    return abs(a - b)")
        assert new.codes[0] == code.strip("\n") + "\n" and state.codes == ("", "")  # not mutated


def test_tester_rewards_hand_computed(jsonl):
    env = make("code", path=jsonl)
    start = env.reset(seed_of(env, "11"))
    correct, _ = act(env, start, "coder", "def absdiff(a, b):\n    return abs(a - b)")
    partial, _ = act(env, start, "coder", "def absdiff(a, b):\n    return b - a")
    broken, _ = act(env, start, "coder", "def absdiff(a, b) return")
    valid = "assert absdiff(1, 4) == 3\nassert absdiff(4, 1) == 3"
    one_wrong = valid + "\nassert absdiff(2, 2) == 1"
    # (coder state, tests) -> (agreement, validity, local): local = 0.5 * agr + 0.5 * validity
    cases = [
        (correct, valid, 1.0, 1.0),  # both verdicts "passes"
        (correct, one_wrong, 0.0, 2 / 3),  # tester says fail, hidden says pass
        (partial, valid, 1.0, 1.0),  # b - a fails absdiff(4, 1): both say "fails"
        (partial, "assert absdiff(1, 4) == 3", 0.0, 1.0),  # too weak: passes a wrong program
        (broken, valid, 1.0, 1.0),  # nothing compiles: every test fails, as hidden ones do
    ]
    for coder_state, tests, agreement, validity in cases:
        _, result = act(env, coder_state, "tester", tests)
        assert result.info["agreement"] == agreement, (tests, result.info)
        assert math.isclose(result.info["validity"], validity)
        assert math.isclose(result.local_reward, 0.5 * agreement + 0.5 * validity)
        assert result.team_reward == coder_state.pass_ratio
    # Agreement alone (the option's other end): the weak test now scores 0, the valid one 1.
    pure = make("code", path=jsonl, tester_validity_weight=0.0)
    assert act(pure, partial, "tester", "assert absdiff(1, 4) == 3")[1].local_reward == 0.0
    assert act(pure, correct, "tester", one_wrong)[1].local_reward == 0.0
    assert act(pure, partial, "tester", valid)[1].local_reward == 1.0
    # No test at all, or hostile tests, score 0 / fail.
    _, result = act(env, correct, "tester", "print('hello')")
    assert result.local_reward == 0.0 and result.info["num_tests"] == 0
    # A bare call at top level is dropped; a test function that kills the harness makes every
    # test fail, on both programs.
    _, result = act(env, correct, "tester", "import os\nos._exit(0)\nassert absdiff(1, 1) == 0")
    assert result.info["num_tests"] == 1 and result.local_reward == 1.0
    _, result = act(env, correct, "tester",
                    "def test_exit():\n    import os\n    os._exit(0)\nassert absdiff(1, 1) == 0")
    assert result.info["num_tests"] == 2
    assert result.info["tester_verdict"] is False and result.info["validity"] == 0.0
    assert result.local_reward == 0.0  # disagrees with hidden (pass) and no valid test


def test_coder_tester_episode_flow(jsonl):
    env = make("code", path=jsonl, max_turns=3)
    state = env.reset(seed_of(env, "11"))
    assert env.agents == env.turn_order == ("coder", "tester") and env.parallel
    state, _ = act(env, state, "coder", "def absdiff(a, b):\n    return b - a")
    state, _ = act(env, state, "tester", "assert absdiff(1, 4) == 3\nassert absdiff(4, 1) == 3")
    state = env.end_turn(state)
    assert state.turn == 1 and not env.done(state) and not env.success(state)
    assert state.test_results == (True, False)  # b - a gives absdiff(4, 1) = -3
    prompt = env.observe(state, "coder")
    assert "1 of 2 tests passed" in prompt
    assert "Failing tests:\n```python\nassert absdiff(4, 1) == 3\n```" in prompt
    state, _ = act(env, state, "coder", "def absdiff(a, b):\n    return abs(a - b)")
    state, _ = env.step(state, "tester", env.expert_text(state, "tester"))
    state = env.end_turn(state)
    assert env.done(state) and env.success(state) and state.turn == 2  # tests agree: stop
    _, result = env.step(state, "coder", "x")
    assert result.done and result.local_reward == 0.0


def test_max_turns_ends_episode():
    env = make("code", max_turns=1)
    state = env.reset(0)
    state, result = env.step(state, "coder", "nothing useful")
    assert result.local_reward == 0.0
    state, _ = env.step(state, "tester", "")
    state = env.end_turn(state)
    assert env.done(state) and not env.success(state)


# ------------------------------------------------------------------------ helper + main rewards


def test_helper_main_rewards_hand_computed(jsonl):
    env = make("code", variant="helper_main", path=jsonl)
    assert env.agents == ("aux", "main") and env.max_turns == 1
    weighted = make("code", variant="helper_main", path=jsonl, joint_weights=(0, 0, 1, 0))
    start = env.reset(seed_of(env, "11"))
    good_aux = "def aux(a, b):\n    return a - b"
    # (aux code, main code) -> (structure, syntax, pass ratio, uses_aux, aux local, main local)
    cases = [
        (good_aux, "def absdiff(a, b):\n    return abs(aux(a, b))", (1, 1, 1.0, 1, 1, 1)),
        (good_aux, "def absdiff(a, b):\n    return abs(a - b)", (1, 1, 1.0, 0, 1, 1)),
        (good_aux, "def absdiff(a, b):\n    return aux(b, a)", (1, 1, 0.5, 1, 1, 1)),
        (good_aux, "def absdiff(a, b) return aux(a, b)", (0, 0, 0.0, 0, 1, 0)),
        ("def helper(a, b):\n    return a - b", "def absdiff(a, b):\n    return abs(aux(a, b))",
         (0, 1, 0.0, 0, 0, 1)),
        (good_aux, "def absdiff(a, b):\n    return abs(aux(a, b))\nwhile True:\n    pass",
         (1, 1, 0.0, 1, 1, 1)),  # hostile: never finishes loading
        (good_aux, "import os\nos._exit(0)\ndef absdiff(a, b):\n    return abs(aux(a, b))",
         (1, 1, 0.0, 1, 1, 1)),  # hostile: exits before any report
    ]
    for aux_code, main_code, (structure, syntax, ratio, uses, aux_local, main_local) in cases:
        state, aux_result = act(env, start, "aux", aux_code)
        # main has not acted yet: the joint program is incomplete.
        assert aux_result.local_reward == aux_local and aux_result.team_reward == 0.0
        state, result = act(env, state, "main", main_code)
        team = 0.1 * structure + 0.1 * syntax + 0.6 * ratio + 0.2 * uses
        assert math.isclose(result.team_reward, team), (main_code, result.info)
        _, passes_only = act(weighted, state, "main", main_code)
        assert math.isclose(passes_only.team_reward, ratio)
        assert result.local_reward == main_local
        info = result.info
        assert (info["structure"], info["syntax_ok"], info["hidden_pass_ratio"],
                info["uses_aux"]) == (bool(structure), bool(syntax), ratio, bool(uses))
        state = env.end_turn(state)
        assert env.done(state) and env.success(state) == (ratio == 1.0)


def test_helper_main_builtin_experts_and_feedback():
    env = make("code", variant="helper_main", max_turns=2)
    state = env.reset(eval_seed(5))
    state, _ = env.step(state, "aux", env.expert_text(state, "aux"))
    state, result = env.step(state, "main", env.expert_text(state, "main"))
    assert result.team_reward == pytest.approx(1.0) and result.local_reward == 1.0
    state = env.end_turn(state)
    assert not env.done(state) and env.success(state)
    assert "2 of 2 pass" in env.observe(state, "main") and "def aux" in env.observe(state, "aux")


# ---------------------------------------------------------------------------- JSONL formats


def test_humaneval_and_apps_records(jsonl):
    env = make("code", path=jsonl)
    he = env.reset(seed_of(env, "HumanEval/900"))
    assert len(he.problem.tests) == 3 and he.problem.entry_point == "double_all"
    _, r = env.step(he, "coder", env.expert_text(he, "coder"))
    assert r.local_reward == 1.0
    _, r = act(env, he, "coder", "def double_all(xs):\n    return [2 * x for x in xs[:1]]")
    assert math.isclose(r.local_reward, 2 / 3)  # [] and [-3] pass, [1, 2] does not

    stdin_problem = env.reset(seed_of(env, "4000"))
    assert stdin_problem.problem.entry_point is None
    _, r = env.step(stdin_problem, "coder", env.expert_text(stdin_problem, "coder"))
    assert r.local_reward == 1.0
    wrong, r = act(env, stdin_problem, "coder",
                   "a, b = map(int, input().split())\nprint(a - b)")
    assert math.isclose(r.local_reward, 1 / 3)  # only "0 0" -> 0 is right
    _, r = act(env, wrong, "tester", 'assert run_program("2 2\\n") == "4\\n"')
    assert r.info["validity"] == 1.0 and r.info["agreement"] == 1.0

    call = env.reset(seed_of(env, "4001"))
    _, r = env.step(call, "coder", env.expert_text(call, "coder"))
    assert r.local_reward == 1.0
    _, r = act(env, call, "coder", "def mul(a, b):\n    return a + b")
    assert r.local_reward == 0.0

    joint = make("code", variant="helper_main", path=jsonl)
    for task in ("11", "HumanEval/900", "4000", "4001"):
        state = joint.reset(seed_of(joint, task))
        state, _ = joint.step(state, "aux", joint.expert_text(state, "aux"))
        state, r = joint.step(state, "main", joint.expert_text(state, "main"))
        assert r.info["hidden_pass_ratio"] == 1.0 and r.info["uses_aux"], task


def test_follows_env_protocol():
    for variant in ("coder_tester", "helper_main"):
        env = make("code", variant=variant)
        assert isinstance(env, Env) and env.name == "code"
        assert env.turn_order == env.agents and len(env.agents) == 2


def test_bad_options_and_files(tmp_path):
    with pytest.raises(JmarlError, match="variant"):
        make("code", variant="pair")
    with pytest.raises(JmarlError, match="not found"):
        make("code", path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no tests"}\n')
    with pytest.raises(JmarlError, match="bad.jsonl:1"):
        make("code", path=str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(JmarlError, match="not valid JSON"):
        make("code", path=str(bad))
    with pytest.raises(JmarlError, match="max_turns"):
        make("code", max_turns=0)
    with pytest.raises(JmarlError, match="joint_weights"):
        make("code", joint_weights=(1.0, 2.0))
    with pytest.raises(JmarlError, match="tester_validity_weight"):
        make("code", tester_validity_weight=1.5)


# ---------------------------------------------------------------------------- never raises


@pytest.mark.parametrize("variant", ["coder_tester", "helper_main"])
def test_step_never_raises_on_junk(variant):
    env = make("code", variant=variant)
    state = env.reset(3)
    junk = ["", "\x00\x01\xff garbage", "x" * 100_000, "```python\n", "(" * 50_000,
            "```python\n" + "-" * 30_000 + "1\n```", "def f(:\n  ???", "```\n\n```",
            "assert " * 1000, "\ud800 lone surrogate"]
    for text in junk:
        for agent in env.turn_order:
            new, result = env.step(state, agent, text)
            assert math.isfinite(result.local_reward) and math.isfinite(result.team_reward)
            assert 0.0 <= result.local_reward <= 1.0 and 0.0 <= result.team_reward <= 1.0
            assert isinstance(env.observe(new, agent), str)
    _, result = env.step(state, "nobody", "x")
    assert result.local_reward == 0.0 and "unknown agent" in result.info["error"]
    assert env.solution(3) == state.problem.reference
