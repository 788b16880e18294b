"""Frames per second of MetaWorld pixel observations on the CPU: tidal's fast camera (shadows,
reflections, multisampling off) against MuJoCo's default rendering, and env steps/s with and
without pixels. Writes JSON.

    python benchmarks/render_bench.py --size 64 --frames 200 --out render_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from tidal.envs import make_env


def frames_per_second(render, frames: int) -> float:
    render()  # warm up (shader compilation, first upload)
    start = time.perf_counter()
    for _ in range(frames):
        render()
    return frames / (time.perf_counter() - start)


def steps_per_second(env, steps: int) -> float:
    env.reset(seeds=list(range(env.num_envs)))
    actions = np.random.default_rng(0).uniform(-1, 1, (steps, env.num_envs, 4))
    start = time.perf_counter()
    for a in actions:
        env.step(a)
    return steps * env.num_envs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="reach-v3")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--out", default="render_bench.json")
    args = parser.parse_args()

    import mujoco

    env = make_env("metaworld", 1, env_id=args.task, obs_mode="pixels", image_size=args.size)
    env.reset(seeds=[0])
    fast = frames_per_second(env.cameras[0].render, args.frames)
    env.envs[0].model.vis.quality.offsamples = 4  # MuJoCo's own settings, shadows on
    default = mujoco.Renderer(env.envs[0].model, args.size, args.size)
    env.envs[0].model.vis.quality.offsamples = 0

    def render_default():
        default.update_scene(env.envs[0].data, camera="corner")
        return default.render()

    slow = frames_per_second(render_default, max(10, args.frames // 10))
    pixel_steps = steps_per_second(env, args.frames)
    env.close()
    state_env = make_env("metaworld", 1, env_id=args.task)
    state_steps = steps_per_second(state_env, args.frames * 5)
    result = {
        "task": args.task,
        "image_size": args.size,
        "mujoco_gl": os.environ.get("MUJOCO_GL"),
        "fast_camera_fps": round(fast, 1),
        "mujoco_default_fps": round(slow, 1),
        "env_steps_per_s_pixels": round(pixel_steps, 1),
        "env_steps_per_s_state": round(state_steps, 1),
        "load_average_1min": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
