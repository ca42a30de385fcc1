"""The contract of the vocabulary pass: the head that defines the logits, what the engine and the
backends exchange, and the one place that picks a backend.

A :class:`Head` is everything that defines the logits of a pass, as one frozen value: the logits
are ``z = transform(hidden @ weight.T + bias + lora term)`` over the vocabulary rows ``weight``
holds (the local shard of a vocabulary-parallel head). It travels unchanged from the public entry
points to the engine; :meth:`Head.local` resolves the shard once per call into the
:class:`LocalHead` the engine and backends index.

Vocabulary (tensor) parallelism and padded vocabularies (:class:`VocabShard`): each rank holds
rows ``[vocab_start, vocab_start + V_local)`` of the head. A pass computes per-token partial
statistics over its rows, then one all-reduce MAX (the running max) and one all-reduce SUM of a
stacked tensor (``Σ exp``, ``Σ exp·z``, the owner's target logit, ``Σ z``, ``Σ exp²``) make them global
(Megatron-style vocab-parallel cross-entropy). Backward: each rank writes ``dz`` for its rows;
``d hidden`` partials are summed over the group unless the caller's framework reduces them itself.

A backend computes, for one chunk of tokens against a :class:`LocalHead`:

* ``chunk_forward(head, rows, plan, want, keep_logits) -> (RowStats, kept)``: the chunk's
  partial statistics over the local vocabulary rows (an online log-sum-exp), and optionally
  an opaque handle on the chunk's logits for the backward (``None`` when not kept);
* ``chunk_backward(head, rows, plan, saved, grads, acc, kept) -> d hidden``: from the
  per-token gradients of the statistics, ``d hidden`` of the chunk (``[n, H]`` in the
  statistics dtype, or ``None``), and in place ``d weight``/``d bias``/adapter gradients;
* ``kept_rows(kept, idx) -> kept``: the kept logits restricted to the rows ``idx`` of the chunk,
  for a backward that leaves out rows without a gradient (:mod:`logitless.ops.engine`).

With ``p = softmax(z)`` and ``sum_pz = Σ p z``, the gradient w.r.t. the logits is
``dz_v = p_v (g_lse - g_logp - g_entropy (z_v - sum_pz)) + g_logp [v == y] + g_sum_z``, then the
chain rule through the head's :class:`~logitless.ops.transform.LogitTransform`.

Backends: :mod:`.torch_backend` (the specification; CPU and any GPU), :mod:`.triton_backend`
(cuBLAS GEMMs around Triton row kernels), :mod:`.flash_backend` (Triton tile GEMMs, logits never
in memory), :mod:`.gemm_backend` (statistics in a Triton GEMM's epilogue, 2-byte kept logits),
:mod:`.cute_backend` (that design's statistics GEMM in CUTLASS's CuTe DSL; Hopper, where the
DSL is installed).
:func:`resolve_backend` makes every choice between them, delegations included.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from ..distributed import all_reduce, is_active
from .lora import HeadLoRA, LowRank
from .transform import LogitTransform

if TYPE_CHECKING:  # the plan module builds this contract's Accumulators
    from .plan import ChunkPlan, Impl, PlanKind


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
        return (
            f"Head(weight={_describe(self.weight)}, bias={_describe(self.bias)}, transform={self.transform}, "
            f"lora={lora}, shard={self.shard})"
        )

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
            return LocalHead(
                weight=self.weight,
                bias=self.bias,
                transform=self.transform,
                group=None,
                vocab_start=0,
                vocab_size=rows,
                reduce_grad_hidden=True,
            )
        shard = VocabShard() if self.shard is None else self.shard
        start, size, valid = shard.resolve(self.weight.shape[0])
        return LocalHead(
            weight=self.weight[:valid],
            bias=None if self.bias is None else self.bias[:valid],
            transform=self.transform,
            group=shard.group,
            vocab_start=start,
            vocab_size=size,
            reduce_grad_hidden=shard.reduce_grad_hidden,
            parallel=is_active(shard.group),
        )


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
        return None if x is None else LowRank(x, b[: self.weight.shape[0]])

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Global ids → local rows; ids owned by another rank fall outside ``[0, V_local)``."""
        return targets - self.vocab_start if self.vocab_start else targets


class StatRequest(NamedTuple):
    """Statistics a pass accumulates beyond ``lse``/``logp``/top-1: ``entropy`` (``Σ p z``),
    ``sum_z`` (``Σ_v z_v``, the mean logit times ``V``) and ``sum_sq`` (``log Σ_v p_v²``, WPO's
    weight; only backends whose :attr:`Capabilities.sum_sq` is set compute it).

    ``logp_grad_only``: the objective's gradient reaches the logits through ``logp`` alone (no
    gradient of ``lse``, ``entropy`` or ``sum_z``; every policy-gradient loss without an entropy
    bonus). A backend may then keep a fused chunk's logits in a form only that gradient can use
    (:mod:`logitless.ops.triton_shared.prob_tile`), and raises ``RuntimeError`` if another
    gradient comes."""

    entropy: bool = True
    sum_z: bool = False
    sum_sq: bool = False
    logp_grad_only: bool = False


class ChunkRows(NamedTuple):
    """The token side of a chunk: ``hidden [n, H]``, ``targets [n]`` int64 indices local to the
    head (outside ``[0, V_local)``: owned by another rank), the adapter's ``low`` factors."""

    hidden: torch.Tensor
    targets: torch.Tensor
    low: LowRank | None = None


class ChunkStats(NamedTuple):
    """Per-token statistics of the head's softmax for a set of tokens (``[n]`` each, fp32 — fp64
    for fp64 inputs — nats): what an objective sees.

    ``logp`` (of the target), ``lse`` (log-partition), ``entropy`` (``None`` unless requested)
    and ``sum_z`` (``Σ_v z_v``, ``None`` unless requested) are differentiable inside an
    objective; ``is_top1`` (bool: the target's logit is the largest, ties count) and
    ``log_sum_sq_probs`` (``log Σ_v p_v²``, ``None`` unless requested with
    ``StatRequest(sum_sq=True)``; TRL's name and definition, ``trl/kernels/chunked_logprob.py``,
    where it is non-differentiable too: WPO's weights take no gradient) are not.
    """

    logp: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    sum_z: torch.Tensor | None
    is_top1: torch.Tensor
    log_sum_sq_probs: torch.Tensor | None = None

    def detached(self) -> ChunkStats:
        return ChunkStats(*(None if t is None else t.detach() for t in self))


@dataclass
class RowStats:
    """Per-token partial statistics of a vocabulary range (``[n]`` each, statistics dtype).

    Attributes:
        max_logit: running maximum logit.
        sum_exp: ``Σ exp(z - max_logit)``.
        sum_exp_logit: ``Σ exp(z - max_logit) · z`` (``None`` unless entropy is wanted).
        target_logit: the target's logit where ``owned``, else 0.
        owned: the target lies in this range.
        sum_logit: ``Σ z`` (``None`` unless asked for).
        sum_exp_sq: ``Σ exp(2 (z - max_logit))`` (``None`` unless ``sum_sq`` is asked for).
    """

    max_logit: torch.Tensor
    sum_exp: torch.Tensor
    sum_exp_logit: torch.Tensor | None
    target_logit: torch.Tensor
    owned: torch.Tensor
    sum_logit: torch.Tensor | None = None
    sum_exp_sq: torch.Tensor | None = None

    _FIELDS = ("max_logit", "sum_exp", "sum_exp_logit", "target_logit", "owned", "sum_logit", "sum_exp_sq")

    @classmethod
    def start(
        cls, n: int, dtype: torch.dtype, device: torch.device, want: StatRequest, owned: torch.Tensor
    ) -> RowStats:
        """The statistics of an empty range (max ``-inf``, sums 0), to fold blocks into."""

        def zeros(flag: bool = True) -> torch.Tensor | None:
            return torch.zeros((n,), dtype=dtype, device=device) if flag else None

        return cls(
            max_logit=torch.full((n,), -torch.inf, dtype=dtype, device=device),
            sum_exp=zeros(),
            sum_exp_logit=zeros(want.entropy),
            target_logit=zeros(),
            owned=owned,
            sum_logit=zeros(want.sum_z),
            sum_exp_sq=zeros(want.sum_sq),
        )

    @classmethod
    def empty(cls, n: int, dtype: torch.dtype, device: torch.device, want: StatRequest) -> RowStats:
        """Uninitialized ``[n]`` buffers, filled chunk by chunk with :meth:`write`."""

        def new(flag: bool = True, dt: torch.dtype = dtype) -> torch.Tensor | None:
            return torch.empty(n, dtype=dt, device=device) if flag else None

        return cls(
            max_logit=new(),
            sum_exp=new(),
            sum_exp_logit=new(want.entropy),
            target_logit=new(),
            owned=new(dt=torch.bool),
            sum_logit=new(want.sum_z),
            sum_exp_sq=new(want.sum_sq),
        )

    @classmethod
    def combine(cls, parts: dict[str, torch.Tensor], owned: torch.Tensor) -> RowStats:
        """Merge ``[parts, n]`` partials of disjoint vocabulary ranges into ``[n]``:
        ``max_logit = max_s m_s``, ``sum_exp = Σ_s se_s e^(m_s - max_logit)`` (likewise ``sez``),
        the target logit ``zy`` and ``Σ z`` (``sz``) summed (``zy`` is nonzero in at most one
        range), ``sum_exp_sq = Σ_s ssq_s e^(2 (m_s - max_logit))``. Keys ``m``, ``se``, ``zy`` and
        optionally ``sez``, ``sz``, ``ssq``."""
        m_s = parts["m"]
        m = m_s.max(dim=0).values
        weight = torch.exp(m_s - m)  # a range that is empty has m_s = -inf: weight 0
        return cls(
            max_logit=m,
            sum_exp=(parts["se"] * weight).sum(dim=0),
            sum_exp_logit=(parts["sez"] * weight).sum(dim=0) if "sez" in parts else None,
            target_logit=parts["zy"].sum(dim=0),
            owned=owned,
            sum_logit=parts["sz"].sum(dim=0) if "sz" in parts else None,
            sum_exp_sq=(parts["ssq"] * weight.square()).sum(dim=0) if "ssq" in parts else None,
        )

    def write(self, sl: slice, part: RowStats) -> None:
        """Copy a chunk's statistics into rows ``sl``."""
        for name in self._FIELDS:
            dst = getattr(self, name)
            if dst is not None:
                dst[sl] = getattr(part, name)

    def reduce(self, group) -> RowStats:
        """Every rank's partials combined into the full vocabulary's (one MAX, one SUM
        all-reduce over the vocabulary-parallel ``group``); ``self`` without a group."""
        if not is_active(group):
            return self
        m = all_reduce(self.max_logit, "max", group)
        scale = torch.exp(self.max_logit - m)  # 0 for a rank with no rows (max_logit = -inf)
        # The optional sums present, rescaled to the global max as Σ exp (Σ exp² by the scale squared).
        optional = {name: x * factor for name, x, factor in (("sum_exp_logit", self.sum_exp_logit, scale),
                                                             ("sum_logit", self.sum_logit, 1),
                                                             ("sum_exp_sq", self.sum_exp_sq, scale.square()))
                    if x is not None}
        parts = [self.sum_exp * scale, torch.where(self.owned, self.target_logit, torch.zeros_like(m)),
                 *optional.values()]
        total = all_reduce(torch.stack(parts), "sum", group)
        reduced = dict(zip(optional, total[2:], strict=True))
        return RowStats(
            max_logit=m,
            sum_exp=total[0],
            target_logit=total[1],
            sum_exp_logit=reduced.get("sum_exp_logit"),
            sum_logit=reduced.get("sum_logit"),
            sum_exp_sq=reduced.get("sum_exp_sq"),
            owned=torch.ones_like(self.owned),
        )

    def finalize(self) -> tuple[ChunkStats, SavedStats]:
        """The full vocabulary's statistics (after :meth:`reduce`), and what a backward needs of them."""
        lse = self.max_logit + torch.log(self.sum_exp)
        sum_pz = None if self.sum_exp_logit is None else self.sum_exp_logit / self.sum_exp
        entropy = None if sum_pz is None else lse - sum_pz
        # Both sums share max_logit: log Σ p² = log Σ e^(2 (z - m)) - 2 log Σ e^(z - m).
        log_sum_sq = None if self.sum_exp_sq is None else torch.log(self.sum_exp_sq) - 2 * torch.log(self.sum_exp)
        stats = ChunkStats(
            logp=self.target_logit - lse,
            lse=lse,
            entropy=entropy,
            sum_z=self.sum_logit,
            is_top1=self.target_logit >= self.max_logit,
            log_sum_sq_probs=log_sum_sq,
        )
        return stats, SavedStats(lse, sum_pz)


class SavedStats(NamedTuple):
    """What the backward of a chunk needs from its forward: ``lse`` and ``sum_pz`` (``[n]``;
    ``sum_pz`` needed iff the entropy has a gradient)."""

    lse: torch.Tensor
    sum_pz: torch.Tensor | None


class StatGrads(NamedTuple):
    """Per-token gradients of the loss w.r.t. the statistics (``[n]``, ``None`` = zero)."""

    logp: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    sum_z: torch.Tensor | None = None

    def any(self) -> bool:
        return any(g is not None for g in self)

    def rows(self, sl: slice) -> StatGrads:
        return StatGrads(*(None if g is None else g[sl] for g in self))


class RowCoefficients(NamedTuple):
    """The per-token inputs of the Triton gradient kernels, fp32 and contiguous:
    ``coef = g_lse - g_logp`` (zeros for absent gradients); ``sum_pz`` only with ``g_entropy``."""

    lse: torch.Tensor
    sum_pz: torch.Tensor | None
    coef: torch.Tensor
    g_logp: torch.Tensor | None
    g_entropy: torch.Tensor | None
    g_sum_z: torch.Tensor | None

    @classmethod
    def make(cls, saved: SavedStats, grads: StatGrads) -> RowCoefficients:
        """Raises:
        ValueError: ``grads.entropy`` given without ``saved.sum_pz``."""
        if grads.entropy is not None and saved.sum_pz is None:
            raise ValueError("chunk_backward: an entropy gradient needs sum_pz from a forward that computed entropy")

        def f32(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(torch.float32).contiguous()

        lse = f32(saved.lse)
        coef = torch.zeros_like(lse)
        if grads.lse is not None:
            coef += grads.lse
        if grads.logp is not None:
            coef -= grads.logp
        return cls(
            lse=lse,
            sum_pz=None if grads.entropy is None else f32(saved.sum_pz),
            coef=coef,
            g_logp=f32(grads.logp),
            g_entropy=f32(grads.entropy),
            g_sum_z=f32(grads.sum_z),
        )


@dataclass
class Accumulators:
    """Gradient outputs of a chunk's backward, updated in place (``None``: not needed).

    Attributes:
        weight: ``[V_local, H]`` fp32/fp64 ``d weight`` of the local rows.
        bias: ``[V_local]`` ``d bias``.
        lora_x: ``[n, r]`` ``d x`` of the chunk's adapter rows.
        lora_b: ``[V_local, r]`` ``d b``.
        hidden: whether ``d hidden`` is returned.
        write_weight: this chunk's products are stored into ``weight`` (uninitialized before the
            first chunk; fp32, or the head's dtype for a pass of one chunk), not added (only
            backends whose pass kind sets ``stores_weight_grad`` see it).
        weight_lo: ``[V_local, H]`` int8, or ``None``. Given (only to pass kinds that set
            ``pairs_weight_grad``), ``d weight`` is the pair of ``weight`` (bf16, the nearest to
            the sum so far) and ``weight_lo``, the residual in units of a power of two that
            ``weight``'s exponent sets (:mod:`logitless.ops.triton_shared.weight_grad`).
        last_weight: no later chunk adds to ``weight``: a pair's residual need not be stored
            (``weight`` is then the result).
    """

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    lora_x: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    hidden: bool = False
    write_weight: bool = False
    weight_lo: torch.Tensor | None = None
    last_weight: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do: the engine and :func:`resolve_backend` read these, never a name.

    Attributes:
        dtypes: the input dtypes it runs (others go to the Triton backend, fp64 to torch).
        lora: it computes a head adapter's low-rank term.
        stores_weight_grad: its backward honours :attr:`Accumulators.write_weight` (stores the
            first chunk's ``d weight`` products instead of adding them to zeros).
        pairs_weight_grad: its backward honours :attr:`Accumulators.weight_lo` (a bf16 result and int8 residual).
        distill: its package holds a ``distill`` module that runs the two-head distillation pass
            (:class:`~logitless.ops.distill_contract.DistillBackend`); without one, distillation
            runs the torch backend's (:func:`~logitless.ops.distill_contract.resolve_distill`).
        sum_sq: its forward computes ``Σ exp(2 (z - max))`` (:attr:`StatRequest.sum_sq`, WPO's
            ``log Σ p²``); :func:`resolve_backend` refuses a request for it on a backend without.
        starts_early: its module has ``start_rows`` (which may continue an earlier launch's rows,
            ``after``) and ``START_ALIGN``, and its statistics GEMM may run on inputs
            whose values are not checked yet: it reads the targets only by comparison and
            writes only its own buffers, so no value can make it fault
            (:func:`~logitless.ops.engine.start_pass`).
        unchecked_values: every kernel of its passes, the gradient kernels included, may run on
            inputs whose values are not checked yet, for the same reasons (a ``d logits`` kernel
            finds the target's column by comparison), so a caller may read its value checks
            after the pass (:func:`defers_checks`).
    """

    dtypes: tuple[torch.dtype, ...]
    lora: bool
    stores_weight_grad: bool = False
    pairs_weight_grad: bool = False
    distill: bool = False
    sum_sq: bool = False
    starts_early: bool = False
    unchecked_values: bool = False


class StartedRows(NamedTuple):
    """A statistics GEMM of a pass's first ``rows`` rows, launched before the caller's value
    checks were read (:func:`~logitless.ops.engine.start_pass`); the first chunk's forward
    launches only its other rows and joins these (a backend's ``chunk_forward(started=...)``).

    Attributes:
        rows: how many rows it covers.
        parts: the backend's per-tile partials of those rows (``{name: [tiles, rows]}``; ``zy``
            ``[1, rows]``).
        z: the first chunk's fp16 logits buffer (``[rows', V]``, ``rows' >= rows``: the most rows
            the first chunk can have), its first ``rows`` rows written, or ``None`` (launched
            without storing).
        backend: the backend's ``NAME``; want, fp32_logits: what it was launched with.
    """

    rows: int
    parts: dict[str, torch.Tensor]
    z: torch.Tensor | None
    backend: str
    want: StatRequest
    fp32_logits: bool


class Started:
    """A :class:`StartedRows` on its way to the pass that joins it, handed over once:
    :meth:`take` returns it and forgets it, so its buffers (the first chunk's logits) live no
    longer than that chunk, whoever else holds this handle."""

    __slots__ = ("_rows",)

    def __init__(self, rows: StartedRows) -> None:
        self._rows: StartedRows | None = rows

    def take(self) -> StartedRows | None:
        rows, self._rows = self._rows, None
        return rows

    @property
    def rows(self) -> int:
        """How many rows it covers (0 once taken)."""
        return 0 if self._rows is None else self._rows.rows


class Backend(Protocol):
    """What every backend module provides (see the module docstring)."""

    NAME: str  # for reports; never tested
    PLAN: PlanKind  # whose block-size heuristic the pass uses (:class:`ChunkPlan`)
    CAPS: Capabilities

    def kept_rows(self, kept: object, idx: torch.Tensor) -> object:
        """The kept logits of ``chunk_forward`` restricted to the rows ``idx`` (``[m]`` int64,
        ascending), for a ``chunk_backward`` of those rows; may reuse (and overwrite) ``kept``."""
        ...

    def chunk_forward(
        self, head: LocalHead, rows: ChunkRows, plan: ChunkPlan, want: StatRequest, keep_logits: bool
    ) -> tuple[RowStats, object | None]: ...

    def chunk_backward(
        self,
        head: LocalHead,
        rows: ChunkRows,
        plan: ChunkPlan,
        saved: SavedStats,
        grads: StatGrads,
        acc: Accumulators,
        kept: object | None,
    ) -> torch.Tensor | None: ...


def compact_rows_(tile: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Move the rows ``idx`` (``[m]`` int64, ascending) of ``tile`` to its first ``m`` rows, in
    place, and return ``tile[:m]``.

    In place is safe block by block in ascending order: row ``i`` receives row ``idx[i] >= i``,
    so a block reads only rows at or after its own first row, which no earlier block wrote, and
    it gathers its rows before it writes them. Blocks of at most 128 MiB bound the temporary.
    """
    m = idx.numel()
    step = max(1, 2**27 // max(1, tile[0].numel() * tile.element_size())) if m else 1
    for start in range(0, m, step):
        stop = min(start + step, m)
        tile[start:stop] = tile.index_select(0, idx[start:stop])
    return tile[:m]


def triton_available() -> bool:
    """Whether Triton imports (it runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


def defers_checks(impl: Impl, hidden: torch.Tensor, has_lora: bool, want: StatRequest) -> bool:
    """Whether a call over ``hidden`` may read its value checks after queueing its pass
    (:class:`~logitless.ops.validate.ValueChecks`: :meth:`~.ValueChecks.queue`, then
    :meth:`~.ValueChecks.read`): where the backend :func:`resolve_backend` picks may run every
    kernel of its passes on values not checked yet (:attr:`Capabilities.unchecked_values`)."""
    return resolve_backend(impl, hidden, has_lora, want).CAPS.unchecked_values


def resolve_backend(impl: Impl, hidden: torch.Tensor, has_lora: bool = False,
                    want: StatRequest | None = None) -> Backend:
    """The backend module that runs a pass over ``hidden`` (its device and dtype).

    ``"auto"`` on CUDA with Triton: on Hopper (sm90) the CuTe DSL backend where CUTLASS's CuTe
    DSL imports (``pip install 'logitless[cute]'``; its statistics GEMM is as fast or faster:
    ``BENCHMARKS.md``; each kernel variant compiles once per process, about 2 s), else the
    GEMM-epilogue backend, which also runs on later GPUs (its kernels read through the copy
    engine; measured faster and, for gradients, more accurate than the Triton backend:
    ``benchmarks/NOTES-h100.md``); the Triton backend on older GPUs; without CUDA or Triton, the
    torch backend. fp64 inputs always run on the torch backend (no fp64 tensor-core GEMMs to
    gain from); a head adapter under ``"flash"``/``"gemm"``/``"cute"`` runs on the Triton backend
    (those kernels have no low-rank term), as do fp32 inputs under ``"gemm"``/``"cute"`` (their
    GEMMs are written for 16-bit tensor-core operands). A ``want`` with ``sum_sq`` needs a backend
    whose :attr:`Capabilities.sum_sq` is set: ``"auto"`` then takes the Triton backend where it
    would take one without.

    Raises:
        ValueError: unknown ``impl``; ``"triton"``/``"flash"``/``"gemm"``/``"cute"`` where Triton cannot
            run; ``"cute"`` without the CuTe DSL or off a Hopper GPU; ``want.sum_sq`` on a named
            backend that does not compute it.
    """
    if impl not in ("auto", "torch", "triton", "flash", "gemm", "cute"):
        raise ValueError(f"impl must be 'auto', 'torch', 'triton', 'flash', 'gemm' or 'cute', got {impl!r}")
    if impl == "cute":
        _check_cute(hidden)
    auto = impl == "auto"
    if auto:
        impl = auto_impl(hidden.device)
    if impl != "torch":
        if not triton_available():
            raise ValueError(f"impl={impl!r} requested but triton is not installed (pip install 'logitless[triton]')")
        if hidden.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"impl={impl!r} needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {hidden.device}")
    if impl == "torch" or hidden.dtype == torch.float64:
        backend = _module("torch")
    else:
        backend = _module(impl)
        if hidden.dtype not in backend.CAPS.dtypes or (has_lora and not backend.CAPS.lora):
            backend = _module("triton")
    if want is not None and want.sum_sq and not backend.CAPS.sum_sq:
        if not auto:
            raise ValueError(f"impl={impl!r}: the {backend.NAME} backend does not compute log_sum_sq_probs "
                             "(StatRequest(sum_sq=True), WPO's use_weighting); use impl='auto', 'triton' or 'torch'")
        backend = _module("triton")
    return backend


def auto_impl(device: torch.device) -> str:
    """The backend ``impl="auto"`` names on ``device`` (before the dtype and adapter delegations
    of :func:`resolve_backend`)."""
    if device.type != "cuda" or not triton_available():
        return "torch"
    if _capability(device) < (9, 0):
        return "triton"
    return "cute" if cute_runs_on(device) else "gemm"


@functools.cache
def cute_available() -> bool:
    """Whether CUTLASS's CuTe DSL imports (``pip install 'logitless[cute]'``); nothing is imported.
    Asked once per process: the search of the import path is host time on every call's path to
    its first GEMM."""
    return importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cuda") is not None


def device_properties(device: torch.device):
    """A CUDA device's properties (``torch.cuda.get_device_properties``), asked of the driver once
    per device: a query is host time on every call's path to its first GEMM."""
    return _properties(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _capability(device: torch.device) -> tuple[int, int]:
    props = device_properties(device)
    return props.major, props.minor


def _on_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device) == (9, 0)


def cute_runs_on(device: torch.device) -> bool:
    """Whether ``impl="cute"`` can run on ``device``: the CuTe DSL imports and it is an sm90 GPU."""
    return cute_available() and _on_hopper(device)


def _check_cute(hidden: torch.Tensor) -> None:
    if not cute_available():
        raise ValueError(
            "impl='cute' needs CUTLASS's CuTe DSL: pip install 'logitless[cute]' (or impl='gemm', the "
            "same design in Triton)"
        )
    if not _on_hopper(hidden.device):
        where = hidden.device if hidden.device.type != "cuda" else torch.cuda.get_device_name(hidden.device)
        raise ValueError(f"impl='cute' runs on Hopper GPUs (sm90: H100, H200), got {where}; use impl='gemm' or 'auto'")


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}_backend.backend")
