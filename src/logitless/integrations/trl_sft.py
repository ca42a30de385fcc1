"""``LogitlessSFTTrainer``: TRL 1.16's ``SFTTrainer`` with the loss computed by logitless.

    from logitless.integrations.trl_sft import LogitlessSFTTrainer as SFTTrainer

The training loss is one fused vocabulary pass (:func:`logitless.head_loss`, 3 GEMMs of work):
the next-token NLL (``loss_type="nll"``) or DFT's probability-weighted NLL (``"dft"``, Wu et al.
2025, arXiv:2508.05629), with ``label_smoothing_factor`` computed from the statistics
``lse - mean_logit`` instead of TRL's extra full-logits forward; the ``entropy`` and
``mean_token_accuracy`` metrics come from the same pass. Padding-free / packed batches
(``position_ids``, ``-100`` at each sequence's first label) and pre-shifted ``shift_labels`` are
taken as TRL takes them. Normalization, ``average_tokens_across_devices`` and the metric
bookkeeping follow ``SFTTrainer.compute_loss``.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import SFTTrainer

from ..objectives import TokenStats, head_loss
from .config import LogitlessConfig
from .trl_head import BACKBONE_KWARGS, ActiveMetric, attach, head_pass, lora_head_admitted, trl_own_path

__all__ = ["LogitlessSFTTrainer", "patch_sft_trainer", "trl_own_path"]

_OUTPUTS = ("log_probs", "entropy", "is_top1")


def _unsupported(trainer: SFTTrainer) -> list[str]:
    out = []
    if trainer.compute_loss_func is not None:
        out.append("compute_loss_func (a loss on the model's logits)")
    if trainer.aux_loss_enabled:
        out.append("MoE router aux loss (output_router_logits)")
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and getattr(pc, "sp_enabled", False) and getattr(pc, "sp_backend", None) == "deepspeed":
        out.append("DeepSpeed sequence parallelism (the loss is the model's own, reduced by Trainer)")
    return out


class LogitlessSFTTrainer(ActiveMetric, SFTTrainer):
    """``trl.SFTTrainer`` whose loss and metrics come from one logitless pass.

    Extra keyword argument: ``logitless_config`` (:class:`LogitlessConfig`), resolved into
    ``trainer.logitless``: ``fused_loss`` is the training loss above; ``fused_logprobs`` puts
    logitless behind TRL's fused head for the calls that still use it (``fused_loss`` off).
    ``compute_loss_func``, MoE aux loss and DeepSpeed sequence parallelism resolve ``fused_loss``
    off (TRL's loss runs); a batch with multimodal inputs, or ``return_outputs=True`` (logits
    asked for), runs TRL's ``compute_loss`` for that call. A LoRA adapter on ``lm_head``
    (``peft_config`` or a PEFT model), which TRL's own trainer refuses, is accepted.

    Raises:
        TypeError, ValueError: an invalid :class:`LogitlessConfig`; everything ``SFTTrainer`` raises.
    """

    def __init__(self, *args: Any, logitless_config: LogitlessConfig | None = None, **kwargs: Any) -> None:
        with lora_head_admitted(SFTTrainer, args, kwargs):
            super().__init__(*args, **kwargs)
        attach(self, logitless_config, outputs=_OUTPUTS, loss_problems=_unsupported(self))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sw = self.logitless
        other = sorted(k for k, v in inputs.items()
                       if v is not None and k not in BACKBONE_KWARGS | {"labels", "shift_labels"})
        if not sw.fused_loss or return_outputs or other:
            if sw.fused_loss and other and sw.config.fused_loss:
                sw.warn_once("fused_loss", f"inputs {other}")
            return SFTTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                           num_items_in_batch=num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        kw = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        kw["use_cache"] = False
        hidden = model(**kw, logitless_hidden_states=True)
        if inputs.get("shift_labels") is None:
            hidden, labels = hidden[:, :-1], inputs["labels"][:, 1:]
        else:
            labels = inputs["shift_labels"]
        hidden, head = head_pass(self, model, hidden)
        labels = labels.to(hidden.device)
        loss, values = head_loss(
            hidden, head, labels, {"loss": self._loss_term(num_items_in_batch, labels)},
            metrics={"entropy": lambda s: s.entropy.sum(), "correct": lambda s: s.is_top1.sum().to(s.logp.dtype)},
            stats=("logp", "lse", "entropy", "is_top1", *(("mean_logit",) if self._smoothing() else ())),
            options=sw.options)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        self._log_metrics(mode, inputs, (labels != -100).sum(), values)
        return loss

    def _smoothing(self) -> float:
        # TRL applies label smoothing (through transformers' LabelSmoother) to the NLL loss only.
        return self.args.label_smoothing_factor if self.args.loss_type == "nll" else 0.0

    def _loss_term(self, num_items_in_batch, labels):
        eps, dft = self._smoothing(), self.args.loss_type == "dft"
        count = (labels != -100).sum()
        if eps:  # LabelSmoother: no clamp (0/0 is NaN there too)
            denom = count if num_items_in_batch is None else num_items_in_batch
        else:
            denom = count.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        denom = torch.as_tensor(denom, device=labels.device)

        def term(s: TokenStats) -> torch.Tensor:
            nll = -s.logp
            if dft:  # DFT: the NLL weighted by the (detached) probability of the label
                nll = nll * s.logp.detach().exp()
            if eps:  # -Σ_v log p_v / V = lse - mean_logit (LabelSmoother's smoothed term)
                nll = (1 - eps) * nll + eps * (s.lse - s.mean_logit)
            return nll.sum() / denom.to(nll.dtype)

        return term

    def _log_metrics(self, mode: str, inputs: dict, count: torch.Tensor, values: dict) -> None:
        """``SFTTrainer.compute_loss``'s metric bookkeeping, on the pass's sums."""
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(count).sum()
        entropy_sum = gather(values["entropy"].reshape(())).sum()
        # An integer count, as TRL's is_top1.sum(): its ratio is then computed (and rounded) as TRL's is.
        num_correct = gather(values["correct"].round().long().reshape(())).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                n = gather(inputs["attention_mask"].sum()).sum().item()
            else:  # padding-free: one packed row
                n = gather(torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device))
                n = n.sum().item()
            self._total_train_tokens += n // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


def patch_sft_trainer(trainer: SFTTrainer, logitless_config: LogitlessConfig | None = None) -> LogitlessSFTTrainer:
    """Turn an existing ``SFTTrainer`` into a :class:`LogitlessSFTTrainer` in place."""
    attach(trainer, logitless_config, outputs=_OUTPUTS, loss_problems=_unsupported(trainer))
    trainer.__class__ = LogitlessSFTTrainer
    return trainer
