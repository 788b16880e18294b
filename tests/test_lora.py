"""LoRA (``model.lora``): only adapters train, the reference is the base with adapters disabled,
the rollout and saved folders get merged weights, checkpoints hold adapters, bad input fails
naming its key."""

import json

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tidal.checkpoint import checkpoint_weights, load_checkpoint
from tidal.config import ActorConfig, ConfigError
from tidal.config.lora import LoRAConfig
from tidal.engine import TrainEngine
from tidal.models.lora import (
    apply_lora,
    base_name,
    check_checkpoint_lora,
    check_lora,
    lora_meta,
    merged_state_dict,
    reference_model,
    rollout_state_dict,
    save_pretrained_folder,
)
from tidal.models.policy import build_policy

IDS = torch.tensor([[3, 9, 4, 1, 7, 2], [5, 5, 8, 6, 0, 2]])


def tiny_qwen(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg)


def lm_loss(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    return loss, {"loss": loss.item()}


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def trained_lora(seed=0, steps=2, strategy="ddp"):
    """A LoRA model a few optimizer steps away from its base (adapters no longer zero)."""
    model = apply_lora(tiny_qwen(), LoRAConfig(rank=4, alpha=8))
    torch.manual_seed(seed)
    engine = TrainEngine(model, ActorConfig(lr=0.05, strategy=strategy), 10)
    for _ in range(steps):
        engine.train_batch([IDS], lm_loss)
        engine.end_step()
    return model, engine


def test_only_adapters_train_and_have_optimizer_state():
    base = tiny_qwen()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model, engine = trained_lora()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear layer of attention and MLP, none of the embeddings or the head
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    state = engine.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)  # Adam moments of the adapters only
    frozen = {base_name(k): v for k, v in model.get_base_model().state_dict().items()}
    for key, value in before.items():  # the base did not move
        assert torch.equal(frozen[key], value), key


def test_the_reference_is_the_base_and_the_rollout_gets_merged_weights(tmp_path):
    model, _ = trained_lora()
    base = tiny_qwen()
    ref = reference_model(model, keep=True)
    torch.testing.assert_close(logits(ref), logits(base), rtol=0, atol=0)
    assert not torch.allclose(logits(model), logits(base))  # the adapters moved the policy
    assert reference_model(model, keep=False) is None

    adapters = {k: v.clone() for k, v in model.state_dict().items()}
    merged = rollout_state_dict(model)
    assert set(merged) == set(base.state_dict())  # the names the engine's servers expect
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in adapters.items())  # not merged in
    base.load_state_dict(merged)
    torch.testing.assert_close(logits(base), logits(model), rtol=1e-5, atol=1e-5)

    save_pretrained_folder(model, tmp_path / "weights")  # what vLLM reloads
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "weights", local_files_only=True)
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=1e-5, atol=1e-5)
    assert rollout_state_dict(tiny_qwen()).keys() == merged.keys()  # without LoRA: as it is


@pytest.fixture
def no_process_group_left():
    """FSDP2 in this process starts a process group of one: gone afterwards."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_lora_checkpoint_holds_the_adapters_and_resumes_exactly(
    tmp_path, strategy, no_process_group_left
):
    model, engine = trained_lora(strategy=strategy)
    engine.save(tmp_path / "ck", {"step": 2, "lora": lora_meta(LoRAConfig(rank=4, alpha=8))})
    for _ in range(2):
        engine.train_batch([IDS.flip(1)], lm_loss)
        engine.end_step()
    expected = {k: v.clone() for k, v in engine.full_state_dict().items()}

    saved, state, _ = load_checkpoint(tmp_path / "ck")
    assert set(saved) == {n for n, p in model.named_parameters() if p.requires_grad}
    if strategy == "ddp":  # (fsdp2's optimizer state is in its shards: tests/test_strategies.py)
        assert len(state["optimizer"]["state"]) == len(saved)

    torch.manual_seed(123)  # other adapter initialisations: the checkpoint overwrites them
    resumed_model = apply_lora(tiny_qwen(), LoRAConfig(rank=4, alpha=8))
    resumed = TrainEngine(resumed_model, ActorConfig(lr=0.05, strategy=strategy), 10)
    assert resumed.load(tmp_path / "ck")["step"] == 2
    for _ in range(2):
        resumed.train_batch([IDS.flip(1)], lm_loss)
        resumed.end_step()
    for key, value in resumed.full_state_dict().items():
        assert torch.equal(value, expected[key]), key

    weights = checkpoint_weights(tiny_qwen(), tmp_path / "ck", LoRAConfig(rank=4, alpha=8))
    plain = tiny_qwen()
    plain.load_state_dict(weights)
    ref, _ = trained_lora()
    torch.testing.assert_close(logits(plain), logits(ref), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_resumed_with_other_lora_settings_is_a_config_error():
    lora = LoRAConfig(rank=4, alpha=8)
    with pytest.raises(ConfigError, match=r"model.lora.rank: ck holds LoRA adapters of rank 4"):
        check_checkpoint_lora({"lora": lora_meta(lora)}, LoRAConfig(), "ck")
    with pytest.raises(ConfigError, match=r"model.lora.rank: ck holds full weights.*rank=4"):
        check_checkpoint_lora({}, lora, "ck")  # and older checkpoints: full weights
    with pytest.raises(ConfigError, match=r"model.lora.rank: ck holds adapters made with"):
        check_checkpoint_lora({"lora": lora_meta(lora)}, LoRAConfig(rank=8, alpha=8), "ck")
    check_checkpoint_lora({"lora": lora_meta(lora)}, LoRAConfig(rank=4, alpha=8), "ck")


def test_targets_that_match_nothing_and_policies_without_linear_layers_are_refused():
    with pytest.raises(
        ConfigError,
        match=r"model.lora.target_modules: \['qkv'\] match no linear layer of 'm'; its linear "
        r"layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj",
    ):
        check_lora(tiny_qwen(), LoRAConfig(rank=4, target_modules=["q_proj", "qkv"]), "'m'")
    convs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    with pytest.raises(ConfigError, match=r"model.lora.rank: policy 'convs' has no linear layers"):
        check_lora(convs, LoRAConfig(rank=4), "policy 'convs'")
    check_lora(convs, LoRAConfig(rank=0), "policy 'convs'")  # off: nothing to check


def test_the_vla_trunk_gets_adapters_that_act_in_evaluation_too():
    obs = gym.spaces.Box(-1, 1, (6,), np.float32)
    act = gym.spaces.Box(-1, 1, (2,), np.float32)
    torch.manual_seed(0)
    policy = build_policy("vla", obs, act, 2, hidden_size=32, num_heads=2, num_layers=2)
    torch.nn.init.normal_(policy.action_head.weight)  # zero at start: every action equally likely
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    model = apply_lora(policy, LoRAConfig(rank=4, alpha=8), "policy 'vla'")
    trainable = {
        n.split(".base_model.model.")[-1] for n, p in model.named_parameters() if p.requires_grad
    }
    assert any(".linear1.lora_A." in n for n in trainable)
    assert all(".lora_" in n or ".modules_to_save." in n for n in trainable)
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.5)
    inputs, actions = {"obs": torch.randn(5, 6)}, torch.randint(0, 256, (5, 2, 2))

    def logp(m):
        with torch.no_grad():  # eval without grad: torch's fused encoder path, were it not off
            return m(inputs, actions)["logprobs"]

    model.eval()
    plain = build_policy("vla", obs, act, 2, hidden_size=32, num_heads=2, num_layers=2).eval()
    plain.load_state_dict(base)
    assert not torch.allclose(logp(model), logp(plain))
    torch.testing.assert_close(logp(reference_model(model, keep=True)), logp(plain))
    plain.load_state_dict(merged_state_dict(model))  # the rollout's policy: plain, merged
    torch.testing.assert_close(logp(plain), logp(model), rtol=1e-5, atol=1e-5)
    assert json.dumps(sorted(merged_state_dict(model))) == json.dumps(sorted(base))


# ----------------------------------------------------------------------------- tidal export


def _run_folder(tmp_path, schema, overrides, model, engine, lora):
    """A run folder as training leaves it: config.yaml and a checkpoint of ``engine``."""
    from tidal.config import load_config, to_yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(schema, None, overrides)))
    meta = {"step": engine.step, "version": engine.step, "lora": lora_meta(lora)}
    engine.save(run / "checkpoints" / "step_000002", meta)
    return run


def test_export_writes_a_merged_hugging_face_folder(tmp_path):
    from transformers import AutoTokenizer

    from tidal.cli import main
    from tidal.config.llm import LLMConfig
    from tidal.inference import GenerationEngine
    from tidal.inference.tiny import save_tiny_chat_model
    from tidal.models.llm import load_causal_lm

    base = save_tiny_chat_model(tmp_path / "base", corpus=["1 + 2 = 3"] * 8, vocab_size=300)
    lora = LoRAConfig(rank=4, alpha=8)
    model = apply_lora(load_causal_lm(base)[0], lora)
    engine = TrainEngine(model, ActorConfig(lr=0.05), 10)
    for _ in range(2):
        engine.train_batch([IDS], lm_loss)
        engine.end_step()
    overrides = [f"model.path={base}", "model.lora.rank=4", "model.lora.alpha=8"]
    run = _run_folder(tmp_path, LLMConfig, overrides, model, engine, lora)

    assert main(["export", str(run), "-o", str(tmp_path / "out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    torch.testing.assert_close(logits(exported), logits(model), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(exported), logits(load_causal_lm(base)[0]))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(base).chat_template
    GenerationEngine(str(tmp_path / "out"))  # what tidal serve loads

    # a checkpoint of adapters exported with a config that has none is a config error
    assert main(["export", str(run), "-o", str(tmp_path / "out")]) == 2  # not empty
    (run / "config.yaml").write_text(
        (run / "config.yaml").read_text().replace("rank: 4", "rank: 0")
    )
    assert main(["export", str(run), "-o", str(tmp_path / "out2")]) == 2


def test_export_writes_the_saved_policy_folder_of_an_embodied_run(tmp_path):
    from tidal.config import EmbodiedConfig
    from tidal.models.saving import load_policy, save_policy
    from tidal.runners.export import export

    obs = gym.spaces.Box(-1, 1, (6,), np.float32)
    act = gym.spaces.Box(-1, 1, (2,), np.float32)
    kwargs = {"hidden_size": 32, "num_heads": 2, "num_layers": 1}
    torch.manual_seed(0)
    save_policy(build_policy("vla", obs, act, 2, **kwargs), tmp_path / "bc")
    lora = LoRAConfig(rank=2, alpha=4)
    model = apply_lora(load_policy(tmp_path / "bc"), lora, "policy 'vla'")
    engine = TrainEngine(model, ActorConfig(lr=0.05), 10)
    inputs, actions = {"obs": torch.randn(8, 6)}, torch.randint(0, 256, (8, 2, 2))

    def nll(m, _):
        loss = -m(inputs, actions)["logprobs"].mean()
        return loss, {}

    for _ in range(2):
        engine.train_batch([None], nll)
        engine.end_step()
    overrides = [
        "model.name=vla",
        f"model.path={tmp_path / 'bc'}",
        "env.num_action_chunks=2",
        "model.lora.rank=2",
        "model.lora.alpha=4",
    ]
    run = _run_folder(tmp_path, EmbodiedConfig, overrides, model, engine, lora)
    assert export(run, tmp_path / "out")["lora"] == 2
    exported = load_policy(tmp_path / "out").eval()
    model.eval()
    with torch.no_grad():
        logp = exported(inputs, actions)["logprobs"]
        torch.testing.assert_close(logp, model(inputs, actions)["logprobs"])
        assert not torch.allclose(logp, load_policy(tmp_path / "bc")(inputs, actions)["logprobs"])


# ----------------------------------------------------------------------------- a language run


def test_a_lora_run_trains_adapters_with_a_kl_reference_and_resumes(tmp_path):
    """The actor sends merged weights to tidal's servers (which validate every name and shape),
    keeps the KL reference as its base, checkpoints the adapters and resumes; resuming that
    checkpoint without LoRA fails before anything starts; tidal eval scores it (merged)."""
    from tidal.config import load_config
    from tidal.config.llm import LLMConfig
    from tidal.inference.tiny import save_tiny_model
    from tidal.runners.llm.eval import run_eval
    from tidal.runners.llm.train import LLMRunner

    base = save_tiny_model(tmp_path / "base", hidden=32, layers=1, heads=2)
    overrides = [
        f"model.path={base}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.eval_interval=0",
        "runner.max_steps=2",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "model.lora.rank=4",
        "algorithm.kl_coef=0.1",
        "runner.experiment=lora",
    ]
    with LLMRunner(load_config(LLMConfig, None, overrides)) as runner:
        summary = runner.run()
    saved, _, meta = load_checkpoint(summary["checkpoint"])
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert meta["lora"]["rank"] == 4
    resume = [f"runner.resume_from={summary['checkpoint']}"]
    with LLMRunner(load_config(LLMConfig, None, [*overrides, *resume, "runner.max_steps=3"])) as r:
        resumed = r.run()
    assert resumed["steps"] == 3 and resumed["run_dir"] == summary["run_dir"]
    evaluated = run_eval(
        load_config(LLMConfig, None, [*overrides, "data.eval_size=4"]), summary["checkpoint"], n=0
    )
    assert evaluated["records"] == 4 and evaluated["checkpoint"] == summary["checkpoint"]
    folders = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match=r"model.lora.rank: .* holds LoRA adapters of rank 4"):
        LLMRunner(load_config(LLMConfig, None, [*overrides, *resume, "model.lora.rank=0"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == folders  # no run folder was made


def test_the_preflight_checks_lora_on_a_skeleton_of_the_model_and_the_policy(tmp_path):
    from tidal.config import EmbodiedConfig, load_config
    from tidal.config.llm import LLMConfig
    from tidal.inference.tiny import save_tiny_model
    from tidal.runners.llm.preflight import check_llm_model
    from tidal.runners.preflight import check_policy_lora

    base = save_tiny_model(tmp_path / "base", hidden=32, layers=1, heads=2)
    bad = [f"model.path={base}", "model.lora.rank=4", "model.lora.target_modules=[c_attn]"]
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['c_attn'\] .* q_proj"):
        check_llm_model(load_config(LLMConfig, None, bad))
    check_llm_model(load_config(LLMConfig, None, bad[:2]))

    cfg = load_config(EmbodiedConfig, None, ["model.name=vla", "model.lora.rank=4"])
    obs = gym.spaces.Box(-1, 1, (6,), np.float32)
    act = gym.spaces.Box(-1, 1, (2,), np.float32)
    check_policy_lora(cfg.model, obs, act, 1)
    cfg.model.lora.target_modules = ["self_attn"]  # attention is no linear layer there
    with pytest.raises(ConfigError, match=r"\['self_attn'\] match no linear layer of policy 'vla'"):
        check_policy_lora(cfg.model, obs, act, 1)
