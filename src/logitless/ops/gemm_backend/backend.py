"""GEMM-epilogue backend of the vocabulary pass: the statistics are computed inside the logits
GEMM, and the kept logits take 2 bytes each.

The contract of :mod:`logitless.ops.contract`, tested against :mod:`.torch_backend`:

* :func:`chunk_forward`: one Triton GEMM over the whole local vocabulary writes per-tile partial
  statistics from its fp32 accumulator (combined by a few torch ops on ``[tiles, n]``); with
  ``keep_logits`` it also stores the chunk's logits as fp16 centred on each tile's maximum
  (:mod:`logitless.ops.gemm_backend.kernels` says why that keeps ~2e-3 nats where it matters). No fp32
  logits are written, and no separate statistics kernel reads them back.
* :func:`chunk_backward`: a row kernel turns the kept tile into ``dy`` in place (where the gradient
  comes through ``logp`` alone, the GEMMs read the kept tile as it is:
  :mod:`logitless.ops.triton_shared.prob_tile`); without kept
  logits the same GEMM recomputes them block by block and writes ``dy`` from its epilogue. Then
  ``d hidden``/``d weight`` run in cuBLAS as in :mod:`.triton_backend` (fp32 accumulation of
  ``d weight`` across chunks), except that a pass of several short chunks adds ``d weight`` into
  a bf16 result + int8 residual pair with its own GEMM (:mod:`logitless.ops.triton_shared.weight_grad`).

Against the Triton backend at default precision (fp32 logits) this halves the tile's bytes
(so token chunks are twice as long in the same budget, and ``d weight`` is read and written half
as often) and removes the fp32 logits' write and two reads. The statistics stay as accurate as
the fp32 path's; the gradient sees the fp16-centred logits (module above).

bf16/fp16 inputs only: fp32 inputs, fp64 inputs and heads with a LoRA adapter run on the
Triton or torch backend (:func:`~logitless.ops.contract.resolve_backend`).
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
    StartedRows,
    StatGrads,
    StatRequest,
)
from ..plan import ChunkPlan
from ..triton_shared.centred import CentredTile, tile_dy
from ..triton_shared.centred import kept_rows as kept_rows  # the contract's kept_rows, shared
from ..triton_shared.prob_tile import ProbTile, folds, kept_tile, prob_tile_grads
from ..triton_shared.tile_gemm import TileOperands, launch_after, launch_started
from ..triton_shared.weight_grad import block_grads
from .kernels import gemm_config, launch_forward, launch_grad_tile

NAME = "gemm"
PLAN = "gemm"
# Its GEMM is written for 16-bit tensor-core operands and has no low-rank term.
CAPS = Capabilities(dtypes=(torch.bfloat16, torch.float16), lora=False, stores_weight_grad=True,
                    pairs_weight_grad=True, distill=True, sum_sq=True, starts_early=True,
                    unchecked_values=True)
START_ALIGN = 128  # rows a started GEMM (start_rows) comes in: whole groups of its token blocks


def chunk_forward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, want: StatRequest, keep_logits: bool,
                  started: StartedRows | None = None) -> tuple[RowStats, CentredTile | ProbTile | None]:
    """Partial statistics (fp32) of one token chunk over the head's local rows; ``kept`` holds
    the chunk's logits when ``keep_logits`` and the plan keeps whole rows: centred fp16, or as
    scaled probabilities where the gradient comes through ``logp`` alone (:func:`folds`).
    ``started``: the chunk's first rows, launched before (:func:`start_rows`).

    Raises:
        ValueError: adapter rows, or inputs that are not bf16/fp16.
    """
    ops = TileOperands.of_chunk(head, rows, "gemm")
    hidden, targets = ops.hidden, ops.targets
    n, vocab = hidden.shape[0], ops.weight.shape[0]
    if n == 0 or vocab == 0:
        return RowStats.start(n, torch.float32, hidden.device, want, (targets >= 0) & (targets < vocab)), None
    keep = keep_logits and plan.vocab_block >= vocab
    fold = keep and folds(ops, want, head.parallel)
    parts, z = launch_after(lambda o, out: launch_forward(o, want, plan.fp32_logits, out, gemm_config()), ops,
                            (lambda rows: _z_buffer(rows, vocab, hidden.device, fold)) if keep else None, started)
    # Built after the launch: the host prepares it while the GEMM runs.
    owned = (targets >= 0) & (targets < vocab)
    return RowStats.combine(parts, owned), kept_tile(z, parts, fold, gemm_config().fwd.block_v)


def _z_buffer(rows: int, vocab: int, device: torch.device, fold: bool) -> torch.Tensor:
    """The kept tile's buffer: bf16 for a :class:`ProbTile`, else fp16 (a :class:`CentredTile`)."""
    return torch.empty((rows, vocab), dtype=torch.bfloat16 if fold else torch.float16, device=device)


def start_rows(head: LocalHead, rows: ChunkRows, want: StatRequest, fp32_logits: bool,
               store_rows: int, after: StartedRows | None = None) -> StartedRows:
    """Launch the statistics GEMM of a pass's first rows, for the first chunk's
    :func:`chunk_forward` to join (:func:`~logitless.ops.engine.start_pass`); ``store_rows > 0``:
    their logits go to the first rows of a buffer of that many rows, the first chunk's.
    ``after``: these rows follow the rows it covers (the same buffer; the result covers both)."""
    ops = TileOperands.of_chunk(head, rows, "gemm")
    n, vocab = ops.hidden.shape[0], ops.weight.shape[0]
    fold = folds(ops, want, head.parallel)
    covered, parts, z = launch_started(
        lambda o, out: launch_forward(o, want, fp32_logits, out, gemm_config()), ops,
        (lambda: _z_buffer(max(n, store_rows), vocab, ops.hidden.device, fold)) if store_rows else None, after)
    return StartedRows(covered, parts, z, NAME, want, fp32_logits)


def chunk_backward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, saved: SavedStats, grads: StatGrads,
                   acc: Accumulators, kept: CentredTile | ProbTile | None) -> torch.Tensor | None:
    """``d hidden`` (fp32) of one chunk and, in place, the accumulators; ``kept`` is
    **overwritten** (a centred tile with ``dy``).

    Raises:
        ValueError: an entropy gradient without ``saved.sum_pz``; adapter rows; inputs that
            are not bf16/fp16.
    """
    ops = TileOperands.of_chunk(head, rows, "gemm")
    if isinstance(kept, ProbTile):
        return prob_tile_grads(kept, ops, saved.lse, grads, acc, round_y=not plan.fp32_logits)
    hidden, weight, targets = ops.hidden, ops.weight, ops.targets
    rc = RowCoefficients.make(saved, grads)
    cfg = gemm_config()
    grad_hidden = None
    for block in plan.vocab_blocks(weight.shape[0], whole=kept is not None):
        if kept is not None:
            dy = tile_dy(kept, hidden.dtype, targets, block.start, head.transform, rc)
        else:
            dy = torch.empty((hidden.shape[0], block.stop - block.start), dtype=hidden.dtype, device=hidden.device)
            launch_grad_tile(ops.block(block), rc, plan.fp32_logits, dy, cfg)
        grad_hidden = block_grads(dy, weight, hidden, block, acc, grad_hidden)
        del dy
    if acc.hidden and grad_hidden is None:  # an empty vocabulary shard
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return grad_hidden
