"""Multi-process (gloo, CPU) results equal the single-process ones: vocabulary-parallel heads
(even and uneven shards, padded vocabulary), sequence-parallel GSPO with segments cut across
ranks, and data-parallel normalizers/metrics."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from logitless import Head, LogitTransform, PolicyConfig, cross_entropy, policy_loss, token_logprobs

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker
from gloo_ranks import run_ranks
from trl_oracle import trl_grpo_loss

from logitless import PassOptions


def _spawn(fn_name: str, world: int, case: dict) -> list[dict]:
    return run_ranks(getattr(dist_worker, fn_name), world, case)


def _policy_case(gen, b=4, t=7, h=16, v=101):
    hidden = torch.randn(b, t, h, generator=gen, dtype=torch.float64)
    weight = 0.7 * torch.randn(v, h, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, v, (b, t), generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.2).to(torch.float64)
    mask[0, 0] = 1.0
    with torch.no_grad():
        cur = token_logprobs(hidden, weight, targets)
    return dict(hidden=hidden, weight=weight, targets=targets, mask=mask,
                advantages=torch.randn(b, generator=gen, dtype=torch.float64),
                old=cur + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64),
                ref=cur + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64))


def _close(a, b, tol=1e-10):
    return torch.allclose(a, b, rtol=tol, atol=tol)


def _reference_policy(case, **kw):
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    loss, metrics = policy_loss(hidden, weight, case["targets"], case["mask"], case["advantages"], case["old"],
                                case["ref"], config=PolicyConfig(**case["config"]), **kw,
                                options=PassOptions(impl="torch"))
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, metrics


def _assert_trls(case, reference, config, **layout):
    """The single-process reference ``(loss, d hidden, d weight, metrics)`` equals TRL's own
    ``_compute_loss`` on float64 materialized logits (an oracle independent of logitless).
    ``layout``: ``hidden``, ``targets``, ... replacing the case's: a padded ``[B, T]`` view of packed
    rows, whose real positions are ``rows``."""
    data = {**case, **layout}
    h, w = data["hidden"].clone().requires_grad_(), data["weight"].clone().requires_grad_()
    trl_loss, trl_metrics = trl_grpo_loss(h, w, data["targets"], data["mask"], data["advantages"], data["old"],
                                          data["ref"], max_completion_length=data["mask"].shape[-1], **config)
    trl_gh, trl_gw = torch.autograd.grad(trl_loss, [h, w])
    loss, gh, gw, metrics = reference
    assert _close(loss, trl_loss.detach()) and _close(gw, trl_gw)
    assert _close(gh, trl_gh if "rows" not in layout else trl_gh[layout["rows"]])  # packed: the real positions
    for k, v in trl_metrics.items():
        assert metrics[k].item() == pytest.approx(v, rel=1e-10, abs=1e-12, nan_ok=True), k


@pytest.mark.parametrize(("world", "sizes", "mode"), [(2, [40, 61], "fused"), (4, None, "recompute")])
def test_vocab_parallel_grpo_matches_single_process(world, sizes, mode):
    gen = torch.Generator().manual_seed(11)
    case = _policy_case(gen)
    case.update(objective="grpo", mode=mode, sizes=sizes, chunk=3000,
                config=dict(loss_type="grpo", beta=0.04, epsilon_high=0.28))
    loss, gh, gw, metrics = _reference_policy(case)
    _assert_trls(case, (loss, gh, gw, metrics), case["config"])
    outs = _spawn("vocab_parallel", world, case)
    for o in outs:
        assert _close(o["loss"], loss) and _close(o["grad_hidden"], gh)
        assert _close(o["grad_weight"], gw[o["start"]:o["start"] + o["rows"]])
        for k, v in metrics.items():
            assert torch.allclose(o["metrics"][k], v, rtol=1e-10, atol=1e-12, equal_nan=True), k


def test_vocab_parallel_gspo_and_ce_padded_vocab():
    gen = torch.Generator().manual_seed(12)
    case = _policy_case(gen)
    case.update(objective="grpo", mode="fused", config=dict(loss_type="grpo", importance_sampling_level="sequence"))
    loss, gh, gw, metrics = _reference_policy(case)
    _assert_trls(case, (loss, gh, gw, metrics), case["config"])
    for o in _spawn("vocab_parallel", 2, case):
        assert _close(o["loss"], loss) and _close(o["grad_hidden"], gh)
        assert _close(o["grad_weight"], gw[o["start"]:o["start"] + o["rows"]])
    # CE with 5 padding rows at the end of the last shard: they must get no probability.
    pad = 5
    hidden = case["hidden"].reshape(-1, 16)
    weight = torch.cat([case["weight"], 3 * torch.randn(pad, 16, generator=gen, dtype=torch.float64)])
    targets = case["targets"].reshape(-1)
    ce_case = dict(hidden=hidden, weight=weight, targets=targets, pad=pad, objective="ce", mode="fused")
    h_ref = hidden.clone().requires_grad_()
    w_ref = case["weight"].clone().requires_grad_()
    ref, _ = cross_entropy(h_ref, w_ref, targets, label_smoothing=0.1, z_loss=1e-3, options=PassOptions(impl="torch"))
    ref.backward()
    logits = h_ref @ w_ref.T  # the oracle: torch's cross_entropy on float64 materialized logits
    want = F.cross_entropy(logits, targets, label_smoothing=0.1) + 1e-3 * (torch.logsumexp(logits, -1) ** 2).mean()
    assert _close(ref, want) and all(map(_close, (h_ref.grad, w_ref.grad), torch.autograd.grad(want, [h_ref, w_ref])))
    for o in _spawn("vocab_parallel", 2, ce_case):
        assert _close(o["loss"], ref) and _close(o["grad_hidden"], h_ref.grad)
        g = o["grad_weight"]
        real = min(o["rows"], w_ref.shape[0] - o["start"])
        assert _close(g[:real], w_ref.grad[o["start"]:o["start"] + real])
        assert (g[real:] == 0).all()


def test_vocab_parallel_rollout_one_max_one_sum():
    gen = torch.Generator().manual_seed(13)
    case = _policy_case(gen)
    hidden = case["hidden"].reshape(-1, 16)
    targets = case["targets"].reshape(-1)
    # chunk=1500 makes several token chunks: still one MAX and one SUM for the whole pass
    rc = dict(hidden=hidden, weight=case["weight"], targets=targets, objective="rollout", chunk=1500)
    ref_logp, ref_ent = token_logprobs(hidden, case["weight"], targets, entropy=True)
    lsm = torch.log_softmax(hidden @ case["weight"].T, -1)  # float64 materialized logits
    assert _close(ref_logp, lsm.gather(-1, targets[:, None]).squeeze(1)) and _close(ref_ent, -(lsm.exp() * lsm).sum(-1))
    for o in _spawn("vocab_parallel", 2, rc):
        assert _close(o["logp"], ref_logp) and _close(o["entropy"], ref_ent)
        assert o["counts"] == {"max": 1, "sum": 1, "other": 0}


def test_vocab_parallel_log_sum_sq_probs():
    """WPO's ``log Σ p²`` over uneven shards with padding rows: each rank's ``Σ e²`` is rescaled by
    the squared distance to the global max in the all-reduce; several token chunks, both modes."""
    gen = torch.Generator().manual_seed(17)
    case = _policy_case(gen)
    hidden, targets = case["hidden"].reshape(-1, 16), case["targets"].reshape(-1)
    pad = 3
    weight = torch.cat([case["weight"], 3 * torch.randn(pad, 16, generator=gen, dtype=torch.float64)])
    lsm = torch.log_softmax(hidden @ case["weight"].T, -1)  # float64 materialized logits, padding excluded
    ref = torch.logsumexp(2 * lsm, -1)
    rc = dict(hidden=hidden, weight=weight, targets=targets, pad=pad, sizes=[30, 71], chunk=1500)
    for o in _spawn("vocab_parallel_sum_sq", 2, rc):
        assert _close(o["recompute"], ref) and _close(o["fused"], ref)


def test_sum_partials_reduce_scatter_equals_all_reduce_then_cast(seed):
    """``d hidden`` of a 16-bit head under a vocabulary split is summed by an fp32
    reduce-scatter, cast per shard, and a 16-bit all-gather (``distributed.sum_partials``): on 4
    gloo ranks it equals the fp32 all-reduce then the cast bit for bit (bf16, fp16), as does the
    fallback (fp32 output; a size that 4 does not divide: no reduce-scatter); every result is
    the float64 sum of the partials to one rounding. In a bf16 ``policy_loss`` (fused and
    recompute) over the 4 ranks' rows, ``d hidden`` is the same bits either way."""
    case = dict(seed=seed, shapes=[(12, 8), (5, 3)])
    outs = _spawn("sum_partials_cases", 4, case)
    for i, first in enumerate(outs[0]["sums"]):
        exact = sum(o["sums"][i]["partial"].double() for o in outs)
        dtype, even = first["dtype"], first["partial"].numel() % 4 == 0
        # one rounding to dtype, plus the fp32 sum's own roundings (relative to the partials' sizes)
        bound = torch.finfo(dtype).eps * exact.abs() + 4 * 2.0**-23 * sum(o["sums"][i]["partial"].double().abs()
                                                                            for o in outs)
        for o in outs:
            got = o["sums"][i]
            assert got["ours"].dtype == dtype and torch.equal(got["ours"], got["reference"]), (got["shape"], dtype)
            assert torch.equal(got["ours"], first["ours"])  # every rank holds the same sum
            assert got["scatters"] == (1 if even and dtype != torch.float32 else 0), (got["shape"], dtype)
            assert ((got["ours"].double() - exact).abs() <= bound).all(), (got["shape"], dtype)
    for o in outs:
        for mode, (ours, reference) in o["pass"].items():
            assert ours.dtype == torch.bfloat16 and torch.equal(ours, reference), mode
            assert torch.equal(ours, outs[0]["pass"][mode][0]), mode


def _packed_case(gen, lens=(5, 9, 3, 7), h=16, v=53):
    n = sum(lens)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = 0.7 * torch.randn(v, h, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=gen)
    mask = (torch.rand(n, generator=gen) > 0.15).to(torch.float64)
    with torch.no_grad():
        cur = token_logprobs(hidden, weight, targets)
    return dict(hidden=hidden, weight=weight, targets=targets, mask=mask, segment_ids=seg,
                advantages=torch.randn(len(lens), generator=gen, dtype=torch.float64),
                old=cur + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64),
                ref=cur + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64))


def _padded(case):
    """The packed case as TRL's ``[B, T]`` batch: one row per segment, right padding (mask 0)."""
    seg = case["segment_ids"]
    lens = torch.bincount(seg)
    rows = torch.arange(int(lens.max()))[None] < lens[:, None]  # [B, T] real positions, row-major = packed order
    out = {"rows": rows}
    for k in ("hidden", "targets", "mask", "old", "ref"):
        x = case[k]
        out[k] = x.new_zeros((*rows.shape, *x.shape[1:]))
        out[k][rows] = x
    return out


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo"])
def test_sequence_parallel_gspo_segments_cut_across_ranks(loss_type):
    gen = torch.Generator().manual_seed(14)
    case = _packed_case(gen)
    level = "token" if loss_type == "vespo" else "sequence"
    case.update(mode="auto", bounds=[0, 8, 17, 24],  # cuts inside segments 1 and 3
                config=dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                            off_policy_mask_threshold=0.5 if loss_type != "vespo" else None))
    reference = loss, gh, gw, metrics = _reference_policy(case, segment_ids=case["segment_ids"])
    _assert_trls(case, reference, case["config"], **_padded(case))
    outs = _spawn("sequence_parallel", 3, case)
    assert _close(sum(o["loss"] for o in outs), loss)
    assert _close(torch.cat([o["grad_hidden"] for o in outs]), gh)
    assert _close(sum(o["grad_weight"] for o in outs), gw)
    for o in outs:
        for k, v in metrics.items():
            assert torch.allclose(o["metrics"][k], v, rtol=1e-10, atol=1e-12, equal_nan=True), k


def _extrema_data(case, gen):
    """Advantages and old log-probs for which each rank's clip extrema differ: rank 0 holds a
    sequence with A > 0 (its low clip fraction 0) whose tokens clip high; every sequence of rank 1
    has A < 0 and clips low (its low minimum > 0, its high maximum 0). A MIN and a MAX over the
    ranks then give different values for both ``clip_ratio/low_min`` and ``clip_ratio/high_max``."""
    b, t = case["mask"].shape
    cur = token_logprobs(case["hidden"], case["weight"], case["targets"])
    old = cur + 0.05 * torch.randn(b, t, generator=gen, dtype=torch.float64)  # ratios inside [1 - ε, 1 + ε_high]
    for row, (shift, k) in enumerate([(-0.5, 2), (0.5, 1), (0.5, 3), (0.5, 2)]):
        counted = case["mask"][row].nonzero().squeeze(1)[:k]
        old[row, counted] = cur[row, counted] + shift  # ratio exp(∓0.5): clips high (A > 0) or low (A < 0)
    return dict(advantages=torch.tensor([1.0, -1.0, -1.0, -0.5], dtype=torch.float64), old=old)


def test_data_parallel_normalizers_and_metrics():
    """TRL's multi-process semantics: in each rank, TRL's own ``_compute_loss`` with its gathers
    over the group (the entropy quantile over every process's tokens, the clip extrema over every
    process's sequences) is the oracle of the loss, gradients and metrics; the ranks together also
    equal the single-process run, itself equal to TRL's on the whole batch."""
    gen = torch.Generator().manual_seed(15)
    case = _policy_case(gen, b=4)
    base = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)
    case["runs"] = [dict(config={**base, "top_entropy_quantile": q}) for q in (1.0, 0.5)]
    case["runs"].append(dict(config=dict(loss_type="grpo", epsilon_high=0.28), data=_extrema_data(case, gen)))
    for run in case["runs"]:
        run["trl"] = dict(max_completion_length=case["mask"].shape[1], **run["config"])
    outs = _spawn("data_parallel", 2, case)
    for i, run in enumerate(case["runs"]):
        data = {**case, **run.get("data", {})}
        loss, gh, gw, metrics = _reference_policy({**data, "config": run["config"]})
        h, w = data["hidden"].clone().requires_grad_(), data["weight"].clone().requires_grad_()
        trl_loss, trl_metrics = trl_grpo_loss(h, w, data["targets"], data["mask"], data["advantages"], data["old"],
                                              data["ref"], **run["trl"])
        assert _close(loss, trl_loss.detach()) and _close(gw, torch.autograd.grad(trl_loss, w)[0]), run
        for k, v in trl_metrics.items():
            assert metrics[k].item() == pytest.approx(v, rel=1e-10, abs=1e-12, nan_ok=True), (run, k)
        ranks = [o["runs"][i] for o in outs]
        for o in ranks:
            trl = o["trl"]
            assert _close(o["loss"], trl["loss"]) and _close(o["grad_hidden"], trl["grad_hidden"]), run
            assert _close(o["grad_weight"], trl["grad_weight"]), run
            assert o["metrics"].keys() == trl["metrics"].keys(), run
            for k, v in trl["metrics"].items():
                assert o["metrics"][k].item() == pytest.approx(v, rel=1e-10, abs=1e-12, nan_ok=True), (run, k)
        # DDP averages gradients over ranks; TRL's dapo normalizer (N / P), and grpo's mean over
        # equally many sequences per rank, make that the global loss's.
        assert _close(sum(o["loss"] for o in ranks) / 2, loss)
        assert _close(sum(o["grad_weight"] for o in ranks) / 2, gw)
        assert _close(torch.cat([o["grad_hidden"] for o in ranks]) / 2, gh)
        if "data" in run:  # the extrema case: the ranks' own extrema differ, so MIN and MAX over them differ
            local = [o["trl_local_metrics"] for o in ranks]
            for name, pick in (("clip_ratio/low_min", min), ("clip_ratio/high_max", max)):
                assert local[0][name] != local[1][name], name
                assert ranks[0]["metrics"][name].item() == pick(m[name] for m in local), name


_DISTILL_RUNS = [dict(divergence=d, mode=m) for d in ("forward_kl", "reverse_kl", "generalized_jsd", "topk")
                 for m in ("fused", "recompute")]


def _distill_case(gen, n=47, hs=16, ht=24, v=123, pad=5):
    """fp64 student and teacher heads with ``pad`` large padding rows after the ``v`` real ones
    (they would dominate both softmaxes if they took part), labels with ignored tokens, a mask,
    and a sparse teacher's top-k (with padding entries) taken from the dense teacher."""
    f64 = dict(generator=gen, dtype=torch.float64)
    weight = torch.cat([torch.randn(v, hs, **f64) / 2, 3 * torch.randn(pad, hs, **f64)])
    teacher_weight = torch.cat([torch.randn(v, ht, **f64) / 2, 3 * torch.randn(pad, ht, **f64)])
    bias, teacher_bias = torch.randn(v + pad, **f64) * 0.3, torch.randn(v + pad, **f64) * 0.3
    teacher_hidden = 1.5 * torch.randn(n, ht, **f64)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.2] = -100
    teacher_logits = LogitTransform(temperature=1.2).apply(teacher_hidden @ teacher_weight[:v].T + teacher_bias[:v])
    topk_logprobs, topk_ids = teacher_logits.log_softmax(-1).topk(5, dim=-1)
    topk_logprobs = topk_logprobs.masked_fill(torch.rand(n, 5, generator=gen) < 0.2, float("-inf"))
    return dict(hidden=1.5 * torch.randn(n, hs, **f64), weight=weight, bias=bias, teacher_hidden=teacher_hidden,
                teacher_weight=teacher_weight, teacher_bias=teacher_bias, labels=labels,
                mask=(torch.rand(n, generator=gen) < 0.85).long(), topk_ids=topk_ids, topk_logprobs=topk_logprobs,
                pad=pad, chunk=20_000, runs=_DISTILL_RUNS)


def _reference_distill(case, run):
    """The unsharded run on the real rows only: ``(loss, d hidden, d weight, d bias, metrics)``."""
    v = case["weight"].shape[0] - case["pad"]
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"][:v].clone().requires_grad_()
    bias = case["bias"][:v].clone().requires_grad_()
    head = Head(weight, bias, LogitTransform(temperature=0.8, softcap=6.0))
    teacher = Head(case["teacher_weight"][:v], case["teacher_bias"][:v], LogitTransform(temperature=1.2))
    loss, metrics = dist_worker._distill_call(case, run, hidden, head, teacher)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, bias.grad, metrics


def _assert_distill_oracle(case, run, reference):
    """A dense run's single-process reference equals the float64 materialized-logits oracle of
    tests/test_distill.py (divergence plus 0.4 x NLL over the counted tokens, their mean)."""
    from test_distill import _oracle as distill_oracle

    v = case["weight"].shape[0] - case["pad"]
    hs, ws, bs = (x.clone().requires_grad_() for x in (case["hidden"], case["weight"][:v], case["bias"][:v]))
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(run["divergence"], 0.3)
    ref = distill_oracle(hs, ws, bs, case["teacher_hidden"], case["teacher_weight"][:v], case["teacher_bias"][:v],
                         LogitTransform(temperature=0.8, softcap=6.0), LogitTransform(temperature=1.2), beta)
    labels = case["labels"]
    counted = (case["mask"] != 0) & (labels != -100)
    nll = -ref["lp"].gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    want = ((ref["div"] + 0.4 * nll) * counted).sum() / counted.sum()
    loss, gh, gw, gb, _ = reference
    assert _close(loss, want.detach()), run
    assert all(map(_close, (gh, gw, gb), torch.autograd.grad(want, [hs, ws, bs]))), run


@pytest.mark.parametrize(("world", "sizes"), [(2, None), (3, [40, 50, 33])])
def test_vocab_parallel_distill_matches_single_process(world, sizes):
    """Sharded student and teacher (even and uneven splits, 5 padding rows on the last rank):
    forward/reverse KL, the generalized JSD and a sparse top-k teacher, each with a hard-label CE
    mixed in, fused and recompute, several token chunks and vocabulary blocks: the loss, metrics,
    ``d hidden`` and each rank's ``d weight``/``d bias`` rows equal the unsharded run's (fp64)."""
    gen = torch.Generator().manual_seed(16)
    case = _distill_case(gen)
    case["sizes"] = sizes
    refs = [_reference_distill(case, run) for run in case["runs"]]
    for run, reference in zip(case["runs"], refs, strict=True):
        if run["divergence"] != "topk":
            _assert_distill_oracle(case, run, reference)
    v = case["weight"].shape[0] - case["pad"]
    for o in _spawn("distill_vocab_parallel", world, case):
        start, real = o["start"], min(o["rows"], v - o["start"])
        assert "sharded differently" in o["mismatch_error"] and "same VocabShard" in o["mismatch_error"]
        for run, got, (loss, gh, gw, gb, metrics) in zip(case["runs"], o["runs"], refs, strict=True):
            what = f"{run} rank {start}"
            assert _close(got["loss"], loss) and _close(got["grad_hidden"], gh), what
            assert _close(got["grad_weight"][:real], gw[start:start + real]), what
            assert _close(got["grad_bias"][:real], gb[start:start + real]), what
            assert (got["grad_weight"][real:] == 0).all() and (got["grad_bias"][real:] == 0).all(), what
            assert got["metrics"].keys() == metrics.keys(), what
            for k, val in metrics.items():
                assert _close(got["metrics"][k], val), f"{what} {k}"
            if run["mode"] == "recompute":
                # several token chunks, yet one MAX and one SUM for the first pass (one more SUM for
                # the JSD pass) and one SUM of the d hidden partials
                jsd = run["divergence"] == "generalized_jsd"
                assert got["counts"] == {"max": 1, "sum": 2 + jsd, "other": 0}, what


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                    reason="the gemm kernels run under the Triton interpreter on CPU machines")
def test_vocab_parallel_distill_on_the_gemm_kernels():
    """bf16 heads on the gemm kernels (interpreted in the ranks), 2 ranks, padding rows, several
    vocabulary blocks: forward KL and the JSD with a hard-label CE, fused and recompute, match the
    unsharded run on the same kernels to bf16 resolution (the tiles fall differently), with the
    same all-reduce counts as the torch functions."""
    gen = torch.Generator().manual_seed(17)
    case = _distill_case(gen)
    for key in ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias"):
        case[key] = case[key].to(torch.bfloat16)
    runs = [dict(divergence=d, mode=m) for d in ("forward_kl", "generalized_jsd") for m in ("fused", "recompute")]
    case.update(impl="gemm", sizes=None, runs=runs)
    v = case["weight"].shape[0] - case["pad"]
    refs = [_reference_distill(case, run) for run in case["runs"]]
    for o in _spawn("distill_vocab_parallel", 2, case):
        start, real = o["start"], min(o["rows"], v - o["start"])
        for run, got, (loss, gh, gw, gb, metrics) in zip(case["runs"], o["runs"], refs, strict=True):
            what = f"{run} rank {start}"
            assert _close(got["loss"].double(), loss.double(), 1e-4), what
            for a, b in ((got["grad_hidden"], gh), (got["grad_weight"][:real], gw[start:start + real]),
                         (got["grad_bias"][:real], gb[start:start + real])):
                assert (a.double() - b.double()).abs().max() <= 2e-2 * b.double().abs().max(), what
            for k, val in metrics.items():
                assert _close(got["metrics"][k].double(), val.double(), 1e-3), f"{what} {k}"
            if run["mode"] == "recompute":
                assert got["counts"] == {"max": 1, "sum": 2 + (run["divergence"] == "generalized_jsd"), "other": 0}



def test_trl_sft_dropin_on_two_processes(tmp_path):
    """The SFT drop-in and logitless behind TRL's fused LM head, on 2 processes against TRL's own
    trainer in each: ``num_items_in_batch`` counts both ranks' tokens, so the SFT loss carries
    ``Trainer``'s world-size factor (``average_tokens_across_devices``) and the fused head divides
    by that count, not the rank's. fp32 tiny model, TRL's own fused head: fp32 agreement."""
    pytest.importorskip("trl")
    from tiny_models import save_tiny_qwen2

    v = 64
    rng = torch.Generator().manual_seed(21)
    rows = [dict(text=" ".join(f"t{int(i)}" for i in torch.randint(0, v - 3, (int(n),), generator=rng)))
            for n in torch.randint(3, 11, (8,), generator=rng)]
    save_tiny_qwen2(tmp_path / "m", vocab_size=v, seed=21)
    case = dict(model=str(tmp_path / "m"), out=str(tmp_path / "out"), rows=rows, vocab=v)
    for o in _spawn("trl_dropins", 2, case):
        assert o["num_items"] > o["local_tokens"]
        for name in ("sft", "fused_head"):
            (loss, grads, metrics), (trl_loss, trl_grads, trl_metrics) = o[name]
            assert torch.allclose(loss, trl_loss, rtol=1e-5, atol=1e-7), (name, loss, trl_loss)
            assert (grads - trl_grads).norm() <= 1e-4 * trl_grads.norm(), name
            metrics.pop("num_tokens", None), trl_metrics.pop("num_tokens", None)
            assert metrics == pytest.approx(trl_metrics, rel=1e-5, abs=1e-6), name
