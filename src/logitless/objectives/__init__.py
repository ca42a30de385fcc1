"""Objective layer: the field's formulas in plain PyTorch on per-token statistics.
Knows nothing about the vocabulary; calls only ``ops``."""

from .config import PolicyConfig
from .cross_entropy import cross_entropy
from .distill import DistillConfig, distill_loss
from .head_loss import TokenStats, head_loss
from .layout import TokenLayout
from .policy import policy_loss
from .preference import (
    CPOLossConfig,
    DPOLossConfig,
    KTOLossConfig,
    SequenceLogps,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    sequence_logps,
    simpo_loss,
)
from .preference_fused import (
    cpo_loss_fused,
    dpo_loss_fused,
    kto_loss_fused,
    orpo_loss_fused,
    simpo_loss_fused,
)
from .sampling import sampling_correction
from .vocab_stats import VocabStats, token_logprobs, vocab_stats

__all__ = [
    "PolicyConfig",
    "TokenLayout",
    "TokenStats",
    "VocabStats",
    "cross_entropy",
    "head_loss",
    "policy_loss",
    "sampling_correction",
    "token_logprobs",
    "vocab_stats",
]
__all__ += ["CPOLossConfig", "DPOLossConfig", "DistillConfig", "KTOLossConfig", "SequenceLogps", "cpo_loss",
            "distill_loss", "dpo_loss", "kto_loss", "orpo_loss", "sequence_logps", "simpo_loss"]
__all__ += ["cpo_loss_fused", "dpo_loss_fused", "kto_loss_fused", "orpo_loss_fused", "simpo_loss_fused"]
