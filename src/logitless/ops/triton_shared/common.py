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


@triton.jit
def row_coefficients(row, tgt_ptr, v_start, lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,
                     HAS_LOGP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_SUM_Z: tl.constexpr):
    """One row's ``(lse, coef, g_entropy, sum_pz, g_logp, target column, g_sum_z)`` for
    :func:`row_dz` (the target relative to ``v_start``; what a flag leaves out is 0, never read)."""
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)  # g_lse - g_logp
    g_ent = 0.0
    c = 0.0
    g_logp = 0.0
    t = 0
    g_sz = 0.0
    if HAS_ENTROPY:
        g_ent = tl.load(g_ent_ptr + row)
        c = tl.load(sum_pz_ptr + row)
    if HAS_LOGP:
        g_logp = tl.load(g_logp_ptr + row)
        t = tl.load(tgt_ptr + row) - v_start
    if HAS_SUM_Z:
        g_sz = tl.load(g_sz_ptr + row)
    return lse, coef, g_ent, c, g_logp, t, g_sz


@triton.jit
def row_dz(z, cols, lse, coef, g_ent, c, g_logp, t, g_sz,
           HAS_LOGP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_SUM_Z: tl.constexpr):
    """``dL/dz`` of one row's logits ``z`` at columns ``cols`` (:mod:`logitless.ops.contract`):
    ``p (coef - g_entropy (z - sum_pz)) + g_sum_z + g_logp [v == y]`` with ``p = exp(z - lse)``,
    from :func:`row_coefficients`."""
    p = tl.exp(z - lse)
    if HAS_ENTROPY:
        dz = p * (coef - g_ent * (z - c))
    else:
        dz = p * coef
    if HAS_SUM_Z:
        dz += g_sz
    if HAS_LOGP:
        dz += tl.where(cols == t, g_logp, 0.0)
    return dz
