"""Token layout: the objectives work on a flat list of the tokens that count.

Padded ``[B, T]`` inputs and packed ``[N]`` inputs with segment ids both become a flat,
segment-sorted list of the ``n`` tokens whose mask is non-zero, with a segment index per
token. Sequence-level quantities are segment sums (``index_add``), so padded and packed
inputs give the same numbers, and masked-out tokens never reach the vocabulary pass.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..distributed import all_reduce, all_reduce_sum_autograd, is_active


def counted_rows(x: torch.Tensor, lead_dims: int, index: torch.Tensor, complete: bool) -> torch.Tensor:
    """Rows ``index`` of ``x [*lead, ...]`` flattened over its ``lead_dims`` leading dimensions →
    ``[len(index), ...]``; when every position counts (``complete``), the flattened view itself:
    no copy, and no scatter of its gradient."""
    flat = x.reshape(-1, *x.shape[lead_dims:])
    return flat if complete else flat[index]


def counted_first_order(counted: torch.Tensor, lead: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position of a bool ``counted`` (any shape, flattened), the counted ones first, each
    part in position order (a stable partition, int64 ``[N]``), and how many count (a 0-dim device
    tensor), with no host read: a caller reads the count with its value checks, and the first
    ``count`` positions are then those ``counted.nonzero()`` would give.

    ``lead``: bool broadcastable to ``counted`` (a ``[B, T]`` mask's ``[B, T]`` or ``[B, 1]``),
    counted positions to put before the other counted ones, each part still in position order (a
    policy loss's tokens that may have a gradient, so that a pass can run its gradient GEMMs on
    its first rows only)."""
    # A stable sort keeps each part in position order; one op where a cumsum-and-scatter
    # partition takes seven, each a host-side launch before the first GEMM.
    key = counted.view(torch.uint8)
    if lead is not None:  # 2 (counted, leading), 1 (counted), 0
        key = torch.addcmul(key, key, lead.view(torch.uint8))
    return torch.sort(key.reshape(-1), descending=True, stable=True).indices, counted.sum()


@dataclass
class TokenLayout:
    """Where the counted tokens sit in the caller's layout.

    Attributes:
        index: ``[n]`` positions of the counted tokens in the flattened caller tensor.
        seg: ``[n]`` segment (sequence) index of each counted token, non-decreasing (except in a
            :meth:`counted_first` layout with leading tokens).
        num_segments: ``S``, the number of sequences (empty ones included).
        weight: ``[n]`` the mask value of each counted token (1 for a binary mask).
        seg_len: ``[S]`` sum of mask values per segment (``Σ_t m``).
        shape: the caller's per-token shape (``[B, T]`` or ``[N]``).
        cuts: token positions in ``(0, n]`` where a segment ends (allowed chunk ends for
            objectives that need whole sequences); computed on first use (a host sync).
        group: sequence-parallel process group whose ranks hold pieces of the same segments
            (global segment ids); ``seg_len`` and :meth:`seq_sum` are then over the group.
        distributed: ``group`` spans more than this process.
        permuted: ``index`` is every position in another order (:meth:`counted_first`): gathers
            are copies even though every position is a token.
    """

    index: torch.Tensor
    seg: torch.Tensor
    num_segments: int
    weight: torch.Tensor
    seg_len: torch.Tensor
    shape: torch.Size
    group: object | None = None
    distributed: bool = False
    permuted: bool = False

    @functools.cached_property
    def cuts(self) -> list[int]:
        seg = self.seg
        if not seg.numel():
            return []
        ends = torch.nonzero(seg[1:] != seg[:-1]).squeeze(1) + 1
        return [*ends.tolist(), int(seg.numel())]

    @property
    def n(self) -> int:
        return int(self.index.shape[0])

    @property
    def complete(self) -> bool:
        """Every position counts (``index`` is ``0..n-1``): gathers are views, not copies."""
        return self.n == self.shape.numel() and not self.permuted

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The counted rows of ``x [*shape, ...]`` → ``[n, ...]`` (a view when :attr:`complete`)."""
        return counted_rows(x, len(self.shape), self.index, self.complete)

    def gather(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Per-token tensor in the caller's layout (``shape``) → ``[n]``."""
        if x is None:
            return None
        if tuple(x.shape) != tuple(self.shape):
            raise ValueError(f"expected a per-token tensor of shape {tuple(self.shape)}, got {tuple(x.shape)}")
        return self.rows(x)

    def per_token(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A per-sequence ``[S]`` or per-token (caller shape) tensor → ``[n]`` per token."""
        if x.dim() == 1 and x.shape[0] == self.num_segments and tuple(x.shape) != tuple(self.shape):
            return x[self.seg]
        if tuple(x.shape) == (self.num_segments, 1):
            return x[:, 0][self.seg]
        if tuple(x.shape) == tuple(self.shape):
            return self.rows(x)
        raise ValueError(f"{name} must be [{self.num_segments}] (per sequence) or {list(self.shape)} "
                         f"(per token), got {list(x.shape)}")

    def seg_sum(self, x: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of per-token ``x`` over each segment's tokens on this rank → ``[S]``."""
        seg = self.seg if seg is None else seg
        return x.new_zeros(self.num_segments).index_add(0, seg, x)

    def seq_sum(self, x: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over each whole segment, across the sequence-parallel group (differentiable)."""
        return all_reduce_sum_autograd(self.seg_sum(x, seg), self.group)

    @classmethod
    def counted_first(cls, mask: torch.Tensor, index: torch.Tensor) -> TokenLayout:
        """Every position of a ``[B, T]`` mask as a token, in the order ``index`` of
        :func:`counted_first_order` (the counted ones, non-zero, first): no host synchronization,
        so a caller launches work on the rows in that order, prepares and checks its per-token
        tensors while the device works, and reads the count with its checks. Uncounted tokens have
        ``weight`` 0 (``seg_len`` is over the counted ones), and ``first(count)`` is the layout of
        the counted positions, its per-token tensors their first ``count`` rows (views). ``seg``
        is non-decreasing over the counted tokens, or within each part of an order with a lead."""
        if mask.dim() != 2:
            raise ValueError(f"completion_mask must be [B, T], got shape {tuple(mask.shape)}")
        b, t = mask.shape
        flat = mask.reshape(-1)
        seg = index // max(t, 1)
        weight = flat[index].to(torch.get_default_dtype() if not flat.is_floating_point() else flat.dtype)
        seg_len = weight.new_zeros(b).index_add(0, seg, weight)
        return cls(index=index, seg=seg, num_segments=b, weight=weight, seg_len=seg_len, shape=mask.shape,
                   permuted=True)

    def first(self, n: int, ends: list[float] | None = None, in_order: bool = True) -> TokenLayout:
        """The layout of this one's first ``n`` tokens (views; the same segments and ``seg_len``).
        ``ends``: the counted tokens up to each segment's end (host numbers, e.g. read with the
        caller's checks), which give :attr:`cuts` without a read of its own. ``in_order``: those
        tokens are in position order (:meth:`counted_first` without a ``lead``, or with all or
        none of the counted tokens leading)."""
        # n = all positions in order is every position: gathers are then views
        out = dataclasses.replace(self, index=self.index[:n], seg=self.seg[:n], weight=self.weight[:n],
                                  permuted=not in_order)
        if ends is not None:  # each non-empty segment's end, as `cuts` finds them
            out.__dict__["cuts"] = [int(e) for i, e in enumerate(ends) if e > (ends[i - 1] if i else 0)]
        return out

    @classmethod
    def from_segments(cls, mask: torch.Tensor, segment_ids: torch.Tensor, group=None) -> TokenLayout:
        """From packed ``[N]`` mask and ``[N]`` non-decreasing segment ids ``0..S-1`` (global ids
        shared by the ranks of a sequence-parallel ``group``)."""
        if mask.dim() != 1 or segment_ids.shape != mask.shape:
            raise ValueError(f"packed inputs need mask [N] and segment_ids [N], got {tuple(mask.shape)} "
                             f"and {tuple(segment_ids.shape)}")
        # One read for the segment count (over the group), the ids' order and the counted tokens.
        ids = segment_ids.long()
        if ids.numel():
            unordered = ((ids[1:] < ids[:-1]).any() | (ids[0] < 0)).long()
            top = torch.stack([ids.max(), unordered])
        else:
            top = ids.new_tensor([-1, 0])
        order, count = counted_first_order(mask != 0)
        top_id, bad, n = torch.cat([all_reduce(top, "max", group), count.reshape(1)]).tolist()
        if bad:
            raise ValueError("segment_ids must be non-negative and non-decreasing (packed sequences)")
        index = order[:n]
        return cls._build(index, ids[index], top_id + 1, mask, mask.shape, group)

    @classmethod
    def _build(cls, index, seg, num, flat_mask, shape, group=None) -> TokenLayout:
        counted = flat_mask if index.shape[0] == flat_mask.numel() else flat_mask[index]
        weight = counted.to(torch.get_default_dtype() if not flat_mask.is_floating_point() else flat_mask.dtype)
        seg_len = weight.new_zeros(num).index_add(0, seg, weight)
        distributed = group is not None and is_active(group)
        if distributed:
            seg_len = all_reduce(seg_len, "sum", group)
        return cls(index=index, seg=seg, num_segments=num, weight=weight, seg_len=seg_len, shape=shape, group=group,
                   distributed=distributed)
