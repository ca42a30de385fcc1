"""Calls of one backend's contract (``logitless.ops.contract``) on plain tensors, for the tests
that compare backends chunk by chunk: a whole, unsharded head; and the engine's chunk planning
pinned for tests of several chunks."""

from __future__ import annotations

import torch

from logitless import Head, HeadLoRA, PassOptions, vocab_stats
from logitless.ops.contract import Accumulators, ChunkRows, LocalHead, SavedStats, StatGrads, StatRequest


def local_head(w, b, tr) -> LocalHead:
    return LocalHead(weight=w, bias=b, transform=tr, group=None, vocab_start=0, vocab_size=w.shape[0],
                     reduce_grad_hidden=True)


def forward(backend, h, w, b, t, tr, plan, want_entropy, keep_logits=False, want_sum_z=False, low=None,
            want_sum_sq=False):
    """``backend.chunk_forward`` of rows ``h``/``t`` against ``w``/``b``/``tr``."""
    return backend.chunk_forward(local_head(w, b, tr), ChunkRows(h, t, low), plan,
                                 StatRequest(want_entropy, want_sum_z, want_sum_sq), keep_logits)


def backward(backend, h, w, b, t, tr, plan, saved: SavedStats, grads: StatGrads, acc: Accumulators, kept=None,
             low=None):
    """``backend.chunk_backward`` of the same rows."""
    return backend.chunk_backward(local_head(w, b, tr), ChunkRows(h, t, low), plan, saved, grads, acc, kept)


def record_layouts(monkeypatch) -> list[str]:
    """The list each engine pass's ``d weight`` layout (``logitless.ops.plan.weight_grad_plan``) is appended to."""
    from logitless.ops import plan as planning

    layouts = []
    real_plan = planning.weight_grad_plan

    def spy(*a):
        planned = real_plan(*a)
        layouts.append(planned[1])
        return planned

    monkeypatch.setattr(planning, "weight_grad_plan", spy)
    return layouts


def keep_planned_chunks(monkeypatch, pairs) -> list[str]:
    """Make the engine's passes keep their planned token chunks (no one-chunk plan, no chunks
    widened by the bf16 pair's savings), with ``pairs(pass)`` deciding whether a single-head
    pass adds ``d weight`` into the bf16 pair; returns :func:`record_layouts`' list."""
    from logitless.ops import fused
    from logitless.ops.plan import ChunkPlan

    monkeypatch.setattr(ChunkPlan, "whole", lambda *a: None)
    monkeypatch.setattr(ChunkPlan, "widened", lambda self, *a, **k: self)
    monkeypatch.setattr(fused.SoftmaxPass, "pairs_weight_grad", property(pairs))
    return record_layouts(monkeypatch)


def logp_grads(leaves: dict, targets: torch.Tensor, impl: str) -> list[torch.Tensor]:
    """Gradients of ``Σ logp`` w.r.t. the leaves (``hidden``, ``weight``, ``bias``, and a LoRA
    adapter's ``a``/``b`` when given): ``impl`` ``"fp64"``/``"plain"`` materialize the
    logits (float64 / the inputs' bf16, softmax in fp32 as the plain path), else logitless."""
    x = {k: v.detach().requires_grad_() for k, v in leaves.items()}
    if impl in ("fp64", "plain"):
        c = (lambda t: t.double()) if impl == "fp64" else (lambda t: t)
        y = c(x["hidden"]) @ c(x["weight"]).T + c(x["bias"])
        if "a" in x:
            y = y + (c(x["hidden"]) @ c(x["a"]).T) @ c(x["b"]).T
        logp = torch.log_softmax(y.double() if impl == "fp64" else y.float(), -1).gather(-1, targets[:, None])
    else:
        lora = HeadLoRA(x["a"], x["b"]) if "a" in x else None
        logp = vocab_stats(x["hidden"], Head(x["weight"], x["bias"], lora=lora), targets,
                           options=PassOptions(impl=impl)).logp
    return [g.double() for g in torch.autograd.grad(logp.sum(), list(x.values()))]


def lse_logp_sum_pz(partials) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse, logp, Σ p z)`` of finished :class:`RowStats` partials."""
    stats, saved = partials.finalize()
    return stats.lse, stats.logp, saved.sum_pz


def log_sum_sq_probs(partials) -> torch.Tensor:
    """``log Σ_v p_v²`` of finished :class:`RowStats` partials (``sum_sq`` requested)."""
    return partials.finalize()[0].log_sum_sq_probs


def log_sum_sq_oracle(h, w, b, tr) -> torch.Tensor:
    """float64 materialized ``log Σ_v p_v²`` (TRL's ``log_sum_sq_probs``) of the logits ``tr(h wᵀ + b)``."""
    y = h.double() @ w.double().t() + (0 if b is None else b.double())
    return torch.logsumexp(2 * torch.log_softmax(tr.apply(y), dim=-1), dim=-1)
