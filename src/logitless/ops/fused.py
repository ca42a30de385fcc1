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

from .plan import ChunkPlan
from .transform import LogitTransform
from .vocab_stats import no_autocast, stat_dtype_for

# objective(token_slice, logp [n], entropy [n] | None) -> (loss term, anything to collect)
ChunkObjective = Callable[[slice, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, Any]]


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


def _run_chunk(*args):
    with no_autocast(args[1].device):
        return _run_chunk_impl(*args)


def _run_chunk_impl(backend, hidden, weight, bias, targets, transform, sl, chunk_bytes, want_entropy, objective,
                    grad_weight, grad_bias, want_grad):
    sdt = stat_dtype_for(hidden.dtype)
    h, t = hidden[sl], targets[sl]
    plan = ChunkPlan.make(h.shape[0], weight.shape[0], chunk_bytes, sdt, hidden.dtype, backend.NAME)
    partials, kept = backend.chunk_forward(h, weight, bias, t, transform, plan, sdt, want_entropy,
                                           keep_logits=want_grad and plan.keep_logits)
    lse, logp, sum_pz = partials.finalize()
    entropy = None if sum_pz is None else lse - sum_pz
    with torch.enable_grad():
        logp_leaf = logp.detach().requires_grad_(want_grad)
        ent_leaf = None if entropy is None else entropy.detach().requires_grad_(want_grad)
        loss, extra = objective(sl, logp_leaf, ent_leaf)
        grads: tuple = (None, None)
        if want_grad and loss.requires_grad:
            leaves = [logp_leaf] + ([ent_leaf] if ent_leaf is not None else [])
            grads = (*torch.autograd.grad(loss, leaves, allow_unused=True), None)
    g_logp, g_ent = grads[0], grads[1]
    grad_hidden = None
    if want_grad and (g_logp is not None or g_ent is not None):
        grad_hidden = backend.chunk_backward(h, weight, bias, t, transform, plan, lse, sum_pz, g_logp, None,
                                             g_ent, kept, grad_weight, grad_bias, hidden.requires_grad)
    return loss.detach(), extra, logp, entropy, grad_hidden


class _FusedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform, chunks, chunk_bytes, want_entropy, objective,
                backend, collected):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        sdt = stat_dtype_for(hidden.dtype)
        grad_weight = torch.zeros(weight.shape, dtype=sdt, device=weight.device) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=sdt, device=weight.device) if need_b else None
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        total = torch.zeros((), dtype=sdt, device=hidden.device)
        logps, ents = [], []
        for sl in chunks:
            loss, extra, logp, ent, gh = _run_chunk(backend, hidden, weight, bias, targets, transform, sl,
                                                    chunk_bytes, want_entropy, objective, grad_weight,
                                                    grad_bias, True)
            total = total + loss
            collected.append(extra)
            logps.append(logp)
            if ent is not None:
                ents.append(ent)
            if need_h and gh is not None:
                grad_hidden[sl] = gh
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        logp_all = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=sdt)
        ent_all = torch.cat(ents) if ents else logp_all.new_zeros(0)
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
        return gh, gw, gb, None, None, None, None, None, None, None, None


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[Any]]:
    """Run ``objective`` over the vocabulary statistics of ``hidden`` in fused mode.

    Inputs are assumed validated (callers go through :func:`check_head_inputs`).

    Returns:
        ``(loss, logp [n], entropy [n] | None, collected)``: ``loss`` is the sum of the chunk
        terms and carries the gradient to ``hidden``/``weight``/``bias``; ``logp``/``entropy``
        are detached; ``collected`` holds each chunk's second return value, in order.
    """
    sdt = stat_dtype_for(hidden.dtype)
    plan = ChunkPlan.make(hidden.shape[0], weight.shape[0], chunk_bytes, sdt, hidden.dtype, backend.NAME)
    chunks = plan_chunks(hidden.shape[0], plan.token_chunk, cuts)
    collected: list[Any] = []
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:
        total = torch.zeros((), dtype=sdt, device=hidden.device)
        logps, ents = [], []
        for sl in chunks:
            loss, extra, logp, ent, _ = _run_chunk(backend, hidden, weight, bias, targets, transform, sl,
                                                   chunk_bytes, want_entropy, objective, None, None, False)
            total = total + loss
            collected.append(extra)
            logps.append(logp)
            if ent is not None:
                ents.append(ent)
        logp_all = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=sdt)
        return total, logp_all, torch.cat(ents) if ents else None, collected
    total, logp_all, ent_all = _FusedFn.apply(hidden, weight, bias, targets, transform, chunks, chunk_bytes,
                                              want_entropy, objective, backend, collected)
    return total, logp_all, ent_all if want_entropy else None, collected
