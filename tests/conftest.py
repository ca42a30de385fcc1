"""Test-session set-up. Without a GPU, Triton kernels run under its interpreter on CPU tensors;
the variable must be set before anything imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
