"""The env protocol: a value-level API over immutable states, so that branching is free.

An environment is a frozen dataclass holding only its options (grid size, difficulty, data
path...). A state is an immutable value (a frozen dataclass or tuple). `step` returns a new
state and never mutates the one it was given, so a tree of candidates is a set of states that
share their parent, and nothing leaks between branches.

Seeds: `reset(seed)` takes any int >= 0. Seeds below `EVAL_SEED_START` are training seeds;
seeds at or above it are held-out evaluation seeds. An env guarantees that no evaluation item
can be produced by any training seed (generated puzzles are split by a hash of the item, not
only by the seed).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

from jmarl.errors import JmarlError

EVAL_SEED_START = 1_000_000_000


def train_seed(index: int) -> int:
    """The index-th training seed."""
    if not 0 <= index < EVAL_SEED_START:
        raise JmarlError(f"training seed index {index} is outside [0, {EVAL_SEED_START})")
    return index


def eval_seed(index: int) -> int:
    """The index-th held-out evaluation seed (disjoint from every training seed)."""
    if index < 0:
        raise JmarlError(f"evaluation seed index must be >= 0, got {index}")
    return EVAL_SEED_START + index


def is_eval_seed(seed: int) -> bool:
    """True for held-out evaluation seeds."""
    return seed >= EVAL_SEED_START


@dataclass(frozen=True)
class StepResult:
    """What one agent's action earned.

    local_reward: the reward of this agent's own action; team_reward: the env's outcome term
    shared by the team; done: the episode ended; info: parsed action, reward components, etc.
    """

    local_reward: float
    team_reward: float
    done: bool
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """The protocol every task implements (see docs/environments.md).

    Attributes:
      name: registry name.
      agents: the agent names, e.g. ("tool", "planner").
      turn_order: the order agents act in within one turn.
      parallel: True if the agents of a turn all observe the state after the previous turn;
        False if each sees the actions already taken in this turn (sequential).
      max_turns: the episode ends after this many turns at the latest.

    Optional: `is_active(state, agent) -> bool`, for hierarchical envs where only some agents
    act in a turn (Router: the master and the sub-agent it routed to). Plans that visit agent
    nodes one at a time (`node_wise`) skip inactive agents; envs without it have every agent
    active.
    """

    name: str
    agents: tuple[str, ...]
    turn_order: tuple[str, ...]
    parallel: bool
    max_turns: int

    def reset(self, seed: int) -> Any:
        """The initial state for `seed` (deterministic)."""
        ...

    def observe(self, state: Any, agent: str) -> str:
        """The prompt text `agent` sees in `state` (no chat template)."""
        ...

    def step(self, state: Any, agent: str, text: str) -> tuple[Any, StepResult]:
        """Applies `agent`'s text; never raises and never mutates `state`."""
        ...

    def end_turn(self, state: Any) -> Any:
        """Closes a turn once every agent in `turn_order` has acted.

        Advances the turn counter and marks the episode done at `max_turns`. The episode loop
        is: for each turn, for each agent in `turn_order`: `observe` (the turn-start state if
        `parallel`, else the running state), `step` on the running state; then `end_turn`;
        stop once `done`.
        """
        ...

    def done(self, state: Any) -> bool:
        """Whether the episode in `state` has ended (solved, failed for good, or out of turns)."""
        ...

    def success(self, state: Any) -> bool:
        """Whether the episode in `state` solved the task."""
        ...

    def solution(self, seed: int) -> Any:
        """An expert solution for `seed` (task-specific), or None where none exists."""
        ...

    def expert_text(self, state: Any, agent: str) -> str:
        """A demonstration: text an expert `agent` would write in `state` (for warm starts)."""
        ...


# name -> "module:attribute". Modules are imported on first use, so importing jmarl.envs is cheap
# and every registered name is known up front.
_REGISTRY: dict[str, str] = {
    "plan_path": "jmarl.envs.plan_path:PlanPath",
    "sokoban": "jmarl.envs.sokoban:Sokoban",
    "sudoku": "jmarl.envs.sudoku:Sudoku",
    "math": "jmarl.envs.math:Math",
    "writing": "jmarl.envs.writing:Writing",
    "router": "jmarl.envs.router:Router",
    "code": "jmarl.envs.code:Code",
}


def registered() -> tuple[str, ...]:
    """The registered env names."""
    return tuple(sorted(_REGISTRY))


def env_class(name: str) -> type:
    """The class of env `name`: a registered name, or `package.module:Class` for your own env."""
    if name in _REGISTRY:
        module_name, attr = _REGISTRY[name].split(":")
    elif ":" in name:
        module_name, attr = name.split(":", 1)
    else:
        raise JmarlError(
            f"unknown env {name!r}; registered envs: {', '.join(registered())} "
            "(or give your own as 'package.module:Class')"
        )
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise JmarlError(f"env {name!r} cannot be imported ({e}); check the module path and class name") from None


def make(name: str, **options: Any) -> Env:
    """Builds env `name` (registered, or 'package.module:Class') with `options` (its fields)."""
    cls = env_class(name)
    try:
        return cls(**options)
    except TypeError as e:
        raise JmarlError(f"bad options for env {name!r}: {e}") from None
