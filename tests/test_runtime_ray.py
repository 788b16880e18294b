"""Ray-only behaviour: torch.distributed across ranks, dying ranks, multi-node placement."""

import json
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster as RayTestCluster
from runtime_workers import EchoWorker

from tidal.runtime import Channel, Cluster, CommMapper, WorkerError, wait_all

pytestmark = pytest.mark.ray
EXAMPLES = Path(__file__).parent.parent / "examples" / "embodied"


@pytest.fixture(scope="module")
def two_nodes():
    """Ray's own multi-node test cluster: two simulated nodes of two devices on this machine."""
    test_cluster = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 2})
    test_cluster.add_node(num_cpus=2)
    test_cluster.wait_for_nodes()
    cluster = Cluster("ray", address=test_cluster.address, devices_per_node=2)
    yield cluster
    ray.shutdown()
    test_cluster.shutdown()


def test_ranks_land_on_the_nodes_asked_for(two_nodes):
    assert len(two_nodes.nodes) == 2 and two_nodes.num_devices == 4
    group = EchoWorker.create_group().launch(two_nodes, placement="1-2", name="spread")
    try:
        node_ids = group.node_id().wait(timeout=120)
        assert node_ids == [two_nodes.nodes[0].node_id, two_nodes.nodes[1].node_id]
        infos = group.info().wait(timeout=60)
        assert [i["local_rank"] for i in infos] == [0, 0]  # one rank on each node
        env = group.env("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT").wait(
            timeout=60
        )
        assert [e["RANK"] for e in env] == ["0", "1"] and {e["WORLD_SIZE"] for e in env} == {"2"}
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env}) == 1
        # torch.distributed initialises unchanged from that environment, across the two nodes
        assert group.allreduce().wait(timeout=120) == [3.0, 3.0]
    finally:
        group.shutdown()


def test_an_address_other_than_the_processs_ray_session_is_refused(two_nodes):
    """ray.init runs once per process: a cluster named beside the session in use is a config
    error naming both (it used to train on the session's cluster); the session's own address,
    by any host of its port, or ``auto`` is taken."""
    from tidal.runtime.errors import ClusterUnreachable

    session = ray.get_runtime_context().gcs_address
    with pytest.raises(ClusterUnreachable) as error:
        Cluster("ray", address="127.0.0.1:9")
    assert f"already in a Ray session at {session!r}" in str(error.value)
    assert str(error.value).startswith("cluster.address:") and "'127.0.0.1:9'" in str(error.value)
    for address in (session, f"127.0.0.1:{session.rpartition(':')[2]}", "auto"):
        assert len(Cluster("ray", address=address).nodes) == 2


def test_pinned_ranks_run_on_the_core_of_their_cpu_slot(two_nodes):
    """``pin_cpus``: slot s of a node runs on the (s mod n)-th allowed core, in every thread
    (those started later too); a group launched without it keeps every core."""
    import os

    pinned = Cluster("ray", address="auto", devices_per_node=2, pin_cpus=True)
    cores = sorted(os.sched_getaffinity(0))
    group = EchoWorker.create_group().launch(pinned, placement="0-3", name="pinned")
    free = EchoWorker.create_group().launch(two_nodes, placement="1", name="unpinned")
    try:
        expected = [[cores[slot % len(cores)]] for slot in (0, 1, 0, 1)]
        assert group.cpu_affinity().wait(timeout=120) == [(e, e) for e in expected]
        assert free.cpu_affinity().wait(timeout=120) == [(cores, cores)]
    finally:
        group.shutdown()
        free.shutdown()


def test_groups_in_the_same_process_pass_items_in_memory_and_end_one_by_one(two_nodes):
    """``same_process``: rank i of the guest runs in rank i's process of its host (one process
    per rank pair, on each node); a put between them reaches the bound channel's mailbox by
    reference, while a rank in another process still gets a copy by ZeroMQ. Neither owns its
    event loop (a blocking step would hold up the other). The guest shutting down leaves the
    host serving. The host is whichever group of the entry is launched first."""
    from tidal.runtime.placement import PlacementError

    placement = two_nodes.placement({"host,guest,apart": "1-2"}, same_process=["guest,host"])
    host = EchoWorker.create_group().launch(two_nodes, placement, name="host")
    guest = EchoWorker.create_group().launch(two_nodes, placement, name="guest")
    apart = EchoWorker.create_group().launch(two_nodes, placement, name="apart")
    try:
        pids = [[i["pid"] for i in g.info().wait(timeout=60)] for g in (host, guest, apart)]
        assert pids[0] == pids[1] and not set(pids[2]) & set(pids[0])
        assert [g.owns_loop().wait(timeout=60) for g in (host, guest, apart)] == [
            [False, False],
            [False, False],
            [True, True],
        ]
        ch = Channel.create(f"same-process-{time.monotonic_ns()}", two_nodes, consumer=guest)
        for src, by_reference in ((host, True), (apart, False)):
            keys = [CommMapper.build_channel_key(r, r, "t") for r in range(2)]
            getting = [guest.execute_on(r).get_tensor(ch, keys[r]) for r in range(2)]
            put_ptrs = [src.execute_on(r).put_tensor(ch, keys[r]).wait(60)[0] for r in range(2)]
            got = [g.wait(60)[0] for g in getting]
            assert [values for _, values in got] == [[0, 1, 2, 3], [1, 2, 3, 4]]
            same_memory = [ptr == put for (ptr, _), put in zip(got, put_ptrs)]
            assert same_memory == [by_reference] * 2
        guest.shutdown()
        assert host.add(1).wait(timeout=60) == [1, 2]  # the process lives on with its host
        with pytest.raises(WorkerError, match="no rank of group 'guest' runs here"):
            guest.add(1).wait(timeout=10)  # answered at once, not at the timeout
    finally:
        host.shutdown()
        apart.shutdown()
    with pytest.raises(PlacementError, match="'guest' is placed on devices \\[1\\].*the same"):
        two_nodes.placement({"host": "1-2", "guest": "1"}, same_process=["host,guest"])


def test_one_rank_dying_fails_fast_naming_it(two_nodes):
    group = EchoWorker.create_group().launch(two_nodes, placement="0-2", name="fragile")
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"fragile\[rank 1\].die_on failed: rank died"):
        group.die_on(1).wait(timeout=50)
    assert time.monotonic() - start < 40  # not held up by the ranks still sleeping
    group.shutdown()


def assert_no_channel_actor(channel: Channel) -> None:
    with pytest.raises(ValueError):  # Ray's answer for an actor name it does not know
        ray.get_actor(f"tidal.channel.{channel.name}", namespace="tidal")


def test_point_to_point_across_nodes_bypasses_the_channel_actor(two_nodes):
    """A channel bound to its reader sends routed keys rank to rank, with no channel actor:
    shards cross from node 0 to node 1 (and the weights too). Only the rank a key is routed to
    reads it, and every key is routed to a rank of the group."""
    import torch

    src = EchoWorker.create_group().launch(two_nodes, placement="0-1", name="p2p_src")
    dst = EchoWorker.create_group().launch(two_nodes, placement="2-3", name="p2p_dst")
    try:
        ch = Channel.create(f"p2p-{time.monotonic_ns()}", two_nodes, consumer=dst)
        assert ch.direct
        assert_no_channel_actor(ch)
        key = CommMapper.build_channel_key(0, 1, "t")
        with pytest.raises(RuntimeError, match=r"qsize\(key='0->1:t'\) outside rank 1 of group"):
            ch.qsize(key)
        with pytest.raises(ValueError, match=r"bound to group 'p2p_dst'.*dst in 0-1; got '0->2'"):
            ch.put("lost", key=CommMapper.build_channel_key(0, 2))
        receiving = dst.async_recv_shard(ch, 2, 2, 12)
        src.send_shard(ch, 2, 2, 6).wait(timeout=60)
        assert [x for part in receiving.wait(timeout=60) for x in part] == list(range(12))
        model = torch.nn.Linear(3, 2)
        loading = dst.load_weights(ch)
        from tidal.runtime import send_weights

        send_weights(ch, model.state_dict(), version=3, dst_world_size=2)
        assert [v for v, _ in loading.wait(timeout=60)] == [3, 3]
    finally:
        src.shutdown()
        dst.shutdown()


def test_unbounded_channel_goes_to_its_channel_actor_by_zeromq_and_its_death_is_named(two_nodes):
    """Puts, gets and qsize of an unbounded channel's unrouted keys reach the channel actor by
    ZeroMQ (from the driver and from ranks on either node); a get waiting on a channel actor
    that dies fails at once, naming the channel, not at its timeout."""
    ch = Channel.create(f"zmq-actor-{time.monotonic_ns()}", two_nodes)
    group = EchoWorker.create_group().launch(two_nodes, placement="1-2", name="zmq_actor")
    try:
        ch.put({"n": 1}, key="a")
        ch.put({"n": 2}, key="a")
        assert ch.qsize("a") == 2 and ch.get(key="a") == {"n": 1}
        key = CommMapper.build_channel_key(0, 0, "k")  # routed, but the channel is not bound
        wait_all([group.execute_on(0).produce(ch, key, 3)], timeout=60)
        assert group.execute_on(1).consume(ch, key, 3).wait(timeout=60) == [
            [(0, 0), (0, 1), (0, 2)]
        ]
        assert ch.get_batch(1, key="a") == [{"n": 2}]
        waiting = ch.get(key="never", async_op=True, timeout=100)
        ray.kill(ch._transport.actor)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"channel '{ch.name}': its channel actor died"):
            waiting.wait()
        assert time.monotonic() - start < 30
    finally:
        group.shutdown()


def test_ray_channels_are_unbounded(two_nodes):
    with pytest.raises(ValueError, match=r"channel 'bounded': maxsize=3, but channels on the ray"):
        Channel.create("bounded", two_nodes, maxsize=3)


def test_rank_dying_mid_transfer_is_named_within_the_timeout(two_nodes):
    src = EchoWorker.create_group().launch(two_nodes, placement="0", name="dying_src")
    dst = EchoWorker.create_group().launch(two_nodes, placement="2", name="waiting_dst")
    try:
        ch = Channel.create(f"fault-{time.monotonic_ns()}", two_nodes, consumer=dst)
        key = CommMapper.build_channel_key(0, 0, "k")
        start = time.monotonic()
        with pytest.raises(
            WorkerError, match=r"dying_src\[rank 0\].produce_then_die failed: rank died"
        ):
            wait_all([dst.consume(ch, key, 10), src.produce_then_die(ch, key, 3)], timeout=25)
        assert time.monotonic() - start < 25
    finally:
        src.shutdown()
        dst.shutdown()


def test_embodied_loop_across_nodes_on_the_fast_path(two_nodes, tmp_path):
    """env on node 0, rollout on node 1, actor on node 0: the env↔rollout traffic crosses nodes
    point to point."""
    from tidal.config import EmbodiedConfig, load_config
    from tidal.runners import EmbodiedRunner

    cfg = load_config(
        EmbodiedConfig,
        EXAMPLES / "cartpole_ppo.yaml",
        [
            f"runner.run_dir={tmp_path}",
            "runner.progress=false",
            "cluster.backend=ray",
            f"cluster.address={ray.get_runtime_context().gcs_address}",
            "cluster.devices_per_node=null",
            "cluster.placement={env: '0', rollout: '2', actor: '1'}",
            "runner.max_steps=2",
            "runner.eval_interval=2",
            "env.total_num_envs=8",
            "rollout.num_steps=16",
            "actor.global_batch_size=128",
            "actor.micro_batch_size=64",
        ],
    )

    class FastPathOnly(EmbodiedRunner):
        def build(self):  # the runner binds each channel to its reader: no channel actor
            super().build()
            for name in ("env", "rollout", "actor", "weights"):
                assert self.channels[name].direct
                assert_no_channel_actor(self.channels[name])

    runner = FastPathOnly(cfg)
    try:
        summary = runner.run()
    finally:
        runner.close()
    rows = [
        json.loads(line)
        for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 2 and rows[-1]["eval/return_mean"] is not None
    assert "time/generate_rollouts" in rows[-1]


def test_unplaceable_group_is_a_clear_error(two_nodes):
    from tidal.runtime import PlacementError

    with pytest.raises(
        PlacementError, match="device 4 is out of range; the cluster has devices 0-3"
    ):
        EchoWorker.create_group().launch(two_nodes, placement="3-4", name="too_far")


def test_local_backend_refuses_multi_rank_torch_distributed():
    cluster = Cluster("local", devices_per_node=2)
    group = EchoWorker.create_group().launch(cluster, placement=2, name="dp")
    with pytest.raises(
        WorkerError, match="torch.distributed with world size 2 needs the 'ray' backend"
    ):
        group.allreduce().wait(timeout=30)
    single = EchoWorker.create_group().launch(cluster, placement=1, name="solo")
    assert single.allreduce().wait(timeout=30) == [1.0]
