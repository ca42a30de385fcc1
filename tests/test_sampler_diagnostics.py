"""Trainer-sampler mismatch metrics: ``policy_loss`` with ``sampling_logp`` and
``sampling_correction``'s clip fraction, against values computed from float64 materialized logits."""

from __future__ import annotations

import math

import pytest
import torch

from logitless import Head, LogitTransform, PolicyConfig, policy_loss, sampling_correction
from logitless.objectives.reference import reference_stats

B, T, H, V = 3, 7, 16, 41


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[0, 0] = 1
    assert (mask == 0).any()  # ragged: padded positions are there to be skipped
    return g, hidden, weight, ids, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_reports_the_trainer_sampler_mismatch(seed):
    g, hidden, weight, ids, mask = _case(seed)
    trainer = reference_stats(hidden, weight, ids, temperature=0.8).logp
    # A sampler whose head is off by up to ~0.1 nats (a bf16 head), with unscored (NaN) tokens.
    sampler = trainer + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampler[1, 2] = math.nan
    _, metrics = policy_loss(hidden, Head(weight, transform=LogitTransform(temperature=0.8)), ids, mask,
                             torch.randn(B, generator=g, dtype=torch.float64), trainer.detach(),
                             sampling_logp=sampler)
    keep = mask.bool() & ~torch.isnan(sampler)
    d = (trainer - sampler)[keep]
    assert metrics["sampling/trainer_sampler_logp_difference/mean"].item() == pytest.approx(d.abs().mean().item(),
                                                                                            rel=1e-12)
    assert metrics["sampling/trainer_sampler_logp_difference/max"].item() == pytest.approx(d.abs().max().item(),
                                                                                           rel=1e-12)
    ratio_err = (d.exp() - 1).abs()
    assert metrics["sampling/trainer_sampler_ratio_error/mean"].item() == pytest.approx(ratio_err.mean().item(),
                                                                                        rel=1e-12)
    assert metrics["sampling/trainer_sampler_ratio_error/max"].item() == pytest.approx(ratio_err.max().item(),
                                                                                       rel=1e-12)


def test_no_mismatch_metrics_without_sampler_logprobs():
    _, hidden, weight, ids, mask = _case(3)
    _, metrics = policy_loss(hidden, weight, ids, mask, torch.randn(B, dtype=torch.float64), config=PolicyConfig())
    assert not any(k.startswith("sampling/") for k in metrics)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampling_correction_reports_the_fraction_beyond_the_clip(mode):
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    samp = old + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.4).to(torch.float64)
    # A ragged mask, with far-off sampler log-probs at the padded positions: counting them (ratio 1
    # after the mask, beyond the clip before it) changes the fraction, which is over counted tokens.
    assert (mask == 0).any() and (mask == 1).any()
    samp = samp.masked_fill(mask == 0, 5.0)
    _, metrics = sampling_correction(old, samp, mask, mode=mode, clip_min=0.5, clip_max=1.5)
    d = (old - samp) * mask
    raw = d.sum(-1).exp() if mode.startswith("sequence") else d.exp()[mask.bool()]
    want = ((raw < 0.5) | (raw > 1.5)).double().mean().item()
    assert 0 < want < 1  # the case does exercise the clip
    assert metrics["sampling/importance_sampling_ratio/beyond_clip_fraction"].item() == pytest.approx(want)
