"""Worker bodies of the multi-process tests (tests/test_distributed.py, tests/test_vocab_parallel_gpu.py):
each runs in one gloo (or NCCL) process and returns numpy-free plain tensors or floats; the
single-process reference is computed in the test itself unless the worker says otherwise."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from logitless import (
    DistillConfig,
    Head,
    LogitTransform,
    PassOptions,
    PolicyConfig,
    VocabShard,
    cross_entropy,
    distill_loss,
    policy_loss,
    token_logprobs,
)


def _shard_rows(v: int, world: int, rank: int, sizes: list[int] | None):
    sizes = sizes or [v // world + (1 if r < v % world else 0) for r in range(world)]
    start = sum(sizes[:rank])
    return start, sizes[rank]


_SKIPPED = []  # rows each of this process's backward decisions left out
# the reduce-scatter logitless.distributed calls (torch 2.13 renamed it; it looks the name up per call)
_RS = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def _small_row_multiple(case: dict) -> None:
    """Tests of rows without a gradient on tiny batches round the backward's rows to a small
    multiple, and count the rows each decision leaves out (``_SKIPPED``)."""
    if "row_multiple" in case:
        from logitless.ops import plan as planning

        planning._ROW_MULTIPLE = case["row_multiple"]
        real = planning.backward_rows

        def counting(zero, chunks):
            out = real(zero, chunks)
            _SKIPPED.extend(0 if idx is None else sl.stop - sl.start - idx.numel()
                            for sl, idx in zip(chunks, out, strict=True))
            return out

        planning.backward_rows = counting
        real_leading = planning.leading_rows

        def leading(zero, n, started=0, cuts=None):
            end = real_leading(zero, n, started, cuts)
            if end is not None:
                _SKIPPED.append(n - end)
            return end

        planning.leading_rows = leading


def vocab_parallel(rank: int, world: int, case: dict) -> dict:
    """The case's loss with this rank's rows of the head; returns loss, grads, metrics."""
    _small_row_multiple(case)
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
                entropy=True,
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
        skipped=list(_SKIPPED),
    )
    return out


def sequence_parallel(rank: int, world: int, case: dict) -> dict:
    """Packed GSPO with this rank's contiguous slice of the token stream (segments cut across ranks)."""
    _small_row_multiple(case)
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
        "skipped": list(_SKIPPED),
    }


def data_parallel(rank: int, world: int, case: dict) -> dict:
    """TRL's multi-process semantics: each rank half of the batch, metrics reduced over the group;
    for each of ``case["runs"]`` (a config, and data replacing the case's), logitless's loss,
    grads and metrics, TRL's own ``_compute_loss`` on the same rows with its gathers over the
    group, and TRL's metrics of this rank's rows alone."""
    from trl_oracle import trl_grpo_loss

    b = case["hidden"].shape[0]
    per = b // world
    sl = slice(rank * per, (rank + 1) * per)
    outs = []
    for run in case["runs"]:
        data = {**case, **run.get("data", {})}
        rows = {k: data[k][sl] for k in ("targets", "mask", "advantages", "old", "ref")}
        hidden = data["hidden"][sl].clone().requires_grad_()
        weight = data["weight"].clone().requires_grad_()
        cfg = PolicyConfig(**run["config"], num_processes=world)
        loss, metrics = policy_loss(
            hidden,
            weight,
            rows["targets"],
            rows["mask"],
            rows["advantages"],
            rows["old"],
            rows["ref"],
            config=cfg,
            num_items_in_batch=data["mask"].sum(),
            group=dist.group.WORLD,
            options=PassOptions(impl="torch"),
        )
        loss.backward()
        out = {"loss": loss.detach(), "grad_hidden": hidden.grad, "grad_weight": weight.grad,
               "metrics": {k: v.detach() for k, v in metrics.items()}}
        trl_args = (rows["targets"], rows["mask"], rows["advantages"], rows["old"], rows["ref"])
        h, w = data["hidden"][sl].clone().requires_grad_(), data["weight"].clone().requires_grad_()
        trl_loss, trl_metrics = trl_grpo_loss(h, w, *trl_args, num_items_in_batch=data["mask"].sum().double(),
                                              group=dist.group.WORLD, **run["trl"])
        trl_loss.backward()
        out["trl"] = {"loss": trl_loss.detach(), "grad_hidden": h.grad, "grad_weight": w.grad, "metrics": trl_metrics}
        with torch.no_grad():
            out["trl_local_metrics"] = trl_grpo_loss(data["hidden"][sl], data["weight"], *trl_args, **run["trl"])[1]
        outs.append(out)
    return {"runs": outs}


def _distill_call(case: dict, run: dict, hidden, head, teacher_head):
    """One ``distill_loss`` of ``case`` for ``run = {"divergence", "mode"}`` ("topk": the sparse teacher)."""
    dense = run["divergence"] != "topk"
    teacher = (dict(teacher_hidden=case["teacher_hidden"], teacher=teacher_head) if dense else
               dict(teacher_topk_ids=case["topk_ids"], teacher_topk_logprobs=case["topk_logprobs"]))
    cfg = DistillConfig(divergence=run["divergence"] if dense else "forward_kl", beta=0.3, ce_weight=0.4)
    return distill_loss(hidden, head, targets=case["labels"], mask=case["mask"], config=cfg,
                        options=PassOptions(mode=run["mode"], impl=case.get("impl", "auto"), chunk_bytes=case["chunk"]),
                        **teacher)


def distill_vocab_parallel(rank: int, world: int, case: dict) -> dict:
    """``distill_loss`` with this rank's rows of both heads (padding rows on the last rank), for
    each of ``case["runs"]``; returns each run's loss, grads, metrics and all-reduce counts, and
    the message of a teacher sharded differently from the student."""
    pad = case["pad"]
    vocab = case["weight"].shape[0] - pad
    start, rows = _shard_rows(vocab, world, rank, case.get("sizes"))
    if rank == world - 1:
        rows += pad  # padding rows live on the last rank
    shard = VocabShard(group=dist.group.WORLD, vocab_start=start, vocab_size=vocab)
    teacher_head = Head(case["teacher_weight"][start:start + rows], case["teacher_bias"][start:start + rows],
                        LogitTransform(temperature=1.2), shard=shard)
    counts = {"max": 0, "sum": 0, "other": 0}
    orig = dist.all_reduce
    orig_rs = getattr(dist, _RS)

    def counting(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        counts["max" if op == dist.ReduceOp.MAX else "sum" if op == dist.ReduceOp.SUM else "other"] += 1
        return orig(t, op=op, group=group, async_op=async_op)

    def counting_rs(out, t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        # a 16-bit d hidden is summed by a reduce-scatter (then all-gathered): it counts as its SUM
        counts["sum" if op == dist.ReduceOp.SUM else "other"] += 1
        return orig_rs(out, t, op=op, group=group, async_op=async_op)

    out = {"start": start, "rows": rows, "runs": []}
    for run in case["runs"]:
        hidden = case["hidden"].clone().requires_grad_()
        weight = case["weight"][start:start + rows].clone().requires_grad_()
        bias = case["bias"][start:start + rows].clone().requires_grad_()
        head = Head(weight, bias, LogitTransform(temperature=0.8, softcap=6.0), shard=shard)
        counts.update(max=0, sum=0, other=0)
        dist.all_reduce = counting
        setattr(dist, _RS, counting_rs)
        try:
            loss, metrics = _distill_call(case, run, hidden, head, teacher_head)
            loss.backward()
        finally:
            dist.all_reduce = orig
            setattr(dist, _RS, orig_rs)
        out["runs"].append(dict(loss=loss.detach(), grad_hidden=hidden.grad, grad_weight=weight.grad,
                                grad_bias=bias.grad, metrics={k: v.detach() for k, v in metrics.items()},
                                counts=dict(counts)))
    other = VocabShard(group=dist.group.WORLD, vocab_start=start + 1, vocab_size=vocab)
    try:
        _distill_call(case, case["runs"][0], case["hidden"], Head(case["weight"][start:start + rows], shard=shard),
                      Head(case["teacher_weight"][start:start + rows], shard=other))
        out["mismatch_error"] = None
    except ValueError as e:
        out["mismatch_error"] = str(e)
    return out


def trl_dropins(rank: int, world: int, case: dict) -> dict:
    """TRL 1.16's ``SFTTrainer`` on this rank (accelerate sees the gloo group: 2 processes, each
    its own shard of the data), with the logitless drop-in and on TRL's own path, for one batch
    whose ``num_items_in_batch`` counts every rank's tokens, as ``Trainer`` passes it:
    the SFT loss and gradients (``fused_loss``), and the fused LM head's ``loss`` when the call
    passes ``num_items_in_batch`` (``fused_logprobs``). Returns ``{name: (ours, TRL's)}``."""
    import os

    from datasets import Dataset
    from tiny_models import word_tokenizer
    from trl import SFTConfig, SFTTrainer
    from trl_head_oracle import trainer_step

    from logitless.integrations.config import LogitlessConfig
    from logitless.integrations.trl_sft import patch_sft_trainer, trl_own_path

    # accelerate's PartialState takes the process group this process already joined (MULTI_CPU)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    args = SFTConfig(output_dir=case["out"], per_device_train_batch_size=2, report_to=[], use_cpu=True, bf16=False,
                     max_steps=1, average_tokens_across_devices=True, dataloader_drop_last=True)
    tr = SFTTrainer(model=case["model"], args=args, train_dataset=Dataset.from_list(case["rows"]),
                    processing_class=word_tokenizer(case["vocab"]))
    assert tr.accelerator.num_processes == world
    tr = patch_sft_trainer(tr, LogitlessConfig(fused_loss=True, fused_logprobs=True))
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    local = (batch["labels"][:, 1:] != -100).sum()
    num_items = tr.accelerator.gather(local).sum()  # Trainer.get_batch_samples with average_tokens_across_devices
    assert num_items > local

    def sft(model):
        return tr.compute_loss(model, dict(batch), num_items_in_batch=num_items)

    def fused_head(model):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return model(**inputs, labels=batch["labels"], fused_lm_head=True, num_items_in_batch=num_items).loss

    out = {"local_tokens": local, "num_items": num_items}
    for name, loss_of in (("sft", sft), ("fused_head", fused_head)):
        ours = trainer_step(tr, loss_of)
        with trl_own_path(tr):
            theirs = trainer_step(tr, loss_of)
        out[name] = (ours, theirs)
    return out


def preference_vocab_parallel(rank: int, world: int, case: dict) -> dict:
    """``dpo_loss_fused`` with this rank's rows of the head (test_preference_fused.py)."""
    from logitless import dpo_loss_fused

    hidden = case["hidden"].clone().requires_grad_()
    vocab = case["weight"].shape[0]
    start, rows = _shard_rows(vocab, world, rank, None)
    weight = case["weight"][start : start + rows].clone().requires_grad_()
    head = Head(weight, shard=VocabShard(group=dist.group.WORLD, vocab_start=start, vocab_size=vocab))
    b = case["ref"].shape[0] // 2
    loss, metrics = dpo_loss_fused(hidden, head, case["labels"], case["mask"], case["ref"][:b], case["ref"][b:],
                                   options=PassOptions(impl="torch", chunk_bytes=case["chunk"]))
    loss.backward()
    return dict(loss=loss.detach(), grad_hidden=hidden.grad, grad_weight=weight.grad, start=start, rows=rows,
                metrics={k: v.detach() for k, v in metrics.items()})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


# The runs of tp_against_tp1: (name, mode, PolicyConfig fields); None: the rollout log-probs.
TP_RUNS = (
    ("rollout", None, None),
    ("fused dapo kl", "fused", dict(loss_type="dapo", beta=0.04)),
    # TRL's default beta = 0: the zero-advantage rows leave the gradient GEMMs (compacted rows per rank)
    ("fused dapo zero-adv rows", "fused", dict(loss_type="dapo", beta=0.0)),
    ("recompute grpo kl", "recompute", dict(loss_type="grpo", beta=0.04, epsilon_high=0.28)),
)


def tp_against_tp1(rank: int, world: int, case: dict) -> dict:
    """TP=``world`` (this rank's rows of a bf16 head, uneven shards when ``world`` does not divide
    ``V``) and TP1 (the whole head on this process alone), each against float64 on the whole head
    (the torch backend, the specification), for each of :data:`TP_RUNS`. Returns, per run and
    quantity, the relative errors ``{"tp_tp1", "tp1_64", "tp_64"}`` (floats; ``d weight`` is this
    rank's rows) and the shard's rows."""
    dev = torch.device("cuda", rank) if case["device"] == "cuda" else torch.device("cpu")
    b, t, h, v = case["b"], case["t"], case["h"], case["v"]
    g = torch.Generator().manual_seed(case["seed"])  # the same inputs on every rank
    weight = (torch.randn(v, h, generator=g) * 2 / h**0.5).to(torch.bfloat16).to(dev)
    hidden = (torch.randn(b, t, h, generator=g) * 2).to(torch.bfloat16).to(dev)
    ids = torch.randint(0, v, (b, t), generator=g).to(dev)
    mask = (torch.rand(b, t, generator=g) > 0.1).to(dev, torch.float32)
    mask[:, 0] = 1.0
    adv = torch.randn(b, generator=g)
    adv[::4] = 0.0  # reward-constant groups
    adv = adv.to(dev)
    noise = (0.2 * torch.randn(2, b, t, generator=g)).to(dev)
    start, rows = _shard_rows(v, world, rank, None)
    shard = VocabShard(group=dist.group.WORLD, vocab_start=start, vocab_size=v)
    transform = LogitTransform(temperature=0.9)
    heads = {"64": (hidden.double(), Head(weight.double(), transform=transform), "torch"),
             "tp1": (hidden, Head(weight, transform=transform), "auto"),
             "tp": (hidden, Head(weight[start:start + rows].clone(), transform=transform, shard=shard), "auto")}
    with torch.no_grad():
        cur = token_logprobs(hidden.double(), heads["64"][1], ids, options=PassOptions(impl="torch"))
    old, ref = cur + noise[0], cur + noise[1]
    out: dict = {"start": start, "rows": rows, "runs": {}}
    for name, mode, config in TP_RUNS:
        res = {}
        for key, (hid, head, impl) in heads.items():
            opts = PassOptions(impl=impl, mode=mode or "auto")
            if mode is None:
                with torch.no_grad():
                    logp, ent = token_logprobs(hid, head, ids, entropy=True, options=opts)
                res[key] = {"logp": logp, "entropy": ent}
                continue
            stat_dtype = torch.float64 if hid.dtype == torch.float64 else torch.float32
            hh = hid.clone().requires_grad_()
            ww = head.weight.clone().requires_grad_()
            loss, metrics = policy_loss(hh, dataclasses.replace(head, weight=ww), ids, mask, adv, old.to(stat_dtype),
                                        ref.to(stat_dtype), config=PolicyConfig(**config), options=opts)
            loss.backward()
            gw = ww.grad if key == "tp" else ww.grad[start:start + rows]
            res[key] = {"loss": loss.detach(), "entropy": metrics["entropy"], "d hidden": hh.grad, "d weight": gw}
        tp, tp1, f64 = res["tp"], res["tp1"], res["64"]
        out["runs"][name] = {q: {"tp_tp1": _rel(tp[q], tp1[q]), "tp1_64": _rel(tp1[q], f64[q]),
                                 "tp_64": _rel(tp[q], f64[q])} for q in tp}
    return out


def sum_partials_cases(rank: int, world: int, case: dict) -> dict:
    """``distributed.sum_partials`` against an fp32 all-reduce then the cast, on this rank's
    random fp32 partials of each ``case["shapes"]`` in each dtype (``ours``, ``reference``, the
    partials, and how many reduce-scatters it made); then a bf16 vocabulary-parallel
    ``policy_loss`` (fused and recompute, this rank's rows of the head) with its ``d hidden``
    summed both ways (``pass``: the two ``d hidden`` per mode)."""
    import logitless.distributed as ld
    from logitless.ops import fused, recompute

    def reference(t, dtype, group):
        return ld.all_reduce(t, "sum", group).to(dtype)

    calls = []
    orig_rs = getattr(dist, _RS)

    def counting_rs(*args, **kwargs):
        calls.append(1)
        return orig_rs(*args, **kwargs)

    g = torch.Generator().manual_seed(case["seed"] * 100 + rank)
    out: dict = {"sums": []}
    for shape in case["shapes"]:
        # magnitudes spread over many binades: the fp32 sums round, and so do their casts
        t = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g))
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            calls.clear()
            setattr(dist, _RS, counting_rs)
            try:
                ours = ld.sum_partials(t.clone(), dtype, dist.group.WORLD)
            finally:
                setattr(dist, _RS, orig_rs)
            out["sums"].append(dict(shape=shape, dtype=dtype, partial=t, ours=ours, scatters=len(calls),
                                    reference=reference(t.clone(), dtype, dist.group.WORLD)))
    b, t_len, h, v = 4, 6, 8, 50
    hidden = (torch.randn(b, t_len, h, generator=g) * 2).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 2).to(torch.bfloat16)
    ids = torch.randint(0, v, (b, t_len), generator=g)
    adv, old = torch.randn(b, generator=g), torch.randn(b, t_len, generator=g) * 0.1 - 3
    start, rows = _shard_rows(v, world, rank, None)
    head = Head(weight[start:start + rows], shard=VocabShard(group=dist.group.WORLD, vocab_start=start, vocab_size=v))
    out["pass"] = {}
    for mode in ("fused", "recompute"):
        got = []
        for summed in (ld.sum_partials, reference):
            fused.sum_partials = recompute.sum_partials = summed
            try:
                hh = hidden.clone().requires_grad_()
                loss, _ = policy_loss(hh, head, ids, torch.ones(b, t_len), adv, old,
                                      options=PassOptions(mode=mode, impl="torch"))
                loss.backward()
            finally:
                fused.sum_partials = recompute.sum_partials = ld.sum_partials
            got.append(hh.grad)
        out["pass"][mode] = got
    return out


def vocab_parallel_sum_sq(rank: int, world: int, case: dict) -> dict:
    """``log Σ_v p_v²`` with this rank's rows of the head (the case's shard sizes, padding rows on
    the last rank), in recompute and fused mode: ``{mode: [n] tensor}``."""
    from logitless.ops import ObjectiveSpec, StatRequest, run_objective

    vocab = case["weight"].shape[0] - case["pad"]
    start, rows = _shard_rows(vocab, world, rank, case["sizes"])
    if rank == world - 1:
        rows += case["pad"]
    head = Head(case["weight"][start:start + rows],
                shard=VocabShard(group=dist.group.WORLD, vocab_start=start, vocab_size=vocab))
    spec = ObjectiveSpec(want=StatRequest(entropy=False, sum_sq=True))
    out = {}
    for mode in ("recompute", "fused"):
        options = PassOptions(mode=mode, impl="torch", chunk_bytes=case["chunk"])
        result = run_objective(case["hidden"], head, case["targets"], lambda sl, st: (st.logp.sum(), None), spec,
                               options)
        out[mode] = result.stats.log_sum_sq_probs
    return out
