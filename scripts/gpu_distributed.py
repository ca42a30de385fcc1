"""Two GPUs with NCCL: vocabulary-parallel and sequence-parallel results equal the one-GPU
ones, and a TP=2 vs TP=1 scaling row (time, per-GPU memory) for fused GRPO.

    python3 scripts/gpu_distributed.py            # spawns one process per visible GPU (2)
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import logitless
from logitless import Head, LogitTransform, PassOptions, PolicyConfig, VocabShard


def _inputs(n, h, v, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(v, h, generator=g) / h**0.5 * 2).to(torch.bfloat16).to(dev)
    hid = (torch.randn(n, h, generator=g) * 2).to(torch.bfloat16).to(dev)
    tgt = torch.randint(0, v, (n,), generator=g).to(dev)
    return hid, w, tgt


def _grpo(hid, w, tgt, shard, mode, b=16):
    n, h = hid.shape
    t = n // b
    ids, mask = tgt.reshape(b, t), torch.ones(b, t, device=hid.device)
    g = torch.Generator(device="cpu").manual_seed(1)
    adv = torch.randn(b, generator=g).to(hid.device)
    old = (torch.randn(b, t, generator=g) * 0.1 - 3).to(hid.device)
    ref = (torch.randn(b, t, generator=g) * 0.1 - 3).to(hid.device)
    hh, ww = hid.reshape(b, t, h).clone().requires_grad_(), w.clone().requires_grad_()
    loss, m = logitless.policy_loss(hh, Head(ww, transform=LogitTransform(temperature=0.9), shard=shard), ids, mask,
                                    adv, old, ref, config=PolicyConfig(loss_type="dapo", beta=0.04),
                                    options=PassOptions(mode=mode))
    loss.backward()
    return loss.detach(), hh.grad.reshape(n, h), ww.grad, m["entropy"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    out = {}
    # correctness at a real shape: TP=world vs the same computation on one GPU (this rank alone)
    n, h, v = 4096, 2048, 32000
    hid, w, tgt = _inputs(n, h, v, dev)
    rows = v // world
    shard = VocabShard(group=dist.group.WORLD)
    for mode in ("fused", "recompute"):
        one = _grpo(hid, w, tgt, None, mode)
        tp = _grpo(hid, w[rank * rows:(rank + 1) * rows], tgt, shard, mode)
        out[f"grpo-{mode} loss"] = rel(tp[0], one[0])
        out[f"grpo-{mode} grad hidden"] = rel(tp[1], one[1])
        out[f"grpo-{mode} grad weight shard"] = rel(tp[2], one[2][rank * rows:(rank + 1) * rows])
        out[f"grpo-{mode} entropy"] = rel(tp[3], one[3])
    hh = hid.clone().requires_grad_()
    ce_tp, _ = logitless.cross_entropy(hh, Head(w[rank * rows:(rank + 1) * rows], shard=shard), tgt,
                                       label_smoothing=0.1)
    ce_one, _ = logitless.cross_entropy(hid, w, tgt, label_smoothing=0.1)
    out["ce loss"] = rel(ce_tp.detach(), ce_one)
    lp_tp = logitless.token_logprobs(hid, Head(w[rank * rows:(rank + 1) * rows], shard=shard), tgt)
    out["rollout logp"] = rel(lp_tp, logitless.token_logprobs(hid, w, tgt))

    # scaling: fused GRPO at N=8k, H=4096, V=128256, TP=world vs TP=1 on this GPU
    n, h, v = 8192, 4096, 128256
    hid, w, tgt = _inputs(n, h, v, dev, seed=2)
    rows = v // world
    for name, weight, sh in (("tp1", w, None), (f"tp{world}", w[rank * rows:(rank + 1) * rows].clone(), shard)):
        for _ in range(2):
            _grpo(hid, weight, tgt, sh, "fused")
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        reps = 5
        for _ in range(reps):
            _grpo(hid, weight, tgt, sh, "fused")
        torch.cuda.synchronize()
        out[f"scaling {name} ms"] = 1e3 * (time.perf_counter() - t0) / reps
        out[f"scaling {name} peak extra GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, 29512, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=400) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(res, indent=1))
    bad = [k for r in res.values() for k, e in r.items() if not k.startswith("scaling") and not e <= 2e-2]
    bad += [k for r in res.values() for k, e in r.items() if k.endswith("loss") and not e <= 1e-4]
    print("world", world, "FAILED:", bad or "none")
    return 1 if bad or any(p.exitcode for p in procs) else 0


if __name__ == "__main__":
    sys.exit(main())
