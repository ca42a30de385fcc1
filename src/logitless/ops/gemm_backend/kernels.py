"""Triton kernels of the GEMM-epilogue backend: statistics in the logits GEMM's epilogue, and a
logits tile stored in fp16 centred on each tile's maximum.

* :func:`_epilogue_kernel` (forward): program ``(token block, vocabulary tile)`` computes one
  ``[BLOCK_N, BLOCK_V]`` tile of ``y = hidden @ weight.T`` with ``tl.dot`` over ``H`` (fp32
  accumulator), applies bias and the :class:`~logitless.ops.transform.LogitTransform` in
  registers and writes the tile's partial statistics: per row its maximum ``m``, ``Σ exp(z - m)``,
  ``Σ exp(z - m) z`` and ``Σ z`` (``[tiles, n]`` fp32), and the target's logit (``[n]``, written
  by the one tile that holds it; 0, by the first tile, for a target outside the vocabulary). The
  statistics come from the fp32 accumulator, so they are as accurate as an fp32 logits matrix,
  which is never written. Optionally the tile is stored as
  ``z - m`` in fp16 (``[n, V]``, 2 bytes a logit: the traffic of the plain path's bf16 logits).
* the backward's row kernels (:mod:`logitless.ops.triton_shared.centred`) read the stored tile
  and overwrite it in place with ``dy = dL/dy`` in the GEMM dtype, ready for the ``d hidden``/
  ``d weight`` GEMMs (cuBLAS, fp32 accumulation).
* :func:`_grad_tile_kernel` (backward without kept logits): the forward's GEMM recomputes a
  vocabulary block's logits and its epilogue writes ``dy`` from the fp32 accumulator, so the
  block is neither stored nor read back.

The fp16 centring, and why it keeps ~2e-3 nats where it matters: :mod:`logitless.ops.triton_shared.centred`.

Layout: launch configs -> kernels -> launchers; the contract functions live in
:mod:`logitless.ops.gemm_backend.backend`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..triton_shared.common import interpreting, raw_grad, transform_args
from ..triton_shared.prob_tile import EXP_CLAMP, reference
from ..triton_shared.tile_gemm import (
    TileOperands,
    Tiles,
    check_operands,
    dot_precision,
    grouped,
    head_logits,
    operand_src,
    sm_count,
    tile_dz,
    tile_partials,
    tma_ready,
)

if TYPE_CHECKING:
    from ..contract import RowCoefficients, StatRequest

# ---------------------------------------------------------------------------------------------
# Launch configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """Every tunable of the GEMM-epilogue kernels.

    Attributes:
        fwd: :class:`~logitless.ops.triton_shared.tile_gemm.Tiles` of the forward GEMM (bf16/fp16 inputs).
        group_n: token blocks whose programs run together, so the weight tiles they share hit L2.
        tma: read ``hidden``/``weight`` through tensor descriptors where they are 16-byte aligned.
        store_tma: write the centred tile through a descriptor (the copy engine's bulk store)
            where it is 16-byte aligned, instead of masked pointer stores.
        persistent: launch ``programs_per_sm`` programs per SM that walk the tiles, instead of
            one program per tile.
        warp_specialize_stats: launches that store no tile split the tile loop into
            producer/MMA/epilogue warp groups (``tl.range(warp_specialize=True)``).
    """

    fwd: Tiles
    group_n: int
    tma: bool
    store_tma: bool = False
    persistent: bool = False
    programs_per_sm: int = 1
    warp_specialize_stats: bool = False


@functools.cache
def gemm_config() -> GemmConfig:
    """The config for this process. Under the interpreter: 16 x 32 tiles and 16-wide ``H`` steps
    (small test shapes then cover several tiles, masked tails and ``H`` steps)."""
    if interpreting():
        return GemmConfig(fwd=Tiles(16, 32, 16, 1, 1), group_n=2, tma=True, store_tma=True, persistent=True,
                          programs_per_sm=2, warp_specialize_stats=True)
    # Measured on one H100 at 8192 x 4096 x 128256 bf16 (scripts/gpu_gemm_sweep.py; cuBLAS's bare
    # bf16 GEMM: 10.9-11.3 ms): persistent 128 x 256 x 64 tiles, 8 warps, 3 stages, groups of 8
    # token blocks: 11.8-12.3 ms for the statistics alone, 13.3 ms storing the tile through a
    # descriptor (pointer stores: 14.1; one program per tile: 15.3 / 16.2 ms in the same run;
    # 128 x 128 and 256 x 128 tiles, 4 stages, 32-wide H steps or two 128 x 128 programs per SM
    # were no faster). Warp specialization (another H100, cuBLAS 12.5 ms): statistics alone
    # 12.0 ms against 13.2, storing the tile 13.5 against 13.3, so statistics-only launches
    # (rollout, recompute's forward) use it.
    return GemmConfig(fwd=Tiles(128, 256, 64, 8, 3), group_n=8, tma=True, store_tma=True, persistent=True,
                      warp_specialize_stats=True)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_at(tile, n, vocab, n_blocks, n_tiles, GROUP_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Where tile number ``tile`` of a persistent walk lies: its first row and column, its rows and
    columns, and which of them exist."""
    pid_n, pid_v = grouped(tile, n_blocks, n_tiles, GROUP_N)
    row0 = pid_n * BLOCK_N
    col0 = pid_v * BLOCK_V
    rows = row0 + tl.arange(0, BLOCK_N)
    cols = col0 + tl.arange(0, BLOCK_V)
    return row0, col0, rows, cols, rows < n, cols < vocab


@triton.jit
def _epilogue_kernel(
    h_src, stride_hn,  # [n, H] hidden (descriptor of [BLOCK_N, BLOCK_K] blocks, or pointer)
    w_src, stride_wv,  # [V, H] weight (descriptor of [BLOCK_V, BLOCK_K] blocks, or pointer)
    bias_ptr, tgt_ptr,  # [V] or dummy; [n] int64 targets (outside [0, V): not in this range)
    m_ptr, se_ptr, sez_ptr, sz_ptr, ssq_ptr,  # [tiles, n] fp32 partials (row stride n)
    zy_ptr,  # [n] fp32: the target's logit, stored by the tile that holds it (0 by the first tile: none does)
    z_dst, stride_zn,  # [n, V] fp16 centred logits or (FOLD) bf16 exp(z - ref) (descriptor of [BLOCK_N, BLOCK_V]
    # blocks, or pointer) or dummy
    ref_ptr,  # [n] fp32 per-row references (FOLD) or dummy
    n, vocab, hidden_size,
    logit_scale, softcap, temperature,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr, WANT_ENTROPY: tl.constexpr, WANT_SUM_Z: tl.constexpr, WANT_SUM_SQ: tl.constexpr,
    STORE_Z: tl.constexpr, FOLD: tl.constexpr, EXP_CLAMP: tl.constexpr, STORE_TMA: tl.constexpr,
    ROUND_Y: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    PERSISTENT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    n_blocks = tl.cdiv(n, BLOCK_N)
    n_tiles = tl.cdiv(vocab, BLOCK_V)
    # One tile per program, or (PERSISTENT) a program per SM walking the tiles: the flattened
    # loop nest lets the pipeline load the next tile's operands during this tile's epilogue.
    for tile in tl.range(tl.program_id(0), n_blocks * n_tiles, tl.num_programs(0), flatten=PERSISTENT,
                         warp_specialize=WARP_SPECIALIZE):
        row0, col0, rows, cols, row_ok, col_ok = _tile_at(tile, n, vocab, n_blocks, n_tiles, GROUP_N, BLOCK_N, BLOCK_V)
        z = head_logits(h_src, stride_hn, w_src, stride_wv, bias_ptr, rows, cols, row_ok, col_ok, row0, col0,
                        hidden_size, logit_scale, softcap, temperature, HAS_BIAS, HAS_SCALE, HAS_SOFTCAP,
                        HAS_TEMPERATURE, ROUND_Y, EVEN_K, USE_TMA, DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_K)
        # Every sum comes from the centred tile c = z - m alone (Σ e z = Σ e c + m Σ e, z_y = c_y + m):
        # z is dead once c is formed, so one [BLOCK_N, BLOCK_V] fp32 tensor is live, not two
        # (measured: no register spills, against 26 for the statistics and 74 with the store).
        # Masked columns (none where EVEN_V: a select an element saved): -inf for the max and exp
        # (e = 0), 0 in the sums of c. Every tile has a valid column, so m is finite.
        z_or_ninf = z if EVEN_V else tl.where(col_ok[None, :], z, -float("inf"))
        m = tl.max(z_or_ninf, axis=1)
        centred = z_or_ninf - m[:, None]
        if STORE_Z and not FOLD:
            _store_tile(z_dst, stride_zn, centred.to(tl.float16), rows, cols, row_ok, col_ok, row0, col0, STORE_TMA)
        finite = centred if EVEN_V else tl.where(col_ok[None, :], centred, 0.0)
        # The target's logit (from the same tile as the maximum: exactly m when it is the largest,
        # so is_top1 is exact) where it costs least: before e is formed where a probability tile
        # is stored last (e live beside the centred tile through this sum costs that GEMM ~4%),
        # after the sums where the centred tile is stored first (before e it costs ~7%).
        if FOLD:
            _target_logit(tgt_ptr, zy_ptr, rows, cols, row_ok, col0, vocab, finite, m, BLOCK_V)
        e = tl.exp(centred)
        se = tl.sum(e, axis=1)
        out = (col0 // BLOCK_V) * n + rows  # this tile's row of the [tiles, n] partials
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(se_ptr + out, se, mask=row_ok)
        if WANT_ENTROPY:
            tl.store(sez_ptr + out, tl.sum(e * finite, axis=1) + m * se, mask=row_ok)
        if WANT_SUM_Z:
            tl.store(sz_ptr + out, tl.sum(finite, axis=1) + m * tl.sum(col_ok.to(tl.float32), axis=0), mask=row_ok)
        if WANT_SUM_SQ:
            tl.store(ssq_ptr + out, tl.sum(e * e, axis=1), mask=row_ok)
        if not FOLD:
            _target_logit(tgt_ptr, zy_ptr, rows, cols, row_ok, col0, vocab, finite, m, BLOCK_V)
        if STORE_Z and FOLD:  # exp(z - ref) = e^c e^(m - ref) (ops.triton_shared.prob_tile), once e alone is live
            ref = tl.load(ref_ptr + rows, mask=row_ok, other=0.0)
            kept = (e * tl.exp(tl.minimum(m - ref, EXP_CLAMP))[:, None]).to(tl.bfloat16)
            _store_tile(z_dst, stride_zn, kept, rows, cols, row_ok, col_ok, row0, col0, STORE_TMA)


@triton.jit
def _target_logit(tgt_ptr, zy_ptr, rows, cols, row_ok, col0, vocab, finite, m, BLOCK_V: tl.constexpr):
    """Store each row's target logit ``c_y + m`` where this tile holds the target."""
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    here = (tgt >= col0) & (tgt < col0 + BLOCK_V) & (tgt < vocab)
    # A target outside [0, vocab) gets 0 from the first tile, so the buffer needs no zero-fill.
    # (col0 broadcast first: the interpreter mishandles a scalar term in a mask.)
    absent = ((tgt < 0) | (tgt >= vocab)) & (tl.zeros_like(rows) + col0 == 0)
    zy = tl.sum(tl.where(cols[None, :] == tgt[:, None], finite, 0.0), axis=1) + m
    tl.store(zy_ptr + rows, tl.where(here, zy, 0.0), mask=row_ok & (here | absent))


@triton.jit
def _store_tile(dst, stride, tile, rows, cols, row_ok, col_ok, row0, col0, STORE_TMA: tl.constexpr):
    if STORE_TMA:  # the copy engine clips the block at the tensor's edges
        dst.store([row0, col0], tile)
    else:
        ptrs = dst + rows.to(tl.int64)[:, None] * stride + cols[None, :]  # int64: n * V exceeds 2**31
        tl.store(ptrs, tile, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grad_tile_kernel(
    h_src, stride_hn,  # [n, H] hidden (descriptor of [BLOCK_N, BLOCK_K] blocks, or pointer)
    w_src, stride_wv,  # [V, H] weight rows of this block (descriptor of [BLOCK_V, BLOCK_K] blocks, or pointer)
    bias_ptr, tgt_ptr,  # [V] or dummy; [n] int64 targets local to these rows
    lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,  # [n] fp32 (dummies when absent)
    dy_dst, stride_dyn,  # [n, V] in the GEMM dtype (descriptor of [BLOCK_N, BLOCK_V] blocks, or pointer)
    n, vocab, hidden_size,
    logit_scale, softcap, temperature,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr, HAS_FACTOR: tl.constexpr, HAS_LOGP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_SUM_Z: tl.constexpr,
    STORE_TMA: tl.constexpr, ROUND_Y: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    n_blocks = tl.cdiv(n, BLOCK_N)
    n_tiles = tl.cdiv(vocab, BLOCK_V)
    for tile in tl.range(tl.program_id(0), n_blocks * n_tiles, tl.num_programs(0), flatten=PERSISTENT):
        row0, col0, rows, cols, row_ok, col_ok = _tile_at(tile, n, vocab, n_blocks, n_tiles, GROUP_N, BLOCK_N, BLOCK_V)
        z = head_logits(h_src, stride_hn, w_src, stride_wv, bias_ptr, rows, cols, row_ok, col_ok, row0, col0,
                        hidden_size, logit_scale, softcap, temperature, HAS_BIAS, HAS_SCALE, HAS_SOFTCAP,
                        HAS_TEMPERATURE, ROUND_Y, EVEN_K, USE_TMA, DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_K)
        dz = tile_dz(z, rows, row_ok, cols, tgt_ptr, lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,
                     HAS_LOGP, HAS_ENTROPY, HAS_SUM_Z)
        dy = raw_grad(dz, z, logit_scale, softcap, temperature, HAS_SOFTCAP, HAS_FACTOR)
        if STORE_TMA:  # the copy engine clips the block at the tensor's edges
            dy_dst.store([row0, col0], dy.to(dy_dst.dtype))
        else:
            ptrs = dy_dst + rows.to(tl.int64)[:, None] * stride_dyn + cols[None, :]
            tl.store(ptrs, dy.to(dy_dst.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def launch_forward(ops: TileOperands, want: StatRequest, fp32_logits: bool, z_out: torch.Tensor | None,
                   cfg: GemmConfig) -> dict[str, torch.Tensor]:
    """Per-tile partial statistics of ``ops.hidden`` against ``ops.weight``, and optionally the
    centred fp16 logits.

    Args:
        ops: :class:`TileOperands`.
        want: :class:`~logitless.ops.contract.StatRequest`: whether ``sez``/``sz``/``ssq`` are computed.
        fp32_logits: statistics from the fp32 accumulator (else from it rounded to the input
            dtype first, as the plain path's; :class:`~logitless.ops.plan.ChunkPlan`).
        z_out: ``[n, V]`` with unit column stride: fp16, overwritten with ``z - m`` of each tile,
            or bf16, overwritten with ``exp(z - ref)`` (a :class:`~logitless.ops.triton_shared.prob_tile.ProbTile`;
            ``ref`` from :func:`~logitless.ops.triton_shared.prob_tile.reference`); ``None``: nothing stored.

    Returns:
        ``{"m", "se", "zy"[, "sez"][, "sz"][, "ssq"][, "ref"]}``: fp32 ``[tiles, n]`` buffers (``zy``,
        ``ref``: ``[1, n]``; ``ref`` with a bf16 ``z_out``);
        for tile ``s`` (``cfg.fwd.block_v`` vocabulary entries), ``m`` is its maximum logit,
        ``se = Σ exp(z - m)``, ``sez = Σ exp(z - m) z``, ``sz = Σ z``, ``ssq = Σ exp(2 (z - m))``; ``zy`` the target's
        logit (0 for a target outside ``[0, V)``).
    """
    hidden, weight, bias, targets, transform = ops
    check_operands(hidden, weight)
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    assert z_out is None or (z_out.dtype in (torch.float16, torch.bfloat16) and z_out.shape == (n, vocab)
                             and z_out.stride(1) == 1)
    t = cfg.fwd
    tiles = triton.cdiv(vocab, t.block_v)
    out, _ = tile_partials(want, tiles, n, hidden.device)
    fold = z_out is not None and z_out.dtype == torch.bfloat16
    if fold:
        out["ref"] = reference(ops)[None]
    scalars, flags = transform_args(transform)
    tma = cfg.tma and tma_ready(hidden, weight)
    store_tma = z_out is not None and cfg.store_tma and tma_ready(z_out)
    z_dst = out["m"] if z_out is None else z_out
    if store_tma:
        z_dst = TensorDescriptor.from_tensor(z_out, [t.block_n, t.block_v])
    programs = triton.cdiv(n, t.block_n) * tiles
    if cfg.persistent:
        programs = min(programs, cfg.programs_per_sm * sm_count(hidden.device))
    _epilogue_kernel[(programs,)](
        operand_src(hidden, t.block_n, t, tma), hidden.stride(0), operand_src(weight, t.block_v, t, tma),
        weight.stride(0), hidden if bias is None else bias, targets,
        out["m"], out["se"], out.get("sez", out["se"]), out.get("sz", out["se"]), out.get("ssq", out["se"]), out["zy"],
        z_dst, 0 if z_out is None else z_out.stride(0), out["ref"] if fold else out["m"],
        n, vocab, hidden_size, *scalars,
        HAS_BIAS=bias is not None, WANT_ENTROPY=want.entropy, WANT_SUM_Z=want.sum_z, WANT_SUM_SQ=want.sum_sq,
        STORE_Z=z_out is not None, FOLD=fold, EXP_CLAMP=EXP_CLAMP,
        STORE_TMA=store_tma,
        ROUND_Y=not fp32_logits and hidden.dtype != torch.float32, EVEN_K=hidden_size % t.block_k == 0,
        EVEN_V=vocab % t.block_v == 0, USE_TMA=tma, DOT_PRECISION=dot_precision(hidden.dtype), UPCAST=interpreting(),
        BLOCK_N=t.block_n, BLOCK_V=t.block_v, BLOCK_K=t.block_k, GROUP_N=cfg.group_n,
        PERSISTENT=cfg.persistent, WARP_SPECIALIZE=cfg.persistent and cfg.warp_specialize_stats and z_out is None,
        num_warps=t.warps, num_stages=t.stages, **flags)
    return out


def launch_grad_tile(ops: TileOperands, rc: RowCoefficients, fp32_logits: bool, out: torch.Tensor,
                     cfg: GemmConfig) -> None:
    """Write ``dy = dL/dy`` of ``ops.hidden`` against ``ops.weight`` into ``out``, the logits
    recomputed by the forward's GEMM and turned into ``dy`` in its epilogue (a backward that kept
    no logits: no tile is stored and read back). Same formula as :func:`launch_centred_grad`, from
    the fp32 logits.

    Args:
        ops: :class:`TileOperands` (``targets`` local to ``ops.weight``'s rows).
        rc: :class:`~logitless.ops.contract.RowCoefficients` (``[n]`` fp32 each).
        fp32_logits: as in :func:`launch_forward`.
        out: ``[n, V]`` in ``ops.hidden``'s dtype, unit column stride.
    """
    hidden, weight, bias, targets, transform = ops
    check_operands(hidden, weight)
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    assert out.shape == (n, vocab) and out.stride(1) == 1 and out.dtype == hidden.dtype
    assert (rc.sum_pz is None) == (rc.g_entropy is None)
    if n == 0 or vocab == 0:
        return
    t = cfg.fwd
    scalars, flags = transform_args(transform)
    tma = cfg.tma and tma_ready(hidden, weight)
    store_tma = cfg.store_tma and tma_ready(out)
    dst = TensorDescriptor.from_tensor(out, [t.block_n, t.block_v]) if store_tma else out
    programs = triton.cdiv(n, t.block_n) * triton.cdiv(vocab, t.block_v)
    if cfg.persistent:
        programs = min(programs, cfg.programs_per_sm * sm_count(hidden.device))
    lse = rc.lse

    def arg(x: torch.Tensor | None) -> torch.Tensor:
        return lse if x is None else x

    _grad_tile_kernel[(programs,)](
        operand_src(hidden, t.block_n, t, tma), hidden.stride(0), operand_src(weight, t.block_v, t, tma),
        weight.stride(0), hidden if bias is None else bias, targets,
        lse, arg(rc.sum_pz), rc.coef, arg(rc.g_logp), arg(rc.g_entropy), arg(rc.g_sum_z),
        dst, out.stride(0), n, vocab, hidden_size, *scalars,
        HAS_BIAS=bias is not None, HAS_FACTOR=transform.logit_scale / transform.temperature != 1.0,
        HAS_LOGP=rc.g_logp is not None, HAS_ENTROPY=rc.g_entropy is not None, HAS_SUM_Z=rc.g_sum_z is not None,
        STORE_TMA=store_tma, ROUND_Y=not fp32_logits and hidden.dtype != torch.float32,
        EVEN_K=hidden_size % t.block_k == 0, USE_TMA=tma, DOT_PRECISION=dot_precision(hidden.dtype),
        UPCAST=interpreting(), BLOCK_N=t.block_n, BLOCK_V=t.block_v, BLOCK_K=t.block_k, GROUP_N=cfg.group_n,
        PERSISTENT=cfg.persistent, num_warps=t.warps, num_stages=t.stages, **flags)
