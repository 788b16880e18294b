"""Records that cross channels. Batch-first: dim 0 indexes envs (or samples), so the
runtime's split/merge and rank mapper route them unchanged. Embodied: ``EnvOutput``,
``ChunkActions``, ``Trajectory``; language: ``TokenSequence`` and ``LMBatch``."""

from tidal.data.records import ChunkActions, EnvOutput, LMBatch, TokenSequence, Trajectory

__all__ = ["ChunkActions", "EnvOutput", "LMBatch", "TokenSequence", "Trajectory"]
