"""Triton backend of the vocabulary pass: cuBLAS GEMMs around two Triton row kernels.

Same contract as :mod:`logitless.ops.torch_backend` (the reference it is tested against):

* :func:`chunk_forward`: ``y = hidden @ weight.T`` block by block with ``torch.mm`` into one
  tile, folded into the running statistics by one Triton kernel that reads the tile once
  (bias and :class:`LogitTransform` applied in registers, logits never written). With
  ``keep_logits`` the raw tile is handed back as the opaque ``kept_logits``.
* :func:`chunk_backward`: one Triton kernel overwrites the tile (kept, or recomputed block by
  block) in place with ``dy = dL/dy`` in the GEMM dtype, then ``d hidden = dy @ W`` and
  ``d weight += dy^T @ hidden`` run in cuBLAS with fp32 outputs/accumulators, so a chunk's
  ``d weight`` is never rounded to bf16 before it is summed.

Tile dtype: fp32 (cuBLAS ``out_dtype``, so logits are not rounded to bf16), or the GEMM's own
dtype with ``LOGITLESS_TRITON_LOGITS=input``. Under ``TRITON_INTERPRET=1`` everything runs on CPU tensors
through the same code, with ``torch.mm`` on CPU for the GEMMs. fp64 inputs are delegated to the
torch backend (no fp64 tensor-core GEMMs to gain from).
"""

from __future__ import annotations

import torch

from . import gemm, torch_backend
from .lora import LowRank, low_rank_grads, low_rank_into
from .plan import ChunkPlan
from .torch_backend import Partials
from .transform import LogitTransform
from .triton_kernels import KernelConfig, kernel_config, launch_dlogits, launch_stats

__all__ = ["Partials", "chunk_backward", "chunk_forward"]


NAME = "triton"  # the plan heuristic to use (ops/plan.py)


def _tile(hidden: torch.Tensor, weight: torch.Tensor, start: int, end: int, cfg: KernelConfig,
          lora: LowRank | None) -> torch.Tensor:
    """Raw ``hidden [n, H] @ weight[start:end].T`` (+ the low-rank term) as a contiguous
    ``[n, v]`` tile in the configured dtype."""
    w = weight[start:end]
    tile = gemm.mm(hidden, w.t(), torch.float32) if cfg.tile == "fp32" else torch.mm(hidden, w.t())
    if lora is not None:
        low_rank_into(tile, lora, start, end)
    return tile


def delegates_to_torch(stat_dtype: torch.dtype, hidden: torch.Tensor) -> bool:
    """fp64 runs on the torch backend (no fp64 tensor-core GEMMs to gain from)."""
    return stat_dtype == torch.float64 or hidden.dtype == torch.float64


def _f32(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.float32).contiguous()


def row_coefficients(lse, sum_pz, g_logp, g_lse, g_entropy, g_sum_z):
    """The per-token inputs of the gradient kernels, fp32 and contiguous: ``(lse, sum_pz, coef,
    g_logp, g_entropy, g_sum_z)`` with ``coef = g_lse - g_logp`` (zeros for absent gradients) and
    ``sum_pz`` kept only when ``g_entropy`` is given."""
    lse = _f32(lse)
    coef = torch.zeros_like(lse)
    if g_lse is not None:
        coef += g_lse
    if g_logp is not None:
        coef -= g_logp
    g_logp, g_entropy, g_sum_z = _f32(g_logp), _f32(g_entropy), _f32(g_sum_z)
    return lse, None if g_entropy is None else _f32(sum_pz), coef, g_logp, g_entropy, g_sum_z


def chunk_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, transform: LogitTransform, plan: ChunkPlan,
                  stat_dtype: torch.dtype, want_entropy: bool,
                  keep_logits: bool, want_sum_z: bool = False,
                  lora: LowRank | None = None) -> tuple[Partials, torch.Tensor | None]:
    """Partial statistics of one token chunk over all of ``weight``'s rows.

    Args:
        hidden: ``[n, H]`` fp16/bf16/fp32 (fp64: torch backend) chunk of hidden states.
        weight: ``[V, H]`` head weight (or the local vocabulary shard), same dtype.
        bias: ``[V]`` or ``None``.
        targets: ``[n]`` integer indices local to ``weight``; values outside ``[0, V)`` mean
            "not in this range" (``zy`` stays 0, ``owned`` False).
        transform: elementwise map from the matmul output to the logits.
        plan: ``plan.vocab_block`` bounds the tile width.
        stat_dtype: fp32 (fp64 delegates to the torch backend).
        want_entropy: also accumulate ``sez``.
        keep_logits: hand back the chunk's tile (only when one block covers ``V``).
        want_sum_z: also accumulate ``sz = Σ z``.
        lora: low-rank factors ``x [n, r]``, ``b [V, r]``; ``x @ b.T`` is added to each tile.

    Returns:
        ``(Partials, kept)``: fp32 ``[n]`` partials; ``kept`` the ``[n, V]`` raw matmul tile
        (fp32, or the GEMM dtype with ``LOGITLESS_TRITON_LOGITS=input``; bias and transform *not*
        applied), opaque to callers and only meant for :func:`chunk_backward`, else ``None``.
    """
    if delegates_to_torch(stat_dtype, hidden):
        return torch_backend.chunk_forward(hidden, weight, bias, targets, transform, plan, stat_dtype,
                                           want_entropy, keep_logits, want_sum_z, lora)
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    cfg = kernel_config(min(plan.vocab_block, vocab), plan.fp32_logits)
    targets = targets.to(torch.int64).contiguous()
    bias = None if bias is None else bias.contiguous()
    m = torch.full((n,), -torch.inf, dtype=torch.float32, device=dev)
    se = torch.zeros((n,), dtype=torch.float32, device=dev)
    sez = torch.zeros((n,), dtype=torch.float32, device=dev) if want_entropy else None
    zy = torch.zeros((n,), dtype=torch.float32, device=dev)
    sz = torch.zeros((n,), dtype=torch.float32, device=dev) if want_sum_z else None
    kept = None
    for start in range(0, vocab, plan.vocab_block):
        end = min(start + plan.vocab_block, vocab)
        tile = _tile(hidden, weight, start, end, cfg, lora)
        launch_stats(tile, bias, targets, start, transform, m, se, sez, zy, cfg, sz)
        if keep_logits and end - start == vocab:
            kept = tile
        del tile
    owned = (targets >= 0) & (targets < vocab)
    return Partials(m=m, se=se, sez=sez, zy=zy, owned=owned, sz=sz), kept


def chunk_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   targets: torch.Tensor, transform: LogitTransform, plan: ChunkPlan,
                   lse: torch.Tensor, sum_pz: torch.Tensor | None, g_logp: torch.Tensor | None,
                   g_lse: torch.Tensor | None, g_entropy: torch.Tensor | None,
                   kept_logits: torch.Tensor | None, grad_weight: torch.Tensor | None,
                   grad_bias: torch.Tensor | None, need_grad_hidden: bool,
                   g_sum_z: torch.Tensor | None = None, lora: LowRank | None = None,
                   grad_lora_x: torch.Tensor | None = None,
                   grad_lora_b: torch.Tensor | None = None) -> torch.Tensor | None:
    """Gradients of one token chunk from the per-token gradients of its statistics.

    ``dz_v = p_v (g_lse - g_logp - g_entropy (z_v - sum_pz)) + g_logp [v == y] + g_sum_z`` with
    ``p = exp(z - lse)``, then the chain rule through ``transform`` (see
    :func:`logitless.ops.torch_backend.chunk_backward`).

    Args:
        hidden, weight, bias, targets, transform, plan: as :func:`chunk_forward`.
        lse, sum_pz: ``[n]`` fp32 statistics of the forward (``sum_pz`` needed iff ``g_entropy``).
        g_logp, g_lse, g_entropy, g_sum_z: ``[n]`` gradients or ``None`` (zero).
        kept_logits: the tile :func:`chunk_forward` returned, or ``None`` to recompute block by
            block. **Overwritten in place** with ``dy``; it cannot be reused afterwards.
        grad_weight: ``[V, H]`` fp32 accumulator updated in place, or ``None``.
        grad_bias: ``[V]`` fp32 accumulator updated in place, or ``None``.
        need_grad_hidden: whether to return ``d hidden``.
        lora, grad_lora_x, grad_lora_b: the forward's low-rank factors and fp32 accumulators of
            their gradients ``[n, r]``/``[V, r]`` (updated in place), as in the torch backend.

    Returns:
        ``[n, H]`` fp32 gradient w.r.t. ``hidden``, or ``None``.

    Raises:
        ValueError: ``g_entropy`` given without ``sum_pz``.
    """
    if delegates_to_torch(lse.dtype, hidden):
        return torch_backend.chunk_backward(hidden, weight, bias, targets, transform, plan, lse, sum_pz, g_logp,
                                            g_lse, g_entropy, kept_logits, grad_weight, grad_bias,
                                            need_grad_hidden, g_sum_z, lora, grad_lora_x, grad_lora_b)
    if g_entropy is not None and sum_pz is None:
        raise ValueError("chunk_backward: g_entropy needs sum_pz from a forward with want_entropy=True")
    vocab = weight.shape[0]
    cfg = kernel_config(vocab if kept_logits is not None else min(plan.vocab_block, vocab), plan.fp32_logits)
    mm_dtype = hidden.dtype
    targets = targets.to(torch.int64).contiguous()
    bias = None if bias is None else bias.contiguous()
    lse, sum_pz, coef, g_logp, g_entropy, g_sum_z = row_coefficients(lse, sum_pz, g_logp, g_lse, g_entropy, g_sum_z)
    grad_hidden = None
    block = vocab if kept_logits is not None else plan.vocab_block
    for start in range(0, vocab, block):
        end = min(start + block, vocab)
        w = weight[start:end]
        tile = kept_logits if kept_logits is not None else _tile(hidden, weight, start, end, cfg, lora)
        # dy goes over the tile's own storage; an fp32 tile is reinterpreted as twice as many
        # bf16/fp16 columns and dy fills the first half of each row (see triton_kernels).
        dy = tile if tile.dtype == mm_dtype else tile.view(mm_dtype)[:, :end - start]
        launch_dlogits(tile, dy, bias, targets, start, transform, lse, sum_pz, coef, g_logp, g_entropy, cfg,
                       g_sum_z)
        del tile
        if grad_bias is not None:
            grad_bias[start:end] += dy.sum(dim=0, dtype=torch.float32).to(grad_bias.dtype)
        if need_grad_hidden:
            if grad_hidden is None:
                grad_hidden = gemm.mm(dy, w, torch.float32)
            else:
                gemm.addmm_(grad_hidden, dy, w)
        if grad_weight is not None:
            gemm.addmm_(grad_weight[start:end], dy.t(), hidden)
        if lora is not None:
            low_rank_grads(dy, lora, start, end, grad_lora_x, grad_lora_b)
        del dy
    return grad_hidden
