"""``vocab_stats`` (recompute mode, with gradients) and ``token_logprobs`` (rollout, no grad)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..distributed import all_reduce, is_active
from .backend import Impl, resolve_impl
from .plan import ChunkPlan
from .shard import VocabShard, reduce_partials
from .torch_backend import Partials
from .transform import LogitTransform
from .validate import check_head_inputs


class VocabStats(NamedTuple):
    """Per-token statistics, each shaped like ``targets`` (``[N]`` or ``[B, T]``), fp32
    (fp64 for fp64 inputs), in nats; ``None`` where not requested. Rows whose target is
    ``ignore_index`` hold 0. ``mean_logit = Σ_v z_v / V``."""

    logp: torch.Tensor | None
    lse: torch.Tensor | None
    entropy: torch.Tensor | None
    mean_logit: torch.Tensor | None = None


class PassStats(NamedTuple):
    """Full-vocabulary statistics of a pass, ``[n]`` each: ``lse``, ``logp``, ``sum_pz = Σ p z``
    (``entropy = lse - sum_pz``), ``sum_z = Σ z`` and ``is_top1`` (the target's logit is the
    largest; ties count)."""

    lse: torch.Tensor
    logp: torch.Tensor
    sum_pz: torch.Tensor | None
    sum_z: torch.Tensor | None
    is_top1: torch.Tensor


def stats_from_partials(p: Partials) -> PassStats:
    lse, logp, sum_pz = p.finalize()
    return PassStats(lse=lse, logp=logp, sum_pz=sum_pz, sum_z=p.sz, is_top1=p.zy >= p.m)


@dataclass(frozen=True)
class LocalHead:
    """The rows of ``weight`` that take part in the softmax, and targets indexed into them."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    group: object | None
    vocab_start: int
    vocab_size: int
    reduce_grad_hidden: bool

    @classmethod
    def make(cls, weight: torch.Tensor, bias: torch.Tensor | None, shard: VocabShard | None) -> LocalHead:
        shard = VocabShard() if shard is None else shard
        start, size, valid = shard.resolve(weight.shape[0])
        return cls(weight=weight[:valid], bias=None if bias is None else bias[:valid], group=shard.group,
                   vocab_start=start, vocab_size=size, reduce_grad_hidden=shard.reduce_grad_hidden)

    def rows_of(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LocalHead:
        """This head over ``weight``/``bias`` (e.g. the tensors autograd saved): the same rows."""
        rows = self.weight.shape[0]
        return dataclasses.replace(self, weight=weight[:rows], bias=None if bias is None else bias[:rows])

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Global ids → local rows; ids owned by another rank fall outside ``[0, V_local)``."""
        return targets - self.vocab_start if self.vocab_start else targets


def no_autocast(device: torch.device):
    """The pass controls its own precisions (fp32 statistics); autocast must not recast them."""
    return torch.autocast(device_type=device.type, enabled=False)


def stat_dtype_for(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward_pass(backend, hidden: torch.Tensor, head: LocalHead, targets: torch.Tensor, transform: LogitTransform,
                 plan: ChunkPlan, want_entropy: bool, want_sum_z: bool = False) -> PassStats:
    """Statistics of every row of ``hidden [n, H]``, chunk by chunk; under vocabulary
    parallelism the partials of the whole pass are reduced once (one MAX, one SUM)."""
    sdt = stat_dtype_for(hidden.dtype)
    n = hidden.shape[0]
    # Whole-pass buffers filled chunk by chunk: keeping every chunk's small result tensors alive
    # instead pins the heap between the chunks' large logits blocks on CPU (glibc), and resident
    # memory then grows by about one block per chunk, i.e. with N x V.
    out = Partials.empty(n, sdt, hidden.device, want_entropy, want_sum_z)
    with no_autocast(hidden.device):
        for start in range(0, n, plan.token_chunk):
            sl = slice(start, start + plan.token_chunk)
            partials, _ = backend.chunk_forward(hidden[sl], head.weight, head.bias, targets[sl], transform, plan, sdt,
                                                want_entropy, keep_logits=False, want_sum_z=want_sum_z)
            out.write(sl, partials)
            del partials
    return stats_from_partials(reduce_partials(out, head.group))


def backward_pass(backend, hidden: torch.Tensor, head: LocalHead, targets: torch.Tensor,
                  transform: LogitTransform, plan: ChunkPlan, lse: torch.Tensor, sum_pz: torch.Tensor | None,
                  g_logp, g_lse, g_entropy, g_sum_z, grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None,
                  need_grad_hidden: bool) -> torch.Tensor | None:
    """``d hidden`` (reduced over the vocabulary group unless told not to) and, in place, the
    local rows of ``d weight``/``d bias``, recomputing logits block by block from the forward's
    ``lse`` and ``sum_pz`` (``[n]``)."""
    # Vocabulary-parallel partials are summed in the statistics dtype, then cast once.
    partial = need_grad_hidden and head.reduce_grad_hidden and is_active(head.group)
    grad_hidden = torch.empty_like(hidden, dtype=lse.dtype if partial else None) if need_grad_hidden else None
    valid = head.weight.shape[0]
    gw = None if grad_weight is None else grad_weight[:valid]
    gb = None if grad_bias is None else grad_bias[:valid]

    def part(x, sl):
        return None if x is None else x[sl]

    with no_autocast(hidden.device):
        for start in range(0, hidden.shape[0], plan.token_chunk):
            sl = slice(start, start + plan.token_chunk)
            gh = backend.chunk_backward(
                hidden[sl], head.weight, head.bias, targets[sl], transform, plan, lse[sl], part(sum_pz, sl),
                part(g_logp, sl), part(g_lse, sl), part(g_entropy, sl), None, gw, gb, need_grad_hidden,
                g_sum_z=part(g_sum_z, sl))
            if need_grad_hidden:
                grad_hidden[sl] = gh
    if partial:
        grad_hidden = all_reduce(grad_hidden, "sum", head.group).to(hidden.dtype)
    return grad_hidden


class _RecomputeFn(torch.autograd.Function):
    """Forward keeps O(N) state (lse, Σpz); backward recomputes logits block by block.

    Outputs ``(lse, logp, entropy, sum_z, is_top1)``, ``[n]`` each; entropy/sum_z are zeros
    (and non-differentiable) when not requested; ``is_top1`` is a bool tensor.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform, plan, want_entropy, want_sum_z, backend, head):
        st = forward_pass(backend, hidden, head, targets, transform, plan, want_entropy, want_sum_z)
        ctx.save_for_backward(hidden, weight, bias, targets, st.lse, st.sum_pz)
        ctx.cfg = (transform, plan, backend, head)
        zeros = torch.zeros_like(st.lse)
        entropy = st.lse - st.sum_pz if want_entropy else zeros
        sum_z = st.sum_z if want_sum_z else zeros.clone()
        top1 = st.is_top1.clone()
        ctx.mark_non_differentiable(top1, *([] if want_entropy else [entropy]), *([] if want_sum_z else [sum_z]))
        return st.lse, st.logp, entropy, sum_z, top1

    @staticmethod
    def backward(ctx, g_lse, g_logp, g_entropy, g_sum_z, _g_max):
        hidden, weight, bias, targets, lse, sum_pz = ctx.saved_tensors
        transform, plan, backend, head = ctx.cfg
        if sum_pz is None:
            g_entropy = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device) if need_b else None
        grad_hidden = backward_pass(backend, hidden, head.rows_of(weight, bias), targets, transform, plan, lse,
                                    sum_pz, g_logp, g_lse, g_entropy, g_sum_z, grad_weight, grad_bias, need_h)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None, None, None)


def recompute_stats(backend, hidden, weight, bias, targets, transform, plan, want_entropy, want_sum_z,
                    shard: VocabShard | None):
    """Differentiable ``(lse, logp, entropy, sum_z, is_top1)`` of ``hidden [n, H]`` against the
    (local shard of the) head, targets global."""
    head = LocalHead.make(weight, bias, shard)
    # LocalHead holds views for the pass; the Function gets the parameters themselves so
    # autograd returns gradients shaped like them.
    return _RecomputeFn.apply(hidden, weight, bias, head.local_targets(targets), transform, plan, want_entropy,
                              want_sum_z, backend, head)


def _prepare(hidden, weight, bias, targets, transform, ignore_index, chunk_bytes, impl, shard):
    head = LocalHead.make(weight, bias, shard)
    check_head_inputs(hidden, weight, bias, targets, ignore_index, vocab_size=head.vocab_size)
    backend = resolve_impl(impl, hidden.device)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1).long()
    valid = t1 != ignore_index
    compact = not bool(valid.all())
    if compact:  # only rows with a target are computed
        h2, t1 = h2[valid], t1[valid]
    plan = ChunkPlan.make(h2.shape[0], max(head.weight.shape[0], 1), chunk_bytes, stat_dtype_for(hidden.dtype),
                          hidden.dtype, backend.NAME)
    return backend, h2, t1, valid if compact else None, plan, head


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
    mean_logit: bool = False,
    shard: VocabShard | None = None,
    chunk_bytes: int | None = None,
    impl: Impl = "auto",
) -> VocabStats:
    """Per-token log-prob of the target, log-sum-exp and entropy of the head's softmax, in
    one blocked pass over the vocabulary, differentiable w.r.t. ``hidden``, ``weight`` and
    ``bias`` (recompute mode: O(N) saved state, logits recomputed blockwise in backward).

    Logits are ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature``
    (see :class:`LogitTransform`); ``logp = z[y] - lse(z)``, ``lse = log Σ_v exp z_v``,
    ``entropy = lse - Σ_v p_v z_v`` (nats), ``mean_logit = Σ_v z_v / V``. Statistics are
    computed in fp32 whatever the input dtype (fp64 for fp64 inputs); ``grad weight`` is
    accumulated in fp32 and cast once.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` fp16/bf16/fp32/fp64.
        weight: ``[V, H]``, same dtype and device (the local rows under ``shard``).
        targets: integer ``[N]`` or ``[B, T]`` global token ids; ``ignore_index`` rows give 0
            and no gradient.
        bias: optional ``[V]``.
        temperature, logit_scale, softcap: see :class:`LogitTransform`.
        entropy: also compute the entropy (one more reduction per block).
        mean_logit: also compute the mean logit (label smoothing).
        shard: :class:`VocabShard` for a vocabulary-parallel or padded head.
        chunk_bytes: workspace budget in bytes (default 1 GiB, env ``LOGITLESS_CHUNK_BYTES``).
        impl: ``"auto"`` (Triton on CUDA when available), ``"torch"`` or ``"triton"``.

    Returns:
        :class:`VocabStats` ``(logp, lse, entropy, mean_logit)``, each shaped like ``targets``.

    Raises:
        TypeError, ValueError: see :func:`logitless.ops.validate.check_head_inputs`; bad
            ``temperature``/``softcap``/``chunk_bytes``/``impl``/``shard``.
    """
    transform = LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    backend, h2, t1, valid, plan, head = _prepare(hidden, weight, bias, targets, transform, ignore_index,
                                                  chunk_bytes, impl, shard)
    lse, logp, ent, sum_z, _ = recompute_stats(backend, h2, weight, bias, t1, transform, plan, entropy, mean_logit,
                                               shard)
    shape = targets.shape
    return VocabStats(logp=_expand(logp, valid, shape), lse=_expand(lse, valid, shape),
                      entropy=_expand(ent, valid, shape) if entropy else None,
                      mean_logit=_expand(sum_z / head.vocab_size, valid, shape) if mean_logit else None)


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
    shard: VocabShard | None = None,
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
    transform = LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    backend, h2, t1, valid, plan, head = _prepare(hidden, weight, bias, targets, transform, ignore_index,
                                                  chunk_bytes, impl, shard)
    st = forward_pass(backend, h2, head, head.local_targets(t1), transform, plan, return_entropy)
    logp = _expand(st.logp, valid, targets.shape)
    if return_entropy:
        return logp, _expand(st.lse - st.sum_pz, valid, targets.shape)
    return logp
