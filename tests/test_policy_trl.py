"""`logitless.policy_loss` against TRL 1.16's own `GRPOTrainer._compute_loss`.

The oracle is TRL's code on a tiny float64 Qwen2 (tests/trl_oracle.py): the loss, the
gradients w.r.t. the completion hidden states and `lm_head.weight`, and every metric TRL
logs. `logitless` gets the hidden states TRL's head consumed and the head weight.

Tolerances: float64 loss and gradients agree to rel 1e-10 (both sides are fp64 end to end);
metrics to rel 1e-6, because TRL casts its clip indicators to float32 before the mean.
Old / reference / sampler log-probs are the current policy's plus noise (std 0.3), so ratios
fall on both sides of the clip boundaries (asserted in `test_clip_branches_are_exercised`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import types
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trl_oracle import SAMPLER_MISMATCH, TRLOracle

from logitless import Head, LogitTransform, PassOptions, PolicyConfig, policy_loss, token_logprobs

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
CLIPPED = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]
MAX_LEN = 8  # the oracle's max_completion_length (dr_grpo's constant); T <= MAX_LEN
LOSS_RTOL = 1e-10
METRIC_RTOL = 1e-6
# TRL logs `entropy_coef` (and `policy_loss`, which logitless returns too) only with an entropy
# bonus; the coefficient is the trainer's bookkeeping (a config value), not a function of the batch.
TRAINER_ONLY_METRICS = {"entropy_coef"}

# Largest relative error seen per loss type and quantity (reported with LOGITLESS_PARITY_REPORT=path).
WORST: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))


@pytest.fixture(scope="module")
def oracle():
    o = TRLOracle()
    yield o
    path = os.environ.get("LOGITLESS_PARITY_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({k: dict(v) for k, v in WORST.items()}, f, indent=1, sort_keys=True)




# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    inputs: dict  # TRL's `_compute_loss` inputs
    hidden: torch.Tensor  # [B, T, H] float64, what TRL's head consumes at the completion positions
    mask: torch.Tensor  # [B, T] completion_mask * tool_mask
    extra: dict = field(default_factory=dict)  # logitless-only keyword arguments


def is_ratio(old, samp, mask, mode: str, lo: float | None, hi: float | None) -> torch.Tensor:
    """The sampler correction exactly as TRL's `_generate_and_score_completions` builds it."""
    d = torch.nan_to_num((old - samp) * mask, nan=0.0)
    r = torch.exp(d.sum(-1, keepdim=True) if mode.startswith("sequence") else d)
    if mode.endswith("truncate"):
        return torch.clamp(r, min=lo, max=hi)
    lo_, hi_ = -math.inf if lo is None else lo, math.inf if hi is None else hi
    return r.masked_fill((r < lo_) | (r > hi_), 0.0)


def make_case(o: TRLOracle, *, B=4, T=7, P=3, mask=None, adv_per_token=False, noise=0.3, tool=False,
              sampling=False, is_mode=None, is_clip=(None, 3.0), num_items=None, empty_rows=(),
              one_token_rows=()) -> Case:
    V = o.vocab_size
    prompt_ids = torch.randint(0, V - 3, (B, P))
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    completion_ids = torch.randint(0, V - 3, (B, T))
    if mask is None:
        mask = (torch.rand(B, T) > 0.25).long()
        mask[:, 0] = 1
    for b in empty_rows:
        mask[b] = 0
    for b in one_token_rows:
        mask[b] = 0
        mask[b, 0] = 1
    hidden = o.hidden_states(prompt_ids, prompt_mask, completion_ids, mask)
    weight = o.model.lm_head.weight.detach()
    cur = token_logprobs(hidden, Head(weight, transform=LogitTransform(temperature=o.trainer.temperature)),
                         completion_ids)
    adv = torch.randn(B, T, dtype=torch.float64) if adv_per_token else torch.randn(B, dtype=torch.float64)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=mask, advantages=adv,
                  old_per_token_logps=cur + noise * torch.randn(B, T, dtype=torch.float64),
                  ref_per_token_logps=cur + noise * torch.randn(B, T, dtype=torch.float64))
    full_mask = mask
    if tool:
        inputs["tool_mask"] = (torch.rand(B, T) > 0.2).long()
        full_mask = mask * inputs["tool_mask"]
    inputs["num_items_in_batch"] = full_mask.sum().double() if num_items is None else torch.tensor(float(num_items))
    extra = {}
    if sampling or is_mode is not None:
        samp = inputs["old_per_token_logps"] + 0.2 * torch.randn(B, T, dtype=torch.float64)
        inputs["sampling_per_token_logps"] = samp
        extra["sampling_logp"] = samp
    if is_mode is not None:
        r = is_ratio(inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], full_mask, is_mode, *is_clip)
        inputs["importance_sampling_ratio"] = r
        extra["importance_sampling_ratio"] = r
    return Case(inputs=inputs, hidden=hidden, mask=mask, extra=extra)


# ----------------------------------------------------------------------------- running both sides


def trl_config_kwargs(cfg: PolicyConfig, use_vllm_is: bool) -> dict:
    return dict(loss_type=cfg.loss_type, importance_sampling_level=cfg.importance_sampling_level,
                epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, delta=cfg.delta, beta=cfg.beta,
                use_bias_correction_kl=cfg.use_bias_correction_kl, top_entropy_quantile=cfg.top_entropy_quantile,
                off_policy_mask_threshold=cfg.off_policy_mask_threshold, entropy_coef=cfg.entropy_coef,
                sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
                vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
                vespo_lambda_neg=cfg.vespo_lambda_neg, max_completion_length=cfg.max_completion_length or MAX_LEN,
                steps_per_generation=cfg.steps_per_generation or cfg.gradient_accumulation_steps,
                gradient_accumulation_steps=cfg.gradient_accumulation_steps, use_vllm_is=use_vllm_is)


def run_trl(o: TRLOracle, case: Case, cfg: PolicyConfig):
    o.configure(**trl_config_kwargs(cfg, "importance_sampling_ratio" in case.inputs))
    loss, gh, gw, metrics, h = o.run(case.inputs, training=cfg.training)
    # The captured hidden states are TRL's own: the case's copy was taken by the same model.
    torch.testing.assert_close(h, case.hidden, rtol=0, atol=0)
    return loss, gh, gw, {k: v for k, v in metrics.items() if k not in TRAINER_ONLY_METRICS}


def run_ours(o: TRLOracle, case: Case, cfg: PolicyConfig, mode: str, *, pass_num_items=True, chunk_bytes=None):
    h = case.hidden.clone().requires_grad_(True)
    w = o.model.lm_head.weight.detach().clone().requires_grad_(True)
    inp = case.inputs
    loss, metrics = policy_loss(h, Head(w, transform=LogitTransform(temperature=o.trainer.temperature)),
                                inp["completion_ids"], inp["completion_mask"], inp["advantages"],
                                inp["old_per_token_logps"], inp["ref_per_token_logps"] if cfg.beta != 0.0 else None,
                                config=cfg, num_items_in_batch=inp["num_items_in_batch"] if pass_num_items else None,
                                tool_mask=inp.get("tool_mask"), **case.extra,
                                options=PassOptions(mode=mode, chunk_bytes=chunk_bytes))
    loss.backward()
    return loss.detach(), h.grad, w.grad, {k: v.item() for k, v in metrics.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = max(b.abs().max().item(), 1e-8)
    return (a - b).abs().max().item() / scale


CONTROLLER_INPUTS = ("entropy_bonus/entropy_sum", "entropy_bonus/token_count")



def assert_matches(ours, ref, loss_type: str) -> None:
    loss, gh, gw, met = ours
    tloss, tgh, tgw, tmet = ref
    worst = WORST[loss_type]
    for name, a, b in (("loss", loss, tloss), ("grad_hidden", gh, tgh), ("grad_weight", gw, tgw)):
        assert torch.isfinite(a).all()
        e = rel_err(a, b)
        worst[name] = max(worst[name], e)
        assert e <= LOSS_RTOL, f"{name}: rel err {e:.3e} (ours {a.flatten()[:4]}, TRL {b.flatten()[:4]})"
    # With an entropy bonus we also report the adaptive controller's inputs, which TRL keeps in
    # trainer state rather than logs (checked against it in test_adaptive_entropy_controller_inputs_are_trls).
    extra = set(CONTROLLER_INPUTS) if "policy_loss" in tmet else set()
    ours = set(met) - set(SAMPLER_MISMATCH)
    assert ours == set(tmet) | extra, f"metric names differ: ours {sorted(met)} TRL {sorted(tmet)}"
    for k, v in tmet.items():
        if math.isnan(v):
            assert math.isnan(met[k]), f"{k}: TRL NaN, ours {met[k]}"
            continue
        e = abs(met[k] - v) / max(abs(v), 1e-3)
        worst["metrics"] = max(worst["metrics"], e)
        assert abs(met[k] - v) <= METRIC_RTOL * max(abs(v), 1e-3), f"{k}: ours {met[k]!r} TRL {v!r}"


def check(o, case, cfg, modes=("fused", "recompute"), **kw):
    ref = run_trl(o, case, cfg)
    for mode in modes:
        assert_matches(run_ours(o, case, cfg, mode, **kw), ref, cfg.loss_type)
    return ref


# ----------------------------------------------------------------------------- the grid


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_type_grid(oracle, seed, loss_type, level, beta):
    # Both modes against one TRL evaluation; padded rows and a ragged mask in every case.
    case = make_case(oracle, one_token_rows=(2,))
    cfg = PolicyConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, max_completion_length=MAX_LEN)
    check(oracle, case, cfg)


def test_clip_branches_are_exercised(oracle, seed):
    """The noise on old log-probs puts ratios outside [1-ε, 1+ε_high] on both sides, so the
    clipped branch of `min(c1·A, c2·A)` decides some tokens' gradients."""
    seen_low = seen_high = 0.0
    for loss_type in CLIPPED:
        case = make_case(oracle, B=6, T=8)
        cfg = PolicyConfig(loss_type=loss_type, max_completion_length=MAX_LEN)
        _, _, _, met = check(oracle, case, cfg)
        seen_low += met["clip_ratio/low_mean"]
        seen_high += met["clip_ratio/high_mean"]
    assert seen_low > 0 and seen_high > 0
    case = make_case(oracle, B=6, T=8)
    cfg = PolicyConfig(loss_type="cispo", epsilon_high=1.1, max_completion_length=MAX_LEN)
    _, _, _, met = check(oracle, case, cfg)
    assert 0 < met["cispo_clip_ratio"] < 1


@pytest.mark.parametrize("loss_type", ["grpo", "luspo"])  # one metric code path for every clipped type
def test_sequence_level_clip_ratios_with_epsilon_high(oracle, seed, loss_type):
    """Sequence level with ε_high ≠ ε: the old log-probs put each sequence's ratio in a band that
    only the right bound classifies (0.75 and 1.25 lie between 1 - ε_high and 1 - ε, and between
    1 + ε and 1 + ε_high), for both signs of the advantage."""
    case = make_case(oracle, B=6, T=7)
    cfg = PolicyConfig(loss_type=loss_type, importance_sampling_level="sequence", epsilon=0.2, epsilon_high=0.28,
                       max_completion_length=MAX_LEN)
    ratio = torch.tensor([0.75, 0.75, 1.25, 1.25, 0.6, 1.4], dtype=torch.float64)
    case.inputs["advantages"] = torch.tensor([-1.0, 0.5, 1.0, -0.5, -0.8, 0.7], dtype=torch.float64)
    cur = token_logprobs(case.hidden, Head(oracle.model.lm_head.weight.detach(),
                                           transform=LogitTransform(temperature=oracle.trainer.temperature)),
                         case.inputs["completion_ids"])
    case.inputs["old_per_token_logps"] = cur - ratio.log()[:, None]  # exp(mean(logp - old)) = ratio
    _, _, _, met = check(oracle, case, cfg)
    # low: 0.75 and 0.6 with A < 0; high: 1.4 with A > 0 (TRL's float32 means)
    assert met["clip_ratio/low_mean"] == pytest.approx(2 / 6, abs=1e-6)
    assert met["clip_ratio/high_mean"] == pytest.approx(1 / 6, abs=1e-6)


def test_default_config_is_trl_default(oracle, seed):
    # PolicyConfig() is TRL's GRPOConfig defaults: dapo, token level, ε = 0.2, β = 0.
    case = make_case(oracle, T=MAX_LEN)
    ref = run_trl(oracle, case, PolicyConfig())
    assert_matches(run_ours(oracle, case, PolicyConfig(), "auto"), ref, "dapo")


# ----------------------------------------------------------------------------- options

OPTIONS = {
    "epsilon_high": dict(cfg=dict(epsilon_high=0.28, epsilon=0.15)),
    "delta": dict(cfg=dict(delta=1.2), types=CLIPPED),
    "no_kl_bias_correction": dict(cfg=dict(beta=0.04, use_bias_correction_kl=False)),
    "grad_accumulation": dict(cfg=dict(gradient_accumulation_steps=4, steps_per_generation=2, beta=0.04)),
    "num_items_in_batch": dict(case=dict(num_items=41)),
    "entropy_coef": dict(cfg=dict(entropy_coef=0.05, gradient_accumulation_steps=2)),
    "off_policy_mask": dict(cfg=dict(off_policy_mask_threshold=0.05), case=dict(sampling=True)),
    "off_policy_mask_old_fallback": dict(cfg=dict(off_policy_mask_threshold=0.02)),
    "per_token_advantages": dict(cfg=dict(beta=0.04), case=dict(adv_per_token=True)),
    "per_token_advantages_sequence": dict(cfg=dict(importance_sampling_level="sequence"),
                                          case=dict(adv_per_token=True)),
    "tool_mask": dict(cfg=dict(beta=0.04), case=dict(tool=True)),
    "empty_and_short_rows": dict(cfg=dict(beta=0.04), case=dict(empty_rows=(1,), one_token_rows=(3,))),
    "empty_and_short_rows_sequence": dict(cfg=dict(importance_sampling_level="sequence"),
                                          case=dict(empty_rows=(0,), one_token_rows=(2,))),
    "is_token_truncate": dict(case=dict(is_mode="token_truncate", is_clip=(0.5, 1.3))),
    "is_token_mask": dict(case=dict(is_mode="token_mask", is_clip=(0.8, 1.25))),
    "is_sequence_truncate": dict(case=dict(is_mode="sequence_truncate", is_clip=(None, 1.5)),
                                 types=[t for t in LOSS_TYPES if t != "vespo"]),
    "is_sequence_mask": dict(case=dict(is_mode="sequence_mask", is_clip=(0.5, 2.0)),
                             types=[t for t in LOSS_TYPES if t != "vespo"]),
    "everything": dict(cfg=dict(beta=0.04, epsilon_high=0.3, entropy_coef=0.01, off_policy_mask_threshold=0.05,
                                gradient_accumulation_steps=2),
                       case=dict(tool=True, adv_per_token=True, is_mode="token_truncate", empty_rows=(2,))),
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_option(oracle, seed, option, loss_type):
    spec = OPTIONS[option]
    if loss_type not in spec.get("types", LOSS_TYPES):
        # TRL ignores these options for this loss type (delta) or refuses them (vespo with a
        # sequence-level sampler ratio); logitless refuses both: checked in test_validation.py.
        return
    case = make_case(oracle, **spec.get("case", {}))
    cfg = PolicyConfig(loss_type=loss_type, max_completion_length=MAX_LEN, **spec.get("cfg", {}))
    check(oracle, case, cfg)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_complete_mask(oracle, seed, loss_type):
    """Every position counted: the rows are views of the caller's tensors, not gathered copies;
    the numbers and gradients are TRL's all the same."""
    case = make_case(oracle, B=3, T=6, mask=torch.ones(3, 6, dtype=torch.long))
    cfg = PolicyConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01, max_completion_length=MAX_LEN)
    check(oracle, case, cfg)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_eval_mode(oracle, seed, loss_type):
    # Evaluation divides by neither G nor steps_per_generation; G = 4 here would show it.
    case = make_case(oracle, num_items=29)
    cfg = PolicyConfig(loss_type=loss_type, training=False, gradient_accumulation_steps=4, steps_per_generation=2,
                       beta=0.04, entropy_coef=0.02, max_completion_length=MAX_LEN)
    check(oracle, case, cfg)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_num_items_default_is_local_token_count(oracle, seed, loss_type):
    case = make_case(oracle)  # TRL gets num_items_in_batch = this batch's mask sum
    cfg = PolicyConfig(loss_type=loss_type, max_completion_length=MAX_LEN)
    check(oracle, case, cfg, pass_num_items=False)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_top_entropy_quantile(oracle, seed, loss_type):
    # Needs every token's entropy before the loss: recompute only, and auto picks it.
    case = make_case(oracle, B=5, T=8, one_token_rows=(4,))
    cfg = PolicyConfig(loss_type=loss_type, top_entropy_quantile=0.4, entropy_coef=0.03, beta=0.04,
                       max_completion_length=MAX_LEN)
    check(oracle, case, cfg, modes=("recompute", "auto"))
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        run_ours(oracle, case, cfg, "fused")


def _trl_entropy_mask(entropy, mask, quantile):
    """TRL's own ``GRPOTrainer.get_high_entropy_mask`` on one process (gathers are identities)."""
    from trl import GRPOTrainer

    accelerator = types.SimpleNamespace(pad_across_processes=lambda x, **_: x, gather=lambda x: x)
    return GRPOTrainer.get_high_entropy_mask(types.SimpleNamespace(accelerator=accelerator), entropy, mask,
                                             1 - quantile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["max", "middle"])
def test_top_entropy_quantile_keeps_ties_at_the_threshold(seed, dtype, where):
    """Low-precision entropies tie: the threshold is itself one of the (fp32) entropies, and rows
    2, 3 duplicate rows 0, 1, so tokens tie with each other there. TRL keeps every token with
    entropy >= the threshold: its own mask, applied to our entropies, gives the tokens the loss
    counts. On-policy (old = current log-probs, ratio 1, no clipping) the dapo loss is then
    -Σ kept A / Σ counted."""
    b, t, h, v = 4, 6, 16, 41
    hidden = torch.randn(b // 2, t, h).repeat(2, 1, 1).to(dtype)
    weight = torch.randn(v, h).to(dtype)
    ids = torch.randint(0, v, (b // 2, t)).repeat(2, 1)
    mask = (torch.rand(b // 2, t) > 0.25).long().repeat(2, 1)
    mask[:, 0] = 1
    adv = torch.randn(b)
    logp, entropy = token_logprobs(hidden, weight, ids, entropy=True)
    n = int(mask.sum())
    # "max": quantile 0 keeps only the largest entropy (a tie with itself and its copy); "middle":
    # the threshold's rank falls between the two copies of one entropy.
    quantile = 0.0 if where == "max" else 1 - (2 * (n // 4) + 0.5) / (n - 1)
    threshold = torch.quantile(entropy[mask.bool()].float(), 1 - quantile)
    assert (entropy[mask.bool()] == threshold).sum() >= 2  # the case has ties at the threshold
    kept = _trl_entropy_mask(entropy, mask, quantile)
    cfg = PolicyConfig(loss_type="dapo", top_entropy_quantile=quantile)
    loss, _ = policy_loss(hidden, weight, ids, mask, adv, logp, config=cfg)
    want = -(adv[:, None] * kept).sum() / mask.sum()
    torch.testing.assert_close(loss.float(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch(oracle, seed, loss_type):
    """TRL: loss 0 (the entropy bonus too), zero gradients that still flow, metrics 0 / NaN."""
    case = make_case(oracle, T=6, mask=torch.zeros(4, 6, dtype=torch.long))
    cfg = PolicyConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01, max_completion_length=MAX_LEN)
    _, tgh, tgw, _ = check(oracle, case, cfg)
    assert (tgh == 0).all() and (tgw == 0).all()


# ----------------------------------------------------------------------------- TRL's real default head


def test_against_trl_default_fused_head(oracle, seed, monkeypatch):
    """TRL's own default head (`fused_lm_head=True`: its chunked log-prob/entropy kernel with
    fp32 statistics), not the oracle's float64 plain path. The oracle's trainer has TRL's
    default `bf16=True`, which on CPU autocasts the head matmul to bf16 (5e-4 log-prob error);
    without mixed precision (`bf16=False`: no autocast) the head's error is its fp32
    statistics', so the comparison is at fp32 tolerance."""
    trainer = oracle.trainer
    monkeypatch.delitem(trainer.__dict__, "_get_per_token_logps_and_entropies")  # the class's method again
    monkeypatch.setattr(trainer.accelerator, "autocast", lambda *a, **k: contextlib.nullcontext())
    assert trainer._get_per_token_logps_and_entropies.__func__ is type(trainer)._get_per_token_logps_and_entropies
    for loss_type in ("grpo", "dapo", "cispo", "vespo"):
        case = make_case(oracle, one_token_rows=(1,))
        cfg = PolicyConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01, max_completion_length=MAX_LEN)
        tloss, tgh, tgw, tmet = run_trl(oracle, case, cfg)
        for mode in ("fused", "recompute"):
            loss, gh, gw, met = run_ours(oracle, case, cfg, mode)
            for name, a, b in (("loss", loss, tloss), ("grad_hidden", gh, tgh), ("grad_weight", gw, tgw)):
                e = rel_err(a, b)
                WORST["trl_default_head"][name] = max(WORST["trl_default_head"][name], e)
                assert e < 1e-5, (loss_type, mode, name, e)
            assert set(met) == set(tmet) | (set(CONTROLLER_INPUTS) if "policy_loss" in tmet else set())
            for k, v in tmet.items():
                assert met[k] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), k


# ----------------------------------------------------------------------------- packed layout


def to_packed(case: Case):
    """Drop the padding: `[N, H]` hidden states of every row's counted tokens, concatenated,
    with segment ids (rows without tokens keep their id by contributing one masked token)."""
    mask = case.mask if "tool_mask" not in case.inputs else case.mask * case.inputs["tool_mask"]
    keep = mask.bool().clone()
    for b in range(mask.shape[0]):
        if not keep[b].any():
            keep[b, 0] = True  # an empty segment is still a segment (it counts in grpo's mean)
    seg = torch.arange(mask.shape[0])[:, None].expand_as(mask)[keep]
    return keep, seg


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_packed_equals_padded(oracle, seed, loss_type):
    """`segment_ids` packing gives the padded layout's loss, gradients and metrics."""
    case = make_case(oracle, B=5, T=8, empty_rows=(1,), one_token_rows=(3,), is_mode="token_truncate")
    keep, seg = to_packed(case)
    inp = case.inputs
    for level in ("token", "sequence"):
        cfg = PolicyConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01,
                           off_policy_mask_threshold=0.05, max_completion_length=MAX_LEN)
        for mode in ("fused", "recompute"):
            padded = run_ours(oracle, case, cfg, mode)
            h = case.hidden[keep].clone().requires_grad_(True)
            w = oracle.model.lm_head.weight.detach().clone().requires_grad_(True)
            loss, met = policy_loss(h, Head(w, transform=LogitTransform(temperature=oracle.trainer.temperature)),
                                    inp["completion_ids"][keep], case.mask[keep], inp["advantages"],
                                    inp["old_per_token_logps"][keep], inp["ref_per_token_logps"][keep], config=cfg,
                                    num_items_in_batch=inp["num_items_in_batch"], segment_ids=seg,
                                    sampling_logp=case.extra["sampling_logp"][keep],
                                    importance_sampling_ratio=case.extra["importance_sampling_ratio"][keep],
                                    options=PassOptions(mode=mode, chunk_bytes=4096))
            loss.backward()
            assert rel_err(loss, padded[0]) < 1e-12
            assert rel_err(h.grad, padded[1][keep]) < 1e-12
            assert (padded[1][~keep] == 0).all()
            assert rel_err(w.grad, padded[2]) < 1e-12
            assert met.keys() == padded[3].keys()
            for k, v in met.items():
                assert v.item() == pytest.approx(padded[3][k], rel=1e-12, abs=1e-15, nan_ok=True), k


# ----------------------------------------------------------------------------- property test


@st.composite
def scenarios(draw):
    loss_type = draw(st.sampled_from(LOSS_TYPES))
    level = draw(st.sampled_from(["token", "sequence"]))
    B = draw(st.integers(1, 5))
    # T >= 2: at T == 1 TRL's metric helpers take a [B, T] tensor for a per-sequence [B, 1] one and
    # average over padding too (`x.shape[1] == 1`); logitless keeps the masked means. Length-1
    # sequences are drawn through the masks ("one" rows).
    T = draw(st.integers(2, MAX_LEN))
    rows = draw(st.lists(st.sampled_from(["empty", "one", "ragged", "full"]), min_size=B, max_size=B))
    is_modes = [None, "token_truncate", "token_mask"] + ([] if loss_type == "vespo" else
                                                         ["sequence_truncate", "sequence_mask"])
    cfg = dict(
        loss_type=loss_type, importance_sampling_level=level,
        epsilon=draw(st.sampled_from([0.1, 0.2])),
        epsilon_high=draw(st.sampled_from([None, 0.28, 4.0] if loss_type == "cispo" else [None, 0.28])),
        delta=draw(st.sampled_from([None, 1.3])) if loss_type in CLIPPED else None,
        beta=draw(st.sampled_from([0.0, 0.04])),
        use_bias_correction_kl=draw(st.booleans()),
        off_policy_mask_threshold=draw(st.sampled_from([None, 0.05])),
        top_entropy_quantile=draw(st.sampled_from([1.0, 1.0, 0.5])),
        entropy_coef=draw(st.sampled_from([0.0, 0.02])),
        gradient_accumulation_steps=draw(st.integers(1, 3)),
        training=draw(st.booleans()),
        max_completion_length=MAX_LEN,
    )
    case = dict(adv_per_token=draw(st.booleans()), tool=draw(st.booleans()), is_mode=draw(st.sampled_from(is_modes)),
                sampling=draw(st.booleans()), noise=draw(st.sampled_from([0.05, 0.3, 1.0])),
                num_items=draw(st.sampled_from([None, 50])))
    chunk_bytes = draw(st.sampled_from([None, 2048]))  # 2 KiB: many token chunks and vocabulary blocks
    seed = draw(st.integers(0, 2**31 - 1))
    return cfg, case, (B, T, rows), chunk_bytes, seed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(scenarios())
def test_property_random_options(oracle, scenario):
    cfg_kw, case_kw, (B, T, rows), chunk_bytes, seed = scenario
    torch.manual_seed(seed)
    mask = (torch.rand(B, T) > 0.4).long()
    for b, kind in enumerate(rows):
        if kind == "empty":
            mask[b] = 0
        elif kind == "one":
            mask[b] = 0
            mask[b, torch.randint(0, T, ())] = 1
        elif kind == "full":
            mask[b] = 1
    case = make_case(oracle, B=B, T=T, mask=mask, **case_kw)
    cfg = PolicyConfig(**cfg_kw)
    modes = ("recompute", "auto") if cfg.top_entropy_quantile < 1 else ("fused", "recompute")
    check(oracle, case, cfg, modes=modes, chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampling_correction_is_trls(mode):
    """`logitless.sampling_correction` builds the ratio exactly as TRL's generation step does."""
    from logitless import sampling_correction

    g = torch.Generator().manual_seed(hash(mode) % 2**31)
    old = torch.randn(5, 9, generator=g, dtype=torch.float64) - 3
    samp = old + 0.4 * torch.randn(5, 9, generator=g, dtype=torch.float64)
    samp[0, 2] = float("nan")  # a token the sampler could not score
    mask = (torch.rand(5, 9, generator=g) > 0.3).to(torch.float64)
    ratio, metrics = sampling_correction(old, samp, mask, mode=mode, clip_min=0.5, clip_max=2.0)
    want = is_ratio(old, samp, mask, mode, 0.5, 2.0)
    assert ratio.shape == want.shape and torch.equal(ratio, want)
    keep = mask.bool()
    delta = (old - samp).abs()[keep & ~torch.isnan(samp)]
    assert metrics["sampling/sampling_logp_difference/max"] == delta.max()
    flat = want.flatten() if mode.startswith("sequence") else want[keep]
    assert metrics["sampling/importance_sampling_ratio/min"] == flat.min()
    assert torch.allclose(metrics["sampling/importance_sampling_ratio/mean"], flat.mean())


@pytest.mark.parametrize("quantile", [1.0, 0.6])
def test_adaptive_entropy_controller_inputs_are_trls(oracle, seed, quantile):
    """`entropy_bonus/entropy_sum` / `token_count` are what TRL's adaptive entropy controller
    accumulates (Σ H·m' and Σ m' over the bonus's tokens): their ratio is its window entropy."""
    torch.manual_seed(seed)
    case = make_case(oracle)
    cfg = PolicyConfig(loss_type="grpo", entropy_coef=0.01, top_entropy_quantile=quantile,
                       max_completion_length=MAX_LEN)
    run_trl(oracle, case, cfg)  # configures the oracle for cfg; then rerun with the controller on
    tr = oracle.trainer
    tr.use_adaptive_entropy, tr._entropy_window_stats, tr._last_world_entropy = True, None, 0.0
    object.__setattr__(tr.args, "entropy_target", 1.0)
    object.__setattr__(tr.args, "entropy_coef_delta", 0.0)
    try:
        oracle.run(case.inputs, training=True)
        world_entropy = tr._last_world_entropy  # Σ H·m' / Σ m' of this (single-step) window
    finally:
        tr.use_adaptive_entropy = False
    *_, metrics = run_ours(oracle, case, cfg, "recompute")
    ours = metrics["entropy_bonus/entropy_sum"] / metrics["entropy_bonus/token_count"]
    assert ours == pytest.approx(world_entropy, rel=1e-6)
    counted = float(case.mask.sum())
    if quantile == 1.0:
        assert metrics["entropy_bonus/token_count"] == counted
    else:  # the entropy mask keeps only the top tokens for the bonus
        assert 0 < metrics["entropy_bonus/token_count"] < counted
