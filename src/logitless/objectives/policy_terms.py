"""Per-token policy-gradient terms on flat token tensors: the math of TRL's
``GRPOTrainer._compute_loss`` (TRL 1.16, ``trl/trainer/grpo_trainer.py``), written once.

Every function here works on the ``[n]`` counted tokens of a chunk (whole segments when the
config needs them) and returns a loss *term*: the loss is the sum of the terms of all
chunks, because every normalizer is a precomputed per-token weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops import ZeroRows
from .config import CLIPPED, PolicyConfig
from .layout import TokenLayout

LOG_1E8 = math.log(1e-8)


@dataclass
class PolicyTokens:
    """Flat per-token inputs of a policy loss, all ``[n]`` over the counted tokens.

    ``loss_weight`` carries the mask value and the loss type's normalizer, so that
    ``loss = Σ L · loss_weight``; ``bonus_weight`` the same for the entropy bonus.
    """

    layout: TokenLayout
    m: torch.Tensor
    advantages: torch.Tensor
    adv_per_sequence: torch.Tensor | None  # [S] when advantages are per sequence
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    sampling_logp: torch.Tensor | None
    is_ratio: torch.Tensor | None  # sampler correction ρ per token (sequence modes broadcast)
    log_is_ratio_seq: torch.Tensor | None  # [S] Σ clamp(log ρ) for vespo
    loss_weight: torch.Tensor
    bonus_weight: torch.Tensor | None
    entropy_mask: torch.Tensor | None = None  # [n] bool, set after the quantile is known
    zero_rows: ZeroRows | None = None  # the tokens whose gradient is exactly zero (no KL, no bonus)
    config: PolicyConfig | None = None  # the call's (read by LazyTokens.loss_term)


@dataclass
class LazyTokens:
    """A call's :class:`PolicyTokens`, built on first use: the first chunk's objective, so that
    the host prepares them while the first statistics GEMM runs."""

    build: Callable[[], PolicyTokens]
    _tokens: PolicyTokens | None = None

    def get(self) -> PolicyTokens:
        if self._tokens is None:
            self._tokens = self.build()
        return self._tokens

    def loss_term(self, sl: slice, stats) -> tuple[torch.Tensor, None]:
        """The pass's chunk objective (``ops.ChunkObjective``): the loss term of the tokens ``sl``
        from their statistics (a ``ChunkStats``: ``logp``, ``entropy``), without metric sums."""
        tok = self.get()
        return chunk_terms(tok.config, tok, sl, stats.logp, stats.entropy, metrics=False)


def vespo_phi(cfg: PolicyConfig, seq_log_ratio: torch.Tensor, adv_seq: torch.Tensor) -> torch.Tensor:
    """VESPO gamma weight ``φ = exp(λ + k·log w − λ·w)`` of the clamped sequence log-ratio
    (``GRPOTrainer.get_gamma_weights``), ``[S]``."""
    log_w = seq_log_ratio.clamp(LOG_1E8, 20.0)
    w = torch.exp(log_w)
    nonneg = adv_seq >= 0
    k = torch.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def chunk_terms(cfg: PolicyConfig, tok: PolicyTokens, sl: slice, logp: torch.Tensor,
                entropy: torch.Tensor | None, *, metrics: bool = True) -> tuple[torch.Tensor, dict | None]:
    """Loss term of the tokens ``sl`` and (``metrics``) their metric partial sums (per
    segment, ``[S]``); ``None`` instead of the sums without ``metrics``.

    ``logp``/``entropy`` are the chunk's statistics (``[len(sl)]``, differentiable).
    """
    lay = tok.layout
    seg = lay.seg[sl]
    m = tok.m[sl]
    adv = tok.advantages[sl]
    old = logp.detach() if tok.old_logp is None else tok.old_logp[sl]
    log_ratio = logp - old
    seg_len = lay.seg_len.clamp(min=1.0)

    def seq_mean(x: torch.Tensor) -> torch.Tensor:  # [S] mean over each whole segment's tokens
        return lay.seq_sum(x * m, seg) / seg_len

    level = cfg.importance_sampling_level
    if level == "token":
        log_w = log_ratio
    elif level == "sequence":
        log_w = seq_mean(log_ratio)[seg]
    else:  # sequence_token (GSPO-token): value of the sequence ratio, gradient of each token
        log_w = logp - logp.detach() + seq_mean(log_ratio.detach())[seg]
    coef_1 = torch.exp(log_w)

    kl = None
    if cfg.beta != 0.0:
        if tok.ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        d = tok.ref_logp[sl] - logp
        kl = torch.exp(d) - d - 1
        if cfg.use_bias_correction_kl:
            kl = kl * coef_1

    lt = cfg.loss_type
    phi = None
    if lt in CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.eps_high)
        if cfg.delta is not None:
            coef_1 = torch.clamp(coef_1, max=cfg.delta)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    elif lt == "cispo":
        per_token = -torch.clamp(coef_1, max=cfg.eps_high).detach() * adv * logp
    elif lt == "sapo":
        tau = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg).to(coef_1.dtype)
        per_token = -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv
    elif lt == "vespo":
        vespo_s = lay.seq_sum(log_ratio.detach().clamp(-20.0, 20.0) * m, seg)
        if tok.log_is_ratio_seq is not None:
            vespo_s = vespo_s + tok.log_is_ratio_seq
        phi = vespo_phi(cfg, vespo_s[seg], adv)
        per_token = -phi * adv * logp
    else:  # reinforce
        per_token = -adv * logp

    if cfg.off_policy_mask_threshold is not None:
        samp = tok.sampling_logp[sl] if tok.sampling_logp is not None else old
        seq_kl = seq_mean(torch.nan_to_num(samp - logp.detach(), nan=0.0))
        keep = (adv >= 0) | (seq_kl[seg] <= cfg.off_policy_mask_threshold)
        per_token = per_token * keep.to(per_token.dtype)
    emask = None if tok.entropy_mask is None else tok.entropy_mask[sl]
    if emask is not None:
        per_token = per_token * emask.to(per_token.dtype)
    if tok.is_ratio is not None and lt != "vespo":
        per_token = per_token * tok.is_ratio[sl]
    if kl is not None:
        per_token = per_token + cfg.beta * kl

    # A masked-in token's term is finite whenever TRL's is; zero weights stay exactly zero.
    loss = (per_token * tok.loss_weight[sl]).sum()
    policy_part = loss.detach()  # TRL logs it as `policy_loss` when the entropy bonus is on
    if tok.bonus_weight is not None and entropy is not None:
        bw = tok.bonus_weight[sl] if emask is None else tok.bonus_weight[sl] * emask.to(entropy.dtype)
        loss = loss - cfg.entropy_coef * (entropy * bw).sum()
    if not metrics:
        return loss, None

    sums: dict[str, torch.Tensor] = {"policy": policy_part}
    with torch.no_grad():
        if kl is not None:
            sums["kl"] = lay.seg_sum(kl.detach() * m, seg)
        if entropy is not None:
            sums["entropy"] = lay.seg_sum(entropy.detach() * m, seg)
            if cfg.entropy_coef != 0.0:  # the bonus's tokens: the adaptive controller's window inputs
                m_eff = m if emask is None else m * emask.to(m.dtype)
                sums["bonus_entropy"] = lay.seg_sum(entropy.detach() * m_eff, seg)
                sums["bonus_tokens"] = lay.seg_sum(m_eff, seg)
        if sequence_metrics(cfg, tok):
            # One value per sequence (TRL's [B, 1] tensors): rebuilt in finalize from the segment sums.
            sums["log_ratio"] = lay.seg_sum(log_ratio.detach() * m, seg)
        else:
            c1 = coef_1.detach()
            if lt in CLIPPED:
                sums["low"] = lay.seg_sum(((c1 < 1 - cfg.epsilon) & (adv < 0)).to(m.dtype) * m, seg)
                sums["high"] = lay.seg_sum(((c1 > 1 + cfg.eps_high) & (adv > 0)).to(m.dtype) * m, seg)
            elif lt == "cispo":
                sums["cispo"] = lay.seg_sum(((c1 > cfg.eps_high) & (adv > 0)).to(m.dtype) * m, seg)
        if lt == "vespo":
            if tok.adv_per_sequence is not None:
                sums["vespo_s"] = lay.seg_sum(log_ratio.detach().clamp(-20.0, 20.0) * m, seg)
            else:
                sums["phi"] = lay.seg_sum(phi.detach() * m, seg)
    return loss, sums


def sequence_metrics(cfg: PolicyConfig, tok: PolicyTokens) -> bool:
    """Whether TRL's clip metrics are over sequences (its ratio and advantages are ``[B, 1]``)."""
    return cfg.importance_sampling_level == "sequence" and tok.adv_per_sequence is not None


def metric_names(cfg: PolicyConfig, sampler: bool) -> tuple[str, ...]:
    """The keys of :func:`logitless.policy_loss`'s metrics under ``cfg``, in their order (the
    compiled path declares them before the pass runs); ``sampler``: ``sampling_logp`` given."""
    names = ["kl"] if cfg.beta != 0.0 else []
    names.append("entropy")
    clipped = cfg.loss_type in CLIPPED
    if clipped:
        names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    elif cfg.loss_type == "cispo":
        names.append("cispo_clip_ratio")
    if cfg.loss_type == "vespo":
        names.append("vespo/phi_seq_mean")
    if cfg.entropy_coef != 0.0:
        names.append("policy_loss")
    if clipped:
        names += ["clip_ratio/low_min", "clip_ratio/high_max"]
    if cfg.entropy_coef != 0.0:
        names += ["entropy_bonus/entropy_sum", "entropy_bonus/token_count"]
    if sampler:
        names += [f"sampling/trainer_sampler_{m}/{s}" for m in ("logp_difference", "ratio_error")
                  for s in ("mean", "max")]
    return tuple(names)
