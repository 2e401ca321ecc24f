"""Router (JoyAgents-R1): a master agent routes a query to sub-agents and composes the answer.

jmarl's own realisation (the paper has no public code). Agents, in `turn_order`:
  master  replies "ROUTE: <math|tool|qa>" to delegate, or "FINAL: <answer>" to answer.
  math    solves arithmetic/word problems; answer in \\boxed{...} (or "ANSWER: ...").
  tool    calls one function of the built-in registry: "CALL calc(sqrt(144) + 7)" or
          "CALL convert(3.5, km, m)"; the env runs it and records the result.
  qa      answers from the facts a built-in retriever shows it (word overlap over a fact table):
          "ANSWER: <answer>".
Within a turn only the master and the sub-agent it routed to are active (`is_active`); the
others' steps are no-ops with reward 0 (a workflow may skip them). Typical episode: turn 1
master routes and the sub-agent answers; turn 2 master writes FINAL. The episode ends at FINAL
or after `max_turns`.

Reward R = accuracy + format - cost, split per step:
  local = format_reward if the text follows the agent's format (else 0)
          - call_cost if the master routes (one sub-agent call)
          - token_cost * min(words of the text, 500)
  team  = 1 if the master's FINAL answer is correct, else 0 (only on the FINAL step).
Memory: `observe` shows `state.memory_context[agent]` (entries a workflow injects with
`dataclasses.replace(state, memory_context={agent: (...)})`).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar

from jmarl.envs.base import StepResult
from jmarl.envs.common import FrozenMap, clip_text, draw_split_item, freeze_memory, with_memory
from jmarl.envs.math import generate_problem
from jmarl.envs.parsing import answers_match, extract_answer, parse_number
from jmarl.envs.writing import words
from jmarl.errors import JmarlError

AGENTS = ("master", "math", "tool", "qa")
SUB_AGENTS = AGENTS[1:]

# ---- the function registry -----------------------------------------------------------------------

# unit -> (dimension, size in the dimension's base unit)
UNITS: dict[str, tuple[str, Fraction]] = {
    "km": ("length", Fraction(1000)), "m": ("length", Fraction(1)),
    "cm": ("length", Fraction(1, 100)), "mm": ("length", Fraction(1, 1000)),
    "kg": ("mass", Fraction(1000)), "g": ("mass", Fraction(1)), "mg": ("mass", Fraction(1, 1000)),
    "h": ("time", Fraction(3600)), "min": ("time", Fraction(60)), "s": ("time", Fraction(1)),
    "l": ("volume", Fraction(1000)), "ml": ("volume", Fraction(1)),
}
_UNIT_NAMES = {"km": "kilometers", "m": "meters", "cm": "centimeters", "mm": "millimeters",
               "kg": "kilograms", "g": "grams", "mg": "milligrams", "h": "hours",
               "min": "minutes", "s": "seconds", "l": "liters", "ml": "milliliters"}


def convert(value: str, from_unit: str, to_unit: str) -> str:
    """`value` in `from_unit` expressed in `to_unit` (exact); raises ValueError if invalid."""
    number = parse_number(value)
    src, dst = UNITS.get(from_unit.strip().lower()), UNITS.get(to_unit.strip().lower())
    if number is None or src is None or dst is None or src[0] != dst[0]:
        raise ValueError(f"cannot convert {value!r} {from_unit!r} to {to_unit!r}")
    return _fmt(number * src[1] / dst[1])


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow, ast.Mod: operator.mod}


def calc(expression: str) -> str:
    """Evaluates + - * / % ** and sqrt() over numbers (no names, no other calls, exponents
    <= 100, at most 200 characters); raises ValueError otherwise."""
    if len(expression) > 200:
        raise ValueError("expression too long")

    def ev(node: ast.AST) -> float | Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 100 or abs(a) > 10**6):
                raise ValueError("exponent too large")
            if isinstance(node.op, ast.Pow) and Fraction(b).denominator != 1:
                return Fraction(float(a) ** float(b))
            return _BINOPS[type(node.op)](a, b)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "sqrt" and len(node.args) == 1 and not node.keywords):
            v = ev(node.args[0])
            root = math.isqrt(int(v)) if v >= 0 and Fraction(v).denominator == 1 else None
            if root is not None and root * root == v:
                return Fraction(root)
            return Fraction(math.sqrt(float(v)))
        raise ValueError("unsupported expression")

    try:
        return _fmt(Fraction(ev(ast.parse(expression.strip(), mode="eval"))))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - syntax errors, zero division, overflow, recursion
        raise ValueError(f"cannot evaluate: {type(e).__name__}") from None


FUNCTIONS = {"calc": calc, "convert": convert}
_CALL_RE = re.compile(r"CALL\s+([A-Za-z_]\w*)\s*\((.*)\)", re.I)


def run_call(text: str) -> tuple[str | None, str | None]:
    """Parses the last "CALL name(args)" line and runs it: (call text, result or "error: ...").
    (None, None) if there is no call."""
    match = None
    for line in text.splitlines():
        m = _CALL_RE.search(line)
        if m:
            match = m
    if match is None:
        return None, None
    name, args = match.group(1).lower(), match.group(2)
    call = f"{name}({args})"[:300]
    try:
        if name == "calc":
            return call, calc(args)
        if name == "convert":
            parts = [a.strip().strip("'\"") for a in args.split(",")]
            if len(parts) != 3:
                raise ValueError("convert takes (value, from_unit, to_unit)")
            return call, convert(*parts)
        raise ValueError(f"unknown function {name!r}; functions are {sorted(FUNCTIONS)}")
    except ValueError as e:
        return call, f"error: {e}"


def _fmt(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.6g}"


# ---- the fact table and retrieval ----------------------------------------------------------------

_CAPITALS = (("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"),
             ("Australia", "Canberra"), ("Egypt", "Cairo"), ("Italy", "Rome"),
             ("Spain", "Madrid"), ("Germany", "Berlin"), ("Norway", "Oslo"), ("Peru", "Lima"),
             ("Chile", "Santiago"), ("Portugal", "Lisbon"), ("Greece", "Athens"),
             ("Ireland", "Dublin"), ("Poland", "Warsaw"), ("Sweden", "Stockholm"),
             ("Vietnam", "Hanoi"), ("Morocco", "Rabat"), ("Argentina", "Buenos Aires"))
_SYMBOLS = (("gold", "Au"), ("iron", "Fe"), ("sodium", "Na"), ("silver", "Ag"),
            ("potassium", "K"), ("lead", "Pb"), ("copper", "Cu"), ("tin", "Sn"),
            ("mercury", "Hg"), ("helium", "He"), ("oxygen", "O"), ("carbon", "C"))
_AUTHORS = (("Pride and Prejudice", "Jane Austen"), ("Hamlet", "William Shakespeare"),
            ("War and Peace", "Leo Tolstoy"), ("Don Quixote", "Miguel de Cervantes"),
            ("The Odyssey", "Homer"), ("Moby-Dick", "Herman Melville"),
            ("Frankenstein", "Mary Shelley"), ("The Trial", "Franz Kafka"))

FACTS: tuple[tuple[str, str, str], ...] = (
    tuple((f"What is the capital of {c}?", a, f"The capital of {c} is {a}.") for c, a in _CAPITALS)
    + tuple((f"What is the chemical symbol of {e}?", s, f"The chemical symbol of {e} is {s}.")
            for e, s in _SYMBOLS)
    + tuple((f"Who wrote {b}?", a, f"{b} was written by {a}.") for b, a in _AUTHORS))


def retrieve(query: str, k: int = 3) -> tuple[str, ...]:
    """The k fact sentences sharing the most words with `query` (ties: table order)."""
    q = set(words(query))
    scored = sorted(enumerate(FACTS), key=lambda item: (-len(q & set(words(item[1][2]))), item[0]))
    return tuple(fact for _, (_, _, fact) in scored[:k])


# ---- queries -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Query:
    """A query, its answer, the sub-agent best suited to it and an expert sub-agent reply."""

    question: str
    answer: str
    route: str
    expert_reply: str


def generate_query(rng: random.Random) -> Query:
    """A math, tool (conversion or calculator) or fact query."""
    kind = rng.randrange(3)
    if kind == 0:
        p = generate_problem(rng, 1)
        return Query(p.question, p.answer, "math", f"{p.explanation}\n\\boxed{{{p.answer}}}")
    if kind == 1:
        if rng.random() < 0.6:
            src = rng.choice(sorted(UNITS))
            dst = rng.choice([u for u in sorted(UNITS) if UNITS[u][0] == UNITS[src][0]
                              and u != src])
            value = str(rng.randint(1, 99)) if rng.random() < 0.7 else f"{rng.randint(1, 99)}.5"
            q = f"How many {_UNIT_NAMES[dst]} are in {value} {_UNIT_NAMES[src]}?"
            call = f"CALL convert({value}, {src}, {dst})"
            return Query(q, convert(value, src, dst), "tool", call)
        root, add = rng.randint(2, 40), rng.randint(1, 999)
        expr = f"sqrt({root * root}) * {add}"
        q = f"What is the square root of {root * root}, multiplied by {add}?"
        return Query(q, calc(expr), "tool", f"CALL calc({expr})")
    question, answer, _ = rng.choice(FACTS)
    return Query(question, answer, "qa", f"ANSWER: {answer}")


# ---- the env -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RouterState:
    """One episode (immutable): the query, the turn, the sub-agent routed to this turn (None:
    none), the sub-agents' results so far, calls made, the master's final answer, flags."""

    seed: int
    query: Query
    turn: int = 0
    route: str | None = None
    results: tuple[str, ...] = ()
    calls: int = 0
    final: str | None = None
    finished: bool = False
    memory_context: FrozenMap = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_context", freeze_memory(self.memory_context))


_ROUTE_RE = re.compile(r"ROUTE\s*:\s*\**\s*(math|tool|qa)\b", re.I)
_FINAL_RE = re.compile(r"FINAL(?:\s+ANSWER)?\s*:\s*([^\n]*)", re.I)
_ANSWER_RE = re.compile(r"ANSWER\s*:\s*([^\n]*)", re.I)


def _last(pattern: re.Pattern, text: str) -> re.Match | None:
    match = None
    for match in pattern.finditer(text):
        pass
    return match


@dataclass(frozen=True)
class Router:
    """Master + math/tool/qa sub-agents (see the module docstring)."""

    name: ClassVar[str] = "router"
    agents: ClassVar[tuple[str, ...]] = AGENTS
    turn_order: ClassVar[tuple[str, ...]] = AGENTS
    parallel: ClassVar[bool] = False
    max_turns: int = 3
    format_reward: float = 0.1
    call_cost: float = 0.1
    token_cost: float = 0.001
    retrieve_k: int = 3

    def __post_init__(self) -> None:
        if self.max_turns < 2:
            raise JmarlError(f"router: max_turns must be >= 2 (route, then answer), got "
                             f"{self.max_turns}")

    def reset(self, seed: int) -> RouterState:
        """The query of `seed` (train/eval split by a hash of the question)."""
        if not isinstance(seed, int) or seed < 0:
            raise JmarlError(f"router: seed must be an int >= 0, got {seed!r}")
        return RouterState(seed, draw_split_item("router", seed, generate_query,
                                                 lambda q: q.question))

    def is_active(self, state: RouterState, agent: str) -> bool:
        """Whether `agent`'s step can change anything: the master, or the routed sub-agent."""
        self._check_agent(agent)
        return not state.finished and (agent == "master" or state.route == agent)

    def observe(self, state: RouterState, agent: str) -> str:
        """(Memory,) the query and the role's instructions (results for the master, retrieved
        facts for qa)."""
        self._check_agent(agent)
        lines = [f"Query: {state.query.question}"]
        if agent == "master":
            lines.append("You are the master agent. Sub-agents: math (arithmetic and word "
                         "problems), tool (functions calc and convert), qa (facts). Reply "
                         "'ROUTE: <math|tool|qa>' to ask one, or 'FINAL: <answer>' to answer.")
            if state.results:
                lines.append("Results so far:\n" + "\n".join(state.results))
            lines.append(f"Turn {state.turn + 1} of {self.max_turns}.")
        elif state.route != agent:
            lines.append("No request for you this turn. Reply with nothing.")
        elif agent == "math":
            lines.append("Solve the problem step by step; put the final answer in \\boxed{...}.")
        elif agent == "tool":
            units = ", ".join(UNITS)
            lines.append("Call one function with one line 'CALL name(args)'. Functions: "
                         "calc(expression) evaluates + - * / ** and sqrt(); convert(value, "
                         f"from_unit, to_unit) with units {units}.")
        else:
            facts = "\n".join(retrieve(state.query.question, self.retrieve_k))
            lines.append(f"Retrieved facts:\n{facts}\nReply 'ANSWER: <answer>'.")
        return with_memory(state, agent, "\n".join(lines))

    def step(self, state: RouterState, agent: str, text: str) -> tuple[RouterState, StepResult]:
        """Master: route or answer; routed sub-agent: answer/call; others: no-op."""
        self._check_agent(agent)
        if not self.is_active(state, agent):
            return state, StepResult(0.0, 0.0, state.finished, {"idle": True})
        text = clip_text(text)
        cost = self.token_cost * min(len(words(text)), 500)
        if agent == "master":
            return self._master_step(state, text, cost)
        if agent == "tool":
            call, result = run_call(text)
            ok = result is not None and not result.startswith("error")
            line = f"tool: {call} = {result}" if call else "tool: no function call"
        else:
            if agent == "math":
                answer = extract_answer(text)
            else:
                m = _last(_ANSWER_RE, text)
                answer = m.group(1).strip() if m else None
            ok = bool(answer)
            line = f"{agent}: {clip_text(answer, 200) if ok else 'no answer'}"
        local = (self.format_reward if ok else 0.0) - cost
        new_state = dataclasses.replace(state, route=None, results=state.results + (line,))
        return new_state, StepResult(local, 0.0, False, {"result": line, "format_ok": ok,
                                                         "cost": cost})

    def _master_step(self, state: RouterState, text: str,
                     cost: float) -> tuple[RouterState, StepResult]:
        final, route = _last(_FINAL_RE, text), _last(_ROUTE_RE, text)
        if final is not None and (route is None or final.start() > route.start()):
            answer = final.group(1).strip().rstrip(".").strip()[:200]
            correct = answers_match(answer, state.query.answer)
            new_state = dataclasses.replace(state, final=answer, finished=True)
            info = {"final": answer, "correct": correct, "format_ok": True, "cost": cost}
            return new_state, StepResult(self.format_reward - cost, 1.0 if correct else 0.0,
                                         True, info)
        if route is not None:
            target = route.group(1).lower()
            new_state = dataclasses.replace(state, route=target, calls=state.calls + 1)
            info = {"route": target, "format_ok": True, "cost": cost + self.call_cost}
            return new_state, StepResult(self.format_reward - self.call_cost - cost, 0.0, False,
                                         info)
        return state, StepResult(-cost, 0.0, False, {"format_ok": False, "cost": cost})

    def end_turn(self, state: RouterState) -> RouterState:
        """Advances the turn, clears an unanswered route; ends the episode at `max_turns`."""
        turn = state.turn + 1
        return dataclasses.replace(state, turn=turn, route=None,
                                   finished=state.finished or turn >= self.max_turns)

    def done(self, state: RouterState) -> bool:
        """FINAL given, or out of turns."""
        return state.finished

    def success(self, state: RouterState) -> bool:
        """The master's final answer is correct."""
        return answers_match(state.final, state.query.answer)

    def solution(self, seed: int) -> tuple[str, str]:
        """(the best sub-agent for `seed`'s query, its answer)."""
        query = self.reset(seed).query
        return query.route, query.answer

    def expert_text(self, state: RouterState, agent: str) -> str:
        """Master: route to the best sub-agent, then FINAL; sub-agents: the right reply."""
        self._check_agent(agent)
        if agent == "master":
            if state.results:
                return f"FINAL: {state.query.answer}"
            return f"ROUTE: {state.query.route}"
        return state.query.expert_reply if state.route == agent else ""

    def _check_agent(self, agent: str) -> None:
        if agent not in AGENTS:
            raise JmarlError(f"router: unknown agent {agent!r}; agents are {AGENTS}")
