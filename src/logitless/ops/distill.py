"""Distillation statistics: a student's and a teacher's softmax folded in the same vocabulary pass.

The student's logits ``zs = Ts(hs Wsᵀ + bs)`` and the teacher's ``zt = Tt(ht Wtᵀ + bt)`` (each
with its own :class:`LogitTransform`: temperature, scale, soft-cap) are computed block by block
over the same vocabulary rows; neither ``[N, V]`` tensor exists. With ``p = softmax(zs)`` and
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

Partials are kept as (running max, sums) per side, so under vocabulary parallelism a shard's
partials can be combined with one all-reduce MAX and one all-reduce SUM (after rescaling by
``exp(m_local - m_global)``), and the JSD pass is a plain SUM; the distributed part is not
implemented here.

Recompute mode: the forward saves O(N) statistics; the backward recomputes both sides' logits
block by block. Gradients flow to the student only (the teacher is frozen). Workspace per block
is bounded by ``chunk_bytes``. Torch backend only (runs on any device PyTorch runs on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .backend import Accumulators
from .engine import no_autocast
from .plan import ChunkPlan, stat_dtype_for
from .settings import settings
from .torch_backend import apply_block_grad, logits_block
from .transform import LogitTransform

# [n, v] arrays in the statistics dtype alive at a block's peak (both sides' logits, their
# exponentials / probabilities, the mixture and product temporaries, dz, dy).
_WORKSPACE_ARRAYS = 10


@dataclass(frozen=True)
class DistillSpec:
    """Scalars of one distillation pass (internal; built by :func:`distill_stats`).

    Attributes:
        student: the student's :class:`LogitTransform`.
        teacher: the teacher's :class:`LogitTransform` (unused without a teacher).
        jsd_beta: ``β`` of the generalized JSD to compute in a second pass, or ``None``.
        plan: block sizes.
    """

    student: LogitTransform
    teacher: LogitTransform
    jsd_beta: float | None
    plan: ChunkPlan


class DistillStats(NamedTuple):
    """Per-token statistics of a distillation pass (fp32, fp64 for fp64 inputs; nats).

    ``lse``, ``entropy``, ``forward_kl``, ``reverse_kl``, ``jsd`` are ``[n]``; ``logp`` is
    ``[n, k]`` (``k = 0`` without targets; columns whose id is outside ``[0, V)`` hold
    ``-lse``, differentiated as such: mask them in the loss); ``teacher_lse``/``teacher_entropy`` are ``[n]`` without
    gradient. Teacher-dependent fields are zeros when no teacher was given, ``jsd`` zeros unless
    requested. Every differentiable field carries its gradient to the student's hidden, weight
    and bias.
    """

    lse: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    forward_kl: torch.Tensor
    reverse_kl: torch.Tensor
    jsd: torch.Tensor
    teacher_lse: torch.Tensor
    teacher_entropy: torch.Tensor


@dataclass
class DistillPartials:
    """Running partials of one token chunk over a vocabulary range (all ``[n]`` but ``zy``).

    Student: ``m_s`` max, ``se_s = Σ exp(zs - m_s)``, ``sez_s = Σ exp(zs - m_s) zs``,
    ``sgap = Σ exp(zs - m_s)(zs - zt)``, ``zy [n, k]`` the targets' logits (0 where not owned).
    Teacher (``None`` without one): ``m_t``, ``se_t``, ``tez = Σ exp(zt - m_t) zt``,
    ``tgap = Σ exp(zt - m_t)(zt - zs)``.
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

    def finalize(self) -> dict[str, torch.Tensor]:
        """Per-token statistics from the partials (see :class:`DistillStats`)."""
        lse = self.m_s + torch.log(self.se_s)
        out = {"lse": lse, "logp": self.zy - lse[:, None], "sum_pz": self.sez_s / self.se_s}
        out["entropy"] = lse - out["sum_pz"]
        if self.m_t is not None:
            lse_t = self.m_t + torch.log(self.se_t)
            out["teacher_lse"] = lse_t
            out["teacher_entropy"] = lse_t - self.tez / self.se_t
            out["forward_kl"] = self.tgap / self.se_t - lse_t + lse
            out["reverse_kl"] = self.sgap / self.se_s - lse + lse_t
        return out


def plan_for(n_tokens: int, vocab: int, chunk_bytes: int | None, dtype: torch.dtype) -> ChunkPlan:
    """Block sizes of a distillation pass within ``chunk_bytes`` of workspace: the library's
    plan for a budget scaled down so that ``_WORKSPACE_ARRAYS`` arrays fit instead of the
    single-softmax pass's.

    Raises:
        ValueError: ``chunk_bytes <= 0``.
    """
    budget = settings().chunk_bytes if chunk_bytes is None else int(chunk_bytes)
    if budget <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes!r}")
    sdt = stat_dtype_for(dtype)
    single = ChunkPlan.make(1, 1, budget, dtype).bytes_per_logit
    ours = _WORKSPACE_ARRAYS * torch.finfo(sdt).bits // 8
    return ChunkPlan.make(n_tokens, vocab, max(1, budget * single // ours), dtype, "torch")


def _blocks(vocab: int, plan: ChunkPlan):
    for start in range(0, vocab, plan.vocab_block):
        yield start, min(start + plan.vocab_block, vocab)


def _bias(b: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if b is None else b[start:end]


def _gather_targets(zy: torch.Tensor, z: torch.Tensor, targets: torch.Tensor, start: int, end: int) -> torch.Tensor:
    in_block = (targets >= start) & (targets < end)
    local = (targets - start).clamp(0, end - start - 1)
    return torch.where(in_block, z.gather(1, local), zy)


def chunk_forward(hs, ws, bs, ht, wt, bt, targets: torch.Tensor, spec: DistillSpec,
                  stat_dtype: torch.dtype) -> DistillPartials:
    """First pass over all vocabulary rows for one token chunk.

    Args:
        hs, ws, bs: student ``[n, H_s]``, ``[V, H_s]``, ``[V]`` or ``None``.
        ht, wt, bt: teacher ``[n, H_t]``, ``[V, H_t]``, ``[V]`` or ``None``; ``ht`` ``None``: no teacher.
        targets: ``[n, k]`` int64 ids; values outside ``[0, V)`` are not gathered.

    Returns:
        :class:`DistillPartials` of the chunk.
    """
    n, vocab, dev = hs.shape[0], ws.shape[0], hs.device
    teacher = ht is not None

    def zeros():
        return torch.zeros((n,), dtype=stat_dtype, device=dev)

    part = DistillPartials(m_s=zeros() - math.inf, se_s=zeros(), sez_s=zeros(),
                          zy=torch.zeros(targets.shape, dtype=stat_dtype, device=dev))
    if teacher:
        part.sgap, part.m_t, part.se_t, part.tez, part.tgap = zeros(), zeros() - math.inf, zeros(), zeros(), zeros()
    for start, end in _blocks(vocab, spec.plan):
        zs = logits_block(hs, ws[start:end], _bias(bs, start, end), spec.student)
        m = torch.maximum(part.m_s, zs.amax(dim=1))
        rescale = torch.exp(part.m_s - m)
        es = torch.exp(zs - m[:, None])
        part.se_s = part.se_s * rescale + es.sum(dim=1)
        part.sez_s = part.sez_s * rescale + (es * zs).sum(dim=1)
        part.m_s = m
        if targets.shape[1]:
            part.zy = _gather_targets(part.zy, zs, targets, start, end)
        if not teacher:
            continue
        zt = logits_block(ht, wt[start:end], _bias(bt, start, end), spec.teacher)
        gap = zt - zs  # [n, v]
        del zs
        part.sgap = part.sgap * rescale - (es * gap).sum(dim=1)
        del es
        mt = torch.maximum(part.m_t, zt.amax(dim=1))
        rescale_t = torch.exp(part.m_t - mt)
        et = torch.exp(zt - mt[:, None])
        part.se_t = part.se_t * rescale_t + et.sum(dim=1)
        part.tez = part.tez * rescale_t + (et * zt).sum(dim=1)
        part.tgap = part.tgap * rescale_t + (et * gap).sum(dim=1)
        part.m_t = mt
    return part


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(β q + (1 - β) p)`` elementwise (TRL's mixture)."""
    return torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))


def chunk_jsd(hs, ws, bs, ht, wt, bt, lse_s: torch.Tensor, lse_t: torch.Tensor, spec: DistillSpec,
              stat_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Second pass of the generalized JSD for one token chunk, given both final ``lse [n]``.

    Returns:
        ``(jsd [n], kl_pm [n])`` with ``kl_pm = KL(p‖m)`` (the backward needs it).
    """
    beta = spec.jsd_beta
    jsd = torch.zeros_like(lse_s)
    kl_pm = torch.zeros_like(lse_s)
    for start, end in _blocks(ws.shape[0], spec.plan):
        log_p = logits_block(hs, ws[start:end], _bias(bs, start, end), spec.student) - lse_s[:, None]
        log_q = logits_block(ht, wt[start:end], _bias(bt, start, end), spec.teacher) - lse_t[:, None]
        log_m = _log_mixture(log_p, log_q, beta)
        kl_p = (torch.exp(log_p) * (log_p - log_m)).sum(dim=1)
        kl_q = (torch.exp(log_q) * (log_q - log_m)).sum(dim=1)
        jsd += beta * kl_q + (1 - beta) * kl_p
        kl_pm += kl_p
    return jsd, kl_pm


@dataclass
class ChunkGrads:
    """Per-token gradients of one chunk's statistics (``None`` = zero) and the forward's saved
    statistics the backward needs."""

    lse: torch.Tensor  # [n] student lse
    sum_pz: torch.Tensor  # [n] Σ p zs
    lse_t: torch.Tensor | None  # [n]
    reverse_kl: torch.Tensor | None  # [n]
    kl_pm: torch.Tensor | None  # [n]
    g_lse: torch.Tensor | None = None
    g_logp: torch.Tensor | None = None  # [n, k]
    g_entropy: torch.Tensor | None = None
    g_fkl: torch.Tensor | None = None
    g_rkl: torch.Tensor | None = None
    g_jsd: torch.Tensor | None = None


def chunk_backward(hs, ws, bs, ht, wt, bt, targets: torch.Tensor, spec: DistillSpec, g: ChunkGrads,
                   grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None,
                   need_grad_hidden: bool) -> torch.Tensor | None:
    """Student gradients of one token chunk, recomputing both sides' logits block by block.

    With ``p = softmax(zs)``, ``q = softmax(zt)``, ``c = Σ p zs``, ``d = log p - log q``:
    ``dz_v = p_v (g_lse - Σ_j g_logp_j - g_entropy (zs_v - c) + g_rkl (d_v - KL(p‖q))
    + g_jsd (1-β)(log p_v - log m_v - KL(p‖m))) + g_fkl (p_v - q_v) + Σ_j g_logp_j [v = y_j]``,
    then the chain rule through the student's transform.

    Args:
        grad_weight: ``[V, H_s]`` accumulator (statistics dtype) updated in place, or ``None``.
        grad_bias: ``[V]`` accumulator updated in place, or ``None``.

    Returns:
        ``[n, H_s]`` gradient w.r.t. ``hs`` in the statistics dtype, or ``None``.
    """
    n, vocab = hs.shape[0], ws.shape[0]
    sdt = g.lse.dtype
    mm_dtype = hs.dtype if hs.device.type == "cuda" else sdt
    coef = torch.zeros_like(g.lse)  # multiplies p
    if g.g_lse is not None:
        coef = coef + g.g_lse
    if g.g_logp is not None:
        coef = coef - g.g_logp.sum(dim=1)
    if g.g_entropy is not None:
        coef = coef + g.g_entropy * g.sum_pz
    if g.g_rkl is not None:
        coef = coef - g.g_rkl * (g.lse + g.reverse_kl)
    if g.g_jsd is not None:
        coef = coef - g.g_jsd * (1 - spec.jsd_beta) * g.kl_pm
    teacher_needed = g.g_fkl is not None or g.g_rkl is not None or g.g_jsd is not None
    grad_hidden = torch.zeros((n, hs.shape[1]), dtype=sdt, device=hs.device) if need_grad_hidden else None
    h_mm = hs.to(mm_dtype)
    for start, end in _blocks(vocab, spec.plan):
        w = ws[start:end]
        zs = logits_block(hs, w, _bias(bs, start, end), spec.student)
        log_p = zs - g.lse[:, None]
        p = torch.exp(log_p)
        a = coef[:, None].expand_as(zs).clone()  # dz = p * a (+ teacher terms, + target scatter)
        if g.g_entropy is not None:
            a -= g.g_entropy[:, None] * zs
        if teacher_needed:
            log_q = logits_block(ht, wt[start:end], _bias(bt, start, end), spec.teacher) - g.lse_t[:, None]
            if g.g_rkl is not None:
                a += g.g_rkl[:, None] * (zs - log_q)  # log p - log q = zs - log q - lse_s (lse_s in coef)
            if g.g_jsd is not None:
                log_m = _log_mixture(log_p, log_q, spec.jsd_beta)
                a += (g.g_jsd * (1 - spec.jsd_beta))[:, None] * (log_p - log_m)
                del log_m
        dz = p * a
        del a
        if g.g_fkl is not None:
            dz += g.g_fkl[:, None] * (p - torch.exp(log_q))
        if teacher_needed:
            del log_q
        if g.g_logp is not None:
            in_block = (targets >= start) & (targets < end)
            rows, cols = in_block.nonzero(as_tuple=True)
            dz.index_put_((rows, targets[rows, cols] - start), g.g_logp[rows, cols], accumulate=True)
        dy = spec.student.grad_to_raw(dz, zs)
        del zs, p, log_p, dz
        apply_block_grad(dy, w, h_mm, slice(start, end), grad_hidden, Accumulators(grad_weight, grad_bias))
    return grad_hidden


def _token_chunks(n: int, plan: ChunkPlan):
    for start in range(0, n, plan.token_chunk):
        yield slice(start, min(start + plan.token_chunk, n))


def _sl(x: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    return None if x is None else x[sl]


class _DistillFn(torch.autograd.Function):
    """Recompute mode: forward keeps O(N) statistics, backward recomputes logits blockwise."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, targets, spec: DistillSpec):
        sdt = stat_dtype_for(hs.dtype)
        teacher = ht is not None
        n = hs.shape[0]
        # Written in place: per-chunk results kept alive between the blocks' large temporaries
        # would pin the top of the C heap and keep it from shrinking (RSS grows with N on CPU).
        cat: dict[str, torch.Tensor] = {}
        with no_autocast(hs.device):
            for sl in _token_chunks(n, spec.plan):
                part = chunk_forward(hs[sl], ws, bs, _sl(ht, sl), wt, bt, targets[sl], spec, sdt)
                out = part.finalize()
                del part
                if teacher and spec.jsd_beta is not None:
                    out["jsd"], out["kl_pm"] = chunk_jsd(hs[sl], ws, bs, ht[sl], wt, bt, out["lse"],
                                                         out["teacher_lse"], spec, sdt)
                for k, v in out.items():
                    if k not in cat:
                        cat[k] = v.new_empty((n, *v.shape[1:]))
                    cat[k][sl] = v
                del out
        zero = hs.new_zeros(n, dtype=sdt)
        lse = cat.get("lse", zero)
        logp = cat.get("logp", hs.new_zeros((n, targets.shape[1]), dtype=sdt))
        entropy = cat.get("entropy", zero)
        fkl, rkl, jsd = (cat.get(k, zero.clone()) for k in ("forward_kl", "reverse_kl", "jsd"))
        lse_t, ent_t = (cat.get(k, zero.clone()) for k in ("teacher_lse", "teacher_entropy"))
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, targets, lse, cat.get("sum_pz", zero),
                              lse_t if teacher else None, rkl if teacher else None, cat.get("kl_pm"))
        ctx.spec = spec
        ctx.mark_non_differentiable(lse_t, ent_t)
        if not teacher:
            ctx.mark_non_differentiable(fkl, rkl, jsd)
        elif spec.jsd_beta is None:
            ctx.mark_non_differentiable(jsd)
        return lse, logp, entropy, fkl, rkl, jsd, lse_t, ent_t

    @staticmethod
    def backward(ctx, g_lse, g_logp, g_entropy, g_fkl, g_rkl, g_jsd, _g_lse_t, _g_ent_t):
        hs, ws, bs, ht, wt, bt, targets, lse, sum_pz, lse_t, rkl, kl_pm = ctx.saved_tensors
        spec: DistillSpec = ctx.spec
        if ht is None:
            g_fkl = g_rkl = g_jsd = None
        if kl_pm is None:
            g_jsd = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        sdt = lse.dtype
        grad_weight = torch.zeros(ws.shape, dtype=sdt, device=ws.device) if need_w else None
        grad_bias = torch.zeros(ws.shape[0], dtype=sdt, device=ws.device) if need_b else None
        grad_hidden = torch.empty_like(hs) if need_h else None
        with no_autocast(hs.device):
            for sl in _token_chunks(hs.shape[0], spec.plan):
                g = ChunkGrads(lse=lse[sl], sum_pz=sum_pz[sl], lse_t=_sl(lse_t, sl), reverse_kl=_sl(rkl, sl),
                               kl_pm=_sl(kl_pm, sl), g_lse=_sl(g_lse, sl), g_logp=_sl(g_logp, sl),
                               g_entropy=_sl(g_entropy, sl), g_fkl=_sl(g_fkl, sl), g_rkl=_sl(g_rkl, sl),
                               g_jsd=_sl(g_jsd, sl))
                gh = chunk_backward(hs[sl], ws, bs, _sl(ht, sl), wt, bt, targets[sl], spec, g, grad_weight,
                                    grad_bias, need_h)
                if need_h:
                    grad_hidden[sl] = gh
        return (grad_hidden, None if grad_weight is None else grad_weight.to(ws.dtype),
                None if grad_bias is None else grad_bias.to(bs.dtype), None, None, None, None, None)


def distill_stats(
    hidden: torch.Tensor,  # [n, H_s]
    weight: torch.Tensor,  # [V, H_s]
    targets: torch.Tensor | None = None,  # [n, k]
    *,
    bias: torch.Tensor | None = None,  # [V]
    transform: LogitTransform | None = None,
    teacher_hidden: torch.Tensor | None = None,  # [n, H_t]
    teacher_weight: torch.Tensor | None = None,  # [V, H_t]
    teacher_bias: torch.Tensor | None = None,  # [V]
    teacher_transform: LogitTransform | None = None,
    jsd_beta: float | None = None,
    chunk_bytes: int | None = None,
) -> DistillStats:
    """Student (and teacher) statistics of one blocked vocabulary pass, differentiable w.r.t. the
    student's ``hidden``, ``weight`` and ``bias`` (recompute mode, O(n) saved state).

    Inputs are used as given (callers validate: see ``objectives/distill.py``): both heads must
    have the same number of rows ``V`` (cut them to a common vocabulary first); the teacher's
    tensors are detached (frozen teacher).

    Args:
        hidden, weight, bias: the student head's inputs.
        targets: ``[n, k]`` int64 ids whose student log-probs to return (``None``: ``k = 0``).
        transform: the student's :class:`LogitTransform` (default identity).
        teacher_hidden, teacher_weight, teacher_bias: the teacher's head, or ``None`` (student
            statistics only).
        teacher_transform: the teacher's :class:`LogitTransform` (default: the student's).
        jsd_beta: compute the generalized JSD with this ``β`` in ``(0, 1)`` (second pass).
        chunk_bytes: workspace budget in bytes (default 1 GiB, env ``LOGITLESS_CHUNK_BYTES``).

    Returns:
        :class:`DistillStats`.

    Raises:
        ValueError: ``jsd_beta`` outside ``(0, 1)`` or given without a teacher, mismatched
            teacher shapes, bad ``chunk_bytes``.
    """
    transform = LogitTransform() if transform is None else transform
    teacher_transform = transform if teacher_transform is None else teacher_transform
    n, vocab = hidden.shape[0], weight.shape[0]
    if targets is None:
        targets = torch.zeros((n, 0), dtype=torch.long, device=hidden.device)
    if jsd_beta is not None:
        if teacher_hidden is None:
            raise ValueError("jsd_beta needs a teacher (teacher_hidden / teacher_weight)")
        if not 0.0 < jsd_beta < 1.0:
            raise ValueError(f"jsd_beta must lie in (0, 1) (0 and 1 are the forward / reverse KL), got {jsd_beta!r}")
    if teacher_hidden is not None:
        if teacher_weight is None or teacher_weight.shape[0] != vocab or teacher_hidden.shape[0] != n:
            raise ValueError(f"teacher head must be hidden [{n}, H_t] and weight [{vocab}, H_t], got "
                             f"{tuple(teacher_hidden.shape)} and "
                             f"{None if teacher_weight is None else tuple(teacher_weight.shape)}")
        teacher_hidden = teacher_hidden.detach()
        teacher_weight = teacher_weight.detach()
        teacher_bias = None if teacher_bias is None else teacher_bias.detach()
    spec = DistillSpec(student=transform, teacher=teacher_transform, jsd_beta=jsd_beta,
                       plan=plan_for(n, vocab, chunk_bytes, hidden.dtype))
    out = _DistillFn.apply(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, targets.long(), spec)
    return DistillStats(*out)
