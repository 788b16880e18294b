"""The language trainer: data-parallel ranks, micro-batch splits and the KL reference's place
agree with one rank, one split and one place."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from tidal.config import load_config
from tidal.config.llm import LLMConfig
from tidal.data import LLMBatch


def _synthetic_batch(
    rows: int, width: int, vocab: int, seed: int = 0, group_size: int = 4
) -> LLMBatch:
    """Random rows in groups of ``group_size`` (the trainer config's rollout.group_size)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, width + 1, (rows,), generator=g)
    attention = torch.arange(width)[None, :] < lengths[:, None]
    loss_mask = attention & (torch.arange(width)[None, :] >= 3)
    return LLMBatch(
        input_ids=torch.randint(3, vocab, (rows, width), generator=g) * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        logprobs=torch.where(loss_mask, -torch.rand(rows, width, generator=g) - 0.5, 0.0),
        versions=torch.where(loss_mask, 0, -1),
        rewards=torch.randint(0, 2, (rows,), generator=g).float(),
        group_ids=torch.arange(rows) // group_size,
    )


def _trainer_config(model, loss_agg: str, *extra: str) -> LLMConfig:
    """A trainer for the synthetic batches: 16 rows in 2 minibatches, decoupled PPO."""
    return load_config(
        LLMConfig,
        None,
        [
            f"model.path={model}",
            "rollout.group_size=4",
            "rollout.batch_size=4",
            "actor.ppo_minibatches=2",
            f"algorithm.loss_agg={loss_agg}",
            "algorithm.use_decoupled_loss=true",
            "actor.lr=1e-3",
            *extra,
        ],
    )


@pytest.mark.ray
def test_data_parallel_trainer_takes_the_same_step_as_one_rank(ray_session, arith_model):
    """Two DDP ranks, each on its half of every minibatch, end a PPO step with the weights a
    single rank reaches on the whole batch: losses are weighted by global counts."""
    from tidal.runtime import Cluster
    from tidal.workers.llm_actor import LLMActor

    vocab = AutoTokenizer.from_pretrained(arith_model).vocab_size
    batch = _synthetic_batch(16, 12, vocab)
    cluster = Cluster("ray", devices_per_node=3, ray_init_kwargs={"num_cpus": 2})
    try:
        # KL to a reference model shaping the reward, with groups that straddle the ranks
        # (token-mean), and LoRA adapters under DDP with the KL reference (in the loss) the base
        # with them disabled (seq-mean-token-mean: per-sequence global counts); each case starts
        # three processes, so each covers one aggregation
        cases = {
            "kl-in-reward": (
                "token-mean",
                [
                    "algorithm.kl_coef=0.5",
                    "algorithm.kl_in=reward",
                    "rollout.group_size=8",
                    "rollout.batch_size=2",
                ],
            ),
            "lora": ("seq-mean-token-mean", ["model.lora.rank=4", "algorithm.kl_coef=0.5"]),
        }
        for agg, (loss_agg, extra) in cases.items():
            cfg = _trainer_config(arith_model, loss_agg, "actor.max_tokens_per_mb=40", *extra)
            size = cfg.rollout.group_size  # the batch's groups as the config has them
            grouped = replace(batch, group_ids=torch.arange(len(batch)) // size)
            one = LLMActor.create_group(cfg).launch(cluster, "0", name=f"one-{agg}")
            two = LLMActor.create_group(cfg).launch(cluster, "1-2", name=f"two-{agg}")
            m1 = one.train_step(grouped).wait(120)[0]
            m2 = two.train_step(grouped).wait(120)
            w1 = one.state_dict().wait(60)[0]
            w2 = two.state_dict().wait(60)
            one.shutdown()
            two.shutdown()
            assert m2[0] == m2[1] and m1["train/tokens"] == m2[0]["train/tokens"], agg
            for name, value in w1.items():
                assert torch.equal(w2[0][name], w2[1][name]), (
                    agg,
                    name,
                )  # the ranks stay in lockstep
                assert torch.allclose(value, w2[0][name], atol=2e-6), (agg, name)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_language_step_does_not_depend_on_the_micro_batch_split(arith_model, loss_agg):
    """Micro-batches packed by a token budget of 400 (one per minibatch) or 40 (several, of
    unequal token counts), decoupled PPO with behaviour-capped tokens: the same weights."""
    from tidal.runtime import Cluster
    from tidal.workers.llm_actor import LLMActor

    vocab = AutoTokenizer.from_pretrained(arith_model).vocab_size
    batch = _synthetic_batch(16, 12, vocab, seed=3)
    g = torch.Generator().manual_seed(4)  # behaviour log-probs far from the model's: some capped
    batch.logprobs = torch.where(batch.loss_mask, -5 * torch.rand(16, 12, generator=g) - 1, 0.0)
    weights = {}
    cluster = Cluster("local")
    try:
        for budget in (400, 40):
            cfg = _trainer_config(
                arith_model,
                loss_agg,
                f"actor.max_tokens_per_mb={budget}",
                "algorithm.behav_weight_cap=1.5",
            )
            group = LLMActor.create_group(cfg).launch(cluster, "0", name=f"budget{budget}")
            metrics = group.train_step(batch).wait(120)[0]
            assert 0 < metrics["train/behave_capped_frac"] < 1
            weights[budget] = group.state_dict().wait(60)[0]
            group.shutdown()
    finally:
        cluster.shutdown()
    for name, value in weights[400].items():
        torch.testing.assert_close(weights[40][name], value, rtol=1e-5, atol=2e-6)


def test_a_host_resident_kl_reference_trains_bitwise_as_one_on_the_device(arith_model):
    """actor.ref_offload: the reference copy waits in host memory between its passes (its
    storages hold nothing after a step) and two steps take exactly the weights they take with
    the reference kept on the device; actor.offload takes the copy off with the engine."""
    from tidal.runtime import Cluster
    from tidal.workers.llm_actor import LLMActor

    batch = _synthetic_batch(16, 12, AutoTokenizer.from_pretrained(arith_model).vocab_size)
    kl = ["algorithm.kl_coef=0.5", "algorithm.kl_in=reward"]
    runs = {}
    cluster = Cluster("local")
    try:
        for parked in (False, True):
            cfg = _trainer_config(arith_model, "token-mean", *kl, f"actor.ref_offload={parked}")
            group = LLMActor.create_group(cfg).launch(cluster, "0", name=f"parked{parked}")
            metrics = [group.train_step(batch).wait(120)[0] for _ in range(2)]
            resident = group.reference_bytes().wait(30)[0]
            assert (resident == 0) == parked, resident
            if not parked:  # the collocated phase takes the reference off with the engine
                assert group.offload_engine().wait(30)[0] > 0
                assert group.reference_bytes().wait(30)[0] == 0
                group.onload_engine().wait(30)
                assert group.reference_bytes().wait(30)[0] == resident
            runs[parked] = metrics, group.state_dict().wait(60)[0]
            group.shutdown()
    finally:
        cluster.shutdown()
    assert runs[True][0] == runs[False][0]
    for name, value in runs[False][1].items():
        assert torch.equal(runs[True][1][name], value), name


def test_a_step_with_each_groups_prompt_packed_once_takes_the_same_weights(arith_model):
    """actor.shared_prefix: the rows of a group share their 3-token prompt, packed once in the
    reference, proximal and training passes; the step ends on the unpacked step's weights."""
    from tidal.runtime import Cluster
    from tidal.workers.llm_actor import LLMActor

    batch = _synthetic_batch(16, 12, AutoTokenizer.from_pretrained(arith_model).vocab_size)
    first = batch.group_ids.diff(prepend=torch.tensor([-1])) != 0
    prompts = batch.input_ids[first][batch.group_ids, :3]  # each group's first row's prompt
    batch.input_ids[:, :3] = prompts
    kl = ["algorithm.kl_coef=0.5", "algorithm.kl_in=reward"]
    runs = {}
    cluster = Cluster("local")
    try:
        for packed in (False, True):
            cfg = _trainer_config(arith_model, "token-mean", *kl, f"actor.shared_prefix={packed}")
            group = LLMActor.create_group(cfg).launch(cluster, "0", name=f"packed{packed}")
            runs[packed] = group.train_step(batch).wait(120)[0], group.state_dict().wait(60)[0]
            group.shutdown()
    finally:
        cluster.shutdown()
    for key in ("train/policy_loss", "train/grad_norm"):
        assert runs[True][0][key] == pytest.approx(runs[False][0][key], rel=1e-4, abs=1e-6), key
    for name, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], value, rtol=1e-5, atol=2e-6)
