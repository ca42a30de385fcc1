"""How a pass over the vocabulary is cut into blocks: the one place that turns a byte
budget into token-chunk and vocabulary-block sizes."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch

DEFAULT_CHUNK_BYTES = 2**30
# Below this many tokens a chunk's matmuls stop using the matrix units well, so a row that
# does not fit is cut along the vocabulary instead of shrinking the token chunk further. On GPUs
# the token chunk is the inner dimension of the fp32 ``d weight += dy^T @ h`` accumulation, whose
# [V, H] read-modify-write dominates below ~1k tokens, hence the larger floor for Triton.
_MIN_TOKENS = {"torch": 32, "triton": 1024}

PlanBackend = Literal["torch", "triton"]
_ALIGN = 128  # token chunks are multiples of this (when a chunk is not the whole input)


def workspace_per_element(stat_dtype: torch.dtype, in_dtype: torch.dtype, backend: PlanBackend = "torch",
                          fp32_logits: bool = True) -> int:
    """Workspace bytes per logit element of one block.

    torch: the logits, the probabilities and ``dz`` in the statistics dtype, plus ``dz`` cast to
    the input dtype for the matmuls. triton: one tile of raw matmul output (fp32, or the input
    dtype without ``fp32_logits``), overwritten in place by ``dy``.
    """
    if backend == "triton" and stat_dtype != torch.float64:
        return torch.finfo(stat_dtype if fp32_logits else in_dtype).bits // 8
    return 3 * torch.finfo(stat_dtype).bits // 8 + torch.finfo(in_dtype).bits // 8


def default_fp32_logits() -> bool:
    """``False`` when ``LOGITLESS_TRITON_LOGITS=input`` is set (the plain path's rounded logits),
    else ``True``."""
    env = os.environ.get("LOGITLESS_TRITON_LOGITS", "fp32")
    if env not in ("input", "fp32"):
        raise ValueError(f"LOGITLESS_TRITON_LOGITS must be 'input' or 'fp32', got {env!r}")
    return env == "fp32"


def default_chunk_bytes() -> int:
    """Workspace budget in bytes: ``LOGITLESS_CHUNK_BYTES`` if set, else 1 GiB."""
    env = os.environ.get("LOGITLESS_CHUNK_BYTES")
    return int(env) if env else DEFAULT_CHUNK_BYTES


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
    """

    token_chunk: int
    vocab_block: int
    keep_logits: bool
    fp32_logits: bool = True

    @classmethod
    def make(cls, n_tokens: int, vocab: int, chunk_bytes: int | None, stat_dtype: torch.dtype,
             in_dtype: torch.dtype, backend: PlanBackend = "torch", fp32_logits: bool | None = None) -> ChunkPlan:
        """Plan for ``n_tokens`` x ``vocab`` logits within ``chunk_bytes`` of workspace, as the
        ``backend`` lays a block out (see :func:`workspace_per_element`). ``fp32_logits=None``:
        :func:`default_fp32_logits`.

        Raises:
            ValueError: ``chunk_bytes <= 0``.
        """
        budget = default_chunk_bytes() if chunk_bytes is None else int(chunk_bytes)
        if budget <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes!r}")
        fp32_logits = default_fp32_logits() if fp32_logits is None else bool(fp32_logits)
        per = workspace_per_element(stat_dtype, in_dtype, backend, fp32_logits)
        n = max(1, n_tokens)
        rows = budget // (vocab * per)
        token_chunk = min(n, max(rows, _MIN_TOKENS[backend]))
        if token_chunk < n and token_chunk >= _ALIGN:
            # A token count that is not a multiple of 8 is a misaligned GEMM dimension for
            # bf16 (the inner one of d weight = dyᵀ h): cuBLAS then falls back to slow kernels
            # (measured on H100: Qwen2.5 8k fused 65 ms at 1766-token chunks vs 46 ms aligned).
            # Round down to a multiple of _ALIGN, then even the chunks out.
            token_chunk -= token_chunk % _ALIGN
            count = math.ceil(n / token_chunk)
            token_chunk = min(token_chunk, math.ceil(math.ceil(n / count) / _ALIGN) * _ALIGN)
        vocab_block = min(vocab, max(1, budget // (token_chunk * per)))
        return cls(token_chunk=token_chunk, vocab_block=vocab_block, keep_logits=vocab_block == vocab,
                   fp32_logits=fp32_logits)
