"""``logitless demo``: GRPO-train a pretrained instruct model (SmolLM2-135M-Instruct by default)
with TRL's ``GRPOTrainer`` through logitless on two-number addition, score a held-out set
before and after, and show one step's loss and gradient next to TRL's own path and the head's
memory with and without logitless, all on the real model and its real training batch."""

from __future__ import annotations

from .run import Preset, add_arguments, run

__all__ = ["Preset", "add_arguments", "run"]
