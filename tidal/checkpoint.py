"""Atomic checkpoints: written to a temporary folder, fsynced, then renamed into place.

A checkpoint folder holds ``model.safetensors`` (weights and buffers, e.g. the observation
normaliser) or, written by a sharded strategy (``actor.strategy=fsdp2``), ``shards/`` (every
rank's part of the model and optimizer state, by ``torch.distributed.checkpoint``), ``state.pt`` (optimizer, scheduler and RNG states; loaded with
``weights_only=True``, never unrestricted pickle) and ``meta.json`` (step, version, counters).
``latest`` moves only once the new folder is complete; a crash while writing leaves the
previous checkpoints untouched, and resuming falls back to the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tidal.files import atomic_write

MODEL_FILE, STATE_FILE, META_FILE = "model.safetensors", "state.pt", "meta.json"
SHARDS_DIR = "shards"  # torch.distributed.checkpoint files: model and optimizer, every rank's part


def rng_state() -> dict[str, Any]:
    """The RNG states a resume restores: torch's (CPU, and the current CUDA device's once CUDA
    is in use: sampling there draws from it), NumPy's and Python's."""
    np_state = np.random.get_state()
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_initialized() else {}
    return {
        **cuda,
        "torch": torch.get_rng_state(),
        "numpy": {
            "key": np_state[1].tolist(),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": repr(random.getstate()),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import ast

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np.array(n["key"], dtype=np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    random.setstate(ast.literal_eval(state["python"]))


def save_checkpoint(
    path: str | Path,
    model_state: dict[str, torch.Tensor],
    state: dict[str, Any],
    meta: dict[str, Any],
    extra: dict[str, Any] | None = None,
    staged: Path | None = None,
) -> Path:
    """Write a checkpoint folder atomically; returns its path. ``extra``: more files
    ``{name: weights-only-loadable value}`` (e.g. the env and rollout workers' state).
    ``staged``: the :func:`staging_folder` the ranks already wrote their files into
    (``model_state`` is None when they wrote the model as ``shards/``)."""
    path = Path(path)
    tmp = staging_folder(path, str(os.getpid())) if staged is None else staged
    if model_state is not None:
        save_file(_unshared(model_state), str(tmp / MODEL_FILE))
    torch.save(state, tmp / STATE_FILE)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    for name, value in (extra or {}).items():
        torch.save(value, tmp / name)
    _fsync_files(tmp)
    if path.exists():  # replace an older checkpoint of the same name: move it aside first
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    _fsync_dir(path.parent)
    _write_latest(path)
    return path


def staging_path(path: str | Path, suffix: str) -> Path:
    """Where :func:`staging_folder` puts the temporary folder of ``path`` (the ranks that do not
    create it find it here)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{suffix}")


def staging_folder(path: str | Path, suffix: str) -> Path:
    """The empty temporary folder a checkpoint is written into before its rename (every rank
    of a sharded save passes the same ``suffix``; only one creates it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_path(path, suffix)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, tied weights (one storage, several names) copied apart: safetensors
    refuses tensors that share memory, and a strict load wants every name."""
    seen, out = set(), {}
    for k, v in state.items():
        t = v.detach().contiguous().cpu()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _fsync_files(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_dir():
            _fsync_files(f)
            continue
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` survive a power cut."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(path: Path) -> None:
    atomic_write(path.parent / "latest", path.name)
    _fsync_dir(path.parent)


def missing_files(path: Path) -> list[str]:
    """What a checkpoint folder lacks: state, meta, and the model (one file, or shards)."""
    missing = [f for f in (STATE_FILE, META_FILE) if not (path / f).is_file()]
    if not (path / MODEL_FILE).is_file() and not (path / SHARDS_DIR / ".metadata").is_file():
        missing.insert(0, MODEL_FILE)
    return missing


def is_complete(path: Path) -> bool:
    return not missing_files(path)


def complete_checkpoints(folder: str | Path) -> list[Path]:
    """The complete ``step_*`` checkpoints in a ``checkpoints/`` folder, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = (p for p in folder.glob("step_*") if p.is_dir() and is_complete(p))
    return sorted(found, key=_step_number)


def _step_number(path: Path) -> int:
    """``step_1000000`` comes after ``step_999999``: by the number, not the name."""
    number = path.name.removeprefix("step_")
    return int(number) if number.isdigit() else -1


def clean_stale(folder: str | Path) -> list[Path]:
    """Remove the temporary folders a killed save left behind; returns what was removed. A save
    killed between the two renames of an overwrite left the old checkpoint moved aside and
    none in its place: that one is moved back."""
    stale = [p for p in Path(folder).glob(".step_*") if p.is_dir()] if Path(folder).is_dir() else []
    for p in stale:
        name, _, kind = p.name[1:].rpartition(".")
        target = p.with_name(name)
        if kind.startswith("old-") and not target.exists() and is_complete(p):
            os.replace(p, target)
        else:
            shutil.rmtree(p, ignore_errors=True)
    return stale


def prune_checkpoints(folder: str | Path, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints (0: all), and always the one ``latest``
    names (a resumed run's newest may be older than an abandoned run's)."""
    if keep > 0:
        pointer = Path(folder) / "latest"
        latest = pointer.read_text().strip() if pointer.is_file() else None
        for old in complete_checkpoints(folder)[:-keep]:
            if old.name != latest:
                shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a ``checkpoints/`` folder: the one ``latest`` names when it is
    complete, else the newest complete one (a save killed between its renames)."""
    path = Path(path)
    if (path / "latest").is_file() or path.name == "checkpoints":
        pointer = path / "latest"
        named = path / pointer.read_text().strip() if pointer.is_file() else None
        if named is not None and is_complete(named):
            return named
        candidates = complete_checkpoints(path)
        if not candidates:
            raise FileNotFoundError(
                f"runner.resume_from: {str(path)!r} holds no complete checkpoint"
            )
        return candidates[-1]
    missing = missing_files(path)
    if missing:
        raise FileNotFoundError(
            f"runner.resume_from: {str(path)!r} is not a checkpoint (missing {', '.join(missing)})"
        )
    return path


def checkpoint_argument(path: str | None) -> Path | None:
    """``tidal eval --checkpoint``: the checkpoint folder it names (None when not given), or a
    config error naming the flag."""
    if path is None:
        return None
    from tidal.config.loader import ConfigError

    try:
        return resolve_checkpoint(path)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc).replace("runner.resume_from", "--checkpoint")) from None


def load_extra(path: str | Path, name: str) -> Any | None:
    """An ``extra`` file of a checkpoint (weights-only load); None when it has none."""
    file = resolve_checkpoint(path) / name
    return torch.load(file, weights_only=True) if file.is_file() else None


def load_checkpoint_state(path: str | Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The checkpoint's folder, ``state.pt`` and ``meta.json`` (not the model)."""
    path = resolve_checkpoint(path)
    state = torch.load(path / STATE_FILE, weights_only=True)
    meta = json.loads((path / META_FILE).read_text())
    return path, state, meta


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights, from ``model.safetensors`` or gathered from the shards (in
    this process, no process group: ``tidal eval``, an export)."""
    if (path / MODEL_FILE).is_file():
        return load_file(str(path / MODEL_FILE))
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    folder = str(path / SHARDS_DIR)
    keys = {k for k in FileSystemReader(folder).read_metadata().state_dict_metadata}
    model_keys = {k for k in keys if k.startswith("model.")}
    with warnings.catch_warnings():  # "assuming ... a single process": it is, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is unavailable or uninitialized")
        return dict(_load_state_dict_from_keys(model_keys, checkpoint_id=folder)["model"])


def check_keys(expected: set[str], given: set[str], source: str) -> None:
    """A strict load: every missing and unexpected key named."""
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source} does not match the model: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}"
        )


def load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``model.load_state_dict(state)`` with every missing and unexpected key named."""
    check_keys(set(model.state_dict()), set(state), source)
    model.load_state_dict(state, strict=True)


def trained_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of a model: its state without the frozen parameters (a LoRA run's
    base, which the run rebuilds from its config), buffers included."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def load_trained_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load a ``trained_state_dict`` into ``model`` with every missing and unexpected key named."""
    expected = set(trained_state_dict(model))
    check_keys(expected, set(state), source)
    model.load_state_dict(state, strict=expected == set(model.state_dict()))


def checkpoint_weights(model: torch.nn.Module, path: str | Path, lora, owner: str = "the model"):
    """A checkpoint's trained weights in the base model's names: as saved, or under LoRA
    (``lora``: the config's ``model.lora``) a copy of the base ``model`` built from the config
    with the saved adapters, merged (``model`` itself is left as it is)."""
    import copy

    from tidal.models.lora import apply_lora, check_checkpoint_lora, merged_state_dict

    path = resolve_checkpoint(path)
    state, _, meta = load_checkpoint(path)
    prefix = meta.get("policy_prefix")  # a checkpoint of more than the policy (SAC's critics)
    if prefix:
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    check_checkpoint_lora(meta, lora, str(path))
    if lora.rank == 0:
        return state
    wrapped = apply_lora(copy.deepcopy(model), lora, owner)
    load_trained_state(wrapped, state, str(path))
    return merged_state_dict(wrapped)


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json`` (no weights read)."""
    return json.loads((resolve_checkpoint(path) / META_FILE).read_text())


def load_checkpoint(
    path: str | Path,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    path, state, meta = load_checkpoint_state(path)
    return load_model_state(path), state, meta
