"""Reward functions for single-turn language tasks, chosen by ``reward.name``: a registered name
(``exact_match``, ``math_verify``, ``regex_match``) or ``module.path:function``.

A reward is called as ``fn(completion=..., **record, **kwargs)``: the completion text, every field
of the record (``prompt``, ``answer``, ``id`` and whatever else the dataset row holds) and the
config's ``reward.kwargs`` (which win over record fields of the same name). It returns a number and
may be ``async``. :func:`resolve_reward` resolves and checks a name at config time; the returned
:class:`Reward` scores sync (``reward(completion=..., **record)``, for threads) or async
(:meth:`Reward.ascore`: off the event loop, under a timeout, failures counted and logged with the
record's id).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import inspect
import logging
import math
import multiprocessing as mp
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tidal.extras import needs_extra
from tidal.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardSpec:
    fn: Callable[..., Any]
    check_kwargs: Callable[[dict], None] | None = None  # raises ValueError naming reward.kwargs.*


REWARDS: Registry[RewardSpec] = Registry("reward", "reward.name")


def register_reward(name: str, check_kwargs: Callable[[dict], None] | None = None):
    """Register ``fn(completion, **record_and_kwargs) -> float`` (sync or async) under ``name``."""

    def decorator(fn):
        REWARDS.register(name)(RewardSpec(fn, check_kwargs))
        return fn

    return decorator


# ---------------------------------------------------------------- exact match


def exact_match_reward(completion: str, answer: str, **_) -> float:
    """1 when the completion (up to the first space or end) is exactly the answer. The generated
    tasks use it: a tiny model keeps generating after its answer."""
    return 1.0 if completion.strip().split(" ")[0] == answer else 0.0


@register_reward("exact_match")
def exact_match(
    completion: str, answer: Any, first_word: bool = False, ignore_case: bool = False, **_
) -> float:
    """1 when the stripped completion equals the stripped reference ``answer`` (only its first
    word with ``first_word``)."""
    text, reference = completion.strip(), str(answer).strip()
    if first_word:
        text = text.split(" ")[0]
    if ignore_case:
        text, reference = text.lower(), reference.lower()
    return 1.0 if text == reference else 0.0


# ---------------------------------------------------------------- regex match


@lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def _check_regex_kwargs(kwargs: dict) -> None:
    if not isinstance(kwargs.get("pattern"), str):
        raise ValueError(
            "reward.kwargs.pattern: regex_match needs a regular expression (a string), "
            f"got {kwargs.get('pattern')!r}"
        )
    try:
        _compile(kwargs["pattern"])
    except re.error as exc:
        raise ValueError(
            f"reward.kwargs.pattern: invalid regular expression {kwargs['pattern']!r}: {exc}"
        ) from None


@register_reward("regex_match", check_kwargs=_check_regex_kwargs)
def regex_match(completion: str, pattern: str, answer: Any = None, **_) -> float:
    """With a capturing group: 1 when the group of the LAST match equals the reference ``answer``
    (e.g. ``Answer: (-?\\d+)``). Without a group: 1 when the pattern occurs at all."""
    regex = _compile(pattern)
    if regex.groups == 0:
        return 1.0 if regex.search(completion) else 0.0
    matches = list(regex.finditer(completion))
    if not matches or answer is None:
        return 0.0
    return 1.0 if matches[-1].group(1).strip() == str(answer).strip() else 0.0


# ---------------------------------------------------------------- math-verify

GSM8K_MARK = "#### "


def final_answer(text: str) -> str:
    """The text after the last ``#### `` (GSM8K's answer marker), else the whole text."""
    return text.rsplit(GSM8K_MARK, 1)[1] if GSM8K_MARK in text else text


# arithmetic between two numbers in an extracted answer ("48 - 2", "3+4", "6 \\times 7"); a
# fraction ("1/2", "\\frac{1}{2}") is a value, not a step left undone
_UNDONE_ARITHMETIC = re.compile(r"\d\s*(?:[-+*×·^]|\\times|\\cdot|\\div)\s*[\d(]")


def _verify_in_this_thread(reference: str, completion: str, computed_only: bool = False) -> bool:
    """math-verify with its signal-based timeouts off, so it runs in any thread. math-verify
    evaluates the expression it extracts, so "so Ben has 48 - 2 cookies left" scores for 46;
    ``computed_only`` scores such an answer 0."""
    with needs_extra("llm", "the math reward (math-verify)"):
        from math_verify import parse, verify

    gold = parse(final_answer(reference), parsing_timeout=None)
    pred = parse(final_answer(completion), parsing_timeout=None)
    if computed_only and pred and _UNDONE_ARITHMETIC.search(str(pred[-1])):
        return False
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def _verifier_main(conn) -> None:
    """The child process: answer (reference, completion, computed_only) requests until the pipe
    closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, _verify_in_this_thread(*request)))
        except Exception as exc:  # reported to the caller, which counts the failure
            conn.send((False, f"{type(exc).__name__}: {exc}"))


class MathVerifyProcess:
    """math-verify in a child process, so a check that hangs (sympy on a pathological expression)
    is bounded by killing the process, not by signals, which only work in the main thread.
    Threads share one child; it is (re)started on first use and after a timeout."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = self._conn = None
        atexit.register(self.close)

    def check(
        self, reference: str, completion: str, timeout_s: float, computed_only: bool = False
    ) -> bool:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((reference, completion, computed_only))
            if not self._conn.poll(timeout_s):
                self.close()  # the child is stuck in sympy: kill it, the next call starts another
                raise TimeoutError(
                    f"math_verify took more than {timeout_s} s (reward.kwargs.timeout_s)"
                )
            ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"math_verify failed: {value}")
        return value

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # fork is unsafe in a process with threads
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_verifier_main, args=(child_conn,), daemon=True, name="tidal-math-verify"
        )
        self._proc.start()
        child_conn.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
            self._conn.close()
        self._proc = self._conn = None


_VERIFIER = MathVerifyProcess()


def _check_math_verify_kwargs(kwargs: dict) -> None:
    timeout = kwargs.get("timeout_s", 5.0)
    if not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(
            f"reward.kwargs.timeout_s: must be a positive number of seconds, got {timeout!r}"
        )
    if not isinstance(kwargs.get("computed_only", False), bool):
        raise ValueError(
            f"reward.kwargs.computed_only: must be true or false, got {kwargs['computed_only']!r}"
        )


@register_reward("math_verify", check_kwargs=_check_math_verify_kwargs)
def math_verify(
    completion: str,
    answer: Any,
    timeout_s: float = 5.0,
    isolate: bool = True,
    computed_only: bool = False,
    **_,
) -> float:
    """1 when the completion's final answer equals the reference mathematically (``\\boxed{}``,
    fractions, LaTeX, plain numbers; GSM8K references and completions are cut after their last
    ``#### ``). math-verify evaluates an expression it extracts: "48 - 2" scores for 46 unless
    ``computed_only``, where arithmetic left undone in the final answer scores 0 (a word problem
    that asks for just the number, where RL would otherwise learn to restate the sum).
    ``isolate`` runs the check in a child process killed after ``timeout_s``; without it the
    check runs in the calling thread, bounded only by the caller's timeout."""
    if isolate:
        return 1.0 if _VERIFIER.check(str(answer), completion, timeout_s, computed_only) else 0.0
    return 1.0 if _verify_in_this_thread(str(answer), completion, computed_only) else 0.0


# ---------------------------------------------------------------- resolution and scoring


@dataclass
class RewardCounters:
    errors: int = 0
    timeouts: int = 0


@dataclass
class Reward:
    """A resolved reward: ``fn`` with the config's ``kwargs`` bound."""

    name: str
    fn: Callable[..., Any]
    kwargs: dict = field(default_factory=dict)
    counters: RewardCounters = field(default_factory=RewardCounters)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def _call(self, completion: str, record: dict) -> Any:
        return self.fn(**{**record, **self.kwargs, "completion": completion})

    def __call__(self, completion: str, **record) -> float:
        """Score synchronously (an async reward runs on a private event loop: call it from a
        thread)."""
        value = self._call(completion, record)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return self._as_float(value)

    async def ascore(self, completion: str, record: dict, timeout_s: float) -> float | None:
        """Score without blocking the event loop (a sync reward runs in a thread, an async one is
        awaited); ``None`` when it fails or takes longer than ``timeout_s``, counted and logged."""
        try:
            if self.is_async:
                value = await asyncio.wait_for(self._call(completion, record), timeout_s)
            else:
                value = await asyncio.wait_for(
                    asyncio.to_thread(self._call, completion, record), timeout_s
                )
            return self._as_float(value)
        except TimeoutError:
            self.counters.timeouts += 1
            log.warning(
                "reward %s timed out after %s s on record %r",
                self.name,
                timeout_s,
                record.get("id"),
            )
        except Exception:  # a broken reward rejects the sample; it is counted, not fatal
            self.counters.errors += 1
            log.exception("reward %s failed on record %r", self.name, record.get("id"))
        return None

    def _as_float(self, value: Any) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise TypeError(f"reward {self.name} returned {value!r}; expected a finite number")
        return float(value)


async def _awaited(awaitable):
    return await awaitable


def _import_function(name: str) -> Callable[..., Any]:
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"reward.name: expected a registered reward ({', '.join(REWARDS.names())}) "
            f"or module.path:function, got {name!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"reward.name: cannot import module {module_name!r} for {name!r}: {exc}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.name: module {module_name!r} has no function {attr!r}")
    return fn


def _check_signature(name: str, fn: Callable[..., Any], kwargs: dict, strict: bool) -> None:
    """The function must accept ``completion`` and the configured kwargs; ``strict`` (registered
    rewards, whose ``**_`` only absorbs record fields) wants each kwarg to be a named parameter."""
    try:
        params = inspect.signature(fn).parameters
        inspect.signature(fn).bind_partial(completion="", **kwargs)
    except TypeError as exc:
        raise ValueError(
            f"reward.kwargs: reward {name!r} does not accept {sorted(kwargs)}: {exc}"
        ) from None
    except ValueError:  # no signature (a builtin): nothing to check
        return
    unknown = sorted(k for k in kwargs if k not in params)
    if strict and unknown:
        options = [
            p
            for p in params
            if p != "completion" and params[p].kind != inspect.Parameter.VAR_KEYWORD
        ]
        raise ValueError(
            f"reward.kwargs: reward {name!r} has no option {', '.join(unknown)}; "
            f"its options: {', '.join(options)}"
        )


def resolve_reward(name: str, kwargs: dict | None = None) -> Reward:
    """``reward.name`` (+ ``reward.kwargs``) → a :class:`Reward`; a ValueError naming the config
    key for an unknown name, an unimportable module, a missing function or bad kwargs."""
    kwargs = dict(kwargs or {})
    registered = ":" not in name
    if registered and name not in REWARDS.names():
        raise ValueError(
            f"reward.name: unknown reward {name!r}; registered: "
            f"{', '.join(REWARDS.names())}; or give module.path:function"
        )
    spec = REWARDS.get(name) if registered else RewardSpec(_import_function(name))
    _check_signature(name, spec.fn, kwargs, strict=registered)
    if spec.check_kwargs is not None:
        spec.check_kwargs(kwargs)
    return Reward(name, spec.fn, kwargs)
