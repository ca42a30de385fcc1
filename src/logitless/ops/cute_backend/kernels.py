"""The CuTe DSL statistics GEMM (Hopper, sm90): ``y = hidden @ weight.T`` in a persistent,
warp-specialized WGMMA kernel whose epilogue reduces each tile's rows to their softmax partials
over its 256 vocabulary entries and, optionally, stores the tile in fp16 centred on its row maxima
or (a :class:`~logitless.ops.triton_shared.prob_tile.ProbTile`) as ``exp(z - ref)`` in bf16.

The outputs are those of the Triton GEMM of :mod:`logitless.ops.gemm_backend` (``[tiles, n]``
partials ``m``, ``se``, ``sez``, ``sz``, ``ssq`` and the target logit ``zy``), so the backward's row kernels
(:mod:`logitless.ops.triton_shared.centred`) and :meth:`~logitless.ops.contract.RowStats.combine`
read them unchanged. The statistics come from the fp32 accumulator.

* One producer warp issues TMA loads of ``hidden``/``weight`` blocks into a ring of shared-memory
  stages (multicast of the weight block across a cluster of two CTAs along the tokens); two
  consumer warpgroups run the WGMMAs and the epilogue, on one of two schedules (see
  :data:`PINGPONG_STORING`):

  - cooperative: both on one ``128 x 256`` tile, 64 rows each; the tensor cores idle during the
    epilogue while the producer fills the ring;
  - ping-pong (CUTLASS's ``KernelTmaWarpSpecializedPingpong``): each warpgroup on its own
    ``64 x 256`` tile, alternate tiles of the schedule; named barriers give them turns at the main
    loop and at the epilogue, so one's epilogue runs under the other's main loop.
* Epilogue: the WGMMA accumulator gives each thread 2 rows x 64 columns of the tile; each row's
  maximum and sums are reduced over the thread's columns, then across the 4 threads that share the
  row (two butterfly shuffles). The targets (and references) are read before the main loop, so
  their latency hides. Only the vocabulary's last tile masks its columns, and only a thread whose
  columns hold a row's target compares columns for it (docs/architecture.md, "The statistics
  GEMM's epilogue on whole tiles").
* The tile store (``z - m`` in fp16, or ``exp(z - ref)`` in bf16) goes through shared memory and
  TMA bulk stores, as the example's epilogue does.

Adapted from the Hopper persistent dense GEMM of CUTLASS's CuTe DSL examples
(``examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/dense_gemm_persistent.py``,
BSD-3-Clause, NVIDIA); the accumulator's row/column view follows QuACK's ``convert_layout_acc_mn``,
the ping-pong turns QuACK's ``gemm_sm90.py``.

Imported only where :func:`logitless.ops.contract.resolve_backend` picks this backend: the
``cutlass`` package (``pip install 'logitless[cute]'``) is optional.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.runtime import from_dlpack
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ..triton_shared.prob_tile import EXP_CLAMP, reference
from ..triton_shared.tile_gemm import TileOperands, tile_partials

# Launching through Apache TVM FFI takes the torch tensors as they are, where CuTe DSL's own launch
# converts each through DLPack and packs its arguments in Python: that is most of a launch's host
# time, which comes before the pass's first GEMM runs. Only with a torch that exports DLPack's C
# exchange API itself: without it, importing tvm_ffi compiles an extension for it.
_TVM_FFI = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
if _TVM_FFI:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        _TVM_FFI = False

if TYPE_CHECKING:
    from ..contract import StatRequest

LOG2_E = 1.4426950408889634
TILE_V = 256  # vocabulary entries of a tile: the width its partials and stored logits are centred over


class KernelKey(NamedTuple):
    """What a compiled kernel is specialized on (each distinct key compiles once per process, ~2 s;
    CuTe DSL caches the binary on disk for later processes). The device index keeps a kernel
    loaded for one GPU from being launched on another in the same process."""

    device: int
    dtype: torch.dtype
    want_entropy: bool
    want_sum_z: bool
    want_sum_sq: bool
    store_z: bool
    fold: bool  # the stored tile is bf16 exp(z - ref) (a ProbTile), not fp16 z - m
    has_bias: bool
    has_scale: bool
    has_softcap: bool
    has_temperature: bool
    round_y: bool
    raster_along_m: bool
    pingpong: bool


def _acc_rows_cols(layout: cute.Layout) -> cute.Layout:
    """The WGMMA accumulator layout ``((2, 2, V), MMA_M, MMA_N)`` viewed as
    ``((2, MMA_M), (2, V, MMA_N))``: a thread's rows, then its columns."""
    col_major = cute.make_layout(layout.shape)
    shape = ((col_major.shape[0][1], col_major.shape[1]),
             (col_major.shape[0][0], *col_major.shape[0][2:], col_major.shape[2]))
    stride = ((col_major.stride[0][1], col_major.stride[1]),
              (col_major.stride[0][0], *col_major.stride[0][2:], col_major.stride[2]))
    return cute.composition(layout, cute.make_layout(shape, stride=stride))


class StatsGemm:
    """The kernel for one :class:`KernelKey`. ``__call__`` takes (all with a trailing batch mode of
    1 where noted): ``hidden [n, H, 1]``, ``weight [V, H, 1]`` (16-bit, unit stride along ``H``),
    ``z_out [n, V, 1]`` fp16 or ``None``, ``bias [V]`` fp32 or ``None``, ``targets [n]`` int64,
    ``parts [k, tiles, n]`` fp32 (``m``, ``se``, then ``sez``, ``sz``, ``ssq`` as asked),
    ``target_logit [n]`` fp32, the transform's ``(logit_scale, softcap, 1 / temperature)``."""

    def __init__(self, key: KernelKey):
        self.key = key
        # Either way a consumer warpgroup holds 64 rows x 256 fp32 accumulators: 128 registers a thread.
        self.pingpong = key.pingpong
        self.tile_n = 64 if key.pingpong else 128
        self.tile_mnk = (self.tile_n, TILE_V, 64)
        self.cluster_mn = (2, 1)
        self.num_mma_wg = 2
        self.threads_per_cta = (1 + self.num_mma_wg) * 128
        self.num_epi_threads = 128 if self.pingpong else self.num_mma_wg * 128
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_epi_threads)
        self.z_dtype = cutlass.BFloat16 if key.fold else cutlass.Float16
        self.epi_tile = (self.tile_n, 32)
        self.epi_stage = 4 if key.store_z else 0

    def _setup(self) -> None:
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.a_dtype, LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(), cutlass.Float32, (self.tile_n // 64, 1, 1),
            tiler_mn=(64, TILE_V))
        self.cta_layout_mnk = cute.make_layout((*self.cluster_mn, 1))
        ab_bytes = (self.tile_n + TILE_V) * self.tile_mnk[2] * self.a_dtype.width // 8
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * 2 * self.epi_stage
        self.ab_stage = (utils.get_smem_capacity_in_bytes("sm_90") - 1024 - epi_bytes) // ab_bytes

        def staged(rows: int, dtype, stages: int) -> cute.ComposedLayout:
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, self.tile_mnk[2]), dtype)
            return cute.tile_to_shape(atom, (rows, self.tile_mnk[2], stages), order=(0, 1, 2))

        self.a_smem = staged(self.tile_n, self.a_dtype, self.ab_stage)
        self.b_smem = staged(TILE_V, self.a_dtype, self.ab_stage)
        self.z_smem = None
        if cutlass.const_expr(self.key.store_z):
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.z_dtype, self.epi_tile[1]),
                self.z_dtype)
            self.z_smem = cute.tile_to_shape(atom, (*self.epi_tile, self.epi_stage), order=(0, 1, 2))

    @cute.jit
    def __call__(self, hidden: cute.Tensor, weight: cute.Tensor, z_out: cute.Tensor | None,
                 bias: cute.Tensor | None, targets: cute.Tensor, parts: cute.Tensor, target_logit: cute.Tensor,
                 ref: cute.Tensor | None,
                 scalars: tuple[cutlass.Float32, cutlass.Float32, cutlass.Float32],
                 max_active_clusters: cutlass.Constexpr, stream: cuda.CUstream):
        self.a_dtype = hidden.element_type
        self._setup()

        def tma_load(tensor, smem_staged, rows, mcast):
            op = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if mcast == 1
                  else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
            return cute.nvgpu.cpasync.make_tiled_tma_atom(op, tensor, cute.slice_(smem_staged, (None, None, 0)),
                                                          (rows, self.tile_mnk[2]), num_multicast=mcast)

        tma_a, g_a = tma_load(hidden, self.a_smem, self.tile_n, self.cluster_mn[1])
        tma_b, g_b = tma_load(weight, self.b_smem, TILE_V, self.cluster_mn[0])
        tma_z, g_z = None, None
        if cutlass.const_expr(self.key.store_z):
            tma_z, g_z = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), z_out, cute.slice_(self.z_smem, (None, None, 0)),
                self.epi_tile)

        n, vocab = hidden.shape[0], weight.shape[0]
        tiles_mnl = (cute.ceil_div(n, self.tile_n), cute.ceil_div(vocab, TILE_V), 1)
        # Bands of 8 clusters traverse the other dimension, so a band's operand stays in L2.
        sched = utils.PersistentTileSchedulerParams(tiles_mnl, (*self.cluster_mn, 1), 8, self.key.raster_along_m)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_active_clusters)
        z_cosize = cute.cosize(self.z_smem) if cutlass.const_expr(self.key.store_z) else 1

        @cute.struct
        class SharedStorage:
            pipe: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.b_smem)], 1024]
            sZ: cute.struct.Align[cute.struct.MemRange[self.z_dtype, z_cosize], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, g_a, tma_b, g_b, tma_z, g_z, bias, targets, parts, target_logit, ref, n, vocab, scalars,
                    self.tiled_mma, self.cta_layout_mnk, self.a_smem, self.b_smem, self.z_smem, sched).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(*self.cluster_mn, 1), min_blocks_per_mp=1,
            stream=stream)

    @cute.jit
    def _logit(self, y: cutlass.Float32, col: cutlass.Int32, mBias: cute.Tensor | None, vocab: cutlass.Int32,
               scalars: tuple[cutlass.Float32, cutlass.Float32, cutlass.Float32]) -> cutlass.Float32:
        """``z = softcap(logit_scale · (y + bias)) / temperature`` (:mod:`logitless.ops.transform`)."""
        if cutlass.const_expr(self.key.round_y):
            y = y.to(self.a_dtype).to(cutlass.Float32)
        if cutlass.const_expr(self.key.has_bias):
            y = y + mBias[cutlass.min(col, vocab - 1)]
        if cutlass.const_expr(self.key.has_scale):
            y = y * scalars[0]
        if cutlass.const_expr(self.key.has_softcap):
            y = scalars[1] * cute.math.tanh(y / scalars[1])
        if cutlass.const_expr(self.key.has_temperature):
            y = y * scalars[2]
        return y

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_z: cute.CopyAtom | None, mZ: cute.Tensor | None, mBias: cute.Tensor | None, mT: cute.Tensor,
               mP: cute.Tensor, mZY: cute.Tensor, mRef: cute.Tensor | None, n: cutlass.Int32, vocab: cutlass.Int32,
               scalars: tuple[cutlass.Float32, cutlass.Float32, cutlass.Float32], tiled_mma: cute.TiledMma,
               cta_layout_mnk: cute.Layout, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               z_smem: cute.ComposedLayout | None, sched_params: utils.PersistentTileSchedulerParams):
        key = self.key
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(key.store_z):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_z)

        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        tma_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0)))
                     + cute.size_in_bytes(self.a_dtype, cute.slice_(b_smem, (None, None, 0))))

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        # A stage is released by each warp that reads it, in every CTA the weight block is multicast to.
        consumers = self.cluster_mn[0] * cute.size(tiled_mma) // 32
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipe.data_ptr(), num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
            tx_count=tma_bytes, cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)), defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        gA = cute.local_tile(mA, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, cluster_coord[1], cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, cluster_coord[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        wg = cute.arch.make_warp_uniform(tidx // 128)
        mma_wg = wg - 1  # 0, 1 for the consumers
        # Within the tiled MMA: a ping-pong warpgroup is the whole of it; a cooperative one, its half.
        mma_tidx = (tidx - 128) % cute.size(tiled_mma)
        # WGMMA reads its operands per warpgroup: the operand slice is the warpgroup's.
        thr_mma = tiled_mma.get_slice(mma_tidx - mma_tidx % 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_n, TILE_V)), cutlass.Float32)
        k_tiles = cute.size(gA, mode=[3])

        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if wg == 0:
            cute.arch.setmaxregister_decrease(40)
        if warp_idx == 0:
            sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                               cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            while work.is_valid_tile:
                coord = work.tile_idx
                tAgA_t = tAgA[(None, coord[0], None, coord[2])]
                tBgB_t = tBgB[(None, coord[1], None, coord[2])]
                state.reset_count()
                for _k in range(k_tiles):
                    mainloop.producer_acquire(state)
                    bar = mainloop.producer_get_barrier(state)
                    cute.copy(tma_a, tAgA_t[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_b, tBgB_t[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                              mcast_mask=b_mask)
                    mainloop.producer_commit(state)
                    state.advance()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            mainloop.producer_tail(state)

        if wg > 0:
            cute.arch.setmaxregister_increase(232)
            sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                               cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            k_blocks = cute.size(tCrA, mode=[2])
            lane = tidx % 32
            stores = mma_tidx < 32  # the warp that issues the tile's bulk stores
            if cutlass.const_expr(self.pingpong):
                # The producer loads the tiles in the scheduler's order; the warpgroups take turns.
                if mma_wg == 0:
                    self._turn_arrive(0, "mma")
                    self._turn_arrive(0, "epi")
                else:
                    read.advance(k_tiles)
                    release.advance(k_tiles)
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
            # Each accumulator element's (row, column) in the tile, as this thread holds it.
            tCcC = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((self.tile_n, TILE_V)))
            acc_mn = cute.make_tensor(acc.iterator, _acc_rows_cols(acc.layout))
            crd_mn = cute.make_tensor(tCcC.iterator, _acc_rows_cols(tCcC.layout))
            rows = cute.size(acc_mn, mode=[0])
            # Each row's target, its column in the tile and (folding) its reference, read before the main loop.
            target = cute.make_rmem_tensor((rows,), cutlass.Int64)
            t_col = cute.make_rmem_tensor((rows,), cutlass.Int32)
            refs = cute.make_rmem_tensor((rows,), cutlass.Float32) if cutlass.const_expr(key.fold) else None

            if cutlass.const_expr(key.store_z):
                sZ = storage.sZ.get_tensor(z_smem.outer, swizzle=z_smem.inner)
                gZ = cute.local_tile(mZ, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))
                store_op = sm90_utils.sm90_get_smem_store_op(LayoutEnum.ROW_MAJOR, elem_ty_d=self.z_dtype,
                                                             elem_ty_acc=cutlass.Float32)
                atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.z_dtype)
                r2s = cute.make_tiled_copy_S(store_op, cute.make_tiled_copy_C_atom(atom_c, tiled_mma))
                thr_r2s = r2s.get_slice(mma_tidx)
                tRS_sZ = thr_r2s.partition_D(sZ)
                tRS_acc = r2s.retile(acc)
                rz_shape = cute.shape(thr_r2s.partition_S(sZ))[:3]
                tRS_f32 = cute.make_rmem_tensor(rz_shape, cutlass.Float32)
                tRS_f16 = cute.make_rmem_tensor(rz_shape, self.z_dtype)
                per_epi = cute.size(tRS_f32)
                store_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=self.epi_stage,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_epi_threads))

            while work.is_valid_tile:
                coord = work.tile_idx
                m0 = coord[0] * self.tile_n
                n0 = coord[1] * TILE_V
                # The tile scheduler rounds the tile grid up to whole bands: such tiles write nothing.
                tile_ok = n0 < vocab
                for r in cutlass.range_constexpr(rows):
                    target[r] = mT[cutlass.min(m0 + crd_mn[r, 0][0], n - 1)]
                    t_col[r] = cutlass.Int32(target[r] - cutlass.Int64(n0))
                    if cutlass.const_expr(key.fold):
                        refs[r] = mRef[cutlass.min(m0 + crd_mn[r, 0][0], n - 1)]

                read.reset_count()
                release.reset_count()
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                if cutlass.const_expr(self.pingpong):
                    self._turn_wait(mma_wg, "mma")
                cute.nvgpu.warpgroup.fence()
                for k in range(k_tiles):
                    mainloop.consumer_wait(read)
                    for kb in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)],
                                  tCrB[(None, None, kb, read.index)], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    # Keep one WGMMA group in flight; the stage before it is free.
                    cute.nvgpu.warpgroup.wait_group(1)
                    if k > 0:
                        mainloop.consumer_release(release)
                        release.advance()
                    read.advance()
                if cutlass.const_expr(self.pingpong):  # the other warpgroup's WGMMAs queue behind these
                    self._turn_arrive(1 - mma_wg, "mma")
                cute.nvgpu.warpgroup.wait_group(0)
                mainloop.consumer_release(release)
                release.advance()
                if cutlass.const_expr(self.pingpong):
                    self._turn_wait(mma_wg, "epi")

                # The tile's partials; only the vocabulary's last tile masks its columns. A mask
                # on every tile held each element's column in a register (spills, and two compares
                # an element in an epilogue the tensor cores wait for).
                if n0 + TILE_V <= vocab:
                    self._row_partials(acc_mn, crd_mn, coord, n, vocab, target, t_col, refs, mBias, mP, mZY,
                                       scalars, lane, tile_ok, False)
                else:
                    self._row_partials(acc_mn, crd_mn, coord, n, vocab, target, t_col, refs, mBias, mP, mZY,
                                       scalars, lane, tile_ok, True)

                if cutlass.const_expr(key.store_z):
                    tiles_z = cute.zipped_divide(gZ[(None, None, *coord)], self.epi_tile)
                    bSG_sZ, bSG_gZ = cute.nvgpu.cpasync.tma_partition(
                        tma_z, 0, cute.make_layout(1), cute.group_modes(sZ, 0, 2), tiles_z)
                    epi_count = cute.size(tiles_z, mode=[1])
                    epi_shape = tiles_z.shape[1]
                    epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
                    # Ping-pong: every store of the previous tile has left shared memory (below).
                    done_before = 0 if cutlass.const_expr(self.pingpong) else sched.num_tiles_executed * epi_count
                    for e in cutlass.range_constexpr(epi_count):
                        for v in cutlass.range_constexpr(per_epi):
                            tRS_f32[v] = tRS_acc[e * per_epi + v]
                        tRS_f16.store(tRS_f32.load().to(self.z_dtype))
                        buf = (done_before + e) % self.epi_stage
                        cute.copy(r2s, tRS_f16, tRS_sZ[(None, None, None, buf)])
                        cute.arch.fence_proxy("async.shared", space="cta")
                        self.epi_barrier.arrive_and_wait()
                        if stores:
                            cute.copy(tma_z, bSG_sZ[(None, buf)], bSG_gZ[(None, epi_layout.get_hier_coord(e))])
                            store_pipe.producer_commit()
                            store_pipe.producer_acquire()
                        self.epi_barrier.arrive_and_wait()

                if cutlass.const_expr(self.pingpong):
                    # Both warpgroups store through the same shared buffers.
                    if cutlass.const_expr(key.store_z):
                        if stores:
                            store_pipe.producer_tail()
                    self._turn_arrive(1 - mma_wg, "epi")
                    read.advance(k_tiles)
                    release.advance(k_tiles)
                sched.advance_to_next_work(advance_count=2 if self.pingpong else 1)
                work = sched.get_current_work()
            if cutlass.const_expr(key.store_z):
                if stores:
                    store_pipe.producer_tail()

    @cute.jit
    def _row_partials(self, acc_mn: cute.Tensor, crd_mn: cute.Tensor, coord, n: cutlass.Int32,
                      vocab: cutlass.Int32, target: cute.Tensor, t_col: cute.Tensor, refs: cute.Tensor | None,
                      mBias: cute.Tensor | None, mP: cute.Tensor, mZY: cute.Tensor,
                      scalars: tuple[cutlass.Float32, cutlass.Float32, cutlass.Float32], lane: cutlass.Int32,
                      tile_ok: cutlass.Boolean, masked: cutlass.Constexpr):
        """One tile's epilogue over this thread's rows: the logits (transformed; ``-inf`` past the
        vocabulary where ``masked``), each row's partials written to ``mP``/``mZY``, and the
        accumulator overwritten with the tile to store (``z - m``, or ``exp(z - ref)`` folding)."""
        key = self.key
        m0 = coord[0] * self.tile_n
        n0 = coord[1] * TILE_V
        cols = cute.size(acc_mn, mode=[1])
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row = m0 + crd_mn[r, 0][0]
            mx = cutlass.Float32(-math.inf)
            for c in cutlass.range_constexpr(cols):
                # The element's column only where a mask or the bias reads it.
                col = n0 + crd_mn[r, c][1] if cutlass.const_expr(masked or key.has_bias) else n0
                z = self._logit(acc_mn[r, c], col, mBias, vocab, scalars)
                if cutlass.const_expr(masked):
                    if col >= vocab:
                        z = cutlass.Float32(-math.inf)
                acc_mn[r, c] = z
                mx = cute.arch.fmax(mx, z)
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            # The target's logit, read only by the threads whose columns hold it (rarely a whole warp).
            zy = cutlass.Float32(0.0)
            if t_col[r] >= 0 and t_col[r] < TILE_V:
                for c in cutlass.range_constexpr(cols):
                    if crd_mn[r, c][1] == t_col[r]:
                        zy = acc_mn[r, c]
            mx_log2 = mx * LOG2_E
            scale = cutlass.Float32(1.0)
            if cutlass.const_expr(key.fold):  # q = e^(z - mx) e^(mx - ref) (ops.triton_shared.prob_tile)
                shift = mx - refs[r]
                if shift > EXP_CLAMP:
                    shift = cutlass.Float32(EXP_CLAMP)
                scale = cute.math.exp2(shift * LOG2_E, fastmath=True)
            se = cutlass.Float32(0.0)
            sez = cutlass.Float32(0.0)
            sz = cutlass.Float32(0.0)
            ssq = cutlass.Float32(0.0)
            for c in cutlass.range_constexpr(cols):
                z = acc_mn[r, c]
                e = cute.math.exp2(z * LOG2_E - mx_log2, fastmath=True)
                se = se + e
                if cutlass.const_expr(key.want_sum_sq):  # padding: e = 0, so e² adds nothing
                    ssq = ssq + e * e
                if cutlass.const_expr(masked):  # -inf padding: e = 0 but e * z is nan
                    if n0 + crd_mn[r, c][1] < vocab:
                        if cutlass.const_expr(key.want_entropy):
                            sez = sez + e * z
                        if cutlass.const_expr(key.want_sum_z):
                            sz = sz + z
                else:
                    if cutlass.const_expr(key.want_entropy):
                        sez = sez + e * z
                    if cutlass.const_expr(key.want_sum_z):
                        sz = sz + z
                if cutlass.const_expr(key.store_z):
                    if cutlass.const_expr(key.fold):
                        acc_mn[r, c] = e * scale
                    else:
                        acc_mn[r, c] = z - mx
            for off in cutlass.range_constexpr(1, 3):
                se = se + cute.arch.shuffle_sync_bfly(se, offset=off)
                zy = zy + cute.arch.shuffle_sync_bfly(zy, offset=off)
                if cutlass.const_expr(key.want_entropy):
                    sez = sez + cute.arch.shuffle_sync_bfly(sez, offset=off)
                if cutlass.const_expr(key.want_sum_z):
                    sz = sz + cute.arch.shuffle_sync_bfly(sz, offset=off)
                if cutlass.const_expr(key.want_sum_sq):
                    ssq = ssq + cute.arch.shuffle_sync_bfly(ssq, offset=off)
            if lane % 4 == 0 and row < n and tile_ok:
                mP[0, coord[1], row] = mx
                mP[1, coord[1], row] = se
                if cutlass.const_expr(key.want_entropy):
                    mP[2, coord[1], row] = sez
                if cutlass.const_expr(key.want_sum_z):
                    mP[2 + int(key.want_entropy), coord[1], row] = sz
                if cutlass.const_expr(key.want_sum_sq):
                    mP[2 + int(key.want_entropy) + int(key.want_sum_z), coord[1], row] = ssq
                if t_col[r] >= 0 and t_col[r] < TILE_V and target[r] < cutlass.Int64(vocab):
                    mZY[row] = zy
                # A target outside [0, V) gets 0 from the first tile: no zero-filled buffer.
                if coord[1] == 0 and (target[r] < 0 or target[r] >= cutlass.Int64(vocab)):
                    mZY[row] = cutlass.Float32(0.0)

    # Ping-pong turns: named barriers 2, 3 (main loop) and 4, 5 (epilogue) of both warpgroups'
    # 256 threads; a warpgroup waits on its own and arrives on the other's (as CUTLASS's
    # OrderedSequenceBarrier and QuACK's pingpong barriers).
    def _turn_wait(self, mma_wg, stage: str) -> None:
        cute.arch.barrier(barrier_id=(2 if stage == "mma" else 4) + mma_wg, number_of_threads=256)

    def _turn_arrive(self, mma_wg, stage: str) -> None:
        cute.arch.barrier_arrive(barrier_id=(2 if stage == "mma" else 4) + mma_wg, number_of_threads=256)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


@functools.cache
def _max_active_clusters() -> int:
    return cutlass.utils.HardwareInfo().get_max_active_clusters(2)


_compiled: dict[KernelKey, object] = {}
# The byte alignment TMA and the epilogue assume of each tensor argument, in order.
_ALIGN = (16, 16, 16, 4, 8, 16, 4, 4)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t [rows, K]`` as TMA reads it: 16-byte aligned base and row stride, unit stride along ``K``,
    rows that do not overlap (a zero-padded copy otherwise: zero columns add nothing to a dot product;
    an expanded weight of stride 0 becomes a real one)."""
    if (t.stride(1) == 1 and t.stride(0) >= t.shape[1] and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0):
        return t
    k = -(-t.shape[1] // 8) * 8
    out = torch.zeros((t.shape[0], k), dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out


def _cute(t: torch.Tensor | None, align: int):
    if t is None:
        return None
    return from_dlpack(t, assumed_align=align, enable_tvm_ffi=_TVM_FFI).mark_layout_dynamic()


def _dsl_args(tensors: tuple, scalars: tuple) -> tuple:
    """The kernel's arguments as CuTe DSL's own types: what ``cute.compile`` traces, and what the
    DLPack launch passes."""
    return (*map(_cute, tensors, _ALIGN), tuple(map(cutlass.Float32, scalars)))


def z_buffer(n: int, vocab: int, device: torch.device, fold: bool = False) -> torch.Tensor:
    """An ``[n, V]`` fp16 (``fold``: bf16) view whose rows start 16-byte aligned (``V`` padded to a
    multiple of 8), as :func:`launch_forward` stores into."""
    dtype = torch.bfloat16 if fold else torch.float16
    return torch.empty((n, -(-vocab // 8) * 8), dtype=dtype, device=device)[:, :vocab]


# The schedule of each kernel (``scripts/gpu_cute_schedules.py`` compares them through the bench):
# cooperative for both. Where the tile is stored, ping-pong overlaps the longer epilogue, but its
# 64-row tiles feed the tensor cores less well: through the bench it was 3-8% slower on an H100
# and within 1-2% on an H200 (benchmarks/NOTES-h100.md, sessions 17-18).
PINGPONG_STORING, PINGPONG_STATS = False, False


def launch_forward(ops: TileOperands, want: StatRequest, fp32_logits: bool,
                   z_out: torch.Tensor | None, pingpong: bool | None = None) -> dict[str, torch.Tensor]:
    """Per-tile partial statistics of ``ops.hidden`` against ``ops.weight`` (bf16/fp16), and
    optionally the centred fp16 logits: the outputs of
    :func:`logitless.ops.gemm_backend.kernels.launch_forward`, with ``TILE_V``-wide tiles.

    Args:
        ops: :class:`~logitless.ops.triton_shared.tile_gemm.TileOperands` (``targets`` int64).
        want: :class:`~logitless.ops.contract.StatRequest`: whether ``sez``/``sz``/``ssq`` are computed.
        fp32_logits: statistics from the fp32 accumulator (else from it rounded to the input dtype first).
        z_out: ``[n, V]`` from :func:`z_buffer`: fp16, overwritten with ``z - m`` of each tile, or bf16,
            with ``exp(z - ref)`` (:mod:`logitless.ops.triton_shared.prob_tile`); ``None``: nothing stored.
        pingpong: the ping-pong schedule (else the cooperative one); ``None``: :data:`PINGPONG_STORING`
            or :data:`PINGPONG_STATS`.

    Returns:
        ``{"m", "se", "zy"[, "sez"][, "sz"][, "ssq"][, "ref"]}``: fp32 ``[tiles, n]`` buffers (``zy``,
        ``ref``: ``[1, n]``; ``ssq = Σ exp(2 (z - m))``; ``ref`` with a bf16 ``z_out``).
    """
    hidden, weight, bias, targets, transform = ops
    n, vocab = hidden.shape[0], weight.shape[0]
    assert hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)
    assert z_out is None or (z_out.dtype in (torch.float16, torch.bfloat16) and z_out.shape == (n, vocab)
                             and z_out.stride(1) == 1 and (z_out.stride(0) * 2) % 16 == 0
                             and z_out.data_ptr() % 16 == 0)
    if pingpong is None:
        pingpong = PINGPONG_STORING if z_out is not None else PINGPONG_STATS
    tiles = -(-vocab // TILE_V)
    entropy, sum_z, sum_sq = want.entropy, want.sum_z, want.sum_sq
    out, stacked = tile_partials(want, tiles, n, hidden.device)
    fold = z_out is not None and z_out.dtype == torch.bfloat16
    if fold:
        out["ref"] = reference(ops)[None]
    if n == 0 or vocab == 0:
        return out
    hidden, weight = _aligned(hidden), _aligned(weight)
    key = KernelKey(hidden.get_device(), hidden.dtype, entropy, sum_z, sum_sq, z_out is not None, fold,
                    bias is not None,
                    transform.logit_scale != 1.0, transform.softcap is not None, transform.temperature != 1.0,
                    not fp32_logits,
                    # raster_along_m, measured on one H200 (8192 tokens): along the vocabulary for
                    # Llama-3's 4096-wide head (1.01x cuBLAS, 1.08x the other way), along the tokens for
                    # Gemma-2's 2304-wide one (1.06x, 1.12x the other way).
                    hidden.shape[1] < 3072, pingpong)
    tensors = tuple(None if t is None else t.detach() for t in (  # (DLPack exports no tensor that requires grad)
        hidden.unsqueeze(-1), weight.unsqueeze(-1), None if z_out is None else z_out.unsqueeze(-1),
        None if bias is None else bias.float().contiguous(), targets.contiguous(), stacked, out["zy"].view(n),
        out["ref"].view(n) if fold else None))
    scalars = (transform.logit_scale, transform.softcap or 1.0, 1.0 / transform.temperature)
    stream = torch.cuda.current_stream(hidden.device).cuda_stream
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = cute.compile(
            StatsGemm(key), *_dsl_args(tensors, scalars), _max_active_clusters(), cuda.CUstream(stream),
            **({"options": "--enable-tvm-ffi"} if _TVM_FFI else {}))
    if _TVM_FFI:
        kernel(*tensors, scalars, stream)
    else:
        kernel(*_dsl_args(tensors, scalars), cuda.CUstream(stream))
    return out
