"""GRPO batches as training makes them: advantages from group rewards.

A GRPO step samples ``G`` completions per prompt and scores them; TRL's advantages are
``(r - mean_group(r)) / (std_group(r) + 1e-4)`` (``scale_rewards="group"``), so every completion
of a group whose rewards are all equal has an advantage of exactly 0. With ``beta = 0`` (TRL's
default) and no entropy bonus those completions carry no gradient, nor do tokens on the clipped
side of the PPO minimum. These batches measure what skipping such rows saves
(``PassOptions.skip_zero_rows``) against the dense floor.

A *group objective* ``grpo-c<percent>[-kl]`` is the GRPO objective on the case's tokens laid out
as ``B = N / GROUP_SEQ_LEN`` completions in groups of :data:`GROUP_SIZE`, with that percentage
of the groups reward-constant (binary rewards, the others mixed), old log-probs from a perturbed
policy (log-ratio noise of :data:`OLD_LOGP_NOISE` nats, so that some tokens clip), and
``beta = 0`` (``-kl``: ``beta = 0.04``).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..objectives import PolicyConfig
from .cases import Inputs

GROUP_SIZE = 8  # completions per prompt (TRL's num_generations default)
GROUP_SEQ_LEN = 128  # tokens per completion in these batches: 8 groups at N = 8k
OLD_LOGP_NOISE = 0.15  # nats: |log ratio| > log 1.2 for about a quarter of the tokens
KL_BETA = 0.04
GROUP_OBJECTIVES = ("grpo-c0", "grpo-c25", "grpo-c50", "grpo-c0-kl", "grpo-c25-kl")
_NAME = re.compile(r"grpo-c(\d+)(-kl)?")


def is_group_objective(objective: str) -> bool:
    return _NAME.fullmatch(objective) is not None


def group_config(objective: str) -> PolicyConfig:
    """The :class:`PolicyConfig` of a group objective (TRL's ``dapo`` loss, ``epsilon_high`` 0.28)."""
    beta = KL_BETA if _parse(objective)[1] else 0.0
    return PolicyConfig(loss_type="dapo", beta=beta, epsilon_high=0.28)


def _parse(objective: str) -> tuple[int, bool]:
    m = _NAME.fullmatch(objective)
    if m is None or not 0 <= int(m.group(1)) <= 100:
        raise ValueError(f"not a group objective: {objective!r} (grpo-c<0..100>[-kl])")
    return int(m.group(1)), m.group(2) is not None


@torch.no_grad()
def group_inputs(x: Inputs, objective: str, seed: int = 0) -> Inputs:
    """The case's inputs as a GRPO batch of ``objective`` (module docstring): the same token
    rows, reshaped to ``[B, GROUP_SEQ_LEN]`` (``hidden`` a new leaf over the same storage), with
    group-reward advantages ``[B]`` and perturbed old log-probs.

    Raises:
        ValueError: the case's tokens do not make at least one group of :data:`GROUP_SIZE`
            completions.
    """
    percent, _ = _parse(objective)
    n, h = x.targets.numel(), x.hidden.shape[-1]
    t = min(GROUP_SEQ_LEN, max(1, n // GROUP_SIZE))
    b = n // t
    groups = b // GROUP_SIZE
    if groups == 0 or n % t:
        raise ValueError(f"{n} tokens do not make a group of {GROUP_SIZE} completions of {t} tokens")
    device = x.hidden.device
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rewards = (torch.rand(groups, GROUP_SIZE, generator=gen, device=device) < 0.5).float()
    mixed = rewards.amin(1) != rewards.amax(1)
    rewards[~mixed, 0] = 1.0 - rewards[~mixed, 0]  # every group mixed first ...
    n_constant = round(percent / 100 * groups)
    constant = torch.randperm(groups, generator=gen, device=device)[:n_constant]
    rewards[constant] = rewards[constant, :1]  # ... then the chosen ones all equal
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    noise = OLD_LOGP_NOISE * torch.randn(n, generator=gen, device=device)
    old = (x.old_logp.reshape(-1) + noise).clamp(max=0.0)
    return dataclasses.replace(
        x, hidden=x.hidden.detach().reshape(b, t, h).requires_grad_(True), targets=x.targets.reshape(b, t),
        mask=x.mask.reshape(b, t), advantages=advantages.reshape(b), old_logp=old.reshape(b, t),
        ref_logp=x.ref_logp.reshape(b, t))


def zero_row_fraction(x: Inputs) -> float:
    """The fraction of the batch's tokens whose advantage is exactly 0."""
    zero = (x.advantages == 0).float()[:, None] * x.mask
    return float(zero.sum() / x.mask.sum())
