"""``LogitlessRLOOTrainer``: TRL 1.16's ``RLOOTrainer`` with its head computed by logitless.

    from logitless.integrations.trl_rloo import LogitlessRLOOTrainer as RLOOTrainer

The old-policy, reference and training log-probs (and the entropy metric) come from one
logitless vocabulary pass each over the completion tokens (:func:`logitless.vocab_stats`, at
TRL's sampling temperature), never from logits. Generation, rewards, the leave-one-out baseline,
the KL-in-reward term, the clipped sequence-level loss and the metrics are TRL's own code.
"""

from __future__ import annotations

from typing import Any

from trl import RLOOTrainer

from .config import LogitlessConfig
from .trl_head import ActiveMetric, attach, lora_head_admitted, trl_own_path

__all__ = ["LogitlessRLOOTrainer", "patch_rloo_trainer", "trl_own_path"]

_OUTPUTS = ("log_probs", "entropy")


class LogitlessRLOOTrainer(ActiveMetric, RLOOTrainer):
    """``trl.RLOOTrainer`` whose log-probs (policy, old policy, reference) come from logitless.

    Extra keyword argument: ``logitless_config`` (:class:`LogitlessConfig`), resolved into
    ``trainer.logitless``. Multimodal batches and MoE router logits go to TRL's head per call.
    A LoRA adapter on ``lm_head`` (``peft_config`` or a PEFT model) is accepted.

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`; everything ``RLOOTrainer`` raises.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, **kwargs: Any) -> None:
        with lora_head_admitted(RLOOTrainer, args, kwargs):
            super().__init__(*args, **kwargs)
        attach(self, logitless_config, outputs=_OUTPUTS, temperature=self.temperature, logprobs_only=True)


def patch_rloo_trainer(trainer: RLOOTrainer, logitless_config: LogitlessConfig | None = None) -> LogitlessRLOOTrainer:
    """Turn an existing ``RLOOTrainer`` into a :class:`LogitlessRLOOTrainer` in place."""
    attach(trainer, logitless_config, outputs=_OUTPUTS, temperature=trainer.temperature, logprobs_only=True)
    trainer.__class__ = LogitlessRLOOTrainer
    return trainer
