"""Hugging Face causal LMs: find the output head and get final hidden states without logits.

Head discovery is an allow-list: each supported ``*ForCausalLM`` class is mapped to what its own
``forward`` applies between the backbone's ``last_hidden_state`` and the returned logits, as read
from its modeling code in transformers 5.x. A class not in the list raises
:class:`UnsupportedModelError` instead of being guessed at (docs/models.md lists the families).
"""

from __future__ import annotations

import types
from collections.abc import Callable
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
        weight: ``[V, H]`` head weight (the tied input embedding where tied). ``V`` is the
            head's row count, padding rows included: the model's softmax runs over every row,
            so logitless's does too.
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


@dataclass(frozen=True)
class _Family:
    """What a family's ``forward`` does after the backbone, read off its modeling code.

    ``logit_scale``/``softcap`` read the model (its config or the attribute its forward uses).
    ``scale_on_hidden``: the forward scales the hidden states before the head; equal to scaling
    the logits only without a head bias (checked). ``head``: the attribute the forward calls.
    """

    logit_scale: Callable[[nn.Module], float] = lambda m: 1.0
    softcap: Callable[[nn.Module], float | None] = lambda m: None
    scale_on_hidden: bool = False
    head: str = "lm_head"


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


_PLAIN = _Family()  # logits = self.lm_head(hidden_states)
_SOFTCAP = _Family(softcap=lambda m: _opt_float(m.config.final_logit_softcapping))  # c * tanh(logits / c)
_COHERE = _Family(logit_scale=lambda m: float(m.logit_scale))  # logits * self.logit_scale (= config.logit_scale)
_GRANITE = _Family(logit_scale=lambda m: 1.0 / float(m.config.logits_scaling))  # logits / config.logits_scaling

# Class name -> family. Every entry is exercised against the model's own logits in
# tests/test_model_families.py; add a class only together with its test.
_FAMILIES: dict[str, _Family] = {
    **dict.fromkeys((
        "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Phi3ForCausalLM", "PhiForCausalLM",
        "GPT2LMHeadModel", "GPTNeoXForCausalLM", "GPTJForCausalLM", "OPTForCausalLM", "Olmo2ForCausalLM",
        "StableLmForCausalLM", "Starcoder2ForCausalLM", "SmolLM3ForCausalLM",
    ), _PLAIN),
    **dict.fromkeys(("Gemma2ForCausalLM", "Gemma3ForCausalLM"), _SOFTCAP),
    **dict.fromkeys(("CohereForCausalLM", "Cohere2ForCausalLM"), _COHERE),
    **dict.fromkeys(("GraniteForCausalLM", "GraniteMoeForCausalLM"), _GRANITE),
    # hidden_states / config.logits_scaling (= hidden_size / dim_model_base), then lm_head
    "MiniCPM3ForCausalLM": _Family(logit_scale=lambda m: 1.0 / float(m.config.logits_scaling), scale_on_hidden=True),
    # lm_head(hidden_states) * self.model.lm_head_multiplier (= config.lm_head_multiplier)
    "FalconH1ForCausalLM": _Family(logit_scale=lambda m: float(m.model.lm_head_multiplier)),
    # lm_head(hidden_states) * config.logits_scaling (multiplies, unlike Granite)
    "HyperCLOVAXForCausalLM": _Family(logit_scale=lambda m: float(m.config.logits_scaling)),
}


def supported_models() -> tuple[str, ...]:
    """Names of the transformers causal LM classes :func:`find_head` accepts."""
    return tuple(sorted(_FAMILIES))


def _base(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (adapters stay active)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and type(model).__name__.startswith("Peft") else model


def _family(base: nn.Module) -> _Family:
    """The verified family of ``base``, matched on the exact class (a subclass or a hub
    ``trust_remote_code`` class of the same name may have a different forward)."""
    name = type(base).__name__
    family = _FAMILIES.get(name)
    if family is not None:
        import transformers

        if getattr(transformers, name, None) is type(base):
            return family
    raise UnsupportedModelError(
        f"{name} ({type(base).__module__}) is not a causal LM class whose head logitless has verified; "
        f"its forward may apply something after the backbone that logitless would not reproduce. "
        f"Supported: {', '.join(supported_models())}")


def find_head(model: nn.Module) -> Head:
    """Head of a Hugging Face causal LM (``lm_head`` / ``embed_out`` / tied embeddings) and
    the scaling / soft-capping its forward applies to the logits.

    Args:
        model: a supported transformers causal LM, optionally wrapped by PEFT (adapters on
            the backbone are fine; they are in the hidden states).

    Returns:
        :class:`Head`; ``Head.transform(temperature)`` reproduces ``model(...).logits / temperature``.

    Raises:
        UnsupportedModelError: a class not in the verified list, no output head, a head that
            is not a plain ``nn.Linear`` (e.g. LoRA-wrapped, ``modules_to_save``, quantized),
            a DTensor-sharded weight, or a hidden-side scale with a head bias; the message
            names the model class.
    """
    base = _base(model)
    name = type(base).__name__
    get_out = getattr(base, "get_output_embeddings", None)
    if not callable(get_out) or get_out() is None:
        raise UnsupportedModelError(f"{name} exposes no output embeddings (get_output_embeddings() is None)")
    family = _family(base)
    head = getattr(base, family.head, None)
    if head is None and family.head == "lm_head":
        head = getattr(base, "embed_out", None)  # GPT-NeoX before transformers 5
    if type(head) is not nn.Linear:
        raise UnsupportedModelError(f"{name}'s output head is a {type(head).__name__}, not an nn.Linear; "
                                    "LoRA/modules_to_save/quantized heads are not supported yet")
    if type(head.weight).__name__ == "DTensor":
        raise UnsupportedModelError(f"{name}'s head weight is a sharded DTensor; gather it (FSDP2) before use")
    if family.scale_on_hidden and head.bias is not None:
        raise UnsupportedModelError(f"{name} scales hidden states before a biased head; not reproducible as a "
                                    "logit scale")
    return Head(weight=head.weight, bias=head.bias, logit_scale=family.logit_scale(base),
                softcap=family.softcap(base))


def backbone(model: nn.Module) -> nn.Module:
    """The decoder that returns ``last_hidden_state`` (``model.base_model``: ``model.model``,
    ``transformer``, ``gpt_neox``, ...), LoRA layers included when PEFT-wrapped.

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
    states ``[B, L, H]`` (after the final norm, before any head-side scaling) instead of
    running the head.

    Calls still go through the model's ``forward`` (so DDP/FSDP/PEFT wrappers around it see
    them), with the same backbone arguments the model's own forward would pass (head-only ones
    such as ``labels``/``logits_to_keep`` dropped); everything else is unchanged. Idempotent.

    Raises:
        UnsupportedModelError: as :func:`find_head` for an unverified model class.
    """
    base = _base(model)
    if getattr(base, "_logitless_patched", False):
        return
    _family(base)
    backbone(base)  # fail early on unsupported models
    original = base.forward

    def forward(self, *args, logitless_hidden_states: bool = False, **kwargs):
        if not logitless_hidden_states:
            return original(*args, **kwargs)
        # use_cache is left as given (the model's default otherwise), as in the model's own forward:
        # some families' numerics depend on it (GPT-J keeps keys in fp32 without a cache).
        for k in ("labels", "logits_to_keep", "num_items_in_batch", "fused_lm_head", "shift_labels",
                  "output_router_logits", "return_dict"):
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
