"""Generation engines whose model misbehaves: fails mid-generation (a CUDA fault), or is slow."""

import time

from tidal.inference import GenerationEngine

FAULT = "CUDA error: an illegal memory access was encountered"


def engine_that_dies_on_pass(model_dir, dying_pass: int = 3) -> GenerationEngine:
    """An engine whose forward raises ``RuntimeError(FAULT)`` from its ``dying_pass``-th pass on
    (the first is the prefill), killing its thread."""
    engine = GenerationEngine(model_dir)
    forward, passes = engine.model.forward, []

    def forward_or_fault(*args, **kwargs):
        passes.append(1)
        if len(passes) >= dying_pass:
            raise RuntimeError(FAULT)
        return forward(*args, **kwargs)

    engine.model.forward = forward_or_fault
    return engine


def engine_with_slow_passes(model_dir, seconds: float) -> GenerationEngine:
    """An engine whose every forward pass takes ``seconds`` longer (a bigger model's pace), so
    that a long generation is still running when a test acts on it."""
    engine = GenerationEngine(model_dir)
    forward = engine.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    engine.model.forward = slow_forward
    return engine
