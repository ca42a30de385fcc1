"""The fused mode's backward multiplies the gradients it computed in the forward by the loss's
incoming gradient without reading that scalar on the host: in place, by a kernel that does nothing
when it is 1. Checked against float64 on the CPU (the kernel under Triton's interpreter), and on
the GPU under ``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import os

import pytest
import torch

from logitless import Head, PassOptions, PolicyConfig, cross_entropy, policy_loss

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                 reason="the kernel runs on CPU tensors under TRITON_INTERPRET=1")


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 4096, 10007])
def test_scale_kernel_skips_one_and_rounds_once(seed, dtype, n):
    from logitless.ops.triton_shared.scale import scale_unless_one_

    x = torch.randn(n, dtype=torch.float64).to(dtype)
    before = x.clone()
    assert torch.equal(scale_unless_one_(x, torch.tensor(1.0)), before)
    s = float(torch.empty(()).uniform_(-3, 3))
    scale_unless_one_(x, torch.tensor(s))
    assert torch.equal(x, (before.double() * torch.tensor(s, dtype=torch.float32).double()).to(torch.float32).to(dtype))


def _grpo(hidden, head, n_seq, t, options):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, head.weight.shape[0], (n_seq, t), generator=g).to(hidden.device)
    mask = torch.rand(n_seq, t, generator=g).to(hidden.device) > 0.2
    adv = torch.randn(n_seq, generator=g).to(hidden.device)
    old = -torch.rand(n_seq, t, generator=g).to(hidden.device)
    return policy_loss(hidden.view(n_seq, t, -1), head, ids, mask, adv, old_logp=old, config=PolicyConfig(),
                       options=options)[0]


def _ce(hidden, head, n_seq, t, options):
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, head.weight.shape[0], (n_seq, t), generator=g).to(hidden.device)
    return cross_entropy(hidden.view(n_seq, t, -1), head, ids, options=options)[0]


@pytest.mark.parametrize("loss_fn", [_grpo, _ce])
@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backward_does_not_synchronize(loss_fn, mode):
    """``loss.backward()`` and ``(s · loss).backward()`` after the forward: no host sync (the
    forward's own checks may synchronize), and the gradients equal float64 within bf16 error."""
    torch.manual_seed(0)
    n_seq, t, h, v = 8, 512, 1024, 32000
    w = (torch.randn(v, h, device="cuda") / h**0.5).bfloat16().requires_grad_()
    x = torch.randn(n_seq * t, h, device="cuda").bfloat16().requires_grad_()
    options = PassOptions(mode=mode)
    grads = []
    for scale in (1.0, -0.37):
        loss = loss_fn(x, Head(w), n_seq, t, options) * scale
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        grads.append((x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loss_fn(x64, Head(w64), n_seq, t, PassOptions(impl="torch")).backward()
    for scale, (gx, gw) in zip((1.0, -0.37), grads, strict=True):
        for got, want in ((gx, x64.grad), (gw, w64.grad)):
            err = ((got.double() - scale * want).norm() / (scale * want).norm()).item()
            assert err < 1e-2, err
