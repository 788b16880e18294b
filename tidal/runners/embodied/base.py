"""What the embodied runners share (the on-policy ``EmbodiedRunner`` and the off-policy
``OffPolicyRunner``): the groups planned and the env probed before anything starts, a run from
a saved policy evaluated first, the trainer's checkpoint check, the processes groups share."""

from __future__ import annotations

from pathlib import Path

from tidal.config import EmbodiedConfig
from tidal.config.embodied import same_process
from tidal.runners.embodied.groups import EmbodiedGroups, plan_groups
from tidal.runners.embodied.pacer import Pacer
from tidal.runners.loop import RunLoop
from tidal.runners.preflight import check_trainer_checkpoint, probe_env


class EmbodiedRunLoop(RunLoop):
    def __init__(self, cfg: EmbodiedConfig, run_dir: Path | None = None):
        self.worlds, self.topo = plan_groups(cfg)
        self.spaces, self.max_episode_steps = probe_env(cfg)
        self.groups: EmbodiedGroups | None = None
        self.cluster = None
        self.env = self.rollout = self.actor = None  # the groups', once launched
        self.pacer: Pacer | None = None
        super().__init__(cfg, run_dir)

    @property
    def initial_evaluation(self) -> bool:
        """A run that starts from a saved policy evaluates it first (the same episodes as
        ``tidal sft``'s evaluation): the start RL improves on."""
        return self.cfg.model.path is not None

    def check_checkpoint(self, checkpoint: Path) -> None:
        check_trainer_checkpoint(self.cfg, checkpoint)

    def shared_processes(self) -> list[str]:
        return same_process(self.cfg)
