"""Tile shapes of the GEMM-epilogue forward kernel against cuBLAS, on one head (GPU only).

    python3 scripts/gpu_gemm_sweep.py [SHAPE]   # a bench shape, default 8k:llama3-8b

On the bench's inputs for SHAPE (trained-model-like logits: a GEMM's speed depends on its data
through the GPU's power draw, so random normal operands time differently), prints in ms:
cuBLAS's logits GEMM (bf16 and fp32 output), the flash forward, and the epilogue kernel for each
variant with and without storing the centred fp16 tile, then the row kernel that turns a stored
tile into ``dy`` for a few step widths, the GEMM that writes ``dy`` from its epilogue, and each
compiled kernel's registers, spills and descriptor-store waits (``SWEEP_REPEATS=k`` runs the
variants k times in turn: the spread between calls of one variant is large).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from triton.testing import do_bench

from logitless.bench.cases import make_inputs, parse_shape
from logitless.ops import gemm
from logitless.ops.contract import RowCoefficients, RowStats, SavedStats, StatGrads, StatRequest
from logitless.ops.flash_backend.kernels import flash_config
from logitless.ops.flash_backend.kernels import launch_stats as flash_stats
from logitless.ops.gemm_backend.kernels import (
    _epilogue_kernel,
    _grad_tile_kernel,
    gemm_config,
    launch_forward,
    launch_grad_tile,
)
from logitless.ops.transform import LogitTransform
from logitless.ops.triton_shared import centred
from logitless.ops.triton_shared.centred import CentredTile, RowKernelConfig, launch_centred_grad
from logitless.ops.triton_shared.tile_gemm import TileOperands, Tiles

# (tiles, programs per SM, warp specialization, token blocks per group): persistent launches,
# tiles stored through a descriptor.
VARIANTS = [
    (Tiles(128, 256, 64, 8, 3), 1, False, 8),
    (Tiles(128, 256, 64, 8, 3), 1, True, 8),
    (Tiles(128, 256, 64, 8, 4), 1, True, 8),
    (Tiles(128, 256, 64, 8, 3), 1, True, 4),
    (Tiles(128, 256, 64, 8, 3), 1, True, 16),
    (Tiles(256, 128, 64, 8, 3), 1, True, 8),
    (Tiles(128, 256, 64, 16, 3), 1, False, 8),
] * int(os.environ.get("SWEEP_REPEATS", "1"))  # each variant again in turn: the spread between its calls


def main() -> None:
    case = parse_shape(sys.argv[1] if len(sys.argv) > 1 else "8k:llama3-8b")
    n, h, v = case.n_tokens, case.hidden_size, case.vocab_size
    x = make_inputs(case, torch.device("cuda"), torch.bfloat16)
    hid, w, tgt = x.hidden.detach().reshape(n, h), x.weight.detach(), x.targets.reshape(n)
    del x
    tr = LogitTransform()
    z = torch.empty((n, v), dtype=torch.float16, device="cuda")
    ops = TileOperands(hid, w, None, tgt, tr)
    ms = {}
    ms["cublas bf16 out"] = do_bench(lambda: torch.mm(hid, w.t()))
    ms["cublas fp32 out"] = do_bench(lambda: gemm.mm(hid, w.t(), torch.float32))
    want = StatRequest(entropy=True)
    ms["flash forward"] = do_bench(lambda: flash_stats(hid, w, None, tgt, tr, want, True, flash_config()))
    base = gemm_config()
    best = (float("inf"), None)
    for t, per_sm, ws, group in VARIANTS:
        cfg = dataclasses.replace(base, fwd=t, persistent=True, store_tma=True, programs_per_sm=per_sm,
                                  warp_specialize_stats=ws, group_n=group)
        name = (f"epilogue {t.block_n}x{t.block_v}x{t.block_k} w{t.warps} s{t.stages} x{per_sm}/SM g{group}"
                f"{' warp-specialized' if ws else ''}")
        try:
            a = do_bench(lambda cfg=cfg: launch_forward(ops, StatRequest(), True, None, cfg))
            # (warp specialization applies to the statistics-only launch alone)
            b = do_bench(lambda cfg=cfg: launch_forward(ops, StatRequest(), True, z, cfg))
        except Exception as e:  # a variant that does not compile or fit is reported and skipped
            print(f"{name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        ms[name + " stats"] = min(a, ms.get(name + " stats", a))
        ms[name + " +store"] = min(b, ms.get(name + " +store", b))
        print(f"{name}: stats {a:.3f}  +store {b:.3f}", flush=True)
        if b < best[0]:
            best = (b, cfg)
    cfg = best[1]
    parts = launch_forward(ops, StatRequest(), True, z, cfg)
    m = parts["m"]
    stats, saved = RowStats.combine(parts, torch.ones(n, dtype=torch.bool, device="cuda")).finalize()
    lse, sum_pz = stats.lse, saved.sum_pz
    g = torch.randn(n, device="cuda")
    rc = RowCoefficients.make(SavedStats(lse, sum_pz), StatGrads(logp=g, lse=None, entropy=0.01 * g))
    default = centred.row_kernel_config
    for block, warps in ((1024, 4), (2048, 8), (4096, 8), (2048, 4)):
        centred.row_kernel_config = lambda block=block, warps=warps: RowKernelConfig(block, warps, (16, 256))
        tile = CentredTile(z.clone(), m, cfg.fwd.block_v)
        ms[f"centred grad {block} w{warps}"] = do_bench(
            lambda tile=tile: launch_centred_grad(tile, tile.z.view(torch.bfloat16), tgt, 0, tr, rc))
    centred.row_kernel_config = default
    dy_out = torch.empty((n, v), dtype=torch.bfloat16, device="cuda")
    ms["recompute + dy in the epilogue (backward without kept logits)"] = do_bench(
        lambda: launch_grad_tile(ops, rc, True, dy_out, cfg))
    dy = torch.randn(n, v, device="cuda").to(torch.bfloat16)
    acc = torch.zeros(v, h, device="cuda")
    ms["cublas dh (bf16 dy @ W, fp32 out)"] = do_bench(lambda: gemm.mm(dy, w, torch.float32))
    ms["cublas dW += dyT h (fp32 acc)"] = do_bench(lambda: gemm.addmm_(acc, dy.t(), hid))
    ms["cublas dW = dyT h (bf16 out)"] = do_bench(lambda: torch.mm(dy.t(), hid))
    _dump_compiled()
    print(f"\nN={n} H={h} V={v}; best forward: {best[1].fwd} x{best[1].programs_per_sm}/SM "
          f"{best[0]:.3f} ms")
    for k, val in ms.items():
        print(f"{val:9.3f} ms  {k}")


def _dump_compiled() -> None:
    """Each compiled variant's TTGIR into $OUT (when set), with its shared memory and where the
    descriptor stores wait: whether a store overlaps the next tile's main loop."""
    out = os.environ.get("OUT")
    compiled = [k for fn in (_epilogue_kernel, _grad_tile_kernel)
                for k in fn.device_caches[torch.cuda.current_device()][0].values()]
    for i, kernel in enumerate(compiled):
        ttgir = kernel.asm.get("ttgir", "")
        lines = ttgir.splitlines()
        waits = [j for j, line in enumerate(lines) if "store_wait" in line]
        copies = [j for j, line in enumerate(lines) if "copy_local_to_global" in line]
        meta = kernel.metadata
        print(f"compiled {i} ({getattr(meta, 'name', '?')}): shared {meta.shared} B, warps {meta.num_warps}, registers "
              f"{getattr(kernel, 'n_regs', '?')}, spills {getattr(kernel, 'n_spills', '?')}, stores at lines "
              f"{copies}, waits at {waits} of {len(lines)}", flush=True)
        if out:
            with open(os.path.join(out, f"epilogue_{i}.ttgir"), "w") as f:
                f.write(ttgir)


if __name__ == "__main__":
    main()
