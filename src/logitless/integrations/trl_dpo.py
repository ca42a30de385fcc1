"""``LogitlessDPOTrainer``: TRL 1.16's ``DPOTrainer`` with its head computed by logitless.

    from logitless.integrations.trl_dpo import LogitlessDPOTrainer as DPOTrainer

The chosen and rejected completions go through the model in one forward (TRL concatenates them)
and their per-token log-probs, entropies and mean logits come from one logitless vocabulary pass
over the completion tokens (:func:`logitless.vocab_stats`), never from logits; the reference
log-probs come the same way from the reference model, or from the dataset when TRL precomputed
them (``precompute_ref_log_probs``), or from a reference log-prob cache (``ref_cache=``, then no
reference model runs at all). The loss (every ``loss_type``, ``ld_alpha``, ``rpo_alpha``, label
smoothing, weights) and the metrics are TRL's own code on those log-probs.
"""

from __future__ import annotations

from typing import Any

from trl import DPOTrainer

from .config import LogitlessConfig
from .trl_head import ActiveMetric, attach, lora_head_admitted, reference_records, trl_own_path

__all__ = ["LogitlessDPOTrainer", "patch_dpo_trainer", "reference_records", "trl_own_path"]

_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


def _outputs(trainer: DPOTrainer) -> tuple[str, ...]:
    # use_weighting (WPO) also asks TRL's head for log Σ p², which logitless does not compute.
    return _OUTPUTS + (("log_sum_sq_probs",) if trainer.use_weighting else ())


class LogitlessDPOTrainer(ActiveMetric, DPOTrainer):
    """``trl.DPOTrainer`` whose log-probs (policy and reference) come from logitless.

    Extra keyword arguments (optional):
        logitless_config: :class:`LogitlessConfig` (default: everything that can, fp32
            statistics), resolved into ``trainer.logitless`` (what runs and why not).
            ``fused_logprobs`` is the switch that matters here; ``use_weighting=True`` (WPO's
            ``log Σ p²``) resolves it off and TRL's head runs.
        ref_cache: a :class:`logitless.refcache.RefCache` (or its directory, then opened
            against the policy's initial weights and tokenizer) holding the reference log-probs
            of every sequence the trainer will see (build it from :func:`reference_records`):
            TRL's reference pass reads them instead, and the reference model TRL loaded is
            freed. With PEFT, pass an opened cache (the wrapped policy's weights fingerprint
            differently).

    A ``peft_config`` whose ``target_modules`` include ``lm_head`` (or a PEFT model with a LoRA
    adapter on the head), which TRL's own trainer refuses, is accepted: logitless computes the
    adapter's term.

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`; everything ``DPOTrainer`` raises.
        UnsupportedConfigError: ``ref_cache`` with ``sync_ref_model`` or ``precompute_ref_log_probs``;
            a LoRA adapter on the head with ``fused_logprobs`` off.
        RefCacheMismatchError: a ``ref_cache`` directory built from other weights or tokenizer.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, ref_cache: Any = None,
                 **kwargs: Any) -> None:
        with lora_head_admitted(DPOTrainer, args, kwargs):
            super().__init__(*args, **kwargs)
        attach(self, logitless_config, outputs=_outputs(self), logprobs_only=True, ref_cache=ref_cache)


def patch_dpo_trainer(trainer: DPOTrainer, logitless_config: LogitlessConfig | None = None,
                      ref_cache: Any = None) -> LogitlessDPOTrainer:
    """Turn an existing ``DPOTrainer`` into a :class:`LogitlessDPOTrainer` in place (``ref_cache``
    as there)."""
    attach(trainer, logitless_config, outputs=_outputs(trainer), logprobs_only=True, ref_cache=ref_cache)
    trainer.__class__ = LogitlessDPOTrainer
    return trainer
