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
