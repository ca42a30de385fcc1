"""The plain path, written out: TRL's GRPO objective on per-token log-probs, and the
materialized-logits heads the competitor rows build on.

``grpo_from_logp`` is TRL 1.16 ``GRPOTrainer._compute_loss`` for the benchmark's setting
(``loss_type="dapo"``, token-level importance sampling, k3 KL to the reference with the bias
correction, ``num_items_in_batch`` = the counted tokens), so every row that only produces
log-probs (TRL's chunked head, plain PyTorch, ``torch.compile``) finishes with the same math.
``dpo_sigmoid_loss`` is likewise TRL 1.16 ``DPOTrainer._compute_loss`` for ``loss_type="sigmoid"``,
``kto_loss_from_logps`` ``KTOTrainer._compute_loss`` for ``loss_type="kto"`` and
``simpo_loss_from_logps`` ``CPOTrainer.cpo_loss`` for ``loss_type="simpo"`` (``cpo_alpha=0``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..objectives import PolicyConfig
from .cases import Inputs

# The objective every GRPO row computes.
GRPO_CONFIG = PolicyConfig(loss_type="dapo", beta=0.04)
# DPO's beta (TRL's DPOConfig default); the loss is sigmoid, mean over pairs.
DPO_BETA = 0.1
# KTO's beta (TRL's KTOConfig default); loss_type "kto", weights 1, mean over sequences.
KTO_BETA = 0.1
# SimPO's beta and target reward margin (the SimPO paper's typical values, as logitless.simpo_loss).
SIMPO_BETA = 2.0
SIMPO_GAMMA = 0.5


def grpo_from_logp(logp: torch.Tensor, entropy: torch.Tensor | None, mask: torch.Tensor, advantages: torch.Tensor,
                   old_logp: torch.Tensor, ref_logp: torch.Tensor,
                   cfg: PolicyConfig = GRPO_CONFIG) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's dapo loss and logged metrics from ``logp [B, T]`` (fp32, differentiable).

    Args:
        logp: ``[B, T]`` log-probs of the completion tokens.
        entropy: ``[B, T]`` entropies for the metric (detached), or ``None``.
        mask: ``[B, T]`` completion mask; advantages ``[B]``; old/ref log-probs ``[B, T]``.

    Returns:
        ``(loss, metrics)`` with metrics ``kl``, ``entropy``, ``clip_ratio/region_mean`` (0-dim).
    """
    m = mask.to(logp.dtype)
    adv = advantages[:, None]
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.eps_high)
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    if cfg.use_bias_correction_kl:
        kl = kl * coef_1
    per_token = -torch.min(coef_1 * adv, coef_2 * adv) + cfg.beta * kl
    total = m.sum().clamp(min=1.0)
    loss = (per_token * m).sum() / total
    with torch.no_grad():
        c1 = coef_1.detach()
        clipped = ((c1 < 1 - cfg.epsilon) & (adv < 0)) | ((c1 > 1 + cfg.eps_high) & (adv > 0))
        metrics = {"kl": (kl.detach() * m).sum() / total, "clip_ratio/region_mean": (clipped * m).sum() / total}
        if entropy is not None:
            metrics["entropy"] = (entropy.detach() * m).sum() / total
    return loss, metrics


def plain_logp_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialized head: bf16 logits ``[N, V]`` → fp32 ``log_softmax`` → target log-prob
    (differentiable) and entropy (detached), both ``[N]``."""
    logits = hidden @ weight.t()  # [N, V] in the input dtype
    logsm = torch.log_softmax(logits.float(), dim=-1)
    logp = logsm.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def plain_grpo(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
               advantages: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
               cfg: PolicyConfig = GRPO_CONFIG) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain-path GRPO from ``hidden [B, T, H]`` (tensor arguments, and a config fixed per
    compiled function, so it compiles cleanly)."""
    b, t, h = hidden.shape
    logp, entropy = plain_logp_entropy(hidden.reshape(-1, h), weight, targets.reshape(-1))
    return grpo_from_logp(logp.view(b, t), entropy.view(b, t), mask, advantages, old_logp, ref_logp, cfg)


def grpo_args(x: Inputs) -> tuple[torch.Tensor, ...]:
    """The non-head arguments of :func:`plain_grpo` from a case's inputs."""
    return x.targets, x.mask, x.advantages, x.old_logp, x.ref_logp


def plain_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain-path cross-entropy (token mean) from ``hidden [N, H]``: bf16 logits, fp32 loss."""
    logits = hidden @ weight.t()
    return torch.nn.functional.cross_entropy(logits.float(), targets)


# ---------------------------------------------------------------- DPO


def dpo_sigmoid_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                     ref_rejected_logps: torch.Tensor, beta: float = DPO_BETA) -> torch.Tensor:
    """TRL's DPO ``sigmoid`` loss from per-sequence log-prob sums (``[B]`` each), mean over pairs.

    Transcribed from TRL 1.16 ``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss``
    (the loss is inline there, not a reusable function) for ``loss_type=["sigmoid"]``,
    ``f_divergence_type="reverse_kl"``, ``loss_weights=[1.0]``, no ``ld_alpha``, no
    ``use_weighting``; names as TRL's.
    """
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta_score = chosen_logratios - rejected_logratios
    per_sequence_loss = -F.logsigmoid(beta * delta_score)
    return per_sequence_loss.mean()


def plain_dpo(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor) -> torch.Tensor:
    """Plain-path DPO from ``hidden [2B, T, H]`` (chosen rows first): bf16 logits ``[N, V]`` →
    fp32 ``log_softmax`` → gather → masked sum per sequence → :func:`dpo_sigmoid_loss`
    (tensor arguments only, so it compiles cleanly)."""
    b, t, h = hidden.shape
    logits = hidden.reshape(-1, h) @ weight.t()  # [N, V] in the input dtype
    per_token_logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.reshape(-1, 1)).view(b, t)
    logps = (per_token_logps * mask).sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    return dpo_sigmoid_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)


# ---------------------------------------------------------------- KTO


def kto_loss_from_logps(logps: torch.Tensor, label: torch.Tensor, ref_logps: torch.Tensor, kl: torch.Tensor,
                        beta: float = KTO_BETA) -> torch.Tensor:
    """TRL's KTO loss (``loss_type="kto"``, desirable / undesirable weights 1) from per-sequence
    log-prob sums ``[B]``, ``label [B]`` (True = desirable) and the batch's KL estimate (0-dim,
    detached, clamped at 0).

    Transcribed from TRL 1.16 ``trl/trainer/kto_trainer.py``, ``KTOTrainer._compute_loss``; its
    split into chosen and rejected rows (``index_select`` of data-dependent size) is written as a
    ``where`` over the batch, the same mean with static shapes (so it compiles without graph breaks).
    """
    logratios = logps - ref_logps
    chosen_losses = 1 - torch.sigmoid(beta * (logratios - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - logratios))
    return torch.where(label, chosen_losses, rejected_losses).mean()


def plain_kto(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              label: torch.Tensor, ref_logps: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
    """Plain-path KTO from ``hidden [B, T, H]``: bf16 logits ``[N, V]`` → fp32 ``log_softmax`` →
    gather → masked sum per sequence → :func:`kto_loss_from_logps` (tensor arguments only)."""
    return kto_loss_from_logps((_plain_token_logps(hidden, weight, targets) * mask).sum(dim=1), label, ref_logps, kl)


# ---------------------------------------------------------------- SimPO


def simpo_loss_from_logps(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, beta: float = SIMPO_BETA,
                          simpo_gamma: float = SIMPO_GAMMA) -> torch.Tensor:
    """SimPO's loss from per-token **mean** log-probs of the chosen and rejected completions
    (``[B]`` each), mean over pairs: TRL 1.16 ``trl/experimental/cpo/cpo_trainer.py``,
    ``CPOTrainer.cpo_loss`` for ``loss_type="simpo"``, no label smoothing, ``cpo_alpha=0`` (no NLL
    term); names as TRL's."""
    logits = chosen_logps - rejected_logps
    gamma_logratios = simpo_gamma / beta
    logits = logits - gamma_logratios
    return (-F.logsigmoid(beta * logits)).mean()


def plain_simpo(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """Plain-path SimPO from ``hidden [2B, T, H]`` (chosen rows first): bf16 logits ``[N, V]`` →
    fp32 ``log_softmax`` → gather → masked mean per sequence (``CPOTrainer.get_batch_logps`` with
    ``average_log_prob``) → :func:`simpo_loss_from_logps`."""
    logps = (_plain_token_logps(hidden, weight, targets) * mask).sum(dim=1) / mask.sum(dim=1)
    return simpo_loss_from_logps(*logps.chunk(2, dim=0))


def _plain_token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` fp32 log-probs of ``targets`` from bf16 logits ``[N, V]``."""
    b, t, h = hidden.shape
    logits = hidden.reshape(-1, h) @ weight.t()  # [N, V] in the input dtype
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.reshape(-1, 1)).view(b, t)
