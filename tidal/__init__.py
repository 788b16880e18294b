"""tidal: reinforcement-learning post-training for agents that act."""

__version__ = "0.1.0"
