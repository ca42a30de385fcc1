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
from typing import Any, NamedTuple

import torch

from ..distributed import all_reduce, is_active
from .lora import HeadLoRA, LowRank
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


def _run_chunk(backend, hidden, head, targets, transform, sl, chunk_bytes, fp32_logits, want_entropy, extra_stats,
               objective, grads_out, low, want_grad):
    """Statistics, the objective's term and (``want_grad``) the chunk's gradients."""
    sdt = stat_dtype_for(hidden.dtype)
    h, t = hidden[sl], targets[sl]
    low = None if low is None else low.rows(sl)
    plan = ChunkPlan.make(h.shape[0], max(head.weight.shape[0], 1), chunk_bytes, sdt, hidden.dtype, backend.NAME,
                          fp32_logits)
    with no_autocast(hidden.device):
        partials, kept = backend.chunk_forward(h, head.weight, head.bias, t, transform, plan, sdt, want_entropy,
                                               keep_logits=want_grad and plan.keep_logits,
                                               want_sum_z="sum_z" in extra_stats, lora=low)
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
            grad_hidden = backend.chunk_backward(
                h, head.weight, head.bias, t, transform, plan, st.lse, st.sum_pz, grads["logp"], grads.get("lse"),
                grads.get("entropy"), kept, grads_out.weight, grads_out.bias, grads_out.hidden is not None,
                g_sum_z=grads.get("sum_z"), lora=low, grad_lora_x=grads_out.lora_x_rows(sl),
                grad_lora_b=grads_out.lora_b)
    return loss.detach(), collected, st.logp, entropy, grad_hidden


class _Grads(NamedTuple):
    """Gradient accumulators of a fused pass (``None`` where not needed); ``weight``/``bias``/
    ``lora_b`` are the local rows, ``hidden`` rows are written chunk by chunk."""

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    lora_x: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None

    def any(self) -> bool:
        return any(g is not None for g in self)

    def lora_x_rows(self, sl: slice) -> torch.Tensor | None:
        return None if self.lora_x is None else self.lora_x[sl]


def _run_chunks(backend, hidden, head, targets, transform, chunks, chunk_bytes, fp32_logits, want_entropy,
                extra_stats, objective, collected, grads_out: _Grads, low: LowRank | None):
    """All chunks in order: ``(total loss, logp [n], entropy [n] | None)``; gradients go into the
    given accumulators (``grads_out.hidden`` rows written per chunk) when any is given."""
    sdt = stat_dtype_for(hidden.dtype)
    n = hidden.shape[0]
    want_grad = grads_out.any()
    total = torch.zeros((), dtype=sdt, device=hidden.device)
    # Filled in place: per-chunk small tensors kept alive fragment the CPU heap (see forward_pass).
    logp_all = torch.empty(n, dtype=sdt, device=hidden.device)
    ent_all = torch.empty(n, dtype=sdt, device=hidden.device) if want_entropy else None
    for sl in chunks:
        loss, extra, logp, ent, gh = _run_chunk(backend, hidden, head, targets, transform, sl, chunk_bytes,
                                                fp32_logits, want_entropy, extra_stats, objective, grads_out, low,
                                                want_grad)
        total = total + loss
        collected.append(extra)
        logp_all[sl] = logp
        if ent_all is not None:
            ent_all[sl] = ent
        if grads_out.hidden is not None and gh is not None:
            grads_out.hidden[sl] = gh
    return total, logp_all, ent_all


class _FusedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, lora_x, lora_b, targets, transform, chunks, chunk_bytes, fp32_logits,
                want_entropy, extra_stats, objective, backend, head, collected):
        need_h, need_w, need_b, need_x, need_lb = ctx.needs_input_grad[:5]
        sdt = stat_dtype_for(hidden.dtype)
        valid = head.weight.shape[0]

        def zeros(want, shape, dtype=sdt):
            return torch.zeros(shape, dtype=dtype, device=hidden.device) if want else None

        # Vocabulary-parallel partials of d hidden / d x are summed in the statistics dtype, then cast once.
        partial = head.reduce_grad_hidden and is_active(head.group)
        full = _Grads(hidden=zeros(need_h, hidden.shape, sdt if partial else hidden.dtype),
                      weight=zeros(need_w, weight.shape), bias=zeros(need_b, weight.shape[0]),
                      lora_x=zeros(need_x, () if lora_x is None else lora_x.shape),
                      lora_b=zeros(need_lb, () if lora_b is None else lora_b.shape))
        local = full._replace(**{k: None if g is None else g[:valid]
                                 for k, g in (("weight", full.weight), ("bias", full.bias), ("lora_b", full.lora_b))})
        low = head.low_rank(lora_x, lora_b)
        total, logp_all, ent_all = _run_chunks(backend, hidden, head, targets, transform, chunks, chunk_bytes,
                                               fp32_logits, want_entropy, extra_stats, objective, collected, local,
                                               low)
        grad_hidden, grad_x = full.hidden, full.lora_x
        if partial and grad_hidden is not None:
            grad_hidden = all_reduce(grad_hidden, "sum", head.group).to(hidden.dtype)
        if partial and grad_x is not None:
            grad_x = all_reduce(grad_x, "sum", head.group)
        ctx.save_for_backward(grad_hidden, full.weight, full.bias, grad_x, full.lora_b)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (hidden, weight, bias, lora_x, lora_b))
        ent_all = logp_all.new_zeros(0) if ent_all is None else ent_all
        ctx.mark_non_differentiable(logp_all, ent_all)
        return total, logp_all, ent_all

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        # loss.backward() sends exactly 1: skip scaling a [V, H] fp32 buffer (a full extra pass).
        unit = bool(g_loss == 1)

        def scaled(g, dtype):
            if g is None:
                return None
            return g.to(dtype) if unit else (g * g_loss.to(g.dtype)).to(dtype)

        grads = [scaled(g, dt) for g, dt in zip(ctx.saved_tensors, ctx.dtypes, strict=True)]
        return (*grads, None, None, None, None, None, None, None, None, None, None, None)


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
    fp32_logits: bool | None = None,
    extra_stats: tuple[str, ...] = (),
    shard: VocabShard | None = None,
    lora: HeadLoRA | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[Any]]:
    """Run ``objective`` over the vocabulary statistics of ``hidden`` in fused mode.

    Inputs are assumed validated (callers go through :func:`check_head_inputs`); ``targets``
    are global ids. ``extra_stats`` (subset of ``"lse"``, ``"sum_z"``, ``"is_top1"``) are passed
    to the objective as keyword arguments (``is_top1`` a bool tensor). Under a vocabulary-parallel
    ``shard`` every chunk's statistics take one MAX and one SUM all-reduce. ``fp32_logits``: see
    :class:`ChunkPlan` (``None``: its default). ``lora`` adds the
    adapter's low-rank term inside each block; its gradients reach ``lora.a``/``lora.b``.

    Returns:
        ``(loss, logp [n], entropy [n] | None, collected)``: ``loss`` is the sum of the chunk
        terms and carries the gradient to ``hidden``/``weight``/``bias``; ``logp``/``entropy``
        are detached; ``collected`` holds each chunk's second return value, in order.
    """
    sdt = stat_dtype_for(hidden.dtype)
    head = LocalHead.make(weight, bias, shard)
    targets = head.local_targets(targets)
    plan = ChunkPlan.make(hidden.shape[0], max(head.weight.shape[0], 1), chunk_bytes, sdt, hidden.dtype,
                          backend.NAME, fp32_logits)
    chunks = plan_chunks(hidden.shape[0], plan.token_chunk, cuts)
    collected: list[Any] = []
    x, b = (None, None) if lora is None else lora.factors(hidden, weight)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias, x, b))
    if not needs_grad:
        total, logp_all, ent_all = _run_chunks(backend, hidden, head, targets, transform, chunks, chunk_bytes,
                                               plan.fp32_logits, want_entropy, extra_stats, objective, collected,
                                               _Grads(), head.low_rank(x, b))
        return total, logp_all, ent_all, collected
    total, logp_all, ent_all = _FusedFn.apply(hidden, weight, bias, x, b, targets, transform, chunks, chunk_bytes,
                                              plan.fp32_logits, want_entropy, extra_stats, objective, backend, head,
                                              collected)
    return total, logp_all, ent_all if want_entropy else None, collected
