"""Materialized-logits oracle: the plain path in float64, used only by tests and the bench."""

from __future__ import annotations

import torch

from ..ops.transform import LogitTransform
from .vocab_stats import VocabStats


def reference_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    bias: torch.Tensor | None = None, temperature: float = 1.0, logit_scale: float = 1.0,
                    softcap: float | None = None, ignore_index: int = -100,
                    dtype: torch.dtype = torch.float64) -> VocabStats:
    """``(logp, lse, entropy)`` from the full ``[..., V]`` logits computed in ``dtype``
    (differentiable; 0 at ``ignore_index`` rows)."""
    transform = LogitTransform(temperature, logit_scale, softcap)
    y = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        y = y + bias.to(dtype)
    z = transform.apply(y)
    logsm = torch.log_softmax(z, dim=-1)
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != ignore_index
    logp = logsm.gather(-1, targets.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    zero = torch.zeros((), dtype=dtype, device=hidden.device)
    return VocabStats(logp=torch.where(valid, logp, zero), lse=torch.where(valid, lse, zero),
                      entropy=torch.where(valid, entropy, zero))
