"""Distillation on the GEMM-epilogue and CuTe backends vs the torch functions and float64: the
GEMM-epilogue kernels under the Triton interpreter (in a child pytest, as the other kernel
modules); ``cuda``-marked tests run the same cases and a larger one on the compiled kernels of
both backends (CuTe on sm90 with the CuTe DSL).

``distill_loss`` on bf16 heads against the same call on the torch functions (bf16) and on float64
inputs: ``|ours - fp64| <= |torch - fp64| + tol`` for the loss, every metric and the student's
gradients.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from interpreter import INTERPRETED, child_run, interpreted

from logitless import DistillConfig, Head, LogitTransform, PassOptions, distill_loss
from logitless.ops.contract import cute_runs_on
from logitless.ops.triton_shared import distill_tiles

pytest.importorskip("triton")

test_under_interpreter = child_run(__file__)
CUTE = torch.cuda.is_available() and not INTERPRETED and cute_runs_on(torch.device("cuda"))

# Interpreter tiles are 32 entries wide: V = 203 is 7 tiles with an 11-entry tail; a 70-entry
# vocabulary block (chunk_bytes below) ends inside a tile.
N, H, HT, V = 37, 48, 40, 203
BLOCKS = N * 4 * 70  # two fp16 tiles of 70 entries per token: three vocabulary blocks

CASES = [
    # divergence, beta, ce_weight, transforms, mode, chunk_bytes
    ("forward_kl", 0.5, 0.0, False, "fused", None),
    ("forward_kl", 0.5, 0.0, "temperature", "fused", None),
    ("generalized_jsd", 0.0, 0.0, "temperature", "fused", None),
    ("reverse_kl", 0.5, 0.5, True, "recompute", BLOCKS),
    ("generalized_jsd", 0.5, 0.3, True, "fused", None),
    ("generalized_jsd", 0.3, 0.0, False, "recompute", None),
    ("forward_kl", 0.5, 0.7, True, "fused", BLOCKS),
    ("generalized_jsd", 0.7, 0.0, True, "fused", BLOCKS),
]


def _case(transforms: bool | str, seed: int = 0, n: int = N):
    """``transforms``: biases and a soft-capped student; ``"temperature"``: temperatures only;
    ``"scale"``: a student logit scale and temperatures."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, H, generator=g)
    ws = torch.randn(V, H, generator=g) * 2.5 / H**0.5
    ht = hs[:, :HT] * 0.8 + 0.4 * torch.randn(n, HT, generator=g)
    wt = ws[:, :HT] * 1.2 + 0.3 * torch.randn(V, HT, generator=g) / HT**0.5
    full = transforms is True
    bs, bt = (torch.randn(V, generator=g) * 0.5, torch.randn(V, generator=g) * 0.5) if full else (None, None)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[::9] = -100
    mask = (torch.rand(n, generator=g) < 0.85).long()
    ts = {True: LogitTransform(temperature=0.8, softcap=6.0), "temperature": LogitTransform(temperature=0.7),
          "scale": LogitTransform(logit_scale=1.7, temperature=0.7)}.get(transforms, LogitTransform())
    tt = LogitTransform(temperature=1.2) if transforms else LogitTransform()
    return hs, ws, bs, ts, ht, wt, bt, tt, labels, mask


def _run(case, dtype, cfg, options, masked: bool = True):
    hs, ws, bs, ts, ht, wt, bt, tt, labels, mask = case
    mask = mask if masked else None
    leaves = [x.to(dtype).requires_grad_() for x in (hs, ws) + ((bs,) if bs is not None else ())]
    teacher = Head(wt.to(dtype), None if bt is None else bt.to(dtype), tt)
    loss, metrics = distill_loss(leaves[0], Head(leaves[1], leaves[2] if bs is not None else None, ts),
                                 ht.to(dtype), teacher, mask=mask, targets=labels if cfg.ce_weight else None,
                                 config=cfg, options=options)
    grads = torch.autograd.grad(loss, leaves)
    return [loss.detach().double()], {k: v.detach().double() for k, v in metrics.items()}, [g.double() for g in grads]


def _assert_close(ours, ref, exact):
    """``|ours - fp64| <= |ref - fp64| + tol`` for the loss, every metric and the gradients."""
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


def _check_case(monkeypatch, impl: str, row: tuple, device: str = "cpu", masked: bool = True, n: int = N,
                one_read: int | None = None):
    """One case of :data:`CASES` (``row``) on ``impl``'s distillation kernels against the torch
    functions (bf16) and float64. ``one_read``: how many chunks must take the forward KL's one read
    (else it follows from the case: the forward KL's gradient alone, whole rows kept, no soft-cap
    or bias)."""
    divergence, beta, ce_weight, transforms, mode, chunk_bytes = row
    module = importlib.import_module(f"logitless.ops.{impl}_backend.distill")
    calls = []
    real = module.chunk_forward
    monkeypatch.setattr(module, "chunk_forward", lambda *a, **k: calls.append("chunk") or real(*a, **k))
    for name in ("launch_cross", "launch_forward_kl"):  # which way the cross sums are taken
        launch = getattr(distill_tiles, name)
        monkeypatch.setattr(distill_tiles, name, lambda *a, _f=launch, _n=name, **k: calls.append(_n) or _f(*a, **k))
    case = [x if x is None or isinstance(x, LogitTransform) else x.to(device) for x in _case(transforms, n=n)]
    cfg = DistillConfig(divergence=divergence, beta=beta, ce_weight=ce_weight)
    ours = _run(case, torch.bfloat16, cfg, PassOptions(mode=mode, impl=impl, chunk_bytes=chunk_bytes), masked)
    assert "chunk" in calls, f"the pass did not run on the {impl} kernels"
    if one_read is None:
        one_read = int(cfg.kind == "forward_kl" and ce_weight == 0 and transforms is not True and mode == "fused"
                       and chunk_bytes is None)
    assert (calls.count("launch_forward_kl"), "launch_cross" in calls) == (one_read, not one_read), calls
    ref = _run(case, torch.bfloat16, cfg, PassOptions(mode=mode, impl="torch", chunk_bytes=chunk_bytes), masked)
    exact = _run(case, torch.float64, cfg, PassOptions(mode=mode, impl="torch"), masked)
    _assert_close(ours, ref, exact)


@interpreted
@pytest.mark.parametrize("row", CASES, ids=str)
def test_matches_torch_and_float64(monkeypatch, row):
    _check_case(monkeypatch, "gemm", row)


@interpreted
def test_forward_kl_in_one_read_over_chunks_without_a_mask(monkeypatch):
    """The one read where it is built for: every position counted (no mask: the value checks are
    read after the pass), a logit scale and temperatures, and three row chunks of at most 256 tokens
    (each kept whole, ``d weight`` added over them in the bf16 pair)."""
    from logitless.ops import plan

    # The gemm plan's floor of 1024 rows a chunk (a GPU's size) would need over 2048 rows for three
    # chunks, which the interpreter's one-read kernel (a program per row) takes minutes over; at a
    # 256-row floor the same three chunks (256, 256 and a 188-row tail) take 700 rows.
    monkeypatch.setitem(plan._MIN_TOKENS, "gemm", 256)
    chunk_bytes = 256 * 4 * V  # both fp16 tiles of 256 rows: three chunks of 700 rows
    _check_case(monkeypatch, "gemm", ("forward_kl", 0.5, 0.0, "scale", "fused", chunk_bytes), masked=False, n=700,
                one_read=3)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("impl", ["gemm", "cute"])
@pytest.mark.parametrize("row", CASES, ids=str)
def test_gpu_cases(monkeypatch, impl, row):
    """The interpreter's cases on the compiled kernels (the CuTe backend's where it runs)."""
    if impl == "cute" and not CUTE:
        pytest.skip("needs an sm90 GPU and the CuTe DSL")
    _check_case(monkeypatch, impl, row, "cuda")


@interpreted
def test_forward_kl_only_refuses_other_gradients():
    """A pass made for the forward KL's gradient alone formed ``p - q`` in its forward: a loss
    that also reads the entropy gets a named error, not a wrong gradient."""
    from logitless.ops.distill import DistillPass, run_distill

    hs, ws, _, _, ht, wt, _, _, _, _ = _case(False)
    h = hs.bfloat16().requires_grad_()
    head = Head(ws.bfloat16())
    opts = PassOptions(impl="gemm", mode="fused")
    p = DistillPass.make(h, head, torch.zeros((N, 0), dtype=torch.long), ht.bfloat16(), Head(wt.bfloat16()), None,
                         opts, forward_kl_only=True)
    assert p.heads.forward_kl_only
    with pytest.raises(RuntimeError, match="forward_kl_only"):  # fused: the gradient is taken in the call
        run_distill(p, lambda sl, st: ((st.forward_kl + 0.1 * st.entropy).sum(), None), h, head, opts)


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
@pytest.mark.parametrize("impl", ["gemm", "cute"])
@pytest.mark.parametrize("divergence", ["forward_kl", "generalized_jsd"])
def test_gpu_matches_torch(impl, divergence):
    """Compiled kernels at a real tile size, V not a multiple of the tiles: loss and metrics within
    1e-4 of float64 (relative), gradients as close to float64 as the torch functions' bf16 path."""
    if impl == "cute" and not CUTE:
        pytest.skip("needs an sm90 GPU and the CuTe DSL")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 1000, 512, 5003
    hs = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    ws = (torch.randn(v, h, device="cuda", generator=g) * 2 / h**0.5).bfloat16()
    ht = (hs.float() + 0.3 * torch.randn(n, h, device="cuda", generator=g)).bfloat16()
    wt = (ws.float() + 0.3 * torch.randn(v, h, device="cuda", generator=g) / h**0.5).bfloat16()
    cfg = DistillConfig(divergence=divergence, beta=0.5)
    out = {}
    for name, dtype, run_on in (("ours", torch.bfloat16, impl), ("torch", torch.bfloat16, "torch"),
                                ("fp64", torch.float64, "torch")):
        hh, ww = hs.to(dtype).clone().requires_grad_(), ws.to(dtype).clone().requires_grad_()
        loss, _ = distill_loss(hh, ww, ht.to(dtype), wt.to(dtype), config=cfg, options=PassOptions(impl=run_on))
        loss.backward()
        out[name] = (loss.double(), hh.grad.double(), ww.grad.double())
    assert abs(out["ours"][0] - out["fp64"][0]) <= 1e-4 * abs(out["fp64"][0])
    for i in (1, 2):
        err = (out["ours"][i] - out["fp64"][i]).norm() / out["fp64"][i].norm()
        ref = (out["torch"][i] - out["fp64"][i]).norm() / out["fp64"][i].norm()
        assert err <= ref + 5e-3, (i, err.item(), ref.item())
