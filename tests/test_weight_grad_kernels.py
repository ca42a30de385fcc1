"""The pair ``d weight`` GEMM (bf16 result, int8 residual: ``ops.triton_shared.weight_grad``)
against float64, under the Triton interpreter (a child pytest with ``TRITON_INTERPRET=1``, as in
``test_gemm_backend.py``) and, where CUDA exists, compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interpreter import INTERPRETED, child_run, interpreted

pytest.importorskip("triton")

test_under_interpreter = child_run(__file__)


def _chunks(sizes, vocab, hidden_size, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    dys = [(torch.randn(n, vocab, device=device, generator=g) * 1e-2).to(torch.bfloat16) for n in sizes]
    hs = [torch.randn(n, hidden_size, device=device, generator=g).to(torch.bfloat16) for n in sizes]
    return dys, hs


def _pair_value(hi, lo):
    """The pair's sum in float64: ``lo`` counts units of ``2**(e - 14)``, ``e`` the binary exponent
    of ``hi`` (``hi = f 2**e'`` with ``f`` in [0.5, 1) is ``e = e' - 1``; no smaller than -126)."""
    exponent = torch.frexp(hi.double()).exponent - 1
    return hi.double() + lo.double() * torch.exp2((exponent.clamp(min=-126 + 14) - 14).double())


def _check_pair(hi, lo, want):
    """The pair's sum carries ~15 significant bits (a bf16 result is off by up to 2**-9 of
    itself); ``hi`` is a bf16 within one rounding of it, ``lo`` at most half an ulp of ``hi``."""
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int8
    scale = want.abs().max()
    total = _pair_value(hi, lo)
    assert (total - want).abs().max() <= 2.0**-13 * scale
    assert ((hi.double() - total).abs() <= 2.0**-8 * total.abs() + 1e-30).all()  # hi = bf16(sum)
    assert (lo.abs() <= 64).all()  # a residual, not a second sum


def _poisoned_pair(vocab, hidden_size, device="cpu"):
    """An uninitialized pair: NaN and a count far outside a residual's."""
    return (torch.full((vocab, hidden_size), float("nan"), dtype=torch.bfloat16, device=device),
            torch.full((vocab, hidden_size), -101, dtype=torch.int8, device=device))


@interpreted
@pytest.mark.parametrize("loads", ["tma", "pair-tma", "pointer"])
@pytest.mark.parametrize("shape", [(72, 48), (203, 40)])  # descriptor-aligned; a tail tile and H step
def test_pair_sums_chunks_against_float64(loads, shape):
    """Three chunks (37, 50 and 16 tokens: tails of the 16-token steps) stored then added into an
    uninitialized (NaN) pair; the descriptors are emulated by the interpreter, and tensors whose
    rows are not 16-byte aligned fall back to pointers."""
    from logitless.ops.triton_shared.weight_grad import launch_weight_grad, weight_grad_config

    vocab, hidden_size = shape
    cfg = dataclasses.replace(weight_grad_config(), tma=loads != "pointer", pair_tma=loads == "pair-tma")
    dys, hs = _chunks((37, 50, 16), vocab, hidden_size, "cpu", seed=vocab)
    hi, lo = _poisoned_pair(vocab, hidden_size)
    want = torch.zeros(vocab, hidden_size, dtype=torch.float64)
    for i, (dy, h) in enumerate(zip(dys, hs, strict=True)):
        launch_weight_grad(dy, h, hi, lo, i == 0, cfg)
        want += dy.double().t() @ h.double()
        _check_pair(hi, lo, want)


@interpreted
@pytest.mark.parametrize("loads", ["pair-tma", "pointer"])
def test_last_chunk_stores_the_result_alone(loads):
    """With ``last`` the chunk's ``hi`` is bit for bit the one it stores without (the nearest bf16
    to the pair's sum, against float64 as above), and the residual is left as it was."""
    from logitless.ops.triton_shared.weight_grad import launch_weight_grad, weight_grad_config

    vocab, hidden_size = 72, 48
    cfg = dataclasses.replace(weight_grad_config(), tma=loads != "pointer", pair_tma=loads == "pair-tma")
    dys, hs = _chunks((37, 50), vocab, hidden_size, "cpu", seed=5)
    results = {}
    for last in (False, True):
        hi, lo = _poisoned_pair(vocab, hidden_size)
        launch_weight_grad(dys[0], hs[0], hi, lo, True, cfg)
        before = lo.clone()
        launch_weight_grad(dys[1], hs[1], hi, lo, False, cfg, last=last)
        results[last] = hi
        if last:
            assert torch.equal(lo, before)
        else:
            _check_pair(hi, lo, sum(dy.double().t() @ h.double() for dy, h in zip(dys, hs, strict=True)))
    assert torch.equal(results[True], results[False])


@interpreted
def test_pair_of_a_vocabulary_block_view():
    """``hi``/``lo`` rows of a block of a larger buffer (the engine's vocabulary blocks), ``dy`` a
    column block of a wider tile: only the block's rows change."""
    from logitless.ops.triton_shared.weight_grad import launch_weight_grad

    dys, hs = _chunks((29,), 96, 32, "cpu", seed=1)
    hi = torch.randn(120, 32).to(torch.bfloat16)
    lo = torch.randint(-64, 65, hi.shape, dtype=torch.int8)
    before, lo_before = hi.clone(), lo.clone()
    launch_weight_grad(dys[0][:, 16:64], hs[0], hi[40:88], lo[40:88], True)
    _check_pair(hi[40:88], lo[40:88], dys[0][:, 16:64].double().t() @ hs[0].double())
    assert torch.equal(hi[:40], before[:40]) and torch.equal(hi[88:], before[88:])
    assert torch.equal(lo[:40], lo_before[:40]) and torch.equal(lo[88:], lo_before[88:])


@interpreted
def test_empty_chunk_stores_zeros_and_adds_nothing():
    from logitless.ops.triton_shared.weight_grad import launch_weight_grad

    dys, hs = _chunks((0, 9), 40, 16, "cpu", seed=2)
    hi, lo = _poisoned_pair(40, 16)
    launch_weight_grad(dys[0], hs[0], hi, lo, True)
    assert torch.all(hi == 0) and torch.all(lo == 0)
    launch_weight_grad(dys[1], hs[1], hi, lo, False)
    launch_weight_grad(dys[0], hs[0], hi, lo, False)
    _check_pair(hi, lo, dys[1].double().t() @ hs[1].double())


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("vocab", [5056, 5003])  # descriptors; pointers (rows not 16-byte aligned)
def test_gpu_pair_against_float64(vocab):
    """The compiled kernel (tensor cores) at sizes that are not multiples of its tiles, three chunks."""
    from logitless.ops.triton_shared.weight_grad import launch_weight_grad

    hidden_size = 520
    dys, hs = _chunks((1000, 777, 64), vocab, hidden_size, "cuda", seed=3)
    hi, lo = _poisoned_pair(vocab, hidden_size, "cuda")
    want = torch.zeros(vocab, hidden_size, dtype=torch.float64, device="cuda")
    for i, (dy, h) in enumerate(zip(dys, hs, strict=True)):
        launch_weight_grad(dy, h, hi, lo, i == 0)
        want += dy.double().t() @ h.double()
    _check_pair(hi, lo, want)
