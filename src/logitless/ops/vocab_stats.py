"""``vocab_stats`` (recompute mode, with gradients) and ``token_logprobs`` (rollout, no grad)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..amp import autocast_head_inputs
from ..compile import graph_break
from ..distributed import all_reduce, is_active
from .backend import Impl, resolve_impl
from .lora import HeadLoRA, LowRank
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

    def low_rank(self, x: torch.Tensor | None, b: torch.Tensor | None) -> LowRank | None:
        """An adapter's factors over this head's rows (``b`` cut like ``weight``), or ``None``."""
        return None if x is None else LowRank(x, b[:self.weight.shape[0]])

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Global ids → local rows; ids owned by another rank fall outside ``[0, V_local)``."""
        return targets - self.vocab_start if self.vocab_start else targets


def no_autocast(device: torch.device):
    """The pass controls its own precisions (fp32 statistics); autocast must not recast them."""
    return torch.autocast(device_type=device.type, enabled=False)


def stat_dtype_for(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward_pass(backend, hidden: torch.Tensor, head: LocalHead, targets: torch.Tensor, transform: LogitTransform,
                 plan: ChunkPlan, want_entropy: bool, want_sum_z: bool = False,
                 low: LowRank | None = None) -> PassStats:
    """Statistics of every row of ``hidden [n, H]``, chunk by chunk; under vocabulary
    parallelism the partials of the whole pass are reduced once (one MAX, one SUM). ``low``:
    the head's low-rank term (``x`` rows aligned with ``hidden``, ``b`` the local rows)."""
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
                                                want_entropy, keep_logits=False, want_sum_z=want_sum_z,
                                                lora=None if low is None else low.rows(sl))
            out.write(sl, partials)
            del partials
    return stats_from_partials(reduce_partials(out, head.group))


def backward_pass(backend, hidden: torch.Tensor, head: LocalHead, targets: torch.Tensor,
                  transform: LogitTransform, plan: ChunkPlan, lse: torch.Tensor, sum_pz: torch.Tensor | None,
                  g_logp, g_lse, g_entropy, g_sum_z, grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None,
                  need_grad_hidden: bool, low: LowRank | None = None, grad_lora_x: torch.Tensor | None = None,
                  grad_lora_b: torch.Tensor | None = None) -> torch.Tensor | None:
    """``d hidden`` (reduced over the vocabulary group unless told not to) and, in place, the
    local rows of ``d weight``/``d bias`` (and of ``d b``, with ``d x`` reduced like ``d hidden``,
    for a low-rank term), recomputing logits block by block from the forward's ``lse`` and
    ``sum_pz`` (``[n]``)."""
    # Vocabulary-parallel partials are summed in the statistics dtype, then cast once.
    partial = need_grad_hidden and head.reduce_grad_hidden and is_active(head.group)
    grad_hidden = torch.empty_like(hidden, dtype=lse.dtype if partial else None) if need_grad_hidden else None
    valid = head.weight.shape[0]
    gw = None if grad_weight is None else grad_weight[:valid]
    gb = None if grad_bias is None else grad_bias[:valid]
    glb = None if grad_lora_b is None else grad_lora_b[:valid]

    def part(x, sl):
        return None if x is None else x[sl]

    with no_autocast(hidden.device):
        for start in range(0, hidden.shape[0], plan.token_chunk):
            sl = slice(start, start + plan.token_chunk)
            gh = backend.chunk_backward(
                hidden[sl], head.weight, head.bias, targets[sl], transform, plan, lse[sl], part(sum_pz, sl),
                part(g_logp, sl), part(g_lse, sl), part(g_entropy, sl), None, gw, gb, need_grad_hidden,
                g_sum_z=part(g_sum_z, sl), lora=None if low is None else low.rows(sl),
                grad_lora_x=part(grad_lora_x, sl), grad_lora_b=glb)
            if need_grad_hidden:
                grad_hidden[sl] = gh
    if partial:
        grad_hidden = all_reduce(grad_hidden, "sum", head.group).to(hidden.dtype)
    if grad_lora_x is not None and head.reduce_grad_hidden and is_active(head.group):
        grad_lora_x.copy_(all_reduce(grad_lora_x, "sum", head.group))
    return grad_hidden


class _RecomputeFn(torch.autograd.Function):
    """Forward keeps O(N) state (lse, Σpz); backward recomputes logits block by block.

    Outputs ``(lse, logp, entropy, sum_z, is_top1)``, ``[n]`` each; entropy/sum_z are zeros
    (and non-differentiable) when not requested; ``is_top1`` is a bool tensor.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, lora_x, lora_b, targets, transform, plan, want_entropy, want_sum_z,
                backend, head):
        st = forward_pass(backend, hidden, head, targets, transform, plan, want_entropy, want_sum_z,
                          head.low_rank(lora_x, lora_b))
        ctx.save_for_backward(hidden, weight, bias, lora_x, lora_b, targets, st.lse, st.sum_pz)
        ctx.cfg = (transform, plan, backend, head)
        zeros = torch.zeros_like(st.lse)
        entropy = st.lse - st.sum_pz if want_entropy else zeros
        sum_z = st.sum_z if want_sum_z else zeros.clone()
        top1 = st.is_top1.clone()
        ctx.mark_non_differentiable(top1, *([] if want_entropy else [entropy]), *([] if want_sum_z else [sum_z]))
        return st.lse, st.logp, entropy, sum_z, top1

    @staticmethod
    def backward(ctx, g_lse, g_logp, g_entropy, g_sum_z, _g_max):
        hidden, weight, bias, lora_x, lora_b, targets, lse, sum_pz = ctx.saved_tensors
        transform, plan, backend, head = ctx.cfg
        if sum_pz is None:
            g_entropy = None
        need_h, need_w, need_b, need_x, need_lb = ctx.needs_input_grad[:5]

        def zeros(want, like):
            return torch.zeros(like.shape, dtype=lse.dtype, device=like.device) if want else None

        grad_weight, grad_bias = zeros(need_w, weight), zeros(need_b, bias)
        grad_x, grad_lb = zeros(need_x, lora_x), zeros(need_lb, lora_b)
        local = head.rows_of(weight, bias)
        grad_hidden = backward_pass(backend, hidden, local, targets, transform, plan, lse, sum_pz, g_logp, g_lse,
                                    g_entropy, g_sum_z, grad_weight, grad_bias, need_h,
                                    local.low_rank(lora_x, lora_b), grad_x, grad_lb)

        def cast(g, like):
            return None if g is None else g.to(like.dtype)

        return (grad_hidden, cast(grad_weight, weight), cast(grad_bias, bias), cast(grad_x, lora_x),
                cast(grad_lb, lora_b), None, None, None, None, None, None, None)


def recompute_stats(backend, hidden, weight, bias, targets, transform, plan, want_entropy, want_sum_z,
                    shard: VocabShard | None, lora: HeadLoRA | None = None):
    """Differentiable ``(lse, logp, entropy, sum_z, is_top1)`` of ``hidden [n, H]`` against the
    (local shard of the) head, targets global, with ``lora``'s low-rank term when given."""
    head = LocalHead.make(weight, bias, shard)
    x, b = (None, None) if lora is None else lora.factors(hidden, weight)
    # LocalHead holds views for the pass; the Function gets the parameters themselves so
    # autograd returns gradients shaped like them.
    return _RecomputeFn.apply(hidden, weight, bias, x, b, head.local_targets(targets), transform, plan,
                              want_entropy, want_sum_z, backend, head)


def _prepare(hidden, weight, bias, targets, transform, ignore_index, chunk_bytes, impl, shard, lora, fp32_logits):
    head = LocalHead.make(weight, bias, shard)
    check_head_inputs(hidden, weight, bias, targets, ignore_index, vocab_size=head.vocab_size, lora=lora)
    backend = resolve_impl(impl, hidden.device)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1).long()
    valid = t1 != ignore_index
    compact = not bool(valid.all())
    if compact:  # only rows with a target are computed
        h2, t1 = h2[valid], t1[valid]
    plan = ChunkPlan.make(h2.shape[0], max(head.weight.shape[0], 1), chunk_bytes, stat_dtype_for(hidden.dtype),
                          hidden.dtype, backend.NAME, fp32_logits)
    return backend, h2, t1, valid if compact else None, plan, head


def _expand(x: torch.Tensor, valid: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    if valid is not None:
        # masked_scatter keeps the graph connected even when no row is valid.
        x = x.new_zeros(valid.shape).masked_scatter(valid, x)
    return x.reshape(shape)


@graph_break
@autocast_head_inputs
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
    lora: HeadLoRA | None = None,
    chunk_bytes: int | None = None,
    fp32_logits: bool | None = None,
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
        lora: :class:`HeadLoRA` adapter on the head (``W`` may be frozen); its low-rank term is
            added inside every block and its ``a``/``b`` receive gradients.
        chunk_bytes: workspace budget in bytes (default 1 GiB, env ``LOGITLESS_CHUNK_BYTES``).
        fp32_logits: keep the head's matmul output in fp32 (default, env
            ``LOGITLESS_TRITON_LOGITS=input`` flips it); ``False`` rounds it to the input dtype
            first, as the plain bf16/fp16 path does (half the workspace and traffic; statistics
            still accumulate in fp32).
        impl: ``"auto"`` (Triton on CUDA when available), ``"torch"`` or ``"triton"``.

    Returns:
        :class:`VocabStats` ``(logp, lse, entropy, mean_logit)``, each shaped like ``targets``.

    Raises:
        TypeError, ValueError: see :func:`logitless.ops.validate.check_head_inputs` and
            :meth:`HeadLoRA.check`; bad ``temperature``/``softcap``/``chunk_bytes``/``impl``/``shard``.
    """
    transform = LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    backend, h2, t1, valid, plan, head = _prepare(hidden, weight, bias, targets, transform, ignore_index,
                                                  chunk_bytes, impl, shard, lora, fp32_logits)
    lse, logp, ent, sum_z, _ = recompute_stats(backend, h2, weight, bias, t1, transform, plan, entropy, mean_logit,
                                               shard, lora)
    shape = targets.shape
    return VocabStats(logp=_expand(logp, valid, shape), lse=_expand(lse, valid, shape),
                      entropy=_expand(ent, valid, shape) if entropy else None,
                      mean_logit=_expand(sum_z / head.vocab_size, valid, shape) if mean_logit else None)


@graph_break
@autocast_head_inputs
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
    lora: HeadLoRA | None = None,
    chunk_bytes: int | None = None,
    fp32_logits: bool | None = None,
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
                                                  chunk_bytes, impl, shard, lora, fp32_logits)
    low = None if lora is None else head.low_rank(*lora.factors(h2, weight))
    st = forward_pass(backend, h2, head, head.local_targets(t1), transform, plan, return_entropy, low=low)
    logp = _expand(st.logp, valid, targets.shape)
    if return_entropy:
        return logp, _expand(st.lse - st.sum_pz, valid, targets.shape)
    return logp
