"""Triton helpers shared by the row kernels (:mod:`.triton_kernels`) and the tile-GEMM kernels
(:mod:`.flash_kernels`): the logit transform and its chain rule, in registers."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..transform import LogitTransform


def interpreting() -> bool:
    """Whether Triton runs kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def transform_args(transform: LogitTransform) -> tuple[tuple[float, float, float], dict[str, bool]]:
    """The kernels' ``(logit_scale, softcap, temperature)`` scalars and ``HAS_*`` constexprs."""
    return ((float(transform.logit_scale), float(transform.softcap or 1.0), float(transform.temperature)),
            {"HAS_SCALE": transform.logit_scale != 1.0, "HAS_SOFTCAP": transform.softcap is not None,
             "HAS_TEMPERATURE": transform.temperature != 1.0})


@triton.jit
def _tanh(x):
    # tl.extra libdevice differs between Triton releases and the interpreter; 2*sigmoid(2x)-1
    # saturates cleanly to +-1 and its absolute error (~1e-7) is what softcap * tanh needs.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def to_logits(y, logit_scale, softcap, temperature,
              HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMPERATURE: tl.constexpr):
    """``z = softcap(logit_scale * y) / temperature`` in fp32 (``y`` includes the bias)."""
    if HAS_SCALE:
        y = y * logit_scale
    if HAS_SOFTCAP:
        y = softcap * _tanh(y / softcap)
    if HAS_TEMPERATURE:
        y = y / temperature
    return y


@triton.jit
def raw_grad(dz, z, logit_scale, softcap, temperature,
             HAS_SOFTCAP: tl.constexpr, HAS_FACTOR: tl.constexpr):
    """``dL/dy`` from ``dL/dz``; ``dz/dy`` is recovered from ``z`` (``tanh = z * T / c``)."""
    if HAS_SOFTCAP:
        t = z * (temperature / softcap)
        dz = dz * (1.0 - t * t)
    if HAS_FACTOR:
        dz = dz * (logit_scale / temperature)
    return dz
