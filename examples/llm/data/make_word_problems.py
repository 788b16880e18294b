"""Generate GSM8K-style arithmetic word problems: ``question`` and an ``answer`` that works the
problem step by step and ends with ``#### N`` (GSM8K's format, without its ``<<a*b=c>>``
calculator annotations). Templated multi-step problems with random names and numbers; the
held-out split has no question of the training split.

    python examples/llm/data/make_word_problems.py [--out DIR] [--train-size 200] [--eval-size 64]
        [--max-operand N] [--two-step] [--terse] [--dev-size N]

writes ``train.jsonl``, ``eval.parquet`` and ``sft.jsonl`` (chat conversations in ``messages``);
with ``--dev-size N`` also ``dev.parquet`` (the first N held-out problems, to choose settings
such as the SFT length) and ``test.parquet`` (the rest, the number to report).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Ella",
    "Finn",
    "Grace",
    "Hugo",
    "Iris",
    "Jack",
    "Lena",
    "Omar",
]
ITEMS = ["apples", "stickers", "marbles", "stamps", "cards", "shells"]
SYSTEM = "Solve the math word problem step by step. End with a line '#### ' and the answer."

Problem = tuple[str, str, int]  # question, worked answer (without the final line), result


class CappedRandom(random.Random):
    """A generator whose ``randint`` draws no number above ``cap``: the templates' own ranges,
    shrunk, so a small model can learn the arithmetic (``--max-operand``)."""

    def __init__(self, seed: int, cap: int | None = None):
        super().__init__(seed)
        self.cap = cap

    def randint(self, a: int, b: int) -> int:
        if self.cap is None:
            return super().randint(a, b)
        return super().randint(min(a, self.cap), min(b, self.cap))


def buy_packs(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(2, 30), r.randint(2, 6), r.randint(2, 9)
    x = b * c
    return (
        f"{name} has {a} {item}. {name} buys {b} packs of {c} {item} each. "
        f"How many {item} does {name} have now?",
        f"The packs hold {b} * {c} = {x} {item}.\n{name} has {a} + {x} = {a + x} {item} now.",
        a + x,
    )


def hourly_pay(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    a, b, c = r.randint(5, 20), r.randint(2, 8), r.randint(2, 8)
    return (
        f"{name} earns ${a} per hour and works {b} hours on Monday and {c} hours on Tuesday. "
        f"How many dollars does {name} earn in total?",
        f"{name} works {b} + {c} = {b + c} hours.\n"
        f"{name} earns {a} * {b + c} = {a * (b + c)} dollars.",
        a * (b + c),
    )


def cookies_left(r: random.Random) -> Problem:
    a, b = r.randint(2, 9), r.randint(6, 12)
    c = r.randint(1, a * b - 1)
    return (
        f"A baker makes {a} trays of {b} cookies and sells {c} cookies. How many cookies are left?",
        f"The baker makes {a} * {b} = {a * b} cookies.\n"
        f"{a * b} - {c} = {a * b - c} cookies are left.",
        a * b - c,
    )


def pages_read(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    a, b, c = r.randint(5, 25), r.randint(2, 7), r.randint(1, 30)
    return (
        f"{name} reads {a} pages a day for {b} days, then {c} more pages. "
        f"How many pages does {name} read in all?",
        f"In {b} days {name} reads {a} * {b} = {a * b} pages.\n"
        f"In all {name} reads {a * b} + {c} = {a * b + c} pages.",
        a * b + c,
    )


def money_left(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    b, c = r.randint(3, 30), r.randint(3, 30)
    a = b + c + r.randint(0, 50)
    return (
        f"{name} had ${a}. {name} spent ${b} on a book and ${c} on lunch. "
        f"How many dollars does {name} have left?",
        f"{name} spent {b} + {c} = {b + c} dollars.\n"
        f"{name} has {a} - {b + c} = {a - b - c} dollars left.",
        a - b - c,
    )


def pencils_needed(r: random.Random) -> Problem:
    a, b = r.randint(10, 30), r.randint(2, 5)
    c = r.randint(0, a * b - 1)
    return (
        f"There are {a} students in a class. Each student needs {b} pencils, and the teacher "
        f"already has {c} pencils. How many more pencils does the teacher need?",
        f"The students need {a} * {b} = {a * b} pencils.\n"
        f"The teacher needs {a * b} - {c} = {a * b - c} more pencils.",
        a * b - c,
    )


def bags_kept(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    b, k = r.randint(3, 9), r.randint(2, 12)
    c = r.randint(1, b - 1)
    return (
        f"{name} splits {b * k} {item} equally into {b} bags, then gives away {c} bags. "
        f"How many {item} are in the bags {name} kept?",
        f"Each bag holds {b * k} / {b} = {k} {item}.\n{name} keeps {b} - {c} = {b - c} bags.\n"
        f"They hold {b - c} * {k} = {(b - c) * k} {item}.",
        (b - c) * k,
    )


def farm_legs(r: random.Random) -> Problem:
    a, b = r.randint(2, 40), r.randint(2, 20)
    return (
        f"A farm has {a} chickens and {b} cows. How many legs do the animals have in total?",
        f"The chickens have {a} * 2 = {2 * a} legs.\nThe cows have {b} * 4 = {4 * b} legs.\n"
        f"Together they have {2 * a} + {4 * b} = {2 * a + 4 * b} legs.",
        2 * a + 4 * b,
    )


# two-step templates with thousands of distinct questions even under --max-operand 9
TWO_STEP = ["buy_packs", "hourly_pay", "pages_read", "money_left"]
EQUATION = re.compile(r"\d+ [-+*/] \d+ = \d+")

TEMPLATES: list[Callable[[random.Random], Problem]] = [
    buy_packs,
    hourly_pay,
    cookies_left,
    pages_read,
    money_left,
    pencils_needed,
    bags_kept,
    farm_legs,
]


def unique_problems(
    n: int,
    seed: int,
    max_operand: int | None = None,
    two_step: bool = False,
    terse: bool = False,
) -> list[dict]:
    """``n`` records with distinct questions, templates taken in turn; with ``max_operand`` no
    drawn number exceeds it (easier problems), with ``two_step`` only the two-step templates, and
    with ``terse`` the worked answer is its equations alone, one per line (``3 * 4 = 12``)."""
    templates = [t for t in TEMPLATES if not two_step or t.__name__ in TWO_STEP]
    rng, seen, out, misses = CappedRandom(seed, max_operand), set(), [], 0
    while len(out) < n:
        question, work, result = templates[len(out) % len(templates)](rng)
        if terse:
            work = "\n".join(EQUATION.findall(work))
        if question not in seen:
            seen.add(question)
            out.append({"question": question, "answer": f"{work}\n#### {result}"})
            misses = 0
        elif (misses := misses + 1) > 10_000:  # a template has fewer distinct questions than asked
            raise ValueError(f"fewer than {n} distinct problems with max_operand={max_operand}")
    return out


def conversations(problems: list[dict], rng: random.Random) -> list[dict]:
    """One- and two-problem chats: a system prompt, then user question / assistant answer turns."""
    out = []
    for i in range(0, len(problems) - 1, 2):
        turns = problems[i : i + 1 + (i // 2) % 2]  # every other chat has a second problem
        messages = [{"role": "system", "content": SYSTEM}]
        for p in turns:
            messages += [
                {"role": "user", "content": p["question"]},
                {"role": "assistant", "content": p["answer"]},
            ]
        out.append({"messages": messages})
    rng.shuffle(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--train-size", type=int, default=200)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--sft-size", type=int, default=48, help="problems in the SFT chats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-operand",
        type=int,
        default=None,
        help="difficulty: no number drawn above this (e.g. 9); default: the templates' ranges",
    )
    parser.add_argument(
        "--two-step",
        action="store_true",
        help="only four two-step templates (a + b * c, a * (b + c), a * b + c, a - (b + c))",
    )
    parser.add_argument(
        "--terse", action="store_true", help="worked answers of equations alone: 3 * 4 = 12"
    )
    parser.add_argument(
        "--dev-size",
        type=int,
        default=None,
        help="also split the held-out problems: the first N into dev.parquet, the rest into "
        "test.parquet",
    )
    args = parser.parse_args()
    if args.dev_size is not None and not 0 < args.dev_size < args.eval_size:
        parser.error(f"--dev-size: must be between 1 and --eval-size - 1, got {args.dev_size}")

    import pyarrow as pa
    import pyarrow.parquet as pq

    problems = unique_problems(
        args.train_size + args.eval_size, args.seed, args.max_operand, args.two_step, args.terse
    )
    train, held_out = problems[: args.train_size], problems[args.train_size :]
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    for name, rows in held_out_splits(held_out, args.dev_size).items():
        pq.write_table(pa.Table.from_pylist(rows), args.out / name)
    chats = conversations(train[: args.sft_size], random.Random(args.seed))
    write_jsonl(args.out / "sft.jsonl", chats)
    print(
        f"wrote {len(train)} train, {len(held_out)} eval problems and {len(chats)} chats "
        f"to {args.out}"
    )


def held_out_splits(held_out: list[dict], dev_size: int | None = None) -> dict[str, list[dict]]:
    """The held-out files: ``eval.parquet`` with every problem and, with ``dev_size``, its first
    ``dev_size`` problems as ``dev.parquet`` and the rest as ``test.parquet``."""
    splits = {"eval.parquet": held_out}
    if dev_size is not None:
        splits.update({"dev.parquet": held_out[:dev_size], "test.parquet": held_out[dev_size:]})
    return splits


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
