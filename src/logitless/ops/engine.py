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

The per-chunk work is a **pass kind** (:class:`PassKind`): :class:`~.fused.SoftmaxPass` is the
single-head softmax run through a backend, beside the fused chunk loop that drives it;
:mod:`.distill` adds a two-head (student + teacher) kind. The chunk loops (:mod:`.fused`,
:mod:`.recompute`), both modes' ``autograd.Function`` and the gradient layout
(:mod:`.plan`) serve every kind.

Under vocabulary parallelism (``Head.shard`` with a group) the partial statistics are reduced
with one MAX and one SUM all-reduce per pass (recompute) or per chunk (fused), and the
``d hidden`` partials are summed in the statistics dtype, then cast once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from .contract import Accumulators, ChunkRows, ChunkStats, Head, LocalHead, Started, StatRequest, resolve_backend
from .fused import PassResult, SoftmaxPass, no_autocast, run_fused
from .lora import LowRank
from .plan import ChunkPlan, Mode, PassOptions, ZeroRows, leading_rows, started_rows, weight_grad_layout
from .recompute import recompute_stats

# objective(token_slice, stats) -> (loss term, anything to collect)
ChunkObjective = Callable[[slice, ChunkStats], tuple[torch.Tensor, Any]]


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
        started: the first rows' statistics GEMM, launched before the caller's value checks were
            read (:func:`start_pass`), or ``None``.
    """

    want: StatRequest = field(default_factory=StatRequest)
    cuts: Sequence[int] | None = None
    needs_all_stats: bool = False
    before_loss: Callable[[ChunkStats], None] | None = None
    zero_rows: ZeroRows | None = None
    started: Started | None = None


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
    stores_weight_grad: bool  # whether the backward honours Accumulators.write_weight
    started: Started | None  # the first rows' statistics GEMM, launched before the pass (start_pass)

    @property
    def pairs_weight_grad(self) -> bool:
        """Whether the backward honours :attr:`Accumulators.weight_lo` (a bf16 result and int8 residual)."""
        ...

    def fields_present(self) -> tuple[bool, ...]: ...

    def rows(self, hidden: torch.Tensor, sl: slice, low: LowRank | None) -> Any: ...

    def chunk_stats(self, rows: Any, plan: ChunkPlan, keep_logits: bool) -> tuple[Any, Any, object | None]: ...

    def forward_all(self, hidden: torch.Tensor, low: LowRank | None) -> tuple[Any, Any]: ...

    def empty_stats(self, n: int, device: torch.device) -> Any: ...

    def grads_of(self, named: dict[str, torch.Tensor]) -> Any: ...

    def backward(self, rows: Any, plan: ChunkPlan, saved: Any, grads: Any, acc: Accumulators,
                 kept: object | None) -> torch.Tensor | None: ...


def compute_stats(hidden: torch.Tensor, head: Head, targets: torch.Tensor, want: StatRequest,
                  options: PassOptions, zero_rows: ZeroRows | None = None,
                  started: Started | None = None) -> ChunkStats:
    """Every row's statistics, differentiable w.r.t. ``hidden`` and the head's tensors (recompute
    mode; under ``torch.no_grad`` only the forward runs: one GEMM's worth of work).

    Args:
        hidden: ``[n, H]`` rows that enter the pass (validated by the caller).
        head: the :class:`Head`.
        targets: ``[n]`` int64 global token ids, all valid.
        want: statistics beyond ``logp``/``lse``/``is_top1``.
        options: :class:`PassOptions` (``mode`` is not read: this is recompute mode).
        zero_rows: rows whose gradient is known to be zero (:attr:`ObjectiveSpec.zero_rows`).
        started: :attr:`ObjectiveSpec.started`.

    Returns:
        :class:`ChunkStats` of the ``n`` rows (``entropy``/``sum_z`` ``None`` unless wanted).
    """
    p, x = SoftmaxPass.make(hidden, head, targets, ObjectiveSpec(want=want, zero_rows=zero_rows, started=started),
                            options)
    return recompute_stats(p, hidden, head.weight, head.bias, x, p.lora_b)


def start_pass(hidden: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None, head: Head,
               spec: ObjectiveSpec, options: PassOptions, fused: bool, after: Started | None = None) -> Started | None:
    """Launch the statistics GEMM of a pass's first rows before the caller's value checks are
    read, so the GPU computes while the host waits for that read and prepares the pass
    (:meth:`~logitless.ops.validate.ValueChecks.send`, then this, then ``wait``), or after a read
    that sized the pass, while the host prepares the rest. The pass's first chunk then launches
    only its other rows (:attr:`ObjectiveSpec.started`).

    A caller may start in two parts: one launch as soon as the pass's order is known, before it
    builds its checks (the GPU computes while the host does), then after the send one with
    ``after``, the rows that follow (the GPU computes while the host waits for the read, which
    waits for the first part, and prepares the pass). Only after a first part that started: given
    the same arguments, a second call whose first returned ``None`` would plan the same pass and
    return ``None`` too (host time before the first GEMM).

    A pass whose rows with a gradient come first (``spec.zero_rows`` with ``leading``) sizes its
    first chunk by their count: start it after the read that brings the count (in ``zero_rows``),
    on the pass's rows, and its whole first chunk starts (a fused pass with a gradient). Started
    before, its rows' logits would be copied into the first chunk's buffer.

    Only on a backend whose :attr:`~logitless.ops.contract.Capabilities.starts_early` is set: its
    GEMM cannot fault on unchecked values, and a failed check still raises its named error before
    any result is used (the started rows are dropped). Not for a head with an adapter or split
    over a vocabulary group, nor a pass too small to gain (:func:`~logitless.ops.plan.started_rows`).

    Args:
        hidden: the caller's hidden states ``[..., H]`` (its device and dtype choose the backend).
        targets: the caller's token ids, shaped like ``hidden`` without ``H``.
        positions: ``[n]`` int64, the flattened positions of the rows that may enter the pass, in
            the pass's order (the counted ones first: the count is not read yet); ``None``:
            ``hidden`` ``[n, H]`` and ``targets`` ``[n]`` are the pass's rows.
        head, spec, options: as the pass will get them (``spec.started`` is not read).
        fused: the pass runs in fused mode (the started rows' logits then go to the first
            chunk's logits buffer, made here, when the pass keeps them for the gradient).
        after: a first part's handle (taken here), or ``None``: these are the pass's first rows.

    Returns:
        a :class:`~logitless.ops.contract.Started` handle on the launch (with ``after``: on both
        parts' rows), or ``None`` where nothing was launched.
    """
    prior = None if after is None else after.take()
    if after is not None and prior is None:
        return None  # no first part: these would not be the pass's first rows
    want = spec.want
    backend = resolve_backend(options.impl, hidden, head.lora is not None, want)  # (an adapter: triton)
    if not backend.CAPS.starts_early:
        return None
    local = head.local()
    n, vocab = (hidden.shape[0] if positions is None else positions.shape[0]), local.weight.shape[0]
    rows = 0 if local.parallel else started_rows(n, hidden.shape[-1], vocab, backend.START_ALIGN)
    if prior is not None:  # as many rows again, within the first half of the rows and the buffer
        room = n // 2 if prior.z is None else min(n // 2, prior.z.shape[0])
        rows = min(rows, (room - prior.rows) // backend.START_ALIGN * backend.START_ALIGN)
        if rows <= 0 or prior.backend != backend.NAME or prior.want != want:
            return Started(prior)
    if not rows:
        return None
    # A fused pass with a gradient keeps its first chunk's logits: the started rows' go straight
    # into that chunk's buffer, sized as run_fused plans the chunk (planning.fused_chunks).
    store_rows = 0
    if prior is None and fused and torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad):
        zero = spec.zero_rows if options.skip_zero_rows else None  # (an adapter started nothing: SoftmaxPass.make)
        grad_rows = leading_rows(zero, n, 0, spec.cuts) or n  # the gradient chunks' rows
        plan = ChunkPlan.make(n, vocab, options.budget, hidden.dtype, backend.PLAN, options.fp32_logits)
        if head.weight.requires_grad:
            plan = weight_grad_layout(plan, grad_rows, vocab, head.weight, backend.CAPS.stores_weight_grad,
                                      lambda: backend.CAPS.pairs_weight_grad)[0]
        store_rows = min(grad_rows, plan.token_chunk) if plan.keep_logits else 0
        if zero is not None and zero.leading and store_rows:  # every row counts (the read came first):
            cuts = None if spec.cuts is None else [c for c in spec.cuts if c <= grad_rows]
            rows = store_rows = plan.chunks(grad_rows, cuts)[0].stop  # the whole first chunk, in one GEMM
    skip = 0 if prior is None else prior.rows
    first = slice(skip, skip + rows) if positions is None else positions[skip:skip + rows]
    h = hidden.detach().reshape(-1, hidden.shape[-1])[first]
    t = targets.reshape(-1)[first].long()
    t = t - local.vocab_start if local.vocab_start else t
    with torch.no_grad(), no_autocast(h.device):
        return Started(backend.start_rows(local, ChunkRows(h, t), want, options.fp32_logits, store_rows, prior))


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
        stats = compute_stats(hidden, head, targets, spec.want, options, spec.zero_rows, spec.started)
        if spec.before_loss is not None:
            spec.before_loss(stats.detached())
        loss, collected = objective(slice(0, hidden.shape[0]), stats)
        return PassResult(loss, stats.detached(), [collected])
    p, x = SoftmaxPass.make(hidden, head, targets, spec, options)
    return run_fused(p, objective, hidden, head.weight, head.bias, x, p.lora_b, spec.cuts)
