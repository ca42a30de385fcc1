"""Flash backend of the vocabulary pass: tile GEMMs inside Triton kernels, logits never in memory.

The contract of :mod:`logitless.ops.contract`, tested against :mod:`.torch_backend`:

* :func:`chunk_forward`: one kernel computes ``[BLOCK_N, BLOCK_V]`` logits tiles with ``tl.dot``
  and folds them into online statistics per vocabulary split; a few torch ops combine the
  ``[splits, n]`` partials. No ``[n, V]`` tile is written, so ``keep_logits`` is ignored and
  ``kept`` is always ``None`` (the fused mode then recomputes in :func:`chunk_backward`).
* :func:`chunk_backward`: one kernel recomputes each tile, forms ``dy`` in registers and adds
  ``dy @ W`` / ``dyᵀ @ hidden`` / ``Σ dy`` into fp32 accumulators with atomics; optional
  gradient filtering (``LOGITLESS_FLASH_FILTER=1``), see :mod:`logitless.ops.flash_backend.kernels`.

Workspace: the forward's (up to) five ``[splits, n]`` fp32 buffers (``splits`` about
``16 · SMs / cdiv(n, 128)``: ~5 MB for a 2k-token chunk on an H100) and, in the backward, the
``[n, H]`` fp32 ``d hidden`` it returns; nothing proportional to ``V``. It reuses the Triton plan
(``NAME``), whose token chunks (>= 1024 tokens) keep the tile grid full (one 8192-token chunk
measured no faster); the plan's vocabulary block is unused. In fused mode nothing is kept between
a chunk's statistics and its gradients, so the logits are computed twice per chunk, as in
recompute mode. fp64 inputs and heads with a LoRA adapter never reach this backend
(:func:`~logitless.ops.contract.resolve_backend` sends them to the torch and Triton backends).
"""

from __future__ import annotations

import torch

from ..contract import (
    Accumulators,
    Capabilities,
    ChunkRows,
    LocalHead,
    RowCoefficients,
    RowStats,
    SavedStats,
    StatGrads,
    StatRequest,
)
from ..plan import ChunkPlan
from ..triton_shared.tile_gemm import unit_stride
from .kernels import FlashGrads, flash_config, launch_grad, launch_stats

NAME = "flash"
PLAN = "triton"
# Its tile GEMMs have no low-rank term.
CAPS = Capabilities(dtypes=(torch.float32, torch.bfloat16, torch.float16), lora=False, sum_sq=True)


def _operands(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor):
    """Unit stride along ``H`` (what the kernels index), contiguous bias, int64 targets."""
    hidden, weight = unit_stride(hidden), unit_stride(weight)
    return hidden, weight, None if bias is None else bias.contiguous(), targets.to(torch.int64).contiguous()


def chunk_forward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, want: StatRequest,
                  keep_logits: bool) -> tuple[RowStats, None]:
    """Partial statistics (fp32) of one token chunk over the head's local rows. Nothing is kept
    (``keep_logits`` is ignored): the backward recomputes every tile.

    Raises:
        ValueError: adapter rows (``rows.low``): the kernels have no low-rank term.
    """
    if rows.low is not None:
        raise ValueError("the flash backend has no LoRA adapter term; resolve_backend sends such heads to triton")
    hidden, weight, bias, targets = _operands(rows.hidden, head.weight, head.bias, rows.targets)
    n, vocab = hidden.shape[0], weight.shape[0]
    owned = (targets >= 0) & (targets < vocab)
    if n == 0 or vocab == 0:  # nothing to fold: the empty range's statistics
        return RowStats.start(n, torch.float32, hidden.device, want, owned), None
    parts = launch_stats(hidden, weight, bias, targets, head.transform, want, plan.fp32_logits, flash_config())
    return RowStats.combine(parts, owned), None


def kept_rows(kept: None, idx: torch.Tensor) -> None:
    """Raises ``ValueError``: the flash backend keeps no logits, so there are none to select."""
    raise ValueError("the flash backend keeps no logits; there are no kept rows to select")


def chunk_backward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, saved: SavedStats, grads: StatGrads,
                   acc: Accumulators, kept: None) -> torch.Tensor | None:
    """``d hidden`` (fp32) of one chunk and, in place, the ``d weight``/``d bias`` accumulators
    (fp32: atomically by the kernel; another dtype through an fp32 temporary). With
    ``LOGITLESS_FLASH_FILTER=1`` all three gradients are approximate (see
    :mod:`logitless.ops.flash_backend.kernels`); fp32 atomics make them non-bit-reproducible either way.

    Raises:
        ValueError: an entropy gradient without ``saved.sum_pz``; ``kept`` given.
    """
    if kept is not None:
        raise ValueError("chunk_backward: the flash backend keeps no logits; pass kept=None")
    rc = RowCoefficients.make(saved, grads)
    n, hidden_size = rows.hidden.shape
    dev = rows.hidden.device
    grad_hidden = torch.zeros((n, hidden_size), dtype=torch.float32, device=dev) if acc.hidden else None
    if n == 0 or head.weight.shape[0] == 0 or (grad_hidden is None and acc.weight is None and acc.bias is None):
        return grad_hidden
    hidden, weight, bias, targets = _operands(rows.hidden, head.weight, head.bias, rows.targets)

    def fp32_acc(buf: torch.Tensor | None) -> torch.Tensor | None:
        if buf is None or (buf.dtype == torch.float32 and buf.stride(-1) == 1):
            return buf
        return torch.zeros(buf.shape, dtype=torch.float32, device=dev)

    gw, gb = fp32_acc(acc.weight), fp32_acc(acc.bias)
    launch_grad(hidden, weight, bias, targets, head.transform, rc, FlashGrads(grad_hidden, gw, gb, plan.fp32_logits),
                flash_config())
    for buf, tmp in ((acc.weight, gw), (acc.bias, gb)):
        if buf is not None and tmp is not buf:
            buf += tmp.to(buf.dtype)
    return grad_hidden
