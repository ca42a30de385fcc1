"""Triton row kernels of distillation over two stored tiles (the GEMM-epilogue and CuTe backends).

Both read a student's and a teacher's logits stored by a statistics GEMM (fp16, each tile
centred on its row maximum: :class:`~logitless.ops.triton_shared.centred.CentredTile`), one
program per token row:

* :func:`_cross_kernel`: each (row, tile)'s cross sums ``sgap``/``tgap`` of both KL directions
  (:class:`~logitless.ops.distill_contract.DistillPartials`), the per-tile partials merged like the GEMM's;
* :func:`_jsd_kernel`: the generalized JSD's per-row sums over a vocabulary range once both
  ``lse`` are known (TRL's ``GKDTrainer.generalized_jsd_loss``: ``m = β q + (1 - β) p``,
  ``JSD_β = β KL(q‖m) + (1 - β) KL(p‖m)``);
* :func:`_distill_grad_kernel`: overwrites the student's stored tile with ``dy = dL/dy`` in the
  GEMM dtype, for the ``d hidden``/``d weight`` GEMMs. The formula is that of
  :func:`logitless.ops.torch_backend.distill.chunk_backward` (the specification these kernels are tested against);
* :func:`_forward_kl_kernel`: where the loss's gradient comes through the forward KL alone and
  both ``lse`` are known before the loss (a chunk's whole rows kept), the cross sums of one row
  and its ``p - q`` in one read of both tiles, ``p - q`` over the student's tile: the gradient's
  per-row factor then scales the GEMMs' rows instead of the tile (one read of both tiles fewer
  than :func:`_cross_kernel` then :func:`_distill_grad_kernel`).

Logits are rebuilt as ``stored + tile max``, and ``log p = stored + (tile max - lse)``, so the
O(|z|) parts cancel in one per-tile difference rather than per element.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..transform import LogitTransform
from .centred import CentredTile, row_kernel_config
from .common import raw_grad, transform_args


class DistillRowCoefficients(NamedTuple):
    """Per-token inputs of :func:`launch_distill_grad` (``[n]`` fp32 contiguous; ``None`` = the
    term is absent). ``coef`` multiplies ``p`` (``g_lse - g_logp - g_rkl KL(p‖q) - g_jsd (1-β)
    KL(p‖m)``); ``sum_pz`` comes with ``g_entropy``, ``teacher_lse`` with any teacher term; ``beta``
    is the JSD's mixture weight (with ``g_jsd``)."""

    lse: torch.Tensor
    coef: torch.Tensor
    sum_pz: torch.Tensor | None = None
    g_entropy: torch.Tensor | None = None
    teacher_lse: torch.Tensor | None = None
    g_reverse_kl: torch.Tensor | None = None
    g_forward_kl: torch.Tensor | None = None
    g_jsd: torch.Tensor | None = None
    g_logp: torch.Tensor | None = None
    beta: float | None = None


@triton.jit
def _log_mixture(log_p, log_q, log_1mb, log_b):
    """``log(β q + (1 - β) p)`` from the two log-probabilities; ``-inf`` where both are."""
    a = log_p + log_1mb
    b = log_q + log_b
    top = tl.maximum(a, b)
    safe = tl.where(top == -float("inf"), 0.0, top)
    return safe + tl.log(tl.exp(a - safe) + tl.exp(b - safe))


@triton.jit
def _log_probs(z_row, m_ptr, lse, cols, mask, row, n, TILE_V: tl.constexpr):
    """``(z, log p)`` of one step of a stored row: ``z = stored + m``, ``log p = stored + (m - lse)``."""
    m = tl.load(m_ptr + (cols // TILE_V) * n + row, mask=mask, other=0.0)
    stored = tl.load(z_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
    return stored + m, stored + (m - lse)


@triton.jit
def _cross_kernel(
    zs_ptr, stride_zs,  # student: [n, width] fp16 logits centred per tile
    zt_ptr, stride_zt,  # teacher: the same, over the same tiles
    sgap_ptr, tgap_ptr,  # [tiles, n] fp32 outputs (row stride n)
    n, width,
    TILE_V: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # A step covers BLOCK_V // TILE_V whole tiles, laid out [tiles of the step, TILE_V], so each
    # tile's sums are one reduction along axis 1.
    row = tl.program_id(0).to(tl.int64)
    per_step: tl.constexpr = BLOCK_V // TILE_V
    tile_idx = tl.arange(0, per_step)
    for off in range(0, width, BLOCK_V):
        cols = off + tile_idx[:, None] * TILE_V + tl.arange(0, TILE_V)[None, :]
        mask = cols < width
        cs = tl.load(zs_ptr + row * stride_zs + cols, mask=mask, other=-float("inf")).to(tl.float32)
        ct = tl.load(zt_ptr + row * stride_zt + cols, mask=mask, other=-float("inf")).to(tl.float32)
        es = tl.exp(cs)
        et = tl.exp(ct)
        gap = cs - ct
        # An entry of zero probability on one side adds nothing to that side's sum (0 log 0 = 0),
        # even where the other side's is infinite.
        sgap = tl.sum(tl.where(es > 0.0, es * gap, 0.0), axis=1)
        tgap = -tl.sum(tl.where(et > 0.0, et * gap, 0.0), axis=1)
        tiles = off // TILE_V + tile_idx
        ok = tiles * TILE_V < width
        tl.store(sgap_ptr + tiles * n + row, sgap, mask=ok)
        tl.store(tgap_ptr + tiles * n + row, tgap, mask=ok)


@triton.jit
def _jsd_kernel(
    zs_ptr, stride_zs, ms_ptr,  # student: [n, width] fp16 centred logits, [tiles, n] fp32 tile maxima
    zt_ptr, stride_zt, mt_ptr,  # teacher: the same
    lse_ptr, lse_t_ptr,  # [n] fp32 final log-partition functions
    jsd_ptr, kl_pm_ptr,  # [n] fp32 outputs: this range's part of JSD_β and of KL(p‖m)
    n, width, beta, log_1mb, log_b,
    TILE_V: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    kl_p = tl.zeros([BLOCK_V], dtype=tl.float32)
    kl_q = tl.zeros([BLOCK_V], dtype=tl.float32)
    for off in range(0, width, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < width
        _, log_p = _log_probs(zs_ptr + row * stride_zs, ms_ptr, lse, cols, mask, row, n, TILE_V)
        _, log_q = _log_probs(zt_ptr + row * stride_zt, mt_ptr, lse_t, cols, mask, row, n, TILE_V)
        log_m = _log_mixture(log_p, log_q, log_1mb, log_b)
        p = tl.exp(log_p)
        q = tl.exp(log_q)
        # 0 log 0 = 0: entries of zero probability (and the masked tail) add nothing.
        kl_p += tl.where(p > 0.0, p * (log_p - log_m), 0.0)
        kl_q += tl.where(q > 0.0, q * (log_q - log_m), 0.0)
    kl_pm = tl.sum(kl_p, axis=0)
    tl.store(jsd_ptr + row, beta * tl.sum(kl_q, axis=0) + (1.0 - beta) * kl_pm)
    tl.store(kl_pm_ptr + row, kl_pm)


@triton.jit
def _distill_grad_kernel(
    zs_ptr, stride_zs, ms_ptr,  # student: [n, width] fp16 centred logits, [tiles, n] fp32 tile maxima
    dy_ptr,  # [n, width] output in the GEMM dtype over the student's storage (same element size, same lanes)
    zt_ptr, stride_zt, mt_ptr,  # teacher: the same as the student's, or dummies without teacher terms
    tgt_ptr,  # [n] int64 targets, vocabulary-local (HAS_LOGP)
    lse_ptr, coef_ptr, sum_pz_ptr, g_ent_ptr, lse_t_ptr, g_rkl_ptr, g_fkl_ptr, g_jsd_ptr, g_logp_ptr,  # [n] fp32
    n, width, v_start, log_1mb, log_b, one_minus_beta,
    logit_scale, softcap, temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_FACTOR: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_RKL: tl.constexpr,
    HAS_FKL: tl.constexpr, HAS_JSD: tl.constexpr, HAS_LOGP: tl.constexpr,
    TILE_V: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_zs
    dy_row = dy_ptr + row * stride_zs
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    if HAS_ENTROPY:
        g_ent = tl.load(g_ent_ptr + row)
        c = tl.load(sum_pz_ptr + row)
    if HAS_RKL or HAS_FKL or HAS_JSD:
        lse_t = tl.load(lse_t_ptr + row)
    if HAS_RKL:
        g_rkl = tl.load(g_rkl_ptr + row)
    if HAS_FKL:
        g_fkl = tl.load(g_fkl_ptr + row)
    if HAS_JSD:
        g_jsd = tl.load(g_jsd_ptr + row) * one_minus_beta
    if HAS_LOGP:
        g_logp = tl.load(g_logp_ptr + row)
        t = tl.load(tgt_ptr + row) - v_start
    for off in range(0, width, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < width
        z, log_p = _log_probs(zs_row, ms_ptr, lse, cols, mask, row, n, TILE_V)
        p = tl.exp(log_p)
        a = tl.zeros([BLOCK_V], dtype=tl.float32) + coef
        if HAS_ENTROPY:
            a -= g_ent * (z - c)
        if HAS_RKL or HAS_FKL or HAS_JSD:
            _, log_q = _log_probs(zt_ptr + row * stride_zt, mt_ptr, lse_t, cols, mask, row, n, TILE_V)
        if HAS_RKL:
            a += g_rkl * (log_p - log_q)
        if HAS_JSD:
            a += g_jsd * (log_p - _log_mixture(log_p, log_q, log_1mb, log_b))
        dz = tl.where(p > 0.0, p * a, 0.0)
        if HAS_FKL:
            dz += g_fkl * (p - tl.exp(log_q))
        if HAS_LOGP:
            dz += tl.where(cols == t, g_logp, 0.0)
        dy = raw_grad(dz, z, logit_scale, softcap, temperature, HAS_SOFTCAP, HAS_FACTOR)
        tl.store(dy_row + cols, dy.to(dy_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _forward_kl_kernel(
    zs_ptr, stride_zs, ms_ptr,  # student: [n, width] fp16 centred logits, [tiles, n] fp32 tile maxima
    d_ptr,  # [n, width] output, p - q in the GEMM dtype over the student's storage
    zt_ptr, stride_zt, mt_ptr,  # teacher: the same
    row_max_s_ptr, row_max_t_ptr, lse_ptr, lse_t_ptr,  # [n] fp32: both rows' maxima and log-partition functions
    sgap_ptr, tgap_ptr,  # [n] fp32 outputs: the cross sums centred on the rows' maxima
    n, width,
    TILE_V: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_zs
    zt_row = zt_ptr + row * stride_zt
    d_row = d_ptr + row * stride_zs
    big_s = tl.load(row_max_s_ptr + row)
    big_t = tl.load(row_max_t_ptr + row)
    # p = exp(c_s) e^(M_s - lse_s): the sums and p - q from the same exponentials.
    norm_s = tl.exp(big_s - tl.load(lse_ptr + row))
    norm_t = tl.exp(big_t - tl.load(lse_t_ptr + row))
    # A step covers BLOCK_V // TILE_V whole tiles, laid out [tiles of the step, TILE_V], so each
    # tile's maximum is one load per tile, not a gather per entry.
    per_step: tl.constexpr = BLOCK_V // TILE_V
    tile_idx = tl.arange(0, per_step)
    sgap = tl.zeros([per_step, TILE_V], dtype=tl.float32)
    tgap = tl.zeros([per_step, TILE_V], dtype=tl.float32)
    for off in range(0, width, BLOCK_V):
        tiles = off // TILE_V + tile_idx
        cols = tiles[:, None] * TILE_V + tl.arange(0, TILE_V)[None, :]
        mask = cols < width
        tile_ok = tiles * TILE_V < width
        # Each side's logit less its row maximum: stored + (tile max - row max), <= 0.
        shift_s = tl.load(ms_ptr + tiles * n + row, mask=tile_ok, other=0.0) - big_s
        shift_t = tl.load(mt_ptr + tiles * n + row, mask=tile_ok, other=0.0) - big_t
        cs = tl.load(zs_row + cols, mask=mask, other=-float("inf")).to(tl.float32) + shift_s[:, None]
        ct = tl.load(zt_row + cols, mask=mask, other=-float("inf")).to(tl.float32) + shift_t[:, None]
        es = tl.exp(cs)
        et = tl.exp(ct)
        gap = cs - ct
        # An entry of zero probability on one side adds nothing to that side's sum (0 log 0 = 0).
        sgap += tl.where(es > 0.0, es * gap, 0.0)
        tgap -= tl.where(et > 0.0, et * gap, 0.0)
        tl.store(d_row + cols, (es * norm_s - et * norm_t).to(d_ptr.dtype.element_ty), mask=mask)
    tl.store(sgap_ptr + row, tl.sum(tl.sum(sgap, axis=1), axis=0))
    tl.store(tgap_ptr + row, tl.sum(tl.sum(tgap, axis=1), axis=0))


def _mixture_logs(beta: float | None) -> tuple[float, float]:
    """``(log(1 - β), log β)`` of the JSD's mixture (unused placeholders without one)."""
    return (math.log1p(-beta), math.log(beta)) if beta is not None else (0.0, 0.0)


def launch_cross(student: CentredTile, teacher: CentredTile) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sgap, tgap)``, ``[tiles, n]`` fp32 each, of two heads' stored tiles over the same rows and
    tiles: with ``c``/``c'`` the student's/teacher's centred logits, ``sgap = Σ exp(c) (c - c')``
    and ``tgap = -Σ exp(c') (c - c')`` per tile (:class:`~logitless.ops.distill_contract.DistillPartials`)."""
    n, width = student.z.shape
    cfg = row_kernel_config()
    assert teacher.z.shape == student.z.shape and cfg.block_v % student.tile_v == 0
    sgap = torch.empty(student.tile_max.shape, dtype=torch.float32, device=student.z.device)
    tgap = torch.empty_like(sgap)
    if n and width:
        _cross_kernel[(n,)](student.z, student.z.stride(0), teacher.z, teacher.z.stride(0), sgap, tgap, n, width,
                            TILE_V=student.tile_v, BLOCK_V=cfg.block_v, num_warps=cfg.warps)
    return sgap, tgap


def launch_jsd(student: CentredTile, teacher: CentredTile, lse: torch.Tensor, teacher_lse: torch.Tensor,
               beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This vocabulary range's part of ``JSD_β`` and of ``KL(p‖m)`` (``[n]`` fp32 each), from both
    heads' stored tiles and their final ``lse`` (``[n]`` fp32)."""
    n, width, cfg = *student.z.shape, row_kernel_config()
    jsd = torch.zeros(n, dtype=torch.float32, device=lse.device)
    kl_pm = torch.zeros_like(jsd)
    if n and width:
        _jsd_kernel[(n,)](student.z, student.z.stride(0), student.tile_max, teacher.z, teacher.z.stride(0),
                          teacher.tile_max, lse.float().contiguous(), teacher_lse.float().contiguous(), jsd, kl_pm,
                          n, width, beta, *_mixture_logs(beta), TILE_V=student.tile_v,
                          BLOCK_V=cfg.block_v, num_warps=cfg.warps)
    return jsd, kl_pm


def launch_distill_grad(student: CentredTile, teacher: CentredTile | None, dy: torch.Tensor, targets: torch.Tensor,
                        v_start: int, transform: LogitTransform, rc: DistillRowCoefficients) -> None:
    """Write the student's ``dy`` over its stored tile (``dy``: a 2-byte view of ``student.z``'s
    storage), from :class:`DistillRowCoefficients` and, for teacher terms, the teacher's tile.

    ``dz_v = p_v (coef - g_entropy (z_v - sum_pz) + g_rkl (log p_v - log q_v) + g_jsd (1 - β)
    (log p_v - log m_v)) + g_fkl (p_v - q_v) + g_logp [v = y]``, then the chain rule through the
    student's ``transform``; ``targets - v_start`` indexes the tile's columns.
    """
    n, width, cfg = *student.z.shape, row_kernel_config()
    assert dy.shape == student.z.shape and dy.stride() == student.z.stride() and dy.element_size() == 2
    if n == 0 or width == 0:
        return
    teacher_terms = any(g is not None for g in (rc.g_reverse_kl, rc.g_forward_kl, rc.g_jsd))
    assert not teacher_terms or (teacher is not None and rc.teacher_lse is not None)
    assert (rc.sum_pz is None) == (rc.g_entropy is None)
    scalars, flags = transform_args(transform)
    other = teacher if teacher is not None else student

    def arg(x: torch.Tensor | None) -> torch.Tensor:
        return rc.lse if x is None else x

    _distill_grad_kernel[(n,)](
        student.z, student.z.stride(0), student.tile_max, dy, other.z, other.z.stride(0), other.tile_max, targets,
        rc.lse, rc.coef, arg(rc.sum_pz), arg(rc.g_entropy), arg(rc.teacher_lse), arg(rc.g_reverse_kl),
        arg(rc.g_forward_kl), arg(rc.g_jsd), arg(rc.g_logp), n, width, v_start, *_mixture_logs(rc.beta),
        1.0 - (rc.beta or 0.0), *scalars,
        HAS_SOFTCAP=flags["HAS_SOFTCAP"], HAS_FACTOR=transform.logit_scale / transform.temperature != 1.0,
        HAS_ENTROPY=rc.g_entropy is not None, HAS_RKL=rc.g_reverse_kl is not None,
        HAS_FKL=rc.g_forward_kl is not None, HAS_JSD=rc.g_jsd is not None, HAS_LOGP=rc.g_logp is not None,
        TILE_V=student.tile_v, BLOCK_V=cfg.block_v, num_warps=cfg.warps)


def launch_forward_kl(student: CentredTile, teacher: CentredTile, d: torch.Tensor, row_max: torch.Tensor,
                      teacher_row_max: torch.Tensor, lse: torch.Tensor,
                      teacher_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sgap, tgap)``, ``[n]`` fp32 each, of two heads' stored tiles over whole rows, centred on
    the rows' maxima ``row_max``/``teacher_row_max`` (``[n]`` fp32, as
    :class:`~logitless.ops.distill_contract.DistillPartials` holds them once merged), and ``p - q``
    written to ``d`` (a 2-byte view of ``student.z``'s storage) from both final ``lse`` (``[n]``
    fp32): ``d KL(q‖p) / d zs = p - q``."""
    n, width = student.z.shape
    cfg = row_kernel_config()
    assert teacher.z.shape == student.z.shape and d.shape == student.z.shape and d.stride() == student.z.stride()
    assert cfg.block_v % student.tile_v == 0
    sgap = torch.empty(n, dtype=torch.float32, device=student.z.device)
    tgap = torch.empty_like(sgap)
    if n and width:
        _forward_kl_kernel[(n,)](student.z, student.z.stride(0), student.tile_max, d, teacher.z, teacher.z.stride(0),
                                 teacher.tile_max, *(x.float().contiguous() for x in (row_max, teacher_row_max, lse,
                                                                                      teacher_lse)),
                                 sgap, tgap, n, width, TILE_V=student.tile_v, BLOCK_V=cfg.block_v,
                                 num_warps=cfg.warps)
    elif n:
        sgap.zero_()
        tgap.zero_()
    return sgap, tgap
