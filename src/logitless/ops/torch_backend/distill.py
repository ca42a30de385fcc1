"""Distillation in plain tensor operations (CPU and any GPU): the specification of
:class:`~logitless.ops.distill_contract.DistillBackend`, which the kernel backends are tested
against and which runs every input they do not take.

Both heads' logits are computed block by block (:func:`~.backend.logits_block`: fp32 GEMM outputs
on GPUs) and recomputed in the backward: nothing is kept between passes.
"""

from __future__ import annotations

import math

import torch

from ..contract import Accumulators, LocalHead
from ..distill_contract import (
    DistillGrads,
    DistillHeads,
    DistillPartials,
    DistillRows,
    DistillSaved,
    DistillScope,
    max_moved,
    p_coefficient,
)
from ..plan import ChunkPlan, PassOptions, stat_dtype_for
from .backend import CAPS as CAPS
from .backend import apply_block_grad, logits_block

SCOPE = DistillScope()

# [n, v] arrays alive at a block's peak (both sides' logits, their exponentials / probabilities,
# the mixture and product temporaries, dz, dy), in units of the single-head pass's workspace
# per element (3 statistics-dtype arrays + one input-dtype array).
_WORKSPACE_ARRAYS = 3


def plan_for(n_tokens: int, vocab: int, options: PassOptions, dtype: torch.dtype) -> ChunkPlan:
    """The torch backend's plan with ``_WORKSPACE_ARRAYS`` times the single-head pass's bytes per element."""
    return ChunkPlan.make(n_tokens, vocab, options.budget, dtype, "torch", options.fp32_logits,
                          arrays=_WORKSPACE_ARRAYS)


def _logits(head: LocalHead, hidden: torch.Tensor, plan: ChunkPlan, start: int, end: int) -> torch.Tensor:
    bias = None if head.bias is None else head.bias[start:end]
    return logits_block(hidden, head.weight[start:end], bias, head.transform, plan)


def _gather_targets(zy: torch.Tensor, z: torch.Tensor, targets: torch.Tensor, start: int, end: int) -> torch.Tensor:
    in_block = (targets >= start) & (targets < end)
    local = (targets - start).clamp(0, end - start - 1)
    return torch.where(in_block, z.gather(1, local), zy)


def chunk_forward(heads: DistillHeads, rows: DistillRows, plan: ChunkPlan,
                  keep: bool) -> tuple[DistillPartials, None]:
    """First pass over all vocabulary rows for one token chunk (the teacher's sums only with a
    teacher); no logits are kept."""
    student, teacher = heads.student, heads.teacher
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
        shift = max_moved(part.m_s, m) - max_moved(part.m_t, mt)
        gap = (zs - m[:, None]) - (zt - mt[:, None])  # [n, v], centred: O(KL), not O(|z|)
        part.sgap = (part.sgap + se_old * shift) * rescale + (es * gap).sum(dim=1)
        part.tgap = (part.tgap - part.se_t * shift) * rescale_t - (et * gap).sum(dim=1)
        part.se_t = part.se_t * rescale_t + et.sum(dim=1)
        part.tez = part.tez * rescale_t + (et * zt).sum(dim=1)
        part.m_s, part.m_t = m, mt
    return part, None


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(β q + (1 - β) p)`` elementwise (TRL's mixture)."""
    return torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))


def chunk_jsd(heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, lse: torch.Tensor, teacher_lse: torch.Tensor,
              kept: None) -> tuple[torch.Tensor, torch.Tensor]:
    """Second pass of the generalized JSD for one token chunk, given both final ``lse [n]``.

    Returns:
        ``(jsd [n], kl_pm [n])`` with ``kl_pm = KL(p‖m)`` (the backward needs it).
    """
    student, teacher, beta = heads.student, heads.teacher, heads.beta
    jsd = torch.zeros_like(lse)
    kl_pm = torch.zeros_like(lse)
    for block in plan.vocab_blocks(student.weight.shape[0]):
        start, end = block.start, block.stop
        log_p = _logits(student, rows.hidden, plan, start, end) - lse[:, None]
        log_q = _logits(teacher, rows.teacher_hidden, plan, start, end) - teacher_lse[:, None]
        log_m = _log_mixture(log_p, log_q, beta)
        kl_p = (torch.exp(log_p) * (log_p - log_m)).sum(dim=1)
        kl_q = (torch.exp(log_q) * (log_q - log_m)).sum(dim=1)
        jsd += beta * kl_q + (1 - beta) * kl_p
        kl_pm += kl_p
    return jsd, kl_pm


def chunk_backward(heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, saved: DistillSaved, g: DistillGrads,
                   acc: Accumulators, kept: None) -> torch.Tensor | None:
    """Student gradients of one token chunk, recomputing both sides' logits block by block.

    With ``p = softmax(zs)``, ``q = softmax(zt)``, ``c = Σ p zs``, ``d = log p - log q``:
    ``dz_v = p_v (g_lse - Σ_j g_logp_j - g_entropy (zs_v - c) + g_rkl (d_v - KL(p‖q))
    + g_jsd (1-β)(log p_v - log m_v - KL(p‖m))) + g_fkl (p_v - q_v) + Σ_j g_logp_j [v = y_j]``,
    then the chain rule through the student's transform.

    Args:
        acc: ``d weight``/``d bias`` accumulators (statistics dtype), added to in place;
            ``acc.hidden``: return ``d hidden``.

    Returns:
        ``[n, H_s]`` gradient w.r.t. ``rows.hidden`` in the statistics dtype, or ``None``.
    """
    student, teacher, beta = heads.student, heads.teacher, heads.beta
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
