"""How well can one camera frame locate MetaWorld reach-v3's goal? (issue 14, pixels target)

A camera sees the goal as a point in its image: every goal on that pixel's view ray looks the
same. For each camera, goals are drawn from reach-v3's goal box and projected at
--image-size; for each sampled goal, the best single point to reach given its pixel (the one
whose 5 cm ball holds most goals of the same pixel) gives the success a perfect estimator
could reach from one frame ("bayes_static"). Also reported: how many pixels the goal box
spans. The hand-mounted behindGripper camera moves, so its figure holds at the reset frame.

  python benchmarks/metaworld_goal_ambiguity.py [--samples 20000] [--out ambiguity.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

SUCCESS_RADIUS = 0.05  # reach-v3's success: tool centre within 5 cm of the goal


def camera_pixels(model, data, camera: int, points: np.ndarray, size: int) -> np.ndarray:
    """Pixel coordinates (from the image centre) of world ``points`` ``[N, 3]``."""
    rotation = data.cam_xmat[camera].reshape(3, 3)  # columns: the camera's axes in the world
    local = (points - data.cam_xpos[camera]) @ rotation  # the camera looks along its -z
    focal = 0.5 * size / np.tan(np.deg2rad(model.cam_fovy[camera]) / 2)
    return local[:, :2] / -local[:, 2:] * focal


def bayes_static_success(goals: np.ndarray, pixels: np.ndarray, every: int) -> float:
    rates = []
    for i in range(0, len(goals), every):
        same = goals[(np.abs(pixels - pixels[i]) < 0.5).all(1)][:1000]  # bounded memory
        within = np.linalg.norm(same[:, None] - same[None], axis=-1) < SUCCESS_RADIUS
        rates.append(within.mean(1).max())
    return float(np.mean(rates))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from tidal.envs.metaworld_adapter import MetaWorldVectorEnv

    env = MetaWorldVectorEnv(1, "reach-v3")
    env.reset(seeds=[0])
    task = env.envs[0]
    low, high = task._random_reset_space.low[3:], task._random_reset_space.high[3:]
    goals = np.random.default_rng(0).uniform(low, high, (args.samples, 3))
    results = {}
    for camera in range(task.model.ncam):
        pixels = camera_pixels(task.model, task.data, camera, goals, args.image_size)
        if not (np.abs(pixels) < args.image_size / 2).all():
            continue  # the goal box is not all in view
        name = task.model.camera(camera).name
        results[name] = {
            "bayes_static": bayes_static_success(goals, pixels, max(1, args.samples // 200)),
            "box_pixels": (pixels.max(0) - pixels.min(0)).round(1).tolist(),
        }
        print(name, results[name])
    env.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
