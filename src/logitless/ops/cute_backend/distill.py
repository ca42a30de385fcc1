"""Distillation on the CuTe backend: :mod:`logitless.ops.triton_shared.distill_tiles`' two-tile
pass on this backend's statistics GEMM (:mod:`.kernels`: both heads' tiles stored centred in
fp16, as the GEMM-epilogue backend's), as a
:class:`~logitless.ops.distill_contract.DistillBackend`; its row kernels are Triton's."""

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
from .kernels import TILE_V, launch_forward, z_buffer


def stats_tile(ops: TileOperands, want: StatRequest, fp32_logits: bool,
               store: bool) -> tuple[dict[str, torch.Tensor], CentredTile | None]:
    """One head's statistics GEMM over ``ops``' rows: its ``[tiles, n]`` partials and, with
    ``store``, its stored tile (a :data:`~logitless.ops.triton_shared.distill_tiles.StatsTile`)."""
    z = z_buffer(ops.hidden.shape[0], ops.weight.shape[0], ops.hidden.device) if store else None
    parts = launch_forward(ops, want, fp32_logits, z)
    return parts, None if z is None else CentredTile(z, parts["m"], TILE_V)


chunk_forward = partial(distill_tiles.chunk_forward, stats_tile)
chunk_jsd = partial(distill_tiles.chunk_jsd, stats_tile)
chunk_backward = partial(distill_tiles.chunk_backward, stats_tile)
