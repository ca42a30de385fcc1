"""Value checks read at the end of a call (``ValueChecks.queue`` / ``read``, where
``ops.defers_checks``), under the Triton interpreter (``impl="gemm"``: a backend whose kernels
may run on unchecked values, ``Capabilities.unchecked_values``; the compiled kernels run in
``test_gpu.py``'s cases).

A policy call then queues its value checks behind its pass's first statistics GEMM and reads them
once the whole call is queued. It must give the same loss, gradients and metrics as a call that
reads them before the pass (bit for bit) and as the torch backend's materialized logits give
them, in fused and recompute mode, and every bad value must still raise its named error, with no
gradient reaching the caller's tensors.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import child_run, interpreted

import logitless
from logitless import PassOptions
from logitless.objectives import policy
from logitless.ops import ValueChecks

pytest.importorskip("triton")

test_under_interpreter = child_run(__file__)

V, H = 96, 32


@pytest.fixture
def events(monkeypatch):
    """The order of the gemm backend's statistics launches and chunk backwards, and of the
    checks' queue and read."""
    from logitless.ops.gemm_backend import backend as gemm_backend

    seen: list[str] = []

    def spy(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def call(*a, **k):
            seen.append(label)
            return real(*a, **k)

        monkeypatch.setattr(owner, name, call)

    spy(gemm_backend, "launch_forward", "stats")
    spy(gemm_backend, "chunk_backward", "backward")
    spy(ValueChecks, "queue", "queue")
    spy(ValueChecks, "read", "read")
    return seen


def _inputs(seed: int, constant_groups: bool):
    g = torch.Generator().manual_seed(seed)
    b, t = 8, 24
    h = torch.randn(b, t, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16)
    ids = torch.randint(0, V, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.8).long()
    adv = torch.randn(b, generator=g)
    if constant_groups:  # rows without a gradient, put after the others (ZeroRows.leading)
        adv[::3] = 0.0
    old = -torch.rand(b, t, generator=g) * 3
    ref = old + 0.1 * torch.randn(b, t, generator=g)
    return h, w, ids, mask, adv, old, ref


def _call(inputs, cfg, mode: str, impl: str = "gemm"):
    h, w, ids, mask, adv, old, ref = inputs
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, metrics = logitless.policy_loss(h, w, ids, mask, adv, old, ref, config=cfg,
                                          options=PassOptions(mode=mode, impl=impl))
    loss.backward()
    return [loss, h.grad, w.grad, *metrics.values()]


@interpreted
@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("kind", ["kl_and_entropy", "rows_with_a_gradient_first", "sequence_level"])
def test_deferred_checks_change_nothing(monkeypatch, events, mode, kind):
    inputs = _inputs(int(torch.randint(0, 2**31, ())), constant_groups=kind != "kl_and_entropy")
    cfg = {"kl_and_entropy": logitless.PolicyConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01),
           "rows_with_a_gradient_first": logitless.PolicyConfig(loss_type="grpo"),
           # GSPO: the sequence ends come with the counts' read
           "sequence_level": logitless.PolicyConfig(loss_type="grpo", importance_sampling_level="sequence")}[kind]
    deferred = _call(inputs, cfg, mode)
    order = list(events)
    assert order.count("queue") >= 1 and order.count("read") == 1
    assert order.index("stats") < order.index("queue"), order  # queued behind the first statistics GEMM
    if mode == "fused":  # read once the pass and its gradients are queued
        assert order.index("backward") < order.index("read"), order
    events.clear()
    monkeypatch.setattr(policy, "defers_checks", lambda *a: False)
    at_once = _call(inputs, cfg, mode)
    assert "queue" not in events and "read" not in events
    for a, b in zip(deferred, at_once, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(deferred, _call(inputs, cfg, mode, "torch"), strict=True):  # bf16 dy in the gemm backend's
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.detach().abs().max()) + 1e-5)


@interpreted
@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("bad", ["nan_hidden", "target_out_of_range", "nan_advantage", "negative_mask",
                                 "nan_old_logp", "negative_ratio"])
def test_bad_values_still_raise_their_named_error(events, mode, bad):
    """The pass ran on the unchecked values, and the call raises the check's named error, not a
    fault or a NaN loss; no gradient reaches the caller's tensors."""
    h, w, ids, mask, adv, old, _ = _inputs(int(torch.randint(0, 2**31, ())), constant_groups=True)
    ratio = torch.rand(h.shape[:2]) + 0.5
    at = (1, 5)
    mask[at] = 1
    if bad == "nan_hidden":
        h[(*at, 3)] = float("nan")
    elif bad == "target_out_of_range":
        ids[at] = V + 7
    elif bad == "nan_advantage":
        adv = adv[:, None].expand(h.shape[:2]).clone()
        adv[at] = float("nan")
    elif bad == "negative_mask":
        mask[at] = -1
    elif bad == "nan_old_logp":
        old[at] = float("nan")
    else:
        ratio[at] = -0.5
    match = {"target_out_of_range": "targets must lie in", "negative_mask": "completion_mask values must be",
             "nan_advantage": "advantages contains NaN", "nan_old_logp": "old_logp contains NaN",
             "negative_ratio": "importance_sampling_ratio contains NaN"}.get(bad, "hidden contains NaN")
    h.requires_grad_(), w.requires_grad_()
    with pytest.raises(ValueError, match=match):
        logitless.policy_loss(h, w, ids, mask, adv, old, importance_sampling_ratio=ratio,
                              options=PassOptions(mode=mode, impl="gemm"))
    assert events.index("stats") < events.index("read"), events
    assert h.grad is None and w.grad is None


def _distill_inputs(bad: str | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, t, ht = 4, 12, 24
    h = torch.randn(b, t, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16)
    th = torch.randn(b, t, ht, generator=g).to(torch.bfloat16)
    tw = (torch.randn(V, ht, generator=g) * 0.7).to(torch.bfloat16)
    if bad == "nan_teacher_hidden":
        th[1, 5, 2] = float("nan")
    elif bad == "inf_weight":
        w[7, 3] = float("inf")
    return h.requires_grad_(), w.requires_grad_(), th, tw


def _distill_call(h, w, th, tw):
    loss, metrics = logitless.distill_loss(h, w, th, tw, config=logitless.DistillConfig(divergence="forward_kl"),
                                           options=PassOptions(mode="fused", impl="gemm"))
    loss.backward()
    return [loss, h.grad, w.grad, *metrics.values()]


@interpreted
@pytest.mark.parametrize("read_first", [False, True])
@pytest.mark.parametrize("bad", [None, "nan_teacher_hidden", "inf_weight"])
def test_distillation_reads_its_checks_after_the_pass(monkeypatch, read_first, bad):
    """Distillation without a mask or targets (every position counts, no count to read) queues
    its pass before it reads its value checks, where the backend's kernels take unchecked values:
    the same loss, gradients and metrics bit for bit as a call that reads them first (a backend
    without ``unchecked_values``), and a bad value still raises its named error, after the pass
    ran on it."""
    import dataclasses

    from logitless.ops.gemm_backend import distill as distill_gemm

    seen: list[str] = []
    real_forward, real_read = distill_gemm.chunk_forward, ValueChecks.read
    monkeypatch.setattr(distill_gemm, "chunk_forward", lambda *a, **k: seen.append("stats") or real_forward(*a, **k))
    monkeypatch.setattr(ValueChecks, "read", lambda self: seen.append("read") or real_read(self))
    checked_first = dataclasses.replace(distill_gemm.CAPS, unchecked_values=False)
    if read_first:
        monkeypatch.setattr(distill_gemm, "CAPS", checked_first)
    inputs = _distill_inputs(bad)
    if bad is not None:
        with pytest.raises(ValueError, match="NaN or inf"):
            _distill_call(*inputs)
        assert seen[0] == ("read" if read_first else "stats"), seen
        return
    ours = _distill_call(*inputs)
    assert seen[0] == ("read" if read_first else "stats") and "read" in seen, seen
    monkeypatch.setattr(distill_gemm, "CAPS", checked_first)
    for a, b in zip(ours, _distill_call(*_distill_inputs(None)), strict=True):
        assert torch.equal(a, b)
