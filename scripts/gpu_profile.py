"""Where the time of one fused GRPO call goes on a GPU, next to cross-entropy, rollout and forward-KL
distillation (a teacher head of the same shape) on the same head (torch.profiler): wall time, GPU busy
time, kernel count, top kernels. `floor` is the three bare GEMMs; distillation's floor adds a fourth.

    python3 scripts/gpu_profile.py [N] [H] [V] [impl]   # impl: auto (default), triton, gemm, flash
    LOGITLESS_LOGITS_PRECISION=input python3 scripts/gpu_profile.py   # bf16 logits
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import logitless
from logitless import DistillConfig, PassOptions, PolicyConfig


def main() -> None:
    n, h, v = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (8192, 4096, 128256)))
    impl = sys.argv[4] if len(sys.argv) > 4 else "auto"
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

    def grpo():
        loss, _ = logitless.policy_loss(hid, w, ids, mask, adv, old, ref, config=cfg,
                                        options=PassOptions(mode="fused", impl=impl))
        loss.backward()
        hid.grad = w.grad = None

    def ce():
        loss, _ = logitless.cross_entropy(hid, w, ids, options=PassOptions(mode="fused", impl=impl))
        loss.backward()
        hid.grad = w.grad = None

    def rollout():
        logitless.token_logprobs(hid.detach(), w.detach(), ids, entropy=True,
                                options=PassOptions(impl=impl))

    t_w = (torch.randn(v, h, device=dev) / h**0.5).to(torch.bfloat16)
    t_hid = (torch.randn(b, t, h, device=dev) * 3).to(torch.bfloat16)

    def distill(divergence: str):
        def run():
            loss, _ = logitless.distill_loss(hid, w, t_hid, t_w, targets=ids,
                                             config=DistillConfig(divergence=divergence),
                                             options=PassOptions(mode="fused", impl=impl))
            loss.backward()
            hid.grad = w.grad = None
        return run

    h2, w2 = hid.detach().reshape(n, h), w.detach()
    dy = torch.randn(n, v, device=dev, dtype=torch.bfloat16)

    def floor():  # the three bare GEMMs (logits, d hidden, d weight)
        y = h2 @ w2.t()
        dh = dy @ w2
        dw = dy.t() @ h2
        del y, dh, dw

    for name, fn in (("floor", floor), ("grpo", grpo), ("ce", ce), ("rollout", rollout),
                     ("fwd_kl", distill("forward_kl")), ("jsd", distill("generalized_jsd"))):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t0) / 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in kernels) / 1e3
        small = [e for e in kernels if e.device_time < 20]
        print(f"{name:8s} wall {wall:7.2f} ms  GPU busy {busy:7.2f} ms  kernels {len(kernels)}  "
              f"small(<20us) {len(small)} = {sum(e.device_time for e in small) / 1e3:.2f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    main()
