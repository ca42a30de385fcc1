"""``LogitlessDPOTrainer``: TRL 1.16's ``DPOTrainer`` with its head computed by logitless.

    from logitless.integrations.trl_dpo import LogitlessDPOTrainer as DPOTrainer

The chosen and rejected completions go through the model in one forward (TRL concatenates them).
With ``fused_loss`` (the default where it applies) the loss, its gradient and every metric TRL logs
come from one fused vocabulary pass over the completion tokens (:func:`~logitless.objectives.
preference_fused.dpo_fused_pass`: chunks of whole pairs, 3 GEMMs of work, the formulas of
:func:`logitless.dpo_loss`, which are ``DPOTrainer._compute_loss``'s; LD-DPO's ``ld_alpha``
included; WPO's ``use_weighting`` too, its weights from the pass's ``log Σ_v p_v²``), never from
logits. Where it does not apply (the MoE router aux loss; ``use_weighting`` with the ``sft`` loss
type, on which TRL's own loss fails; per call: multimodal inputs or ``return_outputs=True``) the
loss is TRL's own code on the per-token log-probs, entropies, mean logits, top-1 hits and
``log Σ p²`` of a logitless pass behind TRL's fused head (``fused_logprobs``, recompute mode).
The reference log-probs come from the reference model through logitless, or from the dataset
when TRL precomputed them (``precompute_ref_log_probs``), or from a reference log-prob cache
(``ref_cache=``, then no reference model runs at all).
"""

from __future__ import annotations

from typing import Any

from trl import DPOTrainer

from ..objectives import DPOLossConfig
from ..objectives.preference_fused import dpo_fused_pass
from .config import LogitlessConfig
from .trl_head import (
    ActiveMetric,
    attach,
    head_pass,
    lora_head_admitted,
    reference_records,
    takes_fused_loss,
    trl_own_path,
)

__all__ = ["LogitlessDPOTrainer", "patch_dpo_trainer", "reference_records", "trl_own_path"]

_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


# Keys of DPO's batches that are not model inputs (DPOTrainer._compute_loss's _non_model_keys).
_NON_MODEL_KEYS = frozenset({"completion_mask", "ref_chosen_logps", "ref_rejected_logps"})


def _outputs(trainer: DPOTrainer) -> tuple[str, ...]:
    # use_weighting (WPO) also asks the head for log Σ_v p_v² (TRL's log_sum_sq_probs), as TRL's
    # __init__ asks its own head.
    return _OUTPUTS + (("log_sum_sq_probs",) if trainer.use_weighting else ())


def _unsupported(trainer: DPOTrainer) -> list[str]:
    """The trainer's options that the fused loss does not reproduce (``fused_loss`` resolves off;
    the loss is then TRL's code on logitless log-probs)."""
    out = []
    if trainer.aux_loss_enabled:
        out.append("MoE router aux loss (output_router_logits)")
    if trainer.use_weighting and "sft" in trainer.loss_types:
        # TRL weighs its batch-wide sft term (an expanded view) in place, which torch refuses: its
        # own loss code then runs, and fails as TRL's trainer does.
        out.append("use_weighting with the sft loss type (TRL's own loss fails on it)")
    return out


def _attach(trainer: DPOTrainer, config: LogitlessConfig | None, ref_cache: Any) -> None:
    attach(trainer, config, outputs=_outputs(trainer), loss_problems=_unsupported(trainer), ref_cache=ref_cache)


class LogitlessDPOTrainer(ActiveMetric, DPOTrainer):
    """``trl.DPOTrainer`` whose log-probs (policy and reference) come from logitless.

    Extra keyword arguments (optional):
        logitless_config: :class:`LogitlessConfig` (default: everything that can, fp32
            statistics), resolved into ``trainer.logitless`` (what runs and why not).
            ``fused_loss``: the loss and metrics from one fused pass (the MoE aux loss resolves
            it off, with the reason logged); ``fused_logprobs``: logitless
            behind TRL's fused head, for the reference and wherever TRL's loss code runs.
            ``use_weighting=True`` (WPO) runs on either, the pass computing ``log Σ p²``.
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
        _attach(self, logitless_config, ref_cache)

    def _compute_loss(self, model, inputs, return_outputs):
        if not takes_fused_loss(self.logitless, inputs, _NON_MODEL_KEYS, return_outputs):
            return DPOTrainer._compute_loss(self, model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"][:, 1:]
        seq_len = completion_mask.size(1)
        hidden = model(**model_kwargs, logitless_hidden_states=True)
        # Prompt-learning PEFT prepends virtual tokens; the last seq_len + 1 positions are the real ones.
        hidden, head = head_pass(self, model, hidden[:, -seq_len - 1:-1])
        if self.precompute_ref_logps:
            ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:  # TRL's own reference call (PEFT adapters off, a reference cache, or the reference model)
            ref_chosen_logps, ref_rejected_logps = self.compute_ref_log_probs(
                self.model if self.ref_model is None else self.ref_model, inputs)
        out = dpo_fused_pass(hidden, head, inputs["input_ids"][:, 1:].to(hidden.device),
                             completion_mask.to(hidden.device), ref_chosen_logps, ref_rejected_logps,
                             config=self.dpo_loss_config(), options=self.logitless.options)
        self._log_fused_metrics(mode, inputs, out, ref_chosen_logps, ref_rejected_logps)
        return out.loss

    def dpo_loss_config(self) -> DPOLossConfig:
        """This trainer's loss options as a :class:`logitless.DPOLossConfig`."""
        return DPOLossConfig(beta=self.beta, loss_type=tuple(self.loss_types), loss_weights=tuple(self.loss_weights),
                             label_smoothing=self.label_smoothing, f_divergence_type=self.f_divergence_type,
                             f_alpha_divergence_coef=self.f_alpha_divergence_coef,
                             discopop_tau=self.args.discopop_tau, ld_alpha=self.ld_alpha,
                             use_weighting=self.use_weighting)

    def _log_fused_metrics(self, mode, inputs, out, ref_chosen_logps, ref_rejected_logps) -> None:
        """``DPOTrainer._compute_loss``'s metric bookkeeping (gathers included), on the pass's sums."""
        gather, gather_m = self.accelerator.gather, self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        policy, tokens = out.policy, out.tokens
        count = policy.lengths.round().long()  # completion tokens per sequence, an integer count as TRL's
        entropy_sum, total = gather_m(policy.entropy_sum.sum()).sum(), gather_m(count.sum()).sum()
        metrics["entropy"].append((entropy_sum / total).item() if total > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += gather_m(inputs["attention_mask"].sum()).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        for name, logit_sums, counts in zip(("logits/chosen", "logits/rejected"), tokens.mean_logit.chunk(2),
                                            count.chunk(2), strict=True):
            s, n = gather_m(logit_sums.sum()).sum().item(), gather_m(counts.sum()).sum().item()
            metrics[name].append(s / n if n > 0 else 0.0)
        correct = gather_m(tokens.top1.chunk(2)[0].round().long().sum())
        chosen_total = gather_m(count.chunk(2)[0].sum()).sum()
        metrics["mean_token_accuracy"].append((correct.sum() / chosen_total).item() if chosen_total > 0 else 0.0)
        chosen_logps, rejected_logps = policy.logps.chunk(2)
        chosen_rewards = self.beta * (chosen_logps - ref_chosen_logps.to(chosen_logps.dtype))
        rejected_rewards = self.beta * (rejected_logps - ref_rejected_logps.to(rejected_logps.dtype))
        metrics["rewards/chosen"].append(gather(chosen_rewards).mean().item())
        metrics["rewards/rejected"].append(gather(rejected_rewards).mean().item())
        metrics["rewards/accuracies"].append(gather((chosen_rewards > rejected_rewards).float()).mean().item())
        metrics["rewards/margins"].append(gather(chosen_rewards - rejected_rewards).mean().item())
        metrics["logps/chosen"].append(gather(chosen_logps).mean().item())
        metrics["logps/rejected"].append(gather(rejected_logps).mean().item())


def patch_dpo_trainer(trainer: DPOTrainer, logitless_config: LogitlessConfig | None = None,
                      ref_cache: Any = None) -> LogitlessDPOTrainer:
    """Turn an existing ``DPOTrainer`` into a :class:`LogitlessDPOTrainer` in place (``ref_cache``
    as there)."""
    _attach(trainer, logitless_config, ref_cache)
    trainer.__class__ = LogitlessDPOTrainer
    return trainer
