"""The entry points under ``torch.compile``: each call is one ``torch.library`` custom op.

Under ``torch.compiler.is_compiling()``, :func:`~logitless.policy_loss`,
:func:`~logitless.cross_entropy`, :func:`~logitless.vocab_stats` and
:func:`~logitless.token_logprobs` hand their arguments to the function of the same name here
(:func:`route`, through their wrapper ``amp.autocast_head_inputs``). The call becomes one op of
namespace ``logitless`` in the caller's graph, with a fake implementation (exact output shapes
and dtypes, whatever the data) and registered autograd, so ``torch.compile(fullgraph=True)``
traces through the head, forward and backward. Why an op rather
than tracing the pass: the pass is Python loops over token and vocabulary chunks whose sizes
depend on the data, and its fused mode runs ``torch.autograd.grad`` inside its forward; traced, it
would break the graph at a dozen places, and compiled code could not beat a pass that never
materializes the logits.

The ops' kernels run the eager functions, so the numbers are the eager ones:

* ``logitless::loss`` (``policy_loss``; ``cross_entropy`` reduced by ``"mean"``/``"sum"``): the
  scalar loss, its metrics and, when an input requires grad, the loss's gradients w.r.t. the
  hidden states and the head's weight, bias and LoRA factors, taken in the same call (the library's
  fused design: the gradient GEMMs run in the forward). The backward multiplies them by the
  incoming gradient on the device (no host synchronization).
* ``logitless::token_stats`` (``vocab_stats``, ``token_logprobs``, ``cross_entropy`` with
  ``"none"``): per-token outputs. Their backward, the op ``logitless::token_stats_backward``, runs
  the eager call again with autograd for the vector-Jacobian product of any incoming per-token
  gradients: one statistics pass more than eager (5 GEMMs of work instead of recompute mode's 4).

The kernels read values on the host (eager's value checks), so the ops are tagged
``cudagraph_unsafe``: under ``mode="reduce-overhead"`` inductor keeps them out of its CUDA graphs.

The non-tensor arguments (``PolicyConfig``, ``PassOptions``, the head's ``LogitTransform``, ...)
reach an op as text, their numbers apart as a ``list[float]``: dynamo guards a number that reaches
an op by its value (another value recompiles), but one it has seen change becomes a symbol, which
cannot be written into text.

Differences from eager: the loss and the metrics come back in the statistics dtype (fp32; fp64 for
fp64 inputs) even where a float64 ``num_items_in_batch`` tensor would promote eager's; the saved
gradients are in the inputs' dtypes before the incoming gradient scales them (eager scales its fp32
accumulators, then rounds: the same for an incoming gradient of 1); ``mode="recompute"`` runs its
backward inside the forward too. Calls the ops cannot take run eagerly behind a graph break, as
before (``fullgraph=True`` then raises dynamo's ``Unsupported`` with the reason): process groups
(``group``, ``sequence_group``, a vocabulary-parallel head's ``VocabShard.group``: their
collectives run inside the pass), a LoRA adapter with dropout (a random Python callable), and
arguments of the wrong type (the eager function raises its error).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

from ..compile import graph_break
from ..ops import Head, HeadLoRA, LogitTransform, PassOptions, VocabShard, stat_dtype_for
from .config import PolicyConfig
from .policy_terms import metric_names

Tensor = torch.Tensor
Args = dict[str, Any]  # an entry point's arguments by name, defaults filled in

_RECORDS = {cls.__name__: cls for cls in (PolicyConfig, PassOptions, LogitTransform, VocabShard)}
_POLICY_TENSORS = ("targets", "completion_mask", "advantages", "old_logp", "ref_logp", "tool_mask",
                   "sampling_logp", "importance_sampling_ratio", "segment_ids", "num_items_in_batch")
_STATS = ("logp", "lse", "entropy", "mean_logit")
# The kernels read values on the host (eager's value checks) and allocate per call: a CUDA graph
# (mode="reduce-overhead") must not capture them; inductor leaves ops so tagged out of its graphs.
_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)  # (absent from older torch)
_OP = {"mutates_args": (), **({} if _UNSAFE is None else {"tags": (_UNSAFE,)})}
_REASON = ("logitless: this call's arguments have no compiled path (a process group, a LoRA adapter with dropout, "
           "or an argument of the wrong type): it runs eagerly (objectives/compiled.py)")


# ----------------------------------------------------------------------------- routes (traced by dynamo)


def policy_loss(eager: Callable, args: Args) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`logitless.policy_loss` as ``logitless::loss``."""
    config = PolicyConfig() if args["config"] is None else args["config"]
    if args["group"] is not None or args["sequence_group"] is not None or not isinstance(config, PolicyConfig):
        return _eagerly(eager, **args)
    tensors = _count(args, {name: args[name] for name in _POLICY_TENSORS})
    names = metric_names(config, args["sampling_logp"] is not None)
    return _loss("policy_loss", eager, args, tensors, {"config": config}, names)


def cross_entropy(eager: Callable, args: Args) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`logitless.cross_entropy` as ``logitless::loss`` (``"mean"``, ``"sum"``) or
    ``logitless::token_stats`` (``"none"``)."""
    tensors = _count(args, {"targets": args["targets"], "num_items_in_batch": args["num_items_in_batch"]})
    values = {name: args[name] for name in ("ignore_index", "reduction", "label_smoothing", "z_loss")}
    if args["reduction"] == "none":
        out = _token_stats("cross_entropy", args, tensors, values, ("loss",), ("ce", "z_loss"))
        return _eagerly(eager, **args) if out is None else (out[0][0], dict(zip(("ce", "z_loss"), out[1], strict=True)))
    # The eager order: the terms, then the metric, then a z_loss that was not a term.
    names = ("ce", "z_loss", "accuracy") if args["z_loss"] else ("ce", "accuracy", "z_loss")
    return _loss("cross_entropy", eager, args, tensors, values, names)


def vocab_stats(eager: Callable, args: Args) -> tuple[Tensor | None, ...]:
    """:func:`logitless.vocab_stats` as ``logitless::token_stats``: ``(logp, lse, entropy, mean_logit)``."""
    names = tuple(name for name in _STATS if name in ("logp", "lse") or args[name])
    values = {name: args[name] for name in ("ignore_index", "entropy", "mean_logit")}
    out = _token_stats("vocab_stats", args, {"targets": args["targets"]}, values, names, ())
    if out is None:
        return _eagerly(eager, **args)
    got = dict(zip(names, out[0], strict=True))
    return tuple(got.get(name) for name in _STATS)


def token_logprobs(eager: Callable, args: Args) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`logitless.token_logprobs` as ``logitless::token_stats`` (no gradient)."""
    names = ("logp", "entropy") if args["entropy"] else ("logp",)
    values = {name: args[name] for name in ("ignore_index", "entropy")}
    out = _token_stats("token_logprobs", args, {"targets": args["targets"]}, values, names, ())
    if out is None:
        return _eagerly(eager, **args)
    return tuple(out[0]) if args["entropy"] else out[0][0]


def _count(args: Args, tensors: Args) -> Args:
    """``tensors`` with a number ``num_items_in_batch`` as a 0-dim tensor in the statistics dtype
    (the value eager's number path takes). Why: a number reaching the op is a constant of the
    graph, and a count that changes every step would recompile every step."""
    count, hidden = tensors["num_items_in_batch"], args["hidden"]
    if type(count) in (int, float) and isinstance(hidden, Tensor):
        count = torch.scalar_tensor(count, dtype=stat_dtype_for(hidden.dtype), device=hidden.device)
    return {**tensors, "num_items_in_batch": count}


def _inputs(kind: str, args: Args, tensors: Args, values: Args) -> tuple[list, list, str, list[float]] | None:
    """The op's differentiable tensors (hidden, the head's weight, bias, LoRA ``a``, ``b``), its
    other tensors, its text and numbers; ``None`` for a call the op cannot take."""
    head, options = args["head"], args["options"]
    head = Head(head) if isinstance(head, Tensor) else head
    if not isinstance(head, Head):
        return None
    lora, shard = head.lora, head.shard
    if (lora is not None and lora.dropout is not None) or (shard is not None and shard.group is not None):
        return None
    if not (isinstance(args["hidden"], Tensor) and isinstance(head.weight, Tensor)):
        return None
    if not (options is None or isinstance(options, PassOptions)):
        return None
    tensors = {name: t for name, t in tensors.items() if t is not None}  # (a list of optional tensors
    if not all(isinstance(t, Tensor) for t in tensors.values()):         # breaks register_autograd's check)
        return None
    if not all(v is None or type(v) in (bool, int, float, str) or isinstance(v, tuple(_RECORDS.values()))
               for v in values.values()):
        return None
    diff = [args["hidden"], head.weight, head.bias, None if lora is None else lora.a, None if lora is None else lora.b]
    text, numbers = _encode({"kind": kind, "tensors": ",".join(tensors), "transform": head.transform,
                             "shard": shard, "lora_scaling": None if lora is None else lora.scaling,
                             "options": options, **values})
    return diff, list(tensors.values()), text, numbers


def _loss(kind: str, eager: Callable, args: Args, tensors: Args, values: Args, names: tuple[str, ...]):
    prepared = _inputs(kind, args, tensors, {**values, "metrics": ",".join(names)})
    if prepared is None:
        return _eagerly(eager, **args)
    diff, others, text, numbers = prepared
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in diff]
    loss, metrics, _ = torch.ops.logitless.loss(*diff, others, text, numbers, needs)
    return loss, dict(zip(names, metrics, strict=True))


def _token_stats(kind: str, args: Args, tensors: Args, values: Args, outputs: tuple[str, ...],
                 metrics: tuple[str, ...]) -> tuple[list[Tensor], list[Tensor]] | None:
    prepared = _inputs(kind, args, tensors, {**values, "outputs": ",".join(outputs), "metrics": ",".join(metrics)})
    if prepared is None:
        return None
    diff, others, text, numbers = prepared
    if kind == "token_logprobs":  # no gradient, as eager
        diff = [None if t is None else t.detach() for t in diff]
    return torch.ops.logitless.token_stats(*diff, others, text, numbers)


@functools.partial(graph_break, reason=_REASON)
def _eagerly(fn: Callable, /, *args, **kwargs):
    return fn(*args, **kwargs)


def route(compiled: Callable[[Callable, Args], Any]) -> Callable[[Callable], Callable[[list, dict], Any]]:
    """An entry point's compiled path, for ``@autocast_head_inputs(compiled=route(compiled))``:
    for the entry point ``fn`` (its signature read once), a function of a call's ``(args,
    kwargs)`` that returns ``compiled(fn, args)`` (``args``: the call's arguments by name, defaults
    filled in). The entry point's wrapper calls it only under ``torch.compiler.is_compiling()``.
    Arguments that do not bind go to ``fn`` eagerly, which raises Python's ``TypeError``."""

    def bind(fn: Callable) -> Callable[[list, dict], Any]:
        params = inspect.signature(fn).parameters
        positional = tuple(n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}

        def routed(args: list, kwargs: dict):
            given = dict(zip(positional, args, strict=False))  # (too many: caught below)
            bound = {**defaults, **given, **kwargs}
            if len(args) > len(positional) or bound.keys() != params.keys() or set(kwargs) & set(given):
                return _eagerly(fn, *args, **kwargs)
            return compiled(fn, bound)

        return routed

    return bind


# ----------------------------------------------------------------------------- non-tensor arguments


def _encode(values: Args) -> tuple[str, list[float]]:
    """``values`` (``None``, bools, strings without ``;``, numbers and the frozen records of
    ``_RECORDS``) as ``;``-separated ``name=literal``, ``name:int`` / ``name:float`` (the value in
    ``numbers``) and ``name:Record`` entries (then one entry per field, ``name.field``)."""
    text: list[str] = []
    numbers: list[float] = []

    def put(key: str, v: object) -> None:
        if type(v) in (int, float):
            text.append(f"{key}:{type(v).__name__}")
            numbers.append(float(v))
        else:
            text.append(f"{key}={v!r}")

    for name, value in values.items():
        if isinstance(value, tuple(_RECORDS.values())):
            text.append(f"{name}:{type(value).__name__}")
            for f in dataclasses.fields(value):
                if f.init:  # the others are derived in __post_init__
                    put(f"{name}.{f.name}", getattr(value, f.name))
        else:
            put(name, value)
    return ";".join(text), numbers


@functools.lru_cache(maxsize=256)
def _decode(text: str, numbers: tuple[float, ...]) -> Args:
    """The values :func:`_encode` wrote (a shared dict: copy it before changing it)."""
    values: Args = {}
    records: dict[str, tuple[str, Args]] = {}
    number = iter(numbers)
    for entry in text.split(";"):
        if "=" in entry:
            key, _, literal = entry.partition("=")
            value = ast.literal_eval(literal)
        else:
            key, _, kind = entry.partition(":")
            if kind in _RECORDS:
                records[key] = (kind, {})
                continue
            value = int(next(number)) if kind == "int" else next(number)
        name, _, field = key.partition(".")
        if field:
            records[name][1][field] = value
        else:
            values[name] = value
    for name, (kind, fields) in records.items():
        values[name] = _RECORDS[kind](**fields)
    return values


def _names(values: Args, key: str) -> list[str]:
    return values[key].split(",") if values[key] else []


# ----------------------------------------------------------------------------- the ops' kernels


def _entry_point(kind: str):
    """The public function (``is_compiling()`` is false in a kernel: it runs eagerly)."""
    from .cross_entropy import cross_entropy
    from .policy import policy_loss
    from .vocab_stats import token_logprobs, vocab_stats

    return {"policy_loss": policy_loss, "cross_entropy": cross_entropy, "vocab_stats": vocab_stats,
            "token_logprobs": token_logprobs}[kind]


def _run(diff: list[Tensor | None], others: list[Tensor], text: str,
         numbers: list[float]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The eager call: ``(outputs by name, metrics by name)``."""
    values = dict(_decode(text, tuple(numbers)))
    kind = values.pop("kind")
    hidden, weight, bias, lora_a, lora_b = diff
    lora = None if lora_a is None else HeadLoRA(lora_a, lora_b, values.pop("lora_scaling"))
    head = Head(weight, bias, transform=values.pop("transform"), lora=lora, shard=values.pop("shard"))
    values.update(zip(_names(values, "tensors"), others, strict=True))
    for key in ("tensors", "lora_scaling", "outputs", "metrics"):
        values.pop(key, None)
    out = _entry_point(kind)(hidden, head, **values)
    if kind == "vocab_stats":
        return {k: v for k, v in out._asdict().items() if v is not None}, {}
    if kind == "token_logprobs":
        return {"logp": out[0], "entropy": out[1]} if isinstance(out, tuple) else {"logp": out}, {}
    return {"loss": out[0]}, out[1]


_AUTOCAST = functools.reduce(operator.or_, (DispatchKeySet(key) for name, key in DispatchKey.__members__.items()
                                           if name.startswith("Autocast")))


def _eager_dispatch():
    """The thread's default dispatch state (autocast still off: the inputs are cast already), in
    which a kernel runs the eager function.

    Why: an op's kernel runs below the autograd dispatch key (excluded thread-locally; from a
    compiled graph with every key above the backend), but the pass's fused mode and the
    vector-Jacobian products here use autograd. Private API, as torch's own leaf functions use it
    (``torch/_higher_order_ops/invoke_leaf_function.py``)."""
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() & _AUTOCAST)


def _leaves(diff: list[Tensor | None], needs: list[bool]) -> list[Tensor | None]:
    return [None if t is None else t.detach().requires_grad_(need) for t, need in zip(diff, needs, strict=True)]


def _grads(outputs: list[Tensor], leaves: list[Tensor | None], grad_outputs: list[Tensor] | None) -> list[Tensor]:
    """``d outputs / d leaves`` (the leaves that require grad), zeros where none reaches a leaf."""
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    got = torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True) if outputs else [None] * len(wanted)
    return [torch.zeros_like(t) if g is None else g.contiguous() for t, g in zip(wanted, got, strict=True)]


def _unaliased(outputs: list[Tensor], inputs: list) -> list[Tensor]:
    """``outputs``, each copied where it shares memory with an input or an earlier output (a
    custom op's outputs may not: e.g. two metrics that are views of one stacked tensor)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if t.numel() and ptr in seen else t)
        seen.add(ptr)
    return out


def _empty_grads(diff: list[Tensor | None], needs: list[bool]) -> list[Tensor]:
    return [t.new_empty(t.shape) for t, need in zip(diff, needs, strict=True) if need]


@torch.library.custom_op("logitless::loss", **_OP)
def _loss_op(hidden: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor | None, lora_b: Tensor | None,
             others: list[Tensor], text: str, numbers: list[float],
             needs: list[bool]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    diff = [hidden, weight, bias, lora_a, lora_b]
    leaves = _leaves(diff, needs)
    with _eager_dispatch(), torch.set_grad_enabled(any(needs)):
        outputs, metrics = _run(leaves, others, text, numbers)
        loss = outputs["loss"]
        grads = _grads([loss] if loss.requires_grad else [], leaves, None) if any(needs) else []
    names = _names(_decode(text, tuple(numbers)), "metrics")
    if sorted(metrics) != sorted(names):
        raise RuntimeError(f"logitless: the compiled path declared the metrics {names}, the call returned "
                           f"{list(metrics)}: please report this")
    sdt = stat_dtype_for(hidden.dtype)
    out = _unaliased([loss.detach().to(sdt), *(metrics[k].detach().to(sdt) for k in names), *grads], [*diff, *others])
    return out[0], out[1:1 + len(names)], out[1 + len(names):]


@_loss_op.register_fake
def _(hidden, weight, bias, lora_a, lora_b, others, text, numbers, needs):
    sdt = stat_dtype_for(hidden.dtype)
    names = _names(_decode(text, tuple(numbers)), "metrics")
    return (hidden.new_empty((), dtype=sdt), [hidden.new_empty((), dtype=sdt) for _ in names],
            _empty_grads([hidden, weight, bias, lora_a, lora_b], needs))


def _loss_setup(ctx, inputs, output) -> None:
    _, metrics, grads = output
    ctx.needs, ctx.n_others = inputs[-1], len(inputs[5])
    ctx.save_for_backward(*grads)
    ctx.mark_non_differentiable(*metrics, *grads)


def _loss_backward(ctx, g_loss, g_metrics, g_grads):
    saved = iter(ctx.saved_tensors)
    grads = [next(saved) * g_loss if need else None for need in ctx.needs]
    return (*grads, [None] * ctx.n_others, None, None, None)


_loss_op.register_autograd(_loss_backward, setup_context=_loss_setup)


@torch.library.custom_op("logitless::token_stats", **_OP)
def _stats_op(hidden: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor | None, lora_b: Tensor | None,
              others: list[Tensor], text: str, numbers: list[float]) -> tuple[list[Tensor], list[Tensor]]:
    with _eager_dispatch(), torch.no_grad():
        outputs, metrics = _run([hidden, weight, bias, lora_a, lora_b], others, text, numbers)
    values = _decode(text, tuple(numbers))
    sdt = stat_dtype_for(hidden.dtype)
    per_token = [outputs[k].to(sdt).contiguous() for k in _names(values, "outputs")]
    scalars = [metrics[k].to(sdt) for k in _names(values, "metrics")]
    out = _unaliased([*per_token, *scalars], [hidden, weight, bias, lora_a, lora_b, *others])
    return out[:len(per_token)], out[len(per_token):]


@_stats_op.register_fake
def _(hidden, weight, bias, lora_a, lora_b, others, text, numbers):
    sdt = stat_dtype_for(hidden.dtype)
    values = _decode(text, tuple(numbers))
    targets = others[0]
    return ([targets.new_empty(targets.shape, dtype=sdt) for _ in _names(values, "outputs")],
            [hidden.new_empty((), dtype=sdt) for _ in _names(values, "metrics")])


def _stats_setup(ctx, inputs, output) -> None:
    *diff, others, ctx.text, ctx.numbers = inputs
    ctx.n_others = len(others)
    ctx.save_for_backward(*diff, *others)
    ctx.mark_non_differentiable(*output[1])


def _stats_backward(ctx, g_outputs, g_metrics):
    saved = list(ctx.saved_tensors)
    diff, others = saved[:5], saved[5:]
    needs = [bool(n) for n in ctx.needs_input_grad[:5]]
    grads = iter(torch.ops.logitless.token_stats_backward(*diff, others, list(g_outputs), ctx.text, ctx.numbers,
                                                          needs))
    return (*(next(grads) if need else None for need in needs), [None] * ctx.n_others, None, None)


_stats_op.register_autograd(_stats_backward, setup_context=_stats_setup)


@torch.library.custom_op("logitless::token_stats_backward", **_OP)
def _stats_backward_op(hidden: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor | None,
                       lora_b: Tensor | None, others: list[Tensor], grad_outputs: list[Tensor | None],
                       text: str, numbers: list[float], needs: list[bool]) -> list[Tensor]:
    diff = [hidden, weight, bias, lora_a, lora_b]
    leaves = _leaves(diff, needs)
    with _eager_dispatch(), torch.enable_grad():
        outputs, _ = _run(leaves, others, text, numbers)
        names = _names(_decode(text, tuple(numbers)), "outputs")
        pairs = [(outputs[k], g) for k, g in zip(names, grad_outputs, strict=True)
                 if g is not None and outputs[k].requires_grad]
        grads = _grads([o for o, _ in pairs], leaves, [g for _, g in pairs])
    return _unaliased(grads, [*diff, *others, *grad_outputs])


@_stats_backward_op.register_fake
def _(hidden, weight, bias, lora_a, lora_b, others, grad_outputs, text, numbers, needs):
    return _empty_grads([hidden, weight, bias, lora_a, lora_b], needs)
