"""Triton backend of the vocabulary pass: cuBLAS GEMMs around two Triton row kernels.

The contract of :mod:`logitless.ops.contract`, tested against :mod:`.torch_backend`:

* :func:`chunk_forward`: ``y = hidden @ weight.T`` block by block with ``torch.mm`` into one
  tile, folded into the running statistics by one Triton kernel that reads the tile once
  (bias and :class:`LogitTransform` applied in registers, logits never written). With
  ``keep_logits`` the raw tile is handed back as the opaque ``kept``.
* :func:`chunk_backward`: one Triton kernel overwrites the tile (kept, or recomputed block by
  block) in place with ``dy = dL/dy`` in the GEMM dtype, then ``d hidden = dy @ W`` and
  ``d weight += dy^T @ hidden`` run in cuBLAS with fp32 outputs/accumulators, so a chunk's
  ``d weight`` is never rounded to bf16 before it is summed.

Tile dtype: fp32 (cuBLAS ``out_dtype``, so logits are not rounded to bf16), or the GEMM's own
dtype with ``logits_precision="input"``. Under ``TRITON_INTERPRET=1`` everything runs on CPU
tensors through the same code, with ``torch.mm`` on CPU for the GEMMs. fp64 inputs never reach
this backend (:func:`~logitless.ops.contract.resolve_backend`).
"""

from __future__ import annotations

import torch

from .. import gemm
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
    compact_rows_,
)
from ..lora import LowRank, low_rank_grads, low_rank_into
from ..plan import ChunkPlan
from ..triton_shared.weight_grad import block_grads
from .kernels import KernelConfig, kernel_config, launch_dlogits, launch_stats

NAME = "triton"
PLAN = "triton"
CAPS = Capabilities(dtypes=(torch.float32, torch.bfloat16, torch.float16), lora=True, stores_weight_grad=True,
                    sum_sq=True)


def _tile(hidden: torch.Tensor, weight: torch.Tensor, start: int, end: int, cfg: KernelConfig,
          low: LowRank | None) -> torch.Tensor:
    """Raw ``hidden [n, H] @ weight[start:end].T`` (+ the low-rank term) as a contiguous
    ``[n, v]`` tile in the configured dtype."""
    w = weight[start:end]
    tile = gemm.mm(hidden, w.t(), torch.float32) if cfg.tile == "fp32" else torch.mm(hidden, w.t())
    if low is not None:
        low_rank_into(tile, low, start, end)
    return tile


def chunk_forward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, want: StatRequest,
                  keep_logits: bool) -> tuple[RowStats, torch.Tensor | None]:
    """Partial statistics (fp32) of one token chunk over the head's local rows; ``kept`` is the
    chunk's ``[n, V]`` raw matmul tile (bias and transform *not* applied: opaque, only for
    :func:`chunk_backward`) when ``keep_logits`` and one block covers the rows, else ``None``."""
    hidden = rows.hidden
    vocab = head.weight.shape[0]
    cfg = kernel_config(min(plan.vocab_block, vocab), plan.fp32_logits)
    targets = rows.targets.to(torch.int64).contiguous()
    bias = None if head.bias is None else head.bias.contiguous()
    st = RowStats.start(hidden.shape[0], torch.float32, hidden.device, want,
                        owned=(targets >= 0) & (targets < vocab))
    kept = None
    for block in plan.vocab_blocks(vocab):
        start, end = block.start, block.stop
        tile = _tile(hidden, head.weight, start, end, cfg, rows.low)
        launch_stats(tile, bias, targets, start, head.transform, st, cfg)
        if keep_logits and end - start == vocab:
            kept = tile
        del tile
    return st, kept


def kept_rows(kept: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The kept ``[n, V]`` tile's rows ``idx``, moved in place to its first rows (``kept`` is overwritten)."""
    return compact_rows_(kept, idx)


def chunk_backward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, saved: SavedStats, grads: StatGrads,
                   acc: Accumulators, kept: torch.Tensor | None) -> torch.Tensor | None:
    """``d hidden`` (fp32) of one chunk and, in place, the accumulators. ``kept`` (the tile of
    :func:`chunk_forward`) is **overwritten** with ``dy``.

    Raises:
        ValueError: an entropy gradient without ``saved.sum_pz``.
    """
    hidden = rows.hidden
    vocab = head.weight.shape[0]
    cfg = kernel_config(vocab if kept is not None else min(plan.vocab_block, vocab), plan.fp32_logits)
    targets = rows.targets.to(torch.int64).contiguous()
    bias = None if head.bias is None else head.bias.contiguous()
    rc = RowCoefficients.make(saved, grads)
    grad_hidden = None
    for block in plan.vocab_blocks(vocab, whole=kept is not None):
        start, end = block.start, block.stop
        tile = kept if kept is not None else _tile(hidden, head.weight, start, end, cfg, rows.low)
        # dy goes over the tile's own storage; an fp32 tile is reinterpreted as twice as many
        # bf16/fp16 columns and dy fills the first half of each row (see triton_kernels).
        dy = tile if tile.dtype == hidden.dtype else tile.view(hidden.dtype)[:, :end - start]
        launch_dlogits(tile, dy, bias, targets, start, head.transform, rc, cfg)
        del tile
        grad_hidden = block_grads(dy, head.weight, hidden, block, acc, grad_hidden)
        if rows.low is not None:
            low_rank_grads(dy, rows.low, start, end, acc.lora_x, acc.lora_b)
        del dy
    if acc.hidden and grad_hidden is None:  # an empty vocabulary shard
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return grad_hidden


