"""``LogitlessCPOTrainer``: TRL 1.16's ``CPOTrainer`` (``trl.experimental.cpo``: CPO, SimPO,
AlphaPO) with its loss computed by logitless.

    from logitless.integrations.trl_cpo import LogitlessCPOTrainer as CPOTrainer

TRL's ``CPOTrainer`` materializes the logits of the chosen and rejected sequences (``[2B, L, V]``).
With ``fused_loss`` the loss (``sigmoid``, ``hinge``, ``ipo``, ``simpo``; label smoothing, AlphaPO's
``alpha``, the ``cpo_alpha`` NLL term), its gradient and the metrics come from one fused
vocabulary pass over the completion tokens instead (:func:`~logitless.objectives.preference_fused.
cpo_fused_pass`, 3 GEMMs of work, no logits); the rewards are TRL's ``cpo_loss`` on the pass's
sequence scores. TRL's ``logits/chosen|rejected`` average every logit of every position (prompt
and padding included): for a head whose logits are linear in the hidden state (no soft-cap) that
is ``Σ_v z_v = h · Σ_v w_v + Σ_v b_v`` (scaled), a matrix-vector product. Where that does not hold
(a soft-capped or vocabulary-sharded head, a LoRA adapter with dropout), or for an encoder-decoder
model or the MoE aux loss, TRL's own code runs (``fused_loss`` resolves off, the reason logged).
"""

from __future__ import annotations

from typing import Any

import torch
from trl.experimental.cpo import CPOTrainer

from ..objectives import CPOLossConfig
from ..objectives.preference_fused import cpo_fused_pass
from .config import LogitlessConfig
from .trl_head import (
    ActiveMetric,
    attach_materialized,
    head_pass,
    paired_metrics,
    sum_logits,
    trl_own_path,
)

__all__ = ["LogitlessCPOTrainer", "patch_cpo_trainer", "trl_own_path"]


class LogitlessCPOTrainer(ActiveMetric, CPOTrainer):
    """``trl.experimental.cpo.CPOTrainer`` whose loss and metrics come from one logitless pass.

    Extra keyword argument: ``logitless_config`` (:class:`LogitlessConfig`), resolved into
    ``trainer.logitless``: ``fused_loss`` is the switch (``fused_logprobs`` does not apply: the
    trainer has no reference and no separate log-prob pass). ``return_outputs`` and evaluation
    run the same path.

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`; everything ``CPOTrainer`` raises.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        attach_materialized(self, logitless_config)

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        if not self.logitless.fused_loss:
            return CPOTrainer.get_batch_loss_metrics(self, model, batch, train_eval)
        cb = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=self.pad_token_id,
                                      device=self.accelerator.device)
        len_chosen = batch["chosen_labels"].shape[0]
        hidden = model(cb["concatenated_input_ids"], attention_mask=cb["concatenated_attention_mask"], use_cache=False,
                       logitless_hidden_states=True)
        hidden, head = head_pass(self, model, hidden)  # [2B, L, H]
        labels = cb["concatenated_labels"][:, 1:]
        mask = labels != -100
        out = cpo_fused_pass(hidden[:, :-1], head, labels.clamp(min=0), mask, config=self.cpo_loss_config(),
                             options=self.logitless.options)
        policy = out.policy
        scores = policy.mean_logps if self.loss_type in ("ipo", "simpo") else policy.logps
        chosen_logps, rejected_logps = scores[:len_chosen], scores[len_chosen:]
        with torch.no_grad():
            _, chosen_rewards, rejected_rewards = self.cpo_loss(chosen_logps, rejected_logps)
            count = policy.lengths[:len_chosen].sum()
            nll = -policy.logps[:len_chosen].sum() / count if self.cpo_alpha != 0 else count.new_zeros(())
            logits_sum = sum_logits(hidden.detach(), head)  # [2B, L]
        gather = self.accelerator.gather_for_metrics
        prefix = "eval_" if train_eval == "eval" else ""
        metrics = paired_metrics(gather, (chosen_rewards, rejected_rewards), (chosen_logps, rejected_logps), logits_sum,
                                 head.vocab_size())
        metrics["nll_loss"] = gather(nll.to(self.accelerator.device)).mean()
        return out.loss, {prefix + k: v.item() for k, v in metrics.items()}

    def cpo_loss_config(self) -> CPOLossConfig:
        """This trainer's loss options as a :class:`logitless.CPOLossConfig`."""
        return CPOLossConfig(beta=self.beta, label_smoothing=self.label_smoothing, loss_type=self.loss_type,
                             cpo_alpha=self.cpo_alpha, simpo_gamma=getattr(self, "simpo_gamma", 0.5), alpha=self.alpha)


def patch_cpo_trainer(trainer: CPOTrainer, logitless_config: LogitlessConfig | None = None) -> LogitlessCPOTrainer:
    """Turn an existing ``CPOTrainer`` into a :class:`LogitlessCPOTrainer` in place."""
    attach_materialized(trainer, logitless_config)
    trainer.__class__ = LogitlessCPOTrainer
    return trainer
