"""Math (AT-GRPO tool + reasoner; HACPO single-agent): numeric answers, verified exactly.

Problems: generated multi-step arithmetic and word problems with exact answers (`difficulty`
1-3), an arithmetic tier sized for small models (`tier=`: `add_small` a + b with operands 0-49,
`add_two_digit` a + b with operands 10-99, `two_ops` a +/- b +/- c with operands 1-30; its
held-out problems are enumerated, so held-out seeds 0..n-1 are n distinct problems), or a GSM8K/MATH-style JSONL file (`path=`; each line an object with a question field
`question|problem|prompt|input|query` and an answer field `answer|final_answer|solution|target|
output`; "#### 42" and \\boxed{42} answers are reduced to the final answer). Held-out items:
generated problems are split by a hash of the question (see `jmarl.envs.common`); a file is
split the same way, or `eval_path=` names a separate held-out file (training items with the
same question are then dropped).

Agents (default `("tool", "reasoner")`, acting in `turn_order` = `agents`): an agent named
`tool` may answer with a ```python program (run in the sandbox; the answer is the last number /
\\boxed{} of its stdout) or directly; the others answer in text, ideally \\boxed{...}. Once every
agent has acted in a turn, the episode ends if their answers agree (or after `max_turns`).
Reward: local = 1 if the agent's own answer is correct else 0; team = `team_bonus` to the agent
whose step completes a turn in which all agents agree on the correct answer (multi-agent only).
`examples=k` (0-8) opens every prompt with k solved training problems (for base models, which
follow a pattern more readily than an instruction).
Single-agent/single-turn mode for HACPO: `make("math", agents=("solver",))` (reward 0/1).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, Sequence

from jmarl.envs.base import EVAL_SEED_START, StepResult, is_eval_seed
from jmarl.envs.common import (FrozenMap, clip_text, draw_split_item, file_stamp, freeze_memory, is_eval_item,
                               read_jsonl, split_items, with_memory)
from jmarl.envs.parsing import (answers_match, canonical_answer, extract_answer, extract_boxed,
                                extract_python, run_program)
from jmarl.errors import JmarlError

EXAMPLE_SEED_START = 900_000_000  # training seeds of the solved examples (`examples=`), far above a run's
_QUESTION_KEYS = ("question", "problem", "prompt", "input", "query")
_ANSWER_KEYS = ("answer", "final_answer", "solution", "target", "output")


@dataclass(frozen=True)
class Problem:
    """A question, its final answer (text) and a worked solution (may be empty)."""

    question: str
    answer: str
    explanation: str = ""


@dataclass(frozen=True)
class MathState:
    """One episode (immutable): the problem, the turn, each agent's latest answer (None =
    none found), the agents that acted this turn, a history of (agent, answer) lines, flags."""

    seed: int
    problem: Problem
    turn: int = 0
    answers: FrozenMap = field(default_factory=FrozenMap)
    acted: tuple[str, ...] = ()
    history: tuple[str, ...] = ()
    agreed: bool = False
    finished: bool = False
    memory_context: FrozenMap = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_context", freeze_memory(self.memory_context))


# ---- generated problems ------------------------------------------------------------------------

def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _expression(rng: random.Random, ops: int, hi: int) -> tuple[str, Fraction, list[str]]:
    """A random integer expression with `ops` binary operations: (text, value, worked steps)."""
    if ops == 0:
        v = rng.randint(1, hi)
        return str(v), Fraction(v), []
    left_ops = rng.randint(0, ops - 1)
    lt, lv, ls = _expression(rng, left_ops, hi)
    rt, rv, rs = _expression(rng, ops - 1 - left_ops, hi)
    choices = ["+", "-", "*"] + (["/"] if rv not in (0, 1) and (lv / rv).denominator == 1 else [])
    op = rng.choice(choices)
    value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else lv}[op]
    lt = f"({lt})" if left_ops else lt
    rt = f"({rt})" if ops - 1 - left_ops else rt
    return f"{lt} {op} {rt}", value, ls + rs + [f"{_fmt(lv)} {op} {_fmt(rv)} = {_fmt(value)}"]


_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kai",
          "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")


def _word_problem(rng: random.Random, difficulty: int) -> Problem:
    """A multi-step word problem from one of five templates, numbers scaled by difficulty."""
    hi = 10 * difficulty
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b, c = rng.randint(2, hi), rng.randint(2, hi), rng.randint(1, hi)
    kind = rng.randrange(5)
    if kind == 0:
        c = min(c, a + b)
        q = (f"{name} has {a} {item}. {other} gives {name} {b} more, then {name} gives away {c}. "
             f"How many {item} does {name} have now?")
        value, steps = a + b - c, [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"]
    elif kind == 1:
        c = min(c, a * b)
        q = (f"A box holds {a} {item}. {name} buys {b} boxes and gives {c} {item} to {other}. "
             f"How many {item} does {name} keep?")
        value, steps = a * b - c, [f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"]
    elif kind == 2:
        q = (f"{name} earns {a} dollars per hour and works {b} hours a day for {c} days. How "
             f"many dollars does {name} earn in total?")
        value, steps = a * b * c, [f"{a} * {b} = {a * b}", f"{a * b} * {c} = {a * b * c}"]
    elif kind == 3:
        total = a * b
        q = (f"{name} has {total} {item} and shares them equally among {b} friends. Then "
             f"{other} gives each friend {c} more. How many {item} does each friend have?")
        value, steps = a + c, [f"{total} / {b} = {a}", f"{a} + {c} = {a + c}"]
    else:
        pay = a * b + c
        q = (f"A shop sells one pack of {item} for {a} dollars. {name} buys {b} packs and pays "
             f"with {pay} dollars. How many dollars of change does {name} get?")
        value, steps = c, [f"{a} * {b} = {a * b}", f"{pay} - {a * b} = {c}"]
    if difficulty >= 3:
        k = rng.randint(2, 4)
        q += f" What is {k} times that number?"
        steps.append(f"{value} * {k} = {value * k}")
        value *= k
    return Problem(q, str(value), "\n".join(steps))


def generate_problem(rng: random.Random, difficulty: int) -> Problem:
    """One generated problem: arithmetic (difficulty + 1 operations) or a word problem."""
    if rng.random() < 0.5:
        text, value, steps = _expression(rng, difficulty + 1, 10 * difficulty)
        return Problem(f"Compute {text}.", _fmt(value), "\n".join(steps))
    return _word_problem(rng, difficulty)


# ---- arithmetic tiers (sized for small models) -------------------------------------------------

# name -> (operand range, operator choices per slot, number of operands): every problem of a tier
# is "Compute a op b [op c]." with integer operands in the inclusive range.
ARITHMETIC_TIERS: dict[str, tuple[tuple[int, int], tuple[str, ...], int]] = {
    "add_small": ((0, 49), ("+",), 2),         # 2,500 problems, ~250 held out
    "add_two_digit": ((10, 99), ("+",), 2),    # 8,100 problems, ~810 held out
    "two_ops": ((1, 30), ("+", "-"), 3),       # 108,000 problems, ~10,800 held out
}


def _tier_problem(operands: Sequence[int], ops: Sequence[str]) -> Problem:
    text = str(operands[0])
    value = operands[0]
    for op, x in zip(ops, operands[1:]):
        text += f" {op} {x}"
        value = value + x if op == "+" else value - x
    return Problem(f"Compute {text}.", str(value))


def draw_tier_problem(rng: random.Random, tier: str) -> Problem:
    """A uniformly drawn problem of an arithmetic tier (see `ARITHMETIC_TIERS`)."""
    (lo, hi), choices, n = ARITHMETIC_TIERS[tier]
    return _tier_problem([rng.randint(lo, hi) for _ in range(n)], [rng.choice(choices) for _ in range(n - 1)])


@functools.lru_cache(maxsize=len(ARITHMETIC_TIERS))
def held_out_tier_problems(tier: str) -> tuple[Problem, ...]:
    """Every held-out problem of a tier (the hash split of `jmarl.envs.common`), in a fixed shuffled
    order: held-out seed i plays item i mod n, so the first n held-out episodes are n distinct
    problems."""
    (lo, hi), choices, n = ARITHMETIC_TIERS[tier]
    held = [p for operands in itertools.product(range(lo, hi + 1), repeat=n)
            for ops in itertools.product(choices, repeat=n - 1)
            for p in (_tier_problem(operands, ops),) if is_eval_item(p.question)]
    random.Random(f"math:{tier}:held-out").shuffle(held)
    return tuple(held)


# ---- JSONL files ---------------------------------------------------------------------------------

def final_answer_of(answer: Any) -> str:
    """The final answer in a dataset's answer field: after "####", else \\boxed{}, else all."""
    text = str(answer)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text.strip()


@functools.lru_cache(maxsize=16)
def _load_jsonl(path: str, mtime: float, size: int) -> tuple[Problem, ...]:
    problems = []
    for where, row in read_jsonl(path, "math"):
        q = next((row[k] for k in _QUESTION_KEYS if k in row), None)
        a = next((row[k] for k in _ANSWER_KEYS if k in row), None)
        if q is None or a is None:
            raise JmarlError(f"math: {where} needs a question field (one of "
                             f"{_QUESTION_KEYS}) and an answer field (one of {_ANSWER_KEYS})")
        full = str(a)
        explanation = full.rsplit("####", 1)[0].strip() if "####" in full else ""
        problems.append(Problem(str(q), final_answer_of(full), explanation))
    if not problems:
        raise JmarlError(f"math: {path} holds no problems")
    return tuple(problems)


def load_problems(path: str) -> tuple[Problem, ...]:
    """The problems of a JSONL file (cached per file version)."""
    return _load_jsonl(*file_stamp(path, "math"))


@functools.lru_cache(maxsize=16)
def _file_splits(stamp: tuple, eval_stamp: tuple | None) -> tuple[tuple[Problem, ...], ...]:
    """(train, held-out) problems of a file, split by question hash or by a held-out file."""
    problems = _load_jsonl(*stamp)
    if eval_stamp is None:
        train, held = split_items(list(problems), lambda p: p.question)
        return tuple(train), tuple(held)
    held = _load_jsonl(*eval_stamp)
    held_questions = {p.question for p in held}
    return tuple(p for p in problems if p.question not in held_questions), held


# ---- the env -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Math:
    """Math problems for `agents` (see the module docstring for options and rewards)."""

    name: ClassVar[str] = "math"
    agents: tuple[str, ...] = ("tool", "reasoner")
    difficulty: int = 1
    tier: str | None = None
    path: str | None = None
    eval_path: str | None = None
    max_turns: int = 3
    examples: int = 0
    parallel: bool = False
    team_bonus: float = 1.0
    program_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        agents = tuple(self.agents) if isinstance(self.agents, (list, tuple)) else (self.agents,)
        object.__setattr__(self, "agents", agents)
        if not agents or len(set(agents)) != len(agents) or not all(
                isinstance(a, str) and a for a in agents):
            raise JmarlError(f"math: agents must be distinct non-empty names, got {agents!r}")
        if self.difficulty not in (1, 2, 3):
            raise JmarlError(f"math: difficulty must be 1, 2 or 3, got {self.difficulty}")
        if not isinstance(self.examples, int) or not 0 <= self.examples <= 8:
            raise JmarlError(f"math: examples must be an int from 0 to 8, got {self.examples!r}")
        if self.max_turns < 1:
            raise JmarlError(f"math: max_turns must be >= 1, got {self.max_turns}")
        if self.tier is not None and self.tier not in ARITHMETIC_TIERS:
            raise JmarlError(f"math: tier must be one of {sorted(ARITHMETIC_TIERS)}, got {self.tier!r}")
        if self.tier is not None and self.path is not None:
            raise JmarlError("math: pass either tier= (generated arithmetic) or path= (a problem file), not both")
        if self.eval_path is not None and self.path is None:
            raise JmarlError("math: eval_path needs path= (the training file) as well")

    @property
    def turn_order(self) -> tuple[str, ...]:
        """Agents act in the order given."""
        return self.agents

    # ---- items -------------------------------------------------------------------------------
    def _splits(self) -> tuple[tuple[Problem, ...], ...]:
        eval_stamp = file_stamp(self.eval_path, "math") if self.eval_path else None
        return _file_splits(file_stamp(self.path, "math"), eval_stamp)

    def reset(self, seed: int) -> MathState:
        """The problem of `seed`: generated, or the (seed mod n)-th item of the file's split."""
        if not isinstance(seed, int) or seed < 0:
            raise JmarlError(f"math: seed must be an int >= 0, got {seed!r}")
        if self.tier is not None:
            if is_eval_seed(seed):
                held = held_out_tier_problems(self.tier)
                problem = held[(seed - EVAL_SEED_START) % len(held)]
            else:
                problem = draw_split_item(f"math(tier={self.tier})", seed,
                                          lambda rng: draw_tier_problem(rng, self.tier), lambda p: p.question)
        elif self.path is None:
            problem = draw_split_item(f"math(difficulty={self.difficulty})", seed,
                                      lambda rng: generate_problem(rng, self.difficulty),
                                      lambda p: p.question)
        else:
            train, held = self._splits()
            items, index = (held, seed - EVAL_SEED_START) if is_eval_seed(seed) else (train, seed)
            if not items:
                which = "held-out" if is_eval_seed(seed) else "training"
                raise JmarlError(f"math: {self.path} has no {which} items after the hash split; "
                                 "use a larger file or pass eval_path= a separate held-out file")
            problem = items[index % len(items)]
        return MathState(seed=seed, problem=problem)

    # ---- prompts -----------------------------------------------------------------------------
    def observe(self, state: MathState, agent: str) -> str:
        """(Memory,) the question, the other agents' latest answers and the answer format."""
        self._check_agent(agent)
        lines = [self.examples_block()] if self.examples else []
        lines.append(f"Problem: {state.problem.question}")
        others = [f"{a}: {state.answers[a]}" for a in self.agents
                  if a != agent and a in state.answers]
        if others:
            lines.append("Latest answers of the other agents: " + "; ".join(others))
        if len(self.agents) > 1:
            lines.append(f"Turn {state.turn + 1} of {self.max_turns}. The episode ends when all "
                         "agents give the same answer.")
        if agent == "tool":
            lines.append("You are the tool agent: write a ```python program that prints the "
                         "answer, or give the answer as \\boxed{...}.")
        else:
            lines.append("Solve it step by step and put the final answer in \\boxed{...}.")
        return with_memory(state, agent, "\n".join(lines))

    def examples_block(self) -> str:
        """`examples` solved training problems, the same in every prompt (a base model's cue for
        the answer format): each question, its worked steps if any, and its answer in \\boxed{}."""
        solved = []
        for j in range(self.examples):
            p = self.reset(EXAMPLE_SEED_START + j).problem
            steps = f"{p.explanation}\n" if p.explanation else ""
            solved.append(f"Problem: {p.question}\n{steps}The answer is \\boxed{{{p.answer}}}.")
        return "Solved examples:\n" + "\n\n".join(solved) + "\n"

    # ---- dynamics ----------------------------------------------------------------------------
    def step(self, state: MathState, agent: str, text: str) -> tuple[MathState, StepResult]:
        """Records `agent`'s answer; local 1/0 correctness, team bonus on correct agreement."""
        self._check_agent(agent)
        if state.finished:
            return state, StepResult(0.0, 0.0, True, {"ignored": "episode already over"})
        text = clip_text(text)
        source = "direct"
        code = extract_python(text) if agent == "tool" else None
        if code is not None:
            run = run_program(code, timeout_s=self.program_timeout_s)
            source = f"program {run.status}"
            answer = extract_answer(run.stdout) if run.status == "ok" else None
        else:
            answer = extract_answer(text)
        answer = clip_text(answer, 200) if answer is not None else None
        correct = answers_match(answer, state.problem.answer)
        answers = state.answers.set(agent, answer)
        acted = state.acted + ((agent,) if agent not in state.acted else ())
        agreed = turn_complete = set(acted) >= set(self.agents)
        if turn_complete:
            first = answers[self.agents[0]]
            agreed = first is not None and all(
                answers_match(answers[a], first) or canonical_answer(answers[a])
                == canonical_answer(first) for a in self.agents)
        team = self.team_bonus if agreed and correct and len(self.agents) > 1 else 0.0
        new_state = dataclasses.replace(
            state, answers=answers, acted=acted, agreed=agreed, finished=agreed,
            history=state.history + (f"turn {state.turn + 1} {agent}: {answer}",))
        info = {"answer": answer, "correct": correct, "source": source, "agreed": agreed}
        return new_state, StepResult(1.0 if correct else 0.0, team, agreed, info)

    def end_turn(self, state: MathState) -> MathState:
        """Advances the turn; the episode ends at `max_turns`."""
        turn = state.turn + 1
        return dataclasses.replace(state, turn=turn, acted=(),
                                   finished=state.finished or turn >= self.max_turns)

    def done(self, state: MathState) -> bool:
        """Agreement reached or out of turns."""
        return state.finished

    def success(self, state: MathState) -> bool:
        """The last agent in `turn_order` (the final answerer) has the correct answer."""
        return answers_match(state.answers.get(self.agents[-1]), state.problem.answer)

    def solution(self, seed: int) -> str:
        """The final answer of `seed`'s problem."""
        return self.reset(seed).problem.answer

    def expert_text(self, state: MathState, agent: str) -> str:
        """The worked solution (if any) and the answer in \\boxed{}."""
        self._check_agent(agent)
        p = state.problem
        body = f"{p.explanation}\n" if p.explanation else ""
        return f"{body}The answer is \\boxed{{{p.answer}}}."

    def _check_agent(self, agent: str) -> None:
        if agent not in self.agents:
            raise JmarlError(f"math: unknown agent {agent!r}; agents are {self.agents}")
