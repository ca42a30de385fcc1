"""The CuTe DSL backend (``PassOptions(impl="cute")``) chunk by chunk against the torch backend
(its specification) and a float64 oracle, on a Hopper GPU; and its refusals anywhere.

CuTe kernels cannot run on a CPU: the ``cuda``-marked cases are skipped without an sm90 GPU and the
CuTe DSL (``scripts/gpu_check.sh`` stages it), the refusals run in CI. The shapes leave a 44-row tail
of the 128-row tile, a 232-entry tail of the 256-wide vocabulary tile, and a hidden size that is not
a multiple of 8 (operands padded for TMA). Errors are bounded by the torch backend's own:
``|ours - fp64| <= |torch - fp64| + tol``. The kernel's two schedules (cooperative, ping-pong)
are compared on a grid with more tiles than CTAs, so each CTA's two warpgroups take turns.
"""

from __future__ import annotations

import pytest
import torch
from backend_calls import backward, forward, log_sum_sq_oracle, log_sum_sq_probs, lse_logp_sum_pz
from test_flash_backend import TRANSFORMS, _assert_bounded

from logitless import PassOptions
from logitless.ops import contract
from logitless.ops.contract import Accumulators, SavedStats, StatGrads
from logitless.ops.plan import ChunkPlan
from logitless.ops.transform import LogitTransform

N, V = 300, 1000
CUTE = torch.cuda.is_available() and contract.cute_runs_on(torch.device("cuda"))
on_hopper = pytest.mark.skipif(not CUTE, reason="needs an sm90 GPU and the CuTe DSL")


def test_refused_where_it_cannot_run(monkeypatch):
    """A named error saying what to do, before any kernel: without the CuTe DSL, and off a Hopper GPU."""
    assert PassOptions(impl="cute").impl == "cute"
    hidden = torch.randn(4, 8)
    monkeypatch.setattr(contract, "cute_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'logitless\[cute\]'"):
        contract.resolve_backend("cute", hidden)
    monkeypatch.setattr(contract, "cute_available", lambda: True)
    with pytest.raises(ValueError, match="Hopper GPUs"):
        contract.resolve_backend("cute", hidden)


@pytest.mark.parametrize(("capability", "cute", "want"), [
    ((9, 0), True, "cute"), ((9, 0), False, "gemm"), ((10, 0), True, "gemm"), ((8, 0), True, "triton")])
def test_auto_picks_cute_on_hopper_where_installed(monkeypatch, capability, cute, want):
    """``impl="auto"`` names the CuTe backend on sm90 with the CuTe DSL installed, the gemm backend
    on other sm90+ GPUs, the Triton one below; distillation, where the CuTe GEMM is no faster,
    then runs on the gemm backend, and on the CuTe one when named."""
    from logitless.ops import distill_contract

    monkeypatch.setattr(contract, "triton_available", lambda: True)
    monkeypatch.setattr(contract, "_capability", lambda device: capability)
    monkeypatch.setattr(contract, "cute_available", lambda: cute)
    cuda = torch.device("cuda", 0)
    assert contract.auto_impl(cuda) == want
    assert contract.auto_impl(torch.device("cpu")) == "torch"
    asked = []
    monkeypatch.setattr(distill_contract, "resolve_backend", lambda impl, hidden: asked.append(impl) or
                        contract.resolve_backend("torch", hidden))
    monkeypatch.setattr(distill_contract, "auto_impl", lambda device: contract.auto_impl(cuda))
    for impl in ("auto", "cute"):
        distill_contract.resolve_distill(impl, torch.randn(4, 8), None, 1)
    assert asked == ["gemm" if want == "cute" else "auto", "cute"]


@on_hopper
@pytest.mark.cuda
def test_auto_resolves_to_cute_on_this_gpu():
    from logitless.ops.cute_backend import backend as cute_backend
    from logitless.ops.cute_backend import distill as cute_distill
    from logitless.ops.distill_contract import resolve_distill
    from logitless.ops.gemm_backend import distill as gemm_distill

    hidden = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    assert contract.resolve_backend("auto", hidden) is cute_backend
    assert resolve_distill("auto", hidden, hidden, 1) is gemm_distill
    assert resolve_distill("cute", hidden, hidden, 1) is cute_distill


def _inputs(dtype, transform_key, hidden_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    kw, has_bias = TRANSFORMS[transform_key]
    h = torch.randn(N, hidden_size, generator=g).to(dtype)
    w = (torch.randn(V, hidden_size, generator=g) * 3 / hidden_size**0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if has_bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[3], t[5], t[299] = V + 2, -1, V  # targets of another vocabulary shard
    return [x if x is None else x.cuda() for x in (h, w, b, t)] + [LogitTransform(**kw)]


def _oracle(h, w, b, t, tr, grads: StatGrads | None = None):
    """fp64 ``(lse, logp, sum_pz, sum_z)`` and, with ``grads``, the gradients of
    ``Σ g_logp logp + g_lse lse + g_ent entropy + g_sz Σz`` w.r.t. ``(h, w[, b])``."""
    leaves = [x.double().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    z = tr.apply(leaves[0] @ leaves[1].t() + (leaves[2] if b is not None else 0))
    lse = torch.logsumexp(z, 1)
    sum_pz = (torch.softmax(z, 1) * z).sum(1)
    owned = (t >= 0) & (t < V)
    logp = torch.where(owned, z.gather(1, t.clamp(0, V - 1)[:, None])[:, 0], 0.0) - lse
    stats = (lse, logp, sum_pz, z.sum(1))
    if grads is None:
        return [s.detach() for s in stats], z.detach()
    terms = ((grads.logp, logp), (grads.lse, lse), (grads.entropy, lse - sum_pz), (grads.sum_z, stats[3]))
    sum(((g.double() * s).sum() for g, s in terms if g is not None), torch.zeros((), device=h.device,
                                                                           dtype=torch.float64)).backward()
    return [s.detach() for s in stats], [x.grad for x in leaves]


def _plan(vocab_block=V, fp32_logits=True):
    return ChunkPlan(token_chunk=N, vocab_block=vocab_block, keep_logits=vocab_block == V, fp32_logits=fp32_logits)


def _backends():
    from logitless.ops.cute_backend import backend as cute_backend
    from logitless.ops.torch_backend import backend as torch_backend

    return cute_backend, torch_backend


@pytest.mark.parametrize(("dtype", "transform_key", "hidden_size"),
                         [(torch.bfloat16, "plain", 72), (torch.bfloat16, "full", 70), (torch.float16, "full", 72)])
@pytest.mark.parametrize("optional", [True, False])
@pytest.mark.cuda
@on_hopper
def test_chunk_forward(dtype, transform_key, hidden_size, optional):
    """Statistics as accurate as the torch backend's fp32 logits; the kept tile is each 256-wide
    tile's logits centred on its row maximum, to fp16's resolution."""
    cute_backend, torch_backend = _backends()
    h, w, b, t, tr = _inputs(dtype, transform_key, hidden_size)
    ours, kept = forward(cute_backend, h, w, b, t, tr, _plan(), optional, keep_logits=True, want_sum_z=optional,
                         want_sum_sq=optional)
    ref, _ = forward(torch_backend, h, w, b, t, tr, _plan(), True, want_sum_z=True, want_sum_sq=True)
    assert (ours.sum_exp_logit is None, ours.sum_logit is None, ours.sum_exp_sq is None) == (not optional,) * 3
    oracle, z64 = _oracle(h, w, b, t, tr)
    assert torch.equal(ours.owned, ref.owned) and torch.all(ours.target_logit[~ours.owned] == 0)
    for i, name in enumerate(("lse", "logp", "sum_pz")[: 3 if optional else 2]):
        _assert_bounded(lse_logp_sum_pz(ours)[i], lse_logp_sum_pz(ref)[i], oracle[i], 1e-5, name)
    if optional:
        _assert_bounded(ours.sum_logit, ref.sum_logit, oracle[3], 1e-5, "sum_z")
        _assert_bounded(log_sum_sq_probs(ours), log_sum_sq_probs(ref), log_sum_sq_oracle(h, w, b, tr), 1e-5,
                        "log_sum_sq_probs")
    tiles = kept.tile_max.shape[0]
    tile_of = torch.arange(V, device=h.device) // 256
    assert kept.z.dtype == torch.float16 and kept.z.shape == (N, V) and tiles == 4 and kept.tile_v == 256
    m64 = torch.stack([z64[:, tile_of == s].max(1).values for s in range(tiles)])
    torch.testing.assert_close(kept.tile_max.double(), m64, rtol=0, atol=1e-4)
    centred = z64 - m64.t()[:, tile_of]
    assert torch.all(kept.z.double() <= 0)
    assert torch.all((kept.z.double() - centred).abs() <= centred.abs() * 2**-10 + 1e-4)


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.cuda
@on_hopper
def test_schedules_agree(store):
    """The cooperative and ping-pong schedules run the same per-tile arithmetic: equal bits in every
    output, on 2000 x 20000 logits (1000+ tiles: every CTA runs several, each warpgroup its turns, and
    the row and vocabulary tails), and ``lse`` within fp32 rounding of float64."""
    from logitless.ops.contract import RowStats, StatRequest
    from logitless.ops.cute_backend import kernels
    from logitless.ops.triton_shared.tile_gemm import TileOperands

    n, vocab, hidden_size = 2000, 20000, 136
    g = torch.Generator().manual_seed(7)
    h = torch.randn(n, hidden_size, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(vocab, hidden_size, generator=g) * 2 / hidden_size**0.5).to(torch.bfloat16).cuda()
    t = torch.randint(0, vocab, (n,), generator=g).cuda()
    ops = TileOperands(h, w, None, t, LogitTransform())
    want = StatRequest(entropy=True, sum_z=True, sum_sq=True)
    outs = []
    for pingpong in (False, True):
        z = kernels.z_buffer(n, vocab, h.device) if store else None
        outs.append((kernels.launch_forward(ops, want, True, z, pingpong), z))
    (coop, z_coop), (pp, z_pp) = outs
    assert coop.keys() == pp.keys() and all(torch.equal(coop[k], pp[k]) for k in coop)
    assert not store or torch.equal(z_coop, z_pp)
    lse = lse_logp_sum_pz(RowStats.combine(coop, (t >= 0) & (t < vocab)))[0]
    lse64 = torch.logsumexp(h.double() @ w.double().t(), 1)
    torch.testing.assert_close(lse.double(), lse64, rtol=0, atol=5e-5)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.cuda
@on_hopper
def test_launch_paths_agree(monkeypatch, fold):
    """The launch through Apache TVM FFI (torch tensors as they are, a hidden that requires grad
    included) and CuTe DSL's own DLPack launch run the same kernel: equal bits in every output,
    with every argument slot filled (bias, transform scalars, the stored tile and, for the
    probability tile, its per-row reference)."""
    from logitless.ops.contract import StatRequest
    from logitless.ops.cute_backend import kernels
    from logitless.ops.triton_shared.tile_gemm import TileOperands

    if not kernels._TVM_FFI:
        pytest.skip("apache-tvm-ffi is not installed (or this torch exports no DLPack C exchange API)")
    h, w, b, t, tr = _inputs(torch.bfloat16, "full", 72, seed=11)
    t = t.clamp(0, V - 1)  # the probability tile's reference needs every target in this shard
    ops = TileOperands(h.requires_grad_(), w, b, t, tr)
    want = StatRequest(entropy=not fold, sum_z=not fold, sum_sq=False)
    outs = []
    for tvm in (True, False):
        monkeypatch.setattr(kernels, "_TVM_FFI", tvm)
        monkeypatch.setattr(kernels, "_compiled", {})
        z = kernels.z_buffer(N, V, h.device, fold=fold)
        outs.append((kernels.launch_forward(ops, want, True, z), z))
    (a, z_a), (b_, z_b) = outs
    assert a.keys() == b_.keys() and all(torch.equal(a[k], b_[k]) for k in a)
    assert torch.equal(z_a, z_b) and torch.isfinite(z_a.float()).all()


# Each statistic's gradient alone and all together, kept logits and recomputed vocabulary blocks
# (300 entries: blocks that end inside a tile), both 16-bit dtypes.
BACKWARD_CASES = [
    (torch.bfloat16, "full", (True, True, True, True), 72, V),
    (torch.bfloat16, "full", (True, True, True, True), 72, 300),
    (torch.float16, "plain", (True, False, False, False), 70, V),
    (torch.bfloat16, "full", (False, False, True, False), 70, 300),
    (torch.bfloat16, "plain", (False, False, False, True), 72, V),
]


@pytest.mark.parametrize(("dtype", "transform_key", "present", "hidden_size", "block"), BACKWARD_CASES)
@pytest.mark.cuda
@on_hopper
def test_chunk_backward(dtype, transform_key, present, hidden_size, block):
    cute_backend, torch_backend = _backends()
    h, w, b, t, tr = _inputs(dtype, transform_key, hidden_size, seed=1)
    gen = torch.Generator().manual_seed(2)
    grads = StatGrads(*(torch.randn(N, generator=gen).cuda() if p else None for p in present))
    _, oracle_grads = _oracle(h, w, b, t, tr, grads)
    plan = _plan(block)
    out = {}
    for backend in (cute_backend, torch_backend):
        partials, kept = forward(backend, h, w, b, t, tr, plan, grads.entropy is not None,
                                 keep_logits=plan.keep_logits)
        lse, _, sum_pz = lse_logp_sum_pz(partials)
        gw = torch.zeros(w.shape, dtype=torch.float32, device=h.device)
        gb = torch.zeros(V, device=h.device) if b is not None else None
        gh = backward(backend, h, w, b, t, tr, plan, SavedStats(lse, sum_pz), grads,
                      Accumulators(gw, gb, hidden=True), kept)
        out[backend.NAME] = (gh, gw, gb)
    for i, name in enumerate(("d hidden", "d weight", "d bias")):
        if out["torch"][i] is None:
            continue
        # dy is cut to the 16-bit dtype for the two GEMMs: 2**-7 of the gradient's largest entry.
        a, r, c = out["cute"][i].double(), out["torch"][i].double(), oracle_grads[i]
        assert ((a - c).abs() - (r - c).abs() - 2**-7 * c.abs().max()).max() <= 0, name
        assert (a - c).abs().max() <= 2 * 2**-7 * c.abs().max(), name



@pytest.mark.cuda
@on_hopper
def test_rounded_logits_as_the_torch_backend():
    """``logits_precision="input"``: the statistics of the logits rounded to bf16 first, as the
    torch backend rounds them (the fp32 accumulators' order differs, so a logit on a rounding
    boundary may land one bf16 step away), and not those of the fp32 logits."""
    cute_backend, torch_backend = _backends()
    h, w, b, t, tr = _inputs(torch.bfloat16, "plain", 72, seed=3)
    rounded, _ = forward(cute_backend, h, w, b, t, tr, _plan(fp32_logits=False), True)
    exact, _ = forward(cute_backend, h, w, b, t, tr, _plan(), True)
    ref, _ = forward(torch_backend, h, w, b, t, tr, _plan(fp32_logits=False), True)
    for ours, theirs, name in zip(lse_logp_sum_pz(rounded), lse_logp_sum_pz(ref), ("lse", "logp", "sum_pz"),
                                  strict=True):
        assert (ours - theirs).abs().max() <= 2e-2, name
    assert (lse_logp_sum_pz(rounded)[0] - lse_logp_sum_pz(exact)[0]).abs().max() > 1e-3
