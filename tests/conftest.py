import pytest

from tidal.runtime import Cluster


@pytest.fixture(scope="module", params=["local", "ray"])
def cluster(request):
    """One cluster per backend per module (one Ray session for the whole module)."""
    c = Cluster(request.param, devices_per_node=4, ray_init_kwargs={"num_cpus": 2})
    yield c
    c.shutdown()


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A tiny chat model trained to play one tool loop (tests/agent_models.py)."""
    from agent_models import save_tool_model

    return save_tool_model(tmp_path_factory.mktemp("models") / "tools")
