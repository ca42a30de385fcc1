"""The kept tile as scaled probabilities (``logitless.ops.triton_shared.prob_tile``): where the
gradient reaches the logits through ``logp`` alone, the gemm and cute backends keep
``exp(z - ref)`` in bf16 and run the gradient GEMMs on it with no ``dy`` pass.

Chunk by chunk against the torch backend and float64 (the gemm backend under the Triton
interpreter on CPUs, both on a Hopper GPU), including rows whose target lies far below ``lse``
(recomputed on the device) and a backward on chosen rows; and through ``policy_loss`` against the
torch backend's materialized logits and the centred tile."""

from __future__ import annotations

import pytest
import torch
from backend_calls import local_head

from logitless import PassOptions, PolicyConfig, head_loss, policy_loss
from logitless.ops import contract
from logitless.ops.contract import Accumulators, ChunkRows, SavedStats, StatGrads, StatRequest
from logitless.ops.plan import ChunkPlan
from logitless.ops.transform import LogitTransform
from logitless.ops.triton_shared import prob_tile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUTE = DEVICE == "cuda" and contract.cute_runs_on(torch.device("cuda"))
BACKENDS = ["gemm", pytest.param("cute", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not CUTE, reason="needs an sm90 GPU and the CuTe DSL")])]
WANT = StatRequest(entropy=True, logp_grad_only=True)


def _backend(name: str):
    if name == "cute":
        from logitless.ops.cute_backend import backend
    else:
        from logitless.ops.gemm_backend import backend
    return backend


def _inputs(n: int, vocab: int, hidden_size: int, seed: int, far: int):
    """bf16 rows and head, the first ``far`` rows' targets more than 80 nats below their ``lse``,
    one target outside the head."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden_size, generator=g)
    w = torch.randn(vocab, hidden_size, generator=g) * 2 / hidden_size**0.5
    h[:far] *= 40
    t = torch.randint(0, vocab, (n,), generator=g)
    t[:far] = (h[:far] @ w.t()).argmin(1)
    t[far] = -1
    return h.bfloat16().to(DEVICE), w.bfloat16().to(DEVICE), t.to(DEVICE), torch.randn(n, generator=g).to(DEVICE)


def _oracle(h, w, t, tr, g_logp):
    """fp64 log-probs and the gradients of ``Σ g_logp logp`` w.r.t. ``(h, w)``."""
    leaves = [x.double().requires_grad_() for x in (h, w)]
    z = tr.apply(leaves[0] @ leaves[1].t())
    owned = (t >= 0) & (t < w.shape[0])
    logp = torch.where(owned, z.gather(1, t.clamp(0, w.shape[0] - 1)[:, None])[:, 0], 0.0) - torch.logsumexp(z, 1)
    (g_logp.double() * logp).sum().backward()
    return logp.detach(), [x.grad for x in leaves]


def _grads(backend, h, w, t, tr, g_logp, want, rows=None):
    """``(d hidden, d weight)`` of ``Σ g_logp logp`` from one kept chunk (``rows``: the backward
    on those rows only, their ``d hidden``), and the kept tile."""
    head = local_head(w, None, tr)
    plan = ChunkPlan(token_chunk=h.shape[0], vocab_block=w.shape[0], keep_logits=True, fp32_logits=True)
    part, kept = backend.chunk_forward(head, ChunkRows(h, t), plan, want, True)
    stats, saved = part.finalize()
    grads = StatGrads(logp=g_logp)
    if rows is not None:
        h, t, kept = h[rows], t[rows], backend.kept_rows(kept, rows)
        saved, grads = SavedStats(saved.lse[rows], None), StatGrads(logp=g_logp[rows])
    gw = torch.zeros(w.shape, dtype=torch.float32, device=h.device)
    gh = backend.chunk_backward(head, ChunkRows(h, t), plan, saved, grads, Accumulators(gw, hidden=True), kept)
    return gh, gw, kept, stats


def _assert_bounded(ours, ref, oracle, name):
    """As close to float64 as the torch backend, within dy's bf16 rounding."""
    a, r, c = ours.double(), ref.double(), oracle
    assert ((a - c).abs() - (r - c).abs() - 2**-7 * c.abs().max()).max() <= 0, name
    assert (a - c).abs().max() <= 2 * 2**-7 * c.abs().max(), name


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("scale", "temperature"), [(1.0, 1.0), (1.5, 0.7)])
@pytest.mark.parametrize("picked", [False, True])
def test_chunk_gradients(name, scale, temperature, picked):
    """``d hidden`` and ``d weight`` from the kept probabilities as accurate as the torch backend's
    from fp32 logits, with two far rows (stored again against ``lse``: their reference is
    rewritten) and a target outside the head; ``picked``: the backward on half the rows, the
    others' coefficient zero."""
    backend = _backend(name)
    from logitless.ops.torch_backend import backend as torch_backend

    n, vocab, hidden_size = (300, 1000, 72) if DEVICE == "cuda" else (40, 300, 48)
    h, w, t, g_logp = _inputs(n, vocab, hidden_size, seed=int(scale * 10 + picked), far=2)
    tr = LogitTransform(temperature=temperature, logit_scale=scale)
    rows = torch.arange(0, n, 2, device=h.device) if picked else None
    gh, gw, kept, stats = _grads(backend, h, w, t, tr, g_logp, WANT, rows)
    assert isinstance(kept, prob_tile.ProbTile) and kept.q.dtype == torch.bfloat16
    far = [0] if picked else [0, 1]  # the far rows the backward ran on: now against lse
    assert torch.allclose(kept.ref[far].double(), torch.logsumexp(tr.apply(h[far].double() @ w.double().t()), 1),
                          atol=1e-3)
    assert (stats.logp[:2] < -80).all()
    ref_gh, ref_gw, _, _ = _grads(torch_backend, h, w, t, tr, g_logp, WANT, rows)
    weights = g_logp if rows is None else torch.zeros_like(g_logp).index_copy_(0, rows, g_logp[rows])
    _, (oh, ow) = _oracle(h, w, t, tr, weights)
    _assert_bounded(gh, ref_gh, oh if rows is None else oh[rows], "d hidden")
    _assert_bounded(gw, ref_gw, ow, "d weight")


@pytest.mark.parametrize("name", BACKENDS)
def test_kept_as_probabilities_only_where_asked(name):
    """The centred tile without ``logp_grad_only`` or with a soft-cap; with it, a gradient of another
    statistic is refused by name."""
    backend = _backend(name)
    h, w, t, g_logp = _inputs(20, 300, 48, seed=3, far=0)
    _, _, kept, _ = _grads(backend, h, w, t, LogitTransform(), g_logp, StatRequest(entropy=True))
    assert not isinstance(kept, prob_tile.ProbTile)
    _, _, kept, _ = _grads(backend, h, w, t, LogitTransform(softcap=20.0), g_logp, WANT)
    assert not isinstance(kept, prob_tile.ProbTile)
    head = local_head(w, None, LogitTransform())
    plan = ChunkPlan(token_chunk=20, vocab_block=300, keep_logits=True, fp32_logits=True)
    part, kept = backend.chunk_forward(head, ChunkRows(h, t), plan, WANT, True)
    _, saved = part.finalize()
    with pytest.raises(RuntimeError, match="logp_grad_only"):
        backend.chunk_backward(head, ChunkRows(h, t), plan, saved, StatGrads(logp=g_logp, entropy=g_logp),
                               Accumulators(None, hidden=True), kept)


@pytest.mark.parametrize("level", ["token", "sequence_token"])
def test_policy_loss_against_materialized_logits(monkeypatch, level):
    """GRPO with a reward-constant group and a far token, through the gemm backend: loss, gradients
    and metrics as the torch backend's materialized logits give them, and as close to them as the
    centred tile's (``sequence_token``: rows with a gradient picked inside whole-sequence chunks)."""
    from logitless.objectives import policy

    g = torch.Generator().manual_seed(11)
    b, t_len, hidden_size, vocab = 4, 10, 40, 250
    h = torch.randn(b, t_len, hidden_size, generator=g)
    h[0, 2] *= 40
    w = torch.randn(vocab, hidden_size, generator=g) * 2 / hidden_size**0.5
    targets = torch.randint(0, vocab, (b, t_len), generator=g)
    targets[0, 2] = (h[0, 2] @ w.t()).argmin()
    mask = (torch.rand(b, t_len, generator=g) > 0.2).long()
    mask[0, 2] = 1
    adv = torch.randn(b, generator=g)
    adv[2] = 0.0
    old = (torch.randn(b, t_len, generator=g) * 0.05 - 4)
    cfg = PolicyConfig(loss_type="grpo", importance_sampling_level=level)
    h, w = h.bfloat16().to(DEVICE), w.bfloat16().to(DEVICE)
    targets, mask, adv, old = (x.to(DEVICE) for x in (targets, mask, adv, old))

    def run(impl, dtype):
        hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        loss, metrics = policy_loss(hh, ww, targets, mask, adv, old.to(dtype), config=cfg,
                                    options=PassOptions(impl=impl))
        loss.backward()
        return [loss.double(), hh.grad.double(), ww.grad.double()], metrics

    oracle, oracle_metrics = run("torch", torch.float64)
    folded, metrics = run("gemm", torch.bfloat16)
    monkeypatch.setattr(policy, "_want", lambda cfg: StatRequest(entropy=True))
    centred, _ = run("gemm", torch.bfloat16)
    for name, a, c, r in zip(("loss", "d hidden", "d weight"), folded, centred, oracle, strict=True):
        err, err_centred = (a - r).norm() / r.norm(), (c - r).norm() / r.norm()
        assert err <= max(2 * err_centred, 1e-3), (name, float(err), float(err_centred))
    for k, v in oracle_metrics.items():
        torch.testing.assert_close(metrics[k].double(), v.double(), rtol=1e-4, atol=1e-5, msg=k)


def _gemm_against_float64(call, h: torch.Tensor, w: torch.Tensor) -> tuple[int, list, list]:
    """``call(hidden, weight, options) -> (loss, [more tensors])`` on the torch backend in float64
    and on the gemm backend in bf16: how many backward chunks ran on the probability tile, and
    each run's ``[loss, d hidden, d weight, *more]`` in float64 (gemm, then torch)."""
    from logitless.ops.gemm_backend import backend as gemm_backend

    real, calls = gemm_backend.prob_tile_grads, []

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    out = []
    for impl, dtype in (("gemm", torch.bfloat16), ("torch", torch.float64)):
        hh, ww = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gemm_backend, "prob_tile_grads", spy)
            loss, more = call(hh, ww, PassOptions(impl=impl))
        loss.backward()
        out.append([t.double() for t in (loss, hh.grad, ww.grad, *more)])
    return len(calls), out[0], out[1]


def test_head_loss_terms_on_logp_alone():
    """A ``head_loss`` whose statistics leave out ``lse``, the entropy and the mean logit runs on
    the probability tile (gemm backend), with the torch backend's float64 loss and gradients."""
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(50, 40, generator=g)).bfloat16().to(DEVICE)
    w = (torch.randn(300, 40, generator=g) * 2 / 40**0.5).bfloat16().to(DEVICE)
    t = torch.randint(0, 300, (50,), generator=g).to(DEVICE)
    weights = torch.rand(50, generator=g).to(DEVICE)

    def call(hh, ww, options):
        loss, _ = head_loss(hh, ww, t, {"nll": lambda s: -(weights[s.positions] * s.logp).sum()},
                            stats=("logp",), options=options)
        return loss, []

    on_prob_tile, got, ref = _gemm_against_float64(call, h, w)
    assert on_prob_tile == 1
    for name, a, r in zip(("loss", "d hidden", "d weight"), got, ref, strict=True):
        assert (a - r).norm() <= 5e-3 * r.norm(), name


@pytest.mark.parametrize("objective", ["dpo", "kto", "simpo", "orpo"])
def test_fused_preference_losses_on_the_probability_tile(objective):
    """The fused preference losses take the tokens' log-probs alone (their entropy and logit sums
    are logged), so the gemm backend keeps the probability tile: the torch backend's float64 loss,
    gradients and metrics."""
    import logitless

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    b, t, hidden_size, vocab = 2, 12, 40, 300
    h = torch.randn(2 * b, t, hidden_size, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(vocab, hidden_size, generator=g) * 2 / hidden_size**0.5).bfloat16().to(DEVICE)
    ids = torch.randint(0, vocab, (2 * b, t), generator=g).to(DEVICE)
    mask = (torch.rand(2 * b, t, generator=g) > 0.2).float().to(DEVICE)
    ref = (-30 * torch.rand(2 * b, generator=g, dtype=torch.float64)).to(DEVICE)
    label = (torch.arange(2 * b) % 2 == 0).to(DEVICE)
    losses = {
        "dpo": lambda hh, ww, o: logitless.dpo_loss_fused(hh, ww, ids, mask, ref[:b], ref[b:], options=o),
        "kto": lambda hh, ww, o: logitless.kto_loss_fused(hh, ww, ids, mask, label, ref, (ref - 1, ref - 2),
                                                          config=logitless.KTOLossConfig(loss_type="kto"), options=o),
        "simpo": lambda hh, ww, o: logitless.simpo_loss_fused(hh, ww, ids, mask, options=o),
        "orpo": lambda hh, ww, o: logitless.orpo_loss_fused(hh, ww, ids, mask, options=o),
    }

    def call(hh, ww, options):
        loss, metrics = losses[objective](hh, ww, options)
        return loss, list(metrics.values())

    on_prob_tile, got, ref_out = _gemm_against_float64(call, h, w)
    assert on_prob_tile > 0
    for a, r in zip(got, ref_out, strict=True):
        assert (a - r).norm() <= 5e-3 * r.norm() + 1e-6
