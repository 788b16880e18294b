import pytest

from tidal.runtime import Cluster


@pytest.fixture(scope="module", params=["local", "ray"])
def cluster(request):
    """One cluster per backend per module (one Ray session for the whole module)."""
    c = Cluster(request.param, devices_per_node=4, ray_init_kwargs={"num_cpus": 2})
    yield c
    c.shutdown()
