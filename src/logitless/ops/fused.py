"""The single-head softmax pass (:class:`SoftmaxPass`, both modes' per-chunk work through a
backend) and fused mode, the chunk loop that drives it (and the distillation kind).

Fused mode: for each chunk the forward computes the statistics, asks the objective for the
chunk's loss term, differentiates it w.r.t. the chunk's statistics (autograd on ``[chunk]``
tensors) and runs the gradient GEMMs right away, reusing the chunk's logits when they fit; the
backward only scales the saved gradients (3 GEMMs of work in all; :mod:`.engine`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..distributed import all_reduce, sum_partials
from . import plan as planning
from .contract import (
    Accumulators,
    Backend,
    ChunkRows,
    ChunkStats,
    Head,
    LocalHead,
    RowStats,
    SavedStats,
    Started,
    StatGrads,
    StatRequest,
    resolve_backend,
    triton_available,
)
from .lora import LowRank
from .plan import ChunkPlan, PassOptions, ZeroRows, advise_on_oom, check_workspace_fits, rows_of
from .validate import check_rounded_logits

if TYPE_CHECKING:
    from .engine import ChunkObjective, ObjectiveSpec, PassKind


class PassResult(NamedTuple):
    """``loss`` (the sum of the objective's terms, differentiable), every token's detached
    ``stats`` and each chunk's collected value, in order."""

    loss: torch.Tensor
    stats: ChunkStats
    collected: list[Any]


def no_autocast(device: torch.device):
    """The pass controls its own precisions (fp32 statistics); autocast must not recast them."""
    return torch.autocast(device_type=device.type, enabled=False)


@dataclass
class SoftmaxPass:
    """One call's resolved single-head softmax pass (a :class:`~.engine.PassKind`) through a
    backend: made once, used by every chunk and by the backward, in both modes."""

    DIFFERENTIABLE = ("logp", "lse", "entropy", "sum_z")

    backend: Backend
    head: LocalHead
    targets: torch.Tensor  # [n] local indices
    plan: ChunkPlan
    want: StatRequest
    lora_b: torch.Tensor | None = None  # [V, r] the adapter's vocabulary-side factor (GEMM dtype)
    zero_rows: ZeroRows | None = None
    # Whether the backward honours Accumulators.write_weight: the backend's, without an adapter.
    stores_weight_grad: bool = False
    # The first rows' statistics, launched before the checks' read; taken by the first forward
    # (a handle that copies of this pass share, so that it is taken once).
    started: Started | None = None

    @classmethod
    def make(cls, hidden: torch.Tensor, head: Head, targets: torch.Tensor, spec: ObjectiveSpec,
             options: PassOptions) -> tuple[SoftmaxPass, torch.Tensor | None]:
        """The pass and the adapter's hidden-side factor ``x`` (differentiable, or ``None``)."""
        local = head.local()
        backend = resolve_backend(options.impl, hidden, head.lora is not None, spec.want)
        plan = ChunkPlan.make(hidden.shape[0], local.weight.shape[0], options.budget, hidden.dtype, backend.PLAN,
                              options.fp32_logits)
        x = b = None
        if head.lora is not None:
            x, b = head.lora.factors(hidden, head.weight)
        # An adapter's d x rows are written in place per chunk; compacting them is not worth a path.
        skip = options.skip_zero_rows and head.lora is None
        local_targets = targets - local.vocab_start if local.vocab_start else targets  # (LocalHead.local_targets)
        return cls(backend, local, local_targets, plan, spec.want, b,
                   spec.zero_rows if skip else None, backend.CAPS.stores_weight_grad and b is None, spec.started), x

    def pick(self, rows: ChunkRows, idx: torch.Tensor) -> ChunkRows:
        """The rows ``idx`` (``[m]`` int64, ascending) of a chunk (no adapter: see :meth:`make`)."""
        return ChunkRows(rows.hidden[idx], rows.targets[idx], None)

    def pick_kept(self, kept: object | None, idx: torch.Tensor) -> object | None:
        """The backend's kept logits of the rows ``idx`` (moved in place to the tile's first rows)."""
        return None if kept is None else self.backend.kept_rows(kept, idx)

    def select(self, idx: torch.Tensor) -> SoftmaxPass:
        """This pass restricted to the rows ``idx`` of its tokens."""
        return dataclasses.replace(self, targets=self.targets[idx], zero_rows=None)

    @property
    def pairs_weight_grad(self) -> bool:
        return self.backend.CAPS.pairs_weight_grad and self.lora_b is None

    def rows(self, hidden: torch.Tensor, sl: slice, low: LowRank | None) -> ChunkRows:
        return ChunkRows(hidden[sl], self.targets[sl], None if low is None else low.rows(sl))

    def forward(self, rows: ChunkRows, plan: ChunkPlan, keep_logits: bool) -> tuple[RowStats, object | None]:
        """A chunk's partial statistics; the first call (the first chunk's) joins :attr:`started`."""
        started = None if self.started is None else self.started.take()
        if started is not None and (started.backend != self.backend.NAME or started.want != self.want
                                    or started.fp32_logits != plan.fp32_logits or self.lora_b is not None):
            started = None  # launched for another pass
        with no_autocast(rows.hidden.device):
            if started is None:
                return self.backend.chunk_forward(self.head, rows, plan, self.want, keep_logits)
            return self.backend.chunk_forward(self.head, rows, plan, self.want, keep_logits, started=started)

    def backward(self, rows: ChunkRows, plan: ChunkPlan, saved: SavedStats, grads: StatGrads, acc: Accumulators,
                 kept: object | None) -> torch.Tensor | None:
        with no_autocast(rows.hidden.device):
            return self.backend.chunk_backward(self.head, rows, plan, saved, grads, acc, kept)

    def fields_present(self) -> tuple[bool, ...]:
        return True, True, self.want.entropy, self.want.sum_z, True, self.want.sum_sq

    def chunk_stats(self, rows: ChunkRows, plan: ChunkPlan,
                    keep_logits: bool) -> tuple[ChunkStats, SavedStats, object | None]:
        """A chunk's statistics over the full vocabulary (reduced over the group), what its
        backward needs, and the backend's kept logits."""
        part, kept = self.forward(rows, plan, keep_logits)
        stats, saved = self.finish(part)
        return stats, saved, kept

    def finish(self, part: RowStats) -> tuple[ChunkStats, SavedStats]:
        """The full vocabulary's statistics from this rank's partials (reduced over the group
        when the vocabulary is split), and what a backward needs of them."""
        return (part.reduce(self.head.group) if self.head.parallel else part).finalize()

    def forward_all(self, hidden: torch.Tensor, low: LowRank | None) -> tuple[ChunkStats, SavedStats]:
        """Statistics of every row, chunk by chunk, reduced over the vocabulary group once
        (recompute mode's forward)."""
        n = hidden.shape[0]
        # Whole-pass buffers filled chunk by chunk: keeping every chunk's small result tensors alive
        # instead pins the heap between the chunks' large logits blocks on CPU (glibc), and resident
        # memory then grows by about one block per chunk, i.e. with N x V.
        chunks = self.plan.stats_chunks(n)
        with advise_on_oom(self.plan, hidden.device):
            if len(chunks) == 1:  # the common case: the chunk's own buffers, no copy
                out, _ = self.forward(self.rows(hidden, chunks[0], low), self.plan, keep_logits=False)
            else:
                out = RowStats.empty(n, self.plan.stat_dtype, hidden.device, self.want)
                for sl in chunks:
                    part, _ = self.forward(self.rows(hidden, sl, low), self.plan, keep_logits=False)
                    out.write(sl, part)
                    del part
        stats, saved = self.finish(out)
        check_rounded_logits(self.plan, hidden.dtype, stats)
        return stats, saved

    def empty_stats(self, n: int, device: torch.device) -> ChunkStats:
        sdt = self.plan.stat_dtype
        return ChunkStats(*(torch.empty(n, dtype=torch.bool if name == "is_top1" else sdt, device=device)
                            if present else None for name, present in zip(ChunkStats._fields, self.fields_present(),
                                                                           strict=True)))

    def grads_of(self, named: dict[str, torch.Tensor]) -> StatGrads:
        return StatGrads(**named)


@dataclass
class _FusedCall:
    """The non-tensor inputs of one fused pass."""

    p: PassKind
    objective: ChunkObjective
    chunks: list[slice]
    plans: list[ChunkPlan]  # each chunk's (planning.fused_chunks)
    weight_grad: planning.WeightGradLayout = "fp32"  # how d weight is held (planning.weight_grad_plan)
    zero_rows: ZeroRows | None = None  # rows the gradient GEMMs leave out (planning.backward_rows)
    grad_chunks: int | None = None  # chunks from this one on take no gradient (planning.fused_chunks)
    collected: list[Any] = field(default_factory=list)
    stats: NamedTuple | None = None  # every token's, set by the pass
    _backward_rows: list[torch.Tensor | None] | None = None

    def picked(self, i: int) -> torch.Tensor | None:
        """The rows chunk ``i``'s backward runs on (``None``: all). Made at the first chunk's
        backward, not before its forward: the sorts (and, over several chunks, the read of their
        counts) then queue behind the first statistics GEMM instead of delaying its launch."""
        if self.zero_rows is None:
            return None
        if self._backward_rows is None:
            self._backward_rows = planning.backward_rows(self.zero_rows, self.chunks)
        return self._backward_rows[i]


def _run_chunk(call: _FusedCall, hidden: torch.Tensor, i: int, low: LowRank | None, acc: Accumulators | None,
               ) -> tuple[torch.Tensor, NamedTuple, torch.Tensor | None, torch.Tensor | None]:
    """A chunk's statistics, its loss term and (``acc`` given) its gradients:
    ``(loss term, detached stats, d hidden rows | None, picked)``; with ``picked`` (the rows the
    backward ran on, :meth:`_FusedCall.picked`) the ``d hidden`` rows are those rows' only."""
    p, sl, plan = call.p, call.chunks[i], call.plans[i]
    rows = p.rows(hidden, sl, low)
    want_grad = acc is not None
    stats, saved, kept = p.chunk_stats(rows, plan, keep_logits=want_grad and plan.keep_logits)
    with torch.enable_grad():
        def leaf(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or name not in p.DIFFERENTIABLE else t.detach().requires_grad_(want_grad)

        leaves = type(stats)(*(leaf(name, t) for name, t in zip(stats._fields, stats, strict=True)))
        loss, collected = call.objective(sl, leaves)
        grads = None  # the statistics' gradients; None where none reaches them
        if want_grad and loss.requires_grad:
            names = [k for k in p.DIFFERENTIABLE if getattr(leaves, k) is not None]
            got = torch.autograd.grad(loss, [getattr(leaves, k) for k in names], allow_unused=True)
            if any(g is not None for g in got):
                grads = p.grads_of(dict(zip(names, got, strict=True)))
    call.collected.append(collected)
    grad_hidden = None
    picked = call.picked(i) if want_grad else None
    backward = grads is not None and (picked is None or picked.numel() > 0)
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
    return loss.detach(), stats, grad_hidden, picked


def _run_chunks(call: _FusedCall, hidden: torch.Tensor, low: LowRank | None,
                acc: Accumulators | None, grad_hidden: torch.Tensor | None) -> tuple[torch.Tensor, NamedTuple]:
    """All chunks in order: the total loss and every token's statistics; with ``acc`` the
    gradients go into it (``grad_hidden`` rows written per chunk)."""
    sdt = call.p.plan.stat_dtype
    n = hidden.shape[0]
    total = None
    # Filled in place: per-chunk small tensors kept alive fragment the CPU heap (see SoftmaxPass.forward_all).
    # One chunk keeps its own.
    out = call.p.empty_stats(n, hidden.device) if len(call.chunks) > 1 else None
    # ``acc`` is the first chunk's (planning.accumulators): it may store its d weight products
    # into the uninitialized buffer; the later chunks add to them.
    later_acc = None if acc is None else dataclasses.replace(acc, write_weight=False)
    # The last chunk that may take a gradient: no chunk after it adds to d weight.
    last = (len(call.chunks) if call.grad_chunks is None else call.grad_chunks) - 1
    with advise_on_oom(call.p.plan, hidden.device):
        for i, sl in enumerate(call.chunks):
            chunk_acc = acc if i == 0 else None if i > last else later_acc
            if chunk_acc is not None and i == last:
                chunk_acc = dataclasses.replace(chunk_acc, last_weight=True)
            loss, stats, gh, picked = _run_chunk(call, hidden, i, low, chunk_acc)
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
        partial = p.head.parallel and p.head.reduce_grad_hidden
        sdt = p.plan.stat_dtype
        # Every chunk writes its rows (zeros where nothing reached its logits).
        grad_hidden = torch.empty_like(hidden, dtype=sdt if partial else None) if ctx.needs_input_grad[0] else None
        full, local = planning.accumulators(p, weight, bias, lora_x, lora_b, ctx.needs_input_grad, call.weight_grad,
                                    hidden.shape[0])
        low = None if lora_x is None else p.head.low_rank(lora_x, lora_b)
        total, stats = _run_chunks(call, hidden, low, local, grad_hidden)
        grad_x = full.lora_x
        if partial and grad_hidden is not None:
            grad_hidden = sum_partials(grad_hidden, hidden.dtype, p.head.group)
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
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)  # (records_graph)
    run = planning.fused_chunks(p, hidden.shape[0], weight, cuts, grad)
    p = run.kind
    check_workspace_fits(p.plan, hidden.device)
    call = _FusedCall(p, objective, run.chunks, run.plans, weight_grad=run.layout,
                      zero_rows=p.zero_rows if grad and run.grad_chunks is None else None, grad_chunks=run.grad_chunks)
    if grad:
        loss = _FusedFn.apply(*tensors, call)
        return PassResult(loss, call.stats, call.collected)
    loss, stats = _run_chunks(call, hidden, None if lora_x is None else p.head.low_rank(lora_x, lora_b), None, None)
    return PassResult(loss, stats, call.collected)
