"""Sampling parameters, defined once: the engine samples with them, the server parses and
validates requests into them, and the client sends them."""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

# Below this temperature sampling is greedy: ``logits / 1e-45`` overflows to inf and the
# log-probs to NaN, while any temperature this small is argmax in all but name.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20


@dataclass
class GenerationConfig:
    max_new_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (the engine needs a tokenizer)
    seed: int | None = None
    top_logprobs: int = 0  # also report this many most likely tokens (and log-probs) per step

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, where: str = "sampling_params") -> GenerationConfig:
        """Types and ranges of every field; the error names the field."""
        _check_int(self.max_new_tokens, f"{where}.max_new_tokens", low=1)
        _check_float(self.temperature, f"{where}.temperature", low=0.0)
        _check_float(self.top_p, f"{where}.top_p")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{where}.top_p: must be in (0, 1], got {self.top_p}")
        _check_int(self.top_k, f"{where}.top_k", low=-1)
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"{where}.stop_token_ids: must be a list of token ids")
        for i, tok in enumerate(self.stop_token_ids):
            _check_int(tok, f"{where}.stop_token_ids[{i}]", low=0)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or not all(
            isinstance(x, str) and x for x in self.stop
        ):
            raise ValueError(
                f"{where}.stop: must be a list of non-empty strings, got {self.stop!r}"
            )
        if self.seed is not None:
            _check_int(self.seed, f"{where}.seed", low=0)
        _check_int(self.top_logprobs, f"{where}.top_logprobs", low=0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(
                f"{where}.top_logprobs: at most {MAX_TOP_LOGPROBS}, got {self.top_logprobs}"
            )
        return self

    def seeded(self, offset: int) -> GenerationConfig:
        """Sample ``offset`` of a seeded ``n``-sample request is seeded ``seed + offset``."""
        return self if self.seed is None else replace(self, seed=self.seed + offset)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(
        cls, data: Any, where: str = "sampling_params", ignored: frozenset[str] = frozenset()
    ) -> GenerationConfig:
        """A validated config from a request's JSON object. Keys in ``ignored`` are dropped;
        any other unknown key is an error naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - ignored)
        if unknown:
            raise ValueError(
                f"{where}.{unknown[0]}: not a supported sampling parameter "
                f"(supported: {', '.join(sorted(known))})"
            )
        return cls(**{k: v for k, v in data.items() if k in known}).validate(where)


class EpisodeSeeds:
    """The sampling seeds of one episode's model calls, in the order it makes them, drawn from
    the run's seed and the episode's place in the data stream: a run repeats its rollouts, and
    a resumed one continues them (``with_episode_seed``; calls that carry a seed keep it)."""

    def __init__(self, run_seed: int, episode: int):
        self.key, self.calls = (run_seed, episode), 0

    def next(self) -> int:
        self.calls += 1
        state = np.random.SeedSequence([*self.key, self.calls]).generate_state(1, np.uint64)
        return int(state[0] >> 2)  # room for ``seeded``'s offsets below 2**63


EPISODE_SEEDS: ContextVar[EpisodeSeeds | None] = ContextVar("tidal_episode_seeds", default=None)


def with_episode_seed(gconfig: GenerationConfig) -> GenerationConfig:
    """``gconfig`` seeded by the running episode's next seed, when it samples unseeded inside an
    episode that has seeds (a dispatcher's, with ``sampling_seed``); else unchanged."""
    seeds = EPISODE_SEEDS.get()
    if seeds is None or gconfig.seed is not None or gconfig.greedy:
        return gconfig
    return replace(gconfig, seed=seeds.next())


def check_request(
    prompt: list[int], params: GenerationConfig, vocab_size: int, max_positions: int, tokenizer
) -> None:
    """What an engine refuses to generate, the error naming the field (a server's 400): a bad
    parameter, a prompt out of the vocabulary or the context, stop strings without a tokenizer."""
    params.validate()
    if not prompt:
        raise ValueError("input_ids: must not be empty")
    bad = [
        t
        for t in prompt
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
    ]
    if bad:
        raise ValueError(f"input_ids: ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_positions:
        raise ValueError(
            f"input_ids: the prompt has {len(prompt)} tokens, longer than the model's context "
            f"allows: the context is {max_positions} tokens, so a prompt may have at most "
            f"{max_positions - 1} (room for one new token)"
        )
    if params.stop and tokenizer is None:
        raise ValueError(
            "sampling_params.stop: stop strings need a tokenizer, and the model folder has none"
        )
    room = max_positions - len(prompt)
    if params.max_new_tokens > room:
        raise ValueError(
            f"sampling_params.max_new_tokens: {params.max_new_tokens} new tokens after a prompt of "
            f"{len(prompt)} tokens exceed the model's context of {max_positions} tokens; "
            f"at most {room} fit"
        )


def _check_int(value: Any, name: str, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")


def _check_float(value: Any, name: str, low: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: must be >= {low:g}, got {value}")
