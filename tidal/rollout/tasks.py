"""Verifiable tasks generated in code: multi-digit arithmetic and a number-guessing game."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

ARITH_ALPHABET = "0123456789+=-*<>?abcdefghijklmnopqrstuvwxyz "


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


def exact_match_reward(completion: str, answer: str, **_) -> float:
    """1 when the completion (up to the first space or end) is exactly the answer."""
    return 1.0 if completion.strip().split(" ")[0] == answer else 0.0


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
