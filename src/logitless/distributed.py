"""Collectives over ``torch.distributed`` process groups (no transport of our own).

``group=None`` everywhere means "this process alone": nothing is communicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_active(group) -> bool:
    """Whether ``group`` spans more than this process."""
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """Out-of-place all-reduce of ``t`` with ``op`` in {"sum", "max", "min"}."""
    if not is_active(group):
        return t
    out = t.clone()
    dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
                    group=group)
    return out


def _single(name: str, old: str):
    """``torch.distributed``'s single-tensor collective ``name``, or its older name ``old``
    (torch 2.13 renamed them and warns on the old names); looked up per call, so a profiler's
    wrapper of either is seen."""
    return getattr(dist, name, None) or getattr(dist, old)


def sum_partials(t: torch.Tensor, dtype: torch.dtype, group) -> torch.Tensor:
    """The sum over ``group`` of every rank's partial sums ``t`` (fp32 or fp64, any shape),
    rounded once to ``dtype``: e.g. ``d hidden`` under a vocabulary split, where each rank holds
    its vocabulary rows' share. ``t`` is overwritten (a buffer of the caller's).

    For a 16-bit ``dtype``, when ``t.numel()`` is a multiple of the world size ``k``, this is a
    reduce-scatter in ``t``'s dtype, each rank's ``1/k`` shard cast to ``dtype``, and an
    all-gather in ``dtype``: 3/4 of an fp32 all-reduce's bytes on the wire, and a cast of ``1/k``
    of the elements instead of all of them. Each element is still the fp32 sum of the ``k``
    partials rounded once, as in all-reduce-then-cast, and equal to it bit for bit wherever the
    two collectives add the partials in the same order (always for ``k = 2``; an all-reduce
    that adds in another order, e.g. NCCL's tree, may differ by the fp32 sum's last bit before
    the rounding). Summing 16-bit partials instead (a 16-bit all-reduce, half the bytes) would
    round every partial and every step of the sum. Otherwise (fp32/fp64 ``dtype``, or a size
    that does not split evenly) an all-reduce in place, then the cast.

    Returns:
        A tensor of ``t``'s shape in ``dtype`` (``t`` itself cast when ``group`` is inactive).
    """
    if not is_active(group):
        return t.to(dtype)
    world = dist.get_world_size(group)
    t = t.contiguous()
    if dtype not in (torch.float16, torch.bfloat16) or t.numel() % world:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t.to(dtype)
    shard = torch.empty(t.numel() // world, dtype=t.dtype, device=t.device)
    _single("reduce_scatter_single", "reduce_scatter_tensor")(shard, t.reshape(-1), op=dist.ReduceOp.SUM, group=group)
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    _single("all_gather_single", "all_gather_into_tensor")(out.reshape(-1), shard.to(dtype), group=group)
    return out


def all_reduce_sum_autograd(t: torch.Tensor, group) -> torch.Tensor:
    """Differentiable SUM all-reduce: the backward sums the gradients of every rank's loss, so
    each rank's local loss is a share of one global loss (sequence parallelism)."""
    if not is_active(group):
        return t
    from torch.distributed.nn.functional import all_reduce as ar

    return ar(t, op=dist.ReduceOp.SUM, group=group)


def gather_varlen(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenate the 1-D tensors ``t`` of every rank (lengths may differ), in rank order."""
    if not is_active(group):
        return t
    world = dist.get_world_size(group)
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = t.new_zeros(longest)
    padded[: t.numel()] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])
