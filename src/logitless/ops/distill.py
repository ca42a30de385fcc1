"""Distillation on the vocabulary engine: a student's and a teacher's softmax in the same blocked pass.

A two-head :class:`~logitless.ops.engine.PassKind` (:class:`DistillPass`), so distillation runs
on the engine's chunk loops, plan and both modes (fused: each chunk's gradient inside the
forward; recompute: O(N) saved state, logits recomputed in the backward).

The student's logits ``zs = Ts(hs Wsᵀ + bs)`` and the teacher's ``zt = Tt(ht Wtᵀ + bt)`` (each
with its own :class:`LogitTransform`: temperature, scale, soft-cap) are computed block by block
over the same vocabulary rows (:func:`~logitless.ops.torch_backend.backend.logits_block`: fp32 GEMM
outputs on GPUs); neither ``[N, V]`` tensor exists. With ``p = softmax(zs)`` and
``q = softmax(zt)``, one pass gives, per token:

* the student's ``lse``, ``entropy`` and the log-probs ``logp [n, k]`` of ``k`` target ids per
  token (a hard label, a teacher's top-k ids, or both, as columns);
* the teacher's ``lse`` and entropy;
* ``forward_kl = KL(q‖p) = Σ q (zt - zs) - lse_t + lse_s`` and
  ``reverse_kl = KL(p‖q) = Σ p (zs - zt) - lse_s + lse_t``, from the cross sums
  ``Σ exp(zt - m_t)(zt - zs)`` and ``Σ exp(zs - m_s)(zs - zt)`` kept with an online
  log-sum-exp of each side (each rescaled by its own running max).

The generalized JSD (TRL's ``GKDTrainer.generalized_jsd_loss``: mixture
``m = β q + (1 - β) p``, ``JSD_β = β KL(q‖m) + (1 - β) KL(p‖m)``) needs ``log m_v`` for every
element: it does not decompose into a few per-token sums, so it is computed by a **second pass**
over the vocabulary (same token chunk) once both final ``lse`` are known.

Vocabulary parallelism (a :class:`~logitless.VocabShard` on both heads, the same layout): each
rank folds its valid local rows (padding rows beyond ``vocab_size`` take no part) into partials
kept as (running max, sums) per side; one all-reduce MAX of both sides' stacked maxima and one
SUM of the sums rescaled by ``exp(m_local - m_global)`` (the target logits riding along, 0 where
another rank owns the id) make them global, per chunk (fused) or once per pass (recompute). The
JSD pass sums its per-rank partials with one more SUM. The backward writes ``dz`` for the local
rows only (the target scatter where owned); the engine sums the ``d hidden`` partials over the
group unless ``reduce_grad_hidden=False``, and ``d weight`` stays local. Gradients flow to the
student only (the teacher is frozen).

Where ``PassOptions.impl`` resolves to the gemm backend (bf16/fp16 heads on Hopper, by default)
and each token has at most one target id, the same functions run on Triton GEMMs with the
statistics in their epilogues (:mod:`logitless.ops.gemm_backend.distill`); the torch functions below
are their specification and run every other case.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..distributed import all_reduce, is_active
from .contract import Accumulators, resolve_backend
from .engine import ChunkObjective, PassResult, no_autocast, recompute_stats, resolve_mode, run_fused
from .head import Head, LocalHead
from .lora import LowRank
from .options import PassOptions
from .plan import ChunkPlan, stat_dtype_for
from .torch_backend.backend import apply_block_grad, logits_block

# [n, v] arrays alive at a block's peak (both sides' logits, their exponentials / probabilities,
# the mixture and product temporaries, dz, dy), in units of the single-head pass's workspace
# per element (3 statistics-dtype arrays + one input-dtype array).
_WORKSPACE_ARRAYS = 3


class DistillRows(NamedTuple):
    """The token side of a chunk: the student's ``hidden [n, H_s]``, ``targets [n, k]`` int64 rows
    local to the head (outside ``[0, V_local)``: another rank's id or none, not gathered), the
    teacher's ``teacher_hidden [n, H_t]`` or ``None``."""

    hidden: torch.Tensor
    targets: torch.Tensor
    teacher_hidden: torch.Tensor | None


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


class DistillSaved(NamedTuple):
    """What a chunk's backward needs from its forward (``[n]``; ``None`` where not computed)."""

    lse: torch.Tensor
    sum_pz: torch.Tensor
    teacher_lse: torch.Tensor | None
    reverse_kl: torch.Tensor | None
    kl_pm: torch.Tensor | None  # KL(p‖m), JSD only


class DistillGrads(NamedTuple):
    """Per-token gradients of the loss w.r.t. the differentiable statistics (``None`` = zero;
    ``logp`` is ``[n, k]``)."""

    lse: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    forward_kl: torch.Tensor | None = None
    reverse_kl: torch.Tensor | None = None
    jsd: torch.Tensor | None = None

    def any(self) -> bool:
        return any(g is not None for g in self)

    def rows(self, sl: slice) -> DistillGrads:
        return DistillGrads(*(None if g is None else g[sl] for g in self))

    def teacher_terms(self) -> bool:
        """Whether the gradient needs the teacher's probabilities (a KL or JSD term)."""
        return self.forward_kl is not None or self.reverse_kl is not None or self.jsd is not None


@dataclass
class DistillPartials:
    """Running partials of one token chunk over a vocabulary range (all ``[n]`` but ``zy``).

    Student: ``m_s`` max, ``se_s = Σ exp(zs - m_s)``, ``sez_s = Σ exp(zs - m_s) zs``,
    ``sgap = Σ exp(zs - m_s)((zs - m_s) - (zt - m_t))``, ``zy [n, k]`` the targets' logits (0
    where not owned). Teacher (``None`` without one): ``m_t``, ``se_t``, ``tez = Σ exp(zt - m_t) zt``,
    ``tgap = Σ exp(zt - m_t)((zt - m_t) - (zs - m_s))``.

    The gaps are taken between logits centred on their own running maxima, so they are O(KL)
    rather than O(|z|): ``KL = gap / se - log se + log se_other`` then holds no difference of
    large numbers (uncentred, ``Σ p (zs - zt) - lse_s + lse_t`` lost the KL of saturated heads
    with |z| ~ 1e3 to fp32 rounding, and the backward's ``log p - log q - KL`` with it).
    """

    m_s: torch.Tensor
    se_s: torch.Tensor
    sez_s: torch.Tensor
    zy: torch.Tensor
    sgap: torch.Tensor | None = None
    m_t: torch.Tensor | None = None
    se_t: torch.Tensor | None = None
    tez: torch.Tensor | None = None
    tgap: torch.Tensor | None = None

    _FIELDS = ("m_s", "se_s", "sez_s", "zy", "sgap", "m_t", "se_t", "tez", "tgap")

    @classmethod
    def empty(cls, n: int, k: int, teacher: bool, dtype: torch.dtype, device: torch.device) -> DistillPartials:
        """Uninitialized whole-pass buffers, filled chunk by chunk with :meth:`write`."""
        def new(*shape: int) -> torch.Tensor:
            return torch.empty(shape or (n,), dtype=dtype, device=device)

        part = cls(m_s=new(), se_s=new(), sez_s=new(), zy=new(n, k))
        if teacher:
            part.sgap, part.m_t, part.se_t, part.tez, part.tgap = new(), new(), new(), new(), new()
        return part

    def write(self, sl: slice, part: DistillPartials) -> None:
        """Copy a chunk's partials into rows ``sl``."""
        for name in self._FIELDS:
            dst = getattr(self, name)
            if dst is not None:
                dst[sl] = getattr(part, name)

    def rows(self, sl: slice) -> DistillPartials:
        """Rows ``sl`` of every field (views)."""
        return DistillPartials(*(None if getattr(self, f) is None else getattr(self, f)[sl] for f in self._FIELDS))

    def reduce(self, group) -> DistillPartials:
        """Every rank's partials combined into the full vocabulary's: one all-reduce MAX of the
        stacked maxima and one SUM of the rescaled sums (with the owners' target logits) over
        the vocabulary-parallel ``group``; ``self`` without a group."""
        if not is_active(group):
            return self
        return self.merged(lambda x: all_reduce(x, "max", group), lambda x: all_reduce(x, "sum", group))

    def merged(self, max_over: Callable[[torch.Tensor], torch.Tensor], sum_over: Callable[[torch.Tensor], torch.Tensor],
               zy: torch.Tensor | None = None) -> DistillPartials:
        """The partials of several disjoint vocabulary ranges combined into their union's.

        ``self`` holds one range's partials (each rank's own, for :meth:`reduce`) or a leading
        range axis on every field (``[ranges, n]``); ``max_over``/``sum_over`` reduce a stack of
        fields across the ranges (all-reduces, or ``max``/``sum`` over dim 1), each called once.
        ``zy``: the targets' logits already summed over the ranges, else ``self.zy`` rides along
        in the sum (0 where another range owns the id, so the sum is the owner's logit).
        """
        teacher = self.m_t is not None
        m = max_over(torch.stack([self.m_s, self.m_t] if teacher else [self.m_s]))
        # 0 for a range without valid rows (local max -inf): it adds nothing to the sums.
        scale_s = torch.exp(self.m_s - m[0])
        sums = [self.se_s * scale_s, self.sez_s * scale_s]
        if teacher:
            scale_t = torch.exp(self.m_t - m[1])
            # The gaps are centred on each range's maxima: re-centre them on the union's.
            shift = _moved(self.m_s, m[0]) - _moved(self.m_t, m[1])
            sums += [(self.sgap + self.se_s * shift) * scale_s, self.se_t * scale_t, self.tez * scale_t,
                     (self.tgap - self.se_t * shift) * scale_t]
        stacked = torch.stack(sums)
        if zy is None:
            stacked = torch.cat([stacked, self.zy.movedim(-1, 0)])
        total = sum_over(stacked)
        p = len(sums)
        zy = total[p:].movedim(0, -1) if zy is None else zy
        out = DistillPartials(m_s=m[0], se_s=total[0], sez_s=total[1], zy=zy)
        if teacher:
            out.sgap, out.m_t, out.se_t, out.tez, out.tgap = total[2], m[1], total[3], total[4], total[5]
        return out

    def finalize(self) -> dict[str, torch.Tensor]:
        """Per-token statistics from the partials (names of :class:`DistillStats`, plus ``sum_pz``)."""
        lse = self.m_s + torch.log(self.se_s)
        out = {"lse": lse, "logp": self.zy - lse[:, None], "sum_pz": self.sez_s / self.se_s}
        out["entropy"] = lse - out["sum_pz"]
        if self.m_t is not None:
            lse_t = self.m_t + torch.log(self.se_t)
            out["teacher_lse"] = lse_t
            out["teacher_entropy"] = lse_t - self.tez / self.se_t
            log_se_s, log_se_t = torch.log(self.se_s), torch.log(self.se_t)
            out["forward_kl"] = self.tgap / self.se_t - log_se_t + log_se_s
            out["reverse_kl"] = self.sgap / self.se_s - log_se_s + log_se_t
        return out


def _logits(head: LocalHead, hidden: torch.Tensor, plan: ChunkPlan, start: int, end: int) -> torch.Tensor:
    bias = None if head.bias is None else head.bias[start:end]
    return logits_block(hidden, head.weight[start:end], bias, head.transform, fp32_logits=plan.fp32_logits)


def _gather_targets(zy: torch.Tensor, z: torch.Tensor, targets: torch.Tensor, start: int, end: int) -> torch.Tensor:
    in_block = (targets >= start) & (targets < end)
    local = (targets - start).clamp(0, end - start - 1)
    return torch.where(in_block, z.gather(1, local), zy)


def chunk_forward(student: LocalHead, teacher: LocalHead | None, rows: DistillRows,
                  plan: ChunkPlan) -> DistillPartials:
    """First pass over all vocabulary rows for one token chunk (the teacher's sums only with a
    ``teacher``)."""
    hs, ht, targets = rows.hidden, rows.teacher_hidden, rows.targets
    n, vocab, dev = hs.shape[0], student.weight.shape[0], hs.device
    sdt = stat_dtype_for(hs.dtype)

    def zeros():
        return torch.zeros((n,), dtype=sdt, device=dev)

    part = DistillPartials(m_s=zeros() - math.inf, se_s=zeros(), sez_s=zeros(),
                          zy=torch.zeros(targets.shape, dtype=sdt, device=dev))
    if teacher is not None:
        part.sgap, part.m_t, part.se_t, part.tez, part.tgap = zeros(), zeros() - math.inf, zeros(), zeros(), zeros()
    for block in plan.vocab_blocks(vocab):
        start, end = block.start, block.stop
        zs = _logits(student, hs, plan, start, end)
        m = torch.maximum(part.m_s, zs.amax(dim=1))
        rescale = torch.exp(part.m_s - m)
        es = torch.exp(zs - m[:, None])
        se_old = part.se_s
        part.se_s = se_old * rescale + es.sum(dim=1)
        part.sez_s = part.sez_s * rescale + (es * zs).sum(dim=1)
        if targets.shape[1]:
            part.zy = _gather_targets(part.zy, zs, targets, start, end)
        if teacher is None:
            part.m_s = m
            continue
        zt = _logits(teacher, ht, plan, start, end)
        mt = torch.maximum(part.m_t, zt.amax(dim=1))
        rescale_t = torch.exp(part.m_t - mt)
        et = torch.exp(zt - mt[:, None])
        # Moving either maximum shifts every earlier centred gap by the same amount.
        shift = _moved(part.m_s, m) - _moved(part.m_t, mt)
        gap = (zs - m[:, None]) - (zt - mt[:, None])  # [n, v], centred: O(KL), not O(|z|)
        part.sgap = (part.sgap + se_old * shift) * rescale + (es * gap).sum(dim=1)
        part.tgap = (part.tgap - part.se_t * shift) * rescale_t - (et * gap).sum(dim=1)
        part.se_t = part.se_t * rescale_t + et.sum(dim=1)
        part.tez = part.tez * rescale_t + (et * zt).sum(dim=1)
        part.m_s, part.m_t = m, mt
    return part


def _moved(old_max: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """``old_max - new_max``, 0 where nothing was summed yet (``old_max = -inf``)."""
    return torch.where(torch.isfinite(old_max), old_max - new_max, 0.0)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(β q + (1 - β) p)`` elementwise (TRL's mixture)."""
    return torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))


def chunk_jsd(student: LocalHead, teacher: LocalHead, rows: DistillRows, plan: ChunkPlan, lse_s: torch.Tensor,
              lse_t: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Second pass of the generalized JSD for one token chunk, given both final ``lse [n]``.

    Returns:
        ``(jsd [n], kl_pm [n])`` with ``kl_pm = KL(p‖m)`` (the backward needs it).
    """
    jsd = torch.zeros_like(lse_s)
    kl_pm = torch.zeros_like(lse_s)
    for block in plan.vocab_blocks(student.weight.shape[0]):
        start, end = block.start, block.stop
        log_p = _logits(student, rows.hidden, plan, start, end) - lse_s[:, None]
        log_q = _logits(teacher, rows.teacher_hidden, plan, start, end) - lse_t[:, None]
        log_m = _log_mixture(log_p, log_q, beta)
        kl_p = (torch.exp(log_p) * (log_p - log_m)).sum(dim=1)
        kl_q = (torch.exp(log_q) * (log_q - log_m)).sum(dim=1)
        jsd += beta * kl_q + (1 - beta) * kl_p
        kl_pm += kl_p
    return jsd, kl_pm


def chunk_backward(student: LocalHead, teacher: LocalHead | None, rows: DistillRows, plan: ChunkPlan,
                   beta: float | None, saved: DistillSaved, g: DistillGrads,
                   acc: Accumulators) -> torch.Tensor | None:
    """Student gradients of one token chunk, recomputing both sides' logits block by block.

    With ``p = softmax(zs)``, ``q = softmax(zt)``, ``c = Σ p zs``, ``d = log p - log q``:
    ``dz_v = p_v (g_lse - Σ_j g_logp_j - g_entropy (zs_v - c) + g_rkl (d_v - KL(p‖q))
    + g_jsd (1-β)(log p_v - log m_v - KL(p‖m))) + g_fkl (p_v - q_v) + Σ_j g_logp_j [v = y_j]``,
    then the chain rule through the student's transform.

    Args:
        acc: ``d weight``/``d bias`` accumulators (statistics dtype) updated in place;
            ``acc.hidden``: return ``d hidden``.

    Returns:
        ``[n, H_s]`` gradient w.r.t. ``rows.hidden`` in the statistics dtype, or ``None``.
    """
    hs, ht, targets = rows.hidden, rows.teacher_hidden, rows.targets
    n, vocab = hs.shape[0], student.weight.shape[0]
    sdt = saved.lse.dtype
    mm_dtype = hs.dtype if hs.device.type == "cuda" else sdt
    coef = p_coefficient(g, saved, beta)
    teacher_needed = g.teacher_terms()
    grad_hidden = torch.zeros((n, hs.shape[1]), dtype=sdt, device=hs.device) if acc.hidden else None
    h_mm = hs.to(mm_dtype)
    for block in plan.vocab_blocks(vocab):
        start, end = block.start, block.stop
        zs = _logits(student, hs, plan, start, end)
        log_p = zs - saved.lse[:, None]
        p = torch.exp(log_p)
        a = coef[:, None].expand_as(zs).clone()  # dz = p * a (+ teacher terms, + target scatter)
        if g.entropy is not None:
            a -= g.entropy[:, None] * (zs - saved.sum_pz[:, None])
        if teacher_needed:
            log_q = _logits(teacher, ht, plan, start, end) - saved.teacher_lse[:, None]
            if g.reverse_kl is not None:
                a += g.reverse_kl[:, None] * (log_p - log_q)
            if g.jsd is not None:
                log_m = _log_mixture(log_p, log_q, beta)
                a += (g.jsd * (1 - beta))[:, None] * (log_p - log_m)
                del log_m
        dz = p * a
        del a
        if g.forward_kl is not None:
            dz += g.forward_kl[:, None] * (p - torch.exp(log_q))
        if teacher_needed:
            del log_q
        if g.logp is not None:
            in_block = (targets >= start) & (targets < end)
            r, c = in_block.nonzero(as_tuple=True)
            dz.index_put_((r, targets[r, c] - start), g.logp[r, c], accumulate=True)
        dy = student.transform.grad_to_raw(dz, zs)
        del zs, p, log_p, dz
        apply_block_grad(dy, student.weight[start:end], h_mm, block, grad_hidden, acc)
    return grad_hidden


def p_coefficient(g: DistillGrads, saved: DistillSaved, beta: float | None) -> torch.Tensor:
    """The per-token part of ``dz`` that multiplies ``p`` (``[n]``): ``g_lse - Σ_j g_logp_j
    - g_rkl KL(p‖q) - g_jsd (1-β) KL(p‖m)``. The entropy and reverse-KL terms' elementwise parts
    stay with their partners: folding the O(|z|) ``sum_pz``/``lse`` into this constant would
    cancel them against ``zs`` in fp32."""
    coef = torch.zeros_like(saved.lse)
    if g.lse is not None:
        coef = coef + g.lse
    if g.logp is not None:
        coef = coef - g.logp.sum(dim=1)
    if g.reverse_kl is not None:
        coef = coef - g.reverse_kl * saved.reverse_kl
    if g.jsd is not None:
        coef = coef - g.jsd * (1 - beta) * saved.kl_pm
    return coef


def plan_for(n_tokens: int, vocab: int, options: PassOptions, dtype: torch.dtype, gemm: bool = False) -> ChunkPlan:
    """Block sizes of a distillation pass within ``options.chunk_bytes`` of workspace: the
    torch backend's plan with ``_WORKSPACE_ARRAYS`` times the single-head pass's bytes per
    element, or (``gemm``) two fp16 tiles, the student's and the teacher's."""
    if gemm:
        return ChunkPlan.make(n_tokens, vocab, options.budget, dtype, "gemm", options.fp32_logits, arrays=2)
    return ChunkPlan.make(n_tokens, vocab, options.budget, dtype, "torch", options.fp32_logits,
                          arrays=_WORKSPACE_ARRAYS)


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
    """A two-head :class:`~logitless.ops.engine.PassKind`: the student ``head`` (differentiable)
    and a frozen ``teacher`` (``None``: the student's statistics and target log-probs only)."""

    head: LocalHead
    teacher: LocalHead | None
    teacher_hidden: torch.Tensor | None  # [n, H_t], detached
    targets: torch.Tensor  # [n, k] int64, local to the head's rows (another rank's ids fall outside)
    jsd_beta: float | None
    plan: ChunkPlan
    gemm: bool = False  # run on the GEMM-epilogue kernels (:mod:`.distill_gemm`)

    DIFFERENTIABLE = ("lse", "logp", "entropy", "forward_kl", "reverse_kl", "jsd")
    zero_rows = None  # every counted token of a distillation loss has a gradient

    @classmethod
    def make(cls, hidden: torch.Tensor, head: Head, targets: torch.Tensor, teacher_hidden: torch.Tensor | None,
             teacher: Head | None, jsd_beta: float | None, options: PassOptions) -> DistillPass:
        """``targets`` are global ids; a shard must be on both heads, laid out alike (:func:`check_shards`).

        Raises:
            ValueError: an adapter on either head; shards of different layouts, or on one head
                only; ``jsd_beta`` outside ``(0, 1)`` or without a teacher; a teacher of other
                rows or tokens than the student's."""
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
        gemm = resolve_backend(options.impl, hidden).NAME == "gemm" and targets.shape[1] <= 1 and (
            teacher_hidden is None or teacher_hidden.dtype == hidden.dtype)
        return cls(local, local_teacher, teacher_hidden, local.local_targets(targets.long()), jsd_beta,
                   plan_for(n, local.weight.shape[0], options, hidden.dtype, gemm), gemm)

    @property
    def stores_weight_grad(self) -> bool:
        return self.gemm

    @property
    def pairs_weight_grad(self) -> bool:
        return self.gemm

    def fields_present(self) -> tuple[bool, ...]:
        t = self.teacher is not None
        return True, True, True, t, t, self.jsd_beta is not None, t, t

    def rows(self, hidden: torch.Tensor, sl: slice, low: LowRank | None) -> DistillRows:
        th = None if self.teacher_hidden is None else self.teacher_hidden[sl]
        return DistillRows(hidden[sl], self.targets[sl], th)

    def _forward(self, rows: DistillRows, plan: ChunkPlan, keep: bool) -> tuple[DistillPartials, object | None]:
        if self.gemm:
            from .gemm_backend import distill as distill_gemm

            return distill_gemm.chunk_forward(self.head, self.teacher, rows, plan, keep)
        return chunk_forward(self.head, self.teacher, rows, plan), None

    def chunk_stats(self, rows: DistillRows, plan: ChunkPlan,
                    keep_logits: bool) -> tuple[DistillStats, DistillSaved, object | None]:
        """A chunk's statistics over the full vocabulary (both passes, reduced over the group);
        logits are kept only on the gemm kernels (the torch functions recompute both sides)."""
        with no_autocast(rows.hidden.device):
            part, kept = self._forward(rows, plan, keep_logits)
            part = part.reduce(self.head.group)
            return (*self._finish(part, rows, plan, reduce_jsd=True, kept=kept), kept)

    def _finish(self, part: DistillPartials, rows: DistillRows, plan: ChunkPlan,
                reduce_jsd: bool, kept: object | None = None) -> tuple[DistillStats, DistillSaved]:
        """Statistics from full-vocabulary partials, running the JSD pass (its per-rank sums
        reduced over the group only with ``reduce_jsd``)."""
        out = part.finalize()
        jsd = kl_pm = None
        if self.jsd_beta is not None:
            if self.gemm:
                from .gemm_backend import distill as distill_gemm

                jsd, kl_pm = distill_gemm.chunk_jsd(self.head, self.teacher, rows, plan, out["lse"],
                                                    out["teacher_lse"], self.jsd_beta, kept)
            else:
                jsd, kl_pm = chunk_jsd(self.head, self.teacher, rows, plan, out["lse"], out["teacher_lse"],
                                       self.jsd_beta)
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
                             None if self.jsd_beta is None else torch.empty(n, dtype=sdt, device=dev))
        chunks = self.plan.chunks(n)
        parts = DistillPartials.empty(n, self.targets.shape[1], self.teacher is not None, sdt, dev)
        with no_autocast(dev):
            for sl in chunks:
                parts.write(sl, self._forward(self.rows(hidden, sl, low), self.plan, keep=False)[0])
            parts = parts.reduce(self.head.group)
            for sl in chunks:
                part, part_saved = self._finish(parts.rows(sl), self.rows(hidden, sl, low), self.plan,
                                                reduce_jsd=False)
                for dst, src in ((stats, part), (saved, part_saved)):
                    for d, s in zip(dst, src, strict=True):
                        if d is not None:
                            d[sl] = s
                del part, part_saved
        if self.jsd_beta is not None and is_active(self.head.group):
            total = all_reduce(torch.stack([stats.jsd, saved.kl_pm]), "sum", self.head.group)
            stats.jsd.copy_(total[0])
            saved.kl_pm.copy_(total[1])
        return stats, saved

    def grads_of(self, named: dict[str, torch.Tensor]) -> DistillGrads:
        return DistillGrads(**named)

    def backward(self, rows: DistillRows, plan: ChunkPlan, saved: DistillSaved, grads: DistillGrads,
                 acc: Accumulators, kept: object | None) -> torch.Tensor | None:
        with no_autocast(rows.hidden.device):
            if self.gemm:
                from .gemm_backend import distill as distill_gemm

                return distill_gemm.chunk_backward(self.head, self.teacher, rows, plan, self.jsd_beta, saved, grads,
                                                   acc, kept)
            return chunk_backward(self.head, self.teacher, rows, plan, self.jsd_beta, saved, grads, acc)


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
