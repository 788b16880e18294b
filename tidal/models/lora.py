"""LoRA adapters (``model.lora``) on a causal language model or an embodied policy, through PEFT.

:func:`apply_lora` freezes the base and wraps the model (``peft.get_peft_model``): only the
adapters (and a policy's fully trained heads) require gradients, so the train engine gives only
them optimizer state and checkpoints only them. :func:`reference_model` is the KL reference:
the same model with its adapters disabled, no second copy of the base. :func:`rollout_weights`
is what the rollout loads: the base model's own names with ``B·A·alpha/r`` added out of place
(the training model is never merged), from the model's own state or, under ``fsdp2``, from the
full tensors gathered from its shards (:func:`merged_weights`, one merge for both strategies);
``tidal.checkpoint.checkpoint_weights`` rebuilds them from a checkpoint (``tidal eval
--checkpoint``, ``tidal export``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch import nn

from tidal.config.loader import ConfigError
from tidal.config.lora import LoRAConfig
from tidal.extras import needs_extra

ADAPTER = "default"  # PEFT's name for the one adapter a run trains
KEY = "model.lora.target_modules"


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries PEFT adapters (``apply_lora``'s result)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


# -- which modules get adapters --------------------------------------------------------------


def linear_module_names(model: nn.Module) -> list[str]:
    """The full names of the model's ``nn.Linear`` layers whose forward runs (the output
    projection inside ``nn.MultiheadAttention`` is read as a raw weight, so an adapter on it
    would never run)."""
    inside_mha = {
        f"{name}.out_proj"
        for name, m in model.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name not in inside_mha
    ]


def short_names(names: list[str]) -> list[str]:
    """Each distinct last component (``q_proj``, ``linear1``): what target_modules usually says."""
    return sorted({n.rsplit(".", 1)[-1] for n in names})


def default_targets(model: nn.Module) -> list[str]:
    """Every linear layer of attention and MLP: a policy says which (``lora_targets``); a causal
    LM's are all its linear layers but the output head."""
    own = getattr(model, "lora_targets", None)
    if callable(own):
        return list(own())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [n for n in linear_module_names(model) if model.get_submodule(n) is not head]
    return short_names(names)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith(f".{target}")


def resolve_targets(model: nn.Module, lora: LoRAConfig, owner: str) -> list[str]:
    """The full names of the linear layers that get adapters, or a config error: ``owner`` (the
    policy or model) has no linear layer, or a target matches none of them."""
    linear = linear_module_names(model)
    if not linear:
        raise ConfigError(
            f"model.lora.rank: {owner} has no linear layers for LoRA adapters; set "
            "model.lora.rank=0 to fine-tune it whole"
        )
    targets = lora.target_modules or default_targets(model)
    unmatched = [t for t in targets if not any(_matches(n, t) for n in linear)]
    if unmatched:
        raise ConfigError(
            f"{KEY}: {unmatched} match no linear layer of {owner}; its linear layers are "
            f"{', '.join(short_names(linear))} (full names: {', '.join(linear[:12])}"
            f"{' ...' if len(linear) > 12 else ''})"
        )
    return [n for n in linear if any(_matches(n, t) for t in targets)]


def check_lora(model: nn.Module, lora: LoRAConfig, owner: str) -> None:
    """The preflight's check of ``model.lora`` on a model skeleton (e.g. on the meta device)."""
    if lora.rank > 0:
        resolve_targets(model, lora, owner)
        _modules_to_save(model)


def _modules_to_save(model: nn.Module) -> list[str]:
    """Modules a policy trains whole beside its adapters (fresh heads, e.g. a critic)."""
    own = getattr(model, "lora_trained_modules", None)
    return [n for n in (own() if callable(own) else ()) if hasattr(model, n)]


# -- wrapping ----------------------------------------------------------------------------------


def apply_lora(model: nn.Module, lora: LoRAConfig, owner: str = "the model") -> nn.Module:
    """``model`` with adapters on its targets (PEFT), the base frozen; rank 0 returns it as is."""
    if lora.rank == 0:
        return model
    with needs_extra("llm", "LoRA adapters (model.lora)"):
        from peft import LoraConfig, get_peft_model

    targets = resolve_targets(model, lora, owner)
    causal_lm = hasattr(model, "get_output_embeddings") and hasattr(model, "generation_config")
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        modules_to_save=_modules_to_save(model) or None,
        task_type="CAUSAL_LM" if causal_lm else None,
    )
    wrapped = get_peft_model(model, config)
    _without_fused_encoder_layers(wrapped)
    return wrapped


def _without_fused_encoder_layers(model: nn.Module) -> None:
    """torch's fused ``TransformerEncoderLayer`` kernel (eval, no grad) reads the linear layers'
    raw weights and would skip their adapters; an activation it does not know turns it off."""
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer):
            module.activation_relu_or_gelu = 0


# -- the KL reference ------------------------------------------------------------------------


class AdaptersDisabled:
    """Calls the LoRA model with its adapters off: the base it started from."""

    def __init__(self, model: nn.Module):
        self.model = model

    def eval(self) -> AdaptersDisabled:
        self.model.eval()
        return self

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)


def reference_model(model: nn.Module, keep: bool):
    """The frozen KL reference (None when ``keep`` is false): the LoRA model with its adapters
    disabled, else a frozen copy of the model as it starts."""
    if not keep:
        return None
    if is_lora(model):
        return AdaptersDisabled(model)
    import copy

    return copy.deepcopy(model).eval().requires_grad_(False)


# -- weights for the rollout, export and evaluation -------------------------------------------

_PEFT_PARTS = (".base_layer", f".modules_to_save.{ADAPTER}")


def base_name(key: str) -> str:
    """A PEFT model's state-dict key as the base model names it."""
    for part in _PEFT_PARTS:
        key = key.replace(part, "")
    return key


def _is_peft_only(key: str) -> bool:
    """Adapter weights, and the untouched originals of modules trained whole."""
    return bool(re.search(r"\.lora_[A-Za-z_]+\.", key)) or ".original_module." in key


@torch.no_grad()
def adapted_layers(model: nn.Module) -> tuple[str, dict[str, nn.Module]]:
    """The LoRA model's key prefix of its base, and its adapted layers by state-dict name."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    prefix = next(name for name, m in model.named_modules() if m is base) + "."
    adapted = {
        f"{prefix}{name}": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }
    return prefix, adapted


def merged_weights(
    model: nn.Module, state: dict[str, torch.Tensor], layers=None
) -> dict[str, torch.Tensor]:
    """The base model's weights in its own names with every adapter's ``B·A·alpha/r`` added,
    from ``state``: the LoRA ``model``'s whole state dict, its own tensors or full ones gathered
    from FSDP2's shards (``model`` gives only each adapter's scaling). Computed out of place:
    the LoRA model keeps its separate adapters. The product is taken in fp32, as PEFT's
    ``get_delta_weight`` does on the CPU. ``layers``: ``adapted_layers(model)``, when known."""
    from peft.utils import transpose

    prefix, adapted = layers or adapted_layers(model)
    out = {}
    for key, value in state.items():
        if _is_peft_only(key):
            continue
        layer = key.removesuffix(".base_layer.weight")
        if layer in adapted:
            lora_b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()
            lora_a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()
            module = adapted[layer]
            delta = transpose(lora_b @ lora_a, module.fan_in_fan_out) * module.scaling[ADAPTER]
            value = value + delta.to(value.dtype)
        out[base_name(key.removeprefix(prefix))] = value
    return out


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The merged weights of an unsharded LoRA model (:func:`merged_weights` of its own state)."""
    return merged_weights(model, model.state_dict())


def rollout_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights as the rollout (or a saved model folder) takes them: merged under LoRA."""
    return merged_state_dict(model) if is_lora(model) else model.state_dict()


def rollout_weight_stream(model: nn.Module, engine, rank: int):
    """The ``(name, tensor)`` pairs the rollout takes, read lazily: the engine's whole model,
    gathered layer by layer from the shards under a sharded strategy, each LoRA layer merged
    as it comes (in the base model's names). Every rank must read it to the end; only rank 0's
    yields pairs."""
    layers = adapted_layers(model) if is_lora(model) else None
    for group in engine.full_state_groups(rank, _lora_layer if layers else str):
        yield from (merged_weights(model, group, layers) if layers else group).items()


def rollout_weights(model: nn.Module, engine, rank: int):
    """The rollout's pairs all at once on rank 0 (None elsewhere; every rank calls it)."""
    pairs = list(rollout_weight_stream(model, engine, rank))
    return pairs if rank == 0 else None


def drain(pairs) -> None:
    """Read a weight stream to its end (a rank that sends nothing still gathers)."""
    for _ in pairs:
        pass


def _lora_layer(key: str) -> str:
    """The layer a state-dict key belongs to: a LoRA layer's base weights and adapters
    together (what one merge needs), any other key by itself."""
    return re.sub(r"\.(base_layer|lora_[A-Za-z_]+)\..*$", "", key)


def save_pretrained_folder(model: nn.Module, folder, weights=None) -> None:
    """A ``save_pretrained`` safetensors folder of a causal LM's weights: ``weights`` (e.g. the
    rollout's, gathered on rank 0), by default the model's own (merged under LoRA)."""
    weights = rollout_state_dict(model) if weights is None else weights
    base = model.get_base_model() if is_lora(model) else model
    # a copy: save_pretrained empties the dict it is given
    base.save_pretrained(folder, state_dict=dict(weights), safe_serialization=True)


def lora_meta(lora: LoRAConfig) -> dict[str, Any]:
    """What a checkpoint records of ``model.lora`` (checked before a resume)."""
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": lora.target_modules}


def check_checkpoint_lora(meta: dict, lora: LoRAConfig, source: str) -> None:
    """A checkpoint of adapters needs the same ``model.lora``, and a full one needs none."""
    saved = meta.get("lora") or {"rank": 0}
    if (saved["rank"] > 0) != (lora.rank > 0):
        held = f"LoRA adapters of rank {saved['rank']}" if saved["rank"] else "full weights"
        raise ConfigError(
            f"model.lora.rank: {source} holds {held}; this config has model.lora.rank="
            f"{lora.rank} (set it to {saved['rank']})"
        )
    if saved["rank"] > 0 and saved != lora_meta(lora):
        raise ConfigError(
            f"model.lora.rank: {source} holds adapters made with {saved}; this config asks for "
            f"{lora_meta(lora)} (model.lora.*)"
        )


@contextlib.contextmanager
def no_init():
    """Build a skeleton without initialising or allocating weights (preflight checks)."""
    with torch.device("meta"):
        yield
