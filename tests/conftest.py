from pathlib import Path

import pytest

from tidal.runtime import Cluster


@pytest.fixture(scope="module")
def ray_session():
    """One Ray session for a module's runs, started as tidal starts its own: tidal's runs and
    clusters reuse a session they find (and leave it up), and starting one costs 7-15 s on two
    cores. Module-scoped, so no later module finds a session it did not ask for."""
    with Cluster("ray", ray_init_kwargs={"num_cpus": 2}):
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama of tidal.inference.tiny (seed 0), one per module; a module that needs
    another model defines its own ``model_dir``."""
    from tidal.inference.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("models") / "v0", seed=0)


@pytest.fixture(scope="module", params=["local", "ray"])
def cluster(request):
    """One cluster per backend per module (one Ray session for the whole module)."""
    c = Cluster(request.param, devices_per_node=4, ray_init_kwargs={"num_cpus": 2})
    yield c
    c.shutdown()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu(count=1): needs count CUDA GPUs (benchmarks/gpu_check.py runs them on one)",
    )


# The modules that start Ray clusters: under pytest-xdist (`make test` runs two workers) they
# are one unit of work, run one after another on one worker, so that two Ray clusters never
# split two cores (and no run joins the other worker's cluster).
RAY_MODULES = {
    "test_agent_runs",
    "test_async_embodied",
    "test_chaos",
    "test_docs_ray",
    "test_embodied",
    "test_embodied_resume",
    "test_gpu",
    "test_llm_runs",
    "test_llm_trainer",
    "test_runtime",
    "test_runtime_ray",
    "test_sac",
    "test_strategies",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's work units: each module one (its module fixtures are built once), the Ray
    modules one together. (``--dist loadgroup`` cannot do it: its group suffix on node ids is
    lost under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray" if Path(module).stem in RAY_MODULES else module

    return ModuleScheduling(config, log)


def uses_ray(item) -> bool:
    """Whether a test starts or joins a Ray session (its marker, fixture or cluster backend)."""
    params = getattr(item, "callspec", None)
    return (
        item.get_closest_marker("ray") is not None
        or "ray_session" in item.fixturenames
        or (params is not None and params.params.get("cluster") == "ray")
    )


def gpus_needed(item) -> int:
    marker = item.get_closest_marker("gpu")
    return 0 if marker is None else int(marker.kwargs.get("count", 1))


def pytest_collection_modifyitems(config, items):
    """A Ray test outside ``RAY_MODULES`` is a usage error (under xdist its cluster would split
    the cores with the other worker's). The ``gpu`` tests that need more CUDA devices than the
    machine has are deselected, and the summary says how many and why (never a silent skip)."""
    import torch

    strays = sorted({Path(i.path).stem for i in items if uses_ray(i)} - RAY_MODULES)
    if strays:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(strays)} to RAY_MODULES")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    short = [item for item in items if gpus_needed(item) > gpus]
    if short:
        config.hook.pytest_deselected(items=short)
        items[:] = [item for item in items if gpus_needed(item) <= gpus]
        config._tidal_gpu_deselected = (len(short), gpus)
        if hasattr(config, "workeroutput"):  # an xdist worker: tell the controller
            config.workeroutput["gpu_deselected"] = (len(short), gpus)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: the workers deselected the ``gpu`` tests (each the same count)."""
    node.config._tidal_gpu_deselected = node.workeroutput.get("gpu_deselected", (0, 0))


def pytest_terminal_summary(terminalreporter, config):
    count, gpus = getattr(config, "_tidal_gpu_deselected", (0, 0))
    if count:
        terminalreporter.write_line(
            f"{count} tests marked gpu deselected: they need more CUDA devices than this "
            f"machine's {gpus} (torch.cuda.device_count()); run benchmarks/gpu_check.py on a "
            "GPU machine (and the gpu(count=2) tests on one with two)"
        )


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A tiny chat model trained to play one tool loop (tests/agent_models.py)."""
    from agent_models import save_tool_model

    return save_tool_model(tmp_path_factory.mktemp("models") / "tools")


@pytest.fixture(scope="session")
def arith_model(tmp_path_factory):
    """A tiny Llama warm-started by ``tidal sft`` on generated sums (the language runs' model)."""
    import math

    from transformers import AutoTokenizer

    from tidal.config import load_config
    from tidal.config.llm import LLMConfig
    from tidal.runners.llm.sft import run_sft

    path = tmp_path_factory.mktemp("m") / "arith"
    cfg = load_config(
        LLMConfig,
        None,
        [
            f"model.path={path}",
            "model.hidden=32",
            "model.layers=1",
            "sft.steps=20",
            "sft.eval_size=16",
        ],
    )
    summary = run_sft(cfg)
    # 20 steps must already beat guessing uniformly over the vocabulary
    assert summary["final_loss"] < math.log(len(AutoTokenizer.from_pretrained(path))), summary
    return path
