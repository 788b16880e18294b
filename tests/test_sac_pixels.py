"""SAC's encoders: DrQ's random shift, what trains the encoder, instruction words as an
embedding, and a short pixel run."""

import math
from types import SimpleNamespace

import pytest
import torch
from gymnasium.spaces import Box
from sac_runs import EXAMPLES, TINY, load, read_metrics, run, transitions

from tidal.config import ConfigError
from tidal.envs.layout import LayoutBox, ObsLayout
from tidal.models.sac import SquashedGaussianPolicy
from tidal.models.sac_cnn import random_shift, shift_observations
from tidal.runners.embodied.offpolicy import OffPolicyRunner
from tidal.runtime import ConfigSections
from tidal.workers.sac_actor import SACActor


def test_random_shift_translates_each_image_by_whole_pixels_with_the_border_replicated():
    images = torch.rand(12, 3, 8, 8)
    gen = torch.Generator().manual_seed(0)
    assert random_shift(images, 0, gen) is images
    shifted = random_shift(images, 2, gen)
    assert shifted.shape == images.shape
    padded = torch.nn.functional.pad(images, (2,) * 4, mode="replicate")
    crops = {(dy, dx): padded[:, :, dy : dy + 8, dx : dx + 8] for dy in range(5) for dx in range(5)}
    found = []
    for i in range(len(images)):
        hits = [k for k, c in crops.items() if torch.allclose(shifted[i], c[i], atol=1e-5)]
        assert len(hits) == 1, f"image {i}: not one whole-pixel crop of the padded image"
        found.append(hits[0])
    assert len(set(found)) > 3  # each image its own offset
    # a packed observation: the state before the pixels passes unchanged
    layout = ObsLayout(state_dim=2, image_size=8)
    obs = torch.cat([torch.randn(12, 2), images.movedim(1, -1).reshape(12, -1) * 255], 1)
    out = shift_observations(obs, layout, 2, gen)
    assert out.shape == obs.shape and torch.equal(out[:, :2], obs[:, :2])


@pytest.mark.parametrize("model", ["sac_cnn", "sac_mlp"])
def test_the_encoder_learns_from_the_critic_loss_only(monkeypatch, model):
    """The actor worker's own update: which of its optimizer steps reach the encoder (sac_cnn's
    convolutions and words; sac_mlp's words, when the observation carries instructions)."""
    monkeypatch.setattr(SACActor, "torch_device", lambda self, setting: torch.device("cpu"))
    monkeypatch.setattr(SACActor, "rank", 0)  # built outside a group: rank 0 of 1
    monkeypatch.setattr(SACActor, "world_size", 1)
    pixels = model == "sac_cnn"
    cfg = load(
        f"model.name={model}",
        "model.hidden_sizes=[16]",
        "model.kwargs={channels: [4], feature_dim: 8}" if pixels else "model.kwargs={}",
        "replay.batch_size=8",
        f"algorithm.image_pad={int(pixels)}",
    )
    layout = ObsLayout(state_dim=2, num_tokens=3, vocab_size=64, image_size=8 if pixels else 0)
    space = LayoutBox(layout)
    sections = ConfigSections("actor", cfg, SACActor.config_sections)
    worker = SACActor(sections, SimpleNamespace(env=1, stages=1), space, Box(-1, 1, (2,)))
    n = 16
    obs = torch.cat(
        [
            torch.randn(n, 2),
            torch.randint(1, 64, (n, 3)).float(),
            torch.randint(0, 256, (n, layout.image_numel)).float(),
        ],
        1,
    )
    worker.buffer.add(
        {**transitions(n), "obs": obs, "next_obs": obs, "actions": torch.zeros(n, 1, 2)}
    )
    encoder = worker.policy.encoder_parameters()
    reached, step = {}, worker.engine.step_loss

    def recording_step(name, loss):
        for p in encoder:
            p.grad = None
        done = step(name, loss)
        reached[name] = any(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder)
        return done

    worker.engine.step_loss = recording_step
    worker.update(1)
    assert reached == {"critic": True, "actor": False, "alpha": False}


def test_sac_mlp_reads_instruction_words_as_an_embedding_not_as_numbers():
    """MT10's task arrives as hashed word ids (up to the vocabulary's size): sac_mlp embeds them
    beside the state, so no id reaches its networks as a number."""
    space = LayoutBox(ObsLayout(state_dim=3, num_tokens=4, vocab_size=1024))
    policy = SquashedGaussianPolicy(space, Box(-1, 1, (2,)), hidden_sizes=(16,))
    tokens = torch.tensor([[1000, 900, 0, 0], [3, 0, 0, 0]])
    obs = torch.cat([torch.randn(2, 3), tokens.float()], 1)
    features = policy.encode(obs)
    assert features.shape == (2, 32 + 3) and policy.net[0].in_features == 35
    assert torch.equal(features[:, :32], policy.encoder.words(tokens))
    assert torch.equal(features[:, 32:], obs[:, :3])
    assert features.abs().max() < 10  # (an id read as a number would be 1000 here)
    assert policy.encoder_parameters() == list(policy.encoder.parameters())
    with pytest.raises(ValueError, match="pixel observations need model.name sac_cnn"):
        SquashedGaussianPolicy(LayoutBox(ObsLayout(state_dim=3, image_size=8)), Box(-1, 1, (2,)))
    plain = SquashedGaussianPolicy(Box(-1, 1, (3,)), Box(-1, 1, (2,)), hidden_sizes=(16,))
    assert plain.encoder is None and plain.encoder_parameters() == []


def test_sac_cnn_without_pixels_is_refused_before_start(tmp_path):
    cfg = load(f"runner.run_dir={tmp_path}", "model.name=sac_cnn")
    with pytest.raises(ConfigError, match="sac_cnn': needs pixel observations"):
        OffPolicyRunner(cfg)


def test_a_short_pixel_sac_run_updates_and_evaluates(tmp_path):
    summary, _ = run(
        tmp_path,
        *TINY,
        "model.kwargs={channels: [8, 8], feature_dim: 16}",
        "env.image_size=16",
        "env.total_num_envs=2",
        "env.max_episode_steps=20",
        "runner.max_env_steps=80",
        "runner.eval_interval=3",
        "replay.warmup_steps=32",
        "replay.batch_size=16",
        path=EXAMPLES / "metaworld_reach_pixels_sac.yaml",
    )
    rows = read_metrics(summary["run_dir"])
    assert rows[-1]["updates"] > 0 and math.isfinite(rows[-1]["train/critic_loss"])
    assert rows[-1]["eval/return_mean"] is not None
