"""The rollout servers of a run, by ``rollout.engine`` (the generation engine that serves the
rollouts): what launches and supervises them, and how the trainer's weights reach them. The
runner only asks them to launch, update weights, check and close; each kind registers its name
here. (One word per concept: the *train engine* is ``tidal.engine``, a *generation engine* is
what a server runs, ``tidal.inference.GenerationEngine`` or vLLM's; these are *servers*.)

- ``tidal``: tidal's own inference server per rollout rank; weights go over a channel.
- ``vllm``: a vLLM OpenAI-compatible server per rollout rank (from vLLM's own virtualenv), or
  running ones at ``rollout.server_urls``; weights go through a safetensors folder in the run
  folder that the servers reload.
"""

from __future__ import annotations

import os
from pathlib import Path

from tidal.config.llm import LLMConfig
from tidal.config.loader import require
from tidal.registry import Registry
from tidal.runtime import wait_all
from tidal.runtime.weight_sync import WEIGHT_TRANSPORTS, open_weight_link

ROLLOUT_SERVERS: Registry[type[RolloutServers]] = Registry("rollout engine", "rollout.engine")


class RolloutServers:
    """The servers of one run: ``launch`` returns their addresses, ``update_weights`` puts the
    actor's weights on all of them (pause → new weights → resume) and returns the version."""

    # the weight transports (rollout.weight_sync) these servers take; the first is their default
    weight_syncs: tuple[str, ...] = ("channel",)
    # whether its servers take a seed per request (then each rollout's are drawn from
    # runner.seed: a run repeats its rollouts)
    seeds_requests: bool = True

    def __init__(self, cfg: LLMConfig, cluster, placement, run_dir: Path):
        self.cfg, self.cluster, self.placement, self.run_dir = cfg, cluster, placement, run_dir
        self.timeout = cfg.runner.timeout_s
        self.servers = None  # the worker group of launched servers, if any

    @classmethod
    def validate(cls, cfg: LLMConfig) -> None:
        """These servers' own config rules, checked before the run folder exists."""

    def protocol(self):
        from tidal.inference import SGLangProtocol

        return SGLangProtocol()

    def server_devices(self):
        r = self.cfg.rollout
        devices = self.placement.devices("rollout")
        return devices[: r.num_servers] if r.num_servers <= len(devices) else r.num_servers

    def launch(self) -> list[str]:
        raise NotImplementedError

    def update_weights(self, actor, timer) -> int:
        """New weights on every server, with generation paused per ``rollout.pause_mode``
        (timed as ``update_weights/<phase>``); returns the version."""
        raise NotImplementedError

    def release_memory(self) -> None:
        """Collocated runs (``actor.offload``): give the device's memory back while the actor
        trains (tidal: drop the KV cache and the allocator's cached blocks)."""

    def check_alive(self) -> None:
        """Raise, naming the group, rank and method, when a launched server is gone."""
        if self.servers is not None:
            self.servers.address().wait(min(self.timeout, 60))

    def cleanup_steps(self, graceful: bool) -> list:
        if self.servers is None:
            return []
        steps = []
        if graceful:
            steps.append(("inference servers", lambda: self.servers.shutdown_server().wait(60)))
        return steps + [("rollout group", self.servers.shutdown)]


@ROLLOUT_SERVERS.register("tidal")
class TidalServers(RolloutServers):
    PAUSE_MODES = {"abort": "abort", "keep": "in_place", "in_place": "in_place"}
    weight_syncs = ("collective", "channel", "disk")

    @classmethod
    def validate(cls, cfg: LLMConfig) -> None:
        require(
            not cfg.rollout.server_urls,
            "rollout.server_urls",
            "connecting to running servers is supported with rollout.engine=vllm; "
            "tidal's engine is launched by the run",
        )

    def launch(self) -> list[str]:
        from tidal.workers.inference_worker import InferenceServerWorker

        cfg = self.cfg
        self.servers = InferenceServerWorker.create_group(
            cfg.model.path,
            max_batch_size=cfg.rollout.max_batch_size,
            torch_threads=cfg.cluster.torch_threads,
            dtype=cfg.rollout_dtype,
            attn_implementation=cfg.model.attn_implementation,
            device=cfg.cluster.device,
            tool_parser=cfg.rollout.tool_parser,
        ).launch(self.cluster, self.server_devices(), name="rollout")
        self.weights_link = None  # opened with the trainer, at the first update
        return self.servers.address().wait(self.timeout)

    def open_link(self, actor):
        """The run's weight link (``rollout.weight_sync``) from actor rank 0 to every server; a
        channel link is bound to the servers: weights go straight into each one's process."""
        cfg = self.cfg
        return open_weight_link(
            cfg.rollout.weight_sync,
            self.cluster,
            actor.execute_on(0),
            self.servers,
            f"{cfg.runner.experiment}-weights",
            self.timeout,
            bucket_mb=cfg.rollout.weight_sync_bucket_mb,
            dtype=None if cfg.rollout_dtype == "auto" else cfg.rollout_dtype,
            device=cfg.cluster.device,
            folder=str(self.run_dir / "rollout_weights"),
        )

    def update_weights(self, actor, timer) -> int:
        """One call per server: it pauses, receives, validates, loads and continues."""
        if self.weights_link is None:
            with timer("update_weights/connect"):
                self.weights_link = self.open_link(actor)
        mode = self.PAUSE_MODES[self.cfg.rollout.pause_mode]
        sent, _ = wait_all(
            [
                actor.send_weights(self.weights_link),
                self.servers.update_weights(self.weights_link, mode, self.timeout),
            ],
            self.timeout,
        )
        return sent[0]

    def release_memory(self) -> None:
        self.servers.release_memory().wait(self.timeout)

    def cleanup_steps(self, graceful: bool) -> list:
        steps = super().cleanup_steps(graceful)
        link = getattr(self, "weights_link", None)
        if link is not None:
            steps.append(
                ("weight link", lambda: WEIGHT_TRANSPORTS.get(link.transport).release(link))
            )
        return steps


@ROLLOUT_SERVERS.register("vllm")
class VLLMServers(RolloutServers):
    """Launched servers are driven through their ranks (a dead one is named with its group,
    rank and method); servers at ``rollout.server_urls`` are called directly. Weights: a
    safetensors folder the servers reload (vLLM's CPU build has no NCCL weight-transfer path)."""

    weight_syncs = ("disk",)
    seeds_requests = False  # vLLM 0.32's CPU build dies on a seeded chunked prefill (vllm.py)

    @classmethod
    def validate(cls, cfg: LLMConfig) -> None:
        if cfg.rollout.server_urls:
            return
        python = cls.python(cfg)
        require(
            Path(python).exists(),
            "rollout.vllm_python",
            f"{python} does not exist: build vLLM's virtualenv with `make vllm`, or set this key "
            "to the python of a virtualenv with vLLM (or give rollout.server_urls)",
        )

    @staticmethod
    def python(cfg: LLMConfig) -> str:
        from tidal.inference.vllm import default_vllm_python

        # absolute (a rank may run elsewhere), but not resolved: a venv's python is a symlink
        return os.path.abspath(cfg.rollout.vllm_python or default_vllm_python())

    def protocol(self):
        from tidal.inference.vllm import VLLMProtocol

        return VLLMProtocol()

    @property
    def weights_dir(self) -> Path:
        return self.run_dir / "rollout_weights"

    def launch(self) -> list[str]:
        from tidal.workers.inference_worker import VLLMServerWorker

        r = self.cfg.rollout
        if r.server_urls:
            self.urls = [u.rstrip("/") for u in r.server_urls]
            return self.urls
        self.servers = VLLMServerWorker.create_group(
            self.cfg.model.path,
            start_timeout_s=r.vllm_start_timeout_s,
            extra_args=self.server_args(),
            python=self.python(self.cfg),
            log_dir=str(self.run_dir),
        ).launch(
            self.cluster,
            self.server_devices(),
            name="rollout",
            launch_timeout=r.vllm_start_timeout_s + 60,
        )
        return self.servers.address().wait(self.timeout)

    def server_args(self) -> list[str]:
        """The run's keys in vLLM's words (later arguments win: rollout.vllm_args last)."""
        cfg = self.cfg
        return [
            *("--dtype", cfg.rollout_dtype),
            *("--max-num-seqs", str(cfg.rollout.max_batch_size)),
            *cfg.rollout.vllm_args,
        ]

    def _each(self, method: str, *args) -> None:
        """A control call on every server: through the ranks, or straight to the URLs."""
        if self.servers is not None:
            getattr(self.servers, method)(*args, self.timeout).wait(self.timeout)
            return
        from tidal.inference import vllm

        calls = {
            "pause_generation": vllm.pause,
            "continue_generation": vllm.resume,
            "reload_weights": vllm.reload_weights,
        }
        for url in self.urls:
            calls[method](url, *args, self.timeout)

    def update_weights(self, actor, timer) -> int:
        """pause → transfer → resume, each over HTTP to every server."""
        with timer("update_weights/pause"):
            self.pause(self.cfg.rollout.pause_mode)
        with timer("update_weights/transfer"):
            version = self.transfer(actor)
        with timer("update_weights/resume"):
            self.resume()
        return version

    def pause(self, mode: str) -> None:
        self._each("pause_generation", mode)

    def transfer(self, actor) -> int:
        """The trainer writes its weights as a safetensors folder; every server reloads it."""
        version = actor.save_weights_folder(str(self.weights_dir)).wait(self.timeout)[0]
        self._each("reload_weights", str(self.weights_dir), version)
        return version

    def resume(self) -> None:
        self._each("continue_generation")
