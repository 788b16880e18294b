"""The checks of a config that need the world, run before any worker starts or any run folder
exists: names against their registries (estimators, backends, policies, env adapters, engines,
tasks, rewards, KL kinds, aggregations), the placement's ranks, dataset files and their keys,
model folders, the env (one instance made here), saved-policy folders. Each fails with a
``ConfigError`` naming the key. The rules between keys are tidal.config's; every function here
runs them too, so a runner, ``tidal sft`` and ``tidal eval`` call one function each, and
``tidal config`` runs a training run's whole set (``check_embodied_run``, and
``tidal.runners.llm.preflight.check_llm_run``) without starting anything. The keys written
null/auto that need the world to decide (``rollout.weight_sync``, ``runner.loggers``) are
decided here, once, and recorded as decided (``tidal.config.schema.decide``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from pathlib import Path

import gymnasium as gym
import torch

from tidal.algorithms import advantage_spec, list_advantages
from tidal.algorithms.kl import KL_KINDS
from tidal.algorithms.losses import AGGREGATIONS, LOGPROB_LEVELS, SURROGATES
from tidal.checkpoint import checkpoint_argument, read_meta
from tidal.config import ConfigError
from tidal.config.common import LOGGER_PACKAGES, ClusterConfig, one_of
from tidal.config.embodied import (
    SHARED_MODEL_FIELDS,
    EmbodiedConfig,
    EnvConfig,
    ModelConfig,
    components,
    same_process,
    validate_embodied,
    validate_sft,
)
from tidal.config.layout import rank_micro_batch, validate_groups, validate_layout
from tidal.config.loader import require
from tidal.config.offpolicy import ON_POLICY, SAC_POLICIES
from tidal.config.schema import decide
from tidal.data.replay import buffer_layout, read_demos
from tidal.envs import adapter_arguments, list_env_adapters
from tidal.envs.demos import DEMO_SOURCES
from tidal.extras import MissingExtraError, installed, missing_extra
from tidal.memory import MemoryPlan
from tidal.memory import plan as memory_plan
from tidal.models.factory import build_from_config
from tidal.models.lora import apply_lora, check_checkpoint_lora, check_lora, no_init
from tidal.models.policy import POLICIES, build_policy, policy_arguments
from tidal.models.saving import read_saved_config, space_from_json
from tidal.runners.embodied.select import EMBODIED_RUNNERS
from tidal.runners.env_probe import env_spaces
from tidal.runtime import ComponentPlacement, PlacementError
from tidal.runtime.backends import backend_class, backend_names
from tidal.runtime.devices import DeviceError, check_device_setting
from tidal.runtime.placement import _parse_spec_string
from tidal.strategies import STRATEGIES, check_resume
from tidal.workers.reward_worker import REWARD_MODELS

# -- both halves ---------------------------------------------------------------------------------


log = logging.getLogger("tidal.preflight")


def check_common(cfg) -> None:
    """The registered names of the shared sections."""
    cluster = cfg.cluster
    one_of(cluster.backend, backend_names(), "cluster.backend")
    require(
        not cluster.pin_cpus or backend_class(cluster.backend).multi_process,
        "cluster.pin_cpus",
        f"pins a process per rank; the {cluster.backend} backend's ranks are threads of one process",
    )
    try:
        backend_class(cluster.backend).check_installed()
    except MissingExtraError as exc:
        raise ConfigError(f"cluster.backend: {exc}") from None
    if cluster.address is None:  # the cluster starts on this node: ask its devices now
        try:
            check_device_setting(cluster.device)
        except DeviceError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.runner.loggers is None:  # jsonl, and TensorBoard where the 'trackers' extra is
        decide(
            cfg,
            "runner.loggers",
            ["jsonl", "tensorboard"] if installed("tensorboard") else ["jsonl"],
        )
    for name in cfg.runner.loggers:
        if name in LOGGER_PACKAGES:
            missing = missing_extra("trackers", f"the {name} logger", LOGGER_PACKAGES[name])
            require(missing is None, "runner.loggers", missing)
    one_of(cfg.actor.strategy, STRATEGIES.names(), "actor.strategy")
    one_of(cfg.algorithm.adv_type, list_advantages(), "algorithm.adv_type")
    one_of(cfg.algorithm.policy_loss, SURROGATES, "algorithm.policy_loss")
    eta = cfg.rollout.max_staleness
    if eta > 0 and not cfg.algorithm.use_decoupled_loss:
        log.warning(
            "algorithm.use_decoupled_loss=false with rollout.max_staleness=%d: plain PPO clips "
            "around the behaviour policy, up to %d versions behind the weights, and then pulls the "
            "policy back towards it; expect slow or no learning (leave the key unset for the "
            "decoupled loss)",
            eta,
            eta,
        )


def decide_loggers(cfg) -> None:
    """``runner.loggers`` null: metrics.jsonl, and TensorBoard where the 'trackers' extra is
    installed (a core install trains with its defaults, a full one writes what it always has)."""
    if cfg.runner.loggers is None:
        found = ["jsonl", "tensorboard"] if installed("tensorboard") else ["jsonl"]
        decide(cfg, "runner.loggers", found)


def decide_weight_sync(cfg, takes: tuple[str, ...], why: str) -> None:
    """``rollout.weight_sync``: auto becomes the first transport the rollout ``takes`` (its
    default); another must be one it takes (``why``: which rollout, for the error)."""
    r = cfg.rollout
    if r.weight_sync == "auto":
        decide(cfg, "rollout.weight_sync", takes[0])
    require(
        r.weight_sync in takes,
        "rollout.weight_sync",
        f"{why} takes {' | '.join(takes)}, got {r.weight_sync!r}",
    )


def world_sizes(
    cluster: ClusterConfig, names: list[str], shared: list[str] | None = None
) -> dict[str, int]:
    """Ranks per component from the placement (and ``shared``: the ``same_process`` entries,
    by default the cluster's own), checked before the cluster exists."""
    try:
        placement = ComponentPlacement(
            cluster.resolved_placement(names),
            _num_devices_hint(cluster),
            same_process=cluster.same_process_entries() if shared is None else shared,
        )
        return {c: placement.get_world_size(c) for c in names}
    except PlacementError as exc:
        msg = str(exc)  # some placement errors already start with their key
        raise ConfigError(msg if msg.startswith("cluster.") else f"cluster.{msg}") from None


def _num_devices_hint(cluster: ClusterConfig) -> int:
    """Devices to validate placement against before the cluster exists: the configured count,
    or the highest device named (the cluster checks the real count when it starts)."""
    if cluster.devices_per_node is not None:
        return cluster.devices_per_node
    named = [
        d
        for spec in cluster.placement.values()
        if spec != "all"
        for d in _parse_spec_string(str(spec), 1 << 16, "cluster.placement")
    ]
    return max([os.cpu_count() or 1, *(d + 1 for d in named)])


def check_actor_ranks(cfg, ranks: int, what: str) -> None:
    """The actor's ranks fit its strategy and, more than one, run as processes."""
    multi_process = backend_class(cfg.cluster.backend).multi_process
    STRATEGIES.get(cfg.actor.strategy).check_ranks(ranks, multi_process)
    require_processes(cfg.cluster, ranks, what)


def require_processes(cluster: ClusterConfig, ranks: int, what: str) -> None:
    """More than one rank of a data-parallel group needs a backend whose ranks are processes."""
    require(
        ranks == 1 or backend_class(cluster.backend).multi_process,
        "cluster.placement",
        f"{what} needs cluster.backend=ray",
    )


def import_object(spec: str, key: str):
    """``module.path:name`` imported, or a config error naming ``key``."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import {module_name!r}: {exc}") from None
    require(hasattr(module, name), key, f"module {module_name!r} has no {name!r}")
    return getattr(module, name)


# -- the embodied half ---------------------------------------------------------------------------


def check_embodied(cfg: EmbodiedConfig) -> dict[str, int]:
    """Every rule of an embodied config but the env's and the saved policy's own (those need an
    env made: ``probe_env``); the world size of each component."""
    env, alg = cfg.env, cfg.algorithm
    one_of(alg.name, EMBODIED_RUNNERS.names(), "algorithm.name")
    check_common(cfg)
    one_of(cfg.model.name, POLICIES.names(), "model.name")
    if cfg.reward.enabled:
        one_of(cfg.reward.name, REWARD_MODELS.names(), "reward.name")
    one_of(alg.logprob_type, LOGPROB_LEVELS, "algorithm.logprob_type")
    one_of(alg.loss_agg, AGGREGATIONS, "algorithm.loss_agg")
    one_of(alg.kl_kind, KL_KINDS, "algorithm.kl_kind")
    one_of(env.adapter, list_env_adapters(), "env.adapter")
    spec = advantage_spec(alg.adv_type)
    require(
        alg.reward_type == "chunk" or not spec.needs_critic,
        "algorithm.reward_type",
        f"'action' needs a value per action; use 'chunk' with adv_type {alg.adv_type}",
    )
    require(
        cfg.model.critic or not spec.needs_critic,
        "model.critic",
        f"adv_type {alg.adv_type} needs a critic",
    )
    validate_embodied(cfg)
    if cfg.asynchronous_rollout():  # it takes a waiting update between chunk steps
        why = "an asynchronous rollout (rollout.max_staleness > 0, or algorithm.name sac)"
        decide_weight_sync(cfg, ("channel",), why)
    else:
        decide_weight_sync(cfg, ("collective", "channel", "disk"), "a synchronous rollout")
    worlds = world_sizes(cfg.cluster, components(cfg), same_process(cfg))
    validate_layout(cfg, worlds)
    _say_micro_batch(cfg, worlds["actor"])
    if spec.needs_groups:
        validate_groups(cfg, worlds["actor"])
    check_actor_ranks(cfg, worlds["actor"], "a data-parallel actor (more than one rank)")
    _check_renders(env)
    _check_policy_arguments(cfg.model)
    if cfg.replay.sft_demos:
        _check_demo_source(env.adapter, "replay.sft_demos", "replay.sft_demos")
    return worlds


def _say_micro_batch(cfg: EmbodiedConfig, actor_ranks: int) -> None:
    act, micro = cfg.actor, rank_micro_batch(cfg.actor, actor_ranks)
    if cfg.algorithm.name in ON_POLICY and micro < act.micro_batch_size:
        log.info(
            f"actor.micro_batch_size: {act.micro_batch_size} is more than a rank's share of "
            f"actor.global_batch_size ({act.global_batch_size} / {actor_ranks} actor ranks): "
            f"each rank computes micro-batches of {micro}"
        )


def _check_renders(env: EnvConfig) -> None:
    require(
        env.obs_mode == "state" or "obs_mode" in adapter_arguments(env.adapter),
        "env.obs_mode",
        f"the {env.adapter} adapter renders no pixels; use state (or e.g. adapter metaworld)",
    )


def _check_policy_arguments(model: ModelConfig) -> None:
    """``model.kwargs`` the policy takes; shared fields it does not take left at their defaults."""
    takes, defaults = policy_arguments(model.name), ModelConfig()
    for key in model.kwargs:
        require(
            key in takes,
            f"model.kwargs.{key}",
            f"policy {model.name!r} takes no such argument; it takes {', '.join(sorted(takes))}",
        )
    for key in SHARED_MODEL_FIELDS:
        require(
            key in takes or getattr(model, key) == getattr(defaults, key),
            f"model.{key}",
            f"policy {model.name!r} does not use it; leave it at its default",
        )


def saved_policy_config(path: str) -> dict:
    """The ``config.json`` of a saved policy folder, or a config error naming ``model.path``."""
    try:
        return read_saved_config(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_saved_policy(model: ModelConfig, num_action_chunks: int) -> None:
    """``model.path`` (when set) a saved folder of the same policy with the same chunk size;
    checked when a run starts from it (``tidal sft`` writes it, so a config may name it first)."""
    if model.path is not None:
        saved = saved_policy_config(model.path)
        require(
            saved["name"] == model.name,
            "model.name",
            f"{model.path!r} holds a {saved['name']!r} policy, not {model.name!r}",
        )
        require(
            saved["num_action_chunks"] == num_action_chunks,
            "env.num_action_chunks",
            f"{model.path!r} predicts chunks of {saved['num_action_chunks']}, not {num_action_chunks}",
        )


def probe_env(cfg: EmbodiedConfig):
    """The spaces and time limit of the configured env, from one instance made here: an env
    that cannot be made, or a saved policy made for other spaces, is a config error."""
    env = cfg.env
    spaces, max_episode_steps = env_spaces(env)
    if cfg.model.path is not None:
        check_saved_policy(cfg.model, env.num_action_chunks)
        _check_saved_spaces(cfg.model.path, *spaces)
    for key, problem in POLICIES.get(cfg.model.name).config_problems(
        cfg.model, cfg.algorithm, spaces[1]
    ):
        raise ConfigError(f"{key}: {problem}")
    check_policy_lora(cfg.model, *spaces, env.num_action_chunks)
    return spaces, max_episode_steps


def check_embodied_run(cfg: EmbodiedConfig) -> None:
    """Everything ``tidal train`` checks before a worker starts (``tidal config`` runs it too):
    the rules, the registered names, the layout, the env made once, the policy built for its
    spaces (on the meta device), and the off-policy algorithm's own."""
    worlds = check_embodied(cfg)
    spaces, _ = probe_env(cfg)
    if cfg.algorithm.name == "sac":
        check_sac(cfg, worlds, spaces)
    check_policy_builds(cfg, spaces)


def check_policy_builds(cfg: EmbodiedConfig, spaces, from_path: bool = True) -> None:
    """The policy ``model.name`` names takes this env's spaces (e.g. a CNN needs pixels, a VLA
    continuous actions): built on the meta device, no weights. ``from_path``: a set
    ``model.path`` is the saved policy the run starts from (checked by probe_env), not one to
    build (``tidal sft`` writes it)."""
    if from_path and cfg.model.path is not None:
        return
    model = dataclasses.replace(cfg.model, path=None)
    try:
        with torch.random.fork_rng(), torch.device("meta"):
            build_from_config(model, *spaces, cfg.env.num_action_chunks)
    except (ValueError, TypeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"model.name: {message} (env.id {cfg.env.id!r}, env.obs_mode {cfg.env.obs_mode!r}); "
            f"choose a policy for this env's spaces (registered: {', '.join(POLICIES.names())})"
        ) from None


def check_sac(cfg: EmbodiedConfig, worlds: dict[str, int], spaces) -> None:
    """``algorithm.name: sac`` in this world: continuous actions, a SAC policy, the actor ranks'
    shares of the replay batch, and the demonstration file's shapes."""
    observation_space, action_space = spaces
    require(
        isinstance(action_space, gym.spaces.Box),
        "algorithm.name",
        f"sac needs a continuous (Box) action space; {cfg.env.id} has {action_space} "
        "(use algorithm.name=ppo)",
    )
    one_of(cfg.model.name, SAC_POLICIES, "model.name")
    ranks = worlds["actor"]
    require(
        cfg.replay.batch_size % ranks == 0,
        "replay.batch_size",
        f"{cfg.replay.batch_size} must divide evenly over {ranks} actor ranks (each samples its "
        "share from its own buffer)",
    )
    stage_envs = cfg.env.total_num_envs // (worlds["env"] * cfg.env.pipeline_stage_num)
    require(
        stage_envs % ranks == 0,
        "env.total_num_envs",
        f"each actor rank's buffer is fed by its own envs; {stage_envs} env(s) per env rank and "
        f"pipeline stage do not divide evenly over {ranks} actor ranks",
    )
    if cfg.replay.demo_path is not None:  # as the actor's buffer will hold them
        chunks = cfg.env.num_action_chunks
        layout = buffer_layout(observation_space.shape[0], (chunks, action_space.shape[0]))
        read_demos(cfg.replay.demo_path, layout)


def checkpoint_lora_argument(checkpoint: str | None, lora) -> Path | None:
    """``--checkpoint``'s folder (None when not given), made with the config's ``model.lora``."""
    folder = checkpoint_argument(checkpoint)
    if folder is not None:
        check_checkpoint_lora(read_meta(folder), lora, str(folder))
    return folder


def check_lora_extra(lora) -> None:
    """``model.lora`` needs PEFT (the 'llm' extra)."""
    if lora.rank > 0:
        missing = missing_extra("llm", "LoRA adapters", "peft", "accelerate")
        require(missing is None, "model.lora.rank", str(missing))


def check_policy_lora(model: ModelConfig, observation_space, action_space, chunks: int) -> None:
    """``model.lora`` on the policy, built as a skeleton (no weights) to find its layers."""
    if model.lora.rank == 0:
        return
    check_lora_extra(model.lora)
    name, kwargs = model.name, dict(model.kwargs)
    if model.path is not None:
        saved = saved_policy_config(model.path)
        name, kwargs = saved["name"], saved["kwargs"]
    with no_init():
        policy = build_policy(name, observation_space, action_space, chunks, **kwargs)
    check_lora(policy, model.lora, f"policy {name!r}")


def _check_saved_spaces(path: str, observation_space, action_space) -> None:
    """A saved policy acts in this env only if it was saved for the same spaces."""
    saved = saved_policy_config(path)
    for what, key, space in (
        ("observations", "observation_space", observation_space),
        ("actions", "action_space", action_space),
    ):
        if space_from_json(saved[key]) != space:
            raise ConfigError(
                f"model.path: {path!r} was saved for {what} {space_from_json(saved[key])}, "
                f"this env has {space} (env.id, env.obs_mode, env.image_size, env.adapter_kwargs)"
            )


def check_embodied_sft(cfg: EmbodiedConfig) -> None:
    """``tidal sft`` on an embodied config."""
    check_embodied(cfg)
    validate_sft(cfg)
    _check_demo_source(cfg.env.adapter, "env.adapter", "tidal sft")
    check_policy_builds(cfg, env_spaces(cfg.env)[0], from_path=False)  # it builds model.path


def _check_demo_source(adapter: str, key: str, what: str) -> None:
    require(
        adapter in DEMO_SOURCES.names(),
        key,
        f"{what} collects scripted demonstrations, which the {adapter} adapter has none of; "
        f"adapters with them: {', '.join(DEMO_SOURCES.names())}",
    )


def check_embodied_eval(cfg: EmbodiedConfig, checkpoint: str | None, episodes: int) -> Path | None:
    """A policy to evaluate (saved, or built from the config for a checkpoint's weights), a
    positive episode count, and the checkpoint folder when one is given; all before the run
    folder exists."""
    if episodes < 1:
        raise ConfigError(f"--episodes: must be >= 1, got {episodes}")
    if cfg.model.path is None and checkpoint is None:
        raise ConfigError(
            "model.path: tidal eval needs a saved policy (tidal sft writes one) or --checkpoint"
        )
    folder = checkpoint_lora_argument(checkpoint, cfg.model.lora)
    check_embodied(cfg)
    spaces, _ = probe_env(cfg)  # the env made once, a saved policy checked against it
    check_policy_builds(cfg, spaces)
    return folder


def meta_training_model(cfg: EmbodiedConfig, spaces) -> torch.nn.Module:
    """The policy the actor trains, built on the meta device (no weights; a saved policy is
    read as saved): what ``tidal config --memory`` counts. Whatever freezes part of it for
    training freezes it here too."""
    if cfg.model.path is not None:
        policy = build_from_config(cfg.model, *spaces, cfg.env.num_action_chunks)
    else:
        with torch.device("meta"):
            policy = build_from_config(cfg.model, *spaces, cfg.env.num_action_chunks)
    return apply_lora(policy, cfg.model.lora, f"policy {cfg.model.name!r}")


def actor_memory(cfg: EmbodiedConfig) -> MemoryPlan:
    """Per actor rank, the parameters, gradients and optimizer state the config implies."""
    worlds = check_embodied(cfg)
    spaces, _ = probe_env(cfg)
    return memory_plan(meta_training_model(cfg, spaces), cfg.actor, worlds["actor"])


def check_trainer_checkpoint(cfg, checkpoint: Path) -> None:
    """A checkpoint a trainer resumes, before any worker starts: written under the same
    ``actor.strategy``, and LoRA adapters need the same ``model.lora`` (both halves)."""
    check_resume(cfg.actor.strategy, checkpoint)
    check_checkpoint_lora(read_meta(checkpoint), cfg.model.lora, str(checkpoint))
