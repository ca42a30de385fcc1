"""Distillation on the CuTe backend: :mod:`logitless.ops.triton_shared.distill_tiles`' two-tile
pass on this backend's statistics GEMM (:func:`.backend.stats_tile`: both heads' tiles stored
centred in fp16, as the GEMM-epilogue backend's), as a
:class:`~logitless.ops.distill_contract.DistillBackend`; its row kernels are Triton's."""

from __future__ import annotations

from functools import partial

from ..triton_shared import distill_tiles
from ..triton_shared.distill_tiles import SCOPE as SCOPE
from ..triton_shared.distill_tiles import plan_for as plan_for
from .backend import CAPS as CAPS
from .backend import stats_tile

chunk_forward = partial(distill_tiles.chunk_forward, stats_tile)
chunk_jsd = partial(distill_tiles.chunk_jsd, stats_tile)
chunk_backward = partial(distill_tiles.chunk_backward, stats_tile)
