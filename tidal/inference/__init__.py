"""LLM generation: an embedded engine with continuous batching, an HTTP server speaking
SGLang's subset and OpenAI's API, and a client with resumable ``agenerate``."""

from tidal.inference.client import (
    InferenceClient,
    InferenceError,
    ModelRequest,
    ModelResponse,
    SGLangProtocol,
)
from tidal.inference.engine import EngineError, GenerationEngine, GenerationResult, WeightsRejected
from tidal.inference.params import GREEDY_TEMPERATURE, GenerationConfig
from tidal.inference.server import InferenceServer, build_app

__all__ = [
    "EngineError",
    "GREEDY_TEMPERATURE",
    "GenerationConfig",
    "GenerationEngine",
    "GenerationResult",
    "InferenceClient",
    "InferenceError",
    "InferenceServer",
    "ModelRequest",
    "ModelResponse",
    "SGLangProtocol",
    "WeightsRejected",
    "build_app",
]
