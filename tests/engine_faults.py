"""A generation engine whose model fails mid-generation, as a CUDA fault would."""

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
