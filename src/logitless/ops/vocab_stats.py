"""``vocab_stats`` (recompute mode, with gradients) and ``token_logprobs`` (rollout, no grad)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backend import Impl, resolve_impl
from .plan import ChunkPlan
from .transform import LogitTransform
from .validate import check_head_inputs


class VocabStats(NamedTuple):
    """Per-token statistics, each shaped like ``targets`` (``[N]`` or ``[B, T]``), fp32
    (fp64 for fp64 inputs), in nats; ``None`` where not requested. Rows whose target is
    ``ignore_index`` hold 0."""

    logp: torch.Tensor | None
    lse: torch.Tensor | None
    entropy: torch.Tensor | None


def no_autocast(device: torch.device):
    """The pass controls its own precisions (fp32 statistics); autocast must not recast them."""
    return torch.autocast(device_type=device.type, enabled=False)


def stat_dtype_for(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward_pass(backend, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 targets: torch.Tensor, transform: LogitTransform, plan: ChunkPlan,
                 want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse, logp, sum_pz)`` for every row of ``hidden [n, H]``, chunk by chunk."""
    sdt = stat_dtype_for(hidden.dtype)
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=sdt)
        return empty, empty.clone(), empty.clone() if want_entropy else None
    lse, logp, sum_pz = [], [], []
    with no_autocast(hidden.device):
        for start in range(0, hidden.shape[0], plan.token_chunk):
            sl = slice(start, start + plan.token_chunk)
            partials, _ = backend.chunk_forward(hidden[sl], weight, bias, targets[sl], transform, plan, sdt,
                                                want_entropy, keep_logits=False)
            a, b, c = partials.finalize()
            lse.append(a)
            logp.append(b)
            if c is not None:
                sum_pz.append(c)
    return torch.cat(lse), torch.cat(logp), torch.cat(sum_pz) if want_entropy else None


class _RecomputeFn(torch.autograd.Function):
    """Forward keeps O(N) state (lse, Σpz); backward recomputes logits block by block."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform, plan, want_entropy, backend):
        lse, logp, sum_pz = forward_pass(backend, hidden, weight, bias, targets, transform, plan, want_entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, sum_pz)
        ctx.cfg = (transform, plan, backend)
        entropy = lse - sum_pz if want_entropy else torch.zeros_like(lse)
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return lse, logp, entropy

    @staticmethod
    def backward(ctx, g_lse, g_logp, g_entropy):
        hidden, weight, bias, targets, lse, sum_pz = ctx.saved_tensors
        transform, plan, backend = ctx.cfg
        if sum_pz is None:
            g_entropy = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device) if need_b else None
        grad_hidden = torch.empty_like(hidden) if need_h else None
        with no_autocast(hidden.device):
            _recompute_backward(backend, hidden, weight, bias, targets, transform, plan, lse, sum_pz, g_logp, g_lse,
                                g_entropy, grad_weight, grad_bias, grad_hidden)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None)


def _recompute_backward(backend, hidden, weight, bias, targets, transform, plan, lse, sum_pz, g_logp, g_lse,
                        g_entropy, grad_weight, grad_bias, grad_hidden) -> None:
    need_h = grad_hidden is not None
    for start in range(0, hidden.shape[0], plan.token_chunk):
        sl = slice(start, start + plan.token_chunk)
        gh = backend.chunk_backward(
            hidden[sl], weight, bias, targets[sl], transform, plan, lse[sl],
            None if sum_pz is None else sum_pz[sl],
            None if g_logp is None else g_logp[sl], None if g_lse is None else g_lse[sl],
            None if g_entropy is None else g_entropy[sl], None, grad_weight, grad_bias, need_h)
        if need_h:
            grad_hidden[sl] = gh


def _prepare(hidden, weight, bias, targets, temperature, logit_scale, softcap, ignore_index, chunk_bytes,
             impl):
    check_head_inputs(hidden, weight, bias, targets, ignore_index)
    transform = LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    backend = resolve_impl(impl, hidden.device)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1).long()
    valid = t1 != ignore_index
    compact = not bool(valid.all())
    if compact:  # only rows with a target are computed
        h2, t1 = h2[valid], t1[valid]
    plan = ChunkPlan.make(h2.shape[0], weight.shape[0], chunk_bytes, stat_dtype_for(hidden.dtype), hidden.dtype,
                          backend.NAME)
    return transform, backend, h2, t1, valid if compact else None, plan


def _expand(x: torch.Tensor, valid: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    if valid is not None:
        # masked_scatter keeps the graph connected even when no row is valid.
        x = x.new_zeros(valid.shape).masked_scatter(valid, x)
    return x.reshape(shape)


def vocab_stats(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] or [B, T]
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    entropy: bool = True,
    chunk_bytes: int | None = None,
    impl: Impl = "auto",
) -> VocabStats:
    """Per-token log-prob of the target, log-sum-exp and entropy of the head's softmax, in
    one blocked pass over the vocabulary, differentiable w.r.t. ``hidden``, ``weight`` and
    ``bias`` (recompute mode: O(N) saved state, logits recomputed blockwise in backward).

    Logits are ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature``
    (see :class:`LogitTransform`); ``logp = z[y] - lse(z)``, ``lse = log Σ_v exp z_v``,
    ``entropy = lse - Σ_v p_v z_v`` (nats). Statistics are computed in fp32 whatever the input
    dtype (fp64 for fp64 inputs); ``grad weight`` is accumulated in fp32 and cast once.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` fp16/bf16/fp32/fp64.
        weight: ``[V, H]``, same dtype and device.
        targets: integer ``[N]`` or ``[B, T]``; ``ignore_index`` rows give 0 and no gradient.
        bias: optional ``[V]``.
        temperature, logit_scale, softcap: see :class:`LogitTransform`.
        entropy: also compute the entropy (one more reduction per block).
        chunk_bytes: workspace budget in bytes (default 1 GiB, env ``LOGITLESS_CHUNK_BYTES``).
        impl: ``"auto"`` (Triton on CUDA when available), ``"torch"`` or ``"triton"``.

    Returns:
        :class:`VocabStats` ``(logp, lse, entropy)``, each shaped like ``targets``.

    Raises:
        TypeError, ValueError: see :func:`logitless.ops.validate.check_head_inputs`; bad
            ``temperature``/``softcap``/``chunk_bytes``/``impl``.
    """
    transform, backend, h2, t1, valid, plan = _prepare(
        hidden, weight, bias, targets, temperature, logit_scale, softcap, ignore_index, chunk_bytes, impl)
    lse, logp, ent = _RecomputeFn.apply(h2, weight, bias, t1, transform, plan, entropy, backend)
    shape = targets.shape
    return VocabStats(logp=_expand(logp, valid, shape), lse=_expand(lse, valid, shape),
                      entropy=_expand(ent, valid, shape) if entropy else None)


@torch.no_grad()
def token_logprobs(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] or [B, T]
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_bytes: int | None = None,
    impl: Impl = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rollout side: log-probs of ``targets`` (old-policy / reference passes), no gradient,
    one logits GEMM's worth of work, workspace bounded by ``chunk_bytes``.

    Same inputs and semantics as :func:`vocab_stats`. Returns ``logp`` shaped like ``targets``
    (fp32, nats; 0 at ``ignore_index``), or ``(logp, entropy)`` with ``return_entropy=True``.

    Raises:
        TypeError, ValueError: as :func:`vocab_stats`.
    """
    transform, backend, h2, t1, valid, plan = _prepare(
        hidden, weight, bias, targets, temperature, logit_scale, softcap, ignore_index, chunk_bytes, impl)
    lse, logp, sum_pz = forward_pass(backend, h2, weight, bias, t1, transform, plan, return_entropy)
    logp = _expand(logp, valid, targets.shape)
    if return_entropy:
        return logp, _expand(lse - sum_pz, valid, targets.shape)
    return logp
