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
