"""The pair ``d weight`` GEMM (bf16 result, int8 residual: ``ops.triton_shared.weight_grad``) against
cuBLAS's fp32 accumulation, over one token chunk of a bench head (GPU only).

    python3 scripts/gpu_weight_grad_sweep.py [SHAPE:CHUNK ...]
    # default: 8k:gemma2-2b:2048 8k:gemma2-2b:4096 8k:llama3-8b:4096

For each shape: ``dy [chunk, V]`` (probabilities-like values) and ``hidden [chunk, H]``; prints in ms
cuBLAS's ``acc32 += dyᵀ h`` (the current per-chunk step), the final fp32 -> bf16 cast, and each
launch config of the pair kernel (first chunk: store; later: add), with its registers and
spills, and the pair's error against float64 next to the fp32 accumulator's.
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from logitless.bench.cases import parse_shape
from logitless.ops.triton_shared.weight_grad import WeightGradConfig, _weight_grad_kernel, launch_weight_grad

VARIANTS = [
    WeightGradConfig(128, 256, 32, 8, 4, 8, True, pair_tma=True),
    WeightGradConfig(128, 256, 16, 8, 4, 8, True, pair_tma=True),
    WeightGradConfig(128, 128, 64, 4, 3, 8, True, pair_tma=True),
]


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> None:
    for item in sys.argv[1:] or ["8k:gemma2-2b:2048", "8k:gemma2-2b:4096", "8k:llama3-8b:4096"]:
        shape, chunk = item.rsplit(":", 1)
        case = parse_shape(shape)
        _chunk(shape, int(chunk), case.vocab_size, case.hidden_size)
        torch.cuda.empty_cache()
    for kernel in _weight_grad_kernel.device_caches[torch.cuda.current_device()][0].values():
        meta = kernel.metadata
        print(f"compiled: shared {meta.shared} B, warps {meta.num_warps}, registers {getattr(kernel, 'n_regs', '?')}, "
              f"spills {getattr(kernel, 'n_spills', '?')}")


def _pair_value(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The pair's sum in float64 (``lo`` counts units of ``2**(e - 14)``, ``e`` ``hi``'s exponent)."""
    exponent = torch.frexp(hi.double()).exponent - 1
    return hi.double() + lo.double() * torch.exp2((exponent.clamp(min=-112) - 14).double())


def _chunk(shape: str, chunk: int, v: int, h: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    dy = (torch.rand(chunk, v, device="cuda", generator=g) * 1e-3).bfloat16()
    hid = torch.randn(chunk, h, device="cuda", generator=g).bfloat16()
    acc = torch.zeros(v, h, device="cuda")
    print(f"\n{shape}: chunk {chunk} tokens, V={v} H={h}", flush=True)
    t_cublas = ms(lambda: torch.addmm(acc, dy.t(), hid, out_dtype=torch.float32, out=acc))
    t_cublas_store = ms(lambda: torch.addmm(acc, dy.t(), hid, beta=0, out_dtype=torch.float32, out=acc))
    t_cast = ms(lambda: acc.to(torch.bfloat16))
    print(f"  cuBLAS add {t_cublas:.3f}  store {t_cublas_store:.3f}  cast {t_cast:.3f}", flush=True)
    hi = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
    lo = torch.empty(v, h, device="cuda", dtype=torch.int8)
    for cfg in VARIANTS:
        try:
            t_first = ms(lambda cfg=cfg: launch_weight_grad(dy, hid, hi, lo, True, cfg))
            t_add = ms(lambda cfg=cfg: launch_weight_grad(dy, hid, hi, lo, False, cfg))
        except Exception as e:  # a config that does not compile
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"  pair {cfg.block_v}x{cfg.block_h}x{cfg.block_k} w{cfg.warps} s{cfg.stages} g{cfg.group_v}: "
              f"store {t_first:.3f}  add {t_add:.3f}  ({t_add / t_cublas:.3f}x cuBLAS add)", flush=True)
    # Two chunks summed, against float64.
    dy2 = (torch.rand(chunk, v, device="cuda", generator=g) * 1e-3).bfloat16()
    ref = dy.double().t() @ hid.double() + dy2.double().t() @ hid.double()
    launch_weight_grad(dy, hid, hi, lo, True)
    launch_weight_grad(dy2, hid, hi, lo, False)
    torch.addmm(acc, dy.t(), hid, beta=0, out_dtype=torch.float32, out=acc)
    torch.addmm(acc, dy2.t(), hid, out_dtype=torch.float32, out=acc)
    norm = ref.norm()

    def err(x: torch.Tensor) -> str:
        return f"{float((x.double() - ref).norm() / norm):.3e}"

    print(f"  rel error vs float64: pair sum {err(_pair_value(hi, lo))}, pair hi {err(hi)}, "
          f"fp32 acc {err(acc)}, fp32 acc cast {err(acc.bfloat16())}", flush=True)


if __name__ == "__main__":
    main()
