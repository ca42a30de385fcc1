"""Triton backend vs the torch backend and the float64 oracle, under the Triton interpreter.

Every kernel runs on CPU tensors with ``TRITON_INTERPRET=1``. That variable only takes effect
for kernels decorated after it is set, and another test module may have imported the kernels
earlier in this pytest process, so the cases run in a child pytest with the variable set
(:func:`test_under_interpreter`). Run ``TRITON_INTERPRET=1 pytest tests/test_triton_backend.py``
to see them one by one.

Errors are bounded by the reference's own: ``|ours - fp64| <= |torch backend - fp64| + tol``.
"""

from __future__ import annotations

import pytest
import torch
from backend_calls import backward, forward, log_sum_sq_oracle, log_sum_sq_probs, lse_logp_sum_pz
from interpreter import child_run, interpreted

from logitless import Head, LogitTransform, PassOptions
from logitless.ops.contract import Accumulators, SavedStats, StatGrads

pytest.importorskip("triton")

test_under_interpreter = child_run(__file__)


# Odd sizes: V = 123 is not a multiple of the interpreter's 64-wide blocks (masked tail) and
# N = 47 not a multiple of rows per program; vocab_block 50 cuts V into 50 + 50 + 23.
N, V = 47, 123
TRANSFORMS = {
    "plain": ({}, False),
    "full": ({"temperature": 0.7, "logit_scale": 1.3, "softcap": 5.0}, True),
}


def _inputs(dtype, transform_key, hidden_size=16, seed=0):
    from logitless.ops.transform import LogitTransform

    g = torch.Generator().manual_seed(seed)
    kw, has_bias = TRANSFORMS[transform_key]
    h = torch.randn(N, hidden_size, generator=g).to(dtype)
    w = (torch.randn(V, hidden_size, generator=g) * 3 / hidden_size**0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if has_bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[3], t[5] = V + 2, -1  # targets of another vocabulary shard
    return h, w, b, t, LogitTransform(**kw)


def _oracle(h, w, b, t, transform, g_logp, g_lse, g_ent):
    """fp64 materialized ``(lse, logp, sum_pz)`` and the gradients of
    ``Σ g_logp logp + g_lse lse + g_ent entropy`` w.r.t. ``(h, w, b)``."""
    leaves = [x.double().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    y = leaves[0] @ leaves[1].t()
    if b is not None:
        y = y + leaves[2]
    z = transform.apply(y)
    lse = torch.logsumexp(z, dim=1)
    sum_pz = (torch.softmax(z, dim=1) * z).sum(1)
    owned = (t >= 0) & (t < V)
    zy = torch.where(owned, z.gather(1, t.clamp(0, V - 1)[:, None]).squeeze(1), torch.zeros_like(lse))
    logp = zy - lse
    loss = sum(
        (g.double() * s).sum() for g, s in ((g_logp, logp), (g_lse, lse), (g_ent, lse - sum_pz)) if g is not None
    )
    grads = torch.autograd.grad(loss, leaves) if torch.is_tensor(loss) else None
    return (lse.detach(), logp.detach(), sum_pz.detach()), grads


def _assert_bounded(ours, ref, oracle, rtol, name):
    """``|ours - oracle| <= |ref - oracle| + rtol * max|oracle|`` elementwise, and, independently
    of the torch backend (whose own error would loosen that bound if it were wrong too),
    ``max |ours - oracle| <= 2 rtol max|oracle|`` and the same of ``ref``."""
    ours, ref, oracle = ours.double(), ref.double(), oracle.double()
    tol = rtol * oracle.abs().max().clamp_min(1.0)
    excess = (ours - oracle).abs() - (ref - oracle).abs() - tol
    assert excess.max() <= 0, f"{name}: error exceeds the torch backend's by {excess.max().item():.3e} (tol {tol:.1e})"
    for who, x in (("ours", ours), ("torch backend", ref)):
        err = (x - oracle).abs().max()
        assert err <= 2 * tol, f"{name}: {who} is {err.item():.3e} off float64 (bound {2 * tol:.1e})"


def _rtol(dtype, tile, what):
    if dtype == torch.float32:
        return 1e-5
    if what == "stats":
        # fp32 tile: same logits as the torch backend. bf16 tile: logits rounded to bf16
        # (relative 2**-9 of |z|, which the max-scaled tolerance covers).
        return 1e-5 if tile == "fp32" else 2**-7
    return 2e-2  # gradients: dy is rounded to bf16 for the bf16 GEMMs (the torch CPU path keeps fp32)


def _plan(vocab_block, tile="fp32"):
    from logitless.ops.plan import ChunkPlan

    return ChunkPlan(token_chunk=N, vocab_block=vocab_block, keep_logits=vocab_block == V, fp32_logits=tile == "fp32")


# Forward: both input dtypes, both transforms (bias, scale, softcap, temperature), one block or
# three, and for bf16 both tile dtypes (the fp32 tile of bf16 inputs is the GPU default).
FORWARD_CASES = [
    (dt, tr, vb, "fp32") for dt in (torch.float32, torch.bfloat16) for tr in TRANSFORMS for vb in (V, 50)
] + [(torch.bfloat16, tr, V, "input") for tr in TRANSFORMS]


@interpreted
@pytest.mark.parametrize(("dtype", "transform_key", "vocab_block", "tile"), FORWARD_CASES)
def test_chunk_forward(monkeypatch, dtype, transform_key, vocab_block, tile):
    from logitless.ops.torch_backend import backend as torch_backend
    from logitless.ops.triton_backend import backend as triton_backend

    h, w, b, t, tr = _inputs(dtype, transform_key)
    plan = _plan(vocab_block, tile)
    ours, kept = forward(triton_backend, h, w, b, t, tr, plan, True, keep_logits=True, want_sum_sq=True)
    ref, _ = forward(torch_backend, h, w, b, t, tr, plan, True, keep_logits=True, want_sum_sq=True)
    assert (kept is not None) == (vocab_block == V)
    assert torch.equal(ours.owned, ref.owned)
    assert (
        ours.max_logit.dtype
        == ours.sum_exp.dtype
        == ours.sum_exp_logit.dtype
        == ours.target_logit.dtype
        == torch.float32
    )
    oracle, _ = _oracle(h, w, b, t, tr, None, None, None)
    names = ("lse", "logp", "sum_pz")
    for name, a, r, o in zip(names, lse_logp_sum_pz(ours), lse_logp_sum_pz(ref), oracle, strict=True):
        _assert_bounded(a, r, o, _rtol(dtype, tile, "stats"), name)
    assert ours.sum_exp_sq.dtype == torch.float32
    _assert_bounded(log_sum_sq_probs(ours), log_sum_sq_probs(ref), log_sum_sq_oracle(h, w, b, tr),
                    _rtol(dtype, tile, "stats"), "log_sum_sq_probs")
    assert torch.all(ours.target_logit[~ours.owned] == 0)


@interpreted
def test_chunk_forward_without_entropy_matches_with():
    from logitless.ops.triton_backend import backend as triton_backend

    h, w, b, t, tr = _inputs(torch.float32, "full")
    a, _ = forward(triton_backend, h, w, b, t, tr, _plan(50), False, keep_logits=False)
    c, _ = forward(triton_backend, h, w, b, t, tr, _plan(50), True, keep_logits=False)
    assert a.sum_exp_logit is None and a.sum_exp_sq is None and c.sum_exp_sq is None
    for x, y in ((a.max_logit, c.max_logit), (a.sum_exp, c.sum_exp), (a.target_logit, c.target_logit)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# Backward: kept tile (fused) and recomputed blocks, g_entropy absent/present, g_logp absent,
# g_lse absent, for fp32, for bf16 with an fp32 tile (dy written over the tile's first half) and
# with a bf16 tile (dy written in place); H = 32 once so the GEMM sizes differ from N and V.
BACKWARD_CASES = [
    # dtype, transform, kept, (g_logp, g_lse, g_entropy) present, tile, H
    (torch.float32, "plain", True, (True, True, True), "fp32", 16),
    (torch.float32, "full", False, (True, True, True), "fp32", 32),
    (torch.float32, "full", True, (True, False, False), "fp32", 16),
    (torch.bfloat16, "full", True, (True, True, True), "fp32", 16),
    (torch.bfloat16, "full", False, (False, True, False), "fp32", 16),
    (torch.bfloat16, "plain", True, (True, True, True), "input", 16),
    (torch.bfloat16, "full", False, (True, False, True), "input", 16),
]


@interpreted
@pytest.mark.parametrize(("dtype", "transform_key", "kept", "present", "tile", "hidden_size"), BACKWARD_CASES)
def test_chunk_backward(monkeypatch, dtype, transform_key, kept, present, tile, hidden_size):
    from logitless.ops.torch_backend import backend as torch_backend
    from logitless.ops.triton_backend import backend as triton_backend

    h, w, b, t, tr = _inputs(dtype, transform_key, hidden_size=hidden_size, seed=1)
    gen = torch.Generator().manual_seed(2)
    g_logp, g_lse, g_ent = (torch.randn(N, generator=gen) if p else None for p in present)
    plan = _plan(V if kept else 50, tile)
    oracle_stats, oracle_grads = _oracle(h, w, b, t, tr, g_logp, g_lse, g_ent)
    results = {}
    for name, backend in (("triton", triton_backend), ("torch", torch_backend)):
        partials, logits = forward(backend, h, w, b, t, tr, plan, g_ent is not None, keep_logits=kept)
        assert (logits is not None) == kept
        lse, _, sum_pz = lse_logp_sum_pz(partials)
        gw = torch.zeros(V, hidden_size)
        gb = torch.zeros(V) if b is not None else None
        gh = backward(
            backend,
            h,
            w,
            b,
            t,
            tr,
            plan,
            SavedStats(lse, sum_pz),
            StatGrads(logp=g_logp, lse=g_lse, entropy=g_ent),
            Accumulators(gw, gb, hidden=True),
            logits,
        )
        assert gh.dtype == torch.float32 and gh.shape == h.shape
        results[name] = (gh, gw, gb)
    for i, name in enumerate(("d hidden", "d weight", "d bias")):
        if results["torch"][i] is not None:
            _assert_bounded(
                results["triton"][i], results["torch"][i], oracle_grads[i], _rtol(dtype, tile, "grads"), name
            )
    assert oracle_stats is not None


@interpreted
def test_chunk_backward_accumulates_and_skips_hidden():
    """grad_weight/grad_bias are accumulators; need_grad_hidden=False returns None."""
    from logitless.ops.triton_backend import backend as triton_backend

    h, w, b, t, tr = _inputs(torch.float32, "full")
    plan = _plan(V)
    partials, kept = forward(triton_backend, h, w, b, t, tr, plan, False, keep_logits=True)
    lse = partials.finalize()[0].lse
    g = torch.ones(N)
    saved = SavedStats(lse, None)

    def step(acc: Accumulators, kept=None):
        return backward(triton_backend, h, w, b, t, tr, plan, saved, StatGrads(logp=g), acc, kept)

    gw1, gb1 = torch.zeros(V, 16), torch.zeros(V)
    step(Accumulators(gw1, gb1, hidden=False))
    gw2, gb2 = gw1.clone(), gb1.clone()
    out = step(Accumulators(gw2, gb2, hidden=False), kept)
    assert out is None
    torch.testing.assert_close(gw2, 2 * gw1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gb2, 2 * gb1, rtol=1e-5, atol=1e-6)


@interpreted
@pytest.mark.parametrize("impl", ["triton", "flash", "gemm", "auto"])
def test_fp64_runs_on_the_torch_backend(impl):
    """fp64 inputs resolve to the torch backend whatever ``impl`` asks for; so does
    ``impl="torch"``, while bf16 under the interpreter gets the Triton kernels."""
    from logitless.ops import resolve_backend
    from logitless.ops.torch_backend import backend as torch_backend
    from logitless.ops.triton_backend import backend as triton_backend

    h64 = torch.randn(3, 4, dtype=torch.float64)
    assert resolve_backend(impl, h64) is torch_backend
    assert resolve_backend("triton", h64.bfloat16()) is triton_backend
    assert resolve_backend("flash", h64.bfloat16(), has_lora=True) is triton_backend


# Public API end to end: a small budget so the plan cuts several token chunks and vocabulary
# blocks (8000 B at 16 B/element: 32-token chunks, 15-entry blocks).
SMALL_BUDGET = 8000


@interpreted
def test_vocab_stats_and_token_logprobs_match_torch():
    import logitless
    from logitless.objectives.reference import reference_stats

    h, w, b, t, _ = _inputs(torch.float32, "full")
    t = t.clamp(0, V - 1)
    t[7] = -100
    tr = LogitTransform(temperature=0.7, logit_scale=1.3, softcap=5.0)
    out, grads = {}, {}
    for impl in ("torch", "triton"):
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        st = logitless.vocab_stats(hh, Head(ww, bb, tr), t, options=PassOptions(impl=impl, chunk_bytes=SMALL_BUDGET))
        (st.logp.sum() * 0.5 + (st.entropy * torch.linspace(-1, 1, N)).sum() + st.lse.square().sum()).backward()
        out[impl], grads[impl] = st, (hh.grad, ww.grad, bb.grad)
    ref = reference_stats(h, w, t, bias=b, temperature=0.7, logit_scale=1.3, softcap=5.0)
    for i, name in enumerate(("logp", "lse", "entropy")):
        _assert_bounded(out["triton"][i], out["torch"][i], ref[i], 1e-5, name)
    for a, c in zip(grads["triton"], grads["torch"], strict=True):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
    lp_tri, ent_tri = logitless.token_logprobs(
        h, Head(w, b, tr), t, entropy=True, options=PassOptions(impl="triton", chunk_bytes=SMALL_BUDGET)
    )
    lp_tch, ent_tch = logitless.token_logprobs(
        h, Head(w, b, tr), t, entropy=True, options=PassOptions(impl="torch", chunk_bytes=SMALL_BUDGET)
    )
    torch.testing.assert_close(lp_tri, lp_tch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_tri, ent_tch, rtol=1e-5, atol=1e-5)
    assert lp_tri[7] == 0


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_loss_fused_matches_torch(dtype):
    import logitless

    g = torch.Generator().manual_seed(3)
    b_, t_, hid = 3, 9, 16
    h = torch.randn(b_, t_, hid, generator=g).to(dtype)
    w = (torch.randn(V, hid, generator=g) * 0.7).to(dtype)
    ids = torch.randint(0, V, (b_, t_), generator=g)
    mask = (torch.rand(b_, t_, generator=g) > 0.2).long()
    adv = torch.randn(b_, generator=g)
    old = -torch.rand(b_, t_, generator=g) * 3
    res = {}
    for impl in ("torch", "triton"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, metrics = logitless.policy_loss(
            hh, ww, ids, mask, adv, old, options=PassOptions(mode="fused", impl=impl, chunk_bytes=SMALL_BUDGET)
        )
        loss.backward()
        res[impl] = (loss.detach(), hh.grad.float(), ww.grad.float(), metrics)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(res["triton"][0], res["torch"][0], **tol)
    torch.testing.assert_close(res["triton"][1], res["torch"][1], **tol)
    torch.testing.assert_close(res["triton"][2], res["torch"][2], **tol)
    for k, v in res["torch"][3].items():
        torch.testing.assert_close(res["triton"][3][k].float(), v.float(), **tol, msg=k)


def test_autotune_restores_every_running_statistic():
    """Autotune trials must start from the same buffers: every pointer the statistics kernel
    updates in place (all but the tile, the bias and the targets) is restored between trials,
    the running Σz included (it was once missing, so label smoothing summed Σz once per trial)."""
    from logitless.ops.triton_backend import kernels as triton_kernels

    in_place = {a for a in triton_kernels._stats_kernel.arg_names if a.endswith("_ptr")} - {"y_ptr", "bias_ptr",
                                                                                            "tgt_ptr"}
    assert in_place == set(triton_kernels._RESTORE["stats"]) and "sz_ptr" in in_place
    assert triton_kernels._RESTORE["dlogits"] == ["y_ptr"]  # dy is written over the tile


def test_settings_are_read_once(monkeypatch):
    """``LOGITLESS_*`` switches are parsed once (a later change needs ``reload``), so no pass can
    see a half-applied switch, such as an untuned kernel launched without its block size."""
    from logitless.ops import settings

    monkeypatch.delenv("LOGITLESS_TRITON_AUTOTUNE", raising=False)
    monkeypatch.delenv("LOGITLESS_CHUNK_BYTES", raising=False)
    try:
        assert settings.reload().triton_autotune is False
        monkeypatch.setenv("LOGITLESS_TRITON_AUTOTUNE", "1")
        monkeypatch.setenv("LOGITLESS_CHUNK_BYTES", "12345")
        assert settings.settings().triton_autotune is False and settings.settings().chunk_bytes == 2**30
        reloaded = settings.reload()
        assert reloaded.triton_autotune is True and reloaded.chunk_bytes == 12345
        assert PassOptions().budget == 12345
        monkeypatch.setenv("LOGITLESS_LOGITS_PRECISION", "bf16")
        with pytest.raises(ValueError, match="LOGITLESS_LOGITS_PRECISION"):
            settings.reload()
    finally:
        monkeypatch.delenv("LOGITLESS_TRITON_AUTOTUNE")
        monkeypatch.delenv("LOGITLESS_CHUNK_BYTES")
        monkeypatch.delenv("LOGITLESS_LOGITS_PRECISION")
        settings.reload()
