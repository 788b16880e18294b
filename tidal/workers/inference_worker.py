"""The inference-server worker: one engine and HTTP server per rollout rank inside a tidal
cluster; it publishes its address, and takes weights from the trainer in the cluster."""

from __future__ import annotations

import torch

from tidal.inference import GenerationEngine, InferenceServer
from tidal.models.llm import DTYPES
from tidal.runtime import Worker
from tidal.runtime.weight_sync import WeightLinks


class InferenceServerWorker(Worker, WeightLinks):
    def __init__(
        self,
        model_dir: str,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        max_batch_size: int = 64,
        allowed_dirs: list[str] | None = None,
        torch_threads: int = 1,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        device: str = "auto",
        tool_parser: str = "hermes",
    ):
        torch.set_num_threads(torch_threads)
        engine = GenerationEngine(
            model_dir,
            max_batch_size=max_batch_size,
            dtype=DTYPES[dtype],
            device=self.torch_device(device),
        )
        if attn_implementation is not None:  # model.attn_implementation, as the trainer loads it
            engine.model.set_attn_implementation(attn_implementation)
        self.server = InferenceServer(
            engine,
            host=host,
            port=0,
            api_key=api_key,
            allowed_dirs=allowed_dirs or [model_dir],
            tool_parser=tool_parser,
        ).start()

    def address(self) -> str:
        return self.server.address

    def pause_generation(self, mode: str = "abort") -> int:
        """The server's ``/pause_generation`` without the HTTP hop (and the driver's event loop,
        busy with hundreds of episodes): the runner pauses the servers it launched directly."""
        self.server.engine.pause(mode)
        return self.server.engine.weight_version

    def continue_generation(self) -> None:
        self.server.engine.resume()

    def update_weights(self, link, pause_mode: str = "abort", timeout: float = 600.0) -> int:
        """pause → receive the trainer's weights → load → continue, in one call (on ray, two
        round trips fewer than separate pause and continue calls); returns the version.
        Receiving while still generating was measured slower on ray: the transfer then
        competes with generation for this process's GIL."""
        engine = self.server.engine
        engine.pause(pause_mode)
        try:
            end = self.weight_end(link, "recv", timeout_s=timeout)
            update = end.recv()
            engine.update_weights(update.state_dict, update.version, adopt=update.owned)
            if update.owned:  # checked, then loaded: the staged tensors are the weights now
                end.adopted()
        finally:
            engine.resume()
        return update.version

    def load_weights(self, link, timeout: float = 600.0) -> int:
        """Load the trainer's weights while the caller holds generation paused (the client's
        pause → update → continue cycle across all servers)."""
        end = self.weight_end(link, "recv", timeout_s=timeout)
        update = end.recv()
        self.server.engine.update_weights(update.state_dict, update.version, adopt=update.owned)
        if update.owned:
            end.adopted()
        return update.version

    def release_memory(self) -> int:
        """Drop the KV cache (when idle) and the allocator's cached blocks; returns bytes freed."""
        return self.server.engine.release_memory()

    def stats(self) -> dict:
        return dict(self.server.engine.stats)

    def shutdown_server(self) -> None:
        self.server.stop()


class VLLMServerWorker(Worker):
    """One vLLM server per rollout rank (``rollout.engine: vllm``): launched from vLLM's own
    virtualenv and supervised by this rank, which publishes its address and drives the
    weight-update cycle of its server. Every call first checks that the process lives: a dead
    server fails the call (``ServerDied``), named with this group, rank and method."""

    def __init__(
        self,
        model_dir: str,
        max_model_len: int | None = None,
        start_timeout_s: float = 600.0,
        extra_args: list[str] | None = None,
        python: str | None = None,
        log_dir: str | None = None,
    ):
        from tidal.inference.vllm import VLLMServer

        self.server = VLLMServer(
            model_dir,
            max_model_len=max_model_len,
            extra_args=extra_args,
            python=python,
            log_dir=log_dir,
        )
        self.server.start(start_timeout_s)

    def address(self) -> str:
        self.server.check_alive()
        return self.server.address

    def alive(self) -> bool:
        return self.server.alive()

    def pause_generation(self, mode: str = "abort", timeout: float = 120.0) -> None:
        from tidal.inference import vllm

        self.server.check_alive()
        vllm.pause(self.server.address, mode, timeout)

    def continue_generation(self, timeout: float = 120.0) -> None:
        from tidal.inference import vllm

        self.server.check_alive()
        vllm.resume(self.server.address, timeout)

    def reload_weights(self, folder: str, version: int, timeout: float = 600.0) -> int:
        from tidal.inference import vllm

        self.server.check_alive()
        vllm.reload_weights(self.server.address, folder, version, timeout)
        return version

    def shutdown_server(self) -> None:
        self.server.stop()
