"""The runtime, one suite run against both backends."""

import itertools
import pickle
import threading
import time
import uuid
from dataclasses import dataclass

import pytest
import torch
from runtime_workers import BrokenWorker, EchoWorker, SectionsWorker, TwoSections

from tidal.runtime import (
    Channel,
    ChannelTimeoutError,
    CommMapper,
    PlacementError,
    WorkerError,
    WorkerTimeoutError,
    merge_batches,
    parse_devices,
    send_weights,
    split_batch,
    wait_all,
    wait_any,
)


def new_channel(cluster, **kwargs):
    return Channel.create(f"test-{uuid.uuid4().hex[:8]}", cluster, **kwargs)


# ----------------------------------------------------------------------------- placement


def test_parse_devices():
    assert parse_devices("0-3", 8) == [0, 1, 2, 3]
    assert parse_devices("0,2,5", 8) == [0, 2, 5]
    assert parse_devices("0-1,4", 8) == [0, 1, 4]
    assert parse_devices("all", 3) == [0, 1, 2]
    assert parse_devices(2, 4) == [2]
    with pytest.raises(
        PlacementError, match="device 8 is out of range; the cluster has devices 0-7"
    ):
        parse_devices("6-8", 8, "placement.env")
    with pytest.raises(PlacementError, match=r"listed more than once"):
        parse_devices("0,1,1", 4)
    with pytest.raises(PlacementError, match="places no device"):
        parse_devices("", 4)
    with pytest.raises(PlacementError, match="runs backwards"):
        parse_devices("3-1", 4)
    with pytest.raises(PlacementError, match="cannot read 'x'"):
        parse_devices("0,x", 4)


def test_component_placement_layouts(cluster):
    collocated = cluster.placement({"actor,rollout": "all", "env": "0-1"})
    assert collocated.devices("actor") == collocated.devices("rollout") == [0, 1, 2, 3]
    assert collocated.is_collocated("actor", "rollout")
    assert collocated.get_world_size("env") == 2
    disagg = cluster.placement({"env": "0-1", "rollout": "2", "actor": "3"}, exclusive=True)
    assert disagg.devices("rollout") == [2]
    with pytest.raises(PlacementError, match="device 1 is used by both 'env' and 'actor'"):
        cluster.placement({"env": "0-1", "actor": "1-3"}, exclusive=True)
    with pytest.raises(PlacementError, match="component 'env' is placed twice"):
        cluster.placement({"env": "0", "env,actor": "1"})
    with pytest.raises(PlacementError, match="component 'reward' is not placed"):
        collocated.devices("reward")
    with pytest.raises(PlacementError, match=r"placement.actor: device 9 is out of range"):
        cluster.placement({"actor": "9"})


# ----------------------------------------------------------------------------- groups and handles


@pytest.fixture(scope="module")
def echo(cluster):
    group = EchoWorker.create_group(offset=100).launch(cluster, placement="0-2", name="echo")
    yield group
    group.shutdown()


def test_group_ranks_know_themselves(echo, cluster):
    infos = echo.info().wait(timeout=60)
    assert [i["rank"] for i in infos] == [0, 1, 2]
    assert all(i["world_size"] == 3 and i["group"] == "echo" for i in infos)
    assert [i["device"] for i in infos] == [0, 1, 2]
    pids = {i["pid"] for i in infos}
    assert len(pids) == (3 if cluster.backend == "ray" else 1)


def test_ranks_run_at_the_drivers_priority(echo):
    """Ray would run its workers at nice 15 (losing the CPU to any ordinary process); the
    cluster tidal starts runs its ranks at the driver's priority."""
    import os

    assert {i["niceness"] for i in echo.info().wait(timeout=60)} == {
        os.getpriority(os.PRIO_PROCESS, 0)
    }


def test_group_call_fans_out_and_execute_on(echo):
    assert echo.add(1).wait(timeout=30) == [101, 102, 103]
    handle = echo.execute_on(0, 2).add(5)
    assert handle.wait(timeout=30) == [105, 107]
    assert handle.ranks == [0, 2]
    assert set(handle.durations()) == {0, 2}
    with pytest.raises(ValueError, match="rank 5 is out of range"):
        echo.execute_on(5)
    with pytest.raises(AttributeError, match="has no method 'nope'"):
        echo.nope()


def test_a_worker_receives_only_the_config_sections_it_declares(cluster):
    config = TwoSections(used={"lr": 0.1}, unused="not for this worker")
    group = SectionsWorker.create_group(config, offset=1).launch(cluster, 1, name="sections")
    try:
        assert group.received().wait(timeout=60) == [["used"]]
        assert group.read("used").wait(timeout=60) == [{"lr": 0.1}]
        [error] = group.read("unused").wait(timeout=60)
        assert "SectionsWorker did not declare the config section 'unused'" in error
        assert "its config_sections: used" in error
    finally:
        group.shutdown()


def test_a_declared_section_the_config_lacks_is_named():
    class Greedy(SectionsWorker):
        config_sections = ("used", "missing")

    config = TwoSections(used={}, unused="")
    with pytest.raises(AttributeError, match=r"Greedy declares config sections \['missing'\]"):
        Greedy.create_group(config)


def test_async_methods_and_async_wait(echo):
    import asyncio

    assert echo.async_add(2).wait(timeout=30) == [20, 21, 22]

    async def driver():
        return await echo.add(0).async_wait(timeout=30)

    assert asyncio.run(driver()) == [100, 101, 102]


def test_remote_exception_names_group_rank_and_method(echo):
    with pytest.raises(WorkerError) as info:
        echo.fail_on(1).wait(timeout=30)
    msg = str(info.value)
    assert "echo[rank 1].fail_on failed: KeyError" in msg
    assert "boom on 1" in msg and "remote traceback" in msg and "runtime_workers.py" in msg
    assert info.value.rank == 1


def test_timeout_names_pending_ranks(echo):
    handle = echo.execute_on(0, 1).sleep(1.5)
    with pytest.raises(
        WorkerTimeoutError, match=r"echo.sleep: ranks \[0, 1\] had not answered after 0.2 s"
    ):
        handle.wait(timeout=0.2)
    assert not handle.done()
    assert handle.wait(timeout=30) == [0, 1]
    assert handle.done()


def test_a_timeout_on_the_local_backend_says_where_every_running_call_was(echo, cluster):
    """A hang in one rank often shows as another rank waiting on it: the timeout lists every
    running call of the process, awaits and compute threads (the ray backend's ranks are in
    other processes: nothing listed)."""
    ch = new_channel(cluster)
    asleep, waiting = echo.execute_on(0).sleep(1.0), echo.execute_on(1).consume(ch, "k", 1)
    with pytest.raises(WorkerTimeoutError) as info:
        waiting.wait(timeout=0.3)
    where = info.value.where
    if cluster.backend != "local":
        assert where == "" and "where" not in str(info.value)
    else:
        assert "echo[rank 1].consume, awaiting:" in where and "in consume" in where
        assert "echo[rank 0] compute thread:" in where and "time.sleep(seconds)" in where
        assert str(info.value).endswith(where)
        assert pickle.loads(pickle.dumps(info.value)).where == where
    ch.put("x", key="k")
    assert waiting.wait(timeout=30) == [["x"]] and asleep.wait(timeout=30) == [0]


def test_wait_any_returns_what_finished_first_raises_failures_and_times_out(echo):
    slow, fast = echo.execute_on(0).sleep(1.5), echo.execute_on(1).sleep(0.05)
    start = time.monotonic()
    assert wait_any([slow, fast], 30) == [fast]
    assert time.monotonic() - start < 1.0  # woken by the fast call, not the slow one
    with pytest.raises(
        WorkerTimeoutError, match=r"echo.sleep: ranks \[0\] had not answered after 0.2 s"
    ):
        wait_any([slow], 0.2)
    with pytest.raises(WorkerError, match=r"echo\[rank 1\].fail_on failed"):  # at once
        wait_any([slow, echo.fail_on(1)], 30)
    assert wait_any([slow], 30) == [slow]
    assert wait_all([slow, fast], 30) == [[0], [1]]


def test_rank_serves_async_calls_while_a_long_method_runs(echo, cluster):
    ch = new_channel(cluster)
    ch.qsize("k")  # the channel is up before the clock starts
    start = time.monotonic()
    long = echo.execute_on(0).long_compute_then_report(3.0)
    consumer = echo.execute_on(0).consume(ch, "k", 2)
    ch.put("a", key="k")
    ch.put("b", key="k")
    assert consumer.wait(timeout=30) == [["a", "b"]]
    assert time.monotonic() - start < 2.5  # served before the long method ended
    assert not long.done()
    long.wait(timeout=30)


def test_init_failure_is_reported(cluster):
    with pytest.raises(
        WorkerError, match=r"broken\[rank 0\].__init__ failed: RuntimeError: cannot start"
    ):
        BrokenWorker.create_group().launch(cluster, placement=1, name="broken")


# ----------------------------------------------------------------------------- channels


def test_channel_fifo_per_key_from_driver(cluster):
    ch = new_channel(cluster)
    for i in range(5):
        ch.put(i, key="a")
        ch.put(-i, key="b")
    assert ch.qsize("a") == 5 and not ch.empty("b")
    assert [ch.get(key="a") for _ in range(5)] == list(range(5))
    assert [ch.get(key="b") for _ in range(5)] == [0, -1, -2, -3, -4]
    assert ch.empty("a")


@dataclass
class Sample:
    obs: torch.Tensor
    reward: float


def test_channel_carries_tensors_dicts_dataclasses(cluster):
    ch = new_channel(cluster)
    payload = {
        "obs": torch.randn(4, 3),
        "nested": {"mask": torch.ones(4, dtype=torch.bool)},
        "bf": torch.randn(2).bfloat16(),
    }
    ch.put(payload)
    ch.put(Sample(torch.arange(3), 1.5))
    ch.put(["plain", 1, None])
    got = ch.get()
    assert torch.equal(got["obs"], payload["obs"]) and got["nested"]["mask"].dtype == torch.bool
    assert got["bf"].dtype == torch.bfloat16 and torch.equal(got["bf"], payload["bf"])
    got["obs"] += 1  # the receiver owns a writable tensor
    sample = ch.get()
    assert isinstance(sample, Sample) and torch.equal(sample.obs, torch.arange(3))
    assert ch.get() == ["plain", 1, None]


def test_channel_get_timeout_loses_nothing(cluster):
    ch = new_channel(cluster)
    with pytest.raises(ChannelTimeoutError, match=r"get\(key='x'\) timed out after 0.2 s"):
        ch.get(key="x", timeout=0.2)
    ch.put("later", key="x")
    assert ch.get(key="x", timeout=10) == "later"


def test_channel_async_ops_wait_and_await(cluster):
    import asyncio

    ch = new_channel(cluster)  # not waited for: a put sent before the actor is up must arrive
    work = ch.get(key="k", async_op=True)
    assert not work.done()
    ch.put("v1", key="k", async_op=True).wait(timeout=10)
    assert work.wait(timeout=60) == "v1"

    async def main():
        pending = ch.get(key="k", async_op=True)
        await ch.put("v2", key="k", async_op=True)
        return await pending

    assert asyncio.run(main()) == "v2"

    async def two_awaiters():  # one wait awaited twice: both awaiters see the item
        pending = ch.get(key="k", async_op=True, timeout=30)
        first, second = (
            asyncio.ensure_future(pending.async_wait()),
            asyncio.ensure_future(pending.async_wait()),
        )
        await asyncio.sleep(0.01)
        await ch.put("v3", key="k", async_op=True)
        return await first, await second

    assert asyncio.run(two_awaiters()) == ("v3", "v3")


def test_channel_get_batch_by_weight(cluster):
    ch = new_channel(cluster)
    work = ch.get_batch(5.0, key="w", async_op=True)
    ch.put("a", key="w", weight=2.0)
    ch.put("b", key="w", weight=2.0)
    time.sleep(0.2)
    assert not work.done()
    ch.put("c", key="w", weight=2.0)
    ch.put("d", key="w", weight=1.0)
    assert work.wait(timeout=10) == ["a", "b", "c"]
    assert ch.qsize("w") == 1


def test_channel_backpressure(cluster):
    if cluster.backend == "ray":  # no runner needs back-pressure: ray's channels are unbounded
        with pytest.raises(ValueError, match=r"maxsize=2, but channels on the ray backend are"):
            new_channel(cluster, maxsize=2)
        return
    ch = new_channel(cluster, maxsize=2)
    ch.put(1)
    ch.put(2)
    with pytest.raises(ChannelTimeoutError, match="put"):
        ch.put(3, timeout=0.2)
    blocked = ch.put(3, async_op=True)
    time.sleep(0.2)
    assert not blocked.done() and ch.qsize() == 2
    assert ch.get(timeout=10) == 1
    blocked.wait(timeout=10)
    assert [ch.get(timeout=10), ch.get(timeout=10)] == [2, 3]


def test_concurrent_producers_and_consumers(cluster, echo):
    ch = new_channel(cluster)
    producers = echo.produce(ch, "q", 20)
    received = [[], []]  # what each consumer took, in the order it took it

    def consume(mine):
        for _ in range(30):
            mine.append(ch.get(key="q", timeout=30))

    threads = [threading.Thread(target=consume, args=(mine,)) for mine in received]
    for t in threads:
        t.start()
    producers.wait(timeout=60)
    for t in threads:
        t.join(timeout=60)
    got = received[0] + received[1]
    assert sorted(got) == sorted((r, i) for r in range(3) for i in range(20))
    for mine in (
        received
    ):  # per-producer order survives: each consumer sees every producer's items in order
        for r in range(3):
            seq = [i for rr, i in mine if rr == r]
            assert seq == sorted(seq), f"producer {r}'s items came out of order: {seq}"


def test_worker_consumes_what_driver_produces(cluster, echo):
    ch = new_channel(cluster)
    handle = echo.execute_on(1).consume(ch, "jobs", 3)
    for i in range(3):
        ch.put({"i": torch.tensor([i])}, key="jobs")
    out = handle.wait(timeout=30)[0]
    assert [o["i"].item() for o in out] == [0, 1, 2]


# ----------------------------------------------------------------------------- mapper and routing


def brute_force_routes(batch, S, D):
    owner_src = [i // (batch // S) for i in range(batch)]
    owner_dst = [i // (batch // D) for i in range(batch)]
    dst_routes = {s: [] for s in range(S)}
    src_routes = {d: [] for d in range(D)}
    for s, d in zip(owner_src, owner_dst):
        for table, key, other in ((dst_routes, s, d), (src_routes, d, s)):
            if table[key] and table[key][-1][0] == other:
                table[key][-1] = (other, table[key][-1][1] + 1)
            else:
                table[key].append((other, 1))
    return dst_routes, src_routes


def test_comm_mapper_matches_brute_force():
    for S, D in itertools.product(range(1, 7), range(1, 7)):
        lcm = S * D // __import__("math").gcd(S, D)
        for batch in (lcm, 2 * lcm, 6 * lcm):
            dst_ref, src_ref = brute_force_routes(batch, S, D)
            for s in range(S):
                got = CommMapper.get_dst_ranks(batch, S, D, s)
                assert got == dst_ref[s] and sum(n for _, n in got) == batch // S
            for d in range(D):
                got = CommMapper.get_src_ranks(batch, S, D, d)
                assert got == src_ref[d] and sum(n for _, n in got) == batch // D


def test_comm_mapper_errors():
    with pytest.raises(
        ValueError, match="batch size 10 is not divisible by the destination group size 4"
    ):
        CommMapper.get_dst_ranks(10, 2, 4, 0)
    with pytest.raises(
        ValueError, match="batch size 9 is not divisible by the source group size 2"
    ):
        CommMapper.get_src_ranks(9, 2, 3, 0)
    with pytest.raises(ValueError, match="src_rank 3 is out of range 0-1"):
        CommMapper.get_dst_ranks(8, 2, 4, 3)
    assert CommMapper.build_channel_key(1, 2, extra="train_obs") == "1->2:train_obs"


def test_split_merge_round_trip():
    batch = {"a": torch.arange(12).reshape(6, 2), "s": Sample(torch.arange(6), 0.5), "none": None}
    shards = split_batch(batch, [1, 2, 3])
    assert [s["a"].shape[0] for s in shards] == [1, 2, 3]
    merged = merge_batches(shards)
    assert torch.equal(merged["a"], batch["a"]) and torch.equal(merged["s"].obs, batch["s"].obs)
    assert merged["none"] is None and merged["s"].reward == 0.5
    with pytest.raises(ValueError, match=r"split sizes \[1, 2\] add up to 3, but the batch has 6"):
        split_batch(batch, [1, 2])


@pytest.fixture(scope="module")
def four_and_four(cluster):
    """Source and destination groups of four ranks; a test uses the first S and D of them."""
    src = EchoWorker.create_group().launch(cluster, placement=4, name="src")
    dst = EchoWorker.create_group().launch(cluster, placement=4, name="dst")
    yield src, dst
    src.shutdown()
    dst.shutdown()


@pytest.mark.parametrize("bound", [False, True], ids=["via-channel", "point-to-point"])
@pytest.mark.parametrize("S,D", [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2), (4, 4)])
def test_send_recv_between_groups(cluster, four_and_four, S, D, bound):
    src, dst = (g.execute_on(range(n)) for g, n in zip(four_and_four, (S, D)))
    ch = new_channel(cluster, consumer=four_and_four[1] if bound else None)
    assert ch.direct == (bound and cluster.backend == "ray")
    per_rank = 12 // S
    receiving = dst.recv_shard(ch, S, D, 12) if D % 2 else dst.async_recv_shard(ch, S, D, 12)
    src.send_shard(ch, S, D, per_rank).wait(timeout=60)
    results = receiving.wait(timeout=60)
    xs = [r[0] if isinstance(r, tuple) else r for r in results]
    assert [x for part in xs for x in part] == list(range(12))
    if isinstance(results[0], tuple):
        assert [y for r in results for y in r[1]] == [2.0 * i for i in range(12)]


def test_shard_size_is_checked_on_receipt(cluster, echo):
    ch = new_channel(cluster)
    ch.put({"x": torch.arange(5)}, key=CommMapper.build_channel_key(0, 0, "t"))
    with pytest.raises(
        WorkerError, match=r"route 0->0 \('t'\): expected a shard of 4 items, got 5"
    ):
        echo.execute_on(0).recv_shard(ch, 1, 3, 12).wait(timeout=30)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("bound", [False, True], ids=["via-channel", "point-to-point"])
def test_weight_transfer_to_every_rank(cluster, echo, bound):
    ch = new_channel(cluster, consumer=echo if bound else None)
    model = torch.nn.Linear(3, 2)
    receiving = echo.load_weights(ch)
    send_weights(ch, model.state_dict(), version=7, dst_world_size=3)
    expected = model.weight.sum().item()
    for version, total in receiving.wait(timeout=60):
        assert version == 7 and abs(total - expected) < 1e-6


def test_bound_channel_keeps_channel_semantics(cluster, four_and_four):
    """Routed keys of a bound channel live with their consumer rank; FIFO per producer, many
    producers and puts from the driver all behave as before."""
    src, dst = four_and_four
    ch = new_channel(cluster, consumer=dst)
    key = CommMapper.build_channel_key(0, 2, "k")
    producing = src.execute_on(0, 1, 2).produce(ch, key, 5)
    got = dst.execute_on(2).consume(ch, key, 15).wait(timeout=60)[0]
    producing.wait(timeout=60)
    assert sorted(got) == sorted((r, i) for r in range(3) for i in range(5))
    for r in range(3):
        assert [i for rr, i in got if rr == r] == list(range(5)), (
            f"producer {r} out of order: {got}"
        )
    ch.put("late", key=key)
    assert dst.execute_on(2).consume(ch, key, 1).wait(timeout=30) == [["late"]]


# ----------------------------------------------------------------------------- backends


def test_gil_switch_interval_is_opt_in_and_restored():
    import sys

    from tidal.runtime import Cluster

    before = sys.getswitchinterval()
    with Cluster("local", devices_per_node=1):
        assert sys.getswitchinterval() == before  # off unless asked for
    cluster = Cluster("local", devices_per_node=1, gil_switch_interval=1e-4)
    assert sys.getswitchinterval() == pytest.approx(1e-4)
    cluster.shutdown()
    assert sys.getswitchinterval() == before


def test_backends_register_by_name():
    from tidal.runtime import Cluster, backend_names, register_backend
    from tidal.runtime.backends.local import LocalBackend

    with pytest.raises(
        ValueError, match=r"cluster.backend: expected one of .*local, .*ray.*, got 'slurm'"
    ):
        Cluster("slurm")
    name = f"local-{uuid.uuid4().hex[:6]}"
    register_backend(name)(type("ThreadsAgain", (LocalBackend,), {}))
    assert name in backend_names()
    with pytest.raises(ValueError, match="registered twice"):
        register_backend(name)(LocalBackend)
    with Cluster(name, devices_per_node=2) as cluster:
        group = EchoWorker.create_group(offset=1).launch(cluster, placement=2, name="custom")
        assert group.add(1).wait(timeout=30) == [2, 3]
        group.shutdown()


def test_reading_a_config_loads_no_backend_machinery():
    """Backends are imported on first use: a config that names ray loads neither torch nor
    cloudpickle nor Ray (a fresh interpreter: this one has them all)."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parent.parent / "examples" / "embodied" / "cartpole_ppo.yaml"
    code = (
        "import sys\n"
        "from tidal.config import EmbodiedConfig, load_config\n"
        f"load_config(EmbodiedConfig, {str(example)!r}, ['cluster.backend=ray'])\n"
        "print(sorted({'torch', 'cloudpickle', 'ray'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_worker_module_does_not_import_the_cluster():
    """No import cycle: ``worker`` may name the cluster in annotations only."""
    import ast
    import inspect

    import tidal.runtime.worker as worker

    tree = ast.parse(inspect.getsource(worker))
    runtime_imports = [
        node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
    ]
    assert "tidal.runtime.cluster" not in runtime_imports


def test_fast_path_frames_round_trip_tensors_and_functions():
    """What the ray backend's ZeroMQ path sends: tensors of every dtype come back equal and
    writable (large ones out of band, without a copy into the pickle); what the standard
    pickler cannot send (a function defined here) goes by cloudpickle."""
    import zmq

    from tidal.runtime.backends.ray_pipe import COPY_LIMIT_BYTES, dumps, loads

    item = {
        "obs": torch.randn(128, 4),
        "done": torch.zeros(128, 1, dtype=torch.bool),
        "half": torch.randn(3, 2).bfloat16(),
        "weights": torch.randn(256, 256),  # 256 KiB: out of band
        "step": 7,
    }
    frames = dumps(item)
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == 256 * 256 * 4 > COPY_LIMIT_BYTES
    back = loads([zmq.Frame(f) for f in frames])
    for key in ("obs", "done", "half", "weights"):
        assert back[key].dtype == item[key].dtype and torch.equal(back[key], item[key])
    back["weights"] += 1  # the receiver's own copy
    assert not torch.equal(back["weights"], item["weights"])
    offset = 3
    assert loads([zmq.Frame(f) for f in dumps(lambda x: x + offset)])(1) == 4
