"""SAC's actor worker alone, outside a run (updates on a buffer of seeded random transitions, so
the numbers do not depend on collection's asynchrony):

hash    a hash of every weight, target, alpha and logged loss after 60 ``sac_mlp`` updates on
        Pendulum-shaped data (two configs): run it on two commits to check that state SAC
        takes exactly the same steps;
cost    milliseconds per update of the pixel example's networks (64x64, batch 128), with and
        without ``algorithm.image_pad``, and the parts: buffer sample, one shift, one encoder
        forward;
memory  replay bytes per transition, pixels stored as float32 against uint8.

  PYTHONPATH=$PWD python benchmarks/sac_pixels_bench.py hash|cost|memory
"""

from __future__ import annotations

import hashlib
import sys
import time
import types

import gymnasium as gym
import torch

from tidal.config import EmbodiedConfig, load_config
from tidal.data.replay import ReplayBuffer
from tidal.envs.layout import LayoutBox, ObsLayout
from tidal.runtime import ConfigSections
from tidal.workers.sac_actor import SACActor

PENDULUM = "examples/embodied/pendulum_sac.yaml"
PIXELS = "examples/embodied/metaworld_reach_pixels_sac.yaml"


def worker(path: str, overrides: list[str], obs_space, action_space) -> SACActor:
    SACActor.torch_device = lambda self, setting="auto": torch.device("cpu")
    SACActor.rank, SACActor.world_size = 0, 1  # built outside a group
    cfg = load_config(EmbodiedConfig, path, overrides)
    sections = ConfigSections("bench", cfg, SACActor.config_sections)
    return SACActor(sections, types.SimpleNamespace(env=1, stages=1), obs_space, action_space)


def transitions(obs: torch.Tensor, next_obs: torch.Tensor, actions: torch.Tensor, g) -> dict:
    n = len(obs)
    return {
        "obs": obs,
        "next_obs": next_obs,
        "actions": actions,
        "rewards": torch.randn(n, generator=g),
        "terminations": torch.rand(n, generator=g) < 0.1,
        "truncations": torch.zeros(n, dtype=torch.bool),
        "steps": torch.ones(n, dtype=torch.int64),
    }


def state_hash() -> str:
    digest = hashlib.sha256()
    env = gym.make("Pendulum-v1")
    configs = (
        [],
        [
            "algorithm.policy_delay=2",
            "actor.max_grad_norm=1.0",
            "algorithm.num_critics=3",
            "algorithm.critic_subset=2",
            "env.num_action_chunks=2",
        ],
    )
    for extra in configs:
        overrides = ["model.hidden_sizes=[32,32]", "replay.batch_size=32", *extra]
        w = worker(PENDULUM, overrides, env.observation_space, env.action_space)
        g, n, chunks = torch.Generator().manual_seed(3), 500, w.policy.chunks
        obs, next_obs = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g)
        w.buffer.add(transitions(obs, next_obs, torch.rand(n, chunks, 1, generator=g) * 2 - 1, g))
        for _ in range(3):
            digest.update(repr(sorted(w.update(20).items())).encode())
        for key, value in w.agent.state_dict().items():
            digest.update(key.encode() + value.numpy().tobytes())
    return digest.hexdigest()


def ms(fn, repeats: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def update_cost() -> None:
    from tidal.models.sac_cnn import shift_observations  # (absent before pixels: hash runs there)

    space = LayoutBox(ObsLayout(num_tokens=4, vocab_size=64, image_size=64))
    g, n = torch.Generator().manual_seed(0), 2000
    tokens = torch.randint(1, 64, (n, 4), generator=g).float()
    obs = torch.cat([tokens, torch.randint(0, 256, (n, 64 * 64 * 3), generator=g).float()], 1)
    for pad in (4, 0):
        w = worker(PIXELS, [f"algorithm.image_pad={pad}"], space, gym.spaces.Box(-1, 1, (4,)))
        w.buffer.add(transitions(obs, obs, torch.zeros(n, 1, 4), g))
        w.update(2)
        update = ms(lambda w=w: w.update(1))
        sample = ms(lambda w=w: w.buffer.sample(128, w.generator))
        batch = w.buffer.sample(128, w.generator)["obs"]
        shift = ms(lambda w=w, b=batch: shift_observations(b, w.obs_layout, 4, w.generator))
        with torch.no_grad():
            encode = ms(lambda w=w, b=batch: w.policy.encode(b))
        print(
            f"image_pad {pad}: update {update:.0f} ms; sample {sample:.1f} ms, one shift "
            f"{shift:.1f} ms, one encoder forward {encode:.0f} ms"
        )


def replay_memory() -> None:
    n = 1000
    for size in (16, 64, 84):
        numel = size * size * 3
        per = {}
        for name, stored in (("float32", 0), ("uint8", numel)):
            buf = ReplayBuffer(n, 4 + numel, (1, 4), image_numel=stored)
            per[name] = sum(v.nbytes for v in buf.data.values()) / n
        f32, u8 = per["float32"], per["uint8"]
        print(
            f"{size}x{size}: float32 {f32:.0f} B, uint8 {u8:.0f} B per transition "
            f"({f32 / u8:.2f}x); 100k: {f32 * 1e5 / 2**30:.2f} GiB vs {u8 * 1e5 / 2**30:.2f} GiB"
        )


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "hash"
    {"hash": lambda: print(state_hash()), "cost": update_cost, "memory": replay_memory}[mode]()
