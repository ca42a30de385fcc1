"""Input checks shared by every entry point: named errors before any kernel runs."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from .head import Head
from .lora import HeadLoRA
from .shard import VocabShard
from .transform import LogitTransform

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_head_inputs(hidden: torch.Tensor, head: Head, targets: torch.Tensor | None, ignore_index: int | None,
                      checks: ValueChecks | None = None) -> bool:
    """Validate ``hidden [..., H]``, the head (``weight [V, H]``, ``bias [V]``, its shard and
    adapter: :meth:`HeadLoRA.check`, then NaN/inf in its factors with the other values) and
    ``targets [...]`` (global ids; ``None``: a pass without target ids, e.g. distillation's).
    Returns whether some target equals ``ignore_index``, read in the same host synchronization
    as the value checks (a second one only when ``ignore_index`` lies outside ``[0, V)`` and so
    does some target: the targets' range alone answers otherwise). With ``checks``, the value
    checks are added to it instead (the caller runs them with its own, in one synchronization)
    and the return value is ``False``; pass ``ignore_index=None`` then.

    Raises:
        TypeError: non-tensor arguments, non-floating hidden/weight, non-integer targets,
            dtype mismatch between hidden, weight and bias.
        ValueError: wrong ranks or shapes (logits passed as ``hidden`` are named as such), an
            empty hidden size or vocabulary, device mismatch, a bad shard, a target outside
            ``[0, V)`` other than ``ignore_index``, NaN/inf in hidden, weight, bias or the
            adapter's factors.
    """
    weight, bias, lora = head.weight, head.bias, head.lora
    for name, value, kind in (("transform", head.transform, LogitTransform), ("lora", lora, HeadLoRA),
                              ("shard", head.shard, VocabShard)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"Head.{name} must be a logitless.{kind.__name__} or None, got {type(value).__name__}")
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor) and not (name == "targets" and t is None):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dtype not in _FLOAT:
        raise TypeError(f"hidden must be float16/bfloat16/float32/float64, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}; cast one")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if hidden.shape[-1] == 0:
        raise ValueError(f"hidden has an empty hidden size (H = 0), shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary (V = 0)")
    if weight.shape[1] != hidden.shape[-1]:
        if hidden.shape[-1] == weight.shape[0]:
            raise ValueError(f"hidden's last dimension is {hidden.shape[-1]} = V, the vocabulary size: pass the "
                             f"final hidden states [..., H = {weight.shape[1]}], not the logits")
        raise ValueError(f"hidden's last dimension ({hidden.shape[-1]}) must equal the head's hidden size H = "
                         f"{weight.shape[1]} (weight is [V, H] = {tuple(weight.shape)})")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden is on {hidden.device}")
    vocab = head.vocab_size()  # raises on a bad shard
    own = ValueChecks() if checks is None else checks
    t = None
    if targets is not None:
        _check_target_tensor(targets, hidden)
        t = targets.reshape(-1)
    # An ignore_index outside [0, V) (TRL's -100) can only occur where the targets' range check
    # fails: one reduction answers both in the common case; the exact check runs only then.
    span = ignored = None
    if t is not None and t.numel() and ignore_index is not None and not 0 <= ignore_index < vocab:
        with torch.no_grad():
            span = torch.aminmax(t)
    elif t is not None:
        ignored = _add_target_range(own, t, vocab, ignore_index)
    if lora is not None:
        lora.check(hidden, weight)
    own.add_finite(hidden, lambda: ValueError("hidden contains NaN or inf"))
    if not _FINITE_WEIGHTS.known(weight):
        own.add_finite(weight, lambda: ValueError("weight contains NaN or inf"),
                       on_pass=lambda: _FINITE_WEIGHTS.add(weight))
    if bias is not None:
        own.add_finite(bias, lambda: ValueError("bias contains NaN or inf"))
    if lora is not None:
        for factor in (lora.a, lora.b):
            own.add_finite(factor, lambda: ValueError("HeadLoRA.a or HeadLoRA.b contains NaN or inf"))
    if checks is not None:
        if ignore_index is not None:
            raise ValueError("check_head_inputs: deferred checks read no ignore_index; pass ignore_index=None")
        return False
    if span is not None:
        low, high = own.run(*span)
        if 0 <= low and high < vocab:
            return False
        ignored = _add_target_range(own, t, vocab, ignore_index)
    if ignored is None:
        own.run()
        return False
    return bool(own.run(ignored.any())[0])


def _add_target_range(checks: ValueChecks, t: torch.Tensor, vocab: int,
                      ignore_index: int | None) -> torch.Tensor | None:
    """Targets in ``[0, vocab)``, ``ignore_index`` allowed too, added to ``checks``; returns the
    ``ignore_index`` mask (``None`` without one)."""
    ignored = None if ignore_index is None else t == ignore_index
    checks.add_range(t if ignored is None else t.masked_fill(ignored, 0), 0, vocab,
                     lambda: _bad_targets(t, vocab, ignore_index))
    return ignored


def _check_target_tensor(targets: torch.Tensor, hidden: torch.Tensor) -> None:
    """The targets' dtype, shape and device."""
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device} but hidden is on {hidden.device}")


def _bad_targets(t: torch.Tensor, vocab: int, ignore_index: int | None) -> ValueError:
    out_of_range = (t < 0) | (t >= vocab)
    extra = ""
    if ignore_index is not None:
        out_of_range &= t != ignore_index
        extra = f" or equal ignore_index={ignore_index}"
    return ValueError(f"targets must lie in [0, {vocab}){extra}; found {t[out_of_range][:5].tolist()}")


class ValueChecks:
    """Checks of tensor values (NaN/inf, ranges) gathered from several places and read in one
    host synchronization, so a call waits for the device once before its first kernel.

    Each check reduces its tensor to one or two scalars on the device (one kernel: the inf-norm
    for NaN/inf, ``aminmax`` for a range) and decides on the host, so a call's checks cost a
    kernel each, one stack of the scalars and one copy. ``error()`` builds the exception of a
    failed check (it may read tensors); :meth:`run` raises the error of the first failed check,
    in the order added."""

    def __init__(self) -> None:
        self._values: list[torch.Tensor] = []
        self._then: list[Callable[[list[float]], None]] = []

    def _add(self, values: tuple[torch.Tensor, ...], failed: Callable[..., bool], error: Callable[[], Exception],
             on_pass: Callable[[], None] | None) -> None:
        first, count = len(self._values), len(values)

        def then(read: list[float]) -> None:
            if failed(*read[first:first + count]):
                raise error()
            if on_pass is not None:
                on_pass()

        self._values.extend(v.reshape(()) for v in values)
        self._then.append(then)

    def add_finite(self, x: torch.Tensor, error: Callable[[], Exception],
                   on_pass: Callable[[], None] | None = None) -> None:
        """Fails when ``x`` holds NaN or inf (the inf-norm, max |x|, propagates both; unlike
        ``isfinite(x).all()`` it reads ``x`` once and writes nothing its size)."""
        if x.numel() == 0:
            if on_pass is not None:
                on_pass()
            return
        # A float32 (fp64 for fp64) norm: the stack below then keeps every value exact.
        with torch.no_grad():
            norm = torch.linalg.vector_norm(x.reshape(-1), float("inf"),
                                            dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        self._add((norm,), lambda v: not math.isfinite(v), error, on_pass)

    def add_range(self, x: torch.Tensor, low: float, high: float, error: Callable[[], Exception]) -> None:
        """Fails when a value of ``x`` lies outside ``[low, high)`` (NaN and inf fail too)."""
        if x.numel() == 0:
            return
        with torch.no_grad():
            lo, hi = torch.aminmax(x.reshape(-1))
        self._add((lo, hi), lambda a, b: not (low <= a and b < high), error, None)

    def run(self, *reads: torch.Tensor) -> list[float]:
        """Read every check's values and the one-element tensors ``reads`` in one
        synchronization, raise the first failed check's error, else return the values of ``reads``
        (as floats: exact for ids below 2^53 and for bools)."""
        values = self._values + [r.reshape(()) for r in reads]
        then, self._values, self._then = self._then, [], []
        if not values:
            return []
        # float64 holds every value exactly (int64 ids up to 2^53, any float's value).
        with torch.no_grad():
            read = torch.stack(values, out=torch.empty(len(values), dtype=torch.float64, device=values[0].device))
        host = read.tolist()
        for step in then:
            step(host)
        return host[len(host) - len(reads):] if reads else []


class _FiniteTensors:
    """Tensors already checked finite, each at the version it had then. A head's weight is
    read whole (``V x H``, ~0.2 ms on an H100 for a 1 GiB weight) on every call otherwise,
    although it only changes at an optimizer step, which bumps its version counter: rollout
    and reference passes, and gradient-accumulation micro-batches, check it once.

    Entries are keyed by the tensor's storage (one Python object for all its aliases, e.g. a
    ``weight.detach()`` made per call, which share the version counter too) and held through
    a weak reference to it, so a freed weight's entry never matches a new tensor. Writes
    through ``.data`` do not bump the counter; NaN written that way reaches the pass and shows
    as NaN statistics, not as this named error."""

    def __init__(self) -> None:
        # (id(storage), view) -> (weak reference to the storage, version when checked).
        self._seen: dict[tuple, tuple[weakref.ref, int]] = {}

    @staticmethod
    def _key(x: torch.Tensor) -> tuple[object, tuple, int] | None:
        try:
            storage = x.untyped_storage()
            view = (id(storage), x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
            return storage, view, x._version
        except (RuntimeError, NotImplementedError):  # e.g. inference tensors: no version counter
            return None

    def known(self, x: torch.Tensor) -> bool:
        got = self._key(x)
        if got is None:
            return False
        storage, view, version = got
        entry = self._seen.get(view)
        return entry is not None and entry[0]() is storage and entry[1] == version

    def add(self, x: torch.Tensor) -> None:
        got = self._key(x)
        if got is None:
            return
        storage, view, version = got
        try:
            ref = weakref.ref(storage)
        except TypeError:
            return
        self._seen = {k: e for k, e in self._seen.items() if e[0]() is not None}
        self._seen[view] = (ref, version)


_FINITE_WEIGHTS = _FiniteTensors()
