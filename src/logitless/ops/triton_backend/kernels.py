"""Triton kernels of the vocabulary pass: row kernels over a tile of raw matmul output.

The GEMMs stay in cuBLAS (``torch.mm``); these kernels read a ``[n, v]`` tile of
``y = hidden @ weight[v0:v0+v].T`` once each:

* :func:`_stats_kernel` folds the tile into the running per-token statistics (max, sum of
  exponentials, sum of ``exp * z``, the target's logit), applying bias and the
  :class:`~logitless.ops.transform.LogitTransform` on the fly, so logits are never written.
* :func:`_dlogits_kernel` overwrites the tile with ``dy = dL/dy`` (the gradient w.r.t. the raw
  matmul output) in the GEMM dtype, ready for ``d hidden = dy @ W`` and ``d W += dy^T @ h``.

Both run one program per token row and walk the row in ``BLOCK_V`` steps. The fp32-tile ->
bf16-``dy`` in-place write of :func:`launch_dlogits` stores step ``k``'s ``dy`` over bytes that
steps ``<= k`` loaded, in other lanes: a barrier after each step keeps every warp's loads ahead
of those stores (without it, on a GPU, warps that ran ahead overwrote logits not yet read, and
``d hidden``/``d weight`` were 1.2e-2 off float64 on an H100 instead of 2.4e-3).

Layout: launch configs -> ``@triton.jit`` helpers -> kernels -> launchers. The autograd-free
contract functions live in :mod:`logitless.ops.triton_backend.backend`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import triton
import triton.language as tl

from ..settings import on_reload, settings
from ..transform import LogitTransform
from ..triton_shared.common import interpreting, raw_grad, row_coefficients, row_dz, to_logits, transform_args

if TYPE_CHECKING:
    from ..contract import RowCoefficients, RowStats

# ---------------------------------------------------------------------------------------------
# Launch configs
# ---------------------------------------------------------------------------------------------

TileDtype = Literal["input", "fp32"]


@dataclass(frozen=True)
class KernelConfig:
    """Every tunable of the backend, in one place.

    Attributes:
        stats_rows: token rows per program of the statistics kernel (its per-step row max
            then reduces within a warp instead of across the whole program).
        stats_block_v, grad_block_v: vocabulary entries per loop step of each kernel.
        stats_warps, grad_warps: warps per program of each kernel.
        tile: dtype of the raw matmul tile: ``"fp32"`` (default; ``torch.mm(..., out_dtype=float32)``:
            logits not rounded, statistics agree with the torch backend to ~1e-5) or ``"input"``
            (the GEMM's own dtype: half the bytes, but bf16 logits of magnitude 16-32 are off by up
            to 0.06, as in the plain bf16 path). Measured: no difference in fused fwd+bwd time.
        autotune: pick blocks/warps by benchmarking (``LOGITLESS_TRITON_AUTOTUNE=1``, read once
            by :mod:`logitless.ops.settings`).
    """

    stats_rows: int
    stats_block_v: int
    stats_warps: int
    grad_block_v: int
    grad_warps: int
    tile: TileDtype
    autotune: bool


def kernel_config(vocab_block: int, fp32_logits: bool = True) -> KernelConfig:
    """Config for rows of ``vocab_block`` entries; the tile is fp32 with ``fp32_logits``, else in
    the GEMM's dtype (:class:`~logitless.ops.plan.ChunkPlan`). Under the interpreter blocks are
    64 wide and the statistics kernel takes 4 rows per program, so small test shapes exercise
    several loop steps, a masked vocabulary tail and masked rows.
    """
    tile = "fp32" if fp32_logits else "input"
    if interpreting():
        return KernelConfig(stats_rows=4, stats_block_v=64, stats_warps=1, grad_block_v=64, grad_warps=1,
                            tile=tile, autotune=False)  # type: ignore[arg-type]
    block_v = min(2048, triton.next_power_of_2(max(vocab_block, 16)))
    # Measured on H200 at 8192 x 128256 bf16 (benchmarks/NOTES-triton.md): statistics 1 row x 2048
    # x 4 warps 0.80 ms (2.6 TB/s; 4-8 rows per program or 8 warps were slower), gradient
    # 2048 x 8 warps 1.07 ms (3.9 TB/s read + write; every swept config within 2%).
    return KernelConfig(stats_rows=1, stats_block_v=block_v, stats_warps=4,
                        grad_block_v=block_v, grad_warps=8 if block_v >= 1024 else 4,
                        tile=tile, autotune=settings().triton_autotune)  # type: ignore[arg-type]


_STATS_TUNE = [triton.Config({"BLOCK_N": bn, "BLOCK_V": bv}, num_warps=w)
               for bn in (1, 2, 4, 8) for bv in (512, 1024, 2048) for w in (4, 8)]
_GRAD_TUNE = [triton.Config({"BLOCK_V": bv}, num_warps=w) for bv in (1024, 2048, 4096) for w in (4, 8, 16)]

# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _stats_kernel(
    y_ptr, stride_yn,  # [n, width] raw matmul tile
    bias_ptr,  # [V] (indexed from v_start) or dummy
    tgt_ptr,  # [n] int64 targets, vocabulary-global
    m_ptr, se_ptr, sez_ptr, zy_ptr, sz_ptr, ssq_ptr,  # [n] fp32 running statistics, updated in place
    n, width, v_start,
    logit_scale, softcap, temperature,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr, WANT_ENTROPY: tl.constexpr, WANT_SUM_Z: tl.constexpr,
    WANT_SUM_SQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_yn  # int64: n * V exceeds 2**31
    # Dead rows start from 0 rather than -inf so they compute finite garbage (never stored).
    m_old = tl.load(m_ptr + rows, mask=row_ok, other=0.0)
    m_run = m_old
    # Per-lane sums rescaled by one factor per row and step: one exp per element and one
    # reduction (the row max of the step) per step; lanes are summed once at the end.
    acc_se = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    acc_sez = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    acc_sz = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    acc_ssq = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for off in range(0, width, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        col_ok = cols < width
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + v_start + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z = to_logits(y, logit_scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
        # Masked lanes: -inf for the max and exp (e = 0); z itself stays finite there (y = 0),
        # so e * z is 0 rather than 0 * -inf.
        z_or_ninf = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m_run, tl.max(z_or_ninf, axis=1))
        alpha = tl.exp(m_run - m_new)
        e = tl.exp(z_or_ninf - m_new[:, None])
        acc_se = acc_se * alpha[:, None] + e
        if WANT_ENTROPY:
            acc_sez = acc_sez * alpha[:, None] + e * z
        if WANT_SUM_Z:
            acc_sz += tl.where(mask, z, 0.0)
        if WANT_SUM_SQ:  # Σ e², rescaled by alpha² (the same max, squared)
            acc_ssq = acc_ssq * (alpha * alpha)[:, None] + e * e
        m_run = m_new
    carry = tl.exp(m_old - m_run)  # 0 on the first block (m_old = -inf)
    tl.store(m_ptr + rows, m_run, mask=row_ok)
    se_old = tl.load(se_ptr + rows, mask=row_ok, other=0.0)
    tl.store(se_ptr + rows, se_old * carry + tl.sum(acc_se, axis=1), mask=row_ok)
    if WANT_ENTROPY:
        sez_old = tl.load(sez_ptr + rows, mask=row_ok, other=0.0)
        tl.store(sez_ptr + rows, sez_old * carry + tl.sum(acc_sez, axis=1), mask=row_ok)
    if WANT_SUM_Z:
        sz_old = tl.load(sz_ptr + rows, mask=row_ok, other=0.0)
        tl.store(sz_ptr + rows, sz_old + tl.sum(acc_sz, axis=1), mask=row_ok)
    if WANT_SUM_SQ:
        ssq_old = tl.load(ssq_ptr + rows, mask=row_ok, other=0.0)
        tl.store(ssq_ptr + rows, ssq_old * (carry * carry) + tl.sum(acc_ssq, axis=1), mask=row_ok)
    # The target's logit: one load of the same tile element, so it agrees with the sums.
    t = tl.load(tgt_ptr + rows, mask=row_ok, other=0) - v_start
    here = row_ok & (t >= 0) & (t < width)
    t_safe = tl.where(here, t, 0)
    y_t = tl.load(y_ptr + rows.to(tl.int64) * stride_yn + t_safe, mask=here, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y_t += tl.load(bias_ptr + v_start + t_safe, mask=here, other=0.0).to(tl.float32)
    z_t = to_logits(y_t, logit_scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
    zy_old = tl.load(zy_ptr + rows, mask=row_ok, other=0.0)
    tl.store(zy_ptr + rows, tl.where(here, z_t, zy_old), mask=row_ok)


@triton.jit
def _dlogits_kernel(
    y_ptr, stride_yn,  # [n, width] raw matmul tile
    dy_ptr, stride_dyn,  # [n, width] output, GEMM dtype; may alias y_ptr
    bias_ptr, tgt_ptr,
    lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,  # [n] fp32
    width, v_start,
    logit_scale, softcap, temperature,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr, HAS_FACTOR: tl.constexpr, HAS_LOGP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_SUM_Z: tl.constexpr, NARROWING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_yn
    dy_row = dy_ptr + row * stride_dyn
    lse, coef, g_ent, c, g_logp, t, g_sz = row_coefficients(
        row, tgt_ptr, v_start, lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,
        HAS_LOGP, HAS_ENTROPY, HAS_SUM_Z)
    for off in range(0, width, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < width
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + v_start + cols, mask=mask, other=0.0).to(tl.float32)
        z = to_logits(y, logit_scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)
        dz = row_dz(z, cols, lse, coef, g_ent, c, g_logp, t, g_sz, HAS_LOGP, HAS_ENTROPY, HAS_SUM_Z)
        dy = raw_grad(dz, z, logit_scale, softcap, temperature, HAS_SOFTCAP, HAS_FACTOR)
        tl.store(dy_row + cols, dy.to(dy_ptr.dtype.element_ty), mask=mask)
        if NARROWING:
            # The next step's stores land on bytes this step loaded, in other warps' lanes:
            # every warp must be done with this step first.
            tl.debug_barrier()


# restore_value: both kernels update buffers in place, so every trial must start from the same
# contents (every running statistic, Σz included; the in-place tile of the gradient kernel).
_RESTORE = {"stats": ["m_ptr", "se_ptr", "sez_ptr", "zy_ptr", "sz_ptr", "ssq_ptr"], "dlogits": ["y_ptr"]}


@functools.cache
def _autotuned(name: str):
    """The autotuned variant of a kernel, built on first use (so the switch is read once, by
    :func:`~logitless.ops.settings.settings`, and never by an import)."""
    kernel, configs = {"stats": (_stats_kernel, _STATS_TUNE), "dlogits": (_dlogits_kernel, _GRAD_TUNE)}[name]
    return triton.autotune(configs, key=["width"], restore_value=_RESTORE[name])(kernel)


on_reload(_autotuned.cache_clear)

# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _launch(name: str, cfg: KernelConfig, n: int, rows: int, block_v: int, warps: int, *args,
            **constexprs) -> None:
    if cfg.autotune:
        _autotuned(name)[lambda meta: (triton.cdiv(n, meta.get("BLOCK_N", 1)),)](*args, **constexprs)
        return
    kernel = {"stats": _stats_kernel, "dlogits": _dlogits_kernel}[name]
    extra = {"BLOCK_N": rows} if rows else {}
    kernel[(triton.cdiv(n, max(rows, 1)),)](*args, **constexprs, **extra, BLOCK_V=block_v, num_warps=warps)


def launch_stats(tile: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, v_start: int,
                 transform: LogitTransform, st: RowStats, cfg: KernelConfig) -> None:
    """Fold a tile into the running statistics ``st``, in place.

    Args:
        tile: ``[n, v]`` raw ``hidden @ weight[v_start:v_start+v].T`` (any float dtype), unit
            column stride.
        bias: the full ``[V]`` bias (read from ``v_start``) or ``None``.
        targets: ``[n]`` int64 local indices; rows whose target is outside
            ``[v_start, v_start + v)`` keep their ``target_logit``.
        st: :class:`~logitless.ops.contract.RowStats` of ``[n]`` fp32 contiguous tensors
            (``sum_exp_logit``/``sum_logit``/``sum_exp_sq`` ``None``: not computed), updated in place.
    """
    n, width = tile.shape
    assert tile.stride(1) == 1 and st.max_logit.dtype == torch.float32 and targets.dtype == torch.int64
    if n == 0:
        return
    scalars, flags = transform_args(transform)
    se, sez, sz, ssq = st.sum_exp, st.sum_exp_logit, st.sum_logit, st.sum_exp_sq
    _launch("stats", cfg, n, cfg.stats_rows, cfg.stats_block_v, cfg.stats_warps,
            tile, tile.stride(0), tile if bias is None else bias, targets,
            st.max_logit, se, se if sez is None else sez, st.target_logit, se if sz is None else sz,
            se if ssq is None else ssq, n, width, v_start, *scalars, HAS_BIAS=bias is not None,
            WANT_ENTROPY=sez is not None, WANT_SUM_Z=sz is not None, WANT_SUM_SQ=ssq is not None, **flags)


def launch_dlogits(tile: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                   v_start: int, transform: LogitTransform, rc: RowCoefficients, cfg: KernelConfig) -> None:
    """Write ``dy = dL/dy`` of a tile into ``out``, which may be the tile itself or a view of
    the tile's storage in a narrower dtype that starts at the same row addresses.

    With ``p = exp(z - lse)``: ``dz = p (coef - g_entropy (z - sum_pz)) + g_logp [v == y] + g_sum_z``,
    ``coef = g_lse - g_logp``, then the chain rule through ``transform``.

    Args:
        tile: ``[n, v]`` raw matmul tile, unit column stride.
        out: ``[n, v]`` output in the GEMM dtype, unit column stride.
        rc: :class:`~logitless.ops.contract.RowCoefficients` (``[n]`` fp32 each).
    """
    n, width = tile.shape
    assert out.shape == tile.shape and tile.stride(1) == 1 and out.stride(1) == 1
    assert (rc.sum_pz is None) == (rc.g_entropy is None)
    if n == 0:
        return
    scalars, flags = transform_args(transform)
    has_factor = transform.logit_scale / transform.temperature != 1.0
    lse = rc.lse

    def arg(x: torch.Tensor | None) -> torch.Tensor:
        return lse if x is None else x

    _launch("dlogits", cfg, n, 0, cfg.grad_block_v, cfg.grad_warps,
            tile, tile.stride(0), out, out.stride(0), tile if bias is None else bias,
            targets, lse, arg(rc.sum_pz), rc.coef, arg(rc.g_logp), arg(rc.g_entropy), arg(rc.g_sum_z), width,
            v_start, *scalars, HAS_BIAS=bias is not None, HAS_FACTOR=has_factor, HAS_LOGP=rc.g_logp is not None,
            HAS_ENTROPY=rc.g_entropy is not None, HAS_SUM_Z=rc.g_sum_z is not None,
            NARROWING=out.data_ptr() == tile.data_ptr() and out.element_size() < tile.element_size(), **flags)
