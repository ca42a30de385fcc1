"""Recompute mode: the forward keeps O(N) state (``lse``, ``Σ p z``) and the backward recomputes
the logits block by block (4 GEMMs of work), for objectives that need every token's statistics
before their loss (:mod:`.engine`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..distributed import all_reduce, sum_partials
from . import plan as planning
from .plan import advise_on_oom, check_workspace_fits, rows_of

if TYPE_CHECKING:
    from .engine import PassKind


class _RecomputeFn(torch.autograd.Function):
    """Outputs the kind's statistics fields, ``[n]``/``[n, k]`` each; a field the kind did not
    compute is zeros ``[n]``, and it and every field outside ``DIFFERENTIABLE`` is
    non-differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, lora_x, lora_b, p: PassKind):
        stats, saved = p.forward_all(hidden, p.head.low_rank(lora_x, lora_b))
        ctx.save_for_backward(hidden, weight, bias, lora_x, lora_b, *saved)
        ctx.p, ctx.saved_type, ctx.fields = p, type(saved), stats._fields
        # A statistic the loss does not use gets None, not zeros: the backward then skips its
        # terms (e.g. an entropy taken only for metrics costs the gradient kernels nothing).
        ctx.set_materialize_grads(False)
        n, sdt = hidden.shape[0], p.plan.stat_dtype
        outs, frozen = [], []
        for name, t in zip(stats._fields, stats, strict=True):
            if t is None:
                t = torch.zeros(n, dtype=sdt, device=hidden.device)
            if name not in p.DIFFERENTIABLE or stats._asdict()[name] is None:
                frozen.append(t)
            outs.append(t)
        ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *g_stats):
        hidden, weight, bias, lora_x, lora_b, *saved = ctx.saved_tensors
        p: PassKind = ctx.p
        saved = ctx.saved_type(*saved)
        present = dict(zip(ctx.fields, p.fields_present(), strict=True))
        grads = p.grads_of({name: g for name, g in zip(ctx.fields, g_stats, strict=True)
                            if name in p.DIFFERENTIABLE and present[name]})
        need_h, need_w = ctx.needs_input_grad[:2]
        sdt = p.plan.stat_dtype
        # The backward runs on the rows with a gradient only: ``rows`` (``hidden``'s, or a gathered copy).
        picked = None if p.zero_rows is None else planning.backward_rows(p.zero_rows, [slice(0, hidden.shape[0])])[0]
        rows = hidden
        if picked is not None:
            p, rows, saved, grads = p.select(picked), hidden[picked], rows_of(saved, picked), grads.rows(picked)
        n = rows.shape[0]
        layout: planning.WeightGradLayout = "fp32"
        if need_w:
            p, layout = planning.weight_grad_plan(p, n, weight)
        local = p.head.rows_of(weight, bias)
        acc, local_acc = planning.accumulators(p, weight, bias, lora_x, lora_b, ctx.needs_input_grad, layout, n)
        low = local.low_rank(lora_x, lora_b)
        # Vocabulary-parallel partials of d hidden are summed in the statistics dtype, then cast once.
        partial = need_h and local.parallel and local.reduce_grad_hidden
        grad_rows = torch.empty_like(rows, dtype=sdt if partial else None) if need_h else None
        with advise_on_oom(p.plan, hidden.device):
            chunks = p.plan.chunks(n)
            for i, sl in enumerate(chunks):
                chunk_acc = dataclasses.replace(planning.first_stores(p, local_acc, i == 0),
                                                lora_x=None if local_acc.lora_x is None else local_acc.lora_x[sl],
                                                last_weight=i == len(chunks) - 1)
                gh = p.backward(p.rows(rows, sl, low), p.plan, rows_of(saved, sl), grads.rows(sl), chunk_acc, None)
                if need_h:
                    grad_rows[sl] = gh
        grad_hidden = grad_rows
        if need_h and picked is not None:
            grad_hidden = torch.zeros_like(hidden, dtype=grad_rows.dtype)
            grad_hidden[picked] = grad_rows
        if partial:
            grad_hidden = sum_partials(grad_hidden, hidden.dtype, local.group)
        if acc.lora_x is not None and local.parallel and local.reduce_grad_hidden:
            acc.lora_x.copy_(all_reduce(acc.lora_x, "sum", local.group))
        return (grad_hidden, _cast(acc.weight, weight), _cast(acc.bias, bias), _cast(acc.lora_x, lora_x),
                _cast(acc.lora_b, lora_b), None)


def recompute_stats(p: PassKind, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    lora_x: torch.Tensor | None = None, lora_b: torch.Tensor | None = None) -> NamedTuple:
    """Every row's statistics of the kind ``p`` in recompute mode, differentiable w.r.t.
    ``hidden``, ``weight``, ``bias`` and the adapter factors (fields not computed: ``None``).

    Raises:
        PassOutOfMemoryError: the workspace does not fit the device, or it ran out of memory.
    """
    check_workspace_fits(p.plan, hidden.device)
    tensors = (hidden, weight, bias, lora_x, lora_b)
    if not planning.records_graph(tensors):
        return p.forward_all(hidden, p.head.low_rank(lora_x, lora_b))[0]  # no graph to record
    outs = _RecomputeFn.apply(*tensors, p)
    template = p.empty_stats(0, hidden.device)
    return type(template)(*(t if present else None for t, present in zip(outs, p.fields_present(), strict=True)))


def _cast(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None else g.to(like.dtype)
