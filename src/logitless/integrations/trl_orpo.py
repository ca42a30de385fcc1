"""``LogitlessORPOTrainer``: TRL 1.16's ``ORPOTrainer`` (``trl.experimental.orpo``) with its loss
computed by logitless.

    from logitless.integrations.trl_orpo import LogitlessORPOTrainer as ORPOTrainer

TRL's ``ORPOTrainer`` materializes the logits of the chosen and rejected sequences (``[2B, L, V]``).
With ``fused_loss`` the loss ``NLL - mean(β log σ(log odds))`` (the odds of the per-token **mean**
completion log-probs; the NLL the token mean of ``-log p`` over the chosen rows' prompt **and**
completion, TRL's ``nn.CrossEntropyLoss`` on the attended tokens), its gradient and the metrics come
from one fused vocabulary pass over the completion tokens and the chosen rows' prompt tokens
(:func:`~logitless.objectives.preference_fused.orpo_fused_pass`, 3 GEMMs of work, no logits).
TRL's ``logits/chosen|rejected`` average every logit of every position (prompt and padding
included): for a head whose logits are linear in the hidden state (no soft-cap) that is
``Σ_v z_v = h · Σ_v w_v + Σ_v b_v`` (scaled), a matrix-vector product, so every metric TRL logs is
logged, with TRL's names. Where that does not hold (a soft-capped or vocabulary-sharded head, a
LoRA adapter with dropout), or for an encoder-decoder model or the MoE aux loss, TRL's own code runs
(``fused_loss`` resolves off, the reason logged).
"""

from __future__ import annotations

from typing import Any

import torch
from trl.experimental.orpo import ORPOTrainer

from ..objectives.preference_fused import orpo_fused_pass
from .config import LogitlessConfig
from .trl_head import ActiveMetric, attach_materialized, head_pass, paired_metrics, sum_logits, trl_own_path

__all__ = ["LogitlessORPOTrainer", "patch_orpo_trainer", "trl_own_path"]


class LogitlessORPOTrainer(ActiveMetric, ORPOTrainer):
    """``trl.experimental.orpo.ORPOTrainer`` whose loss and metrics come from one logitless pass.

    Extra keyword argument: ``logitless_config`` (:class:`LogitlessConfig`), resolved into
    ``trainer.logitless``: ``fused_loss`` is the switch (``fused_logprobs`` does not apply: the
    trainer has no reference and no separate log-prob pass). ``return_outputs`` and evaluation
    run the same path.

    Metrics: TRL's, with its names (``rewards/*``, ``logps/*``, ``logits/*``, ``nll_loss``,
    ``log_odds_ratio``, ``log_odds_chosen``); none needs the logits. The rewards and log-odds
    metrics are TRL's ``odds_ratio_loss`` on the pass's mean log-probs (which casts them to
    float32, as TRL does). The loss keeps the pass's statistics dtype (fp32, fp64 for a float64
    model): for a float64 model it is float64-exact where TRL's odds-ratio term is float32-rounded.

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`; a batch whose completion labels
            differ from its input ids (TRL's NLL reads the input ids, its log-odds the labels: one
            pass has one target per position; train with ``fused_loss=False``); everything
            ``ORPOTrainer`` raises.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        attach_materialized(self, logitless_config)

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        if not self.logitless.fused_loss:
            return ORPOTrainer.get_batch_loss_metrics(self, model, batch, train_eval)
        cb = self.concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=self.padding_value, device=self.accelerator.device
        )
        len_chosen = batch["chosen_labels"].shape[0]
        input_ids, attention_mask = cb["concatenated_input_ids"], cb["concatenated_attention_mask"]
        labels, ids = cb["concatenated_labels"][:, 1:], input_ids[:, 1:]
        completion_mask = labels != -100  # get_batch_logps' tokens (the completion)
        nll_mask = attention_mask[:, 1:] == 1  # concatenated_forward's cross_entropy_loss tokens, chosen rows only
        nll_mask[len_chosen:] = False
        if bool((completion_mask & nll_mask & (labels != ids)).any()):
            raise ValueError(
                "ORPO batch: a chosen completion label differs from its input id; TRL's NLL reads the "
                "input ids and its log-odds the labels, which one fused pass cannot both take; train "
                "with LogitlessConfig(fused_loss=False)"
            )
        targets = torch.where(completion_mask, labels, ids)
        hidden = model(input_ids, attention_mask=attention_mask, use_cache=False, logitless_hidden_states=True)
        hidden, head = head_pass(self, model, hidden)  # [2B, L, H]
        out = orpo_fused_pass(
            hidden[:, :-1],
            head,
            targets,
            completion_mask,
            nll_mask=nll_mask,
            beta=self.beta,
            options=self.logitless.options,
        )
        policy = out.policy
        with torch.no_grad():
            chosen_logps, rejected_logps = policy.halves(policy.mean_logps)
            _, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = self.odds_ratio_loss(
                chosen_logps, rejected_logps
            )
            nll_sum, nll_count = policy.halves(policy.nll_sum)[0], policy.halves(policy.nll_count)[0]
            nll = nll_sum.sum() / nll_count.sum()
            logits_sum = sum_logits(hidden[:, :-1].detach(), head)  # [2B, L - 1]
        gather = self.accelerator.gather_for_metrics
        metrics = paired_metrics(gather, (chosen_rewards, rejected_rewards), (chosen_logps, rejected_logps), logits_sum,
                                 head.vocab_size())
        metrics.update({
            "nll_loss": gather(nll).mean(),
            "log_odds_ratio": gather(log_odds_ratio).mean(),
            "log_odds_chosen": gather(log_odds_chosen).mean(),
        })
        prefix = "eval_" if train_eval == "eval" else ""
        return out.loss, {prefix + k: v.item() for k, v in metrics.items()}


def patch_orpo_trainer(trainer: ORPOTrainer, logitless_config: LogitlessConfig | None = None) -> LogitlessORPOTrainer:
    """Turn an existing ``ORPOTrainer`` into a :class:`LogitlessORPOTrainer` in place."""
    attach_materialized(trainer, logitless_config)
    trainer.__class__ = LogitlessORPOTrainer
    return trainer
