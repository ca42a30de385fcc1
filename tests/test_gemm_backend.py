"""GEMM-epilogue backend vs the torch backend and the float64 oracle, under the Triton interpreter.

As in ``test_flash_backend.py``, the cases run in a child pytest with ``TRITON_INTERPRET=1``
(:func:`test_under_interpreter`); :func:`test_gpu_matches_torch` runs the compiled kernels where
CUDA exists. Errors are bounded by the torch backend's own: ``|ours - fp64| <= |torch - fp64| + tol``.
"""

from __future__ import annotations

import math

import pytest
import torch
from backend_calls import (
    backward,
    forward,
    keep_planned_chunks,
    log_sum_sq_oracle,
    log_sum_sq_probs,
    lse_logp_sum_pz,
    record_layouts,
)
from interpreter import INTERPRETED, child_run, interpreted
from test_flash_backend import TRANSFORMS, _assert_bounded, _oracle

from logitless import Head, LogitTransform, PassOptions, token_logprobs
from logitless.ops.contract import Accumulators, SavedStats, StatGrads

pytest.importorskip("triton")

test_under_interpreter = child_run(__file__)

# The interpreter's tiles are 16 tokens x 32 entries with 16-wide H steps, and the row kernel
# steps 64 entries: N = 37 leaves a 5-row tail, V = 203 an 11-entry tail tile (7 tiles), H = 40 a
# zero-filled last H step.
N, H, V = 37, 48, 203


def _inputs(dtype, transform_key, hidden_size=H, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    kw, has_bias = TRANSFORMS[transform_key]
    h = torch.randn(N, hidden_size, generator=g).to(dtype)
    w = (torch.randn(V, hidden_size, generator=g) * 3 / hidden_size**0.5).to(dtype)
    b = (torch.randn(V, generator=g) + offset).to(dtype) if has_bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[3], t[5], t[36] = V + 2, -1, V  # targets of another vocabulary shard
    return h, w, b, t, LogitTransform(**kw)


def _plan(vocab_block=V, **kw):
    from logitless.ops.plan import ChunkPlan

    return ChunkPlan(token_chunk=N, vocab_block=vocab_block, keep_logits=vocab_block == V, **kw)


def _use_loads(monkeypatch, loads):
    """``"tma"`` tensor descriptors (emulated by the interpreter) or ``"pointer"`` masked loads."""
    import dataclasses

    from logitless.ops.gemm_backend import backend as gemm_backend
    from logitless.ops.gemm_backend.kernels import gemm_config

    cfg = dataclasses.replace(gemm_config(), tma=loads == "tma", store_tma=loads == "tma")
    monkeypatch.setattr(gemm_backend, "gemm_config", lambda: cfg)


FORWARD_CASES = [
    (dt, tr, opt, "tma") for dt in (torch.float16, torch.bfloat16) for tr in TRANSFORMS for opt in (True, False)
] + [(torch.bfloat16, "full", True, "pointer")]


@interpreted
@pytest.mark.parametrize(("dtype", "transform_key", "optional", "loads"), FORWARD_CASES)
def test_chunk_forward(monkeypatch, dtype, transform_key, optional, loads):
    """Statistics as accurate as the torch backend's fp32 logits; the kept tile is each tile's
    logits centred on the tile's maximum, to fp16's resolution."""
    from logitless.ops.gemm_backend import backend as gemm_backend
    from logitless.ops.torch_backend import backend as torch_backend

    _use_loads(monkeypatch, loads)
    h, w, b, t, tr = _inputs(dtype, transform_key)
    ours, kept = forward(gemm_backend, h, w, b, t, tr, _plan(), optional, keep_logits=True, want_sum_z=optional,
                         want_sum_sq=optional)
    ref, _ = forward(torch_backend, h, w, b, t, tr, _plan(), True, keep_logits=False, want_sum_z=True,
                     want_sum_sq=True)
    assert (ours.sum_exp_logit is None, ours.sum_logit is None, ours.sum_exp_sq is None) == (not optional,) * 3
    assert torch.equal(ours.owned, ref.owned) and torch.all(ours.target_logit[~ours.owned] == 0)
    assert torch.equal(ours.target_logit >= ours.max_logit, ref.target_logit >= ref.max_logit)  # is_top1
    oracle, _ = _oracle(h, w, b, t, tr)
    names = ("lse", "logp", "sum_pz")
    for i, name in enumerate(names[:3 if optional else 2]):
        _assert_bounded(lse_logp_sum_pz(ours)[i], lse_logp_sum_pz(ref)[i], oracle[i], 1e-5, name)
    if optional:
        _assert_bounded(ours.sum_logit, ref.sum_logit, oracle[3], 1e-5, "sum_z")
        _assert_bounded(log_sum_sq_probs(ours), log_sum_sq_probs(ref), log_sum_sq_oracle(h, w, b, tr), 1e-5,
                        "log_sum_sq_probs")
    # The kept tile: z - m per 32-wide tile, fp16.
    z64 = tr.apply(h.double() @ w.double().t() + (0 if b is None else b.double()))
    tiles = kept.tile_max.shape[0]
    assert kept.z.dtype == torch.float16 and kept.z.shape == (N, V) and tiles == -(-V // 32)
    tile_of = torch.arange(V) // 32
    m64 = torch.stack([z64[:, tile_of == s].max(1).values for s in range(tiles)])  # [tiles, N]
    torch.testing.assert_close(kept.tile_max.double(), m64, rtol=0, atol=1e-4)
    centred = z64 - m64.t()[:, tile_of]
    assert torch.all(kept.z.double() <= 0)
    assert torch.all((kept.z.double() - centred).abs() <= centred.abs() * 2**-10 + 1e-4)


@interpreted
@pytest.mark.parametrize("transform_key", ["plain", "full"])
def test_whole_tiles_forward(transform_key):
    """A vocabulary of whole tiles (192 = 6 x 32: the kernel drops its column masks) gives the
    statistics and kept tile of the float64 logits, as bounded as the torch backend's; rows whose
    target is in no tile (another shard's ids) get 0."""
    from logitless.ops.gemm_backend import backend as gemm_backend
    from logitless.ops.plan import ChunkPlan
    from logitless.ops.torch_backend import backend as torch_backend

    h, w, b, t, tr = _inputs(torch.bfloat16, transform_key, seed=5)
    vocab = 192
    w, b = w[:vocab].contiguous(), None if b is None else b[:vocab].contiguous()
    t = torch.where(t < vocab, t, t % vocab)
    t[3], t[5], t[36] = vocab + 2, -1, vocab
    plan = ChunkPlan(token_chunk=N, vocab_block=vocab, keep_logits=True)
    ours, kept = forward(gemm_backend, h, w, b, t, tr, plan, True, keep_logits=True, want_sum_z=True)
    ref, _ = forward(torch_backend, h, w, b, t, tr, plan, True, keep_logits=False, want_sum_z=True)
    assert torch.equal(ours.owned, ref.owned) and torch.all(ours.target_logit[~ours.owned] == 0)
    z64 = tr.apply(h.double() @ w.double().t() + (0 if b is None else b.double()))
    lse = torch.logsumexp(z64, 1)
    logp = torch.where(ours.owned, z64.gather(1, t.clamp(0, vocab - 1)[:, None])[:, 0], 0.0) - lse
    oracle = (lse, logp, (torch.softmax(z64, 1) * z64).sum(1), z64.sum(1))
    for i, name in enumerate(("lse", "logp", "sum_pz")):
        _assert_bounded(lse_logp_sum_pz(ours)[i], lse_logp_sum_pz(ref)[i], oracle[i], 1e-5, name)
    _assert_bounded(ours.sum_logit, ref.sum_logit, oracle[3], 1e-5, "sum_z")
    m64 = z64.view(N, vocab // 32, 32).amax(2)
    torch.testing.assert_close(kept.tile_max.double().t(), m64, rtol=0, atol=1e-4)
    centred = z64 - m64.repeat_interleave(32, 1)
    assert torch.all((kept.z.double() - centred).abs() <= centred.abs() * 2**-10 + 1e-4)


@interpreted
def test_forward_needs_no_zeroed_buffers(monkeypatch):
    """Every buffer of the statistics GEMM is allocated uninitialized: with ``torch.empty``
    poisoned (NaN / -7), the partials and the target logits (0 for targets of another shard) are
    those of a clean run."""
    from logitless.ops.gemm_backend import backend as gemm_backend

    h, w, b, t, tr = _inputs(torch.bfloat16, "plain")
    clean, _ = forward(gemm_backend, h, w, b, t, tr, _plan(), True, keep_logits=False, want_sum_z=True,
                       want_sum_sq=True)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        x = real_empty(*args, **kwargs)
        return x.fill_(math.nan if x.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)
    dirty, _ = forward(gemm_backend, h, w, b, t, tr, _plan(), True, keep_logits=False, want_sum_z=True,
                       want_sum_sq=True)
    assert torch.all(dirty.target_logit[~dirty.owned] == 0)
    for name in ("max_logit", "sum_exp", "sum_exp_logit", "target_logit", "sum_logit", "sum_exp_sq"):
        assert torch.equal(getattr(dirty, name), getattr(clean, name)), name


# Backward: each statistic's gradient alone and all together, kept logits and recomputed vocabulary
# blocks (70 entries: blocks that end inside a tile), both 16-bit dtypes, H = 40, plain loads and
# stores for kept and recomputed logits.
BACKWARD_CASES = [
    # dtype, transform, (g_logp, g_lse, g_entropy, g_sum_z) present, H, vocab block, loads
    (torch.bfloat16, "full", (True, True, True, True), H, V, "tma"),
    (torch.bfloat16, "full", (True, True, True, True), H, 70, "tma"),
    (torch.float16, "plain", (True, False, False, False), H, V, "tma"),
    (torch.float16, "full", (False, True, False, False), 40, 70, "tma"),
    (torch.bfloat16, "full", (False, False, True, False), 40, V, "tma"),
    (torch.bfloat16, "plain", (False, False, False, True), H, 70, "tma"),
    (torch.bfloat16, "plain", (True, False, True, False), 40, V, "pointer"),
    (torch.bfloat16, "full", (True, False, True, True), 40, 70, "pointer"),
]


def _grads(backend, h, w, b, t, tr, plan, grads: StatGrads):
    partials, kept = forward(backend, h, w, b, t, tr, plan, grads.entropy is not None, keep_logits=plan.keep_logits)
    lse, _, sum_pz = lse_logp_sum_pz(partials)
    gw = torch.zeros(w.shape, dtype=torch.float32)
    gb = torch.zeros(w.shape[0]) if b is not None else None
    gh = backward(backend, h, w, b, t, tr, plan, SavedStats(lse, sum_pz), grads, Accumulators(gw, gb, hidden=True),
                  kept)
    assert gh.dtype == torch.float32 and gh.shape == h.shape
    return gh, gw, gb


@interpreted
@pytest.mark.parametrize(("dtype", "transform_key", "present", "hidden_size", "block", "loads"), BACKWARD_CASES)
def test_chunk_backward(monkeypatch, dtype, transform_key, present, hidden_size, block, loads):
    from logitless.ops.gemm_backend import backend as gemm_backend
    from logitless.ops.torch_backend import backend as torch_backend

    _use_loads(monkeypatch, loads)
    h, w, b, t, tr = _inputs(dtype, transform_key, hidden_size=hidden_size, seed=1)
    gen = torch.Generator().manual_seed(2)
    grads = StatGrads(*(torch.randn(N, generator=gen) if p else None for p in present))
    _, oracle_grads = _oracle(h, w, b, t, tr, grads.logp, grads.lse, grads.entropy, grads.sum_z)
    ours = _grads(gemm_backend, h, w, b, t, tr, _plan(block), grads)
    ref = _grads(torch_backend, h, w, b, t, tr, _plan(block), grads)
    for i, name in enumerate(("d hidden", "d weight", "d bias")):
        if ref[i] is not None:
            # dy is cut to the 16-bit dtype for the two GEMMs (the torch CPU path keeps fp32): 2**-7
            # of the gradient's largest entry, whatever its size (measured: up to 4.8e-3 while the
            # interpreter's cast truncated, before tests/interpreter.py rounded it as the GPU).
            a, b, c = ours[i].double(), ref[i].double(), oracle_grads[i]
            excess = (a - c).abs() - (b - c).abs() - 2**-7 * c.abs().max()
            assert excess.max() <= 0, f"{name}: {excess.max():.3e} over the bound"
            # and independently of the torch backend: within twice that of float64
            assert (a - c).abs().max() <= 2 * 2**-7 * c.abs().max(), name


@interpreted
def test_large_logits_keep_their_gradient():
    """Logits near 1000, where a bf16 (or fp16) logit is off by 2-4 nats: centred on their tile's
    maximum, the kept values give the same gradient as float64, to the 16-bit ``dy``'s rounding."""
    from logitless.ops.gemm_backend import backend as gemm_backend

    h, w, b, t, tr = _inputs(torch.bfloat16, "full", seed=3, offset=1000.0)
    tr = LogitTransform(temperature=0.7)  # no softcap, which would clip the offset away
    gen = torch.Generator().manual_seed(4)
    grads = StatGrads(logp=torch.randn(N, generator=gen), entropy=torch.randn(N, generator=gen))
    (lse64, *_), oracle = _oracle(h, w, b, t, tr, grads.logp, None, grads.entropy)
    assert lse64.min() > 1000
    ours = _grads(gemm_backend, h, w, b, t, tr, _plan(), grads)
    for a, ref, name in zip(ours, oracle, ("d hidden", "d weight", "d bias"), strict=True):
        assert (a.double() - ref).abs().max() <= 2e-2 * ref.abs().max(), name


@interpreted
def test_rounded_logits_match_the_flash_backend():
    """``fp32_logits=False`` rounds the GEMM output to the input dtype before bias and transform,
    exactly as the flash backend (tested against a rounded float64 oracle) does."""
    from logitless.ops.flash_backend import backend as flash_backend
    from logitless.ops.gemm_backend import backend as gemm_backend

    h, w, b, t, tr = _inputs(torch.bfloat16, "full")
    a, _ = forward(gemm_backend, h, w, b, t, tr, _plan(fp32_logits=False), True, keep_logits=False)
    c, _ = forward(flash_backend, h, w, b, t, tr, _plan(fp32_logits=False), True, keep_logits=False)
    f, _ = forward(gemm_backend, h, w, b, t, tr, _plan(), True, keep_logits=False)
    for x, y in zip(lse_logp_sum_pz(a), lse_logp_sum_pz(c), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert (a.finalize()[0].lse - f.finalize()[0].lse).abs().max() > 1e-3


@interpreted
def test_resolve_and_refusals():
    """bf16/fp16 resolve to this backend; fp32 inputs and adapter heads go to the Triton backend,
    and the backend refuses both instead of computing something else."""
    from logitless.ops import resolve_backend
    from logitless.ops.gemm_backend import backend as gemm_backend
    from logitless.ops.lora import LowRank
    from logitless.ops.triton_backend import backend as triton_backend

    h, w, b, t, tr = _inputs(torch.bfloat16, "full")
    assert resolve_backend("gemm", h) is gemm_backend
    assert resolve_backend("gemm", h.half()) is gemm_backend
    assert resolve_backend("gemm", h.float()) is triton_backend
    assert resolve_backend("gemm", h, has_lora=True) is triton_backend
    with pytest.raises(ValueError, match="bf16/fp16"):
        forward(gemm_backend, h.float(), w.float(), b, t, tr, _plan(), False)
    g = torch.Generator().manual_seed(5)
    low = LowRank(torch.randn(N, 4, generator=g), torch.randn(V, 4, generator=g))
    with pytest.raises(ValueError, match="adapter"):
        forward(gemm_backend, h, w, b, t, tr, _plan(), False, low=low)
    assert PassOptions(impl="gemm").impl == "gemm"


def _poison_weight_grad_buffer(monkeypatch):
    """Fill an uninitialized ``d weight`` buffer and pair residual (ones the first chunk stores
    into) with NaN, as reused memory may hold anything, so a row the pass fails to store shows."""
    from logitless.ops import plan as planning

    real = planning.weight_grad_buffers

    def poisoned(p, weight, layout, n):
        buf, lo = real(p, weight, layout, n)
        if p.stores_weight_grad and n:
            buf[:p.head.weight.shape[0]] = float("nan")
            if lo is not None:
                lo.fill_(-101)  # far outside a residual's counts (at most 64)
        return buf, lo

    monkeypatch.setattr(planning, "weight_grad_buffers", poisoned)


@interpreted
@pytest.mark.parametrize("mode", ["recompute", "fused"])
@pytest.mark.parametrize("layout", ["one_block", "vocab_blocks"])
def test_policy_loss_matches_torch(monkeypatch, mode, layout):
    """Through the engine: a DAPO loss with KL and entropy bonus against the torch backend, the
    unmasked tokens in one chunk whose ``d weight`` is stored once per row (the fp32 accumulator's
    bytes go to the chunk), its logits kept whole (``one_block``) or recomputed in 21 vocabulary
    blocks (``vocab_blocks``: a budget too small for whole rows even with those bytes)."""
    import logitless
    from logitless.ops import plan as planning

    _poison_weight_grad_buffer(monkeypatch)
    plans = []
    real_plan = planning.weight_grad_plan
    monkeypatch.setattr(planning, "weight_grad_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])

    g = torch.Generator().manual_seed(3)
    b_, t_, hid = 4, 40, 32
    h = torch.randn(b_, t_, hid, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, hid, generator=g) * 0.7).to(torch.bfloat16)
    ids = torch.randint(0, V, (b_, t_), generator=g)
    mask = (torch.rand(b_, t_, generator=g) > 0.2).long()
    adv = torch.randn(b_, generator=g)
    old = -torch.rand(b_, t_, generator=g) * 3
    ref_lp = old + 0.1 * torch.randn(b_, t_, generator=g)
    cfg = logitless.PolicyConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    res = {}
    for impl in ("torch", "gemm"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        budget = 2**30 if layout == "one_block" else 10 * int(mask.sum()) * 2
        loss, metrics = logitless.policy_loss(hh, ww, ids, mask, adv, old, ref_lp, config=cfg,
                                              options=PassOptions(mode=mode, impl=impl, chunk_bytes=budget))
        loss.backward()
        res[impl] = (loss.detach(), hh.grad.float(), ww.grad.float(), metrics)
    gemm_plan = plans[-1][0].plan  # the torch backend accumulates in fp32: no single-chunk plan
    assert plans[0][1] == "fp32" and plans[-1][1] == "single"
    assert gemm_plan.token_chunk == int(mask.sum())  # the unmasked tokens
    assert gemm_plan.vocab_block == (V if layout == "one_block" else 10)
    torch.testing.assert_close(res["gemm"][0], res["torch"][0], rtol=1e-4, atol=1e-5)
    for i in (1, 2):  # bf16 dy in both; bf16 gradients out
        torch.testing.assert_close(res["gemm"][i], res["torch"][i], rtol=2e-2, atol=2e-2 * res["torch"][i].abs().max())
    for k, v in res["torch"][3].items():
        torch.testing.assert_close(res["gemm"][3][k].float(), v.float(), rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_gpu_matches_torch(mode):
    """The compiled kernels (real tiles, tensor cores, descriptors) against the torch backend and
    float64, with a vocabulary that is not a multiple of the tiles and an odd token count."""
    import logitless

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hid, vocab = 1000, 512, 5003
    h = torch.randn(n, hid, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(vocab, hid, device="cuda", generator=g) / hid**0.5 * 3).to(torch.bfloat16)
    b = torch.randn(vocab, device="cuda", generator=g).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    tr = LogitTransform(temperature=0.9, softcap=30.0)
    out = {}
    for impl in ("torch", "gemm"):
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        st = logitless.vocab_stats(hh, Head(ww, bias=bb, transform=tr), t, options=PassOptions(mode=mode, impl=impl))
        (-(st.logp.sum()) + 0.01 * st.entropy.sum()).backward()
        out[impl] = (st.logp.detach(), st.entropy.detach(), hh.grad.float(), ww.grad.float(), bb.grad.float())
    z = tr.apply(h.double() @ w.double().t() + b.double())
    lp64 = torch.log_softmax(z, 1).gather(1, t[:, None]).squeeze(1)
    assert (out["gemm"][0] - lp64).abs().max() <= 2e-4  # statistics from the fp32 accumulator
    names = ("logp", "entropy", "d hidden", "d weight", "d bias")
    for a, c, name in zip(out["gemm"], out["torch"], names, strict=True):
        scale = c.abs().max().clamp_min(1.0)
        assert (a - c).abs().max() <= 2e-2 * scale, name


@interpreted
@pytest.mark.parametrize("chunks", ["one", "several-fp32", "several-pair"])
@pytest.mark.parametrize("objective", ["logp", "constant"])
def test_stored_weight_grad_is_written_everywhere(monkeypatch, objective, chunks):
    """Every local row of ``d weight`` is stored by the first chunk (into an uninitialized buffer:
    one chunk's in the head's dtype, several chunks' in fp32 or a bf16 pair, the later ones
    added), also when the objective does not depend on the statistics (then exactly 0), and a
    vocabulary shard's padding rows are 0; it equals the torch backend's fp32-accumulated gradient."""
    from logitless import VocabShard
    from logitless.ops import fused
    from logitless.ops.engine import ObjectiveSpec, run_objective

    _poison_weight_grad_buffer(monkeypatch)
    budget = None
    if chunks == "one":
        layouts = record_layouts(monkeypatch)
    else:  # 24 rows in chunks of 8, d weight accumulated over them
        from logitless.ops import plan

        layouts = keep_planned_chunks(monkeypatch, lambda p: chunks == "several-pair")
        monkeypatch.setitem(plan._MIN_TOKENS, "gemm", 8)
        budget = 8 * V * 2
    stores = []  # each chunk's Accumulators (write_weight, last_weight), as the fused loop hands them on
    real_chunk = fused._run_chunk
    monkeypatch.setattr(fused, "_run_chunk", lambda call, hidden, i, low, acc:
                        stores.append((acc.write_weight, acc.last_weight)) or real_chunk(call, hidden, i, low, acc))
    g = torch.Generator().manual_seed(5)
    h = torch.randn(24, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V + 5, H, generator=g) / H**0.5 * 3).to(torch.bfloat16)  # 5 padding rows
    t = torch.randint(0, V, (24,), generator=g)

    def terms(sl, st):
        return (-st.logp.sum() if objective == "logp" else torch.zeros(())), None

    grads = {}
    for impl in ("torch", "gemm"):
        ww = w.clone().requires_grad_()
        stores.clear()
        res = run_objective(h, Head(ww, shard=VocabShard(vocab_size=V)), t, terms, ObjectiveSpec(),
                            PassOptions(mode="fused", impl=impl, chunk_bytes=budget))
        res.loss.backward()
        grads[impl] = ww.grad.float()
    # The gemm pass's chunks: the first stores, the last leaves a pair's residual unwritten.
    assert stores == ([(True, True)] if chunks == "one" else [(True, False), (False, False), (False, True)])
    assert layouts[-1] == {"one": "single", "several-fp32": "fp32", "several-pair": "pair"}[chunks]
    assert torch.all(grads["gemm"][V:] == 0)
    if objective == "constant":
        assert torch.all(grads["gemm"] == 0)
    else:
        assert grads["gemm"].abs().max() > 0
        torch.testing.assert_close(grads["gemm"], grads["torch"], rtol=2e-2, atol=2e-2 * grads["torch"].abs().max())


@interpreted
@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_no_counted_tokens_give_zero_gradients(impl):
    """A batch whose mask counts no token runs no chunk: ``d weight`` is zeros, not the
    uninitialized buffer a first chunk would have stored into."""
    from logitless import PolicyConfig, policy_loss

    g = torch.Generator().manual_seed(11)
    h = torch.randn(2, 5, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (2, 5), generator=g)
    loss, _ = policy_loss(h, w, ids, torch.zeros(2, 5, dtype=torch.long), torch.randn(2, generator=g),
                          config=PolicyConfig(loss_type="dapo"), options=PassOptions(impl=impl, mode="fused"))
    loss.backward()
    assert torch.all(w.grad == 0) and torch.all(h.grad == 0)


@interpreted
@pytest.mark.parametrize("impl, dtype", [("flash", torch.float32), ("gemm", torch.bfloat16)])
def test_hidden_size_one_with_a_non_unit_stride(impl, dtype):
    """``hidden [n, 1]`` whose one column has stride 6 (a column of a transposed tensor): such a
    tensor counts as contiguous, so ``contiguous()`` keeps the stride; the tile kernels read it."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 6, generator=g).to(dtype).t()[:, :1]
    assert h.stride(1) != 1 and h.is_contiguous()
    w = torch.randn(9, 1, generator=g).to(dtype)
    t = torch.randint(0, 9, (6,), generator=g)
    got = token_logprobs(h, w, t, entropy=True, options=PassOptions(impl=impl))
    want = token_logprobs(h.contiguous().clone(), w, t, entropy=True, options=PassOptions(impl="torch"))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("pairs", [True, False])
def test_weight_grad_layout_by_the_accumulator_bytes(pairs):
    """A pass whose logits fit the budget plus the fp32 ``d weight`` accumulator it makes
    unnecessary runs as one chunk (Llama-3 8k tokens: 2.1 GB of fp16 logits in 1 GiB + 2.1 GB).
    Gemma-2's 8k (4.2 GB against 1 GiB + 2.4 GB) needs several chunks: a kind that adds into a
    pair (bf16 result, int8 residual) gets the 1.8 GB the pair saves against fp32 (two chunks of
    4096 tokens, not four of 2048), others keep the fp32 accumulator and the budget's chunks;
    chunks of 4096 tokens already (Llama-3 128k) keep it too."""
    import dataclasses

    from logitless.ops import plan as planning
    from logitless.ops.plan import ChunkPlan

    @dataclasses.dataclass
    class Kind:
        plan: ChunkPlan
        head: Head
        stores_weight_grad: bool = True
        pairs_weight_grad: bool = pairs

    def kind_for(n, v, hid, dtype=torch.bfloat16):
        return Kind(ChunkPlan.make(n, v, 2**30, torch.bfloat16, "gemm"),
                    Head(torch.empty(v, hid, dtype=dtype, device="meta")))

    llama = kind_for(8192, 128256, 4096)
    got, layout = planning.weight_grad_plan(llama, 8192, llama.head.weight)
    assert layout == "single" and got.plan.keep_logits and got.plan.chunks(8192) == [slice(0, 8192)]
    gemma = kind_for(8192, 256000, 2304)
    got, layout = planning.weight_grad_plan(gemma, 8192, gemma.head.weight)
    assert layout == ("pair" if pairs else "fp32")
    want = 4096 if pairs else 2048
    assert got.plan.keep_logits and got.plan.chunks(8192) == [slice(s, s + want) for s in range(0, 8192, want)]
    assert got.plan.budget == 2**30 + (256000 * 2304 * 3 if pairs else 0)
    llama_128k = kind_for(131072, 128256, 4096)  # 4096-token chunks: the fp32 accumulator's GEMMs are as fast
    assert planning.weight_grad_plan(llama_128k, 131072, llama_128k.head.weight) == (llama_128k, "fp32")
    assert planning.weight_grad_plan(llama, 0, llama.head.weight)[1] == "fp32"
    fp32 = kind_for(8192, 128256, 4096, torch.float32)  # an fp32 head accumulates in fp32
    assert planning.weight_grad_plan(fp32, 8192, fp32.head.weight) == (fp32, "fp32")


def test_plan_keeps_two_bytes_a_logit():
    """The gemm backend's block sizes count 2 bytes a logit (the fp16 tile), so a 1 GiB budget
    keeps whole 128k-vocabulary rows for twice as many tokens as the Triton backend's fp32 tile."""
    from logitless.ops.plan import ChunkPlan

    gemm = ChunkPlan.make(8192, 128256, 2**30, torch.bfloat16, "gemm")
    triton = ChunkPlan.make(8192, 128256, 2**30, torch.bfloat16, "triton")
    assert gemm.bytes_per_logit == 2 and gemm.keep_logits and gemm.vocab_block == 128256
    assert gemm.token_chunk == 2 * triton.token_chunk == 4096


def test_statistics_only_passes_take_longer_chunks():
    """A pass that keeps no logits (rollout, recompute's forward) holds only the epilogue's
    ``[tiles, n]`` partials: its chunks are as long as their partials and the merge's
    temporaries (7 fp32 values per token and 256-entry tile) fit the budget, and never shorter
    than the logits chunks. Llama-3 8k runs one GEMM; 128k two."""
    from logitless.ops.plan import ChunkPlan

    budget = 2**30
    for n, v, chunks in ((8192, 128256, 1), (8192, 256000, 1), (32768, 151936, 1), (131072, 128256, 2),
                         (131072, 151936, 3)):
        plan = ChunkPlan.make(n, v, budget, torch.bfloat16, "gemm")
        got = plan.stats_chunks(n)
        assert len(got) == chunks, (n, v, got)
        assert plan.stats_chunk >= plan.token_chunk
        assert all(sl.stop - sl.start <= plan.stats_chunk for sl in got) and got[-1].stop == n
        assert plan.stats_chunk * -(-v // 256) * 7 * 4 <= budget
        assert plan.stats_chunk == n or plan.stats_chunk % 128 == 0
    for kind in ("torch", "triton"):  # their forwards hold logits blocks: the same chunks
        plan = ChunkPlan.make(8192, 128256, budget, torch.bfloat16, kind)
        assert plan.stats_chunks(8192) == plan.chunks(8192)
    plan = ChunkPlan.make(8192, 128256, budget, torch.float64, "gemm")  # fp64 runs on torch
    assert plan.stats_chunks(8192) == plan.chunks(8192)


@interpreted
def test_rollout_runs_one_statistics_chunk(monkeypatch):
    """With a budget that cuts the logits into 4 chunks, a rollout on the gemm backend launches
    one forward over all tokens, and its log-probs and entropies match the torch backend's."""
    from logitless.ops.gemm_backend import backend as gemm_backend

    h, w, _b, _t, _tr = _inputs(torch.bfloat16, "plain")
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    budget = 10 * V * 2  # ten tokens of fp16 logits a chunk
    calls = []
    real = gemm_backend.chunk_forward
    monkeypatch.setattr(gemm_backend, "chunk_forward", lambda head, rows, *a: calls.append(rows.hidden.shape[0])
                        or real(head, rows, *a))
    got = token_logprobs(h, w, t, entropy=True, options=PassOptions(impl="gemm", chunk_bytes=budget))
    ref = token_logprobs(h, w, t, entropy=True, options=PassOptions(impl="torch", chunk_bytes=budget))
    assert calls == [N]
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@interpreted
def test_launch_variants_agree(monkeypatch):
    """One program per tile or persistent programs walking the tiles; the kept tile written through
    a descriptor (rows 16-byte aligned at V = 200), clipped at the tensor's edges (a 5-row and an
    8-entry tail block), or by masked pointer stores: bit for bit the same statistics and tile."""
    import dataclasses

    from logitless.ops.gemm_backend import backend as gemm_backend
    from logitless.ops.gemm_backend.kernels import gemm_config
    from logitless.ops.triton_shared.tile_gemm import tma_ready

    h, w, b, t, tr = _inputs(torch.bfloat16, "full")
    w, b, t = w[:200], b[:200], t.clamp(max=199)
    results = []
    for store_tma, persistent in ((True, True), (False, True), (False, False)):
        cfg = dataclasses.replace(gemm_config(), store_tma=store_tma, persistent=persistent)
        monkeypatch.setattr(gemm_backend, "gemm_config", lambda cfg=cfg: cfg)
        st, kept = forward(gemm_backend, h, w, b, t, tr, _plan(200), True, keep_logits=True)
        results.append((st.max_logit, st.sum_exp, st.sum_exp_logit, st.target_logit, kept.z, kept.tile_max))
    assert tma_ready(results[0][4])  # so the descriptor path did run
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            assert torch.equal(a, c)


@interpreted
def test_recompute_backward_gets_no_gradient_for_unused_statistics(monkeypatch):
    """A statistic the loss leaves out (the entropy, computed for a metric) reaches the recompute
    backward as ``None``, not zeros, so the gradient kernel compiles without its terms; the
    gradient equals the torch backend's."""
    from logitless import vocab_stats
    from logitless.ops.gemm_backend import backend as gemm_backend

    seen = []
    launch = gemm_backend.launch_grad_tile
    monkeypatch.setattr(gemm_backend, "launch_grad_tile", lambda ops, rc, *a: (seen.append(rc), launch(ops, rc, *a)))
    h, w, b, t, tr = _inputs(torch.bfloat16, "full", seed=5)
    t = t.clamp(0, V - 1)  # _inputs mixes in ids of other shards
    grads = {}
    for impl in ("gemm", "torch"):
        hh = h.detach().clone().requires_grad_()
        st = vocab_stats(hh, Head(w, b, tr), t, entropy=True, options=PassOptions(impl=impl, chunk_bytes=1 << 14))
        (st.logp.float() * torch.linspace(-1, 1, N)).sum().backward()
        grads[impl] = hh.grad.double()
    assert seen and all(rc.g_entropy is None and rc.sum_pz is None and rc.g_logp is not None for rc in seen)
    torch.testing.assert_close(grads["gemm"], grads["torch"], rtol=0, atol=2**-7 * grads["torch"].abs().max())
