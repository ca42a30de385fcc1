"""Input checks shared by every entry point: named errors before any result is computed from bad
input. Shapes, dtypes and devices are checked on the host before any kernel; values are reduced on
the device and read once, and the only kernel that may run before that read is a statistics GEMM
that no value can make fault, whose result is dropped when a check fails
(:func:`~logitless.ops.engine.start_pass`)."""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .contract import Head, VocabShard
from .lora import HeadLoRA
from .transform import LogitTransform

if TYPE_CHECKING:
    from .plan import ChunkPlan

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_head_inputs(hidden: torch.Tensor, head: Head, targets: torch.Tensor | None, ignore_index: int | None,
                      checks: ValueChecks | None = None, *, pending: ValueChecks | None = None,
                      counted: torch.Tensor | None = None) -> bool:
    """Validate ``hidden [..., H]``, the head (``weight [V, H]``, ``bias [V]``, its shard and
    adapter: :meth:`HeadLoRA.check`, then NaN/inf in its factors with the other values) and
    ``targets [...]`` (global ids; ``None``: a pass without target ids, e.g. distillation's).
    Returns whether some target equals ``ignore_index``, read in the same host synchronization
    as the value checks (a second one only when ``ignore_index`` lies outside ``[0, V)`` and so
    does some target: the targets' range alone answers otherwise). With ``checks``, the value
    checks are added to it instead, when it sends them (:meth:`ValueChecks.later`; the caller
    reads them with its own, in one synchronization) and the return value is ``False``; pass
    ``ignore_index=None`` then. ``pending``: checks the caller has already added (e.g.
    :func:`check_count`'s), run here in this function's synchronization. ``counted``: bool of
    ``targets``' shape, the positions whose hidden row and target are value-checked (the others
    may hold anything), so a caller checks its own layout before it knows which positions
    count; with ``checks`` only.

    Raises:
        TypeError: non-tensor arguments, non-floating hidden/weight, non-integer targets,
            dtype mismatch between hidden, weight and bias.
        ValueError: wrong ranks or shapes (logits passed as ``hidden`` are named as such), an
            empty hidden size or vocabulary, device mismatch, a bad shard, a target outside
            ``[0, V)`` other than ``ignore_index``, NaN/inf in hidden, weight, bias or the
            adapter's factors, logits that may exceed :func:`logit_limit`, and whatever
            ``pending`` raises.
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
    check_device("hidden", hidden, hidden.device)  # a meta hidden: every other input must share its device
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
    check_device("weight", weight, hidden.device)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}")
        check_device("bias", bias, hidden.device)
    vocab = head.vocab_size()  # raises on a bad shard
    if checks is not None and pending is not None:
        raise ValueError("check_head_inputs: give checks (deferred) or pending (run here), not both")
    if counted is not None and (checks is None or targets is None):
        raise ValueError("check_head_inputs: counted positions need deferred checks and targets")
    own = checks if checks is not None else pending if pending is not None else ValueChecks()
    t = None
    rows = None
    if targets is not None:
        _check_target_tensor(targets, hidden)
        t = targets.reshape(-1)
        if counted is not None:
            rows = counted.reshape(-1)
            hidden = hidden.reshape(-1, hidden.shape[-1])
    # An ignore_index outside [0, V) (TRL's -100) can only occur where the targets' range check
    # fails: one reduction answers both in the common case; the exact check runs only then.
    span = None
    if t is not None and t.numel() and ignore_index is not None and not 0 <= ignore_index < vocab:
        with torch.no_grad():
            span = torch.aminmax(t)
    if lora is not None:
        lora.check(hidden, weight)

    def add_values() -> torch.Tensor | None:
        """Add the value checks to ``own``; returns the targets equal to ``ignore_index`` (or ``None``)."""
        ignored = None
        if t is not None and span is None:
            ignored = _add_target_range(own, t, vocab, ignore_index, rows)
        norms = [own.add_finite(hidden, lambda: ValueError("hidden contains NaN or inf"), where=rows)]
        known = _FINITE_WEIGHTS.known(weight)
        if known is None:
            norms.append(own.add_finite(weight, lambda: ValueError("weight contains NaN or inf"),
                                        on_pass=lambda norm: _FINITE_WEIGHTS.add(weight, norm)))
        else:
            norms.append(known)
        norms.append(None if bias is None else own.add_finite(bias, lambda: ValueError("bias contains NaN or inf")))
        if lora is not None:
            for factor in (lora.a, lora.b):
                norms.append(own.add_finite(factor,
                                            lambda: ValueError("HeadLoRA.a or HeadLoRA.b contains NaN or inf")))
        _add_logit_bound(own, head, hidden, norms)
        return ignored

    if checks is not None:  # added when the caller sends its checks
        if ignore_index is not None:
            raise ValueError("check_head_inputs: deferred checks read no ignore_index; pass ignore_index=None")
        checks.later(add_values)
        return False
    ignored = add_values()
    if span is not None:
        low, high = own.run(*span)
        if 0 <= low and high < vocab:
            return False
        ignored = _add_target_range(own, t, vocab, ignore_index)
    if ignored is None:
        own.run()
        return False
    return bool(own.run(ignored.any())[0])


def _add_target_range(checks: ValueChecks, t: torch.Tensor, vocab: int, ignore_index: int | None,
                      rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """Targets in ``[0, vocab)``, ``ignore_index`` allowed too, added to ``checks`` (at ``rows``
    only, when given); returns the ``ignore_index`` mask (``None`` without one)."""
    ignored = None if ignore_index is None else t == ignore_index
    checks.add_range(t if ignored is None else t.masked_fill(ignored, 0), 0, vocab,
                     lambda: _bad_targets(t if rows is None else t[rows], vocab, ignore_index), where=rows)
    return ignored


def check_target_range(targets: torch.Tensor, vocab: int, checks: ValueChecks, counted: torch.Tensor,
                       ignore_index: int | None = None) -> None:
    """Integer ``targets`` in ``[0, vocab)`` at the ``counted`` positions (bool, ``targets``' shape),
    added to ``checks`` (read with them); ``ignore_index`` is named in the error as allowed.

    Raises:
        TypeError: ``targets`` not an integer tensor (at once).
    """
    _check_integer(targets)
    _add_target_range(checks, targets.reshape(-1), vocab, ignore_index, counted.reshape(-1))


def _check_integer(targets: torch.Tensor) -> None:
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")


def _check_target_tensor(targets: torch.Tensor, hidden: torch.Tensor) -> None:
    """The targets' dtype, shape and device."""
    _check_integer(targets)
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    check_device("targets", targets, hidden.device)


def check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    """``x`` holds data (not the ``meta`` device) and lies on ``device`` (the hidden states').

    Raises:
        ValueError: naming ``name``.
    """
    if x.is_meta:
        raise ValueError(f"{name} is on the meta device (a shape without data): materialize it first, e.g. load the "
                         "checkpoint after model.to_empty(device=...)")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but hidden is on {device}: move it with .to(hidden.device)")


def check_devices(device: torch.device, tensors: dict[str, torch.Tensor | None]) -> None:
    """:func:`check_device` of each named tensor in order (``None``: absent, skipped).

    Raises:
        ValueError: naming the first tensor on the meta device or not on ``device``.
    """
    for name, x in tensors.items():
        if x is not None:
            check_device(name, x, device)


def check_count(value: object, checks: ValueChecks, device: torch.device, *,
                zero_ok: bool | torch.Tensor = False) -> float | torch.Tensor:
    """``num_items_in_batch``, a token count given as an int, a float or a one-element tensor (TRL
    passes a tensor on the accelerator), checked finite and > 0 (``>= 0`` where ``zero_ok``; a
    one-element tensor there: where it is 0, e.g. the call's own count, read with ``checks``). A
    tensor's value is read with ``checks`` (no synchronization of its own) and returned on
    ``device``; a number is checked at once (with ``checks`` when ``zero_ok`` is a tensor) and
    returned as a float.

    Raises:
        TypeError: not a number or a one-element real tensor (a bool, a string, a complex tensor).
        ValueError: NaN, inf, negative, or zero where not ``zero_ok``; a tensor on the meta device.
    """
    read_zero_ok = isinstance(zero_ok, torch.Tensor)
    allow_zero = [False if read_zero_ok else zero_ok]  # a tensor's verdict once read

    def bad(v: float, count: float | None = None) -> bool:
        if count is not None:
            allow_zero[0] = count == 0
        return not (math.isfinite(v) and (v >= 0 if allow_zero[0] else v > 0))

    def error(v: object) -> ValueError:
        need = ">= 0" if allow_zero[0] else "> 0"
        return ValueError(f"num_items_in_batch must be a finite count {need} (the counted tokens of the whole "
                          f"batch, over processes and accumulation steps), got {v}")

    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"num_items_in_batch must be a number or a one-element real tensor, got a {value.dtype} "
                            f"tensor of shape {tuple(value.shape)}")
        if value.is_meta:
            raise ValueError("num_items_in_batch is on the meta device (a shape without data)")
        value = value.detach().to(device).reshape(())
        if read_zero_ok:
            checks.add((value, zero_ok), bad, lambda: error(value.item()))
        else:
            checks.add((value,), bad, lambda: error(value.item()))
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"num_items_in_batch must be a number or a one-element tensor, got {value!r} "
                        f"({type(value).__name__})")
    if read_zero_ok and float(value) == 0:  # allowed where the call counts no token: read with the checks
        checks.add((zero_ok,), lambda count: count != 0, lambda: error(value))
    elif bad(float(value)):
        raise error(value)
    return float(value)


def check_mask(mask: object, name: str, checks: ValueChecks, device: torch.device, *, binary: bool) -> None:
    """A token mask of any dtype (bool, integer, floating), the same rule for each: values finite
    and ``>= 0`` (a weight per token), or exactly 0/1 where ``binary`` (a mask that only selects
    tokens: a 0.5 there would silently count as 1). Values are read with ``checks``.

    Raises:
        TypeError: not a tensor, or a complex one.
        ValueError: a value that breaks the rule (an integer -1 as much as a float -1 or NaN),
            naming ``name``; the device (see :func:`check_device`).
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool, integer or floating tensor, got {mask.dtype}")
    check_device(name, mask, device)
    if mask.dtype == torch.bool or mask.numel() == 0:
        return
    rule = "0 or 1 (or bool)" if binary else "finite and >= 0 (0/1, bool, or a weight per token)"

    def error() -> ValueError:
        flat = mask.reshape(-1)
        wrong = (flat != 0) & (flat != 1) if binary else ~torch.isfinite(flat.double()) | (flat < 0)
        return ValueError(f"{name} values must be {rule}; found {flat[wrong][:5].tolist()}")

    def add() -> None:
        if binary:
            with torch.no_grad():
                wrong = ((mask != 0) & (mask != 1)).any()
            checks.add((wrong,), bool, error)
        else:
            checks.add_range(mask, 0, math.inf, error)

    checks.later(add)


# Beyond this bound on |logits| the objectives' fp32 arithmetic (z-loss's lse², KL and
# entropy terms) overflows; no trained head comes within many orders of magnitude of it.
_LOGIT_LIMIT = {torch.float32: 1e18, torch.float64: 1e150}


def logit_limit(stat_dtype: torch.dtype) -> float:
    """The largest ``|logit|`` the statistics of ``stat_dtype`` (fp32 or fp64) are computed for."""
    return _LOGIT_LIMIT[torch.float64 if stat_dtype == torch.float64 else torch.float32]


def _add_logit_bound(checks: ValueChecks, head: Head, hidden: torch.Tensor,
                     norms: list[torch.Tensor | float | None]) -> None:
    """Refuse inputs whose logits may exceed :func:`logit_limit`, from the inf-norms the NaN/inf
    checks already read (no extra pass over the data): ``|y| <= H·max|h|·max|W| + max|b|``
    (+ the adapter's ``scaling·r·H·max|h|·max|a|·max|b_lora|``), then the transform
    (``|z| <= softcap / T`` under a soft-cap, else ``|scale|·|y| / T``)."""
    tensors = [n for n in norms if isinstance(n, torch.Tensor)]
    if not tensors:
        return
    width, lora, transform = hidden.shape[-1], head.lora, head.transform or LogitTransform()
    limit = logit_limit(hidden.dtype)
    scale, cap, temperature = abs(transform.logit_scale), transform.softcap, transform.temperature
    if cap is not None and cap / temperature < limit:
        return  # the cap bounds the logits whatever the inputs

    def bound(*read: float) -> float:
        it = iter(read)
        h, w, b, *factors = (next(it) if isinstance(n, torch.Tensor) else (n or 0.0) for n in norms)
        y = width * h * w + b
        if lora is not None:
            y += abs(lora.scaling) * lora.a.shape[0] * width * h * factors[0] * factors[1]
        y = scale * y
        return (y if cap is None else min(y, cap)) / temperature

    def error() -> Exception:
        return ValueError(f"the logits may reach {bound(*(float(t) for t in tensors)):.3g} (bound from max|hidden|, "
                          f"max|weight|, the bias, adapter and transform), beyond {limit:.0e}, where the loss's "
                          f"{'fp64' if limit > 1e20 else 'fp32'} statistics overflow to inf/NaN: hidden or the head "
                          "holds values far outside a trained model's range (a missing final norm? unscaled inputs?)")

    checks.add(tuple(tensors), lambda *read: not bound(*read) < limit, error)


def _bad_targets(t: torch.Tensor, vocab: int, ignore_index: int | None) -> ValueError:
    out_of_range = (t < 0) | (t >= vocab)
    extra = ""
    if ignore_index is not None:
        out_of_range &= t != ignore_index
        extra = f" or equal ignore_index={ignore_index}"
    return ValueError(f"targets must lie in [0, {vocab}){extra}; found {t[out_of_range][:5].tolist()}")


class ValueChecks:
    """Checks of tensor values (NaN/inf, ranges) gathered from several places and read in one
    host synchronization, so a call waits for the device once before its pass.

    Each check reduces its tensor to one or two scalars on the device (one kernel: the inf-norm
    for NaN/inf, ``aminmax`` for a range) and decides on the host, so a call's checks cost a
    kernel each, one stack of the scalars and one copy. ``error()`` builds the exception of a
    failed check (it may read tensors); :meth:`run` raises the error of the first failed check,
    in the order added.

    Reductions added through :meth:`later` run when the checks are sent (:meth:`send`,
    :meth:`run`, :meth:`queue`). A caller whose pass may run on unchecked values
    (:func:`~logitless.ops.contract.defers_checks`) reads the counts its pass is planned with
    apart, queues its checks (:meth:`queue`) once the pass's first statistics GEMM is queued (the
    host prepares them while the GPU computes instead of before) and reads them (:meth:`read`)
    before it returns, so a failed check still raises its error before any result is used."""

    def __init__(self) -> None:
        self._values: list[torch.Tensor] = []
        self._then: list[Callable[[list[float]], None]] = []
        self._later: list[Callable[[], object]] = []
        self._pending: PendingRead | None = None
        self._read = False

    def later(self, add: Callable[[], object]) -> None:
        """Run ``add`` (which adds checks to this object) when the checks are next sent."""
        self._later.append(add)

    def queue(self) -> None:
        """Send the checks (their copy to the host queued, :meth:`send`) for :meth:`read`, once."""
        if self._pending is None and not self._read:
            self._pending = self.send(None)

    def read(self) -> None:
        """Read the queued checks (queued first if not yet), raising the first failed check's
        error; once (a later call does nothing)."""
        if self._read:
            return
        self.queue()
        pending, self._pending, self._read = self._pending, None, True
        pending.wait()

    def add(self, values: tuple[torch.Tensor, ...], failed: Callable[..., bool], error: Callable[[], Exception],
            on_pass: Callable[..., None] | None = None) -> None:
        """A check of one-element ``values`` (already reduced on the device): ``failed(*floats)``
        decides on the host; ``on_pass(*floats)`` runs when it passes."""
        first, count = len(self._values), len(values)

        def then(read: list[float]) -> None:
            mine = read[first:first + count]
            if failed(*mine):
                raise error()
            if on_pass is not None:
                on_pass(*mine)

        self._values.extend(v if v.dim() == 0 else v.reshape(()) for v in values)
        self._then.append(then)

    def add_finite(self, x: torch.Tensor, error: Callable[[], Exception],
                   on_pass: Callable[[float], None] | None = None,
                   where: torch.Tensor | None = None) -> torch.Tensor | None:
        """Fails when ``x`` holds NaN or inf (the inf-norm, max |x|, propagates both; unlike
        ``isfinite(x).all()`` it reads ``x`` once and writes nothing its size). Returns that
        inf-norm (a 0-dim device tensor; ``None`` for an empty ``x``, whose norm is 0), which
        ``on_pass`` receives as a float. ``where``: a bool mask of ``x``'s shape, or of its
        shape without the last dimension (rows): only those elements or rows are checked and
        measured (a position of the caller's layout that does not count may hold anything)."""
        if x.numel() == 0:
            if on_pass is not None:
                on_pass(0.0)
            return None
        # A float32 (fp64 for fp64) norm: the stack below then keeps every value exact.
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        with torch.no_grad():
            if where is not None:
                if where.shape != x.shape:  # one norm per row first, [..., H] -> [...]
                    x = torch.linalg.vector_norm(x, float("inf"), dim=-1, dtype=dtype)
                x = torch.where(where, x, 0)
            norm = torch.linalg.vector_norm(x.reshape(-1), float("inf"), dtype=dtype)
        self.add((norm,), lambda v: not math.isfinite(v), error, on_pass)
        return norm

    def add_range(self, x: torch.Tensor, low: float, high: float, error: Callable[[], Exception],
                  where: torch.Tensor | None = None) -> None:
        """Fails when a value of ``x`` lies outside ``[low, high)`` (NaN and inf fail too);
        ``where``: a bool mask of ``x``'s shape, the only elements checked."""
        if x.numel() == 0:
            return
        with torch.no_grad():
            lo, hi = torch.aminmax((x if where is None else x.masked_fill(~where, low)).reshape(-1))
        self.add((lo, hi), lambda a, b: not (low <= a and b < high), error)

    def run(self, *reads: torch.Tensor) -> list[float]:
        """Read every check's values and the one-element tensors ``reads`` in one
        synchronization, raise the first failed check's error, else return the values of ``reads``
        (as floats: exact for ids below 2^53 and for bools)."""
        return self.send(None, *reads).wait()[0]

    def send(self, vector: torch.Tensor | None, *reads: torch.Tensor) -> PendingRead:
        """Queue the copy of :meth:`run`'s values, and of the 1-D ``vector`` in the same
        synchronization, and return without waiting for it: work the caller queues before
        :meth:`PendingRead.wait` runs on the device while the host waits for the copy (on a GPU;
        on a CPU the copy is done here)."""
        later, self._later = self._later, []
        for add in later:
            add()
        values = self._values + [r if r.dim() == 0 else r.reshape(()) for r in reads]
        then, self._values, self._then = self._then, [], []
        if not values and vector is None:
            return PendingRead(None, None, 0, 0, False, then)
        k, extra = len(values), 0 if vector is None else vector.numel()
        device = (values[0] if values else vector).device
        # float64 holds every value exactly (int64 ids up to 2^53, any float's value).
        with torch.no_grad():
            buf = torch.empty(k + extra, dtype=torch.float64, device=device)
            if k:
                torch.stack(values, out=buf[:k])
            if extra:
                buf[k:].copy_(vector)
            if device.type != "cuda":
                return PendingRead(buf.cpu(), None, k, len(reads), vector is not None, then)
            host = torch.empty(k + extra, dtype=torch.float64, pin_memory=True)
            host.copy_(buf, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
        return PendingRead(host, done, k, len(reads), vector is not None, then)


@dataclass
class PendingRead:
    """The checks' values on their way to the host (:meth:`ValueChecks.send`)."""

    host: torch.Tensor | None  # [k + vector] float64 on the host (pinned: filled once ``done`` has passed)
    done: torch.cuda.Event | None
    k: int  # the checks' and the reads' values; then the vector
    reads: int
    vector: bool  # whether a vector follows them
    then: list[Callable[[list[float]], None]]

    def wait(self) -> tuple[list[float], np.ndarray | None]:
        """Wait for the copy, raise the first failed check's error, else return ``(the values of
        the reads, the vector)``, the vector a float64 NumPy array (exact for counts below 2^53;
        ``None`` without a vector)."""
        if self.host is None:
            return [], None
        if self.done is not None:
            self.done.synchronize()
        host = self.host[:self.k].tolist()
        for step in self.then:
            step(host)
        vector = self.host[self.k:].numpy() if self.vector else None
        return (host[len(host) - self.reads:] if self.reads else []), vector


class _FiniteTensors:
    """Tensors already checked finite, each at the version it had then, with the inf-norm
    read then (the logits bound of :func:`_add_logit_bound` reuses it). A head's weight is
    read whole (``V x H``, ~0.2 ms on an H100 for a 1 GiB weight) on every call otherwise,
    although it only changes at an optimizer step, which bumps its version counter: rollout
    and reference passes, and gradient-accumulation micro-batches, check it once.

    Entries are keyed by the tensor's storage (one Python object for all its aliases, e.g. a
    ``weight.detach()`` made per call, which share the version counter too) and held through
    a weak reference to it, so a freed weight's entry never matches a new tensor. Writes
    through ``.data`` do not bump the counter; NaN written that way reaches the pass and shows
    as NaN statistics, not as this named error (kept so, docs/reliability.md says why; in-place
    writes under ``torch.no_grad()`` bump it and are re-checked)."""

    def __init__(self) -> None:
        # (id(storage), view) -> (weak reference to the storage, version when checked, inf-norm).
        self._seen: dict[tuple, tuple[weakref.ref, int, float]] = {}

    @staticmethod
    def _key(x: torch.Tensor) -> tuple[object, tuple, int] | None:
        try:
            storage = x.untyped_storage()
            view = (id(storage), x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
            return storage, view, x._version
        except (RuntimeError, NotImplementedError):  # e.g. inference tensors: no version counter
            return None

    def known(self, x: torch.Tensor) -> float | None:
        """``x``'s inf-norm when it was checked finite at its current version, else ``None``."""
        got = self._key(x)
        if got is None:
            return None
        storage, view, version = got
        entry = self._seen.get(view)
        return entry[2] if entry is not None and entry[0]() is storage and entry[1] == version else None

    def add(self, x: torch.Tensor, norm: float) -> None:
        got = self._key(x)
        if got is None:
            return
        storage, view, version = got
        try:
            ref = weakref.ref(storage)
        except TypeError:
            return
        self._seen = {k: e for k, e in self._seen.items() if e[0]() is not None}
        self._seen[view] = (ref, version, norm)


_FINITE_WEIGHTS = _FiniteTensors()


def check_rounded_logits(plan: ChunkPlan, dtype: torch.dtype, stats: NamedTuple) -> None:
    """With ``logits_precision="input"`` the matmul output is rounded to ``dtype`` first; a
    logit beyond its range (fp16: ±65504) rounds to ±inf and turns the statistics into NaN, so
    one check per pass (only in that mode: finite inputs give finite fp32 logits).

    Raises:
        ValueError: a non-finite ``lse``/``logp``/``entropy``, naming the option to change.
    """
    if plan.fp32_logits or dtype not in (torch.float16, torch.bfloat16):
        return
    checked = [getattr(stats, name) for name in ("lse", "logp", "entropy") if getattr(stats, name, None) is not None]
    if checked and not bool(torch.stack([torch.isfinite(t).all() for t in checked]).all()):
        raise ValueError(f"logits_precision='input' with {dtype} inputs: some logits exceed {dtype}'s range "
                         f"(max {torch.finfo(dtype).max:g}) and round to inf, which makes the log-probs/entropy NaN; "
                         f"use PassOptions(logits_precision='fp32') (or LOGITLESS_LOGITS_PRECISION=fp32)")
