"""Portable backend of the vocabulary pass: chunked matmuls in PyTorch (CPU and any GPU).

Two functions make the contract every backend implements, for one chunk of tokens:

* :func:`chunk_forward` folds the chunk's logits, vocabulary block by block, into per-token
  partial statistics (running max, sum of exponentials, sum of ``exp * z``, the target's
  logit) with an online log-sum-exp, and can hand the logits back when they fit.
* :func:`chunk_backward` turns per-token gradients of the statistics (``g_logp``,
  ``g_lse``, ``g_entropy``) into ``d hidden`` and accumulates ``d weight`` / ``d bias``,
  recomputing the logits unless they were kept.

It is also the reference the Triton backend is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gemm
from .lora import LowRank, low_rank_grads, low_rank_into
from .plan import ChunkPlan
from .transform import LogitTransform

NAME = "torch"  # the plan heuristic to use (ops/plan.py)


def logits_block(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 transform: LogitTransform, stat_dtype: torch.dtype, lora: LowRank | None = None,
                 rows: slice | None = None, fp32_logits: bool = True) -> torch.Tensor:
    """Logits ``z`` of ``hidden [n, H]`` against the vocabulary rows ``weight [v, H]`` (rows
    ``rows`` of the head, whose ``lora`` term is added): ``[n, v]`` in ``stat_dtype``; without
    ``fp32_logits`` the matmul output is first rounded to the input dtype, as the plain path's."""
    y = gemm.mm(hidden, weight.t(), stat_dtype)
    if lora is not None:
        low_rank_into(y, lora, rows.start, rows.stop)
    if not fp32_logits and hidden.dtype != y.dtype:
        y = y.to(hidden.dtype).to(stat_dtype)
    if bias is not None:
        y = y + bias.to(stat_dtype)
    return transform.apply(y)


@dataclass
class Partials:
    """Per-token partial statistics of a vocabulary range (all ``[n]``, statistics dtype).

    ``m`` running max, ``se = Σ exp(z - m)``, ``sez = Σ exp(z - m) * z`` (``None`` when
    entropy was not asked for), ``zy`` the target's logit where ``owned`` (the target lies in
    this range), else 0, ``sz = Σ z`` (``None`` unless asked for; the mean logit times V).
    Once complete, ``m`` is the largest logit (``zy >= m``: the target is a top-1 token).
    """

    m: torch.Tensor
    se: torch.Tensor
    sez: torch.Tensor | None
    zy: torch.Tensor
    owned: torch.Tensor
    sz: torch.Tensor | None = None

    @classmethod
    def empty(cls, n: int, dtype: torch.dtype, device: torch.device, want_entropy: bool,
              want_sum_z: bool) -> Partials:
        """Uninitialized ``[n]`` buffers, to be filled chunk by chunk with :meth:`write`."""
        def new(want=True, dt=dtype):
            return torch.empty(n, dtype=dt, device=device) if want else None

        return cls(m=new(), se=new(), sez=new(want_entropy), zy=new(), owned=new(dt=torch.bool), sz=new(want_sum_z))

    def write(self, sl: slice, part: Partials) -> None:
        """Copy a chunk's partials into rows ``sl``."""
        for name in ("m", "se", "sez", "zy", "owned", "sz"):
            dst = getattr(self, name)
            if dst is not None:
                dst[sl] = getattr(part, name)

    def finalize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(lse, logp, sum_pz)`` with ``sum_pz = Σ p z`` (``entropy = lse - sum_pz``)."""
        lse = self.m + torch.log(self.se)
        logp = self.zy - lse
        sum_pz = None if self.sez is None else self.sez / self.se
        return lse, logp, sum_pz


def chunk_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, transform: LogitTransform, plan: ChunkPlan,
                  stat_dtype: torch.dtype, want_entropy: bool,
                  keep_logits: bool, want_sum_z: bool = False,
                  lora: LowRank | None = None) -> tuple[Partials, torch.Tensor | None]:
    """Partial statistics of one token chunk over all of ``weight``'s rows.

    Args:
        hidden: ``[n, H]`` chunk of hidden states.
        weight: ``[V, H]`` head weight (or the local vocabulary shard).
        bias: ``[V]`` or ``None``.
        targets: ``[n]`` int64 target indices local to ``weight``; any value outside
            ``[0, V)`` means "not in this range" (the target logit stays 0, ``owned`` False).
        keep_logits: return the chunk's ``[n, V]`` logits (only when ``plan.keep_logits``).
        want_sum_z: also accumulate ``sz = Σ_v z_v``.
        lora: low-rank factors ``x [n, r]``, ``b [V, r]`` whose product joins the logits.

    Returns:
        ``(Partials, z)`` with ``z`` the kept logits or ``None``.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    m = torch.full((n,), -torch.inf, dtype=stat_dtype, device=dev)
    se = torch.zeros((n,), dtype=stat_dtype, device=dev)
    sez = torch.zeros((n,), dtype=stat_dtype, device=dev) if want_entropy else None
    zy = torch.zeros((n,), dtype=stat_dtype, device=dev)
    sz = torch.zeros((n,), dtype=stat_dtype, device=dev) if want_sum_z else None
    owned = (targets >= 0) & (targets < vocab)
    kept = None
    for start in range(0, vocab, plan.vocab_block):
        end = min(start + plan.vocab_block, vocab)
        z = logits_block(hidden, weight[start:end], None if bias is None else bias[start:end],
                         transform, stat_dtype, lora, slice(start, end), plan.fp32_logits)
        new_m = torch.maximum(m, z.max(dim=1).values)
        rescale = torch.exp(m - new_m)
        e = torch.exp(z - new_m[:, None])
        se = se * rescale + e.sum(dim=1)
        if sez is not None:
            sez = sez * rescale + (e * z).sum(dim=1)
        if sz is not None:
            sz = sz + z.sum(dim=1)
        m = new_m
        in_block = owned & (targets >= start) & (targets < end)
        local = (targets - start).clamp(0, end - start - 1)
        zy = torch.where(in_block, z.gather(1, local[:, None]).squeeze(1), zy)
        if keep_logits and end - start == vocab:
            kept = z
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

    With ``p = softmax(z)`` and ``c = Σ p z``, the gradient w.r.t. the logits is
    ``dz_v = p_v (g_lse - g_logp - g_entropy (z_v - c)) + g_logp [v == y] + g_sum_z``, then
    the chain rule through the :class:`LogitTransform`.

    Args:
        lse, sum_pz: ``[n]`` statistics of the forward (``sum_pz`` needed iff ``g_entropy``).
        g_logp, g_lse, g_entropy: ``[n]`` gradients (statistics dtype) or ``None`` (zero).
        g_sum_z: ``[n]`` gradient w.r.t. ``Σ_v z_v`` or ``None``.
        kept_logits: ``[n, V]`` logits from :func:`chunk_forward`, or ``None`` to recompute.
        grad_weight: ``[V, H]`` fp32/fp64 accumulator updated in place, or ``None``.
        grad_bias: ``[V]`` accumulator updated in place, or ``None``.
        lora: low-rank factors of the forward (see :func:`chunk_forward`).
        grad_lora_x: ``[n, r]`` accumulator of ``d x``, updated in place, or ``None``.
        grad_lora_b: ``[V, r]`` accumulator of ``d b``, updated in place, or ``None``.

    Returns:
        ``[n, H]`` gradient w.r.t. ``hidden`` in the statistics dtype, or ``None``.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    stat_dtype = lse.dtype
    # dz in the matmul dtype: the input dtype on GPUs (bf16 GEMMs), the statistics dtype on CPUs.
    mm_dtype = hidden.dtype if hidden.device.type == "cuda" else stat_dtype
    coef = torch.zeros_like(lse)
    if g_lse is not None:
        coef = coef + g_lse
    if g_logp is not None:
        coef = coef - g_logp
    grad_hidden = torch.zeros((n, hidden.shape[1]), dtype=stat_dtype, device=hidden.device) \
        if need_grad_hidden else None
    h_mm = hidden.to(mm_dtype)
    for start in range(0, vocab, plan.vocab_block):
        end = min(start + plan.vocab_block, vocab)
        w = weight[start:end]
        z = kept_logits if kept_logits is not None else logits_block(
            hidden, w, None if bias is None else bias[start:end], transform, stat_dtype, lora, slice(start, end),
            plan.fp32_logits)
        p = torch.exp(z - lse[:, None])
        if g_entropy is not None:
            dz = p * (coef[:, None] - g_entropy[:, None] * (z - sum_pz[:, None]))
        else:
            dz = p * coef[:, None]
        if g_sum_z is not None:
            dz = dz + g_sum_z[:, None]
        if g_logp is not None:
            in_block = (targets >= start) & (targets < end)
            rows = in_block.nonzero().squeeze(1)
            cols = targets[rows] - start
            dz[rows, cols] += g_logp[rows]
        dy = transform.grad_to_raw(dz, z)
        del z, p, dz
        apply_block_grad(dy, w, h_mm, slice(start, end), mm_dtype, grad_hidden, grad_weight, grad_bias)
        if lora is not None:
            low_rank_grads(dy.to(mm_dtype), lora, start, end, grad_lora_x, grad_lora_b)
    return grad_hidden


def apply_block_grad(dy: torch.Tensor, w: torch.Tensor, h_mm: torch.Tensor, rows: slice, mm_dtype: torch.dtype,
                     grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
                     grad_bias: torch.Tensor | None) -> None:
    """Accumulate one vocabulary block's gradients from ``dy = dL/d(h Wᵀ + b)`` ``[n, v]``:
    ``d hidden += dy @ W[rows]``, ``d weight[rows] += dyᵀ @ h``, ``d bias[rows] += Σ_n dy``."""
    if grad_bias is not None:
        grad_bias[rows] += dy.sum(dim=0).to(grad_bias.dtype)
    dy_mm = dy.to(mm_dtype)
    if grad_hidden is not None:
        gemm.addmm_(grad_hidden, dy_mm, w.to(mm_dtype))
    if grad_weight is not None:
        gemm.addmm_(grad_weight[rows], dy_mm.t(), h_mm)
