"""LLM generation: an embedded engine with continuous batching, an HTTP server speaking
SGLang's subset, and a client with resumable ``agenerate``."""

from tidal.inference.client import (
    GenerationConfig,
    InferenceClient,
    InferenceError,
    ModelRequest,
    ModelResponse,
)
from tidal.inference.engine import EngineError, GenerationEngine, GenerationResult, SamplingParams
from tidal.inference.server import InferenceServer, build_app

__all__ = [
    "EngineError",
    "GenerationConfig",
    "GenerationEngine",
    "GenerationResult",
    "InferenceClient",
    "InferenceError",
    "InferenceServer",
    "ModelRequest",
    "ModelResponse",
    "SamplingParams",
    "build_app",
]
