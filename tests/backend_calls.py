"""Calls of one backend's contract (``logitless.ops.backend``) on plain tensors, for the tests
that compare backends chunk by chunk: a whole, unsharded head."""

from __future__ import annotations

from logitless.ops.backend import Accumulators, ChunkRows, SavedStats, StatGrads, StatRequest
from logitless.ops.head import LocalHead


def local_head(w, b, tr) -> LocalHead:
    return LocalHead(weight=w, bias=b, transform=tr, group=None, vocab_start=0, vocab_size=w.shape[0],
                     reduce_grad_hidden=True)


def forward(backend, h, w, b, t, tr, plan, want_entropy, keep_logits=False, want_sum_z=False, low=None):
    """``backend.chunk_forward`` of rows ``h``/``t`` against ``w``/``b``/``tr``."""
    return backend.chunk_forward(local_head(w, b, tr), ChunkRows(h, t, low), plan,
                                 StatRequest(want_entropy, want_sum_z), keep_logits)


def backward(backend, h, w, b, t, tr, plan, saved: SavedStats, grads: StatGrads, acc: Accumulators, kept=None,
             low=None):
    """``backend.chunk_backward`` of the same rows."""
    return backend.chunk_backward(local_head(w, b, tr), ChunkRows(h, t, low), plan, saved, grads, acc, kept)
