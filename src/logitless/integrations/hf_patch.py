"""``apply_logitless(model)``: a transformers causal LM whose ``model(input_ids, labels=labels)``
returns the next-token loss from one logitless pass, the logits never built.

The counterpart of Liger's ``apply_liger_kernel_to_*`` fused linear cross-entropy for plain
transformers training (``transformers.Trainer`` or your own loop). It patches one model instance
through forward hooks, and copies no model's ``forward``: the model's own forward runs as
written, its output head is swapped for a ``[..., 0]`` placeholder for the length of the call (its
input, the final hidden states, is kept), and its ``loss_function`` is swapped for one that
computes :func:`logitless.cross_entropy` from those hidden states and the head that
:func:`~logitless.model_heads.find_head` finds (with the family's logit scale / soft-cap). What
the forward does around the loss (the MoE router aux loss, the output fields) is the model's.
Between fused calls ``loss_function`` is a stand-in for the model's own that notices calls which
bypassed the hooks.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..model_heads import _base, _family, _own_class, find_head, head_inputs
from ..objectives import cross_entropy
from ..ops import Head, PassOptions, as_options

__all__ = ["LogitlessPatch", "apply_logitless"]


class _Missing(enum.Enum):
    """No instance attribute of that name (an enum member survives ``copy.deepcopy`` of the model as itself)."""

    MISSING = enum.auto()


_MISSING = _Missing.MISSING


@dataclass
class _Call:
    """One fused forward call, from the model's pre-hook to its post-hook."""

    base: nn.Module  # the transformers model whose head and loss_function are swapped
    head_module: nn.Module
    head_forward: Any  # the head's own instance ``forward`` attribute before the call, or _MISSING
    loss_function: Any  # the model's own ``_loss_function`` attribute before the call, or _MISSING
    hidden: torch.Tensor | None = None  # what the forward passed to its head
    loss_computed: bool = False


@dataclass(eq=False)
class LogitlessPatch:
    """What :func:`apply_logitless` installed on a model; ``remove()`` takes it off.

    Also a context manager: ``with apply_logitless(model): ...`` removes the patch on exit.

    Attributes:
        model: the module the hooks are on: the PEFT model when one was given, else the
            transformers model (inside a ``torch.compile`` wrapper).
        base: the transformers model whose head and ``loss_function`` a fused call swaps.
        z_loss, label_smoothing, options: as given to :func:`apply_logitless`.
        last_metrics: detached metrics of the last fused loss (``ce``: the smoothed CE without
            z-loss, ``z_loss``, ``accuracy``: top-1 rate; reduced like the loss, see
            :func:`logitless.cross_entropy`); empty before the first one.
    """

    model: nn.Module = field(repr=False)
    base: nn.Module = field(repr=False)
    z_loss: float
    label_smoothing: float
    options: PassOptions | None
    last_metrics: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _handles: list[RemovableHandle] = field(default_factory=list, repr=False)
    # Open calls per module: nn.DataParallel runs replicas (copies sharing these hooks) in threads at once.
    _calls: dict[int, list[_Call | None]] = field(default_factory=dict, repr=False)
    _own_loss: Any = field(default=None, repr=False)  # the model's ForCausalLMLoss
    _previous_loss: Any = field(default=_MISSING, repr=False)  # base's _loss_function attribute before the patch
    _warned: bool = field(default=False, repr=False)

    @property
    def active(self) -> bool:
        """Whether the patch is still installed."""
        return bool(self._handles)

    def remove(self) -> None:
        """Restore the model's own forward behaviour (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.model.__dict__.get("_logitless_apply") is self:
            del self.model._logitless_apply
        if self.base.__dict__.get("_loss_function") == self._guard:
            _restore(self.base, "_loss_function", self._previous_loss)

    def __enter__(self) -> LogitlessPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ---- hooks -----------------------------------------------------------------------------

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # One entry per call, pushed first: the always_call post-hook pops it even when this hook raises.
        stack = self._calls.setdefault(id(module), [])
        stack.append(None)
        skip_logits = kwargs.pop("skip_logits", None)
        labels = kwargs.get("labels", _MISSING)
        if labels is _MISSING:
            labels = _bound_labels(module, args, kwargs)
        if skip_logits and labels is None:
            raise ValueError("skip_logits=True needs labels: without them there is no loss to compute")
        base = _base(module)
        # As Liger's lce_forward: fused by default in training only; an eval pass (Trainer.evaluate with
        # compute_metrics, generation) keeps the logits and the model's own loss.
        fused = labels is not None and (base.training if skip_logits is None else bool(skip_logits))
        if kwargs.get("logitless_hidden_states") or kwargs.get("fused_lm_head"):
            fused = False  # a logitless drop-in asks for hidden states / TRL runs its own fused head: no logits
        if not fused:
            return args, kwargs
        _check_loss_function(base, self._guard)
        # Looked up per call: PEFT, FSDP or accelerate may have wrapped or re-hooked the head since.
        head_module = base.get_output_embeddings()
        call = _Call(
            base,
            head_module,
            head_module.__dict__.get("forward", _MISSING),
            base.__dict__.get("_loss_function", _MISSING),
        )

        def placeholder_head(x: torch.Tensor, *_a, **_k) -> torch.Tensor:
            call.hidden = x
            return x.new_empty((*x.shape[:-1], 0))

        def loss_function(
            logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_kwargs
        ):
            return self._loss(call, labels, num_items_in_batch, ignore_index, shift_labels)

        head_module.forward = placeholder_head
        base.loss_function = loss_function  # transformers' setter: the instance's _loss_function
        stack[-1] = call
        return args, kwargs

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        # always_call: also runs when the forward raised (then output is None).
        stack = self._calls.get(id(module))
        call = stack.pop() if stack else None
        if not stack:
            self._calls.pop(id(module), None)
        if call is None:
            return None
        _restore(call.head_module, "forward", call.head_forward)
        _restore(call.base, "_loss_function", call.loss_function)
        if output is None:  # the forward raised
            return None
        if not call.loss_computed:
            if call.hidden is None:  # neither head nor loss ran (another patch's path): its output as it is
                return None
            raise RuntimeError(
                f"{type(call.base).__name__}'s forward ran its output head but not its loss_function although labels "
                "were given; its logits were not computed. Call it with skip_logits=False"
            )
        if isinstance(output, tuple):  # return_dict=False: (loss, logits, ...), None fields left out
            return (output[0], *output[2:])
        values = {k: v for k, v in output.items() if k != "logits"}
        return type(output)(**values)

    def _guard(self, logits, labels, vocab_size, **kwargs) -> torch.Tensor:
        """The model's ``loss_function`` between fused calls: its own loss, with a warning when a training
        call reached it without passing the hooks (a wrapper calling ``model.forward`` directly, as PEFT
        before 0.21 does, so the logits were built)."""
        if not self._calls and self.base.training and not self._warned:
            self._warned = True
            warnings.warn(
                f"apply_logitless: {type(self.base).__name__}.forward was called directly, not through the module "
                "call, so the patch did not apply: the logits were built and the loss is the model's own. A wrapper "
                "does this (PEFT before 0.21 calls model.forward): apply apply_logitless to the outermost model you "
                "call, e.g. the PeftModel.",
                stacklevel=2,
            )
        return self._own_loss(logits, labels, vocab_size, **kwargs)

    def _loss(self, call: _Call, labels, num_items_in_batch, ignore_index, shift_labels) -> torch.Tensor:
        if call.hidden is None:
            raise RuntimeError(
                f"{type(call.base).__name__}'s forward computed a loss without calling its output head "
                "(get_output_embeddings()); logitless cannot compute it"
            )
        hidden, head = head_inputs(call.hidden, _head_at_input(call.base))
        if shift_labels is None:  # ForCausalLMLoss: tokens < n predict n
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.to(hidden.device)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(hidden.device)
        loss, metrics = cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            head,
            targets.reshape(-1),
            ignore_index=ignore_index,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            num_items_in_batch=num_items_in_batch,
            options=self.options,
        )
        self.last_metrics = metrics
        call.loss_computed = True
        # ForCausalLMLoss upcasts half-precision logits: its loss is never lower than fp32.
        return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss


def _restore(obj: nn.Module, name: str, previous: Any) -> None:
    if previous is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = previous


def _bound_labels(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``labels`` passed positionally (rare: Trainer and TRL pass keywords), read off the class's
    ``forward`` signature (the instance's may be a ``(*args, **kwargs)`` wrapper)."""
    if not args:
        return None
    try:
        bound = inspect.signature(type(module).forward).bind_partial(module, *args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("labels")


def _check_loss_function(base: nn.Module, guard: Any = None) -> None:
    """Refuse a model whose ``loss_function`` is not transformers' ``ForCausalLMLoss`` (one the user set,
    or a ``config.loss_type`` that maps elsewhere): the patch computes that loss, not theirs. ``guard``:
    the patch's own stand-in, also accepted."""
    fn = base.loss_function
    name = (getattr(fn, "__name__", None), getattr(fn, "__module__", None))
    if (guard is not None and fn == guard) or name == ("ForCausalLMLoss", "transformers.loss.loss_utils"):
        return
    raise ValueError(
        f"{type(base).__name__}.loss_function is {getattr(fn, '__qualname__', fn)!r}, not transformers' "
        "ForCausalLMLoss, which is the loss apply_logitless computes; restore it (del model._loss_function) "
        "or call logitless.cross_entropy / head_loss on the hidden states yourself"
    )


def _head_at_input(module: nn.Module) -> Head:
    """The head that maps what the forward passes to its head module to the model's logits:
    :func:`find_head`'s, minus a scale the forward applies to the hidden states before its head
    (MiniCPM3), which the head's input already carries."""
    head = find_head(module)
    if _family(module).scale_on_hidden:
        head = dataclasses.replace(head, transform=dataclasses.replace(head.transform, logit_scale=1.0))
    return head


def apply_logitless(
    model: nn.Module,
    *,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    options: PassOptions | None = None,
) -> LogitlessPatch:
    """Make ``model(..., labels=labels)`` compute the next-token loss with :func:`logitless.cross_entropy`
    from the final hidden states and the output head, without building the ``[B, T, V]`` logits.

    The loss is transformers' ``ForCausalLMLoss`` (``model.loss_function``), in nats: labels
    shifted by one (tokens ``< n`` predict ``n``; ``shift_labels=`` taken as given),
    ``ignore_index=-100`` not counted, the sum over counted tokens divided by
    ``num_items_in_batch`` when given (Trainer's gradient-accumulation normalization; forward it
    as ``model(..., num_items_in_batch=n)``), else their mean (NaN when none is counted). Plus,
    when set, ``label_smoothing`` (``ε``: ``(1 - ε)·NLL + ε·(lse - mean logit)``, the smoothing of
    ``torch.nn.functional.cross_entropy``) and ``z_loss`` (``z_loss · lse²`` per counted token,
    PaLM's), reduced the same way. The head's logit scale / soft-cap (Gemma-2/3, Cohere, Granite,
    MiniCPM3, Falcon-H1, HyperCLOVA X) and a LoRA adapter on the head are applied as the model's
    own forward applies them; the MoE router aux loss (``output_router_logits``) is added by the
    model's forward as usual.

    When it applies: a call with ``labels`` while ``model.training`` (as Liger's ``lce_forward``).
    Per call, ``skip_logits=True`` forces it (e.g. in eval mode) and ``skip_logits=False`` turns it
    off. Such a call returns the model's usual output (``CausalLMOutputWithPast``,
    ``MoeCausalLMOutputWithPast``, ... or the tuple of ``return_dict=False``) with
    **``logits`` set to ``None``**: nothing else needs them in training. Calls without labels, and
    eval-mode calls with labels (``Trainer.evaluate`` with ``compute_metrics``, generation), run
    the model's own forward unchanged: logits returned, and the loss, if any, is the model's own,
    without z-loss or label smoothing. For smoothing use ``label_smoothing`` here, not Trainer's
    ``label_smoothing_factor`` (which needs the logits, so it turns this patch off).

    The patch is per instance, nothing changed on the class: forward hooks on the model you call (a
    PEFT model when given one, else the transformers model, inside a ``torch.compile`` wrapper), and
    ``model.loss_function`` set to a stand-in that runs the model's own ``ForCausalLMLoss`` outside
    fused calls and warns once if a training call reached it without passing the hooks (a wrapper
    that calls ``model.forward`` directly, as PEFT before 0.21 does with the model it wraps: apply
    the patch to the outermost model you call). Applying again replaces the patch.

    Args:
        model: one of the verified causal LM classes
            (:func:`logitless.model_heads.supported_models`), optionally PEFT-wrapped.
        z_loss: coefficient of ``lse²`` (``>= 0``; PaLM used 1e-4).
        label_smoothing: ``ε`` in ``[0, 1]``.
        options: :class:`logitless.PassOptions` (backend, mode, chunk budget); ``None``: defaults.

    Returns:
        :class:`LogitlessPatch`: ``.remove()`` restores the model (also a context manager);
        ``.last_metrics`` holds the last loss's ``ce``/``z_loss``/``accuracy``.

    Raises:
        UnsupportedModelError: (a ``ValueError``) the model's class is not a verified one (the
            message lists the supported classes), or its head is not a plain ``nn.Linear``.
        TypeError: ``model`` is not an ``nn.Module``, or ``options`` not a ``PassOptions``.
        ValueError: ``z_loss`` negative or not finite, ``label_smoothing`` outside ``[0, 1]``, a
            ``model.loss_function`` other than transformers' ``ForCausalLMLoss`` (also checked at
            each fused call); at call time, ``skip_logits=True`` without labels, and what
            :func:`logitless.cross_entropy` raises (e.g. labels whose shape does not match).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers causal LM), got {type(model).__name__}")
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not (math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    as_options(options)
    target = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
    base = _base(target)
    find_head(base)  # UnsupportedModelError, naming the class and the supported ones
    # The hooks go on the module the user calls: a PEFT model's own forward may call the transformers
    # model's forward directly (PEFT before 0.21), which would pass hooks on the latter by.
    if not _own_class(target).__name__.startswith("Peft"):
        target = base
    for m in (target, base):
        previous = m.__dict__.get("_logitless_apply")
        if previous is not None:
            previous.remove()
    _check_loss_function(base)
    patch = LogitlessPatch(target, base, float(z_loss), float(label_smoothing), options)
    patch._own_loss = base.loss_function
    patch._previous_loss = base.__dict__.get("_loss_function", _MISSING)
    patch._handles.append(target.register_forward_pre_hook(patch._pre_hook, with_kwargs=True))
    patch._handles.append(target.register_forward_hook(patch._post_hook, with_kwargs=True, always_call=True))
    base.loss_function = patch._guard  # transformers' setter: the instance's _loss_function
    target._logitless_apply = patch
    return patch
