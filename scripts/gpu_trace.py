"""Export a GPU trace of two fused GRPO calls (or rollout log-prob calls) and list the GPU idle
gaps with the CPU op that was running (to find host syncs and launch-bound stretches).

    python3 scripts/gpu_trace.py OUT_DIR [grpo|rollout] [N]
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import logitless
from logitless import PassOptions, PolicyConfig


def main() -> None:
    out = sys.argv[1]
    what = sys.argv[2] if len(sys.argv) > 2 else "grpo"
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    dev = "cuda"
    torch.manual_seed(0)
    b, t, h, v = 16, n // 16, 4096, 128256
    w = (torch.randn(v, h, device=dev) / h**0.5).to(torch.bfloat16).requires_grad_()
    hid = (torch.randn(b, t, h, device=dev) * 3).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (b, t), device=dev)
    mask = torch.ones(b, t, device=dev)
    adv = torch.randn(b, device=dev)
    old = torch.randn(b, t, device=dev) * 0.1 - 5
    ref = torch.randn(b, t, device=dev) * 0.1 - 5
    cfg = PolicyConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28)

    def grpo():
        loss, _ = logitless.policy_loss(hid, w, ids, mask, adv, old, ref, config=cfg, options=PassOptions(mode="fused"))
        loss.backward()
        hid.grad = w.grad = None

    def rollout():
        with torch.no_grad():
            logitless.token_logprobs(hid, w, ids, return_entropy=True)

    call = grpo if what == "grpo" else rollout

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
        call()
        call()
        torch.cuda.synchronize()
    prof.export_chrome_trace(f"{out}/trace.json")
    ev = json.load(open(f"{out}/trace.json"))["traceEvents"]
    kern = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "python_function") and "dur" in e]
    gaps = []
    for a, b_ in itertools.pairwise(kern):
        gap = b_["ts"] - (a["ts"] + a["dur"])
        if gap > 100:
            start = a["ts"] + a["dur"]
            running = [c["name"] for c in cpu if c["ts"] <= start + gap / 2 <= c["ts"] + c["dur"]]
            gaps.append((gap, a["name"][:40], b_["name"][:40], running[-3:]))
    total = sum(g[0] for g in gaps)
    print(f"{what} N={n}: {len(kern)} GPU events, {len(gaps)} gaps > 100 us, {total / 1e3:.2f} ms in them (2 calls)")
    for g in sorted(gaps, reverse=True)[:25]:
        print(f"{g[0] / 1e3:7.3f} ms after {g[1]!r} before {g[2]!r} cpu: {g[3]}")


if __name__ == "__main__":
    main()
