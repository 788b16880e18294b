"""``tidal export RUN [--checkpoint DIR] -o OUT``: a training checkpoint as a folder other tools
load as any model, with LoRA adapters merged into the base. ``tidal export --from-gguf FILE -o OUT``:
a GGUF file (or packaged model) as a float32 Hugging Face folder with its tokenizer and template.

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


def export(
    run: str | Path | None,
    out: str | Path,
    checkpoint: str | None = None,
    from_gguf: str | None = None,
) -> dict:
    """Write the folder; returns what was written."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"-o: {str(out)!r} exists and is not empty")
    if (run is None) == (from_gguf is None):
        raise ConfigError("RUN: give a run folder, or --from-gguf FILE (not both)")
    if from_gguf is not None:
        return export_gguf(from_gguf, out, checkpoint)
    task, cfg = run_config(run)
    folder = checkpoint_argument(checkpoint or str(Path(run) / "checkpoints"))
    (export_llm if task == "llm" else export_policy)(cfg, folder, out)
    log.info("export: %s -> %s", folder, out)
    return {"task": task, "checkpoint": str(folder), "out": str(out), "lora": cfg.model.lora.rank}


def export_gguf(file: str, out: Path, checkpoint: str | None) -> dict:
    """A GGUF file (or packaged model) dequantised into a Hugging Face folder at ``out``: a copy
    of the folder ``model.path`` would use (converted into the cache first when missing)."""
    import shutil

    from tidal.models.gguf import (
        CONVERTED,
        ModelSourceError,
        is_gguf,
        local_model_path,
        model_folder,
    )

    if checkpoint is not None:
        raise ConfigError("--checkpoint: a run's; --from-gguf exports the file as it is")
    try:
        local = local_model_path(file, "--from-gguf")
        if not is_gguf(local):
            raise ConfigError(f"--from-gguf: {file!r} is not a .gguf file")
        folder = model_folder(local, "--from-gguf")
    except ModelSourceError as exc:
        raise ConfigError(str(exc)) from None
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns(CONVERTED), dirs_exist_ok=True)
    log.info("export: %s -> %s", local, out)
    return {"task": "llm", "gguf": local, "out": str(out)}


def export_llm(cfg, checkpoint: Path, out: Path) -> None:
    """The base model from ``model.path`` with the checkpoint's (merged) weights, and its
    tokenizer as it is (chat template included)."""
    from transformers import AutoTokenizer

    from tidal.models.llm import hf_folder, load_causal_lm

    m = cfg.model
    model, _ = load_causal_lm(m.path, m.dtype, m.attn_implementation)
    model.load_state_dict(checkpoint_weights(model, checkpoint, m.lora, repr(m.path)))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(hf_folder(m.path), local_files_only=True).save_pretrained(out)


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
