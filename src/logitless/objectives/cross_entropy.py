"""``cross_entropy``: next-token CE with label smoothing and z-loss, one vocabulary pass."""

from __future__ import annotations

import math
from typing import Literal

import torch

from ..amp import autocast_head_inputs
from ..ops import Head, PassOptions, ValueChecks, as_head, check_count
from . import compiled
from .head_loss import TokenStats, _head_loss
from .vocab_stats import vocab_stats

Reduction = Literal["mean", "sum", "none"]


@autocast_head_inputs(compiled=compiled.route(compiled.cross_entropy))
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
            accumulated batch): a number or a one-element tensor (TRL's, on the accelerator),
            finite and > 0, read with the other value checks; other reductions check it but do not use it.
        options: :class:`logitless.PassOptions` (``mode``: see :func:`logitless.policy_loss`).

    Returns:
        ``(loss, metrics)``; metrics (detached, over counted tokens): ``ce`` (the smoothed CE
        without z-loss, reduced like the loss), ``z_loss`` (the added term, reduced like the
        loss), ``accuracy`` (top-1 rate; ties count as correct).
        With no counted token, in every mode: with ``reduction="mean"`` (and no
        ``num_items_in_batch``) the loss, ``ce`` and ``z_loss`` are NaN (0/0, as in PyTorch and
        transformers' loss), else 0; ``accuracy`` is 0 (TRL's ``mean_token_accuracy`` of such a
        batch).

    Raises:
        TypeError: ``num_items_in_batch`` not a number or a one-element tensor.
        ValueError: bad ``reduction``/``label_smoothing``/``z_loss``, a ``num_items_in_batch``
            that is not a finite count > 0 (whatever its type), and everything
            :func:`logitless.vocab_stats` raises.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not (math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    checks = ValueChecks()  # read in the head checks' synchronization
    if num_items_in_batch is not None:
        num_items_in_batch = check_count(num_items_in_batch, checks, hidden.device)
    head = as_head(head)
    eps = float(label_smoothing)

    if reduction == "none":
        checks.run()  # a tensor count, unused by this reduction, is still checked (its own synchronization)
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
    # TRL's mean_token_accuracy of a batch without a counted token is 0.
    metrics = {"accuracy": lambda s: s.is_top1.to(s.logp.dtype).sum() / max(s.count, 1)}
    # With lse among the statistics the pass keeps its fp16-centred tile even without a z-loss: a
    # d weight of 1.5e-3 against float64 where the probability tile gives 2.8e-3 (and Liger's native
    # CuTe kernel 1.6e-3-1.7e-3), for 2-5% of a call's time (docs/architecture.md, "The kept tile as
    # probabilities").
    stats = ("logp", "lse", "is_top1", *(("mean_logit",) if eps else ()))
    loss, values = _head_loss(hidden, head, targets, terms, metrics, ignore_index, stats, options, pending=checks)
    if "z_loss" not in values:
        values["z_loss"] = torch.zeros_like(values["ce"])
    if reduction == "mean" and num_items_in_batch is None:
        # No counted token: the fused pass ran no chunk, so its sums are 0; the mean is 0/0, NaN
        # in every mode, for the loss and the `ce`/`z_loss` parts reported beside it. A factor
        # rather than a branch: reading the flag would make the host wait for the pass.
        empty = torch.where((targets != ignore_index).any(), 1.0, float("nan")).to(loss.dtype)
        loss = loss * empty
        values["ce"], values["z_loss"] = values["ce"] * empty, values["z_loss"] * empty
    return loss, values
