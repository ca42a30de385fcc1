"""``LogitlessConfig(skip_zero_advantage=True)``: the GRPO drop-in's training step without the
completions that carry no gradient.

With ``beta == 0``, no entropy bonus and no entropy-quantile mask, every per-token loss of TRL 1.16's
``GRPOTrainer._compute_loss`` is the advantage times a finite factor: the clipped surrogates
(``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``, ``delta`` included), ``cispo``'s detached
ratio, ``sapo``'s gate, ``vespo``'s detached gamma weight; the off-policy sequence mask and the
sampler's importance-sampling ratio only multiply it, row by row. A completion whose advantage is
exactly 0, or that has no counted token (``completion_mask * tool_mask`` all 0), therefore adds 0
to the loss and 0 to every gradient. Such rows are removed before the model's forward (trailing
completion columns that no remaining row uses are cut too: under causal attention no earlier
position reads them), and TRL's normalizers are restored on the rows that ran:

* ``grpo``, ``sapo``, ``luspo``, ``dr_grpo`` divide by the micro-batch's row count: the loss of the
  ``k`` rows that ran is multiplied by ``k / B``;
* ``bnpo`` divides by the micro-batch's counted tokens: multiplied by ``n_ran / n_all`` (each
  clamped at 1, as TRL clamps);
* ``dapo``, ``cispo``, ``vespo`` divide by ``num_items_in_batch`` (the generation batch's tokens),
  which is passed unchanged.

A micro-batch where no row carries a gradient still runs one row (the one with the fewest counted
tokens) with its loss multiplied by 0: every parameter then gets an exact zero gradient
(``0 · finite``) through the same forward and backward, so every DDP / FSDP / ZeRO rank joins the
gradient reduction and the metric collectives.

Metrics: TRL's clip ratios (``clip_ratio/*``, ``cispo_clip_ratio``) are 0 on a row with zero
advantage (they require ``A < 0`` or ``A > 0``), so they are restored to TRL's full-batch values:
means over all counted tokens (or sequences, at sequence level) of every process, the row minimum
0 where a removed row counts. ``entropy``, ``vespo/phi_seq_mean`` and the trainer-sampler mismatch
are averaged over the rows that ran.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import all_reduce

# How each TRL loss type normalizes its sum (the loss types TRL 1.16's GRPOTrainer accepts).
_PER_ROW = ("grpo", "sapo", "luspo", "dr_grpo")
_PER_TOKEN = ("bnpo",)
_PER_GENERATION_BATCH = ("dapo", "cispo", "vespo")
# TRL's micro-batch entries indexed by row; num_items_in_batch is a scalar of the generation batch.
_ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
             "ref_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask")
_COLUMN_KEYS = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                "sampling_per_token_logps", "tool_mask")
_SCALAR_KEYS = ("num_items_in_batch",)
_CLIP_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")


@dataclass(frozen=True)
class RowSelection:
    """The rows of one micro-batch that run.

    Attributes:
        rows: ``[k]`` int64 indices of the rows that run, ascending.
        carries: ``[B]`` bool, rows with a nonzero advantage at a counted token.
        columns: completion columns kept (the trailing ones no running row uses are cut).
        dummy: no row carries a gradient; ``rows`` is one row whose loss is multiplied by 0.
    """

    rows: torch.Tensor
    carries: torch.Tensor
    columns: int
    dummy: bool


def skip_problem(trainer: Any) -> str | None:
    """Why ``trainer``'s TRL options give a zero-advantage completion a gradient (or a normalizer
    logitless does not restore), or ``None`` when the rows can be removed exactly."""
    if not trainer.logitless.fused_loss:
        return ("needs fused_loss (TRL's own loss gathers per-row metrics across processes): "
                + trainer.logitless.why_not.get("fused_loss", "off"))
    if trainer.beta != 0.0:
        return f"beta={trainer.beta}: the KL to the reference gives every completion a gradient"
    if getattr(trainer, "_entropy_bonus_enabled", False) or trainer.entropy_coef != 0.0 \
            or getattr(trainer, "use_adaptive_entropy", False):
        return "an entropy bonus gives every completion a gradient"
    if trainer.top_entropy_quantile < 1.0:
        return (f"top_entropy_quantile={trainer.top_entropy_quantile}: the entropy quantile is taken over every "
                "completion's tokens")
    if trainer.loss_type not in (*_PER_ROW, *_PER_TOKEN, *_PER_GENERATION_BATCH):
        return f"loss_type={trainer.loss_type!r} is not one whose normalizer is restored"
    return None


def _inputs_problem(inputs: dict[str, Any]) -> str | None:
    other = sorted(k for k, v in inputs.items() if v is not None and k not in (*_ROW_KEYS, *_SCALAR_KEYS))
    return f"inputs not split by row here: {other}" if other else None


def counted_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """``[B, T]`` TRL's loss mask: ``completion_mask`` times ``tool_mask`` when present."""
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


def select_rows(inputs: dict[str, Any]) -> RowSelection:
    """The rows of TRL's micro-batch ``inputs`` that carry a gradient (host synchronizations: the
    row indices, the kept column count).

    Raises:
        ValueError: ``advantages`` is neither ``[B]``, ``[B, 1]`` nor ``[B, T]``.
    """
    mask = counted_mask(inputs) != 0
    adv = inputs["advantages"]
    b, t = mask.shape
    if adv.shape not in ((b,), (b, 1), (b, t)):
        raise ValueError(f"advantages must be [B], [B, 1] or [B, T] = [{b}, {t}], got {list(adv.shape)}")
    nonzero = adv != 0  # NaN stays in: the loss's own checks name it
    carries = (nonzero[:, None] & mask if nonzero.dim() == 1 else nonzero & mask).any(-1)
    rows = carries.nonzero().squeeze(1)
    dummy = rows.numel() == 0
    if dummy:  # the cheapest row: fewest counted tokens, but one if any row has one
        n = mask.sum(-1)
        rows = torch.where(n > 0, n, t + 1).argmin().reshape(1)
    used = inputs["completion_mask"][rows] != 0
    cols = used.any(0).nonzero()
    columns = int(cols[-1]) + 1 if cols.numel() else 1
    return RowSelection(rows=rows, carries=carries, columns=columns, dummy=dummy)


def take_rows(inputs: dict[str, Any], sel: RowSelection) -> dict[str, Any]:
    """TRL's micro-batch restricted to ``sel``'s rows and completion columns."""
    t = inputs["completion_ids"].shape[1]
    out = {}
    for k, v in inputs.items():
        if k in _ROW_KEYS and v is not None:
            v = v[sel.rows]
            if k in _COLUMN_KEYS or (k in ("advantages", "importance_sampling_ratio") and v.dim() == 2
                                     and v.shape[1] == t):
                v = v[:, :sel.columns]
        out[k] = v
    return out


def loss_without_zero_advantage(trainer: Any, model: torch.nn.Module, inputs: dict[str, Any],
                                loss_of_rows: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor]
                                ) -> torch.Tensor:
    """TRL's GRPO training loss of ``inputs`` from the rows that carry a gradient.

    Args:
        trainer: the ``LogitlessGRPOTrainer`` (its options, ``logitless`` switches, ``_metrics``).
        model: the (wrapped) model.
        inputs: TRL's micro-batch (``prompt_ids`` ``[B, P]`` … ``advantages`` ``[B]``,
            ``num_items_in_batch``).
        loss_of_rows: the drop-in's fused loss of a micro-batch; it logs its metrics into
            ``trainer._metrics["train"]``.

    Returns:
        The scalar loss, equal to TRL's on all of ``inputs``, with its gradients; an option that
        gives zero-advantage rows a gradient warns once and every row runs.
    """
    problem = skip_problem(trainer) or _inputs_problem(inputs)
    if problem is not None:
        trainer.logitless.warn_once("skip_zero_advantage", problem + "; every completion runs")
        return loss_of_rows(model, inputs)
    sel = select_rows(inputs)
    mask = counted_mask(inputs)
    logged = trainer._metrics["train"]
    before = {k: len(v) for k, v in logged.items()}
    loss = loss_of_rows(model, take_rows(inputs, sel))
    loss = loss * _normalizer_ratio(trainer.loss_type, sel, mask, loss.dtype)
    group = dist.group.WORLD if trainer.accelerator.num_processes > 1 else None
    sequence_level = trainer.importance_sampling_level == "sequence" and inputs["advantages"].dim() == 1
    _restore_clip_metrics(logged, before, sel, mask, sequence_level, group)
    return loss


def _normalizer_ratio(loss_type: str, sel: RowSelection, mask: torch.Tensor, dtype: torch.dtype):
    """TRL's normalizer of the rows that ran over its normalizer of the whole micro-batch."""
    if sel.dummy:
        return 0.0
    if loss_type in _PER_ROW:
        return sel.rows.numel() / mask.shape[0]
    if loss_type in _PER_TOKEN:
        n_all = mask.sum().to(dtype)
        return mask[sel.rows].sum().to(dtype).clamp(min=1.0) / n_all.clamp(min=1.0)
    return 1.0


def _restore_clip_metrics(logged: dict[str, list], before: dict[str, int], sel: RowSelection, mask: torch.Tensor,
                          sequence_level: bool, group) -> None:
    """Put TRL's full-batch values back into the clip-ratio metrics the last call logged.

    TRL's mean is ``Σ indicator / count`` over every process's counted tokens (sequences at
    sequence level): the rows that did not run add 0 to the sum, so the mean over the rows that
    ran is rescaled by ``count_ran / count_all``. Its row minimum / maximum (over rows with a
    counted token, every row at sequence level) includes those rows' 0."""
    new = {k for k, v in logged.items() if len(v) > before.get(k, 0)}
    if not new & {*_CLIP_MEANS, "clip_ratio/low_min", "clip_ratio/high_max"}:
        return
    ran = torch.zeros_like(sel.carries)
    ran[sel.rows] = True
    per_row = torch.ones_like(mask[:, 0], dtype=torch.float64) if sequence_level else mask.sum(-1).double()
    counts = per_row > 0
    stats = torch.stack([per_row[ran].sum(), per_row.sum(), (counts & ~sel.carries).sum().double()])
    n_ran, n_all, zero_rows = all_reduce(stats, "sum", group).tolist()
    for k in new & set(_CLIP_MEANS):
        logged[k][-1] = logged[k][-1] * max(n_ran, 1.0) / max(n_all, 1.0)
    if zero_rows > 0:
        if "clip_ratio/low_min" in new:
            logged["clip_ratio/low_min"][-1] = 0.0
        # The removed rows' 0 changes TRL's nanmax only where no row that ran had a value (NaN).
        if "clip_ratio/high_max" in new and math.isnan(logged["clip_ratio/high_max"][-1]):
            logged["clip_ratio/high_max"][-1] = 0.0
