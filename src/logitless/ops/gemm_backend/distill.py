"""Distillation on the GEMM-epilogue kernels: the same partials, statistics and gradients as
:mod:`logitless.ops.torch_backend.distill` (the specification), from Triton GEMMs: this backend's
:class:`~logitless.ops.distill_contract.DistillBackend`.

Per vocabulary block (the whole local vocabulary when a chunk's rows fit the plan):

1. the teacher's logits GEMM writes its partial statistics and stores its tile (fp16, centred
   per tile: :mod:`logitless.ops.gemm_backend.kernels`);
2. the student's logits GEMM writes its partials and stores its tile;
3. a row kernel over both stored tiles writes the cross sums ``sgap``/``tgap`` of both KL
   directions per tile (reading the teacher's tile inside the student's epilogue instead costs
   that GEMM a pipeline stage and doubles its epilogue: 2.6x its time on an H100);
4. a few torch ops fold the ``[tiles, n]`` partials into
   :class:`~logitless.ops.distill_contract.DistillPartials`.

The JSD's second sweep and the gradient are row kernels over both stored tiles
(:mod:`logitless.ops.gemm_backend.distill_kernels`); ``d hidden``/``d weight`` are cuBLAS GEMMs as in the
single-head pass. Kept tiles (fused mode) cost 4 bytes a logit; recompute mode recomputes both
tiles block by block. Scope (:data:`SCOPE`): at most one target id per token (a hard label) and
bf16/fp16 heads of one dtype; the torch backend's functions run everything else
(:func:`~logitless.ops.distill_contract.resolve_distill` decides).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..contract import Accumulators, LocalHead, StatRequest
from ..distill_contract import (
    DistillGrads,
    DistillHeads,
    DistillPartials,
    DistillRows,
    DistillSaved,
    DistillScope,
    p_coefficient,
)
from ..plan import ChunkPlan, PassOptions
from ..triton_shared.centred import CentredTile
from ..triton_shared.tile_gemm import TileOperands
from ..triton_shared.weight_grad import block_grads
from .backend import CAPS as CAPS
from .backend import recompute_tile
from .distill_kernels import DistillRowCoefficients, launch_cross, launch_distill_grad, launch_jsd
from .kernels import GemmConfig, gemm_config, launch_forward

SCOPE = DistillScope(max_targets=1, mixed_dtypes=False)


def plan_for(n_tokens: int, vocab: int, options: PassOptions, dtype: torch.dtype) -> ChunkPlan:
    """The gemm backend's plan for two fp16 tiles, the student's and the teacher's."""
    return ChunkPlan.make(n_tokens, vocab, options.budget, dtype, "gemm", options.fp32_logits, arrays=2)


class DistillTiles(NamedTuple):
    """A chunk's stored logits over the local vocabulary: the student's and the teacher's (``None``
    without a teacher)."""

    student: CentredTile
    teacher: CentredTile | None


def _sides(student: LocalHead, teacher: LocalHead | None, rows: DistillRows) -> tuple[TileOperands,
                                                                                   TileOperands | None]:
    """Both heads' kernel operands for a chunk (the student's hard label, if any, as its target)."""
    label = rows.targets[:, 0] if rows.targets.shape[1] else None
    s_ops = TileOperands.of(student, rows.hidden, label)
    return s_ops, None if teacher is None else TileOperands.of(teacher, rows.teacher_hidden, None)


def _tile(ops: TileOperands, fp32_logits: bool, cfg: GemmConfig,
          store: bool = True) -> tuple[dict, CentredTile | None]:
    """One head's launch over ``ops``' rows: its ``[tiles, n]`` partials and stored tile (``store``)."""
    n, width = ops.hidden.shape[0], ops.weight.shape[0]
    z = torch.empty((n, width), dtype=torch.float16, device=ops.hidden.device) if store else None
    parts = launch_forward(ops, StatRequest(), fp32_logits, z, cfg)
    return parts, None if z is None else CentredTile(z, parts["m"], cfg.fwd.block_v)


def chunk_forward(heads: DistillHeads, rows: DistillRows, plan: ChunkPlan,
                  keep: bool) -> tuple[DistillPartials, DistillTiles | None]:
    """The chunk's :class:`~logitless.ops.distill_contract.DistillPartials` over the local
    vocabulary and, with ``keep`` (whole rows fit the plan), the stored :class:`DistillTiles`."""
    cfg = gemm_config()
    s_ops, t_ops = _sides(heads.student, heads.teacher, rows)
    vocab = s_ops.weight.shape[0]
    keep = keep and plan.vocab_block >= vocab
    s_parts, t_parts, kept = [], [], None
    for block in plan.vocab_blocks(vocab, keep):
        t_tile = None
        parts, s_tile = _tile(s_ops.block(block), plan.fp32_logits, cfg, store=keep or t_ops is not None)
        if t_ops is not None:
            t_parts_block, t_tile = _tile(t_ops.block(block), plan.fp32_logits, cfg)
            t_parts.append(t_parts_block)
            parts["sgap"], parts["tgap"] = launch_cross(s_tile, t_tile)
        s_parts.append(parts)
        if keep:
            kept = DistillTiles(s_tile, t_tile)
    # Every tile's partials, [tiles, n] per field, merged over the tiles as ranks are merged.
    s_all = {k: torch.cat([p[k] for p in s_parts]) for k in s_parts[0] if k != "zy"}
    zy = sum(p["zy"] for p in s_parts).t()  # nonzero in the one block that holds the target
    tiles = DistillPartials(m_s=s_all["m"], se_s=s_all["se"], sez_s=s_all["sez"], zy=zy)
    if t_ops is not None:
        t_all = {k: torch.cat([p[k] for p in t_parts]) for k in ("m", "se", "sez")}
        tiles.sgap, tiles.tgap = s_all["sgap"], s_all["tgap"]
        tiles.m_t, tiles.se_t, tiles.tez = t_all["m"], t_all["se"], t_all["sez"]
    part = tiles.merged(lambda x: x.max(dim=1).values, lambda x: x.sum(dim=1),
                        zy=zy[:, :rows.targets.shape[1]])
    return part, kept


def _both_tiles(s_ops: TileOperands, t_ops: TileOperands | None, block: slice, plan: ChunkPlan,
                cfg: GemmConfig) -> DistillTiles:
    """Both heads' stored tiles of vocabulary rows ``block`` (statistics discarded)."""
    t_tile = None if t_ops is None else recompute_tile(t_ops, block, plan.fp32_logits, cfg)
    return DistillTiles(recompute_tile(s_ops, block, plan.fp32_logits, cfg), t_tile)


def chunk_jsd(heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, lse: torch.Tensor, teacher_lse: torch.Tensor,
              kept: DistillTiles | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(jsd [n], kl_pm [n])`` over the local vocabulary, from the kept tiles or recomputed ones."""
    cfg = gemm_config()
    student, teacher, beta = heads
    sides = None if kept is not None else _sides(student, teacher, rows)
    jsd = torch.zeros_like(lse)
    kl_pm = torch.zeros_like(lse)
    for block in plan.vocab_blocks(student.weight.shape[0], kept is not None):
        tiles = kept if kept is not None else _both_tiles(*sides, block, plan, cfg)
        j, k = launch_jsd(tiles.student, tiles.teacher, lse, teacher_lse, beta)
        jsd += j
        kl_pm += k
    return jsd, kl_pm


def chunk_backward(heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, saved: DistillSaved, g: DistillGrads,
                   acc: Accumulators, kept: DistillTiles | None) -> torch.Tensor | None:
    """The student's gradients of one chunk (:func:`logitless.ops.torch_backend.distill.chunk_backward`'s
    formula), from the kept tiles or tiles recomputed block by block; ``kept`` is overwritten."""
    cfg = gemm_config()
    student, teacher, beta = heads
    teacher_terms = g.teacher_terms()
    s_ops, t_ops = _sides(student, teacher if teacher_terms else None, rows)
    hs = s_ops.hidden

    def f32(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.float().contiguous()

    rc = DistillRowCoefficients(
        lse=f32(saved.lse), coef=f32(p_coefficient(g, saved, beta)),
        sum_pz=f32(saved.sum_pz) if g.entropy is not None else None,
        g_entropy=f32(g.entropy), teacher_lse=f32(saved.teacher_lse) if teacher_terms else None,
        g_reverse_kl=f32(g.reverse_kl), g_forward_kl=f32(g.forward_kl), g_jsd=f32(g.jsd),
        g_logp=None if g.logp is None or g.logp.shape[1] == 0 else f32(g.logp[:, 0]), beta=beta)
    grad_hidden = None
    for block in plan.vocab_blocks(s_ops.weight.shape[0], kept is not None):
        tiles = kept if kept is not None else _both_tiles(s_ops, t_ops, block, plan, cfg)
        dy = tiles.student.z.view(hs.dtype)
        launch_distill_grad(tiles.student, tiles.teacher, dy, s_ops.targets, block.start, student.transform, rc)
        del tiles
        grad_hidden = block_grads(dy, student.weight, hs, block, acc, grad_hidden)
        del dy
    if acc.hidden and grad_hidden is None:  # an empty vocabulary shard
        grad_hidden = torch.zeros(hs.shape, dtype=torch.float32, device=hs.device)
    return grad_hidden
