"""A LoRA adapter on the head, added inside each logits block instead of merged into ``W``.

With an adapter, the head computes ``y = h Wᵀ + s · dropout(h) Aᵀ Bᵀ`` (Hu et al. 2021,
"LoRA", eq. 3; PEFT ``lora.Linear.forward``). The pass splits it as ``y = h Wᵀ + x Bᵀ`` with the
hidden-side factor ``x = s · dropout(h) Aᵀ`` (``[n, r]``, computed by autograd before the pass, so
its gradient reaches ``A``, ``h`` and the dropout mask the usual way) and the vocabulary-side
factor ``B`` (``[V, r]``), sliced per vocabulary block like ``W``. Each block then costs one
extra rank-``r`` product in the forward and two in the backward (``d x += dy B``,
``d B += dyᵀ x``); no merged ``V x H`` weight is ever formed, and a frozen ``W`` gets no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import gemm


@dataclass(frozen=True)
class HeadLoRA:
    """A LoRA adapter on the output head: ``logits += scaling · dropout(hidden) @ a.T @ b.T``.

    Attributes:
        a: ``[r, H]`` down-projection (PEFT ``lora_A[name].weight``).
        b: ``[V, r]`` up-projection (PEFT ``lora_B[name].weight``), the local rows under a
            vocabulary-parallel shard, like the head weight.
        scaling: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), PEFT ``scaling[name]``.
        dropout: applied to the hidden states before ``a`` (PEFT ``lora_dropout[name]``), or
            ``None``. It sees the rows that enter the pass (masked tokens are dropped first).

    Checked with the hidden states and the head where it is used (:meth:`check`: ``TypeError``
    for non-floating factors, ``ValueError`` for their shapes or devices).
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float = 1.0
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None

    def check(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        """Validate the structure against ``hidden [..., H]`` and the head ``weight [V, H]``
        (NaN/inf values are checked with the other inputs' in
        :func:`~logitless.ops.validate.check_head_inputs`, in one host sync).

        Raises:
            TypeError: ``a``/``b`` not floating tensors.
            ValueError: shapes (``a [r, H]``, ``b [V, r]``) or device.
        """
        for name, t in (("a", self.a), ("b", self.b)):
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                raise TypeError(f"HeadLoRA.{name} must be a floating torch.Tensor, got {type(t).__name__}")
            if t.device != weight.device:
                raise ValueError(f"HeadLoRA.{name} is on {t.device} but the head weight is on {weight.device}")
            if t.dim() != 2:
                raise ValueError(f"HeadLoRA.{name} must be 2-D, got shape {tuple(t.shape)}")
        r = self.a.shape[0]
        if self.a.shape[1] != hidden.shape[-1]:
            raise ValueError(f"HeadLoRA.a must be [r, H] with H = {hidden.shape[-1]}, got {tuple(self.a.shape)}")
        if tuple(self.b.shape) != (weight.shape[0], r):
            raise ValueError(f"HeadLoRA.b must be [V, r] = [{weight.shape[0]}, {r}], got {tuple(self.b.shape)}")

    def factors(self, hidden: torch.Tensor, weight: torch.Tensor) -> LowRank:
        """``x = scaling · dropout(hidden) @ a.T`` (``[n, r]``, differentiable; computed in ``a``'s
        dtype) and ``b``, both then cast to the dtype of the head's GEMMs (``weight.dtype``)."""
        h = hidden if self.dropout is None else self.dropout(hidden)
        # In the adapter's dtype, as PEFT computes it (adapters are often kept in fp32).
        x = (h.to(self.a.dtype) @ self.a.t()) * self.scaling
        return LowRank(x=x.to(weight.dtype), b=self.b.to(weight.dtype))


class LowRank(NamedTuple):
    """The two factors of the low-rank logits term ``x @ b.T`` seen by the backends."""

    x: torch.Tensor  # [n, r]
    b: torch.Tensor  # [V, r]

    def rows(self, sl: slice) -> LowRank:
        """Token rows ``sl`` (the vocabulary side is whole)."""
        return LowRank(self.x[sl], self.b)


def low_rank_into(tile: torch.Tensor, low: LowRank, start: int, end: int) -> None:
    """``tile += x @ b[start:end].T`` in place, accumulated in ``tile``'s dtype (an fp32 tile is
    not rounded to the factors' dtype)."""
    gemm.addmm_(tile, low.x, low.b[start:end].t())


def low_rank_grads(dy: torch.Tensor, low: LowRank, start: int, end: int, grad_x: torch.Tensor | None,
                   grad_b: torch.Tensor | None) -> None:
    """From one block's ``dy = dL/dy`` ``[n, v]``: ``grad_x += dy @ b[start:end]`` and
    ``grad_b[start:end] += dyᵀ @ x`` into fp32/fp64 accumulators (rank-``r`` products: small)."""
    if grad_x is not None:
        gemm.addmm_(grad_x, dy, low.b[start:end].to(dy.dtype))
    if grad_b is not None:
        gemm.addmm_(grad_b[start:end], dy.t(), low.x.to(dy.dtype))
