"""A fused chunk's kept logits as scaled probabilities, which the backward's GEMMs read as they
are: no ``dy`` pass over the tile (the gemm and cute backends, where the objective's gradient
reaches the logits through ``logp`` alone, :attr:`~logitless.ops.contract.StatRequest.logp_grad_only`).

With one coefficient per row, ``dL/dz_v = coef · p_v + g_logp · [v = y]`` where ``coef = -g_logp``
(no ``lse``, entropy or ``Σ z`` gradient). The statistics GEMM stores ``q_v = exp(z_v - r)`` in bf16,
``r`` a per-row reference (:func:`reference`: the target's logit plus :data:`REF_ABOVE_TARGET`,
from one dot product per row before the GEMM). Then ``p_v = q_v · exp(r - lse)``, so with

* ``s = coef · exp(r - lse) · dz/dy`` (the transform's constant factor) per row, and
* ``q'`` = ``q`` except at the target's column, ``q'_y = (p_y - 1) · exp(lse - r)`` formed in fp32
  from the forward's own target logit (no cancellation where ``p_y`` is close to 1),

``dy = s ⊙ q'``: ``d hidden = s ⊙ (q' @ W)`` and ``d weight = q'ᵀ @ (s ⊙ hidden)``, two GEMMs that
read the tile once each, where the centred tile (:mod:`.centred`) first needs a pass that reads and
writes all of it. Accuracy: ``dy`` carries one bf16 rounding per entry (of ``q``), as the centred
path's ``dy`` does (its own); ``s ⊙ hidden`` adds one bf16 rounding per hidden entry to ``d weight``.

Range: ``Σ_v q_v = exp(lse - r) = exp(-logp_y - 40)``, and an entry lost to bf16's underflow
(``q < e^-92``) has ``p_v < e^-47``. A row whose ``lse - r`` exceeds :data:`FAR_BELOW` (a target
more than 80 nats below ``lse``) or whose ``r - lse`` exceeds :data:`FAR_ABOVE` (an id outside the
head) has its logits recomputed on the device and stored against ``r = lse``
(:func:`_far_rows_kernel`; the statistics GEMM clamps the exponents of such rows, so nothing
overflows before): exact for every row, with no host synchronization.

Layout: the tile -> kernel -> launchers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..contract import Accumulators, StatGrads, StatRequest
from ..transform import LogitTransform
from .centred import CentredTile
from .common import interpreting
from .tile_gemm import TileOperands
from .weight_grad import block_grads

REF_ABOVE_TARGET = 40.0  # r - z_y: an entry stays a normal bf16 down to p_v = e^-47 p_y
# Rows beyond these are recomputed: q and the row's coefficient s stay within e^±45 of their
# natural scales, so neither the GEMMs' fp32 sums nor s ⊙ hidden in bf16 leave the normal range.
FAR_BELOW = 40.0  # lse - r (a target more than 80 nats below lse)
FAR_ABOVE = 45.0  # r - lse (r = z_y + 40 <= lse + 40 for an id of this head)
EXP_CLAMP = 88.0  # the statistics GEMM's largest exponent for q: finite in bf16 (max e^88.72)


class ProbTile(NamedTuple):
    """A kept tile ``q [n, V]`` bf16 (``q_v = exp(z_v - ref)``), the per-row reference ``ref [n]``
    fp32 and the forward's target logit ``target_logit [n]`` fp32; ``rows`` (``[m]`` int64,
    ascending), when set, the only rows a backward runs on (the others' gradient is zero)."""

    q: torch.Tensor
    ref: torch.Tensor
    target_logit: torch.Tensor
    rows: torch.Tensor | None = None


def kept_tile(z: torch.Tensor | None, parts: dict[str, torch.Tensor], fold: bool,
              tile_v: int) -> CentredTile | ProbTile | None:
    """A statistics GEMM's stored logits ``z`` (``None``: none stored) and its partials as the
    backward's kept tile: a :class:`ProbTile` where it stored probabilities (``fold``), else a
    :class:`~.centred.CentredTile` of ``tile_v``-wide tiles."""
    if z is None:
        return None
    if fold:
        return ProbTile(z, parts["ref"][0], parts["zy"][0])
    return CentredTile(z, parts["m"], tile_v)


def folds(ops: TileOperands, want: StatRequest, parallel: bool) -> bool:
    """Whether a chunk's kept tile is a :class:`ProbTile`: the objective asks for the ``logp``
    gradient alone, ``dz/dy`` is one constant (no soft-cap), there is no bias (whose gradient
    would need ``Σ_n dy``), the inputs are bf16 (``s ⊙ hidden`` needs bf16's range) and the whole
    vocabulary is on this rank (``parallel``: a target on another rank gives no reference here)."""
    return (want.logp_grad_only and ops.bias is None and ops.transform.softcap is None and not parallel
            and ops.hidden.dtype == torch.bfloat16)


@triton.jit
def _reference_kernel(h_ptr, stride_h, w_ptr, stride_w, t_ptr, out_ptr, n, vocab, hidden_size, factor, above,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < n
    t = tl.minimum(tl.maximum(tl.load(t_ptr + rows, mask=ok, other=0), 0), vocab - 1)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        both = ok[:, None] & (ks < hidden_size)[None, :]
        h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + ks[None, :], mask=both, other=0.0)
        w = tl.load(w_ptr + t.to(tl.int64)[:, None] * stride_w + ks[None, :], mask=both, other=0.0)
        y += tl.sum(h.to(tl.float32) * w.to(tl.float32), axis=1)
    tl.store(out_ptr + rows, y * factor + above, mask=ok)


def reference(ops: TileOperands) -> torch.Tensor:
    """``[n]`` fp32: each row's target logit plus :data:`REF_ABOVE_TARGET` (one kernel before the
    statistics GEMM; an id outside the head reads row 0 or ``V - 1``: its row is recomputed)."""
    n, hidden_size = ops.hidden.shape
    out = torch.empty(n, dtype=torch.float32, device=ops.hidden.device)
    if n == 0 or ops.weight.shape[0] == 0:
        return out
    block_n, block_k, warps = (4, 16, 1) if interpreting() else (16, 256, 4)
    _reference_kernel[(triton.cdiv(n, block_n),)](
        ops.hidden, ops.hidden.stride(0), ops.weight, ops.weight.stride(0), ops.targets, out, n, ops.weight.shape[0],
        hidden_size, _factor(ops.transform), REF_ABOVE_TARGET, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def _factor(transform: LogitTransform) -> float:
    return transform.logit_scale / transform.temperature


@triton.jit
def _far_rows_kernel(
    q_ptr, stride_q,  # [n, V] bf16 tile
    ref_ptr,  # [n] fp32 references, rewritten (lse) for a recomputed row
    rows_ptr,  # [m] int64 rows of the tile (HAS_ROWS), else rows 0..m-1
    lse_ptr,  # [m] fp32
    h_ptr, stride_h, w_ptr, stride_w,  # [m, H] hidden of those rows, [V, H] weight
    vocab, hidden_size, factor,
    FAR_BELOW: tl.constexpr, FAR_ABOVE: tl.constexpr, HAS_ROWS: tl.constexpr, ROUND_Y: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = i
    if HAS_ROWS:
        row = tl.load(rows_ptr + i)
    lse = tl.load(lse_ptr + i)
    ref = tl.load(ref_ptr + row)
    if (lse - ref > FAR_BELOW) | (ref - lse > FAR_ABOVE):
        for v0 in range(0, vocab, BLOCK_V):
            vs = v0 + tl.arange(0, BLOCK_V)
            v_ok = vs < vocab
            y = tl.zeros([BLOCK_V], dtype=tl.float32)
            for k0 in range(0, hidden_size, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < hidden_size
                h = tl.load(h_ptr + i * stride_h + ks, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + vs.to(tl.int64)[:, None] * stride_w + ks[None, :],
                            mask=v_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                y += tl.sum(w * h[None, :], axis=1)
            if ROUND_Y:  # as the statistics GEMM rounds its logits
                y = y.to(h_ptr.dtype.element_ty).to(tl.float32)
            q = tl.exp(y * factor - lse)
            tl.store(q_ptr + row * stride_q + vs, q.to(q_ptr.dtype.element_ty), mask=v_ok)
        tl.store(ref_ptr + row, lse)


def _recompute_far_rows(tile: ProbTile, ops: TileOperands, lse: torch.Tensor, round_y: bool) -> None:
    """Rows outside the tile's range (module docstring) stored again against ``ref = lse``, in
    place; ``ops`` and ``lse`` are of the rows the backward runs on."""
    q, rows = tile.q, tile.rows
    m = lse.shape[0]
    if m == 0:
        return
    block_v, block_k, warps = (16, 32, 1) if interpreting() else (64, 128, 4)
    _far_rows_kernel[(m,)](
        q, q.stride(0), tile.ref, lse if rows is None else rows, lse, ops.hidden, ops.hidden.stride(0), ops.weight,
        ops.weight.stride(0), ops.weight.shape[0], ops.hidden.shape[1], _factor(ops.transform),
        FAR_BELOW=FAR_BELOW, FAR_ABOVE=FAR_ABOVE, HAS_ROWS=rows is not None, ROUND_Y=round_y,
        BLOCK_V=block_v, BLOCK_K=block_k, num_warps=warps)


def prob_tile_grads(tile: ProbTile, ops: TileOperands, saved_lse: torch.Tensor, grads: StatGrads,
                    acc: Accumulators, round_y: bool) -> torch.Tensor | None:
    """The gradients of a chunk from its kept :class:`ProbTile` (module docstring): ``d weight``
    into ``acc`` (stored, added, or into the pair, as :func:`.weight_grad.block_grads` does)
    and ``d hidden`` (fp32) returned when ``acc.hidden``. ``ops``, ``saved_lse`` and ``grads`` are
    of the rows the backward runs on (``tile.rows`` when set: the others' gradient is zero, and
    the GEMMs run over every row of the tile with a zero coefficient for them). The tile's target
    entries and far rows (and their references) are overwritten.

    Raises:
        RuntimeError: a gradient of ``lse``, the entropy or ``Σ z`` (the tile serves ``logp``'s only).
    """
    if grads.logp is None or grads.lse is not None or grads.entropy is not None or grads.sum_z is not None:
        raise RuntimeError("a pass that asked StatRequest(logp_grad_only=True) got a gradient of lse, the entropy "
                           "or sum_z; ask without logp_grad_only")
    assert acc.bias is None and acc.lora_x is None and acc.lora_b is None
    q, rows = tile.q, tile.rows
    n, vocab = q.shape
    lse = saved_lse.to(torch.float32)
    _recompute_far_rows(tile, ops, lse, round_y)
    at = torch.arange(n, device=q.device) if rows is None else rows
    ref, zy = tile.ref[at], tile.target_logit[at]
    s = -grads.logp.to(torch.float32) * torch.exp(ref - lse) * _factor(ops.transform)  # coef = -g_logp
    # q'_y = (p_y - 1) e^(lse - r) from the exact target logit; a row whose target is outside the
    # head has no one-hot term (dz = coef p): its entry at the clamped column stays as it is.
    col = ops.targets
    owned = (col >= 0) & (col < vocab)
    col = col.clamp(0, max(vocab - 1, 0))
    q_y = torch.where(owned, torch.expm1(zy - lse) * torch.exp(lse - ref), q[at, col].float())
    q[at, col] = q_y.to(q.dtype)
    scaled = torch.mul(ops.hidden, s[:, None], out=torch.empty_like(ops.hidden))  # fp32 products, rounded once
    if rows is not None:  # the other rows of the tile: a zero coefficient
        scaled = scaled.new_zeros((n, scaled.shape[1])).index_copy_(0, rows, scaled)
    grad_hidden = block_grads(q, ops.weight, scaled, slice(0, vocab), acc, None)
    if grad_hidden is None:
        return None
    if rows is not None:
        grad_hidden = grad_hidden[rows]
    return grad_hidden.mul_(s[:, None])
