"""The one-call fused preference losses against the two-call path they replace.

``dpo_loss_fused`` / ``cpo_loss_fused`` / ``simpo_loss_fused`` / ``kto_loss_fused`` /
``orpo_loss_fused`` must give what ``sequence_logps`` + ``dpo_loss`` / ``cpo_loss`` /
``simpo_loss`` / ``kto_loss`` / ``orpo_loss`` give (those
are checked against TRL's own code in test_preference.py; one DPO case here is checked against
TRL directly too): loss, d hidden, d weight (and d bias) and every metric, in float64 to 1e-12.
A small ``chunk_bytes`` makes the fused pass run several chunks (each holding whole pairs), the
masks are ragged (prompts of different lengths, right padding, one empty sequence), and one
batch has a pair longer than a chunk.
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless import (
    CPOLossConfig,
    DPOLossConfig,
    Head,
    HeadLoRA,
    KTOLossConfig,
    PassOptions,
    cpo_loss,
    cpo_loss_fused,
    dpo_loss,
    dpo_loss_fused,
    kto_loss,
    kto_loss_fused,
    orpo_loss,
    orpo_loss_fused,
    sequence_logps,
    simpo_loss,
    simpo_loss_fused,
)
from logitless.ops.plan import ChunkPlan

B, T, V, H = 4, 16, 37, 8  # 2B sequences of T predictions
# fp64 torch plan: 32 bytes a logit, so 32-token chunks (the torch floor) of 1 to 2 pairs, whose
# logits (32 x V) just fit: the fused chunks keep them. BLOCKED cuts the vocabulary into 2 blocks.
CHUNK = 32 * V * 32
BLOCKED = 20_000
TOL = 1e-12

pytestmark = pytest.mark.usefixtures("seed")  # a fresh seed per test (conftest)


def _batch(rows=2 * B, t=T, dtype=torch.float64, empty=True):
    """Hidden ``[S, t, H]``, weight, bias, labels and a ragged completion mask (prompts of 1-3
    tokens, right padding; with ``empty`` one rejected sequence has no completion token)."""
    hidden = torch.randn(rows, t, H, dtype=dtype)
    weight = torch.randn(V, H, dtype=dtype) / 2
    bias = torch.randn(V, dtype=dtype) / 4
    labels = torch.randint(0, V, (rows, t))
    prompt = torch.randint(0, 3, (rows,))
    length = torch.randint(t // 2, t + 1, (rows,))
    pos = torch.arange(t)
    mask = ((pos[None] >= prompt[:, None]) & (pos[None] < length[:, None])).long()
    if empty:
        mask[-1] = 0
    return hidden, weight, bias, labels, mask


def _leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def _close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= TOL * max(1.0, b.abs().max().item() if b.numel() else 0.0), f"{what}: {err:.3e}"


def _compare(fused, two_call, hidden, weight, bias=None):
    """Run both on fresh leaves; compare the loss, the gradients and every metric."""
    outs = []
    for fn in (fused, two_call):
        leaves = _leaves(hidden, weight) + ([] if bias is None else _leaves(bias))
        head = Head(leaves[1], bias=None if bias is None else leaves[2])
        loss, metrics = fn(leaves[0], head)
        grads = torch.autograd.grad(loss, leaves)
        outs.append((loss.detach(), grads, metrics))
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = outs
    _close(loss, ref_loss, "loss")
    for name, g, r in zip(("d hidden", "d weight", "d bias"), grads, ref_grads, strict=False):
        _close(g, r, name)
    assert metrics.keys() == ref_metrics.keys()
    for k in ref_metrics:
        _close(metrics[k], ref_metrics[k], k)
    return loss


@pytest.fixture
def chunk_counts(monkeypatch):
    """``(token_chunk, [chunk lengths])`` of every fused plan's ``chunks(n, cuts)`` call."""
    seen = []
    original = ChunkPlan.chunks

    def spy(self, n_tokens, cuts=None):
        out = original(self, n_tokens, cuts)
        if cuts is not None:
            seen.append((self.token_chunk, [sl.stop - sl.start for sl in out]))
        return out

    monkeypatch.setattr(ChunkPlan, "chunks", spy)
    return seen


DPO_CASES = [
    dict(loss_type=["sigmoid"]),
    dict(loss_type=["ipo"], beta=0.3),
    dict(loss_type=["hinge"]),
    dict(loss_type=["robust"], label_smoothing=0.2),
    dict(loss_type=["exo_pair"], label_smoothing=1e-3),
    dict(loss_type=["nca_pair", "bco_pair", "sppo_hard"], loss_weights=[0.5, 1.0, 0.2]),
    dict(loss_type=["apo_zero", "apo_down"]),
    dict(loss_type=["discopop"]),
    dict(loss_type=["sigmoid", "sft"], loss_weights=[0.8, 0.2]),
    dict(loss_type=["sigmoid_norm"], f_divergence_type="js_divergence"),
    dict(loss_type=["sigmoid"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    dict(loss_type=["aot", "aot_unpaired"], label_smoothing=0.1),  # batch-coupled: the two-call path inside
]


@pytest.mark.parametrize("case", DPO_CASES, ids=lambda c: "+".join(c["loss_type"]) + "-" + c.get(
    "f_divergence_type", "rkl"))
def test_dpo_fused_equals_two_call(case, chunk_counts):
    hidden, weight, bias, labels, mask = _batch()
    ref = torch.randn(2 * B, dtype=torch.float64) * 2 - 15
    cfg = DPOLossConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in case.items()})
    opts = PassOptions(chunk_bytes=CHUNK)

    def fused(h, head):
        return dpo_loss_fused(h, head, labels, mask, ref[:B], ref[B:], config=cfg, options=opts)

    def two_call(h, head):
        return dpo_loss(sequence_logps(h, head, labels, mask, options=opts), ref[:B], ref[B:], config=cfg)

    _compare(fused, two_call, hidden, weight, bias)
    if "aot" in cfg.loss_type:
        assert chunk_counts == []  # sequence_logps' recompute pass
    else:  # several chunks of whole pairs
        assert len(chunk_counts[0][1]) > 1, chunk_counts


def test_fused_computes_the_logits_once(monkeypatch):
    """The point of the fused path: each chunk's logits serve its statistics and its gradient
    (one logits GEMM a chunk), where the two-call path's backward recomputes them (two)."""
    from logitless.ops.torch_backend import backend as torch_backend

    hidden, weight, _, labels, mask = _batch()
    ref = torch.randn(2 * B, dtype=torch.float64) - 15
    opts = PassOptions(chunk_bytes=CHUNK)
    rows = []
    original = torch_backend.logits_block

    def counted(h, *args, **kwargs):  # logit rows computed
        rows.append(h.shape[0])
        return original(h, *args, **kwargs)

    monkeypatch.setattr(torch_backend, "logits_block", counted)
    counts = []
    for fused in (True, False):
        rows.clear()
        h, w = _leaves(hidden, weight)
        if fused:
            loss, _ = dpo_loss_fused(h, w, labels, mask, ref[:B], ref[B:], options=opts)
        else:
            loss, _ = dpo_loss(sequence_logps(h, w, labels, mask, options=opts), ref[:B], ref[B:])
        loss.backward()
        counts.append(sum(rows))
    assert counts[1] == 2 * counts[0] == 2 * int(mask.sum()), counts


def _fused_dpo_against_trl(loss_type: list[str], ld_alpha: float | None = None, use_weighting: bool = False):
    """The fused DPO loss, gradients and metrics against TRL's ``DPOTrainer._compute_loss``
    (test_preference's stub) on one batch."""
    from test_preference import DPOTrainer, _fake_model, _trl_stub

    hidden, weight, _, input_ids, attention = _batch(t=T + 1, empty=False)
    hidden = hidden[:, :-1].contiguous()
    completion = attention.clone()
    completion[:, 0] = 0
    ref = torch.randn(2 * B, dtype=torch.float64) - 12
    hidden, weight = _leaves(hidden, weight)
    cfg = DPOLossConfig(beta=0.2, loss_type=loss_type, ld_alpha=ld_alpha, use_weighting=use_weighting)
    loss, metrics = dpo_loss_fused(hidden, weight, input_ids[:, 1:], completion[:, 1:], ref[:B], ref[B:],
                                   config=cfg, options=PassOptions(chunk_bytes=CHUNK))
    stub = _trl_stub(DPOTrainer, _fake_model(hidden, weight, None), loss_types=loss_type, beta=0.2,
                     label_smoothing=0.0, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5,
                     discopop_tau=0.05, loss_weights=[1.0] * len(loss_type))
    stub.ld_alpha, stub.use_weighting = ld_alpha, use_weighting
    inputs = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion,
              "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    trl_loss = DPOTrainer._compute_loss(stub, stub.model, inputs, return_outputs=False)
    _close(loss.detach(), trl_loss.detach(), "loss")
    for g, r in zip(torch.autograd.grad(loss, [hidden, weight]), torch.autograd.grad(trl_loss, [hidden, weight]),
                    strict=True):
        _close(g, r, "grad")
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "entropy"):
        _close(metrics[name], stub._metrics["train"][name][-1], name)


def test_dpo_fused_matches_trl():
    """One case straight against TRL's ``DPOTrainer._compute_loss`` (test_preference's stub)."""
    _fused_dpo_against_trl(["sigmoid"])


# LD-DPO against TRL's own _compute_loss: ld_alpha 0 (the tail masked) and inside (0, 1), with the
# length-normalized ipo, the plain-NLL sft term, and a batch-coupled type (one chunk of every pair).
@pytest.mark.parametrize(("loss_type", "ld_alpha"), [(["sigmoid", "sft"], 0.5), (["ipo"], 0.0),
                                                     (["aot", "hinge"], 0.3)])
def test_ld_dpo_fused_matches_trl(loss_type, ld_alpha, chunk_counts):
    _fused_dpo_against_trl(loss_type, ld_alpha)
    if "aot" not in loss_type:
        assert len(chunk_counts[0][1]) > 1, chunk_counts  # several chunks of whole pairs


# WPO against TRL's own _compute_loss: per-pair weights on several loss types (several chunks of
# whole pairs) and with LD-DPO's scores.
# Not hinge: TRL 1.16 weighs relu's output in place (per_sequence_loss *= ...), so its own
# backward fails ("modified by an inplace operation"); ours has no such step.
@pytest.mark.parametrize(("loss_type", "ld_alpha"), [(["sigmoid", "ipo"], None), (["bco_pair", "robust"], 0.5)])
def test_wpo_fused_matches_trl(loss_type, ld_alpha, chunk_counts):
    _fused_dpo_against_trl(loss_type, ld_alpha, use_weighting=True)
    assert len(chunk_counts[0][1]) > 1, chunk_counts  # several chunks of whole pairs


def test_wpo_is_refused_where_it_cannot_apply():
    """WPO needs per-token statistics (not the two-call path's sums) and per-pair losses (not
    aot's sorts over the batch, which TRL refuses too, nor the batch-wide sft term, on which TRL's
    own loss fails)."""
    hidden, weight, _, labels, mask = _batch()
    ref = torch.randn(2 * B, dtype=torch.float64) - 12
    with pytest.raises(ValueError, match=r"use_weighting .* aot"):
        DPOLossConfig(loss_type=("sigmoid", "aot"), use_weighting=True)
    with pytest.raises(ValueError, match=r"use_weighting .* sft"):
        DPOLossConfig(loss_type=("sigmoid", "sft"), use_weighting=True)
    policy = sequence_logps(hidden, weight, labels, mask)
    with pytest.raises(ValueError, match=r"use_weighting .*dpo_loss_fused"):
        dpo_loss(policy, ref[:B], ref[B:], config=DPOLossConfig(use_weighting=True))


def test_ld_alpha_is_refused_where_it_cannot_apply():
    hidden, weight, _, labels, mask = _batch()
    ref = torch.randn(2 * B, dtype=torch.float64) - 12
    with pytest.raises(ValueError, match="ld_alpha must be in"):
        DPOLossConfig(ld_alpha=1.5)
    policy = sequence_logps(hidden, weight, labels, mask)
    with pytest.raises(ValueError, match="dpo_loss_fused"):  # sums no longer tell the tail tokens apart
        dpo_loss(policy, ref[:B], ref[B:], config=DPOLossConfig(ld_alpha=0.5))


@pytest.mark.parametrize("mode", ["recompute", "fused"])
def test_pair_longer_than_a_chunk(mode, chunk_counts):
    """A pair of 2 x 30 tokens in 32-token chunks: it becomes a chunk of its own (vocabulary
    blocks shrunk to the budget, logits recomputed in its backward); the others stay shorter."""
    hidden, weight, bias, labels, mask = _batch(t=30, empty=False)
    mask[1:B] = 0
    mask[B + 1:] = 0
    mask[1:B, :4] = 1
    mask[B + 1:, :3] = 1  # pairs 1.. hold 7 tokens, pair 0 up to 60
    ref = torch.randn(2 * B, dtype=torch.float64) - 20
    opts = PassOptions(chunk_bytes=CHUNK, mode=mode)

    def fused(h, head):
        return dpo_loss_fused(h, head, labels, mask, ref[:B], ref[B:], options=opts)

    def two_call(h, head):
        return dpo_loss(sequence_logps(h, head, labels, mask, options=opts), ref[:B], ref[B:])

    _compare(fused, two_call, hidden, weight, bias)
    if mode == "fused":
        token_chunk, lengths = chunk_counts[0]
        assert lengths[0] > token_chunk and len(lengths) > 1, chunk_counts


@pytest.mark.parametrize("cfg", [
    CPOLossConfig(),
    CPOLossConfig(loss_type="hinge", cpo_alpha=0.5),
    CPOLossConfig(loss_type="ipo", beta=0.4),
    CPOLossConfig(loss_type="sigmoid", label_smoothing=0.1, alpha=0.05),
    CPOLossConfig(loss_type="simpo", beta=2.0, simpo_gamma=0.7, cpo_alpha=0.3),
], ids=["sigmoid", "hinge", "ipo", "alphapo", "simpo-nll"])
def test_cpo_fused_equals_two_call(cfg):
    hidden, weight, _, labels, mask = _batch(empty=False)  # CPO's mean log-probs divide by the length
    opts = PassOptions(chunk_bytes=CHUNK)
    _compare(lambda h, head: cpo_loss_fused(h, head, labels, mask, config=cfg, options=opts),
             lambda h, head: cpo_loss(sequence_logps(h, head, labels, mask, options=opts), config=cfg),
             hidden, weight)


def test_simpo_fused_equals_two_call():
    hidden, weight, bias, labels, mask = _batch(empty=False)
    opts = PassOptions(chunk_bytes=CHUNK)
    kw = dict(beta=2.5, simpo_gamma=0.4, label_smoothing=0.05)
    _compare(lambda h, head: simpo_loss_fused(h, head, labels, mask, options=opts, **kw),
             lambda h, head: simpo_loss(sequence_logps(h, head, labels, mask, options=opts), **kw),
             hidden, weight, bias)


# kl_gap: the KL completions' policy minus reference mean; a negative gap clamps the estimate at 0.
@pytest.mark.parametrize(("loss_type", "kl_gap"), [("kto", 2.0), ("kto", -2.0), ("apo_zero_unpaired", 2.0)])
def test_kto_fused_equals_two_call(loss_type, kl_gap, chunk_counts):
    rows = 7
    hidden, weight, bias, labels, mask = _batch(rows)
    label = torch.tensor([True, False, True, True, False, False, True])
    ref = torch.randn(rows, dtype=torch.float64) * 2 - 15
    ref_kl = torch.randn(rows, dtype=torch.float64) - 15
    kl = ref_kl + kl_gap + 0.3 * torch.randn(rows, dtype=torch.float64)
    cfg = KTOLossConfig(beta=0.2, loss_type=loss_type, desirable_weight=1.3, undesirable_weight=0.7)
    opts = PassOptions(chunk_bytes=BLOCKED)
    _compare(lambda h, head: kto_loss_fused(h, head, labels, mask, label, ref, (kl, ref_kl), config=cfg,
                                            options=opts),
             lambda h, head: kto_loss(sequence_logps(h, head, labels, mask, options=opts), label, ref, kl, ref_kl,
                                      config=cfg),
             hidden, weight, bias)
    assert len(chunk_counts[0][1]) > 1, chunk_counts


def _nll_mask(mask):
    """ORPO's NLL tokens: the chosen rows' prompt and response (every position up to the last
    completion token), none of the rejected rows'."""
    last = (mask * torch.arange(1, mask.shape[1] + 1)).amax(1, keepdim=True)
    nll = (torch.arange(mask.shape[1])[None] < last).long()
    nll[B:] = 0
    return nll


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_fused_equals_two_call(beta, chunk_counts):
    hidden, weight, bias, labels, mask = _batch(empty=False)
    nll = _nll_mask(mask)
    opts = PassOptions(chunk_bytes=CHUNK)
    _compare(lambda h, head: orpo_loss_fused(h, head, labels, mask, nll_mask=nll, beta=beta, options=opts),
             lambda h, head: orpo_loss(sequence_logps(h, head, labels, mask, nll_mask=nll, options=opts), beta=beta),
             hidden, weight, bias)
    assert len(chunk_counts[0][1]) > 1, chunk_counts


def test_cpo_nll_mask_and_lora_head():
    """CPO with a separate NLL mask, on a head with a LoRA adapter (its factors get gradients too)."""
    hidden, weight, _, labels, mask = _batch(empty=False)
    nll = _nll_mask(mask)
    a, b = torch.randn(3, H, dtype=torch.float64) / 3, torch.randn(V, 3, dtype=torch.float64) / 3
    cfg = CPOLossConfig(cpo_alpha=0.7)
    opts = PassOptions(chunk_bytes=CHUNK)
    outs = []
    for fused in (True, False):
        h, w, la, lb = _leaves(hidden, weight, a, b)
        head = Head(w, lora=HeadLoRA(la, lb, scaling=0.5))
        if fused:
            loss, metrics = cpo_loss_fused(h, head, labels, mask, config=cfg, nll_mask=nll, options=opts)
        else:
            loss, metrics = cpo_loss(sequence_logps(h, head, labels, mask, nll_mask=nll, options=opts), config=cfg)
        outs.append((loss.detach(), torch.autograd.grad(loss, [h, w, la, lb]), metrics))
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = outs
    _close(loss, ref_loss, "loss")
    for name, g, r in zip(("d hidden", "d weight", "d a", "d b"), grads, ref_grads, strict=True):
        _close(g, r, name)
    assert metrics.keys() == ref_metrics.keys()
    for k in ref_metrics:
        _close(metrics[k], ref_metrics[k], k)


def test_no_completion_token():
    """Every mask empty: no chunk runs, the loss is the pairs' constant."""
    hidden, weight, _, labels, mask = _batch()
    ref = torch.randn(2 * B, dtype=torch.float64) - 10
    mask.zero_()
    _compare(lambda h, head: dpo_loss_fused(h, head, labels, mask, ref[:B], ref[B:]),
             lambda h, head: dpo_loss(sequence_logps(h, head, labels, mask), ref[:B], ref[B:]), hidden, weight)


def test_bad_inputs_are_named():
    hidden, weight, _, labels, mask = _batch()
    ref = torch.randn(B, dtype=torch.float64)
    with pytest.raises(ValueError, match="ref_rejected_logps contains NaN"):
        dpo_loss_fused(hidden, weight, labels, mask, ref, torch.full((B,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="ref_chosen_logps must be a tensor of shape"):
        dpo_loss_fused(hidden, weight, labels, mask, ref[:-1], ref)
    with pytest.raises(ValueError, match=r"\[2B, T\]"):
        cpo_loss_fused(hidden[:-1], weight, labels[:-1], mask[:-1])
    with pytest.raises(ValueError, match="completion_mask must be a tensor of shape"):
        cpo_loss_fused(hidden, weight, labels, mask[:, :-1])
    with pytest.raises(ValueError, match="needs kl_logps"):
        kto_loss_fused(hidden, weight, labels, mask, torch.ones(2 * B, dtype=torch.bool), ref.repeat(2))
    assert logitless.dpo_loss_fused is dpo_loss_fused


@pytest.mark.parametrize("value", [0.5, -1.0, float("nan")])
def test_masks_are_zero_or_one_as_in_sequence_logps(value):
    """The masks only select tokens: a 0.5, -1 or NaN (which ``!= 0`` would count as 1) is refused by
    the fused losses as by :func:`sequence_logps`, naming the mask."""
    hidden, weight, _, labels, mask = _batch()
    bad = mask.double()
    bad[0, T // 2] = value
    ref = torch.randn(B, dtype=torch.float64)
    with pytest.raises(ValueError, match="completion_mask values must be 0 or 1"):
        sequence_logps(hidden, weight, labels, bad)
    with pytest.raises(ValueError, match="completion_mask values must be 0 or 1"):
        dpo_loss_fused(hidden, weight, labels, bad, ref, ref)
    with pytest.raises(ValueError, match="completion_mask values must be 0 or 1"):
        kto_loss_fused(hidden, weight, labels, bad, torch.ones(2 * B, dtype=torch.bool), ref.repeat(2),
                       config=KTOLossConfig(loss_type="apo_zero_unpaired"))
    with pytest.raises(ValueError, match="nll_mask values must be 0 or 1"):
        orpo_loss_fused(hidden, weight, labels, mask, nll_mask=bad)


def test_vocab_shards():
    """Two vocabulary-parallel ranks (gloo; 19 rows each, so 32-token chunks: several per pass,
    each reducing its statistics over the ranks): each rank's loss, d hidden and metrics equal
    the single-process two-call path's, and its d weight rows are those rows of it."""
    from test_distributed import _spawn

    hidden, weight, _, labels, mask = _batch()
    weight = torch.cat([weight, torch.randn(1, H, dtype=torch.float64)])  # V + 1 = 38: an even split
    ref = torch.randn(2 * B, dtype=torch.float64) - 15
    case = dict(hidden=hidden, weight=weight, labels=labels, mask=mask, ref=ref, chunk=CHUNK // 2)
    outs = _spawn("preference_vocab_parallel", 2, case)
    h, w = _leaves(hidden, weight)
    loss, metrics = dpo_loss(sequence_logps(h, w, labels, mask), ref[:B], ref[B:])
    gh, gw = torch.autograd.grad(loss, [h, w])
    for o in outs:
        _close(o["loss"], loss.detach(), "loss")
        _close(o["grad_hidden"], gh, "d hidden")
        _close(o["grad_weight"], gw[o["start"] : o["start"] + o["rows"]], "d weight")
        assert o["metrics"].keys() == metrics.keys()
        for k, v in metrics.items():
            _close(o["metrics"][k], v, k)


@pytest.mark.parametrize("impl", ["triton", "gemm", "flash"])
def test_kernel_backends(seed, impl):
    """The interpreter's kernels (bf16; CPU CI runs them under TRITON_INTERPRET) against the same
    backend's two-call path: the same logits, summed in other orders, hence bf16 tolerances."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, weight, _, labels, mask = (x.to(dev) for x in _batch(dtype=torch.bfloat16))
    ref = (torch.randn(2 * B) - 12).to(dev)
    opts = PassOptions(impl=impl)
    outs = []
    for fn in (lambda h, w: dpo_loss_fused(h, w, labels, mask, ref[:B], ref[B:], options=opts),
               lambda h, w: dpo_loss(sequence_logps(h, w, labels, mask, options=opts), ref[:B], ref[B:])):
        h, w = _leaves(hidden, weight)
        loss, metrics = fn(h, w)
        outs.append((loss, torch.autograd.grad(loss, [h, w]), metrics))
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = outs
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-3)
    for k, v in ref_metrics.items():
        torch.testing.assert_close(metrics[k], v, rtol=1e-4, atol=1e-4, msg=k)


# ---------------------------------------------------------------- the passes the TRL drop-ins call


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_passes_return_the_sums_of_the_materialized_logits(mode):
    """``dpo_fused_pass`` / ``kto_fused_pass``: the loss of ``dpo_loss_fused`` / ``kto_loss_fused``,
    and every sequence's log-prob, entropy and mean-logit sums and top-1 counts equal to the float64
    materialized logits' (the head with a bias and a temperature, so that the mean logit sees both)."""
    from logitless.objectives.preference_fused import dpo_fused_pass, kto_fused_pass

    hidden, weight, bias, labels, mask = _batch()
    ref = torch.randn(2 * B, dtype=torch.float64) - 15
    opts = PassOptions(chunk_bytes=CHUNK, mode=mode)
    head = Head(weight, bias=bias).at_temperature(0.7)
    z = (hidden @ weight.t() + bias) / 0.7  # [S, T, V]
    logsm = torch.log_softmax(z, -1)
    m = mask.double()
    logp = logsm.gather(-1, labels[..., None]).squeeze(-1)
    want = dict(logps=(logp * m).sum(1), entropy_sum=(-(logsm.exp() * logsm).sum(-1) * m).sum(1),
                mean_logit=(z.mean(-1) * m).sum(1), top1=((z.argmax(-1) == labels) * m).sum(1))

    def check(out, loss):
        _close(out.loss, loss, "loss")
        for k in ("logps", "entropy_sum"):
            _close(getattr(out.policy, k), want[k], k)
        _close(out.policy.lengths, m.sum(1), "lengths")
        _close(out.tokens.mean_logit, want["mean_logit"], "mean_logit")
        assert torch.equal(out.tokens.top1, want["top1"])

    cfg = DPOLossConfig(loss_type=("sigmoid", "sft"))
    check(dpo_fused_pass(hidden, head, labels, mask, ref[:B], ref[B:], config=cfg, options=opts),
          dpo_loss_fused(hidden, head, labels, mask, ref[:B], ref[B:], config=cfg, options=opts)[0])
    label = torch.arange(2 * B) % 3 == 0
    kl_logps = (torch.randn(2 * B, dtype=torch.float64) - 15, torch.randn(2 * B, dtype=torch.float64) - 16)
    kl = (kl_logps[0] - kl_logps[1]).mean().clamp(min=0)
    check(kto_fused_pass(hidden, head, labels, mask, label, ref, kl, options=opts),
          kto_loss_fused(hidden, head, labels, mask, label, ref, kl_logps, options=opts)[0])


def test_kto_pass_names_a_missing_or_bad_kl():
    from logitless.objectives.preference_fused import kto_fused_pass

    hidden, weight, _, labels, mask = _batch()
    label, ref = torch.arange(2 * B) % 2 == 0, torch.randn(2 * B, dtype=torch.float64)
    for kl in (None, torch.zeros(2)):
        with pytest.raises(ValueError, match="needs kl"):
            kto_fused_pass(hidden, weight, labels, mask, label, ref, kl)
    with pytest.raises(ValueError, match="kl contains NaN or inf"):  # with the inputs' value checks
        kto_fused_pass(hidden, weight, labels, mask, label, ref, torch.tensor(float("nan"), dtype=torch.float64))
