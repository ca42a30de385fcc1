"""The public entry points' one wrapper: autocast (mixed precision) of the head operands, and a
named error for a keyword that another framework spells differently."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

# Arguments that are operands of a head matmul, by name, in every entry point that has them:
# hidden states, and heads (a Head's weight and bias, or a bare weight tensor).
HEAD_OPERANDS = ("hidden", "head", "teacher_hidden", "teacher")

# Keywords of the frameworks (TRL, verl, AgileRL, OpenRLHF) that the core spells one way: the framework's name,
# the core's, and what the argument is. The integrations map them (STYLE.md rule 22).
FRAMEWORK_KEYWORDS = {
    "completion_ids": ("targets", "the completion token ids"),
    "labels": ("targets", "the token ids each hidden state predicts"),
    "return_entropy": ("entropy", "a bool: also return the entropy"),
    "old_per_token_logps": ("old_logp", "the old policy's per-token log-probs"),
    "old_log_prob": ("old_logp", "the old policy's per-token log-probs"),
    "old_log_probs": ("old_logp", "the old policy's per-token log-probs"),
    "ref_per_token_logps": ("ref_logp", "the reference model's per-token log-probs"),
}


def autocast_head_inputs(fn: F | None = None, *, compiled: Callable[[Callable], Callable] | None = None):
    """``fn`` with its head operands (``hidden``, the head's weight and bias, and the teacher's) cast to
    the autocast dtype when autocast is enabled on their device, as ``nn.Linear`` casts them.

    Why: the vocabulary pass turns autocast off inside (its statistics stay fp32), so without
    this an fp32 model under ``torch.autocast`` would get an fp32 head from logitless but a bf16
    (fp16) one from its own ``lm_head``, and a bf16 ``hidden`` from an autocast backbone with the
    fp32 head weight would be refused as a dtype mismatch. Casting at the entry point makes the
    head's matmul take the same rounded operands as the model's own head; the casts are
    differentiable, so fp32 parameters receive fp32 gradients. As autocast does, float64 tensors
    are left alone, and nothing happens without autocast (disable it around the call for an fp32
    head, e.g. TRL's ``cast_lm_head_to_fp32``).

    A keyword of :data:`FRAMEWORK_KEYWORDS` that ``fn`` does not take raises a ``TypeError`` naming
    the core's spelling (``policy_loss(..., completion_ids=ids)``: ``policy_loss takes `targets` (the
    completion token ids), not `completion_ids```), where Python's own would only call it unexpected.

    ``compiled``: the entry point's ``torch.compile`` path (``objectives/compiled.py::route``):
    ``compiled(fn)`` is made once, here, and under ``torch.compiler.is_compiling()`` the call, its
    operands cast, goes to it instead of ``fn``. Used as ``@autocast_head_inputs(compiled=...)``.
    """
    if fn is None:
        return functools.partial(autocast_head_inputs, compiled=compiled)
    params = inspect.signature(fn).parameters
    positions = {name: i for i, name in enumerate(params)
                 if params[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
    names = tuple(n for n in HEAD_OPERANDS if n in params)
    renamed = {old: new for old, new in FRAMEWORK_KEYWORDS.items() if old not in params}
    routed = None if compiled is None else compiled(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for key in kwargs:
            if key in renamed:
                new, what = renamed[key]
                raise TypeError(f"{fn.__name__} takes `{new}` ({what}), not `{key}`")
        args = list(args)
        for name in names:
            i = positions.get(name)
            if i is not None and i < len(args):
                args[i] = _cast(args[i])
            elif name in kwargs:
                kwargs[name] = _cast(kwargs[name])
        if routed is not None and torch.compiler.is_compiling():
            return routed(args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _cast(x):
    """``x`` in its device's autocast dtype if autocast is on there and ``x`` is eligible under
    autocast's own rule (a floating tensor other than float64); a :class:`~logitless.ops.Head`
    with its weight and bias cast."""
    from .ops.contract import Head

    if isinstance(x, Head):
        weight, bias = _cast(x.weight), _cast(x.bias)
        if weight is x.weight and bias is x.bias:
            return x
        return dataclasses.replace(x, weight=weight, bias=bias)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == torch.float64:
        return x
    device = x.device.type
    # Devices without autocast (meta, ...) raise in is_autocast_enabled; validation reports them.
    # (CUDA and CPU have it: asking would be a call torch.compile cannot trace in every release.)
    if device not in ("cuda", "cpu") and not torch.amp.is_autocast_available(device):
        return x
    if not torch.is_autocast_enabled(device):
        return x
    dtype = torch.get_autocast_dtype(device)
    return x if x.dtype == dtype else x.to(dtype)
