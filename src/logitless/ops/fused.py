"""Fused mode: the objective's gradient is taken chunk by chunk inside the forward.

For a chunk of tokens the forward computes its statistics, asks the objective for the
chunk's loss, differentiates that loss w.r.t. the chunk's ``logp``/``entropy`` (autograd on
``[chunk]`` tensors), turns those gradients into ``d hidden`` / ``d weight`` right away and
drops the chunk's logits. The backward only scales the saved gradients by the incoming
gradient of the loss. Total work is three GEMMs' worth (``6NHV``) instead of four in the
recompute mode, and the logits of a chunk are reused instead of recomputed.

The objective must be a sum of per-chunk terms (global normalizers precomputed by the
caller); chunks are cut only at the caller's allowed cut points (sequence boundaries for
sequence-level objectives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..distributed import all_reduce, is_active
from .plan import ChunkPlan
from .shard import VocabShard, reduce_partials
from .transform import LogitTransform
from .vocab_stats import LocalHead, no_autocast, stat_dtype_for, stats_from_partials

# objective(token_slice, logp [n], entropy [n] | None, **extra_stats) -> (loss term, anything to collect)
ChunkObjective = Callable[..., tuple[torch.Tensor, Any]]


def plan_chunks(n_tokens: int, token_chunk: int, cuts: Sequence[int] | None) -> list[slice]:
    """Cut ``[0, n_tokens)`` into chunks of at most ``token_chunk`` tokens, ending only at
    positions in ``cuts`` (sorted, each in ``(0, n_tokens]``) when given. A stretch between two
    allowed cuts longer than ``token_chunk`` becomes one chunk of its own."""
    if cuts is None:
        return [slice(s, min(s + token_chunk, n_tokens)) for s in range(0, n_tokens, token_chunk)]
    chunks, start, last = [], 0, 0
    for c in cuts:
        if c <= start:
            continue
        if c - start > token_chunk and last > start:
            chunks.append(slice(start, last))
            start = last
        last = c
        if c - start >= token_chunk:
            chunks.append(slice(start, c))
            start = c
    if n_tokens > start:
        chunks.append(slice(start, n_tokens))
    return chunks


def _run_chunk(backend, hidden, head, targets, transform, sl, chunk_bytes, want_entropy, extra_stats, objective,
               grad_weight, grad_bias, want_grad):
    """Statistics, the objective's term and (``want_grad``) the chunk's gradients."""
    sdt = stat_dtype_for(hidden.dtype)
    h, t = hidden[sl], targets[sl]
    plan = ChunkPlan.make(h.shape[0], max(head.weight.shape[0], 1), chunk_bytes, sdt, hidden.dtype, backend.NAME)
    with no_autocast(hidden.device):
        partials, kept = backend.chunk_forward(h, head.weight, head.bias, t, transform, plan, sdt, want_entropy,
                                               keep_logits=want_grad and plan.keep_logits,
                                               want_sum_z="sum_z" in extra_stats)
        st = stats_from_partials(reduce_partials(partials, head.group))
    entropy = None if st.sum_pz is None else st.lse - st.sum_pz
    with torch.enable_grad():
        leaves = {"logp": st.logp.detach().requires_grad_(want_grad)}
        if entropy is not None:
            leaves["entropy"] = entropy.detach().requires_grad_(want_grad)
        if "lse" in extra_stats:
            leaves["lse"] = st.lse.detach().requires_grad_(want_grad)
        if "sum_z" in extra_stats:
            leaves["sum_z"] = st.sum_z.detach().requires_grad_(want_grad)
        extra = {k: leaves[k] for k in ("lse", "sum_z") if k in leaves}
        if "is_top1" in extra_stats:
            extra["is_top1"] = st.is_top1
        loss, collected = objective(sl, leaves["logp"], leaves.get("entropy"), **extra)
        grads = dict.fromkeys(leaves)
        if want_grad and loss.requires_grad:
            names = list(leaves)
            grads = dict(zip(names, torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True),
                             strict=True))
    grad_hidden = None
    if want_grad and any(g is not None for g in grads.values()):
        with no_autocast(hidden.device):
            valid = head.weight.shape[0]
            grad_hidden = backend.chunk_backward(
                h, head.weight, head.bias, t, transform, plan, st.lse, st.sum_pz, grads["logp"], grads.get("lse"),
                grads.get("entropy"), kept, None if grad_weight is None else grad_weight[:valid],
                None if grad_bias is None else grad_bias[:valid], hidden.requires_grad, g_sum_z=grads.get("sum_z"))
    return loss.detach(), collected, st.logp, entropy, grad_hidden


def _run_chunks(backend, hidden, head, targets, transform, chunks, chunk_bytes, want_entropy, extra_stats, objective,
                collected, grad_weight, grad_bias, grad_hidden):
    """All chunks in order: ``(total loss, logp [n], entropy [n] | None)``; gradients go into the
    given accumulators (``grad_hidden`` rows written per chunk) when any is given."""
    sdt = stat_dtype_for(hidden.dtype)
    n = hidden.shape[0]
    want_grad = any(g is not None for g in (grad_weight, grad_bias, grad_hidden))
    total = torch.zeros((), dtype=sdt, device=hidden.device)
    # Filled in place: per-chunk small tensors kept alive fragment the CPU heap (see forward_pass).
    logp_all = torch.empty(n, dtype=sdt, device=hidden.device)
    ent_all = torch.empty(n, dtype=sdt, device=hidden.device) if want_entropy else None
    for sl in chunks:
        loss, extra, logp, ent, gh = _run_chunk(backend, hidden, head, targets, transform, sl, chunk_bytes,
                                                want_entropy, extra_stats, objective, grad_weight, grad_bias,
                                                want_grad)
        total = total + loss
        collected.append(extra)
        logp_all[sl] = logp
        if ent_all is not None:
            ent_all[sl] = ent
        if grad_hidden is not None and gh is not None:
            grad_hidden[sl] = gh
    return total, logp_all, ent_all


class _FusedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform, chunks, chunk_bytes, want_entropy, extra_stats,
                objective, backend, head, collected):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        sdt = stat_dtype_for(hidden.dtype)
        grad_weight = torch.zeros(weight.shape, dtype=sdt, device=weight.device) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=sdt, device=weight.device) if need_b else None
        # Vocabulary-parallel partials are summed in the statistics dtype, then cast once.
        partial = need_h and head.reduce_grad_hidden and is_active(head.group)
        grad_hidden = torch.zeros_like(hidden, dtype=sdt if partial else None) if need_h else None
        total, logp_all, ent_all = _run_chunks(backend, hidden, head, targets, transform, chunks, chunk_bytes,
                                               want_entropy, extra_stats, objective, collected, grad_weight,
                                               grad_bias, grad_hidden)
        if partial:
            grad_hidden = all_reduce(grad_hidden, "sum", head.group).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ent_all = logp_all.new_zeros(0) if ent_all is None else ent_all
        ctx.mark_non_differentiable(logp_all, ent_all)
        return total, logp_all, ent_all

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        # loss.backward() sends exactly 1: skip scaling a [V, H] fp32 buffer (a full extra pass).
        unit = bool(g_loss == 1)

        def scaled(g, dtype):
            if g is None:
                return None
            return g.to(dtype) if unit else (g * g_loss.to(g.dtype)).to(dtype)

        gh = scaled(grad_hidden, grad_hidden.dtype if grad_hidden is not None else None)
        gw = scaled(grad_weight, w_dtype)
        gb = scaled(grad_bias, b_dtype)
        return gh, gw, gb, None, None, None, None, None, None, None, None, None, None


def fused_objective(
    hidden: torch.Tensor,  # [n, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [n] int64, all valid
    transform: LogitTransform,
    objective: ChunkObjective,
    *,
    cuts: Sequence[int] | None,
    want_entropy: bool,
    chunk_bytes: int | None,
    backend,
    extra_stats: tuple[str, ...] = (),
    shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[Any]]:
    """Run ``objective`` over the vocabulary statistics of ``hidden`` in fused mode.

    Inputs are assumed validated (callers go through :func:`check_head_inputs`); ``targets``
    are global ids. ``extra_stats`` (subset of ``"lse"``, ``"sum_z"``, ``"is_top1"``) are passed
    to the objective as keyword arguments (``is_top1`` a bool tensor). Under a vocabulary-parallel
    ``shard`` every chunk's statistics take one MAX and one SUM all-reduce.

    Returns:
        ``(loss, logp [n], entropy [n] | None, collected)``: ``loss`` is the sum of the chunk
        terms and carries the gradient to ``hidden``/``weight``/``bias``; ``logp``/``entropy``
        are detached; ``collected`` holds each chunk's second return value, in order.
    """
    sdt = stat_dtype_for(hidden.dtype)
    head = LocalHead.make(weight, bias, shard)
    targets = head.local_targets(targets)
    plan = ChunkPlan.make(hidden.shape[0], max(head.weight.shape[0], 1), chunk_bytes, sdt, hidden.dtype,
                          backend.NAME)
    chunks = plan_chunks(hidden.shape[0], plan.token_chunk, cuts)
    collected: list[Any] = []
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:
        total, logp_all, ent_all = _run_chunks(backend, hidden, head, targets, transform, chunks, chunk_bytes,
                                               want_entropy, extra_stats, objective, collected, None, None, None)
        return total, logp_all, ent_all, collected
    total, logp_all, ent_all = _FusedFn.apply(hidden, weight, bias, targets, transform, chunks, chunk_bytes,
                                              want_entropy, extra_stats, objective, backend, head, collected)
    return total, logp_all, ent_all if want_entropy else None, collected
