"""The CuTe DSL ``d weight`` GEMM of a pass of several token chunks (Hopper, sm90): ``hi + lo (+)=
dyᵀ @ hidden`` into the bf16 pair of :mod:`logitless.ops.triton_shared.weight_grad` (same
arithmetic: the fp32 product of the chunk plus the pair's sum, split again into the nearest bf16
and its residual), in a persistent, warp-specialized ping-pong WGMMA kernel.

Why: the pair's read and write (8 bytes an element of ``d weight`` per chunk) is the epilogue of
every tile. The Triton kernel runs it after the tile's main loop, with the tensor cores idle; here
the two consumer warpgroups take alternate ``64 x 256`` tiles and turns (as the statistics GEMM's
ping-pong schedule, :mod:`.kernels`), so one's epilogue runs under the other's main loop.

Operands as they lie in memory, no transposed copy: ``A = dyᵀ`` (``[V, n]``, ``V`` contiguous: the
M-major operand) and ``B = hiddenᵀ`` (``[H, n]``, ``H`` contiguous: N-major), tokens along K. The
epilogue reads and writes the pair in place, two columns (32 bits) at a time, from the WGMMA
accumulator's own layout. Takes ``V`` a multiple of 64 and ``H`` of 256 (:func:`takes`); the
Triton kernel serves the rest.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass._mlir.extras import types as T
from cutlass._mlir_helpers.arith import bitcast
from cutlass.cute.runtime import from_dlpack
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ..triton_shared.weight_grad import launch_weight_grad

TILE_M, TILE_N, TILE_K = 64, 256, 64  # vocabulary rows x hidden columns of d weight, tokens a step


class KernelKey(NamedTuple):
    device: int
    first: bool  # store the pair (not read: uninitialized before), else add to it
    pingpong: bool  # each warpgroup its own 64 x 256 tile, taking turns; else both on one 128 x 256
    raster_along_m: bool


def takes(dy: torch.Tensor, hidden: torch.Tensor, hi: torch.Tensor) -> bool:
    """Whether this kernel serves these operands: bf16, whole tiles (``V % 64 == 0``,
    ``H % 256 == 0``), unit stride along ``V``/``H`` and 16-byte aligned rows (TMA)."""
    def aligned(t: torch.Tensor) -> bool:
        return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0

    return (dy.dtype == hidden.dtype == hi.dtype == torch.bfloat16 and dy.shape[1] % TILE_M == 0
            and hidden.shape[1] % TILE_N == 0 and aligned(dy) and aligned(hidden) and hi.is_contiguous())


class PairWeightGrad:
    """The kernel for one :class:`KernelKey`. ``__call__`` takes ``a [V, n, 1]`` (``dyᵀ``),
    ``b [H, n, 1]`` (``hiddenᵀ``), both bf16 with unit stride along their first mode, and the
    pair ``hi``, ``lo`` as ``[V, H / 2]`` int32 (two bf16 columns a word)."""

    def __init__(self, key: KernelKey):
        self.key = key
        self.tile_m = TILE_M if key.pingpong else 2 * TILE_M
        self.tile_mnk = (self.tile_m, TILE_N, TILE_K)
        self.cluster_mn = (2, 1)  # B (the hidden block) multicast to the two vocabulary tiles' CTAs
        self.threads_per_cta = 3 * 128  # a producer warpgroup, two consumer warpgroups

    def _setup(self) -> None:
        mn = LayoutEnum.COL_MAJOR  # A M-major, B N-major
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.a_dtype, mn.sm90_mma_major_mode(), mn.sm90_mma_major_mode(), cutlass.Float32,
            (1 if self.key.pingpong else 2, 1, 1), tiler_mn=(TILE_M, TILE_N))
        self.cta_layout_mnk = cute.make_layout((*self.cluster_mn, 1))
        stage_bytes = (self.tile_m + TILE_N) * TILE_K * self.a_dtype.width // 8
        self.ab_stage = (utils.get_smem_capacity_in_bytes("sm_90") - 1024) // stage_bytes

        def staged(rows: int) -> cute.ComposedLayout:
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(mn, self.a_dtype, rows), self.a_dtype)
            return cute.tile_to_shape(atom, (rows, TILE_K, self.ab_stage), order=(1, 0, 2))

        self.a_smem = staged(self.tile_m)
        self.b_smem = staged(TILE_N)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor,
                 max_active_clusters: cutlass.Constexpr, stream: cuda.CUstream):
        self.a_dtype = a.element_type
        self._setup()

        def tma_load(tensor, smem_staged, rows, mcast):
            op = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if mcast == 1
                  else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
            return cute.nvgpu.cpasync.make_tiled_tma_atom(op, tensor, cute.slice_(smem_staged, (None, None, 0)),
                                                          (rows, TILE_K), num_multicast=mcast)

        tma_a, g_a = tma_load(a, self.a_smem, self.tile_m, self.cluster_mn[1])
        tma_b, g_b = tma_load(b, self.b_smem, TILE_N, self.cluster_mn[0])
        tiles_mnl = (cute.ceil_div(a.shape[0], self.tile_m), cute.ceil_div(b.shape[0], TILE_N), 1)
        # Along the hidden columns first: the tiles of one vocabulary block read its dyᵀ rows
        # from L2 after the first; the hidden operand (n x H) stays in L2 throughout.
        sched = utils.PersistentTileSchedulerParams(tiles_mnl, (*self.cluster_mn, 1), 8, self.key.raster_along_m)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_active_clusters)

        @cute.struct
        class SharedStorage:
            pipe: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.b_smem)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, g_a, tma_b, g_b, hi, lo, a.shape[0], b.shape[0], self.tiled_mma, self.cta_layout_mnk,
                    self.a_smem, self.b_smem, sched).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(*self.cluster_mn, 1), min_blocks_per_mp=1,
            stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               mHi: cute.Tensor, mLo: cute.Tensor, rows_m: cutlass.Int32, cols_n: cutlass.Int32,
               tiled_mma: cute.TiledMma, cta_layout_mnk: cute.Layout, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, sched_params: utils.PersistentTileSchedulerParams):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        tma_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0)))
                     + cute.size_in_bytes(self.a_dtype, cute.slice_(b_smem, (None, None, 0))))

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        # A stage is released by each consumer warp that reads it, in both CTAs B is multicast to.
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
        mma_wg = wg - 1
        pingpong = self.key.pingpong
        # Within the tiled MMA: a ping-pong warpgroup is the whole of it; a cooperative one, its half.
        mma_tidx = (tidx - 128) % cute.size(tiled_mma)
        # WGMMA reads its operands per warpgroup: the operand slice is the warpgroup's.
        thr_mma = tiled_mma.get_slice(mma_tidx - mma_tidx % 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, TILE_N)), cutlass.Float32)
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
            # The producer loads the tiles in the scheduler's order; the warpgroups take alternate ones.
            if cutlass.const_expr(pingpong):
                if mma_wg == 0:
                    self._turn_arrive(0, "mma")
                    self._turn_arrive(0, "epi")
                else:
                    read.advance(k_tiles)
                    release.advance(k_tiles)
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
            # Each accumulator element's (row, column) in the tile, as this thread holds it: mode 0
            # is (column pair, row half, 8-column group), so ((None, r, j), 0, 0) is two adjacent columns.
            crd = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((self.tile_m, TILE_N)))
            groups = cute.size(acc, mode=[0, 2])

            while work.is_valid_tile:
                coord = work.tile_idx
                m0 = coord[0] * self.tile_m
                n0 = coord[1] * TILE_N
                read.reset_count()
                release.reset_count()
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                if cutlass.const_expr(pingpong):
                    self._turn_wait(mma_wg, "mma")
                cute.nvgpu.warpgroup.fence()
                for k in range(k_tiles):
                    mainloop.consumer_wait(read)
                    for kb in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)],
                                  tCrB[(None, None, kb, read.index)], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)
                    if k > 0:
                        mainloop.consumer_release(release)
                        release.advance()
                    read.advance()
                if cutlass.const_expr(pingpong):  # the other warpgroup's WGMMAs queue behind these
                    self._turn_arrive(1 - mma_wg, "mma")
                cute.nvgpu.warpgroup.wait_group(0)
                mainloop.consumer_release(release)
                release.advance()
                if cutlass.const_expr(pingpong):
                    self._turn_wait(mma_wg, "epi")

                # The scheduler rounds the tile grid up to whole bands: such tiles write nothing.
                if m0 < rows_m and n0 < cols_n:
                    for mm, r, j in itertools.product(range(cute.size(acc, mode=[1])), range(2), range(groups)):
                        row = m0 + crd[(0, r, j), mm, 0][0]
                        word = (n0 + crd[(0, r, j), mm, 0][1]) // 2
                        s0 = acc[(0, r, j), mm, 0]
                        s1 = acc[(1, r, j), mm, 0]
                        if cutlass.const_expr(not self.key.first):
                            h_bits = cutlass.Uint32(mHi[row, word])
                            l_bits = cutlass.Uint32(mLo[row, word])
                            s0 = s0 + _low_bf16(h_bits) + _low_bf16(l_bits)
                            s1 = s1 + _high_bf16(h_bits) + _high_bf16(l_bits)
                        h0 = _nearest_bf16_bits(s0)
                        h1 = _nearest_bf16_bits(s1)
                        r0 = _nearest_bf16_bits(s0 - _as_f32(h0))
                        r1 = _nearest_bf16_bits(s1 - _as_f32(h1))
                        mHi[row, word] = cutlass.Int32((h0 >> 16) | h1)
                        mLo[row, word] = cutlass.Int32((r0 >> 16) | r1)

                if cutlass.const_expr(pingpong):
                    self._turn_arrive(1 - mma_wg, "epi")
                    read.advance(k_tiles)
                    release.advance(k_tiles)
                sched.advance_to_next_work(advance_count=2 if pingpong else 1)
                work = sched.get_current_work()

    def _turn_wait(self, mma_wg, stage: str) -> None:
        cute.arch.barrier(barrier_id=(2 if stage == "mma" else 4) + mma_wg, number_of_threads=256)

    def _turn_arrive(self, mma_wg, stage: str) -> None:
        cute.arch.barrier_arrive(barrier_id=(2 if stage == "mma" else 4) + mma_wg, number_of_threads=256)


@dsl_user_op
def _as_f32(bits: cutlass.Uint32, *, loc=None, ip=None) -> cutlass.Float32:
    """The fp32 whose bit pattern is ``bits``."""
    return cutlass.Float32(bitcast(cutlass.Uint32(bits).ir_value(loc=loc, ip=ip), T.f32()))


@dsl_user_op
def _bits(x: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Uint32:
    """The bit pattern of fp32 ``x``."""
    return cutlass.Uint32(bitcast(cutlass.Float32(x).ir_value(loc=loc, ip=ip), T.i32()))


def _low_bf16(word: cutlass.Uint32) -> cutlass.Float32:
    """The bf16 in the low half of ``word`` (the even column), as fp32."""
    return _as_f32(word << 16)


def _high_bf16(word: cutlass.Uint32) -> cutlass.Float32:
    """The bf16 in the high half of ``word`` (the odd column), as fp32."""
    return _as_f32(word & cutlass.Uint32(0xFFFF0000))


def _nearest_bf16_bits(x: cutlass.Float32) -> cutlass.Uint32:
    """``x`` rounded to the nearest bf16 (ties to even), as fp32 bits with a zero low half (the
    Triton kernel's rounding; finite inputs)."""
    bits = _bits(x)
    return (bits + cutlass.Uint32(0x7FFF) + ((bits >> 16) & cutlass.Uint32(1))) & cutlass.Uint32(0xFFFF0000)


@functools.cache
def _max_active_clusters() -> int:
    return cutlass.utils.HardwareInfo().get_max_active_clusters(2)


_compiled: dict[KernelKey, object] = {}


PINGPONG, RASTER_ALONG_M = True, False


def launch_pair_grad(dy: torch.Tensor, hidden: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, first: bool,
                     pingpong: bool | None = None, raster_along_m: bool | None = None) -> None:
    """``hi + lo (+)= dyᵀ @ hidden``, the contract of
    :func:`logitless.ops.triton_shared.weight_grad.launch_weight_grad` (which runs the operands
    :func:`takes` refuses, and an empty chunk)."""
    if dy.shape[0] == 0 or dy.shape[1] == 0 or not takes(dy, hidden, hi):
        launch_weight_grad(dy, hidden, hi, lo, first)
        return
    assert lo.shape == hi.shape and lo.is_contiguous() and hidden.shape[0] == dy.shape[0]

    def operand(t: torch.Tensor):  # [rows, K] as [K-major cols, rows, 1]: unit stride along mode 0
        return from_dlpack(t.t().unsqueeze(-1), assumed_align=16).mark_layout_dynamic(leading_dim=0)

    def pair(t: torch.Tensor):
        return from_dlpack(t.view(torch.int32), assumed_align=16).mark_layout_dynamic(leading_dim=1)

    key = KernelKey(dy.get_device(), first, PINGPONG if pingpong is None else pingpong,
                    RASTER_ALONG_M if raster_along_m is None else raster_along_m)
    args = (operand(dy), operand(hidden), pair(hi), pair(lo))
    stream = cuda.CUstream(torch.cuda.current_stream(dy.device).cuda_stream)
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = cute.compile(PairWeightGrad(key), *args, _max_active_clusters(), stream)
    kernel(*args, stream)
