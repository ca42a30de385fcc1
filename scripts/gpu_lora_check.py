"""GPU check of LoRA on the head and of ``fp32_logits=False`` at a real shape.

Correctness: the Triton backend with a rank-16 adapter against the torch backend with the same
adapter and against the Triton backend on the merged weight ``W + s·B·A`` (no adapter).
Timing (``triton.testing.do_bench`` medians, ms), fused GRPO fwd+bwd, frozen ``W``:
with and without the adapter, against the two-GEMM floor a frozen head needs (logits and
``d hidden``); and the ``fp32_logits`` switch on a trainable head against the three-GEMM floor.

    python3 scripts/gpu_lora_check.py [--tokens 8192] [--hidden 4096] [--vocab 128256] [--rank 16]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton.testing
from gpu_correctness import FAILED, check, rel  # scripts/ is on sys.path when run as a script

import logitless
from logitless import Head, HeadLoRA, PassOptions, PolicyConfig


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    n, h, v, r = a.tokens, a.hidden, a.vocab, a.rank
    g = torch.Generator(dev).manual_seed(0)
    w = (torch.randn(v, h, device=dev, generator=g) * 2 / h**0.5).to(dt)
    hid = torch.randn(n, h, device=dev, generator=g).to(dt)
    la = (torch.randn(r, h, device=dev, generator=g) / h**0.5).to(dt)
    lb = (torch.randn(v, r, device=dev, generator=g) * 0.5).to(dt)
    tgt = torch.randint(0, v, (n,), device=dev, generator=g)
    scaling = 2.0

    # ---- correctness on the first 2048 tokens
    m = min(n, 2048)
    outs = {}
    for impl in ("torch", "triton"):
        hh, aa, bb = (x.clone().requires_grad_() for x in (hid[:m], la, lb))
        st = logitless.vocab_stats(hh, Head(w, lora=HeadLoRA(aa, bb, scaling)), tgt[:m], options=PassOptions(impl=impl))
        (-st.logp.sum() + 0.1 * st.entropy.sum()).backward()
        outs[impl] = (st.logp, st.entropy, hh.grad, aa.grad, bb.grad)
    merged = (w.float() + scaling * lb.float() @ la.float()).to(dt)
    ref = logitless.vocab_stats(hid[:m], merged, tgt[:m], options=PassOptions(impl="triton"))
    for i, k in enumerate(("logp", "entropy", "grad hidden", "grad A", "grad B")):
        check(f"lora {k}: triton vs torch backend", rel(outs["triton"][i], outs["torch"][i]), 1e-2 if i > 1 else 1e-4)
    # The merged weight is rounded to bf16 once, the adapter term is not: agreement to bf16 level.
    check("lora logp: triton vs merged-weight triton", rel(outs["triton"][0], ref.logp), 2e-2)

    # ---- timing
    cfg = PolicyConfig(loss_type="dapo", beta=0.0)
    mask = torch.ones(1, n, dtype=torch.long, device=dev)
    adv = torch.randn(1, device=dev, generator=g)

    def fused(weight, lora=None, fp32_logits=None, train_w=False):
        hh = hid.view(1, n, h).detach().requires_grad_()
        ww = weight.detach().requires_grad_(train_w)
        lr = None if lora is None else HeadLoRA(la.detach().requires_grad_(), lb.detach().requires_grad_(), scaling)

        def step():
            loss, _ = logitless.policy_loss(
                hh,
                Head(ww, lora=lr),
                tgt.view(1, n),
                mask,
                adv,
                config=cfg,
                options=PassOptions(
                    logits_precision=None if fp32_logits is None else ("fp32" if fp32_logits else "input")
                ),
            )
            loss.backward()

        return step

    dy = torch.randn(n, v, device=dev, dtype=dt)

    def floor(k):
        def step():
            y = hid @ w.t()
            dh = dy @ w
            if k == 3:
                dw = dy.t() @ hid
                del dw
            del y, dh

        return step

    rows = [
        ("2-GEMM floor (logits, d hidden)", floor(2)),
        ("fused GRPO, frozen W", fused(w)),
        (f"fused GRPO, frozen W + LoRA r={r}", fused(w, lora=True)),
        ("3-GEMM floor", floor(3)),
        ("fused GRPO, trainable W, fp32 logits", fused(w, train_w=True, fp32_logits=True)),
        ("fused GRPO, trainable W, bf16 logits", fused(w, train_w=True, fp32_logits=False)),
    ]
    times = {}
    for name, fn in rows:
        try:
            times[name] = triton.testing.do_bench(fn, warmup=3, rep=200)
        except Exception as e:  # report and go on
            print(f"FAIL timing {name}: {type(e).__name__}: {e}")
            FAILED.append(name)
    print(f"\n| case (N={n}, H={h}, V={v}) | ms | ratio |\n|---|---|---|")
    for name, t in times.items():
        base = times.get(
            "3-GEMM floor" if "trainable" in name or "3-GEMM" in name else "2-GEMM floor (logits, d hidden)"
        )
        print(f"| {name} | {t:.2f} | {t / base:.3f} |" if base else f"| {name} | {t:.2f} | |")
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all lora checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
