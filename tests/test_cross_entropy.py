"""cross_entropy / head_loss against PyTorch's own cross_entropy on float64 materialized logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import logitless
from logitless import Head, LogitTransform, PassOptions, cross_entropy, head_loss
from logitless.ops.torch_backend import backend as torch_backend


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(abs(hash(request.node.name)) % 2**31)


def _inputs(gen, n=47, h=16, v=123, dtype=torch.float64, ignore=True):
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(v, h, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    if ignore:
        targets[torch.rand(n, generator=gen) < 0.2] = -100
    return hidden, weight, targets


def _oracle(hidden, weight, targets, transform, eps, z, reduction):
    logits = transform.apply(hidden.double() @ weight.double().t())
    ce = F.cross_entropy(logits, targets, label_smoothing=eps, reduction=reduction)
    valid = targets != -100
    lse2 = torch.logsumexp(logits, -1)[valid] ** 2
    zl = z * (lse2.sum() if reduction == "sum" else lse2.mean())
    acc = (logits.argmax(-1) == targets)[valid].double().mean()
    return ce + zl, ce, acc


@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("eps", "z"), [(0.0, 0.0), (0.1, 1e-3)])
def test_matches_torch_cross_entropy(gen, mode, reduction, eps, z):
    hidden, weight, targets = _inputs(gen)
    tf = LogitTransform(temperature=0.8, softcap=6.0)
    # small chunk_bytes: several token chunks and vocabulary blocks
    loss, m = cross_entropy(
        hidden,
        Head(weight, transform=tf),
        targets,
        label_smoothing=eps,
        z_loss=z,
        reduction=reduction,
        options=PassOptions(mode=mode, chunk_bytes=4000),
    )
    ref, ref_ce, acc = _oracle(hidden, weight, targets, tf, eps, z, reduction)
    assert torch.allclose(loss, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(m["ce"], ref_ce, rtol=1e-12)
    assert m["accuracy"].item() == pytest.approx(acc.item(), abs=1e-12)
    g = torch.autograd.grad(loss, [hidden, weight])
    g_ref = torch.autograd.grad(ref, [hidden, weight])
    for a, b in zip(g, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_reduction_none_and_num_items(gen):
    hidden, weight, targets = _inputs(gen)
    per_tok, _ = cross_entropy(hidden, weight, targets, label_smoothing=0.2, reduction="none")
    ref = F.cross_entropy(hidden @ weight.t(), targets, label_smoothing=0.2, reduction="none")
    assert torch.allclose(per_tok, ref, rtol=1e-12, atol=1e-12)
    loss, _ = cross_entropy(hidden, weight, targets, num_items_in_batch=100)
    assert torch.allclose(loss, F.cross_entropy(hidden @ weight.t(), targets, reduction="sum") / 100, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_reference_error(gen, dtype):
    hidden, weight, targets = _inputs(gen, dtype=dtype)
    loss, _ = cross_entropy(hidden, weight, targets, z_loss=1e-4)
    exact, _, _ = _oracle(hidden, weight, targets, LogitTransform(), 0.0, 1e-4, "mean")
    logits = (hidden @ weight.t()).float()  # the plain path in this dtype
    plain = F.cross_entropy(logits, targets) + 1e-4 * (torch.logsumexp(logits, -1)[targets != -100] ** 2).mean()
    assert (loss.double() - exact).abs() <= (plain.double() - exact).abs() + 1e-5


def test_head_loss_single_pass_and_term_values(gen, monkeypatch):
    """CE + z-loss + entropy metric: one forward pass over the vocabulary, one backward."""
    hidden, weight, targets = _inputs(gen, ignore=False)
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = torch_backend.chunk_forward, torch_backend.chunk_backward

    def count_fwd(*a, **k):
        calls["forward"] += 1
        return fwd(*a, **k)

    def count_bwd(*a, **k):
        calls["backward"] += 1
        return bwd(*a, **k)

    monkeypatch.setattr(torch_backend, "chunk_forward", count_fwd)
    monkeypatch.setattr(torch_backend, "chunk_backward", count_bwd)
    n = targets.numel()
    loss, values = head_loss(
        hidden,
        weight,
        targets,
        {"ce": lambda s: -s.logp.sum() / s.count, "z": lambda s: 1e-3 * (s.lse**2).sum() / s.count},
        metrics={"entropy": lambda s: s.entropy.sum() / s.count},
        options=PassOptions(mode="fused", impl="torch"),
    )
    loss.backward()
    assert calls == {"forward": 1, "backward": 1}  # one chunk fits: one pass each way
    logits = hidden.detach() @ weight.detach().t()
    logp = torch.log_softmax(logits, -1)
    assert torch.allclose(values["ce"], F.cross_entropy(logits, targets), rtol=1e-12)
    assert torch.allclose(values["z"], 1e-3 * (torch.logsumexp(logits, -1) ** 2).sum() / n, rtol=1e-12)
    assert torch.allclose(values["entropy"], -(logp.exp() * logp).sum(-1).mean(), rtol=1e-12)
    assert torch.allclose(loss, values["ce"] + values["z"], rtol=1e-14)


def test_bad_arguments(gen):
    hidden, weight, targets = _inputs(gen)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(hidden, weight, targets, label_smoothing=1.5)
    with pytest.raises(ValueError, match="z_loss"):
        cross_entropy(hidden, weight, targets, z_loss=float("nan"))
    with pytest.raises(ValueError, match="unknown statistics"):
        head_loss(hidden, weight, targets, {"x": lambda s: s.logp.sum()}, stats=("logp", "logits"))
    bad = targets.clone()
    bad[0] = 123
    with pytest.raises(ValueError, match="targets must lie"):
        logitless.cross_entropy(hidden, weight, bad)


def test_mean_of_no_counted_token_is_nan(gen):
    """Every target ignored: the mean is 0/0 (NaN), as ``F.cross_entropy``'s; one counted token
    gives F's value again."""
    hidden, weight, targets = _inputs(gen)[:3]
    ignored = torch.full_like(targets, -100)
    loss, _ = cross_entropy(hidden, weight, ignored)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(hidden @ weight.t(), ignored))
    ignored[5] = targets[5].clamp_min(0)
    loss, _ = cross_entropy(hidden, weight, ignored)
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.t(), ignored), rtol=1e-12, atol=1e-12)


# A pad id inside the vocabulary (0, or any other id) is ignored as -100 is: every entry point and
# mode against torch's own cross_entropy with that ignore_index, on float64 materialized logits.
@pytest.mark.parametrize("ignore_index", [0, 57])
@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_ignore_index_inside_the_vocabulary(seed, mode, ignore_index):
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, targets = _inputs(gen, ignore=False)
    targets[torch.rand(targets.shape, generator=gen) < 0.3] = ignore_index
    counted = targets != ignore_index
    assert 0 < counted.sum() < targets.numel()
    tf = LogitTransform(temperature=0.8)
    options = PassOptions(mode=mode, chunk_bytes=4000)
    for reduction in ("mean", "sum") + (("none",) if mode == "recompute" else ()):
        logits = tf.apply(hidden @ weight.t())
        loss, m = cross_entropy(hidden, Head(weight, transform=tf), targets, ignore_index=ignore_index,
                                label_smoothing=0.1, z_loss=1e-3, reduction=reduction, options=options)
        ce = F.cross_entropy(logits, targets, ignore_index=ignore_index, label_smoothing=0.1, reduction=reduction)
        lse2 = torch.logsumexp(logits, -1) ** 2 * counted
        z = 1e-3 * (lse2 if reduction == "none" else lse2.sum() / (counted.sum() if reduction == "mean" else 1))
        torch.testing.assert_close(loss, ce + z, rtol=1e-12, atol=1e-12)
        if reduction != "none":
            torch.testing.assert_close(m["ce"], ce.detach(), rtol=1e-12, atol=1e-12)
            acc = (logits.argmax(-1) == targets)[counted].double().mean()
            assert m["accuracy"].item() == pytest.approx(acc.item(), abs=1e-12)
        g = torch.autograd.grad(loss.sum(), [hidden, weight])
        g_ref = torch.autograd.grad((ce + z).sum(), [hidden, weight])
        for a, b in zip(g, g_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # head_loss: the rows its terms sum over, and the count they normalize by
    logits = tf.apply(hidden.detach() @ weight.detach().t())
    nll = F.cross_entropy(logits, targets, ignore_index=ignore_index)
    loss, values = head_loss(hidden, Head(weight, transform=tf), targets, {"ce": lambda s: -s.logp.sum() / s.count},
                             metrics={"rows": lambda s: s.logp.new_tensor(float(s.positions.numel()))},
                             ignore_index=ignore_index, options=options)
    torch.testing.assert_close(loss.detach(), nll, rtol=1e-12, atol=1e-12)
    assert values["rows"].item() == counted.sum().item()
