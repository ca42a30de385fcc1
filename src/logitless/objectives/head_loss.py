"""``head_loss``: several terms on the head's softmax (CE, z-loss, entropy, your own) from a
single vocabulary pass, each term's value reported separately."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..amp import autocast_head_inputs
from ..compile import graph_break
from ..ops import (
    ChunkStats,
    Head,
    ObjectiveSpec,
    PassOptions,
    StatRequest,
    ValueChecks,
    as_head,
    as_options,
    run_objective,
    stat_dtype_for,
)
from .vocab_stats import read_counted

STATS = ("logp", "lse", "entropy", "mean_logit", "is_top1")
# Statistics a term may also ask for, never by default (one more sum per logit).
EXTRA_STATS = ("log_sum_sq_probs",)


@dataclass
class TokenStats:
    """What a term sees: the statistics of a set of counted tokens (one chunk in fused mode,
    all of them in recompute mode), ``[n]`` each, fp32 (fp64 for fp64 inputs), nats.

    ``logp``, ``lse``, ``entropy``, ``mean_logit`` are differentiable (``None`` unless
    requested); ``is_top1`` (bool, the target has the largest logit; ties count) and
    ``log_sum_sq_probs`` (``log Σ_v p_v²``, TRL's name: WPO's weight) are not.
    ``positions`` are the tokens' indices in the flattened ``targets`` and ``count`` the
    number of counted tokens of the whole call (for means).
    """

    logp: torch.Tensor
    lse: torch.Tensor | None
    entropy: torch.Tensor | None
    mean_logit: torch.Tensor | None
    is_top1: torch.Tensor | None
    positions: torch.Tensor
    count: int
    log_sum_sq_probs: torch.Tensor | None = None


Term = Callable[[TokenStats], torch.Tensor]


@graph_break
@autocast_head_inputs
def head_loss(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [N] or [B, T]
    terms: Mapping[str, Term],
    *,
    metrics: Mapping[str, Term] | None = None,
    ignore_index: int = -100,
    stats: tuple[str, ...] = STATS,
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of ``terms`` over the counted tokens, all from one pass over the vocabulary.

    Each term maps a :class:`TokenStats` to a scalar that must be a *sum over those tokens*
    (normalize inside the term with ``stats.count`` or your own constant): the loss of the call
    is the sum over chunks, so fused mode (3 GEMMs of work) applies to any combination, and the
    softmax is computed once however many terms there are.

    Args:
        hidden, head, targets: as :func:`logitless.vocab_stats` (``hidden`` ``[N, H]`` or
            ``[B, T, H]``, ``targets`` integer ``[N]`` or ``[B, T]``); a term sees the counted
            tokens' statistics (:class:`TokenStats`: fp32, fp64 for fp64 inputs, nats).
        terms: ``{name: term}``; e.g. ``{"ce": lambda s: -s.logp.sum() / s.count,
            "z_loss": lambda s: 1e-4 * (s.lse ** 2).sum() / s.count}``.
        metrics: like ``terms`` but only reported (no gradient, not added to the loss), e.g.
            ``{"entropy": lambda s: s.entropy.sum() / s.count}``.
        ignore_index: target value of tokens that are not counted.
        stats: statistics the terms use (subset of ``logp, lse, entropy, mean_logit, is_top1``, the
            default, and ``log_sum_sq_probs``, only when named).
        options: :class:`logitless.PassOptions` (``mode`` ``"auto"``/``"fused"``: gradient in the
            forward; ``"recompute"``).

    Returns:
        ``(loss, values)``: the summed loss (differentiable w.r.t. ``hidden`` and the head)
        and each term's and metric's value (detached 0-dim tensors).

    Raises:
        TypeError, ValueError: invalid inputs (as :func:`vocab_stats`), unknown stats, no terms.
    """
    return _head_loss(hidden, head, targets, terms, metrics, ignore_index, stats, options)


def _head_loss(hidden: torch.Tensor, head: Head | torch.Tensor, targets: torch.Tensor, terms: Mapping[str, Term],
               metrics: Mapping[str, Term] | None, ignore_index: int, stats: tuple[str, ...],
               options: PassOptions | None,
               pending: ValueChecks | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`head_loss` (its arguments positionally), with the caller's ``pending`` value checks
    (:func:`cross_entropy`'s count) read in the head checks' synchronization."""
    if not terms:
        raise ValueError("head_loss needs at least one term")
    unknown = set(stats) - set(STATS + EXTRA_STATS)
    if unknown:
        raise ValueError(f"unknown statistics {sorted(unknown)}; choose from {STATS + EXTRA_STATS}")
    head, options = as_head(head), as_options(options)
    checks = ValueChecks() if pending is None else pending
    # The counted positions' rows and ids are checked where they are, and how many count is read
    # with the checks: one host read, whether or not some rows are ignored.
    want = StatRequest(entropy="entropy" in stats, sum_z="mean_logit" in stats, sum_sq="log_sum_sq_probs" in stats,
                       logp_grad_only=not {"lse", "entropy", "mean_logit"} & set(stats))
    order, count, started = read_counted(hidden, head, targets, ignore_index, checks, want, options,
                                         options.mode != "recompute")
    vocab_size = head.local().vocab_size
    flat = targets.reshape(-1)
    h = hidden.reshape(-1, hidden.shape[-1])
    if count < flat.numel():
        positions = order[:count]
        h, t = h[positions], flat[positions].long()
    else:  # every position counts: the order is 0, 1, ..., and the rows are views
        positions, t = order, flat.long()
    sdt = stat_dtype_for(hidden.dtype)

    def objective(sl: slice, st: ChunkStats):
        ts = TokenStats(logp=st.logp, lse=st.lse if "lse" in stats else None,
                        entropy=st.entropy, mean_logit=None if st.sum_z is None else st.sum_z / vocab_size,
                        is_top1=st.is_top1 if "is_top1" in stats else None, positions=positions[sl], count=count,
                        log_sum_sq_probs=st.log_sum_sq_probs)
        values = {name: term(ts) for name, term in terms.items()}
        total = sum(values.values(), torch.zeros((), dtype=sdt, device=hidden.device))
        reported = {k: v.detach() for k, v in values.items()}
        with torch.no_grad():
            reported.update({name: fn(ts).detach() for name, fn in (metrics or {}).items()})
        return total, reported

    spec = ObjectiveSpec(want=want, started=started)
    _, _, collected = result = run_objective(h, head, t, objective, spec, options)
    values = {name: sum((c[name] for c in collected), torch.zeros((), dtype=sdt, device=hidden.device))
              for name in (*terms, *(metrics or {}))}
    return result.loss, values
