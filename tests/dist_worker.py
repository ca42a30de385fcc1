"""Worker bodies of tests/test_distributed.py: each runs in one gloo process and returns
numpy-free plain tensors; the single-process reference is computed in the test itself."""

from __future__ import annotations

import torch.distributed as dist

from logitless import Head, PassOptions, PolicyConfig, VocabShard, cross_entropy, policy_loss, token_logprobs


def _shard_rows(v: int, world: int, rank: int, sizes: list[int] | None):
    sizes = sizes or [v // world + (1 if r < v % world else 0) for r in range(world)]
    start = sum(sizes[:rank])
    return start, sizes[rank]


def vocab_parallel(rank: int, world: int, case: dict) -> dict:
    """The case's loss with this rank's rows of the head; returns loss, grads, metrics."""
    hidden = case["hidden"].clone().requires_grad_()
    weight_full = case["weight"]
    start, rows = _shard_rows(weight_full.shape[0] - case.get("pad", 0), world, rank, case.get("sizes"))
    if case.get("pad") and rank == world - 1:
        rows += case["pad"]  # padding rows live on the last rank
    weight = weight_full[start : start + rows].clone().requires_grad_()
    shard = VocabShard(group=dist.group.WORLD, vocab_start=start, vocab_size=weight_full.shape[0] - case.get("pad", 0))
    out = {}
    if case["objective"] == "ce":
        loss, metrics = cross_entropy(
            hidden,
            Head(weight, shard=shard),
            case["targets"],
            label_smoothing=0.1,
            z_loss=1e-3,
            options=PassOptions(mode=case["mode"], impl="torch", chunk_bytes=case.get("chunk")),
        )
    elif case["objective"] == "rollout":
        counts = {"max": 0, "sum": 0, "other": 0}
        orig = dist.all_reduce

        def counting(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
            counts["max" if op == dist.ReduceOp.MAX else "sum" if op == dist.ReduceOp.SUM else "other"] += 1
            return orig(t, op=op, group=group, async_op=async_op)

        dist.all_reduce = counting
        try:
            logp, ent = token_logprobs(
                hidden.detach(),
                Head(weight.detach(), shard=shard),
                case["targets"],
                return_entropy=True,
                options=PassOptions(impl="torch", chunk_bytes=case.get("chunk")),
            )
        finally:
            dist.all_reduce = orig
        return {"logp": logp, "entropy": ent, "counts": counts}
    else:
        loss, metrics = policy_loss(
            hidden,
            Head(weight, shard=shard),
            case["targets"],
            case["mask"],
            case["advantages"],
            case["old"],
            case["ref"],
            config=PolicyConfig(**case["config"]),
            options=PassOptions(mode=case["mode"], impl="torch", chunk_bytes=case.get("chunk")),
        )
    loss.backward()
    out.update(
        loss=loss.detach(),
        grad_hidden=hidden.grad,
        grad_weight=weight.grad,
        start=start,
        rows=rows,
        metrics={k: v.detach() for k, v in metrics.items()},
    )
    return out


def sequence_parallel(rank: int, world: int, case: dict) -> dict:
    """Packed GSPO with this rank's contiguous slice of the token stream (segments cut across ranks)."""
    n = case["hidden"].shape[0]
    bounds = case["bounds"]
    sl = slice(bounds[rank], bounds[rank + 1])
    hidden = case["hidden"][sl].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    loss, metrics = policy_loss(
        hidden,
        weight,
        case["targets"][sl],
        case["mask"][sl],
        case["advantages"],
        case["old"][sl],
        case["ref"][sl],
        config=PolicyConfig(**case["config"]),
        segment_ids=case["segment_ids"][sl],
        sequence_group=dist.group.WORLD,
        options=PassOptions(mode=case["mode"], impl="torch"),
    )
    loss.backward()
    assert n == bounds[-1]
    return {
        "loss": loss.detach(),
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
        "metrics": {k: v.detach() for k, v in metrics.items()},
    }


def data_parallel(rank: int, world: int, case: dict) -> dict:
    """TRL's multi-process semantics: each rank half of the batch, metrics reduced over the group."""
    b = case["hidden"].shape[0]
    per = b // world
    sl = slice(rank * per, (rank + 1) * per)
    hidden = case["hidden"][sl].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    cfg = PolicyConfig(**case["config"], num_processes=world)
    loss, metrics = policy_loss(
        hidden,
        weight,
        case["targets"][sl],
        case["mask"][sl],
        case["advantages"][sl],
        case["old"][sl],
        case["ref"][sl],
        config=cfg,
        num_items_in_batch=case["mask"].sum(),
        group=dist.group.WORLD,
        options=PassOptions(impl="torch"),
    )
    loss.backward()
    return {
        "loss": loss.detach(),
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
        "metrics": {k: v.detach() for k, v in metrics.items()},
    }
