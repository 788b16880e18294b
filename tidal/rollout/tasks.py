"""Verifiable tasks generated in code: multi-digit arithmetic, reversing digit strings of
long-tailed lengths, a number-guessing game, and one-step word problems for a pretrained chat
model. A task registers under the name ``data.task``
takes: ``problems(n, seed, data_cfg) -> [record]``; single-turn records hold ``prompt`` and
``answer``, multi-turn ones what their environment needs."""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.registry import Registry
from tidal.rollout.rewards import (  # exact_match_reward: re-exported, runners import it from here
    exact_match_reward,  # noqa: F401
    math_verify,
)

ARITH_ALPHABET = "0123456789+=-*<>?abcdefghijklmnopqrstuvwxyz "


Segment = tuple[str, bool]  # (text, trained): a trained segment is a model turn, ended by EOS


def prompt_answer(record: dict, _rng: random.Random) -> list[Segment]:
    """The supervised demonstration of a single-turn record: its prompt, then its answer."""
    return [(record["prompt"], False), (record["answer"], True)]


@dataclass(frozen=True)
class Task:
    problems: Callable[..., list[dict]]  # (n, seed, data_cfg) -> records
    # (record, rng) -> segments laid out as the workflow lays out an episode (for tidal sft)
    demonstration: Callable[[dict, random.Random], list[Segment]] = prompt_answer
    reward: Callable[..., float] | None = None  # single-turn: reward_fn(completion=..., **record)
    env: Callable[[dict], Any] | None = None  # multi-turn: record -> env with step(completion)

    @property
    def multi_turn(self) -> bool:
        return self.env is not None


TASKS: Registry[Task] = Registry("task", "data.task")


def is_multi_turn(data) -> bool:
    """Whether a ``data`` section's episodes are multi-turn: a dataset file is single-turn; a
    registered task says which it is."""
    return data.path is None and TASKS.get(data.task).multi_turn


def register_task(name: str, demonstration=prompt_answer, reward=None, env=None):
    """Register ``problems(n, seed, data_cfg)`` under ``name``: single-turn with a ``reward``
    function, or multi-turn with an ``env`` factory."""

    def decorator(fn):
        TASKS.register(name)(Task(fn, demonstration, reward, env))
        return fn

    return decorator


def arithmetic_problems(n: int, digits: int = 2, seed: int = 0, ops: str = "+") -> list[dict]:
    """``{"prompt": "37+85=", "answer": "122"}`` records."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    out = []
    for _ in range(n):
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"prompt": f"{a}{op}{b}=", "answer": str(value)})
    return out


@register_task("arithmetic", reward=exact_match_reward)
def _arithmetic_task(n: int, seed: int, data) -> list[dict]:
    return arithmetic_problems(n, data.digits, seed, data.ops)


def reverse_problems(n: int, max_len: int = 24, seed: int = 0, tail: float = 1.2) -> list[dict]:
    """``{"prompt": "r3071=", "answer": "1703"}``: reverse a digit string whose length ``L`` in
    ``1..max_len`` is drawn with ``P(L) ~ L^-tail``, so answers have long-tailed lengths."""
    rng = random.Random(seed)
    lengths = list(range(1, max_len + 1))
    weights = [length**-tail for length in lengths]
    out = []
    for length in rng.choices(lengths, weights, k=n):
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        out.append({"prompt": f"r{digits}=", "answer": digits[::-1]})
    return out


@register_task("reverse", reward=exact_match_reward)
def _reverse_task(n: int, seed: int, data) -> list[dict]:
    return reverse_problems(n, data.max_len, seed)


@dataclass
class GuessNumberEnv:
    """Guess a number in [0, 99]: each guess is answered ``higher`` / ``lower``; reward 1 on a hit."""

    target: int

    def step(self, completion: str) -> tuple[str, float, bool]:
        match = re.match(r"\s*(\d+)", completion)
        if match is None:
            return " ?", 0.0, False
        guess = int(match.group(1))
        if guess == self.target:
            return "", 1.0, True
        return (" >" if guess < self.target else " <"), 0.0, False


def guess_number_problems(n: int, seed: int = 0, high: int = 99) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": "guess?", "target": rng.randint(0, high)} for _ in range(n)]


def consistent_guesses(
    record: dict, rng: random.Random, max_turns: int = 6, high: int = 99
) -> list[Segment]:
    """A demonstration that plays by the rules but not well: each guess is uniform among the
    numbers the feedback so far allows. RL has room to learn to halve the range instead."""
    env, lo, hi = GuessNumberEnv(record["target"]), 0, high
    segments: list[Segment] = [(record["prompt"], False)]
    for _ in range(max_turns):
        guess = rng.randint(lo, hi)
        segments.append((str(guess), True))
        feedback, _, done = env.step(str(guess))
        if done:
            break
        segments.append((feedback, False))
        lo, hi = (guess + 1, hi) if guess < record["target"] else (lo, guess - 1)
    return segments


@register_task(
    "guess_number",
    demonstration=consistent_guesses,
    env=lambda record: GuessNumberEnv(record["target"]),
)
def _guess_number_task(n: int, seed: int, data) -> list[dict]:
    return guess_number_problems(n, seed)


WORD_PROBLEM_NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Maya", "Leo", "Emma", "Max", "Zoe")
WORD_PROBLEM_ITEMS = (
    "apples",
    "books",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "cards",
    "coins",
)
# (story, answer(a, b)): one step each; a >= b where the story takes b away
WORD_PROBLEM_STORIES = (
    ("{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?", lambda a, b: a + b),
    (
        "{n} had {a} {i}. A friend gave {n} {b} more. How many {i} does {n} have?",
        lambda a, b: a + b,
    ),
    ("{n} has {a} {i} and gives {b} of them away. How many {i} are left?", lambda a, b: a - b),
    ("{n} had {a} {i} and lost {b}. How many {i} does {n} have left?", lambda a, b: a - b),
)
# the format issue 46 measured on SmolLM2-135M-Instruct (greedy 28% -> 48% after 8 GRPO steps,
# math_verify on the reply)
WORD_PROBLEM_FORMAT = "Answer with just the number."
PRODUCT_STORIES = (  # (story, answer(a, b))
    ("{n} buys {a} boxes with {b} {i} in each box. How many {i} does {n} have?", operator.mul),
)
TWO_STEP_STORIES = (  # (story, answer(a, b, c)): a sum, then a difference
    (
        "{n} has {a} {i} and buys {b} more. Then {n} gives {c} away. How many {i} does {n} have "
        "now?",
        lambda a, b, c: a + b - c,
    ),
)


def story_problems(n: int, seed: int, stories, draw) -> list[dict]:
    """Word problems told by ``stories`` (``(format, answer(*numbers))``, the numbers named
    ``a``, ``b``, ...) on numbers ``draw(rng)``, each asking for just the number."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        story, answer = rng.choice(stories)
        numbers = draw(rng)
        name, item = rng.choice(WORD_PROBLEM_NAMES), rng.choice(WORD_PROBLEM_ITEMS)
        text = story.format(n=name, i=item, **dict(zip("abc", numbers, strict=False)))
        out.append({"prompt": f"{text} {WORD_PROBLEM_FORMAT}", "answer": str(answer(*numbers))})
    return out


def word_problems(
    n: int, seed: int = 0, high: int = 60, stories=WORD_PROBLEM_STORIES
) -> list[dict]:
    """One-step word problems (``"Tom has 17 apples and buys 25 more. ..."``, answer ``"42"``):
    a sum or a difference of two numbers in ``[2, high]``, asking for just the number."""

    def draw(rng):
        return sorted((rng.randint(2, high), rng.randint(2, high)), reverse=True)

    return story_problems(n, seed, stories, draw)


@register_task("word_problems", reward=math_verify)
def _word_problems_task(n: int, seed: int, data) -> list[dict]:
    return word_problems(n, seed)


@register_task("word_products", reward=math_verify)
def _word_products_task(n: int, seed: int, data) -> list[dict]:
    """``a`` boxes of ``b`` items, ``a`` in [2, 9] and ``b`` in [10, 60]: issue 46's harder set
    (the untouched SmolLM2-135M-Instruct answers 25% greedy, 3% sampled at temperature 1)."""

    def draw(rng):
        return rng.randint(2, 9), rng.randint(10, 60)

    return story_problems(n, seed, PRODUCT_STORIES, draw)


@register_task("word_two_steps", reward=math_verify)
def _word_two_steps_task(n: int, seed: int, data) -> list[dict]:
    """``a`` plus ``b`` minus ``c``, ``a`` and ``b`` in [2, 9], ``c`` in [1, a + b - 1]: two steps
    on numbers the model can add (the untouched SmolLM2-135M-Instruct answers 17% greedy with 64
    new tokens, writing "4 + 3 = 7" and often stopping there; pass@16 at T = 0.7: 58%)."""

    def draw(rng):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return a, b, rng.randint(1, a + b - 1)

    return story_problems(n, seed, TWO_STEP_STORIES, draw)


@register_task("word_sums", reward=math_verify)
def _word_sums_task(n: int, seed: int, data) -> list[dict]:
    """The first story alone ("... buys b more"), the set issue 46 measured SmolLM2 on: its base
    model answers 14% greedy here (numbers 2-60), 8% on all four stories with differences."""
    return word_problems(n, seed, stories=WORD_PROBLEM_STORIES[:1])
