"""Preference objectives (DPO, KTO, CPO / SimPO, ORPO) on sequence log-prob sums.

:func:`sequence_logps` runs one vocabulary pass (:func:`logitless.vocab_stats`) over the
chosen and rejected sequences concatenated (``[2B, T]``, chosen first, as TRL's trainers
concatenate them) and returns per-sequence sums; the loss functions are the field's formulas on
those sums, with TRL 1.16's semantics and metric names:

* :func:`dpo_loss`: ``DPOTrainer._compute_loss`` (loss types below, ``f_divergence_type``,
  ``loss_weights``; ``ld_alpha`` and ``use_weighting`` (WPO, whose weights need every token's
  ``log Σ p²``) in :func:`~logitless.dpo_loss_fused` only); not supported: the ``logits/*`` and
  ``mean_token_accuracy`` metrics (need the mean logit and the argmax; the fused pass for the TRL
  drop-in, :func:`~logitless.objectives.preference_fused.dpo_fused_pass`, returns their sums).
* :func:`kto_loss`: ``KTOTrainer._compute_loss`` (``kto``, ``apo_zero_unpaired``).
* :func:`cpo_loss`: ``CPOTrainer.cpo_loss`` + its NLL term (``sigmoid``, ``hinge``, ``ipo``,
  ``simpo``; AlphaPO's ``alpha``); SimPO is ``loss_type="simpo"`` with ``cpo_alpha=0``
  (:func:`simpo_loss`).
* :func:`orpo_loss`: ``ORPOTrainer.odds_ratio_loss`` + its NLL term.

Reference log-prob sums are inputs (from a reference cache, or a no-grad
:func:`logitless.token_logprobs` pass summed per sequence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from ..amp import autocast_head_inputs
from ..compile import graph_break
from ..ops import Head, PassOptions, ValueChecks, check_device, check_mask
from .layout import counted_first_order
from .vocab_stats import vocab_stats

DPOLossType = Literal["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                      "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
DPO_LOSS_TYPES: tuple[str, ...] = DPOLossType.__args__
_F_DIVERGENCE_LOSS_TYPES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
FDivergence = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]


class SequenceLogps(NamedTuple):
    """Per-sequence results of one pass over ``S`` sequences (``[S]`` each, fp32/fp64; log-probs
    and entropies in nats).

    Attributes:
        logps: ``Σ_t logp`` over the completion tokens (differentiable).
        lengths: number of completion tokens.
        nll_sum: ``-Σ_t logp`` over the NLL tokens (differentiable; ``None`` without ``nll_mask``).
        nll_count: number of NLL tokens (``None`` without ``nll_mask``).
        entropy_sum: ``Σ_t entropy`` over the completion tokens (detached; TRL's ``entropy`` metric).
    """

    logps: torch.Tensor
    lengths: torch.Tensor
    nll_sum: torch.Tensor | None
    nll_count: torch.Tensor | None
    entropy_sum: torch.Tensor

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [2B]`` → ``(chosen [B], rejected [B])``."""
        if x.shape[0] % 2:
            raise ValueError(f"expected chosen and rejected sequences concatenated ([2B]), got {x.shape[0]} sequences")
        return x.chunk(2, dim=0)

    @property
    def mean_logps(self) -> torch.Tensor:
        """``logps / lengths`` (TRL's ``average_log_prob=True``)."""
        return self.logps / self.lengths


@graph_break
@autocast_head_inputs
def sequence_logps(
    hidden: torch.Tensor,  # [S, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [S, T]
    completion_mask: torch.Tensor,  # [S, T]
    *,
    nll_mask: torch.Tensor | None = None,  # [S, T]
    options: PassOptions | None = None,
) -> SequenceLogps:
    """Per-sequence log-prob sums of ``targets`` under the head, from one vocabulary pass.

    ``hidden[s, t]`` must be the hidden state that predicts ``targets[s, t]`` (the caller shifts:
    ``hidden[:, :-1]`` with ``input_ids[:, 1:]``). Only tokens of ``completion_mask`` or
    ``nll_mask`` reach the pass (one pass for both).

    Args:
        hidden: ``[S, T, H]``; for preference losses ``S = 2B``, chosen rows first.
        head: the :class:`logitless.Head` or a bare weight (see :func:`logitless.vocab_stats`).
        targets: integer ``[S, T]`` token ids (TRL's ``labels``), each in ``[0, V)`` where a mask
            counts it (values at positions of neither mask are ignored).
        completion_mask: ``[S, T]`` tokens whose log-probs are summed.
        nll_mask: ``[S, T]`` tokens of an NLL term that differ from the completion tokens
            (ORPO's NLL covers prompt and response); ``None``: no separate NLL sums.
        options: :class:`logitless.PassOptions`.

    Returns:
        :class:`SequenceLogps`: ``[S]`` sums in fp32 (fp64 for fp64 inputs), nats.

    Raises:
        TypeError, ValueError: see :func:`logitless.vocab_stats`; masks of another shape or
            device, or holding a value other than 0/1 (bool, integer or floating alike).
    """
    if targets.dim() != 2 or tuple(completion_mask.shape) != tuple(targets.shape):
        raise ValueError(f"targets and completion_mask must both be [S, T], got {tuple(targets.shape)} and "
                         f"{tuple(completion_mask.shape)}")
    if nll_mask is not None and tuple(nll_mask.shape) != tuple(targets.shape):
        raise ValueError(f"nll_mask must be {tuple(targets.shape)}, got {tuple(nll_mask.shape)}")
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    check_device("hidden", hidden, hidden.device)
    check_device("targets", targets, hidden.device)
    # The masks select tokens (a 0.5 would count as 1): 0/1 only, read in one synchronization.
    checks = ValueChecks()
    check_mask(completion_mask, "completion_mask", checks, hidden.device, binary=True)
    if nll_mask is not None:
        check_mask(nll_mask, "nll_mask", checks, hidden.device, binary=True)
    checks.run()
    cm = completion_mask != 0
    used = cm if nll_mask is None else cm | (nll_mask != 0)
    ids = torch.where(used, targets.long(), -100)
    st = vocab_stats(hidden, head, ids, ignore_index=-100, options=options)
    cmf = cm.to(st.logp.dtype)
    nll_sum = nll_count = None
    if nll_mask is not None:
        nm = (nll_mask != 0).to(st.logp.dtype)
        nll_sum, nll_count = -(st.logp * nm).sum(1), nm.sum(1)
    return SequenceLogps(logps=(st.logp * cmf).sum(1), lengths=cmf.sum(1), nll_sum=nll_sum, nll_count=nll_count,
                         entropy_sum=(st.entropy.detach() * cmf).sum(1))


# ---------------------------------------------------------------- DPO


@dataclass(frozen=True)
class DPOLossConfig:
    """TRL ``DPOConfig``'s loss options (same names and defaults).

    Attributes:
        beta: deviation from the reference (``τ`` for IPO).
        loss_type: one or more of :data:`DPO_LOSS_TYPES`, combined with ``loss_weights``.
        loss_weights: per loss type (default 1 each).
        label_smoothing: Robust DPO's flip probability in ``[0, 0.5)``, EXO's ``ε``, AOT's smoothing.
        f_divergence_type: ``reverse_kl`` (standard DPO), ``forward_kl``, ``js_divergence``,
            ``alpha_divergence`` (only with the loss types built on the reward difference).
        f_alpha_divergence_coef: ``α`` of ``alpha_divergence``.
        discopop_tau: DiscoPOP's ``τ``.
        ld_alpha: LD-DPO's ``α`` in ``[0, 1]``: a sequence's score is ``Σ logp`` over its first
            ``min(chosen length, rejected length)`` completion tokens plus ``α ·`` the rest (the
            ``sft`` term stays the plain token mean); ``None``: no weighting. Per-token, so only
            the fused pass (:func:`~logitless.dpo_loss_fused`) takes it, not :func:`dpo_loss`.
        use_weighting: WPO (Zhou et al. 2024, https://huggingface.co/papers/2406.11827, Eq. 2, as
            TRL's ``DPOTrainer._compute_loss``): every loss type's per-pair loss is multiplied by
            ``w_chosen · w_rejected``, ``w = exp(mean over the completion tokens of (logp - log Σ_v p_v²))``,
            detached (no gradient flows through the weights). Per-token, so only the fused pass
            (:func:`~logitless.dpo_loss_fused`) takes it.

    Raises:
        ValueError: an unknown or empty ``loss_type``, ``loss_weights`` of another length, an
            unknown ``f_divergence_type`` or one the loss types do not support,
            ``label_smoothing`` outside what ``robust`` allows, ``ld_alpha`` outside ``[0, 1]``,
            ``use_weighting`` with ``aot``/``aot_unpaired`` (as TRL: their sorts over the batch
            would misalign the per-pair weights) or with ``sft`` (TRL 1.16 multiplies its
            batch-wide token mean, an expanded view, by the weights in place, which torch refuses).
    """

    beta: float = 0.1
    loss_type: Sequence[str] = field(default_factory=lambda: ("sigmoid",))
    loss_weights: Sequence[float] | None = None
    label_smoothing: float = 0.0
    f_divergence_type: FDivergence = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    ld_alpha: float | None = None
    use_weighting: bool = False

    def __post_init__(self) -> None:
        types = (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)
        object.__setattr__(self, "loss_type", types)
        unknown = [t for t in types if t not in DPO_LOSS_TYPES]
        if not types or unknown:
            raise ValueError(f"loss_type must be a non-empty list of {list(DPO_LOSS_TYPES)}, got {list(types)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} entries for {len(types)} loss types")
        if self.f_divergence_type not in FDivergence.__args__:
            raise ValueError(f"f_divergence_type must be one of {list(FDivergence.__args__)}, "
                             f"got {self.f_divergence_type!r}")
        if self.f_divergence_type != "reverse_kl" and not set(types) <= _F_DIVERGENCE_LOSS_TYPES:
            raise ValueError(f"f_divergence_type={self.f_divergence_type!r} supports only loss types "
                             f"{sorted(_F_DIVERGENCE_LOSS_TYPES)}, got {list(types)}")
        if "robust" in types and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"robust needs 0 <= label_smoothing < 0.5, got {self.label_smoothing}")
        if "exo_pair" in types and self.label_smoothing == 0.0:
            raise ValueError("exo_pair needs label_smoothing > 0 (the paper recommends 1e-3)")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must be in [0, 1] (or None), got {self.ld_alpha}")
        if self.use_weighting and {"aot", "aot_unpaired"} & set(types):
            raise ValueError("use_weighting (WPO) is not supported with the aot and aot_unpaired loss types: they sort "
                             "over the batch, which would misalign the per-pair weights")
        if self.use_weighting and "sft" in types:
            raise ValueError("use_weighting (WPO) is not supported with the sft loss type: TRL 1.16 defines no "
                             "weighted sft term (its own DPOTrainer fails on it); drop sft or use_weighting")


def _f_scores(logratios: torch.Tensor, cfg: DPOLossConfig) -> torch.Tensor:
    f = cfg.f_divergence_type
    if f == "reverse_kl":
        return logratios
    if f == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    a = cfg.f_alpha_divergence_coef
    if abs(a - 1.0) < 1e-6:
        return logratios
    t = ((a - 1.0) * logratios).float().clamp(max=80.0)
    return (torch.exp(t) - 1.0).to(logratios.dtype) / (a - 1.0)


def dpo_loss(
    policy: SequenceLogps,  # [2B] chosen then rejected
    ref_chosen_logps: torch.Tensor,  # [B]
    ref_rejected_logps: torch.Tensor,  # [B]
    *,
    config: DPOLossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO-family loss on sequence log-prob sums, as TRL 1.16 ``DPOTrainer._compute_loss``.

    Args:
        policy: :func:`sequence_logps` of chosen + rejected (``[2B]``, chosen first).
        ref_chosen_logps, ref_rejected_logps: ``[B]`` floating reference log-prob sums (nats).
        config: :class:`DPOLossConfig`.

    Returns:
        ``(loss, metrics)``: scalar loss (``Σ_types weight · mean over pairs``; in ``policy``'s
        dtype) and TRL's
        metrics: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
        ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (means over pairs of sums),
        ``entropy`` (token mean over all completion tokens).

    Raises:
        ValueError: an odd number of sequences in ``policy``, reference shapes that do not
            match the pairs; ``config.ld_alpha`` or ``config.use_weighting`` set (they weight
            tokens, which sums no longer tell apart: use :func:`~logitless.dpo_loss_fused`).
    """
    cfg = DPOLossConfig() if config is None else config
    if cfg.ld_alpha is not None:
        raise ValueError("dpo_loss takes sequence sums, but ld_alpha weights the tokens past the shorter completion "
                         "of a pair: use dpo_loss_fused (or set ld_alpha=None)")
    if cfg.use_weighting:
        raise ValueError("dpo_loss takes sequence sums, but use_weighting (WPO) needs every token's log Σ p²: use "
                         "dpo_loss_fused (or set use_weighting=False)")
    chosen_logps, rejected_logps = policy.halves(policy.logps)
    chosen_len, rejected_len = policy.halves(policy.lengths)
    _check_pairs(chosen_logps, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    ref_chosen_logps = ref_chosen_logps.to(chosen_logps.dtype)
    ref_rejected_logps = ref_rejected_logps.to(chosen_logps.dtype)
    loss = chosen_logps.new_zeros(())
    for per, loss_weight in _dpo_pair_losses(chosen_logps, rejected_logps, chosen_len, rejected_len, ref_chosen_logps,
                                             ref_rejected_logps, cfg):
        loss = loss + per.mean() * loss_weight
    beta = cfg.beta
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    metrics = _reward_metrics(beta * chosen_logratios.detach(), beta * rejected_logratios.detach(),
                              chosen_logps, rejected_logps)
    metrics["entropy"] = _entropy_metric(policy)
    return loss, metrics


def _dpo_pair_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_len: torch.Tensor,
                     rejected_len: torch.Tensor, ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
                     cfg: DPOLossConfig, sft_scale: torch.Tensor | None = None) -> list[tuple[torch.Tensor, float]]:
    """``[(per-pair loss [k], weight)]``, one per loss type of ``cfg``: the loss is
    ``Σ weight · mean(per)`` over the batch's pairs. ``sft`` is a token mean over the batch's chosen
    tokens, expanded to every pair; ``sft_scale`` (``B / Σ chosen tokens`` of the whole batch) makes it a
    per-pair term instead, so a subset of the pairs gives its share of the batch's loss."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores, rejected_scores = _f_scores(chosen_logratios, cfg), _f_scores(rejected_logratios, cfg)
    delta_score = chosen_scores - rejected_scores
    beta, ls = cfg.beta, cfg.label_smoothing
    weights = cfg.loss_weights or [1.0] * len(cfg.loss_type)
    out = []
    for loss_type, loss_weight in zip(cfg.loss_type, weights, strict=True):
        if loss_type == "sigmoid":
            per = -F.logsigmoid(beta * delta_score)
        elif loss_type == "hinge":
            per = torch.relu(1 - beta * delta_score)
        elif loss_type == "ipo":
            d = chosen_scores / chosen_len.clamp(min=1.0) - rejected_scores / rejected_len.clamp(min=1.0)
            per = (d - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            x = beta * delta_score
            eps = torch.tensor(ls)  # fp32, as TRL builds it: same rounding of log(1 - ε), log ε
            per = (torch.sigmoid(x) * (F.logsigmoid(x) - torch.log1p(-eps).to(x))
                   + torch.sigmoid(-x) * (F.logsigmoid(-x) - torch.log(eps).to(x)))
        elif loss_type == "nca_pair":
            cr, rr = beta * chosen_logratios, beta * rejected_logratios
            per = -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
        elif loss_type == "robust":
            per = (-(1 - ls) * F.logsigmoid(beta * delta_score) + ls * F.logsigmoid(-beta * delta_score)) / (1 - 2 * ls)
        elif loss_type == "bco_pair":
            per = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        elif loss_type == "sppo_hard":
            per = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                d = (torch.sort(chosen_logps - rejected_logps, dim=0)[0]
                     - torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)[0])
            else:
                d = torch.sort(chosen_logratios, dim=0)[0] - torch.sort(rejected_logratios, dim=0)[0]
            per = -F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls
        elif loss_type == "apo_zero":
            per = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        elif loss_type == "apo_down":
            per = torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * (chosen_logratios
                                                                                    - rejected_logratios))
        elif loss_type == "discopop":
            x = delta_score * beta
            mod = torch.sigmoid(x / cfg.discopop_tau)
            per = -F.logsigmoid(x) * (1 - mod) + torch.exp(-x) * mod
        elif loss_type == "sft":
            if sft_scale is None:
                per = (-chosen_logps.sum() / chosen_len.sum()).expand(chosen_logps.shape[0])
            else:
                per = -chosen_logps * sft_scale
        else:  # sigmoid_norm
            d = chosen_scores / chosen_len.clamp(min=1.0) - rejected_scores / rejected_len.clamp(min=1.0)
            per = -F.logsigmoid(beta * d)
        out.append((per, loss_weight))
    return out


# ---------------------------------------------------------------- KTO


@dataclass(frozen=True)
class KTOLossConfig:
    """TRL ``KTOConfig``'s loss options (same names and defaults).

    Attributes:
        beta: deviation from the reference.
        loss_type: ``"kto"`` or ``"apo_zero_unpaired"``.
        desirable_weight, undesirable_weight: weights of the desirable / undesirable losses.

    Raises:
        ValueError: another ``loss_type``.
    """

    beta: float = 0.1
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_type not in ("kto", "apo_zero_unpaired"):
            raise ValueError(f"loss_type must be 'kto' or 'apo_zero_unpaired', got {self.loss_type!r}")


def kto_loss(
    policy: SequenceLogps,  # [B]
    label: torch.Tensor,  # [B] bool, True = desirable
    ref_logps: torch.Tensor,  # [B]
    kl_logps: torch.Tensor | None = None,  # [B] policy on mismatched (KL) completions, no grad
    ref_kl_logps: torch.Tensor | None = None,  # [B]
    *,
    config: KTOLossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO loss on sequence log-prob sums, as TRL 1.16 ``KTOTrainer._compute_loss``.

    Args:
        policy: :func:`sequence_logps` of the ``B`` completions (unpaired).
        label: ``[B]`` desirable (True) / undesirable (False).
        ref_logps: ``[B]`` floating reference log-prob sums (nats).
        kl_logps, ref_kl_logps: ``[B]`` policy / reference sums (nats) on the mismatched KL completions
            (TRL computes the policy's without gradient: pass
            :func:`logitless.token_logprobs` summed per row); needed by ``kto``, whose KL
            estimate is ``mean(kl_logps - ref_kl_logps)`` clamped at 0.
        config: :class:`KTOLossConfig`.

    Returns:
        ``(loss, metrics)``: ``nanmean`` of the weighted per-sequence losses; metrics ``kl``,
        ``rewards/chosen``, ``logps/chosen`` (if any desirable), ``rewards/rejected``,
        ``logps/rejected`` (if any undesirable), ``rewards/margins`` (if both), ``entropy``.

    Raises:
        ValueError: shapes, or ``kto`` without the KL log-probs.
    """
    cfg = KTOLossConfig() if config is None else config
    logps = policy.logps
    _check_pairs(logps, label=label, ref_logps=ref_logps)
    if cfg.loss_type == "kto":
        if kl_logps is None or ref_kl_logps is None:
            raise ValueError("loss_type='kto' needs kl_logps and ref_kl_logps (the KL completions' sums)")
        kl = (kl_logps.detach().to(logps.dtype) - ref_kl_logps.to(logps.dtype)).mean().detach().clamp(min=0)
    else:
        kl = logps.new_zeros(())
    label = label.to(torch.bool)
    return _kto_terms(policy, label, ref_logps, kl, int(label.sum()), cfg)


def _kto_terms(policy: SequenceLogps, label: torch.Tensor, ref_logps: torch.Tensor, kl: torch.Tensor,
              desirable: int, cfg: KTOLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`kto_loss` given its KL estimate ``kl`` (0-dim) and how many of the ``[B]`` bool
    ``label`` are desirable (a host int: a caller that read it with other values reads nothing
    more here)."""
    logps = policy.logps
    ref_logps = ref_logps.to(logps.dtype)
    # The desirable sequences first, then the others, each in batch order (what logps[label],
    # logps[~label] select), without a host read of the selection.
    order = counted_first_order(label)[0]
    chosen, rejected = order[:desirable], order[desirable:]
    chosen_logps, rejected_logps = logps[chosen], logps[rejected]
    chosen_logratios = chosen_logps - ref_logps[chosen]
    rejected_logratios = rejected_logps - ref_logps[rejected]
    chosen_losses, rejected_losses = _kto_losses(chosen_logratios, rejected_logratios, kl, cfg)
    losses = torch.cat((cfg.desirable_weight * chosen_losses, cfg.undesirable_weight * rejected_losses), 0)
    loss = losses.nanmean()
    chosen_rewards, rejected_rewards = cfg.beta * chosen_logratios.detach(), cfg.beta * rejected_logratios.detach()
    metrics = {"kl": kl}
    n_c, n_r = chosen_logps.shape[0], rejected_logps.shape[0]
    if n_c:
        metrics["rewards/chosen"] = chosen_rewards.nansum() / n_c
        metrics["logps/chosen"] = chosen_logps.detach().nansum() / n_c
    if n_r:
        metrics["rewards/rejected"] = rejected_rewards.nansum() / n_r
        metrics["logps/rejected"] = rejected_logps.detach().nansum() / n_r
    if n_c and n_r:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    metrics["entropy"] = _entropy_metric(policy)
    return loss, metrics


def _kto_losses(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, kl: torch.Tensor,
                cfg: KTOLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's per-sequence losses of desirable and undesirable sequences (elementwise, unweighted)."""
    if cfg.loss_type == "kto":
        return (1 - torch.sigmoid(cfg.beta * (chosen_logratios - kl)),
                1 - torch.sigmoid(cfg.beta * (kl - rejected_logratios)))
    return 1 - torch.sigmoid(cfg.beta * chosen_logratios), torch.sigmoid(cfg.beta * rejected_logratios)


# ---------------------------------------------------------------- CPO / SimPO


@dataclass(frozen=True)
class CPOLossConfig:
    """TRL ``CPOConfig``'s loss options (same names and defaults). ``loss_type="simpo"`` with
    ``cpo_alpha=0`` is SimPO; ``alpha != 0`` is AlphaPO's reward.

    Attributes:
        beta: temperature of the preference loss.
        label_smoothing: the conservative (robust) loss's flip probability.
        loss_type: ``"sigmoid"``, ``"hinge"``, ``"ipo"`` or ``"simpo"``.
        cpo_alpha: weight of the chosen sequences' NLL term.
        simpo_gamma: SimPO's target reward margin ``γ``.
        alpha: AlphaPO's reward exponent (0: CPO/SimPO's log-prob reward).

    Raises:
        ValueError: another ``loss_type``.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: Literal["sigmoid", "hinge", "ipo", "simpo"] = "sigmoid"
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_type not in ("sigmoid", "hinge", "ipo", "simpo"):
            raise ValueError(f"loss_type must be 'sigmoid', 'hinge', 'ipo' or 'simpo', got {self.loss_type!r}")


def cpo_loss(policy: SequenceLogps, *,
             config: CPOLossConfig | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CPO / SimPO loss, as TRL 1.16 ``CPOTrainer.get_batch_loss_metrics``: ``losses.mean() +
    cpo_alpha · NLL`` with the NLL the token mean of the chosen sequences' ``-logp``.

    The sequence score is the log-prob **sum**, or the **mean** per token for ``ipo`` and
    ``simpo`` (TRL's ``average_log_prob``). The NLL tokens are ``policy.nll_*`` when
    :func:`sequence_logps` got an ``nll_mask``, else the completion tokens (TRL's CPO labels
    mask the prompt, so they are the same).

    Args:
        policy: :func:`sequence_logps` of chosen + rejected (``[2B]``, chosen first).
        config: :class:`CPOLossConfig`.

    Returns:
        ``(loss, metrics)``: a scalar loss in ``policy``'s dtype and 0-dim metrics, TRL's
        ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
        ``logps/chosen``, ``logps/rejected`` (nats), ``nll_loss``, plus ``entropy``.

    Raises:
        ValueError: an odd number of sequences in ``policy``; a bad ``config``
            (:class:`CPOLossConfig`).
    """
    cfg = CPOLossConfig() if config is None else config
    losses, (chosen, rejected), (chosen_r, rejected_r) = _cpo_pair_losses(policy, cfg)
    beta = cfg.beta
    nll = _chosen_nll(policy) if cfg.cpo_alpha != 0 else losses.new_zeros(())
    loss = losses.mean() + cfg.cpo_alpha * nll
    metrics = _reward_metrics(beta * chosen_r.detach(), beta * rejected_r.detach(), chosen, rejected)
    metrics["nll_loss"] = nll.detach()
    metrics["entropy"] = _entropy_metric(policy)
    return loss, metrics


_Halves = tuple[torch.Tensor, torch.Tensor]


def _cpo_pair_losses(policy: SequenceLogps, cfg: CPOLossConfig) -> tuple[torch.Tensor, _Halves, _Halves]:
    """CPO's per-pair losses ``[k]`` (before the mean and the NLL term), the sequence scores
    ``(chosen, rejected)`` and the rewards' bases ``(chosen, rejected)`` (AlphaPO's transform)."""
    scores = policy.mean_logps if cfg.loss_type in ("ipo", "simpo") else policy.logps
    chosen, rejected = policy.halves(scores)
    if cfg.alpha != 0.0:
        chosen_r = (1 - torch.exp(chosen).pow(-cfg.alpha)) / cfg.alpha
        rejected_r = (1 - torch.exp(rejected).pow(-cfg.alpha)) / cfg.alpha
        logits = chosen_r - rejected_r
    else:
        chosen_r, rejected_r = chosen, rejected
        logits = chosen - rejected
    beta, ls = cfg.beta, cfg.label_smoothing
    if cfg.loss_type in ("simpo", "sigmoid"):
        if cfg.loss_type == "simpo":
            logits = logits - cfg.simpo_gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    elif cfg.loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:  # ipo
        losses = (logits - 1 / (2 * beta)) ** 2
    return losses, (chosen, rejected), (chosen_r, rejected_r)


def simpo_loss(policy: SequenceLogps, *, beta: float = 2.0, simpo_gamma: float = 0.5,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO: :func:`cpo_loss` with ``loss_type="simpo"`` and ``cpo_alpha=0`` (TRL's recipe;
    ``beta=2.0`` is the SimPO paper's typical value, TRL's CPO default is 0.1).

    Args:
        policy: :func:`sequence_logps` of chosen + rejected (``[2B]``, chosen first).
        beta, simpo_gamma, label_smoothing: as :class:`CPOLossConfig`.

    Returns:
        ``(loss, metrics)`` as :func:`cpo_loss`.

    Raises:
        ValueError: as :func:`cpo_loss`.
    """
    return cpo_loss(policy, config=CPOLossConfig(beta=beta, simpo_gamma=simpo_gamma, label_smoothing=label_smoothing,
                                                 loss_type="simpo", cpo_alpha=0.0))


# ---------------------------------------------------------------- ORPO


def orpo_loss(policy: SequenceLogps, *, beta: float = 0.1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO loss, as TRL 1.16 ``ORPOTrainer.get_batch_loss_metrics``: ``NLL - mean(β log σ(log odds))``
    with per-token **mean** log-probs and the NLL the token mean of the chosen sequences' ``-logp``
    over prompt **and** response (give :func:`sequence_logps` ``nll_mask`` = the chosen rows'
    attention mask shifted, zeros for rejected rows; without it, the completion tokens).

    Args:
        policy: :func:`sequence_logps` of chosen + rejected (``[2B]``, chosen first).
        beta: weight ``β`` of the odds-ratio term.

    Raises:
        ValueError: an odd number of sequences in ``policy``.

    Returns:
        ``(loss, metrics)``: TRL's ``rewards/*``, ``logps/*``, ``nll_loss``, ``log_odds_ratio``
        (TRL's name for ``mean(log σ(log odds))``), ``log_odds_chosen`` (``mean(log odds)``),
        plus ``entropy``.
    """
    chosen, rejected, log_odds, ratio = _orpo_log_odds(policy)
    nll = _chosen_nll(policy)
    loss = nll - (beta * ratio).mean()
    metrics = _reward_metrics(beta * chosen.detach(), beta * rejected.detach(), chosen, rejected)
    metrics.update(nll_loss=nll.detach(), log_odds_ratio=ratio.detach().mean(),
                   log_odds_chosen=log_odds.detach().mean())
    metrics["entropy"] = _entropy_metric(policy)
    return loss, metrics


# ---------------------------------------------------------------- helpers


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable (TRL's ``log1mexp``)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _orpo_log_odds(policy: SequenceLogps) -> tuple[torch.Tensor, ...]:
    """ORPO's per-pair ``(chosen, rejected)`` mean log-probs, log odds ratio and ``log σ`` of it ``[k]``."""
    chosen, rejected = policy.halves(policy.mean_logps)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return chosen, rejected, log_odds, F.logsigmoid(log_odds)


def _chosen_nll_parts(policy: SequenceLogps) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ -logp, token count)`` per chosen sequence ``[k]`` over its NLL tokens (``nll_*`` when
    given, else the completion tokens)."""
    if policy.nll_sum is not None:
        return policy.halves(policy.nll_sum)[0], policy.halves(policy.nll_count)[0]
    return -policy.halves(policy.logps)[0], policy.halves(policy.lengths)[0]


def _chosen_nll(policy: SequenceLogps) -> torch.Tensor:
    """Token mean of ``-logp`` over the chosen sequences' NLL tokens (``nn.CrossEntropyLoss()``)."""
    s, c = _chosen_nll_parts(policy)
    return s.sum() / c.sum()


def _reward_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict[str, torch.Tensor]:
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }


def _entropy_metric(policy: SequenceLogps) -> torch.Tensor:
    # A batch without tokens has entropy_sum 0: clamping its count reads nothing on the host.
    return policy.entropy_sum.sum() / policy.lengths.sum().clamp(min=1)


def _check_pairs(ref: torch.Tensor, **named: torch.Tensor) -> None:
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(ref.shape):
            raise ValueError(f"{name} must be a tensor of shape {tuple(ref.shape)}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
