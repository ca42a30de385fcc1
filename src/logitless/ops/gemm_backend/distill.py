"""Distillation on the GEMM-epilogue backend: :mod:`logitless.ops.triton_shared.distill_tiles`'
two-tile pass on this backend's Triton statistics GEMM (:mod:`.kernels`), as a
:class:`~logitless.ops.distill_contract.DistillBackend`."""

from __future__ import annotations

from functools import partial

import torch

from ..contract import StatRequest
from ..triton_shared import distill_tiles
from ..triton_shared.centred import CentredTile
from ..triton_shared.distill_tiles import SCOPE as SCOPE
from ..triton_shared.distill_tiles import plan_for as plan_for
from ..triton_shared.tile_gemm import TileOperands
from .backend import CAPS as CAPS
from .kernels import gemm_config, launch_forward


def stats_tile(ops: TileOperands, want: StatRequest, fp32_logits: bool,
               store: bool) -> tuple[dict[str, torch.Tensor], CentredTile | None]:
    """One head's statistics GEMM over ``ops``' rows: its ``[tiles, n]`` partials and, with
    ``store``, its stored tile (a :data:`~logitless.ops.triton_shared.distill_tiles.StatsTile`)."""
    cfg = gemm_config()
    n, width = ops.hidden.shape[0], ops.weight.shape[0]
    z = torch.empty((n, width), dtype=torch.float16, device=ops.hidden.device) if store else None
    parts = launch_forward(ops, want, fp32_logits, z, cfg)
    return parts, None if z is None else CentredTile(z, parts["m"], cfg.fwd.block_v)


chunk_forward = partial(distill_tiles.chunk_forward, stats_tile)
chunk_jsd = partial(distill_tiles.chunk_jsd, stats_tile)
chunk_backward = partial(distill_tiles.chunk_backward, stats_tile)
