"""The bench's GRPO batches with group-reward advantages (logitless.bench.batches)."""

from __future__ import annotations

import pytest
import torch

from logitless.bench.batches import GROUP_SIZE, group_config, group_inputs, is_group_objective, zero_row_fraction
from logitless.bench.cases import make_inputs, parse_shape


@pytest.mark.parametrize(("objective", "percent"), [("grpo-c0", 0), ("grpo-c25", 25), ("grpo-c50-kl", 50)])
def test_group_batches(objective, percent):
    x = make_inputs(parse_shape("4096:tiny-a"), torch.device("cpu"), torch.float32, seed=3)
    g = group_inputs(x, objective, seed=3)
    b = g.advantages.shape[0]
    groups = g.advantages.view(-1, GROUP_SIZE)
    assert b * g.hidden.shape[1] == x.targets.numel() and g.hidden.is_leaf and g.hidden.requires_grad
    assert g.hidden.data_ptr() == x.hidden.data_ptr()  # a view of the case's tokens, no copy
    constant = (groups == 0).all(1)
    # TRL's group advantages: zero mean per group; exactly 0 where the rewards are equal.
    torch.testing.assert_close(groups.sum(1), torch.zeros(len(groups)), atol=1e-4, rtol=0)
    assert int(constant.sum()) == round(percent / 100 * len(groups))
    assert (groups[~constant] != 0).all()
    assert zero_row_fraction(g) == pytest.approx(percent / 100)
    # Perturbed old log-probs: some tokens lie beyond the clip range.
    log_ratio = (x.old_logp.reshape(-1) - g.old_logp.reshape(-1)).abs()
    assert 0.05 < float((log_ratio > 0.2).float().mean()) < 0.5
    assert group_config(objective).beta == (0.04 if objective.endswith("-kl") else 0.0)


def test_group_objective_names():
    assert is_group_objective("grpo-c38") and is_group_objective("grpo-c0-kl")
    assert not is_group_objective("grpo") and not is_group_objective("grpo-c25-k")
    with pytest.raises(ValueError, match="group objective"):
        group_config("grpo-c101")
