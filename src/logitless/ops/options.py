"""``PassOptions``: the knobs of a vocabulary pass, as one frozen value."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

from .settings import LogitsPrecision, settings

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
        impl: backend: ``"auto"`` (on CUDA with Triton: ``"gemm"`` for bf16/fp16 on Hopper or
            later, else ``"triton"``; torch elsewhere; see ``resolve_backend``), ``"torch"``,
            ``"triton"`` (cuBLAS GEMMs + Triton row kernels), ``"flash"`` (Triton tile GEMMs
            that never write logits), ``"gemm"`` (statistics in a Triton GEMM's epilogue,
            logits kept in fp16 centred per tile, cuBLAS gradient GEMMs) or ``"cute"`` (that
            design with the statistics GEMM written in CUTLASS's CuTe DSL: Hopper only,
            ``pip install 'logitless[cute]'``).
        chunk_bytes: workspace budget of the pass in bytes; ``None``: ``LOGITLESS_CHUNK_BYTES``,
            else 1 GiB. Beyond it a training pass holds an fp32 ``d weight`` accumulator
            (``V x H x 4`` bytes), except where all its tokens fit one chunk within the budget
            plus those bytes: then it runs as one chunk and needs no accumulator (bf16/fp16 heads
            on the Triton and gemm backends).
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
        raise TypeError(f"chunk_bytes must be a positive whole number of bytes or None, got {value!r} "
                        f"({type(value).__name__})")
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
