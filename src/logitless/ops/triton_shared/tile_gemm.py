"""Triton tile-GEMM helpers shared by the kernels that compute logits tiles with ``tl.dot``
(:mod:`.flash_kernels`, :mod:`.gemm_kernels`): launch shapes, program ordering, operand loads
through tensor descriptors (the Hopper copy engine) or pointers, the tile GEMM itself, a tile's
head logits (bias and transform applied) and its ``dL/dz``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..transform import LogitTransform
from .common import interpreting, to_logits

if TYPE_CHECKING:
    from ..contract import ChunkRows, LocalHead, StartedRows, StatRequest


class TileOperands(NamedTuple):
    """One head's side of a forward launch: ``hidden [n, H]`` and ``weight [V, H]`` (bf16/fp16/fp32,
    same dtype, unit stride along ``H``), ``bias [V]`` or ``None``, ``targets [n]`` int64 local to
    ``weight``'s rows (outside ``[0, V)``: no target here), and the head's transform."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor
    transform: LogitTransform

    @classmethod
    def of(cls, head: LocalHead, hidden: torch.Tensor, targets: torch.Tensor | None) -> TileOperands:
        """``hidden [n, H]`` against ``head``'s local rows as kernel operands (unit stride along ``H``,
        contiguous bias, int64 ``targets``; ``None``: no target, -1 for every row)."""
        hidden, weight = unit_stride(hidden), unit_stride(head.weight)
        if targets is None:
            targets = torch.full((hidden.shape[0],), -1, dtype=torch.int64, device=hidden.device)
        bias = None if head.bias is None else head.bias.contiguous()
        return cls(hidden, weight, bias, targets.to(torch.int64).contiguous(), head.transform)

    @classmethod
    def of_chunk(cls, head: LocalHead, rows: ChunkRows, backend: str) -> TileOperands:
        """:meth:`of` for a chunk's rows on a ``backend`` whose GEMMs take 16-bit operands and have no
        low-rank term (gemm, cute: ``resolve_backend`` sends other rows to triton or torch).

        Raises:
            ValueError: adapter rows, or inputs that are not bf16/fp16.
        """
        if rows.low is not None:
            raise ValueError(f"the {backend} backend has no LoRA adapter term; resolve_backend sends such heads to "
                             "triton")
        if rows.hidden.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the {backend} backend takes bf16/fp16 inputs, got {rows.hidden.dtype}; resolve_backend "
                             "sends others to triton or torch")
        return cls.of(head, rows.hidden, rows.targets)

    def block(self, rows: slice) -> TileOperands:
        """The head's vocabulary rows ``rows`` (targets shifted to index them)."""
        bias = None if self.bias is None else self.bias[rows]
        return self._replace(weight=self.weight[rows], bias=bias, targets=self.targets - rows.start)


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one kernel: a program's ``block_n`` token rows x ``block_v`` vocabulary
    entries, ``tl.dot`` steps of ``block_k`` along ``H``, ``warps`` and software-pipeline ``stages``."""

    block_n: int
    block_v: int
    block_k: int
    warps: int
    stages: int


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (2 for the interpreter's CPU tensors)."""
    if device.type != "cuda":
        return 2  # the interpreter: a couple of "SMs" keeps the split count small but above one
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def grouped(pid, n_blocks, n_cols, GROUP_N: tl.constexpr):
    """``(token block, column)`` of program ``pid``: ``GROUP_N`` consecutive token blocks sweep
    the columns together (Triton's matmul-tutorial ordering), so column operands hit L2."""
    per_group = GROUP_N * n_cols
    first = (pid // per_group) * GROUP_N
    size = tl.minimum(n_blocks - first, GROUP_N)
    r = pid % per_group
    return first + r % size, r // size


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b (+ acc)`` in fp32. ``UPCAST`` (the interpreter only): Triton's interpreter
    multiplies bf16 operands as raw bit patterns, so they are widened first (exact)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def load_tile(src, stride, idx, idx_ok, first, k0, hidden_size, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``idx`` (``first`` = ``idx[0]``), columns ``k0 : k0 + BLOCK_K`` of a ``[rows, H]``
    operand, ``[len(idx), BLOCK_K]``, zero outside. ``src``: a tensor descriptor (``USE_TMA``,
    the copy engine fills out-of-range rows with zeros) or a pointer with row stride ``stride``."""
    if USE_TMA:
        tile = src.load([first, k0])
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        ptrs = src + idx.to(tl.int64)[:, None] * stride + ks[None, :]  # int64: V * H exceeds 2**31
        if EVEN_K:
            tile = tl.load(ptrs, mask=idx_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=idx_ok[:, None] & (ks < hidden_size)[None, :], other=0.0)
    return tile


@triton.jit
def logits_tile(h_src, stride_hn, w_src, stride_wv, rows, cols, row_ok, col_ok, row0, col0, hidden_size,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``hidden[rows] @ weight[cols].T`` as a ``[BLOCK_N, BLOCK_V]`` fp32 tile (0 where masked);
    ``row0``/``col0`` are ``rows[0]``/``cols[0]``."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        a = load_tile(h_src, stride_hn, rows, row_ok, row0, k0, hidden_size, BLOCK_K, EVEN_K, USE_TMA)
        b = load_tile(w_src, stride_wv, cols, col_ok, col0, k0, hidden_size, BLOCK_K, EVEN_K, USE_TMA)
        acc = mma(a, tl.trans(b), acc, DOT_PRECISION, UPCAST)
    return acc


@triton.jit
def head_logits(h_src, stride_hn, w_src, stride_wv, bias_ptr, rows, cols, row_ok, col_ok, row0, col0, hidden_size,
                logit_scale, softcap, temperature,
                HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_TEMPERATURE: tl.constexpr, ROUND_Y: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The head's logits ``z`` of a ``[BLOCK_N, BLOCK_V]`` tile in fp32: :func:`logits_tile`, then
    (``ROUND_Y``) the plain path's rounding of the matmul output to the input dtype, the bias and
    the :class:`~logitless.ops.transform.LogitTransform`."""
    y = logits_tile(h_src, stride_hn, w_src, stride_wv, rows, cols, row_ok, col_ok, row0, col0, hidden_size,
                    BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, USE_TMA, DOT_PRECISION, UPCAST)
    if ROUND_Y:  # ChunkPlan.fp32_logits = False
        if USE_TMA:
            y = y.to(h_src.dtype).to(tl.float32)
        else:
            y = y.to(h_src.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return to_logits(y, logit_scale, softcap, temperature, HAS_SCALE, HAS_SOFTCAP, HAS_TEMPERATURE)


@triton.jit
def tile_dz(z, rows, row_ok, cols, tgt_ptr, lse_ptr, sum_pz_ptr, coef_ptr, g_logp_ptr, g_ent_ptr, g_sz_ptr,
            HAS_LOGP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_SUM_Z: tl.constexpr):
    """``dL/dz`` of a tile of logits ``z`` from each row's ``lse`` and statistic gradients
    (:mod:`logitless.ops.contract`): ``p (coef - g_entropy (z - sum_pz)) + g_sum_z + g_logp [v == y]``
    with ``p = exp(z - lse)``, ``coef = g_lse - g_logp``. Rows outside the tensor read zeros (their
    values are garbage that is never stored)."""
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(z - lse[:, None])
    if HAS_ENTROPY:
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        c = tl.load(sum_pz_ptr + rows, mask=row_ok, other=0.0)
        dz = p * (coef[:, None] - g_ent[:, None] * (z - c[:, None]))
    else:
        dz = p * coef[:, None]
    if HAS_SUM_Z:
        dz += tl.load(g_sz_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_LOGP:
        g_logp = tl.load(g_logp_ptr + rows, mask=row_ok, other=0.0)
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        dz += tl.where(cols[None, :] == tgt[:, None], g_logp[:, None], 0.0)
    return dz


def tile_partials(want: StatRequest, tiles: int, n: int,
                  device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The statistics GEMMs' outputs over ``tiles`` vocabulary tiles of ``n`` rows, in one
    uninitialized fp32 allocation (each is host time while the GPU waits): ``({"m", "se",
    "zy"[, "sez"][, "sz"][, "ssq"]}, the stacked [k, tiles, n] partials)``, ``zy`` ``[1, n]``."""
    names = ("m", "se", *(k for k, on in (("sez", want.entropy), ("sz", want.sum_z), ("ssq", want.sum_sq)) if on))
    flat = torch.empty(len(names) * tiles * n + n, dtype=torch.float32, device=device)
    stacked = flat[:-n].view(len(names), tiles, n)
    out = dict(zip(names, stacked, strict=True))
    out["zy"] = flat[-n:].view(1, n)
    return out, stacked


def launch_started(launch: Callable[[TileOperands, torch.Tensor | None], dict[str, torch.Tensor]], ops: TileOperands,
                   new_z: Callable[[], torch.Tensor] | None,
                   after: StartedRows | None) -> tuple[int, dict[str, torch.Tensor], torch.Tensor | None]:
    """The statistics GEMM of started rows ``ops`` (a backend's ``start_rows``): a pass's first rows
    (``after`` ``None``; their logits into the first rows of ``new_z()``, or nowhere without it), or
    the rows that follow those ``after`` covers (their logits into the next rows of its buffer, the
    partials joined to its). Returns ``(rows covered, partials, logits buffer)``."""
    n = ops.hidden.shape[0]
    if after is None:
        z = None if new_z is None else new_z()
        return n, launch(ops, None if z is None else z[:n]), z
    s, z = after.rows, after.z
    parts = launch(ops, None if z is None else z[s:s + n])
    return s + n, {k: torch.cat((after.parts[k], v), 1) for k, v in parts.items()}, z


def launch_after(launch: Callable[[TileOperands, torch.Tensor | None], dict[str, torch.Tensor]], ops: TileOperands,
                 new_z: Callable[[int], torch.Tensor] | None,
                 started: StartedRows | None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A chunk's statistics GEMM, ``launch(ops, z)`` (``z``: where it stores the logits, from
    ``new_z(rows)``; ``None``: nothing stored), for a chunk whose first ``started.rows`` rows were
    launched before (``None``: none were): only the other rows run now, and their partials are
    joined to the started ones. The started logits buffer becomes the chunk's when it holds the
    chunk's rows (else they are copied into a new one). Started rows the chunk cannot take (more
    than it has, or not stored where it stores) run again with the rest. Returns ``(partials,
    z)``."""
    n = ops.hidden.shape[0]
    if started is None or started.rows > n or (new_z is not None and started.z is None):
        z = None if new_z is None else new_z(n)
        return launch(ops, z), z
    s, z = started.rows, None
    if new_z is not None and started.z.shape[0] >= n:
        z = started.z[:n]
    elif new_z is not None:
        z = new_z(n)
        z[:s].copy_(started.z[:s])
    if s == n:
        return started.parts, z
    rest = launch(ops._replace(hidden=ops.hidden[s:], targets=ops.targets[s:]), None if z is None else z[s:])
    return {k: torch.cat((started.parts[k], v), 1) for k, v in rest.items()}, z


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for ``dtype`` operands."""
    # fp32 inputs: three TF32 products (about fp32 accuracy, as the cuBLAS fp32 GEMM of the other
    # backends); bf16/fp16 ignore the setting.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t [rows, K]`` with stride 1 along ``K``, as the kernels index it: ``t`` itself, a free
    restride when ``K == 1`` (``contiguous()`` keeps any stride of a size-1 dimension, and every
    stride addresses that one column), else a contiguous copy."""
    if t.stride(1) == 1:
        return t
    if t.shape[1] == 1:
        return t.as_strided(t.shape, (t.stride(0), 1))
    return t.contiguous()


def check_operands(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """The kernels' operand contract (asserted: callers convert before)."""
    assert hidden.dtype == weight.dtype and hidden.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert hidden.stride(1) == 1 and weight.stride(1) == 1 and hidden.shape[1] == weight.shape[1]


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """The copy engine's tensor descriptors: Hopper and later (the interpreter emulates them)."""
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device) >= (9, 0)


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether every ``[rows, H]`` tensor can be read through a descriptor: 16-byte aligned base
    and row stride, unit stride along ``H``."""
    return all(_has_tma(t.device) and t.data_ptr() % 16 == 0 and t.stride(1) == 1
               and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def operand_src(t: torch.Tensor, block_rows: int, tiles: Tiles, tma: bool):
    """``t`` as a kernel operand: a descriptor of ``[block_rows, BLOCK_K]`` blocks, or itself."""
    return TensorDescriptor.from_tensor(t, [block_rows, tiles.block_k]) if tma else t
