"""Distillation on the GEMM-epilogue kernels: the same partials, statistics and gradients as
:mod:`logitless.ops.distill`'s torch functions (the specification), from Triton GEMMs.

Per vocabulary block (the whole local vocabulary when a chunk's rows fit the plan):

1. the teacher's logits GEMM writes its partial statistics and stores its tile (fp16, centred
   per tile: :mod:`logitless.ops.gemm_kernels`);
2. the student's logits GEMM writes its partials and, reading the teacher's stored tile in its
   epilogue, the cross sums ``sgap``/``tgap`` of both KL directions, and stores its own tile when
   the backward will reuse it;
3. a few torch ops fold the ``[tiles, n]`` partials into :class:`~logitless.ops.distill.DistillPartials`.

The JSD's second sweep and the gradient are row kernels over both stored tiles
(:mod:`logitless.ops.distill_kernels`); ``d hidden``/``d weight`` are cuBLAS GEMMs as in the
single-head pass. Kept tiles (fused mode) cost 4 bytes a logit; recompute mode recomputes both
tiles block by block. Scope: at most one target id per token (a hard label) and bf16/fp16 heads
of one dtype (``DistillPass.make`` decides); the torch functions run everything else.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backend import Accumulators
from .distill import DistillGrads, DistillPartials, DistillRows, DistillSaved, p_coefficient
from .distill_kernels import DistillRowCoefficients, launch_distill_grad, launch_jsd
from .gemm_kernels import CentredTile, GemmConfig, TileOperands, gemm_config, launch_forward
from .head import LocalHead
from .plan import ChunkPlan
from .triton_backend import block_grads


class DistillTiles(NamedTuple):
    """A chunk's stored logits over the local vocabulary: the student's and the teacher's (``None``
    without a teacher)."""

    student: CentredTile
    teacher: CentredTile | None


def _operands(head: LocalHead, hidden: torch.Tensor, targets: torch.Tensor | None) -> TileOperands:
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = head.weight if head.weight.stride(1) == 1 else head.weight.contiguous()
    if targets is None:
        targets = torch.full((hidden.shape[0],), -1, dtype=torch.int64, device=hidden.device)
    bias = None if head.bias is None else head.bias.contiguous()
    return TileOperands(hidden, weight, bias, targets.contiguous(), head.transform)


def _block(ops: TileOperands, block: slice) -> TileOperands:
    bias = None if ops.bias is None else ops.bias[block]
    return ops._replace(weight=ops.weight[block], bias=bias, targets=ops.targets - block.start)


def _tile(ops: TileOperands, want_entropy: bool, fp32_logits: bool, cfg: GemmConfig,
          partner: torch.Tensor | None = None, store: bool = True) -> tuple[dict, CentredTile | None]:
    """One head's launch over ``ops``' rows: its ``[tiles, n]`` partials and stored tile (``store``)."""
    n, width = ops.hidden.shape[0], ops.weight.shape[0]
    z = torch.empty((n, width), dtype=torch.float16, device=ops.hidden.device) if store else None
    parts = launch_forward(ops, (want_entropy, False), fp32_logits, z, cfg, partner)
    return parts, None if z is None else CentredTile(z, parts["m"])


def _blocks(vocab: int, plan: ChunkPlan, whole: bool) -> list[slice]:
    step = vocab if whole else max(1, plan.vocab_block)
    return [slice(s, min(s + step, vocab)) for s in range(0, vocab, step)]


def chunk_forward(student: LocalHead, teacher: LocalHead | None, rows: DistillRows, plan: ChunkPlan,
                  keep: bool) -> tuple[DistillPartials, DistillTiles | None]:
    """The chunk's :class:`~logitless.ops.distill.DistillPartials` over the local vocabulary and,
    with ``keep`` (whole rows fit the plan), the stored :class:`DistillTiles`."""
    cfg = gemm_config()
    targets = rows.targets[:, 0] if rows.targets.shape[1] else None
    s_ops = _operands(student, rows.hidden, targets)
    t_ops = None if teacher is None else _operands(teacher, rows.teacher_hidden, None)
    vocab = s_ops.weight.shape[0]
    keep = keep and plan.vocab_block >= vocab
    s_parts, t_parts, kept = [], [], None
    for block in _blocks(vocab, plan, keep):
        t_tile = None
        if t_ops is not None:
            parts, t_tile = _tile(_block(t_ops, block), True, plan.fp32_logits, cfg)
            t_parts.append(parts)
        parts, s_tile = _tile(_block(s_ops, block), True, plan.fp32_logits, cfg,
                              None if t_tile is None else t_tile.z, store=keep)
        s_parts.append(parts)
        if keep:
            kept = DistillTiles(s_tile, t_tile)
    s_all = {k: torch.cat([p[k] for p in s_parts]) for k in s_parts[0] if k != "zy"}
    zy = sum(p["zy"] for p in s_parts)  # nonzero in the one block that holds the target
    m_s = s_all["m"].max(dim=0).values
    w_s = torch.exp(s_all["m"] - m_s)
    part = DistillPartials(m_s=m_s, se_s=(s_all["se"] * w_s).sum(0), sez_s=(s_all["sez"] * w_s).sum(0),
                           zy=zy.t() if targets is not None else zy.t()[:, :0])
    if t_ops is not None:
        t_all = {k: torch.cat([p[k] for p in t_parts]) for k in ("m", "se", "sez")}
        m_t = t_all["m"].max(dim=0).values
        w_t = torch.exp(t_all["m"] - m_t)
        # Each tile's gaps are centred on its own maxima: moving both to the rows' maxima adds
        # the same shift to every entry of the tile.
        shift = (s_all["m"] - m_s) - (t_all["m"] - m_t)
        part.sgap = ((s_all["sgap"] + s_all["se"] * shift) * w_s).sum(0)
        part.tgap = ((s_all["tgap"] - t_all["se"] * shift) * w_t).sum(0)
        part.m_t, part.se_t, part.tez = m_t, (t_all["se"] * w_t).sum(0), (t_all["sez"] * w_t).sum(0)
    return part, kept


def _both_tiles(student: LocalHead, teacher: LocalHead | None, rows: DistillRows, plan: ChunkPlan, block: slice,
                cfg: GemmConfig) -> DistillTiles:
    """Both heads' stored tiles of vocabulary rows ``block`` (statistics discarded)."""
    targets = rows.targets[:, 0] if rows.targets.shape[1] else None
    _, s_tile = _tile(_block(_operands(student, rows.hidden, targets), block), False, plan.fp32_logits, cfg)
    t_tile = None
    if teacher is not None:
        _, t_tile = _tile(_block(_operands(teacher, rows.teacher_hidden, None), block), False, plan.fp32_logits, cfg)
    return DistillTiles(s_tile, t_tile)


def chunk_jsd(student: LocalHead, teacher: LocalHead, rows: DistillRows, plan: ChunkPlan, lse_s: torch.Tensor,
              lse_t: torch.Tensor, beta: float, kept: DistillTiles | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(jsd [n], kl_pm [n])`` over the local vocabulary, from the kept tiles or recomputed ones."""
    cfg = gemm_config()
    vocab = student.weight.shape[0]
    jsd = torch.zeros_like(lse_s)
    kl_pm = torch.zeros_like(lse_s)
    for block in _blocks(vocab, plan, kept is not None):
        tiles = kept if kept is not None else _both_tiles(student, teacher, rows, plan, block, cfg)
        j, k = launch_jsd(tiles.student, tiles.teacher, lse_s, lse_t, beta, cfg)
        jsd += j
        kl_pm += k
    return jsd, kl_pm


def chunk_backward(student: LocalHead, teacher: LocalHead | None, rows: DistillRows, plan: ChunkPlan,
                   beta: float | None, saved: DistillSaved, g: DistillGrads, acc: Accumulators,
                   kept: DistillTiles | None) -> torch.Tensor | None:
    """The student's gradients of one chunk (:func:`logitless.ops.distill.chunk_backward`'s formula),
    from the kept tiles or tiles recomputed block by block; ``kept`` is overwritten."""
    cfg = gemm_config()
    hs = rows.hidden if rows.hidden.stride(1) == 1 else rows.hidden.contiguous()
    vocab = student.weight.shape[0]

    def f32(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.float().contiguous()

    teacher_terms = g.teacher_terms()
    rc = DistillRowCoefficients(
        lse=f32(saved.lse), coef=f32(p_coefficient(g, saved, beta)),
        sum_pz=f32(saved.sum_pz) if g.entropy is not None else None,
        g_entropy=f32(g.entropy), teacher_lse=f32(saved.teacher_lse) if teacher_terms else None,
        g_reverse_kl=f32(g.reverse_kl), g_forward_kl=f32(g.forward_kl), g_jsd=f32(g.jsd),
        g_logp=None if g.logp is None or g.logp.shape[1] == 0 else f32(g.logp[:, 0]), beta=beta)
    targets = rows.targets[:, 0].contiguous() if rows.targets.shape[1] else rows.targets.new_zeros(hs.shape[0])
    grad_hidden = None
    for block in _blocks(vocab, plan, kept is not None):
        tiles = kept if kept is not None else _both_tiles(student, teacher if teacher_terms else None, rows, plan,
                                                         block, cfg)
        dy = tiles.student.z.view(hs.dtype)
        launch_distill_grad(tiles.student, tiles.teacher, dy, targets, block.start, student.transform, rc, cfg)
        del tiles
        grad_hidden = block_grads(dy, student.weight, hs, block, acc, grad_hidden)
        del dy
    if acc.hidden and grad_hidden is None:  # an empty vocabulary shard
        grad_hidden = torch.zeros(hs.shape, dtype=torch.float32, device=hs.device)
    return grad_hidden
