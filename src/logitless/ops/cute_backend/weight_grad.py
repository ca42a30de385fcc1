"""The CuTe DSL ``d weight`` pair GEMM (Hopper, sm90): ``pair (+)= dyᵀ @ hidden`` over one token
chunk, the pair being the bf16 result and its int8 residual of
:mod:`logitless.ops.triton_shared.weight_grad` (same format, same arithmetic: that module's
docstring says why the pair, and its Triton kernel is the specification).

The Triton kernel runs its epilogue (reading the pair, adding, splitting, storing) after each
tile's main loop, while the tensor cores wait. Here two consumer warpgroups take turns
(CUTLASS's ping-pong schedule, as :class:`~logitless.ops.cute_backend.kernels.StatsGemm` can):
one's epilogue runs under the other's main loop, so the pair's reads and writes overlap the
GEMM.

* Operands: ``dy [n, V]`` and ``hidden [n, H]`` as they lie, read through TMA as the MN-major
  ``dyᵀ [V, n]`` and ``hiddenᵀ [H, n]`` (the tokens are the reduction); one producer warp fills a
  ring of shared-memory stages, the hidden block multicast across a cluster of two CTAs along
  the vocabulary.
* Epilogue: each thread reads the pair at its accumulator elements straight from global memory
  (pairs of adjacent columns, vectorized: ``H`` is a compile-time constant, so rows are aligned),
  adds, splits and writes back. No shared memory: the stages keep all of it.
* Tiles: ``64 x 256`` (``[vocabulary rows, hidden columns]``) a warpgroup; the launcher takes
  the Triton kernel where ``V`` is not a multiple of 128 or ``H`` of 256.

Not called by the engine: on one H200 it ran slower than the Triton kernel (Gemma-2's head,
2048-token chunk, adding: 5.22 ms ping-pong, 5.55 cooperative, against 4.90; storing without a
read 4.74 against 4.12: the main loop, not the epilogue; benchmarks/NOTES-h100.md, session 27).

Adapted from the Hopper persistent dense GEMM of CUTLASS's CuTe DSL examples
(``examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/dense_gemm_persistent.py``,
BSD-3-Clause, NVIDIA), as :mod:`.kernels` is.
"""

from __future__ import annotations

from typing import NamedTuple

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

from .kernels import max_active_clusters

TILE_H = 256  # hidden columns of a tile
TILE_K = 64  # tokens of a main-loop step
ROUND = 12582912.0  # 1.5 * 2**23: adding then taking it away rounds an fp32 of magnitude < 2**22 to an integer


class PairKey(NamedTuple):
    """What a compiled pair kernel is specialized on (``hidden_size`` static: the pair's rows are
    then provably aligned for vector loads)."""

    device: int
    hidden_size: int
    first: bool  # the pair is not read (uninitialized): the product is stored
    last: bool  # the residual is not written (no later chunk reads it)
    pingpong: bool


class PairGemm:
    """The kernel for one :class:`PairKey`. ``__call__`` takes ``dy_t [V, n, 1]`` and
    ``hidden_t [H, n, 1]`` (bf16, unit stride along ``V``/``H``), ``hi [V, H]`` bf16 and
    ``lo [V, H]`` int8 (contiguous rows of ``H``)."""

    def __init__(self, key: PairKey):
        self.key = key
        self.pingpong = key.pingpong
        self.tile_m = 64 if key.pingpong else 128
        self.tile_mnk = (self.tile_m, TILE_H, TILE_K)
        self.cluster_mn = (2, 1)
        self.num_mma_wg = 2
        self.threads_per_cta = (1 + self.num_mma_wg) * 128

    def _setup(self) -> None:
        mn_major = LayoutEnum.COL_MAJOR  # dyᵀ is M-major, hiddenᵀ N-major
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.a_dtype, mn_major.sm90_mma_major_mode(), mn_major.sm90_mma_major_mode(),
            cutlass.Float32, (self.tile_m // 64, 1, 1), tiler_mn=(64, TILE_H))
        self.cta_layout_mnk = cute.make_layout((*self.cluster_mn, 1))
        ab_bytes = (self.tile_m + TILE_H) * TILE_K * self.a_dtype.width // 8
        self.ab_stage = (utils.get_smem_capacity_in_bytes("sm_90") - 1024) // ab_bytes
        self.a_smem = sm90_utils.make_smem_layout_a(mn_major, self.tile_mnk, self.a_dtype, self.ab_stage)
        self.b_smem = sm90_utils.make_smem_layout_b(mn_major, self.tile_mnk, self.a_dtype, self.ab_stage)

    @cute.jit
    def __call__(self, dy_t: cute.Tensor, hidden_t: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor,
                 max_clusters: cutlass.Constexpr, stream: cuda.CUstream):
        self.a_dtype = dy_t.element_type
        self._setup()

        def tma_load(tensor, smem_staged, rows, mcast):
            op = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if mcast == 1
                  else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
            return cute.nvgpu.cpasync.make_tiled_tma_atom(op, tensor, cute.slice_(smem_staged, (None, None, 0)),
                                                          (rows, TILE_K), num_multicast=mcast)

        tma_a, g_a = tma_load(dy_t, self.a_smem, self.tile_m, self.cluster_mn[1])
        tma_b, g_b = tma_load(hidden_t, self.b_smem, TILE_H, self.cluster_mn[0])
        vocab = dy_t.shape[0]
        # The pair with its row stride static (rows of H elements).
        rows = cute.make_layout((vocab, self.key.hidden_size), stride=(self.key.hidden_size, 1))
        m_hi = cute.make_tensor(hi.iterator, rows)
        m_lo = cute.make_tensor(lo.iterator, rows)
        tiles_mnl = (cute.ceil_div(vocab, self.tile_m), self.key.hidden_size // TILE_H, 1)
        # Along the hidden columns: a band's dyᵀ rows stay in L2 (along the vocabulary: 3-4x slower).
        sched = utils.PersistentTileSchedulerParams(tiles_mnl, (*self.cluster_mn, 1), 8, False)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_clusters)

        @cute.struct
        class SharedStorage:
            pipe: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.b_smem)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, g_a, tma_b, g_b, m_hi, m_lo, vocab, self.tiled_mma, self.cta_layout_mnk,
                    self.a_smem, self.b_smem, sched).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(*self.cluster_mn, 1), min_blocks_per_mp=1,
            stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               m_hi: cute.Tensor, m_lo: cute.Tensor, vocab: cutlass.Int32, tiled_mma: cute.TiledMma,
               cta_layout_mnk: cute.Layout, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               sched_params: utils.PersistentTileSchedulerParams):
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
        mma_tidx = (tidx - 128) % cute.size(tiled_mma)
        thr_mma = tiled_mma.get_slice(mma_tidx - mma_tidx % 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, TILE_H)), cutlass.Float32)
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
            if cutlass.const_expr(self.pingpong):
                if mma_wg == 0:
                    self._turn_arrive(0, "mma")
                    self._turn_arrive(0, "epi")
                else:
                    read.advance(k_tiles)
                    release.advance(k_tiles)
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
            thr_epi = tiled_mma.get_slice(mma_tidx)
            g_hi = cute.local_tile(m_hi, (self.tile_m, TILE_H), (None, None))
            g_lo = cute.local_tile(m_lo, (self.tile_m, TILE_H), (None, None))
            r_hi = cute.make_rmem_tensor_like(thr_epi.partition_C(g_hi[(None, None, 0, 0)]))
            r_lo = cute.make_rmem_tensor_like(thr_epi.partition_C(g_lo[(None, None, 0, 0)]))

            while work.is_valid_tile:
                coord = work.tile_idx
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
                    cute.nvgpu.warpgroup.wait_group(1)
                    if k > 0:
                        mainloop.consumer_release(release)
                        release.advance()
                    read.advance()
                if cutlass.const_expr(self.pingpong):
                    self._turn_arrive(1 - mma_wg, "mma")
                cute.nvgpu.warpgroup.wait_group(0)
                mainloop.consumer_release(release)
                release.advance()
                if cutlass.const_expr(self.pingpong):
                    self._turn_wait(mma_wg, "epi")

                # The scheduler rounds the tile grid up to whole bands: such tiles write nothing
                # (a column past H would land in the next row).
                if coord[0] * self.tile_m < vocab and coord[1] * TILE_H < self.key.hidden_size:
                    t_hi = thr_epi.partition_C(g_hi[(None, None, coord[0], coord[1])])
                    t_lo = thr_epi.partition_C(g_lo[(None, None, coord[0], coord[1])])
                    if cutlass.const_expr(not self.key.first):
                        cute.autovec_copy(t_hi, r_hi)
                        cute.autovec_copy(t_lo, r_lo)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        total = acc[i]
                        if cutlass.const_expr(not self.key.first):
                            total = total + _pair_sum(r_hi[i], r_lo[i])
                        r_hi[i], r_lo[i] = _split(total)
                    cute.autovec_copy(r_hi, t_hi)
                    if cutlass.const_expr(not self.key.last):
                        cute.autovec_copy(r_lo, t_lo)

                if cutlass.const_expr(self.pingpong):
                    self._turn_arrive(1 - mma_wg, "epi")
                    read.advance(k_tiles)
                    release.advance(k_tiles)
                sched.advance_to_next_work(advance_count=2 if self.pingpong else 1)
                work = sched.get_current_work()

    # Ping-pong turns: named barriers 2, 3 (main loop) and 4, 5 (epilogue), as in StatsGemm.
    def _turn_wait(self, mma_wg, stage: str) -> None:
        cute.arch.barrier(barrier_id=(2 if stage == "mma" else 4) + mma_wg, number_of_threads=256)

    def _turn_arrive(self, mma_wg, stage: str) -> None:
        cute.arch.barrier_arrive(barrier_id=(2 if stage == "mma" else 4) + mma_wg, number_of_threads=256)


@cute.jit
def _unit_biased(hi_f32: cutlass.Float32) -> tuple[cutlass.Int32, cutlass.Int32]:
    """``(biased exponent of the residual's unit, biased exponent of hi)``: the unit is
    ``2**(e - 14)`` for ``hi``'s binary exponent ``e``, or ``2**-126`` below ``|hi| = 2**-112``."""
    biased = (hi_f32.bitcast(cutlass.Int32) >> 23) & 0xFF
    return cutlass.max(biased, 15) - 14, biased


@cute.jit
def _pair_sum(hi: cutlass.BFloat16, lo: cutlass.Int8) -> cutlass.Float32:
    """The fp32 value of the pair ``(hi, lo)``."""
    hi_f32 = hi.to(cutlass.Float32)
    unit, _ = _unit_biased(hi_f32)
    return hi_f32 + lo.to(cutlass.Float32) * (unit << 23).bitcast(cutlass.Float32)


@cute.jit
def _split(total: cutlass.Float32) -> tuple[cutlass.BFloat16, cutlass.Int8]:
    """fp32 ``total`` as the pair: ``hi`` the nearest bf16, ``lo`` the residual in units, rounded
    to nearest (0 where ``hi`` is not finite)."""
    hi = total.to(cutlass.BFloat16)
    hi_f32 = hi.to(cutlass.Float32)
    unit, biased = _unit_biased(hi_f32)
    inverse = ((254 - unit) << 23).bitcast(cutlass.Float32)  # 1 / unit, a power of two
    # total - hi is exact and at most 64 units, so the product is exact.
    count = ((total - hi_f32) * inverse + ROUND) - ROUND
    count = cutlass.Float32(cutlass.select_(biased != 0xFF, count, cutlass.Float32(0.0)))
    return hi, count.to(cutlass.Int8)


_compiled: dict[PairKey, object] = {}


def supports(dy: torch.Tensor, hidden: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> bool:
    """Whether :func:`launch_weight_grad` takes these operands: whole tiles (``V`` a multiple of
    128, ``H`` of 256), contiguous pair rows, 16-byte aligned TMA rows."""
    vocab, hidden_size = hi.shape
    return (dy.is_cuda and vocab % 128 == 0 and hidden_size % TILE_H == 0
            and hi.stride() == lo.stride() == (hidden_size, 1)
            and all(t.data_ptr() % 16 == 0 for t in (dy, hidden, hi, lo))
            and all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (dy, hidden)))


PINGPONG = True


def launch_weight_grad(dy: torch.Tensor, hidden: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, first: bool,
                       last: bool = False) -> None:
    """``pair (+)= dyᵀ @ hidden``: the contract of
    :func:`logitless.ops.triton_shared.weight_grad.launch_weight_grad` for operands that
    :func:`supports` (``n > 0``)."""
    key = PairKey(dy.get_device(), hi.shape[1], first, last, PINGPONG)
    args = (from_dlpack(dy.detach().t().unsqueeze(-1), assumed_align=16).mark_layout_dynamic(leading_dim=0),
            from_dlpack(hidden.detach().t().unsqueeze(-1), assumed_align=16).mark_layout_dynamic(leading_dim=0),
            from_dlpack(hi.detach(), assumed_align=16).mark_layout_dynamic(leading_dim=1),
            from_dlpack(lo.detach(), assumed_align=16).mark_layout_dynamic(leading_dim=1))
    stream = cuda.CUstream(torch.cuda.current_stream(dy.device).cuda_stream)
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = cute.compile(PairGemm(key), *args, max_active_clusters(), stream)
    kernel(*args, stream)
