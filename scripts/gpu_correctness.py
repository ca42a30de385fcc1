"""GPU correctness at real shapes: the Triton backend against the torch backend and a float64
oracle (on a subset of rows), for every public entry point. Prints one line per check and
exits non-zero on any failure.

    python3 scripts/gpu_correctness.py
"""

from __future__ import annotations

import sys

import torch

import logitless
from logitless import Head, LogitTransform, PassOptions, PolicyConfig
from logitless.ops.reference import reference_stats

FAILED: list[str] = []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def check(name: str, err: float, tol: float) -> None:
    ok = err <= tol and err == err
    print(f"{'ok  ' if ok else 'FAIL'} {name:58s} rel err {err:.2e} (tol {tol:.0e})")
    if not ok:
        FAILED.append(name)


def main() -> int:
    dev = "cuda"
    torch.manual_seed(0)
    n, h, v = 4096, 2048, 32011
    dt = torch.bfloat16
    w = (torch.randn(v, h, device=dev) / h**0.5 * 2).to(dt)
    b = (0.1 * torch.randn(v, device=dev)).to(dt)
    hid = (torch.randn(n, h, device=dev) * 2).to(dt)
    tgt = torch.randint(0, v, (n,), device=dev)
    tgt[::97] = -100
    tf = dict(temperature=0.9, softcap=30.0)
    rows = torch.arange(0, n, 37, device=dev)
    rows = rows[tgt[rows] != -100]

    # vocab_stats: triton vs torch backend vs fp64 oracle on sampled rows; gradients too
    outs = {}
    for impl in ("torch", "triton"):
        hh, ww, bb = (x.clone().requires_grad_() for x in (hid, w, b))
        st = logitless.vocab_stats(hh, Head(ww, bias=bb), tgt, mean_logit=True, **tf, options=PassOptions(impl=impl))
        g = torch.randn(4, n, device=dev, generator=torch.Generator(dev).manual_seed(1))
        (g[0] * st.logp + g[1] * st.lse + g[2] * st.entropy + g[3] * st.mean_logit).sum().backward()
        outs[impl] = (st, hh.grad, ww.grad, bb.grad)
    ref = reference_stats(hid[rows], w, tgt[rows], bias=b, **tf)
    for k in ("logp", "lse", "entropy"):
        check(f"vocab_stats {k} triton vs fp64 (rows)", rel(getattr(outs["triton"][0], k)[rows], getattr(ref, k)), 1e-5)
        ours, theirs = getattr(outs["triton"][0], k), getattr(outs["torch"][0], k)
        check(f"vocab_stats {k} triton vs torch", rel(ours, theirs), 1e-5)
    check("vocab_stats mean_logit triton vs torch", rel(outs["triton"][0].mean_logit, outs["torch"][0].mean_logit),
          1e-4)
    for i, k in ((1, "grad hidden"), (2, "grad weight"), (3, "grad bias")):
        check(f"vocab_stats {k} triton vs torch", rel(outs["triton"][i], outs["torch"][i]), 1e-2)

    # token_logprobs (rollout) = vocab_stats
    lp, ent = logitless.token_logprobs(hid, Head(w, bias=b), tgt, return_entropy=True, **tf)
    check("token_logprobs vs vocab_stats", rel(lp, outs["triton"][0].logp), 1e-6)
    check("token_logprobs entropy vs vocab_stats", rel(ent, outs["triton"][0].entropy), 1e-6)

    # policy_loss: fused vs recompute vs torch backend (dapo, beta, sequence level too)
    bsz, t = 16, n // 16
    ids = tgt.clamp(min=0).reshape(bsz, t)
    mask = (tgt != -100).reshape(bsz, t).float()
    with torch.no_grad():
        cur = logitless.token_logprobs(hid.reshape(bsz, t, h), Head(w, bias=b), ids, **tf)
    old, refl = cur + 0.2 * torch.randn_like(cur), cur + 0.2 * torch.randn_like(cur)
    adv = torch.randn(bsz, device=dev)
    for level in ("token", "sequence"):
        cfg = PolicyConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28, importance_sampling_level=level)
        res = {}
        for impl, mode in (("triton", "fused"), ("triton", "recompute"), ("torch", "fused")):
            hh, ww = hid.reshape(bsz, t, h).clone().requires_grad_(), w.clone().requires_grad_()
            loss, m = logitless.policy_loss(hh, Head(ww, bias=b, transform=LogitTransform(**tf)), ids, mask, adv, old,
                                            refl, config=cfg, options=PassOptions(mode=mode, impl=impl))
            loss.backward()
            res[(impl, mode)] = (loss.detach(), hh.grad, ww.grad, m)
        base = res[("torch", "fused")]
        for key in (("triton", "fused"), ("triton", "recompute")):
            r = res[key]
            check(f"policy_loss[{level}] {key[0]}-{key[1]} loss vs torch", rel(r[0], base[0]), 1e-4)
            check(f"policy_loss[{level}] {key[0]}-{key[1]} grad hidden vs torch", rel(r[1], base[1]), 2e-2)
            check(f"policy_loss[{level}] {key[0]}-{key[1]} grad weight vs torch", rel(r[2], base[2]), 2e-2)
            check(f"policy_loss[{level}] {key[0]}-{key[1]} entropy metric", rel(r[3]["entropy"], base[3]["entropy"]),
                  1e-5)

    # cross_entropy with label smoothing + z-loss (sum_z through the Triton kernels)
    res = {}
    for impl in ("torch", "triton"):
        hh, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
        loss, m = logitless.cross_entropy(hh, Head(ww, bias=b, transform=LogitTransform(**tf)), tgt,
                                          label_smoothing=0.1, z_loss=1e-4, options=PassOptions(impl=impl))
        loss.backward()
        res[impl] = (loss.detach(), hh.grad, ww.grad, m["accuracy"])
    check("cross_entropy loss triton vs torch", rel(res["triton"][0], res["torch"][0]), 1e-5)
    check("cross_entropy grad hidden triton vs torch", rel(res["triton"][1], res["torch"][1]), 2e-2)
    check("cross_entropy grad weight triton vs torch", rel(res["triton"][2], res["torch"][2]), 2e-2)
    check("cross_entropy accuracy triton vs torch", abs(res["triton"][3] - res["torch"][3]).item(), 1e-3)
    print("FAILED:", FAILED if FAILED else "none")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
