"""How a pass over the vocabulary is cut into blocks: the one place that turns a byte
budget into token-chunk and vocabulary-block sizes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

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


def stat_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The statistics dtype of a pass over ``dtype`` inputs: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def workspace_per_element(stat_dtype: torch.dtype, in_dtype: torch.dtype, kind: PlanKind = "torch",
                          fp32_logits: bool = True) -> int:
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
    def make(cls, n_tokens: int, vocab: int, budget: int, in_dtype: torch.dtype, kind: PlanKind = "torch",
             fp32_logits: bool = True, arrays: int = 1) -> ChunkPlan:
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
        return cls(token_chunk=token_chunk, vocab_block=vocab_block, keep_logits=vocab_block == vocab,
                   fp32_logits=fp32_logits, budget=budget, bytes_per_logit=per, stats_chunk=stats_chunk,
                   stat_dtype=stat_dtype, vocab=vocab)

    def whole(self, n_tokens: int, vocab: int, extra: int) -> ChunkPlan | None:
        """This plan as one chunk of all ``n_tokens`` rows kept whole, if their logits fit the
        budget plus ``extra`` bytes (memory the caller saves by running one chunk), else ``None``."""
        if n_tokens * vocab * self.bytes_per_logit > self.budget + extra:
            return None
        return dataclasses.replace(self, token_chunk=max(1, n_tokens), vocab_block=max(1, vocab), keep_logits=True,
                                   vocab=vocab)

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
        return dataclasses.replace(self, budget=budget, token_chunk=token_chunk, vocab_block=vocab_block,
                                   keep_logits=vocab_block >= vocab, vocab=vocab)

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

    def stats_chunks(self, n_tokens: int) -> list[slice]:
        """``[0, n_tokens)`` in chunks of a statistics-only pass (``stats_chunk`` tokens)."""
        return dataclasses.replace(self, token_chunk=max(self.token_chunk, self.stats_chunk)).chunks(n_tokens)

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
