"""The backward's row kernels over a logits tile stored in fp16, each ``tile_v``-wide tile
centred on its row maximum (written by the statistics GEMMs of :mod:`logitless.ops.gemm_backend`
and :mod:`logitless.ops.cute_backend`): they turn it into ``dy = dL/dy`` in the GEMM dtype, in
place, ready for the ``d hidden``/``d weight`` GEMMs.

Why fp16 centred on the tile maximum: every stored value is ``<= 0``, and an entry that carries
probability lies within a few nats of its row's maximum, hence of its tile's. fp16 keeps 11
significant bits, so ``z`` of such an entry is off by at most ``|z - m| · 2**-11`` (``2e-3`` nats
at ``|z - m| = 4``) where a bf16 logit of magnitude 16-32 is off by up to 0.06. Entries further
than 65504 below their tile's maximum round to ``-inf``: probability 0, as in fp32.

Layout: launch config -> kernels -> launchers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from ..transform import LogitTransform
from .common import interpreting, raw_grad, row_coefficients, row_dz, transform_args
from .tile_gemm import tile_dz

if TYPE_CHECKING:
    from ..contract import RowCoefficients


@dataclass(frozen=True)
class RowKernelConfig:
    """Launch shape of the row kernels: ``block_v`` vocabulary entries per loop step and ``warps``
    per program (one program per token row); ``rows_block``: ``(rows, entries)`` per step of the
    kernel that turns chosen rows into ``dy`` (:func:`launch_centred_grad_rows`; 4 warps, 3 stages)."""

    block_v: int
    warps: int
    rows_block: tuple[int, int]


@functools.cache
def row_kernel_config() -> RowKernelConfig:
    """Under the interpreter a 64-wide step that straddles tile boundaries; on GPUs 2048-wide steps
    (1.5 ms on one H100 at 8192 x 128256 for any step of 1024-4096 entries)."""
    if interpreting():
        return RowKernelConfig(block_v=64, warps=1, rows_block=(4, 64))
    return RowKernelConfig(block_v=2048, warps=8, rows_block=(16, 256))


class CentredTile(NamedTuple):
    """A stored logits tile: ``z [n, V]`` fp16, each ``tile_v``-wide tile centred on its row maximum
    ``tile_max [tiles, n]`` fp32 (``z + tile_max`` is the logit); ``rows`` (``[m]`` int64,
    ascending), when set, the only rows a backward turns into ``dy`` (:func:`launch_centred_grad_rows`)."""

    z: torch.Tensor
    tile_max: torch.Tensor
    tile_v: int
    rows: torch.Tensor | None = None


@triton.jit
def _centred_grad_kernel(
    z_ptr, stride_zn,  # [n, width] fp16 centred logits
    dy_ptr, stride_dyn,  # [n, width] output in the GEMM dtype; may alias z_ptr (same element size)
    m_ptr,  # [tiles, n] fp32 tile maxima (row stride n)
    tgt_ptr,  # [n] int64 targets, vocabulary-global
    lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,  # [n] fp32 (dummies when absent)
    n, width, v_start,
    logit_scale, softcap, temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_FACTOR: tl.constexpr, HAS_LOGP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_SUM_Z: tl.constexpr, TILE_V: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_zn
    dy_row = dy_ptr + row * stride_dyn
    lse, coef, g_ent, c, g_logp, t, g_sz = row_coefficients(
        row, tgt_ptr, v_start, lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,
        HAS_LOGP, HAS_ENTROPY, HAS_SUM_Z)
    for off in range(0, width, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < width
        # One tile maximum per TILE_V columns: a broadcast load from cache.
        m = tl.load(m_ptr + (cols // TILE_V) * n + row, mask=mask, other=0.0)
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32) + m
        dz = row_dz(z, cols, lse, coef, g_ent, c, g_logp, t, g_sz, HAS_LOGP, HAS_ENTROPY, HAS_SUM_Z)
        # An entry stored as -inf (more than 65504 below its tile's maximum) has p = 0; only the
        # softcap's chain rule would see z = -inf, and a softcap bounds |z| far below that.
        dy = raw_grad(dz, z, logit_scale, softcap, temperature, HAS_SOFTCAP, HAS_FACTOR)
        tl.store(dy_row + cols, dy.to(dy_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _centred_grad_rows_kernel(
    z_ptr, stride_zn,  # [n, width] fp16 centred logits
    dy_ptr,  # z's storage in the GEMM dtype (same element size, same strides): dy row i overwrites row i
    rows_ptr, m,  # [m] int64 ascending rows of z to turn into dy rows 0..m-1
    m_ptr, n,  # [tiles, n] fp32 tile maxima of z's rows (row stride n)
    tgt_ptr,  # [m] int64 targets, vocabulary-global
    lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,  # [m] fp32 (dummies when absent)
    width, v_start,
    logit_scale, softcap, temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_FACTOR: tl.constexpr, HAS_LOGP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_SUM_Z: tl.constexpr, TILE_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, STAGES: tl.constexpr,
):
    """:func:`_centred_grad_kernel` for the rows ``rows`` of the tile only, written compacted
    in place: output row ``i`` is input row ``rows[i] >= i``. A program owns a column block and
    walks the output rows in ascending blocks, so every input row is read before the block that
    overwrites it (a later block, or its own, which loads first); loads of later blocks may
    run ahead (they read rows no earlier block writes)."""
    start = tl.program_id(0) * BLOCK_V
    cols = start + tl.arange(0, BLOCK_V)
    col_ok = cols < width
    # BLOCK_V divides TILE_V: the block lies in one tile, so each row has one maximum (a vector
    # load per row block, not a gather per entry).
    tile_row = (start // TILE_V) * n
    for i0 in tl.range(0, m, BLOCK_N, num_stages=STAGES):
        out = i0 + tl.arange(0, BLOCK_N)
        ok = out < m
        src = tl.load(rows_ptr + out, mask=ok, other=0)
        both = ok[:, None] & col_ok[None, :]
        mx = tl.load(m_ptr + tile_row + src, mask=ok, other=0.0)
        z = tl.load(z_ptr + src[:, None] * stride_zn + cols[None, :], mask=both, other=0.0).to(tl.float32)
        z += mx[:, None]
        dz = tile_dz(z, out, ok, cols + v_start, tgt_ptr, lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr,
                     g_sz_ptr, HAS_LOGP, HAS_ENTROPY, HAS_SUM_Z)
        dy = raw_grad(dz, z, logit_scale, softcap, temperature, HAS_SOFTCAP, HAS_FACTOR)
        tl.store(dy_ptr + out[:, None].to(tl.int64) * stride_zn + cols[None, :], dy.to(dy_ptr.dtype.element_ty),
                 mask=both)


def launch_centred_grad(tile: CentredTile, out: torch.Tensor, targets: torch.Tensor, v_start: int,
                        transform: LogitTransform, rc: RowCoefficients) -> None:
    """Write ``dy = dL/dy`` of a stored tile into ``out`` (which may be ``z``'s own storage).

    With ``z = stored + tile_max`` and ``p = exp(z - lse)``:
    ``dz = p (coef - g_entropy (z - sum_pz)) + g_logp [v == y] + g_sum_z``, ``coef = g_lse - g_logp``,
    then the chain rule through ``transform``.

    Args:
        tile: :class:`CentredTile` (``z`` with unit column stride).
        out: ``[n, v]`` in the GEMM dtype (2 bytes), unit column stride.
        targets: ``[n]`` int64; ``targets - v_start`` indexes ``z``'s columns.
        rc: :class:`~logitless.ops.contract.RowCoefficients` (``[n]`` fp32 each).
    """
    z, cfg = tile.z, row_kernel_config()
    n, width = z.shape
    assert out.shape == z.shape and z.stride(1) == 1 and out.stride(1) == 1 and out.element_size() == 2
    assert (rc.sum_pz is None) == (rc.g_entropy is None)
    if n == 0 or width == 0:
        return
    scalars, flags = transform_args(transform)
    lse = rc.lse

    def arg(x: torch.Tensor | None) -> torch.Tensor:
        return lse if x is None else x

    _centred_grad_kernel[(n,)](
        z, z.stride(0), out, out.stride(0), tile.tile_max, targets, lse, arg(rc.sum_pz), rc.coef, arg(rc.g_logp),
        arg(rc.g_entropy), arg(rc.g_sum_z), n, width, v_start, *scalars,
        HAS_SOFTCAP=flags["HAS_SOFTCAP"], HAS_FACTOR=transform.logit_scale / transform.temperature != 1.0,
        HAS_LOGP=rc.g_logp is not None, HAS_ENTROPY=rc.g_entropy is not None, HAS_SUM_Z=rc.g_sum_z is not None,
        TILE_V=tile.tile_v, BLOCK_V=cfg.block_v, num_warps=cfg.warps)


def launch_centred_grad_rows(tile: CentredTile, dtype: torch.dtype, targets: torch.Tensor, v_start: int,
                             transform: LogitTransform, rc: RowCoefficients) -> torch.Tensor:
    """:func:`launch_centred_grad` of the rows ``tile.rows`` only, compacted: returns ``dy``
    ``[m, v]`` in ``dtype`` (the GEMM's, 2 bytes) over ``tile.z``'s first rows (the tile is
    overwritten), row ``i`` the gradient of row ``tile.rows[i]``.

    Args:
        tile: :class:`CentredTile` with ``rows``; ``z`` with unit column stride.
        targets: ``[m]`` int64 targets of those rows; ``rc``: their
            :class:`~logitless.ops.contract.RowCoefficients` (``[m]`` fp32 each).
    """
    z, rows = tile.z, tile.rows
    n, width = z.shape
    m = rows.numel()
    assert z.stride(1) == 1 and rows.dtype == torch.int64 and targets.shape == (m,)
    assert (rc.sum_pz is None) == (rc.g_entropy is None)
    out = z.view(dtype)
    dy = out[:m]
    if m == 0 or width == 0:
        return dy
    scalars, flags = transform_args(transform)
    lse = rc.lse
    block_n, block_v = row_kernel_config().rows_block
    block_v = min(block_v, tile.tile_v)
    assert tile.tile_v % block_v == 0  # powers of two

    def arg(x: torch.Tensor | None) -> torch.Tensor:
        return lse if x is None else x

    _centred_grad_rows_kernel[(triton.cdiv(width, block_v),)](
        z, z.stride(0), out, rows, m, tile.tile_max, n, targets, lse, arg(rc.sum_pz), rc.coef, arg(rc.g_logp),
        arg(rc.g_entropy), arg(rc.g_sum_z), width, v_start, *scalars,
        HAS_SOFTCAP=flags["HAS_SOFTCAP"], HAS_FACTOR=transform.logit_scale / transform.temperature != 1.0,
        HAS_LOGP=rc.g_logp is not None, HAS_ENTROPY=rc.g_entropy is not None, HAS_SUM_Z=rc.g_sum_z is not None,
        TILE_V=tile.tile_v, BLOCK_N=block_n, BLOCK_V=block_v, STAGES=3, num_warps=4)
    return dy


def kept_rows(kept, idx: torch.Tensor):
    """The kept tile restricted to its rows ``idx`` (a backend's ``kept_rows``; a
    :class:`CentredTile` or a :class:`~.prob_tile.ProbTile`): the backward's ``dy`` kernel reads
    a centred tile's rows and writes their ``dy`` compacted into its first rows (no separate copy)."""
    return kept._replace(rows=idx)


def tile_dy(tile: CentredTile, dtype: torch.dtype, targets: torch.Tensor, v_start: int, transform: LogitTransform,
            rc: RowCoefficients) -> torch.Tensor:
    """``dy`` of a kept tile over its own storage: of every row (:func:`launch_centred_grad`), or of
    ``tile.rows`` compacted into its first rows (:func:`launch_centred_grad_rows`; ``targets`` and
    ``rc`` then of those rows). ``[n or m, v]`` in ``dtype`` (the GEMM's, 2 bytes)."""
    if tile.rows is not None:
        return launch_centred_grad_rows(tile, dtype, targets, v_start, transform, rc)
    dy = tile.z.view(dtype)
    launch_centred_grad(tile, dy, targets, v_start, transform, rc)
    return dy
