"""Preference losses in one fused vocabulary pass (3 GEMMs of work instead of 4).

:func:`sequence_logps` followed by :func:`~logitless.dpo_loss` runs the pass in recompute mode:
the loss needs every sequence's sum first, so the backward recomputes the logits. But a pair's
loss depends only on that pair's tokens (a KTO sequence's only on its own, given the batch's
KL estimate, which is an input). So the counted tokens are laid out pair by pair (chosen, then
rejected, then the next pair), the engine's chunks end only at pair ends, and each chunk's
objective sums its own pairs' log-probs (``index_add`` over the chunk's sequences) and applies
the existing per-pair formula to them, scaled by ``1 / B`` so that the chunks' terms add up to
the batch mean: every token's gradient is known at the end of its chunk's forward, and the
engine's fused mode runs the gradient GEMMs on the logits it still holds.

* A pair longer than a chunk becomes a chunk of its own (``ChunkPlan.chunks``); its vocabulary
  blocks shrink to stay within the workspace budget (``ChunkPlan.fit``), so its logits are not
  kept and its gradient recomputes them: 4 GEMMs for that chunk only, as recompute mode.
* Loss types that couple the pairs of a batch (DPO's ``aot`` and ``aot_unpaired`` sort over the
  batch) cannot be split into per-chunk terms: :func:`dpo_loss_fused` runs the same objective in
  recompute mode (one chunk of every pair, the backward recomputes the logits), with the same results.
* WPO (``DPOLossConfig.use_weighting``): a pair's weight ``w_chosen · w_rejected`` is detached and
  depends on that pair's tokens only (each ``w = exp(mean(logp - log Σ p²))`` over a completion;
  the pass computes ``log Σ p²`` beside the other statistics), so it stays a per-pair factor of the
  chunk's terms.
* The metrics are taken once after the pass from every token's detached statistics, by the
  two-call path's own code, so they are those of :func:`~logitless.dpo_loss` & co.
* :func:`dpo_fused_pass`, :func:`kto_fused_pass`, :func:`cpo_fused_pass` and :func:`orpo_fused_pass`
  are the same passes for a caller that logs its own metrics (the TRL drop-ins): every sequence's sums (DPO, KTO: and
  the :class:`TokenSums` of the mean logit and the top-1 hits), instead of the metrics.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..amp import autocast_head_inputs
from ..compile import graph_break
from ..ops import (
    ChunkStats,
    Head,
    ObjectiveSpec,
    PassOptions,
    Started,
    StatRequest,
    ValueChecks,
    as_head,
    as_options,
    check_device,
    check_head_inputs,
    check_mask,
    run_objective,
    start_pass,
    stat_dtype_for,
)
from .layout import counted_first_order
from .preference import (
    CPOLossConfig,
    DPOLossConfig,
    KTOLossConfig,
    SequenceLogps,
    _chosen_nll_parts,
    _cpo_pair_losses,
    _dpo_pair_losses,
    _kto_losses,
    _kto_terms,
    _orpo_log_odds,
    cpo_loss,
    dpo_loss,
    orpo_loss,
)

# DPO loss types whose loss is not a mean of per-pair terms: they sort over the batch.
BATCH_COUPLED_DPO_LOSS_TYPES = frozenset({"aot", "aot_unpaired"})


@dataclass(frozen=True)
class _Units:
    """The counted tokens of ``S`` sequences grouped into units of ``size`` sequences (a pair:
    chosen then rejected; or one sequence), laid out unit by unit for the pass.

    Attributes:
        order: ``[S]`` the caller's sequence index at each position of the pass's sequence order.
        seq: ``[n]`` each token's sequence position in the pass's order (non-decreasing).
        completion: ``[n]`` 1 for completion tokens, 0 for NLL-only ones (statistics dtype).
        score: ``[n]`` each token's weight in its sequence's score ``logps`` (statistics dtype;
            LD-DPO), or ``None``: ``completion``.
        nll: ``[n]`` 1 for NLL tokens (statistics dtype), or ``None`` without an ``nll_mask``.
        lengths, nll_count: ``[S]`` completion / NLL tokens per sequence, in the pass's order.
        ends: token count at each unit's end (host ints, non-decreasing).
        size: sequences per unit.
        desirable: KTO's count of desirable sequences (a host int read with the value checks), or
            ``None``.
        started: the pass's first rows' statistics GEMM (:func:`~logitless.ops.start_pass`).
    """

    order: torch.Tensor
    seq: torch.Tensor
    completion: torch.Tensor
    nll: torch.Tensor | None
    lengths: torch.Tensor
    nll_count: torch.Tensor | None
    ends: list[int]
    size: int
    score: torch.Tensor | None = None
    desirable: int | None = None
    started: Started | None = None  # the pass's first rows, launched before the checks' read

    @property
    def score_weight(self) -> torch.Tensor:
        """``[n]`` each token's weight in its sequence's ``logps``."""
        return self.completion if self.score is None else self.score

    def span(self, sl: slice) -> tuple[int, int]:
        """The units ``[u0, u1)`` a chunk ``sl`` of the pass owns: those ending inside it (and,
        for the first chunk, those without tokens before it); chunks end only at unit ends."""
        lo = 0 if sl.start == 0 else bisect.bisect_right(self.ends, sl.start)
        return lo, bisect.bisect_right(self.ends, sl.stop)

    def part(self, sl: slice, logp: torch.Tensor) -> SequenceLogps:
        """The sums of the units a chunk ``sl`` owns, from its tokens' ``logp``, as a
        :class:`SequenceLogps` of ``[(u1 - u0) · size]`` in the caller's convention (for pairs:
        chosen first), as the two-call path's loss functions take it (``entropy_sum`` is zeros)."""
        u0, u1 = self.span(sl)
        s0, k = u0 * self.size, u1 - u0
        local = self.seq[sl] - s0

        def per_sequence(x: torch.Tensor) -> torch.Tensor:  # pass order -> caller's convention
            return x.view(k, self.size).t().reshape(-1)

        def sums(w: torch.Tensor) -> torch.Tensor:
            return per_sequence(logp.new_zeros(k * self.size).index_add(0, local, logp * w[sl]))

        nll = self.nll is not None
        return SequenceLogps(logps=sums(self.score_weight), lengths=per_sequence(self.lengths[s0:s0 + k * self.size]),
                             nll_sum=-sums(self.nll) if nll else None,
                             nll_count=per_sequence(self.nll_count[s0:s0 + k * self.size]) if nll else None,
                             entropy_sum=logp.new_zeros(k * self.size))

    def wpo_weights(self, sl: slice, logp: torch.Tensor, log_sum_sq: torch.Tensor) -> torch.Tensor:
        """WPO's weight of each sequence of the units a chunk ``sl`` owns, from its tokens' ``logp``
        and ``log Σ_v p_v²`` (detached): ``exp(Σ_t (logp_t - log Σ p²_t) / max(length, 1))`` over the
        completion tokens, ``[(u1 - u0) · size]`` in the caller's convention (TRL's
        ``DPOTrainer._compute_loss``, WPO's Eq. 2)."""
        u0, u1 = self.span(sl)
        s0, k = u0 * self.size, u1 - u0
        aligned = (logp.detach() - log_sum_sq) * self.completion[sl]
        sums = aligned.new_zeros(k * self.size).index_add(0, self.seq[sl] - s0, aligned)
        mean = sums / self.lengths[s0:s0 + k * self.size].clamp(min=1)
        return torch.exp(mean).view(k, self.size).t().reshape(-1)

    def caller_sums(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token ``x [n]`` summed per sequence, in the caller's order ``[S]``."""
        return x.new_zeros(self.order.shape[0]).index_add(0, self.order[self.seq], x)

    def caller_order(self, x: torch.Tensor) -> torch.Tensor:
        """A per-sequence ``[S]`` tensor in the pass's order → the caller's."""
        return torch.empty_like(x).index_copy_(0, self.order, x)


# loss_of_units(u0, u1, the units' sums[, their WPO weights]) -> the chunk's loss term
UnitLoss = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class _Batch:
    """The caller's per-token inputs of a fused preference call."""

    targets: torch.Tensor  # [S, T]
    completion_mask: torch.Tensor  # [S, T]
    nll_mask: torch.Tensor | None = None  # [S, T]


def _check_shaped(name: str, x: object, shape: tuple[int, ...], device: torch.device, where: str = "") -> None:
    """``x`` is a tensor of ``shape`` on ``device``.

    Raises:
        ValueError: naming ``name``: another shape or not a tensor; as :func:`check_device`.
    """
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
        raise ValueError(f"{name} must be a tensor of shape {shape}{where}, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    check_device(name, x, device)


def _want(token_sums: bool = False, weighted: bool = False) -> StatRequest:
    """The statistics of a preference pass (:func:`_run`'s flags); every loss reaches the logits
    through the tokens' log-probs alone (the entropy and logit sums are logged, WPO's weights
    detached)."""
    return StatRequest(entropy=True, sum_z=token_sums, sum_sq=weighted, logp_grad_only=True)


def _prepare(hidden: torch.Tensor, head: Head, batch: _Batch, size: int, per_unit: dict[str, torch.Tensor],
             options: PassOptions, want: StatRequest, label: torch.Tensor | None = None,
             ) -> tuple[_Units, torch.Tensor, torch.Tensor]:
    """Validate the inputs, gather the counted tokens unit by unit: ``(units, hidden rows [n, H],
    token ids [n])``. ``per_unit``: ``[S // size]`` inputs that must be finite (the reference
    log-probs), checked in the same host synchronization as the head's values; ``options`` and
    ``want``: the pass's (its first rows start before and during that synchronization);
    ``label``: KTO's ``[S]`` bool labels (checked by the caller), whose desirable count is read
    with them.

    Raises:
        TypeError, ValueError: as :func:`sequence_logps` (masks of another shape or device, or
            holding a value other than 0/1); a per-unit input of another shape or device, or
            with NaN/inf.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden must be a [S, T, H] tensor, got "
                         f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
    for name, x in (("targets", batch.targets), ("completion_mask", batch.completion_mask),
                    ("nll_mask", batch.nll_mask)):
        if x is not None or name != "nll_mask":
            _check_shaped(name, x, tuple(hidden.shape[:2]), hidden.device, " (hidden's [S, T])")
    # The masks select tokens (a 0.5 would count as 1): 0/1 only, as sequence_logps requires.
    checks = ValueChecks()
    for name, x in (("completion_mask", batch.completion_mask), ("nll_mask", batch.nll_mask)):
        if x is not None:
            check_mask(x, name, checks, hidden.device, binary=True)
    s, t = batch.targets.shape
    if s % size:
        raise ValueError(f"expected chosen and rejected sequences concatenated ([2B, T]), got {s} sequences")
    units = s // size
    for name, x in per_unit.items():
        _check_shaped(name, x, (units,), hidden.device)
    dev = hidden.device
    sdt = stat_dtype_for(hidden.dtype)
    # Pass order: pair i's chosen (row i) then its rejected (row B + i); one sequence a unit otherwise.
    order = torch.arange(s, device=dev).view(size, units).t().reshape(-1)
    cm = batch.completion_mask[order] != 0  # [S, T] in pass order
    nm = None if batch.nll_mask is None else batch.nll_mask[order] != 0
    used = cm if nm is None else cm | nm
    # Every position, the used ones first (a stable partition, in pass order):
    # how many are used comes with the checks' one read, so nothing before it waits for the device.
    every, _ = counted_first_order(used.reshape(-1))
    # Each of those positions in the caller's [S, T], flattened. The first statistics GEMM runs on
    # the first of them while the host builds the checks, and a second on the next ones while it
    # waits for the read (which waits for the first) and prepares the pass.
    at = order[every // max(t, 1)] * t + every % t
    # The hidden rows and ids are checked in the caller's layout, at the positions that count
    # (their shapes here, their values' reductions at the send).
    caller_used = batch.completion_mask != 0
    if batch.nll_mask is not None:
        caller_used = caller_used | (batch.nll_mask != 0)
    check_head_inputs(hidden.reshape(-1, hidden.shape[-1]), head, batch.targets.reshape(-1), ignore_index=None,
                      checks=checks, counted=caller_used.reshape(-1))
    first = start_pass(hidden, batch.targets, at, head, ObjectiveSpec(want), options, options.mode != "recompute")
    ends = torch.cumsum(used.sum(1).view(units, size).sum(1), 0)
    for name, x in per_unit.items():
        checks.add_finite(x, lambda name=name: ValueError(f"{name} contains NaN or inf"))
    counts = () if label is None else (label.sum(),)
    pending = checks.send(None, *ends.unbind(), *counts)  # the one synchronization of the checks
    started = first and start_pass(hidden, batch.targets, at, head, ObjectiveSpec(want), options,
                                   options.mode != "recompute", after=first)
    host = pending.wait()[0]
    desirable = None if label is None else int(host.pop())
    n = int(host[-1]) if units else 0
    pos, flat = every[:n], at[:n]
    seq = pos // max(t, 1)
    complete = pos.shape[0] == s * t and (size == 1 or units == 1)
    h_flat = hidden.reshape(-1, hidden.shape[-1]) if complete else hidden.reshape(-1, hidden.shape[-1])[flat]
    t_flat = batch.targets.reshape(-1)[flat].long()
    return _Units(order=order, seq=seq, completion=cm.reshape(-1)[pos].to(sdt),
                  nll=None if nm is None else nm.reshape(-1)[pos].to(sdt), lengths=cm.sum(1).to(sdt),
                  nll_count=None if nm is None else nm.sum(1).to(sdt), ends=[int(e) for e in host],
                  size=size, desirable=desirable, started=started), h_flat, t_flat


class TokenSums(NamedTuple):
    """Per-sequence sums over the completion tokens of the statistics TRL's trainers log beside
    the loss (``[S]`` each, the caller's order, detached, statistics dtype).

    Attributes:
        mean_logit: ``Σ_t mean_logit_t`` (``mean_logit = Σ_v z_v / V``; TRL's ``logits/*``).
        top1: how many tokens' label has the largest logit, ties counted (TRL's ``is_top1``).
    """

    mean_logit: torch.Tensor
    top1: torch.Tensor


class PreferencePass(NamedTuple):
    """What one fused preference pass returns to a caller that logs its own metrics (a trainer).

    Attributes:
        loss: the scalar loss, differentiable w.r.t. ``hidden`` and the head.
        policy: every sequence's sums (:class:`SequenceLogps`, ``[S]``, the caller's order,
            detached; ``entropy_sum`` included).
        tokens: :class:`TokenSums`.
    """

    loss: torch.Tensor
    policy: SequenceLogps
    tokens: TokenSums


def _run(hidden: torch.Tensor, head: Head, targets: torch.Tensor, units: _Units, loss_of_units: UnitLoss,
         options: PassOptions, token_sums: bool = False, weighted: bool = False) -> PreferencePass:
    """The pass: the loss, every sequence's detached sums in the caller's order and, with
    ``token_sums``, their :class:`TokenSums` (else ``tokens`` is ``None``). With ``weighted``
    the pass also computes ``log Σ p²`` and ``loss_of_units`` takes the units' WPO weights
    (:meth:`_Units.wpo_weights`) as a fourth argument."""

    def objective(sl: slice, stats: ChunkStats):
        extra = (units.wpo_weights(sl, stats.logp, stats.log_sum_sq_probs),) if weighted else ()
        return loss_of_units(*units.span(sl), units.part(sl, stats.logp), *extra), None

    cuts = sorted({e for e in units.ends if e > 0})
    spec = ObjectiveSpec(want=_want(token_sums, weighted), cuts=cuts, started=units.started)
    loss, stats, collected = run_objective(hidden, head, targets, objective, spec, options)
    if not collected:  # no token, so no chunk: every unit's loss is a constant
        empty = loss.new_zeros(0)
        extra = (units.wpo_weights(slice(0, 0), empty, empty),) if weighted else ()
        loss = loss + loss_of_units(0, len(units.ends), units.part(slice(0, 0), empty), *extra)
    nll = units.nll is not None
    policy = SequenceLogps(logps=units.caller_sums(stats.logp * units.score_weight),
                           lengths=units.caller_order(units.lengths),
                           nll_sum=-units.caller_sums(stats.logp * units.nll) if nll else None,
                           nll_count=units.caller_order(units.nll_count) if nll else None,
                           entropy_sum=units.caller_sums(stats.entropy * units.completion))
    tokens = None
    if token_sums:
        tokens = TokenSums(mean_logit=units.caller_sums(stats.sum_z / head.vocab_size() * units.completion),
                           top1=units.caller_sums(stats.is_top1.to(units.completion.dtype) * units.completion))
    return PreferencePass(loss, policy, tokens)


def _ld_dpo_score(units: _Units, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's per-token weight ``[n]`` (TRL's ``DPOTrainer._compute_loss``): 1 for a sequence's
    first ``min(chosen length, rejected length)`` completion tokens, ``ld_alpha`` past them. A pair's
    weights depend on that pair's lengths only, so its loss stays a per-pair term of the pass.
    Every token of ``units`` is a completion token (the DPO pass has no NLL-only tokens)."""
    lengths = units.lengths.long()  # [S], pass order: pair i's chosen at 2i, its rejected at 2i + 1
    start = torch.cumsum(lengths, 0) - lengths
    rank = torch.arange(units.seq.shape[0], device=lengths.device) - start[units.seq] + 1  # 1-based in its sequence
    shared = lengths.view(-1, 2).min(1).values.repeat_interleave(2)  # [S]
    inside = rank <= shared[units.seq]
    return torch.where(inside, units.completion, units.completion * ld_alpha)


def _chosen_tokens(units: _Units) -> torch.Tensor:
    """The batch's chosen NLL tokens (the completion tokens without an ``nll_mask``)."""
    count = units.lengths if units.nll_count is None else units.nll_count
    return count.view(-1, 2)[:, 0].sum()


@graph_break
@autocast_head_inputs
def dpo_loss_fused(
    hidden: torch.Tensor,  # [2B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [2B, T]
    completion_mask: torch.Tensor,  # [2B, T]
    ref_chosen_logps: torch.Tensor,  # [B]
    ref_rejected_logps: torch.Tensor,  # [B]
    *,
    config: DPOLossConfig | None = None,
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO-family loss and TRL's metrics from one fused vocabulary pass (3 GEMMs of work):
    :func:`sequence_logps` + :func:`~logitless.dpo_loss` in one call, with their results.

    Args:
        hidden: ``[2B, T, H]``, chosen sequences first; ``hidden[s, t]`` predicts ``targets[s, t]``.
        head: the :class:`logitless.Head` or a bare ``[V, H]`` weight.
        targets: integer ``[2B, T]`` token ids (TRL's ``labels``), each in ``[0, V)`` at completion
            positions (read there only).
        completion_mask: ``[2B, T]`` tokens whose log-probs are summed.
        ref_chosen_logps, ref_rejected_logps: ``[B]`` reference log-prob sums (nats).
        config: :class:`DPOLossConfig`; ``aot`` / ``aot_unpaired`` (which sort over the batch) run
            the same objective in recompute mode (one chunk of every pair).
        options: :class:`logitless.PassOptions` (``mode="recompute"`` runs the same objective
            after one forward over every token).

    Returns:
        ``(loss, metrics)`` as :func:`~logitless.dpo_loss`; the loss is differentiable w.r.t.
        ``hidden`` and the head's weight, bias and adapter.

    Raises:
        TypeError, ValueError: as :func:`sequence_logps` and :func:`~logitless.dpo_loss`; NaN or
            inf in the reference log-probs.
    """
    cfg = DPOLossConfig() if config is None else config
    refs = (ref_chosen_logps, ref_rejected_logps)
    batch = _Batch(targets, completion_mask)
    loss, policy, _ = _dpo(hidden, as_head(head), batch, refs, cfg, as_options(options), False)
    with torch.no_grad():
        # ld_alpha already weighs policy.logps; dpo_loss (on sums) refuses it, and its loss is not used here.
        # use_weighting weighs the loss only (TRL logs no weight), and needs per-token statistics too.
        _, metrics = dpo_loss(policy, ref_chosen_logps, ref_rejected_logps,
                              config=dataclasses.replace(cfg, ld_alpha=None, use_weighting=False))
    return loss, metrics


@graph_break
@autocast_head_inputs
def dpo_fused_pass(
    hidden: torch.Tensor,  # [2B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [2B, T]
    completion_mask: torch.Tensor,  # [2B, T]
    ref_chosen_logps: torch.Tensor,  # [B]
    ref_rejected_logps: torch.Tensor,  # [B]
    *,
    config: DPOLossConfig | None = None,
    options: PassOptions | None = None,
) -> PreferencePass:
    """:func:`dpo_loss_fused`'s pass for a caller that logs its own metrics (the TRL drop-in):
    the loss, every sequence's sums and the :class:`TokenSums` of TRL's ``logits/*`` and
    ``mean_token_accuracy``, from the same pass (the mean logit costs one more sum per logit).

    Args:
        hidden, head, targets, completion_mask, ref_chosen_logps, ref_rejected_logps, config,
            options: as :func:`dpo_loss_fused`.

    Returns:
        :class:`PreferencePass`.

    Raises:
        TypeError, ValueError: as :func:`dpo_loss_fused`.
    """
    cfg = DPOLossConfig() if config is None else config
    return _dpo(hidden, as_head(head), _Batch(targets, completion_mask), (ref_chosen_logps, ref_rejected_logps), cfg,
                as_options(options), True)


def _dpo(hidden: torch.Tensor, head: Head, batch: _Batch, refs: tuple[torch.Tensor, torch.Tensor],
         cfg: DPOLossConfig, options: PassOptions, token_sums: bool) -> PreferencePass:
    if BATCH_COUPLED_DPO_LOSS_TYPES & set(cfg.loss_type):
        # The loss sorts over the batch: the objective must see every pair at once.
        options = dataclasses.replace(options, mode="recompute")
    ld = cfg.ld_alpha is not None
    plain_sft = ld and "sft" in cfg.loss_type
    cm = batch.completion_mask
    if plain_sft and isinstance(cm, torch.Tensor) and cm.dim() > 0:
        # LD-DPO weights the scores only: the sft term is the plain NLL of the chosen completions.
        chosen = torch.zeros_like(cm)
        chosen[: cm.shape[0] // 2] = cm[: cm.shape[0] // 2]
        batch = dataclasses.replace(batch, nll_mask=chosen)
    units, h_flat, t_flat = _prepare(hidden, head, batch, 2, {"ref_chosen_logps": refs[0],
                                                               "ref_rejected_logps": refs[1]},
                                     options, _want(token_sums, cfg.use_weighting))
    if ld:
        units = dataclasses.replace(units, score=_ld_dpo_score(units, cfg.ld_alpha))
    sdt = stat_dtype_for(hidden.dtype)
    ref_c, ref_r = refs[0].to(sdt), refs[1].to(sdt)
    pairs = ref_c.shape[0]
    sft_scale = pairs / _chosen_tokens(units) if "sft" in cfg.loss_type else None

    def loss_of_pairs(u0: int, u1: int, part: SequenceLogps, wpo: torch.Tensor | None = None) -> torch.Tensor:
        (c, r), (c_len, r_len) = part.halves(part.logps), part.halves(part.lengths)
        terms = _dpo_pair_losses(c, r, c_len, r_len, ref_c[u0:u1], ref_r[u0:u1], cfg, sft_scale)
        if plain_sft:
            nll = _chosen_nll_parts(part)[0]
            terms = [(nll * sft_scale, w) if t == "sft" else (per, w) for t, (per, w) in zip(cfg.loss_type, terms,
                                                                                             strict=True)]
        if wpo is not None:  # (DPOLossConfig refuses it with the batch-wide sft and aot terms)
            chosen_w, rejected_w = part.halves(wpo)
            terms = [(per * (chosen_w * rejected_w), w) for per, w in terms]
        return sum(per.sum() * w for per, w in terms) / pairs

    return _run(h_flat, head, t_flat, units, loss_of_pairs, options, token_sums, cfg.use_weighting)


@graph_break
@autocast_head_inputs
def cpo_loss_fused(
    hidden: torch.Tensor,  # [2B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [2B, T]
    completion_mask: torch.Tensor,  # [2B, T]
    *,
    config: CPOLossConfig | None = None,
    nll_mask: torch.Tensor | None = None,  # [2B, T]
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CPO / SimPO loss and TRL's metrics from one fused vocabulary pass: :func:`sequence_logps`
    + :func:`~logitless.cpo_loss` in one call.

    Args:
        hidden, head, targets, completion_mask, options: as :func:`dpo_loss_fused`.
        config: :class:`CPOLossConfig`.
        nll_mask: ``[2B, T]`` the NLL term's tokens when they differ from the completion tokens
            (as :func:`sequence_logps`); ``None``: the chosen completion tokens (TRL's CPO).

    Returns:
        ``(loss, metrics)`` as :func:`~logitless.cpo_loss`.

    Raises:
        TypeError, ValueError: as :func:`sequence_logps`.
    """
    cfg = CPOLossConfig() if config is None else config
    loss, policy, _ = _cpo(hidden, as_head(head), _Batch(targets, completion_mask, nll_mask), cfg, as_options(options))
    with torch.no_grad():
        _, metrics = cpo_loss(policy, config=cfg)
    return loss, metrics


@graph_break
@autocast_head_inputs
def cpo_fused_pass(
    hidden: torch.Tensor,  # [2B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [2B, T]
    completion_mask: torch.Tensor,  # [2B, T]
    *,
    config: CPOLossConfig | None = None,
    options: PassOptions | None = None,
) -> PreferencePass:
    """:func:`cpo_loss_fused`'s pass for a caller that logs its own metrics (the TRL CPO drop-in):
    the loss and every sequence's sums (the NLL tokens are the chosen completion tokens).

    Args:
        hidden, head, targets, completion_mask, config, options: as :func:`cpo_loss_fused`.

    Returns:
        :class:`PreferencePass` (``tokens`` is ``None``).

    Raises:
        TypeError, ValueError: as :func:`cpo_loss_fused`.
    """
    cfg = CPOLossConfig() if config is None else config
    return _cpo(hidden, as_head(head), _Batch(targets, completion_mask), cfg, as_options(options))


def _cpo(hidden: torch.Tensor, head: Head, batch: _Batch, cfg: CPOLossConfig, options: PassOptions) -> PreferencePass:
    units, h_flat, t_flat = _prepare(hidden, head, batch, 2, {}, options, _want())
    pairs = hidden.shape[0] // 2
    chosen_tokens = _chosen_tokens(units)

    def loss_of_pairs(u0: int, u1: int, part: SequenceLogps) -> torch.Tensor:
        term = _cpo_pair_losses(part, cfg)[0].sum() / pairs
        if cfg.cpo_alpha != 0:  # the token mean of the chosen -logp, a sum over pairs too
            term = term + cfg.cpo_alpha * (_chosen_nll_parts(part)[0].sum() / chosen_tokens)
        return term

    return _run(h_flat, head, t_flat, units, loss_of_pairs, options)


@autocast_head_inputs
def simpo_loss_fused(hidden: torch.Tensor, head: Head | torch.Tensor, targets: torch.Tensor,
                     completion_mask: torch.Tensor, *, beta: float = 2.0, simpo_gamma: float = 0.5,
                     label_smoothing: float = 0.0,
                     options: PassOptions | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO in one fused pass: :func:`cpo_loss_fused` with ``loss_type="simpo"`` and
    ``cpo_alpha=0`` (as :func:`~logitless.simpo_loss`).

    Args:
        hidden, head, targets, completion_mask, options: as :func:`dpo_loss_fused`.
        beta, simpo_gamma, label_smoothing: SimPO's ``β``, target reward margin ``γ`` and
            label smoothing, as :func:`~logitless.simpo_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`~logitless.simpo_loss`.

    Raises:
        TypeError, ValueError: as :func:`cpo_loss_fused`.
    """
    cfg = CPOLossConfig(beta=beta, simpo_gamma=simpo_gamma, label_smoothing=label_smoothing, loss_type="simpo",
                        cpo_alpha=0.0)
    return cpo_loss_fused(hidden, head, targets, completion_mask, config=cfg, options=options)


@graph_break
@autocast_head_inputs
def kto_loss_fused(
    hidden: torch.Tensor,  # [B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [B, T]
    completion_mask: torch.Tensor,  # [B, T]
    label: torch.Tensor,  # [B] bool, True = desirable
    ref_logps: torch.Tensor,  # [B]
    kl_logps: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([B] policy, [B] reference) on KL completions
    *,
    config: KTOLossConfig | None = None,
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO loss and TRL's metrics from one fused vocabulary pass: :func:`sequence_logps` +
    :func:`~logitless.kto_loss` in one call. The unit is one sequence: each chunk holds whole
    sequences, and the batch's KL estimate (an input, detached) couples nothing.

    Args:
        hidden, head, targets, completion_mask, options: as :func:`dpo_loss_fused`, for ``B``
            unpaired completions.
        label: ``[B]`` bool, desirable (True) / undesirable (False).
        ref_logps: ``[B]`` reference log-prob sums (nats).
        kl_logps: ``(kl_logps, ref_kl_logps)``, the policy's (no gradient) and the reference's
            ``[B]`` sums on the mismatched KL completions, as :func:`~logitless.kto_loss` takes
            them; needed by ``kto``.
        config: :class:`KTOLossConfig`.

    Returns:
        ``(loss, metrics)`` as :func:`~logitless.kto_loss` (the loss is its mean over the
        ``B`` sequences: the inputs are checked finite, so TRL's ``nanmean`` is the mean).

    Raises:
        TypeError, ValueError: as :func:`sequence_logps` and :func:`~logitless.kto_loss`; NaN or
            inf in ``ref_logps`` or the KL sums.
    """
    cfg = KTOLossConfig() if config is None else config
    if cfg.loss_type == "kto" and kl_logps is None:
        raise ValueError("loss_type='kto' needs kl_logps=(kl_logps, ref_kl_logps) (the KL completions' sums)")
    named = {} if kl_logps is None else {"kl_logps": kl_logps[0], "ref_kl_logps": kl_logps[1]}
    sdt = stat_dtype_for(hidden.dtype) if isinstance(hidden, torch.Tensor) else torch.float32

    def kl_estimate() -> torch.Tensor | None:  # after _prepare's shape and finiteness checks
        if cfg.loss_type != "kto":
            return None
        return (kl_logps[0].detach().to(sdt) - kl_logps[1].to(sdt)).mean().detach().clamp(min=0)

    (loss, policy, _), desirable = _kto(hidden, as_head(head), _Batch(targets, completion_mask), (label, ref_logps),
                                        kl_estimate, named, cfg, as_options(options), False)
    with torch.no_grad():
        kl = kl_estimate()
        kl = policy.logps.new_zeros(()) if kl is None else kl
        _, metrics = _kto_terms(policy, label.to(torch.bool), ref_logps, kl, desirable, cfg)
    return loss, metrics


@graph_break
@autocast_head_inputs
def kto_fused_pass(
    hidden: torch.Tensor,  # [B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [B, T]
    completion_mask: torch.Tensor,  # [B, T]
    label: torch.Tensor,  # [B] bool, True = desirable
    ref_logps: torch.Tensor,  # [B]
    kl: torch.Tensor | None = None,  # [] the batch's KL estimate, clamped at 0
    *,
    config: KTOLossConfig | None = None,
    options: PassOptions | None = None,
) -> PreferencePass:
    """:func:`kto_loss_fused`'s pass for a caller that logs its own metrics (the TRL drop-in),
    given the batch's KL estimate itself (a trainer may average it over its data-parallel ranks
    first, as TRL's ``KTOTrainer`` does).

    Args:
        hidden, head, targets, completion_mask, label, ref_logps, config, options: as
            :func:`kto_loss_fused`.
        kl: the 0-dim KL estimate ``max(0, mean(kl_logps - ref_kl_logps))`` (nats; detached
            here); used by ``kto`` only, which needs it.

    Returns:
        :class:`PreferencePass` (``loss``: the mean over the ``B`` sequences of the weighted
        losses; ``tokens``: :class:`TokenSums`).

    Raises:
        TypeError, ValueError: as :func:`kto_loss_fused`; ``kto`` without ``kl``, or a ``kl``
            that is not a 0-dim tensor or not finite ("kl contains NaN or inf").
    """
    cfg = KTOLossConfig() if config is None else config
    needed = cfg.loss_type == "kto"
    if needed and (not isinstance(kl, torch.Tensor) or kl.dim() != 0):
        raise ValueError(f"loss_type='kto' needs kl, the batch's KL estimate as a finite 0-dim tensor, got "
                         f"{kl if not isinstance(kl, torch.Tensor) else f'shape {tuple(kl.shape)}'}")
    # Its value is checked with the other inputs' values, in their one host read.
    named = {"kl": kl.detach().expand(ref_logps.shape)} if needed and isinstance(ref_logps, torch.Tensor) else {}
    return _kto(hidden, as_head(head), _Batch(targets, completion_mask), (label, ref_logps),
                lambda: None if kl is None else kl.detach(), named, cfg, as_options(options), True)[0]


def _kto(hidden: torch.Tensor, head: Head, batch: _Batch, labelled: tuple[torch.Tensor, torch.Tensor],
         kl_estimate: Callable[[], torch.Tensor | None], named: dict[str, torch.Tensor], cfg: KTOLossConfig,
         options: PassOptions, token_sums: bool) -> tuple[PreferencePass, int]:
    """KTO's pass and how many sequences are desirable (read with the value checks); ``labelled``
    is ``(label, ref_logps)``, ``named`` more ``[B]`` inputs to check finite in the same
    synchronization."""
    label, ref_logps = labelled
    if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:  # (else _prepare names hidden)
        _check_shaped("label", label, (hidden.shape[0],), hidden.device)
    flags = label.to(torch.bool) if isinstance(label, torch.Tensor) else None
    units, h_flat, t_flat = _prepare(hidden, head, batch, 1, {"ref_logps": ref_logps, **named}, options,
                                     _want(token_sums), flags)
    sdt = stat_dtype_for(hidden.dtype)
    label, ref = label.to(torch.bool), ref_logps.to(sdt)
    kl = kl_estimate() if cfg.loss_type == "kto" else None
    kl = ref.new_zeros(()) if kl is None else kl.to(sdt)
    count = hidden.shape[0]

    def loss_of_sequences(u0: int, u1: int, part: SequenceLogps) -> torch.Tensor:
        logratios = part.logps - ref[u0:u1]
        chosen, rejected = _kto_losses(logratios, logratios, kl, cfg)
        desirable = label[u0:u1]
        losses = torch.where(desirable, cfg.desirable_weight * chosen, cfg.undesirable_weight * rejected)
        return losses.sum() / count

    return _run(h_flat, head, t_flat, units, loss_of_sequences, options, token_sums), units.desirable


@graph_break
@autocast_head_inputs
def orpo_loss_fused(
    hidden: torch.Tensor,  # [2B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [2B, T]
    completion_mask: torch.Tensor,  # [2B, T]
    *,
    nll_mask: torch.Tensor | None = None,  # [2B, T]
    beta: float = 0.1,
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO loss and TRL's metrics from one fused vocabulary pass: :func:`sequence_logps` (with
    ``nll_mask``) + :func:`~logitless.orpo_loss` in one call. The pass covers the completion
    and NLL tokens once; the NLL is the token mean over the whole batch's chosen NLL tokens,
    which each chunk adds its share of.

    Args:
        hidden, head, targets, completion_mask, options: as :func:`dpo_loss_fused`.
        nll_mask: ``[2B, T]`` the NLL term's tokens (ORPO: the chosen rows' prompt and response,
            zeros for rejected rows); ``None``: the completion tokens.
        beta: ORPO's ``β``.

    Returns:
        ``(loss, metrics)`` as :func:`~logitless.orpo_loss`.

    Raises:
        TypeError, ValueError: as :func:`sequence_logps`.
    """
    batch = _Batch(targets, completion_mask, nll_mask)
    loss, policy, _ = _orpo(hidden, as_head(head), batch, beta, as_options(options))
    with torch.no_grad():
        _, metrics = orpo_loss(policy, beta=beta)
    return loss, metrics


@graph_break
@autocast_head_inputs
def orpo_fused_pass(
    hidden: torch.Tensor,  # [2B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [2B, T]
    completion_mask: torch.Tensor,  # [2B, T]
    *,
    nll_mask: torch.Tensor | None = None,  # [2B, T]
    beta: float = 0.1,
    options: PassOptions | None = None,
) -> PreferencePass:
    """:func:`orpo_loss_fused`'s pass for a caller that logs its own metrics (the TRL ORPO
    drop-in): the loss and every sequence's sums (completion and NLL).

    Args:
        hidden, head, targets, completion_mask, nll_mask, beta, options: as :func:`orpo_loss_fused`.

    Returns:
        :class:`PreferencePass` (``tokens`` is ``None``).

    Raises:
        TypeError, ValueError: as :func:`orpo_loss_fused`.
    """
    return _orpo(hidden, as_head(head), _Batch(targets, completion_mask, nll_mask), beta, as_options(options))


def _orpo(hidden: torch.Tensor, head: Head, batch: _Batch, beta: float, options: PassOptions) -> PreferencePass:
    units, h_flat, t_flat = _prepare(hidden, head, batch, 2, {}, options, _want())
    pairs = hidden.shape[0] // 2
    chosen_tokens = _chosen_tokens(units)

    def loss_of_pairs(u0: int, u1: int, part: SequenceLogps) -> torch.Tensor:
        ratio = _orpo_log_odds(part)[3]
        return _chosen_nll_parts(part)[0].sum() / chosen_tokens - (beta * ratio).sum() / pairs

    return _run(h_flat, head, t_flat, units, loss_of_pairs, options)
