"""An env's exact state as plain values (tensors, numbers, strings, lists, dicts), so a resumed
run continues the very episodes the interrupted one was in. The values load with
``torch.load(weights_only=True)``: nothing here needs unrestricted pickle.

A gymnasium env is captured layer by layer (every wrapper, then the env itself): the plain
attributes of each layer, the env's random generator, and for MuJoCo envs the simulator's
``MjData`` arrays (state, warm start and the derived quantities some envs read at the start of
a step). Attributes that are neither plain nor known to be constant are listed in ``missed``:
such an env cannot be restored exactly, and the resume says so.

Each copy of a vector env is wrapped in ``StateAccess``, so its state is read and written
where the copy lives (an async vector env's copies live in subprocesses).

Not restored exactly (each named in a warning at resume):
- an adapter without ``state_dict`` (see ``VectorEnvAdapter``);
- an env holding state in objects other than plain values, numpy generators or ``MjData``
  (the attribute is named), e.g. a simulator handle of another engine; and an env that changes
  its ``MjModel`` while running (domain randomisation): the model is rebuilt, not saved.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

NUMPY_TAG = "__numpy__"
# set when the env is made and never changed by stepping (or restored by their own rule)
CONSTANT_ATTRS = frozenset(
    {
        "env",
        "envs",
        "env_fns",
        "spec",
        "_cached_spec",
        "_saved_kwargs",
        "_ezpickle_args",
        "_ezpickle_kwargs",
        "metadata",
        "_metadata",
        "render_mode",
        "action_space",
        "observation_space",
        "_action_space",
        "_observation_space",
        "single_action_space",
        "single_observation_space",
        "autoreset_mode",
        "_np_random",
        "screen",
        "clock",
        "pending_state",
    }
)
# MuJoCo's: the model is assumed constant, the data is captured on its own, the renderer draws
SIMULATOR_TYPES = frozenset({"MjModel", "MjData", "MujocoRenderer"})


def to_plain(value: Any) -> Any:
    """``value`` as weights-only-loadable values; raises TypeError for anything else."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype == object:
            raise TypeError("object array")
        return {NUMPY_TAG: torch.from_numpy(array.copy()), "scalar": isinstance(value, np.generic)}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, list | tuple):
        return type(value)(to_plain(v) for v in value)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: to_plain(v) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def from_plain(value: Any) -> Any:
    if isinstance(value, dict) and NUMPY_TAG in value:
        array = value[NUMPY_TAG].numpy().copy()
        return array[()] if value["scalar"] else array
    if isinstance(value, list | tuple):
        return type(value)(from_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: from_plain(v) for k, v in value.items()}
    return value


def capture_layer(layer: Any, missed: list[str]) -> dict[str, Any]:
    """The plain attributes of one wrapper or env; what cannot be captured goes to ``missed``."""
    out = {}
    for name, value in vars(layer).items():
        if name in CONSTANT_ATTRS or type(value).__name__ in SIMULATOR_TYPES:
            continue
        try:
            out[name] = to_plain(value)
        except TypeError:
            missed.append(f"{type(layer).__name__}.{name} ({type(value).__name__})")
    return out


def restore_layer(layer: Any, state: dict[str, Any]) -> None:
    for name, value in state.items():
        setattr(layer, name, from_plain(value))


def _layers(env: Any) -> list[Any]:
    layers = [env]
    while hasattr(layers[-1], "env"):
        layers.append(layers[-1].env)
    return layers


def capture_env(env: Any, missed: list[str]) -> dict[str, Any]:
    """One gymnasium env (with its wrappers)."""
    layers = _layers(env)
    base = layers[-1]
    rng = getattr(base, "_np_random", None)
    return {
        "types": [type(layer).__name__ for layer in layers],
        "layers": [capture_layer(layer, missed) for layer in layers],
        "np_random": None if rng is None else to_plain(rng.bit_generator.state),
        "mujoco": capture_mujoco(base.data) if _is_mujoco(base) else None,
    }


def restore_env(env: Any, state: dict[str, Any]) -> None:
    layers = _layers(env)
    types = [type(layer).__name__ for layer in layers]
    if types != state["types"]:
        raise ValueError(f"env layers {types} differ from the checkpoint's {state['types']}")
    for layer, layer_state in zip(layers, state["layers"]):
        restore_layer(layer, layer_state)
    base = layers[-1]
    if state["np_random"] is not None:
        from gymnasium.utils import seeding

        rng, _ = seeding.np_random(0)
        rng.bit_generator.state = from_plain(state["np_random"])
        base._np_random = rng
    if state["mujoco"] is not None:
        restore_mujoco(base.data, state["mujoco"])


def _is_mujoco(env: Any) -> bool:
    return type(getattr(env, "data", None)).__name__ == "MjData"


def _mjdata_arrays(data: Any) -> dict[str, np.ndarray]:
    names = (n for n in dir(data) if not n.startswith("_"))
    return {n: v for n in names if isinstance(v := getattr(data, n), np.ndarray)}


def capture_mujoco(data: Any) -> dict[str, Any]:
    """Every array of ``MjData`` (not only qpos/qvel: the solver's warm start changes the next
    step, and envs such as Ant or Reacher read body positions computed by the last step)."""
    arrays = {n: to_plain(a) for n, a in _mjdata_arrays(data).items()}
    return {"time": float(data.time), "arrays": arrays}


def restore_mujoco(data: Any, state: dict[str, Any]) -> None:
    current = _mjdata_arrays(data)
    for name, saved in state["arrays"].items():
        value = from_plain(saved)
        # constraint arrays are sized by the last step's contacts; the next step recomputes them
        if name in current and current[name].shape == value.shape:
            current[name][...] = value
    data.time = state["time"]


class StateAccess(gym.Wrapper):
    """Wraps each copy of a vector env so ``call`` and ``set_attr`` (which reach copies in
    subprocesses too) can read and write its state."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.pending_state = None  # set by ``set_attr``, applied by ``apply_pending_state``

    def capture_state(self) -> tuple[dict[str, Any], list[str]]:
        missed: list[str] = []
        return capture_env(self.env, missed), missed

    def apply_pending_state(self) -> None:
        restore_env(self.env, self.pending_state)
        self.pending_state = None


def capture_vector_env(vector_env: Any) -> tuple[dict[str, Any], list[str]]:
    """A gymnasium vector env whose copies are wrapped in ``StateAccess``: the vector env's own
    buffers (a sync one's) and every copy. Returns the state and what could not be captured."""
    missed: list[str] = []
    vector = capture_layer(vector_env, missed) if hasattr(vector_env, "envs") else {}
    envs = []
    for env_state, env_missed in vector_env.call("capture_state"):
        envs.append(env_state)
        missed += [m for m in env_missed if m not in missed]
    return {"vector": vector, "envs": envs}, missed


def restore_vector_env(vector_env: Any, state: dict[str, Any]) -> None:
    if vector_env.num_envs != len(state["envs"]):
        raise ValueError(
            f"{vector_env.num_envs} env copies, the checkpoint has {len(state['envs'])}"
        )
    restore_layer(vector_env, state["vector"])
    vector_env.set_attr("pending_state", state["envs"])
    vector_env.call("apply_pending_state")
