"""The base of every actor worker (the ``actor`` group): the language actor
(``workers/llm_actor.py``), the embodied on-policy actor (``workers/embodied_actor.py``) and
SAC's (``workers/sac_actor.py``) are each a ``Trainer`` that says what it trains on.

A trainer owns the model it trains and its KL reference, the train engine (``tidal.engine``)
and the objective (``algorithm.name``); the weights out to the rollout (a weight link or a bare
channel, gathered layer by layer under a sharded strategy), the policy version (training steps
applied to the weights), ``actor.offload`` / ``actor.ref_offload``, and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal.algorithms.objectives import make_objective
from tidal.engine import TrainEngine
from tidal.models.lora import (
    drain,
    lora_meta,
    reference_model,
    rollout_weight_stream,
    rollout_weights,
)
from tidal.runtime import ConfigSections, Worker
from tidal.runtime.offload import HostParkedModule
from tidal.runtime.weight_sync import WeightLinks
from tidal.strategies import build_model


class Trainer(Worker, WeightLinks):
    """Subclasses call ``setup_rank`` first, then ``build_trainer`` (or build their own model
    and engine, as SAC does, and override the weights out)."""

    # ranks a bare weights channel reaches (a weight link names its own receivers)
    weight_receivers: int = 0

    def setup_rank(self, cfg: ConfigSections) -> None:
        """This rank's threads, seed and device, before anything random is built."""
        self.cfg = cfg
        torch.set_num_threads(cfg.cluster.torch_threads)
        torch.manual_seed(cfg.runner.seed)
        self.compute_device = self.torch_device(cfg.cluster.device)
        self.ref, self.reference = None, HostParkedModule(None)  # no KL reference (yet)

    def build_trainer(self, build: Callable[..., torch.nn.Module]) -> None:
        """The model ``build(weights=True)`` makes (``weights=False``: a skeleton, to be filled
        from rank 0 under fsdp2), spread over the ranks by ``actor.strategy``; its reference,
        the engine and the objective."""
        cfg = self.cfg
        # a KL penalty keeps the policy near the one training started from: the reference is
        # made before the engine shards the model; without LoRA it is a full copy, so every
        # rank builds the whole model (else under fsdp2 the ranks but 0 build a skeleton)
        keep_ref = cfg.algorithm.kl_coef > 0
        self.model = build_model(
            cfg.actor,
            build,
            self.rank,
            self.world_size,
            self.compute_device,
            skeleton=lambda: build(weights=False),
            whole=keep_ref and cfg.model.lora.rank == 0,
        )
        self.ref = reference_model(self.model, keep=keep_ref)
        self.reference = HostParkedModule(self.ref, resident_on_host=cfg.actor.ref_offload)
        if self.world_size > 1:
            self.init_distributed()
        self.engine = TrainEngine(
            self.model, cfg.actor, cfg.runner.max_steps, distributed=self.world_size > 1
        )
        self.objective = make_objective(cfg.algorithm)

    @property
    def version(self) -> int:
        """The policy version: training steps applied to the weights."""
        return self.engine.step

    # -- weights out ---------------------------------------------------------------------

    @property
    def sends_snapshot(self) -> bool:
        """Whether a send copies the weights: an update that may wait in a channel while the
        next step changes them in place (asynchronous runs) must."""
        return False

    def send_weights(self, link) -> int:
        """Rank 0 sends the weights over the run's weight link (or a bare channel to
        ``weight_receivers`` ranks); every rank calls it, since sharded weights are gathered.
        Returns their version."""
        weights = self.weight_stream()
        if self.rank == 0:
            end = self.weight_end(link, "send", self.weight_receivers)
            end.send(weights, self.version, snapshot=self.sends_snapshot)
        else:
            drain(weights)  # this rank's part of each layer's gather
        return self.version

    def weight_tensors(self):
        """The ``(name, tensor)`` pairs a weight link sends, on rank 0 (None elsewhere)."""
        return rollout_weights(self.model, self.engine, self.rank)

    def weight_stream(self):
        """The same pairs read lazily (gathered layer by layer under fsdp2): every rank reads
        it to the end, and only rank 0's yields."""
        return rollout_weight_stream(self.model, self.engine, self.rank)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's own weights (under fsdp2: its shards; ``send_weights`` gathers)."""
        return self.model.state_dict()

    # -- collocated offload (actor.offload, actor.ref_offload) -----------------------------

    def offload_engine(self) -> int:
        """``actor.offload``: parameters, gradients, optimizer state and the reference copy
        to host memory while the rollout generates; returns the bytes freed."""
        return self.engine.offload() + self.reference.park()

    def onload_engine(self) -> int:
        return self.engine.onload() + self.reference.unpark()

    def reference_bytes(self) -> int:
        """Bytes the reference copy's weights hold in their storages now (0 while they wait
        in host memory, or when there is no copy)."""
        return self.reference.resident_bytes()

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, path: str, meta: dict, extra: dict | None = None) -> str | None:
        """The checkpoint (rank 0 writes all of it, or each rank its shards); ``extra``: other
        groups' state, saved alongside. Its path on rank 0."""
        meta = {**meta, "version": self.version, "lora": lora_meta(self.cfg.model.lora)}
        saved = self.engine.save(path, meta, extra, rank=self.rank)
        return None if saved is None else str(saved)

    def load(self, path: str) -> dict:
        return self.engine.load(path)
