"""The statistics GEMMs alone (GPU only, sm90, with the CuTe DSL importable): cuBLAS's bf16 logits
GEMM, the Triton epilogue GEMM (statistics, + the stored fp16 tile) and the CuTe DSL one, each as
a ratio to cuBLAS's time in the same run, and the CuTe GEMM's ``lse``/target logit against the
Triton one's (max abs, nats).

    python3 scripts/gpu_cute_gemm.py [SHAPE ...]     # default 8k:llama3-8b 8k:gemma2-2b 8k:qwen2.5-7b
"""

from __future__ import annotations

import statistics
import sys

import torch

from logitless.bench.cases import make_inputs, parse_shape
from logitless.ops.contract import StatRequest
from logitless.ops.cute_backend import kernels as cute_kernels
from logitless.ops.gemm_backend.kernels import gemm_config, launch_forward
from logitless.ops.transform import LogitTransform
from logitless.ops.triton_shared.tile_gemm import TileOperands


def bench(fn, reps: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def lse(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    m = parts["m"].max(0).values
    return m + torch.log((parts["se"] * torch.exp(parts["m"] - m)).sum(0))


def case_line(text: str, dev: torch.device) -> str:
    case = parse_shape(text)
    x = make_inputs(case, dev, torch.bfloat16)
    hidden = x.hidden.detach().reshape(-1, case.hidden_size).contiguous()
    ops = TileOperands(hidden, x.weight.detach().contiguous(), None, x.targets.reshape(-1).contiguous(),
                       LogitTransform())
    logits = torch.empty(hidden.shape[0], case.vocab_size, device=dev, dtype=torch.bfloat16)
    tile = cute_kernels.z_buffer(hidden.shape[0], case.vocab_size, dev)
    cublas = bench(lambda: torch.mm(ops.hidden, ops.weight.t(), out=logits))
    rows = {
        "triton": lambda z: launch_forward(ops, StatRequest(), True, z, gemm_config()),
        "cute": lambda z: cute_kernels.launch_forward(ops, StatRequest(), True, z),
    }
    line = f"{text}: cuBLAS {cublas:.3f} ms"
    for name, run in rows.items():
        alone, stored = bench(lambda run=run: run(None)), bench(lambda run=run: run(tile))
        line += f" | {name} {alone / cublas:.3f}x, + tile {stored / cublas:.3f}x"
    ref, got = rows["triton"](None), rows["cute"](None)
    return line + (f" | cute - triton: lse {(lse(got) - lse(ref)).abs().max().item():.1e},"
                   f" target logit {(got['zy'] - ref['zy']).abs().max().item():.1e}")


def main() -> None:
    for text in sys.argv[1:] or ["8k:llama3-8b", "8k:gemma2-2b", "8k:qwen2.5-7b"]:
        print(case_line(text, torch.device("cuda")), flush=True)


if __name__ == "__main__":
    main()
