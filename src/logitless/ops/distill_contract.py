"""The backend contract of distillation: a student's and a teacher's softmax in the same blocked pass.

The student's logits ``zs = Ts(hs Wsᵀ + bs)`` and the teacher's ``zt = Tt(ht Wtᵀ + bt)`` (each
with its own :class:`~logitless.ops.transform.LogitTransform`: temperature, scale, soft-cap) are
computed block by block over the same vocabulary rows; neither ``[N, V]`` tensor exists. With
``p = softmax(zs)`` and ``q = softmax(zt)``, one pass gives, per token, the partials of
:class:`DistillPartials`: the student's ``lse``, ``entropy`` and the logits of ``k`` target ids
per token (a hard label, a teacher's top-k ids, or both, as columns); the teacher's ``lse`` and
entropy; and both KL directions, ``KL(q‖p) = Σ q (zt - zs) - lse_t + lse_s`` and
``KL(p‖q) = Σ p (zs - zt) - lse_s + lse_t``, from cross sums kept with an online log-sum-exp of
each side. The generalized JSD (TRL's ``GKDTrainer.generalized_jsd_loss``: mixture
``m = β q + (1 - β) p``, ``JSD_β = β KL(q‖m) + (1 - β) KL(p‖m)``) needs ``log m_v`` for every
element, which does not decompose into per-token sums: it is a **second pass** over the
vocabulary (same token chunk) once both final ``lse`` are known.

A backend that runs distillation with its own kernels sets ``CAPS.distill``
(:class:`~logitless.ops.contract.Capabilities`) and holds a ``distill`` module in its package
that implements :class:`DistillBackend`; :func:`resolve_distill` picks it, or the torch
backend's (:mod:`logitless.ops.torch_backend.distill`: the specification, which takes every
input) where a backend has none or its :class:`DistillScope` does not take the inputs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple, Protocol

import torch

from ..distributed import all_reduce, is_active
from .contract import Accumulators, Capabilities, LocalHead, auto_impl, resolve_backend
from .plan import ChunkPlan, Impl, PassOptions


class DistillHeads(NamedTuple):
    """The resolved heads of a pass: the differentiable ``student``, the frozen ``teacher``
    (``None``: the student's statistics and target log-probs only) and the JSD's mixture weight
    ``beta`` (``None``: no JSD). ``forward_kl_only``: the loss's gradient comes through
    ``forward_kl`` alone (:class:`DistillGrads` with that field only), so a backend may form the
    gradient's ``p - q`` in the forward, before the loss is known."""

    student: LocalHead
    teacher: LocalHead | None
    beta: float | None
    forward_kl_only: bool = False


class DistillRows(NamedTuple):
    """The token side of a chunk: the student's ``hidden [n, H_s]``, ``targets [n, k]`` int64 rows
    local to the head (outside ``[0, V_local)``: another rank's id or none, not gathered), the
    teacher's ``teacher_hidden [n, H_t]`` or ``None``."""

    hidden: torch.Tensor
    targets: torch.Tensor
    teacher_hidden: torch.Tensor | None


class DistillSaved(NamedTuple):
    """What a chunk's backward needs from its forward (``[n]``; ``None`` where not computed)."""

    lse: torch.Tensor
    sum_pz: torch.Tensor
    teacher_lse: torch.Tensor | None
    reverse_kl: torch.Tensor | None
    kl_pm: torch.Tensor | None  # KL(p‖m), JSD only


class DistillGrads(NamedTuple):
    """Per-token gradients of the loss w.r.t. the differentiable statistics (``None`` = zero;
    ``logp`` is ``[n, k]``)."""

    lse: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    forward_kl: torch.Tensor | None = None
    reverse_kl: torch.Tensor | None = None
    jsd: torch.Tensor | None = None

    def any(self) -> bool:
        return any(g is not None for g in self)

    def rows(self, sl: slice) -> DistillGrads:
        return DistillGrads(*(None if g is None else g[sl] for g in self))

    def teacher_terms(self) -> bool:
        """Whether the gradient needs the teacher's probabilities (a KL or JSD term)."""
        return self.forward_kl is not None or self.reverse_kl is not None or self.jsd is not None


def max_moved(old_max: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """``old_max - new_max``, 0 where nothing was summed yet (``old_max = -inf``)."""
    return torch.where(torch.isfinite(old_max), old_max - new_max, 0.0)


@dataclass
class DistillPartials:
    """Running partials of one token chunk over a vocabulary range (all ``[n]`` but ``zy``).

    Student: ``m_s`` max, ``se_s = Σ exp(zs - m_s)``, ``sez_s = Σ exp(zs - m_s) zs``,
    ``sgap = Σ exp(zs - m_s)((zs - m_s) - (zt - m_t))``, ``zy [n, k]`` the targets' logits (0
    where not owned). Teacher (``None`` without one): ``m_t``, ``se_t``, ``tez = Σ exp(zt - m_t) zt``,
    ``tgap = Σ exp(zt - m_t)((zt - m_t) - (zs - m_s))``.

    The gaps are taken between logits centred on their own running maxima, so they are O(KL)
    rather than O(|z|): ``KL = gap / se - log se + log se_other`` then holds no difference of
    large numbers (uncentred, ``Σ p (zs - zt) - lse_s + lse_t`` lost the KL of saturated heads
    with |z| ~ 1e3 to fp32 rounding, and the backward's ``log p - log q - KL`` with it).
    """

    m_s: torch.Tensor
    se_s: torch.Tensor
    sez_s: torch.Tensor
    zy: torch.Tensor
    sgap: torch.Tensor | None = None
    m_t: torch.Tensor | None = None
    se_t: torch.Tensor | None = None
    tez: torch.Tensor | None = None
    tgap: torch.Tensor | None = None

    _FIELDS = ("m_s", "se_s", "sez_s", "zy", "sgap", "m_t", "se_t", "tez", "tgap")

    @classmethod
    def empty(cls, n: int, k: int, teacher: bool, dtype: torch.dtype, device: torch.device) -> DistillPartials:
        """Uninitialized whole-pass buffers, filled chunk by chunk with :meth:`write`."""
        def new(*shape: int) -> torch.Tensor:
            return torch.empty(shape or (n,), dtype=dtype, device=device)

        part = cls(m_s=new(), se_s=new(), sez_s=new(), zy=new(n, k))
        if teacher:
            part.sgap, part.m_t, part.se_t, part.tez, part.tgap = new(), new(), new(), new(), new()
        return part

    def write(self, sl: slice, part: DistillPartials) -> None:
        """Copy a chunk's partials into rows ``sl``."""
        for name in self._FIELDS:
            dst = getattr(self, name)
            if dst is not None:
                dst[sl] = getattr(part, name)

    def rows(self, sl: slice) -> DistillPartials:
        """Rows ``sl`` of every field (views)."""
        return DistillPartials(*(None if getattr(self, f) is None else getattr(self, f)[sl] for f in self._FIELDS))

    def reduce(self, group) -> DistillPartials:
        """Every rank's partials combined into the full vocabulary's: one all-reduce MAX of the
        stacked maxima and one SUM of the rescaled sums (with the owners' target logits) over
        the vocabulary-parallel ``group``; ``self`` without a group."""
        if not is_active(group):
            return self
        return self.merged(lambda x: all_reduce(x, "max", group), lambda x: all_reduce(x, "sum", group))

    def merged(self, max_over: Callable[[torch.Tensor], torch.Tensor], sum_over: Callable[[torch.Tensor], torch.Tensor],
               zy: torch.Tensor | None = None) -> DistillPartials:
        """The partials of several disjoint vocabulary ranges combined into their union's.

        ``self`` holds one range's partials (each rank's own, for :meth:`reduce`) or a leading
        range axis on every field (``[ranges, n]``); ``max_over``/``sum_over`` reduce a stack of
        fields across the ranges (all-reduces, or ``max``/``sum`` over dim 1), each called once.
        ``zy``: the targets' logits already summed over the ranges, else ``self.zy`` rides along
        in the sum (0 where another range owns the id, so the sum is the owner's logit). Gaps
        that are ``None`` (a teacher's partials without its cross sums, taken later over whole
        rows) stay ``None``.
        """
        teacher, gaps = self.m_t is not None, self.sgap is not None
        m = max_over(torch.stack([self.m_s, self.m_t] if teacher else [self.m_s]))
        # 0 for a range without valid rows (local max -inf): it adds nothing to the sums.
        scale_s = torch.exp(self.m_s - m[0])
        sums = [self.se_s * scale_s, self.sez_s * scale_s]
        if teacher:
            scale_t = torch.exp(self.m_t - m[1])
            sums += [self.se_t * scale_t, self.tez * scale_t]
        if teacher and gaps:
            # The gaps are centred on each range's maxima: re-centre them on the union's.
            shift = max_moved(self.m_s, m[0]) - max_moved(self.m_t, m[1])
            sums += [(self.sgap + self.se_s * shift) * scale_s, (self.tgap - self.se_t * shift) * scale_t]
        stacked = torch.stack(sums)
        if zy is None:
            stacked = torch.cat([stacked, self.zy.movedim(-1, 0)])
        total = sum_over(stacked)
        p = len(sums)
        zy = total[p:].movedim(0, -1) if zy is None else zy
        out = DistillPartials(m_s=m[0], se_s=total[0], sez_s=total[1], zy=zy)
        if teacher:
            out.m_t, out.se_t, out.tez = m[1], total[2], total[3]
        if teacher and gaps:
            out.sgap, out.tgap = total[4], total[5]
        return out

    def lse(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The student's and the teacher's log-partition functions (``None`` without a teacher)."""
        return self.m_s + torch.log(self.se_s), None if self.m_t is None else self.m_t + torch.log(self.se_t)

    def finalize(self) -> dict[str, torch.Tensor]:
        """Per-token statistics from the partials (names of :class:`~logitless.ops.distill.DistillStats`,
        plus ``sum_pz``)."""
        lse, lse_t = self.lse()
        out = {"lse": lse, "logp": self.zy - lse[:, None], "sum_pz": self.sez_s / self.se_s}
        out["entropy"] = lse - out["sum_pz"]
        if self.m_t is not None:
            out["teacher_lse"] = lse_t
            out["teacher_entropy"] = lse_t - self.tez / self.se_t
            log_se_s, log_se_t = torch.log(self.se_s), torch.log(self.se_t)
            out["forward_kl"] = self.tgap / self.se_t - log_se_t + log_se_s
            out["reverse_kl"] = self.sgap / self.se_s - log_se_s + log_se_t
        return out


def p_coefficient(g: DistillGrads, saved: DistillSaved, beta: float | None) -> torch.Tensor:
    """The per-token part of ``dz`` that multiplies ``p`` (``[n]``): ``g_lse - Σ_j g_logp_j
    - g_rkl KL(p‖q) - g_jsd (1-β) KL(p‖m)``. The entropy and reverse-KL terms' elementwise parts
    stay with their partners: folding the O(|z|) ``sum_pz``/``lse`` into this constant would
    cancel them against ``zs`` in fp32."""
    coef = torch.zeros_like(saved.lse)
    if g.lse is not None:
        coef = coef + g.lse
    if g.logp is not None:
        coef = coef - g.logp.sum(dim=1)
    if g.reverse_kl is not None:
        coef = coef - g.reverse_kl * saved.reverse_kl
    if g.jsd is not None:
        coef = coef - g.jsd * (1 - beta) * saved.kl_pm
    return coef


class DistillScope(NamedTuple):
    """The inputs a distillation backend takes (the torch backend's: all of them).

    Attributes:
        max_targets: target ids per token (``None``: any number).
        mixed_dtypes: a teacher whose hidden states have another dtype than the student's.
    """

    max_targets: int | None = None
    mixed_dtypes: bool = True

    def takes(self, hidden: torch.Tensor, teacher_hidden: torch.Tensor | None, n_targets: int) -> bool:
        return (self.max_targets is None or n_targets <= self.max_targets) and (
            self.mixed_dtypes or teacher_hidden is None or teacher_hidden.dtype == hidden.dtype)


class DistillBackend(Protocol):
    """What a backend's ``distill`` module provides: one token chunk's work against both heads.

    ``kept`` is an opaque handle on the chunk's logits of both heads (``None``: not kept; the
    functions then recompute them block by block); a backward may overwrite it.
    """

    CAPS: Capabilities  # its backend's: whether ``chunk_backward`` honours ``write_weight``/``weight_lo``
    SCOPE: DistillScope

    def plan_for(self, n_tokens: int, vocab: int, options: PassOptions, dtype: torch.dtype) -> ChunkPlan:
        """Block sizes within ``options.chunk_bytes`` of workspace for ``n_tokens`` rows of ``dtype``."""
        ...

    def chunk_forward(self, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan,
                      keep: bool) -> tuple[DistillPartials, object | None]:
        """The first pass over the local vocabulary: the chunk's partials (the teacher's only with
        one) and, with ``keep``, the kept logits (or ``None``)."""
        ...

    def chunk_jsd(self, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, lse: torch.Tensor,
                  teacher_lse: torch.Tensor, kept: object | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The JSD's second pass over the local vocabulary, given both final ``lse [n]``:
        ``(jsd [n], kl_pm [n])`` with ``kl_pm = KL(p‖m)`` (the backward needs it)."""
        ...

    def chunk_backward(self, heads: DistillHeads, rows: DistillRows, plan: ChunkPlan, saved: DistillSaved,
                       grads: DistillGrads, acc: Accumulators, kept: object | None) -> torch.Tensor | None:
        """The student's gradients of one chunk: ``d hidden [n, H_s]`` (statistics dtype, or
        ``None`` without ``acc.hidden``) and, in place, ``acc``'s ``d weight``/``d bias``."""
        ...


def resolve_distill(impl: Impl, hidden: torch.Tensor, teacher_hidden: torch.Tensor | None,
                    n_targets: int) -> DistillBackend:
    """The distillation functions of a pass over ``hidden`` (the student's rows), the teacher's
    ``teacher_hidden`` and ``n_targets`` target ids per token: the ``distill`` module of the
    backend :func:`~logitless.ops.contract.resolve_backend` picks, when it declares one
    (``CAPS.distill``) whose ``SCOPE`` takes these inputs, else the torch backend's. Where
    ``impl="auto"`` would pick the CuTe backend, distillation runs on the gemm backend (its
    Triton statistics GEMM); ``impl="cute"`` runs it on the CuTe one.

    Raises:
        ValueError: as :func:`~logitless.ops.contract.resolve_backend` (bad ``impl`` for the device).
    """
    # On distillation's chunks the CuTe GEMM is no faster than the Triton one, and slower where a
    # chunk ends inside one of its 2048-row bands (measured: benchmarks/NOTES-h100.md).
    if impl == "auto" and auto_impl(hidden.device) == "cute":
        impl = "gemm"
    backend = resolve_backend(impl, hidden)
    if backend.CAPS.distill:
        kernels = _distill_module(backend)
        if kernels.SCOPE.takes(hidden, teacher_hidden, n_targets):
            return kernels
    return _distill_module(resolve_backend("torch", hidden))


def _distill_module(backend: ModuleType) -> DistillBackend:
    return importlib.import_module(f"{backend.__package__}.distill")
