"""``model.lora``: low-rank adapters (LoRA, through PEFT) on the trained model, in both halves.

With ``rank`` > 0 the base weights are frozen; only the adapters train and have optimizer state,
checkpoints hold only them, the KL reference is the same model with its adapters disabled, and
the rollout and ``tidal export`` get merged weights (base + B·A·alpha/rank)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.loader import require
from tidal.config.schema import setting


@dataclass
class LoRAConfig:
    """Low-rank adapters (PEFT): only they train; rank 0 fine-tunes every weight."""

    rank: int = setting(0, "LoRA rank r; 0: off (full fine-tuning)")
    alpha: float = setting(16.0, "LoRA alpha: the adapters' update is scaled by alpha / rank")
    dropout: float = setting(0.0, "dropout on the adapters' input")
    target_modules: list[str] | None = setting(
        None,
        "module names (or name suffixes) that get adapters; null: every linear layer of "
        "attention and MLP (the model's or policy's own list)",
    )


def validate_lora(lora: LoRAConfig) -> None:
    """The section's rules (which modules exist is the preflight's: it needs the model)."""
    require(lora.rank >= 0, "model.lora.rank", f"must be >= 0 (0: off), got {lora.rank}")
    require(lora.alpha > 0, "model.lora.alpha", f"must be > 0, got {lora.alpha}")
    require(0 <= lora.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    require(
        lora.target_modules is None or len(lora.target_modules) > 0,
        "model.lora.target_modules",
        "an empty list adapts nothing: give module names, or null for the default",
    )
