"""Distillation over two stored tiles, on any statistics GEMM that stores centred fp16 logits
(the GEMM-epilogue backend's Triton kernel, the CuTe backend's): the same partials, statistics
and gradients as :mod:`logitless.ops.torch_backend.distill` (the specification).

Per vocabulary block (the whole local vocabulary when a chunk's rows fit the plan):

1. the teacher's statistics GEMM writes its partial statistics and stores its tile (fp16,
   centred per tile: :class:`~logitless.ops.triton_shared.centred.CentredTile`);
2. the student's statistics GEMM writes its partials and stores its tile;
3. a row kernel over both stored tiles writes the cross sums ``sgap``/``tgap`` of both KL
   directions per tile (reading the teacher's tile inside the student's epilogue instead costs
   that GEMM a pipeline stage and doubles its epilogue: 2.6x its time on an H100);
4. a few torch ops fold the ``[tiles, n]`` partials into
   :class:`~logitless.ops.distill_contract.DistillPartials`.

The JSD's second sweep and the gradient are row kernels over both stored tiles
(:mod:`.distill_rows`); ``d hidden``/``d weight`` are cuBLAS GEMMs as in the single-head pass.
Kept tiles (fused mode) cost 4 bytes a logit; recompute mode recomputes both tiles block by
block. A backend's ``distill`` module binds these functions to its GEMM (a :data:`StatsTile`).

Where the loss's gradient comes through the forward KL alone (``DistillHeads.forward_kl_only``)
and a chunk keeps its whole rows, steps 3 and the gradient's row kernel are one: once the
partials give both ``lse``, one read of both tiles writes the cross sums and ``p - q`` (a
:class:`ForwardKlTile`), before the loss. The loss's per-row factor ``g`` (``dz = g (p - q)``)
then scales the rows of ``hidden`` before the ``d weight`` GEMM and of ``d hidden`` after its
GEMM, as :mod:`.prob_tile` does: ``(g ⊙ D)ᵀ h = Dᵀ (g ⊙ h)`` and ``(g ⊙ D) W = g ⊙ (D W)``.
"""

from __future__ import annotations

from collections.abc import Callable
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
from .centred import CentredTile
from .distill_rows import DistillRowCoefficients, launch_cross, launch_distill_grad, launch_forward_kl, launch_jsd
from .tile_gemm import TileOperands
from .weight_grad import block_grads

# A backend's statistics GEMM over one head's operands: ``(ops, want, fp32_logits, store) ->
# ({"m", "se", "zy"[, "sez"]} [tiles, n] partials, the stored CentredTile or None)``.
StatsTile = Callable[[TileOperands, StatRequest, bool, bool], tuple[dict[str, torch.Tensor], CentredTile | None]]

SCOPE = DistillScope(max_targets=1, mixed_dtypes=False)
"""At most one target id per token (a hard label) and bf16/fp16 heads of one dtype; the torch
backend's functions run everything else (:func:`~logitless.ops.distill_contract.resolve_distill`)."""


def plan_for(n_tokens: int, vocab: int, options: PassOptions, dtype: torch.dtype) -> ChunkPlan:
    """The plan for two fp16 tiles, the student's and the teacher's."""
    return ChunkPlan.make(n_tokens, vocab, options.budget, dtype, "gemm", options.fp32_logits, arrays=2)


class DistillTiles(NamedTuple):
    """A chunk's stored logits over the local vocabulary: the student's and the teacher's (``None``
    without a teacher)."""

    student: CentredTile
    teacher: CentredTile | None


class ForwardKlTile(NamedTuple):
    """A chunk's ``p - q`` over the local vocabulary (``d [n, V]`` bf16, over the student's
    stored tile), the forward KL's gradient before its per-row factor."""

    d: torch.Tensor


def _forms_forward_kl(heads: DistillHeads, s_ops: TileOperands, t_ops: TileOperands | None) -> bool:
    """Whether a kept chunk forms ``p - q`` in its forward (:class:`ForwardKlTile`): the gradient
    comes through the forward KL alone, ``dz/dy`` is one constant (no soft-cap), the student has
    no bias (whose gradient would need ``Σ_n dy``), and the inputs are bf16 (``g ⊙ hidden``
    needs bf16's range)."""
    return (heads.forward_kl_only and t_ops is not None and s_ops.bias is None
            and s_ops.transform.softcap is None and s_ops.hidden.dtype == torch.bfloat16)


def _sides(student: LocalHead, teacher: LocalHead | None, rows: DistillRows) -> tuple[TileOperands,
                                                                                   TileOperands | None]:
    """Both heads' kernel operands for a chunk (the student's hard label, if any, as its target)."""
    label = rows.targets[:, 0] if rows.targets.shape[1] else None
    s_ops = TileOperands.of(student, rows.hidden, label)
    return s_ops, None if teacher is None else TileOperands.of(teacher, rows.teacher_hidden, None)


def chunk_forward(stats: StatsTile, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan,
                  keep: bool) -> tuple[DistillPartials, DistillTiles | ForwardKlTile | None]:
    """The chunk's :class:`~logitless.ops.distill_contract.DistillPartials` over the local
    vocabulary and, with ``keep`` (whole rows fit the plan), the stored :class:`DistillTiles`,
    or their :class:`ForwardKlTile` where it forms one (:func:`_forms_forward_kl`)."""
    s_ops, t_ops = _sides(heads.student, heads.teacher, rows)
    vocab = s_ops.weight.shape[0]
    keep = keep and plan.vocab_block >= vocab
    forward_kl = keep and _forms_forward_kl(heads, s_ops, t_ops)
    s_parts, t_parts, kept = [], [], None
    for block in plan.vocab_blocks(vocab, keep):
        t_tile = None
        parts, s_tile = stats(s_ops.block(block), StatRequest(), plan.fp32_logits, keep or t_ops is not None)
        if t_ops is not None:
            t_parts_block, t_tile = stats(t_ops.block(block), StatRequest(), plan.fp32_logits, True)
            t_parts.append(t_parts_block)
            if not forward_kl:
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
        tiles.sgap, tiles.tgap = s_all.get("sgap"), s_all.get("tgap")
        tiles.m_t, tiles.se_t, tiles.tez = t_all["m"], t_all["se"], t_all["sez"]
    part = tiles.merged(lambda x: x.max(dim=1).values, lambda x: x.sum(dim=1),
                        zy=zy[:, :rows.targets.shape[1]])
    if forward_kl:
        d = kept.student.z.view(torch.bfloat16)
        part.sgap, part.tgap = launch_forward_kl(kept.student, kept.teacher, d, part.m_s, part.m_t, *part.lse())
        kept = ForwardKlTile(d)
    return part, kept


def _both_tiles(stats: StatsTile, s_ops: TileOperands, t_ops: TileOperands | None, block: slice,
                plan: ChunkPlan) -> DistillTiles:
    """Both heads' stored tiles of vocabulary rows ``block`` (statistics discarded)."""
    def tile(ops: TileOperands) -> CentredTile:
        return stats(ops.block(block), StatRequest(entropy=False), plan.fp32_logits, True)[1]

    return DistillTiles(tile(s_ops), None if t_ops is None else tile(t_ops))


def chunk_jsd(stats: StatsTile, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, lse: torch.Tensor,
              teacher_lse: torch.Tensor, kept: DistillTiles | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(jsd [n], kl_pm [n])`` over the local vocabulary, from the kept tiles or recomputed ones."""
    student, teacher, beta = heads.student, heads.teacher, heads.beta
    sides = None if kept is not None else _sides(student, teacher, rows)
    jsd = torch.zeros_like(lse)
    kl_pm = torch.zeros_like(lse)
    for block in plan.vocab_blocks(student.weight.shape[0], kept is not None):
        tiles = kept if kept is not None else _both_tiles(stats, *sides, block, plan)
        j, k = launch_jsd(tiles.student, tiles.teacher, lse, teacher_lse, beta)
        jsd += j
        kl_pm += k
    return jsd, kl_pm


def chunk_backward(stats: StatsTile, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, saved: DistillSaved,
                   g: DistillGrads, acc: Accumulators,
                   kept: DistillTiles | ForwardKlTile | None) -> torch.Tensor | None:
    """The student's gradients of one chunk (:func:`logitless.ops.torch_backend.distill.chunk_backward`'s
    formula), from the kept tiles or tiles recomputed block by block; ``kept`` is overwritten."""
    student, teacher, beta = heads.student, heads.teacher, heads.beta
    if isinstance(kept, ForwardKlTile):
        return _forward_kl_grads(kept, _sides(student, None, rows)[0], g, acc)
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
        tiles = kept if kept is not None else _both_tiles(stats, s_ops, t_ops, block, plan)
        dy = tiles.student.z.view(hs.dtype)
        launch_distill_grad(tiles.student, tiles.teacher, dy, s_ops.targets, block.start, student.transform, rc)
        del tiles
        grad_hidden = block_grads(dy, student.weight, hs, block, acc, grad_hidden)
        del dy
    if acc.hidden and grad_hidden is None:  # an empty vocabulary shard
        grad_hidden = torch.zeros(hs.shape, dtype=torch.float32, device=hs.device)
    return grad_hidden


def _forward_kl_grads(kept: ForwardKlTile, ops: TileOperands, g: DistillGrads,
                      acc: Accumulators) -> torch.Tensor | None:
    """A chunk's gradients from its :class:`ForwardKlTile`: ``dy = s (p - q)`` with the per-row
    ``s = g_forward_kl · logit_scale / temperature``, ``s`` on the rows of ``hidden`` before the
    ``d weight`` GEMM and on those of ``d hidden`` after its GEMM (module docstring).

    Raises:
        RuntimeError: a gradient of another statistic than the forward KL.
    """
    if any(x is not None and x.numel() for x in (g.lse, g.logp, g.entropy, g.reverse_kl, g.jsd)):
        raise RuntimeError("a distillation pass made with forward_kl_only got a gradient of another statistic "
                           "than forward_kl; make it without forward_kl_only")
    assert acc.bias is None and acc.lora_x is None and acc.lora_b is None
    hidden = ops.hidden
    if g.forward_kl is None:  # the loss does not depend on these rows
        s = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    else:
        s = g.forward_kl.to(torch.float32) * (ops.transform.logit_scale / ops.transform.temperature)
    scaled = torch.mul(hidden, s[:, None], out=torch.empty_like(hidden))  # fp32 products, rounded once
    grad_hidden = block_grads(kept.d, ops.weight, scaled, slice(0, ops.weight.shape[0]), acc, None)
    return None if grad_hidden is None else grad_hidden.mul_(s[:, None])
