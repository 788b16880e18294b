"""SAC's transitions and replay buffer: chunk transitions, wrapping, saving into another
capacity, pixels stored as bytes, demonstrations and the RLPD run that samples them."""

import pytest
import torch
from sac_runs import TINY, load, read_metrics, run, transitions

from tidal.config import ConfigError
from tidal.data import EnvOutput
from tidal.data.replay import ReplayBuffer, buffer_layout, fit_demos
from tidal.envs.demos import collect_metaworld_demos
from tidal.envs.recorder import chunk_transition
from tidal.runners.embodied.offpolicy import OffPolicyRunner


def test_a_chunk_transition_keeps_the_final_observation_and_the_end():
    obs = torch.zeros(3, 2)
    out = EnvOutput(
        obs=torch.tensor([[9.0, 9.0], [1.0, 1.0], [8.0, 8.0]]),  # envs 0 and 2 were reset
        final_obs=torch.tensor([[5.0, 5.0], [1.0, 1.0], [6.0, 6.0]]),
        rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]),
        terminations=torch.tensor([[True, False], [False, False], [False, False]]),
        truncations=torch.tensor([[False, False], [False, False], [False, True]]),
        dones=torch.tensor([[True, False], [False, False], [False, True]]),
    )
    t = chunk_transition(obs, torch.zeros(3, 2, 1), out, gamma=0.5)
    assert t["terminations"].tolist() == [True, False, False]
    assert t["truncations"].tolist() == [False, False, True]
    assert t["next_obs"].tolist() == [[5.0, 5.0], [1.0, 1.0], [6.0, 6.0]]
    assert t["rewards"].tolist() == [1.0, 1.5, 1.5]
    assert t["steps"].tolist() == [1, 2, 2]


def test_the_buffer_wraps_around_and_samples_demos_symmetrically(tmp_path):
    buf = ReplayBuffer(5, 3, (1, 1))
    buf.add(transitions(4))
    buf.add(transitions(3, start=4))
    assert (buf.size, buf.pos, buf.added) == (5, 2, 7)
    assert sorted(buf.data["rewards"].tolist()) == [2.0, 3.0, 4.0, 5.0, 6.0]
    demos = transitions(10, start=100)
    torch.save(demos, tmp_path / "demos.pt")
    assert buf.load_demos(str(tmp_path / "demos.pt")) == 10
    batch = buf.sample(8, torch.Generator().manual_seed(0), demo_fraction=0.5)
    assert (batch["rewards"] >= 100).sum() == 4 and batch["obs"].shape == (8, 3)
    restored = ReplayBuffer(5, 3, (1, 1))
    assert restored.load_state_dict(buf.state_dict(with_data=True))
    torch.testing.assert_close(restored.data["rewards"], buf.data["rewards"])
    assert not ReplayBuffer(5, 3, (1, 1)).load_state_dict(buf.state_dict(with_data=False))


@pytest.mark.parametrize("capacity", [3, 5, 8])
def test_a_saved_buffer_comes_back_into_another_capacity_newest_first(capacity):
    """Saved wrapped (rewards 2..6 in a ring of 5, the oldest in slot 2), restored into a
    smaller, the same or a larger ring: the newest that fit, and the next transition goes
    after them (into a larger ring, the buffer grew over rows of zeros)."""
    saved = ReplayBuffer(5, 3, (1, 1))
    saved.add(transitions(4))
    saved.add(transitions(3, start=4))
    restored = ReplayBuffer(capacity, 3, (1, 1))
    assert restored.load_state_dict(saved.state_dict(with_data=True))
    restored.add(transitions(1, start=7))
    held = restored.data["rewards"][: restored.size]
    if capacity == 5:  # the same ring: slot for slot, so the resume samples as the saved run
        assert held.tolist() == [5.0, 6.0, 7.0, 3.0, 4.0]
    else:
        newest = list(range(max(2, 8 - capacity), 8))
        assert sorted(held.tolist()) == newest and restored.size == min(6, capacity)
    assert restored.added == 8
    empty = ReplayBuffer(capacity, 3, (1, 1))  # saved before any transition was stored
    assert empty.load_state_dict(ReplayBuffer(5, 3, (1, 1)).state_dict(with_data=True))
    assert (empty.size, empty.pos) == (0, 0)


def test_demonstrations_that_are_not_finite_or_chunked_are_read_as_such():
    layout = buffer_layout(3, (4, 1))  # chunks of 4 actions
    demos = {**transitions(5), "actions": torch.zeros(5, 4, 1)}
    del demos["steps"]
    assert fit_demos(demos, layout, "x")["steps"].tolist() == [4] * 5  # env steps, not 1
    demos["rewards"][[1, 3]] = float("nan")
    with pytest.raises(ConfigError, match=r"x: rewards is not finite in 2 of 5 .*first: 1"):
        fit_demos(demos, layout, "x")


def test_a_demo_file_of_the_wrong_shape_is_a_config_error(tmp_path):
    demos = transitions(4)
    demos["obs"] = torch.zeros(4, 5)
    torch.save(demos, tmp_path / "demos.pt")
    with pytest.raises(ConfigError, match=r"replay.demo_path: .*: obs has shape \(4, 5\)"):
        ReplayBuffer(8, 3, (1, 1)).load_demos(str(tmp_path / "demos.pt"))
    cfg = load(f"runner.run_dir={tmp_path}", f"replay.demo_path={tmp_path / 'demos.pt'}")
    with pytest.raises(ConfigError, match="replay.demo_path"):
        OffPolicyRunner(cfg)  # before any worker starts
    assert buffer_layout(3, (1, 1))["obs"][0] == (3,)


def test_the_buffer_stores_pixels_as_uint8_and_gives_them_back_as_floats():
    n, image = 6, 4 * 4 * 3
    obs = torch.cat([torch.randn(n, 2), torch.randint(0, 256, (n, image)).float()], 1)
    batch = {**transitions(n), "obs": obs, "next_obs": obs.flip(0)}
    buf = ReplayBuffer(8, 2 + image, (1, 1), image_numel=image)
    buf.add(batch)
    assert buf.data["obs_pixels"].dtype == torch.uint8 and buf.data["obs"].shape == (8, 2)
    got = buf.sample(16, torch.Generator().manual_seed(0))
    rows = got["rewards"].long()
    torch.testing.assert_close(got["obs"], obs[rows])
    torch.testing.assert_close(got["next_obs"], obs.flip(0)[rows])


def test_scripted_demonstrations_are_transitions_as_executed():
    """RLPD's demos from MetaWorld's experts: the noisy action sent (not the expert's label),
    the reward it earned, and the observation it led to (the next step's own)."""
    demos = collect_metaworld_demos("reach-v3", 2, action_noise=0.3, instruction_tokens=4)
    t = demos.transitions()
    n = len(demos.obs)
    assert t["actions"].shape == (n, 1, 4) and t["next_obs"].shape == t["obs"].shape
    assert not torch.equal(t["actions"][:, 0], torch.from_numpy(demos.actions))  # noise kept
    assert t["actions"].abs().max() <= 1.0 and torch.isfinite(t["rewards"]).all()
    same_episode = torch.from_numpy(demos.episode[1:] == demos.episode[:-1])
    assert torch.equal(t["next_obs"][:-1][same_episode], t["obs"][1:][same_episode])


def test_an_rlpd_run_samples_the_scripted_demonstrations(tmp_path, monkeypatch):
    """Every update's minibatch holds replay.demo_fraction of demonstrations, from the first
    update on: each row sampled is matched (observation and action) against the demos held."""
    sampled = []  # per minibatch: (its rows, how many are demonstrations)
    sample = ReplayBuffer.sample

    def counting_sample(self, batch_size, generator, demo_fraction=0.0):
        batch = sample(self, batch_size, generator, demo_fraction)
        demos = 0
        if self.demos is not None:
            rows = torch.cat([batch["obs"], batch["actions"].flatten(1)], 1)
            held = torch.cat([self.demos["obs"], self.demos["actions"].flatten(1)], 1)
            demos = int((rows[:, None] == held[None]).all(-1).any(1).sum())
        sampled.append((len(batch["rewards"]), demos))
        return batch

    monkeypatch.setattr(ReplayBuffer, "sample", counting_sample)
    summary, held = run(
        tmp_path,
        *TINY,
        "env.adapter=metaworld",
        "env.id=reach-v3",
        "env.max_episode_steps=40",
        "env.total_num_envs=2",
        "env.adapter_kwargs={instruction_tokens: 4}",
        "replay.sft_demos=true",
        "replay.demo_fraction=0.25",
        "sft.demos=2",
        "runner.max_env_steps=160",
        inspect=lambda r: r.actor.execute_on(0).demo_count().wait(30)[0],
    )
    updates = read_metrics(summary["run_dir"])[-1]["updates"]
    assert held > 0 and updates > 0 and len(sampled) == updates
    assert set(sampled) == {(32, 8)}, sampled  # replay.batch_size 32, a quarter demos
