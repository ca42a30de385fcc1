"""The Triton-interpreter harness shared by the kernel test modules.

``TRITON_INTERPRET=1`` only takes effect for kernels decorated after it is set. Without a GPU,
conftest sets it before anything imports triton, so the cases run in this process. Elsewhere
another module may have imported the kernels first, so the cases run in a child pytest with the
variable set (and the ``LOGITLESS_*`` switches cleared, so they start from defaults); on a GPU
machine they are skipped, since the compiled kernels are tested there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def round_bf16_like_the_gpu() -> bool:
    """Make the interpreter round fp32 -> bf16 to nearest even, as compiled kernels do.

    Triton's interpreter (3.x ``InterpreterBuilder.cast_impl``) converts fp32 to bf16 with no
    rounding mode, i.e. by truncation toward zero, where a compiled kernel's ``.to(tl.bfloat16)``
    and the implicit cast of ``tl.store`` round to nearest even (``cvt.rn.bf16.f32``). Truncation
    is biased: the rounding errors of a bf16 ``dy = dL/dy`` tile then add up along the vocabulary
    instead of cancelling, so on CPU the Triton/gemm backends' ``d weight``, ``d bias`` and LoRA
    gradients looked up to several times the plain path's error that the GPU does not have. The
    patch converts with ``torch`` (round to nearest even). Returns whether it was applied (not
    when Triton or that builder method is missing)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    cast = getattr(builder, "cast_impl", None)
    if cast is None or getattr(cast, "rounds_to_nearest", False):
        return cast is not None

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(data.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    cast_impl.rounds_to_nearest = True
    builder.cast_impl = cast_impl
    return True
_ON_GPU = torch.cuda.is_available()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_under_interpreter's child process")


def child_run(path: str):
    """A test that runs the module at ``path`` under the interpreter in a child pytest."""

    @pytest.mark.skipif(INTERPRETED, reason="this process already runs the cases")
    @pytest.mark.skipif(_ON_GPU, reason="a GPU machine tests the compiled kernels (the cuda-marked tests); the "
                        "interpreter cases are CPU CI's: the GPU image's Triton 3.6 interpreter fails on them in "
                        "its own argument conversion (TypeError: only 0-dimensional arrays can be converted)")
    def test_under_interpreter():
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOGITLESS_")}
        env["TRITON_INTERPRET"] = "1"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                               "ignore::RuntimeWarning", path], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]

    return test_under_interpreter
