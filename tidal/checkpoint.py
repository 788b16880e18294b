"""Atomic checkpoints: written to a temporary folder, then renamed into place.

A checkpoint folder holds ``model.safetensors`` (weights and buffers, e.g. the observation
normaliser), ``state.pt`` (optimizer, scheduler and RNG states; loaded with
``weights_only=True``, never unrestricted pickle) and ``meta.json`` (step, version, counters).
A crash while writing leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MODEL_FILE, STATE_FILE, META_FILE = "model.safetensors", "state.pt", "meta.json"


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"key": np_state[1].tolist(), "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4])},
        "python": repr(random.getstate()),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import ast

    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", np.array(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(ast.literal_eval(state["python"]))


def save_checkpoint(path: str | Path, model_state: dict[str, torch.Tensor], state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write a checkpoint folder atomically; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(tmp / MODEL_FILE))
    torch.save(state, tmp / STATE_FILE)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    _fsync_dir(tmp)
    if path.exists():  # replace an older checkpoint of the same name: move it aside first
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    _write_latest(path)
    return path


def _fsync_dir(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _write_latest(path: Path) -> None:
    pointer = path.parent / "latest"
    tmp = path.parent / ".latest.tmp"
    tmp.write_text(path.name)
    os.replace(tmp, pointer)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a ``checkpoints/`` folder whose ``latest`` names one."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    missing = [f for f in (MODEL_FILE, STATE_FILE, META_FILE) if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"runner.resume_from: {str(path)!r} is not a checkpoint (missing {', '.join(missing)})")
    return path


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    path = resolve_checkpoint(path)
    model_state = load_file(str(path / MODEL_FILE))
    state = torch.load(path / STATE_FILE, weights_only=True)
    meta = json.loads((path / META_FILE).read_text())
    return model_state, state, meta
