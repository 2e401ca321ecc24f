"""Writing (MAGRPO): two writers summarise a source text, one the concise part, one the detailed.

Agents `concise` and `detailed` act in one parallel turn (each sees the state at the start of
the turn; with `max_turns` > 1 they see each other's previous parts and may revise). Sources:
a built-in corpus of template-generated paragraphs (from seeds, split by a hash of the text),
or a JSONL file (`path=`; a text field `text|source|document|article|content|prompt`, split by
hash, or `eval_path=` for a separate held-out file).

Reward components (`writing_reward`, each in [0, 1], reported separately in `info`):
  structure    mean of range_score(words(concise), concise_words) and
               range_score(words(detailed), detailed_words)
  ratio        range_score(words(detailed) / words(concise), ratio_range)
  diversity    mean over the two parts of distinct words / words (type-token ratio)
  transitions  min(1, distinct transition words in the detailed part / transitions_target)
  overlap      share of the summary's distinct content words that occur in the source
range_score(x, (lo, hi)) = 1 inside [lo, hi], x / lo below, max(0, 1 - (x - hi) / hi) above.
Team reward = sum of the components, given at the step that completes a turn (both parts
written). Local reward = range_score of the agent's own part (its length target).
`success`: the team reward of the final pair >= `success_threshold`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from dataclasses import dataclass, field
from typing import ClassVar

from jmarl.envs.base import EVAL_SEED_START, StepResult, is_eval_seed
from jmarl.envs.common import (FrozenMap, clip_text, draw_split_item, file_stamp, freeze_memory, read_jsonl,
                               split_items, with_memory)
from jmarl.errors import JmarlError

AGENTS = ("concise", "detailed")
COMPONENTS = ("structure", "ratio", "diversity", "transitions", "overlap")
TRANSITIONS = ("however", "moreover", "furthermore", "therefore", "additionally", "consequently",
               "meanwhile", "finally", "first", "second", "then", "also", "thus", "instead",
               "similarly", "nevertheless", "in addition", "for example", "as a result",
               "in contrast", "overall", "later")
_STOPWORDS = frozenset(
    "the a an and or but of to in on at for with by from as is are was were be been it its this "
    "that these those which who whom what when where how than then there their they them he she "
    "his her we our you your not no so such can could would should will also into over about "
    "after before during while more most many much some any each other very".split())
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'-]*|\d+")
_TEXT_KEYS = ("text", "source", "document", "article", "content", "prompt")


def words(text: str) -> list[str]:
    """The lower-case words (and numbers) of `text`."""
    return [w.lower() for w in _WORD_RE.findall(text)]


def range_score(x: float, bounds: tuple[float, float]) -> float:
    """1 inside [lo, hi]; x / lo below; max(0, 1 - (x - hi) / hi) above."""
    lo, hi = bounds
    if x < lo:
        return max(0.0, x / lo)
    if x > hi:
        return max(0.0, 1.0 - (x - hi) / hi)
    return 1.0


def _content(ws: list[str]) -> set[str]:
    return {w for w in ws if len(w) >= 4 and w not in _STOPWORDS}


def writing_reward(source: str, concise: str, detailed: str,
                   concise_words: tuple[int, int] = (15, 50),
                   detailed_words: tuple[int, int] = (50, 150),
                   ratio_range: tuple[float, float] = (2.0, 5.0),
                   transitions_target: int = 2) -> dict[str, float]:
    """The five reward components (see the module docstring) of a (concise, detailed) pair."""
    wc, wd = words(concise), words(detailed)
    structure = (range_score(len(wc), concise_words) + range_score(len(wd), detailed_words)) / 2
    ratio = range_score(len(wd) / len(wc), ratio_range) if wc else 0.0
    diversity = sum(len(set(w)) / len(w) for w in (wc, wd) if w) / 2
    detailed_lower = " " + " ".join(wd) + " "
    found = sum(f" {t} " in detailed_lower for t in TRANSITIONS)
    transitions = min(1.0, found / transitions_target) if transitions_target > 0 else 1.0
    summary = _content(wc + wd)
    overlap = len(summary & _content(words(source))) / len(summary) if summary else 0.0
    return {"structure": structure, "ratio": ratio, "diversity": diversity,
            "transitions": transitions, "overlap": overlap}


# ---- the built-in corpus -----------------------------------------------------------------------

_PLACES = ("Alder Bay", "Brightwater", "Cobalt Ridge", "Dunmore", "Elmstead", "Fernhollow",
           "Glenrock", "Harrow Point", "Ivydale", "Juniper Falls", "Kestrel Moor", "Larkspur")
_PEOPLE = ("Mira Okafor", "Tomas Lindqvist", "Asha Raman", "Leo Marchetti", "Yuki Tanaka",
           "Nadia Petrova", "Samuel Osei", "Clara Jensen", "Ravi Mehta", "Ines Duarte")
_SUBJECTS = ("the {p} tide mill", "the {p} glass workshop", "the {p} seed library",
             "the {p} lantern festival", "the {p} river ferry", "the {p} weather station",
             "the {p} honey cooperative", "the {p} paper factory", "the {p} stone bridge")
_ADJ = ("unusual", "steady", "fragile", "remarkable", "quiet", "ambitious", "careful", "bold")
_INTRO = ("{S} was founded in {Y} by {P} near the town of {Q}.",
          "Few local institutions are as well known as {S}, which {P} started in {Y}.",
          "In {Y}, {P} opened {S} on the edge of {Q}.")
_BODY = ("At first it employed only {N} workers, most of them from nearby farms.",
         "Its {A} design attracted visitors from across the region.",
         "A severe flood in {Y2} damaged the building and halted work for months.",
         "Volunteers later rebuilt the damaged walls using timber from {Q}.",
         "By the end of its first decade, output had grown to about {N2} units a year.",
         "Historians describe its early management as {A} but often short of money.",
         "A new road built in {Y2} made deliveries faster and cheaper.",
         "Local schools still organise trips there to teach children about the trade.",
         "Critics argued that the project used too much water from the river.",
         "A small museum now displays its original tools and account books.",
         "The founders kept detailed diaries that survive in the town archive.",
         "Competition from larger firms nearly forced it to close in {Y3}.",
         "Today it is run by a foundation that relies on donations and ticket sales.",
         "Residents celebrate its anniversary each spring with music and food stalls.")


def generate_paragraph(rng: random.Random) -> str:
    """A template-generated source paragraph: an intro and six body sentences (~100 words)."""
    year = rng.randint(1800, 1960)
    slots = {"S": rng.choice(_SUBJECTS).format(p=rng.choice(_PLACES)), "P": rng.choice(_PEOPLE),
             "Q": rng.choice(_PLACES), "Y": year, "Y2": year + rng.randint(5, 30),
             "Y3": year + rng.randint(31, 60), "N": rng.randint(3, 40),
             "N2": rng.randint(100, 5000), "A": rng.choice(_ADJ)}
    sentences = [rng.choice(_INTRO)] + rng.sample(_BODY, 6)
    text = " ".join(s.format(**slots) for s in sentences)
    return text[0].upper() + text[1:]


@functools.lru_cache(maxsize=16)
def _load_jsonl(path: str, mtime: float, size: int) -> tuple[str, ...]:
    texts = []
    for where, row in read_jsonl(path, "writing"):
        text = next((row[k] for k in _TEXT_KEYS if k in row), None)
        if not isinstance(text, str) or not text.strip():
            raise JmarlError(f"writing: {where} needs a non-empty text field (one of {_TEXT_KEYS})")
        texts.append(text.strip())
    if not texts:
        raise JmarlError(f"writing: {path} holds no texts")
    return tuple(texts)


def load_texts(path: str) -> tuple[str, ...]:
    """The source texts of a JSONL file (cached per file version)."""
    return _load_jsonl(*file_stamp(path, "writing"))


@functools.lru_cache(maxsize=16)
def _file_splits(stamp: tuple, eval_stamp: tuple | None) -> tuple[tuple[str, ...], ...]:
    """(train, held-out) texts of a file, split by text hash or by a held-out file."""
    texts = _load_jsonl(*stamp)
    if eval_stamp is None:
        train, held = split_items(list(texts), lambda t: t)
        return tuple(train), tuple(held)
    held = _load_jsonl(*eval_stamp)
    return tuple(t for t in texts if t not in set(held)), held


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


# ---- the env -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WritingState:
    """One episode (immutable): the source text, each writer's latest part, who acted this
    turn, the latest reward components, flags."""

    seed: int
    source: str
    turn: int = 0
    parts: FrozenMap = field(default_factory=FrozenMap)
    acted: tuple[str, ...] = ()
    components: FrozenMap = field(default_factory=FrozenMap)
    finished: bool = False
    memory_context: FrozenMap = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_context", freeze_memory(self.memory_context))


@dataclass(frozen=True)
class Writing:
    """Two-writer summaries (see the module docstring)."""

    name: ClassVar[str] = "writing"
    agents: ClassVar[tuple[str, ...]] = AGENTS
    turn_order: ClassVar[tuple[str, ...]] = AGENTS
    parallel: ClassVar[bool] = True
    path: str | None = None
    eval_path: str | None = None
    max_turns: int = 1
    concise_words: tuple[int, int] = (15, 50)
    detailed_words: tuple[int, int] = (50, 150)
    ratio_range: tuple[float, float] = (2.0, 5.0)
    transitions_target: int = 2
    success_threshold: float = 4.0

    def __post_init__(self) -> None:
        for name in ("concise_words", "detailed_words", "ratio_range"):
            value = tuple(getattr(self, name))
            if len(value) != 2 or not 0 < value[0] <= value[1]:
                raise JmarlError(f"writing: {name} must be (lo, hi) with 0 < lo <= hi, got "
                                 f"{value!r}")
            object.__setattr__(self, name, value)
        if self.max_turns < 1:
            raise JmarlError(f"writing: max_turns must be >= 1, got {self.max_turns}")
        if self.eval_path is not None and self.path is None:
            raise JmarlError("writing: eval_path needs path= (the training file) as well")

    def score(self, source: str, concise: str, detailed: str) -> dict[str, float]:
        """The reward components of a joint action under this env's targets."""
        return writing_reward(source, clip_text(concise), clip_text(detailed),
                              self.concise_words, self.detailed_words, self.ratio_range,
                              self.transitions_target)

    def reset(self, seed: int) -> WritingState:
        """The source text of `seed` (built-in corpus or file split)."""
        if not isinstance(seed, int) or seed < 0:
            raise JmarlError(f"writing: seed must be an int >= 0, got {seed!r}")
        if self.path is None:
            source = draw_split_item("writing", seed, generate_paragraph, lambda t: t)
        else:
            eval_stamp = file_stamp(self.eval_path, "writing") if self.eval_path else None
            train, held = _file_splits(file_stamp(self.path, "writing"), eval_stamp)
            items, index = (held, seed - EVAL_SEED_START) if is_eval_seed(seed) else (train, seed)
            if not items:
                which = "held-out" if is_eval_seed(seed) else "training"
                raise JmarlError(f"writing: {self.path} has no {which} texts after the hash "
                                 "split; use a larger file or pass eval_path=")
            source = items[index % len(items)]
        return WritingState(seed=seed, source=source)

    def observe(self, state: WritingState, agent: str) -> str:
        """The source, this writer's part and length target, the partner's previous part."""
        self._check_agent(agent)
        lo, hi = self.concise_words if agent == "concise" else self.detailed_words
        role = ("the CONCISE part: the key point only" if agent == "concise" else
                "the DETAILED part: the main events in order, linked with transition words "
                "such as 'first', 'moreover', 'finally'")
        lines = [f"Source text:\n{state.source}", "",
                 f"Two writers summarise this text. You write {role}, {lo}-{hi} words. "
                 "Reply with your part only."]
        other = AGENTS[1] if agent == AGENTS[0] else AGENTS[0]
        if other in state.parts:
            lines.append(f"The {other} writer's latest part: {state.parts[other]}")
        return with_memory(state, agent, "\n".join(lines))

    def step(self, state: WritingState, agent: str, text: str) -> tuple[WritingState, StepResult]:
        """Stores the part; the step completing a turn scores the pair (team reward)."""
        self._check_agent(agent)
        if state.finished:
            return state, StepResult(0.0, 0.0, True, {"ignored": "episode already over"})
        part = clip_text(text, 4000).strip()
        bounds = self.concise_words if agent == "concise" else self.detailed_words
        local = range_score(len(words(part)), bounds)
        parts = state.parts.set(agent, part)
        acted = state.acted + ((agent,) if agent not in state.acted else ())
        info: dict = {"words": len(words(part))}
        team, components = 0.0, state.components
        if set(acted) >= set(AGENTS):
            scores = self.score(state.source, parts["concise"], parts["detailed"])
            components = FrozenMap(scores)
            team = float(sum(scores.values()))
            info.update(scores)
        new_state = dataclasses.replace(state, parts=parts, acted=acted, components=components)
        return new_state, StepResult(float(local), team, False, info)

    def end_turn(self, state: WritingState) -> WritingState:
        """Advances the turn; the episode ends after `max_turns`."""
        turn = state.turn + 1
        return dataclasses.replace(state, turn=turn, acted=(),
                                   finished=state.finished or turn >= self.max_turns)

    def done(self, state: WritingState) -> bool:
        """Out of turns."""
        return state.finished

    def success(self, state: WritingState) -> bool:
        """The latest scored pair reaches `success_threshold`."""
        return bool(state.components) and sum(state.components.values()) >= self.success_threshold

    def solution(self, seed: int) -> tuple[str, str]:
        """An expert (concise, detailed) pair for `seed`'s source."""
        state = self.reset(seed)
        return self.expert_text(state, "concise"), self.expert_text(state, "detailed")

    def expert_text(self, state: WritingState, agent: str) -> str:
        """Extractive demonstration: leading sentences for the concise part; the following
        sentences linked by transition words for the detailed part (both within their ranges)."""
        self._check_agent(agent)
        sentences = _sentences(state.source) or [state.source]
        if agent == "concise":
            return _fit(sentences[:2], self.concise_words)
        links = ("First,", "Moreover,", "In addition,", "Later,", "Finally,", "Overall,")
        linked = [f"{links[i % len(links)]} {s[0].lower()}{s[1:]}" for i, s in
                  enumerate(sentences[1:] or sentences)]
        return _fit(linked, self.detailed_words)

    def _check_agent(self, agent: str) -> None:
        if agent not in AGENTS:
            raise JmarlError(f"writing: unknown agent {agent!r}; agents are {AGENTS}")


def _fit(sentences: list[str], bounds: tuple[int, int]) -> str:
    """Whole sentences while they fit under bounds[1] words (at least one, cut to fit)."""
    lo, hi = bounds
    out: list[str] = []
    for s in sentences:
        if len(words(" ".join(out + [s]))) > hi:
            break
        out.append(s)
    if not out:
        out = [" ".join(sentences[0].split()[:hi])]
    return " ".join(out)
