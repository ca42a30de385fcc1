"""``Head``: everything that defines the logits of a pass, as one frozen value.

The logits are ``z = transform(hidden @ weight.T + bias + lora term)`` over the vocabulary rows
``weight`` holds (the local shard of a vocabulary-parallel head). A :class:`Head` travels
unchanged from the public entry points to the backends; :meth:`Head.local` resolves the shard
once per call into the :class:`LocalHead` the engine and backends index.

Vocabulary (tensor) parallelism and padded vocabularies (:class:`VocabShard`): each rank holds
rows ``[vocab_start, vocab_start + V_local)`` of the head. A pass computes per-token partial
statistics over its rows, then one all-reduce MAX (the running max) and one all-reduce SUM of a
stacked tensor (``Σ exp``, ``Σ exp·z``, the owner's target logit, ``Σ z``) make them global
(Megatron-style vocab-parallel cross-entropy). Backward: each rank writes ``dz`` for its rows;
``d hidden`` partials are summed over the group unless the caller's framework reduces them itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..distributed import is_active
from .lora import HeadLoRA, LowRank
from .transform import LogitTransform


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows a ``weight [V_local, H]`` holds.

    Attributes:
        group: ``torch.distributed`` process group the vocabulary is split over (``None``: the
            whole vocabulary is local).
        vocab_start: global index of the first local row (default ``rank * V_local``: even
            shards; give it for uneven ones).
        vocab_size: true vocabulary size; rows at or beyond it are padding and get no
            probability (default: ``world * V_local``, i.e. no padding).
        reduce_grad_hidden: all-reduce the ``d hidden`` partials over ``group`` (set False when
            your framework reduces the input gradient of the head itself, e.g. Megatron's
            ``copy_to_tensor_model_parallel_region``).
    """

    group: object | None = None
    vocab_start: int | None = None
    vocab_size: int | None = None
    reduce_grad_hidden: bool = True

    def resolve(self, local_rows: int) -> tuple[int, int, int]:
        """``(vocab_start, vocab_size, valid local rows)``.

        Raises:
            ValueError: a start/size inconsistent with the local rows.
        """
        world, rank = 1, 0
        parallel = is_active(self.group)
        if parallel:
            import torch.distributed as dist

            world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        start = rank * local_rows if self.vocab_start is None else int(self.vocab_start)
        size = world * local_rows if self.vocab_size is None else int(self.vocab_size)
        if start < 0 or size <= 0:
            raise ValueError(f"VocabShard: vocab_start={start} and vocab_size={size} must be >= 0 and > 0")
        if not parallel and start != 0:
            raise ValueError("VocabShard: vocab_start must be 0 without a vocabulary-parallel group")
        valid = max(0, min(local_rows, size - start))
        return start, size, valid


_IDENTITY = LogitTransform()  # frozen: one serves every head without a transform of its own


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    return f"[{', '.join(map(str, t.shape))}] {str(t.dtype).removeprefix('torch.')} {t.device}"


@dataclass(frozen=True, repr=False)
class Head:
    """The output head of a language model as the vocabulary pass sees it.

    Attributes:
        weight: ``[V, H]`` head weight (the local rows of a vocabulary-parallel head), fp16/bf16/
            fp32/fp64, same dtype and device as the hidden states.
        bias: ``[V]`` or ``None``.
        transform: :class:`LogitTransform` (temperature, logit scale, soft-cap) applied to the
            matmul output; ``None`` (the default) is the identity ``LogitTransform()``.
        lora: :class:`HeadLoRA` adapter on the head, added inside every vocabulary block (no
            merged weight), or ``None``.
        shard: :class:`VocabShard` for a vocabulary-parallel or padded head, or ``None``.

    A plain ``weight`` tensor wherever a ``Head`` is accepted means ``Head(weight)``. A ``Head``
    is checked where it is used, with the hidden states (the entry points'
    :class:`TypeError`/:class:`ValueError`: a part of the wrong type, dtypes, shapes or devices that
    do not fit, NaN/inf values; :func:`logitless.ops.validate.check_head_inputs`).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    transform: LogitTransform = None  # type: ignore[assignment]  # the identity: see __post_init__
    lora: HeadLoRA | None = None
    shard: VocabShard | None = None

    def __post_init__(self) -> None:
        # None (the default) is the identity, one shared instance. Neither a default_factory nor an
        # instance as the default: dynamo can call neither, and Head(weight) inside
        # torch.compile(fullgraph=True) would fail.
        if self.transform is None:
            object.__setattr__(self, "transform", _IDENTITY)

    def __repr__(self) -> str:
        lora = "None" if self.lora is None else f"HeadLoRA(r={self.lora.a.shape[0]}, scaling={self.lora.scaling})"
        return (f"Head(weight={_describe(self.weight)}, bias={_describe(self.bias)}, transform={self.transform}, "
                f"lora={lora}, shard={self.shard})")

    def at_temperature(self, temperature: float) -> Head:
        """This head with the sampling ``temperature`` in its transform (scale and cap kept)."""
        return dataclasses.replace(self, transform=dataclasses.replace(self.transform, temperature=temperature))

    def vocab_size(self) -> int:
        """The full vocabulary's size: global token ids lie in ``[0, vocab_size)``.

        Raises:
            ValueError: a shard inconsistent with ``weight``'s rows.
        """
        return self.weight.shape[0] if self.shard is None else self.shard.resolve(self.weight.shape[0])[1]

    def local(self) -> LocalHead:
        """The rows that take part in the softmax and where they sit in the global vocabulary.

        Raises:
            ValueError: a shard inconsistent with ``weight``'s rows.
        """
        rows = self.weight.shape[0]
        if self.shard is None and rows:  # the whole vocabulary, in this process: nothing to resolve
            return LocalHead(weight=self.weight, bias=self.bias, transform=self.transform, group=None, vocab_start=0,
                             vocab_size=rows, reduce_grad_hidden=True)
        shard = VocabShard() if self.shard is None else self.shard
        start, size, valid = shard.resolve(self.weight.shape[0])
        return LocalHead(weight=self.weight[:valid], bias=None if self.bias is None else self.bias[:valid],
                         transform=self.transform, group=shard.group, vocab_start=start, vocab_size=size,
                         reduce_grad_hidden=shard.reduce_grad_hidden, parallel=is_active(shard.group))


def as_head(head: Head | torch.Tensor) -> Head:
    """``head`` itself, or ``Head(head)`` for a bare weight tensor.

    Raises:
        TypeError: neither a :class:`Head` nor a tensor.
    """
    if isinstance(head, Head):
        return head
    if isinstance(head, torch.Tensor):
        return Head(head)
    raise TypeError(f"head must be a logitless.Head or a [V, H] weight tensor, got {type(head).__name__}")


@dataclass(frozen=True)
class LocalHead:
    """A :class:`Head` resolved for one pass: the valid local rows and the shard's layout.

    Attributes:
        weight, bias: the local rows that take part in the softmax (padding rows cut off).
        transform: the head's :class:`LogitTransform`.
        group: vocabulary-parallel process group, or ``None``.
        vocab_start: global index of the first local row.
        vocab_size: the full vocabulary's size.
        reduce_grad_hidden: sum the ``d hidden`` partials over ``group`` (when ``parallel``).
        parallel: ``group`` spans more than this process: the partial statistics are reduced
            over it.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    transform: LogitTransform
    group: object | None
    vocab_start: int
    vocab_size: int
    reduce_grad_hidden: bool
    parallel: bool = False

    def rows_of(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LocalHead:
        """This head over ``weight``/``bias`` (e.g. the tensors autograd saved): the same rows."""
        rows = self.weight.shape[0]
        return dataclasses.replace(self, weight=weight[:rows], bias=None if bias is None else bias[:rows])

    def low_rank(self, x: torch.Tensor | None, b: torch.Tensor | None) -> LowRank | None:
        """An adapter's factors over this head's rows (``b`` cut like ``weight``), or ``None``."""
        return None if x is None else LowRank(x, b[:self.weight.shape[0]])

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Global ids → local rows; ids owned by another rank fall outside ``[0, V_local)``."""
        return targets - self.vocab_start if self.vocab_start else targets
