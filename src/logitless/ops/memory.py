"""Out-of-memory advice for a vocabulary pass: which ``chunk_bytes`` would fit.

A pass's working memory is its per-chunk logits workspace (set by ``PassOptions.chunk_bytes``)
on top of what the caller holds. When the device cannot hold the workspace, the user can only
act on ``chunk_bytes``, so both the up-front refusal (:func:`check_workspace_fits`) and an
out-of-memory raised inside the chunk loop (:func:`advise_on_oom`) name the budget, the
workspace of one chunk and a smaller budget to retry with.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .plan import ChunkPlan

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
    message = (f"{what} on {device}: the pass's workspace budget is chunk_bytes={plan.budget:,}, one chunk's logits "
               f"workspace is {workspace:,} bytes ({plan.token_chunk} tokens x {plan.vocab_block} vocabulary entries "
               f"x {plan.bytes_per_logit} bytes); device memory available: {free_txt}. Retry with "
               f"PassOptions(chunk_bytes={suggested}) (or LOGITLESS_CHUNK_BYTES={suggested}). If a small budget "
               f"still fails, the memory is held outside the workspace (activations, the [V, H] gradient "
               f"accumulators): free it or shard the head.")
    return PassOutOfMemoryError(message, plan.budget, workspace, free, suggested)


def check_workspace_fits(plan: ChunkPlan, device: torch.device) -> None:
    """Refuse a pass whose per-chunk workspace exceeds the device's available memory.

    Raises:
        PassOutOfMemoryError: the workspace of one chunk is larger than the memory available on
            ``device`` (CUDA only), with a ``chunk_bytes`` that would fit.
    """
    workspace = workspace_bytes(plan)
    # The driver's free memory alone answers most calls; the caching allocator's unused bytes
    # (a walk over its statistics, ~0.2 ms of host time while the GPU waits) only when needed.
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
