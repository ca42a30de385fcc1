"""Distillation on the GEMM-epilogue kernels: the two-head pass of
:mod:`logitless.ops.triton_shared.two_heads` on this backend's Triton statistics GEMM (this
backend's :class:`~logitless.ops.distill_contract.DistillBackend`)."""

from __future__ import annotations

import torch

from ..contract import StatRequest
from ..triton_shared.tile_gemm import TileOperands
from ..triton_shared.two_heads import SCOPE as SCOPE
from ..triton_shared.two_heads import TileStore, TwoHeadPass
from .backend import CAPS
from .kernels import gemm_config, launch_forward


def _launch(ops: TileOperands, want: StatRequest, fp32_logits: bool, z: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return launch_forward(ops, want, fp32_logits, z, gemm_config())


def _buffer(n: int, width: int, device: torch.device) -> torch.Tensor:
    return torch.empty((n, width), dtype=torch.float16, device=device)


_PASS = TwoHeadPass(TileStore(_launch, _buffer, lambda: gemm_config().fwd.block_v), CAPS)
plan_for, chunk_forward, chunk_jsd, chunk_backward = _PASS.plan_for, _PASS.chunk_forward, _PASS.chunk_jsd, \
    _PASS.chunk_backward
