"""CuTe DSL backend of the vocabulary pass (Hopper): the statistics GEMM is a persistent,
warp-specialized WGMMA kernel written in CUTLASS's CuTe DSL (:mod:`.kernels`); the backward is the
GEMM-epilogue design's: a row kernel turns the kept fp16-centred tile into ``dy`` in place
(:mod:`logitless.ops.triton_shared.centred`), then ``d hidden``/``d weight`` run in cuBLAS
(:func:`~logitless.ops.triton_shared.weight_grad.block_grads`); where the gradient comes through
``logp`` alone the GEMMs read the kept tile as it is (:mod:`logitless.ops.triton_shared.prob_tile`).

The contract of :mod:`logitless.ops.contract`, tested against :mod:`.torch_backend` on the GPU
(``tests/test_cute_backend.py``); the torch backend is its specification on CPUs, where CuTe
kernels cannot run. Without kept logits (recompute mode, or a vocabulary cut into blocks) the
backward recomputes a block's tile with the same kernel, storing it, and reads it back.

bf16/fp16 inputs only, sm90 only (``PassOptions(impl="cute")``; ``pip install 'logitless[cute]'``):
fp32/fp64 inputs and heads with a LoRA adapter run on the Triton or torch backend
(:func:`~logitless.ops.contract.resolve_backend`).
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
from .kernels import TILE_V, launch_forward, z_buffer

NAME = "cute"
PLAN = "gemm"  # the same 2-byte kept tile as the GEMM-epilogue backend
CAPS = Capabilities(dtypes=(torch.bfloat16, torch.float16), lora=False, stores_weight_grad=True,
                    pairs_weight_grad=True, distill=True, sum_sq=True, starts_early=True,
                    unchecked_values=True)
# Rows a started GEMM (start_rows) comes in: the persistent scheduler's bands of 8 clusters of two
# 128-row tiles; a GEMM over part of a band ran at 55-85% of the full bands' pace (Llama-3's head,
# H200: 1152 rows 2.92 ms, where 8192 take 11.7).
START_ALIGN = 2048


def chunk_forward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, want: StatRequest, keep_logits: bool,
                  started: StartedRows | None = None) -> tuple[RowStats, CentredTile | ProbTile | None]:
    """Partial statistics (fp32) of one token chunk over the head's local rows; ``kept`` holds
    the chunk's logits when ``keep_logits`` and the plan keeps whole rows: centred fp16, or as
    scaled probabilities where the gradient comes through ``logp`` alone (:func:`folds`).
    ``started``: the chunk's first rows, launched before (:func:`start_rows`).

    Raises:
        ValueError: adapter rows, or inputs that are not bf16/fp16.
    """
    ops = TileOperands.of_chunk(head, rows, "cute")
    n, vocab = ops.hidden.shape[0], ops.weight.shape[0]
    if n == 0 or vocab == 0:
        owned = (ops.targets >= 0) & (ops.targets < vocab)
        return RowStats.start(n, torch.float32, ops.hidden.device, want, owned), None
    keep = keep_logits and plan.vocab_block >= vocab
    fold = keep and folds(ops, want, head.parallel)
    parts, z = launch_after(lambda o, out: launch_forward(o, want, plan.fp32_logits, out), ops,
                            (lambda rows: z_buffer(rows, vocab, ops.hidden.device, fold)) if keep else None, started)
    # Built after the launch: the host prepares it while the GEMM runs.
    owned = (ops.targets >= 0) & (ops.targets < vocab)
    return RowStats.combine(parts, owned), kept_tile(z, parts, fold, TILE_V)


def start_rows(head: LocalHead, rows: ChunkRows, want: StatRequest, fp32_logits: bool,
               store_rows: int, after: StartedRows | None = None) -> StartedRows:
    """Launch the statistics GEMM of a pass's first rows, for the first chunk's
    :func:`chunk_forward` to join (:func:`~logitless.ops.engine.start_pass`); ``store_rows > 0``:
    their logits go to the first rows of a buffer of that many rows, the first chunk's.
    ``after``: these rows follow the rows it covers (the same buffer; the result covers both)."""
    ops = TileOperands.of_chunk(head, rows, "cute")
    n = ops.hidden.shape[0]
    fold = folds(ops, want, head.parallel)
    covered, parts, z = launch_started(
        lambda o, out: launch_forward(o, want, fp32_logits, out), ops,
        (lambda: z_buffer(max(n, store_rows), ops.weight.shape[0], ops.hidden.device, fold)) if store_rows else None,
        after)
    return StartedRows(covered, parts, z, NAME, want, fp32_logits)


def chunk_backward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, saved: SavedStats, grads: StatGrads,
                   acc: Accumulators, kept: CentredTile | ProbTile | None) -> torch.Tensor | None:
    """``d hidden`` (fp32) of one chunk and, in place, the accumulators; ``kept`` is
    **overwritten** (a centred tile with ``dy``).

    Raises:
        ValueError: an entropy gradient without ``saved.sum_pz``; adapter rows; inputs that
            are not bf16/fp16.
    """
    ops = TileOperands.of_chunk(head, rows, "cute")
    if isinstance(kept, ProbTile):
        return prob_tile_grads(kept, ops, saved.lse, grads, acc, round_y=not plan.fp32_logits)
    hidden, weight, targets = ops.hidden, ops.weight, ops.targets
    rc = RowCoefficients.make(saved, grads)
    grad_hidden = None
    for block in plan.vocab_blocks(weight.shape[0], whole=kept is not None):
        tile = kept
        if tile is None:
            tile = stats_tile(ops.block(block), StatRequest(entropy=False), plan.fp32_logits, True)[1]
        dy = tile_dy(tile, hidden.dtype, targets, block.start, head.transform, rc)
        grad_hidden = block_grads(dy, weight, hidden, block, acc, grad_hidden)
        del dy, tile
    if acc.hidden and grad_hidden is None:  # an empty vocabulary shard
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return grad_hidden


def stats_tile(ops: TileOperands, want: StatRequest, fp32_logits: bool,
               store: bool) -> tuple[dict[str, torch.Tensor], CentredTile | None]:
    """One head's statistics GEMM over ``ops``' rows: its ``[tiles, n]`` partials and, with
    ``store``, its logits as a centred fp16 tile (a backward's recomputed tile; distillation's
    :data:`~logitless.ops.triton_shared.distill_tiles.StatsTile`)."""
    z = z_buffer(ops.hidden.shape[0], ops.weight.shape[0], ops.hidden.device) if store else None
    parts = launch_forward(ops, want, fp32_logits, z)
    return parts, None if z is None else CentredTile(z, parts["m"], TILE_V)
