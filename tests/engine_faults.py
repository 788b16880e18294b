"""Generation engines whose model misbehaves: fails mid-generation (a CUDA fault), or is slow."""

import time

from tidal.inference import GenerationEngine

FAULT = "CUDA error: an illegal memory access was encountered"


def engine_that_dies_on_pass(model_dir, dying_pass: int = 3) -> GenerationEngine:
    """An engine whose forward raises ``RuntimeError(FAULT)`` from its ``dying_pass``-th pass on
    (the first is the prefill), killing its thread."""

    def fault_from(count: int) -> None:
        if count >= dying_pass:
            raise RuntimeError(FAULT)

    return _engine_with(model_dir, fault_from)


def engine_with_slow_passes(model_dir, seconds: float) -> GenerationEngine:
    """An engine whose every forward pass takes ``seconds`` longer (a bigger model's pace), so
    that a long generation is still running when a test acts on it."""
    return _engine_with(model_dir, lambda count: time.sleep(seconds))


def _engine_with(model_dir, before_pass) -> GenerationEngine:
    """An engine whose model calls ``before_pass(n)`` before its ``n``-th forward pass."""
    engine = GenerationEngine(model_dir)
    forward, passes = engine.model.forward, [0]

    def patched(*args, **kwargs):
        passes[0] += 1
        before_pass(passes[0])
        return forward(*args, **kwargs)

    engine.model.forward = patched
    return engine
