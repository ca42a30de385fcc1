"""Hugging Face causal LMs: find the output head and get final hidden states without logits.

Head discovery is an allow-list: each supported ``*ForCausalLM`` class is mapped to what its own
``forward`` applies between the backbone's ``last_hidden_state`` and the returned logits, as read
from its modeling code in transformers 5.x. A class not in the list raises
:class:`UnsupportedModelError` instead of being guessed at (docs/models.md lists the families).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .objectives import token_logprobs
from .ops import Head, HeadLoRA, LogitTransform


class UnsupportedModelError(ValueError):
    """The model's head or backbone is not one logitless recognizes; computing through it
    could differ from what the model itself computes."""


@dataclass(frozen=True, repr=False)
class ModelHead(Head):
    """A model's output head as :func:`find_head` finds it: a :class:`logitless.Head` (weight,
    bias, the model's logit scale and soft-cap as its transform at temperature 1, its PEFT
    LoRA adapter) plus where FSDP2 keeps it.

    Attributes:
        weight: ``[V, H]`` head weight (the tied input embedding where tied). ``V`` is the
            head's row count, padding rows included: the model's softmax runs over every row,
            so logitless's does too.
        fsdp: set when an FSDP2 (``fully_shard``) module manages the head's parameters; then
            ``weight``/``bias`` are whatever FSDP had registered when :func:`find_head` ran
            (a sharded DTensor outside the owning module's forward) and :func:`head_inputs`
            gives the unsharded ones.
        zero3: the head's parameters are DeepSpeed ZeRO-3 parameters (``ds_id`` set; their
            ``.data`` is empty while partitioned); :func:`head_inputs` gathers them.

    Pass it to the losses after :func:`head_inputs` (which gives the tensors to compute with),
    with the sampling temperature set by :meth:`~logitless.Head.at_temperature`.
    """

    fsdp: FSDPHeadParams | None = None
    zero3: bool = False


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
    """The transformers model inside a ``torch.compile`` wrapper, a value-head wrapper and/or a PEFT
    wrapper (adapters stay active)."""
    # torch.compile(model) returns an OptimizedModule whose calls go through the original module's
    # __call__, so the forward patched on that module is what the compiled wrapper traces.
    model = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
    # Value-head wrappers (TRL's AutoModelForCausalLMWithValueHead and its look-alikes) hold the
    # causal LM as `pretrained_model` next to a `v_head`; the head that makes logits is the LM's.
    if isinstance(getattr(model, "pretrained_model", None), nn.Module) and hasattr(model, "v_head"):
        model = model.pretrained_model
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and _own_class(model).__name__.startswith("Peft") else model


def _family(base: nn.Module) -> _Family:
    """The verified family of ``base``, matched on the exact class (a subclass or a hub
    ``trust_remote_code`` class of the same name may have a different forward)."""
    admitted = base.__dict__.get("_logitless_family")  # set by admit_unverified after its check
    if admitted is not None:
        return admitted
    name = _own_class(base).__name__
    family = _FAMILIES.get(name)
    if family is not None:
        import transformers

        if getattr(transformers, name, None) is _own_class(base):
            return family
    raise UnsupportedModelError(
        f"{name} ({type(base).__module__}) is not a causal LM class whose head logitless has verified; "
        f"its forward may apply something after the backbone that logitless would not reproduce. "
        f"Supported: {', '.join(supported_models())}")


def _nearest_verified(cls: type) -> _Family:
    """The family of the closest verified transformers class among ``cls``'s bases, else the
    plain one (``logits = lm_head(hidden)``)."""
    import transformers

    for base_cls in cls.__mro__:
        family = _FAMILIES.get(base_cls.__name__)
        if family is not None and getattr(transformers, base_cls.__name__, None) is base_cls:
            return family
    return _PLAIN


# The probe of admit_unverified: its shape, and its tolerance in ulps of the model's dtype.
_PROBE_SHAPE = (2, 8)
_PROBE_ULPS = 16


def admit_unverified(model: nn.Module) -> None:
    """Let :func:`find_head` and :func:`add_hidden_states_forward` take ``model`` although its
    class is not verified (another architecture, or a subclass of a verified class), once a
    probe agrees with the model's own logits. A verified model is left as it is.

    The head is ``get_output_embeddings()`` with the logit scale / soft-cap of the nearest
    verified base class (none for other classes). The probe: a fixed batch of random token ids
    ``[2, 8]`` (eval mode, no grad, restored after); the token log-probs
    :func:`logitless.token_logprobs` computes from ``backbone(model)``'s final hidden states and
    that head, at random target ids, must equal the log-softmax of ``model(input_ids).logits``
    there to within 16 ulps of the model's dtype times ``max(1, max |logit|)``. The decision is
    stored on the model instance (not its class).

    Raises:
        UnsupportedModelError: no output head or backbone, a head :func:`find_head` refuses, or
            a probe that disagrees (the message gives the difference).
    """
    base = _base(model)
    try:
        _family(base)
        return
    except UnsupportedModelError:
        pass
    base._logitless_family = _nearest_verified(_own_class(base))
    try:
        head = find_head(model)
        backbone(base)
        weight = head.weight
        g = torch.Generator().manual_seed(0)
        emb = base.get_input_embeddings()
        vocab = weight.shape[0] if emb is None else min(weight.shape[0], emb.weight.shape[0])
        ids = torch.randint(0, vocab, _PROBE_SHAPE, generator=g).to(weight.device)
        targets = torch.randint(0, weight.shape[0], _PROBE_SHAPE, generator=g).to(weight.device)
        training = base.training
        base.eval()
        try:
            with torch.no_grad():
                logits = base(input_ids=ids, use_cache=False).logits
                hidden = backbone(base)(input_ids=ids, use_cache=False).last_hidden_state
                h, ready = head_inputs(hidden, head)
                ours = token_logprobs(h, ready, targets)
        finally:
            base.train(training)
        theirs = torch.log_softmax(logits.to(ours.dtype), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        diff = float((ours - theirs).abs().max())
        tol = _PROBE_ULPS * torch.finfo(logits.dtype).eps * max(1.0, float(logits.abs().max()))
        if not diff <= tol:
            raise UnsupportedModelError(
                f"{type(base).__name__}: the probe's log-probs from the hidden states and the head differ from the "
                f"model's own logits by {diff:.3g} nats (tolerance {tol:.3g}); its forward does something after the "
                "backbone that logitless does not reproduce")
    except Exception:
        del base._logitless_family
        raise


def find_head(model: nn.Module) -> ModelHead:
    """Head of a Hugging Face causal LM (``lm_head`` / ``embed_out`` / tied embeddings) and
    the scaling / soft-capping its forward applies to the logits.

    Args:
        model: a supported transformers causal LM, optionally wrapped by PEFT (adapters on
            the backbone are in the hidden states; a LoRA adapter on the head comes back as
            ``Head.lora``, a ``modules_to_save`` copy of the head as ``Head.weight``).

    Returns:
        :class:`ModelHead`; with the tensors of :func:`head_inputs`,
        ``head.at_temperature(t)`` reproduces ``model(...).logits / t``.

    FSDP2 (``fully_shard``) models are accepted, the head sharded with the root, on its own
    or grouped with tied embeddings: ``Head.fsdp`` then says where FSDP keeps the head's
    parameters and :func:`head_inputs` unshards them (docs/frameworks.md, FSDP section).
    DeepSpeed ZeRO-3 models too: ``Head.zero3`` is set and :func:`head_inputs` gathers the
    partitioned parameters (docs/frameworks.md, ZeRO-3 section).

    Raises:
        UnsupportedModelError: a class not in the verified list, no output head, a head that
            is not a plain ``nn.Linear`` once PEFT's ``modules_to_save`` / LoRA wrapper is
            opened (quantized heads; several active adapters; DoRA and other LoRA variants),
            a DTensor weight that no FSDP2 module manages (tensor parallelism), or a
            hidden-side scale with a head bias; the message names the model class.
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
    head, lora = _unwrap_adapters(head, name)
    if _own_class(head) is not nn.Linear:
        raise UnsupportedModelError(f"{name}'s output head is a {type(head).__name__}, not an nn.Linear "
                                    "(quantized or otherwise wrapped heads are not supported)")
    fsdp = _fsdp_head_params(model, head)
    if fsdp is None and _is_dtensor(head.weight):
        raise UnsupportedModelError(f"{name}'s head weight is a DTensor that no FSDP2 (fully_shard) module "
                                    "manages (tensor parallel?); pass the local vocabulary rows with "
                                    "logitless.VocabShard instead")
    if family.scale_on_hidden and head.bias is not None:
        raise UnsupportedModelError(f"{name} scales hidden states before a biased head; not reproducible as a "
                                    "logit scale")
    transform = LogitTransform(logit_scale=family.logit_scale(base), softcap=family.softcap(base))
    zero3 = any(_is_zero3(t) for t in (head.weight, head.bias))
    if zero3 and lora is not None:
        raise UnsupportedModelError(f"{name}'s head has a LoRA adapter under DeepSpeed ZeRO-3; not supported yet "
                                    "(its adapter weights are partitioned too)")
    return ModelHead(weight=head.weight, bias=head.bias, transform=transform, lora=lora, fsdp=fsdp, zero3=zero3)


def _unwrap_adapters(head: nn.Module, name: str) -> tuple[nn.Module, HeadLoRA | None]:
    """The linear layer a PEFT-wrapped head runs and its active LoRA adapter, read the way
    PEFT 0.x's ``ModulesToSaveWrapper.forward`` and ``lora.Linear.forward`` choose them."""
    cls = type(head).__name__
    if cls == "ModulesToSaveWrapper":  # a trainable copy of the head per adapter
        active = list(head.active_adapters)
        if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
            return head.original_module, None
        return head.modules_to_save[active[0]], None
    if not (hasattr(head, "base_layer") and hasattr(head, "lora_A") and hasattr(head, "lora_B")):
        return head, None
    base = head.get_base_layer() if hasattr(head, "get_base_layer") else head.base_layer
    if head.disable_adapters or head.merged:  # the base layer alone computes the head (merged: W + sBA)
        return base, None
    active = [a for a in head.active_adapters if a in head.lora_A]
    if not active:
        return base, None
    if len(active) > 1:
        raise UnsupportedModelError(f"{name}'s head has {len(active)} active LoRA adapters {active}; "
                                    "logitless supports one")
    a = active[0]
    if a in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(a, False):
        raise UnsupportedModelError(f"{name}'s head adapter {a!r} is a LoRA variant (DoRA, ...); only plain "
                                    "LoRA is supported")
    lora_a, lora_b = head.lora_A[a], head.lora_B[a]
    if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_a.bias is not None \
            or lora_b.bias is not None:
        raise UnsupportedModelError(f"{name}'s head adapter {a!r} is not a bias-free linear LoRA pair "
                                    f"({type(lora_a).__name__}, {type(lora_b).__name__})")
    dropout = head.lora_dropout[a]
    return base, HeadLoRA(a=lora_a.weight, b=lora_b.weight, scaling=float(head.scaling[a]),
                          dropout=None if isinstance(dropout, nn.Identity) else dropout)


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


# ---- FSDP2 (torch.distributed.fsdp.fully_shard) ---------------------------------------------
# Looked up in sys.modules: a model cannot hold an FSDPModule or a DTensor unless the module
# defining it was imported, and importing torch.distributed here would cost every other user.

def _fsdp_module_class() -> type | None:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def _is_dtensor(t: torch.Tensor | None) -> bool:
    tensor_mod = sys.modules.get("torch.distributed.tensor")
    return tensor_mod is not None and isinstance(t, tensor_mod.DTensor)


def _own_class(module: nn.Module) -> type:
    """The class ``module`` was built as. ``fully_shard`` swaps in a generated
    ``FSDP<Name>(FSDPModule, <Name>)`` that adds hooks and methods but keeps ``forward``
    (torch/distributed/fsdp/_fully_shard/_fsdp_init.py, ``_apply_to_module``), so the verified
    family of the original class still describes what the model computes."""
    cls = type(module)
    fsdp_cls = _fsdp_module_class()
    if fsdp_cls is not None and isinstance(module, fsdp_cls):
        bases = [b for b in cls.__bases__ if b is not fsdp_cls]
        if len(bases) == 1 and cls.__name__ == "FSDP" + bases[0].__name__:
            return bases[0]
    return cls


@dataclass(frozen=True)
class FSDPHeadParams:
    """Where FSDP2 keeps a head's parameters: ``module`` is the ``fully_shard``-ed module whose
    parameter group holds them (the head itself when sharded on its own or grouped with tied
    embeddings, else the nearest such ancestor, usually the root), ``weight``/``bias`` their
    names in it. FSDP re-registers a different tensor under these names as it shards and
    unshards, so they are read at use, not kept."""

    module: nn.Module
    weight: str
    bias: str | None

    def _registered(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.module
        return m.get_parameter(self.weight), None if self.bias is None else m.get_parameter(self.bias)

    def unsharded(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The unsharded ``(weight, bias)``, gathered through FSDP so that the gradient gets
        FSDP's own reduction. See :func:`head_inputs`."""
        weight, bias = self._registered()
        if not _is_dtensor(weight):
            # Already unsharded by FSDP (the root's group stays so after its forward): its
            # post-backward reduce-scatters what accumulates in .grad, as for the model's own head.
            return weight, bias
        trains = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
        self.module.unshard()
        weight, bias = self._registered()
        if _is_dtensor(weight):
            self.module.reshard()
            raise UnsupportedModelError("the head's FSDP2-unsharded weight is still a DTensor (FSDP with tensor "
                                        "parallelism); not supported yet")
        if trains:
            # Left unsharded for the backward. The root's post-backward callback runs
            # post_backward() on every group that did not run it itself
            # (_fsdp_state.py, _root_post_backward_final_callback), which reduce-scatters
            # .grad with FSDP's own divide factor, reduce dtype and no-sync setting, then reshards.
            return weight, bias
        # Nothing will reduce or reshard it: keep a private copy and give FSDP its shards back.
        weight, bias = weight.detach().clone(), None if bias is None else bias.detach().clone()
        self.module.reshard()
        return weight, bias


def _fsdp_head_params(model: nn.Module, head: nn.Module) -> FSDPHeadParams | None:
    """The nearest ``fully_shard``-ed module at or above ``head`` in ``model`` (the one whose
    parameter group holds the head's parameters: ``fully_shard`` takes a module's parameters
    except those of nested ``fully_shard`` modules), or ``None`` without FSDP2."""
    fsdp_cls = _fsdp_module_class()
    if fsdp_cls is None:
        return None
    path = next((name for name, m in model.named_modules() if m is head), None)
    if path is None:
        return None
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:i]))
        if isinstance(owner, fsdp_cls):
            prefix = "".join(p + "." for p in parts[i:])
            return FSDPHeadParams(owner, prefix + "weight", None if head.bias is None else prefix + "bias")
    return None


def head_inputs(hidden: torch.Tensor, head: ModelHead) -> tuple[torch.Tensor, Head]:
    """``(hidden, head)`` ready for the losses: hidden, weight and bias in one dtype — the
    autocast dtype when autocast is on (as the model's own head would run), else the weight's
    dtype — as a plain :class:`logitless.Head` (transform and adapter kept).

    Call it after the model's forward. With DeepSpeed ZeRO-3 (parameters with ``ds_id``,
    whether or not ``head.zero3`` was recorded) the weight and bias are gathered
    (``deepspeed.zero.GatheredParameters``, skipped for those already available, e.g. tied
    embeddings still held by the forward) and given back as tensors that keep the gathered values
    after DeepSpeed re-partitions the parameters; their gradient flows to the parameters
    themselves, so ZeRO-3's gradient hook on each parameter reduces and partitions it, once per
    backward, as for the model's own head. With FSDP2 (``head.fsdp`` set) the weight and bias are
    the unsharded parameters, in FSDP's ``param_dtype``. When FSDP holds them sharded (the head
    is ``fully_shard``-ed apart from the root, or the root reshards after forward), they are
    all-gathered with ``FSDPModule.unshard()``. With gradients enabled they stay unsharded
    until the backward, whose FSDP post-backward reduce-scatters their gradient exactly as
    for the model's own head (averaged over the data-parallel ranks by default), then
    reshards; the backward must reach the model's output, i.e. ``hidden`` must require
    grad. Without gradients a copy is returned and FSDP reshards at once.

    Raises:
        UnsupportedModelError: ``head.weight`` is a DTensor without ``head.fsdp`` (a
            :class:`Head` not from :func:`find_head`), FSDP combined with tensor parallelism,
            or an FSDP-managed trainable head with gradients on but ``hidden`` not requiring
            grad (FSDP's post-backward, which reduces the head's gradient, would not run).
    """
    dev = hidden.device.type
    weight, bias = head.weight, head.bias
    if head.fsdp is not None:
        registered = [t for t in head.fsdp._registered() if t is not None]
        if torch.is_grad_enabled() and any(t.requires_grad for t in registered) and not hidden.requires_grad:
            # FSDP queues its post-backward callback from hooks on module outputs; without a
            # path from the loss to the model's output the head's gradient would stay unreduced.
            raise UnsupportedModelError("FSDP2 head: gradients are on but the hidden states do not require grad, "
                                        "so FSDP's post-backward would not reduce the head's gradient")
        weight, bias = head.fsdp.unsharded()
    elif _is_dtensor(weight):
        raise UnsupportedModelError("the head weight is a DTensor but the Head does not say which FSDP2 module "
                                    "holds it; get the Head from find_head(model)")
    elif _is_zero3(weight) or _is_zero3(bias):
        weight, bias = _zero3_gathered(weight, bias)
    hidden = hidden.to(weight.device)
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    else:
        dtype = weight.dtype
    def cast(t):
        return (t if t is None or t.dtype == dtype else t.to(dtype))
    return cast(hidden), Head(cast(weight), cast(bias), head.transform, head.lora, head.shard)


# ---- DeepSpeed ZeRO-3 -----------------------------------------------------------------------
# A ZeRO-3 parameter keeps its nn.Parameter object; DeepSpeed swaps its .data between the local
# partition (an empty tensor; the values live in ds_tensor) and the gathered [ds_shape] tensor, and
# marks it with ds_id / ds_status / ds_shape / ds_numel (deepspeed/runtime/zero/partition_parameters.py).

def _is_zero3(t: torch.Tensor | None) -> bool:
    return t is not None and hasattr(t, "ds_id") and hasattr(t, "ds_status")


class _ZeroGathered(torch.autograd.Function):
    """Identity from a gathered ZeRO-3 parameter to a tensor holding its gathered storage.

    The output keeps the gathered values alive after DeepSpeed re-partitions the parameter (which
    only re-points ``param.data`` at an empty tensor, ``free_param``), and its gradient goes to the
    parameter itself: autograd accumulates it into ``param.grad`` (the ``[ds_shape]`` gradient of
    the full parameter), where ZeRO-3's post-accumulate-grad hook (``stage3.py``,
    ``create_reduce_and_remove_grad_hooks``) reduces and partitions it, once per backward.
    Autograd accumulates only into a parameter whose data has the gradient's shape, so the backward
    gathers the parameter again (as DeepSpeed's pre-backward hook does for a module's parameters)
    and :func:`_release_after_grad` partitions it once its gradient is accumulated.
    """

    @staticmethod
    def forward(ctx, param: torch.Tensor) -> torch.Tensor:
        ctx.param = param
        return param.data

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        param = ctx.param
        if param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            param.all_gather()  # a collective: every rank runs this backward
            param._logitless_release_after_grad = True
            if not getattr(param, "_logitless_release_hook", False):
                # Registered now, after DeepSpeed's own hook, so that it runs after the reduction's.
                param.register_post_accumulate_grad_hook(_release_after_grad)
                param._logitless_release_hook = True
        return grad


def _release_after_grad(param: torch.Tensor) -> None:
    """Partition a ZeRO-3 parameter that :class:`_ZeroGathered` gathered for its gradient, unless
    a module's forward or backward holds it (DeepSpeed releases it then)."""
    if getattr(param, "_logitless_release_after_grad", False):
        param._logitless_release_after_grad = False
        if not param.ds_active_sub_modules:
            param.partition()


def _zero3_gathered(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` of a ZeRO-3 head as full tensors (see :func:`head_inputs`); every rank
    must call it (the gather is a collective)."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = [t for t in (weight, bias) if t is not None]
    # Already available ones stay as DeepSpeed holds them: re-partitioning a tied embedding on exit
    # would break the forward's own bookkeeping of the module that gathered it (TRL's
    # maybe_gather_lm_head_ctx skips them for the same reason).
    missing = list({id(p): p for p in params if _is_zero3(p) and p.ds_status != ZeroParamStatus.AVAILABLE}.values())

    def full(p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None or not _is_zero3(p):
            return p
        if tuple(p.data.shape) != tuple(p.ds_shape):
            raise UnsupportedModelError(f"the ZeRO-3 head parameter (ds_id {p.ds_id}) is not gathered: its data has "
                                        f"shape {tuple(p.data.shape)}, expected {tuple(p.ds_shape)}")
        return _ZeroGathered.apply(p) if torch.is_grad_enabled() and p.requires_grad else p.data.detach()

    with deepspeed.zero.GatheredParameters(missing, enabled=bool(missing)):
        return full(weight), full(bias)
