"""Every command of README.md and docs/*.md, and how the tests run it: shortened (one step,
small sizes) by tests/test_docs.py and tests/test_docs_ray.py, in the documents' order, in one
folder that holds ``examples`` (a link) and the ``runs/`` the commands write, as a new user's
checkout would; or, where a command needs a long install or a GPU, checked by `tidal config`
(every rule of the run, nothing run).

A command in a document without an entry here fails tests/test_docs.py: documents and tests
stay in step. (``pip install`` lines are `make setup`'s, which CI runs.)"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))


@dataclass(frozen=True)
class Way:
    """How a documented command runs in the tests."""

    extra: tuple[str, ...] = ()  # overrides appended: one step, small sizes
    flags: tuple[tuple[str, str], ...] = ()  # (flag, value) replacing the document's value
    ray: bool = False  # it starts a Ray cluster: tests/test_docs_ray.py runs it
    not_run: str = ""  # a make target: why it is not run here, and what runs it instead
    config_only: str = ""  # why `tidal config` checks it (every rule, nothing run) instead


ONE_STEP = ("runner.max_steps=1", "runner.eval_interval=0", "runner.target_value=null")
NO_BUDGETS = ("runner.max_env_steps=null", "runner.max_minutes=null")
# the PPO examples: one step of a few envs x 8 chunk steps, the whole step one minibatch;
# evaluations on 2 envs of short episodes
PPO_SMALL = (*ONE_STEP, *NO_BUDGETS, "rollout.num_steps=8", "env.eval_num_envs=2")
# evaluated: `tidal plot` draws eval/return_mean of two of these runs
CARTPOLE = (*PPO_SMALL, "actor.global_batch_size=64", "runner.eval_interval=1")
PENDULUM = (*PPO_SMALL, "env.total_num_envs=4", "actor.global_batch_size=32")
CHEETAH = (*PPO_SMALL, "env.total_num_envs=4", "actor.global_batch_size=32",
           "env.max_episode_steps=16")  # fmt: skip
GRPO = (*ONE_STEP, *NO_BUDGETS, "env.total_num_envs=16", "env.max_episode_steps=16",
        "rollout.num_steps=16", "actor.global_batch_size=256", "env.eval_num_envs=2")  # fmt: skip
SAC = (*ONE_STEP, "runner.max_env_steps=48", "replay.warmup_steps=32", "replay.batch_size=16",
       "env.eval_num_envs=2", "env.max_episode_steps=16")  # fmt: skip
# MetaWorld: one scripted demo of 10 steps per task, 2 SFT steps; RL on 10-step episodes
REACH_SFT = ("sft.demos=1", "sft.steps=2", "env.max_episode_steps=10", "env.eval_num_envs=2")
REACH = (*PPO_SMALL, "env.max_episode_steps=10", "rollout.num_steps=10",
         "actor.global_batch_size=80")  # fmt: skip
MT10_SFT = (*REACH_SFT, "env.eval_num_envs=10")  # a task per env
MT10 = (*ONE_STEP, *NO_BUDGETS, "runner.save_interval=1", "env.total_num_envs=20",
        "env.group_size=2", "env.max_episode_steps=10", "rollout.num_steps=10",
        "actor.global_batch_size=200", "env.eval_num_envs=10")  # fmt: skip
# LIBERO's robosuite envs take minutes to build on two busy cores: `tidal config` checks the
# commands (model.path as sft would leave it is not there), tests/test_libero.py runs one step
LIBERO = "robosuite's envs build slowly; tests/test_libero.py runs one step of tidal train"
NO_SAVED_POLICY = ("model.path=null",)
# the language examples: 2 SFT steps of the tiny models, one GRPO step of 2 groups of 2
LLM_SFT = ("sft.steps=2", "sft.eval_size=4")
LLM = (*ONE_STEP, "rollout.batch_size=2", "rollout.group_size=2", "data.eval_size=4")

MADE_ELSEWHERE = "CI's own `make test` (.ci/run)"
COMMANDS: dict[str, Way] = {
    "make train": Way(not_run="its recipe is `tidal train examples/embodied/cartpole_ppo.yaml`, run next"),
    "make test": Way(not_run=f"the test suite itself: {MADE_ELSEWHERE}"),
    "tidal train examples/embodied/cartpole_ppo.yaml": Way(CARTPOLE),
    "tidal train examples/embodied/cartpole_grpo.yaml": Way(GRPO),
    "tidal train examples/embodied/pendulum_ppo.yaml": Way(PENDULUM),
    "tidal train examples/embodied/halfcheetah_ppo.yaml": Way(CHEETAH),
    "tidal train examples/embodied/cartpole_ppo.yaml cluster.backend=ray cluster.placement={env: '0', rollout: '1', actor: '2-3'} cluster.devices_per_node=4": Way(CARTPOLE, ray=True),
    "tidal sft examples/embodied/metaworld_reach_vla.yaml": Way(REACH_SFT),
    "tidal train examples/embodied/metaworld_reach_vla.yaml": Way(REACH),
    "tidal sft examples/embodied/metaworld_reach_pixels_cnn.yaml": Way(REACH_SFT),
    "tidal sft examples/embodied/libero_object_ppo.yaml": Way(NO_SAVED_POLICY, config_only=LIBERO),
    "tidal train examples/embodied/libero_object_ppo.yaml": Way(NO_SAVED_POLICY, config_only=LIBERO),
    "tidal eval examples/embodied/libero_object_ppo.yaml --episodes 500": Way(NO_SAVED_POLICY, config_only=LIBERO),
    "tidal sft examples/embodied/libero_object_vla_grpo.yaml": Way(NO_SAVED_POLICY, config_only=LIBERO),
    "tidal train examples/embodied/libero_object_vla_grpo.yaml": Way(NO_SAVED_POLICY, config_only=LIBERO),
    "tidal sft examples/embodied/metaworld_mt10_vla_grpo.yaml": Way(MT10_SFT),
    "tidal train examples/embodied/metaworld_mt10_vla_grpo.yaml": Way(MT10),
    "tidal eval examples/embodied/metaworld_mt10_vla_grpo.yaml --episodes 200 --checkpoint runs/metaworld_mt10_vla_grpo/checkpoints": Way(("env.eval_num_envs=10",), (("--episodes", "10"),)),
    "tidal train examples/embodied/pendulum_ppo.yaml rollout.max_staleness=2": Way(PENDULUM),
    "tidal train examples/embodied/halfcheetah_ppo.yaml rollout.max_staleness=2 cluster.backend=ray cluster.devices_per_node=2 cluster.pin_cpus=true cluster.placement={'env,rollout': '0', actor: '1'}": Way(CHEETAH, ray=True),
    "tidal train examples/embodied/pendulum_sac.yaml": Way(SAC),
    "tidal train examples/embodied/halfcheetah_sac.yaml": Way(SAC),
    "make setup": Way(not_run=f"the install (tidal, its extras and the model package): {MADE_ELSEWHERE} runs it"),
    "make smollm2": Way(not_run="its recipe is `tidal train examples/llm/smollm2_grpo.yaml`: tests/test_smollm2.py trains it, shortened"),
    "tidal sft examples/llm/arith_grpo.yaml": Way(LLM_SFT),
    "tidal train examples/llm/arith_grpo.yaml": Way(LLM),
    "tidal train examples/llm/arith_grpo.yaml rollout.max_staleness=0": Way(LLM),
    "tidal serve --model runs/models/arith --port 30000": Way(flags=(("--port", "0"),)),
    "tidal sft examples/llm/reverse_grpo.yaml": Way(LLM_SFT, ray=True),
    "tidal train examples/llm/reverse_grpo.yaml cluster.backend=ray cluster.devices_per_node=3 cluster.placement={rollout: '0', actor: '1-2'} rollout.pause_mode=keep": Way(LLM, ray=True),
    "tidal sft examples/llm/guess_grpo.yaml": Way(LLM_SFT),
    "tidal train examples/llm/guess_grpo.yaml": Way(LLM),
    "tidal sft examples/llm/gsm8k_grpo.yaml": Way(LLM_SFT),
    "tidal train examples/llm/gsm8k_grpo.yaml": Way((*LLM, "runner.save_interval=1")),
    "tidal eval examples/llm/gsm8k_grpo.yaml --n 8 --checkpoint runs/gsm8k_grpo/checkpoints": Way(("data.eval_size=2",), (("--n", "2"),)),
    "make gsm8k": Way(not_run="three 1000-step runs: tests/test_llm_e2e.py::test_the_gsm8k_recipe_applies_each_objective_preset_over_the_demo runs the recipe's steps, shortened"),
    "make vllm": Way(not_run=f"vLLM's install (minutes): {MADE_ELSEWHERE} builds it"),
    "tidal train examples/llm/arith_grpo.yaml rollout.engine=vllm": Way(config_only="vLLM's server takes minutes to start; tests/test_vllm.py trains this command's run with vLLM"),
    "tidal config examples/embodied/cartpole_ppo.yaml": Way(),
    "tidal train examples/embodied/cartpole_ppo.yaml runner.loggers=[jsonl,tensorboard,wandb,mlflow]": Way(CARTPOLE),
    "tidal plot runs/cartpole_ppo runs/cartpole_ppo-2 -x env_steps -o curves.png": Way(),
    "tidal train examples/embodied/halfcheetah_ppo.yaml env.total_num_envs=32 cluster.backend=ray cluster.devices_per_node=2 cluster.pin_cpus=true cluster.placement={'env,rollout': '0-1', actor: '1'} cluster.same_process=['env,rollout']": Way((*CHEETAH, "env.total_num_envs=8", "actor.global_batch_size=64"), ray=True),
}  # fmt: skip


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every ``tidal ...`` and ``make ...`` of the documents' bash blocks, in order, as
    (document, argv without the program's path)."""
    found = []
    for name in DOCUMENTS:
        blocks = re.findall(r"```bash\n(.*?)```", (ROOT / name).read_text(), flags=re.S)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    words = shlex.split(part, comments=True)
                    if words and (words[0].endswith("tidal") or words[0] == "make"):
                        found.append(
                            (name, ["tidal" if words[0].endswith("tidal") else "make", *words[1:]])
                        )
    return found


def key(argv: list[str]) -> str:
    return " ".join(argv)


def shortened(argv: list[str], way: Way) -> list[str]:
    """The command's arguments (without ``tidal``) with the way's flag values and overrides;
    ``tidal config`` of them where the way says so."""
    if way.config_only:  # its config file and overrides, without the command's own flags
        return ["config", argv[2], *(w for w in argv[3:] if "=" in w), *way.extra]
    args = list(argv[1:])
    for flag, value in way.flags:
        args[args.index(flag) + 1] = value
    return [*args, *way.extra]


def runs(ray: bool) -> list[tuple[str, list[str], Way]]:
    """The commands one test module runs (Ray's or the others), in the documents' order."""
    out, seen = [], set()
    for doc, argv in documented_commands():
        way = COMMANDS.get(key(argv))
        if way is not None and way.ray == ray and argv[0] == "tidal" and key(argv) not in seen:
            out.append((doc, argv, way))
            seen.add(key(argv))  # a command in two documents runs once, where it comes first
    return out


def command_params(ray: bool) -> list:
    """The commands as test parameters, named by their place and first words."""
    return [
        pytest.param(doc, argv, way, id=f"{i}-{' '.join(argv[1:3])}")
        for i, (doc, argv, way) in enumerate(runs(ray))
    ]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder as a new user's checkout has it for the commands: ``examples`` (a link), and
    the ``runs/`` they write; offline trackers."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "examples").symlink_to(ROOT / "examples")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.setenv("WANDB_MODE", "offline")
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield folder


def run_documented(workspace: Path, doc: str, argv: list[str], way: Way, capsys) -> None:
    """One documented command, shortened, in ``workspace``: in this process, as ``tidal``'s
    entry point runs it (`tidal serve`, which serves until stopped, as a process of its own)."""
    from tidal import cli

    args = shortened(argv, way)
    if args[0] == "serve":
        return serve(args, workspace)
    code = cli.main(args)
    assert code == 0, f"{doc}: tidal {' '.join(args)}: {capsys.readouterr().err[-3000:]}"


def serve(args: list[str], workspace: Path) -> None:
    """`tidal serve` until it answers /health, then stopped as a user stops it (SIGINT)."""
    import httpx

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tidal.cli", *args]
    proc = subprocess.Popen(command, cwd=workspace, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "tidal: serving MODEL on ADDRESS" once it listens
        assert line.startswith("tidal: serving"), line
        address = line.split(" on ")[-1].strip()
        assert httpx.get(f"{address}/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait(10)
