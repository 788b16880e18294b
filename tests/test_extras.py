"""Extras: a feature whose extra is missing fails naming the extra (at config time naming the key
too), and a core-only install (`pip install tidal`, no extras) configures and trains CartPole.

A package is made missing here by ``sys.modules[name] = None``: ``import name`` then raises
``ModuleNotFoundError`` and ``importlib.util.find_spec(name)`` returns None, as when it is not
installed."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.config import ConfigError, EmbodiedConfig, load_config
from tidal.extras import MissingExtraError, missing_extra, needs_extra

REPO = Path(__file__).resolve().parent.parent
CARTPOLE = REPO / "examples" / "embodied" / "cartpole_ppo.yaml"


def hide(monkeypatch, *packages):
    """Each package unimportable, as if not installed: its loaded submodules too (an import of
    ``package.sub`` already in ``sys.modules`` never looks at ``package``)."""
    for package in packages:
        for name in [n for n in sys.modules if n.startswith(f"{package}.")]:
            monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.setitem(sys.modules, package, None)


# -- the helper ---------------------------------------------------------------------------------


def test_a_missing_package_names_the_extra_and_the_install_command(monkeypatch):
    hide(monkeypatch, "ray")
    with pytest.raises(MissingExtraError) as error:
        with needs_extra("ray", "the ray backend"):
            import ray  # noqa: F401
    assert str(error.value) == (
        "the ray backend needs the 'ray' extra (ray is not installed): pip install 'tidal[ray]'"
    )
    assert isinstance(error.value, ImportError) and error.value.name == "ray"


def test_other_import_errors_pass_through_unchanged():
    with pytest.raises(ModuleNotFoundError) as error:  # tidal's own module: a bug, not an extra
        with needs_extra("llm", "x"):
            import tidal.no_such_module  # noqa: F401
    assert not isinstance(error.value, MissingExtraError)
    with pytest.raises(ImportError, match="cannot import name") as error:  # a wrong version
        with needs_extra("llm", "x"):
            from json import no_such_name  # noqa: F401
    assert not isinstance(error.value, MissingExtraError)


def test_a_nested_block_keeps_the_inner_extra(monkeypatch):
    hide(monkeypatch, "openai")
    with pytest.raises(MissingExtraError, match=r"'agents' extra"):
        with needs_extra("llm", "outer"):
            with needs_extra("agents", "inner"):
                import openai  # noqa: F401


def test_missing_extra_imports_nothing_and_names_the_first_missing_package(monkeypatch):
    hide(monkeypatch, "wandb")
    assert missing_extra("trackers", "x", "json") is None
    assert missing_extra("trackers", "the wandb logger", "json", "wandb") == (
        "the wandb logger needs the 'trackers' extra (wandb is not installed): "
        "pip install 'tidal[trackers]'"
    )


# -- config time: the key and the extra ---------------------------------------------------------


@pytest.mark.parametrize(
    "hidden,overrides,message",
    [
        (("ray",), ["cluster.backend=ray"], r"cluster.backend: the ray backend needs the 'ray'"),
        (("zmq",), ["cluster.backend=ray"], r"cluster.backend: .*\(zmq is not installed\)"),
        (
            ("tensorboard",),
            ["runner.loggers=[jsonl,tensorboard]"],
            r"runner.loggers: the tensorboard logger needs the 'trackers' extra",
        ),
        (("mlflow",), ["runner.loggers=[mlflow]"], r"runner.loggers: the mlflow logger .*trackers"),
        (
            ("metaworld",),
            ["env.adapter=metaworld", "env.id=reach-v3"],
            r"env.id: cannot make 'reach-v3' with the metaworld adapter: the metaworld env "
            r"adapter needs the 'embodied' extra",
        ),
    ],
)
def test_config_errors_name_the_key_and_the_extra(monkeypatch, hidden, overrides, message):
    """The preflight checks, before any worker or run folder (the env is made by the probe)."""
    from tidal.runners.preflight import check_embodied, probe_env

    hide(monkeypatch, *hidden)
    cfg = load_config(EmbodiedConfig, CARTPOLE, overrides)
    with pytest.raises(ConfigError, match=message) as error:
        check_embodied(cfg)
        probe_env(cfg)
    assert "pip install 'tidal[" in str(error.value)


def test_the_llm_half_needs_the_llm_extra(tmp_path):
    """``tidal train`` of a language config, transformers missing: exit 2 naming the extra."""
    hide = "import sys; sys.modules['transformers'] = None; from tidal.cli import main; sys.exit(main())"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            hide,
            "train",
            str(REPO / "examples" / "llm" / "arith_grpo.yaml"),
            f"runner.run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "needs the 'llm' extra" in done.stderr and "pip install 'tidal[llm]'" in done.stderr
    assert not list(tmp_path.iterdir())  # no run folder


def test_the_llm_half_runs_without_the_agents_extra():
    """openai missing: the language runner imports (GRPO on the llm extra alone), and only an
    agent workflow asks for the 'agents' extra, when it is built."""
    probe = """
import sys
sys.modules['openai'] = sys.modules['agents'] = None
import tidal.runners.llm.train
from tidal.extras import MissingExtraError
from tidal.rollout.workflows import WORKFLOWS
try:
    WORKFLOWS.get('agent')(None)
except MissingExtraError as error:
    print(error)
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "needs the 'agents' extra" in done.stdout, done.stdout


def test_tensorboard_is_a_default_logger_only_where_it_is_installed(monkeypatch):
    from tidal.runners.preflight import check_embodied

    cfg = load_config(EmbodiedConfig, CARTPOLE)
    assert cfg.runner.loggers is None  # decided by the preflight, which asks what is installed
    check_embodied(cfg)
    assert cfg.runner.loggers == ["jsonl", "tensorboard"]
    hide(monkeypatch, "tensorboard")
    cfg = load_config(EmbodiedConfig, CARTPOLE)
    check_embodied(cfg)  # a core install trains with the defaults
    assert cfg.runner.loggers == ["jsonl"]


def test_the_ray_backend_without_ray_names_the_extra(monkeypatch):
    from tidal.runtime import Cluster

    hide(monkeypatch, "ray")
    with pytest.raises(MissingExtraError, match=r"pip install 'tidal\[ray\]'"):
        Cluster("ray")


# -- a core-only install ------------------------------------------------------------------------

# What the extras bring; a core install must have none of them.
EXTRA_PACKAGES = (
    "ray",
    "zmq",
    "mujoco",
    "metaworld",
    "transformers",
    "datasets",
    "math_verify",
    "fastapi",
    "aiohttp",
    "tensorboard",
    "wandb",
    "mlflow",
    "openai",
)


# Runs each `tidal` command line of argv[1] (JSON) in this process; prints [[exit code, stderr]].
TRAIN_EACH = """
import contextlib, io, json, sys
from tidal.cli import main
outcomes = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        outcomes.append([main(argv), err.getvalue()])
print(json.dumps(outcomes))
"""


def _run(args, cwd, env, check=True):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_core_install_configures_and_trains_cartpole(tmp_path):
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The project's packaging files only: pip builds in the source folder, not in the checkout.
    source = tmp_path / "tidal-src"
    shutil.copytree(REPO / "tidal", source / "tidal", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python, tidal = venv / "bin" / "python", str(venv / "bin" / "tidal")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-compile"]
    _run([*pip, "torch==2.13.0"], tmp_path, env)
    _run([*pip, str(source)], tmp_path, env)
    installed = time.monotonic()

    probe = "import importlib.util as u, sys; print([p for p in sys.argv[1:] if u.find_spec(p)])"
    found = _run([str(python), "-c", probe, *EXTRA_PACKAGES], tmp_path, env).stdout.strip()
    assert found == "[]", f"the core install pulled packages of the extras: {found}"

    shown = _run([tidal, "config", str(CARTPOLE)], tmp_path, env).stdout
    assert "loggers: null  # decided: [jsonl];" in shown
    run_dir = f"runner.run_dir={tmp_path / 'runs'}"
    _run([tidal, "train", str(CARTPOLE), "runner.max_steps=2", run_dir], tmp_path, env)
    lines = (tmp_path / "runs" / "cartpole_ppo" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["step"] for row in rows] == [1, 2] and all("train/policy_loss" in r for r in rows)

    # the features of the extras, each through `tidal train` (one process: torch imports once)
    cases = [
        (CARTPOLE, ["cluster.backend=ray"], "config error: cluster.backend: the ray backend"),
        (CARTPOLE, ["runner.loggers=[wandb]"], "config error: runner.loggers: the wandb logger"),
        (
            "embodied/metaworld_reach_vla.yaml",
            [],
            "the metaworld env adapter needs the 'embodied' extra",
        ),
        ("embodied/halfcheetah_ppo.yaml", [], "config error: env.id: cannot make 'HalfCheetah"),
        ("llm/arith_grpo.yaml", [], "missing extra: the inference client needs the 'llm' extra"),
    ]
    commands = [["train", str(REPO / "examples" / c), *o, run_dir] for c, o, _ in cases]
    printed = _run([str(python), "-c", TRAIN_EACH, json.dumps(commands)], tmp_path, env).stdout
    outcomes = json.loads(printed.splitlines()[-1])
    for (_, _, message), (code, stderr) in zip(cases, outcomes, strict=True):
        assert code == 2 and message in stderr, stderr[-2000:]
        assert "pip install 'tidal[" in stderr
    print(
        f"core install: {installed - started:.0f} s to install, "
        f"{time.monotonic() - installed:.0f} s to configure, train and fail as it should"
    )
