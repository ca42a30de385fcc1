"""The vocabulary layer's public functions: ``vocab_stats`` (differentiable statistics) and
``token_logprobs`` (rollout log-probs, no gradient)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..amp import autocast_head_inputs
from ..ops import (
    ChunkStats,
    ObjectiveSpec,
    PassOptions,
    Started,
    ValueChecks,
    as_options,
    check_head_inputs,
    compute_stats,
    start_pass,
)
from ..ops.contract import Head, StatRequest, as_head
from . import compiled
from .layout import counted_first_order


class VocabStats(NamedTuple):
    """Per-token statistics, each shaped like ``targets`` (``[N]`` or ``[B, T]``), fp32
    (fp64 for fp64 inputs), in nats; ``None`` where not requested. Rows whose target is
    ``ignore_index`` hold 0. ``mean_logit = Σ_v z_v / V``."""

    logp: torch.Tensor | None
    lse: torch.Tensor | None
    entropy: torch.Tensor | None
    mean_logit: torch.Tensor | None = None


def read_counted(hidden: torch.Tensor, head: Head, targets: torch.Tensor, ignore_index: int,
                 checks: ValueChecks, want: StatRequest, options: PassOptions,
                 fused: bool) -> tuple[torch.Tensor, int, Started | None]:
    """Check the head's inputs at the counted positions (targets other than ``ignore_index``)
    with ``checks``, and read them with how many positions count in one host synchronization;
    the pass's first statistics GEMMs run while the host builds the checks and while it waits
    (:func:`~logitless.ops.start_pass`, in two parts). Returns ``(every flattened position, the
    counted ones first, in order; the count; the started GEMM or None)``."""
    counted = targets != ignore_index if isinstance(targets, torch.Tensor) else None  # (else the checks name it)
    check_head_inputs(hidden, head, targets, None, checks, counted=counted)  # (its values' reductions: at the send)
    order = counted_first_order(counted.reshape(-1))[0]
    first = start_pass(hidden, targets, order, head, ObjectiveSpec(want), options, fused)
    read = checks.send(None, counted.sum())
    started = first and start_pass(hidden, targets, order, head, ObjectiveSpec(want), options, fused, after=first)
    return order, int(read.wait()[0][0]), started


def _stats(hidden, head, targets, ignore_index, want: StatRequest,
           options) -> tuple[ChunkStats, torch.Tensor | None, Head]:
    """Validate, then every counted row's statistics (the rows whose target is not
    ``ignore_index``; only those enter the pass), their flattened positions (``None``: every
    row counts) and the head, with one host read (:func:`read_counted`)."""
    head, options = as_head(head), as_options(options)
    order, count, started = read_counted(hidden, head, targets, ignore_index, ValueChecks(), want, options, False)
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).long()
    positions = None if count == t1.numel() else order[:count]
    if positions is not None:
        h2, t1 = h2[positions], t1[positions]
    return compute_stats(h2, head, t1, want, options, started=started), positions, head


def _expand(x: torch.Tensor, positions: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    if positions is not None:
        # Out of place: keeps the graph connected even when no row counts.
        x = x.new_zeros(shape.numel()).index_put((positions,), x)
    return x.reshape(shape)


def _compiled_vocab_stats(eager, args) -> VocabStats:
    return VocabStats(*compiled.vocab_stats(eager, args))


@autocast_head_inputs(compiled=compiled.route(_compiled_vocab_stats))
def vocab_stats(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [N] or [B, T]
    *,
    ignore_index: int = -100,
    entropy: bool = True,
    mean_logit: bool = False,
    options: PassOptions | None = None,
) -> VocabStats:
    """Per-token log-prob of the target, log-sum-exp and entropy of the head's softmax, in
    one blocked pass over the vocabulary, differentiable w.r.t. ``hidden`` and the head's
    weight, bias and adapter (recompute mode: O(N) saved state, logits recomputed blockwise in
    the backward).

    Logits are ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature``
    (the head's :class:`LogitTransform`); ``logp = z[y] - lse(z)``, ``lse = log Σ_v exp z_v``,
    ``entropy = lse - Σ_v p_v z_v`` (nats), ``mean_logit = Σ_v z_v / V``. Statistics are
    computed in fp32 whatever the input dtype (fp64 for fp64 inputs); ``grad weight`` is
    accumulated in fp32 (across token chunks, or inside one GEMM when the pass is one chunk;
    across short chunks of a bf16 head on Hopper, as a bf16 + int8 pair with 15 significant bits)
    and rounded once.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` fp16/bf16/fp32/fp64.
        head: a :class:`Head` (weight ``[V, H]`` of the same dtype and device, bias, transform,
            LoRA adapter, vocabulary shard), or a bare ``[V, H]`` weight.
        targets: integer ``[N]`` or ``[B, T]`` global token ids; ``ignore_index`` rows give 0
            and no gradient.
        entropy: also compute the entropy (one more reduction per block).
        mean_logit: also compute the mean logit (label smoothing).
        options: :class:`PassOptions` (backend, workspace budget, logits precision).

    Returns:
        :class:`VocabStats` ``(logp, lse, entropy, mean_logit)``, each shaped like ``targets``.

    Raises:
        TypeError: a non-tensor ``hidden``/weight/``targets``, a non-floating ``hidden`` or
            weight, non-integer ``targets``, dtypes of ``hidden``, weight and bias that differ,
            ``options`` not a :class:`PassOptions`.
        ValueError: ranks or shapes that do not fit (``[N, H]``/``[B, T, H]`` against ``[V, H]``
            and ``targets`` of ``hidden``'s leading shape), devices that differ, a target outside
            ``[0, V)`` other than ``ignore_index``, NaN/inf in ``hidden``, the weight, bias or
            adapter factors, logits beyond what the statistics hold, a bad shard or adapter
            (:meth:`HeadLoRA.check`); the details are in
            :func:`logitless.ops.validate.check_head_inputs`.
        PassOutOfMemoryError: the per-chunk workspace does not fit the device; the message
            names a ``chunk_bytes`` to retry with.
    """
    st, valid, head = _stats(hidden, head, targets, ignore_index, StatRequest(entropy, mean_logit), options)
    shape = targets.shape
    vocab = head.local().vocab_size
    return VocabStats(logp=_expand(st.logp, valid, shape), lse=_expand(st.lse, valid, shape),
                      entropy=_expand(st.entropy, valid, shape) if entropy else None,
                      mean_logit=_expand(st.sum_z / vocab, valid, shape) if mean_logit else None)


@autocast_head_inputs(compiled=compiled.route(compiled.token_logprobs))
@torch.no_grad()
def token_logprobs(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    head: Head | torch.Tensor,  # Head, or a [V, H] weight
    targets: torch.Tensor,  # [N] or [B, T]
    *,
    ignore_index: int = -100,
    entropy: bool = False,
    options: PassOptions | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rollout side: log-probs of ``targets`` (old-policy / reference passes), no gradient,
    one logits GEMM's worth of work, workspace bounded by ``options.chunk_bytes``.

    Args:
        hidden, head, targets, ignore_index, options: as :func:`vocab_stats` (``hidden``
            ``[N, H]`` or ``[B, T, H]`` fp16/bf16/fp32/fp64, ``targets`` integer ``[N]`` or
            ``[B, T]`` global token ids).
        entropy: also return every token's entropy.

    Returns:
        ``logp`` shaped like ``targets`` (fp32, fp64 for fp64 inputs; nats; 0 at
        ``ignore_index``), or ``(logp, entropy)`` with ``entropy=True`` (same shape, dtype, units).

    Raises:
        TypeError, ValueError: as :func:`vocab_stats`.
    """
    st, valid, _ = _stats(hidden, head, targets, ignore_index, StatRequest(entropy, False), options)
    logp = _expand(st.logp, valid, targets.shape)
    if entropy:
        return logp, _expand(st.entropy, valid, targets.shape)
    return logp
