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


def _short_chunks(monkeypatch):
    """Token chunks of 256 rows at the shortest, where the gemm plan's floor is 1024 (a GPU's
    size): the several-chunk cases then take 512 rows, not 2048, which the interpreter takes
    minutes over. The started rows (64, see ``launches``) stay well inside a first chunk."""
    monkeypatch.setitem(planning._MIN_TOKENS, "gemm", 256)


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
    rows = started(n_seen, H, V, 16)
    assert rows > 0
    # A second part after the send, within the first half of the rows.
    parts = [rows, min(rows, (n_seen // 2 - rows) // 16 * 16)]
    first = launches[:len(parts) + 1]
    launches.clear()
    monkeypatch.setattr(engine, "started_rows", lambda *a: 0)
    _, without = call("gemm", mode, keep, seed)
    assert len(launches) == 1 and launches[0] == count  # one chunk, one launch of its rows
    total = sum(parts)
    if count > total:  # the first chunk launched only the rest
        assert first == [*parts, count - total]
    elif count < total:  # too few rows counted: the chunk computed them all again
        assert first == [*parts, count]
    else:
        assert first == parts
    for a, b in zip(with_start, without, strict=True):
        assert torch.equal(a, b)
    _, oracle = call("torch", mode, keep, seed)
    for a, b in zip(with_start, oracle, strict=True):  # bf16 dy in the gemm backend's gradients
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.detach().abs().max()) + 1e-5)


@interpreted
@pytest.mark.parametrize("call", ["policy", "dpo", "cross_entropy"])
@pytest.mark.parametrize("bad", ["nan_hidden", "target_out_of_range"])
def test_bad_values_still_raise_their_named_error(launches, call, bad):
    """The started GEMM ran on the unchecked values (a NaN, a token id past the vocabulary), and
    the call still raises the check's error, not a fault or a NaN loss (the first part launches
    before the checks are even built)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    b, t = 4, 40
    h = torch.randn(b, t, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, V, (b, t), generator=g)
    if bad == "nan_hidden":
        h[0, 3, 5] = float("nan")
    else:
        ids[0, 3] = V + 7
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16)
    options = PassOptions(impl="gemm")
    with pytest.raises(ValueError, match="NaN or inf" if bad == "nan_hidden" else "targets must lie in"):
        if call == "policy":
            logitless.policy_loss(h, w, ids, torch.ones(b, t, dtype=torch.long), torch.randn(b, generator=g),
                                  -torch.rand(b, t, generator=g), options=options)
        elif call == "dpo":
            ref = -30 * torch.rand(b, generator=g, dtype=torch.float64)
            logitless.dpo_loss_fused(h, w, ids, torch.ones(b, t), ref[:b // 2], ref[b // 2:], options=options)
        else:
            logitless.cross_entropy(h, w, ids, options=options)
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


@pytest.mark.parametrize("buffer_rows", [None, 0, 5, 12, 20])
def test_launch_after_joins_or_recomputes_the_started_rows(buffer_rows):
    """``launch_after`` with a stand-in launch (each row's partial is its id plus a tile offset, each
    stored logit its row id): the chunk's partials and logits are those of one launch over all its
    rows, whether the started rows' buffer becomes the chunk's (20 or 12 rows: it holds the chunk's
    12), their logits are copied into a new one (a buffer of 5 rows), they were launched without
    storing (0: run again), or nothing was started (``None``)."""
    from logitless.ops.contract import StartedRows, StatRequest
    from logitless.ops.triton_shared.tile_gemm import TileOperands, launch_after

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n, started_n, tiles, vocab = 12, 4, 3, 7
    ids = torch.randn(n, generator=g)  # a row's identity, carried in its hidden state
    ops = TileOperands(ids[:, None], torch.ones(vocab, 1), None, torch.zeros(n, dtype=torch.long), None)
    launched: list[int] = []

    def launch(o, z):
        launched.append(o.hidden.shape[0])
        if z is not None:
            z.copy_(o.hidden.expand(-1, vocab).to(z.dtype))
        return {"m": o.hidden[:, 0] + torch.arange(tiles)[:, None], "zy": o.hidden.t()}

    started = None
    if buffer_rows is not None:
        z0 = torch.full((max(buffer_rows, started_n), vocab), torch.nan, dtype=torch.float16) if buffer_rows else None
        first = ops._replace(hidden=ops.hidden[:started_n], targets=ops.targets[:started_n])
        started = StartedRows(started_n, launch(first, None if z0 is None else z0[:started_n]), z0, "stand-in",
                              StatRequest(), True)
    launched.clear()
    parts, z = launch_after(launch, ops, lambda rows: torch.empty((rows, vocab), dtype=torch.float16), started)
    torch.testing.assert_close(parts["m"], ids + torch.arange(tiles)[:, None], rtol=0, atol=0)
    torch.testing.assert_close(parts["zy"], ids[None, :], rtol=0, atol=0)
    torch.testing.assert_close(z, ids[:, None].expand(-1, vocab).half(), rtol=0, atol=0)
    assert launched == ([n] if not buffer_rows else [n - started_n])
    assert (started is not None and started.z is not None and z.data_ptr() == started.z.data_ptr()) == \
        (buffer_rows is not None and buffer_rows >= n)


@pytest.mark.parametrize("store", [True, False])
def test_a_second_started_part_continues_the_first(store):
    """``launch_started`` with a stand-in launch (as above): a first part of 4 rows, then the next
    5 after it, cover 9 rows whose partials and stored logits are those of one launch over them,
    in the first part's buffer (or none stored, without one)."""
    from logitless.ops.contract import StartedRows, StatRequest
    from logitless.ops.triton_shared.tile_gemm import TileOperands, launch_started

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n, tiles, vocab = 9, 3, 7
    ids = torch.randn(n, generator=g)
    ops = TileOperands(ids[:, None], torch.ones(vocab, 1), None, torch.zeros(n, dtype=torch.long), None)

    def launch(o, z):
        if z is not None:
            z.copy_(o.hidden.expand(-1, vocab).to(z.dtype))
        return {"m": o.hidden[:, 0] + torch.arange(tiles)[:, None], "zy": o.hidden.t()}

    new_z = (lambda: torch.full((12, vocab), torch.nan, dtype=torch.float16)) if store else None
    rows, parts, z = launch_started(launch, ops._replace(hidden=ops.hidden[:4]), new_z, None)
    first = StartedRows(rows, parts, z, "stand-in", StatRequest(), True)
    rows, parts, z = launch_started(launch, ops._replace(hidden=ops.hidden[4:]), new_z, first)
    assert rows == n and (z is None) == (not store) and (z is None or z.data_ptr() == first.z.data_ptr())
    torch.testing.assert_close(parts["m"], ids + torch.arange(tiles)[:, None], rtol=0, atol=0)
    torch.testing.assert_close(parts["zy"], ids[None, :], rtol=0, atol=0)
    if store:
        torch.testing.assert_close(z[:n], ids[:, None].expand(-1, vocab).half(), rtol=0, atol=0)
        assert z[n:].isnan().all()


@interpreted
def test_a_second_part_needs_a_first(launches):
    """``start_pass(after=...)``: nothing starts after a handle already taken (its rows would not
    be the pass's first), and a second part with no room left (half the rows started) keeps the
    first part's rows as they are."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n = 128
    h = torch.randn(n, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16)
    ids, order = torch.randint(0, V, (n,), generator=g), torch.arange(n)
    args = (h, ids, order, logitless.Head(w), engine.ObjectiveSpec(), PassOptions(impl="gemm"), False)
    first = engine.start_pass(*args)
    assert first is not None and first.rows == 64 and launches == [64]  # half the rows: no room for more
    second = engine.start_pass(*args, after=first)
    assert second is not None and second.rows == 64 and first.rows == 0 and launches == [64]
    assert engine.start_pass(*args, after=first) is None and launches == [64]


@interpreted
def test_the_started_buffer_lives_no_longer_than_the_first_chunk(monkeypatch, launches):
    """A fused pass of two chunks: the first chunk's logits buffer, made with the started rows, is
    gone (no handle keeps it) when the second chunk's statistics GEMM runs, as a buffer the chunk
    made itself would be."""
    import weakref

    from logitless.ops.gemm_backend import backend as gemm_backend

    buffers, alive = [], []
    real_start, real_launch = gemm_backend.start_rows, gemm_backend.launch_forward

    def start_rows(*a):
        out = real_start(*a)
        buffers.append(weakref.ref(out.z))
        return out

    def launch(ops, *a, **k):
        alive.append([ref() is not None for ref in buffers])
        return real_launch(ops, *a, **k)

    monkeypatch.setattr(gemm_backend, "start_rows", start_rows)
    monkeypatch.setattr(gemm_backend, "launch_forward", launch)
    _short_chunks(monkeypatch)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    b, t = 16, 32  # two chunks of 256 tokens, the shortest (see _short_chunks)
    h = torch.randn(b, t, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16).requires_grad_()
    loss, _ = logitless.policy_loss(h, w, torch.randint(0, V, (b, t), generator=g), torch.ones(b, t),
                                    torch.randn(b, generator=g), -torch.rand(b, t, generator=g),
                                    # (skipping puts the rows with a gradient first, and then nothing
                                    # starts ahead of two chunks: the test below)
                                    options=PassOptions(impl="gemm", chunk_bytes=256 * V * 2, skip_zero_rows=False))
    loss.backward()
    # the started rows' two parts, the first chunk's rest, the second chunk
    assert launches == [64, 64, 128, 256]
    assert alive[2] == [True, True] and alive[3] == [False, False]


@interpreted
def test_rows_with_a_gradient_first_start_after_the_read(monkeypatch, launches):
    """A policy pass whose rows with a gradient come first sizes its first chunk by their count
    (a chunk of those rows alone): after the read that brings the count, the whole first chunk's
    statistics GEMM starts, into a buffer of that chunk's size, which the first chunk then takes
    (no buffer of its own, no launch), whether the rows with a gradient take one chunk or
    several. With a quarter of the rows reward-constant the rest take statistics only. The loss,
    gradients and metrics are those of the same pass with nothing started, bit for bit."""
    from logitless.ops.gemm_backend import backend as gemm_backend

    started, buffers = [], []
    real_start, real_buffer = gemm_backend.start_rows, gemm_backend._z_buffer

    def start_rows(head, rows, *a):
        started.append(rows.hidden.shape[0])
        return real_start(head, rows, *a)

    def z_buffer(rows, *a):
        buffers.append(rows)
        return real_buffer(rows, *a)

    monkeypatch.setattr(gemm_backend, "start_rows", start_rows)
    monkeypatch.setattr(gemm_backend, "_z_buffer", z_buffer)
    _short_chunks(monkeypatch)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    b, t = 16, 32
    h = torch.randn(b, t, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 0.7).to(torch.bfloat16)
    ids, adv = torch.randint(0, V, (b, t), generator=g), torch.randn(b, generator=g)
    old = -torch.rand(b, t, generator=g)

    def run(adv_now, chunk_rows, config=None):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, metrics = logitless.policy_loss(hh, ww, ids, torch.ones(b, t), adv_now, old, config=config,
                                              options=PassOptions(impl="gemm", chunk_bytes=chunk_rows * V * 2))
        loss.backward()
        return [loss, hh.grad, ww.grad, *metrics.values()]

    # 512 rows (384 with a gradient) in chunks of 256 (several) or 512 (one): the statistics GEMMs'
    # rows, and the logits buffers made (the started one first, then each later gradient chunk's);
    # GSPO's chunks hold whole sequences (32 rows each), those with a gradient first
    constant = torch.where(torch.arange(b) % 4 == 0, 0.0, adv)
    gspo = logitless.PolicyConfig(importance_sampling_level="sequence")
    for chunk_rows, adv_now, config, want, made in ((256, adv, None, [256, 256], [256, 256]),
                                                    (256, constant, None, [256, 128, 128], [256, 128]),
                                                    (256, constant, gspo, [256, 128, 128], [256, 128]),
                                                    (512, adv, None, [512], [512]),
                                                    (512, constant, None, [384, 128], [384])):
        launches.clear(), buffers.clear(), started.clear()
        got = run(adv_now, chunk_rows, config)
        assert launches == want and buffers == made and started == want[:1], (chunk_rows, launches, buffers)
        launches.clear(), started.clear()
        with monkeypatch.context() as nothing_starts:
            nothing_starts.setattr(engine, "started_rows", lambda *a: 0)
            expected = run(adv_now, chunk_rows, config)
        assert launches == want and not started
        for a, e in zip(got, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
