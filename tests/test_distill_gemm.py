"""Distillation on the GEMM-epilogue kernels vs the torch functions and float64, under the Triton
interpreter (in a child pytest, as the other kernel modules; ``test_gpu_matches_torch`` runs the
compiled kernels where CUDA exists).

``distill_loss`` with ``impl="gemm"`` on bf16 heads against the same call on the torch functions
(bf16) and on float64 inputs: ``|gemm - fp64| <= |torch - fp64| + tol`` for the loss, every metric
and the student's gradients.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import INTERPRETED, child_run, interpreted

from logitless import DistillConfig, Head, LogitTransform, PassOptions, distill_loss

pytest.importorskip("triton")

test_under_interpreter = child_run(__file__)

# Interpreter tiles are 32 entries wide: V = 203 is 7 tiles with an 11-entry tail; a 70-entry
# vocabulary block (chunk_bytes below) ends inside a tile.
N, H, HT, V = 37, 48, 40, 203
BLOCKS = N * 4 * 70  # two fp16 tiles of 70 entries per token: three vocabulary blocks

CASES = [
    # divergence, beta, ce_weight, transforms, mode, chunk_bytes
    ("forward_kl", 0.5, 0.0, False, "fused", None),
    ("reverse_kl", 0.5, 0.5, True, "recompute", BLOCKS),
    ("generalized_jsd", 0.5, 0.3, True, "fused", None),
    ("generalized_jsd", 0.3, 0.0, False, "recompute", None),
    ("forward_kl", 0.5, 0.7, True, "fused", BLOCKS),
    ("generalized_jsd", 0.7, 0.0, True, "fused", BLOCKS),
]


def _case(transforms: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, H, generator=g)
    ws = torch.randn(V, H, generator=g) * 2.5 / H**0.5
    ht = hs[:, :HT] * 0.8 + 0.4 * torch.randn(N, HT, generator=g)
    wt = ws[:, :HT] * 1.2 + 0.3 * torch.randn(V, HT, generator=g) / HT**0.5
    bs, bt = (torch.randn(V, generator=g) * 0.5, torch.randn(V, generator=g) * 0.5) if transforms else (None, None)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::9] = -100
    mask = (torch.rand(N, generator=g) < 0.85).long()
    ts = LogitTransform(temperature=0.8, softcap=6.0) if transforms else LogitTransform()
    tt = LogitTransform(temperature=1.2) if transforms else LogitTransform()
    return hs, ws, bs, ts, ht, wt, bt, tt, labels, mask


def _run(case, dtype, cfg, options):
    hs, ws, bs, ts, ht, wt, bt, tt, labels, mask = case
    leaves = [x.to(dtype).requires_grad_() for x in (hs, ws) + ((bs,) if bs is not None else ())]
    teacher = Head(wt.to(dtype), None if bt is None else bt.to(dtype), tt)
    loss, metrics = distill_loss(leaves[0], Head(leaves[1], leaves[2] if bs is not None else None, ts),
                                 ht.to(dtype), teacher, mask=mask, targets=labels if cfg.ce_weight else None,
                                 config=cfg, options=options)
    grads = torch.autograd.grad(loss, leaves)
    return [loss.detach().double()], {k: v.detach().double() for k, v in metrics.items()}, [g.double() for g in grads]


@interpreted
@pytest.mark.parametrize(("divergence", "beta", "ce_weight", "transforms", "mode", "chunk_bytes"), CASES)
def test_matches_torch_and_float64(monkeypatch, divergence, beta, ce_weight, transforms, mode, chunk_bytes):
    from logitless.ops.gemm_backend import distill as distill_gemm

    calls = []
    real = distill_gemm.chunk_forward
    monkeypatch.setattr(distill_gemm, "chunk_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    case = _case(transforms)
    cfg = DistillConfig(divergence=divergence, beta=beta, ce_weight=ce_weight)
    ours = _run(case, torch.bfloat16, cfg, PassOptions(mode=mode, impl="gemm", chunk_bytes=chunk_bytes))
    assert calls, "the pass did not run on the gemm kernels"
    ref = _run(case, torch.bfloat16, cfg, PassOptions(mode=mode, impl="torch", chunk_bytes=chunk_bytes))
    exact = _run(case, torch.float64, cfg, PassOptions(mode=mode, impl="torch"))
    for what, tol in (("loss", 1e-4), ("metrics", 1e-4), ("grads", 2e-2)):
        i = ("loss", "metrics", "grads").index(what)
        a, b, c = ours[i], ref[i], exact[i]
        if what == "metrics":
            assert a.keys() == c.keys()
            a, b, c = ([d[k] for k in sorted(c)] for d in (a, b, c))
        for x, y, z, name in zip(a, b, c, range(len(c)), strict=True):
            # Gradients relative to their own largest entry; statistics (nats) at least absolutely.
            scale = z.abs().max() if what == "grads" else z.abs().max().clamp_min(1.0)
            bound = (y - z).abs() + tol * scale
            assert torch.all((x - z).abs() <= bound), f"{what}[{name}]: {((x - z).abs() - bound).max():.3e} over"


@interpreted
def test_scope():
    """Top-k teacher ids (several target columns), fp32 heads, a teacher of another dtype than the
    student's and a backend without distillation kernels (``impl="triton"``) run on the torch
    functions, through the resolver."""
    from logitless.ops.distill import DistillPass
    from logitless.ops.gemm_backend import distill as gemm_distill
    from logitless.ops.torch_backend import distill as torch_distill

    hs, ws, _, _, ht, wt, _, _, labels, _ = _case(False)
    opts = PassOptions(impl="gemm")
    one = DistillPass.make(hs.bfloat16(), Head(ws.bfloat16()), labels.clamp_min(0)[:, None], ht.bfloat16(),
                           Head(wt.bfloat16()), None, opts)
    two = DistillPass.make(hs.bfloat16(), Head(ws.bfloat16()), torch.stack([labels, labels], 1).clamp_min(0),
                           ht.bfloat16(), Head(wt.bfloat16()), None, opts)
    f32 = DistillPass.make(hs, Head(ws), labels.clamp_min(0)[:, None], ht, Head(wt), None, opts)
    assert [p.backend is gemm_distill for p in (one, two, f32)] == [True, False, False]
    assert one.plan.bytes_per_logit == 4
    mixed = DistillPass.make(hs.bfloat16(), Head(ws.bfloat16()), labels.clamp_min(0)[:, None], ht.half(),
                             Head(wt.half()), None, opts)
    triton = DistillPass.make(hs.bfloat16(), Head(ws.bfloat16()), labels.clamp_min(0)[:, None], ht.bfloat16(),
                              Head(wt.bfloat16()), None, PassOptions(impl="triton"))
    assert mixed.backend is torch_distill and triton.backend is torch_distill
    assert (one.stores_weight_grad, triton.stores_weight_grad) == (True, False)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("divergence", ["forward_kl", "generalized_jsd"])
def test_gpu_matches_torch(divergence):
    """Compiled kernels at a real tile size, V not a multiple of the tiles: loss and metrics within
    1e-4 of float64 (relative), gradients as close to float64 as the torch functions' bf16 path."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 1000, 512, 5003
    hs = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    ws = (torch.randn(v, h, device="cuda", generator=g) * 2 / h**0.5).bfloat16()
    ht = (hs.float() + 0.3 * torch.randn(n, h, device="cuda", generator=g)).bfloat16()
    wt = (ws.float() + 0.3 * torch.randn(v, h, device="cuda", generator=g) / h**0.5).bfloat16()
    cfg = DistillConfig(divergence=divergence, beta=0.5)
    out = {}
    for name, dtype, impl in (("gemm", torch.bfloat16, "gemm"), ("torch", torch.bfloat16, "torch"),
                              ("fp64", torch.float64, "torch")):
        hh, ww = hs.to(dtype).clone().requires_grad_(), ws.to(dtype).clone().requires_grad_()
        loss, _ = distill_loss(hh, ww, ht.to(dtype), wt.to(dtype), config=cfg, options=PassOptions(impl=impl))
        loss.backward()
        out[name] = (loss.double(), hh.grad.double(), ww.grad.double())
    assert abs(out["gemm"][0] - out["fp64"][0]) <= 1e-4 * abs(out["fp64"][0])
    for i in (1, 2):
        err = (out["gemm"][i] - out["fp64"][i]).norm() / out["fp64"][i].norm()
        ref = (out["torch"][i] - out["fp64"][i]).norm() / out["fp64"][i].norm()
        assert err <= ref + 5e-3, (i, err.item(), ref.item())
