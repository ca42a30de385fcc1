"""OpenRLHF's actor on logitless: :func:`use_logitless` switches ``openrlhf.models.Actor``'s
log-prob path.

OpenRLHF 0.11 computes every policy log-prob in ``Actor.forward`` (``openrlhf/models/actor.py``):
the training forward of ``PPOTrainer`` (``openrlhf/trainer/ray/ppo_actor.py``: action log-probs
for ``PolicyLoss``, the KL loss and, with ``entropy_coef``, the entropy), the old-policy
log-probs of the actor group and the reference model's log-probs. It runs the model to
``(B, T, V)`` logits, casts them to fp32, divides by the sampling temperature, and takes
``log_softmax`` at ``roll(sequences, -1)`` (and the entropy at every position). The switched
forward runs the model's backbone only (``logitless.model_heads.add_hidden_states_forward``)
and computes the same log-probs (and entropy) with :func:`logitless.vocab_stats`, without the
logits; ``PolicyLoss``, ``compute_approx_kl`` and ``aggregate_loss`` are OpenRLHF's own,
unchanged, on top. Statistics are fp32 (fp64 for fp64 models), as OpenRLHF's fp32 logits;
a LoRA adapter on ``lm_head`` is kept. The recipe is in ``docs/openrlhf.md``.

Returned like OpenRLHF's: ``action_log_probs [B, A]`` (zero where ``action_mask`` is 0) or
``log_probs [B, T-1]``; with ``return_output`` an output whose ``entropy`` is ``[B, T-1]`` and
whose ``logits`` is None. With ``action_mask`` the head runs only on the last ``A`` positions:
log-probs and entropy are 0 at the other positions and where ``action_mask`` is 0 (OpenRLHF's
trainer reads the entropy only there, through ``action_mask``).

Names (OpenRLHF's → the core's): ``roll(sequences, -1)`` → ``targets``, ``return_entropy`` →
``entropy=``.
"""

from __future__ import annotations

import importlib
import types
import warnings
from typing import Any

import torch

from ..model_heads import UnsupportedModelError, add_hidden_states_forward, find_head, head_inputs
from ..objectives import vocab_stats
from ..ops import PassOptions

_IGNORE = -100


def _unsupported(actor: Any, model: torch.nn.Module, mm_inputs: dict) -> str | None:
    """Why a log-prob call of ``actor`` cannot go through logitless, or None."""
    if mm_inputs or getattr(actor, "is_vlm", False):
        return "a vision-language model (multimodal inputs)"
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        return "an MoE model with router logits (its auxiliary loss comes from the full forward)"
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if weight is not None and hasattr(weight, "ds_id"):
        return "a DeepSpeed ZeRO-3 partitioned head (not gathered outside its module's forward)"
    try:
        add_hidden_states_forward(model)
        find_head(model)
    except UnsupportedModelError as e:
        return str(e)
    return None


def _forward(
    self: Any,
    sequences: torch.LongTensor,  # [B, T]
    action_mask: torch.Tensor | None = None,  # [B, A]
    attention_mask: torch.Tensor | None = None,  # [B, T]
    return_output: bool = False,
    allgather_logits: bool = False,
    return_logprobs: bool = False,
    ring_attn_group: torch.distributed.ProcessGroup | None = None,
    packed_seq_lens: list[int] | None = None,
    return_entropy: bool = False,
    **mm_inputs: Any,
) -> Any:
    """``Actor.forward`` with OpenRLHF's signature and returns, the head through logitless."""
    args = (
        sequences,
        action_mask,
        attention_mask,
        return_output,
        allgather_logits,
        return_logprobs,
        ring_attn_group,
        packed_seq_lens,
        return_entropy,
    )
    if action_mask is None and not return_logprobs:
        reason = "a call that returns the logits"
    else:
        reason = _unsupported(self, self.model, mm_inputs)
    if reason is not None:
        if not getattr(self, "_logitless_fallback_warned", False):
            warnings.warn(f"logitless: OpenRLHF's own Actor.forward is used: {reason}", stacklevel=2)
            self._logitless_fallback_warned = True
        return type(self).forward(self, *args, **mm_inputs)

    batch, seqlen = sequences.size()
    packing = getattr(self, "packing_samples", False)
    if packing:
        ring = importlib.import_module(type(self).__module__.rpartition(".")[0] + ".ring_attn_utils")
        ids, position_ids, targets, ring_attn_pad_len, indices = ring.unpad_and_slice_tensor(
            sequences, attention_mask, ring_attn_group
        )
        hidden = self.model(ids, attention_mask=None, position_ids=position_ids, logitless_hidden_states=True)
    else:
        targets = torch.roll(sequences, shifts=-1, dims=1)
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        hidden = self.model(
            sequences, attention_mask=attention_mask, position_ids=position_ids, logitless_hidden_states=True
        )
        if action_mask is not None:
            # Only the last A positions before the final one predict actions (OpenRLHF's
            # log_probs[:, :-1][:, -A:]); the head runs there and where action_mask is set.
            a = action_mask.shape[1]
            hidden = hidden[:, -a - 1 : -1]
            targets = targets[:, -a - 1 : -1].masked_fill(action_mask == 0, _IGNORE)
    h, head = head_inputs(hidden, find_head(self.model))
    stats = vocab_stats(
        h,
        head.at_temperature(float(self.temperature)),
        targets,
        ignore_index=_IGNORE,
        entropy=return_entropy,
        options=getattr(self, "logitless_options", None),
    )
    log_probs, entropy = stats.logp, stats.entropy
    if packing:
        log_probs = ring.gather_and_pad_tensor(log_probs, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen)
        log_probs = log_probs[:, :-1]
        if return_entropy:
            entropy = ring.gather_and_pad_tensor(entropy, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen)
            entropy = entropy[:, :-1]
    elif action_mask is not None:
        pad = log_probs.new_zeros(batch, seqlen - 1 - log_probs.shape[1])
        log_probs = torch.cat([pad, log_probs], dim=1)
        if return_entropy:
            entropy = torch.cat([pad, entropy], dim=1)
    else:
        log_probs = log_probs[:, :-1]
        entropy = entropy[:, :-1] if return_entropy else None

    output = None
    if return_output:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        output = CausalLMOutputWithPast(logits=None)
        if return_entropy:
            output.entropy = entropy
    if action_mask is None:
        return (log_probs, output) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.to(log_probs.dtype)
    return (action_log_probs, output) if return_output else action_log_probs


def use_logitless(actor: torch.nn.Module, *, options: PassOptions | None = None) -> torch.nn.Module:
    """Switch an OpenRLHF ``Actor`` (policy, old policy or reference) to logitless, in place.

    Its ``forward`` becomes the switched one (same signature and returns); call it before
    ``strategy.prepare`` or after, on the ``Actor`` itself. What logitless cannot take over runs
    OpenRLHF's own ``Actor.forward``, with one warning per actor saying why: a call that asks
    for the logits (no ``action_mask`` and no ``return_logprobs``), a vision-language model, an
    MoE model with router logits, a DeepSpeed ZeRO-3 partitioned head, a model class
    ``logitless.model_heads`` does not verify.

    Args:
        actor: an ``openrlhf.models.Actor`` (anything with ``model``, ``temperature`` and
            OpenRLHF's ``forward``).
        options: :class:`logitless.PassOptions` for every pass.

    Returns:
        ``actor``.

    Raises:
        TypeError: ``actor`` has no ``model`` module or no ``temperature``.
    """
    if not isinstance(getattr(actor, "model", None), torch.nn.Module) or not hasattr(actor, "temperature"):
        raise TypeError(
            f"actor must be an openrlhf.models.Actor (with .model and .temperature), got {type(actor).__name__}"
        )
    if options is not None and not isinstance(options, PassOptions):
        raise TypeError(f"options must be a logitless.PassOptions or None, got {type(options).__name__}")
    actor.logitless_options = options
    actor.forward = types.MethodType(_forward, actor)
    return actor
