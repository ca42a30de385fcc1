"""verl's fused-kernel interface on logitless: drop-in ``FusedLinearForPPO`` and
``linear_cross_entropy`` (hidden states, vocabulary weight, target ids, temperature → per-token
log-probs and entropy, both differentiable), tensor-parallel through a process group.

verl's actor (``actor_rollout_ref.model.use_fused_kernels=True``) calls one of two things from
its patched model forward (``verl/models/transformers/dense_common.py`` and the per-family
files): ``FusedLinearForPPO()(hidden_states=, vocab_weights=, input_ids=rolled_labels,
temperature=)`` (``verl/utils/experimental/torch_functional.py``, ``impl_backend=torch``) or
``linear_cross_entropy(hidden, weight, rolled_labels, temperature, "none"[, tp_group])``
(``verl/utils/kernel/linear_cross_entropy.py``, ``impl_backend=triton``). The ids are already the
targets (verl rolls ``input_ids`` by -1 before the call); no token is masked. :func:`patch_verl`
swaps both for the versions below; the recipe is in ``docs/verl.md``.
"""

from __future__ import annotations

import importlib
import sys

import torch

from ..objectives import vocab_stats
from ..ops import Head, LogitTransform, PassOptions, VocabShard


def linear_cross_entropy(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H] or this rank's rows [V / tp, H]
    labels: torch.Tensor,  # [N] or [B, T], global ids
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: torch.distributed.ProcessGroup | None = None,
    *,
    options: PassOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log p(label)`` and entropy of ``softmax(hidden @ weight.T / temperature)``, in
    one logitless vocabulary pass, with verl's ``linear_cross_entropy`` call signature.

    Args:
        hidden: final hidden states ``[N, H]`` or ``[B, T, H]`` (bf16/fp16/fp32/fp64).
        weight: the head ``[V, H]``; with ``dist_process_group``, this rank's contiguous rows of a
            vocabulary-parallel head (rank ``r`` holds rows ``r·V_local …``, Megatron's layout).
        labels: target ids shaped like ``hidden[..., 0]`` (verl passes ``input_ids`` rolled by -1).
        temperature: the logits are divided by it (> 0).
        reduction: only ``"none"`` (what verl's actor passes).
        dist_process_group: the tensor-parallel group of a vocabulary-parallel head; one
            all-reduce MAX and one SUM per pass, ``d hidden`` all-reduced over the group.
        options: :class:`logitless.PassOptions`.

    Returns:
        ``(log_probs, entropy)`` shaped like ``labels``, fp32 (fp64 for fp64 inputs), nats; both
        differentiable w.r.t. ``hidden`` and ``weight``.

    Raises:
        ValueError: ``reduction`` other than ``"none"``; everything :func:`logitless.vocab_stats`
            raises (shapes, dtypes, out-of-range ids, temperature).
    """
    if reduction != "none":
        raise ValueError(
            f"reduction must be 'none' (per-token log-probs and entropy, as verl's actor asks), "
            f"got {reduction!r}; reduce the returned tensors yourself"
        )
    shard = None if dist_process_group is None else VocabShard(group=dist_process_group)
    head = Head(weight, transform=LogitTransform(temperature=float(temperature)), shard=shard)
    st = vocab_stats(hidden, head, labels, entropy=True, ignore_index=-(2**62), options=options)
    return st.logp, st.entropy


class FusedLinearForPPO(torch.nn.Module):
    """verl's ``FusedLinearForPPO`` module on logitless (same constructor and ``forward``).

    ``chunk_size`` (tokens per chunk in verl) is accepted and ignored: logitless sizes its blocks
    by a byte budget. ``impl_backend`` (verl's choice between its torch and Liger kernels) is
    checked as verl checks it and otherwise ignored: both compute the same statistics, which
    logitless computes in one pass. ``process_group`` (extra, keyword-only) makes the head
    vocabulary-parallel, as :func:`linear_cross_entropy`'s ``dist_process_group``.

    Raises:
        ValueError: ``impl_backend`` other than ``"torch"`` or ``"liger"`` (verl's message).
    """

    def __init__(
        self,
        chunk_size: int = 512,
        impl_backend: str = "torch",
        *,
        process_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend
        self.process_group = process_group

    def forward(
        self,
        hidden_states: torch.Tensor,
        vocab_weights: torch.Tensor,
        input_ids: torch.Tensor,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_probs, entropy)`` of ``input_ids`` (already the targets, any integer dtype, as
        verl casts them to int64), shaped like them; see :func:`linear_cross_entropy`."""
        return linear_cross_entropy(
            hidden_states, vocab_weights, input_ids.to(torch.int64), temperature, "none", self.process_group
        )


def patch_verl() -> list[str]:
    """Point verl's fused-kernel entry points at logitless, in this process: the
    ``FusedLinearForPPO`` of ``verl.utils.experimental.torch_functional`` and the
    ``linear_cross_entropy`` of ``verl.utils.kernel.linear_cross_entropy`` (and of
    ``verl.models.mcore.model_forward_fused``, which binds it at import, when that module is
    already imported). verl's FSDP model patches import them inside the forward, so a swap before
    the first step takes effect. Returns the patched names; a verl module that does not import
    (its Triton kernels missing) is skipped.

    Raises:
        ImportError: verl is not installed.
    """
    importlib.import_module("verl")
    done = []
    for module, name, ours in (
        ("verl.utils.experimental.torch_functional", "FusedLinearForPPO", FusedLinearForPPO),
        ("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy", linear_cross_entropy),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        setattr(mod, name, ours)
        done.append(f"{module}.{name}")
    # Megatron's fused forward did ``from ... import linear_cross_entropy`` at its own import.
    mcore = sys.modules.get("verl.models.mcore.model_forward_fused")
    if mcore is not None and hasattr(mcore, "linear_cross_entropy"):
        mcore.linear_cross_entropy = linear_cross_entropy
        done.append("verl.models.mcore.model_forward_fused.linear_cross_entropy")
    return done
