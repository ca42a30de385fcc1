"""Triton kernels of the flash backend: the logits tile is a ``tl.dot`` in registers, never memory.

* :func:`_flash_stats_kernel` (forward): program ``(token block, vocabulary split)`` computes the
  ``[BLOCK_N, BLOCK_V]`` tiles of ``y = hidden @ weight.T`` of its split one after the other
  (``tl.dot`` over ``H`` in ``BLOCK_K`` steps, fp32 accumulator), applies bias and the
  :class:`~logitless.ops.transform.LogitTransform` in registers and folds each tile into online
  per-row statistics (max, ``Σ exp``, ``Σ exp·z``, the target's logit, ``Σ z``). Each split
  writes its partials to ``[splits, n]`` fp32 buffers; the caller combines them (a log-sum-exp
  over ``splits`` values per row). No ``[n, V]`` buffer exists.
* :func:`_flash_grad_kernel` (backward): program ``(token block, vocabulary tile)`` recomputes
  its logits tile, turns it into ``dy = dL/dy`` (the same formula as
  :func:`logitless.ops.torch_backend.backend.chunk_backward`), then walks ``H`` in ``BLOCK_K`` steps and
  adds ``dy @ W[tile]`` to ``d hidden`` and ``dyᵀ @ hidden`` to ``d weight[tile]`` with fp32
  ``tl.atomic_add`` (relaxed). Per chunk of ``n`` tokens that is ``cdiv(V, BLOCK_V) · n · H``
  atomic additions into ``d hidden`` and ``cdiv(n, BLOCK_N) · V · H`` into ``d weight``: the
  price of never storing ``dy``. Atomic fp32 sums make the gradients non-bit-reproducible
  (the order of the additions varies from run to run).

Both kernels read ``hidden`` and ``weight`` through tensor descriptors (the Hopper copy engine)
when they are 16-byte aligned, else with masked loads, and order their programs so that groups
of ``GROUP_N`` token blocks share weight tiles in L2.

Measured on one H100 (8192 x 4096 x 128256 bf16, ``scripts/gpu_flash_check.py``): the forward
kernel takes 13.6 ms, 1.17x cuBLAS's bare logits GEMM (11.6 ms; plain loads instead of
descriptors: 15.9 ms). The backward kernel takes ~92 ms where the three bf16 GEMMs take 36 ms:
its fp32 atomic additions (~200 GB at the default 128 x 256 tiles), not its matmuls, bound it;
the copy engine's bulk reductions were no faster. Recompute fwd+bwd: 114 ms, the Triton backend
59 ms. What this backend buys is memory: no ``[n, V]`` workspace in either pass (rollout forward:
6 MiB beyond the inputs, the Triton backend 1 GiB), and, with filtering on a peaked head, time.

Gradient filtering (``LOGITLESS_FLASH_FILTER=1``, off by default) skips both matmuls of a tile
whose every ``|dz|`` is at most ``eps · (|g_lse - g_logp| + |g_entropy|)`` of its row, with
``eps = finfo(input dtype).eps / 32`` (Apple CCE's ``filter_eps="auto"``: ``2**-12`` for bf16,
``2**-15`` fp16, ``2**-28`` fp32). For cross-entropy (``g_logp`` only) this is CCE's test
``p_v < eps``. A tile that holds a row's target, or where any row has ``g_sum_z != 0`` (the
mean-logit term touches every entry), is never skipped; ``d bias`` is always exact. What is
dropped is bounded per row by ``Σ_{skipped v} |dy_v| · |W_v|`` (``d hidden``) and per vocabulary
row by ``Σ_{skipped n} |dy_n| · |h_n|`` (``d weight``): each entry is below the input dtype's
resolution relative to the row's gradient scale, but for flat distributions (many entries just
below ``eps``, e.g. an untrained head or a high temperature) the sum of many can be a visible
bias. Measured on a peaked synthetic head (88 % of 128 x 128 tiles skippable): backward 90 ->
39 ms, gradients off by 7e-3 (``d hidden``) and 3e-3 (``d weight``) in relative norm, i.e. more
than bf16 rounding: ~11 % of that head's probability mass sits below ``eps``. Meant for trained,
peaked heads; check against an unfiltered step before relying on it.

Layout: launch configs -> ``@triton.jit`` helpers -> kernels -> launchers. The contract functions
(``chunk_forward``/``chunk_backward``) live in :mod:`logitless.ops.flash_backend.backend`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from ..settings import on_reload, settings
from ..transform import LogitTransform
from ..triton_shared.common import interpreting, raw_grad, transform_args
from ..triton_shared.tile_gemm import (
    Tiles,
    check_operands,
    dot_precision,
    grouped,
    head_logits,
    load_tile,
    mma,
    operand_src,
    sm_count,
    tile_dz,
    tma_ready,
)

if TYPE_CHECKING:
    from ..contract import RowCoefficients, StatRequest

# ---------------------------------------------------------------------------------------------
# Launch configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlashConfig:
    """Every tunable of the flash kernels, in one place.

    Attributes:
        fwd, bwd: :class:`Tiles` of the forward and the backward kernel for bf16/fp16 inputs.
        fwd_fp32, bwd_fp32: the same for fp32 inputs (a pipeline stage of fp32 operands takes
            twice the shared memory).
        group_n: token blocks whose programs are launched together, so that the weight tiles
            they share are read from HBM once per group and then hit L2.
        programs_per_sm: forward programs aimed for per SM; the vocabulary is cut into
            ``cdiv(programs_per_sm · SMs, token blocks)`` splits, so the last wave is a small
            fraction of the run.
        tma: read ``hidden``/``weight`` through tensor descriptors (the copy engine, Hopper and
            later) where they are 16-byte aligned; else plain masked loads.
        filter: gradient filtering (``LOGITLESS_FLASH_FILTER=1``; see the module docstring).
        autotune: benchmark a few tile shapes instead (``LOGITLESS_FLASH_AUTOTUNE=1``; plain loads).
    """

    fwd: Tiles
    bwd: Tiles
    fwd_fp32: Tiles
    bwd_fp32: Tiles
    group_n: int
    programs_per_sm: int
    tma: bool
    filter: bool
    autotune: bool

    def tiles(self, kernel: str, dtype: torch.dtype) -> Tiles:
        """:class:`Tiles` of ``kernel`` (``"fwd"``/``"bwd"``) for ``dtype`` inputs."""
        return getattr(self, kernel + ("_fp32" if dtype == torch.float32 else ""))

    def splits(self, n: int, vocab: int, tiles: Tiles, device: torch.device) -> int:
        """Vocabulary splits of the forward (``tiles``) for ``n`` tokens (1 to the number of tiles)."""
        n_tiles = triton.cdiv(vocab, tiles.block_v)
        want = triton.cdiv(self.programs_per_sm * sm_count(device), triton.cdiv(n, tiles.block_n))
        per_split = triton.cdiv(n_tiles, max(1, min(n_tiles, want)))
        return triton.cdiv(n_tiles, per_split)


class FlashGrads(NamedTuple):
    """Outputs of :func:`launch_grad`: fp32 accumulators with unit stride along the last dim,
    updated in place (``None``: not needed), and whether logits stay fp32 (``ChunkPlan``)."""

    hidden: torch.Tensor | None  # [n, H]
    weight: torch.Tensor | None  # [V, H]
    bias: torch.Tensor | None  # [V]
    fp32_logits: bool


@functools.cache
def flash_config() -> FlashConfig:
    """The config, built once per process from :func:`~logitless.ops.settings.settings`.

    GPU defaults, the fastest of a sweep on an H100 at 8192 x 4096 x 128256 bf16: forward
    128 x 128 tiles, ``BLOCK_K`` 64, 8 warps, 4 stages (a stage holds a 128 x 64 slice of
    ``hidden`` and of ``W``: 32 KB of shared memory; 3 stages: 15.9 ms instead of 13.5, 256 x 128:
    13.9); backward 128 x 256 x 32, 8 warps, 3 stages (90 ms; twice the vocabulary entries per
    program halve the ``d hidden`` atomics: 128 x 128 x 64 took 122 ms, 256 x 128 x 32 96 ms).
    fp32 inputs: 128 x 128 x 32 forward (4 stages, 128 KB) and 128 x 128 x 16 backward (4 stages,
    192 KB), chosen to fit the 227 KB of shared memory, not measured for speed.
    Under the interpreter: 16-32 wide tiles and ``BLOCK_K`` 16, so small test shapes cover several
    tiles, vocabulary splits, masked tails and ``H`` steps.

    Raises:
        ValueError: ``LOGITLESS_FLASH_FILTER``/``LOGITLESS_FLASH_AUTOTUNE`` not ``0``/``1``
            (:func:`~logitless.ops.settings.settings`).
    """
    env = settings()
    if interpreting():
        small_fwd, small_bwd = Tiles(16, 32, 16, 1, 1), Tiles(32, 16, 16, 1, 1)
        return FlashConfig(fwd=small_fwd, bwd=small_bwd, fwd_fp32=small_fwd, bwd_fp32=small_bwd, group_n=2,
                           programs_per_sm=4, tma=True, filter=env.flash_filter, autotune=False)
    autotune = env.flash_autotune
    return FlashConfig(fwd=Tiles(128, 128, 64, 8, 4), bwd=Tiles(128, 256, 32, 8, 3),
                       fwd_fp32=Tiles(128, 128, 32, 8, 4), bwd_fp32=Tiles(128, 128, 16, 8, 4), group_n=16,
                       programs_per_sm=16, tma=not autotune, filter=env.flash_filter,
                       autotune=autotune)


on_reload(flash_config.cache_clear)


# LOGITLESS_FLASH_AUTOTUNE=1: both kernels pick among these (BLOCK_N, BLOCK_V, BLOCK_K, warps,
# stages); the ones that do not fit in shared memory are skipped by the autotuner.
_TUNE = [triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk}, num_warps=w, num_stages=s)
         for bn, bv, bk, w, s in ((128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (256, 128, 64, 8, 3),
                                  (128, 256, 32, 8, 3), (256, 128, 32, 8, 3), (128, 128, 32, 8, 4),
                                  (64, 128, 64, 4, 4), (128, 128, 16, 8, 4), (64, 128, 32, 4, 3))]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _add_tile(dst_ptr, stride, val, idx, idx_ok, k0, hidden_size, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``dst[idx, k0 : k0 + BLOCK_K] += val``: fp32 atomics (relaxed; vectorized by 4 on Hopper).
    The copy engine's bulk reductions (``desc.atomic_add``) measured no faster on an H100."""
    ks = k0 + tl.arange(0, BLOCK_K)
    ptrs = dst_ptr + idx.to(tl.int64)[:, None] * stride + ks[None, :]
    if EVEN_K:
        mask = idx_ok[:, None]
    else:
        mask = idx_ok[:, None] & (ks < hidden_size)[None, :]
    tl.atomic_add(ptrs, val, mask=mask, sem="relaxed")


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _flash_stats_kernel(
    h_src, stride_hn,  # [n, H] hidden (descriptor of [BLOCK_N, BLOCK_K] blocks, or pointer), unit stride along H
    w_src, stride_wv,  # [V, H] weight (descriptor of [BLOCK_V, BLOCK_K] blocks, or pointer), unit stride along H
    bias_ptr,  # [V] or dummy
    tgt_ptr,  # [n] int64 targets (outside [0, V): not in this range)
    m_ptr, se_ptr, sez_ptr, zy_ptr, sz_ptr, ssq_ptr,  # [splits, n] fp32 outputs (row stride n)
    n, vocab, hidden_size, n_splits,
    logit_scale, softcap, temperature,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr, WANT_ENTROPY: tl.constexpr, WANT_SUM_Z: tl.constexpr, WANT_SUM_SQ: tl.constexpr,
    ROUND_Y: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid_n, split = grouped(tl.program_id(0), tl.cdiv(n, BLOCK_N), n_splits, GROUP_N)
    n_tiles = tl.cdiv(vocab, BLOCK_V)
    per_split = tl.cdiv(n_tiles, n_splits)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    m_run = tl.full([BLOCK_N], -float("inf"), dtype=tl.float32)
    se = tl.zeros([BLOCK_N], dtype=tl.float32)
    sez = tl.zeros([BLOCK_N], dtype=tl.float32)
    zy = tl.zeros([BLOCK_N], dtype=tl.float32)
    sz = tl.zeros([BLOCK_N], dtype=tl.float32)
    ssq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        z = head_logits(h_src, stride_hn, w_src, stride_wv, bias_ptr, rows, cols, row_ok, col_ok, pid_n * BLOCK_N,
                        tile * BLOCK_V, hidden_size, logit_scale, softcap, temperature, HAS_BIAS, HAS_SCALE,
                        HAS_SOFTCAP, HAS_TEMPERATURE, ROUND_Y, EVEN_K, USE_TMA, DOT_PRECISION, UPCAST,
                        BLOCK_N, BLOCK_V, BLOCK_K)
        # Masked columns: -inf for the max and exp (e = 0); z itself is finite there (y = 0), so
        # e * z is 0 rather than 0 * -inf. Every tile has a valid column, so m_new is finite.
        z_or_ninf = tl.where(col_ok[None, :], z, -float("inf"))
        m_new = tl.maximum(m_run, tl.max(z_or_ninf, axis=1))
        alpha = tl.exp(m_run - m_new)  # 0 on the first tile (m_run = -inf)
        e = tl.exp(z_or_ninf - m_new[:, None])
        se = se * alpha + tl.sum(e, axis=1)
        if WANT_ENTROPY:
            sez = sez * alpha + tl.sum(e * z, axis=1)
        if WANT_SUM_Z:
            sz += tl.sum(tl.where(col_ok[None, :], z, 0.0), axis=1)
        if WANT_SUM_SQ:  # Σ e², rescaled by alpha² (the same max, squared)
            ssq = ssq * (alpha * alpha) + tl.sum(e * e, axis=1)
        m_run = m_new
        # The target's logit is read from the same tile as the sums, so zy >= max is exact at top-1.
        zy += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    out = split * n + rows
    tl.store(m_ptr + out, m_run, mask=row_ok)
    tl.store(se_ptr + out, se, mask=row_ok)
    tl.store(zy_ptr + out, zy, mask=row_ok)
    if WANT_ENTROPY:
        tl.store(sez_ptr + out, sez, mask=row_ok)
    if WANT_SUM_Z:
        tl.store(sz_ptr + out, sz, mask=row_ok)
    if WANT_SUM_SQ:
        tl.store(ssq_ptr + out, ssq, mask=row_ok)


@triton.jit
def _flash_grad_kernel(
    h_src, stride_hn,  # [n, H] hidden (descriptor of [BLOCK_N, BLOCK_K] blocks, or pointer), unit stride along H
    w_src, stride_wv,  # [V, H] weight (descriptor of [BLOCK_V, BLOCK_K] blocks, or pointer), unit stride along H
    bias_ptr, tgt_ptr,  # [V] or dummy; [n] int64
    lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,  # [n] fp32 (dummies when absent)
    dh_ptr, stride_dhn,  # [n, H] fp32 accumulator or dummy
    dw_ptr, stride_dwv,  # [V, H] fp32 accumulator or dummy
    db_ptr,  # [V] fp32 accumulator or dummy
    n, vocab, hidden_size,
    logit_scale, softcap, temperature, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr, HAS_FACTOR: tl.constexpr, HAS_LOGP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_SUM_Z: tl.constexpr,
    NEED_DH: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, FILTER: tl.constexpr,
    ROUND_Y: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    n_blocks = tl.cdiv(n, BLOCK_N)
    pid_n, pid_v = grouped(tl.program_id(0), n_blocks, tl.cdiv(vocab, BLOCK_V), GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n
    col_ok = cols < vocab
    mask = row_ok[:, None] & col_ok[None, :]
    row0 = pid_n * BLOCK_N
    col0 = pid_v * BLOCK_V
    z = head_logits(h_src, stride_hn, w_src, stride_wv, bias_ptr, rows, cols, row_ok, col_ok, row0, col0,
                    hidden_size, logit_scale, softcap, temperature, HAS_BIAS, HAS_SCALE, HAS_SOFTCAP,
                    HAS_TEMPERATURE, ROUND_Y, EVEN_K, USE_TMA, DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_K)
    dz = tile_dz(z, rows, row_ok, cols, tgt_ptr, lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,
                 HAS_LOGP, HAS_ENTROPY, HAS_SUM_Z)
    # Dead lanes: dead rows may hold exp overflow (lse = 0 there) times 0, i.e. NaN; zero them.
    dz = tl.where(mask, dz, 0.0)
    dy = raw_grad(dz, z, logit_scale, softcap, temperature, HAS_SOFTCAP, HAS_FACTOR)
    if NEED_DB:
        tl.atomic_add(db_ptr + cols, tl.sum(dy, axis=0), mask=col_ok, sem="relaxed")
    if FILTER:  # the row inputs again (cached): tile_dz keeps them to itself
        scale = tl.abs(tl.load(coef_ptr + rows, mask=row_ok, other=0.0))
        if HAS_ENTROPY:
            scale += tl.abs(tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0))
        skip = tl.max(tl.abs(dz) - filter_eps * scale[:, None]) <= 0.0
        if HAS_LOGP:
            tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
            skip = skip & (tl.max(tl.where(row_ok & (tgt >= pid_v * BLOCK_V) & (tgt < pid_v * BLOCK_V + BLOCK_V),
                                           1, 0)) == 0)
        if HAS_SUM_Z:
            skip = skip & (tl.max(tl.abs(tl.load(g_sz_ptr + rows, mask=row_ok, other=0.0))) == 0.0)
    else:
        skip = False
    if not skip:
        if USE_TMA:
            dy_mm = dy.to(h_src.dtype)
        else:
            dy_mm = dy.to(h_src.dtype.element_ty)
        num_k = tl.cdiv(hidden_size, BLOCK_K)
        # Programs of one token block (or one vocabulary tile) start at different H blocks, so
        # their atomic additions to the same d hidden (d weight) rows do not queue on one address.
        k_shift = pid_n + pid_v
        for kk in range(0, num_k):
            k0 = ((kk + k_shift) % num_k) * BLOCK_K
            if NEED_DH:
                w_k = load_tile(w_src, stride_wv, cols, col_ok, col0, k0, hidden_size, BLOCK_K, EVEN_K, USE_TMA)
                dh = mma(dy_mm, w_k, None, DOT_PRECISION, UPCAST)  # [BLOCK_N, BLOCK_K]
                _add_tile(dh_ptr, stride_dhn, dh, rows, row_ok, k0, hidden_size, BLOCK_K, EVEN_K)
            if NEED_DW:
                h_k = load_tile(h_src, stride_hn, rows, row_ok, row0, k0, hidden_size, BLOCK_K, EVEN_K, USE_TMA)
                dw = mma(tl.trans(dy_mm), h_k, None, DOT_PRECISION, UPCAST)  # [BLOCK_V, BLOCK_K]
                _add_tile(dw_ptr, stride_dwv, dw, cols, col_ok, k0, hidden_size, BLOCK_K, EVEN_K)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


@functools.cache
def _autotuned(kernel):
    # The forward only stores, so trials need no restoring; the backward adds into its
    # accumulators, which every trial must find as they were.
    restore = ["dh_ptr", "dw_ptr", "db_ptr"] if kernel is _flash_grad_kernel else None
    return triton.autotune(_TUNE, key=["vocab", "hidden_size"], restore_value=restore)(kernel)


def _launch(kernel, cfg: FlashConfig, tiles: Tiles, n_programs, *args, **constexprs) -> None:
    if cfg.autotune:
        _autotuned(kernel)[lambda meta: (n_programs(meta["BLOCK_N"], meta["BLOCK_V"]),)](
            *args, **constexprs, GROUP_N=cfg.group_n)
    else:
        kernel[(n_programs(tiles.block_n, tiles.block_v),)](
            *args, **constexprs, BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_K=tiles.block_k,
            GROUP_N=cfg.group_n, num_warps=tiles.warps, num_stages=tiles.stages)


def launch_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 transform: LogitTransform, want: StatRequest, fp32_logits: bool,
                 cfg: FlashConfig) -> dict[str, torch.Tensor]:
    """Per-split partial statistics of ``hidden [n, H]`` against ``weight [V, H]``.

    Args:
        hidden, weight: fp16/bf16/fp32, same dtype, unit stride along ``H``.
        bias: ``[V]`` or ``None``.
        targets: ``[n]`` int64; values outside ``[0, V)`` leave ``zy`` at 0.
        want: :class:`~logitless.ops.contract.StatRequest`: whether ``sez``/``sz``/``ssq`` are computed.
        fp32_logits: keep the matmul output in fp32 (else round it to the input dtype first, as
            the plain bf16/fp16 path does; :class:`~logitless.ops.plan.ChunkPlan`).

    Returns:
        ``{"m", "se", "zy"[, "sez"][, "sz"][, "ssq"]}``: fp32 ``[splits, n]`` buffers; for split ``s``,
        ``m`` is the max logit of its vocabulary range (``-inf`` if the range is empty),
        ``se = Σ exp(z - m)``, ``sez = Σ exp(z - m) z``, ``zy`` the target's logit if it lies
        in the range (else 0), ``sz = Σ z``, ``ssq = Σ exp(2 (z - m))``.
    """
    check_operands(hidden, weight)
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    t = cfg.tiles("fwd", hidden.dtype)
    splits = cfg.splits(n, vocab, t, hidden.device)
    optional = (("sez", want.entropy), ("sz", want.sum_z), ("ssq", want.sum_sq))
    names = ("m", "se", "zy", *(k for k, on in optional if on))
    out = {k: torch.empty((splits, n), dtype=torch.float32, device=hidden.device) for k in names}
    scalars, flags = transform_args(transform)
    tma = cfg.tma and tma_ready(hidden, weight)
    _launch(_flash_stats_kernel, cfg, t, lambda bn, _bv: triton.cdiv(n, bn) * splits,
            operand_src(hidden, t.block_n, t, tma), hidden.stride(0), operand_src(weight, t.block_v, t, tma),
            weight.stride(0), hidden if bias is None else bias, targets,
            out["m"], out["se"], out.get("sez", out["se"]), out["zy"], out.get("sz", out["se"]),
            out.get("ssq", out["se"]), n, vocab, hidden_size, splits, *scalars,
            HAS_BIAS=bias is not None, WANT_ENTROPY=want.entropy, WANT_SUM_Z=want.sum_z, WANT_SUM_SQ=want.sum_sq,
            ROUND_Y=not fp32_logits and hidden.dtype != torch.float32,
            EVEN_K=hidden_size % t.block_k == 0 and not cfg.autotune, USE_TMA=tma,
            DOT_PRECISION=dot_precision(hidden.dtype), UPCAST=interpreting(), **flags)
    return out


def launch_grad(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                transform: LogitTransform, rc: RowCoefficients, grads: FlashGrads, cfg: FlashConfig) -> None:
    """Add one chunk's gradients into fp32 accumulators, recomputing the logits tile by tile.

    With ``p = exp(z - lse)``: ``dz = p (coef - g_entropy (z - sum_pz)) + g_logp [v == y] + g_sum_z``,
    ``coef = g_lse - g_logp``, ``dy = dz · dz/dy`` through ``transform``; then
    ``grad_hidden += dy @ weight``, ``grad_weight += dyᵀ @ hidden``, ``grad_bias += Σ_n dy``
    (``dy`` rounded to the input dtype for the two matmuls, as in the other backends' GPU path).

    Args:
        hidden, weight, bias, targets, transform: as :func:`launch_stats`.
        rc: :class:`~logitless.ops.contract.RowCoefficients` (``[n]`` fp32 each).
        grads: :class:`FlashGrads`, fp32 accumulators updated in place.
        cfg: ``cfg.filter`` turns on gradient filtering (module docstring).
    """
    check_operands(hidden, weight)
    lse, sum_pz, coef, g_logp, g_entropy, g_sum_z = rc
    grad_hidden, grad_weight, grad_bias, fp32_logits = grads
    assert (sum_pz is None) == (g_entropy is None)
    for acc in (grad_hidden, grad_weight, grad_bias):
        assert acc is None or (acc.dtype == torch.float32 and acc.stride(-1) == 1)
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    scalars, flags = transform_args(transform)
    tma = cfg.tma and tma_ready(hidden, weight)
    dummy = lse
    t = cfg.tiles("bwd", hidden.dtype)
    _launch(_flash_grad_kernel, cfg, t, lambda bn, bv: triton.cdiv(n, bn) * triton.cdiv(vocab, bv),
            operand_src(hidden, t.block_n, t, tma), hidden.stride(0), operand_src(weight, t.block_v, t, tma),
            weight.stride(0), dummy if bias is None else bias, targets,
            lse, dummy if sum_pz is None else sum_pz, coef, dummy if g_logp is None else g_logp,
            dummy if g_entropy is None else g_entropy, dummy if g_sum_z is None else g_sum_z,
            dummy if grad_hidden is None else grad_hidden, 0 if grad_hidden is None else grad_hidden.stride(0),
            dummy if grad_weight is None else grad_weight, 0 if grad_weight is None else grad_weight.stride(0),
            dummy if grad_bias is None else grad_bias,
            n, vocab, hidden_size, *scalars, torch.finfo(hidden.dtype).eps / 32,
            HAS_BIAS=bias is not None, HAS_FACTOR=transform.logit_scale / transform.temperature != 1.0,
            HAS_LOGP=g_logp is not None, HAS_ENTROPY=g_entropy is not None, HAS_SUM_Z=g_sum_z is not None,
            NEED_DH=grad_hidden is not None, NEED_DW=grad_weight is not None, NEED_DB=grad_bias is not None,
            FILTER=cfg.filter, ROUND_Y=not fp32_logits and hidden.dtype != torch.float32,
            EVEN_K=hidden_size % t.block_k == 0 and not cfg.autotune, USE_TMA=tma,
            DOT_PRECISION=dot_precision(hidden.dtype), UPCAST=interpreting(), **flags)
