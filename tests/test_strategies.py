"""actor.strategy: DDP and FSDP2 take the steps one rank takes on the same batches (2 ranks on
ray), with LoRA adapters too (the same merged rollout weights), FSDP2's sharded checkpoints resume on another world size and survive a crash mid-save, the memory plan
matches the tensors, and bad input is a config error naming the key."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from strategy_workers import (
    LORA,
    EngineWorker,
    actor_config,
    build_model,
    make_batches,
    micro_loss,
    train_steps,
)

from tidal.checkpoint import (
    checkpoint_weights,
    load_checkpoint,
    load_model_state,
    resolve_checkpoint,
)
from tidal.config import ConfigError, EmbodiedConfig, load_config
from tidal.engine import TrainEngine
from tidal.inference.tiny import char_tokenizer
from tidal.memory import plan
from tidal.models.lora import rollout_weights
from tidal.runtime import Cluster
from tidal.strategies import STRATEGIES

STEPS, ROWS = 4, 8  # global rows per step: 4 per rank, 2 micro-batches of 2
CASES = [("lm", False), ("vla", False), ("lm", True), ("vla", True)]  # (model, LoRA)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One Ray session, one group of 2 ranks: every model, with and without LoRA, under both
    strategies (a NaN loss at step 1, skipped), and FSDP2 checkpoints of the LM (full, and its
    adapters) after step 2."""
    folder = tmp_path_factory.mktemp("strategies")
    cluster = Cluster("ray", devices_per_node=2, ray_init_kwargs={"num_cpus": 2})
    try:
        group = EngineWorker.create_group().launch(cluster, 2, name="engines")
        out = {}
        for kind, lora in CASES:
            for strategy in ("ddp", "fsdp2"):
                ck = folder / ("ck-lora" if lora else "ck")
                lm_fsdp2 = (kind, strategy) == ("lm", "fsdp2")
                save = (2, str(ck / "step_000002")) if lm_fsdp2 else None
                weights = str(folder / "weights") if lm_fsdp2 and lora else None
                out[kind, strategy, lora] = group.train(
                    kind,
                    strategy,
                    STEPS,
                    ROWS,
                    poison_step=1,
                    save=save,
                    lora=lora,
                    weights_folder=weights,
                ).wait(120)
        lm_folder = save_tied_lm(folder / "lm")
        for lora in (False, True):
            out["folder", lora] = group.load(str(lm_folder), lora).wait(60)
        out["lm-folder"] = lm_folder
        # resumed by 2 ranks from the LoRA checkpoint after step 2
        ck = str(resolve_checkpoint(folder / "ck-lora"))
        out["resumed"] = group.resume("lm", ck, STEPS, ROWS, lora=True).wait(60)
        out["checkpoints"], out["checkpoints-lora"] = folder / "ck", folder / "ck-lora"
        out["weights-folder"] = folder / "weights"
        for kind, lora in CASES:
            out[kind, "one", lora] = one_rank(kind, lora)
        yield out
    finally:
        cluster.shutdown()


def save_tied_lm(folder: Path) -> Path:
    """A tiny Hugging Face folder whose output head is its input embedding (as Qwen's small
    models): a shared parameter must stay shared through the meta build and the sharding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer("0123456789+=")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def one_rank(kind: str, lora: bool) -> dict:
    """The reference both strategies are held to: one process, no process group, each step's
    whole batch in 4 micro-batches (the 2 ranks' 2 each), the same NaN step. Its history is
    per rank as the ranks report it: the mean loss of that rank's 2 micro-batches (losses are
    not reduced over the ranks), and the step's global gradient norm."""
    engine = TrainEngine(build_model(kind, lora), actor_config("ddp", lora), 10)
    history = {0: [], 1: []}
    for step, batch in enumerate(make_batches(kind, STEPS, ROWS)):
        micros = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, ROWS, 2)]
        if step == 1:
            micros[1]["poison"] = micros[3]["poison"] = True  # each rank's last micro-batch
        metrics = engine.train_batch(micros, micro_loss(kind, 4))
        engine.end_step()
        for rank in (0, 1):
            loss = float(np.mean(metrics["loss"][2 * rank : 2 * rank + 2]))
            history[rank].append((loss, metrics["grad_norm"][0]))
    return {
        "history": history,
        "weights": engine.full_state_dict(0),
        "skipped": engine.skipped_steps,
    }


@pytest.fixture
def single_process_group():
    """FSDP2 in this process: the engine starts a process group of one; gone afterwards."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def assert_close_relative(a: torch.Tensor, b: torch.Tensor, what: str, tol=1e-5):
    scale = a.abs().max().clamp_min(1e-8)
    assert ((a - b).abs().max() / scale).item() <= tol, what


@pytest.mark.parametrize(("kind", "lora"), CASES)
def test_ddp_and_fsdp2_take_the_same_steps(results, kind, lora):
    ddp, fsdp = results[kind, "ddp", lora], results[kind, "fsdp2", lora]
    one = results[kind, "one", lora]
    # under fsdp2 rank 1 built a meta skeleton, its shards filled from rank 0's model
    assert [r["built_on_meta"] for r in fsdp] == [False, True]
    assert not any(r["built_on_meta"] for r in ddp)
    # each rank reports the losses of its rows and the norm of the whole step's gradient, as one
    # rank computes them on the whole batches; the NaN step skipped on both
    assert one["skipped"] == 1 and len(one["history"][0]) == STEPS
    for rank in (0, 1):
        assert fsdp[rank]["skipped"] == ddp[rank]["skipped"] == 1
        for out in (ddp, fsdp):
            torch.testing.assert_close(
                torch.tensor(out[rank]["history"]),
                torch.tensor(one["history"][rank]),
                rtol=1e-5,
                atol=0,
                equal_nan=True,
            )
    clip = actor_config("ddp", lora).max_grad_norm
    assert min(n for _, n in ddp[0]["history"] if n == n) > clip  # clipping was active
    # the whole updated weights (under LoRA: the adapters and the frozen base) and the
    # rollout's (merged under LoRA, in the base model's names)
    for part in ("weights", "rollout"):
        weights_ddp, weights_fsdp = ddp[0][part], fsdp[0][part]
        assert fsdp[1][part] is None and set(weights_ddp) == set(weights_fsdp)
        for k in weights_ddp:
            assert weights_fsdp[k].dtype == weights_ddp[k].dtype
            assert_close_relative(weights_ddp[k], weights_fsdp[k], f"{part}: {k}")
    assert set(one["weights"]) == set(ddp[0]["weights"])
    for k, v in one["weights"].items():
        assert_close_relative(v, ddp[0]["weights"][k], f"one rank against ddp: {k}")
    if kind == "vla":  # a forward method besides forward gathers its parameters too
        assert_close_relative(ddp[0]["value"], fsdp[0]["value"], "value")
    before = build_model(kind, lora).state_dict()
    assert any(not torch.equal(before[k], ddp[0]["weights"][k]) for k in before)
    base = build_model(kind)
    assert set(ddp[0]["rollout"]) == set(base.state_dict())
    if lora:
        assert_lora_steps(kind, ddp, fsdp, base)


def assert_lora_steps(kind, ddp, fsdp, base):
    """Only the adapters (and a policy's heads) moved; the merged weights are PEFT's own merge;
    the reference under both strategies is the base model."""
    model = build_model(kind, lora=True)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    before = model.state_dict()
    for out in (ddp, fsdp):  # the frozen base, bit for bit (fsdp2's rank 1 from rank 0's)
        for k, v in out[0]["weights"].items():
            assert k in trained or torch.equal(v, before[k]), k
    model.load_state_dict(fsdp[0]["weights"])
    merged = model.merge_and_unload().state_dict()
    for k, v in fsdp[0]["rollout"].items():
        assert_close_relative(merged[k], v, k, tol=1e-6)
    assert any(not torch.equal(v, base.state_dict()[k]) for k, v in merged.items())
    with torch.no_grad():
        base_loss = micro_loss(kind, 1)(base, make_batches(kind, 1, ROWS)[0])[0]
    for rank in (0, 1):
        for out in (ddp, fsdp):
            torch.testing.assert_close(out[rank]["ref_loss"], base_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("kind", "lora"), CASES)
def test_fsdp2_streams_the_rollout_weights_a_layer_at_a_time(results, kind, lora):
    """Under fsdp2 the rollout's weights are gathered as they are read: the first pair leaves
    rank 0 after its own layer's gather (LoRA: base and adapters), not the whole model's."""
    first, total = results[kind, "fsdp2", lora][0]["gathers"]
    assert 1 <= first <= 3 and total > 10 * first, (first, total)
    assert results[kind, "ddp", lora][0]["gathers"] == (0, 0)  # nothing is sharded


@pytest.mark.parametrize(("kind", "lora"), CASES)
def test_memory_plan_matches_the_tensors_and_fsdp2_halves_it(results, kind, lora):
    with torch.device("meta"):
        model = build_model(kind, lora)
    for strategy in ("ddp", "fsdp2"):
        expected = plan(model, actor_config(strategy), 2)
        counted = [r["bytes"] for r in results[kind, strategy, lora]]
        ranks = 1 if strategy == "ddp" else 2  # a DDP rank holds it all, FSDP2's hold halves
        for key, planned in (
            ("params", expected.param_bytes),
            ("grads", expected.grad_bytes),
            ("optimizer", expected.optimizer_bytes),
        ):
            total = sum(c[key] for c in counted[:ranks])
            assert abs(total - planned * ranks) <= 4 * ranks, (strategy, key, total, planned)
    ddp = sum(results[kind, "ddp", lora][0]["bytes"].values())
    fsdp = max(sum(r["bytes"].values()) for r in results[kind, "fsdp2", lora])
    assert fsdp <= 0.55 * ddp  # under LoRA too: the frozen base is sharded


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp2_loads_a_model_folder_on_rank_0_only(results, lora):
    """The language actor's model.path under fsdp2: rank 1 builds it from config.json on the
    meta device and gets its shards from rank 0; gathered, the folder's weights bit for bit
    (under LoRA merged, with B = 0 at the start), its tied embeddings still one parameter."""
    from transformers import AutoModelForCausalLM

    folder = results["lm-folder"]
    saved = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).state_dict()
    out = results["folder", lora]
    assert [r["built_on_meta"] for r in out] == [False, True]
    assert all(r["tied"] for r in out)
    assert out[1]["rollout"] is None and set(out[0]["rollout"]) == set(saved)
    for k, v in out[0]["rollout"].items():
        assert torch.equal(v, saved[k]), k


def test_an_fsdp2_lora_checkpoint_resumes_exactly_on_two_ranks(results):
    """Saved by 2 ranks after step 2, resumed by 2 (rank 1 built on the meta device again):
    steps 3 and 4 are the uninterrupted run's bit for bit (the same ranks reduce in the same
    order), losses, norms and the whole weights, adapters and frozen base."""
    run, resumed = results["lm", "fsdp2", True], results["resumed"]
    for rank in (0, 1):
        assert resumed[rank]["history"] == run[rank]["history"][2:]
    assert resumed[1]["weights"] is None
    expected = run[0]["weights"]
    assert set(resumed[0]["weights"]) == set(expected)
    for k, v in resumed[0]["weights"].items():
        assert torch.equal(v, expected[k]), k


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
    expected = results["lm", "fsdp2", False][0]["weights"]
    for k, v in engine.full_state_dict().items():
        assert_close_relative(expected[k], v, k)


def test_the_reloaded_weights_folder_of_an_fsdp2_lora_run_is_merged(results):
    """What the actor writes for vLLM to reload: a Hugging Face folder of the merged weights."""
    from transformers import AutoModelForCausalLM

    folder = results["weights-folder"]
    reloaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).state_dict()
    rollout = results["lm", "fsdp2", True][0]["rollout"]
    assert set(reloaded) == set(rollout)
    for k, v in rollout.items():
        assert torch.equal(reloaded[k], v), k


def test_an_fsdp2_lora_checkpoint_holds_the_adapters_and_resumes_on_one_rank(
    results, single_process_group
):
    """The 2-rank FSDP2 LoRA run's checkpoint after step 2: adapters and their Adam moments only;
    resumed by 1 rank, steps 3 and 4 give the run's weights; tidal export's loader merges it."""
    folder = resolve_checkpoint(results["checkpoints-lora"])
    model = build_model("lm", lora=True)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert set(load_model_state(folder)) == adapters
    saved = dcp.FileSystemReader(str(folder / "shards")).read_metadata().state_dict_metadata
    moments = {k for k in saved if k.startswith("optimizer.state.")}
    assert moments == {
        f"optimizer.state.{n}.{m}" for n in adapters for m in ("exp_avg", "exp_avg_sq", "step")
    }
    engine = TrainEngine(model, actor_config("fsdp2", lora=True), 10)
    assert engine.load(folder)["step"] == 2
    exported = checkpoint_weights(build_model("lm"), folder, LORA)
    for k, v in rollout_weights(model, engine, 0):
        assert torch.equal(exported[k], v), k
    train_steps(
        engine, "lm", make_batches("lm", STEPS, ROWS)[2:], rank=0, world=1, micro_per_rank=4
    )
    expected = results["lm", "fsdp2", True][0]
    for k, v in engine.full_state_dict().items():
        assert_close_relative(expected["weights"][k], v, k)
    for k, v in rollout_weights(model, engine, 0):
        assert_close_relative(expected["rollout"][k], v, k)


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
