"""Hugging Face causal LMs: find the output head and get final hidden states without logits."""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from ..ops import LogitTransform


class UnsupportedModelError(ValueError):
    """The model's head or backbone is not one logitless recognizes; computing through it
    could differ from what the model itself computes."""


@dataclass
class Head:
    """The output projection of a causal LM and the elementwise map after it.

    Attributes:
        weight: ``[V, H]`` head weight (the tied input embedding where tied).
        bias: ``[V]`` or ``None``.
        logit_scale: multiplier before soft-capping (1.0 when the model has none).
        softcap: final logit soft-capping or ``None``.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    logit_scale: float
    softcap: float | None

    def transform(self, temperature: float = 1.0) -> LogitTransform:
        return LogitTransform(temperature=temperature, logit_scale=self.logit_scale, softcap=self.softcap)


def _base(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (adapters stay active)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and type(model).__name__.startswith("Peft") else model


def _logit_scale(cfg) -> float:
    # Same reading of the config as the model families' own forward passes: Cohere `logit_scale`,
    # Falcon-H1 `lm_head_multiplier`, Granite/MiniCPM3 divide by `logits_scaling` (HyperCLOVA X multiplies).
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        v = getattr(cfg, name, None)
        if v is not None:
            return float(v)
    v = getattr(cfg, "logits_scaling", None)
    if v is not None:
        return float(v) if getattr(cfg, "model_type", "") == "hyperclovax" else 1.0 / float(v)
    return 1.0


def find_head(model: nn.Module) -> Head:
    """Head of a Hugging Face causal LM (``lm_head`` / ``embed_out`` / tied embeddings).

    Raises:
        UnsupportedModelError: no output embeddings, a head that is not a plain
            ``nn.Linear`` (e.g. a LoRA-wrapped head), or a DTensor-sharded weight; the
            message names the model class.
    """
    base = _base(model)
    get_out = getattr(base, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    name = type(base).__name__
    if head is None:
        raise UnsupportedModelError(f"{name} exposes no output embeddings (get_output_embeddings() is None)")
    if type(head) is not nn.Linear:
        raise UnsupportedModelError(f"{name}'s output head is a {type(head).__name__}, not an nn.Linear; "
                                    "LoRA/quantized heads are not supported yet")
    if type(head.weight).__name__ == "DTensor":
        raise UnsupportedModelError(f"{name}'s head weight is a sharded DTensor; gather it (FSDP2) before use")
    cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return Head(weight=head.weight, bias=head.bias, logit_scale=_logit_scale(cfg),
                softcap=None if softcap is None else float(softcap))


def backbone(model: nn.Module) -> nn.Module:
    """The decoder that returns ``last_hidden_state`` (``model.base_model``).

    Raises:
        UnsupportedModelError: when the model has no separate backbone.
    """
    base = _base(model)
    bb = getattr(base, "base_model", None)
    if bb is None or bb is base:
        raise UnsupportedModelError(f"{type(base).__name__} has no backbone distinct from the model "
                                    "(base_model); not a recognized causal LM")
    return bb


def add_hidden_states_forward(model: nn.Module) -> None:
    """Let ``model(..., logitless_hidden_states=True)`` return the backbone's final hidden
    states ``[B, L, H]`` instead of running the head.

    Calls still go through the model's ``forward`` (so DDP/FSDP wrappers around it see them)
    and everything else is unchanged. Idempotent.
    """
    base = _base(model)
    if getattr(base, "_logitless_patched", False):
        return
    backbone(base)  # fail early on unsupported models
    original = base.forward

    def forward(self, *args, logitless_hidden_states: bool = False, **kwargs):
        if not logitless_hidden_states:
            return original(*args, **kwargs)
        kwargs["use_cache"] = False
        for k in ("labels", "logits_to_keep", "num_items_in_batch", "fused_lm_head", "shift_labels"):
            kwargs.pop(k, None)
        # Looked up per call: PEFT and FSDP replace modules after patching.
        return backbone(self)(*args, **kwargs).last_hidden_state

    base.forward = types.MethodType(forward, base)
    base._logitless_patched = True


def head_inputs(hidden: torch.Tensor, head: Head) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(hidden, weight, bias)`` in one dtype: the autocast dtype when autocast is on (as the
    model's own head would run), else the weight's dtype."""
    dev = hidden.device.type
    weight, bias = head.weight, head.bias
    hidden = hidden.to(weight.device)
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    else:
        dtype = weight.dtype
    def cast(t):
        return (t if t is None or t.dtype == dtype else t.to(dtype))
    return cast(hidden), cast(weight), cast(bias)
