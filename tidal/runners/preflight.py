"""The checks of a config that need the world, run before any worker starts or any run folder
exists: names against their registries (estimators, backends, policies, env adapters, engines,
tasks, rewards, KL kinds, aggregations), the placement's ranks, dataset files and their keys,
model folders, the env (one instance made here), saved-policy folders. Each fails with a
``ConfigError`` naming the key. The rules between keys are tidal.config's; every function here
runs them too, so a runner, ``tidal sft`` and ``tidal eval`` call one function each.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

from tidal.algorithms import advantage_spec, list_advantages
from tidal.algorithms.kl import KL_KINDS
from tidal.algorithms.losses import AGGREGATIONS, LOGPROB_LEVELS
from tidal.checkpoint import checkpoint_argument
from tidal.config import ConfigError
from tidal.config.common import ClusterConfig, one_of
from tidal.config.embodied import (
    SHARED_MODEL_FIELDS,
    EmbodiedConfig,
    EnvConfig,
    ModelConfig,
    components,
    validate_embodied,
    validate_groups,
    validate_layout,
    validate_sft,
)
from tidal.config.llm import (
    DataConfig,
    LLMConfig,
    validate_actor_ranks,
    validate_data,
    validate_llm,
    validate_llm_sft,
)
from tidal.config.loader import require
from tidal.data.datasets import DataConfigError, load_conversations, load_prompts
from tidal.envs import adapter_arguments, env_make_kwargs, list_env_adapters, make_env
from tidal.models.llm import (
    ModelConfigError,
    check_causal_lm,
    check_load_options,
    load_tokenizer,
    require_template,
)
from tidal.models.policy import POLICIES, policy_arguments
from tidal.models.saving import read_saved_config, space_from_json
from tidal.rollout.engines import ROLLOUT_ENGINES
from tidal.rollout.rewards import Reward, resolve_reward
from tidal.rollout.tasks import TASKS, is_multi_turn
from tidal.runtime import ComponentPlacement, PlacementError
from tidal.runtime.backends import backend_class, backend_names
from tidal.runtime.placement import _parse_spec_string

# -- both halves ---------------------------------------------------------------------------------


def check_common(cfg: EmbodiedConfig | LLMConfig) -> None:
    """The registered names of the shared sections."""
    cluster = cfg.cluster
    one_of(cluster.backend, backend_names(), "cluster.backend")
    require(
        not cluster.pin_cpus or backend_class(cluster.backend).multi_process,
        "cluster.pin_cpus",
        f"pins a process per rank; the {cluster.backend} backend's ranks are threads of one process",
    )
    one_of(cfg.algorithm.adv_type, list_advantages(), "algorithm.adv_type")


def world_sizes(cluster: ClusterConfig, names: list[str]) -> dict[str, int]:
    """Ranks per component from the placement, checked before the cluster exists."""
    try:
        placement = ComponentPlacement(
            cluster.resolved_placement(names), _num_devices_hint(cluster)
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


def _require_processes(cluster: ClusterConfig, ranks: int, what: str) -> None:
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
    check_common(cfg)
    env, alg = cfg.env, cfg.algorithm
    one_of(cfg.model.name, POLICIES.names(), "model.name")
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
    worlds = world_sizes(cfg.cluster, components(cfg))
    validate_layout(cfg, worlds)
    if spec.needs_groups:
        validate_groups(cfg, worlds["actor"])
    _require_processes(cfg.cluster, worlds["actor"], "a data-parallel actor (more than one rank)")
    _check_renders(env)
    _check_policy_arguments(cfg.model)
    return worlds


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
    try:
        probe = make_env(env.adapter, 1, **{**env_make_kwargs(env), "vectorization_mode": "sync"})
    except Exception as exc:  # noqa: BLE001 - gymnasium raises many kinds for a bad id or kwarg
        key = "env.kwargs" if isinstance(exc, TypeError) and env.kwargs else "env.id"
        raise ConfigError(
            f"{key}: cannot make {env.id!r} with kwargs {dict(env.kwargs)}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    try:
        spaces = (probe.observation_space, probe.action_space)
    finally:
        probe.close()
    if cfg.model.path is not None:
        check_saved_policy(cfg.model, env.num_action_chunks)
        _check_saved_spaces(cfg.model.path, *spaces)
    return spaces, probe.max_episode_steps


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


def check_embodied_eval(cfg: EmbodiedConfig, checkpoint: str | None, episodes: int) -> Path | None:
    """A policy to evaluate (saved, or built from the config for a checkpoint's weights), a
    positive episode count, and the checkpoint folder when one is given; all before the env or
    the run folder exists."""
    if episodes < 1:
        raise ConfigError(f"--episodes: must be >= 1, got {episodes}")
    if cfg.model.path is None and checkpoint is None:
        raise ConfigError(
            "model.path: tidal eval needs a saved policy (tidal sft writes one) or --checkpoint"
        )
    folder = checkpoint_argument(checkpoint)
    check_embodied(cfg)
    check_saved_policy(cfg.model, cfg.env.num_action_chunks)
    return folder


# -- the language half ---------------------------------------------------------------------------


def check_llm(cfg: LLMConfig) -> None:
    """Every rule of a language config but the model folder's (``check_llm_model``)."""
    check_common(cfg)
    alg, r = cfg.algorithm, cfg.rollout
    one_of(alg.adv_type, list_advantages(needs_critic=False), "algorithm.adv_type")
    one_of(alg.loss_agg, AGGREGATIONS[:3], "algorithm.loss_agg")
    one_of(alg.kl_kind, KL_KINDS, "algorithm.kl_kind")
    one_of(r.engine, ROLLOUT_ENGINES.names(), "rollout.engine")
    ROLLOUT_ENGINES.get(r.engine).validate(cfg)
    validate_llm(cfg)
    kind = data_kind(cfg.data)
    require(
        r.workflow in ("auto", kind) or ":" in r.workflow,
        "rollout.workflow",
        f"{_data_name(cfg.data)} runs the {kind!r} workflow (or 'auto', or module.path:factory), "
        f"got {r.workflow!r}",
    )
    if ":" in r.workflow:
        import_object(r.workflow, "rollout.workflow")
    ranks = world_sizes(cfg.cluster, ["rollout", "actor"])["actor"]
    _require_processes(cfg.cluster, ranks, "a data-parallel trainer (more than one actor rank)")
    validate_actor_ranks(cfg, ranks)
    check_data(cfg)


def check_llm_sft(cfg: LLMConfig) -> None:
    """``tidal sft`` on a language config: the data, and the model folder, or the options of the
    tiny model it builds there."""
    validate_llm_sft(cfg)
    check_data(cfg, sft=True)
    if Path(cfg.model.path).exists():  # else tidal sft builds a tiny model there
        check_llm_model(cfg)
        return
    try:
        check_load_options(cfg.model.dtype, cfg.model.attn_implementation)
    except ModelConfigError as exc:
        raise ConfigError(str(exc)) from None
    require(
        cfg.data.path is None or cfg.data.chat_template,
        "data.chat_template",
        "tidal sft builds a chat model for a dataset file: set data.chat_template=true",
    )


def check_llm_eval(cfg: LLMConfig, checkpoint: str | None, n: int) -> Path | None:
    """The config and model as for training, something to evaluate on, and the checkpoint (its
    folder) when one is given; all before the run folder exists."""
    check_llm(cfg)
    check_llm_model(cfg)
    if is_multi_turn(cfg.data):
        raise ConfigError(
            f"data.task: tidal eval scores single-turn records; {cfg.data.task!r} is multi-turn "
            "(the training run evaluates it)"
        )
    if cfg.data.path is not None and cfg.data.eval_path is None:
        raise ConfigError("data.eval_path: tidal eval needs held-out records (a dataset file)")
    if n < 0:
        raise ConfigError(f"--n: must be >= 0, got {n}")
    return checkpoint_argument(checkpoint)


def data_kind(d: DataConfig) -> str:
    """The workflow the data runs: a dataset file is single-turn; a task says which it is."""
    if d.path is None:
        one_of(d.task, TASKS.names(), "data.task")
    return "multi_turn" if is_multi_turn(d) else "rlvr"


def _data_name(d: DataConfig) -> str:
    return f"data.path {d.path!r}" if d.path is not None else f"task {d.task!r}"


def check_data(cfg: LLMConfig, sft: bool = False) -> None:
    """Dataset files, their keys, the chat-template options and the reward (``sft``:
    data.messages_key conversations may replace prompt/answer records)."""
    d = cfg.data
    validate_data(cfg, sft)
    kind = data_kind(d)
    if d.path is not None:
        _check_file(d, d.path, "data.path", sft and d.messages_key is not None)
    if d.eval_path is not None:
        _check_file(d, d.eval_path, "data.eval_path", conversations=False)
    require(
        kind == "rlvr" or cfg.reward.name == "auto",
        "reward.name",
        f"task {d.task!r} is multi-turn: its environment gives the reward (leave reward.name: auto)",
    )
    if kind == "rlvr":
        configured_reward(cfg)


def configured_reward(cfg: LLMConfig) -> Reward:
    """The reward of single-turn episodes and evaluation: ``reward.name`` resolved, or with
    ``auto`` a generated task's own (exact_match for a file)."""
    name, kwargs = cfg.reward.name, dict(cfg.reward.kwargs)
    if name == "auto" and cfg.data.path is None:
        return Reward(cfg.data.task, TASKS.get(cfg.data.task).reward, kwargs)
    try:
        return resolve_reward("exact_match" if name == "auto" else name, kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_file(d: DataConfig, path: str, key: str, conversations: bool) -> None:
    """The file loads, holds records with the configured keys, and chat-message prompts come
    with data.chat_template."""
    with tempfile.TemporaryDirectory(prefix="tidal-data-check-") as cache:
        try:
            if conversations:
                load_conversations(path, cache, d.messages_key, d.id_key, key=key)
                return
            table = load_prompts(path, cache, d.prompt_key, d.answer_key, d.id_key, key=key)
        except DataConfigError as exc:
            raise ConfigError(str(exc)) from None
        text = getattr(table.features["prompt"], "dtype", None) in ("string", "large_string")
        require(
            d.chat_template or text,
            "data.chat_template",
            f"the prompts in {path!r} are chat messages: set data.chat_template=true",
        )


def check_llm_model(cfg: LLMConfig) -> None:
    """The model folder holds a causal language model (no weights read), the load options are known, its
    context holds the generated tokens, and its tokenizer has a chat template when asked."""
    m = cfg.model
    try:
        check_load_options(m.dtype, m.attn_implementation)
        model_cfg = check_causal_lm(m.path)
        if cfg.data.chat_template:
            require_template(load_tokenizer(m.path))
    except ModelConfigError as exc:
        raise ConfigError(str(exc)) from None
    context = getattr(model_cfg, "max_position_embeddings", None)
    require(
        context is None or cfg.rollout.max_new_tokens < context,
        "rollout.max_new_tokens",
        f"{cfg.rollout.max_new_tokens} does not fit the model's context of {context} tokens",
    )
