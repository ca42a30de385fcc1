"""The first statistics GEMM launched before the value checks' read (``engine.start_pass``), under
the Triton interpreter (``impl="gemm"``; the compiled kernels run in ``test_gpu.py``'s cases).

In policy, fused preference, cross-entropy and rollout calls, the started rows must change
nothing: the same loss, gradients and metrics as the pass without them (bit for bit: each row's
statistics come from the same tiles either way), and against the torch backend as in
``test_gemm_backend.py``, whether the first chunk joins them (enough counted rows) or computes
them again (fewer counted rows than were started). Bad values still raise their
named error, after the started GEMM ran on them.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import child_run, interpreted

import logitless
from logitless import PassOptions
from logitless.ops import engine
from logitless.ops import plan as planning

pytest.importorskip("triton")

test_under_interpreter = child_run(__file__)

V, H = 96, 32


@pytest.fixture
def launches(monkeypatch):
    """Row counts of the gemm backend's statistics launches, in order; started passes use 16-row
    steps of about 12 rows' GEMM each (the interpreter's sizes), so a 40-token sequence batch
    starts some."""
    from logitless.ops.gemm_backend import backend as gemm_backend

    monkeypatch.setattr(gemm_backend, "START_ALIGN", 16)
    monkeypatch.setattr(planning, "_START_FLOP", 64 * 2 * H * V)
    rows: list[int] = []
    real = gemm_backend.launch_forward

    def counted(ops, *a, **k):
        rows.append(ops.hidden.shape[0])
        return real(ops, *a, **k)

    monkeypatch.setattr(gemm_backend, "launch_forward", counted)
    return rows


def _policy(impl: str, mode: str, keep: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 40
    h = torch.randn(b, t, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) < keep).long()
    adv, old = torch.randn(b, generator=g), -torch.rand(b, t, generator=g) * 3
    ref = old + 0.1 * torch.randn(b, t, generator=g)
    cfg = logitless.PolicyConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    loss, metrics = logitless.policy_loss(h, w, ids, mask, adv, old, ref, config=cfg,
                                          options=PassOptions(mode=mode, impl=impl))
    loss.backward()
    return int(mask.sum()), [loss, h.grad, w.grad, *metrics.values()]


def _dpo(impl: str, mode: str, keep: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    pairs, t = 3, 48
    h = torch.randn(2 * pairs, t, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (2 * pairs, t), generator=g)
    mask = (torch.rand(2 * pairs, t, generator=g) < keep).long()
    ref_c, ref_r = -torch.rand(pairs, generator=g) * 30, -torch.rand(pairs, generator=g) * 30
    loss, metrics = logitless.dpo_loss_fused(h, w, ids, mask, ref_c, ref_r, options=PassOptions(mode=mode, impl=impl))
    loss.backward()
    return int(mask.sum()), [loss, h.grad, w.grad, *metrics.values()]


def _token_inputs(keep: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 40
    h = torch.randn(b, t, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (b, t), generator=g).masked_fill(torch.rand(b, t, generator=g) >= keep, -100)
    return h, w, ids


def _cross_entropy(impl: str, mode: str, keep: float, seed: int):
    h, w, ids = _token_inputs(keep, seed)
    loss, metrics = logitless.cross_entropy(h, w, ids, z_loss=1e-3, options=PassOptions(mode=mode, impl=impl))
    loss.backward()
    return int((ids != -100).sum()), [loss, h.grad, w.grad, *metrics.values()]


def _rollout(impl: str, mode: str, keep: float, seed: int):
    h, w, ids = _token_inputs(keep, seed)
    logp, entropy = logitless.token_logprobs(h, w, ids, entropy=True, options=PassOptions(mode=mode, impl=impl))
    return int((ids != -100).sum()), [logp, entropy]


@interpreted
@pytest.mark.parametrize("call", [_policy, _dpo, _cross_entropy, _rollout],
                         ids=["policy", "dpo", "cross_entropy", "rollout"])
@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("keep", [0.8, 0.15], ids=["joined", "computed_again"])
def test_started_rows_change_nothing(monkeypatch, launches, call, mode, keep):
    seed = int(torch.randint(0, 2**31, ()))
    n_seen, started = (6 * 48 if call is _dpo else 4 * 40), planning.started_rows
    count, with_start = call("gemm", mode, keep, seed)
    first = launches[:2]
    launches.clear()
    monkeypatch.setattr(engine, "started_rows", lambda *a: 0)
    _, without = call("gemm", mode, keep, seed)
    assert len(launches) == 1 and launches[0] == count  # one chunk, one launch of its rows
    rows = started(n_seen, H, V, 16)
    assert rows > 0
    if count >= rows:  # the first chunk launched only the rest
        assert first == [rows, count - rows]
    else:  # too few rows counted: the chunk computed them all again
        assert first == [rows, count]
    for a, b in zip(with_start, without, strict=True):
        assert torch.equal(a, b)
    _, oracle = call("torch", mode, keep, seed)
    for a, b in zip(with_start, oracle, strict=True):  # bf16 dy in the gemm backend's gradients
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.detach().abs().max()) + 1e-5)


@interpreted
@pytest.mark.parametrize("bad", ["nan_hidden", "target_out_of_range"])
def test_bad_values_still_raise_their_named_error(launches, bad):
    """The started GEMM ran on the unchecked values (a NaN, a token id past the vocabulary), and
    the call still raises the check's error, not a fault or a NaN loss."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    b, t = 4, 40
    h = torch.randn(b, t, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, V, (b, t), generator=g)
    if bad == "nan_hidden":
        h[0, 3, 5] = float("nan")
    else:
        ids[0, 3] = V + 7
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16)
    with pytest.raises(ValueError, match="NaN or inf" if bad == "nan_hidden" else "targets must lie in"):
        logitless.policy_loss(h, w, ids, torch.ones(b, t, dtype=torch.long), torch.randn(b, generator=g),
                              -torch.rand(b, t, generator=g), options=PassOptions(impl="gemm"))
    assert launches, "the started GEMM did not run before the read"


@pytest.mark.parametrize("hidden_size,vocab", [(4096, 128256), (2304, 256000), (3584, 151936)])
def test_started_rows_cover_the_host_wait(hidden_size, vocab):
    """About 2 ms of the dense pass's GEMM at the bench's shapes (more where the backend's rows come
    in larger steps), whole steps, at most half the rows; none for a pass too short for one step."""
    rows = planning.started_rows(8192, hidden_size, vocab, 128)
    assert rows % 128 == 0 and 1.3e12 <= 2 * rows * hidden_size * vocab <= 1.3e12 + 2 * 128 * hidden_size * vocab
    assert planning.started_rows(8192, hidden_size, vocab, 2048) == 2048
    assert planning.started_rows(4095, hidden_size, vocab, 2048) == 0
    assert planning.started_rows(2 * rows, hidden_size, vocab, 128) == rows
    assert planning.started_rows(2 * rows - 1, hidden_size, vocab, 128) == 0
