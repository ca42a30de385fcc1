"""Bad input raises a named error (TypeError / ValueError naming the bad value) before any
vocabulary pass runs; the degenerate-but-valid all-masked batch behaves as TRL does."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import logitless
import logitless.ops.torch_backend.backend as torch_backend
from logitless import Head, LogitTransform, PassOptions, PolicyConfig, policy_loss, token_logprobs, vocab_stats

V, H = 11, 6




@pytest.fixture
def no_kernel(monkeypatch):
    """Any call into the backend fails the test: errors must come first."""

    def boom(*_a, **_k):
        raise AssertionError("a vocabulary pass ran before the input was rejected")

    monkeypatch.setattr(torch_backend, "chunk_forward", boom)
    monkeypatch.setattr(torch_backend, "chunk_backward", boom)


def head_inputs(n=5):
    return torch.randn(n, H), torch.randn(V, H), torch.randint(0, V, (n,))


_HEAD_KW = ("bias", "temperature", "logit_scale", "softcap")
_PASS_KW = ("mode", "impl", "chunk_bytes")


def _split(weight, kw):
    """``(head, options, rest)`` from flat keyword arguments, built where the bad value is seen."""
    head_kw = {k: kw.pop(k) for k in _HEAD_KW if k in kw}
    bias = head_kw.pop("bias", None)
    head = Head(weight, bias, LogitTransform(**head_kw))
    options = PassOptions(**{k: kw.pop(k) for k in _PASS_KW if k in kw})
    return head, options, kw


def _entry(fn):
    def call(h, w, t, **kw):
        head, options, rest = _split(w, kw)
        return fn(h, head, t, options=options, **rest)
    return call


ENTRY_POINTS = {"vocab_stats": _entry(vocab_stats), "token_logprobs": _entry(token_logprobs)}


def _bad_cases():
    h, w, t = head_inputs()
    nan_h = h.clone()
    nan_h[1, 2] = math.nan
    inf_w = w.clone()
    inf_w[3, 0] = math.inf
    bad_bias = torch.randn(V)
    bad_bias[0] = math.nan
    neg = t.clone()
    neg[0] = -1
    big = t.clone()
    big[2] = V
    return {
        "hidden rank": (dict(hidden=torch.randn(H)), ValueError, "hidden"),
        "weight H": (dict(weight=torch.randn(V, H + 1)), ValueError, "weight"),
        "weight rank": (dict(weight=torch.randn(V * H)), ValueError, "weight"),
        "empty vocab": (dict(weight=torch.randn(0, H)), ValueError, "vocab|V = 0|weight"),
        "targets shape": (dict(targets=t[:-1]), ValueError, "targets"),
        "targets float": (dict(targets=t.float()), TypeError, "targets"),
        "targets bool": (dict(targets=t > 3), TypeError, "targets"),
        "hidden int": (dict(hidden=h.long(), weight=w.long()), TypeError, "hidden"),
        "dtype mismatch": (dict(weight=w.double()), TypeError, "dtype"),
        "bias dtype": (dict(bias=torch.randn(V, dtype=torch.float64)), TypeError, "bias"),
        "bias shape": (dict(bias=torch.randn(V + 1)), ValueError, "bias"),
        "weight device": (dict(weight=torch.empty(V, H, device="meta")), ValueError, "device|meta"),
        "targets device": (dict(targets=torch.empty(5, dtype=torch.long, device="meta")), ValueError, "meta"),
        "bias device": (dict(bias=torch.empty(V, device="meta")), ValueError, "meta"),
        "target >= V": (dict(targets=big), ValueError, rf"\[0, {V}\).*{V}"),
        "negative target": (dict(targets=neg), ValueError, r"-1"),
        "nan hidden": (dict(hidden=nan_h), ValueError, "hidden.*NaN"),
        "inf weight": (dict(weight=inf_w), ValueError, "weight.*NaN or inf"),
        "nan bias": (dict(bias=bad_bias), ValueError, "bias.*NaN"),
        "temperature 0": (dict(temperature=0.0), ValueError, "temperature"),
        "temperature nan": (dict(temperature=math.nan), ValueError, "temperature"),
        "softcap negative": (dict(softcap=-1.0), ValueError, "softcap"),
        "logit_scale inf": (dict(logit_scale=math.inf), ValueError, "logit_scale"),
        "chunk_bytes 0": (dict(chunk_bytes=0), ValueError, "chunk_bytes"),
        "chunk_bytes negative": (dict(chunk_bytes=-5), ValueError, "chunk_bytes"),
        "impl": (dict(impl="cuda"), ValueError, "impl"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(BAD))
def test_head_inputs_rejected(no_kernel, entry, case):
    torch.manual_seed(zlib.crc32(case.encode()))
    h, w, t = head_inputs()
    over, exc, pattern = BAD[case]
    args = dict(hidden=h, weight=w, targets=t)
    args.update({k: v for k, v in over.items() if k in args})
    kwargs = {k: v for k, v in over.items() if k not in args}
    with pytest.raises(exc, match=pattern):
        ENTRY_POINTS[entry](args["hidden"], args["weight"], args["targets"], **kwargs)


def test_ignore_index_is_the_only_negative_target(no_kernel):
    h, w, t = head_inputs()
    t[1] = -7
    with pytest.raises(ValueError, match="-7"):
        vocab_stats(h, w, t, ignore_index=-100)


def test_token_logprobs_not_a_tensor(no_kernel):
    h, w, t = head_inputs()
    with pytest.raises(TypeError, match="hidden"):
        token_logprobs(h.tolist(), w, t)


# ----------------------------------------------------------------------------- policy_loss


def policy_inputs(b=3, t=4, dtype=torch.float32):
    return dict(hidden=torch.randn(b, t, H, dtype=dtype), weight=torch.randn(V, H, dtype=dtype),
                targets=torch.randint(0, V, (b, t)), completion_mask=torch.ones(b, t, dtype=torch.long),
                advantages=torch.randn(b, dtype=dtype), old_logp=-torch.rand(b, t, dtype=dtype) * 3)


def _call(inp, **kw):
    head, options, rest = _split(inp["weight"], kw)
    args = [inp[k] for k in ("hidden", "targets", "completion_mask", "advantages")]
    return policy_loss(args[0], head, *args[1:], inp.get("old_logp"), inp.get("ref_logp"), options=options, **rest)


def _policy_bad():
    nan_old = -torch.rand(3, 4)
    nan_old[1, 1] = math.nan
    nan_adv = torch.randn(3)
    nan_adv[2] = math.inf
    return {
        "hidden 2d without segment_ids": (dict(hidden=torch.randn(12, H)), {}, ValueError, "hidden"),
        "ids shape": (dict(targets=torch.randint(0, V, (3, 5))), {}, ValueError, "targets"),
        "mask shape": (dict(completion_mask=torch.ones(3, 5)), {}, ValueError, "completion_mask"),
        "old_logp shape": (dict(old_logp=torch.zeros(3, 5)), {}, ValueError, "old_logp"),
        "advantages shape": (dict(advantages=torch.randn(4)), {}, ValueError, "advantages"),
        "advantages list": (dict(advantages=[1.0, 2.0, 3.0]), {}, TypeError, "advantages"),
        "advantages None": (dict(advantages=None), {}, TypeError, "advantages"),
        "ids out of range": (dict(targets=torch.full((3, 4), V)), {}, ValueError, "targets|range"),
        "ids device": (dict(targets=torch.empty(3, 4, dtype=torch.long, device="meta")), {}, ValueError,
                       "meta"),
        "weight device": (dict(weight=torch.empty(V, H, device="meta")), {}, ValueError, "meta"),
        "weight dtype": (dict(weight=torch.randn(V, H, dtype=torch.float64)), {}, TypeError, "dtype"),
        "nan old_logp": (dict(old_logp=nan_old), {}, ValueError, "old_logp"),
        "inf advantages": (dict(advantages=nan_adv), {}, ValueError, "advantages"),
        "beta without ref": ({}, dict(config=PolicyConfig(beta=0.04)), ValueError, "ref_logp"),
        "mode": ({}, dict(mode="sometimes"), ValueError, "mode"),
        "impl": ({}, dict(impl="cuda"), ValueError, "impl"),
        "chunk_bytes": ({}, dict(chunk_bytes=0), ValueError, "chunk_bytes"),
        "fused with quantile": ({}, dict(config=PolicyConfig(top_entropy_quantile=0.5), mode="fused"), ValueError,
                                "top_entropy_quantile"),
        "negative IS ratio": ({}, dict(importance_sampling_ratio=-torch.ones(3, 4)), ValueError,
                              "importance_sampling_ratio"),
        "vespo sequence IS ratio": ({}, dict(config=PolicyConfig(loss_type="vespo"),
                                             importance_sampling_ratio=torch.ones(3, 1)), ValueError, "vespo"),
    }


POLICY_BAD = _policy_bad()


@pytest.mark.parametrize("case", list(POLICY_BAD))
def test_policy_inputs_rejected(no_kernel, case):
    torch.manual_seed(zlib.crc32(case.encode()))
    inp = policy_inputs()
    over, kw, exc, pattern = POLICY_BAD[case]
    inp.update(over)
    with pytest.raises(exc, match=pattern):
        _call(inp, **kw)


# A framework's spelling of a core argument (completion_ids, labels, return_entropy, ...) is named, with the core's.
_RENAMED = {
    "policy_loss completion_ids": (lambda h, w, t, m: policy_loss(h[None], w, completion_ids=t[None],
                                                                  completion_mask=m[None], advantages=torch.ones(1)),
                                   r"policy_loss takes `targets` \(the completion token ids\), not `completion_ids`"),
    "policy_loss old_per_token_logps": (lambda h, w, t, m: policy_loss(h[None], w, t[None], m[None], torch.ones(1),
                                                                       old_per_token_logps=torch.zeros(1, len(t))),
                                        "policy_loss takes `old_logp`"),
    "sequence_logps labels": (lambda h, w, t, m: logitless.sequence_logps(h[None], w, labels=t[None],
                                                                          completion_mask=m[None]),
                              "sequence_logps takes `targets`"),
    "dpo_loss_fused labels": (lambda h, w, t, m: logitless.dpo_loss_fused(
        h[None].expand(2, -1, -1), w, labels=t[None].expand(2, -1), completion_mask=m[None].expand(2, -1),
        ref_chosen_logps=torch.zeros(1), ref_rejected_logps=torch.zeros(1)), "dpo_loss_fused takes `targets`"),
    "simpo_loss_fused labels": (lambda h, w, t, m: logitless.simpo_loss_fused(
        h[None].expand(2, -1, -1), w, labels=t[None].expand(2, -1), completion_mask=m[None].expand(2, -1)),
        "simpo_loss_fused takes `targets`"),
    "distill_loss labels": (lambda h, w, t, m: logitless.distill_loss(h, w, h, w, labels=t),
                            "distill_loss takes `targets`"),
    "token_logprobs return_entropy": (lambda h, w, t, m: token_logprobs(h, w, t, return_entropy=True),
                                      r"token_logprobs takes `entropy` \(a bool: also return the entropy\)"),
    "vocab_stats return_entropy": (lambda h, w, t, m: vocab_stats(h, w, t, return_entropy=True),
                                   "vocab_stats takes `entropy`"),
}


@pytest.mark.parametrize("case", list(_RENAMED))
def test_framework_keyword_names_the_core_one(no_kernel, case):
    call, pattern = _RENAMED[case]
    h, w, t = head_inputs()
    with pytest.raises(TypeError, match=pattern):
        call(h, w, t, torch.ones(len(t)))


@pytest.mark.parametrize(("field", "value", "pattern"), [
    ("loss_type", "gspo", "loss_type"),
    ("importance_sampling_level", "tokens", "importance_sampling_level"),
    ("epsilon", -0.1, "epsilon"),
    ("epsilon", math.nan, "epsilon"),
    ("epsilon_high", -1.0, "epsilon_high"),
    ("beta", -0.01, "beta"),
    ("beta", math.inf, "beta"),
    ("entropy_coef", math.inf, "entropy_coef"),  # a negative one is an entropy penalty (TRL accepts it)
    ("top_entropy_quantile", -0.1, "top_entropy_quantile"),
    ("delta", 0.0, "delta"),
    ("top_entropy_quantile", 1.5, "top_entropy_quantile"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps"),
    ("num_processes", 0, "num_processes"),
    ("steps_per_generation", 0, "steps_per_generation"),
])
def test_policy_config_rejected(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        PolicyConfig(**{field: value})


@pytest.mark.parametrize("loss_type", ["cispo", "vespo", "sapo", "reinforce"])
def test_delta_is_ignored_where_trl_ignores_it(seed, loss_type):
    """TRL 1.16 accepts ``delta`` with every loss type and applies it only to the clipped
    surrogates: with the other types the loss and gradient equal the ones without it."""
    inp = policy_inputs(dtype=torch.float64)
    inp["old_logp"] = inp["old_logp"] * 0.1
    ratio = torch.rand(3, 4, dtype=torch.float64) + 0.5
    extra = dict(importance_sampling_ratio=ratio) if loss_type == "vespo" else {}
    out = []
    for delta in (None, 1.05):
        h = inp["hidden"].clone().requires_grad_()
        loss, _ = _call({**inp, "hidden": h}, config=PolicyConfig(loss_type=loss_type, delta=delta), **extra)
        loss.backward()
        out.append((loss.detach(), h.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_all_masked_batch_is_zero_with_a_gradient(seed, loss_type, mode):
    """TRL: an all-masked micro-batch gives loss 0 whose (zero) gradient still reaches the
    parameters (so a distributed backward does not hang), entropy/kl/clip means 0 and the
    per-sequence clip extrema NaN. (Matched against TRL itself in test_policy_trl.py.)"""
    inp = policy_inputs()
    inp["completion_mask"] = torch.zeros(3, 4, dtype=torch.long)
    inp["ref_logp"] = -torch.rand(3, 4) * 3
    h = inp["hidden"].requires_grad_(True)
    w = inp["weight"].requires_grad_(True)
    cfg = PolicyConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01, max_completion_length=4)
    loss, metrics = _call(inp, config=cfg, mode=mode, num_items_in_batch=0)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert h.grad is not None and (h.grad == 0).all()
    assert w.grad is not None and (w.grad == 0).all()
    assert metrics["entropy"].item() == 0.0 and metrics["kl"].item() == 0.0
    if "clip_ratio/low_mean" in metrics:
        assert metrics["clip_ratio/low_mean"].item() == 0.0
        assert math.isnan(metrics["clip_ratio/low_min"].item()) and math.isnan(metrics["clip_ratio/high_max"].item())


def test_no_kernel_guard_is_armed(no_kernel):
    # The guard above is what makes "before any kernel runs" checkable: a valid call trips it.
    h, w, t = head_inputs()
    with pytest.raises(AssertionError, match="vocabulary pass ran"):
        token_logprobs(h, w, t)


def test_weight_checked_once_per_version(monkeypatch):
    """The weight's NaN/inf check runs once per version of the weight: a rollout loop does not
    re-read it, and an in-place write (an optimizer step) is checked again before the next pass."""
    import logitless.ops.validate as validate

    h, w, t = head_inputs()
    reads = []
    real = validate.ValueChecks.add_finite
    monkeypatch.setattr(validate.ValueChecks, "add_finite",
                        lambda self, x, *a, **k: reads.append(x.data_ptr() == w.data_ptr()) or real(self, x, *a, **k))
    token_logprobs(h, w, t)
    token_logprobs(torch.randn_like(h), w, t)
    assert reads.count(True) == 1
    with torch.no_grad():
        w[3, 2] = math.nan
    with pytest.raises(ValueError, match="weight contains NaN or inf"):
        token_logprobs(h, w, t)
    assert reads.count(True) == 2
    with torch.no_grad():
        w[3, 2] = 0.5
    token_logprobs(h, w, t)
    token_logprobs(h, w, t)
    assert reads.count(True) == 3
    # A detached alias made per call (same storage and version counter) is known too; a
    # write through it is seen; a view of other rows is checked on its own.
    token_logprobs(h, w.detach(), t)
    assert reads.count(True) == 3
    with torch.no_grad():
        w.detach()[0, 0] = math.inf
    with pytest.raises(ValueError, match="weight contains NaN or inf"):
        token_logprobs(h, w.detach(), t)
    with torch.no_grad():
        w[0, 0] = 1.0
    token_logprobs(h, w[: V - 1].contiguous(), t.clamp(max=V - 2))
    assert reads.count(True) == 5


def test_policy_per_token_values_checked_at_counted_tokens(no_kernel):
    """NaN/inf in a per-token input or a negative importance-sampling ratio at a counted token is
    a named error before any pass; the same values at masked-out tokens are not."""
    b, t = 2, 4
    h, w = torch.randn(b, t, H), torch.randn(V, H)
    ids = torch.randint(0, V, (b, t))
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 3] = 0
    adv, old, ratio = torch.randn(b), torch.randn(b, t) - 2.0, torch.rand(b, t) + 0.5
    cfg = PolicyConfig(loss_type="dapo")

    def call(**kw):
        args = dict(advantages=adv, old_logp=old, importance_sampling_ratio=ratio) | kw
        return policy_loss(h, w, ids, mask, args.pop("advantages"), args.pop("old_logp"), config=cfg, **args)

    bad_old = old.clone()
    bad_old[0, 2] = math.inf
    with pytest.raises(ValueError, match="old_logp contains NaN or inf"):
        call(old_logp=bad_old)
    bad_adv = adv.clone()
    bad_adv[1] = math.nan
    with pytest.raises(ValueError, match="advantages contains NaN or inf"):
        call(advantages=bad_adv)
    negative = ratio.clone()
    negative[1, 0] = -0.25
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        call(importance_sampling_ratio=negative)
    nan_ratio = ratio.clone()
    nan_ratio[0, 0] = math.nan
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        call(importance_sampling_ratio=nan_ratio)
    big_id = ids.clone()
    big_id[0, 1] = V
    with pytest.raises(ValueError, match=rf"\[0, {V}\).*{V}"):
        policy_loss(h, w, big_id, mask, adv, old, config=cfg)
    # Masked-out positions may hold anything: they never reach the pass or the checks.
    masked_old, masked_ratio, masked_ids = old.clone(), ratio.clone(), ids.clone()
    masked_old[1, 3], masked_ratio[1, 3], masked_ids[1, 3] = math.nan, -1.0, V + 5
    with pytest.raises(AssertionError, match="vocabulary pass ran"):  # the checks passed: the pass was reached
        policy_loss(h, w, masked_ids, mask, adv, masked_old, config=cfg, importance_sampling_ratio=masked_ratio)


def test_ignored_targets_and_out_of_range_ids_together(no_kernel):
    """With ``ignore_index`` among the targets, an id >= V elsewhere is still named; only
    ``ignore_index`` itself is exempt."""
    h, w, t = head_inputs(6)
    t[0], t[4] = -100, V + 3
    with pytest.raises(ValueError, match=rf"{V + 3}"):
        vocab_stats(h, w, t, ignore_index=-100)
    t[4] = V - 1
    with pytest.raises(AssertionError, match="vocabulary pass ran"):
        vocab_stats(h, w, t, ignore_index=-100)


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ignore_index_outside_and_inside_the_vocabulary(ignore_index):
    """The targets' range and ``ignore_index`` are decided from one reduction when no target can
    be ignored, exactly otherwise (an ``ignore_index`` inside ``[0, V)`` always takes the exact
    path): ignored rows give 0, the others match float64 materialized logits."""
    torch.manual_seed(11 + ignore_index)
    h, w, t = head_inputs(9)
    t[t == ignore_index] = (ignore_index + 1) % V
    t[2] = t[6] = ignore_index
    got = vocab_stats(h, w, t, ignore_index=ignore_index).logp
    ref = torch.log_softmax(h.double() @ w.double().T, -1).gather(1, t.clamp(0, V - 1)[:, None])[:, 0]
    keep = t != ignore_index
    torch.testing.assert_close(got[keep].double(), ref[keep], atol=1e-5, rtol=1e-5)
    assert got[~keep].abs().max() == 0
    t[2] = t[6] = (ignore_index + 2) % V  # nothing ignored now: the same rows as the oracle's
    got = vocab_stats(h, w, t, ignore_index=ignore_index).logp
    ref = torch.log_softmax(h.double() @ w.double().T, -1).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
