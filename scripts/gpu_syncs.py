"""Where a logitless call makes the host wait for the GPU (GPU only).

    python3 scripts/gpu_syncs.py [impl]

Runs one fused GRPO step, one cross-entropy step and one rollout call on a small head under
``torch.cuda.set_sync_debug_mode("warn")`` and prints the innermost logitless frames of every
synchronizing operation. Each one idles the GPU while the host then enqueues the next kernels.
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings

import torch

import logitless
from logitless import PassOptions, PolicyConfig


def main() -> None:
    impl = sys.argv[1] if len(sys.argv) > 1 else "auto"
    torch.manual_seed(0)
    b, t, h, v = 4, 256, 512, 32000
    w = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_()
    hid = torch.randn(b, t, h, device="cuda").to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (b, t), device="cuda")
    mask = torch.ones(b, t, device="cuda")
    adv = torch.randn(b, device="cuda")
    old = -torch.rand(b, t, device="cuda")
    opts = PassOptions(mode="fused", impl=impl)
    calls = {
        "grpo": lambda: logitless.policy_loss(hid, w, ids, mask, adv, old, old, options=opts,
                                              config=PolicyConfig(loss_type="dapo", beta=0.04))[0].backward(),
        "ce": lambda: logitless.cross_entropy(hid, w, ids, options=opts)[0].backward(),
        "rollout": lambda: logitless.token_logprobs(hid.detach(), w.detach(), ids, entropy=True,
                                                    options=PassOptions(impl=impl)),
    }
    for name, fn in calls.items():
        fn()  # compile and warm up outside the check
        torch.cuda.synchronize()
        sites: collections.Counter[str] = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None, sites=sites):
            frames = [f for f in traceback.extract_stack() if "logitless" in f.filename and "scripts" not in f.filename]
            where = [f"{f.filename.split('logitless/')[-1]}:{f.lineno} {f.line}" for f in frames[::-1][:3]]
            sites[" <- ".join(where)] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        print(f"== {name}: {sum(sites.values())} synchronizing operations")
        for site, count in sites.most_common():
            print(f"  {count:3d}x {site}")


if __name__ == "__main__":
    main()
