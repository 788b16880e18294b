"""Offscreen pixels: layout, upright images, blank-frame check, MetaWorld from pixels."""

import threading

import numpy as np
import pytest
import torch

from tidal.envs import make_env
from tidal.envs.rendering import FastCamera

# A red box above the look-at point and a blue one below it, seen by an upright camera and by
# the same camera rolled 180° (its image-up axis points down, like MetaWorld's corner cameras).
SCENE = """
<mujoco>
  <worldbody>
    <light pos="0 -2 2" dir="0 1 -1"/>
    <geom name="red" type="box" size=".3 .05 .3" pos="0 0 .6" rgba="1 0 0 1"/>
    <geom name="blue" type="box" size=".3 .05 .3" pos="0 0 -.6" rgba="0 0 1 1"/>
    <camera name="upright" pos="0 -3 0" xyaxes="1 0 0 0 0 1"/>
    <camera name="rolled" pos="0 -3 0" xyaxes="-1 0 0 0 0 -1"/>
  </worldbody>
</mujoco>
"""


@pytest.fixture(scope="module")
def scene():
    import mujoco

    model = mujoco.MjModel.from_xml_string(SCENE)
    data = mujoco.MjData(model)
    mujoco.mj_forward(model, data)
    return model, data


@pytest.mark.parametrize("camera", ["upright", "rolled"])
def test_images_come_out_the_right_way_up(scene, camera):
    cam = FastCamera(*scene, camera, 32)
    image = cam.render().astype(int)
    assert image.shape == (32, 32, 3)
    red = (image[..., 0] > 100) & (image[..., 2] < 50)
    blue = (image[..., 2] > 100) & (image[..., 0] < 50)
    assert red[:16].sum() > 10 and red[16:].sum() == 0  # red on top
    assert blue[16:].sum() > 10 and blue[:16].sum() == 0  # blue below
    cam.close()


def test_a_blank_frame_is_a_clear_error(scene, monkeypatch):
    cam = FastCamera(*scene, "upright", 16)
    monkeypatch.setattr(cam.renderer, "render", lambda: np.zeros((16, 16, 3), np.uint8))
    with pytest.raises(RuntimeError, match="blank frame .*MUJOCO_GL"):
        cam.render()
    with pytest.raises(ValueError, match="no camera 'nope'; it has upright, rolled"):
        FastCamera(*scene, "nope", 16)


def test_metaworld_state_and_pixels_layout():
    env = make_env("metaworld", 1, env_id="reach-v3", obs_mode="state+pixels", image_size=32)
    obs = env.reset(seeds=[0])
    assert obs.shape == (1, 39 + 16 + 32 * 32 * 3)
    parts = env.layout.split(torch.from_numpy(obs))
    assert parts["state"].shape == (1, 39) and parts["tokens"].shape == (1, 16)
    image = parts["image"]
    assert image.shape == (1, 3, 32, 32) and 0 <= image.min() and image.max() <= 1
    assert image.std() > 0.05
    for _ in range(6):
        moved = env.step(np.array([[1.0, 0.0, 0.0, 0.0]]))[0]
    assert np.abs(moved[:, 55:] - obs[:, 55:]).mean() > 0.5  # the arm moved in the picture
    env.close()

    only = make_env("metaworld", 1, env_id="reach-v3", obs_mode="pixels", image_size=16)
    assert only.layout.state_dim == 0 and only.reset(seeds=[0]).shape == (1, 16 + 16 * 16 * 3)
    only.close()


def test_a_camera_built_in_one_thread_renders_in_others(scene):
    cam = FastCamera(*scene, "upright", 16)
    frames = []
    for _ in range(2):  # env workers build envs in one thread and may step them in another
        worker = threading.Thread(target=lambda: frames.append(cam.render()))
        worker.start()
        worker.join()
    frames.append(cam.render())
    assert len(frames) == 3 and all(np.array_equal(f, frames[0]) for f in frames)
    cam.close()


def test_evaluation_video_of_a_state_only_env(tmp_path):
    from PIL import Image

    from tidal.envs.video import tile, write_video

    env = make_env("metaworld", 2, env_id="reach-v3")  # state observations; video frames anyway
    env.reset(seeds=[0, 1])
    frames = []
    for _ in range(3):
        env.step(np.ones((2, 4)))
        frames.append(tile(env.render(size=24)))
    assert frames[0].shape == (24, 48, 3) and not np.array_equal(frames[0], frames[-1])
    gif = Image.open(write_video(frames, tmp_path / "eval.gif"))
    assert gif.n_frames == 3 and gif.size == (48, 24)
    env.close()
    with pytest.raises(ValueError, match="expected a .gif or .mp4 path"):
        write_video(frames, tmp_path / "eval.avi")


def test_gymnasium_mujoco_envs_film_every_action_and_others_are_refused():
    from tidal.envs.video import FrameRecorder

    env = FrameRecorder(make_env("gymnasium", 3, env_id="HalfCheetah-v5"), rows=2, size=32)
    env.start()
    env.reset(seeds=[0, 1, 2])
    for _ in range(4):
        env.step(np.ones((3, 6), dtype=np.float32))
    frames = env.take()
    assert frames.shape == (5, 32, 64, 3) and frames.dtype == np.uint8
    assert not np.array_equal(frames[0], frames[-1])  # the cheetah moved
    assert env.take() is None and env.num_envs == 3  # drained; the rest passes through
    env.close()

    with pytest.raises(ValueError, match="runner.eval_video: only MuJoCo envs"):
        FrameRecorder(make_env("gymnasium", 1, env_id="CartPole-v1"), 1, 32)
