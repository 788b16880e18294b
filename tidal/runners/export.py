"""``tidal export RUN [--checkpoint DIR] -o OUT``: a training checkpoint as a folder other tools
load as any model, with LoRA adapters merged into the base.

- language runs: a Hugging Face folder (weights, config, generation config, tokenizer with its
  chat template) that ``transformers``, ``tidal serve`` and vLLM load;
- embodied runs: the saved-policy folder ``tidal eval`` and ``model.path`` take.

The run's own ``config.yaml`` says what was trained (``model.path``, ``model.lora``); the
checkpoint is ``--checkpoint`` or the run's newest.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tidal.checkpoint import checkpoint_argument, checkpoint_weights
from tidal.config import ConfigError, load_config, read_yaml

log = logging.getLogger("tidal.export")


def run_config(run: str | Path):
    """The half and resolved config of a run folder (its ``config.yaml``)."""
    from tidal.config.embodied import EmbodiedConfig
    from tidal.config.llm import LLMConfig

    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"RUN: {str(run)!r} is not a run folder (it has no config.yaml)")
    task = (read_yaml(path).get("runner") or {}).get("task", "embodied")
    schema = {"llm": LLMConfig, "embodied": EmbodiedConfig}.get(task)
    if schema is None:
        raise ConfigError(f"runner.task: {path} names {task!r}, not llm or embodied")
    return task, load_config(schema, path, [])


def export(run: str | Path, out: str | Path, checkpoint: str | None = None) -> dict:
    """Write the folder; returns what was written."""
    task, cfg = run_config(run)
    folder = checkpoint_argument(checkpoint or str(Path(run) / "checkpoints"))
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"-o: {str(out)!r} exists and is not empty")
    (export_llm if task == "llm" else export_policy)(cfg, folder, out)
    log.info("export: %s -> %s", folder, out)
    return {"task": task, "checkpoint": str(folder), "out": str(out), "lora": cfg.model.lora.rank}


def export_llm(cfg, checkpoint: Path, out: Path) -> None:
    """The base model from ``model.path`` with the checkpoint's (merged) weights, and its
    tokenizer as it is (chat template included)."""
    from transformers import AutoTokenizer

    from tidal.models.llm import load_causal_lm

    m = cfg.model
    model, _ = load_causal_lm(m.path, m.dtype, m.attn_implementation)
    model.load_state_dict(checkpoint_weights(model, checkpoint, m.lora, repr(m.path)))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(m.path, local_files_only=True).save_pretrained(out)


def export_policy(cfg, checkpoint: Path, out: Path) -> None:
    """The policy built as training built it (``model.path``, or the registry on the env's
    spaces) with the checkpoint's (merged) weights, as a saved-policy folder."""
    from tidal.models.factory import build_from_config
    from tidal.models.saving import save_policy
    from tidal.runners.preflight import probe_env

    if cfg.model.path is not None:
        from tidal.models.saving import read_saved_config, space_from_json

        saved = read_saved_config(cfg.model.path)
        spaces = (
            space_from_json(saved["observation_space"]),
            space_from_json(saved["action_space"]),
        )
    else:
        spaces, _ = probe_env(cfg)
    policy = build_from_config(cfg.model, *spaces, cfg.env.num_action_chunks)
    owner = f"policy {cfg.model.name!r}"
    policy.load_state_dict(checkpoint_weights(policy, checkpoint, cfg.model.lora, owner))
    save_policy(policy, out)
