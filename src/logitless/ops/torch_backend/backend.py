"""Portable backend of the vocabulary pass: chunked matmuls in PyTorch (CPU and any GPU).

It implements the contract of :mod:`logitless.ops.contract` in plain tensor operations and is
the specification the Triton backends are tested against.
"""

from __future__ import annotations

import torch

from .. import gemm
from ..contract import (
    Accumulators,
    Capabilities,
    ChunkRows,
    LocalHead,
    RowStats,
    SavedStats,
    StatGrads,
    StatRequest,
    compact_rows_,
)
from ..lora import LowRank, low_rank_grads, low_rank_into
from ..plan import ChunkPlan
from ..transform import LogitTransform

NAME = "torch"
PLAN = "torch"
CAPS = Capabilities(dtypes=(torch.float64, torch.float32, torch.bfloat16, torch.float16), lora=True, distill=True,
                    sum_sq=True)


def logits_block(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 transform: LogitTransform, plan: ChunkPlan, lora: LowRank | None = None,
                 rows: slice | None = None) -> torch.Tensor:
    """Logits ``z`` of ``hidden [n, H]`` against the vocabulary rows ``weight [v, H]`` (rows
    ``rows`` of the head, whose ``lora`` term is added): ``[n, v]`` in the plan's statistics
    dtype; without the plan's ``fp32_logits`` the matmul output is first rounded to the input
    dtype, as the plain path's."""
    stat_dtype = plan.stat_dtype
    # Inputs already in the statistics dtype (fp32/fp64): a plain product; gemm.mm widens the others.
    y = hidden @ weight.t().to(stat_dtype) if hidden.dtype == stat_dtype else gemm.mm(hidden, weight.t(), stat_dtype)
    if lora is not None:
        low_rank_into(y, lora, rows.start, rows.stop)
    if not plan.fp32_logits and hidden.dtype != y.dtype:
        y = y.to(hidden.dtype).to(stat_dtype)
    if bias is not None:
        y = y + bias.to(stat_dtype)
    return y if transform.identity else transform.apply(y)


def _block(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, start: int, end: int) -> torch.Tensor:
    return logits_block(rows.hidden, head.weight[start:end], None if head.bias is None else head.bias[start:end],
                        head.transform, plan, rows.low, slice(start, end))


def _blocks(plan: ChunkPlan, vocab: int) -> tuple[slice, ...] | list[slice]:
    """The vocabulary blocks of ``vocab`` rows: the plan's own when it was made for them."""
    return plan.blocks if plan.vocab == vocab else plan.vocab_blocks(vocab)


def chunk_forward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, want: StatRequest,
                  keep_logits: bool) -> tuple[RowStats, torch.Tensor | None]:
    """Partial statistics of one token chunk over all of the head's local rows, folded block by
    block with an online log-sum-exp; ``kept`` is the chunk's ``[n, V]`` logits when
    ``keep_logits`` and one block covers the rows, else ``None``."""
    hidden, targets = rows.hidden, rows.targets
    vocab = head.weight.shape[0]
    st = RowStats.start(hidden.shape[0], plan.stat_dtype, hidden.device, want,
                        owned=(targets >= 0) & (targets < vocab))
    kept = None
    for block in _blocks(plan, vocab):
        start, end = block.start, block.stop
        z = _block(head, rows, plan, start, end)
        new_max = torch.maximum(st.max_logit, z.max(dim=1).values)
        rescale = torch.exp(st.max_logit - new_max)
        # In place: one [n, v] temporary beside z (this backend's workspace, plan.workspace_per_element).
        e = (z - new_max[:, None]).exp_()
        st.sum_exp = st.sum_exp * rescale + e.sum(dim=1)
        if st.sum_exp_sq is not None:  # Σ e², a row-wise dot product: no second [n, v] temporary
            st.sum_exp_sq = st.sum_exp_sq * rescale.square() + torch.einsum("nv,nv->n", e, e)
        if st.sum_exp_logit is not None:
            st.sum_exp_logit = st.sum_exp_logit * rescale + e.mul_(z).sum(dim=1)
        del e
        if st.sum_logit is not None:
            st.sum_logit = st.sum_logit + z.sum(dim=1)
        st.max_logit = new_max
        in_block = st.owned & (targets >= start) & (targets < end)
        local = (targets - start).clamp(0, end - start - 1)
        st.target_logit = torch.where(in_block, z.gather(1, local[:, None]).squeeze(1), st.target_logit)
        if keep_logits and end - start == vocab:
            kept = z
    return st, kept


def kept_rows(kept: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The kept ``[n, V]`` tile's rows ``idx``, moved in place to its first rows (``kept`` is overwritten)."""
    return compact_rows_(kept, idx)


def chunk_backward(head: LocalHead, rows: ChunkRows, plan: ChunkPlan, saved: SavedStats, grads: StatGrads,
                   acc: Accumulators, kept: torch.Tensor | None) -> torch.Tensor | None:
    """``d hidden`` of one chunk (statistics dtype) and, in place, the accumulators, from the
    statistics' gradients (``dz`` of :mod:`logitless.ops.contract`), the logits recomputed block
    by block unless ``kept``."""
    hidden, targets = rows.hidden, rows.targets
    n, vocab = hidden.shape[0], head.weight.shape[0]
    lse, sum_pz = saved
    stat_dtype = lse.dtype
    # dz in the matmul dtype: the input dtype on GPUs (bf16 GEMMs), the statistics dtype on CPUs.
    mm_dtype = hidden.dtype if hidden.device.type == "cuda" else stat_dtype
    coef = torch.zeros_like(lse)
    if grads.lse is not None:
        coef = coef + grads.lse
    if grads.logp is not None:
        coef = coef - grads.logp
    grad_hidden = torch.zeros((n, hidden.shape[1]), dtype=stat_dtype, device=hidden.device) if acc.hidden else None
    h_mm = hidden.to(mm_dtype)
    for block in _blocks(plan, vocab):
        start, end = block.start, block.stop
        z = kept if kept is not None else _block(head, rows, plan, start, end)
        dz = (z - lse[:, None]).exp_()  # p, made into dz in place
        if grads.entropy is not None:
            dz.mul_((z - sum_pz[:, None]).mul_(-grads.entropy[:, None]).add_(coef[:, None]))
        else:
            dz.mul_(coef[:, None])
        if grads.sum_z is not None:
            dz.add_(grads.sum_z[:, None])
        if grads.logp is not None:
            hit = ((targets >= start) & (targets < end)).nonzero().squeeze(1)
            dz[hit, targets[hit] - start] += grads.logp[hit]
        dy = dz if head.transform.identity else head.transform.grad_to_raw(dz, z)
        del z, dz
        apply_block_grad(dy, head.weight[start:end], h_mm, block, grad_hidden, acc)
        if rows.low is not None:
            low_rank_grads(dy.to(mm_dtype), rows.low, start, end, acc.lora_x, acc.lora_b)
    return grad_hidden


def apply_block_grad(dy: torch.Tensor, w: torch.Tensor, h_mm: torch.Tensor, rows: slice,
                     grad_hidden: torch.Tensor | None, acc: Accumulators) -> None:
    """Accumulate one vocabulary block's gradients from ``dy = dL/d(h Wᵀ + b)`` ``[n, v]``:
    ``d hidden += dy @ W[rows]``, ``d weight[rows] += dyᵀ @ h``, ``d bias[rows] += Σ_n dy``
    (the matmuls in ``h_mm``'s dtype)."""
    if acc.bias is not None:
        acc.bias[rows] += dy.sum(dim=0).to(acc.bias.dtype)
    dy_mm = dy.to(h_mm.dtype)
    # Products into an accumulator of their own dtype (CPU: the statistics dtype) are a plain
    # addmm_; gemm.addmm_ widens bf16/fp16 products into fp32 ones.
    if grad_hidden is not None:
        w_mm = w.to(h_mm.dtype)
        if grad_hidden.dtype == h_mm.dtype:
            grad_hidden.addmm_(dy_mm, w_mm)
        else:
            gemm.addmm_(grad_hidden, dy_mm, w_mm)
    if acc.weight is not None:
        gw = acc.weight[rows]
        if gw.dtype == h_mm.dtype:
            gw.addmm_(dy_mm.t(), h_mm)
        else:
            gemm.addmm_(gw, dy_mm.t(), h_mm)
