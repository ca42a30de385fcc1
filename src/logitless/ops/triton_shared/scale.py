"""Scaling a gradient buffer in place by the incoming gradient of the loss, without reading it on the host.

The fused mode computes every gradient in its forward; its backward only multiplies them by the
loss's incoming gradient, a device scalar that is exactly 1 for ``loss.backward()``. Reading it
to skip that multiply would synchronize with the host; multiplying always would cost a pass over
the ``[V, H]`` weight gradient. Here each program reads the scalar and leaves at once when it is
1, so the common case costs one launch and nothing is synchronized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(x_ptr + offs, (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty), mask=mask)


def scale_unless_one_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x *= scale`` in place (fp32 arithmetic, one rounding), reading nothing when ``scale == 1``.

    Args:
        x: a contiguous tensor of any floating dtype.
        scale: a 0-d (or one-element) floating tensor on ``x``'s device.
    """
    n = x.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, _BLOCK),)](x, scale.reshape(1), n, BLOCK=_BLOCK)
    return x
