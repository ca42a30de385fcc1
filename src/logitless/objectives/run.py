"""Runs an objective over one vocabulary pass, in fused or recompute mode."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from ..ops import ChunkPlan, HeadLoRA, LogitTransform, VocabShard, fused_objective, resolve_impl, stat_dtype_for
from ..ops.vocab_stats import recompute_stats

Mode = Literal["auto", "fused", "recompute"]


def resolve_mode(mode: Mode, needs_global: bool) -> Literal["fused", "recompute"]:
    """``auto`` → fused unless the objective needs every token's statistics before its loss.

    Raises:
        ValueError: unknown mode, or ``fused`` for an objective that cannot be chunked.
    """
    if mode not in ("auto", "fused", "recompute"):
        raise ValueError(f"mode must be 'auto', 'fused' or 'recompute', got {mode!r}")
    if mode == "fused" and needs_global:
        raise ValueError("mode='fused' cannot run an objective that needs every token's entropy before the "
                         "loss (top_entropy_quantile < 1); use mode='recompute' or 'auto'")
    if mode == "auto":
        return "recompute" if needs_global else "fused"
    return mode


def run_objective(
    hidden: torch.Tensor,  # [n, H] counted tokens
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [n]
    transform: LogitTransform,
    objective: Callable[[slice, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, Any]],
    *,
    mode: Literal["fused", "recompute"],
    cuts: Sequence[int] | None,
    want_entropy: bool,
    impl: str,
    chunk_bytes: int | None,
    before_loss: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None,
    extra_stats: tuple[str, ...] = (),
    shard: VocabShard | None = None,
    lora: HeadLoRA | None = None,
    fp32_logits: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[Any]]:
    """``(loss, logp, entropy, collected)`` of ``objective`` summed over the tokens.

    In recompute mode the objective sees all tokens at once, after ``before_loss`` has seen
    the detached statistics (e.g. to set a quantile mask); in fused mode it is called per
    chunk (cut at ``cuts`` when given). ``extra_stats`` (``"lse"``, ``"sum_z"``, ``"is_top1"``)
    reach the objective as keyword arguments. ``logp``/``entropy`` come back detached.
    """
    backend = resolve_impl(impl, hidden.device)
    if mode == "fused":
        return fused_objective(hidden, weight, bias, targets, transform, objective, cuts=cuts,
                               want_entropy=want_entropy, chunk_bytes=chunk_bytes, backend=backend,
                               extra_stats=extra_stats, shard=shard, lora=lora,
                               fp32_logits=fp32_logits)
    plan = ChunkPlan.make(hidden.shape[0], weight.shape[0], chunk_bytes, stat_dtype_for(hidden.dtype),
                          hidden.dtype, backend.NAME, fp32_logits)
    lse, logp, ent, sum_z, top1 = recompute_stats(backend, hidden, weight, bias, targets, transform, plan,
                                                   want_entropy, "sum_z" in extra_stats, shard, lora)
    entropy = ent if want_entropy else None
    if before_loss is not None:
        before_loss(logp.detach(), None if entropy is None else entropy.detach())
    extra = {k: v for k, v in (("lse", lse), ("sum_z", sum_z), ("is_top1", top1)) if k in extra_stats}
    loss, extra = objective(slice(0, hidden.shape[0]), logp, entropy, **extra)
    return loss, logp.detach(), None if entropy is None else entropy.detach(), [extra]
