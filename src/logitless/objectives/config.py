"""Options of the policy-gradient objectives, with TRL ``GRPOConfig``'s names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "reinforce", "ppo"]
ImportanceSamplingLevel = Literal["token", "sequence", "sequence_token"]
SamplingCorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "reinforce", "ppo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "ppo")


@dataclass(frozen=True)
class PolicyConfig:
    """Options of :func:`logitless.policy_loss`. Field names and defaults are TRL 1.16
    ``GRPOConfig``'s (``trl/trainer/grpo_config.py``); see ``docs/policy-objectives.md``.

    Attributes:
        loss_type: aggregation / surrogate (``"dapo"`` default, as TRL). ``"reinforce"``: plain
            policy gradient ``-A·logp`` (token mean over the batch); ``"ppo"``: clipped
            surrogate averaged over all counted tokens of the call (per-token mean).
        importance_sampling_level: ``"token"``, ``"sequence"`` (GSPO) or ``"sequence_token"``
            (GSPO-token, TRL experimental).
        epsilon: lower clip ``ε`` (ratio floor ``1-ε``).
        epsilon_high: upper clip ``ε_high`` (``None`` → ``epsilon``); CISPO's ``ε_max``.
        delta: two-sided clipping bound on the un-clipped ratio (INTELLECT-2), or ``None``;
            as in TRL, it applies to the clipped surrogates (grpo, bnpo, dr_grpo, dapo, luspo, ppo)
            and is ignored by the other loss types.
        beta: coefficient of the k3 KL to ``ref_logp``.
        use_bias_correction_kl: multiply the KL by the (un-clamped) ratio (TRL default True).
        sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperatures.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO gamma weight.
        off_policy_mask_threshold: DeepSeek-V3.2 off-policy sequence mask threshold, or ``None``.
        top_entropy_quantile: keep only tokens at or above the ``1 - q`` quantile of the entropies
            (1.0: off; 0.0: only the highest-entropy tokens), TRL's ``get_high_entropy_mask``.
        (The sampler's importance-sampling correction is an input, not an option: build it with
        :func:`logitless.sampling_correction` and pass ``importance_sampling_ratio``.)
        entropy_coef: entropy bonus coefficient (``loss -= entropy_coef · mean entropy``); a
            negative one penalizes entropy (TRL accepts either sign).
        gradient_accumulation_steps: ``G``, TRL's ``current_gradient_accumulation_steps``.
        num_processes: ``P``, data-parallel processes (dapo/cispo/vespo normalizer).
        steps_per_generation: TRL's ``steps_per_generation`` (``None`` → ``G``).
        max_completion_length: dr_grpo's constant (``None`` → padded length ``T``).
        training: train mode (eval divides by neither ``G`` nor ``steps_per_generation``).

    Derived once from the fields above (not arguments):

        eps_high: the upper clip in force (``epsilon_high``, or ``epsilon`` when ``None``).
        needs_whole_sequences: a token's loss depends on other tokens of its sequence.
        needs_global_entropy: the loss needs every token's entropy before it exists (the
            quantile mask).

    Raises:
        ValueError: an unknown choice or an invalid combination, naming it.
    """

    loss_type: LossType = "dapo"
    importance_sampling_level: ImportanceSamplingLevel = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    gradient_accumulation_steps: int = 1
    num_processes: int = 1
    steps_per_generation: int | None = None
    max_completion_length: int | None = None
    training: bool = True
    eps_high: float = field(init=False, repr=False, compare=False)
    needs_whole_sequences: bool = field(init=False, repr=False, compare=False)
    needs_global_entropy: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in ("token", "sequence", "sequence_token"):
            raise ValueError("importance_sampling_level must be 'token', 'sequence' or 'sequence_token', "
                             f"got {self.importance_sampling_level!r}")
        for name in ("epsilon", "beta"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be a finite number, got {self.entropy_coef!r}")
        if self.epsilon_high is not None and not (math.isfinite(self.epsilon_high) and self.epsilon_high >= 0):
            raise ValueError(f"epsilon_high must be a finite number >= 0 or None, got {self.epsilon_high!r}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile!r}")
        for name in ("gradient_accumulation_steps", "num_processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ValueError(f"steps_per_generation must be >= 1, got {self.steps_per_generation!r}")
        if self.delta is not None and not (math.isfinite(self.delta) and self.delta > 0):
            raise ValueError(f"delta must be a finite number > 0 or None, got {self.delta!r}")
        object.__setattr__(self, "eps_high", self.epsilon if self.epsilon_high is None else self.epsilon_high)
        object.__setattr__(self, "needs_whole_sequences", self.importance_sampling_level != "token"
                           or self.off_policy_mask_threshold is not None or self.loss_type == "vespo")
        object.__setattr__(self, "needs_global_entropy", self.top_entropy_quantile < 1.0)
