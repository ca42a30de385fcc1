"""Planning a vocabulary pass, in the order a pass is planned: the user's settings of the pass
(:class:`PassOptions`), the block sizes they give (:class:`ChunkPlan`: the one place that turns a
byte budget into token-chunk and vocabulary-block sizes), whether one chunk's workspace fits the
device (and which ``chunk_bytes`` would, when it does not: :class:`PassOutOfMemoryError`), and how
the backward lays out its work: the rows it runs on (those whose gradient is not known to be
zero) and how it holds ``d weight`` (one buffer in the head's dtype, a bf16 + int8 pair, or an fp32
accumulator). Both modes of :mod:`.engine` use it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import torch

from .contract import Accumulators, device_properties
from .settings import LogitsPrecision, settings

if TYPE_CHECKING:
    from .engine import PassKind

# ---------------------------------------------------------------------------------------- the settings of a pass

Mode = Literal["auto", "fused", "recompute"]
Impl = Literal["auto", "torch", "triton", "flash", "gemm", "cute"]

_MODES = ("auto", "fused", "recompute")
_IMPLS = ("auto", "torch", "triton", "flash", "gemm", "cute")


@dataclass(frozen=True)
class PassOptions:
    """How a pass runs; none of it changes what is computed beyond rounding.

    Attributes:
        mode: ``"fused"`` (the objective's gradient is taken chunk by chunk inside the forward:
            3 GEMMs of work), ``"recompute"`` (O(N) saved state, logits recomputed in the
            backward: 4 GEMMs), or ``"auto"`` (fused unless the objective needs every token's
            statistics before its loss).
        impl: backend: ``"auto"`` (on CUDA with Triton: ``"cute"`` on Hopper where the CuTe DSL
            is installed, else ``"gemm"`` for bf16/fp16 on Hopper or later, ``"triton"`` on older
            GPUs; torch elsewhere; see ``resolve_backend``), ``"torch"``,
            ``"triton"`` (cuBLAS GEMMs + Triton row kernels), ``"flash"`` (Triton tile GEMMs
            that never write logits), ``"gemm"`` (statistics in a Triton GEMM's epilogue,
            logits kept in fp16 centred per tile, cuBLAS gradient GEMMs) or ``"cute"`` (that
            design with the statistics GEMM written in CUTLASS's CuTe DSL: Hopper only,
            ``pip install 'logitless[cute]'``).
        chunk_bytes: workspace budget of the pass in bytes; ``None``: ``LOGITLESS_CHUNK_BYTES``,
            else 1 GiB. Beyond it a training pass holds an fp32 ``d weight`` accumulator
            (``V x H x 4`` bytes), except where all its tokens fit one chunk within the budget
            plus those bytes: then it runs as one chunk and needs no accumulator (bf16/fp16 heads
            on the Triton, gemm and CuTe backends). A larger budget trades memory for time where
            the default splits a training pass: ``N x V x 2`` bytes runs the pass as one chunk
            of 16-bit logits (Gemma-2's 256k vocabulary at 8k tokens: dense GRPO 1.06x the
            cuBLAS floor instead of 1.11-1.14x, for 4.1 GiB of workspace instead of 2.6;
            ``BENCHMARKS.md``).
        logits_precision: ``"fp32"`` keeps the head's matmul output in fp32 (statistics within
            ~1e-4 nats of float64 for bf16 inputs); ``"input"`` rounds it to the input dtype
            first, as the plain bf16/fp16 path does (half the workspace and traffic; statistics
            still accumulate in fp32). ``None``: ``LOGITLESS_LOGITS_PRECISION``, else ``"fp32"``.
        budget: ``chunk_bytes`` with its default applied (derived, set at construction).
        fp32_logits: whether the matmul output stays fp32 (``logits_precision`` with its
            default applied; derived, set at construction).
        skip_zero_rows: where the objective knows rows whose gradient is exactly zero (a policy
            loss without KL or entropy bonus: the tokens of zero advantage), run the gradient
            GEMMs on the other rows only (exact: those rows add nothing; their statistics are
            still computed). ``False`` runs them on every row.

    Raises:
        TypeError: ``chunk_bytes`` not a number (a string, a bool, ...); ``skip_zero_rows`` not a bool.
        ValueError: a value outside its choices, or a ``chunk_bytes`` that is not a positive whole
            number (``0``, ``-5``, ``1.5``, ``inf``, ``nan``); a float such as ``1e9`` is stored as an int.
    """

    mode: Mode = "auto"
    impl: Impl = "auto"
    chunk_bytes: int | None = None
    logits_precision: LogitsPrecision | None = None
    skip_zero_rows: bool = True
    # Derived once here, not per read: the pass reads them as plain attributes.
    budget: int = field(init=False, repr=False, compare=False)
    fp32_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {self.impl!r}")
        if self.chunk_bytes is not None:
            object.__setattr__(self, "chunk_bytes", _byte_count(self.chunk_bytes))
        if not isinstance(self.skip_zero_rows, bool):
            raise TypeError(f"skip_zero_rows must be True or False, got {self.skip_zero_rows!r}")
        if self.logits_precision not in (None, "fp32", "input"):
            raise ValueError(f"logits_precision must be 'fp32', 'input' or None, got {self.logits_precision!r}")
        env = settings()
        object.__setattr__(self, "budget", env.chunk_bytes if self.chunk_bytes is None else self.chunk_bytes)
        object.__setattr__(self, "fp32_logits", (self.logits_precision or env.logits_precision) == "fp32")


def _byte_count(value: object) -> int:
    """``chunk_bytes`` as a positive int (ints, NumPy integers and integral floats such as ``1e9``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"chunk_bytes must be a positive whole number of bytes or None, got {value!r} ({type(value).__name__})"
        )
    if not (math.isfinite(value) and value > 0 and value == int(value)):
        raise ValueError(f"chunk_bytes must be a positive whole number of bytes or None, got {value!r}")
    return int(value)


def as_options(options: PassOptions | None) -> PassOptions:
    """``options`` or the defaults.

    Raises:
        TypeError: not a :class:`PassOptions` (e.g. a dict: build ``PassOptions(**d)``).
    """
    if options is None:
        return PassOptions()
    if not isinstance(options, PassOptions):
        raise TypeError(f"options must be a logitless.PassOptions, got {type(options).__name__}")
    return options


# ----------------------------------------------------------------------------------------------- the block sizes


# Below this many tokens a chunk's matmuls stop using the matrix units well, so a row that
# does not fit is cut along the vocabulary instead of shrinking the token chunk further. On GPUs
# the token chunk is the inner dimension of the fp32 ``d weight += dy^T @ h`` accumulation, whose
# [V, H] read-modify-write dominates below ~1k tokens, hence the larger floor for Triton.
_MIN_TOKENS = {"torch": 32, "triton": 1024, "gemm": 1024}

PlanKind = Literal["torch", "triton", "gemm"]
_ALIGN = 128  # token chunks are multiples of this (when a chunk is not the whole input)
# Bytes per logit element of a pass that keeps no logits, where a kind's forward writes less
# than a logits block: the gemm kind's epilogue writes up to four fp32 partials per token and
# 256-entry vocabulary tile, and combining them (RowStats.combine) takes up to three more of
# that shape: 7 x 4 / 256 = 0.11 bytes, rounded up. Fewer, longer chunks then replace several
# per-chunk launches (Llama-3 8k: one GEMM instead of two).
_STATS_ONLY_BYTES: dict[str, float] = {"gemm": 0.125}
_SMALL_WORKSPACE = 2**20


def _even_chunk(n: int, rows: int) -> int:
    """Tokens per chunk for ``n`` tokens and at most ``rows`` a chunk: all ``n``, or a multiple
    of ``_ALIGN`` that cuts them into chunks of nearly equal length."""
    chunk = min(n, rows)
    if chunk < n and chunk >= _ALIGN:
        # A token count that is not a multiple of 8 is a misaligned GEMM dimension for bf16 (the
        # inner one of d weight = dyᵀ h): cuBLAS then falls back to slow kernels (measured on
        # H100: Qwen2.5 8k fused 65 ms at 1766-token chunks vs 46 ms aligned). Round down to a
        # multiple of _ALIGN, then even the chunks out.
        chunk -= chunk % _ALIGN
        count = math.ceil(n / chunk)
        chunk = min(chunk, math.ceil(math.ceil(n / count) / _ALIGN) * _ALIGN)
    return chunk


# A statistics GEMM launched before the value checks' read (engine.start_pass) keeps the GPU
# busy while the host waits for that read and prepares the pass after it, 1-2 ms of host work on
# the GPU hosts measured: rows whose GEMM is ~1.3 TFLOP, about 2 ms at the dense pass's pace.
_START_FLOP = 1.3e12


def started_rows(n_tokens: int, hidden_size: int, vocab: int, align: int) -> int:
    """How many of a pass's first rows :func:`~logitless.ops.engine.start_pass` launches: about
    :data:`_START_FLOP` of GEMM, a multiple of ``align`` (the backend's ``START_ALIGN``: rows its
    GEMM runs at full pace in), at most half the rows (fewer might count: the rest of those rows
    would be computed for nothing); 0 when that leaves none."""
    rows = max(align, int(_START_FLOP // (2 * max(1, hidden_size) * max(1, vocab))))
    rows = -(-rows // align) * align
    return rows if rows <= n_tokens // 2 else 0


def stat_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The statistics dtype of a pass over ``dtype`` inputs: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def workspace_per_element(
    stat_dtype: torch.dtype, in_dtype: torch.dtype, kind: PlanKind = "torch", fp32_logits: bool = True
) -> int:
    """Workspace bytes per logit element of one block.

    torch: the logits, the probabilities and ``dz`` in the statistics dtype, plus ``dz`` cast to
    the input dtype for the matmuls. triton: one tile of raw matmul output (fp32, or the input
    dtype without ``fp32_logits``), overwritten in place by ``dy``. gemm: one fp16 tile of
    centred logits, overwritten in place by ``dy`` (the statistics need no fp32 logits in memory).
    """
    if kind == "gemm" and stat_dtype != torch.float64:
        return 2
    if kind == "triton" and stat_dtype != torch.float64:
        return torch.finfo(stat_dtype if fp32_logits else in_dtype).bits // 8
    return 3 * torch.finfo(stat_dtype).bits // 8 + torch.finfo(in_dtype).bits // 8


@dataclass(frozen=True)
class ChunkPlan:
    """Block sizes of one pass.

    Attributes:
        token_chunk: tokens per chunk (rows of a logits block).
        vocab_block: vocabulary entries per block; equal to ``V`` when a whole row fits.
        keep_logits: whether a chunk's full logits rows fit in the budget, so the fused mode
            can keep them between the statistics and the gradient instead of recomputing.
        fp32_logits: the head's matmul output is kept in fp32 (``True``), or rounded to the
            input dtype first as the plain bf16/fp16 path rounds it (``False``; statistics are
            accumulated in fp32 either way).
        stats_chunk: tokens per chunk of a pass that keeps no logits (a rollout, recompute
            mode's forward): at least ``token_chunk``, more where the kind's statistics-only
            forward holds less than a logits block per element (``_STATS_ONLY_BYTES``).
        stat_dtype: the dtype statistics and gradients accumulate in (:func:`stat_dtype_for`
            of the inputs' dtype).
        vocab: the vocabulary rows the plan was made for (0: not given).
        blocks: derived: :meth:`vocab_blocks` of ``vocab``, made once with the plan, since every
            chunk of a pass walks the same blocks.
    """

    token_chunk: int
    vocab_block: int
    keep_logits: bool
    fp32_logits: bool = True
    budget: int = 0
    bytes_per_logit: int = 0
    stats_chunk: int = 0  # tokens per chunk of a statistics-only pass (0: token_chunk)
    stat_dtype: torch.dtype = torch.float32
    vocab: int = 0
    blocks: tuple[slice, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.vocab_blocks(self.vocab)))

    @classmethod
    def make(
        cls,
        n_tokens: int,
        vocab: int,
        budget: int,
        in_dtype: torch.dtype,
        kind: PlanKind = "torch",
        fp32_logits: bool = True,
        arrays: int = 1,
    ) -> ChunkPlan:
        """Plan for ``n_tokens`` x ``vocab`` logits within ``budget`` bytes of workspace, as a
        ``kind`` backend lays a block out (see :func:`workspace_per_element`), with ``arrays``
        times that per element (a two-head pass holds more temporaries per block).

        Raises:
            ValueError: ``budget <= 0``.
        """
        if budget <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {budget!r}")
        vocab = max(1, vocab)
        stat_dtype = stat_dtype_for(in_dtype)
        per = workspace_per_element(stat_dtype, in_dtype, kind, fp32_logits) * arrays
        n = max(1, n_tokens)
        # No workspace larger than the problem: the materialized path holds at least the logits
        # (a word per logit and head in the statistics dtype), so a pass plans no more than that,
        # however large the budget; below _SMALL_WORKSPACE one chunk costs too little to cut.
        logits = n * vocab * torch.finfo(stat_dtype_for(in_dtype)).bits // 8 * arrays
        sizing = min(budget, max(logits, _SMALL_WORKSPACE))
        token_chunk = _even_chunk(n, max(sizing // (vocab * per), _MIN_TOKENS[kind]))
        vocab_block = min(vocab, max(1, sizing // (token_chunk * per)))
        stats_chunk = token_chunk
        if kind in _STATS_ONLY_BYTES and stat_dtype != torch.float64:
            stats_chunk = _even_chunk(n, max(token_chunk, int(sizing / (vocab * _STATS_ONLY_BYTES[kind] * arrays))))
        return cls(
            token_chunk=token_chunk,
            vocab_block=vocab_block,
            keep_logits=vocab_block == vocab,
            fp32_logits=fp32_logits,
            budget=budget,
            bytes_per_logit=per,
            stats_chunk=stats_chunk,
            stat_dtype=stat_dtype,
            vocab=vocab,
        )

    def whole(self, n_tokens: int, vocab: int, extra: int) -> ChunkPlan | None:
        """This plan as one chunk of all ``n_tokens`` rows kept whole, if their logits fit the
        budget plus ``extra`` bytes (memory the caller saves by running one chunk), else ``None``."""
        if n_tokens * vocab * self.bytes_per_logit > self.budget + extra:
            return None
        return dataclasses.replace(
            self, token_chunk=max(1, n_tokens), vocab_block=max(1, vocab), keep_logits=True, vocab=vocab
        )

    def widened(self, n_tokens: int, vocab: int, extra: int, row_bytes: int = 0) -> ChunkPlan:
        """This plan for ``n_tokens`` rows with ``extra`` bytes more budget (memory the caller
        saves elsewhere), so with larger chunks. ``row_bytes``: what a chunk holds per token
        beside its logits (outside the budget, e.g. fp32 ``d hidden`` rows); the larger chunks'
        growth of it comes out of ``extra``, so the pass's memory stays what it was."""
        budget = self.budget + extra
        per_token = max(1, vocab) * self.bytes_per_logit
        rows = (budget + self.token_chunk * row_bytes) // (per_token + row_bytes)
        token_chunk = _even_chunk(max(1, n_tokens), max(rows, self.token_chunk))
        vocab_block = min(max(1, vocab), max(1, budget // (token_chunk * self.bytes_per_logit)))
        return dataclasses.replace(
            self,
            budget=budget,
            token_chunk=token_chunk,
            vocab_block=vocab_block,
            keep_logits=vocab_block >= vocab,
            vocab=vocab,
        )

    def vocab_blocks(self, vocab: int, whole: bool = False) -> list[slice]:
        """The vocabulary rows ``[0, vocab)`` in blocks of ``vocab_block`` (one block with
        ``whole``: a pass over logits kept whole)."""
        step = vocab if whole else max(1, self.vocab_block)
        return [slice(s, min(s + step, vocab)) for s in range(0, vocab, step)]

    def fit(self, rows: int, vocab: int) -> ChunkPlan:
        """This plan for a chunk of ``rows`` tokens: itself when ``rows <= token_chunk``, else
        with the vocabulary block shrunk to keep the budget (a sequence longer than a chunk,
        which :meth:`chunks` never cuts)."""
        if rows <= self.token_chunk:
            return self
        block = min(max(1, vocab), max(1, self.budget // (rows * self.bytes_per_logit)))
        return dataclasses.replace(self, token_chunk=rows, vocab_block=block, keep_logits=block >= vocab, vocab=vocab)

    def fit_chunks(self, n_tokens: int, cuts: Sequence[int] | None, vocab: int) -> tuple[list[slice], list[ChunkPlan]]:
        """:meth:`chunks` of ``[0, n_tokens)`` and each one's plan (:meth:`fit`), made once for a pass."""
        chunks = self.chunks(n_tokens, cuts)
        return chunks, [self.fit(sl.stop - sl.start, vocab) for sl in chunks]

    def stats_chunks(self, n_tokens: int, cuts: Sequence[int] | None = None) -> list[slice]:
        """``[0, n_tokens)`` in chunks of a statistics-only pass (``stats_chunk`` tokens; ending
        only at ``cuts`` when given, as :meth:`chunks`)."""
        return dataclasses.replace(self, token_chunk=max(self.token_chunk, self.stats_chunk)).chunks(n_tokens, cuts)

    def chunks(self, n_tokens: int, cuts: Sequence[int] | None = None) -> list[slice]:
        """Cut ``[0, n_tokens)`` into chunks of at most ``token_chunk`` tokens, ending only at
        positions in ``cuts`` (sorted, each in ``(0, n_tokens]``) when given. A stretch between
        two allowed cuts longer than ``token_chunk`` becomes one chunk of its own."""
        size = self.token_chunk
        if cuts is None:
            return [slice(s, min(s + size, n_tokens)) for s in range(0, n_tokens, size)]
        chunks, start, last = [], 0, 0
        for c in cuts:
            if c <= start:
                continue
            if c - start > size and last > start:
                chunks.append(slice(start, last))
                start = last
            last = c
            if c - start >= size:
                chunks.append(slice(start, c))
                start = c
        if n_tokens > start:
            chunks.append(slice(start, n_tokens))
        return chunks


# ----------------------------------------------------------------------------------- the workspace on the device

# A pass's working memory is its per-chunk logits workspace (set by ``PassOptions.chunk_bytes``) on
# top of what the caller holds. The user can act only on ``chunk_bytes``, so both the up-front
# refusal (check_workspace_fits) and an out-of-memory inside the chunk loop (advise_on_oom) name the
# budget, the workspace of one chunk and a smaller budget to retry with.

_MIB = 2**20
_MIN_SUGGESTION = 64 * 1024  # below this the blocks are too thin to be worth suggesting


class PassOutOfMemoryError(torch.OutOfMemoryError):
    """A vocabulary pass ran out of device memory (or would: refused before allocating).

    A ``torch.OutOfMemoryError``, so existing handlers still catch it. Attributes:
    ``budget`` (the ``chunk_bytes`` in force), ``workspace`` (bytes of one chunk's logits
    workspace), ``free`` (bytes the device had available, ``None`` if unknown) and
    ``suggested_chunk_bytes`` (a budget to retry with).
    """

    def __init__(self, message: str, budget: int, workspace: int, free: int | None, suggested: int) -> None:
        super().__init__(message)
        self.budget, self.workspace, self.free, self.suggested_chunk_bytes = budget, workspace, free, suggested


def workspace_bytes(plan: ChunkPlan) -> int:
    """Bytes of one chunk's logits workspace under ``plan``."""
    return plan.token_chunk * plan.vocab_block * plan.bytes_per_logit


def free_device_bytes(device: torch.device, driver_free: int | None = None) -> int | None:
    """Bytes a new allocation on ``device`` can use: the driver's free memory (``driver_free`` when
    the caller just read it) plus what PyTorch's caching allocator holds unused; ``None`` off CUDA
    or while a CUDA graph is captured (querying the driver there is not allowed)."""
    free = _driver_free_bytes(device) if driver_free is None else driver_free
    if free is None:
        return None
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _driver_free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    return torch.cuda.mem_get_info(device)[0]


def _suggest(workspace: int, free: int | None) -> int:
    # Half of what is free leaves room for the GEMMs' own temporaries and the allocator's
    # fragmentation; without a free figure, halve the workspace that failed.
    target = workspace // 2 if free is None else min(workspace // 2, free // 2)
    if target >= 4 * _MIB:
        target -= target % _MIB
    return max(_MIN_SUGGESTION, target)


def _error(plan: ChunkPlan, device: torch.device, what: str) -> PassOutOfMemoryError:
    workspace = workspace_bytes(plan)
    free = free_device_bytes(device)
    suggested = _suggest(workspace, free)
    free_txt = "unknown" if free is None else f"{free:,} bytes ({free / _MIB:.1f} MiB)"
    message = (
        f"{what} on {device}: the pass's workspace budget is chunk_bytes={plan.budget:,}, one chunk's logits "
        f"workspace is {workspace:,} bytes ({plan.token_chunk} tokens x {plan.vocab_block} vocabulary entries "
        f"x {plan.bytes_per_logit} bytes); device memory available: {free_txt}. Retry with "
        f"PassOptions(chunk_bytes={suggested}) (or LOGITLESS_CHUNK_BYTES={suggested}). If a small budget "
        f"still fails, the memory is held outside the workspace (activations, the [V, H] gradient "
        f"accumulators): free it or shard the head."
    )
    return PassOutOfMemoryError(message, plan.budget, workspace, free, suggested)


_UNASKED_SHARE = 16  # a workspace up to 1/16 of the device's memory is not checked in advance


def check_workspace_fits(plan: ChunkPlan, device: torch.device) -> None:
    """Refuse a pass whose per-chunk workspace exceeds the device's available memory.

    Raises:
        PassOutOfMemoryError: the workspace of one chunk is larger than the memory available on
            ``device`` (CUDA only), with a ``chunk_bytes`` that would fit.
    """
    workspace = workspace_bytes(plan)
    # A workspace within a small share of the device is not asked about: the driver's answer costs
    # ~0.07 ms of host time while the GPU waits, and if it does not fit, the allocation's OOM is
    # raised as the same PassOutOfMemoryError with the same advice (advise_on_oom). Otherwise the
    # driver's free memory alone answers most calls; the caching allocator's unused bytes (a walk
    # over its statistics, ~0.2 ms) only when needed.
    if device.type == "cuda" and workspace <= device_properties(device).total_memory // _UNASKED_SHARE:
        return
    driver_free = _driver_free_bytes(device)
    if driver_free is not None and workspace <= driver_free:
        return
    free = free_device_bytes(device, driver_free)
    if free is not None and workspace > free:
        raise _error(plan, device, "the vocabulary pass would not fit (refused before allocating)")


@contextmanager
def advise_on_oom(plan: ChunkPlan, device: torch.device) -> Iterator[None]:
    """Re-raise a ``torch.OutOfMemoryError`` from the body as :class:`PassOutOfMemoryError`
    naming the budget, the workspace per chunk and a smaller ``chunk_bytes``."""
    try:
        yield
    except PassOutOfMemoryError:
        raise
    except torch.OutOfMemoryError as exc:
        raise _error(plan, device, "out of memory inside the vocabulary pass") from exc


# ----------------------------------------------------------------------------------------- the backward's layout


class ZeroRows(NamedTuple):
    """The rows of a pass whose gradient is known before it runs to be exactly zero.

    Attributes:
        mask: ``[n]`` bool.
        others: how many rows are not in ``mask``, when the caller has read it (e.g. with its
            value checks); ``None``: the pass reads it (one host synchronization).
        before: ``[n]`` NumPy array, how many of rows ``0..i`` are not in ``mask``, when the
            caller has read it: a pass of several chunks then counts each chunk's rows on the host
            (``None``: it reads those counts, one host synchronization behind the first chunk's
            statistics GEMM).
        leading: the rows not in ``mask`` are the first ``others`` rows (the caller ordered its
            rows so): a fused pass then runs its gradient chunks over those rows only and the
            statistics of the others alone (:func:`leading_rows`).
    """

    mask: torch.Tensor
    others: int | None = None
    before: np.ndarray | None = None
    leading: bool = False


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
    """How a pass over ``n`` rows holds ``d weight``, and the pass planned for it
    (:func:`weight_grad_layout` of the kind's plan)."""
    plan, layout = weight_grad_layout(p.plan, n, p.head.weight.shape[0], weight, p.stores_weight_grad,
                                      lambda: p.pairs_weight_grad)
    return (p if plan is p.plan else dataclasses.replace(p, plan=plan)), layout


class FusedChunks(NamedTuple):
    """How a fused pass runs (:func:`fused_chunks`)."""

    kind: PassKind  # the pass, planned for its d weight layout
    layout: WeightGradLayout
    chunks: list[slice]
    plans: list[ChunkPlan]  # each chunk's
    grad_chunks: int | None  # chunks from this one on take no gradient (None: every chunk may)


def fused_chunks(p: PassKind, n: int, weight: torch.Tensor, cuts: Sequence[int] | None, grad: bool) -> FusedChunks:
    """The chunks of a fused pass of the kind ``p`` over ``n`` rows (ending only at ``cuts`` when
    given), each one's plan, and how its ``d weight`` is held when it takes gradients (``grad``;
    :func:`weight_grad_plan`). Where its rows with a gradient come first (:func:`leading_rows`),
    the gradient chunks cover those rows and the rest follow as statistics-only chunks."""
    stats_plan, layout = p.plan, "fp32"
    end = leading_rows(p.zero_rows, n, 0 if p.started is None else p.started.rows, cuts) if grad else None
    rows = n if end is None else end
    if grad and weight.requires_grad:
        p, layout = weight_grad_plan(p, rows, weight)
    chunks, plans = p.plan.fit_chunks(rows, None if cuts is None else [c for c in cuts if c <= rows],
                                      p.head.weight.shape[0])
    if end is None:
        return FusedChunks(p, layout, chunks, plans, None)
    rest = stats_plan.stats_chunks(n - end, None if cuts is None else [c - end for c in cuts if c > end])
    return FusedChunks(p, layout, chunks + [slice(end + sl.start, end + sl.stop) for sl in rest],
                       plans + [stats_plan] * len(rest), len(chunks))


def weight_grad_layout(plan: ChunkPlan, n: int, rows_w: int, weight: torch.Tensor, stores: bool,
                       pairs: Callable[[], bool]) -> tuple[ChunkPlan, WeightGradLayout]:
    """How a pass over ``n`` rows of a head with ``rows_w`` local rows holds ``d weight``, and
    its plan for it (``stores``: the kind's ``stores_weight_grad``; ``pairs()``: its
    ``pairs_weight_grad``, asked only of a pass whose rows need several chunks).

    * ``"single"``: all rows in one chunk, when their logits fit the budget plus the fp32
      accumulator this saves; each vocabulary block's ``d weight`` rows are stored once in the
      head's dtype (no zero-fill, read-modify-write or cast; the products are rounded once
      either way).
    * ``"pair"``: several chunks of fewer than ``_PAIR_BELOW_TOKENS`` tokens adding into a pair
      (the bf16 gradient and an int8 residual; bf16 heads on a kind that sets
      ``pairs_weight_grad``: :mod:`logitless.ops.triton_shared.weight_grad`); the residual is
      ``3 V H`` bytes smaller than an fp32 accumulator and those bytes go to larger chunks (their
      logits and fp32 ``d hidden`` rows), so the pass holds what it would with that accumulator.
    * ``"fp32"``: several chunks adding into an fp32 accumulator (and a head without a
      ``d weight`` buffer of its own kind).
    """
    if n == 0 or not stores or weight.dtype not in (torch.float16, torch.bfloat16):
        return plan, "fp32"
    if plan.token_chunk >= n:
        return plan, "single"
    hidden_size = weight.shape[1]
    whole = plan.whole(n, rows_w, rows_w * hidden_size * 4)
    if whole is not None:
        return whole, "single"
    if weight.dtype == torch.bfloat16 and plan.token_chunk < _PAIR_BELOW_TOKENS and pairs():
        # A chunk's fp32 d hidden rows grow with it: 4 H bytes a token beside its logits.
        return plan.widened(n, rows_w, rows_w * hidden_size * 3, row_bytes=hidden_size * 4), "pair"
    return plan, "fp32"


def weight_grad_buffers(
    p: PassKind, weight: torch.Tensor, layout: WeightGradLayout, n: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``d weight``'s buffer for a pass over ``n`` rows, and the residual half of a pair
    (``[V_local, H]`` int8, or ``None``). A backend that stores products
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
        buf[p.head.weight.shape[0] :].zero_()
    lo = None
    if layout == "pair":
        lo = torch.empty((p.head.weight.shape[0], weight.shape[1]), dtype=torch.int8, device=weight.device)
    return buf, lo


def accumulators(
    p: PassKind,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_x: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    needs: tuple[bool, ...],
    layout: WeightGradLayout,
    n: int,
) -> tuple[Accumulators, Accumulators]:
    """The gradient accumulators of a pass over ``n`` rows, for the inputs whose ``needs``
    (``hidden, weight, bias, lora_x, lora_b``, as ``ctx.needs_input_grad``) are set: the
    head-sized ones (``d weight`` laid out as ``layout``, :func:`weight_grad_buffers`) and their
    views of the head's local rows, which the chunks update: the first chunk's (as
    :func:`first_stores` makes them: a kind that stores ``d weight`` stores its products)."""
    need_h, need_w, need_b, need_x, need_lb = needs[:5]
    sdt = p.plan.stat_dtype
    rows_w = p.head.weight.shape[0]
    grad_w, grad_w_lo = weight_grad_buffers(p, weight, layout, n) if need_w else (None, None)
    full = Accumulators(
        weight=grad_w,
        bias=_zeros(need_b, bias, sdt),
        lora_x=_zeros(need_x, lora_x, sdt),
        lora_b=_zeros(need_lb, lora_b, sdt),
        hidden=need_h,
    )
    local = Accumulators(
        weight=None if full.weight is None else full.weight[:rows_w],
        bias=None if full.bias is None else full.bias[:rows_w],
        lora_x=full.lora_x,
        lora_b=None if full.lora_b is None else full.lora_b[:rows_w],
        hidden=need_h,
        weight_lo=grad_w_lo,
        write_weight=full.weight is not None and p.stores_weight_grad,
    )
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
    others as round the count up to :data:`_ROW_MULTIPLE`. The counts come from ``zero.others``
    (one chunk) or ``zero.before`` (several); without them, one host synchronization for the
    whole pass."""
    mask = zero.mask
    if not mask.numel():
        return [None] * len(chunks)
    if len(chunks) == 1 and zero.others is not None:
        totals = [0, zero.others]
    elif zero.before is not None:
        totals = [0, *(int(zero.before[sl.stop - 1]) for sl in chunks)]
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


def leading_rows(zero: ZeroRows | None, n: int, started: int = 0, cuts: Sequence[int] | None = None) -> int | None:
    """Where a fused pass over ``n`` rows whose rows with a gradient come first
    (:attr:`ZeroRows.leading`) ends its gradient chunks; the rows after it need their statistics
    only (statistics-only chunks, no logits kept), so the gradient chunks, their ``d weight``
    layout and their logits buffer are planned for the rows with a gradient alone: a pass whose
    every row would take several chunks may then fit its rows with a gradient in one.

    The end is at least ``started`` (the rows whose statistics GEMM was launched with their logits
    kept: :attr:`~logitless.ops.engine.ObjectiveSpec.started`) and rounded up (rows of zero
    gradient add exact zeros): to the next of the pass's allowed ``cuts`` when given (its chunks
    hold whole sequences), else to :data:`_ROW_MULTIPLE`. ``None`` where every row goes through
    the gradient chunks: no such order, no row with a gradient (the pass's ``d weight`` is then
    zero-filled as for a chunk with none), or fewer rows left out than :data:`_MIN_SKIPPED`."""
    if zero is None or not zero.leading or not zero.others:
        return None
    least = max(started, zero.others)
    if cuts is None:
        end = min(n, -(-least // _ROW_MULTIPLE) * _ROW_MULTIPLE)
    else:
        end = next((c for c in cuts if c >= least), n)
    return None if n - end < n * _MIN_SKIPPED else end
