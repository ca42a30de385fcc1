"""Host reads of device values: a head call reads the device once, in its value checks, which also
bring every count the pass needs (the counted tokens, the rows with a gradient, chunk cuts, KTO's
desirable count), so the host prepares the checks and per-token tensors while the device works and
never waits for the pass itself. Counted on the CPU as reads of tensor values on the host (on a GPU
each is a synchronization): ``nonzero``, ``tolist``, ``item``, the conversions to Python numbers,
and PyTorch's own (boolean-mask indexing, ``masked_select``)."""

from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logitless
from logitless import PassOptions, PolicyConfig, policy_loss
from logitless.objectives.layout import TokenLayout, counted_first_order
from logitless.ops.torch_backend import backend as torch_backend

_READS = ("nonzero", "tolist", "item", "__bool__", "__int__", "__float__", "__index__")


def _cpu_only(code) -> bool:
    """Whether a read is made by a CPU-only path, not the GPU's: the torch backend (the CPU
    specification) or the fused backward's scale (read on the host only for CPU tensors)."""
    return "torch_backend" in code.co_filename or code.co_name == "_scaled"


@pytest.fixture
def host_reads(monkeypatch):
    """The names of the host reads of tensor values made before the first GEMM (``chunk_forward``),
    or during the whole call with ``state["until_end"]``."""
    reads: list[str] = []
    state = {"before_gemm": True}
    for name in _READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            if (state["before_gemm"] or state.get("until_end")) and not _cpu_only(sys._getframe(1).f_code):
                reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    forward = torch_backend.chunk_forward

    def first_gemm(*a, **k):
        state["before_gemm"] = False
        return forward(*a, **k)

    monkeypatch.setattr(torch_backend, "chunk_forward", first_gemm)
    return reads, state


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])  # 0: the zero-advantage rows' count is read too
def test_one_host_read_before_the_first_gemm(seed, host_reads, masked, beta):
    b, t, h, v = 4, 6, 8, 30
    hidden, weight = torch.randn(b, t, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    ids, adv, old = torch.randint(0, v, (b, t)), torch.randn(b), torch.randn(b, t) - 3
    adv[0] = 0.0
    mask = (torch.rand(b, t) > 0.3).float() if masked else torch.ones(b, t)
    reads, state = host_reads
    policy_loss(hidden, weight, ids, mask, adv, old, old, config=PolicyConfig(beta=beta),
                num_items_in_batch=torch.tensor(40.0), options=PassOptions(impl="torch"))
    assert not state["before_gemm"]  # the pass ran
    assert reads == ["tolist"]  # ValueChecks.run's one stacked copy


def test_counted_first_is_the_counted_layout(seed):
    """``TokenLayout.counted_first(mask, counted_first_order(mask != 0)[0]).first(count, ends)`` (no
    host read) is the layout of the counted positions found with ``nonzero``: every field and the
    chunk cuts, for empty, full, sparse and weighted masks; its tokens are every position once."""
    for b, t, p in ((3, 7, 0.4), (2, 5, 1.0), (2, 4, 0.0), (1, 1, 1.0), (0, 3, 0.5), (5, 9, 0.9)):
        mask = (torch.rand(b, t) < p) * torch.rand(b, t).add(0.25)  # weights, zeros where not counted
        index = (mask.reshape(-1) != 0).nonzero().squeeze(1)  # the oracle
        seg = index // t
        lengths = (mask != 0).sum(1).tolist()
        cuts = [sum(lengths[:i + 1]) for i in range(b) if lengths[i]]
        order, count = counted_first_order(mask != 0)
        every = TokenLayout.counted_first(mask, order)
        assert sorted(every.index.tolist()) == list(range(b * t))
        assert int(count) == index.numel()
        torch.testing.assert_close(every.seg_len, mask.sum(1))  # (summed in another order)
        got = every.first(int(count), torch.cumsum(torch.tensor(lengths, dtype=torch.float64), 0).tolist())
        assert torch.equal(got.index, index) and torch.equal(got.seg, seg), (b, t, p)
        assert torch.equal(got.weight, mask.reshape(-1)[index]) and got.cuts == cuts, (b, t, p)
        assert got.num_segments == b and got.complete == (index.numel() == b * t)


def test_counted_first_order_with_a_lead(seed):
    """``counted_first_order(counted, lead)`` puts the counted positions of ``lead`` first, then the
    other counted ones, then the rest, each part in position order (the oracle: three
    ``nonzero`` calls), for a per-token and a per-sequence (``[B, 1]``) lead."""
    for b, t in ((4, 6), (1, 9), (3, 1), (0, 4)):
        counted = torch.rand(b, t) < 0.7
        for lead in (torch.rand(b, t) < 0.5, torch.rand(b, 1) < 0.5):
            both = counted & lead
            parts = (both, counted & ~both, ~counted)
            oracle = torch.cat([p.reshape(-1).nonzero().squeeze(1) for p in parts])
            order, count = counted_first_order(counted, lead)
            assert torch.equal(order, oracle) and int(count) == int(counted.sum()), (b, t, tuple(lead.shape))


def test_uncounted_positions_may_hold_anything(seed):
    """NaN hidden rows and out-of-range ids at uncounted positions (checked in the caller's layout,
    counted positions only) change nothing: the same loss and gradients, bit for bit, as with
    clean values there, and no gradient reaches those rows; at a counted position they raise."""
    b, t, h, v = 3, 5, 8, 20
    hidden, weight = torch.randn(b, t, h), torch.randn(v, h)
    ids, adv, old = torch.randint(0, v, (b, t)), torch.randn(b), torch.randn(b, t) - 3
    mask = torch.ones(b, t)
    mask[1, 3:] = 0
    mask[2, 4] = 0

    def run(hid, tgt):
        hh, ww = hid.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = policy_loss(hh, ww, tgt, mask, adv, old, options=PassOptions(impl="torch"))
        loss.backward()
        return loss, hh.grad, ww.grad

    dirty_h, dirty_ids = hidden.clone(), ids.clone()
    dirty_h[1, 3] = math.nan
    dirty_h[2, 4, 0] = math.inf
    dirty_ids[1, 4] = v + 7
    clean, dirty = run(hidden, ids), run(dirty_h, dirty_ids)
    for a, c in zip(clean, dirty, strict=True):
        assert torch.equal(a, c)
    assert (dirty[1][mask == 0] == 0).all()
    bad = hidden.clone()
    bad[0, 2, 1] = math.nan
    with pytest.raises(ValueError, match="hidden contains NaN or inf"):
        run(bad, ids)
    with pytest.raises(ValueError, match=rf"\[0, {v}\).*{v + 2}"):
        run(hidden, torch.where(torch.arange(t) == 1, v + 2, ids))


class _SyncingOps(TorchDispatchMode):
    """The aten ops that read device values on the host inside PyTorch (boolean-mask indexing,
    ``nonzero``, ``masked_select``, scalar reads), outside the CPU-only paths."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        syncing = func in (aten.nonzero.default, aten.masked_select.default, aten._local_scalar_dense.default,
                           aten.is_nonzero.default)
        if func is aten.index.Tensor:
            syncing = any(i is not None and i.dtype == torch.bool for i in args[1])
        if syncing:
            frame = sys._getframe(1)  # the innermost logitless frame (past torch and host_reads' wrappers)
            while frame is not None and "/logitless/" not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is None or not _cpu_only(frame.f_code):
                self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("objective", ["dpo", "kto", "simpo", "cpo", "orpo"])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_preference_reads_the_host_once(seed, host_reads, objective, masked):
    """A fused preference step (forward, metrics and backward) reads device values on the host
    once, the value checks' read, which also brings the used-token count, the units' ends and
    KTO's desirable count: a read after the pass (a metric's) would leave the device idle while
    the host catches up."""
    b, t, h, v = 3, 7, 8, 30
    hidden, weight = torch.randn(2 * b, t, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    ids = torch.randint(0, v, (2 * b, t))
    mask = (torch.rand(2 * b, t) > 0.3).float() if masked else torch.ones(2 * b, t)
    ref = torch.randn(2 * b, dtype=torch.float64) - 10
    options = PassOptions(impl="torch")
    calls = {
        "dpo": lambda: logitless.dpo_loss_fused(hidden, weight, ids, mask, ref[:b], ref[b:], options=options),
        "kto": lambda: logitless.kto_loss_fused(hidden, weight, ids, mask, torch.rand(2 * b) > 0.5, ref,
                                                (ref - 1, ref - 2), config=logitless.KTOLossConfig(loss_type="kto"),
                                                options=options),
        "simpo": lambda: logitless.simpo_loss_fused(hidden, weight, ids, mask, options=options),
        "cpo": lambda: logitless.cpo_loss_fused(hidden, weight, ids, mask, options=options),
        "orpo": lambda: logitless.orpo_loss_fused(hidden, weight, ids, mask, options=options),
    }
    reads, state = host_reads
    state["until_end"] = True
    with _SyncingOps() as syncing:
        loss, _ = calls[objective]()
        loss.backward()
    assert not state["before_gemm"] and hidden.grad is not None
    assert reads == ["tolist"] and syncing.ops == [], (reads, syncing.ops)


def _chunked_policy(hidden: torch.Tensor, weight: torch.Tensor, v: int) -> torch.Tensor:
    """A fused policy loss over several chunks (this budget plans 64-token chunks of its ~300
    counted tokens), 2 of the 8 sequences of zero advantage; the hidden rows are the call's own,
    tiled, so their gradient reaches ``hidden``."""
    b, t = 8, 48
    rows = hidden.reshape(-1, hidden.shape[-1])
    h = rows.repeat(-(-b * t // rows.shape[0]), 1)[:b * t].reshape(b, t, -1)
    mask = (torch.rand(b, t) > 0.2).float()
    adv = torch.randn(b).masked_fill(torch.arange(b) < 2, 0.0)
    return policy_loss(h, weight, torch.randint(0, v, (b, t)), mask, adv, torch.randn(b, t) - 3,
                       options=PassOptions(impl="torch", mode="fused", chunk_bytes=128 * v * 8))[0]


@pytest.mark.parametrize("call", ["policy", "policy_chunks", "sequence_level_policy", "cross_entropy",
                                  "cross_entropy_ignored", "token_logprobs", "distill"])
def test_head_calls_read_the_host_once(seed, host_reads, call):
    """One host read in the whole call: a policy loss (its zero-gradient rows' count comes with
    the checks' read; over several chunks, a running count of them, so each chunk's backward
    rows are counted on the host), a sequence-level one (its chunk cuts too), cross-entropy with
    and without ignored targets (the ignored positions and their count need no read of their own), rollout
    log-probs, and distillation with a mask and ignored targets (the targets' range is checked with
    the other values)."""
    b, t, h, v = 4, 6, 8, 30
    hidden, weight = torch.randn(b, t, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    ids = torch.randint(0, v, (b, t))
    mask = (torch.rand(b, t) > 0.3).float()
    options = PassOptions(impl="torch")
    calls = {
        "policy": lambda: policy_loss(hidden, weight, ids, mask, torch.randn(b).masked_fill(torch.arange(b) == 0, 0.0),
                                      torch.randn(b, t) - 3, options=options)[0],  # zero rows: a zero advantage
        "policy_chunks": lambda: _chunked_policy(hidden, weight, v),
        "cross_entropy": lambda: logitless.cross_entropy(hidden, weight, ids, options=options)[0],
        "cross_entropy_ignored": lambda: logitless.cross_entropy(hidden, weight, ids.masked_fill(mask == 0, -100),
                                                                 options=options)[0],
        "sequence_level_policy": lambda: policy_loss(
            hidden, weight, ids, mask, torch.randn(b), torch.randn(b, t) - 3,
            config=PolicyConfig(loss_type="grpo", importance_sampling_level="sequence"), options=options)[0],
        "token_logprobs": lambda: logitless.token_logprobs(hidden, weight, ids, options=options).sum(),
        "distill": lambda: logitless.distill_loss(
            hidden, weight, torch.randn(b, t, h), torch.randn(v, h), mask=mask,
            targets=ids.masked_fill(mask == 0, -100), config=logitless.DistillConfig(ce_weight=0.5),
            options=options)[0],
    }
    reads, state = host_reads
    state["until_end"] = True
    with _SyncingOps() as syncing:
        out = calls[call]()
        if out.requires_grad:  # (rollout log-probs carry none)
            out.backward()
    assert (hidden.grad is None) == (call == "token_logprobs")
    assert reads == ["tolist"] and syncing.ops == [], (reads, syncing.ops)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("call", ["policy", "sequence_level_policy", "cross_entropy_ignored", "dpo", "kto", "distill"])
def test_one_synchronization_on_the_gpu(call):
    """On the GPU (default backend), a whole step synchronizes the host with the device once,
    counted by ``torch.cuda.set_sync_debug_mode("warn")`` after a warm-up call; a policy loss
    twice: the counts its pass is planned with, while the device has little queued, then its value
    checks, queued behind the pass's first statistics GEMM and read once the call is queued."""
    torch.manual_seed(0)
    b, t, h, v = 4, 64, 256, 4096
    dev = torch.device("cuda")
    hidden = torch.randn(b, t, h, device=dev).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device=dev) / h**0.5).bfloat16().requires_grad_()
    ids = torch.randint(0, v, (b, t), device=dev)
    mask = (torch.rand(b, t, device=dev) > 0.3).float()
    ref = torch.randn(b, device=dev, dtype=torch.float64) - 10
    calls = {
        "policy": lambda: policy_loss(hidden, weight, ids, mask, torch.randn(b, device=dev),
                                      torch.randn(b, t, device=dev) - 3)[0],
        "sequence_level_policy": lambda: policy_loss(
            hidden, weight, ids, mask, torch.randn(b, device=dev), torch.randn(b, t, device=dev) - 3,
            config=PolicyConfig(loss_type="grpo", importance_sampling_level="sequence"))[0],
        "cross_entropy_ignored": lambda: logitless.cross_entropy(hidden, weight, ids.masked_fill(mask == 0, -100))[0],
        "dpo": lambda: logitless.dpo_loss_fused(hidden, weight, ids, mask, ref[:b // 2], ref[b // 2:])[0],
        "kto": lambda: logitless.kto_loss_fused(hidden, weight, ids, mask, torch.arange(b, device=dev) % 2 == 0, ref,
                                                (ref - 1, ref - 2), config=logitless.KTOLossConfig(loss_type="kto"))[0],
        "distill": lambda: logitless.distill_loss(hidden, weight, torch.randn_like(hidden), torch.randn_like(weight),
                                                  mask=mask, targets=ids.masked_fill(mask == 0, -100))[0],
    }
    calls[call]().backward()  # warm-up: compiles the kernels
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    # A wait for an event (the checks' copy, queued before a started GEMM) is a synchronization
    # that the debug mode does not report: counted here.
    waits = []
    real_wait = torch.cuda.Event.synchronize
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = lambda self: waits.append("event") or real_wait(self)
        try:
            calls[call]().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.Event.synchronize = real_wait
    # (The first set_sync_debug_mode of a process also warns that the mode is a prototype: not a sync.)
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs + waits) == (2 if "policy" in call else 1), syncs + waits


def test_packed_policy_reads_the_host_twice(seed, host_reads):
    """Packed inputs read once more, before the value checks: the segment count (over the
    sequence-parallel group; the per-sequence tensors are shaped by it), the ids' order check
    and the counted tokens, in one read."""
    n, h, v = 24, 8, 30
    hidden, weight = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    segment_ids = torch.arange(4).repeat_interleave(6)
    mask = (torch.rand(n) > 0.3).float()
    reads, state = host_reads
    state["until_end"] = True
    with _SyncingOps() as syncing:
        loss, _ = policy_loss(hidden, weight, torch.randint(0, v, (n,)), mask, torch.randn(4), torch.randn(n) - 3,
                              segment_ids=segment_ids, options=PassOptions(impl="torch"))
        loss.backward()
    assert reads == ["tolist", "tolist"] and syncing.ops == [], (reads, syncing.ops)
    with pytest.raises(ValueError, match="non-decreasing"):
        policy_loss(hidden, weight, torch.randint(0, v, (n,)), mask, torch.randn(4), torch.randn(n) - 3,
                    segment_ids=segment_ids.flip(0), options=PassOptions(impl="torch"))
