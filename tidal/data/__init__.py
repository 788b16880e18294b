"""Records that cross channels. Batch-first: dim 0 indexes envs (or samples), so the
runtime's split/merge and rank mapper route them unchanged."""

from tidal.data.records import ChunkActions, EnvOutput, Trajectory

__all__ = ["ChunkActions", "EnvOutput", "Trajectory"]
