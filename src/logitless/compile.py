"""``torch.compile`` boundary of the public entry points."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


_REASON = "logitless runs its vocabulary pass eagerly by design (docs/frameworks.md)"


def graph_break(fn: F, *, reason: str = _REASON) -> F:
    """``fn`` run eagerly, as an explicit graph break, when called from code under ``torch.compile``;
    ``reason`` is shown in dynamo's report (and its ``Unsupported`` error under ``fullgraph=True``).

    Why: the entry points are custom autograd Functions driven by Python loops over token and
    vocabulary chunks whose sizes depend on the data (the number of counted tokens, the memory
    budget); the fused mode even runs ``torch.autograd.grad`` inside its forward. Traced, they
    break the graph at many data-dependent places (16-22 for two ``policy_loss`` calls) and
    specialize on token counts, and the compiled kernels could not beat ours, which never
    materialize the logits. So the whole call is one opaque eager region: the model code around
    it is still compiled (one graph break per call), the numbers are the eager ones, and
    ``fullgraph=True`` fails at compile time with dynamo's own error naming the function.
    ``policy_loss``, ``cross_entropy``, ``vocab_stats`` and ``token_logprobs`` are custom ops
    under compile instead (``objectives/compiled.py``, no break); this stays for the entry points
    that take Python callables or have no op, and for the calls those ops cannot take.

    Applying it imports ``torch._dynamo`` (about 2 s on CPU, once per process; libraries such as
    transformers import it anyway). Signature, docstring and name of ``fn`` are kept.
    """
    disable = getattr(torch.compiler, "disable", None)
    if disable is None:  # torch < 2.1
        from torch import _dynamo

        disable = _dynamo.disable
    try:
        disabled = disable(fn, recursive=True, reason=reason)
    except TypeError:  # older torch: no reason argument
        disabled = disable(fn, recursive=True)
    return functools.wraps(fn)(disabled)
