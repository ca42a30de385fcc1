"""Rows whose gradient is exactly zero: the pass runs the gradient GEMMs on the other rows only
(``PassOptions.skip_zero_rows``). Skipping is exact, so in float64 it must agree with the dense
pass (``skip_zero_rows=False``) to 1e-12 in the loss, every gradient and every metric, in fused
and recompute modes, and the rows must really be left out (the backward sees fewer rows).

The batches are made as GRPO makes them: group rewards, advantages ``(r - mean) / (std + 1e-4)``
(exactly 0 for a group whose rewards are all equal), old log-probs from a perturbed policy so that
tokens fall on the clipped side of the PPO minimum, and a ragged completion mask.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from logitless import Head, PassOptions, PolicyConfig, policy_loss, token_logprobs
from logitless.ops import plan as planning

sys.path.insert(0, str(Path(__file__).parent))

GROUP = 4
TOL = 1e-12


def _batch(gen, groups=4, t=6, h=12, v=67, constant=(0, 2), dtype=torch.float64):
    """A GRPO batch of ``groups`` groups of ``GROUP`` completions; the groups in ``constant`` get
    equal rewards (zero advantages)."""
    b = groups * GROUP
    hidden = torch.randn(b, t, h, generator=gen, dtype=dtype)
    weight = 0.8 * torch.randn(v, h, generator=gen, dtype=dtype)
    bias = 0.3 * torch.randn(v, generator=gen, dtype=dtype)
    ids = torch.randint(0, v, (b, t), generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.25).to(dtype)
    mask[:, 0] = 1.0
    assert (mask == 0).any()
    rewards = torch.rand(groups, GROUP, generator=gen, dtype=dtype).round(decimals=1)
    for g in constant:
        rewards[g] = rewards[g, 0]
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    adv = ((rewards - mean) / (std + 1e-4)).flatten()
    with torch.no_grad():
        cur = token_logprobs(hidden, Head(weight, bias), ids)
    old = cur + 0.4 * torch.randn(b, t, generator=gen, dtype=dtype)
    return dict(hidden=hidden, weight=weight, bias=bias, ids=ids, mask=mask, adv=adv, old=old)


def _run(batch, config: PolicyConfig, skip: bool, mode="fused", impl="torch", chunk_bytes=None,
         frozen=False, **kw):
    hidden = batch["hidden"].clone().requires_grad_()
    weight = batch["weight"].clone().requires_grad_(not frozen)
    bias = batch["bias"].clone().requires_grad_(not frozen)
    loss, metrics = policy_loss(hidden, Head(weight, bias), batch["ids"], batch["mask"], batch["adv"], batch["old"],
                                batch.get("ref"), config=config,
                                options=PassOptions(mode=mode, impl=impl, chunk_bytes=chunk_bytes,
                                                    skip_zero_rows=skip), **kw)
    loss.backward()
    return loss.detach(), [hidden.grad, weight.grad, bias.grad], {k: v.detach() for k, v in metrics.items()}


def _assert_same(a, b, tol=TOL):
    (la, ga, ma), (lb, gb, mb) = a, b
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
    for x, y in zip(ga, gb, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        else:
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    assert ma.keys() == mb.keys()
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=tol, atol=tol, equal_nan=True, msg=k)


@pytest.fixture(autouse=True)
def small_row_multiple(monkeypatch):
    """Test batches have tens of rows: round the backward's rows to a multiple of 4 (not 128), so
    some rows without a gradient still join it and others are left out."""
    monkeypatch.setattr(planning, "_ROW_MULTIPLE", 4)


@pytest.fixture
def picked_counts(monkeypatch):
    """``(rows with a gradient, rows)`` of every decision the engine takes: rows picked within
    a chunk (``planning.backward_rows``), or the pass's gradient chunks ending before its rows
    with none (``planning.leading_rows``, whose rows must then be in that order)."""
    seen: list[tuple[int, int]] = []
    real, real_leading = planning.backward_rows, planning.leading_rows

    def leading(zero, n, started=0, cuts=None):
        end = real_leading(zero, n, started, cuts)
        if end is not None:
            seen.append((end, n))
            assert not zero.mask[:zero.others].any() and zero.mask[zero.others:].all()
            assert end in cuts if cuts is not None else end % 4 == 0 or end == n
        return end

    monkeypatch.setattr(planning, "leading_rows", leading)

    def spy(zero, chunks):
        out = real(zero, chunks)
        for sl, idx in zip(chunks, out, strict=True):
            n = sl.stop - sl.start
            seen.append((n if idx is None else idx.numel(), n))
            if idx is not None:
                assert idx.numel() % 4 == 0 or idx.numel() == n
                assert (idx.diff() > 0).all()  # ascending: the in-place compactions rely on it
                assert not zero.mask[sl][idx].all() or idx.numel() == 0
        return out

    monkeypatch.setattr(planning, "backward_rows", spy)
    return seen


@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize(("loss_type", "level"), [("grpo", "token"), ("dapo", "token"), ("dr_grpo", "token"),
                                                  ("bnpo", "token"), ("cispo", "token"), ("sapo", "token"),
                                                  ("vespo", "token"), ("luspo", "token"), ("grpo", "sequence"),
                                                  ("dapo", "sequence_token")])
@pytest.mark.parametrize("chunked", [False, True])
def test_skipping_is_exact_and_skips(seed, picked_counts, mode, loss_type, level, chunked):
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(gen)
    cfg = PolicyConfig(loss_type=loss_type, importance_sampling_level=level, epsilon_high=0.28)
    # Chunked: a few rows a chunk and vocabulary blocks (logits recomputed in the backward);
    # else one chunk whose kept logits are compacted.
    chunk_bytes = 20 * 67 * 8 if chunked else None
    on = _run(batch, cfg, True, mode, chunk_bytes=chunk_bytes)
    assert picked_counts and sum(m for m, _ in picked_counts) < sum(n for _, n in picked_counts)
    # gradient chunks over the rows with one: at token level, or of whole sequences (GSPO)
    leading = mode == "fused" and (not cfg.needs_whole_sequences or level == "sequence")
    assert len(picked_counts) == 1 if leading else not (mode == "fused" and chunked) or len(picked_counts) > 1
    picked_counts.clear()
    off = _run(batch, cfg, False, mode, chunk_bytes=chunk_bytes)
    assert not picked_counts
    _assert_same(on, off)


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_every_row_zero(seed, picked_counts, mode):
    """All groups reward-constant: no gradient GEMM runs, the gradients are exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(gen, constant=range(4))
    assert (batch["adv"] == 0).all()
    on = _run(batch, PolicyConfig(), True, mode)
    assert all(m == 0 for m, _ in picked_counts)
    off = _run(batch, PolicyConfig(), False, mode)
    _assert_same(on, off)
    assert all((g == 0).all() for g in on[1])


def test_every_token_clipped(seed, picked_counts):
    """Every ratio beyond ``1 + epsilon_high`` with a positive advantage: the clipped side of the
    minimum carries no gradient for any token, which the pass cannot know before it runs (no
    row is left out), and both agree."""
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(gen, constant=())
    batch["adv"] = batch["adv"].abs() + 0.1
    with torch.no_grad():
        cur = token_logprobs(batch["hidden"], Head(batch["weight"], batch["bias"]), batch["ids"])
    batch["old"] = cur - 1.0  # ratio e > 1.28
    on = _run(batch, PolicyConfig(epsilon_high=0.28), True)
    assert picked_counts and all(m == n for m, n in picked_counts)
    _assert_same(on, _run(batch, PolicyConfig(epsilon_high=0.28), False))
    assert all((g == 0).all() for g in on[1])


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_per_token_advantages(seed, picked_counts, level):
    """Per-token advantages with zeros inside sequences: at token level those tokens are left out;
    at sequence level a token's log-ratio reaches its sequence's ratio, so only sequences with
    zero advantage throughout are."""
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(gen)
    adv = batch["adv"][:, None].repeat(1, batch["ids"].shape[1])
    adv[1::3, ::2] = 0.0  # zeros inside sequences that otherwise have a gradient
    batch["adv"] = adv
    cfg = PolicyConfig(importance_sampling_level=level, epsilon_high=0.28)
    on = _run(batch, cfg, True, chunk_bytes=20 * 67 * 8)
    assert sum(m for m, _ in picked_counts) < sum(n for _, n in picked_counts)
    _assert_same(on, _run(batch, cfg, False, chunk_bytes=20 * 67 * 8))


def test_frozen_head(seed, picked_counts):
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(gen)
    on = _run(batch, PolicyConfig(), True, frozen=True)
    assert on[1][1] is None and picked_counts[0][0] < picked_counts[0][1]
    _assert_same(on, _run(batch, PolicyConfig(), False, frozen=True))


def test_kl_or_entropy_bonus_never_checks(seed, picked_counts):
    """With a KL term or an entropy bonus every row has a gradient: no decision is taken (no
    host synchronization)."""
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(gen)
    batch["ref"] = batch["old"] + 0.1
    _run(batch, PolicyConfig(beta=0.04), True)
    _run(batch, PolicyConfig(entropy_coef=0.01), True)
    assert picked_counts == []


def _cute_ok() -> bool:
    from logitless.ops.contract import cute_runs_on

    return torch.cuda.is_available() and cute_runs_on(torch.device("cuda"))


@pytest.mark.parametrize("impl", ["triton", "gemm", "flash",
                                  pytest.param("cute", marks=pytest.mark.skipif(not _cute_ok(), reason="sm90 + CuTe"))])
@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_kernel_backends(seed, picked_counts, impl, mode):
    """The interpreter's kernels (bf16, kept tiles compacted in place) against the same backend
    without skipping; the GEMMs' sums run over other row counts, so bf16 rounding differs."""
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(gen, groups=3, t=5, h=16, v=96, constant=(1,))
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels on a GPU, the interpreter elsewhere
    batch = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).to(dev) for k, v in batch.items()}
    cfg = PolicyConfig(epsilon_high=0.28)
    on = _run(batch, cfg, True, mode, impl=impl)
    assert picked_counts and picked_counts[0][0] < picked_counts[0][1]
    off = _run(batch, cfg, False, mode, impl=impl)
    torch.testing.assert_close(on[0], off[0], rtol=1e-6, atol=1e-6)
    for x, y in zip(on[1], off[1], strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-3)
    # Rows without a gradient get exact zeros, as the dense pass gives them.
    zero_rows = batch["adv"] == 0
    assert zero_rows.any()
    assert (on[1][0][zero_rows] == 0).all() and (off[1][0][zero_rows] == 0).all()


def _dist_case(gen, **extra):
    batch = _batch(gen, groups=2, t=5, h=12, v=61, constant=(1,))
    case = dict(hidden=batch["hidden"], weight=batch["weight"], targets=batch["ids"], mask=batch["mask"],
                advantages=batch["adv"], old=batch["old"], ref=None, **extra)
    return case


def test_vocab_shards_skip_the_same_rows():
    """Vocabulary-parallel ranks (gloo) decide from the reduced statistics, so they all skip the
    same rows; each rank's result equals the single-process dense pass."""
    from test_distributed import _spawn

    gen = torch.Generator().manual_seed(21)
    case = _dist_case(gen, objective="grpo", mode="fused", sizes=[30, 31], chunk=2000, row_multiple=4,
                      config=dict(loss_type="grpo", epsilon_high=0.28))
    batch = dict(hidden=case["hidden"], weight=case["weight"], bias=torch.zeros(61, dtype=torch.float64),
                 ids=case["targets"], mask=case["mask"], adv=case["advantages"], old=case["old"])
    loss, (gh, gw, _), metrics = _run(batch, PolicyConfig(**case["config"]), False, chunk_bytes=2000)
    outs = _spawn("vocab_parallel", 2, case)
    assert outs[0]["skipped"] == outs[1]["skipped"] and sum(outs[0]["skipped"]) > 0
    for o in outs:
        torch.testing.assert_close(o["loss"], loss, rtol=TOL, atol=TOL)
        torch.testing.assert_close(o["grad_hidden"], gh, rtol=TOL, atol=TOL)
        torch.testing.assert_close(o["grad_weight"], gw[o["start"]:o["start"] + o["rows"]], rtol=TOL, atol=TOL)
        for k, v in metrics.items():
            torch.testing.assert_close(o["metrics"][k], v, rtol=TOL, atol=TOL, equal_nan=True, msg=k)


def test_sequence_parallel_ranks_skip_exactly():
    """Packed sequences cut across sequence-parallel ranks (recompute mode: each rank decides
    for its own rows): the ranks' results add up to the single-process dense pass."""
    from test_distributed import _packed_case, _spawn

    gen = torch.Generator().manual_seed(23)
    case = _packed_case(gen)
    case["advantages"][1:3] = 0.0  # two sequences of a reward-constant group
    case.update(mode="auto", bounds=[0, 9, 17, 24], row_multiple=4,  # ref_logp is ignored at beta = 0
                config=dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_high=0.28))
    batch = dict(hidden=case["hidden"], weight=case["weight"], bias=torch.zeros(53, dtype=torch.float64),
                 ids=case["targets"], mask=case["mask"], adv=case["advantages"], old=case["old"])
    loss, (gh, gw, _), metrics = _run(batch, PolicyConfig(**case["config"]), False, segment_ids=case["segment_ids"])
    outs = _spawn("sequence_parallel", 3, case)
    assert sum(sum(o["skipped"]) for o in outs) > 0
    torch.testing.assert_close(sum(o["loss"] for o in outs), loss, rtol=TOL, atol=TOL)
    torch.testing.assert_close(torch.cat([o["grad_hidden"] for o in outs]), gh, rtol=TOL, atol=TOL)
    torch.testing.assert_close(sum(o["grad_weight"] for o in outs), gw, rtol=TOL, atol=TOL)
    for o in outs:
        for k, v in metrics.items():
            torch.testing.assert_close(o["metrics"][k], v, rtol=TOL, atol=TOL, equal_nan=True, msg=k)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gemm_row_kernel_matches_the_dense_one(seed, softcap):
    """The gemm backend's compacting ``dy`` kernel (rows ``idx`` read, ``dy`` written to the
    tile's first rows in place) gives the dense kernel's values for those rows, with every
    gradient term present, over several tiles and column blocks."""
    from logitless.ops.contract import RowCoefficients, SavedStats, StatGrads
    from logitless.ops.gemm_backend.kernels import gemm_config
    from logitless.ops.transform import LogitTransform
    from logitless.ops.triton_shared.centred import CentredTile, launch_centred_grad, launch_centred_grad_rows

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    n, v = 37, 300 if dev == "cpu" else 3000
    cfg = gemm_config()
    tiles = -(-v // cfg.fwd.block_v)
    z = (-3 * torch.rand(n, v, generator=gen)).half().to(dev)
    tile_max = torch.randn(tiles, n, generator=gen).to(dev)
    targets = torch.randint(0, v, (n,), generator=gen).to(dev)
    lse = (torch.rand(n, generator=gen) + 2).to(dev)
    sum_pz = torch.randn(n, generator=gen).to(dev)
    grads = StatGrads(*(torch.randn(n, generator=gen).to(dev) for _ in range(4)))
    idx = torch.sort(torch.randperm(n, generator=gen)[:23]).values.to(dev)
    transform = LogitTransform(temperature=0.7, softcap=softcap)
    dense = torch.empty(n, v, dtype=torch.bfloat16, device=dev)
    launch_centred_grad(CentredTile(z.clone(), tile_max, cfg.fwd.block_v), dense, targets, 0, transform,
                        RowCoefficients.make(SavedStats(lse, sum_pz), grads))
    tile = z.clone()
    picked = RowCoefficients.make(SavedStats(lse[idx], sum_pz[idx]), grads.rows(idx))
    dy = launch_centred_grad_rows(CentredTile(tile, tile_max, cfg.fwd.block_v, idx), torch.bfloat16, targets[idx],
                                  0, transform, picked)
    assert dy.data_ptr() == tile.data_ptr() and dy.shape == (23, v)
    torch.testing.assert_close(dy.float(), dense[idx].float(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rows_with_a_gradient_take_the_gradient_chunks(seed, picked_counts, monkeypatch, level):
    """The rows with a gradient come first (at sequence level, GSPO's, whole sequences), and a
    fused pass plans its gradient chunks for them alone: here every row would take two chunks and
    those rows take one, with one backward; the others' statistics come from a pass that keeps
    no logits. Exact against the dense pass."""
    from logitless.ops.fused import SoftmaxPass

    gen = torch.Generator().manual_seed(seed)
    batch = _batch(gen, groups=6, t=8)
    counted = batch["mask"] != 0
    n = int(counted.sum())
    with_grad = int((counted & (batch["adv"][:, None] != 0)).sum())
    end = -(-with_grad // 4) * 4 if level == "token" else with_grad  # (a sequence's end)
    cfg = PolicyConfig(epsilon_high=0.28, importance_sampling_level=level)
    assert end < n // 2 + n // 4
    forwards, backwards = [], []
    real_stats, real_backward = SoftmaxPass.chunk_stats, SoftmaxPass.backward

    def chunk_stats(self, rows, plan, keep_logits):
        forwards.append((rows.hidden.shape[0], keep_logits))
        return real_stats(self, rows, plan, keep_logits)

    def backward(self, rows, *a):
        backwards.append(rows.hidden.shape[0])
        return real_backward(self, rows, *a)

    monkeypatch.setattr(SoftmaxPass, "chunk_stats", chunk_stats)
    monkeypatch.setattr(SoftmaxPass, "backward", backward)
    budget = end * 67 * 32  # the torch plan's float64 block of `end` rows (planning.workspace_per_element)
    on = _run(batch, cfg, True, chunk_bytes=budget)
    assert picked_counts == [(end, n)] and backwards == [end]
    assert forwards[0] == (end, True) and sum(r for r, _ in forwards[1:]) == n - end
    assert not any(keep for _, keep in forwards[1:])
    forwards.clear()
    off = _run(batch, cfg, False, chunk_bytes=budget)
    assert len(forwards) > 1 and sum(r for r, _ in forwards) == n
    _assert_same(on, off)
