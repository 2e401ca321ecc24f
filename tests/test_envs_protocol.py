"""Protocol tests shared by every task env: determinism, expert episodes, held-out splits,
immutability of states, and fuzzing `step` with hostile text."""

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jmarl.envs import EVAL_SEED_START, Env, eval_seed, make
from jmarl.envs.common import content_hash, is_eval_item

# (name, options) of every env configuration under test: CPU sizes plus one paper size each.
CONFIGS = [
    ("plan_path", {}),
    ("plan_path", {"size": 10}),
    ("sokoban", {"size": 5}),
    ("sokoban", {"size": 6, "boxes": 2}),
    ("sudoku", {}),
    ("sudoku", {"size": 9}),
    ("math", {}),
    ("math", {"difficulty": 3}),
    ("math", {"agents": ("solver",)}),
    ("writing", {}),
    ("router", {}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for n, o in CONFIGS]
# How many seeds each env's split test draws (9x9 Sudoku generation is the slowest).
SPLIT_SEEDS = {"sudoku-size=9": 40, "plan_path-size=10": 400}


def item_key(env, state) -> str:
    """The canonical text the env hashes to split items."""
    if env.name in ("plan_path", "sokoban", "sudoku"):
        return env._key(state.puzzle)
    if env.name == "math":
        return state.problem.question
    if env.name == "writing":
        return state.source
    return state.query.question


def run_episode(env, state, writer):
    """The episode loop of `Env.end_turn`'s docstring; writer(view, agent) -> text.
    Returns the final state and every StepResult."""
    results = []
    while not env.done(state):
        start = state
        for agent in env.turn_order:
            view = start if env.parallel else state
            assert isinstance(env.observe(view, agent), str)
            state, result = env.step(state, agent, writer(view, agent))
            results.append(result)
        state = env.end_turn(state)
    return state, results


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_reset_is_deterministic(name, options):
    env = make(name, **options)
    for seed in (0, 1, 12345, eval_seed(3)):
        a, b = env.reset(seed), env.reset(seed)
        assert a == b and hash(a) == hash(b)
    assert env.reset(0) != env.reset(1)


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_env_implements_the_protocol(name, options):
    env = make(name, **options)
    assert isinstance(env, Env) and env.name == name
    assert set(env.turn_order) <= set(env.agents) and env.max_turns >= 1
    assert isinstance(env.parallel, bool)


@pytest.mark.parametrize("name,reward_options", [
    ("plan_path", {"shaping": 0.5, "max_turns": 7}),
    ("sokoban", {"solved_reward": 3.0, "max_turns": 1}),
    ("sudoku", {"givens": 8, "conflict_penalty": 1.0}),  # givens=8 is the 4x4 default
])
def test_reward_options_do_not_change_the_items(name, reward_options):
    base, other = make(name), make(name, **reward_options)
    assert all(base.reset(s).puzzle == other.reset(s).puzzle for s in (0, 1, eval_seed(0)))


def test_reset_is_deterministic_across_processes():
    """Generated items do not depend on the process (PYTHONHASHSEED, import order)."""
    script = ("import json; from jmarl.envs import make; print(json.dumps({f'{n}{o}': "
              "[repr(make(n, **o).reset(s)) for s in (0, 7, 1000000005)] for n, o in %r}))"
              % ([(n, o) for n, o in CONFIGS if not (n == "sudoku" and o)],))
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    theirs = json.loads(out.stdout)
    for n, o in CONFIGS:
        if n == "sudoku" and o:
            continue
        assert theirs[f"{n}{o}"] == [repr(make(n, **o).reset(s)) for s in (0, 7, 1000000005)]


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_expert_solves(name, options):
    env = make(name, **options)
    seeds = list(range(8)) + [eval_seed(i) for i in range(4)]
    for seed in seeds:
        state, results = run_episode(env, env.reset(seed), env.expert_text)
        assert env.success(state), (seed, state)
        assert all(math.isfinite(r.local_reward) and math.isfinite(r.team_reward)
                   for r in results)


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_held_out_items_never_in_training(name, options):
    env = make(name, **options)
    n = SPLIT_SEEDS.get(IDS[CONFIGS.index((name, options))], 2000)
    train = {item_key(env, env.reset(s)) for s in range(n)}
    held = {item_key(env, env.reset(eval_seed(s))) for s in range(max(20, n // 10))}
    assert not any(is_eval_item(k) for k in train)
    assert all(is_eval_item(k) for k in held)
    assert not train & held
    assert len(held) > 1  # the held-out split really varies


def test_content_hash_is_blake2b():
    import hashlib
    digest = hashlib.blake2b(b"abc", digest_size=8).digest()
    assert content_hash("abc") == int.from_bytes(digest, "big")
    assert is_eval_item("abc") == (int.from_bytes(digest, "big") % 10 == 0)


# ---- immutability --------------------------------------------------------------------------------

def _states_along_expert_episode(env, seed):
    """Every running state an expert episode passes through (with the agent about to act)."""
    state, out = env.reset(seed), []
    while not env.done(state):
        start = state
        for agent in env.turn_order:
            view = start if env.parallel else state
            out.append((state, agent))
            state, _ = env.step(state, agent, env.expert_text(view, agent))
        state = env.end_turn(state)
    return out


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_step_never_mutates_its_state(name, options):
    env = make(name, **options)
    texts = ["", "garbage \x00\xff", "Actions: U U R", "1 2 3 4\n3 4 1 2", "\\boxed{7}",
             "ROUTE: tool", "CALL calc(1+1)", "FINAL: 3"]
    for state, agent in _states_along_expert_episode(env, 3):
        before, digest = copy.deepcopy(state), hash(state)
        for text in texts + [env.expert_text(state, agent)]:
            env.step(state, agent, text)
            env.observe(state, agent)
        assert state == before and hash(state) == digest
        after_end = env.end_turn(state)
        assert state == before and after_end is not state


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_memory_context_reaches_the_prompt(name, options):
    env = make(name, **options)
    state = env.reset(0)
    agent = env.turn_order[0]
    with_memory = dataclasses.replace(state, memory_context={agent: ["tip one", "tip two"]})
    prompt = env.observe(with_memory, agent)
    plain = env.observe(state, agent)
    assert "- tip one\n- tip two" in prompt and "tip one" not in plain
    # the memory comes first: a prompt cut from the front (sampling.max_prompt_len) loses it, not the task
    assert prompt.startswith("Relevant memory:\n") and prompt.endswith("\n" + plain)
    hash(with_memory)  # the injected dict was frozen
    other = [a for a in env.agents if a != agent]
    if other:
        assert "tip one" not in env.observe(with_memory, other[0])


# ---- fuzzing -------------------------------------------------------------------------------------

NEAR_MISS = [
    "Actions: U R R D", "actions = [\"UP\", \"RIGHT\"]", "URRDLLUUDDRR", "U, R, , D,", "Actions:",
    "↑→↓←", "up up up up up up up up", "Actions: X Y Z", "[[1,2],[3,4]]", "[[1,2,3,4]]",
    "1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1", "1 2 3\n4 5 6", "12341234123412341", "0 0 0 0\n" * 9,
    "Grid:\n" + "9 9 9 9\n" * 4, "\\boxed{", "\\boxed{\\frac{1}{0}}", "#### ", "#### 1e999999",
    "\\boxed{1/0}", "Answer: -", "answer is 3/", "99999999999999999999999999999999.5e-99999",
    "ROUTE: ", "ROUTE: chef", "ROUTE math", "FINAL:", "FINAL: \\boxed{}", "CALL calc(",
    "CALL calc(9**9**9**9)", "CALL calc(__import__('os').system('ls'))", "CALL calc(" + "(" * 300,
    "CALL convert(1, km, kg)", "CALL convert(a, b)", "CALL nope()", "ANSWER:", "```python\n",
    "```py print(1)```", "```\nprint('U R')\n```", "\x00\x01\x02", "\ud800", "\u202e\u200b",
]
TEXTS = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    st.sampled_from(NEAR_MISS),
    st.tuples(st.sampled_from(NEAR_MISS), st.text(max_size=40), st.sampled_from(NEAR_MISS)).map(
        "".join),
    st.sampled_from(["U " * 50_000, "9" * 100_000, "\\boxed{" * 20_000, "a" * 100_000,
                     "1 2 3 4\n" * 25_000, "CALL calc(" + "1+" * 50_000 + "1)"]),
)


def _fuzz_states(env):
    """(state, agent) pairs where each agent is active: the start, and mid-episode states."""
    pairs = _states_along_expert_episode(env, 5)
    if env.name == "router":  # sub-agents only act once routed to
        start = env.reset(5)
        for sub in ("math", "tool", "qa"):
            routed, _ = env.step(start, "master", f"ROUTE: {sub}")
            pairs.append((routed, sub))
    return pairs


@pytest.mark.parametrize("name,options", [c for c in CONFIGS if c[1] == {} or
                                          c[1] == {"agents": ("solver",)}],
                         ids=[i for c, i in zip(CONFIGS, IDS) if c[1] == {} or
                              c[1] == {"agents": ("solver",)}])
def test_fuzz_step_never_raises_and_rewards_are_finite(name, options):
    env = make(name, **options)
    pairs = _fuzz_states(env)

    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(text=TEXTS, index=st.integers(0, len(pairs) - 1))
    def check(text, index):
        state, agent = pairs[index]
        new_state, result = env.step(state, agent, text)
        assert math.isfinite(result.local_reward) and math.isfinite(result.team_reward)
        assert isinstance(result.done, bool)
        assert isinstance(env.observe(new_state, agent), str)
        env.end_turn(new_state)

    check()


def test_eval_seed_start_matches_base():
    assert eval_seed(0) == EVAL_SEED_START
