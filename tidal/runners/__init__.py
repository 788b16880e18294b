"""Training loops."""

from tidal.runners.embodied import EmbodiedRunner

__all__ = ["EmbodiedRunner"]
