"""``LogitlessKTOTrainer``: TRL 1.16's ``KTOTrainer`` with its head computed by logitless.

    from logitless.integrations.trl_kto import LogitlessKTOTrainer as KTOTrainer

With ``fused_loss`` (the default where it applies) the loss (``kto``, ``apo_zero_unpaired``;
desirable / undesirable weights), its gradient and every metric TRL logs come from one fused
vocabulary pass over the completion tokens (:func:`~logitless.objectives.preference_fused.
kto_fused_pass`: chunks of whole sequences, 3 GEMMs of work, the formulas of
:func:`logitless.kto_loss`, which are ``KTOTrainer._compute_loss``'s), never from logits; the
batch's KL estimate is TRL's (averaged over the data-parallel ranks). Where it does not apply
(the MoE router aux loss; per call: multimodal inputs or ``return_outputs=True``) the loss is
TRL's own code on the log-probs of a logitless pass behind TRL's fused head (``fused_logprobs``).
The reference's log-probs and both models' log-probs on the mismatched (prompt, completion) pairs
of the KL estimate come from logitless passes behind TRL's head, or from the dataset when TRL
precomputed them, or from a reference log-prob cache (``ref_cache=``, then no reference model
runs at all).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from accelerate.utils import is_peft_model
from trl import KTOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from ..objectives import KTOLossConfig
from ..objectives.preference_fused import kto_fused_pass
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

__all__ = ["LogitlessKTOTrainer", "patch_kto_trainer", "reference_records", "trl_own_path"]

_OUTPUTS = ("log_probs", "entropy", "mean_logits")
# Keys of KTO's batches that are not model inputs (KTOTrainer._compute_loss's _non_model_keys).
_NON_MODEL_KEYS = frozenset({"completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask",
                             "KL_token_type_ids", "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps"})


def _unsupported(trainer: KTOTrainer) -> list[str]:
    """The trainer's options that the fused loss does not reproduce (``fused_loss`` resolves off)."""
    return ["MoE router aux loss (output_router_logits)"] if trainer.aux_loss_enabled else []


def _attach(trainer: KTOTrainer, config: LogitlessConfig | None, ref_cache: Any) -> None:
    attach(trainer, config, outputs=_OUTPUTS, loss_problems=_unsupported(trainer), ref_cache=ref_cache)


class LogitlessKTOTrainer(ActiveMetric, KTOTrainer):
    """``trl.KTOTrainer`` whose log-probs (policy, reference, KL pairs) come from logitless.

    Extra keyword arguments (optional): ``logitless_config`` (:class:`LogitlessConfig`), resolved
    into ``trainer.logitless`` (``fused_loss``: the loss and metrics from one fused pass;
    ``fused_logprobs``: logitless behind TRL's fused head, for the reference, the KL pairs and
    wherever TRL's loss code runs); ``ref_cache``, as for
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
        _attach(self, logitless_config, ref_cache)

    def _compute_loss(self, model, inputs, return_outputs):
        if not takes_fused_loss(self.logitless, inputs, _NON_MODEL_KEYS, return_outputs):
            return KTOTrainer._compute_loss(self, model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        batch = {k: (v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        kl_logps = self._compute_kl_logps(model, batch)  # TRL's no-grad pass on the KL pairs
        model_kwargs = {k: v for k, v in batch.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        seq_len = batch["input_ids"].size(1) - 1
        hidden = model(**model_kwargs, logitless_hidden_states=True)
        # Prompt-learning PEFT prepends virtual tokens; the last seq_len + 1 positions are the real ones.
        hidden, head = head_pass(self, model, hidden[:, -seq_len - 1:-1])
        ref_logps, ref_kl_logps = self._reference_logps(batch, model_kwargs, completion_labels, seq_len)
        label = torch.as_tensor(batch["label"], dtype=torch.bool, device=hidden.device)
        if self.calculate_KL:
            kl = (kl_logps - ref_kl_logps).mean().detach()
            kl = self.accelerator.gather_for_metrics(kl).mean().clamp(min=0)
        else:
            kl = None
        out = kto_fused_pass(hidden, head, batch["input_ids"][:, 1:], batch["completion_mask"][:, 1:], label,
                             ref_logps, kl, config=self.kto_loss_config(), options=self.logitless.options)
        self._log_fused_metrics(mode, batch, out, label, ref_logps, kl)
        return out.loss

    def kto_loss_config(self) -> KTOLossConfig:
        """This trainer's loss options as a :class:`logitless.KTOLossConfig`."""
        return KTOLossConfig(beta=self.beta, loss_type=self.loss_type, desirable_weight=self.desirable_weight,
                             undesirable_weight=self.undesirable_weight)

    def _reference_logps(self, batch, model_kwargs, completion_labels, seq_len):
        """``(ref_logps [B], ref_KL_logps [B] or None)`` as ``KTOTrainer._compute_loss`` gets them."""
        if self.precompute_ref_logps:
            return batch["ref_logps"], batch["ref_KL_logps"] if self.calculate_KL else None
        ref_model_kwargs = {k: v for k, v in model_kwargs.items() if k != "output_router_logits"}
        adapter, ref_model = contextlib.nullcontext(), self.ref_model
        if is_peft_model(self.model) and self.ref_model is None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            adapter = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
            ref_model = self.model
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            with adapter:
                ref_kl_logps = self._compute_kl_logps(ref_model, batch)
                ref_outputs = ref_model(**ref_model_kwargs, labels=completion_labels, fused_lm_head=True)
        return ref_outputs.log_probs[:, -seq_len:].sum(-1), ref_kl_logps

    def _log_fused_metrics(self, mode, batch, out, label, ref_logps, kl) -> None:
        """``KTOTrainer._compute_loss``'s metric bookkeeping (gathers included), on the pass's sums."""
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        policy, tokens = out.policy, out.tokens
        metrics["kl"].append(0.0 if kl is None else kl.item())
        count = policy.lengths.round().long()  # completion tokens per sequence, an integer count as TRL's
        entropy_sum, total = gather(policy.entropy_sum.sum()).sum(), gather(count.sum()).sum()
        metrics["entropy"].append((entropy_sum / total).item() if total > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += gather(batch["attention_mask"].sum()).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        rewards = self.beta * (policy.logps - ref_logps.to(policy.logps.dtype))
        for side, rows in (("chosen", label), ("rejected", ~label)):
            s, n = gather(tokens.mean_logit[rows].sum()).sum().item(), gather(count[rows].sum()).sum().item()
            if n > 0:
                metrics[f"logits/{side}"].append(s / n)
        sides = {}
        for side, rows in (("chosen", label), ("rejected", ~label)):
            n = gather(rows.sum()).sum().item()
            if n > 0:
                metrics[f"rewards/{side}"].append(gather(rewards[rows].nansum()).nansum().item() / n)
                metrics[f"logps/{side}"].append(gather(policy.logps[rows].nansum()).nansum().item() / n)
                sides[side] = metrics[f"rewards/{side}"][-1]
        if len(sides) == 2:
            metrics["rewards/margins"].append(sides["chosen"] - sides["rejected"])


def patch_kto_trainer(trainer: KTOTrainer, logitless_config: LogitlessConfig | None = None,
                      ref_cache: Any = None) -> LogitlessKTOTrainer:
    """Turn an existing ``KTOTrainer`` into a :class:`LogitlessKTOTrainer` in place (``ref_cache``
    as there)."""
    _attach(trainer, logitless_config, ref_cache)
    trainer.__class__ = LogitlessKTOTrainer
    return trainer
