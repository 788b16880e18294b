import pytest

from tidal.runtime import Cluster


@pytest.fixture(scope="module", params=["local", "ray"])
def cluster(request):
    """One cluster per backend per module (one Ray session for the whole module)."""
    c = Cluster(request.param, devices_per_node=4, ray_init_kwargs={"num_cpus": 2})
    yield c
    c.shutdown()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (benchmarks/gpu_check.py runs them on one)"
    )


def pytest_collection_modifyitems(config, items):
    """Without CUDA the ``gpu`` tests are deselected, and the summary says how many and why
    (never a silent skip)."""
    import torch

    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config._tidal_gpu_deselected = len(gpu)


def pytest_terminal_summary(terminalreporter, config):
    count = getattr(config, "_tidal_gpu_deselected", 0)
    if count:
        terminalreporter.write_line(
            f"{count} tests marked gpu deselected: this machine has no CUDA device "
            "(torch.cuda.is_available() is false); run benchmarks/gpu_check.py on a GPU machine"
        )


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A tiny chat model trained to play one tool loop (tests/agent_models.py)."""
    from agent_models import save_tool_model

    return save_tool_model(tmp_path_factory.mktemp("models") / "tools")
