"""Flash backend vs the torch backend and the float64 oracle, under the Triton interpreter.

As in ``test_triton_backend.py``, the cases run in a child pytest with ``TRITON_INTERPRET=1``
(:func:`test_under_interpreter`), because the variable only reaches kernels decorated after it
is set. ``TRITON_INTERPRET=1 pytest tests/test_flash_backend.py`` shows them one by one.
:func:`test_gpu_matches_torch` runs the compiled kernels where CUDA exists.

Errors are bounded by the reference's own: ``|ours - fp64| <= |torch backend - fp64| + tol``.
"""

from __future__ import annotations

import pytest
import torch
from backend_calls import backward, forward, log_sum_sq_oracle, log_sum_sq_probs, lse_logp_sum_pz
from interpreter import INTERPRETED, child_run, interpreted

from logitless import Head, LogitTransform, PassOptions
from logitless.ops.contract import Accumulators, SavedStats, StatGrads

pytest.importorskip("triton")

test_under_interpreter = child_run(__file__)


# Odd sizes against the interpreter's tiles (forward 16 rows x 32 entries, backward 32 x 16) and
# 16-wide H steps: N = 37 leaves a 5-row tail block in both; V = 203 an 11-entry tail tile in both
# and, in the forward, 3 vocabulary splits of 3, 3 and 1 tiles (combined afterwards); H = 48 is
# three H steps and H = 40 a masked (or, through descriptors, zero-filled) last step.
N, H, V = 37, 48, 203
TRANSFORMS = {
    "plain": ({}, False),
    "full": ({"temperature": 0.7, "logit_scale": 1.3, "softcap": 5.0}, True),
}


def _inputs(dtype, transform_key, hidden_size=H, seed=0):
    from logitless.ops.transform import LogitTransform

    g = torch.Generator().manual_seed(seed)
    kw, has_bias = TRANSFORMS[transform_key]
    h = torch.randn(N, hidden_size, generator=g).to(dtype)
    w = (torch.randn(V, hidden_size, generator=g) * 3 / hidden_size**0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if has_bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[3], t[5], t[36] = V + 2, -1, V  # targets of another vocabulary shard
    return h, w, b, t, LogitTransform(**kw)


def _oracle(h, w, b, t, transform, g_logp=None, g_lse=None, g_ent=None, g_sz=None):
    """fp64 materialized ``(lse, logp, sum_pz, sum_z)`` and the gradients of
    ``Σ g_logp logp + g_lse lse + g_ent entropy + g_sz Σz`` w.r.t. ``(h, w[, b])``."""
    leaves = [x.double().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    y = leaves[0] @ leaves[1].t()
    if b is not None:
        y = y + leaves[2]
    z = transform.apply(y)
    lse = torch.logsumexp(z, dim=1)
    sum_pz = (torch.softmax(z, dim=1) * z).sum(1)
    owned = (t >= 0) & (t < V)
    zy = torch.where(owned, z.gather(1, t.clamp(0, V - 1)[:, None]).squeeze(1), torch.zeros_like(lse))
    logp, sum_z = zy - lse, z.sum(1)
    terms = ((g_logp, logp), (g_lse, lse), (g_ent, lse - sum_pz), (g_sz, sum_z))
    loss = sum((g.double() * s).sum() for g, s in terms if g is not None)
    grads = torch.autograd.grad(loss, leaves) if torch.is_tensor(loss) else None
    return tuple(x.detach() for x in (lse, logp, sum_pz, sum_z)), grads


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


def _rtol(dtype, what):
    if dtype == torch.float32 or what == "stats":
        return 1e-5  # fp32 accumulation of exact products, like the torch backend's fp32 matmul
    return 2e-2  # gradients: dy is rounded to bf16 for the two bf16 matmuls (the torch CPU path keeps fp32)


def _plan(**kw):
    from logitless.ops.plan import ChunkPlan

    return ChunkPlan(token_chunk=N, vocab_block=V, keep_logits=True, **kw)


def _use_loads(monkeypatch, loads):
    """Pick how the kernels read ``hidden``/``weight``: ``"tma"`` tensor descriptors (the default
    where they are aligned; emulated by the interpreter) or ``"pointer"`` plain masked loads."""
    import dataclasses

    from logitless.ops.flash_backend import backend as flash_backend
    from logitless.ops.flash_backend.kernels import flash_config

    cfg = dataclasses.replace(flash_config(), tma=loads == "tma")
    monkeypatch.setattr(flash_backend, "flash_config", lambda: cfg)


# Forward: both input dtypes, plain / full transform (bias, scale, softcap, temperature), the
# optional sums on and off, through descriptors; two of them again with plain loads.
FORWARD_CASES = [
    (dt, tr, opt, "tma") for dt in (torch.float32, torch.bfloat16) for tr in TRANSFORMS for opt in (True, False)
] + [(torch.float32, "full", True, "pointer"), (torch.bfloat16, "plain", False, "pointer")]


@interpreted
@pytest.mark.parametrize(("dtype", "transform_key", "optional", "loads"), FORWARD_CASES)
def test_chunk_forward(monkeypatch, dtype, transform_key, optional, loads):
    from logitless.ops.flash_backend import backend as flash_backend
    from logitless.ops.torch_backend import backend as torch_backend

    _use_loads(monkeypatch, loads)
    h, w, b, t, tr = _inputs(dtype, transform_key)
    ours, kept = forward(flash_backend, h, w, b, t, tr, _plan(), optional, keep_logits=True, want_sum_z=optional,
                         want_sum_sq=optional)
    ref, _ = forward(torch_backend, h, w, b, t, tr, _plan(), True, keep_logits=False, want_sum_z=True,
                     want_sum_sq=True)
    assert kept is None
    assert (ours.sum_exp_logit is None, ours.sum_logit is None, ours.sum_exp_sq is None) == (not optional,) * 3
    assert torch.equal(ours.owned, ref.owned) and torch.all(ours.target_logit[~ours.owned] == 0)
    assert torch.equal(ours.target_logit >= ours.max_logit, ref.target_logit >= ref.max_logit)  # is_top1
    oracle, _ = _oracle(h, w, b, t, tr)
    ours_lse, ours_logp, ours_spz = lse_logp_sum_pz(ours)
    ref_lse, ref_logp, ref_spz = lse_logp_sum_pz(ref)
    _assert_bounded(ours_lse, ref_lse, oracle[0], _rtol(dtype, "stats"), "lse")
    _assert_bounded(ours_logp, ref_logp, oracle[1], _rtol(dtype, "stats"), "logp")
    if optional:
        _assert_bounded(ours_spz, ref_spz, oracle[2], _rtol(dtype, "stats"), "sum_pz")
        _assert_bounded(ours.sum_logit, ref.sum_logit, oracle[3], _rtol(dtype, "stats"), "sum_z")
        _assert_bounded(log_sum_sq_probs(ours), log_sum_sq_probs(ref), log_sum_sq_oracle(h, w, b, tr),
                        _rtol(dtype, "stats"), "log_sum_sq_probs")


# Backward: each of g_logp, g_lse, g_entropy, g_sum_z alone and all together, both dtypes, both
# transforms, and H = 40 (a masked H step in both the recompute and the gradient loops); three
# again with plain loads.
BACKWARD_CASES = [
    # dtype, transform, (g_logp, g_lse, g_entropy, g_sum_z) present, H, loads
    (torch.float32, "full", (True, True, True, True), H, "tma"),
    (torch.float32, "plain", (True, False, False, False), H, "tma"),
    (torch.float32, "full", (False, True, False, False), H, "tma"),
    (torch.float32, "full", (False, False, True, False), 40, "tma"),
    (torch.float32, "plain", (False, False, False, True), H, "tma"),
    (torch.bfloat16, "full", (True, True, True, True), H, "tma"),
    (torch.bfloat16, "plain", (True, False, True, False), 40, "tma"),
    (torch.float32, "full", (True, True, True, True), H, "pointer"),
    (torch.float32, "full", (False, False, True, False), 40, "pointer"),
    (torch.bfloat16, "plain", (True, False, True, False), 40, "pointer"),
]


@interpreted
@pytest.mark.parametrize(("dtype", "transform_key", "present", "hidden_size", "loads"), BACKWARD_CASES)
def test_chunk_backward(monkeypatch, dtype, transform_key, present, hidden_size, loads):
    from logitless.ops.flash_backend import backend as flash_backend
    from logitless.ops.torch_backend import backend as torch_backend

    _use_loads(monkeypatch, loads)
    h, w, b, t, tr = _inputs(dtype, transform_key, hidden_size=hidden_size, seed=1)
    gen = torch.Generator().manual_seed(2)
    g_logp, g_lse, g_ent, g_sz = (torch.randn(N, generator=gen) if p else None for p in present)
    _, oracle_grads = _oracle(h, w, b, t, tr, g_logp, g_lse, g_ent, g_sz)
    results = {}
    for name, backend in (("flash", flash_backend), ("torch", torch_backend)):
        partials, kept = forward(backend, h, w, b, t, tr, _plan(), g_ent is not None, keep_logits=False)
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
            _plan(),
            SavedStats(lse, sum_pz),
            StatGrads(logp=g_logp, lse=g_lse, entropy=g_ent, sum_z=g_sz),
            Accumulators(gw, gb, hidden=True),
            kept,
        )
        assert gh.dtype == torch.float32 and gh.shape == h.shape
        results[name] = (gh, gw, gb)
    for i, name in enumerate(("d hidden", "d weight", "d bias")):
        if results["torch"][i] is not None:
            _assert_bounded(results["flash"][i], results["torch"][i], oracle_grads[i], _rtol(dtype, "grads"), name)


def _to_bf16(y):
    """fp64 -> the bf16 value a kernel's fp32 -> bf16 cast gives: round to nearest even, as torch
    (compiled kernels do; the interpreter's truncation is patched to match, tests/interpreter.py)."""
    return y.float().bfloat16().double()


@interpreted
def test_fp32_logits_false_rounds_the_matmul_output():
    """``plan.fp32_logits=False``: the bf16 matmul output is rounded before bias and transform, as
    in the plain bf16 path, in the forward and in the backward's recomputation alike (gradients
    pass straight through the rounding)."""
    from logitless.ops.flash_backend import backend as flash_backend
    from logitless.ops.transform import LogitTransform

    h, w, b, t, tr = _inputs(torch.bfloat16, "full")
    gen = torch.Generator().manual_seed(4)
    g_logp, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    leaves = [x.double().requires_grad_() for x in (h, w, b)]
    y = leaves[0] @ leaves[1].t()
    y = y + (_to_bf16(y) - y).detach() + leaves[2]
    z = tr.apply(y)
    lse = torch.logsumexp(z, 1)
    ent = lse - (torch.softmax(z, 1) * z).sum(1)
    owned = (t >= 0) & (t < V)
    logp = torch.where(owned, z.gather(1, t.clamp(0, V - 1)[:, None]).squeeze(1), 0.0) - lse
    want = torch.autograd.grad((g_logp * logp + g_ent * ent).sum(), leaves)
    outs = {}
    for fp32 in (True, False):
        part, _ = forward(flash_backend, h, w, b, t, tr, _plan(fp32_logits=fp32), True, keep_logits=False)
        ours_lse, _, spz = lse_logp_sum_pz(part)
        gw, gb = torch.zeros(V, H), torch.zeros(V)
        gh = backward(
            flash_backend,
            h,
            w,
            b,
            t,
            tr,
            _plan(fp32_logits=fp32),
            SavedStats(ours_lse, spz),
            StatGrads(logp=g_logp, entropy=g_ent),
            Accumulators(gw, gb, hidden=True),
        )
        # g_lse = 1, no transform: d bias sums each row's probabilities, which is 1 only if both
        # passes see the same logits.
        plain, gb1 = LogitTransform(), torch.zeros(V)
        part, _ = forward(flash_backend, h, w, b, t, plain, _plan(fp32_logits=fp32), False, keep_logits=False)
        backward(
            flash_backend,
            h,
            w,
            b,
            t,
            plain,
            _plan(fp32_logits=fp32),
            SavedStats(part.finalize()[0].lse, None),
            StatGrads(lse=torch.ones(N)),
            Accumulators(None, gb1, hidden=False),
        )
        torch.testing.assert_close(gb1.sum(), torch.tensor(float(N)), rtol=1e-5, atol=0)
        outs[fp32] = (ours_lse, gh, gw, gb)
    assert (outs[True][0] - outs[False][0]).abs().max() > 1e-3
    torch.testing.assert_close(outs[False][0].double(), lse.detach(), rtol=0, atol=1e-5)
    for ours, ref in zip(outs[False][1:], want, strict=True):
        assert (ours.double() - ref).abs().max() <= 2e-2 * ref.abs().max()


@interpreted
def test_chunk_backward_accumulates_and_skips_hidden():
    """grad_weight/grad_bias are accumulators (fp32 in place, other dtypes through a temporary);
    need_grad_hidden=False returns None; kept logits are refused."""
    from logitless.ops.flash_backend import backend as flash_backend

    h, w, b, t, tr = _inputs(torch.float32, "full")
    partials, _ = forward(flash_backend, h, w, b, t, tr, _plan(), False, keep_logits=False)
    lse = partials.finalize()[0].lse
    g = torch.ones(N)
    saved = SavedStats(lse, None)

    def step(grads: StatGrads, acc: Accumulators, kept=None):
        return backward(flash_backend, h, w, b, t, tr, _plan(), saved, grads, acc, kept)

    gw1, gb1 = torch.zeros(V, H), torch.zeros(V)
    assert step(StatGrads(logp=g), Accumulators(gw1, gb1, hidden=False)) is None
    gw2, gb2 = gw1.clone(), gb1.clone()
    step(StatGrads(logp=g), Accumulators(gw2, gb2, hidden=False))
    torch.testing.assert_close(gw2, 2 * gw1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gb2, 2 * gb1, rtol=1e-5, atol=1e-6)
    gw64 = torch.ones(V, H, dtype=torch.float64)
    step(StatGrads(logp=g), Accumulators(gw64, None, hidden=False))
    torch.testing.assert_close(gw64, 1 + gw1.double(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="keeps no logits"):
        step(StatGrads(logp=g), Accumulators(gw1, None, hidden=False), torch.zeros(N, V))
    with pytest.raises(ValueError, match="sum_pz"):
        step(StatGrads(entropy=g), Accumulators(gw1, None, hidden=False))


@interpreted
def test_lora_goes_to_the_triton_backend():
    """The flash kernels have no low-rank term: a head with an adapter resolves to the Triton
    backend, and the flash backend refuses adapter rows instead of dropping them."""
    from logitless.ops import resolve_backend
    from logitless.ops.flash_backend import backend as flash_backend
    from logitless.ops.lora import LowRank
    from logitless.ops.triton_backend import backend as triton_backend

    h, w, b, t, tr = _inputs(torch.float32, "full")
    assert resolve_backend("flash", h, has_lora=True) is triton_backend
    assert resolve_backend("flash", h) is flash_backend
    g = torch.Generator().manual_seed(5)
    low = LowRank(torch.randn(N, 4, generator=g), torch.randn(V, 4, generator=g))
    with pytest.raises(ValueError, match="adapter"):
        forward(flash_backend, h, w, b, t, tr, _plan(), False, low=low)


def _peaked_inputs():
    """A trained-like head: the softmax mass sits in vocabulary entries 0-23 (and 100), targets
    are in 0-23, so most 32-wide tiles hold only probabilities below 2**-12 and no target."""
    from logitless.ops.transform import LogitTransform

    g = torch.Generator().manual_seed(7)
    h = torch.randn(N, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 0.3).to(torch.bfloat16)
    b = torch.where(torch.arange(V) < 24, 0.0, -14.0)
    b[100] = 0.0
    t = torch.randint(0, 24, (N,), generator=g)
    return h, w, b.to(torch.bfloat16), t, LogitTransform()


def _flash_grads(monkeypatch, filtered, h, w, b, t, tr, g_logp, g_ent, g_sz):
    from logitless.ops.flash_backend import backend as flash_backend
    from logitless.ops.flash_backend.kernels import flash_config
    from logitless.ops.settings import reload

    monkeypatch.setenv("LOGITLESS_FLASH_FILTER", "1" if filtered else "0")
    reload()
    try:
        assert flash_config().filter == filtered
        partials, _ = forward(flash_backend, h, w, b, t, tr, _plan(), True, keep_logits=False)
        lse, _, sum_pz = lse_logp_sum_pz(partials)
        gw, gb = torch.zeros(V, H), torch.zeros(V)
        gh = backward(
            flash_backend,
            h,
            w,
            b,
            t,
            tr,
            _plan(),
            SavedStats(lse, sum_pz),
            StatGrads(logp=g_logp, entropy=g_ent, sum_z=g_sz),
            Accumulators(gw, gb, hidden=True),
        )
    finally:
        monkeypatch.delenv("LOGITLESS_FLASH_FILTER")
        reload()
    return gh, gw, gb, lse, sum_pz


@interpreted
def test_gradient_filtering(monkeypatch):
    """Filtered gradients differ from unfiltered ones by at most what the skipped entries carry:
    ``|Δ d hidden| <= Σ_{v small} |dy_v| |W_v|`` and ``|Δ d weight| <= Σ_{n small} |dy_n| |h_n|``,
    over the entries under the threshold (a superset of the skipped ones), plus rounding. With a
    ``g_sum_z`` term nothing may be skipped. ``d bias`` is always exact."""
    h, w, b, t, tr = _peaked_inputs()
    gen = torch.Generator().manual_seed(8)
    g_logp, g_ent = torch.randn(N, generator=gen), 0.1 * torch.randn(N, generator=gen)
    exact = _flash_grads(monkeypatch, False, h, w, b, t, tr, g_logp, g_ent, None)
    approx = _flash_grads(monkeypatch, True, h, w, b, t, tr, g_logp, g_ent, None)
    # Rebuild dz/dy as the kernel sees them, to bound what the filter may drop.
    lse, sum_pz = exact[3], exact[4]
    z = h.double() @ w.double().t() + b.double()
    p = torch.exp(z - lse.double()[:, None])
    dz = p * (-g_logp.double()[:, None] - g_ent.double()[:, None] * (z - sum_pz.double()[:, None]))
    dz[torch.arange(N), t] += g_logp.double()
    eps = torch.finfo(torch.bfloat16).eps / 32
    small = dz.abs() <= eps * (g_logp.abs() + g_ent.abs()).double()[:, None]
    assert small.float().mean() > 0.5  # the case does exercise the filter
    dy_small = torch.where(small, dz.abs(), 0.0)
    bound_h = dy_small @ w.double().abs()
    bound_w = dy_small.t() @ h.double().abs()
    rounding = 2e-2 * exact[0].abs().max()  # bf16 dy, as in the unfiltered comparison
    assert not torch.equal(approx[1], exact[1]), "no tile was skipped"
    assert torch.all((approx[0] - exact[0]).abs() <= bound_h + rounding)
    assert torch.all((approx[1] - exact[1]).abs() <= bound_w + 2e-2 * exact[1].abs().max())
    torch.testing.assert_close(approx[2], exact[2], rtol=0, atol=0)
    # Relative to the gradient's size the dropped part is at the bf16 resolution here.
    assert (approx[0] - exact[0]).abs().max() <= 2**-7 * exact[0].abs().max()
    # g_sum_z touches every entry: nothing is skipped (the interpreter's sums are deterministic).
    g_sz = torch.full((N,), 1e-6)  # below the threshold: only the g_sum_z rule keeps the tiles
    with_sz = [_flash_grads(monkeypatch, f, h, w, b, t, tr, g_logp, g_ent, g_sz)[:3] for f in (False, True)]
    for x, y in zip(*with_sz, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@interpreted
def test_config_env(monkeypatch):
    from logitless.ops.flash_backend.kernels import flash_config
    from logitless.ops.settings import reload

    monkeypatch.setenv("LOGITLESS_FLASH_FILTER", "yes")
    try:
        with pytest.raises(ValueError, match="LOGITLESS_FLASH_FILTER"):
            reload()
        monkeypatch.delenv("LOGITLESS_FLASH_FILTER")
        reload()
        cfg = flash_config()
        assert not cfg.filter and flash_config() is cfg  # read once
        assert cfg.splits(N, V, cfg.tiles("fwd", torch.bfloat16), torch.device("cpu")) == 3
        assert cfg.tiles("bwd", torch.float32) is cfg.bwd_fp32 and cfg.tiles("bwd", torch.bfloat16) is cfg.bwd
    finally:
        reload()


@interpreted
def test_resolve_backend():
    from logitless.ops import resolve_backend
    from logitless.ops.flash_backend import backend as flash_backend
    from logitless.ops.torch_backend import backend as torch_backend

    h = torch.randn(2, 3)
    assert resolve_backend("flash", h) is flash_backend
    assert resolve_backend("auto", h) is torch_backend
    with pytest.raises(ValueError, match="flash"):
        resolve_backend("flashy", h)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_stats_matches_torch(dtype):
    import logitless
    from logitless.objectives.reference import reference_stats

    h, w, b, t, _ = _inputs(dtype, "full")
    t = t.clamp(0, V - 1)
    t[7] = -100
    tr = LogitTransform(temperature=0.7, logit_scale=1.3, softcap=5.0)
    out, grads = {}, {}
    for impl in ("torch", "flash"):
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        st = logitless.vocab_stats(hh, Head(ww, bb, tr), t, mean_logit=True, options=PassOptions(impl=impl))
        loss = (
            st.logp.sum() * 0.5
            + (st.entropy * torch.linspace(-1, 1, N)).sum()
            + st.lse.square().sum()
            + st.mean_logit.sum()
        )
        loss.backward()
        out[impl], grads[impl] = st, (hh.grad, ww.grad, bb.grad)
    ref = reference_stats(h, w, t, bias=b, temperature=0.7, logit_scale=1.3, softcap=5.0)
    for i, name in enumerate(("logp", "lse", "entropy")):
        _assert_bounded(out["flash"][i], out["torch"][i], ref[i], 1e-5, name)
    torch.testing.assert_close(out["flash"].mean_logit, out["torch"].mean_logit, rtol=1e-5, atol=1e-5)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, c, name in zip(grads["flash"], grads["torch"], ("hidden", "weight", "bias"), strict=True):
        assert a.dtype == c.dtype == dtype
        torch.testing.assert_close(a.float(), c.float(), **tol, msg=name)
    lp_flash = logitless.token_logprobs(
        h,
        Head(w, bias=b, transform=LogitTransform(temperature=0.7, logit_scale=1.3, softcap=5.0)),
        t,
        options=PassOptions(impl="flash"),
    )
    torch.testing.assert_close(lp_flash, out["torch"].logp.detach(), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("mode", ["recompute", "fused"])
def test_policy_loss_matches_torch(mode):
    import logitless

    g = torch.Generator().manual_seed(3)
    b_, t_, hid = 3, 9, 32
    h = torch.randn(b_, t_, hid, generator=g)
    w = torch.randn(V, hid, generator=g) * 0.7
    ids = torch.randint(0, V, (b_, t_), generator=g)
    mask = (torch.rand(b_, t_, generator=g) > 0.2).long()
    adv = torch.randn(b_, generator=g)
    old = -torch.rand(b_, t_, generator=g) * 3
    cfg = logitless.PolicyConfig(entropy_coef=0.01)
    res = {}
    for impl in ("torch", "flash"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, metrics = logitless.policy_loss(
            hh, ww, ids, mask, adv, old, config=cfg, options=PassOptions(mode=mode, impl=impl)
        )
        loss.backward()
        res[impl] = (loss.detach(), hh.grad, ww.grad, metrics)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for i in range(3):
        torch.testing.assert_close(res["flash"][i], res["torch"][i], **tol)
    for k, v in res["torch"][3].items():
        torch.testing.assert_close(res["flash"][3][k].float(), v.float(), **tol, msg=k)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_torch(dtype):
    """The compiled kernels (real tile sizes, tensor cores, descriptors, atomics) against the torch
    backend, with a vocabulary that is not a multiple of the tiles and an odd token count."""
    import logitless

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hid, vocab = 1000, 512, 5003
    h = torch.randn(n, hid, device="cuda", generator=g).to(dtype)
    w = (torch.randn(vocab, hid, device="cuda", generator=g) / hid**0.5 * 3).to(dtype)
    b = torch.randn(vocab, device="cuda", generator=g).to(dtype)
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    out = {}
    for impl in ("torch", "flash"):
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        st = logitless.vocab_stats(
            hh,
            Head(ww, bias=bb, transform=LogitTransform(temperature=0.9, softcap=30.0)),
            t,
            options=PassOptions(impl=impl),
        )
        (-(st.logp.sum()) + 0.01 * st.entropy.sum()).backward()
        out[impl] = (st.logp.detach(), st.entropy.detach(), hh.grad.float(), ww.grad.float(), bb.grad.float())
    # bf16: dy is rounded to bf16 for the gradient matmuls in both; fp32: TF32x3 vs fp32 cuBLAS.
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    names = ("logp", "entropy", "d hidden", "d weight", "d bias")
    for a, c, name in zip(out["flash"], out["torch"], names, strict=True):
        scale = c.abs().max().clamp_min(1.0)
        assert (a - c).abs().max() <= rtol * scale, name
