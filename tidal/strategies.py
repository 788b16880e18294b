"""How the train engine spreads a model over the actor ranks (``actor.strategy``), by registry.

``ddp``: every rank holds the whole model, gradients and optimizer state; DDP averages the
gradients. ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each shard unit (a causal LM's
decoder layers, the classes its ``_no_split_modules`` names; an embodied policy's
``shard_units()``, e.g. the VLA's transformer blocks) and then the root, so each rank holds
1/world of the parameters, gradients and optimizer state, gathered layer by layer for compute.

A strategy also says how each rank builds its model (:func:`build_model`): under ``fsdp2`` only
rank 0 builds (or loads) the whole model; the others build it on the meta device, and the wrap
shards it and fills each rank's shards from rank 0's full tensors, one tensor at a time
(``set_model_state_dict(..., broadcast_from_rank0=True)``): the same initial weights as DDP's,
bit for bit, with no full copy on the other ranks.

A strategy says what differs: wrapping, skipping the gradient sync on all but the last
micro-batch, the full weights for the rollout, and the checkpoint's model and optimizer state
(one safetensors file, or ``torch.distributed.checkpoint`` shards). The engine asks it; it never
tests the strategy's name.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from tidal.checkpoint import (
    META_FILE,
    SHARDS_DIR,
    check_keys,
    load_checkpoint_state,
    load_model_state,
    load_trained_state,
    save_checkpoint,
    staging_folder,
    staging_path,
    trained_state_dict,
)
from tidal.registry import Registry

STRATEGIES: Registry[type[Strategy]] = Registry("train strategy", "actor.strategy")


class ShardingError(ValueError):
    """A model the strategy cannot spread over the ranks; the message names the key."""


class Strategy:
    """DDP's behaviour is the default of every hook."""

    name: ClassVar[str]

    def __init__(self, cfg, distributed: bool):
        self.cfg, self.distributed = cfg, distributed

    # -- preflight (before any worker starts): raise a ConfigError naming the key ----------

    @classmethod
    def check_ranks(cls, ranks: int, multi_process: bool) -> None:
        """The actor's ranks fit the strategy (more than one on a backend of processes is
        every data-parallel group's rule, checked by the runners)."""

    @classmethod
    def check_model(cls, build_meta: Callable[[], nn.Module]) -> None:
        """The model (``build_meta()``: on the meta device, no weights) can be wrapped."""

    @classmethod
    def builds_on(cls, rank: int) -> str:
        """Where a rank of several builds the model: ``device`` (its own), ``cpu`` (the wrap
        moves it to the device, one shard unit at a time) or ``meta`` (a skeleton the wrap
        fills)."""
        return "device"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the loss calls (may be ``model`` itself, changed in place)."""
        return model

    def accumulate(self, module: nn.Module, sync: bool):
        """A context for one micro-batch's forward and backward: ``sync`` false on all but the
        last of a minibatch, so gradients are reduced over the ranks once."""
        return contextlib.nullcontext()

    def before_step(self, module: nn.Module) -> None:
        """Before an optimizer step's first forward."""

    def state_shares(self, world_size: int) -> float:
        """The fraction of the parameters, gradients and optimizer state one rank holds."""
        return 1.0

    # -- full weights (rollout) and checkpoints --------------------------------------------

    def full_state_dict(self, model: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
        """The whole model's state on rank 0 (None elsewhere); every rank calls it."""
        return model.state_dict() if rank == 0 else None

    def full_state_groups(
        self, model: nn.Module, rank: int, group_of: Callable[[str], str]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The whole model's state one group of keys at a time (consecutive keys with the same
        ``group_of(key)``), on rank 0; every rank iterates it to the end (a sharded model is
        gathered group by group as it is read), the others getting nothing."""
        state = self.full_state_dict(model, rank)
        if state is not None:
            yield from _grouped(state.items(), group_of)

    def save(self, model, optimizer, path: Path, state: dict, meta: dict, extra, rank: int):
        """Write the checkpoint (every rank calls it); its path on rank 0, else None."""
        if rank != 0:
            return None
        state = {**state, "optimizer": optimizer.state_dict()}
        # frozen parameters (a LoRA run's base) are rebuilt from the config, not saved
        return save_checkpoint(path, trained_state_dict(model), state, meta, extra)

    def load(self, model, optimizer, path: Path) -> tuple[dict, dict]:
        """Model (its trained part) and optimizer from a checkpoint, strictly; its
        ``state.pt`` and meta."""
        path, state, meta = load_checkpoint_state(path)
        load_trained_state(model, load_model_state(path), str(path))
        optimizer.load_state_dict(state["optimizer"])
        return state, meta


@STRATEGIES.register("ddp")
class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        # DDP averages gradients over the ranks (the process group is the worker's to start)
        return nn.parallel.DistributedDataParallel(model) if self.distributed else model

    def accumulate(self, module: nn.Module, sync: bool):
        return module.no_sync() if self.distributed and not sync else contextlib.nullcontext()


@STRATEGIES.register("fsdp2")
class FSDP2Strategy(Strategy):
    name = "fsdp2"

    @classmethod
    def check_ranks(cls, ranks: int, multi_process: bool) -> None:
        from tidal.config.loader import require

        require(
            ranks == 1 or multi_process,
            "actor.strategy",
            f"fsdp2 over {ranks} actor ranks shards the model across processes: set "
            "cluster.backend=ray (the local backend runs every rank as a thread of one process)",
        )

    @classmethod
    def check_model(cls, build_meta: Callable[[], nn.Module]) -> None:
        from tidal.config.loader import ConfigError

        try:
            shard_units(build_meta())
        except ShardingError as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def builds_on(cls, rank: int) -> str:
        # rank 0's full tensors stay on the host: its device only ever holds its shards and
        # one unit being sharded, and each tensor is copied there once to be broadcast
        return "cpu" if rank == 0 else "meta"

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        ensure_process_group()
        skeleton = _is_meta(model)
        skeletons = [False] * dist.get_world_size()
        dist.all_gather_object(skeletons, skeleton)
        # rank 0's full tensors, kept past the sharding (which copies each rank's slice out)
        full = model.state_dict() if any(skeletons) and dist.get_rank() == 0 else {}
        options: dict[str, Any] = {
            "reshard_after_forward": self.cfg.fsdp.reshard_after_forward is not False
        }
        if self.cfg.bf16:  # compute in bf16, keep fp32 shards and reduce gradients in fp32
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        if self.cfg.fsdp.cpu_offload:  # pinned memory (fast copies) only where there is a GPU
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for unit in shard_units(model):
            fully_shard(unit, **options)
        fully_shard(model, **options)
        if any(skeletons):
            self._fill_from_rank0(model, full, skeleton)
        # methods the trainer calls besides forward gather their parameters like forward
        for method in getattr(model, "sharded_forward_methods", ()):
            register_fsdp_forward_method(model, method)
        return model

    def _fill_from_rank0(self, model: nn.Module, full: dict, skeleton: bool) -> None:
        """Allocate a skeleton's shards (only them), then every rank's shards and buffers
        from rank 0's full tensors; the torch RNG continues as rank 0's, which built the model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        compute = _process_group_device()
        if skeleton:
            model.to_empty(device="cpu" if self.cfg.fsdp.cpu_offload else compute)
            for module in model.modules():  # buffers are not offloaded
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(compute)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        full.clear()
        for buffer in model.buffers():  # those outside the state dict too (e.g. RoPE's)
            dist.broadcast(buffer.data, 0)
        rng = [
            torch.get_rng_state(),
            torch.cuda.get_rng_state() if compute.type == "cuda" else None,
        ]
        dist.broadcast_object_list(rng, 0)
        if skeleton:
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1])

    def accumulate(self, module: nn.Module, sync: bool):
        module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def before_step(self, module: nn.Module) -> None:
        """Buffers (e.g. observation statistics) from rank 0, as DDP broadcasts them."""
        if dist.get_world_size() > 1:
            for buffer in module.buffers():
                dist.broadcast(buffer.data, 0)

    def state_shares(self, world_size: int) -> float:
        return 1.0 / world_size

    def full_state_dict(self, model: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # every rank all-gathers each parameter; with cpu_offload only rank 0 keeps the result
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        return state if rank == 0 else None

    def full_state_groups(
        self, model: nn.Module, rank: int, group_of: Callable[[str], str]
    ) -> Iterator[dict[str, torch.Tensor]]:
        # each parameter all-gathered as it is read: no rank ever holds the whole model
        # (with cpu_offload the shards live on the host, which the gather of the whole state
        # dict handles)
        if self.cfg.fsdp.cpu_offload:
            yield from super().full_state_groups(model, rank, group_of)
            return
        from torch.distributed.tensor import DTensor

        gathered = (
            (key, value.full_tensor() if isinstance(value, DTensor) else value)
            for key, value in model.state_dict().items()
        )
        for group in _grouped(gathered, group_of):
            if rank == 0:
                yield group

    def checkpoint_state(self, model: nn.Module, optimizer) -> dict[str, Any]:
        """The trained state only: frozen parameters (a LoRA run's base) are rebuilt from the
        config, as under DDP."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(
            model, optimizer, options=_checkpoint_options(model)
        )
        return {"model": model_state, "optimizer": optim_state}

    def save(self, model, optimizer, path: Path, state: dict, meta: dict, extra, rank: int):
        """Every rank writes its shards into one staging folder, then rank 0 adds the rest
        and renames it into place: a crash before the rename leaves older checkpoints whole.
        (On several nodes the run folder must be on a shared file system.)"""
        import torch.distributed.checkpoint as dcp

        staged = staging_path(path, "shards")
        if rank == 0:
            staging_folder(path, "shards")
        dist.barrier()
        dcp.save(self.checkpoint_state(model, optimizer), checkpoint_id=str(staged / SHARDS_DIR))
        if rank != 0:
            return None
        return save_checkpoint(path, None, state, meta, extra, staged=staged)

    def load(self, model, optimizer, path: Path) -> tuple[dict, dict]:
        """Resharded to this world size by ``torch.distributed.checkpoint``; strict on the
        model's keys."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path, state, meta = load_checkpoint_state(path)
        folder = str(path / SHARDS_DIR)
        current = self.checkpoint_state(model, optimizer)
        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        check_keys(
            set(current["model"]),
            {k.removeprefix("model.") for k in saved if k.startswith("model.")},
            str(path),
        )
        dcp.load(current, checkpoint_id=folder)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=current["model"],
            optim_state_dict=current["optimizer"],
            options=_checkpoint_options(model),
        )
        return state, meta


def _checkpoint_options(model: nn.Module):
    """Frozen parameters left out; a load is strict unless some are (the keys were checked)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def make_strategy(cfg, distributed: bool) -> Strategy:
    return STRATEGIES.get(cfg.strategy)(cfg, distributed)


def build_model(
    cfg,
    make: Callable[[], nn.Module],
    rank: int,
    world_size: int,
    device,
    skeleton: Callable[[], nn.Module] | None = None,
    whole: bool = False,
) -> nn.Module:
    """This rank's model for the train engine under ``cfg.strategy`` (``actor.*``): ``make()``
    on ``device`` (or on the host, for the wrap to move), or on ranks the strategy fills from
    rank 0 (fsdp2's), ``skeleton()`` (by default ``make()``) on the meta device: the same model
    with no weights allocated nor read. ``whole``: every rank builds it on ``device`` (e.g. a
    full copy of it is kept as the KL reference)."""
    where = "device" if whole or world_size == 1 else STRATEGIES.get(cfg.strategy).builds_on(rank)
    if where == "meta":
        with torch.device("meta"):
            return (skeleton or make)()
    return make().to(device if where == "device" else "cpu")


def _grouped(items, group_of: Callable[[str], str]) -> Iterator[dict[str, torch.Tensor]]:
    """``(key, tensor)`` pairs as dicts of consecutive keys with the same group."""
    group: dict[str, torch.Tensor] = {}
    current = None
    for key, value in items:
        name = group_of(key)
        if group and name != current:
            yield group
            group = {}
        current = name
        group[key] = value
    if group:
        yield group


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _process_group_device() -> torch.device:
    """Where this rank computes: its current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ensure_process_group() -> None:
    """FSDP2 needs a process group even alone: one of world size 1 for an engine outside a
    group of workers (``tidal sft``, tests)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules ``fsdp2`` shards one by one before the root: an embodied policy's
    ``shard_units()`` (empty: the whole policy is one unit), a Hugging Face model's decoder
    layers (the classes in its ``_no_split_modules``)."""
    if hasattr(model, "shard_units"):
        return list(model.shard_units())
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not units:
        raise ShardingError(
            f"actor.strategy: fsdp2 shards a language model by its decoder layers (the classes "
            f"its _no_split_modules names), and {type(model).__name__} has "
            + (f"no module of class {', '.join(sorted(names))}" if names else "none declared")
            + "; use actor.strategy=ddp"
        )
    return units


def checkpoint_strategy(path: Path) -> str:
    """The strategy that wrote a checkpoint (older checkpoints: ``ddp``)."""
    meta = json.loads((path / META_FILE).read_text())
    return meta.get("strategy", "ddp")


def check_resume(strategy: str, checkpoint: Path) -> None:
    """A checkpoint resumes under the strategy that wrote it (on any number of ranks): a
    DDP checkpoint's optimizer state is keyed by parameter index, FSDP2's is sharded."""
    from tidal.config.loader import ConfigError

    written = checkpoint_strategy(checkpoint)
    if written != strategy:
        raise ConfigError(
            f"actor.strategy: the checkpoint {str(checkpoint)!r} (runner.resume_from) was written "
            f"with actor.strategy={written}; resume it with actor.strategy={written}, not {strategy}"
        )
