"""actor.strategy: DDP and FSDP2 take the same steps on the same batches (2 ranks on ray), FSDP2's
sharded checkpoints resume on another world size and survive a crash mid-save, the memory plan
matches the tensors, and bad input is a config error naming the key."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from strategy_workers import EngineWorker, actor_config, build_model, make_batches, train_steps

from tidal.checkpoint import load_checkpoint, resolve_checkpoint
from tidal.config import ConfigError, EmbodiedConfig, load_config
from tidal.engine import TrainEngine
from tidal.memory import plan
from tidal.runtime import Cluster
from tidal.strategies import STRATEGIES

STEPS, ROWS = 4, 8  # global rows per step: 4 per rank, 2 micro-batches of 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One Ray session, one group of 2 ranks: every model under both strategies (a NaN loss at
    step 1, skipped), and an FSDP2 checkpoint of the LM after step 2."""
    folder = tmp_path_factory.mktemp("strategies")
    cluster = Cluster("ray", devices_per_node=2, ray_init_kwargs={"num_cpus": 2})
    try:
        group = EngineWorker.create_group().launch(cluster, 2, name="engines")
        out = {}
        for kind in ("lm", "vla"):
            for strategy in ("ddp", "fsdp2"):
                save = (
                    (2, str(folder / "ck" / "step_000002"))
                    if (kind, strategy) == ("lm", "fsdp2")
                    else None
                )
                out[kind, strategy] = group.train(
                    kind, strategy, STEPS, ROWS, poison_step=1, save=save
                ).wait(120)
        out["checkpoints"] = folder / "ck"
        yield out
    finally:
        cluster.shutdown()


@pytest.fixture
def single_process_group():
    """FSDP2 in this process: the engine starts a process group of one; gone afterwards."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def assert_close_relative(a: torch.Tensor, b: torch.Tensor, what: str, tol=1e-5):
    scale = a.abs().max().clamp_min(1e-8)
    assert ((a - b).abs().max() / scale).item() <= tol, what


@pytest.mark.parametrize("kind", ["lm", "vla"])
def test_ddp_and_fsdp2_take_the_same_steps(results, kind):
    ddp, fsdp = results[kind, "ddp"], results[kind, "fsdp2"]
    # every rank reports the same (reduced) losses and norms; the NaN step skipped on both
    for rank in (0, 1):
        assert fsdp[rank]["skipped"] == ddp[rank]["skipped"] == 1
        for a, b in zip(ddp[rank]["history"], fsdp[rank]["history"]):
            torch.testing.assert_close(
                torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0, equal_nan=True
            )
    assert min(n for _, n in ddp[0]["history"] if n == n) > 0.5  # clipping was active
    weights_ddp, weights_fsdp = ddp[0]["weights"], fsdp[0]["weights"]
    assert fsdp[1]["weights"] is None and set(weights_ddp) == set(weights_fsdp)
    for k in weights_ddp:
        assert weights_fsdp[k].dtype == weights_ddp[k].dtype
        assert_close_relative(weights_ddp[k], weights_fsdp[k], k)
    if kind == "vla":  # a forward method besides forward gathers its parameters too
        assert_close_relative(ddp[0]["value"], fsdp[0]["value"], "value")
    before = build_model(kind).state_dict()
    assert any(not torch.equal(before[k], weights_ddp[k]) for k in before)


@pytest.mark.parametrize("kind", ["lm", "vla"])
def test_memory_plan_matches_the_tensors_and_fsdp2_halves_it(results, kind):
    with torch.device("meta"):
        model = build_model(kind)
    for strategy in ("ddp", "fsdp2"):
        expected = plan(model, actor_config(strategy), 2)
        counted = [r["bytes"] for r in results[kind, strategy]]
        ranks = 1 if strategy == "ddp" else 2  # a DDP rank holds it all, FSDP2's hold halves
        for key, planned in (
            ("params", expected.param_bytes),
            ("grads", expected.grad_bytes),
            ("optimizer", expected.optimizer_bytes),
        ):
            total = sum(c[key] for c in counted[:ranks])
            assert abs(total - planned * ranks) <= 4 * ranks, (strategy, key, total, planned)
    ddp = sum(results[kind, "ddp"][0]["bytes"].values())
    fsdp = max(sum(r["bytes"].values()) for r in results[kind, "fsdp2"])
    assert fsdp <= 0.55 * ddp


def test_fsdp2_checkpoint_resumes_on_one_rank(results, single_process_group):
    """Saved by 2 ranks after step 2, resumed by 1 (resharded): steps 3 and 4 give the 2-rank
    run's weights; tidal eval's loader gathers the whole model from the shards."""
    folder = resolve_checkpoint(results["checkpoints"])
    assert folder.name == "step_000002" and (folder / "shards" / ".metadata").is_file()
    assert json.loads((folder / "meta.json").read_text())["strategy"] == "fsdp2"
    assert not list(folder.parent.glob(".step_*"))  # no staging folder left
    engine = TrainEngine(build_model("lm"), actor_config("fsdp2"), 10)
    assert engine.load(folder)["step"] == 2 and engine.step == 2
    full, _, _ = load_checkpoint(folder)
    for k, v in engine.full_state_dict().items():
        assert torch.equal(full[k], v), k
    batches = make_batches("lm", STEPS, ROWS)[2:]
    train_steps(engine, "lm", batches, rank=0, world=1, micro_per_rank=4)
    expected = results["lm", "fsdp2"][0]["weights"]
    for k, v in engine.full_state_dict().items():
        assert_close_relative(expected[k], v, k)


def test_a_crash_mid_save_leaves_the_previous_checkpoint(
    tmp_path, monkeypatch, single_process_group
):
    import torch.distributed.checkpoint as dcp

    engine = TrainEngine(build_model("lm"), actor_config("fsdp2"), 10)
    engine.save(tmp_path / "step_000001", {"step": 1})

    def crash(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        engine.save(tmp_path / "step_000002", {"step": 2})
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert not (tmp_path / "step_000002").exists()


# ----------------------------------------------------------------------------- bad input


def _embodied(*overrides):
    return load_config(EmbodiedConfig, "examples/embodied/cartpole_ppo.yaml", list(overrides))


TWO_ACTORS = 'cluster.placement={env: "0", rollout: "0", actor: "0-1"}'


def test_fsdp2_over_local_ranks_and_fsdp_keys_without_it_are_config_errors():
    from tidal.runners.preflight import check_embodied

    cfg = _embodied("actor.strategy=fsdp2", TWO_ACTORS, "actor.micro_batch_size=64")
    with pytest.raises(ConfigError, match=r"^actor.strategy: fsdp2 over 2 actor ranks .*ray"):
        check_embodied(cfg)
    with pytest.raises(ConfigError, match=r"^actor.fsdp.cpu_offload: is an FSDP2 option"):
        check_embodied(_embodied("actor.fsdp.cpu_offload=true"))
    with pytest.raises(ConfigError, match=r"^actor.strategy: expected one of ddp, fsdp2"):
        check_embodied(_embodied("actor.strategy=zero"))


def test_a_language_model_without_decoder_layers_to_shard_is_a_config_error(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    fsdp2 = STRATEGIES.get("fsdp2")
    fsdp2.check_model(lambda: build_model("lm"))  # Llama's decoder layers are found
    monkeypatch.setattr(LlamaPreTrainedModel, "_no_split_modules", [])
    with pytest.raises(ConfigError, match=r"^actor.strategy: fsdp2 shards .* LlamaForCausalLM"):
        fsdp2.check_model(lambda: build_model("lm"))


def test_resuming_a_checkpoint_under_another_strategy_fails_before_any_worker(tmp_path):
    from tidal.runners.embodied.train import EmbodiedRunner

    ck = tmp_path / "step_000001"
    ck.mkdir()
    for name in ("model.safetensors", "state.pt"):
        (ck / name).write_bytes(b"")
    (ck / "meta.json").write_text(json.dumps({"step": 1}))  # no strategy: an older DDP one
    cfg = _embodied(
        "actor.strategy=fsdp2", f"runner.resume_from={ck}", f"runner.run_dir={tmp_path}"
    )
    with pytest.raises(ConfigError, match=r"^actor.strategy: .* written with actor.strategy=ddp"):
        EmbodiedRunner(cfg)
    assert not list(tmp_path.glob("run*"))  # no run folder made


def test_fsdp2_options_bf16_offload_and_no_reshard_train(single_process_group):
    """The mixed-precision policy (actor.bf16), CPU offload and keeping gathered layers."""
    cfg = actor_config("fsdp2", bf16=True)
    cfg.fsdp.cpu_offload, cfg.fsdp.reshard_after_forward = True, False
    engine = TrainEngine(build_model("lm"), cfg, 10)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    history = train_steps(engine, "lm", make_batches("lm", 1, 4), rank=0, world=1, micro_per_rank=2)
    after = engine.full_state_dict()
    assert all(v.dtype == torch.float32 for v in after.values())  # fp32 shards, bf16 compute
    assert history[0][1] > 0 and any(not torch.equal(before[k], after[k]) for k in before)


def test_tidal_config_memory_plans_each_half(tmp_path, capsys):
    """Per actor rank, before anything is built: an embodied policy and a language model (on
    the meta device, from model.path's config), halved by fsdp2 over 2 ranks."""
    from tidal.cli import main
    from tidal.inference.tiny import save_tiny_model

    assert main(["config", "examples/embodied/cartpole_ppo.yaml", "--memory"]) == 0
    out = capsys.readouterr().out
    assert "# actor memory per rank (ddp, 1 rank(s)" in out and "#   optimizer state" in out
    folder = save_tiny_model(tmp_path / "lm")
    base = ["config", "examples/llm/arith_grpo.yaml", f"model.path={folder}"]
    two = [
        "actor.strategy=fsdp2",
        "cluster.backend=ray",
        'cluster.placement={rollout: "0", actor: "0-1"}',
    ]
    totals = {}
    for name, extra in (("ddp", []), ("fsdp2", two)):
        assert main([*base, *extra, "--memory"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("#   total"))
        value, unit = line.split()[2:4]
        totals[name] = float(value) * {"KiB": 2**10, "MiB": 2**20}[unit]
    assert totals["fsdp2"] == pytest.approx(totals["ddp"] / 2, rel=1e-2)
