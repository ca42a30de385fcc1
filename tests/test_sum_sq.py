"""``log Σ_v p_v²`` (``StatRequest(sum_sq=True)``, ``ChunkStats.log_sum_sq_probs``: TRL's
``log_sum_sq_probs``, WPO's weight) through the engine, on every backend that declares it, against
float64 materialized logits.

The backend kernels' own partials are tested beside ``sum_z`` in the backend modules
(``test_triton_backend.py``, ``test_flash_backend.py``, ``test_gemm_backend.py``); here the
engine's merges are: several token chunks and vocabulary blocks (the rescale by the squared max
difference), fused and recompute modes, a vocabulary split over ranks, and the statistic's lack of
a gradient.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from backend_calls import forward
from interpreter import INTERPRETED

from logitless import Head, LogitTransform, PassOptions
from logitless.ops import ObjectiveSpec, StatRequest, run_objective
from logitless.ops.contract import RowStats, resolve_backend

N, H, V = 47, 16, 123
# Several token chunks and vocabulary blocks (the torch backend's blocks of the 6_000-byte budget
# hold a few dozen entries), and the whole call in one block.
CHUNKS = {"blocks": 6_000, "whole": None}
TRANSFORM = LogitTransform(temperature=0.8, logit_scale=1.2, softcap=6.0)
# Backends and the input dtype each runs (the gemm backend takes 16-bit inputs only); the Triton
# backends run under the interpreter on CPU (conftest sets it where no GPU exists).
BACKENDS = {"torch": torch.float64, "triton": torch.float32, "flash": torch.float32, "gemm": torch.bfloat16}
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-5}


def _inputs(dtype):
    hidden = torch.randn(N, H, dtype=torch.float64)
    weight = torch.randn(V, H, dtype=torch.float64) * (3.0 / H**0.5)  # logits of std ~3: neither flat nor one-hot
    bias = torch.randn(V, dtype=torch.float64)
    targets = torch.randint(0, V, (N,))
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), targets


def _oracle(hidden, weight, bias) -> torch.Tensor:
    """float64 ``log Σ_v p_v²`` of the materialized logits, as TRL's tests define it."""
    z = TRANSFORM.apply(hidden.double() @ weight.double().t() + bias.double())
    return torch.logsumexp(2 * torch.log_softmax(z, dim=-1), dim=-1)


@pytest.mark.parametrize("chunk", list(CHUNKS.values()), ids=list(CHUNKS))
@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("impl", list(BACKENDS))
def test_log_sum_sq_probs_vs_fp64(seed, impl, mode, chunk):
    """The statistic matches float64 on every backend and mode; it carries no gradient, and the
    other statistics' gradients are those of a pass that does not compute it."""
    if impl != "torch" and not INTERPRETED:
        pytest.skip("the Triton backends run on CPU tensors under TRITON_INTERPRET=1 (test_gpu.py on a GPU)")
    dtype = BACKENDS[impl]
    hidden, weight, bias, targets = _inputs(dtype)
    g = torch.randn(N, dtype=torch.float64).to(torch.float32 if dtype != torch.float64 else dtype)
    options = PassOptions(mode=mode, impl=impl, chunk_bytes=chunk)
    out = {}
    for sum_sq in (True, False):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]

        def objective(sl, st, g=g):
            if st.log_sum_sq_probs is not None:
                assert not st.log_sum_sq_probs.requires_grad  # WPO's weight takes no gradient (TRL: no_grad)
            return (g[sl] * st.logp).sum(), None

        spec = ObjectiveSpec(want=StatRequest(entropy=False, sum_sq=sum_sq))
        loss, stats, _ = run_objective(leaves[0], Head(leaves[1], leaves[2], TRANSFORM), targets, objective, spec,
                                       options)
        loss.backward()
        out[sum_sq] = stats, [x.grad for x in leaves]
    stats, grads = out[True]
    assert out[False][0].log_sum_sq_probs is None
    lss = stats.log_sum_sq_probs
    assert lss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and lss.shape == (N,)
    torch.testing.assert_close(lss.double(), _oracle(hidden, weight, bias), rtol=0, atol=TOL[dtype])
    for a, b in zip(grads, out[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_log_sum_sq_probs_is_not_differentiable_in_recompute_mode(seed):
    """Recompute mode hands the statistic out of its ``autograd.Function``: marked
    non-differentiable, as TRL's head marks it."""
    from logitless.ops.engine import compute_stats

    hidden, weight, bias, targets = _inputs(torch.float64)
    leaf = hidden.clone().requires_grad_()
    st = compute_stats(leaf, Head(weight, bias, TRANSFORM), targets, StatRequest(sum_sq=True), PassOptions())
    assert st.logp.requires_grad and not st.log_sum_sq_probs.requires_grad
    torch.testing.assert_close(st.log_sum_sq_probs, _oracle(hidden, weight, bias), rtol=0, atol=1e-12)


def test_vocabulary_shards_merge(seed):
    """Partials of disjoint vocabulary ranges (shards, tiles) merge into the whole vocabulary's:
    ``RowStats.combine`` rescales each range's ``Σ e²`` by its squared max difference; an empty
    range (max ``-inf``) adds nothing. (The all-reduce merge, ``RowStats.reduce``, runs in
    ``test_distributed.py``.)"""
    from logitless.ops.plan import ChunkPlan
    from logitless.ops.torch_backend import backend as torch_backend

    hidden, weight, bias, targets = _inputs(torch.float64)
    bounds = [0, 40, 40, 97, V]  # one empty range
    parts = []
    for lo, hi in itertools.pairwise(bounds):
        plan = ChunkPlan(token_chunk=N, vocab_block=max(hi - lo, 1), keep_logits=False, stat_dtype=torch.float64)
        st, _ = forward(torch_backend, hidden, weight[lo:hi], bias[lo:hi], targets - lo, TRANSFORM, plan, False,
                        want_sum_sq=True)
        parts.append(st)
    stacked = {k: torch.stack([getattr(p, f) for p in parts])
               for k, f in (("m", "max_logit"), ("se", "sum_exp"), ("zy", "target_logit"), ("ssq", "sum_exp_sq"))}
    merged = RowStats.combine(stacked, torch.ones(N, dtype=torch.bool))
    torch.testing.assert_close(merged.finalize()[0].log_sum_sq_probs, _oracle(hidden, weight, bias), rtol=0,
                               atol=1e-12)


def test_a_backend_without_the_statistic_is_refused(monkeypatch):
    """A named backend whose capabilities lack ``sum_sq`` (every backend has it today: the torch
    backend's is taken away here) raises a ValueError naming it before any kernel runs."""
    from logitless.ops.torch_backend import backend as torch_backend

    monkeypatch.setattr(torch_backend, "CAPS", dataclasses.replace(torch_backend.CAPS, sum_sq=False))
    h = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"impl='torch': the torch backend does not compute log_sum_sq_probs"):
        resolve_backend("torch", h, want=StatRequest(sum_sq=True))
    assert resolve_backend("torch", h, want=StatRequest(sum_z=True)) is torch_backend


@pytest.mark.skipif(not INTERPRETED, reason="resolves Triton backends for CPU tensors: TRITON_INTERPRET=1 (CPU CI)")
def test_auto_takes_a_backend_with_the_statistic(monkeypatch):
    """Where ``impl="auto"`` would take a backend without ``sum_sq`` (patched away here from the
    gemm backend), a request for the statistic runs on the Triton backend instead of failing."""
    from logitless.ops import contract
    from logitless.ops.gemm_backend import backend as gemm_backend
    from logitless.ops.triton_backend import backend as triton_backend

    monkeypatch.setattr(contract, "auto_impl", lambda device: "gemm")
    monkeypatch.setattr(gemm_backend, "CAPS", dataclasses.replace(gemm_backend.CAPS, sum_sq=False))
    h = torch.randn(2, 3).bfloat16()
    assert resolve_backend("auto", h, want=StatRequest(sum_sq=True)) is triton_backend
    assert resolve_backend("auto", h, want=StatRequest(sum_z=True)) is gemm_backend
