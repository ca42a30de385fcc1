"""The statistics GEMMs alone (GPU only, sm90, with the CuTe DSL importable): cuBLAS's bf16 logits
GEMM, the Triton epilogue GEMM (statistics, + the stored fp16 tile) and the CuTe DSL one on each of
its schedules, each as a ratio to cuBLAS's time in the same run (timed round-robin), and the CuTe
GEMM's ``lse``/target logit against the Triton one's (max abs, nats).

    python3 scripts/gpu_cute_gemm.py [SHAPE ...]     # default 8k:llama3-8b 8k:gemma2-2b 8k:qwen2.5-7b
"""

from __future__ import annotations

import statistics
import sys

import torch

from logitless.bench.cases import make_inputs, parse_shape
from logitless.ops.contract import RowStats, StatRequest
from logitless.ops.gemm_backend.kernels import gemm_config, launch_forward
from logitless.ops.transform import LogitTransform
from logitless.ops.triton_shared.tile_gemm import TileOperands

SCHEDULES = ("cooperative", "pingpong")  # of the CuTe statistics GEMM (launch_forward's pingpong)


def bench(fns: dict, rounds: int = 25) -> dict[str, float]:
    """Median ms of each of ``fns``, timed round-robin (one call of each a round), so the GPU's clock
    drift over the run falls on every function alike."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def lse(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's log-partition from a launch's ``[tiles, n]`` partials (nats)."""
    return RowStats.combine(parts, torch.ones_like(parts["m"][0], dtype=torch.bool)).finalize()[0].lse


def case_line(text: str, dev: torch.device) -> str:
    from logitless.ops.cute_backend import kernels as cute_kernels  # (bench() is importable without the DSL)

    case = parse_shape(text)
    x = make_inputs(case, dev, torch.bfloat16)
    hidden = x.hidden.detach().reshape(-1, case.hidden_size).contiguous()
    ops = TileOperands(hidden, x.weight.detach().contiguous(), None, x.targets.reshape(-1).contiguous(),
                       LogitTransform())
    logits = torch.empty(hidden.shape[0], case.vocab_size, device=dev, dtype=torch.bfloat16)
    tile = cute_kernels.z_buffer(hidden.shape[0], case.vocab_size, dev)
    rows = {"triton": lambda z: launch_forward(ops, StatRequest(), True, z, gemm_config())}
    for schedule in SCHEDULES:
        rows[f"cute-{schedule}"] = lambda z, schedule=schedule: cute_kernels.launch_forward(
            ops, StatRequest(), True, z, schedule == "pingpong")
    fns = {"cuBLAS": lambda: torch.mm(ops.hidden, ops.weight.t(), out=logits)}
    for name, run in rows.items():
        fns[name] = lambda run=run: run(None)
        fns[f"{name} + tile"] = lambda run=run: run(tile)
    ms = bench(fns)
    line = f"{text}: cuBLAS {ms['cuBLAS']:.3f} ms"
    for name in rows:
        line += f" | {name} {ms[name] / ms['cuBLAS']:.3f}x, + tile {ms[name + ' + tile'] / ms['cuBLAS']:.3f}x"
    ref = rows["triton"](None)
    for schedule in SCHEDULES:
        got = rows[f"cute-{schedule}"](None)
        line += (f"\n  cute-{schedule} - triton: lse {(lse(got) - lse(ref)).abs().max().item():.1e},"
                 f" target logit {(got['zy'] - ref['zy']).abs().max().item():.1e}")
    return line


def main() -> None:
    for text in sys.argv[1:] or ["8k:llama3-8b", "8k:gemma2-2b", "8k:qwen2.5-7b"]:
        print(case_line(text, torch.device("cuda")), flush=True)


if __name__ == "__main__":
    main()
