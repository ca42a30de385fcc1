"""Flash backend of the vocabulary pass: tile GEMMs inside Triton kernels, logits never in memory.

Same contract as :mod:`logitless.ops.torch_backend` (the reference it is tested against):

* :func:`chunk_forward`: one kernel computes ``[BLOCK_N, BLOCK_V]`` logits tiles with ``tl.dot``
  and folds them into online statistics per vocabulary split; a few torch ops combine the
  ``[splits, n]`` partials. No ``[n, V]`` tile is written, so ``keep_logits`` is ignored and
  ``kept`` is always ``None`` (the fused mode then recomputes in :func:`chunk_backward`).
* :func:`chunk_backward`: one kernel recomputes each tile, forms ``dy`` in registers and adds
  ``dy @ W`` / ``dyᵀ @ hidden`` / ``Σ dy`` into fp32 accumulators with atomics; optional
  gradient filtering (``LOGITLESS_FLASH_FILTER=1``), see :mod:`logitless.ops.flash_kernels`.

Workspace: the forward's (up to) five ``[splits, n]`` fp32 buffers (``splits`` about
``16 · SMs / cdiv(n, 128)``: ~5 MB for a 2k-token chunk on an H100) and, in the backward, the
``[n, H]`` fp32 ``d hidden`` it returns; nothing proportional to ``V``. It reuses the Triton plan
(``NAME``), whose token chunks (>= 1024 tokens) keep the tile grid full (one 8192-token chunk
measured no faster); the plan's vocabulary block is unused. In fused mode nothing is kept between
a chunk's statistics and its gradients, so the logits are computed twice per chunk, as in
recompute mode. fp64 inputs go to the torch backend; a LoRA term (``lora``) to the Triton backend.
"""

from __future__ import annotations

import torch

from . import torch_backend, triton_backend
from .flash_kernels import flash_config, launch_grad, launch_stats
from .plan import ChunkPlan
from .torch_backend import Partials
from .transform import LogitTransform

__all__ = ["Partials", "chunk_backward", "chunk_forward"]

NAME = "triton"  # the plan heuristic to use (ops/plan.py)


def _operands(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor):
    """Unit stride along ``H`` (what the kernels index), contiguous bias, int64 targets."""
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    return hidden, weight, None if bias is None else bias.contiguous(), targets.to(torch.int64).contiguous()


def _combine(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Merge ``[splits, n]`` partials into ``[n]``: ``m = max_s m_s``, ``se = Σ_s se_s e^(m_s - m)``
    (likewise ``sez``), ``zy``/``sz`` summed (``zy`` is nonzero in at most one split)."""
    m_s = parts["m"]
    m = m_s.max(dim=0).values
    weight = torch.exp(m_s - m)  # a split whose range is empty has m_s = -inf: weight 0
    out = {"m": m, "se": (parts["se"] * weight).sum(dim=0), "zy": parts["zy"].sum(dim=0)}
    if "sez" in parts:
        out["sez"] = (parts["sez"] * weight).sum(dim=0)
    if "sz" in parts:
        out["sz"] = parts["sz"].sum(dim=0)
    return out


def chunk_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, transform: LogitTransform, plan: ChunkPlan,
                  stat_dtype: torch.dtype, want_entropy: bool,
                  keep_logits: bool, want_sum_z: bool = False, lora=None) -> tuple[Partials, None]:
    """Partial statistics of one token chunk over all of ``weight``'s rows.

    Args:
        hidden: ``[n, H]`` fp16/bf16/fp32 (fp64: torch backend) chunk of hidden states.
        weight: ``[V, H]`` head weight (or the local vocabulary shard), same dtype.
        bias: ``[V]`` or ``None``.
        targets: ``[n]`` integer indices local to ``weight``; values outside ``[0, V)`` mean
            "not in this range" (``zy`` stays 0, ``owned`` False).
        transform: elementwise map from the matmul output to the logits.
        plan: only ``plan.fp32_logits`` is read (round the matmul output to the input dtype when
            ``False``); tile sizes come from :func:`~logitless.ops.flash_kernels.flash_config`.
        stat_dtype: fp32 (fp64 delegates to the torch backend).
        want_entropy: also accumulate ``sez``.
        keep_logits: ignored: this backend never materializes logits.
        want_sum_z: also accumulate ``sz = Σ z``.
        lora: low-rank factors (:class:`~logitless.ops.lora.LowRank`) or ``None``; when given
            the whole call goes to :func:`logitless.ops.triton_backend.chunk_forward`.

    Returns:
        ``(Partials, None)`` with fp32 ``[n]`` partials (or the delegate's result).
    """
    if lora is not None:
        return triton_backend.chunk_forward(hidden, weight, bias, targets, transform, plan, stat_dtype,
                                            want_entropy, keep_logits, want_sum_z, lora=lora)
    if triton_backend.delegates_to_torch(stat_dtype, hidden):
        partials, _ = torch_backend.chunk_forward(hidden, weight, bias, targets, transform, plan, stat_dtype,
                                                  want_entropy, False, want_sum_z)
        return partials, None
    n, vocab = hidden.shape[0], weight.shape[0]
    hidden, weight, bias, targets = _operands(hidden, weight, bias, targets)
    owned = (targets >= 0) & (targets < vocab)
    if n == 0 or vocab == 0:
        # Nothing to fold: the torch backend's starting values.
        return torch_backend.chunk_forward(hidden, weight, bias, targets, transform, plan, torch.float32,
                                           want_entropy, False, want_sum_z)[0], None
    parts = _combine(launch_stats(hidden, weight, bias, targets, transform, want_entropy, want_sum_z,
                                  plan.fp32_logits, flash_config()))
    return Partials(m=parts["m"], se=parts["se"], sez=parts.get("sez"), zy=parts["zy"], owned=owned,
                    sz=parts.get("sz")), None


def chunk_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   targets: torch.Tensor, transform: LogitTransform, plan: ChunkPlan,
                   lse: torch.Tensor, sum_pz: torch.Tensor | None, g_logp: torch.Tensor | None,
                   g_lse: torch.Tensor | None, g_entropy: torch.Tensor | None,
                   kept_logits: torch.Tensor | None, grad_weight: torch.Tensor | None,
                   grad_bias: torch.Tensor | None, need_grad_hidden: bool,
                   g_sum_z: torch.Tensor | None = None, lora=None, grad_lora_x: torch.Tensor | None = None,
                   grad_lora_b: torch.Tensor | None = None) -> torch.Tensor | None:
    """Gradients of one token chunk from the per-token gradients of its statistics.

    ``dz_v = p_v (g_lse - g_logp - g_entropy (z_v - sum_pz)) + g_logp [v == y] + g_sum_z`` with
    ``p = exp(z - lse)``, then the chain rule through ``transform`` (see
    :func:`logitless.ops.torch_backend.chunk_backward`); logits recomputed tile by tile.

    Args:
        hidden, weight, bias, targets, transform, plan: as :func:`chunk_forward`.
        lse, sum_pz: ``[n]`` statistics of the forward (``sum_pz`` needed iff ``g_entropy``).
        g_logp, g_lse, g_entropy, g_sum_z: ``[n]`` gradients or ``None`` (zero).
        kept_logits: must be ``None`` (this backend's forward keeps nothing).
        grad_weight: ``[V, H]`` accumulator updated in place (fp32: atomically by the kernel;
            another dtype through an fp32 temporary), or ``None``.
        grad_bias: ``[V]`` accumulator updated in place, or ``None``.
        need_grad_hidden: whether to return ``d hidden``.
        lora, grad_lora_x, grad_lora_b: a LoRA term and its accumulators: when ``lora`` is given
            the whole call goes to :func:`logitless.ops.triton_backend.chunk_backward`.

    Returns:
        ``[n, H]`` fp32 gradient w.r.t. ``hidden``, or ``None``. With ``LOGITLESS_FLASH_FILTER=1``
        all three gradients are approximate (see :mod:`logitless.ops.flash_kernels`); fp32
        atomics make them non-bit-reproducible either way.

    Raises:
        ValueError: ``g_entropy`` given without ``sum_pz``; ``kept_logits`` given.
    """
    if lora is not None:
        return triton_backend.chunk_backward(hidden, weight, bias, targets, transform, plan, lse, sum_pz, g_logp,
                                             g_lse, g_entropy, kept_logits, grad_weight, grad_bias,
                                             need_grad_hidden, g_sum_z, lora=lora, grad_lora_x=grad_lora_x,
                                             grad_lora_b=grad_lora_b)
    if triton_backend.delegates_to_torch(lse.dtype, hidden):
        return torch_backend.chunk_backward(hidden, weight, bias, targets, transform, plan, lse, sum_pz, g_logp,
                                            g_lse, g_entropy, kept_logits, grad_weight, grad_bias,
                                            need_grad_hidden, g_sum_z)
    if g_entropy is not None and sum_pz is None:
        raise ValueError("chunk_backward: g_entropy needs sum_pz from a forward with want_entropy=True")
    if kept_logits is not None:
        raise ValueError("chunk_backward: the flash backend keeps no logits; pass kept_logits=None")
    n, hidden_size = hidden.shape
    dev = hidden.device
    grad_hidden = torch.zeros((n, hidden_size), dtype=torch.float32, device=dev) if need_grad_hidden else None
    if n == 0 or weight.shape[0] == 0 or (grad_hidden is None and grad_weight is None and grad_bias is None):
        return grad_hidden
    hidden, weight, bias, targets = _operands(hidden, weight, bias, targets)
    lse, sum_pz, coef, g_logp, g_entropy, g_sum_z = triton_backend.row_coefficients(lse, sum_pz, g_logp, g_lse,
                                                                                    g_entropy, g_sum_z)

    def fp32_acc(acc: torch.Tensor | None) -> torch.Tensor | None:
        if acc is None or (acc.dtype == torch.float32 and acc.stride(-1) == 1):
            return acc
        return torch.zeros(acc.shape, dtype=torch.float32, device=dev)

    gw, gb = fp32_acc(grad_weight), fp32_acc(grad_bias)
    launch_grad(hidden, weight, bias, targets, transform, lse, sum_pz, coef, g_logp, g_entropy, g_sum_z,
                grad_hidden, gw, gb, plan.fp32_logits, flash_config())
    for acc, tmp in ((grad_weight, gw), (grad_bias, gb)):
        if acc is not None and tmp is not acc:
            acc += tmp.to(acc.dtype)
    return grad_hidden
