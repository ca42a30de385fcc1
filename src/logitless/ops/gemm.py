"""Matrix products with a wide output: low-precision inputs at full tensor-core rate, product
and accumulators in fp32 (never rounded to bf16 in between). Shared by both backends."""

from __future__ import annotations

import functools

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@functools.cache
def cuda_out_dtype_ok() -> bool:
    """Whether ``torch.mm``/``torch.addmm(..., out_dtype=float32, out=acc)`` exist on CUDA and
    accumulate correctly in place (torch >= 2.8); probed once on a small product."""
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(48, 80, device="cuda", dtype=torch.bfloat16, generator=g)
        acc = torch.randn(64, 80, device="cuda", generator=g)
        want = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        prod = torch.mm(a, b, out_dtype=torch.float32)
        return bool(torch.allclose(acc, want, atol=1e-3, rtol=1e-4)
                    and torch.allclose(prod, a.float() @ b.float(), atol=1e-3, rtol=1e-4))
    except (RuntimeError, TypeError):
        return False


@functools.cache
def cuda_store_ok() -> bool:
    """Whether ``torch.addmm(out, a, b, beta=0, out_dtype=float32, out=out)`` stores ``a @ b``
    on CUDA without reading ``out`` (NaN there must not propagate); probed once."""
    if not cuda_out_dtype_ok():
        return False
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        a = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(48, 80, device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.full((64, 80), float("nan"), device="cuda")
        torch.addmm(out, a, b, beta=0, out_dtype=torch.float32, out=out)
        return bool(torch.allclose(out, a.float() @ b.float(), atol=1e-3, rtol=1e-4))
    except (RuntimeError, TypeError):
        return False


def _wide_gemm(a: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return (a.device.type == "cuda" and a.dtype in _LOW_PRECISION and out_dtype == torch.float32
            and cuda_out_dtype_ok())


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in ``out_dtype`` (the inputs' dtype, fp32 or fp64).

    CUDA bf16/fp16 → fp32: cuBLAS with an fp32 output. Elsewhere (CPU, old torch) the inputs are
    upcast first, which is exact (and on CPU faster than a low-precision matmul)."""
    b = b.to(a.dtype)
    if a.dtype == out_dtype:
        return a @ b
    if _wide_gemm(a, out_dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(out_dtype) @ b.to(out_dtype)


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place; on CUDA with bf16/fp16 inputs and an fp32 ``acc`` the product
    is accumulated by cuBLAS without being materialized."""
    b = b.to(a.dtype)
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _wide_gemm(a, acc.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += mm(a, b, acc.dtype)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, the products accumulated in fp32 (at least) and rounded once to ``out``'s
    dtype (its old values, possibly uninitialized, are not read). On CUDA one cuBLAS GEMM writes
    ``out`` (a contiguous view; bf16/fp16 inputs into fp32 too); elsewhere the product is formed
    in fp32 (or the inputs' wider dtype) and copied."""
    b = b.to(a.dtype)
    if a.device.type == "cuda" and out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    elif _wide_gemm(a, out.dtype) and cuda_store_ok():  # beta = 0: out's old values are not read
        torch.addmm(out, a, b, beta=0, out_dtype=torch.float32, out=out)
    elif _wide_gemm(a, out.dtype):
        addmm_(out.zero_(), a, b)
    else:
        out.copy_(mm(a, b, torch.promote_types(a.dtype, torch.float32)))
