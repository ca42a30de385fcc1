"""``LogitlessKTOTrainer``: TRL 1.16's ``KTOTrainer`` with its head computed by logitless.

    from logitless.integrations.trl_kto import LogitlessKTOTrainer as KTOTrainer

The completion log-probs of the policy and the reference, and those of the mismatched
(prompt, completion) pairs of KTO's KL estimate, come from logitless vocabulary passes over the
completion tokens (:func:`logitless.vocab_stats`), never from logits; precomputed reference
log-probs are used when TRL computed them, or a reference log-prob cache (``ref_cache=``, then no
reference model runs at all). The loss (``kto``, ``apo_zero_unpaired``; desirable /
undesirable weights) and the metrics are TRL's own code on those log-probs.
"""

from __future__ import annotations

from typing import Any

from trl import KTOTrainer

from .config import LogitlessConfig
from .trl_head import ActiveMetric, attach, lora_head_admitted, reference_records, trl_own_path

__all__ = ["LogitlessKTOTrainer", "patch_kto_trainer", "reference_records", "trl_own_path"]

_OUTPUTS = ("log_probs", "entropy", "mean_logits")


class LogitlessKTOTrainer(ActiveMetric, KTOTrainer):
    """``trl.KTOTrainer`` whose log-probs (policy, reference, KL pairs) come from logitless.

    Extra keyword arguments (optional): ``logitless_config`` (:class:`LogitlessConfig`), resolved
    into ``trainer.logitless``; ``ref_cache``, as for
    :class:`~logitless.integrations.trl_dpo.LogitlessDPOTrainer` (the cache must hold the KL
    pairs too: :func:`reference_records` yields them). A LoRA adapter on ``lm_head``
    (``peft_config`` or a PEFT model) is accepted.

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`; everything ``KTOTrainer`` raises.
        UnsupportedConfigError: ``ref_cache`` with ``sync_ref_model`` or ``precompute_ref_log_probs``;
            a LoRA adapter on the head with ``fused_logprobs`` off.
        RefCacheMismatchError: a ``ref_cache`` directory built from other weights or tokenizer.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, ref_cache: Any = None,
                 **kwargs: Any) -> None:
        with lora_head_admitted(KTOTrainer, args, kwargs):
            super().__init__(*args, **kwargs)
        attach(self, logitless_config, outputs=_OUTPUTS, logprobs_only=True, ref_cache=ref_cache)


def patch_kto_trainer(trainer: KTOTrainer, logitless_config: LogitlessConfig | None = None,
                      ref_cache: Any = None) -> LogitlessKTOTrainer:
    """Turn an existing ``KTOTrainer`` into a :class:`LogitlessKTOTrainer` in place (``ref_cache``
    as there)."""
    attach(trainer, logitless_config, outputs=_OUTPUTS, logprobs_only=True, ref_cache=ref_cache)
    trainer.__class__ = LogitlessKTOTrainer
    return trainer
