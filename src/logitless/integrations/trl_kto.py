"""``LogitlessKTOTrainer``: TRL 1.16's ``KTOTrainer`` with its head computed by logitless.

    from logitless.integrations.trl_kto import LogitlessKTOTrainer as KTOTrainer

The completion log-probs of the policy and the reference, and those of the mismatched
(prompt, completion) pairs of KTO's KL estimate, come from logitless vocabulary passes over the
completion tokens (:func:`logitless.vocab_stats`), never from logits; precomputed reference
log-probs are used when TRL computed them. The loss (``kto``, ``apo_zero_unpaired``; desirable /
undesirable weights) and the metrics are TRL's own code on those log-probs.
"""

from __future__ import annotations

from typing import Any

from trl import KTOTrainer

from .config import LogitlessConfig
from .trl_head import attach, trl_own_path

__all__ = ["LogitlessKTOTrainer", "patch_kto_trainer", "trl_own_path"]

_OUTPUTS = ("log_probs", "entropy", "mean_logits")
_SHARED_LOSS = ["the loss is TRL's own code on logitless log-probs (fused_logprobs)"]


class LogitlessKTOTrainer(KTOTrainer):
    """``trl.KTOTrainer`` whose log-probs (policy, reference, KL pairs) come from logitless.

    Extra keyword argument: ``logitless_config`` (:class:`LogitlessConfig`), resolved into
    ``trainer.logitless``.

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`; everything ``KTOTrainer`` raises.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        attach(self, logitless_config, outputs=_OUTPUTS, loss_problems=_SHARED_LOSS)


def patch_kto_trainer(trainer: KTOTrainer, logitless_config: LogitlessConfig | None = None) -> LogitlessKTOTrainer:
    """Turn an existing ``KTOTrainer`` into a :class:`LogitlessKTOTrainer` in place."""
    attach(trainer, logitless_config, outputs=_OUTPUTS, loss_problems=_SHARED_LOSS)
    trainer.__class__ = LogitlessKTOTrainer
    return trainer
