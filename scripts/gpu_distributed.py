"""Vocabulary-parallel (TP) heads on several GPUs over NCCL: results equal the one-GPU ones, the
TP=world vs TP=1 scaling row (time, per-GPU memory) of fused GRPO, and with ``--diagnose`` where
TP=k loses time against TP1/k (``scripts/tp_diagnose.py``: per-rank GEMM shape, statistics
all-reduces, the ``d hidden`` all-reduce, GPU idle and host synchronizations).

    python3 scripts/gpu_distributed.py                          # one process per visible GPU
    python3 scripts/gpu_distributed.py --diagnose --out "$OUT"  # + the diagnosis table and JSON
    python3 scripts/gpu_distributed.py --dry-run --world 4 --diagnose --out /tmp/tp   # CPU, gloo, tiny shapes

Exits non-zero when a TP result is off TP1's (relative error above 2e-2, losses above 1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_diagnose
from gloo_ranks import run_ranks

import logitless
from logitless import Head, LogitTransform, PassOptions, PolicyConfig, VocabShard

# (correctness shape, scaling/diagnosis shape) as N tokens, H, V
SHAPES = {"gpu": ((4096, 2048, 32000), (8192, 4096, 128256)), "dry-run": ((256, 32, 1000), (512, 64, 4000))}
_T0 = time.monotonic()


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def _inputs(n, h, v, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)  # on the device: the same numbers on every rank
    w = (torch.randn(v, h, generator=g, device=dev) / h**0.5 * 2).to(torch.bfloat16)
    hid = (torch.randn(n, h, generator=g, device=dev) * 2).to(torch.bfloat16)
    tgt = torch.randint(0, v, (n,), generator=g, device=dev)
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


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def worker(rank: int, world: int, cfg: dict) -> dict:
    """This rank's errors against TP1 and scaling row (and its diagnosis with ``cfg["diagnose"]``)."""
    dev = torch.device("cuda", rank) if cfg["device"] == "cuda" else torch.device("cpu")
    check, scale = SHAPES[cfg["shapes"]]
    out = {}
    # correctness at a real shape: TP=world vs the same computation on one GPU (this rank alone)
    _log(rank, f"correctness at N, H, V = {check}")
    n, h, v = check
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

    # scaling: fused GRPO, TP=world vs TP=1 on this GPU, each call making its inputs (as measured before)
    _log(rank, f"scaling at N, H, V = {scale}")
    n, h, v = scale
    hid, w, tgt = _inputs(n, h, v, dev, seed=2)
    rows = v // world
    for name, weight, sh in (("tp1", w, None), (f"tp{world}", w[rank * rows:(rank + 1) * rows].clone(), shard)):
        for _ in range(2):
            _grpo(hid, weight, tgt, sh, "fused")
        _sync(dev)
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        reps = cfg["reps"]
        for _ in range(reps):
            _grpo(hid, weight, tgt, sh, "fused")
        _sync(dev)
        out[f"scaling {name} ms"] = 1e3 * (time.perf_counter() - t0) / reps
        if dev.type == "cuda":
            out[f"scaling {name} peak extra GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    del hid, w, tgt
    result = {"checks": out}
    if cfg["diagnose"]:
        result["diagnose"] = tp_diagnose.diagnose(rank, world, scale, dev, cfg["reps"], cfg["out"],
                                                  lambda msg: _log(rank, msg), cfg["impl"])
    dist.barrier()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=None, help="processes (default: visible GPUs; dry run: 2)")
    ap.add_argument("--diagnose", action="store_true", help="also measure where TP=k loses time (tp_diagnose.py)")
    ap.add_argument("--dry-run", action="store_true", help="CPU processes over gloo at tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON (default: $OUT)")
    ap.add_argument("--impl", default="auto", help="backend of the diagnosed pass (PassOptions.impl)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per measurement")
    ap.add_argument("--time-limit", type=float, default=420, help="seconds before the ranks are killed")
    args = ap.parse_args()
    if args.dry_run:
        backend, device, world = "gloo", "cpu", args.world or 2
    else:
        backend, device, world = "nccl", "cuda", args.world or torch.cuda.device_count()
        if world < 2 or world > torch.cuda.device_count():
            print(f"needs 2..{torch.cuda.device_count()} GPUs for --world, got {world} (use --dry-run on a CPU)")
            return 2
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    cfg = dict(device=device, shapes="dry-run" if args.dry_run else "gpu", diagnose=args.diagnose, out=args.out,
               reps=args.reps, impl=args.impl)
    print(f"{world} ranks over {backend}; shapes (N, H, V) {SHAPES[cfg['shapes']]}", flush=True)
    res = run_ranks(worker, world, cfg, timeout_s=args.time_limit, backend=backend)
    checks = {r: o["checks"] for r, o in enumerate(res)}
    print(json.dumps(checks, indent=1))
    bad = [k for r in checks.values() for k, e in r.items() if not k.startswith("scaling") and not e <= 2e-2]
    bad += [k for r in checks.values() for k, e in r.items() if k.endswith("loss") and not e <= 1e-4]
    print("world", world, "FAILED:", bad or "none")
    doc = {"world": world, "backend": backend, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
           "torch": torch.__version__, "shapes": SHAPES[cfg["shapes"]], "checks": checks}
    if args.diagnose:
        table, summary = tp_diagnose.report([o["diagnose"] for o in res])
        print(table)
        doc.update(diagnose_summary=summary, diagnose=[o["diagnose"] for o in res])
    if args.out:
        path = os.path.join(args.out, "gpu_distributed.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print("wrote", path)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
