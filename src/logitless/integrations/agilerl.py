"""AgileRL's LLM algorithms on logitless: one switch, :func:`use_logitless`.

AgileRL 2.58 computes every head log-prob of its LLM algorithms (``GRPO``, ``CISPO``, ``GSPO``,
``LLMPPO``, ``LLMREINFORCE``, ``SFT``, ``DPO``) through one seam,
``LLMAlgorithm._fused_logprob_fn_and_head`` (``agilerl/algorithms/core/base.py``): the model runs
with ``lm_head`` patched to the identity, and the returned function turns the last hidden states
and the head weight into per-token log-probs, ``fn(hidden, head_w, head_b, target_ids, *,
temperature, cast_to_fp32, chunk_rows) -> [B, T]``. It serves both head paths: the no-grad
rollout / old-policy / reference log-probs and the gradient-time log-probs that AgileRL's loss
(``GRPO._compute_policy_loss``: every loss type, importance-sampling level, KL clamp, off-policy
masks and the vLLM sampling-mismatch correction) consumes. :func:`use_logitless` points that
seam at :func:`logitless.vocab_stats`, so AgileRL's own loss code runs unchanged on log-probs
computed by logitless: one blocked pass over the vocabulary with an analytic backward, fp32
statistics (fp64 for fp64 models) whatever ``cast_logprobs_to_fp32`` says, and a LoRA adapter on
``lm_head`` kept (AgileRL's own path reads ``lm_head.weight``, the base layer's, and leaves the
head adapter out of the log-probs). The Liger loss (``use_liger_loss``) bypasses that seam; the
switch turns it off. The recipe is in ``docs/agilerl.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings
from typing import Any

import torch

from ..model_heads import UnsupportedModelError, _is_dtensor, _unwrap_adapters
from ..objectives import vocab_stats
from ..ops import Head, LogitTransform, PassOptions

_PREFIX = "Logitless__"
_CLASSES: dict[type, type] = {}


def _fn_and_head(agent: Any, base: type) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """The switched agent's ``_fused_logprob_fn_and_head``: logitless's function with AgileRL's
    head tensors, or AgileRL's own (warned once per agent) where logitless cannot take over."""
    fused_fn, head_w, head_b = base._fused_logprob_fn_and_head(agent)
    lm_head = agent._get_lm_head()
    reason, lora = None, None
    sharded = getattr(getattr(agent, "shard_runtime", None), "is_sharded", False)
    if sharded or _is_dtensor(getattr(lm_head, "weight", None)):
        reason = "the head is FSDP2-sharded (untested with logitless inside AgileRL)"
    else:
        try:
            _, lora = _unwrap_adapters(lm_head, type(agent).__name__)
        except UnsupportedModelError as e:
            reason = str(e)
    if reason is not None:
        if not getattr(agent, "_logitless_fallback_warned", False):
            warnings.warn(f"logitless: AgileRL's own head path is used: {reason}", stacklevel=3)
            agent._logitless_fallback_warned = True
        return fused_fn, head_w, head_b
    return functools.partial(_logprobs, lora=lora, options=agent.logitless_options), head_w, head_b


def _logprobs(
    hidden: torch.Tensor,  # [B, T, H]
    head_w: torch.Tensor,  # [V, H]
    head_b: torch.Tensor | None,  # [V]
    target_ids: torch.Tensor,  # [B, T]
    *,
    temperature: float = 1.0,
    cast_to_fp32: bool = True,
    chunk_rows: int | None = None,
    lora: Any = None,
    options: PassOptions | None = None,
) -> torch.Tensor:
    """AgileRL's fused log-prob function's contract on :func:`logitless.vocab_stats`: per-token
    ``log p(target)`` of ``softmax((hidden @ head_w.T + head_b [+ LoRA]) / temperature)``, ``[B, T]``,
    fp32 (fp64 for fp64 inputs), differentiable w.r.t. ``hidden``, the head and its adapter.
    ``cast_to_fp32`` and ``chunk_rows`` are accepted and ignored: statistics are always at least
    fp32, and logitless sizes its blocks by a byte budget."""
    if hidden.dtype != head_w.dtype:
        # As AgileRL does for an fp16 checkpoint under bf16 autocast (fp32 hidden, fp16 head).
        dtype = torch.promote_types(hidden.dtype, head_w.dtype)
        hidden, head_w = hidden.to(dtype), head_w.to(dtype)
    dtype = head_w.dtype
    if head_b is not None:
        head_b = head_b.to(dtype)
    if lora is not None and (lora.a.dtype != dtype or lora.b.dtype != dtype):
        lora = dataclasses.replace(lora, a=lora.a.to(dtype), b=lora.b.to(dtype))
    head = Head(head_w, head_b, transform=LogitTransform(temperature=float(temperature)), lora=lora)
    return vocab_stats(hidden, head, target_ids.long(), entropy=False, options=options).logp


def _logitless_class(cls: type) -> type:
    """The switched subclass of an AgileRL algorithm class, one per class, named
    ``Logitless__<module, dots as __>__<class>`` so that pickle finds it through this module. It
    only overrides ``_fused_logprob_fn_and_head`` and adds no slots, so an agent's ``__class__``
    can be switched in place."""
    if getattr(cls, "_logitless_switched", False):
        return cls
    if cls not in _CLASSES:
        name = f"{_PREFIX}{cls.__module__.replace('.', '__')}__{cls.__qualname__}"

        def _fused_logprob_fn_and_head(self):
            return _fn_and_head(self, cls)

        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "_logitless_switched": True,
            "logitless_options": None,
            "_fused_logprob_fn_and_head": _fused_logprob_fn_and_head,
        }
        _CLASSES[cls] = type(cls)(name, (cls,), namespace)
    return _CLASSES[cls]


def __getattr__(name: str) -> type:
    """The switched class named ``name`` (see :func:`_logitless_class`), built on demand, so that
    a pickled switched agent loads in a fresh process."""
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, qualname = name[len(_PREFIX) :].rpartition("__")
    return _logitless_class(getattr(importlib.import_module(module.replace("__", ".")), qualname))


def use_logitless(agent: Any, *, options: PassOptions | None = None) -> Any:
    """Put logitless under both head paths of an AgileRL LLM agent, in place.

    The agent's class becomes a subclass of its own (``Logitless__…``) that overrides only
    ``_fused_logprob_fn_and_head``; AgileRL's ``clone()`` (``type(self)(**init_args)``), its
    checkpoints and its population tools keep the switch. ``use_liger_loss`` is set to False (the
    Liger loss computes its own head; logitless replaces it). What logitless cannot take over
    falls back to AgileRL's own path, with one warning per agent saying why: an FSDP2-sharded
    head, more than one active LoRA adapter on ``lm_head``, a LoRA variant (DoRA) there.

    Args:
        agent: an AgileRL ``LLMAlgorithm`` (``GRPO``, ``CISPO``, ``GSPO``, ``LLMPPO``,
            ``LLMREINFORCE``, ``SFT``, ``DPO``).
        options: :class:`logitless.PassOptions` for every pass (backend, workspace).

    Returns:
        ``agent`` (switched).

    Raises:
        TypeError: ``agent`` is not an AgileRL LLM algorithm (it has no
            ``_fused_logprob_fn_and_head``: AgileRL older than 2.58, or another object).
    """
    if not callable(getattr(agent, "_fused_logprob_fn_and_head", None)) or not callable(
        getattr(agent, "_get_lm_head", None)
    ):
        raise TypeError(
            f"agent must be an AgileRL LLM algorithm (agilerl>=2.58: GRPO, CISPO, GSPO, LLMPPO, LLMREINFORCE, "
            f"SFT, DPO), got {type(agent).__name__}"
        )
    if options is not None and not isinstance(options, PassOptions):
        raise TypeError(f"options must be a logitless.PassOptions or None, got {type(options).__name__}")
    agent.__class__ = _logitless_class(type(agent))
    agent.logitless_options = options
    if getattr(agent, "use_liger_loss", False):
        agent.use_liger_loss = False
    return agent
