"""How a pass's backward lays out its work: the rows it runs on (those whose gradient is not
known to be zero) and how it holds ``d weight`` (one buffer in the head's dtype, a bf16 pair, or
an fp32 accumulator). Both modes of :mod:`.engine` use it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from .contract import Accumulators

if TYPE_CHECKING:
    from .engine import PassKind


class ZeroRows(NamedTuple):
    """The rows of a pass whose gradient is known before it runs to be exactly zero.

    Attributes:
        mask: ``[n]`` bool.
        others: how many rows are not in ``mask``, when the caller has read it (e.g. with its
            value checks); ``None``: the pass reads it (one host synchronization).
    """

    mask: torch.Tensor
    others: int | None = None


def rows_of(value: NamedTuple, sl: slice) -> NamedTuple:
    """Rows ``sl`` of every tensor field of ``value`` (``None`` fields stay ``None``)."""
    return type(value)(*(None if t is None else t[sl] for t in value))


def records_graph(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether autograd records a graph through ``tensors`` (grad mode on, one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _zeros(want: bool, like: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return torch.zeros(like.shape, dtype=dtype, device=like.device) if want and like is not None else None




WeightGradLayout = Literal["fp32", "single", "pair"]

# Chunks of fewer tokens make cuBLAS's gradient GEMMs lose more (14% at Qwen2.5's 3.3k-token
# chunks against 14k) than the pair's own GEMM costs against cuBLAS (1.08-1.10x); at 4096-token
# chunks the pair was measured 2.7% slower (Llama-3 128k GRPO, H200): benchmarks/NOTES-h100.md.
_PAIR_BELOW_TOKENS = 4096


def weight_grad_plan(p: PassKind, n: int, weight: torch.Tensor) -> tuple[PassKind, WeightGradLayout]:
    """How a pass over ``n`` rows holds ``d weight``, and the pass planned for it.

    * ``"single"``: all rows in one chunk, when their logits fit the budget plus the fp32
      accumulator this saves; each vocabulary block's ``d weight`` rows are stored once in the
      head's dtype (no zero-fill, read-modify-write or cast; the products are rounded once
      either way).
    * ``"pair"``: several chunks of fewer than ``_PAIR_BELOW_TOKENS`` tokens adding into a bf16
      pair (bf16 heads on a kind that sets ``pairs_weight_grad``:
      :mod:`logitless.ops.triton_shared.weight_grad`); the pair is ``2 V H``
      bytes smaller than an fp32 accumulator and those bytes go to larger chunks (their logits
      and fp32 ``d hidden`` rows), so the pass holds what it would with that accumulator.
    * ``"fp32"``: several chunks adding into an fp32 accumulator (and a head without a
      ``d weight`` buffer of its own kind).
    """
    if n == 0 or not p.stores_weight_grad or weight.dtype not in (torch.float16, torch.bfloat16):
        return p, "fp32"
    if p.plan.token_chunk >= n:
        return p, "single"
    rows_w, hidden_size = p.head.weight.shape[0], weight.shape[1]
    whole = p.plan.whole(n, rows_w, rows_w * hidden_size * 4)
    if whole is not None:
        return dataclasses.replace(p, plan=whole), "single"
    if p.pairs_weight_grad and weight.dtype == torch.bfloat16 and p.plan.token_chunk < _PAIR_BELOW_TOKENS:
        # A chunk's fp32 d hidden rows grow with it: 4 H bytes a token beside its logits.
        plan = p.plan.widened(n, rows_w, rows_w * hidden_size * 2, row_bytes=hidden_size * 4)
        return dataclasses.replace(p, plan=plan), "pair"
    return p, "fp32"


def weight_grad_buffers(p: PassKind, weight: torch.Tensor, layout: WeightGradLayout,
                         n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``d weight``'s buffer for a pass over ``n`` rows, and the residual half of a pair
    (``[V_local, H]`` bf16, or ``None``). A backend that stores products
    (``stores_weight_grad``) gets the buffer uninitialized: the first chunk stores each
    vocabulary block's product (:func:`first_stores`) and later chunks add to it, so it is
    neither zero-filled nor read before the first add; in the head's dtype for ``"single"`` and
    ``"pair"``, else fp32. A shard's padding rows beyond the local rows are zeroed. Other
    backends, and a pass without rows (no chunk to store), add into fp32 zeros."""
    if not p.stores_weight_grad or n == 0:
        return torch.zeros(weight.shape, dtype=p.plan.stat_dtype, device=weight.device), None
    dtype = p.plan.stat_dtype if layout == "fp32" else weight.dtype
    buf = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if p.head.weight.shape[0] < weight.shape[0]:
        buf[p.head.weight.shape[0]:].zero_()
    lo = None
    if layout == "pair":
        lo = torch.empty((p.head.weight.shape[0], weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return buf, lo


def accumulators(p: PassKind, weight: torch.Tensor, bias: torch.Tensor | None, lora_x: torch.Tensor | None,
                  lora_b: torch.Tensor | None, needs: tuple[bool, ...], layout: WeightGradLayout,
                  n: int) -> tuple[Accumulators, Accumulators]:
    """The gradient accumulators of a pass over ``n`` rows, for the inputs whose ``needs``
    (``hidden, weight, bias, lora_x, lora_b``, as ``ctx.needs_input_grad``) are set: the
    head-sized ones (``d weight`` laid out as ``layout``, :func:`weight_grad_buffers`) and their
    views of the head's local rows, which the chunks update: the first chunk's (as
    :func:`first_stores` makes them: a kind that stores ``d weight`` stores its products)."""
    need_h, need_w, need_b, need_x, need_lb = needs[:5]
    sdt = p.plan.stat_dtype
    rows_w = p.head.weight.shape[0]
    grad_w, grad_w_lo = weight_grad_buffers(p, weight, layout, n) if need_w else (None, None)
    full = Accumulators(weight=grad_w, bias=_zeros(need_b, bias, sdt), lora_x=_zeros(need_x, lora_x, sdt),
                        lora_b=_zeros(need_lb, lora_b, sdt), hidden=need_h)
    local = Accumulators(weight=None if full.weight is None else full.weight[:rows_w],
                         bias=None if full.bias is None else full.bias[:rows_w], lora_x=full.lora_x,
                         lora_b=None if full.lora_b is None else full.lora_b[:rows_w], hidden=need_h,
                         weight_lo=grad_w_lo, write_weight=full.weight is not None and p.stores_weight_grad)
    return full, local


def first_stores(p: PassKind, acc: Accumulators, first: bool) -> Accumulators:
    """The accumulators of one chunk: the first chunk's ``d weight`` products are stored into
    the uninitialized buffer of :func:`weight_grad_buffers`, later ones added."""
    return dataclasses.replace(acc, write_weight=first and acc.weight is not None and p.stores_weight_grad)


# The rows a backward runs on are rounded up to a multiple of this (with rows of zero gradient,
# which add exact zeros): GEMMs whose row count is no multiple of their tiles run measurably slower.
_ROW_MULTIPLE = 128
# Below this share of rows left out, gathering the rows costs about what the smaller GEMMs save:
# the chunk's backward runs on every row.
_MIN_SKIPPED = 1 / 16


def backward_rows(zero: ZeroRows, chunks: Sequence[slice]) -> list[torch.Tensor | None]:
    """For each chunk, the rows (``[m]`` int64, relative to the chunk, ascending) its backward
    runs on, or ``None`` for all of them.

    A row whose statistics all have a zero gradient has ``dz = 0`` exactly (``p_v`` times zero
    coefficients), so it adds nothing to ``d weight`` and its ``d hidden`` is zero: the gradient
    GEMMs may leave it out. A chunk's rows are those not in ``zero.mask``, then as many of the
    others as round the count up to :data:`_ROW_MULTIPLE`. Several chunks (or an unread count)
    take one host synchronization for the whole pass."""
    mask = zero.mask
    if not mask.numel():
        return [None] * len(chunks)
    if len(chunks) == 1 and zero.others is not None:
        totals = [0, zero.others]
    else:
        ends = torch.tensor([sl.stop - 1 for sl in chunks], device=mask.device)
        totals = [0, *torch.cumsum((~mask).to(torch.int64), 0)[ends].tolist()]
    out: list[torch.Tensor | None] = []
    for i, sl in enumerate(chunks):
        n = sl.stop - sl.start
        m = min(n, -(-(totals[i + 1] - totals[i]) // _ROW_MULTIPLE) * _ROW_MULTIPLE)
        if n - m < n * _MIN_SKIPPED:
            out.append(None)
            continue
        order = torch.argsort(mask[sl].to(torch.int8), stable=True)  # rows with a gradient first, each part ascending
        out.append(torch.sort(order[:m]).values)
    return out
