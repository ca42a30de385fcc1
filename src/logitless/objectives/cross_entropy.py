"""``cross_entropy``: next-token CE with label smoothing and z-loss, one vocabulary pass."""

from __future__ import annotations

import math
from typing import Literal

import torch

from ..amp import autocast_head_inputs
from ..compile import graph_break
from ..ops import HeadLoRA, Impl, LogitTransform, VocabShard, vocab_stats
from .head_loss import TokenStats, head_loss
from .run import Mode

Reduction = Literal["mean", "sum", "none"]


@graph_break
@autocast_head_inputs
def cross_entropy(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] or [B, T]
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    shard: VocabShard | None = None,
    lora: HeadLoRA | None = None,
    mode: Mode = "auto",
    impl: Impl = "auto",
    chunk_bytes: int | None = None,
    fp32_logits: bool | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy of ``targets`` under the head's softmax, with label smoothing and z-loss,
    from one vocabulary pass.

    Per counted token: ``(1 - ε)·(-logp) + ε·(lse - mean_logit) + z_loss·lse²`` — the label
    smoothing of ``torch.nn.functional.cross_entropy`` (uniform ``ε / V`` over the classes) and
    the z-loss of PaLM (Chowdhery et al. 2022, §5) on the log-partition ``lse``; nats.

    Args:
        hidden, weight, targets, bias, transform, shard, lora, impl, chunk_bytes, fp32_logits: as
            :func:`logitless.vocab_stats` (``transform`` carries temperature/scale/soft-cap).
        ignore_index: targets not counted.
        reduction: ``"mean"`` (over counted tokens, or ``num_items_in_batch`` when given: the
            Hugging Face gradient-accumulation convention), ``"sum"``, or ``"none"`` (per-token
            losses shaped like ``targets``, 0 at ignored tokens; recompute mode).
        label_smoothing: ``ε`` in ``[0, 1]``.
        z_loss: coefficient of ``lse²``.
        mode: ``"auto"``/``"fused"``/``"recompute"`` (see :func:`logitless.policy_loss`).

    Returns:
        ``(loss, metrics)``; metrics (detached, over counted tokens): ``ce`` (the smoothed CE
        without z-loss, reduced like the loss), ``z_loss`` (the added term, reduced like the
        loss), ``accuracy`` (top-1 rate; ties count as correct).
        With ``reduction="mean"`` and no counted token the loss is NaN, as in PyTorch.

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
    transform = LogitTransform() if transform is None else transform
    eps = float(label_smoothing)

    if reduction == "none":
        st = vocab_stats(hidden, weight, targets, bias=bias, temperature=transform.temperature,
                         logit_scale=transform.logit_scale, softcap=transform.softcap, ignore_index=ignore_index,
                         entropy=False, mean_logit=eps > 0, shard=shard, lora=lora, chunk_bytes=chunk_bytes,
                         fp32_logits=fp32_logits, impl=impl)
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
    loss, values = head_loss(hidden, weight, targets, terms, metrics=metrics, bias=bias, transform=transform,
                             ignore_index=ignore_index, stats=stats, shard=shard, lora=lora, mode=mode, impl=impl,
                             chunk_bytes=chunk_bytes, fp32_logits=fp32_logits)
    if "z_loss" not in values:
        values["z_loss"] = torch.zeros_like(values["ce"])
    return loss, values
