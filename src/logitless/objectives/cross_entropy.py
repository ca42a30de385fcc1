"""``cross_entropy``: next-token CE with label smoothing and z-loss, one vocabulary pass."""

from __future__ import annotations

import math
from typing import Literal

import torch

from ..amp import autocast_head_inputs
from ..compile import graph_break
from ..ops import Head, PassOptions, as_head, vocab_stats
from .head_loss import TokenStats, head_loss

Reduction = Literal["mean", "sum", "none"]


@graph_break
@autocast_head_inputs
def cross_entropy(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [N] or [B, T]
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy of ``targets`` under the head's softmax, with label smoothing and z-loss,
    from one vocabulary pass.

    Per counted token: ``(1 - ε)·(-logp) + ε·(lse - mean_logit) + z_loss·lse²`` — the label
    smoothing of ``torch.nn.functional.cross_entropy`` (uniform ``ε / V`` over the classes) and
    the z-loss of PaLM (Chowdhery et al. 2022, §5) on the log-partition ``lse``; nats.

    Args:
        hidden, head, targets: as :func:`logitless.vocab_stats` (the head's ``transform`` carries
            temperature/scale/soft-cap).
        ignore_index: targets not counted.
        reduction: ``"mean"`` (over counted tokens, or ``num_items_in_batch`` when given: the
            Hugging Face gradient-accumulation convention), ``"sum"``, or ``"none"`` (per-token
            losses shaped like ``targets``, 0 at ignored tokens; recompute mode).
        label_smoothing: ``ε`` in ``[0, 1]``.
        z_loss: coefficient of ``lse²``.
        num_items_in_batch: the denominator of ``"mean"`` (counted tokens of the whole
            accumulated batch; > 0).
        options: :class:`logitless.PassOptions` (``mode``: see :func:`logitless.policy_loss`).

    Returns:
        ``(loss, metrics)``; metrics (detached, over counted tokens): ``ce`` (the smoothed CE
        without z-loss, reduced like the loss), ``z_loss`` (the added term, reduced like the
        loss), ``accuracy`` (top-1 rate; ties count as correct).
        With ``reduction="mean"`` and no counted token the loss is NaN, as in PyTorch, in every
        mode.

    Raises:
        ValueError: bad ``reduction``/``label_smoothing``/``z_loss``, and everything
            :func:`logitless.vocab_stats` raises.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not (math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if num_items_in_batch is not None and not isinstance(num_items_in_batch, torch.Tensor) \
            and not num_items_in_batch > 0:
        raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch!r}")
    head = as_head(head)
    eps = float(label_smoothing)

    if reduction == "none":
        st = vocab_stats(hidden, head, targets, ignore_index=ignore_index, entropy=False, mean_logit=eps > 0,
                         options=options)
        ce = -st.logp if eps == 0 else (1 - eps) * -st.logp + eps * (st.lse - st.mean_logit)
        valid = targets != ignore_index
        ce = torch.where(valid, ce, torch.zeros_like(ce))
        zl = torch.where(valid, z_loss * st.lse**2, torch.zeros_like(ce))
        count = valid.sum().clamp(min=1)
        return ce + zl, {"ce": ce.detach().sum() / count, "z_loss": zl.detach().sum() / count}

    def denominator(s: TokenStats) -> float | torch.Tensor:
        if reduction == "sum":
            return 1.0
        if num_items_in_batch is not None:
            return num_items_in_batch
        return s.count if s.count else float("nan")

    def ce_term(s: TokenStats) -> torch.Tensor:
        nll = -s.logp
        if eps:
            nll = (1 - eps) * nll + eps * (s.lse - s.mean_logit)
        return nll.sum() / denominator(s)

    terms = {"ce": ce_term}
    if z_loss:
        terms["z_loss"] = lambda s: z_loss * (s.lse**2).sum() / denominator(s)
    metrics = {"accuracy": lambda s: s.is_top1.to(s.logp.dtype).sum() / (s.count or float("nan"))}
    stats = ("logp", "lse", "is_top1", *(("mean_logit",) if eps else ()))
    loss, values = head_loss(hidden, head, targets, terms, metrics=metrics, ignore_index=ignore_index, stats=stats,
                             options=options)
    if "z_loss" not in values:
        values["z_loss"] = torch.zeros_like(values["ce"])
    if reduction == "mean" and num_items_in_batch is None:
        # No counted token: the fused pass ran no chunk, so its sum is 0; the mean is 0/0. A
        # factor rather than a branch: reading the flag would make the host wait for the pass.
        loss = loss * torch.where((targets != ignore_index).any(), 1.0, float("nan")).to(loss.dtype)
    return loss, values
