"""How a pass over the vocabulary is cut into blocks: the one place that turns a byte
budget into token-chunk and vocabulary-block sizes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DEFAULT_CHUNK_BYTES = 512 * 2**20
# Below this many tokens a chunk's matmuls stop using the matrix units well, so a row that
# does not fit is cut along the vocabulary instead of shrinking the token chunk further.
_MIN_TOKENS = 32


def default_chunk_bytes() -> int:
    """Workspace budget in bytes: ``LOGITLESS_CHUNK_BYTES`` if set, else 512 MiB."""
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
    """

    token_chunk: int
    vocab_block: int
    keep_logits: bool

    @classmethod
    def make(cls, n_tokens: int, vocab: int, chunk_bytes: int | None, stat_dtype: torch.dtype,
             in_dtype: torch.dtype) -> ChunkPlan:
        """Plan for ``n_tokens`` x ``vocab`` logits within ``chunk_bytes`` of workspace.

        The workspace of one block holds the fp32 (fp64) logits, the probabilities and
        ``dz`` in the statistics dtype, and ``dz`` cast to the input dtype for the matmuls.
        """
        budget = default_chunk_bytes() if chunk_bytes is None else int(chunk_bytes)
        if budget <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes!r}")
        per = 3 * torch.finfo(stat_dtype).bits // 8 + torch.finfo(in_dtype).bits // 8
        n = max(1, n_tokens)
        rows = budget // (vocab * per)
        token_chunk = min(n, max(rows, _MIN_TOKENS))
        vocab_block = min(vocab, max(1, budget // (token_chunk * per)))
        return cls(token_chunk=token_chunk, vocab_block=vocab_block, keep_logits=vocab_block == vocab)
