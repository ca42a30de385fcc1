"""Issue 33's input and value items: token counts of every type, masks of every dtype, meta and
foreign devices, option types, and logits beyond what the statistics hold all get a named error
before any vocabulary pass; ``cross_entropy``'s empty-batch metrics agree across modes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import logitless.ops.torch_backend.backend as torch_backend
import logitless.ops.validate as validate
from logitless import (
    DistillConfig,
    Head,
    LogitTransform,
    PassOptions,
    PolicyConfig,
    cross_entropy,
    distill_loss,
    head_loss,
    policy_loss,
    sequence_logps,
    token_logprobs,
    vocab_stats,
)

V, H, B, T = 13, 6, 2, 4


@pytest.fixture
def no_kernel(monkeypatch):
    """Any vocabulary pass fails the test: errors must come first (the distillation pass runs
    its own GEMMs, so it is patched too)."""

    def boom(*_a, **_k):
        raise AssertionError("a vocabulary pass ran before the input was rejected")

    monkeypatch.setattr(torch_backend, "chunk_forward", boom)
    monkeypatch.setattr(torch_backend, "chunk_backward", boom)
    import logitless.objectives.distill as distill

    monkeypatch.setattr(distill, "run_distill", boom)


def _inputs():
    hidden, weight = torch.randn(B, T, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3] = 0
    return hidden, weight, ids, mask


def _policy(hidden, weight, ids, mask, **kw):
    # Defaults derived from hidden, so that repeated calls see the same values.
    adv = kw.pop("advantages", hidden[:, 0, 0].detach().clone() if not hidden.is_meta else None)
    old = kw.pop("old_logp", -hidden[..., 1].detach().abs() if not hidden.is_meta else None)
    return policy_loss(hidden, weight, ids, mask, adv, old, **kw)


def _ce(hidden, weight, ids, mask, **kw):
    return cross_entropy(hidden, weight, torch.where(mask.bool(), ids, -100), **kw)


def _distill(hidden, weight, ids, mask, **kw):
    return distill_loss(hidden, weight, kw.pop("teacher_hidden", hidden.flip(0)),
                        kw.pop("teacher", weight.flip(0)), mask=kw.pop("mask", mask), **kw)


COUNTED = {"policy_loss": _policy, "cross_entropy": _ce, "distill_loss": _distill}

# ----------------------------------------------------------------- item 4: num_items_in_batch

BAD_COUNTS = {
    "tensor 0": (torch.tensor(0.0), ValueError), "tensor -3": (torch.tensor(-3.0), ValueError),
    "tensor nan": (torch.tensor(math.nan), ValueError), "tensor inf": (torch.tensor(math.inf), ValueError),
    "int tensor 0": (torch.tensor(0), ValueError), "1-element -2": (torch.tensor([-2.0]), ValueError),
    "int 0": (0, ValueError), "int -3": (-3, ValueError), "float nan": (math.nan, ValueError),
    "float inf": (math.inf, ValueError), "numpy -1": (np.float32(-1.0), ValueError),
    "two elements": (torch.tensor([3.0, 4.0]), TypeError), "bool": (True, TypeError), "str": ("5", TypeError),
    "bool tensor": (torch.tensor(True), TypeError), "meta": (torch.empty((), device="meta"), ValueError),
}


@pytest.mark.parametrize("entry", list(COUNTED))
@pytest.mark.parametrize("case", list(BAD_COUNTS))
def test_num_items_in_batch_checked_whatever_its_type(seed, no_kernel, entry, case):
    value, exc = BAD_COUNTS[case]
    with pytest.raises(exc, match="num_items_in_batch"):
        COUNTED[entry](*_inputs(), num_items_in_batch=value)


@pytest.mark.parametrize("entry", list(COUNTED))
def test_tensor_count_in_the_one_value_synchronization(seed, monkeypatch, entry):
    """A tensor count is read with the other value checks: the call synchronizes as often as with
    a Python count, and gives the same loss, which is the oracle's sum over the count."""
    runs = []
    real = validate.ValueChecks.run
    monkeypatch.setattr(validate.ValueChecks, "run", lambda self, *r: runs.append(1) or real(self, *r))
    hidden, weight, ids, mask = _inputs()
    out = []
    for count in (9.0, torch.tensor(9, dtype=torch.int32)):
        runs.clear()
        out.append((COUNTED[entry](hidden, weight, ids, mask, num_items_in_batch=count)[0], len(runs)))
    assert out[0][1] == out[1][1]
    assert torch.equal(out[0][0], out[1][0])
    if entry == "cross_entropy":  # the oracle: the float64 CE summed over the counted tokens, / count
        logits = hidden.reshape(-1, H) @ weight.T
        ref = F.cross_entropy(logits, torch.where(mask.bool(), ids, -100).reshape(-1), reduction="sum") / 9
        torch.testing.assert_close(out[1][0], ref, rtol=1e-12, atol=1e-12)


def test_policy_count_zero_only_for_a_call_without_counted_token(seed):
    """TRL clamps the generation batch's count to 1, so 0 is its count when no token is counted
    anywhere: accepted then (loss 0), refused when this call counts tokens (it was read as 1)."""
    hidden, weight, ids, mask = _inputs()
    loss, _ = _policy(hidden, weight, ids, torch.zeros_like(mask), num_items_in_batch=torch.tensor(0.0))
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="num_items_in_batch"):
        _policy(hidden, weight, ids, mask, num_items_in_batch=torch.tensor(0.0))


# ----------------------------------------------------------------- item 5: masks


def _masks():
    neg = torch.ones(B, T, dtype=torch.long)
    neg[0, 1] = -1
    nan = torch.ones(B, T)
    nan[1, 0] = math.nan
    return {"int -1": neg, "float -1": neg.float(), "int8 -1": neg.to(torch.int8), "float nan": nan,
            "float inf": nan.nan_to_num(nan=math.inf)}


MASKS = _masks()


@pytest.mark.parametrize("case", list(MASKS))
@pytest.mark.parametrize("name", ["completion_mask", "tool_mask"])
def test_policy_masks_one_rule_for_every_dtype(seed, no_kernel, case, name):
    hidden, weight, ids, mask = _inputs()
    kw = {"tool_mask": MASKS[case]} if name == "tool_mask" else {}
    with pytest.raises(ValueError, match=name):
        _policy(hidden, weight, ids, MASKS[case] if name == "completion_mask" else mask, **kw)


@pytest.mark.parametrize("case", [*MASKS, "float 0.5", "int 2"])
def test_selecting_masks_are_zero_or_one(seed, no_kernel, case):
    """distill_loss's ``mask`` and sequence_logps's masks only select tokens (a NaN or a 0.5 used to
    count as 1, a -1 too): 0/1 in every dtype."""
    hidden, weight, ids, _ = _inputs()
    bad = {"float 0.5": torch.full((B, T), 0.5), "int 2": torch.full((B, T), 2)}.get(case, MASKS.get(case))
    with pytest.raises(ValueError, match="mask"):
        _distill(hidden, weight, ids, bad)
    with pytest.raises(ValueError, match="completion_mask"):
        sequence_logps(hidden, weight, ids, bad)
    with pytest.raises(ValueError, match="nll_mask"):
        sequence_logps(hidden, weight, ids, torch.ones(B, T), nll_mask=bad)


def test_valid_masks_of_every_dtype_agree(seed):
    """bool, integer and floating 0/1 masks give the same loss on every masked entry point; the
    policy's float weights (its documented rule) still pass."""
    hidden, weight, ids, mask = _inputs()
    for fn in (_policy, _distill):
        adv = torch.randn(B, dtype=hidden.dtype)
        old = -torch.rand(B, T, dtype=hidden.dtype)
        kw = {"advantages": adv, "old_logp": old} if fn is _policy else {}
        losses = [fn(hidden, weight, ids, m, **dict(kw))[0] for m in (mask, mask.bool(), mask.double(),
                                                                        mask.to(torch.uint8))]
        assert all(torch.equal(losses[0], x) for x in losses[1:])
    _policy(hidden, weight, ids, mask * 0.5)


# ----------------------------------------------------------------- item 8: cross_entropy, no counted token


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("eps", "z"), [(0.0, 0.0), (0.1, 1e-3)])
def test_cross_entropy_without_counted_token_same_in_every_mode(seed, reduction, eps, z):
    """The loss and its ``ce``/``z_loss`` parts are PyTorch's for the empty batch (mean: NaN, sum:
    0) and ``accuracy`` is TRL's ``mean_token_accuracy`` of it (0), in fused and recompute mode."""
    hidden, weight, _, _ = _inputs()
    targets = torch.full((B, T), -100)
    ref = F.cross_entropy(hidden.reshape(-1, H) @ weight.T, targets.reshape(-1), reduction=reduction,
                          label_smoothing=eps)
    for mode in ("fused", "recompute"):
        loss, m = cross_entropy(hidden, weight, targets, reduction=reduction, label_smoothing=eps, z_loss=z,
                                options=PassOptions(mode=mode))
        for got in (loss, m["ce"], *((m["z_loss"],) if z else ())):
            torch.testing.assert_close(got, ref, equal_nan=True)
        assert m["accuracy"].item() == 0.0


# ----------------------------------------------------------------- item 9: devices and dtypes


def _meta(x):
    return torch.empty_like(x, device="meta")


def _device_cases():
    hidden, weight, ids, mask = _inputs()
    labels = ids.clone()
    return {
        "vocab_stats hidden": (lambda: vocab_stats(_meta(hidden), _meta(weight), _meta(ids)), "hidden"),
        "token_logprobs targets": (lambda: token_logprobs(hidden, weight, _meta(ids)), "targets"),
        "cross_entropy hidden": (lambda: cross_entropy(_meta(hidden), _meta(weight), _meta(ids)), "hidden"),
        "head_loss hidden": (lambda: head_loss(_meta(hidden), _meta(weight), _meta(ids),
                                               {"ce": lambda s: -s.logp.sum()}), "hidden"),
        "policy all meta": (lambda: _policy(_meta(hidden), _meta(weight), _meta(ids), _meta(mask),
                                            advantages=_meta(hidden[:, 0, 0]), old_logp=_meta(hidden[..., 0])),
                            "hidden"),
        "policy advantages": (lambda: _policy(hidden, weight, ids, mask, advantages=_meta(hidden[:, 0, 0])),
                              "advantages"),
        "policy importance_sampling_ratio": (lambda: _policy(hidden, weight, ids, mask,
                                                             importance_sampling_ratio=_meta(hidden[..., 0])),
                                             "importance_sampling_ratio"),
        "policy tool_mask": (lambda: _policy(hidden, weight, ids, mask, tool_mask=_meta(mask)), "tool_mask"),
        "distill hidden": (lambda: _distill(_meta(hidden), _meta(weight), ids, None), "hidden"),
        "distill teacher_hidden": (lambda: _distill(hidden, weight, ids, None, teacher_hidden=_meta(hidden)),
                                   "teacher_hidden"),
        "distill teacher weight": (lambda: _distill(hidden, weight, ids, None, teacher=_meta(weight)), "teacher"),
        "distill mask": (lambda: _distill(hidden, weight, ids, _meta(mask)), "mask"),
        "distill targets": (lambda: _distill(hidden, weight, ids, None, targets=_meta(labels),
                                            config=DistillConfig(ce_weight=0.5)), "targets"),
        "sequence_logps hidden": (lambda: sequence_logps(_meta(hidden), _meta(weight), _meta(ids), _meta(mask)),
                                  "hidden"),
        "sequence_logps completion_mask": (lambda: sequence_logps(hidden, weight, ids, _meta(mask)),
                                           "completion_mask"),
    }


DEVICE_CASES = _device_cases()


@pytest.mark.parametrize("case", list(DEVICE_CASES))
def test_meta_and_foreign_devices_are_named(no_kernel, case):
    """A meta tensor (no data) anywhere, or an input on another device than ``hidden`` (meta
    stands in for another device on the CPU), is a ValueError naming the argument."""
    torch.manual_seed(len(case))
    call, name = DEVICE_CASES[case]
    with pytest.raises(ValueError, match=rf"{name}.*(meta|device)"):
        call()


@pytest.mark.parametrize("name", ["old_logp", "ref_logp", "sampling_logp", "importance_sampling_ratio"])
def test_integer_log_probs_and_ratios_refused(seed, no_kernel, name):
    hidden, weight, ids, mask = _inputs()
    kw = {name: -torch.randint(0, 3, (B, T))}
    if name == "ref_logp":
        kw["config"] = PolicyConfig(beta=0.1)
    with pytest.raises(TypeError, match=name):
        _policy(hidden, weight, ids, mask, **kw)
    with pytest.raises(TypeError, match="advantages"):
        _policy(hidden, weight, ids, mask, advantages=torch.ones(B, dtype=torch.bool))


# ----------------------------------------------------------------- item 10: option types


@pytest.mark.parametrize(("value", "exc"), [(math.inf, ValueError), (math.nan, ValueError), (1.5, ValueError),
                                            (0, ValueError), (-5, ValueError), ("1000", TypeError),
                                            ([1], TypeError), (True, TypeError), (torch.tensor(4096), TypeError)])
def test_chunk_bytes_errors_name_it(value, exc):
    with pytest.raises(exc, match="chunk_bytes"):
        PassOptions(chunk_bytes=value)


def test_chunk_bytes_whole_floats_and_numpy_ints_become_ints():
    for value in (4096.0, np.int64(4096), 4096):
        got = PassOptions(chunk_bytes=value).chunk_bytes
        assert got == 4096 and type(got) is int


@pytest.mark.parametrize("field", ["temperature", "logit_scale", "softcap"])
@pytest.mark.parametrize("value", ["1.0", True, [1.0], torch.tensor([1.0, 2.0])])
def test_transform_scalars_must_be_numbers(field, value):
    with pytest.raises(TypeError, match=field):
        LogitTransform(**{field: value})


@pytest.mark.parametrize("kind", ["numpy64", "numpy32", "tensor", "tensor 1-element"])
def test_numpy_and_tensor_temperatures_are_numbers(seed, kind):
    """A temperature from a config (NumPy) or a schedule (a tensor) is the number it holds: the
    log-probs equal float64 materialized ones at that temperature."""
    t = {"numpy64": np.float64(0.7), "numpy32": np.float32(0.7), "tensor": torch.tensor(0.7, dtype=torch.float64),
         "tensor 1-element": torch.tensor([0.7], dtype=torch.float64)}[kind]
    tf = LogitTransform(temperature=t, softcap=torch.tensor(5.0))
    assert type(tf.temperature) is float and type(tf.softcap) is float
    hidden, weight, ids, _ = _inputs()
    got = vocab_stats(hidden, Head(weight, transform=tf), ids).logp
    z = 5.0 * torch.tanh(hidden @ weight.T / 5.0) / float(t)
    torch.testing.assert_close(got, torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0])


# ----------------------------------------------------------------- item 11: logits beyond the statistics


def _beyond(scale):
    hidden, weight, ids, mask = _inputs()
    return hidden.float() * scale, weight.float(), ids, mask


BEYOND = {
    "policy beta": lambda h, w, i, m: _policy(h, w, i, m, ref_logp=-torch.rand(B, T), config=PolicyConfig(beta=0.04)),
    "cross_entropy z_loss": lambda h, w, i, m: _ce(h, w, i, m, z_loss=1e-4),
    "vocab_stats": lambda h, w, i, m: vocab_stats(h, w, i),
    "distill": lambda h, w, i, m: _distill(h, w, i, m),
}


@pytest.mark.parametrize("entry", list(BEYOND))
def test_logits_beyond_the_statistics_range_are_refused(seed, no_kernel, entry):
    """Finite inputs whose logits reach 1e20 gave NaN (policy, β > 0) or inf (z-loss): a named
    error now, from the inf-norms the NaN checks read (no extra pass, no extra synchronization),
    also when the weight's check is cached from an earlier call."""
    h, w, ids, mask = _beyond(1e19)
    with pytest.raises(ValueError, match="logits may reach"):
        BEYOND[entry](h, w, ids, mask)
    with pytest.raises(ValueError, match="logits may reach"):  # weight known finite now: bound from its cache
        BEYOND[entry](h, w, ids, mask)


def test_large_but_representable_logits_pass_and_a_softcap_bounds_them(seed):
    """Logits of ~1e5 (far above any trained head, far below the bound) pass and match float64;
    a soft-cap bounds the logits whatever the inputs, so huge inputs under it pass too."""
    h, w, ids, _ = _beyond(1e4)
    got = vocab_stats(h, w, ids).logp
    ref = torch.log_softmax(h.double() @ w.double().T, -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-2)
    h, w, ids, _ = _beyond(1e19)
    capped = Head(w, transform=LogitTransform(softcap=30.0))
    got = vocab_stats(h, capped, ids).logp
    z = 30.0 * torch.tanh(h.double() @ w.double().T / 30.0)
    torch.testing.assert_close(got.double(), torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0],
                               rtol=1e-4, atol=1e-4)


def test_writes_through_data_are_not_rechecked(seed):
    """The documented limit of the weight's cached check (docs/reliability.md): a NaN written
    through ``.data`` (no version bump) after a first call reaches the pass and shows as NaN, never
    as a wrong finite number; the same write done in place is seen and named."""
    hidden, weight, ids, _ = _inputs()
    weight = weight.float()
    hidden = hidden.float().reshape(-1, H)
    ids = ids.reshape(-1)
    assert torch.isfinite(token_logprobs(hidden, weight, ids)).all()
    weight.data[:, 2] = math.nan
    assert torch.isnan(token_logprobs(hidden, weight, ids)).all()
    with torch.no_grad():
        weight[:, 2] = math.nan
    with pytest.raises(ValueError, match="weight contains NaN or inf"):
        token_logprobs(hidden, weight, ids)


@pytest.mark.parametrize("case", list(MASKS))
def test_sampling_correction_mask_has_the_policy_rule(seed, case):
    """``sampling_correction``'s mask multiplies the log-ratio as ``policy_loss``'s weights the
    loss: the same rule (an integer -1 used to flip that token's log-ratio)."""
    from logitless import sampling_correction

    old, samp = -torch.rand(B, T), -torch.rand(B, T)
    with pytest.raises(ValueError, match="mask"):
        sampling_correction(old, samp, MASKS[case])
    ratio, _ = sampling_correction(old, samp, torch.ones(B, T, dtype=torch.long), mode="token_truncate")
    torch.testing.assert_close(ratio, torch.exp(old - samp).clamp(max=3.0))


def test_refcache_build_takes_numpy_and_tensor_temperatures():
    """The reference cache's temperature is the head's: NumPy scalars and one-element tensors are
    numbers, strings are not (the error names it)."""
    from logitless.refcache.build import BuildOptions

    assert BuildOptions(temperature=np.float64(0.7)).temperature == 0.7
    assert BuildOptions(temperature=torch.tensor(0.5)).temperature == 0.5
    with pytest.raises(TypeError, match="temperature"):
        BuildOptions(temperature="0.7")
    with pytest.raises(ValueError, match="temperature"):
        BuildOptions(temperature=np.float32("nan"))
