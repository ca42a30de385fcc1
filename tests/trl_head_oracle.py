"""TRL 1.16's fused-LM-head contract from full float64 logits: the oracle the SFT / DPO / KTO /
RLOO drop-ins are checked against.

TRL's own chunked head keeps its statistics in fp32 whatever the model dtype, so on a float64
model it is only good to ~1e-7. This head computes the same ``FusedCausalLMOutput`` fields from
the model's own (materialized, float64) logits with TRL's ``selective_log_softmax`` and
``entropy_from_logits``; everything else the trainer does (its loss, metrics, reference pass) is
TRL's code, untouched.
"""

from __future__ import annotations

import types

import torch


def install_plain_head(model: torch.nn.Module, temperature: float = 1.0) -> None:
    """Replace TRL's fused head on ``model`` (a transformers causal LM) with the full-logits one."""
    from trl.trainer.utils import FusedCausalLMOutput, entropy_from_logits, selective_log_softmax

    own_forward = type(model).forward

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kw):
        if not fused_lm_head:
            return own_forward(self, *args, labels=labels, **kw)
        kw["use_cache"] = False
        logits = own_forward(self, *args, **kw).logits
        if shift_labels is None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        logits = logits / temperature
        mask = labels != -100
        safe = labels.clamp(min=0)
        log_probs = selective_log_softmax(logits, safe).masked_fill(~mask, 0)
        entropy = entropy_from_logits(logits).masked_fill(~mask, 0)
        log_sum_sq = torch.logsumexp(2 * torch.log_softmax(logits, -1), -1).detach().masked_fill(~mask, 0)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq,
            mean_logits=logits.mean(-1).detach().masked_fill(~mask, 0),
            is_top1=(logits.argmax(-1) == labels) & mask, label_mask=mask)

    model.forward = types.MethodType(forward, model)


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def trainer_step(tr, loss_of) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(loss, every parameter's gradient flattened, last logged train metrics)`` of one
    ``loss_of(tr.model)`` on a trainer, gradients and metrics cleared first."""
    tr.model.zero_grad(set_to_none=True)
    tr._metrics["train"].clear()
    loss = loss_of(tr.model)
    loss.backward()
    return loss.detach(), flat_grads(tr.model), {k: v[-1] for k, v in tr._metrics["train"].items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


class PassCounter:
    """Counts the logitless passes behind TRL's fused head (``trl_head.vocab_stats`` calls)."""

    def __init__(self, monkeypatch) -> None:
        import logitless.integrations.trl_head as trl_head

        self.n = 0
        inner = trl_head.vocab_stats

        def counted(*args, **kwargs):
            self.n += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(trl_head, "vocab_stats", counted)
