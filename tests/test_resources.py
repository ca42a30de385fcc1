"""Determinism and out-of-memory advice of the vocabulary pass (issue #16, items 4 and 5).

CPU parts: same inputs give the same bits across calls on the default path, and a
``torch.OutOfMemoryError`` inside the chunk loop (simulated by monkeypatching the backend)
comes back as :class:`logitless.PassOutOfMemoryError` naming a ``chunk_bytes`` that fits.
The CUDA-marked tests repeat the determinism check on the default Triton path.
"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

import logitless
from logitless import Head, LogitTransform, PassOptions, PassOutOfMemoryError
from logitless.ops import fused
from logitless.ops import plan as planning
from logitless.ops.torch_backend import backend as torch_backend

SEED = int(os.environ.get("LOGITLESS_TEST_SEED") or random.SystemRandom().randrange(2**31))


def _inputs(device="cpu", n=300, vocab=1001, hid=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(SEED)
    h = torch.randn(n, hid, generator=g).to(device, dtype)
    w = (torch.randn(vocab, hid, generator=g) / hid**0.5).to(device, dtype)
    b = torch.randn(vocab, generator=g).to(device, dtype)
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    return h, w, b, t


def _all_outputs(h, w, b, t, options=None):
    """Forward and gradient bits of vocab_stats, cross_entropy and policy_loss."""
    outs = []
    hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
    head = Head(ww, bb, LogitTransform(temperature=0.7, softcap=20.0))
    st = logitless.vocab_stats(hh, head, t, options=options)
    (st.logp.sum() + st.entropy.square().sum()).backward()
    outs += [st.logp, st.lse, st.entropy, hh.grad, ww.grad, bb.grad]
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = logitless.cross_entropy(hh, ww, t, label_smoothing=0.1, z_loss=1e-4, options=options)
    loss.backward()
    outs += [loss, hh.grad, ww.grad]
    bsz = h.shape[0] // 3
    hh, ww = h[: 3 * bsz].reshape(bsz, 3, -1).clone().requires_grad_(), w.clone().requires_grad_()
    ids = t[: 3 * bsz].reshape(bsz, 3)
    loss, _ = logitless.policy_loss(hh, ww, ids, torch.ones_like(ids), torch.linspace(-1, 1, bsz, device=h.device),
                                    torch.full(ids.shape, -7.0, device=h.device), options=options)
    loss.backward()
    outs += [loss, hh.grad, ww.grad]
    return [x.detach().clone() for x in outs]


def _assert_same_bits(a, b):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x.reshape(-1).view(torch.uint8) if x.dtype.is_floating_point else x,
                           y.reshape(-1).view(torch.uint8) if y.dtype.is_floating_point else y), \
            f"output {i} differs, seed {SEED}"


@pytest.mark.parametrize("chunk_bytes", [None, 20_000])
def test_default_path_is_bitwise_repeatable_on_cpu(chunk_bytes):
    h, w, b, t = _inputs()
    opts = None if chunk_bytes is None else PassOptions(chunk_bytes=chunk_bytes)
    first = _all_outputs(h, w, b, t, opts)
    _assert_same_bits(first, _all_outputs(h, w, b, t, opts))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_default_triton_path_is_bitwise_repeatable_on_cuda(dtype):
    """The default path on a GPU (impl="auto" → Triton: cuBLAS GEMMs + row kernels, no atomics)."""
    h, w, b, t = _inputs("cuda", n=4096, vocab=32003, hid=512, dtype=dtype)
    first = _all_outputs(h, w, b, t)
    for _ in range(2):
        _assert_same_bits(first, _all_outputs(h, w, b, t))


def _fake_device_limit(monkeypatch, limit):
    """Make the torch backend raise a CUDA-style OOM whenever a chunk's workspace exceeds ``limit``."""
    forward = torch_backend.chunk_forward

    def limited(head, rows, plan, want, keep_logits):
        if rows.hidden.shape[0] * plan.vocab_block * plan.bytes_per_logit > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(head, rows, plan, want, keep_logits)

    monkeypatch.setattr(torch_backend, "chunk_forward", limited)


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_oom_inside_the_pass_names_a_chunk_bytes_that_fits(monkeypatch, mode):
    h, w, _b, t = _inputs(n=257, vocab=997)
    ref = logitless.cross_entropy(h, w, t, options=PassOptions(mode=mode))[0]
    _fake_device_limit(monkeypatch, limit=150_000)
    opts, tries = PassOptions(mode=mode, impl="torch", chunk_bytes=2**30), 0
    while True:
        try:
            loss = logitless.cross_entropy(h.requires_grad_(), w, t, options=opts)[0]
            loss.backward()
            break
        except PassOutOfMemoryError as exc:
            assert isinstance(exc, torch.OutOfMemoryError)
            assert isinstance(exc.__cause__, torch.OutOfMemoryError)
            msg = str(exc)
            assert f"chunk_bytes={opts.chunk_bytes:,}" in msg and f"{exc.workspace:,} bytes" in msg, msg
            suggested = int(re.search(r"PassOptions\(chunk_bytes=(\d+)\)", msg).group(1))
            assert suggested == exc.suggested_chunk_bytes < exc.workspace
            opts, tries = PassOptions(mode=mode, impl="torch", chunk_bytes=suggested), tries + 1
            assert tries <= 8, "the advice does not converge"
        finally:
            h.grad = None
    assert tries >= 1
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-6, atol=1e-6)


def test_workspace_larger_than_the_device_is_refused_before_allocating(monkeypatch):
    h, w, _b, t = _inputs(n=64, vocab=101)
    monkeypatch.setattr(planning, "free_device_bytes", lambda device, driver_free=None: 10_000)
    called = []
    monkeypatch.setattr(torch_backend, "chunk_forward", lambda *a, **k: called.append(1))
    with pytest.raises(PassOutOfMemoryError, match=r"refused before allocating.*PassOptions\(chunk_bytes=") as info:
        logitless.vocab_stats(h, w, t)
    assert (info.value.free == 10_000 and info.value.suggested_chunk_bytes <= 10_000 // 2) or \
        info.value.suggested_chunk_bytes == planning._MIN_SUGGESTION
    assert not called
    # Within the device's memory it runs.
    monkeypatch.setattr(planning, "free_device_bytes", lambda device, driver_free=None: 2**40)
    monkeypatch.undo()
    logitless.vocab_stats(h, w, t)
    assert fused.check_workspace_fits is planning.check_workspace_fits


@pytest.mark.parametrize("impl", ["torch", "triton", "flash", "gemm"])
def test_fp16_input_precision_overflow_is_an_error(impl):
    """fp16 with logits_precision="input" and logits beyond ±65504 used to give NaN log-probs."""
    if impl != "torch" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or the interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    h, w, _b, t = _inputs(device, n=16, vocab=13, hid=8, dtype=torch.float16)
    h, w = h * 1e4, w * 4  # logits of a few 1e4: beyond fp16 in some rows
    for mode in ("fused", "recompute"):
        with pytest.raises(ValueError, match="logits_precision='fp32'"):
            logitless.cross_entropy(h.clone().requires_grad_(), w, t,
                                    options=PassOptions(mode=mode, impl=impl, logits_precision="input"))
    st = logitless.vocab_stats(h, w, t, options=PassOptions(impl=impl, logits_precision="fp32"))
    assert torch.isfinite(st.logp).all() and torch.isfinite(st.entropy).all()
