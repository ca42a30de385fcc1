"""Test-session set-up. Without a GPU, Triton kernels run under its interpreter on CPU tensors;
the variable must be set before anything imports triton."""

import os
import zlib

import pytest
import torch

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
