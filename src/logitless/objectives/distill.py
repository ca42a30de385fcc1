"""``distill_loss``: knowledge distillation straight from two heads' hidden states and weights.

The divergences follow TRL 1.16: ``GKDTrainer.generalized_jsd_loss`` /
``DistillationTrainer`` (``trl.kernels.chunked_divergence``) for a dense teacher, and
``ServerDistillationTrainer._compute_server_forward_kl_loss`` for a teacher given as top-k
log-probs. Neither side's ``[N, V]`` logits are materialized: the statistics come from one
blocked vocabulary pass (the two-head kind :class:`logitless.ops.distill.DistillPass` on the
vocabulary engine, fused or recompute mode), and a hard-label cross-entropy mixed in is a column
of the same pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..amp import autocast_head_inputs
from ..compile import graph_break
from ..ops import (
    DistillPass,
    DistillStats,
    Head,
    PassOptions,
    ValueChecks,
    as_head,
    as_options,
    check_count,
    check_device,
    check_head_inputs,
    check_mask,
    check_shards,
    check_target_range,
    run_distill,
)
from .layout import counted_first_order, counted_rows

Divergence = Literal["generalized_jsd", "forward_kl", "reverse_kl"]
Reduction = Literal["mean", "sum", "none"]
_IGNORE = -100
_MASS_TOL = 1e-4  # a teacher top-k mass above 1 + this is not a set of log-probabilities


@dataclass(frozen=True)
class DistillConfig:
    """Options of :func:`distill_loss` (TRL's names).

    Attributes:
        divergence: ``"generalized_jsd"`` (TRL's ``generalized_jsd_loss``: ``beta = 0`` is the
            forward KL, ``beta = 1`` the reverse KL, else ``β KL(q‖m) + (1-β) KL(p‖m)`` with
            ``m = β q + (1-β) p``, ``p`` the student, ``q`` the teacher), ``"forward_kl"``
            (``KL(q‖p)``, whatever ``beta``) or ``"reverse_kl"`` (``KL(p‖q)``).
        beta: the JSD interpolation ``β ∈ [0, 1]`` (GKD's default 0.5).
        ce_weight: weight of the hard-label cross-entropy added to the divergence (needs
            ``targets``): ``loss = divergence + ce_weight * ce``, both token means.
        reduction: ``"mean"`` over counted tokens (TRL's ``batchmean``; divided by
            ``num_items_in_batch`` when given), ``"sum"``, or ``"none"`` (per-token loss in the
            caller's layout, 0 at tokens not counted).
        vocab_size: the tokenizer's vocabulary. Both heads (and biases) are cut to their first
            ``vocab_size`` rows, so padded rows of either head are excluded from both softmaxes
            (and get no gradient). ``None``: both heads must have the same number of rows.
        topk_add_tail: sparse teacher only (TRL ``loss_add_tail``, default ``True``): append a
            tail bucket ``log(1 - Σ_topk p)`` to both distributions; ``False``: renormalize both
            over the top-k support.

    Raises:
        ValueError: an unknown ``divergence`` or ``reduction``, ``beta`` outside ``[0, 1]``, a
            negative or non-finite ``ce_weight``, a ``vocab_size`` that is not a positive int.
    """

    divergence: Divergence = "generalized_jsd"
    beta: float = 0.5
    ce_weight: float = 0.0
    reduction: Reduction = "mean"
    vocab_size: int | None = None
    topk_add_tail: bool = True

    def __post_init__(self) -> None:
        if self.divergence not in ("generalized_jsd", "forward_kl", "reverse_kl"):
            raise ValueError(f"divergence must be 'generalized_jsd', 'forward_kl' or 'reverse_kl', "
                             f"got {self.divergence!r}")
        if not (isinstance(self.beta, (int, float)) and 0.0 <= self.beta <= 1.0):
            raise ValueError(f"beta must lie in [0, 1], got {self.beta!r}")
        if not math.isfinite(self.ce_weight) or self.ce_weight < 0:
            raise ValueError(f"ce_weight must be a finite number >= 0, got {self.ce_weight!r}")
        if self.reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {self.reduction!r}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size <= 0):
            raise ValueError(f"vocab_size must be a positive int or None, got {self.vocab_size!r}")

    @property
    def kind(self) -> Literal["forward_kl", "reverse_kl", "jsd"]:
        """Which divergence is computed: the JSD at ``β`` 0 / 1 is exactly the forward / reverse KL."""
        if self.divergence == "generalized_jsd":
            return "forward_kl" if self.beta == 0 else "reverse_kl" if self.beta == 1 else "jsd"
        return self.divergence


@graph_break
@autocast_head_inputs
def distill_loss(
    hidden: torch.Tensor,  # [B, T, H_s] or [N, H_s]
    head: Head | torch.Tensor,  # Head, or a [V_s, H_s] weight
    teacher_hidden: torch.Tensor | None = None,  # [B, T, H_t] or [N, H_t]
    teacher: Head | torch.Tensor | None = None,  # Head, or a [V_t, H_t] weight
    *,
    mask: torch.Tensor | None = None,  # [B, T] or [N]
    targets: torch.Tensor | None = None,  # [B, T] or [N]
    teacher_topk_ids: torch.Tensor | None = None,  # [B, T, k] or [N, k]
    teacher_topk_logprobs: torch.Tensor | None = None,  # [B, T, k] or [N, k]
    config: DistillConfig | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Distillation loss (and metrics) of a student head against a teacher, in one vocabulary pass.

    The teacher is either **dense** (``teacher_hidden`` + ``teacher``: its full softmax
    is folded into the same blocked pass as the student's) or **sparse** (``teacher_topk_ids``
    + ``teacher_topk_logprobs``, what inference servers return; entries with ``-inf`` log-prob
    are padding). With a sparse teacher the divergence is TRL's server forward KL over the top-k
    support: the student's full-vocabulary log-probs at the teacher's ids, then either a tail
    bucket ``log(1 - Σ exp)`` appended to both (``config.topk_add_tail``, TRL's default) or
    both renormalized over the top-k; only the forward KL exists there (as in TRL).

    Log-probs are of the transformed logits: TRL's ``temperature`` is the ``temperature`` of
    the student head's ``transform``; a bare teacher weight takes the student's transform (TRL
    applies one temperature to both); give the teacher a :class:`Head` of its own to differ.
    Gradients flow to the student's ``hidden``, weight and bias only; the teacher is detached.

    Vocabulary (tensor) parallelism: give the student head a :class:`logitless.VocabShard` and
    this rank's rows; a dense teacher must hold the same rows under the same shard (a bare
    teacher weight takes the student's shard, a teacher :class:`Head` needs its own equal one).
    Targets and top-k ids are global; padding rows (``VocabShard.vocab_size``) get no
    probability. The statistics combine over the group (one MAX and one SUM all-reduce per
    chunk, fused, or per pass, recompute; one more SUM for the JSD), the ``d hidden`` partials
    are summed unless ``reduce_grad_hidden=False``, ``d weight`` is this rank's rows. With a
    shard, ``config.vocab_size`` is refused: the shard's ``vocab_size`` says where padding starts.

    Args:
        hidden: the student's final hidden states ``[B, T, H_s]`` or ``[N, H_s]`` (fp16/bf16/fp32/
            fp64; each predicting the token at its position).
        head: the student's :class:`logitless.Head` (weight ``[V_s, H_s]``, bias, transform) or
            a bare weight.
        teacher_hidden, teacher: the teacher's hidden states (same leading shape as ``hidden``;
            its hidden size may differ) and head (:class:`logitless.Head` or a bare weight).
        mask: counted tokens (completion mask: 0/1 or bool, any dtype); ``None``: all.
        targets: integer hard-label token ids (TRL's ``labels``), shaped like ``mask``, each in
            ``[0, V)`` or ``-100`` (TRL's convention: a token not counted). Needed for
            ``config.ce_weight > 0``; the cross-entropy is a column of the same pass.
        teacher_topk_ids, teacher_topk_logprobs: sparse teacher, ``[..., k]`` integer ids and
            floating log-probs (nats; ``-inf`` for padding entries).
        config: :class:`DistillConfig`.
        num_items_in_batch: global count of counted tokens (gradient accumulation), a number or
            a one-element tensor, finite and > 0 (read with the other value checks); ``None``:
            this call's count (clamped to >= 1). Only ``reduction="mean"`` reads it.
        options: :class:`logitless.PassOptions`: workspace budget, ``mode`` (``"auto"``:
            fused, or recompute for ``reduction="none"``, whose per-token loss fused mode cannot
            give) and ``impl``: the gemm backend's kernels (``"auto"`` on Hopper and later GPUs),
            the CuTe ones (``"cute"``), else the torch functions (any backend without
            distillation kernels, a sparse teacher, fp32 heads, CPUs).

    Returns:
        ``(loss, metrics)``: a scalar loss (or per-token ``[B, T]`` / ``[N]`` with
        ``reduction="none"``), fp32 (fp64 for fp64 inputs), nats, and 0-dim tensors, means over
        counted tokens: ``divergence``,
        ``entropy`` (the student's, as TRL's DistillationTrainer logs it), ``nll`` (with
        targets); dense teacher: ``forward_kl``, ``reverse_kl``, ``teacher_entropy``, ``jsd``
        (when computed); sparse teacher: ``topk_mass/teacher``, ``topk_mass/student``.

    Raises:
        TypeError, ValueError: shapes, dtypes, devices (meta included, each input named), ids
            out of range, NaN/inf in the heads, a ``mask`` value other than 0/1 (NaN, -1, 0.5), a
            ``num_items_in_batch`` that is not a finite count > 0,
            both or neither teacher kinds, heads of different vocabularies without
            ``config.vocab_size``, ``ce_weight > 0`` without targets; a sparse teacher with
            ``k = 0``, an id repeated within a token's top-k, or a top-k mass above ``1 + 1e-4``;
            a vocabulary shard on one head only, student and teacher shards of different
            layouts, or ``config.vocab_size`` with a shard.
    """
    cfg = DistillConfig() if config is None else config
    head, options = as_head(head), as_options(options)
    weight, bias = head.weight, head.bias
    teacher_weight = teacher_bias = None
    if teacher is not None:
        # A bare weight is this rank's rows under the student's shard, as it takes its transform.
        teacher = teacher if isinstance(teacher, Head) else Head(as_head(teacher).weight, transform=head.transform,
                                                                 shard=head.shard)
        teacher_weight, teacher_bias = teacher.weight, teacher.bias
    dense = teacher_hidden is not None or teacher_weight is not None
    sparse = teacher_topk_ids is not None or teacher_topk_logprobs is not None
    if dense == sparse:
        raise ValueError("give exactly one teacher: teacher_hidden + teacher (dense) or "
                         "teacher_topk_ids + teacher_topk_logprobs (sparse)")
    if dense and (teacher_hidden is None or teacher_weight is None):
        raise ValueError("a dense teacher needs both teacher_hidden and teacher")
    if sparse and (teacher_topk_ids is None or teacher_topk_logprobs is None):
        raise ValueError("a sparse teacher needs both teacher_topk_ids and teacher_topk_logprobs")
    if sparse and cfg.kind != "forward_kl":
        raise ValueError("a sparse (top-k) teacher supports only the forward KL: use divergence='forward_kl' "
                         "or generalized_jsd with beta=0")
    if cfg.ce_weight > 0 and targets is None:
        raise ValueError("ce_weight > 0 needs targets")

    sharded = head.shard is not None or (dense and teacher.shard is not None)
    if sharded and cfg.vocab_size is not None:
        raise ValueError("DistillConfig(vocab_size=...) cuts whole heads; with a vocabulary shard give the true "
                         "vocabulary as VocabShard(vocab_size=...) instead (its padding rows get no probability)")
    if dense:
        check_shards(head, teacher)
    vocab = _common_vocab(weight, teacher_weight if dense else None, cfg.vocab_size)
    weight, bias = weight[:vocab], None if bias is None else bias[:vocab]
    # Targets and top-k ids are global: checked against the whole vocabulary, padding excluded.
    id_bound = head.vocab_size() if head.shard is not None else vocab
    shape = hidden.shape[:-1]
    # One synchronization for the student's and the teacher's value checks, the mask's and the count's.
    checks = ValueChecks()
    check_head_inputs(hidden, Head(weight, bias, head.transform), None, None, checks=checks)
    if dense:
        if not isinstance(teacher_hidden, torch.Tensor):
            raise TypeError(f"teacher_hidden must be a torch.Tensor, got {type(teacher_hidden).__name__}")
        check_device("teacher_hidden", teacher_hidden, hidden.device)
        check_device("the teacher's weight", teacher_weight, hidden.device)
        teacher_weight = teacher_weight[:vocab]
        teacher_bias = None if teacher_bias is None else teacher_bias[:vocab]
        if teacher_hidden.shape[:-1] != shape:
            raise ValueError(f"teacher_hidden leading shape {tuple(teacher_hidden.shape[:-1])} differs from "
                             f"hidden's {tuple(shape)}")
        check_head_inputs(teacher_hidden, Head(teacher_weight, teacher_bias, teacher.transform), None, None,
                          checks=checks)
    for name, x in (("mask", mask), ("targets", targets), ("teacher_topk_ids", teacher_topk_ids),
                    ("teacher_topk_logprobs", teacher_topk_logprobs)):
        if isinstance(x, torch.Tensor):  # anything else is named by the type and shape checks below
            check_device(name, x, hidden.device)
    if mask is not None:
        check_mask(mask, "mask", checks, hidden.device, binary=True)
    if num_items_in_batch is not None and cfg.reduction == "mean":
        num_items_in_batch = check_count(num_items_in_batch, checks, hidden.device)
    positions = math.prod(shape)
    # Without a mask or targets every position counts: no count to read before the pass, and the
    # value checks are read after it where its backend's kernels take unchecked values (below).
    read_later = mask is None and targets is None
    n, idx = positions, None
    if not read_later:
        counted = _counted(shape, mask, targets, hidden.device)
        order, counted_count = counted_first_order(counted.reshape(-1))
        if targets is not None:
            check_target_range(targets, id_bound, checks, counted, ignore_index=_IGNORE)
        # The value checks' one synchronization also reads how many positions count.
        n = int(checks.run(counted_count)[0])
        idx = order[:n]

    def rows(x: torch.Tensor) -> torch.Tensor:  # a view when every position counts
        return counted_rows(x, len(shape), idx, n == positions)

    h = rows(hidden)
    cols: list[torch.Tensor] = []
    if sparse:
        topk_ids, topk_lp = _check_topk(teacher_topk_ids, teacher_topk_logprobs, shape, id_bound)
        topk_ids, topk_lp = rows(topk_ids), rows(topk_lp)
        cols.append(topk_ids)
    if targets is not None:
        cols.append(rows(targets).long()[:, None])
    columns = torch.cat(cols, dim=1) if cols else torch.zeros((n, 0), dtype=torch.long, device=hidden.device)

    th = rows(teacher_hidden) if dense else None
    # The pass reads the heads cut to the shared vocabulary; the gradient goes to the caller's
    # tensors (padded rows: zero).
    p = DistillPass.make(h, replace(head, weight=weight, bias=bias), columns, th,
                         replace(teacher, weight=teacher_weight, bias=teacher_bias) if dense else None,
                         cfg.beta if dense and cfg.kind == "jsd" else None, options,
                         forward_kl_only=dense and cfg.kind == "forward_kl" and cfg.ce_weight == 0)
    if read_later and not p.backend.CAPS.unchecked_values:
        checks.read()
    count = max(n, 1)
    if cfg.reduction == "mean":
        denom = count if num_items_in_batch is None else num_items_in_batch
    k = topk_ids.shape[1] if sparse else 0

    def divergence(sl: slice, st: DistillStats) -> torch.Tensor:
        if dense:
            return {"forward_kl": st.forward_kl, "reverse_kl": st.reverse_kl, "jsd": st.jsd}[cfg.kind]
        return sparse_forward_kl(st.logp[:, :k], topk_lp[sl], cfg.topk_add_tail)[0]

    def objective(sl: slice, st: DistillStats) -> tuple[torch.Tensor, None]:
        if read_later:
            # Behind the first chunk's statistics GEMMs: the read below then waits for them, not
            # for the whole pass, so the host returns (and launches the backward) while the GPU
            # still runs the later chunks. Once; a later call does nothing.
            checks.queue()
        per = divergence(sl, st)
        if cfg.ce_weight > 0:
            per = per - cfg.ce_weight * st.logp[:, -1]
        if cfg.reduction == "none":
            return per, None
        return (per.sum() if cfg.reduction == "sum" else per.sum() / denom), None

    loss, stats, _ = run_distill(p, objective, h, head, options, per_token=cfg.reduction == "none")

    metrics: dict[str, torch.Tensor] = {}
    div = divergence(slice(0, n), stats)
    if dense:
        metrics.update(forward_kl=stats.forward_kl, reverse_kl=stats.reverse_kl,
                       teacher_entropy=stats.teacher_entropy)
        if cfg.kind == "jsd":
            metrics["jsd"] = stats.jsd
    else:
        _, mass_t, mass_s = sparse_forward_kl(stats.logp[:, :k], topk_lp, cfg.topk_add_tail)
        metrics.update({"topk_mass/teacher": mass_t, "topk_mass/student": mass_s})
    if targets is not None:
        metrics["nll"] = -stats.logp[:, -1]
    metrics["divergence"] = div
    metrics["entropy"] = stats.entropy
    metrics = {name: v.detach().sum() / count for name, v in metrics.items()}
    # Before any result is returned (done above where the pass needed it first).
    checks.read()
    if cfg.reduction == "none":
        out = loss if n == positions else loss.new_zeros(positions).index_put((idx,), loss)
        return out.reshape(shape), metrics
    return loss, metrics


def sparse_forward_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                      add_tail: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's server forward KL over a top-k support (``_compute_server_forward_kl_loss``, ``beta=0``).

    Args:
        student_logp: ``[n, k]`` the student's full-vocabulary log-probs at the teacher's ids.
        teacher_logp: ``[n, k]`` the teacher's log-probs; ``-inf`` marks padding entries.
        add_tail: append ``log(1 - Σ exp)`` (clamped to keep the sum below 1) to both sides;
            else renormalize both over the valid entries.

    Returns:
        ``(kl [n], teacher_mass [n], student_mass [n])``: the per-token KL (summed over the
        support) and each side's probability mass on the valid top-k entries.
    """
    valid = teacher_logp > float("-inf")
    neg_inf = torch.full((), float("-inf"), dtype=student_logp.dtype, device=student_logp.device)
    s = torch.where(valid, student_logp, neg_inf)
    t = torch.where(valid, teacher_logp.to(student_logp.dtype), neg_inf)
    mass_t, mass_s = torch.logsumexp(t, dim=-1), torch.logsumexp(s, dim=-1)
    if add_tail:
        s, support = _add_tail(s, valid)
        t, _ = _add_tail(t, valid)
    else:
        support = valid
        s = s - mass_s[:, None]
        t = t - mass_t[:, None]
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    s_safe, t_safe = torch.where(support, s, zero), torch.where(support, t, zero)
    kl = torch.nan_to_num(torch.where(support, t.exp(), zero) * (t_safe - s_safe), nan=0.0).sum(-1)
    return kl, mass_t.exp().detach(), mass_s.exp().detach()


def _add_tail(log_probs: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``_add_tail_bucket``: a ``(k+1)``-th entry ``log(1 - Σ exp(log_probs))``."""
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    tail = torch.log(-torch.expm1(log_sum))
    return torch.cat([log_probs, tail], dim=-1), torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)


def _common_vocab(weight: torch.Tensor, teacher_weight: torch.Tensor | None, vocab_size: int | None) -> int:
    for name, w in (("weight", weight), ("teacher_weight", teacher_weight)):
        if w is not None and (not isinstance(w, torch.Tensor) or w.dim() != 2):
            raise ValueError(f"{name} must be a [V, H] tensor, got "
                             f"{type(w).__name__ if not isinstance(w, torch.Tensor) else tuple(w.shape)}")
    rows = [weight.shape[0]] + ([] if teacher_weight is None else [teacher_weight.shape[0]])
    if vocab_size is None:
        if len(set(rows)) > 1:
            raise ValueError(f"student head has {rows[0]} rows and teacher head {rows[1]}: pass "
                             "DistillConfig(vocab_size=len(tokenizer)) to cut both to the shared vocabulary")
        return rows[0]
    if vocab_size > min(rows):
        raise ValueError(f"vocab_size={vocab_size} exceeds a head's rows {rows}")
    return vocab_size


def _counted(shape: torch.Size, mask: torch.Tensor | None, targets: torch.Tensor | None,
             device: torch.device) -> torch.Tensor:
    counted = torch.ones(shape, dtype=torch.bool, device=device)
    for name, x in (("mask", mask), ("targets", targets)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must be a tensor of shape {tuple(shape)}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        counted = counted & ((x != 0) if name == "mask" else (x != _IGNORE))
    return counted


def _check_topk(ids: torch.Tensor, logprobs: torch.Tensor, shape: torch.Size,
                vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    if tuple(ids.shape[:-1]) != tuple(shape) or ids.shape != logprobs.shape or ids.dim() != len(shape) + 1:
        raise ValueError(f"teacher_topk_ids and teacher_topk_logprobs must both be {[*shape, 'k']}, got "
                         f"{tuple(ids.shape)} and {tuple(logprobs.shape)}")
    if ids.shape[-1] == 0:
        raise ValueError(f"teacher_topk_ids must hold at least one id per token (k >= 1), got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"teacher_topk_ids must be an integer tensor, got {ids.dtype}")
    if not logprobs.dtype.is_floating_point:
        raise TypeError(f"teacher_topk_logprobs must be floating point, got {logprobs.dtype}")
    valid = logprobs > float("-inf")
    bad = valid & ((ids < 0) | (ids >= vocab))
    if bool(bad.any()):
        raise ValueError(f"teacher_topk_ids must lie in [0, {vocab}) where the log-prob is finite; "
                         f"found {ids[bad][:5].tolist()}")
    if bool((torch.isnan(logprobs) | (logprobs > 0)).any()):
        raise ValueError("teacher_topk_logprobs must be log-probabilities (<= 0, -inf for padding), found NaN or > 0")
    mass = torch.logsumexp(logprobs.double(), dim=-1).exp()
    if bool((mass > 1 + _MASS_TOL).any()):
        raise ValueError(f"teacher_topk_logprobs must sum to at most 1 per token (tolerance {_MASS_TOL}); found a "
                         f"mass of {mass.max().item():.6g}")
    ids = torch.where(valid, ids.long(), -1)
    ordered = ids.sort(dim=-1).values
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(dup.any()):
        raise ValueError(f"teacher_topk_ids must not repeat an id within a token's top-k; found "
                         f"{ordered[..., 1:][dup][:5].tolist()} repeated")
    return ids, logprobs

