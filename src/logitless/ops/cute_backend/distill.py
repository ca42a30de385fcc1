"""Distillation on the CuTe DSL statistics GEMM: the two-head pass of
:mod:`logitless.ops.triton_shared.two_heads` with both heads' tiles stored by
:func:`.kernels.launch_forward` (this backend's
:class:`~logitless.ops.distill_contract.DistillBackend`). Tested against the torch backend on a
Hopper GPU (``tests/test_distill_gemm.py``)."""

from __future__ import annotations

import torch

from ..contract import StatRequest
from ..triton_shared.tile_gemm import TileOperands
from ..triton_shared.two_heads import SCOPE as SCOPE
from ..triton_shared.two_heads import TileStore, TwoHeadPass
from .backend import CAPS
from .kernels import TILE_V, launch_forward, z_buffer


def _launch(ops: TileOperands, want: StatRequest, fp32_logits: bool, z: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return launch_forward(ops, want, fp32_logits, z)


_PASS = TwoHeadPass(TileStore(_launch, z_buffer, lambda: TILE_V), CAPS)
plan_for, chunk_forward, chunk_jsd, chunk_backward = _PASS.plan_for, _PASS.chunk_forward, _PASS.chunk_jsd, \
    _PASS.chunk_backward
