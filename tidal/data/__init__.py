"""Records that cross channels. Batch-first: dim 0 indexes envs (or samples), so the
runtime's split/merge and rank mapper route them unchanged. Embodied: ``EnvOutput``,
``ChunkActions``, ``PolicyRecord``, ``Trajectory``; language: ``TokenSequence`` and ``LLMBatch``."""

from tidal.data.records import (
    ChunkActions,
    EnvOutput,
    LLMBatch,
    PolicyRecord,
    TokenSequence,
    Trajectory,
)

__all__ = [
    "ChunkActions",
    "EnvOutput",
    "LLMBatch",
    "PolicyRecord",
    "TokenSequence",
    "Trajectory",
]
