"""The statistics kernels compiled for sm_90a on any machine (no GPU needed; Triton's bundled
``ptxas``, the CuTe DSL with ``CUTE_DSL_ARCH=sm_90a``), and a digest of each one's PTX instructions:
to check that an optional statistic's flag off compiles to the same code as a revision without
the flag (line info, comments and kernel parameters left out: an unused pointer argument is all
that may differ).

    PYTHONPATH=src python3 scripts/stats_kernel_ptx.py                # this tree
    git archive REV src | tar -x -C /tmp/rev && PYTHONPATH=/tmp/rev/src python3 scripts/stats_kernel_ptx.py
    CUTE_DSL_ARCH=sm_90a PYTHONPATH=src VENV/bin/python scripts/stats_kernel_ptx.py --cute

Each line: kernel, the flags it was compiled with, instruction lines, digest. Equal digests for
the same kernel and flags across revisions mean the same instructions. CuTe lines add the SASS
instruction count and the spill loads and stores (the DSL keeps the cubin).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import re
import subprocess
import tempfile
from pathlib import Path

# One configuration per kernel: the GPU default tiles, plain pointer loads, entropy on, Σz off.
FLAGS = dict(HAS_BIAS=False, HAS_SCALE=False, HAS_SOFTCAP=False, HAS_TEMPERATURE=False, WANT_ENTROPY=True,
             WANT_SUM_Z=False)
TILE_FLAGS = dict(ROUND_Y=False, EVEN_K=True, USE_TMA=False, DOT_PRECISION="ieee", UPCAST=False, GROUP_N=8)
SCALARS = {"logit_scale", "softcap", "temperature"}


def digest(ptx: str) -> tuple[int, str]:
    """``(instruction lines, digest)`` of a PTX module's kernel bodies (up to the debug sections)."""
    body = []
    for line in ptx.splitlines():
        if re.match(r"\s*\.section", line):
            break
        # Debug-scope labels of inlined @triton.jit helpers ($L__tmpN) move with the source, not the code.
        if re.match(r"\s*(\.loc|//|\.file)", line) or "param" in line or re.match(r"\s*\$L__tmp\d+:", line):
            continue
        body.append(line)
    text = "\n".join(body)
    return len(body), hashlib.sha1(text.encode()).hexdigest()[:12]


def triton_kernels(want_sum_sq: bool):
    """``(name, kernel, pointer dtypes, constexprs, options)`` of each Triton statistics kernel."""
    from logitless.ops.flash_backend import kernels as flash
    from logitless.ops.gemm_backend import kernels as gemm
    from logitless.ops.triton_backend import kernels as row

    operands = {"h_src": "*bf16", "w_src": "*bf16", "bias_ptr": "*bf16", "tgt_ptr": "*i64"}
    yield ("triton._stats_kernel", row._stats_kernel, {"y_ptr": "*fp32", "bias_ptr": "*fp32", "tgt_ptr": "*i64"},
           dict(FLAGS, BLOCK_N=1, BLOCK_V=2048), dict(num_warps=4))
    yield ("flash._flash_stats_kernel", flash._flash_stats_kernel, operands,
           dict(FLAGS, **TILE_FLAGS, BLOCK_N=128, BLOCK_V=128, BLOCK_K=64), dict(num_warps=8, num_stages=3))
    for store in (False, True):
        yield (f"gemm._epilogue_kernel[store_z={store}]", gemm._epilogue_kernel, dict(operands, z_dst="*fp16"),
               dict(FLAGS, **TILE_FLAGS, EVEN_V=True, FOLD=False, EXP_CLAMP=88.0, STORE_Z=store, STORE_TMA=False,
                    BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, PERSISTENT=True, WARP_SPECIALIZE=False),
               dict(num_warps=8, num_stages=3))


def compile_triton(want_sum_sq: bool) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, fn, pointers, constexprs, options in triton_kernels(want_sum_sq):
        names = fn.arg_names
        constexprs = {a: v for a, v in constexprs.items() if a in names}  # a flag a revision lacks
        if "WANT_SUM_SQ" in names:  # a revision without the flag compiles as it is
            constexprs = dict(constexprs, WANT_SUM_SQ=want_sum_sq)
        elif want_sum_sq:
            continue
        signature = {a: "constexpr" if a in constexprs else pointers.get(a, "*fp32" if a.endswith(("_ptr", "_dst"))
                                                                          else "fp32" if a in SCALARS else "i32")
                     for a in names}
        source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(a),): v for a, v in constexprs.items()})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        print(name, f"sum_sq={want_sum_sq}", *digest(ptx))


def compile_cute(want_sum_sq: bool, dump: Path) -> None:
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from logitless.ops.cute_backend import kernels as K

    fields = K.KernelKey._fields
    if "want_sum_sq" not in fields and want_sum_sq:
        return
    folds = (False, True) if "fold" in fields else (None,)
    for store_z, pingpong, fold in itertools.product((False, True), (False, True) if "pingpong" in fields else (None,),
                                                     folds):
        if fold and not store_z:
            continue
        key = dict(device=0, dtype=torch.bfloat16, want_entropy=not fold, want_sum_z=False, store_z=store_z,
                   has_bias=False, has_scale=False, has_softcap=False, has_temperature=False, round_y=False,
                   raster_along_m=False)
        if "want_sum_sq" in fields:
            key["want_sum_sq"] = want_sum_sq
        if pingpong is not None:
            key["pingpong"] = pingpong
        if fold is not None:
            key["fold"] = fold
        n, h, v, tiles = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
        row = cute.sym_int(divisibility=8)
        parts = 2 + (not fold) + want_sum_sq

        def fake(dtype, shape, stride, align=16):
            return make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)

        for old in [*dump.glob("*.ptx"), *dump.glob("*.cubin")]:
            old.unlink()
        cute.compile(K.StatsGemm(K.KernelKey(**key)), fake(cutlass.BFloat16, (n, h, 1), (row, 1, 0)),
                         fake(cutlass.BFloat16, (v, h, 1), (row, 1, 0)),
                     fake(cutlass.BFloat16 if fold else cutlass.Float16, (n, v, 1),
                          (cute.sym_int(divisibility=8), 1, 0)) if store_z else None,
                     None, fake(cutlass.Int64, (n,), (1,), 8),
                     fake(cutlass.Float32, (parts, tiles, n), (cute.sym_int(), n, 1), 4),
                     fake(cutlass.Float32, (n,), (1,), 4),
                     *([fake(cutlass.Float32, (n,), (1,), 4) if fold else None] if fold is not None else []),
                     (cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Float32(1.0)), 132, make_fake_stream())
        (ptx,) = dump.glob("*.ptx")
        named = ([] if pingpong is None else [f"pingpong={pingpong}"]) + ([] if fold is None else [f"fold={fold}"])
        print(f"cute.StatsGemm[store_z={store_z}]", f"sum_sq={want_sum_sq}", *named, *digest(ptx.read_text()),
              *sass_counts(dump))


def sass_counts(dump: Path) -> list[str]:
    """The kept cubin's SASS (Triton's bundled ``cuobjdump``): its instructions, and its local-memory
    loads and stores (register spills)."""
    import triton

    cubins = list(dump.glob("*.cubin"))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if len(cubins) != 1 or not tool.exists():
        return []
    sass = subprocess.run([str(tool), "-sass", str(cubins[0])], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return [f"sass={len(ops)}", f"spills={sum(op in ('LDL', 'STL') for op in ops)}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cute", action="store_true", help="the CuTe DSL kernel (needs CUTE_DSL_ARCH=sm_90a)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as dump:
        # Read when the CuTe DSL is imported: set before anything imports it.
        os.environ.update(CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=dump)
        for want_sum_sq in (False, True):
            if args.cute:
                compile_cute(want_sum_sq, Path(dump))
            else:
                compile_triton(want_sum_sq)


if __name__ == "__main__":
    main()
