"""Distillation over two stored tiles, the student's and the teacher's: the chunk work of the
GEMM-epilogue and CuTe backends' :class:`~logitless.ops.distill_contract.DistillBackend`
(:class:`TwoHeadPass`, given the backend's statistics GEMM as a :class:`TileStore`). The same
partials, statistics and gradients as :mod:`logitless.ops.torch_backend.distill` (the
specification).

Per vocabulary block (the whole local vocabulary when a chunk's rows fit the plan):

1. the teacher's logits GEMM writes its partial statistics and stores its tile (fp16, centred
   per tile: :class:`~logitless.ops.triton_shared.centred.CentredTile`);
2. the student's logits GEMM writes its partials and stores its tile;
3. a row kernel over both stored tiles writes the cross sums ``sgap``/``tgap`` of both KL
   directions per tile (reading the teacher's tile inside the student's epilogue instead costs
   that GEMM a pipeline stage and doubles its epilogue: 2.6x its time on an H100, Triton);
4. a few torch ops fold the ``[tiles, n]`` partials into
   :class:`~logitless.ops.distill_contract.DistillPartials`.

The JSD's second sweep and the gradient are row kernels over both stored tiles
(:mod:`logitless.ops.triton_shared.distill_rows`); ``d hidden``/``d weight`` are cuBLAS GEMMs as in
the single-head pass. Kept tiles (fused mode) cost 4 bytes a logit; recompute mode recomputes both
tiles block by block. Scope (:data:`SCOPE`): at most one target id per token (a hard label) and
bf16/fp16 heads of one dtype; the torch backend's functions run everything else
(:func:`~logitless.ops.distill_contract.resolve_distill` decides).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..contract import Accumulators, Capabilities, LocalHead, StatRequest
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
from .distill_rows import DistillRowCoefficients, launch_cross, launch_distill_grad, launch_jsd
from .tile_gemm import TileOperands
from .weight_grad import block_grads

SCOPE = DistillScope(max_targets=1, mixed_dtypes=False)
_ENTROPY = StatRequest()  # the forward's partials include sez (both heads' entropies)


class TileStore(NamedTuple):
    """A backend's statistics GEMM, as the two-head pass uses it.

    ``launch(ops, want, fp32_logits, z)``: one head's ``[tiles, n]`` partials (``m``, ``se``, ``zy``,
    and ``sez`` with ``want.entropy``) over ``ops``' rows, storing the centred fp16 tile into ``z``
    (``None``: nothing stored);
    ``buffer(n, width, device)``: a ``z`` that ``launch`` stores into; ``tile_v()``: the tile
    width its partials and stored logits are centred over."""

    launch: Callable[[TileOperands, StatRequest, bool, torch.Tensor | None], dict[str, torch.Tensor]]
    buffer: Callable[[int, int, torch.device], torch.Tensor]
    tile_v: Callable[[], int]


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


class TwoHeadPass:
    """A :class:`~logitless.ops.distill_contract.DistillBackend` on ``store``, the statistics GEMM
    of a backend whose capabilities are ``caps``."""

    SCOPE = SCOPE

    def __init__(self, store: TileStore, caps: Capabilities):
        self.store = store
        self.CAPS = caps

    def plan_for(self, n_tokens: int, vocab: int, options: PassOptions, dtype: torch.dtype) -> ChunkPlan:
        """The plan for two fp16 tiles, the student's and the teacher's."""
        return ChunkPlan.make(n_tokens, vocab, options.budget, dtype, "gemm", options.fp32_logits, arrays=2)

    def _tile(self, ops: TileOperands, fp32_logits: bool, store: bool = True,
              want: StatRequest = _ENTROPY) -> tuple[dict, CentredTile | None]:
        """One head's launch over ``ops``' rows: its ``[tiles, n]`` partials and stored tile (``store``)."""
        z = self.store.buffer(ops.hidden.shape[0], ops.weight.shape[0], ops.hidden.device) if store else None
        parts = self.store.launch(ops, want, fp32_logits, z)
        return parts, None if z is None else CentredTile(z, parts["m"], self.store.tile_v())

    def chunk_forward(self, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan,
                      keep: bool) -> tuple[DistillPartials, DistillTiles | None]:
        """The chunk's :class:`~logitless.ops.distill_contract.DistillPartials` over the local
        vocabulary and, with ``keep`` (whole rows fit the plan), the stored :class:`DistillTiles`."""
        s_ops, t_ops = _sides(heads.student, heads.teacher, rows)
        vocab = s_ops.weight.shape[0]
        keep = keep and plan.vocab_block >= vocab
        s_parts, t_parts, kept = [], [], None
        for block in plan.vocab_blocks(vocab, keep):
            t_tile = None
            parts, s_tile = self._tile(s_ops.block(block), plan.fp32_logits, store=keep or t_ops is not None)
            if t_ops is not None:
                t_parts_block, t_tile = self._tile(t_ops.block(block), plan.fp32_logits)
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

    def _both_tiles(self, s_ops: TileOperands, t_ops: TileOperands | None, block: slice,
                    plan: ChunkPlan) -> DistillTiles:
        """Both heads' stored tiles of vocabulary rows ``block`` (statistics discarded)."""
        def tile(ops: TileOperands) -> CentredTile:
            return self._tile(ops.block(block), plan.fp32_logits, want=StatRequest(entropy=False))[1]

        return DistillTiles(tile(s_ops), None if t_ops is None else tile(t_ops))

    def chunk_jsd(self, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, lse: torch.Tensor,
                  teacher_lse: torch.Tensor, kept: DistillTiles | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(jsd [n], kl_pm [n])`` over the local vocabulary, from the kept tiles or recomputed ones."""
        student, teacher, beta = heads
        sides = None if kept is not None else _sides(student, teacher, rows)
        jsd = torch.zeros_like(lse)
        kl_pm = torch.zeros_like(lse)
        for block in plan.vocab_blocks(student.weight.shape[0], kept is not None):
            tiles = kept if kept is not None else self._both_tiles(*sides, block, plan)
            j, k = launch_jsd(tiles.student, tiles.teacher, lse, teacher_lse, beta)
            jsd += j
            kl_pm += k
        return jsd, kl_pm

    def chunk_backward(self, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, saved: DistillSaved,
                       g: DistillGrads, acc: Accumulators, kept: DistillTiles | None) -> torch.Tensor | None:
        """The student's gradients of one chunk (:func:`logitless.ops.torch_backend.distill.chunk_backward`'s
        formula), from the kept tiles or tiles recomputed block by block; ``kept`` is overwritten."""
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
            tiles = kept if kept is not None else self._both_tiles(s_ops, t_ops, block, plan)
            dy = tiles.student.z.view(hs.dtype)
            launch_distill_grad(tiles.student, tiles.teacher, dy, s_ops.targets, block.start, student.transform, rc)
            del tiles
            grad_hidden = block_grads(dy, student.weight, hs, block, acc, grad_hidden)
            del dy
        if acc.hidden and grad_hidden is None:  # an empty vocabulary shard
            grad_hidden = torch.zeros(hs.shape, dtype=torch.float32, device=hs.device)
        return grad_hidden
