"""Ray-only behaviour: torch.distributed across ranks, dying ranks, multi-node placement."""

import time

import pytest
import ray
from ray.cluster_utils import Cluster as RayTestCluster
from runtime_workers import EchoWorker

from tidal.runtime import Cluster, WorkerError

pytestmark = pytest.mark.ray


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
        env = group.env("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT").wait(timeout=60)
        assert [e["RANK"] for e in env] == ["0", "1"] and {e["WORLD_SIZE"] for e in env} == {"2"}
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env}) == 1
        # torch.distributed initialises unchanged from that environment, across the two nodes
        assert group.allreduce().wait(timeout=120) == [3.0, 3.0]
    finally:
        group.shutdown()


def test_one_rank_dying_fails_fast_naming_it(two_nodes):
    group = EchoWorker.create_group().launch(two_nodes, placement="0-2", name="fragile")
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"fragile\[rank 1\].die_on failed: rank died"):
        group.die_on(1).wait(timeout=50)
    assert time.monotonic() - start < 40  # not held up by the ranks still sleeping
    group.shutdown()


def test_unplaceable_group_is_a_clear_error(two_nodes):
    from tidal.runtime import PlacementError

    with pytest.raises(PlacementError, match="device 4 is out of range; the cluster has devices 0-3"):
        EchoWorker.create_group().launch(two_nodes, placement="3-4", name="too_far")


def test_local_backend_refuses_multi_rank_torch_distributed():
    cluster = Cluster("local", devices_per_node=2)
    group = EchoWorker.create_group().launch(cluster, placement=2, name="dp")
    with pytest.raises(WorkerError, match="torch.distributed with world size 2 needs the 'ray' backend"):
        group.allreduce().wait(timeout=30)
    single = EchoWorker.create_group().launch(cluster, placement=1, name="solo")
    assert single.allreduce().wait(timeout=30) == [1.0]
