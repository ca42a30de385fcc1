"""Sampler (e.g. vLLM) importance-sampling correction, as TRL builds it at generation time."""

from __future__ import annotations

import math

import torch

from ..distributed import all_reduce, is_active
from ..ops import ValueChecks, check_device, check_mask
from .config import SamplingCorrectionMode


def sampling_correction(
    old_logp: torch.Tensor,  # [B, T]
    sampling_logp: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    mode: SamplingCorrectionMode = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
    group=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The importance-sampling ratio ``ρ`` between the trained policy's old log-probs and the
    sampler's, and TRL's ``sampling/*`` metrics (TRL 1.16 ``GRPOTrainer._generate_and_score_completions``).

    ``d = (old_logp - sampling_logp) · mask`` (NaN → 0: tokens the sampler could not score);
    ``token_*``: ``ρ = exp(d)`` ``[B, T]``; ``sequence_*``: ``ρ = exp(Σ_t d)`` ``[B, 1]``;
    ``*_truncate``: ``ρ`` clamped to ``[clip_min, clip_max]``; ``*_mask``: ``ρ = 0`` outside
    ``[clip_min, clip_max]`` (a missing bound is ∓inf). Pass ``ρ`` to
    :func:`logitless.policy_loss` as ``importance_sampling_ratio``.

    Args:
        old_logp, sampling_logp: ``[B, T]`` log-probs (nats); ``sampling_logp`` may hold NaN.
        mask: ``[B, T]`` counted tokens (``completion_mask * tool_mask``).
        mode, clip_min, clip_max: TRL's ``vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max``.
        group: process group the metrics are gathered over (TRL: all processes).

    Returns:
        ``(ratio, metrics)``: ``ratio`` ``[B, T]`` or ``[B, 1]``; metrics
        ``sampling/sampling_logp_difference/{mean,max}`` and
        ``sampling/importance_sampling_ratio/{min,mean,max}`` (means of per-process values, as TRL),
        and ``sampling/importance_sampling_ratio/beyond_clip_fraction``: the fraction of tokens
        (sequences, in ``sequence_*`` modes) whose uncorrected ratio lies outside
        ``[clip_min, clip_max]`` (truncated, or masked to 0).

    Raises:
        ValueError: unknown mode, mismatched shapes or devices, a mask value that is negative or
            not finite (any dtype).
    """
    if mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        raise ValueError(f"unknown sampling correction mode {mode!r}")
    if old_logp.shape != sampling_logp.shape or old_logp.shape != mask.shape or old_logp.dim() != 2:
        raise ValueError(f"old_logp, sampling_logp and mask must share one [B, T] shape, got "
                         f"{tuple(old_logp.shape)}, {tuple(sampling_logp.shape)}, {tuple(mask.shape)}")
    checks = ValueChecks()  # the mask rule of policy_loss's completion_mask, for every dtype
    check_device("sampling_logp", sampling_logp, old_logp.device)
    check_mask(mask, "mask", checks, old_logp.device, binary=False)
    checks.run()
    d = torch.nan_to_num((old_logp - sampling_logp) * mask, nan=0.0)
    sequence = mode.startswith("sequence")
    ratio = torch.exp(d.sum(-1, keepdim=True) if sequence else d)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    beyond = ((ratio < lo) | (ratio > hi)).to(ratio.dtype)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        ratio = ratio.masked_fill(beyond.bool(), 0.0)

    with torch.no_grad():
        keep = mask.bool()
        delta = torch.abs(old_logp - sampling_logp)
        delta = delta[keep & ~torch.isnan(delta)]
        zero = old_logp.new_zeros(())
        flat = ratio.flatten() if sequence else ratio[keep]
        flat_beyond = beyond.flatten() if sequence else beyond[keep]
        world = torch.distributed.get_world_size(group) if is_active(group) else 1
        local = {
            "sampling/sampling_logp_difference/mean": (delta.mean() if delta.numel() else zero, "mean"),
            "sampling/sampling_logp_difference/max": (delta.max() if delta.numel() else zero, "max"),
            "sampling/importance_sampling_ratio/min": (flat.min() if flat.numel() else zero, "min"),
            "sampling/importance_sampling_ratio/mean": (flat.mean() if flat.numel() else zero, "mean"),
            "sampling/importance_sampling_ratio/max": (flat.max() if flat.numel() else zero, "max"),
            "sampling/importance_sampling_ratio/beyond_clip_fraction": (
                flat_beyond.mean() if flat_beyond.numel() else zero, "mean"),
        }
        metrics = {}
        for name, (value, how) in local.items():
            if how == "mean":
                metrics[name] = all_reduce(value, "sum", group) / world
            else:
                metrics[name] = all_reduce(value, how, group)
    return ratio, metrics
