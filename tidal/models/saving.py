"""A policy as a folder: ``config.json`` (registered name, spaces, constructor kwargs) and
``model.safetensors`` (weights and buffers). RL starts from a behaviour-cloned policy this way
(``model.path``); nothing is unpickled."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
from safetensors.torch import load_file, save_file

from tidal.envs.layout import LayoutBox, ObsLayout
from tidal.models.policy import POLICIES, EmbodiedPolicy, build_policy

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def space_to_json(space: gym.Space) -> dict:
    if isinstance(space, LayoutBox):
        return {"type": "layout", "layout": space.layout.to_dict()}
    if isinstance(space, gym.spaces.Box):
        return {
            "type": "box",
            "low": space.low.tolist(),
            "high": space.high.tolist(),
            "dtype": str(space.dtype),
        }
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "discrete", "n": int(space.n)}
    raise ValueError(f"cannot save a policy for the space {space}")


def space_from_json(data: dict) -> gym.Space:
    if data["type"] == "layout":
        return LayoutBox(ObsLayout(**data["layout"]))
    if data["type"] == "box":
        dtype = np.dtype(data["dtype"])
        return gym.spaces.Box(
            np.array(data["low"], dtype), np.array(data["high"], dtype), dtype=dtype
        )
    return gym.spaces.Discrete(data["n"])


def save_policy(policy: EmbodiedPolicy, folder: str | os.PathLike) -> Path:
    """Write the folder atomically (a temporary sibling renamed into place)."""
    spec = getattr(policy, "build_spec", None)
    if spec is None:
        raise ValueError(
            "save_policy: build the policy with build_policy so it knows how to rebuild itself"
        )
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {
        "name": spec["name"],
        "num_action_chunks": spec["num_action_chunks"],
        "kwargs": spec["kwargs"],
        "observation_space": space_to_json(spec["observation_space"]),
        "action_space": space_to_json(spec["action_space"]),
    }
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.detach().contiguous() for k, v in policy.state_dict().items()}, str(tmp / WEIGHTS)
    )
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def read_saved_config(folder: str | os.PathLike) -> dict:
    """The ``config.json`` of a saved policy folder (no weights read), or a ``ValueError`` naming
    ``model.path``."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ValueError(
            f"model.path: {str(folder)!r} is not a saved policy folder ({CONFIG} and {WEIGHTS}); "
            "`tidal sft CONFIG` writes one"
        )
    return json.loads((folder / CONFIG).read_text())


def load_policy(
    folder: str | os.PathLike, weights: bool = True, run_settings: dict | None = None
) -> EmbodiedPolicy:
    """The saved policy; ``weights=False``: its skeleton, the weights not read (built on the
    meta device, e.g. by the ranks fsdp2 fills from rank 0). ``run_settings``: values of the
    arguments the policy's class lists in ``run_settings``, replacing the saved ones."""
    folder = Path(folder)
    config = read_saved_config(folder)
    own = POLICIES.get(config["name"]).run_settings
    overrides = {k: v for k, v in (run_settings or {}).items() if k in own}
    policy = build_policy(
        config["name"],
        space_from_json(config["observation_space"]),
        space_from_json(config["action_space"]),
        config["num_action_chunks"],
        **{**config["kwargs"], **overrides},
    )
    if weights:
        policy.load_state_dict(load_file(str(folder / WEIGHTS)))
    return policy
