"""Where the time of one fused GRPO call goes on a GPU (torch.profiler, top kernels + CPU).

    python3 scripts/gpu_profile.py [N] [H] [V]
"""

from __future__ import annotations

import sys
import time

import torch

import logitless
from logitless import PolicyConfig


def main() -> None:
    n, h, v = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (8192, 4096, 128256)))
    dev = "cuda"
    torch.manual_seed(0)
    b = 16
    t = n // b
    w = (torch.randn(v, h, device=dev) / h**0.5).to(torch.bfloat16).requires_grad_()
    hid = (torch.randn(b, t, h, device=dev) * 3).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (b, t), device=dev)
    mask = torch.ones(b, t, device=dev)
    adv = torch.randn(b, device=dev)
    with torch.no_grad():
        cur = logitless.token_logprobs(hid, w, ids)
    old, ref = cur + 0.1 * torch.randn_like(cur), cur + 0.1 * torch.randn_like(cur)
    cfg = PolicyConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28)

    def step(mode):
        loss, _m = logitless.policy_loss(hid, w, ids, mask, adv, old, ref, config=cfg, mode=mode)
        loss.backward()
        hid.grad = None
        w.grad = None

    def gemms():
        x = hid.reshape(-1, h)
        z = x @ w.t()
        _ = z @ w
        _ = z.t() @ x

    for name, fn in (("floor 3 GEMMs", gemms), ("fused", lambda: step("fused")),
                     ("recompute", lambda: step("recompute"))):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        print(f"{name:14s} {1e3 * (time.perf_counter() - t0) / reps:8.2f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step("fused")
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
