"""The vocabulary engine: one blocked pass over the vocabulary, in fused or recompute mode.

Objectives hand the engine a :class:`Head`, the rows that enter the pass and (for a loss) a
chunk objective; the engine resolves the head, the backend and the block sizes once per call,
walks the token chunks, and returns the loss and every token's statistics. Two modes:

* **recompute**: the forward keeps O(N) state (``lse``, ``Σ p z``); the backward recomputes the
  logits block by block (4 GEMMs of work). The objective sees every token's statistics at once,
  so it may need global information first (an entropy quantile, a sequence split across chunks).
* **fused**: for each chunk the forward computes the statistics, asks the objective for the
  chunk's loss term, differentiates it w.r.t. the chunk's statistics (autograd on ``[chunk]``
  tensors), and runs the gradient GEMMs right away, reusing the chunk's logits when they fit;
  the backward only scales the saved gradients (3 GEMMs). The objective must be a sum of
  per-chunk terms (global normalizers precomputed by the caller); chunks end only at the
  caller's allowed cut points (sequence boundaries for sequence-level objectives).

The per-chunk work is a **pass kind** (:class:`PassKind`): :class:`_Pass` is the single-head
softmax run through a backend; :mod:`.distill` adds a two-head (student + teacher) kind. The
chunk loops, both modes' ``autograd.Function`` and the accumulators below serve every kind.

Under vocabulary parallelism (``Head.shard`` with a group) the partial statistics are reduced
with one MAX and one SUM all-reduce per pass (recompute) or per chunk (fused), and the
``d hidden`` partials are summed in the statistics dtype, then cast once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import torch

from ..distributed import all_reduce
from .contract import (
    Accumulators,
    Backend,
    ChunkRows,
    RowStats,
    SavedStats,
    StatGrads,
    StatRequest,
    resolve_backend,
    triton_available,
)
from .head import Head, LocalHead
from .lora import LowRank
from .memory import advise_on_oom, check_workspace_fits
from .options import Mode, PassOptions
from .plan import ChunkPlan, stat_dtype_for


class ChunkStats(NamedTuple):
    """Per-token statistics of the head's softmax for a set of tokens (``[n]`` each, fp32 — fp64
    for fp64 inputs — nats): what an objective sees.

    ``logp`` (of the target), ``lse`` (log-partition), ``entropy`` (``None`` unless requested)
    and ``sum_z`` (``Σ_v z_v``, ``None`` unless requested) are differentiable inside an
    objective; ``is_top1`` (bool: the target's logit is the largest, ties count) is not.
    """

    logp: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    sum_z: torch.Tensor | None
    is_top1: torch.Tensor

    def detached(self) -> ChunkStats:
        return ChunkStats(*(None if t is None else t.detach() for t in self))


# objective(token_slice, stats) -> (loss term, anything to collect)
ChunkObjective = Callable[[slice, ChunkStats], tuple[torch.Tensor, Any]]


class ZeroRows(NamedTuple):
    """The rows of a pass whose gradient is known before it runs to be exactly zero.

    Attributes:
        mask: ``[n]`` bool.
        others: how many rows are not in ``mask``, when the caller has read it (e.g. with its
            value checks); ``None``: the pass reads it (one host synchronization).
    """

    mask: torch.Tensor
    others: int | None = None


@dataclass(frozen=True)
class ObjectiveSpec:
    """What an objective needs from the pass.

    Attributes:
        want: statistics beyond ``logp``/``lse``/``is_top1`` (:class:`StatRequest`).
        cuts: token positions where a fused chunk may end (sorted, in ``(0, n]``), or ``None``
            (anywhere): sequence boundaries for sequence-level objectives.
        needs_all_stats: the objective needs every token's statistics before its loss (e.g. an
            entropy quantile), so it runs in recompute mode.
        before_loss: called with every token's detached statistics before the objective, in
            recompute mode (e.g. to set a quantile mask).
        zero_rows: the rows whose gradient is known before the pass to be exactly zero
            (:class:`ZeroRows`; a policy loss without KL or entropy bonus: the tokens of zero
            advantage), or ``None``; with :attr:`PassOptions.skip_zero_rows` the gradient GEMMs
            leave them out (their statistics are still computed).
    """

    want: StatRequest = field(default_factory=StatRequest)
    cuts: Sequence[int] | None = None
    needs_all_stats: bool = False
    before_loss: Callable[[ChunkStats], None] | None = None
    zero_rows: ZeroRows | None = None


class PassResult(NamedTuple):
    """``loss`` (the sum of the objective's terms, differentiable), every token's detached
    ``stats`` and each chunk's collected value, in order."""

    loss: torch.Tensor
    stats: ChunkStats
    collected: list[Any]


def resolve_mode(mode: Mode, needs_all_stats: bool) -> Literal["fused", "recompute"]:
    """``auto`` → fused unless the objective needs every token's statistics before its loss.

    Raises:
        ValueError: unknown mode, or ``fused`` for an objective that cannot be chunked.
    """
    if mode not in ("auto", "fused", "recompute"):
        raise ValueError(f"mode must be 'auto', 'fused' or 'recompute', got {mode!r}")
    if mode == "fused" and needs_all_stats:
        raise ValueError("mode='fused' cannot run an objective that needs every token's statistics before the "
                         "loss (e.g. top_entropy_quantile < 1); use mode='recompute' or 'auto'")
    if mode == "auto":
        return "recompute" if needs_all_stats else "fused"
    return mode


def no_autocast(device: torch.device):
    """The pass controls its own precisions (fp32 statistics); autocast must not recast them."""
    return torch.autocast(device_type=device.type, enabled=False)


class PassKind(Protocol):
    """The per-chunk work of a pass, as the engine's loops and ``autograd.Function`` use it.

    A kind's statistics are a ``NamedTuple`` of ``[n]``/``[n, k]`` tensors (``None``: not
    computed); the fields named in ``DIFFERENTIABLE`` carry gradients, which come back to
    :meth:`backward` as ``grads_of`` builds them (a ``NamedTuple`` with ``any()`` and ``rows(sl)``).
    ``head`` is the differentiable head (its weight, bias and adapter get the gradients).
    """

    head: LocalHead
    plan: ChunkPlan
    DIFFERENTIABLE: tuple[str, ...]
    # The rows the backward may leave out (their gradient is exactly zero), or ``None``; a kind
    # that sets it implements ``pick``, ``pick_kept`` and ``select``.
    zero_rows: ZeroRows | None

    @property
    def stores_weight_grad(self) -> bool:
        """Whether the backward honours :attr:`Accumulators.write_weight`."""
        ...

    @property
    def pairs_weight_grad(self) -> bool:
        """Whether the backward honours :attr:`Accumulators.weight_lo` (a bf16 pair)."""
        ...

    def fields_present(self) -> tuple[bool, ...]: ...

    def rows(self, hidden: torch.Tensor, sl: slice, low: LowRank | None) -> Any: ...

    def chunk_stats(self, rows: Any, plan: ChunkPlan, keep_logits: bool) -> tuple[Any, Any, object | None]: ...

    def forward_all(self, hidden: torch.Tensor, low: LowRank | None) -> tuple[Any, Any]: ...

    def empty_stats(self, n: int, device: torch.device) -> Any: ...

    def grads_of(self, named: dict[str, torch.Tensor]) -> Any: ...

    def backward(self, rows: Any, plan: ChunkPlan, saved: Any, grads: Any, acc: Accumulators,
                 kept: object | None) -> torch.Tensor | None: ...


def rows_of(value: NamedTuple, sl: slice) -> NamedTuple:
    """Rows ``sl`` of every tensor field of ``value`` (``None`` fields stay ``None``)."""
    return type(value)(*(None if t is None else t[sl] for t in value))


@dataclass
class _Pass:
    """One call's resolved single-head pass (a :class:`PassKind`): made once, used by every
    chunk and by the backward."""

    DIFFERENTIABLE = ("logp", "lse", "entropy", "sum_z")

    backend: Backend
    head: LocalHead
    targets: torch.Tensor  # [n] local indices
    plan: ChunkPlan
    want: StatRequest
    lora_b: torch.Tensor | None = None  # [V, r] the adapter's vocabulary-side factor (GEMM dtype)
    zero_rows: ZeroRows | None = None

    @classmethod
    def make(cls, hidden: torch.Tensor, head: Head, targets: torch.Tensor, spec: ObjectiveSpec,
             options: PassOptions) -> tuple[_Pass, torch.Tensor | None]:
        """The pass and the adapter's hidden-side factor ``x`` (differentiable, or ``None``)."""
        local = head.local()
        backend = resolve_backend(options.impl, hidden, head.lora is not None)
        plan = ChunkPlan.make(hidden.shape[0], local.weight.shape[0], options.budget, hidden.dtype, backend.PLAN,
                              options.fp32_logits)
        x = b = None
        if head.lora is not None:
            x, b = head.lora.factors(hidden, head.weight)
        # An adapter's d x rows are written in place per chunk; compacting them is not worth a path.
        skip = options.skip_zero_rows and head.lora is None
        return cls(backend, local, local.local_targets(targets), plan, spec.want, b,
                   spec.zero_rows if skip else None), x

    def pick(self, rows: ChunkRows, idx: torch.Tensor) -> ChunkRows:
        """The rows ``idx`` (``[m]`` int64, ascending) of a chunk (no adapter: see :meth:`make`)."""
        return ChunkRows(rows.hidden[idx], rows.targets[idx], None)

    def pick_kept(self, kept: object | None, idx: torch.Tensor) -> object | None:
        """The backend's kept logits of the rows ``idx`` (moved in place to the tile's first rows)."""
        return None if kept is None else self.backend.kept_rows(kept, idx)

    def select(self, idx: torch.Tensor) -> _Pass:
        """This pass restricted to the rows ``idx`` of its tokens."""
        return dataclasses.replace(self, targets=self.targets[idx], zero_rows=None)

    @property
    def stores_weight_grad(self) -> bool:
        return self.backend.CAPS.stores_weight_grad and self.lora_b is None

    @property
    def pairs_weight_grad(self) -> bool:
        return self.backend.CAPS.pairs_weight_grad and self.lora_b is None

    def rows(self, hidden: torch.Tensor, sl: slice, low: LowRank | None) -> ChunkRows:
        return ChunkRows(hidden[sl], self.targets[sl], None if low is None else low.rows(sl))

    def forward(self, rows: ChunkRows, plan: ChunkPlan, keep_logits: bool) -> tuple[RowStats, object | None]:
        with no_autocast(rows.hidden.device):
            return self.backend.chunk_forward(self.head, rows, plan, self.want, keep_logits)

    def backward(self, rows: ChunkRows, plan: ChunkPlan, saved: SavedStats, grads: StatGrads, acc: Accumulators,
                 kept: object | None) -> torch.Tensor | None:
        with no_autocast(rows.hidden.device):
            return self.backend.chunk_backward(self.head, rows, plan, saved, grads, acc, kept)

    def fields_present(self) -> tuple[bool, ...]:
        return True, True, self.want.entropy, self.want.sum_z, True

    def chunk_stats(self, rows: ChunkRows, plan: ChunkPlan,
                    keep_logits: bool) -> tuple[ChunkStats, SavedStats, object | None]:
        """A chunk's statistics over the full vocabulary (reduced over the group), what its
        backward needs, and the backend's kept logits."""
        part, kept = self.forward(rows, plan, keep_logits)
        stats, saved = _stats_of(part.reduce(self.head.group))
        return stats, saved, kept

    def forward_all(self, hidden: torch.Tensor, low: LowRank | None) -> tuple[ChunkStats, SavedStats]:
        return _forward_all(self, hidden, low)

    def empty_stats(self, n: int, device: torch.device) -> ChunkStats:
        sdt = stat_dtype_for(self.head.weight.dtype)
        return ChunkStats(*(torch.empty(n, dtype=torch.bool if name == "is_top1" else sdt, device=device)
                            if present else None for name, present in zip(ChunkStats._fields, self.fields_present(),
                                                                           strict=True)))

    def grads_of(self, named: dict[str, torch.Tensor]) -> StatGrads:
        return StatGrads(**named)


def _stats_of(st: RowStats) -> tuple[ChunkStats, SavedStats]:
    fin = st.finalize()
    entropy = None if fin.sum_pz is None else fin.lse - fin.sum_pz
    return ChunkStats(fin.logp, fin.lse, entropy, fin.sum_z, fin.is_top1), SavedStats(fin.lse, fin.sum_pz)


# ----------------------------------------------------------------------------- recompute mode


def _forward_all(p: _Pass, hidden: torch.Tensor, low: LowRank | None) -> tuple[ChunkStats, SavedStats]:
    """Statistics of every row, chunk by chunk, reduced over the vocabulary group once."""
    n = hidden.shape[0]
    # Whole-pass buffers filled chunk by chunk: keeping every chunk's small result tensors alive
    # instead pins the heap between the chunks' large logits blocks on CPU (glibc), and resident
    # memory then grows by about one block per chunk, i.e. with N x V.
    chunks = p.plan.stats_chunks(n)
    with advise_on_oom(p.plan, hidden.device):
        if len(chunks) == 1:  # the common case: the chunk's own buffers, no copy
            out, _ = p.forward(p.rows(hidden, chunks[0], low), p.plan, keep_logits=False)
        else:
            out = RowStats.empty(n, stat_dtype_for(hidden.dtype), hidden.device, p.want)
            for sl in chunks:
                part, _ = p.forward(p.rows(hidden, sl, low), p.plan, keep_logits=False)
                out.write(sl, part)
                del part
    stats, saved = _stats_of(out.reduce(p.head.group))
    check_rounded_logits(p.plan, hidden.dtype, stats)
    return stats, saved


def check_rounded_logits(plan: ChunkPlan, dtype: torch.dtype, stats: NamedTuple) -> None:
    """With ``logits_precision="input"`` the matmul output is rounded to ``dtype`` first; a
    logit beyond its range (fp16: ±65504) rounds to ±inf and turns the statistics into NaN, so
    one check per pass (only in that mode: finite inputs give finite fp32 logits).

    Raises:
        ValueError: a non-finite ``lse``/``logp``/``entropy``, naming the option to change.
    """
    if plan.fp32_logits or dtype not in (torch.float16, torch.bfloat16):
        return
    checked = [getattr(stats, name) for name in ("lse", "logp", "entropy") if getattr(stats, name, None) is not None]
    if checked and not bool(torch.stack([torch.isfinite(t).all() for t in checked]).all()):
        raise ValueError(f"logits_precision='input' with {dtype} inputs: some logits exceed {dtype}'s range "
                         f"(max {torch.finfo(dtype).max:g}) and round to inf, which makes the log-probs/entropy NaN; "
                         f"use PassOptions(logits_precision='fp32') (or LOGITLESS_LOGITS_PRECISION=fp32)")


def _records_graph(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether autograd records a graph through ``tensors`` (grad mode on, one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _zeros(want: bool, like: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return torch.zeros(like.shape, dtype=dtype, device=like.device) if want and like is not None else None


def _cast(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None else g.to(like.dtype)


WeightGradLayout = Literal["fp32", "single", "pair"]

# Chunks of fewer tokens make cuBLAS's gradient GEMMs lose more (14% at Qwen2.5's 3.3k-token
# chunks against 14k) than the pair's own GEMM costs against cuBLAS (1.08-1.10x); at 4096-token
# chunks the pair was measured 2.7% slower (Llama-3 128k GRPO, H200): benchmarks/NOTES-h100.md.
_PAIR_BELOW_TOKENS = 4096


def _weight_grad_plan(p: PassKind, n: int, weight: torch.Tensor) -> tuple[PassKind, WeightGradLayout]:
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


def _weight_grad_buffers(p: PassKind, weight: torch.Tensor, layout: WeightGradLayout,
                         n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``d weight``'s buffer for a pass over ``n`` rows, and the residual half of a pair
    (``[V_local, H]`` bf16, or ``None``). A backend that stores products
    (``stores_weight_grad``) gets the buffer uninitialized: the first chunk stores each
    vocabulary block's product (:func:`_first_stores`) and later chunks add to it, so it is
    neither zero-filled nor read before the first add; in the head's dtype for ``"single"`` and
    ``"pair"``, else fp32. A shard's padding rows beyond the local rows are zeroed. Other
    backends, and a pass without rows (no chunk to store), add into fp32 zeros."""
    if not p.stores_weight_grad or n == 0:
        return torch.zeros(weight.shape, dtype=stat_dtype_for(weight.dtype), device=weight.device), None
    dtype = stat_dtype_for(weight.dtype) if layout == "fp32" else weight.dtype
    buf = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if p.head.weight.shape[0] < weight.shape[0]:
        buf[p.head.weight.shape[0]:].zero_()
    lo = None
    if layout == "pair":
        lo = torch.empty((p.head.weight.shape[0], weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return buf, lo


def _accumulators(p: PassKind, weight: torch.Tensor, bias: torch.Tensor | None, lora_x: torch.Tensor | None,
                  lora_b: torch.Tensor | None, needs: tuple[bool, ...], layout: WeightGradLayout,
                  n: int) -> tuple[Accumulators, Accumulators]:
    """The gradient accumulators of a pass over ``n`` rows, for the inputs whose ``needs``
    (``hidden, weight, bias, lora_x, lora_b``, as ``ctx.needs_input_grad``) are set: the
    head-sized ones (``d weight`` laid out as ``layout``, :func:`_weight_grad_buffers`) and their
    views of the head's local rows, which the chunks update."""
    need_h, need_w, need_b, need_x, need_lb = needs[:5]
    sdt = stat_dtype_for(weight.dtype)
    rows_w = p.head.weight.shape[0]
    grad_w, grad_w_lo = _weight_grad_buffers(p, weight, layout, n) if need_w else (None, None)
    full = Accumulators(weight=grad_w, bias=_zeros(need_b, bias, sdt), lora_x=_zeros(need_x, lora_x, sdt),
                        lora_b=_zeros(need_lb, lora_b, sdt), hidden=need_h)
    local = Accumulators(weight=None if full.weight is None else full.weight[:rows_w],
                         bias=None if full.bias is None else full.bias[:rows_w], lora_x=full.lora_x,
                         lora_b=None if full.lora_b is None else full.lora_b[:rows_w], hidden=need_h,
                         weight_lo=grad_w_lo)
    return full, local


def _first_stores(p: PassKind, acc: Accumulators, first: bool) -> Accumulators:
    """The accumulators of one chunk: the first chunk's ``d weight`` products are stored into
    the uninitialized buffer of :func:`_weight_grad_buffers`, later ones added."""
    return dataclasses.replace(acc, write_weight=first and acc.weight is not None and p.stores_weight_grad)


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
        n, sdt = hidden.shape[0], stat_dtype_for(hidden.dtype)
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
        sdt = stat_dtype_for(hidden.dtype)
        # The backward runs on the rows with a gradient only: ``rows`` (``hidden``'s, or a gathered copy).
        picked = None if p.zero_rows is None else _backward_rows(p.zero_rows, [slice(0, hidden.shape[0])])[0]
        rows = hidden
        if picked is not None:
            p, rows, saved, grads = p.select(picked), hidden[picked], rows_of(saved, picked), grads.rows(picked)
        n = rows.shape[0]
        layout: WeightGradLayout = "fp32"
        if need_w:
            p, layout = _weight_grad_plan(p, n, weight)
        local = p.head.rows_of(weight, bias)
        acc, local_acc = _accumulators(p, weight, bias, lora_x, lora_b, ctx.needs_input_grad, layout, n)
        low = local.low_rank(lora_x, lora_b)
        # Vocabulary-parallel partials of d hidden are summed in the statistics dtype, then cast once.
        partial = need_h and local.reduces_grad_hidden
        grad_rows = torch.empty_like(rows, dtype=sdt if partial else None) if need_h else None
        with advise_on_oom(p.plan, hidden.device):
            for i, sl in enumerate(p.plan.chunks(n)):
                chunk_acc = dataclasses.replace(_first_stores(p, local_acc, i == 0),
                                                lora_x=None if local_acc.lora_x is None else local_acc.lora_x[sl])
                gh = p.backward(p.rows(rows, sl, low), p.plan, rows_of(saved, sl), grads.rows(sl), chunk_acc, None)
                if need_h:
                    grad_rows[sl] = gh
        grad_hidden = grad_rows
        if need_h and picked is not None:
            grad_hidden = torch.zeros_like(hidden, dtype=grad_rows.dtype)
            grad_hidden[picked] = grad_rows
        if partial:
            grad_hidden = all_reduce(grad_hidden, "sum", local.group).to(hidden.dtype)
        if acc.lora_x is not None and local.reduces_grad_hidden:
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
    if not _records_graph(tensors):
        return p.forward_all(hidden, p.head.low_rank(lora_x, lora_b))[0]  # no graph to record
    outs = _RecomputeFn.apply(*tensors, p)
    template = p.empty_stats(0, hidden.device)
    return type(template)(*(t if present else None for t, present in zip(outs, p.fields_present(), strict=True)))


def compute_stats(hidden: torch.Tensor, head: Head, targets: torch.Tensor, want: StatRequest,
                  options: PassOptions, zero_rows: ZeroRows | None = None) -> ChunkStats:
    """Every row's statistics, differentiable w.r.t. ``hidden`` and the head's tensors (recompute
    mode; under ``torch.no_grad`` only the forward runs: one GEMM's worth of work).

    Args:
        hidden: ``[n, H]`` rows that enter the pass (validated by the caller).
        head: the :class:`Head`.
        targets: ``[n]`` int64 global token ids, all valid.
        want: statistics beyond ``logp``/``lse``/``is_top1``.
        options: :class:`PassOptions` (``mode`` is not read: this is recompute mode).
        zero_rows: rows whose gradient is known to be zero (:attr:`ObjectiveSpec.zero_rows`).

    Returns:
        :class:`ChunkStats` of the ``n`` rows (``entropy``/``sum_z`` ``None`` unless wanted).
    """
    p, x = _Pass.make(hidden, head, targets, ObjectiveSpec(want=want, zero_rows=zero_rows), options)
    return recompute_stats(p, hidden, head.weight, head.bias, x, p.lora_b)


# ----------------------------------------------------------------------------- fused mode


@dataclass
class _FusedCall:
    """The non-tensor inputs of one fused pass."""

    p: PassKind
    objective: ChunkObjective
    chunks: list[slice]
    weight_grad: WeightGradLayout = "fp32"  # how d weight is held (_weight_grad_plan)
    backward_rows: list[torch.Tensor | None] | None = None  # per chunk (_backward_rows); None: all
    collected: list[Any] = field(default_factory=list)
    stats: NamedTuple | None = None  # every token's, set by the pass


def _run_chunk(call: _FusedCall, hidden: torch.Tensor, sl: slice, low: LowRank | None, acc: Accumulators | None,
               picked: torch.Tensor | None) -> tuple[torch.Tensor, NamedTuple, torch.Tensor | None]:
    """A chunk's statistics, its loss term and (``acc`` given) its gradients:
    ``(loss term, detached stats, d hidden rows | None)``; with ``picked`` (the rows the backward
    runs on, :func:`_backward_rows`) the ``d hidden`` rows are those rows' only."""
    p = call.p
    rows = p.rows(hidden, sl, low)
    plan = p.plan.fit(sl.stop - sl.start, p.head.weight.shape[0])
    want_grad = acc is not None
    stats, saved, kept = p.chunk_stats(rows, plan, keep_logits=want_grad and plan.keep_logits)
    with torch.enable_grad():
        def leaf(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or name not in p.DIFFERENTIABLE else t.detach().requires_grad_(want_grad)

        leaves = type(stats)(*(leaf(name, t) for name, t in zip(stats._fields, stats, strict=True)))
        loss, collected = call.objective(sl, leaves)
        grads = p.grads_of({})
        if want_grad and loss.requires_grad:
            names = [k for k in p.DIFFERENTIABLE if getattr(leaves, k) is not None]
            got = torch.autograd.grad(loss, [getattr(leaves, k) for k in names], allow_unused=True)
            grads = p.grads_of(dict(zip(names, got, strict=True)))
    call.collected.append(collected)
    grad_hidden = None
    backward = want_grad and grads.any() and (picked is None or picked.numel() > 0)
    if backward and picked is not None:
        rows, saved, grads, kept = p.pick(rows, picked), rows_of(saved, picked), grads.rows(picked), \
            p.pick_kept(kept, picked)
    if backward:
        chunk_acc = dataclasses.replace(acc, lora_x=None if acc.lora_x is None else acc.lora_x[sl])
        grad_hidden = p.backward(rows, plan, saved, grads, chunk_acc, kept)
    elif want_grad and acc.write_weight and acc.weight is not None:
        acc.weight.zero_()  # nothing reaches the logits: d weight is 0, and nothing else writes it
        if acc.weight_lo is not None:
            acc.weight_lo.zero_()
    return loss.detach(), stats, grad_hidden


# The rows a backward runs on are rounded up to a multiple of this (with rows of zero gradient,
# which add exact zeros): GEMMs whose row count is no multiple of their tiles run measurably slower.
_ROW_MULTIPLE = 128
# Below this share of rows left out, gathering the rows costs about what the smaller GEMMs save:
# the chunk's backward runs on every row.
_MIN_SKIPPED = 1 / 16


def _backward_rows(zero: ZeroRows, chunks: Sequence[slice]) -> list[torch.Tensor | None]:
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


def _run_chunks(call: _FusedCall, hidden: torch.Tensor, low: LowRank | None,
                acc: Accumulators | None, grad_hidden: torch.Tensor | None) -> tuple[torch.Tensor, NamedTuple]:
    """All chunks in order: the total loss and every token's statistics; with ``acc`` the
    gradients go into it (``grad_hidden`` rows written per chunk)."""
    sdt = stat_dtype_for(hidden.dtype)
    n = hidden.shape[0]
    total = None
    # Filled in place: per-chunk small tensors kept alive fragment the CPU heap (see _forward_all).
    # One chunk keeps its own.
    out = call.p.empty_stats(n, hidden.device) if len(call.chunks) > 1 else None
    with advise_on_oom(call.p.plan, hidden.device):
        for i, sl in enumerate(call.chunks):
            chunk_acc = None if acc is None else _first_stores(call.p, acc, i == 0)
            picked = None if call.backward_rows is None else call.backward_rows[i]
            loss, stats, gh = _run_chunk(call, hidden, sl, low, chunk_acc, picked)
            total = loss.to(sdt) if total is None else total + loss
            if out is None:
                out = stats
            else:
                for dst, src in zip(out, stats, strict=True):
                    if dst is not None:
                        dst[sl] = src
            if grad_hidden is not None:
                if gh is None or picked is not None:
                    grad_hidden[sl].zero_()  # nothing reached these rows' logits
                if gh is not None and picked is None:
                    grad_hidden[sl] = gh
                elif gh is not None:
                    grad_hidden[sl.start + picked] = gh.to(grad_hidden.dtype)
    if total is None:  # no rows
        total, out = torch.zeros((), dtype=sdt, device=hidden.device), call.p.empty_stats(n, hidden.device)
    check_rounded_logits(call.p.plan, hidden.dtype, out)
    return total, out


class _FusedFn(torch.autograd.Function):
    """Outputs the summed loss; the gradients are computed in the forward and only scaled by the
    incoming gradient in the backward (every token's statistics go to ``call.stats``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, lora_x, lora_b, call: _FusedCall):
        p = call.p
        # Vocabulary-parallel partials of d hidden / d x are summed in the statistics dtype, then cast once.
        partial = p.head.reduces_grad_hidden
        sdt = stat_dtype_for(hidden.dtype)
        # Every chunk writes its rows (zeros where nothing reached its logits).
        grad_hidden = torch.empty_like(hidden, dtype=sdt if partial else None) if ctx.needs_input_grad[0] else None
        full, local = _accumulators(p, weight, bias, lora_x, lora_b, ctx.needs_input_grad, call.weight_grad,
                                    hidden.shape[0])
        total, stats = _run_chunks(call, hidden, p.head.low_rank(lora_x, lora_b), local, grad_hidden)
        grad_x = full.lora_x
        if partial and grad_hidden is not None:
            grad_hidden = all_reduce(grad_hidden, "sum", p.head.group).to(hidden.dtype)
        if partial and grad_x is not None:
            grad_x = all_reduce(grad_x, "sum", p.head.group)
        ctx.save_for_backward(grad_hidden, full.weight, full.bias, grad_x, full.lora_b)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (hidden, weight, bias, lora_x, lora_b))
        call.stats = stats
        ctx.first_scale = None
        return total

    @staticmethod
    def backward(ctx, g_loss):
        grads = tuple(_scaled(g, g_loss, dt, ctx.first_scale)
                      for g, dt in zip(ctx.saved_tensors, ctx.dtypes, strict=True))
        if ctx.first_scale is None:
            ctx.first_scale = g_loss.detach().clone()
        return (*grads, None)


def _scaled(g: torch.Tensor | None, g_loss: torch.Tensor, dtype: torch.dtype | None,
            earlier: torch.Tensor | None) -> torch.Tensor | None:
    """``g_loss · g`` in ``dtype`` (fp32 arithmetic, rounded once), with no host synchronization.

    ``loss.backward()`` sends exactly 1, where scaling a ``[V, H]`` buffer would be a full extra
    pass. So a buffer already in ``dtype`` is scaled in place, by a kernel that reads the scalar
    on the device and does nothing when it is 1 (on the CPU the scalar is read directly); a buffer
    in another dtype is scaled within its cast and left as it is. A later backward through a
    retained graph (``earlier``: the first one's ``g_loss``) finds the in-place buffers scaled by
    ``earlier`` and returns new tensors, so what the first one returned is never changed.

    Raises:
        RuntimeError: a later backward after a first one whose incoming gradient was 0 (the
            buffers hold zeros; this check reads the scalar on the host).
    """
    if g is None:
        return None
    if g.dtype != dtype:
        return torch.mul(g, g_loss, out=torch.empty_like(g, dtype=dtype))
    if earlier is not None:
        if not bool(earlier != 0):
            raise RuntimeError("a second backward through a fused pass whose first backward's incoming gradient was 0: "
                               "its gradients were scaled to 0 in place; use PassOptions(mode='recompute')")
        return g * (g_loss / earlier)
    # In place through ``.data``, which autograd's version check on saved tensors does not see
    # (a later backward reads these buffers knowing they were scaled), as the kernel's writes.
    if g.device.type != "cuda":
        return g if float(g_loss) == 1.0 else g.data.mul_(g_loss)
    if not (triton_available() and g.is_contiguous()):
        return g.data.mul_(g_loss)
    from .triton_shared.scale import scale_unless_one_

    return scale_unless_one_(g, g_loss.to(torch.float32))


# ----------------------------------------------------------------------------- the entry point


def run_objective(hidden: torch.Tensor, head: Head, targets: torch.Tensor, objective: ChunkObjective,
                  spec: ObjectiveSpec, options: PassOptions) -> PassResult:
    """Run ``objective`` over the vocabulary statistics of ``hidden`` and sum its terms.

    Args:
        hidden: ``[n, H]`` rows that enter the pass (validated by the caller, e.g. with
            :func:`~logitless.ops.validate.check_head_inputs`).
        head: the :class:`Head` (global ``targets`` are mapped to its shard's rows here).
        targets: ``[n]`` int64 global token ids, all valid.
        objective: ``objective(rows, stats) -> (loss term, collected)``; ``rows`` is the slice of
            the ``n`` rows that ``stats`` (:class:`ChunkStats`) covers — a chunk in fused mode,
            all rows in recompute mode.
        spec: :class:`ObjectiveSpec` (statistics wanted, allowed cuts, mode constraints).
        options: :class:`PassOptions`.

    Returns:
        :class:`PassResult`: the loss carries the gradient to ``hidden`` and the head's weight,
        bias and adapter.

    Raises:
        ValueError: ``mode="fused"`` for an objective that needs all statistics first; a bad
            ``impl`` for the device; ``logits_precision="input"`` and logits beyond the input
            dtype's range (they would round to inf).
        PassOutOfMemoryError: (a ``torch.OutOfMemoryError``) the per-chunk workspace does not fit
            the device, or the pass ran out of memory; the message names a ``chunk_bytes`` to retry.
    """
    mode = resolve_mode(options.mode, spec.needs_all_stats)
    if mode == "recompute":
        stats = compute_stats(hidden, head, targets, spec.want, options, spec.zero_rows)
        if spec.before_loss is not None:
            spec.before_loss(stats.detached())
        loss, collected = objective(slice(0, hidden.shape[0]), stats)
        return PassResult(loss, stats.detached(), [collected])
    p, x = _Pass.make(hidden, head, targets, spec, options)
    return run_fused(p, objective, hidden, head.weight, head.bias, x, p.lora_b, spec.cuts)


def run_fused(p: PassKind, objective: ChunkObjective, hidden: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, lora_x: torch.Tensor | None = None, lora_b: torch.Tensor | None = None,
              cuts: Sequence[int] | None = None) -> PassResult:
    """Run ``objective`` chunk by chunk over the kind ``p``'s statistics in fused mode (chunks
    end only at ``cuts`` when given); the loss carries the gradient to ``hidden``, ``weight``,
    ``bias`` and the adapter factors. Without a gradient to take, only the forward runs.

    Raises:
        PassOutOfMemoryError: the workspace does not fit the device, or it ran out of memory.
        ValueError: ``logits_precision="input"`` and logits beyond the input dtype's range.
    """
    tensors = (hidden, weight, bias, lora_x, lora_b)
    grad = _records_graph(tensors)
    layout: WeightGradLayout = "fp32"
    if grad and weight.requires_grad:
        p, layout = _weight_grad_plan(p, hidden.shape[0], weight)
    check_workspace_fits(p.plan, hidden.device)
    call = _FusedCall(p, objective, p.plan.chunks(hidden.shape[0], cuts), weight_grad=layout)
    if grad and p.zero_rows is not None:
        call.backward_rows = _backward_rows(p.zero_rows, call.chunks)
    if grad:
        loss = _FusedFn.apply(*tensors, call)
        return PassResult(loss, call.stats, call.collected)
    loss, stats = _run_chunks(call, hidden, p.head.low_rank(lora_x, lora_b), None, None)
    return PassResult(loss, stats, call.collected)
