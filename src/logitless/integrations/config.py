"""The switches of a trainer integration and how each resolves for a given model and config."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

from ..ops import Impl, LogitsPrecision, Mode, PassOptions

logger = logging.getLogger("logitless")


@dataclass(frozen=True)
class LogitlessConfig:
    """What a trainer integration runs through logitless (``None`` = decide automatically).

    Attributes:
        fused_loss: the training loss from hidden states and the head in one vocabulary pass
            (``logitless.policy_loss``). Auto: on when the head is discoverable and the
            trainer's options are all reproduced; else the trainer's own loss.
        fused_logprobs: per-token log-probs/entropies without logits: the rollout's old and
            reference log-probs (``token_logprobs``) and, when the trainer's own loss runs, the
            differentiable log-probs it consumes (``vocab_stats``). Auto: on when the head is
            discoverable; per call, the trainer's own path for inputs logitless does not take
            (multimodal, MoE aux loss).
        allow_unverified: take a model class ``find_head`` has not verified (e.g. BLOOM, or your
            subclass of a verified class) after a check at construction: on a fixed probe batch
            (2 × 8 random tokens, eval mode, no grad) the token log-probs logitless computes from
            the backbone's final hidden states and the head (``get_output_embeddings()``, with the
            scale / soft-cap of the nearest verified base class, else none) must equal the
            log-softmax of the model's own logits to within 16 ulps of its dtype (relative to the
            largest logit). A failed check resolves both switches off with a warning. Not checked:
            behaviour that depends on inputs the probe does not have (``labels``, padding, a
            training-mode-only branch of the forward). Default ``False``: unverified classes run
            the trainer's own path.
        logits_precision: ``"fp32"`` keeps the head's matmul output in fp32 before the softmax
            statistics (which accumulate in fp32 either way); ``"input"`` rounds it to the model
            dtype first, as the plain bf16 path does: the plain path's numbers, half the workspace
            traffic. ``None``: ``LOGITLESS_LOGITS_PRECISION``, else ``"fp32"``
            (:class:`logitless.PassOptions`).
        mode: ``"auto"`` | ``"fused"`` | ``"recompute"`` (see :func:`logitless.policy_loss`).
        impl: ``"auto"`` | ``"torch"`` | ``"triton"`` | ``"flash"`` | ``"gemm"`` (see
            :class:`logitless.PassOptions`).
        chunk_bytes: workspace budget of a vocabulary pass in bytes (``None``:
            ``LOGITLESS_CHUNK_BYTES``, else 1 GiB).
        skip_zero_advantage: GRPO only (``LogitlessGRPOTrainer``), off by default: completions
            that carry no gradient (advantage exactly 0, e.g. every completion of a group whose
            rewards are all equal, or no counted token) are removed from the training forward and
            backward, TRL's normalizers kept, so the loss and every gradient are TRL's own. Needs
            ``fused_loss``, ``beta == 0``, no entropy bonus and ``top_entropy_quantile == 1``
            (else one warning and every completion runs). Metrics averaged over the rows that ran
            change (``docs/trainers.md``, "GRPO: skipping completions without gradient").

    Explicit ``False`` forces the trainer's own path (A/B checks); an explicit ``True`` that
    cannot be honoured warns once, saying why, and runs the trainer's own path.
    """

    fused_loss: bool | None = None
    fused_logprobs: bool | None = None
    allow_unverified: bool = False
    logits_precision: LogitsPrecision | None = None
    mode: Mode = "auto"
    impl: Impl = "auto"
    chunk_bytes: int | None = None
    skip_zero_advantage: bool = False

    def __post_init__(self) -> None:
        for name in ("fused_loss", "fused_logprobs"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"LogitlessConfig.{name} must be True, False or None, got {v!r}")
        if not isinstance(self.skip_zero_advantage, bool):
            raise TypeError(f"LogitlessConfig.skip_zero_advantage must be True or False, got "
                            f"{self.skip_zero_advantage!r}")
        if not isinstance(self.allow_unverified, bool):
            raise TypeError(f"LogitlessConfig.allow_unverified must be True or False, got {self.allow_unverified!r}")
        try:
            _ = self.options
        except ValueError as e:
            raise ValueError(f"LogitlessConfig: {e}") from None

    @property
    def options(self) -> PassOptions:
        """The vocabulary passes' :class:`logitless.PassOptions`."""
        return PassOptions(mode=self.mode, impl=self.impl, chunk_bytes=self.chunk_bytes,
                           logits_precision=self.logits_precision)


@dataclass
class Switches:
    """A :class:`LogitlessConfig` resolved for one trainer: what runs (``options``: how the
    passes run; ``backend``: the backend ``options.impl`` resolves to for the model's device
    and training dtype, e.g. ``"torch"`` on a CPU), and why not where off."""

    config: LogitlessConfig
    fused_loss: bool
    fused_logprobs: bool
    options: PassOptions
    why_not: dict[str, str] = field(default_factory=dict)
    backend: str | None = None
    _warned: set[str] = field(default_factory=set, repr=False)

    @property
    def active(self) -> bool:
        """Whether any logitless pass runs in this trainer (else it is the trainer's own code)."""
        return self.fused_loss or self.fused_logprobs

    def warn_if_inactive(self, trainer: str, switches: tuple[str, ...] = ("fused_loss", "fused_logprobs")) -> None:
        """One warning when nothing runs through logitless, unless each of ``switches`` (those
        that apply to the trainer) was set to ``False`` on purpose."""
        if self.active or all(self.why_not.get(k) == "set to False" for k in switches):
            return
        reasons = "; ".join(dict.fromkeys(self.why_not[k] for k in switches if self.why_not[k] != "set to False"))
        warnings.warn(f"logitless: {trainer} runs the trainer's own code throughout, no logitless pass ({reasons}). "
                      "trainer.logitless.why_not has the details; LogitlessConfig(allow_unverified=True) takes a "
                      "model class logitless has not verified, after a check (docs/trainers.md)",
                      UserWarning, stacklevel=5)  # the caller of the drop-in's __init__ / patch_*

    @classmethod
    def resolve(cls, config: LogitlessConfig, head_problem: str | None, loss_problems: list[str]) -> Switches:
        """Resolve ``config`` given why the head cannot be used (``None``: it can) and which
        trainer options the fused loss does not reproduce; warns for explicit ``True`` switches
        that resolve off."""
        why: dict[str, str] = {}
        if head_problem is not None:
            why["fused_logprobs"] = why["fused_loss"] = head_problem
        elif loss_problems:
            why["fused_loss"] = "not reproduced yet: " + "; ".join(loss_problems)
        for name in ("fused_loss", "fused_logprobs"):
            if getattr(config, name) is False:
                why[name] = "set to False"
        out = cls(config=config, fused_loss="fused_loss" not in why, fused_logprobs="fused_logprobs" not in why,
                  options=config.options, why_not=why)
        for name in ("fused_loss", "fused_logprobs"):
            if getattr(config, name) is True and name in why:
                out.warn_once(name, why[name])
            elif getattr(config, name) is None and name in why:
                logger.info("logitless: %s resolved off (%s); the trainer's own path runs", name, why[name])
        if config.logits_precision is not None and not (out.fused_loss or out.fused_logprobs):
            out.warn_once("logits_precision", "no logitless pass runs (fused_loss and fused_logprobs are off)")
        return out

    def warn_once(self, switch: str, reason: str) -> None:
        """One warning per switch and reason for this trainer."""
        key = f"{switch}: {reason}"
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"logitless: {switch}=True cannot be honoured ({reason}); running the trainer's own path",
                          UserWarning, stacklevel=3)
