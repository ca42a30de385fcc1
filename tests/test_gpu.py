"""GPU correctness at real shapes (compiled Triton kernels, tensor cores): the Triton and gemm
backends against the torch backend and a float64 oracle on sampled rows, for every public entry point.

Marked ``cuda``: skipped without a GPU; ``scripts/gpu_check.sh`` runs them with
``pytest -m cuda``. Errors are relative norms ``|a - b| / |b|``.
"""

from __future__ import annotations

import pytest
import torch
from backend_calls import logp_grads

import logitless
from logitless import Head, HeadLoRA, LogitTransform, PassOptions, PolicyConfig
from logitless.objectives.reference import reference_stats
from logitless.ops.contract import cute_runs_on, resolve_backend

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")]

N, H, V = 4096, 2048, 32011  # V prime: no block size divides it
# The compiled backends; the CuTe DSL one where it is installed and the GPU is a Hopper.
CUTE = torch.cuda.is_available() and cute_runs_on(torch.device("cuda"))
KERNELS = ("triton", "gemm", *(("cute",) if CUTE else ()))
TRANSFORM = LogitTransform(temperature=0.9, softcap=30.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def case():
    g = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(V, H, device="cuda", generator=g) / H**0.5 * 2).bfloat16()
    b = (0.1 * torch.randn(V, device="cuda", generator=g)).bfloat16()
    hid = (torch.randn(N, H, device="cuda", generator=g) * 2).bfloat16()
    tgt = torch.randint(0, V, (N,), device="cuda", generator=g)
    tgt[::97] = -100
    rows = torch.arange(0, N, 37, device="cuda")
    return hid, w, b, tgt, rows[tgt[rows] != -100]


@pytest.mark.parametrize("impl", (*KERNELS, "flash"))
def test_log_sum_sq_probs_vs_fp64(case, impl):
    """WPO's ``log Σ p²`` (``StatRequest(sum_sq=True)``) from the compiled kernels, in recompute
    and fused mode, against float64 materialized logits on sampled rows."""
    from logitless.ops import ObjectiveSpec, StatRequest, run_objective

    hid, w, b, tgt, rows = case
    valid = tgt != -100
    at = valid.cumsum(0)[rows] - 1  # the sampled rows among the valid ones
    want = StatRequest(entropy=False, sum_sq=True)
    assert resolve_backend(impl, hid, want=want).NAME == impl  # no silent fallback
    z64 = TRANSFORM.apply(hid[rows].double() @ w.double().t() + b.double())
    ref = torch.logsumexp(2 * torch.log_softmax(z64, -1), -1)
    got = {}
    for mode in ("recompute", "fused"):
        hh = hid[valid].clone().requires_grad_()
        out = run_objective(hh, Head(w, b, TRANSFORM), tgt[valid], lambda sl, st: (st.logp.sum(), None),
                            ObjectiveSpec(want=want), PassOptions(impl=impl, mode=mode))
        out.loss.backward()
        got[mode] = out.stats.log_sum_sq_probs
        assert got[mode].dtype == torch.float32 and rel(got[mode][at], ref) <= 1e-5, mode
    assert rel(got["fused"], got["recompute"]) <= 1e-6


def _vocab_stats(case, impl):
    hid, w, b, tgt, _ = case
    hh, ww, bb = (x.clone().requires_grad_() for x in (hid, w, b))
    st = logitless.vocab_stats(hh, Head(ww, bb, TRANSFORM), tgt, mean_logit=True, options=PassOptions(impl=impl))
    g = torch.randn(4, N, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    (g[0] * st.logp + g[1] * st.lse + g[2] * st.entropy + g[3] * st.mean_logit).sum().backward()
    return st, hh.grad, ww.grad, bb.grad


@pytest.mark.parametrize("impl", KERNELS)
def test_vocab_stats_vs_torch_and_fp64(case, impl):
    hid, w, b, tgt, rows = case
    assert resolve_backend(impl, hid).NAME == impl  # no silent fallback
    tri, tch = _vocab_stats(case, impl), _vocab_stats(case, "torch")
    ref = reference_stats(hid[rows], w, tgt[rows], bias=b, temperature=0.9, softcap=30.0)
    for k in ("logp", "lse", "entropy"):
        assert rel(getattr(tri[0], k)[rows], getattr(ref, k)) <= 1e-5, k
        assert rel(getattr(tri[0], k), getattr(tch[0], k)) <= 1e-5, k
    assert rel(tri[0].mean_logit, tch[0].mean_logit) <= 1e-4
    for i, k in ((1, "grad hidden"), (2, "grad weight"), (3, "grad bias")):
        assert rel(tri[i], tch[i]) <= 1e-2, k
    lp, ent = logitless.token_logprobs(hid, Head(w, b, TRANSFORM), tgt, entropy=True,
                                       options=PassOptions(impl=impl))
    assert rel(lp, tri[0].logp) <= 1e-6 and rel(ent, tri[0].entropy) <= 1e-6


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_policy_loss_fused_and_recompute_vs_torch(case, level):
    hid, w, b, tgt, _ = case
    bsz, t = 16, N // 16
    ids = tgt.clamp(min=0).reshape(bsz, t)
    mask = (tgt != -100).reshape(bsz, t).float()
    head = Head(w, b, TRANSFORM)
    with torch.no_grad():
        cur = logitless.token_logprobs(hid.reshape(bsz, t, H), head, ids)
    gen = torch.Generator("cuda").manual_seed(2)
    old = cur + 0.2 * torch.randn(cur.shape, device="cuda", generator=gen)
    ref_lp = cur + 0.2 * torch.randn(cur.shape, device="cuda", generator=gen)
    adv = torch.randn(bsz, device="cuda", generator=gen)
    cfg = PolicyConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28, importance_sampling_level=level)
    res = {}
    runs = [(impl, mode) for impl in KERNELS for mode in ("fused", "recompute")]
    for impl, mode in [*runs, ("torch", "fused")]:
        hh, ww = hid.reshape(bsz, t, H).clone().requires_grad_(), w.clone().requires_grad_()
        loss, m = logitless.policy_loss(hh, Head(ww, b, TRANSFORM), ids, mask, adv, old, ref_lp, config=cfg,
                                        options=PassOptions(mode=mode, impl=impl))
        loss.backward()
        res[(impl, mode)] = (loss.detach(), hh.grad, ww.grad, m["entropy"])
    base = res[("torch", "fused")]
    for key in runs:
        loss, gh, gw, ent = res[key]
        assert rel(loss, base[0]) <= 1e-4, key
        assert rel(gh, base[1]) <= 2e-2 and rel(gw, base[2]) <= 2e-2, key
        assert rel(ent, base[3]) <= 1e-5, key


@pytest.mark.parametrize("pairs", [True, False])
def test_weight_grad_over_several_chunks_vs_torch(case, monkeypatch, pairs):
    """``d weight`` accumulated over four token chunks: the first chunk's products are stored into
    the uninitialized buffer, the later ones added; an fp32 buffer by cuBLAS (``beta = 0`` first),
    or the gemm backend's bf16 pair by its own GEMM (``ops.triton_shared.weight_grad``)."""
    from backend_calls import keep_planned_chunks

    from logitless.ops import gemm

    layouts = keep_planned_chunks(monkeypatch, lambda p: pairs and p.backend.CAPS.pairs_weight_grad)  # 4 chunks
    assert gemm.cuda_store_ok()
    hid, w, b, tgt, _ = case
    res = {}
    for impl in ("torch", *KERNELS):
        hh, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
        loss, _ = logitless.cross_entropy(hh, Head(ww, b, TRANSFORM), tgt,
                                          options=PassOptions(mode="fused", impl=impl, chunk_bytes=64 << 20))
        loss.backward()
        res[impl] = (loss.detach(), hh.grad, ww.grad)
    assert layouts == ["fp32", "fp32", *(["pair" if pairs else "fp32"] * (len(KERNELS) - 1))]
    for impl in KERNELS:
        assert rel(res[impl][0], res["torch"][0]) <= 1e-4, impl
        assert rel(res[impl][1], res["torch"][1]) <= 2e-2 and rel(res[impl][2], res["torch"][2]) <= 2e-2, impl


def test_cross_entropy_with_smoothing_and_z_loss_vs_torch(case):
    hid, w, b, tgt, _ = case
    res = {}
    for impl in ("torch", "triton"):
        hh, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
        loss, m = logitless.cross_entropy(hh, Head(ww, b, TRANSFORM), tgt, label_smoothing=0.1, z_loss=1e-4,
                                          options=PassOptions(impl=impl))
        loss.backward()
        res[impl] = (loss.detach(), hh.grad, ww.grad, m["accuracy"])
    assert rel(res["triton"][0], res["torch"][0]) <= 1e-5
    assert rel(res["triton"][1], res["torch"][1]) <= 2e-2 and rel(res["triton"][2], res["torch"][2]) <= 2e-2
    assert abs(res["triton"][3] - res["torch"][3]).item() <= 1e-3


def test_lora_head_triton_vs_torch_and_merged_weight(case):
    hid, w, _, tgt, _ = case
    g = torch.Generator("cuda").manual_seed(3)
    la = (torch.randn(16, H, device="cuda", generator=g) / H**0.5).bfloat16()
    lb = (torch.randn(V, 16, device="cuda", generator=g) * 0.5).bfloat16()
    m, scaling = 2048, 2.0
    targets = tgt[:m].clamp(min=0)
    outs = {}
    for impl in ("torch", "triton"):
        hh, aa, bb = (x.clone().requires_grad_() for x in (hid[:m], la, lb))
        st = logitless.vocab_stats(hh, Head(w, lora=HeadLoRA(aa, bb, scaling)), targets,
                                   options=PassOptions(impl=impl))
        (-st.logp.sum() + 0.1 * st.entropy.sum()).backward()
        outs[impl] = (st.logp, st.entropy, hh.grad, aa.grad, bb.grad)
    for i, k in enumerate(("logp", "entropy", "grad hidden", "grad A", "grad B")):
        assert rel(outs["triton"][i], outs["torch"][i]) <= (1e-2 if i > 1 else 1e-4), k
    # The merged weight is rounded to bf16 once, the adapter term is not: agreement to bf16 level.
    merged = (w.float() + scaling * lb.float() @ la.float()).bfloat16()
    assert rel(outs["triton"][0], logitless.token_logprobs(hid[:m], merged, targets)) <= 2e-2


def test_default_precision_is_fp64_close_and_input_precision_is_not(case):
    """fp32 logits (default) stay within 2e-4 nats of float64 (≈1.0e-4 measured on
    an H100: fp32 accumulation over H); ``logits_precision="input"`` rounds the bf16 matmul output
    as the plain path does, which costs far more."""
    hid, w, _, tgt, _ = case
    m = 1024
    targets = tgt[:m].clamp(min=0)
    exact64 = torch.log_softmax(hid[:m].double() @ w.double().t(), -1).gather(1, targets[:, None])[:, 0]
    exact = logitless.token_logprobs(hid[:m], w, targets)
    rounded = logitless.token_logprobs(hid[:m], w, targets, options=PassOptions(logits_precision="input"))
    err, err_rounded = (exact.double() - exact64).abs().max(), (rounded.double() - exact64).abs().max()
    assert err <= 2e-4 and err_rounded > 10 * err


@pytest.mark.parametrize("kind", ["stride-0 weight", "lora"])
def test_stride0_weight_and_lora_bf16_gradients_within_plain_error(kind):
    """Issue 33, item 12, on the compiled kernels: with a stride-0 (expanded) weight and a bias, or
    a LoRA adapter, every bf16 gradient of the Triton and gemm backends lies within 1.2x the plain
    bf16 path's error against float64 (error norms; a stride-0 weight's exact ``d hidden`` is 0).
    Under the interpreter a truncating fp32 -> bf16 cast made them up to ~2x (LoRA's ``d A`` up to
    9x reported); see tests/test_bf16_rounding.py."""
    n, h, v = 512, 256, 4099
    g = torch.Generator("cuda").manual_seed(5)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 3 / h**0.5).bfloat16()
    leaves = {"hidden": torch.randn(n, h, device="cuda", generator=g).bfloat16(),
              "weight": weight[:1].expand(v, h) if kind == "stride-0 weight" else weight,
              "bias": torch.randn(v, device="cuda", generator=g).bfloat16()}
    if kind == "lora":
        leaves["a"] = (torch.randn(16, h, device="cuda", generator=g) / h**0.5).bfloat16()
        leaves["b"] = (torch.randn(v, 16, device="cuda", generator=g) * 0.5).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)

    ref = logp_grads(leaves, targets, "fp64")
    plain = [(a - b).norm().item() for a, b in zip(logp_grads(leaves, targets, "plain"), ref, strict=True)]
    for impl in KERNELS:
        for name, got, want, bound in zip(leaves, logp_grads(leaves, targets, impl), ref, plain, strict=True):
            assert (got - want).norm().item() <= 1.2 * bound, (impl, name, (got - want).norm().item() / bound)


# The fused preference passes' runs checked against the torch backend's fused run.
_PREFERENCE_RUNS = (("triton", "fused"), ("gemm", "fused"), ("gemm", "recompute"),
                    *((("cute", "fused"), ("cute", "recompute")) if CUTE else ()))


@pytest.mark.parametrize("objective", ["dpo", "kto", "simpo"])
def test_preference_fused_passes_vs_torch(case, objective):
    """``dpo_fused_pass`` / ``kto_fused_pass`` / ``cpo_fused_pass`` (SimPO), what the TRL drop-ins
    run: loss, gradients, per-sequence sums and the mean-logit / top-1 sums on the compiled
    backends against the torch backend, 8 pairs of 256 tokens with masked positions."""
    from logitless.objectives.preference_fused import cpo_fused_pass, dpo_fused_pass, kto_fused_pass

    hid, w, b, tgt, _ = case
    dev = hid.device
    bsz, t = 16, N // 16
    ids, mask = tgt.clamp(min=0).reshape(bsz, t), (tgt != -100).reshape(bsz, t)
    ref = -2.0 * mask.sum(1) + torch.randn(bsz, device=dev, generator=torch.Generator(dev).manual_seed(3))
    label = torch.arange(bsz, device=dev) % 3 == 0
    res = {}
    for impl, mode in [*_PREFERENCE_RUNS, ("torch", "fused")]:
        hh, ww = hid.reshape(bsz, t, H).clone().requires_grad_(), w.clone().requires_grad_()
        head, opts = Head(ww, b, TRANSFORM), PassOptions(mode=mode, impl=impl)
        if objective == "dpo":
            cfg = logitless.DPOLossConfig(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.2))
            out = dpo_fused_pass(hh, head, ids, mask, ref[:8], ref[8:], config=cfg, options=opts)
        elif objective == "kto":
            out = kto_fused_pass(hh, head, ids, mask, label, ref, torch.tensor(0.3, device=dev), options=opts)
        else:
            cfg = logitless.CPOLossConfig(loss_type="simpo", beta=2.0, cpo_alpha=0.0)
            out = cpo_fused_pass(hh, head, ids, mask, config=cfg, options=opts)
        out.loss.backward()
        res[(impl, mode)] = (out.loss.detach(), hh.grad, ww.grad, out.policy, out.tokens)
    base = res[("torch", "fused")]
    for key, (loss, gh, gw, policy, tokens) in res.items():
        assert rel(loss, base[0]) <= 1e-4, key
        assert rel(gh, base[1]) <= 2e-2 and rel(gw, base[2]) <= 2e-2, key
        assert rel(policy.logps, base[3].logps) <= 1e-5 and rel(policy.entropy_sum, base[3].entropy_sum) <= 1e-5, key
        if tokens is not None:  # near-ties of bf16 inputs may flip a few top-1 hits between backends
            # A sequence's sum of per-token mean logits cancels (both signs): its relative error is
            # a few times the per-token one (1e-4 in test_vocab_stats_vs_torch_and_fp64).
            assert rel(tokens.mean_logit, base[4].mean_logit) <= 5e-4, key
            assert (tokens.top1 - base[4].top1).abs().sum() <= 0.01 * mask.sum(), key
