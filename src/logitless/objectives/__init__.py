"""Objective layer: the field's formulas in plain PyTorch on per-token statistics.
Knows nothing about the vocabulary; calls only ``ops``."""

from .config import PolicyConfig
from .layout import TokenLayout
from .policy import policy_loss
from .run import Mode

__all__ = ["Mode", "PolicyConfig", "TokenLayout", "policy_loss"]
