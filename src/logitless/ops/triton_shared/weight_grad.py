"""``d weight`` of the GEMM-epilogue backend over several token chunks, held as a bf16 result
and an int8 residual instead of one fp32 accumulator.

``d weight = Σ_chunks dyᵀ @ hidden`` is summed over token chunks. An fp32 accumulator costs
``4 V H`` bytes beside the bf16 result, a read and a write of all of it per chunk, and a final
cast. Here the running sum is the pair ``hi + lo · s(hi)``: ``hi`` is the gradient's own bf16
buffer (the sum rounded to nearest), ``lo`` an int8 count of ``s(hi) = 2**(e - 14)`` for ``hi``'s
binary exponent ``e`` (:func:`_unit_exponent`): the residual ``sum - hi`` is at most half an
ulp of ``hi``, ``2**(e - 8)``, so at most 64 such units. One GEMM per chunk
(:func:`_weight_grad_kernel`) adds its fp32 product to the pair in its epilogue and splits the
sum again, so the result needs no cast, and the ``3 V H`` bytes saved go to longer token chunks,
on which the other GEMMs of the pass run faster, and fewer of them read and write the pair
(:func:`logitless.ops.plan.weight_grad_plan` says where that pays).

Accuracy: the pair carries about 15 significant bits, so each chunk's update is rounded to
``2**-15`` of the running sum (fp32: ``2**-24``); both are far below the final rounding of the
result to bf16 (``2**-9``), which is the same here as a cast of an fp32 sum (``hi`` is the
nearest bf16 to the pair's sum).

Layout: config -> kernels -> launcher; :func:`block_grads` (the
gradient GEMMs of the gemm backend and of distillation's) calls the launcher.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import gemm
from ..contract import Accumulators
from .common import interpreting
from .tile_gemm import grouped, mma, sm_count, tma_ready


@dataclass(frozen=True)
class WeightGradConfig:
    """Launch shape: ``block_v`` vocabulary rows x ``block_h`` hidden columns of ``d weight`` per
    tile, ``block_k`` tokens per ``tl.dot`` step, ``warps``, pipeline ``stages``, ``group_v``
    vocabulary blocks whose tiles run together (their ``dy`` columns hit L2), whether operands
    go through tensor descriptors (``tma``) and whether the pair's loads and the residual's store
    do too (``pair_tma``: shared memory for their blocks beside the pipeline's, against address
    registers for pointers)."""

    block_v: int
    block_h: int
    block_k: int
    warps: int
    stages: int
    group_v: int
    tma: bool
    pair_tma: bool = False


@functools.cache
def weight_grad_config() -> WeightGradConfig:
    """The config for this process. Under the interpreter: 16 x 32 tiles and 16-token steps, so
    small test shapes cover several tiles, masked edges and steps."""
    if interpreting():
        return WeightGradConfig(16, 32, 16, 1, 1, 2, tma=True, pair_tma=True)
    # Measured on one H100 (scripts/gpu_weight_grad_sweep.py; Qwen2.5's head, 7117-token chunks):
    # adding to the pair 12.6 ms against cuBLAS's fp32 accumulation 11.5 (its store: 11.5 against
    # 11.6). 64-token steps with 3 stages leave no shared memory for the pair's blocks, and
    # pointer loads of the pair spill 154 registers (12.5-13.3 ms); 2 stages: 15.5. With the int8
    # residual (one H200, Gemma-2's 2048-token chunks, adding): 4.9 ms; 16-token steps, whose
    # stages leave room for the residual's store block, 6.5; 128 x 128 x 64 tiles 7.1.
    return WeightGradConfig(128, 256, 32, 8, 4, 8, tma=True, pair_tma=True)


@triton.jit
def _nearest_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even) in every Triton: the interpreter's
    cast truncates, the GPU's rounds to nearest. NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x).to(tl.bfloat16)


@triton.jit
def _unit_exponent(hi):
    """``(biased exponent of the residual's unit, finite)`` for bf16 ``hi`` of binary exponent
    ``e``: the unit is ``2**(e - 14)``, or ``2**-126`` below ``|hi| = 2**-112`` (zero and
    subnormals included); ``finite``: whether ``hi`` is."""
    biased = (hi.to(tl.float32).to(tl.uint32, bitcast=True) >> 23) & 0xFF
    return tl.maximum(biased, 15) - 14, biased != 0xFF


@triton.jit
def _split(acc):
    """fp32 ``acc`` as the pair: ``hi`` the nearest bf16, ``lo`` the residual counted in units of
    :func:`_unit_exponent`, rounded to nearest (0 where ``hi`` is not finite)."""
    hi = _nearest_bf16(acc)
    unit, finite = _unit_exponent(hi)
    inverse = ((254 - unit) << 23).to(tl.float32, bitcast=True)  # 1 / unit, a power of two
    # acc - hi is exact and at most 64 units, so the product is exact; adding then taking away
    # 1.5 * 2**23 rounds it to an integer (ties to even) in two additions.
    count = ((acc - hi.to(tl.float32)) * inverse + 12582912.0) - 12582912.0
    return hi, tl.where(finite, count, 0.0).to(tl.int8)


@triton.jit
def _pair_sum(hi, lo):
    """The fp32 value of the pair ``(hi, lo)``."""
    unit, _ = _unit_exponent(hi)
    return hi.to(tl.float32) + lo.to(tl.float32) * (unit << 23).to(tl.float32, bitcast=True)


@triton.jit
def _weight_grad_kernel(
    dy_src, stride_dy,  # [n, V] dy (descriptor of [BLOCK_K, BLOCK_V] blocks, or pointer)
    h_src, stride_h,  # [n, H] hidden (descriptor of [BLOCK_K, BLOCK_H] blocks, or pointer)
    hi_ptr, lo_ptr, stride_w,  # [V, H] bf16 result, int8 residual
    hi_src, lo_src,  # with PAIR_TMA their descriptors of [BLOCK_V, BLOCK_H] blocks (else unused)
    n, vocab, hidden_size,
    FIRST: tl.constexpr, LAST: tl.constexpr, USE_TMA: tl.constexpr, PAIR_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
):
    v_blocks = tl.cdiv(vocab, BLOCK_V)
    h_blocks = tl.cdiv(hidden_size, BLOCK_H)
    # A program per SM walks the tiles; the flattened loop nest loads the next tile's operands
    # during this tile's epilogue.
    for tile in tl.range(tl.program_id(0), v_blocks * h_blocks, tl.num_programs(0), flatten=True):
        pid_v, pid_h = grouped(tile, v_blocks, h_blocks, GROUP_V)
        v0 = pid_v * BLOCK_V
        h0 = pid_h * BLOCK_H
        vs = v0 + tl.arange(0, BLOCK_V)
        hs = h0 + tl.arange(0, BLOCK_H)
        acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
        for k0 in range(0, n, BLOCK_K):
            if USE_TMA:  # the copy engine fills rows past n and columns past V or H with zeros
                a = dy_src.load([k0, v0])
                b = h_src.load([k0, h0])
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < n
                a = tl.load(dy_src + ks.to(tl.int64)[:, None] * stride_dy + vs[None, :],
                            mask=k_ok[:, None] & (vs < vocab)[None, :], other=0.0)
                b = tl.load(h_src + ks.to(tl.int64)[:, None] * stride_h + hs[None, :],
                            mask=k_ok[:, None] & (hs < hidden_size)[None, :], other=0.0)
            acc = mma(tl.trans(a), b, acc, "tf32", UPCAST)
        ok = (vs < vocab)[:, None] & (hs < hidden_size)[None, :]
        # A tile's own int64 offset and int32 offsets within it (V * H may exceed 2**31).
        tile_at = v0.to(tl.int64) * stride_w + h0
        offs = tl.arange(0, BLOCK_V)[:, None] * stride_w + tl.arange(0, BLOCK_H)[None, :]
        if PAIR_TMA:  # the copy engine reads zeros and clips stores outside the tensor
            if not FIRST:
                acc += _pair_sum(hi_src.load([v0, h0]), lo_src.load([v0, h0]))
            hi, lo = _split(acc)
            hi_src.store([v0, h0], hi)
            if not LAST:  # no later chunk reads the last chunk's residual
                if FIRST:
                    lo_src.store([v0, h0], lo)
                else:
                    # Beside the loads' blocks, a descriptor's block for this store would take the
                    # shared memory that the pipeline's stages need. (Pointer loads of the residual
                    # would move the fp32 sum through shared memory to change its layout; this
                    # store's addresses spill registers, which the last chunk saves.)
                    tl.store(lo_ptr + tile_at + offs, lo, mask=ok)
        else:
            if not FIRST:
                acc += _pair_sum(tl.load(hi_ptr + tile_at + offs, mask=ok, other=0.0),
                                 tl.load(lo_ptr + tile_at + offs, mask=ok, other=0))
            hi, lo = _split(acc)
            tl.store(hi_ptr + tile_at + offs, hi, mask=ok)
            if not LAST:
                tl.store(lo_ptr + tile_at + offs, lo, mask=ok)


def launch_weight_grad(dy: torch.Tensor, hidden: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, first: bool,
                       cfg: WeightGradConfig | None = None, *, last: bool = False) -> None:
    """``pair (+)= dyᵀ @ hidden``, the pair split again (see the module docstring).

    Args:
        dy: ``[n, V]`` bf16, unit column stride (``d loss / d logits`` of a chunk's vocabulary block).
        hidden: ``[n, H]`` bf16, unit column stride.
        hi, lo: ``[V, H]`` bf16 and int8 with unit column stride and one row stride (in elements),
            overwritten: ``hi`` the bf16 nearest the sum, ``lo`` the residual in units of
            ``2**(e - 14)``, ``e`` the binary exponent of ``hi``. With ``first`` they are not read
            (uninitialized before); else they hold the sum so far. With ``last`` (no later chunk
            adds) ``lo`` is left as it was: ``hi`` is the result.
    """
    cfg = cfg or weight_grad_config()
    n, vocab = dy.shape
    hidden_size = hidden.shape[1]
    assert dy.dtype == hidden.dtype == hi.dtype == torch.bfloat16 and lo.dtype == torch.int8
    assert hidden.shape[0] == n and hi.shape == lo.shape == (vocab, hidden_size) and hi.stride() == lo.stride()
    assert dy.stride(1) == 1 and hidden.stride(1) == 1 and hi.stride(1) == 1
    if vocab == 0 or hidden_size == 0:
        return
    if n == 0:  # an empty chunk adds nothing; the first one stores zeros
        if first:
            hi.zero_()
            lo.zero_()
        return
    tma = cfg.tma and tma_ready(dy, hidden)
    pair_tma = tma and cfg.pair_tma and tma_ready(hi, lo)
    dy_src, h_src, hi_src, lo_src = dy, hidden, hi, lo
    if tma:
        dy_src = TensorDescriptor.from_tensor(dy, [cfg.block_k, cfg.block_v])
        h_src = TensorDescriptor.from_tensor(hidden, [cfg.block_k, cfg.block_h])
    if pair_tma:
        hi_src = TensorDescriptor.from_tensor(hi, [cfg.block_v, cfg.block_h])
        lo_src = TensorDescriptor.from_tensor(lo, [cfg.block_v, cfg.block_h])
    tiles = triton.cdiv(vocab, cfg.block_v) * triton.cdiv(hidden_size, cfg.block_h)
    _weight_grad_kernel[(min(tiles, sm_count(dy.device)),)](
        dy_src, dy.stride(0), h_src, hidden.stride(0), hi, lo, hi.stride(0), hi_src, lo_src,
        n, vocab, hidden_size,
        FIRST=first, LAST=last, USE_TMA=tma, PAIR_TMA=pair_tma, UPCAST=interpreting(),
        BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, GROUP_V=cfg.group_v,
        num_warps=cfg.warps, num_stages=cfg.stages)


def block_grads(dy: torch.Tensor, weight: torch.Tensor, hidden: torch.Tensor, block: slice, acc: Accumulators,
                grad_hidden: torch.Tensor | None) -> torch.Tensor | None:
    """The gradients of one vocabulary block from its ``dy [n, v]`` (GEMM dtype) in cuBLAS:
    ``d bias[block] += Σ_n dy``, ``d weight[block] += dyᵀ @ hidden`` (fp32 accumulator), and
    ``d hidden (+)= dy @ weight[block]`` in fp32, returned (``grad_hidden`` is ``None`` before
    the first block, or without ``acc.hidden``). With ``acc.write_weight`` the ``d weight``
    product is stored in ``acc.weight``'s dtype instead of added; with ``acc.weight_lo`` it goes
    into that pair (:func:`~logitless.ops.triton_shared.weight_grad.launch_weight_grad`)."""
    if acc.bias is not None:
        acc.bias[block] += dy.sum(dim=0, dtype=torch.float32).to(acc.bias.dtype)
    if acc.hidden:
        w = weight[block]
        if grad_hidden is None:
            grad_hidden = gemm.mm(dy, w, torch.float32)
        else:
            gemm.addmm_(grad_hidden, dy, w)
    if acc.weight is not None and acc.weight_lo is not None:
        launch_weight_grad(dy, hidden, acc.weight[block], acc.weight_lo[block], acc.write_weight,
                           last=acc.last_weight)
    elif acc.weight is not None and acc.write_weight:
        gemm.mm_into(acc.weight[block], dy.t(), hidden)
    elif acc.weight is not None:
        gemm.addmm_(acc.weight[block], dy.t(), hidden)
    return grad_hidden
