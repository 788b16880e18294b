"""The LIBERO env family: spaces, the official init states, success that ends an episode,
per-task metrics, bad input named before anything starts, a scripted demonstration, and one
step of `tidal train`. Needs the `libero` extra (in `all`, which CI installs)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tidal.config import ConfigError, EmbodiedConfig, load_config
from tidal.envs import ChunkedEnv, make_env, success_metrics, tokenize
from tidal.envs.libero import PROPRIO_DIM, init_state_index
from tidal.envs.libero_demos import PickPlaceScript
from tidal.extras import MissingExtraError

EXAMPLE = Path(__file__).parent.parent / "examples" / "embodied" / "libero_object_ppo.yaml"
SOUP, CHEESE = (
    "pick_up_the_alphabet_soup_and_place_it_in_the_basket",
    "pick_up_the_cream_cheese_and_place_it_in_the_basket",
)


@pytest.fixture(scope="module")
def two_tasks():
    """libero_object tasks 0 and 1, one copy each (building a LIBERO env takes seconds)."""
    env = make_env("libero", 2, env_id="libero_object", tasks=[0, 1], max_episode_steps=200)
    yield env
    env.close()


def test_spaces_instructions_and_the_official_init_states(two_tasks):
    env = two_tasks
    obs = env.reset(seeds=[0, 1])
    assert env.task_names == [SOUP, CHEESE] and env.max_episode_steps == 200
    assert env.layout.state_dim == PROPRIO_DIM + 14 * 7 and env.layout.image_size == 0
    assert obs.shape == (2, env.layout.size) == (2, env.observation_space.shape[0])
    assert env.action_space.shape == (7,) and env.action_space.high.tolist() == [1.0] * 7
    words = obs[:, env.layout.state_dim :]
    assert words[0].tolist() == tokenize(env.instructions[0], 16, 1024).tolist()
    assert env.instructions[0] == "pick up the alphabet soup and place it in the basket"
    for i, task in enumerate(env.task_index):  # each copy starts from its task's init state 0
        official = env.suite.get_task_init_states(task)[0]
        assert np.allclose(env.envs[i].get_sim_state(), official)
    # the state starts with the object of interest: its pose relative to the gripper follows
    soup = env.position(0, "alphabet_soup_1")
    assert np.allclose(obs[0, PROPRIO_DIM : PROPRIO_DIM + 3], soup, atol=1e-5)
    env.reset(mask=np.array([True, False]))  # its next episode: the next init state
    assert env.init_index.tolist() == [1, 0]
    env.reset(seeds=[0, 1])  # a new round for all: the copy behind catches up
    assert env.init_index.tolist() == [2, 2]


def _texture_sides(env) -> dict[str, int]:
    """The longest side of each 2-D texture compiled into the first copy's model."""
    import mujoco

    model = env.envs[0].env.sim.model._model
    return {
        mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_TEXTURE, i): int(
            max(model.tex_width[i], model.tex_height[i])
        )
        for i in range(model.ntex)
        if model.tex_type[i] == mujoco.mjtTexture.mjTEXTURE_2D
    }


def test_textures_are_shrunk_to_the_limit_and_kept_when_it_is_0(two_tasks):
    shrunk = _texture_sides(two_tasks)  # the default, 512 pixels a side
    assert shrunk["basket_1_tex-basket"] == 512 and max(shrunk.values()) == 512
    whole = make_env("libero", 1, env_id="libero_object", tasks=[0], max_texture_size=0)
    try:
        assert _texture_sides(whole)["basket_1_tex-basket"] == 4096  # as LIBERO ships it
    finally:
        whole.close()


def test_shrinking_a_texture_file_writes_a_smaller_copy_once(tmp_path, monkeypatch):
    import cv2

    from tidal.envs.libero_textures import shrink_textures

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    big, small = tmp_path / "big.png", tmp_path / "small.png"
    cv2.imwrite(str(big), np.full((20, 40, 3), 200, np.uint8))
    cv2.imwrite(str(small), np.zeros((8, 8, 3), np.uint8))
    xml = (
        f'<mujoco><asset><texture name="a" type="2d" file="{big}"/>'
        f'<texture name="b" type="2d" file="{small}"/>'
        f'<texture name="c" type="cube" file="{big}"/></asset></mujoco>'
    )
    out = shrink_textures(xml, limit=16)
    files = {t.split('"')[0]: t.split('file="')[1].split('"')[0] for t in out.split('name="')[1:]}
    assert files["b"] == str(small) and files["c"] == str(big)  # fits; a cube's grid stays
    copy = cv2.imread(files["a"])
    assert copy.shape == (8, 16, 3) and copy.mean() == 200
    assert shrink_textures(xml, limit=16) == out  # the cached copy, the same path
    assert shrink_textures(xml, limit=64) == xml


def test_copies_of_a_task_run_its_init_states_in_order():
    # copy k of a task, episode n, with 3 copies per task: init states k, k + 3, k + 6, ...
    order = [
        init_state_index(k, n, copies=3, indices=list(range(50)))
        for n in range(3)
        for k in range(3)
    ]
    assert order == list(range(9))
    assert init_state_index(1, 17, copies=3, indices=list(range(50))) == (1 + 51) % 50
    assert init_state_index(0, 1, copies=1, indices=[7, 9]) == 9


def test_a_scripted_episode_succeeds_terminates_and_counts_per_task(two_tasks):
    """The script carries the soup into the basket: reward 1 and `terminated` on that step;
    the other copy, left still, is truncated at the time limit, unsuccessful."""
    env = ChunkedEnv(two_tasks, auto_reset=False, seeds=[0, 1])
    env.reset()
    script = PickPlaceScript(two_tasks, 0, np.random.default_rng(0))
    rewards, ended_at = [], None
    for t in range(two_tasks.max_episode_steps):
        actions = np.zeros((2, 1, 7))
        actions[0, 0] = script.action()
        out = env.step(actions)
        rewards.append(out.rewards[0, 0].item())
        if ended_at is None and out.terminations[0, 0]:
            ended_at = t
        if env.all_reported():
            break
    assert ended_at is not None and rewards[ended_at] == 1.0 and sum(rewards[:ended_at]) == 0
    stats = env.stats.drain()
    assert sorted(zip(stats["tasks"], stats["successes"])) == [(SOUP, 1.0), (CHEESE, 0.0)]
    assert success_metrics(stats["successes"], stats["tasks"], "eval") == {
        "eval/success_rate": 0.5,
        f"eval/success_rate/{CHEESE}": 0.0,
        f"eval/success_rate/{SOUP}": 1.0,
    }


def _preflight(*overrides: str):
    from tidal.runners.preflight import check_embodied, probe_env

    cfg = load_config(EmbodiedConfig, EXAMPLE, ["model.path=null", *overrides])
    check_embodied(cfg)
    probe_env(cfg)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["env.id=libero_objects"],
            r"LIBERO has no suite 'libero_objects'; the suites are libero_spatial, libero_object",
        ),
        (
            ["env.adapter_kwargs.tasks=[12]"],
            r"libero_object has no task 12; its tasks are 0..9: 0 pick_up_the_alphabet_soup",
        ),
        (["env.adapter_kwargs.tasks=[pick_up_the_moon]"], r"has no task 'pick_up_the_moon'"),
        (
            ["env.adapter_kwargs.init_states=[0,50]"],
            r"env.adapter_kwargs.init_states: init state \[50\] out of range; each task has 50",
        ),
        (
            ["env.adapter_kwargs.reward=dense"],
            r"env.adapter_kwargs.reward: expected one of success, shaped",
        ),
        (
            ["env.adapter_kwargs.max_texture_size=-1"],
            r"env.adapter_kwargs.max_texture_size: expected pixels a side \(an integer >= 1",
        ),
        (
            ["env.adapter_kwargs.max_texture_size=big"],
            r"env.adapter_kwargs.max_texture_size: expected pixels a side \(an integer",
        ),
    ],
)
def test_bad_input_is_a_config_error_before_any_worker(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _preflight(*overrides)


def test_a_missing_extra_and_a_missing_renderer_are_named(monkeypatch):
    for name in ("libero", "libero.libero"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        ConfigError, match=r"needs the 'libero' extra .*pip install 'tidal\[libero\]'"
    ):
        _preflight()
    with pytest.raises(MissingExtraError, match="'libero' extra"):
        make_env("libero", 1, env_id="libero_object")
    monkeypatch.undo()
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs libEGL or libOSMesa.*make system-deps"):
        _preflight("env.obs_mode=pixels")


def test_one_step_of_tidal_train_on_libero(tmp_path):
    import json

    from tidal.cli import main

    code = main(
        [
            "train",
            str(EXAMPLE),
            "model.path=null",
            f"runner.run_dir={tmp_path}",
            "runner.max_steps=1",
            "env.total_num_envs=1",
            "env.eval_num_envs=1",
            "env.max_episode_steps=8",
            "env.adapter_kwargs.tasks=[0]",
            "rollout.num_steps=2",
            "actor.global_batch_size=2",
            "actor.micro_batch_size=2",
        ]
    )
    assert code == 0
    rows = [
        json.loads(x)
        for x in (tmp_path / "libero_object_ppo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any("train/policy_loss" in r for r in rows)
    evals = [r for r in rows if "eval/success_rate" in r]
    assert evals and f"eval/success_rate/{SOUP}" in evals[-1]


def test_pixels_tile_agentview_over_the_wrist_camera_upright():
    env = make_env(
        "libero", 1, env_id="libero_object", tasks=[0], obs_mode="state+pixels", image_size=32
    )
    try:
        obs = env.reset(seeds=[0])
        layout = env.layout
        assert layout.image_size == 32 and obs.shape == (1, layout.size)
        image = obs[0, layout.state_dim + layout.num_tokens :].reshape(32, 32, 3)
        agentview, wrist = image[:16], image[16:]
        assert agentview.std() > 5 and wrist.std() > 5  # both drawn, neither blank
        # upright: the floor (bright, near the camera) at the bottom of the agentview tile
        assert agentview[12:].mean() > agentview[:4].mean()
        assert env.render(32).shape == (1, 32, 32, 3)
    finally:
        env.close()


def test_scripted_demonstrations_from_random_placements_and_the_tasks_they_cover():
    from tidal.envs.libero_demos import collect_libero_demos

    demos = collect_libero_demos("libero_object", 1, action_noise=0.05, tasks=[0])
    assert demos.num_episodes == 1 and demos.tasks == [SOUP] and demos.successes.all()
    assert demos.obs.shape == (len(demos.actions), PROPRIO_DIM + 14 * 7 + 16)
    assert demos.actions.shape[1] == 7 and np.abs(demos.actions).max() <= 1.0
    assert demos.terminations[-1] and demos.rewards[-1] == 1.0  # the episode ends in success
    assert 0 < demos.script_success[SOUP] <= 1
    with pytest.raises(ValueError, match=r"not 0 open_the_middle_drawer.*covered tasks: \[1, 2, 4"):
        collect_libero_demos("libero_goal", 1, tasks=[0])


def test_the_flow_policy_clones_then_trains_with_grpo_on_libero(tmp_path, capsys):
    """Issue 48 on LIBERO: `tidal sft` (flow matching on a scripted demo), then a GRPO step
    through the stochastic chain starting from the saved policy."""
    import json

    from tidal.cli import main

    flow = EXAMPLE.parent / "libero_object_flow_grpo.yaml"
    small = [
        f"runner.run_dir={tmp_path}/runs",
        f"model.path={tmp_path}/flow",
        "env.adapter_kwargs.tasks=[0]",
        "env.max_episode_steps=16",
        "env.eval_num_envs=1",
        "sft.demos=1",
        "sft.steps=20",
        "sft.batch_size=32",
    ]
    assert main(["sft", str(flow), *small]) == 0
    cloned = json.loads(capsys.readouterr().out)
    assert cloned["demos"] == 1 and cloned["final_loss"] < cloned["first_loss"]
    rl = [
        *small,
        "runner.max_steps=1",
        "env.total_num_envs=4",
        "rollout.num_steps=2",
        "actor.global_batch_size=8",
        "actor.micro_batch_size=8",
    ]
    assert main(["train", str(flow), *rl]) == 0
    rows = [json.loads(x) for x in (tmp_path / "runs/libero_object_flow_grpo/metrics.jsonl").open()]
    step = next(r for r in rows if "train/policy_loss" in r)
    assert step["step"] == 1 and 0 <= step["rollout/success_rate"] <= 1
    assert f"eval_sampled/success_rate/{SOUP}" in rows[0]  # the clone, before RL: ODE and chain
