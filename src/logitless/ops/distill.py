"""Distillation on the vocabulary engine: a student's and a teacher's softmax in the same blocked pass.

A two-head :class:`~logitless.ops.engine.PassKind` (:class:`DistillPass`), so distillation runs
on the engine's chunk loops, plan and both modes (fused: each chunk's gradient inside the
forward; recompute: O(N) saved state, logits recomputed in the backward). A chunk's work (both
heads' partials, the JSD's second pass, the student's gradients) is a backend's
(:class:`~logitless.ops.distill_contract.DistillBackend`, where the formulas are; the torch
backend's is the specification), picked once per call by
:func:`~logitless.ops.distill_contract.resolve_distill`; this module reduces the partials over
the vocabulary group and turns them into statistics.

Vocabulary parallelism (a :class:`~logitless.VocabShard` on both heads, the same layout): each
rank folds its valid local rows (padding rows beyond ``vocab_size`` take no part) into partials
kept as (running max, sums) per side; one all-reduce MAX of both sides' stacked maxima and one
SUM of the sums rescaled by ``exp(m_local - m_global)`` (the target logits riding along, 0 where
another rank owns the id) make them global, per chunk (fused) or once per pass (recompute). The
JSD pass sums its per-rank partials with one more SUM. The backward writes ``dz`` for the local
rows only (the target scatter where owned); the engine sums the ``d hidden`` partials over the
group unless ``reduce_grad_hidden=False``, and ``d weight`` stays local. Gradients flow to the
student only (the teacher is frozen).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..distributed import all_reduce, is_active
from .contract import Accumulators, Head, LocalHead
from .distill_contract import (
    DistillBackend,
    DistillGrads,
    DistillHeads,
    DistillPartials,
    DistillRows,
    DistillSaved,
    resolve_distill,
)
from .engine import ChunkObjective, PassResult, recompute_stats, resolve_mode, run_fused
from .fused import no_autocast
from .lora import LowRank
from .plan import ChunkPlan, PassOptions, stat_dtype_for


class DistillStats(NamedTuple):
    """Per-token statistics of a distillation pass (fp32, fp64 for fp64 inputs; nats).

    ``lse``, ``entropy``, ``forward_kl``, ``reverse_kl``, ``jsd`` are ``[n]``; ``logp`` is
    ``[n, k]`` (columns whose id is outside ``[0, V)`` hold ``-lse``, differentiated as such: mask
    them in the loss); ``teacher_lse``/``teacher_entropy`` are ``[n]`` without gradient.
    Teacher fields are ``None`` without a teacher, ``jsd`` ``None`` unless requested.
    """

    lse: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    forward_kl: torch.Tensor | None
    reverse_kl: torch.Tensor | None
    jsd: torch.Tensor | None
    teacher_lse: torch.Tensor | None
    teacher_entropy: torch.Tensor | None


def check_shards(head: Head, teacher: Head | None) -> None:
    """Both heads split the vocabulary the same way: a shard on both or neither, the same group,
    ``vocab_start``, ``vocab_size`` and local row count (each rank folds the same rows of both
    softmaxes).

    Raises:
        ValueError: a shard on one head only, or two different layouts.
    """
    if teacher is None or (head.shard is None and teacher.shard is None):
        return
    fix = ("give the student and the teacher the same VocabShard (same group, vocab_start and vocab_size) "
           "over the same local rows of the vocabulary")
    if head.shard is None or teacher.shard is None:
        which, other = ("head", "teacher") if teacher.shard is None else ("teacher", "head")
        raise ValueError(f"distillation: the {which} has a vocabulary shard and the {other} has none; {fix}")
    s, t = head.local(), teacher.local()
    layout_s = (s.vocab_start, s.vocab_size, head.weight.shape[0])
    layout_t = (t.vocab_start, t.vocab_size, teacher.weight.shape[0])
    if s.group is not t.group or layout_s != layout_t:
        raise ValueError(f"distillation: the student and teacher heads are sharded differently "
                         f"((vocab_start, vocab_size, local rows) = {layout_s} vs {layout_t}"
                         f"{', different groups' if s.group is not t.group else ''}); {fix}")


@dataclass
class DistillPass:
    """A two-head :class:`~logitless.ops.engine.PassKind`: the student ``heads.student``
    (differentiable) and a frozen ``heads.teacher`` (``None``: the student's statistics and target
    log-probs only), run by ``backend``."""

    heads: DistillHeads
    teacher_hidden: torch.Tensor | None  # [n, H_t], detached
    targets: torch.Tensor  # [n, k] int64, local to the head's rows (another rank's ids fall outside)
    plan: ChunkPlan
    backend: DistillBackend

    DIFFERENTIABLE = ("lse", "logp", "entropy", "forward_kl", "reverse_kl", "jsd")
    zero_rows = None  # every counted token of a distillation loss has a gradient
    started = None  # no statistics GEMM is launched ahead of the pass (start_pass)

    @classmethod
    def make(cls, hidden: torch.Tensor, head: Head, targets: torch.Tensor, teacher_hidden: torch.Tensor | None,
             teacher: Head | None, jsd_beta: float | None, options: PassOptions,
             forward_kl_only: bool = False) -> DistillPass:
        """``targets`` are global ids; a shard must be on both heads, laid out alike (:func:`check_shards`).
        ``forward_kl_only``: the loss's gradient will come through ``forward_kl`` alone
        (:class:`~logitless.ops.distill_contract.DistillHeads`; not under a vocabulary shard,
        whose ``lse`` are known only once reduced over the group).

        Raises:
            ValueError: an adapter on either head; shards of different layouts, or on one head
                only; ``jsd_beta`` outside ``(0, 1)`` or without a teacher; a teacher of other
                rows or tokens than the student's; a bad ``options.impl`` for the device."""
        for name, h in (("head", head), ("teacher", teacher)):
            if h is not None and h.lora is not None:
                raise ValueError(f"distillation with a LoRA adapter on the {name} is not supported yet")
        check_shards(head, teacher)
        n, vocab = hidden.shape[0], head.weight.shape[0]
        if jsd_beta is not None:
            if teacher is None:
                raise ValueError("jsd_beta needs a teacher")
            if not 0.0 < jsd_beta < 1.0:
                raise ValueError(f"jsd_beta must lie in (0, 1) (0 and 1 are the forward / reverse KL), "
                                 f"got {jsd_beta!r}")
        local_teacher = None
        if teacher is not None:
            if teacher.weight.shape[0] != vocab or teacher_hidden is None or teacher_hidden.shape[0] != n:
                raise ValueError(f"teacher head must be hidden [{n}, H_t] and weight [{vocab}, H_t], got "
                                 f"{None if teacher_hidden is None else tuple(teacher_hidden.shape)} and "
                                 f"{tuple(teacher.weight.shape)}")
            teacher_hidden = teacher_hidden.detach()
            teacher = dataclasses.replace(teacher, weight=teacher.weight.detach(),
                                          bias=None if teacher.bias is None else teacher.bias.detach())
            local_teacher = teacher.local()
        local = head.local()
        backend = resolve_distill(options.impl, hidden, teacher_hidden, targets.shape[1])
        heads = DistillHeads(local, local_teacher, jsd_beta,
                             forward_kl_only and teacher is not None and jsd_beta is None and head.shard is None)
        return cls(heads, teacher_hidden, local.local_targets(targets.long()),
                   backend.plan_for(n, local.weight.shape[0], options, hidden.dtype), backend)

    @property
    def head(self) -> LocalHead:
        return self.heads.student

    @property
    def stores_weight_grad(self) -> bool:
        return self.backend.CAPS.stores_weight_grad

    @property
    def pairs_weight_grad(self) -> bool:
        return self.backend.CAPS.pairs_weight_grad

    def fields_present(self) -> tuple[bool, ...]:
        t = self.heads.teacher is not None
        return True, True, True, t, t, self.heads.beta is not None, t, t

    def rows(self, hidden: torch.Tensor, sl: slice, low: LowRank | None) -> DistillRows:
        th = None if self.teacher_hidden is None else self.teacher_hidden[sl]
        return DistillRows(hidden[sl], self.targets[sl], th)

    def chunk_stats(self, rows: DistillRows, plan: ChunkPlan,
                    keep_logits: bool) -> tuple[DistillStats, DistillSaved, object | None]:
        """A chunk's statistics over the full vocabulary (both passes, reduced over the group),
        what its backward needs, and the backend's kept logits."""
        with no_autocast(rows.hidden.device):
            part, kept = self.backend.chunk_forward(self.heads, rows, plan, keep_logits)
            part = part.reduce(self.head.group)
            return (*self._finish(part, rows, plan, reduce_jsd=True, kept=kept), kept)

    def _finish(self, part: DistillPartials, rows: DistillRows, plan: ChunkPlan,
                reduce_jsd: bool, kept: object | None = None) -> tuple[DistillStats, DistillSaved]:
        """Statistics from full-vocabulary partials, running the JSD pass (its per-rank sums
        reduced over the group only with ``reduce_jsd``)."""
        out = part.finalize()
        jsd = kl_pm = None
        if self.heads.beta is not None:
            jsd, kl_pm = self.backend.chunk_jsd(self.heads, rows, plan, out["lse"], out["teacher_lse"], kept)
            if reduce_jsd and is_active(self.head.group):
                jsd, kl_pm = all_reduce(torch.stack([jsd, kl_pm]), "sum", self.head.group)
        stats = DistillStats(lse=out["lse"], logp=out["logp"], entropy=out["entropy"],
                             forward_kl=out.get("forward_kl"), reverse_kl=out.get("reverse_kl"), jsd=jsd,
                             teacher_lse=out.get("teacher_lse"), teacher_entropy=out.get("teacher_entropy"))
        saved = DistillSaved(out["lse"], out["sum_pz"], out.get("teacher_lse"), out.get("reverse_kl"), kl_pm)
        return stats, saved

    def empty_stats(self, n: int, device: torch.device) -> DistillStats:
        sdt = stat_dtype_for(self.head.weight.dtype)
        return DistillStats(*(None if not present else
                              torch.empty((n, self.targets.shape[1]) if name == "logp" else (n,), dtype=sdt,
                                          device=device)
                              for name, present in zip(DistillStats._fields, self.fields_present(), strict=True)))

    def forward_all(self, hidden: torch.Tensor, low: LowRank | None) -> tuple[DistillStats, DistillSaved]:
        """Every row's statistics, written into whole-pass buffers: the first pass's partials of
        every chunk, reduced over the group once, then each chunk's statistics (and JSD pass),
        the JSD sums reduced once."""
        n, dev = hidden.shape[0], hidden.device
        sdt = stat_dtype_for(hidden.dtype)
        stats = self.empty_stats(n, dev)
        saved = DistillSaved(stats.lse, torch.empty(n, dtype=sdt, device=dev), stats.teacher_lse, stats.reverse_kl,
                             None if self.heads.beta is None else torch.empty(n, dtype=sdt, device=dev))
        chunks = self.plan.chunks(n)
        parts = DistillPartials.empty(n, self.targets.shape[1], self.heads.teacher is not None, sdt, dev)
        with no_autocast(dev):
            for sl in chunks:
                parts.write(sl, self.backend.chunk_forward(self.heads, self.rows(hidden, sl, low), self.plan, False)[0])
            parts = parts.reduce(self.head.group)
            for sl in chunks:
                part, part_saved = self._finish(parts.rows(sl), self.rows(hidden, sl, low), self.plan,
                                                reduce_jsd=False)
                for dst, src in ((stats, part), (saved, part_saved)):
                    for d, s in zip(dst, src, strict=True):
                        if d is not None:
                            d[sl] = s
                del part, part_saved
        if self.heads.beta is not None and is_active(self.head.group):
            total = all_reduce(torch.stack([stats.jsd, saved.kl_pm]), "sum", self.head.group)
            stats.jsd.copy_(total[0])
            saved.kl_pm.copy_(total[1])
        return stats, saved

    def grads_of(self, named: dict[str, torch.Tensor]) -> DistillGrads:
        return DistillGrads(**named)

    def backward(self, rows: DistillRows, plan: ChunkPlan, saved: DistillSaved, grads: DistillGrads,
                 acc: Accumulators, kept: object | None) -> torch.Tensor | None:
        with no_autocast(rows.hidden.device):
            return self.backend.chunk_backward(self.heads, rows, plan, saved, grads, acc, kept)


def run_distill(p: DistillPass, objective: ChunkObjective, hidden: torch.Tensor, head: Head, options: PassOptions,
                per_token: bool = False) -> PassResult:
    """Run ``objective(rows, stats: DistillStats) -> (loss term, collected)`` over the pass
    ``p`` (made from ``hidden`` and ``head``) in ``options.mode``: fused sums the chunks' terms;
    recompute calls it once over all rows. ``per_token``: the objective returns a per-token loss,
    which only recompute mode can give (``auto`` picks it).

    Raises:
        ValueError: ``mode="fused"`` with ``per_token``.
    """
    if per_token and options.mode == "fused":
        raise ValueError("mode='fused' gives a scalar loss; a per-token loss (reduction='none') needs "
                         "mode='recompute' or 'auto'")
    if resolve_mode(options.mode, per_token) == "fused":
        return run_fused(p, objective, hidden, head.weight, head.bias)
    stats = recompute_stats(p, hidden, head.weight, head.bias)
    loss, collected = objective(slice(0, hidden.shape[0]), stats)
    return PassResult(loss, DistillStats(*(None if t is None else t.detach() for t in stats)), [collected])
