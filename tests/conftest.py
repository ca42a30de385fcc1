"""Test-session set-up. Without a GPU, Triton kernels run under its interpreter on CPU tensors;
the variable must be set before anything imports triton."""

import os
import zlib

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (the README runs `-n 2` on a 2-core CPU) each worker is one core's share:
    # one intra-op thread in torch, OpenMP and the BLAS behind numpy (the interpreter's `tl.dot`),
    # here and in the processes the tests start, instead of every worker spinning up a thread per
    # core. Set before torch and numpy are imported; an explicit setting is kept.
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import torch

if os.environ.get("PYTEST_XDIST_WORKER") and os.environ["OMP_NUM_THREADS"].isdigit():
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter import round_bf16_like_the_gpu

    round_bf16_like_the_gpu()


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (stable across runs, different between tests and parameters),
    applied to torch's default generator."""
    s = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(s)
    return s
