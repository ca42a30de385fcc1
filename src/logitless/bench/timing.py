"""Timing and peak-memory measurement of one row's ``step()``.

Time: CUDA events around each call (wall clock on CPUs), after warm-up, median of the
repetitions. At the benchmark's sizes the inputs (hundreds of MiB to GiBs) do not fit in L2,
so no input rotation is needed. Each call starts from a synchronization, so the host's work
before its first kernel counts; :func:`time_in_step` times it queued behind other GPU work instead,
as a training step calls its head. Memory: ``torch.cuda.max_memory_allocated`` during one call,
minus what was allocated before it (the inputs), minus the outputs every implementation must
produce (``grad hidden`` and ``grad weight``, or the per-token results of a rollout).
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    """Milliseconds of each timed call and their median."""

    times_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Drop garbage and cached blocks so the next measurement starts clean (CUDA only: on CPUs
    there is no peak to measure, and a full collection after importing transformers costs
    more than a tiny case)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def time_step(step: Callable[[], object], reset: Callable[[], None], device: torch.device, *, min_reps: int = 3,
              max_reps: int = 20, min_time_s: float = 1.0) -> Timing:
    """Time ``step`` (already warmed up): at least ``min_reps`` calls and ``min_time_s`` seconds,
    at most ``max_reps`` calls. ``reset`` runs before each call, outside the timed region."""
    times: list[float] = []
    spent = 0.0
    while len(times) < max_reps and (len(times) < min_reps or spent < min_time_s):
        reset()
        if device.type == "cuda":
            synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            step()
            ms = (time.perf_counter() - t0) * 1e3
        times.append(ms)
        spent += ms / 1e3
    return Timing(times)


# GPU work queued ahead of each call in :func:`time_in_step`, standing for the model's forward that
# a training step runs before its head; longer than any row's host preparation (a few ms).
STEP_AHEAD_MS = 10.0


def time_in_step(step: Callable[[], object], reset: Callable[[], None], device: torch.device,
                 reps: int = 10) -> Timing | None:
    """Time ``step`` (already warmed up) queued behind :data:`STEP_AHEAD_MS` of bf16 GEMMs, from
    the end of those to the end of the call: the host prepares the call while the GPU computes, as
    in a training step, so only host work after a read of the device (which waits for the queue)
    leaves the GPU idle. GEMMs rather than an idle wait keep the GPU at a computing clock, as a
    forward pass does. ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    ahead = _step_ahead(device.index if device.index is not None else torch.cuda.current_device())
    times: list[float] = []
    for _ in range(reps):
        reset()
        synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ahead()
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return Timing(times)


@functools.cache
def _step_ahead(index: int) -> Callable[[], None]:
    """Enqueues about :data:`STEP_AHEAD_MS` of 4096-cubed bf16 GEMMs on GPU ``index`` (their count
    measured once)."""
    with torch.cuda.device(index):
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(a)
        for _ in range(3):
            torch.mm(a, a, out=out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.mm(a, a, out=out)
        end.record()
        end.synchronize()
        count = max(1, math.ceil(STEP_AHEAD_MS / (start.elapsed_time(end) / 10)))

    def ahead() -> None:
        for _ in range(count):
            torch.mm(a, a, out=out)

    return ahead


def peak_bytes(step: Callable[[], object], reset: Callable[[], None], device: torch.device) -> int | None:
    """Peak bytes allocated during one call of ``step`` beyond what was allocated before it
    (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    reset()
    free_memory(device)
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = step()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error of the device (or of the host allocator)."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖x - ref‖ / ‖ref‖`` in fp32 (a tensor's error relative to its size)."""
    x, ref = x.detach().float(), ref.detach().float()
    denom = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(x - ref))
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom
