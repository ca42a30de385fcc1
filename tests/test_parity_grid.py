"""Option-space parity with TRL 1.16: every ``GRPOConfig`` configuration TRL trains either
matches TRL's own ``GRPOTrainer._compute_loss`` in float64, or (through
``LogitlessGRPOTrainer``) falls back to TRL's path with one warning; never an exception.

Hypothesis draws the whole option surface TRL's ``_compute_loss`` reads (loss type ×
importance-sampling level × delta × ε/ε_high × beta with and without KL bias correction ×
off-policy mask × entropy quantile incl. 0 and 1 × entropy bonus × sampler correction in all
four modes with NaN sampler log-probs × G × steps_per_generation × eval × temperature ×
per-sequence / per-token / zero advantages × ragged masks incl. empty and one-token rows, T = 1
and all-masked batches), plus the pass's own knobs (mode, chunk size). The draws are
derandomized (the same configurations on every CI run) unless ``LOGITLESS_PARITY_SEED=S`` is
set; ``LOGITLESS_PARITY_EXAMPLES=N`` draws N configurations (default 300, the trainer test a
sixth of that). The number drawn and the worst errors are printed at the end of the module
and written to ``LOGITLESS_PARITY_REPORT`` (JSON) when set.

Two documented differences (docs/policy-objectives.md, "Where logitless differs from TRL"),
where TRL 1.16's numbers depend on padding and logitless's do not; the grid checks logitless
against an independent padding-free oracle there and measures how far TRL's own value is:
(a) T = 1 with a padded position: TRL's metric helpers take the [B, 1] tensors for
    per-sequence ones and average padded positions into ``entropy``, ``kl`` and the token-level
    clip ratios. Oracle: TRL on the batch without its empty rows (no padding left at T = 1).
(b) ``vespo`` with a token-level sampler ratio whose clip range excludes 1: TRL's gamma weight
    sums ``log ρ`` over padded positions too, where ρ is the clip of exp(0) = 1 (log 1e-8 in
    the mask modes). Oracle: TRL with ρ = 1 at the padded positions.
The drop-in trainer falls back to TRL's own path in both cases (one warning).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from trl_oracle import SAMPLER_MISMATCH, TRL_DEFAULTS, TRLOracle, configure_trainer

from logitless import Head, LogitTransform, PassOptions, PolicyConfig, policy_loss, sampling_correction, token_logprobs

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]  # TRL 1.16's
IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# (clip_min, clip_max): TRL's default, two ranges around 1, and two that exclude 1 (padding case b).
IS_CLIPS = [(None, 3.0), (0.5, 2.0), (0.8, 1.25), (1.05, 3.0), (None, 0.95)]
MAX_LEN = 8  # the oracle's max_completion_length (dr_grpo's constant)
P = 3  # prompt length
LOSS_RTOL = 1e-10
METRIC_RTOL = 1e-6  # TRL casts its clip indicators to float32 before the mean
TRL_HEAD_RTOL = 1e-5
CLIP_METRICS = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max", "cispo_clip_ratio"}
CONTROLLER_INPUTS = {"entropy_bonus/entropy_sum", "entropy_bonus/token_count"}  # logitless-only, see test_policy_trl
TRAINER_ONLY_METRICS = {"entropy_coef"}  # TRL's bookkeeping, not a function of the batch

EXAMPLES = int(os.environ.get("LOGITLESS_PARITY_EXAMPLES", "300"))
SEED = os.environ.get("LOGITLESS_PARITY_SEED")
TRAINER_EXAMPLES = max(EXAMPLES // 6, 1)

STATS: dict[str, dict] = {"drawn": defaultdict(int), "worst": defaultdict(float), "trl_padding_deviation":
                          defaultdict(float)}


def _settings(n: int):
    s = settings(max_examples=n, deadline=None, derandomize=SEED is None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

    def wrap(f):
        f = s(f)
        return hypothesis.seed(int(SEED))(f) if SEED is not None else f
    return wrap


@pytest.fixture(scope="module")
def oracle():
    o = TRLOracle()
    yield o
    report = {k: dict(v) for k, v in STATS.items()}
    print("\nparity grid:", json.dumps(report, sort_keys=True))
    path = os.environ.get("LOGITLESS_PARITY_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)


# ----------------------------------------------------------------------------- drawing


@dataclass
class Draw:
    opts: dict  # TRL options (trl_oracle.configure_trainer's names)
    training: bool
    shape: tuple[int, int, list[str]]  # B, T, row kinds
    batch: dict  # how the batch is built
    mode: str  # logitless PassOptions.mode
    chunk_bytes: int | None
    seed: int


@st.composite
def configurations(draw) -> Draw:
    lt = draw(st.sampled_from(LOSS_TYPES))
    # TRL refuses vespo with a sequence-level sampler ratio (GRPOTrainer.__init__), so it never trains it.
    is_mode = draw(st.sampled_from([None, *(m for m in IS_MODES if lt != "vespo" or m.startswith("token"))]))
    quantile = draw(st.sampled_from([1.0, 1.0, 0.0, 0.3]))
    opts = dict(
        loss_type=lt, importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        epsilon=draw(st.sampled_from([0.1, 0.2, 0.3])), epsilon_high=draw(st.sampled_from([None, 0.28, 5.0])),
        delta=draw(st.sampled_from([None, None, 1.5, 0.9])),  # TRL ignores it outside the clipped types
        beta=draw(st.sampled_from([0.0, 0.0, 0.04, 0.5])), use_bias_correction_kl=draw(st.booleans()),
        off_policy_mask_threshold=draw(st.sampled_from([None, None, 0.0, 0.05])), top_entropy_quantile=quantile,
        entropy_coef=draw(st.sampled_from([0.0, 0.0, 0.02])), gradient_accumulation_steps=draw(st.integers(1, 4)),
        steps_per_generation=draw(st.sampled_from([1, 2, 4])), temperature=draw(st.sampled_from([1.0, 0.7, 1.3])),
        use_vllm_is=is_mode is not None, is_mode=is_mode or "sequence_mask", is_clip=draw(st.sampled_from(IS_CLIPS)),
        max_completion_length=MAX_LEN)
    B = draw(st.integers(1, 5))
    # Hypothesis favours the first choices: the common case first, the edge cases (T = 1, empty rows,
    # an all-masked batch) later in each list, so that they come about one draw in five to ten.
    T = draw(st.sampled_from([MAX_LEN, *range(2, MAX_LEN), 1, 1]))
    rows = ["empty"] * B if draw(st.integers(0, 11)) == 7 else draw(
        st.lists(st.sampled_from(["ragged", "full", "one", "empty"]), min_size=B, max_size=B))
    batch = dict(adv=draw(st.sampled_from(["sequence", "token", "zero"])), tool=draw(st.booleans()),
                 sampling=is_mode is not None or draw(st.booleans()), nan_sampler=draw(st.booleans()),
                 noise=draw(st.sampled_from([0.05, 0.3, 1.0])), extra_items=draw(st.sampled_from([0, 0, 17])))
    # fused needs no entropy before the loss; a 2 KiB workspace makes many token chunks and vocabulary blocks
    mode = draw(st.sampled_from(["recompute", "auto"] if quantile < 1 else ["fused", "recompute", "auto"]))
    return Draw(opts, draw(st.booleans()), (B, T, rows), batch, mode, draw(st.sampled_from([None, 2048])),
                draw(st.integers(0, 2**31 - 1)))


@dataclass
class Batch:
    inputs: dict  # TRL's `_compute_loss` inputs
    hidden: torch.Tensor  # [B, T, H] float64
    counted: torch.Tensor  # [B, T] completion_mask * tool_mask


def make_batch(o: TRLOracle, d: Draw) -> Batch:
    g = torch.Generator().manual_seed(d.seed)
    B, T, rows = d.shape
    V = o.vocab_size
    mask = (torch.rand(B, T, generator=g) > 0.4).long()
    for b, kind in enumerate(rows):
        if kind == "empty":
            mask[b] = 0
        elif kind == "one":
            mask[b] = 0
            mask[b, torch.randint(0, T, (), generator=g)] = 1
        elif kind == "full":
            mask[b] = 1
    prompt_ids = torch.randint(0, V - 3, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    completion_ids = torch.randint(0, V - 3, (B, T), generator=g)
    hidden = o.hidden_states(prompt_ids, prompt_mask, completion_ids, mask)
    head = Head(o.model.lm_head.weight.detach(), transform=LogitTransform(temperature=d.opts["temperature"]))
    cur = token_logprobs(hidden, head, completion_ids)

    def noisy(x, s):
        return x + s * torch.randn(x.shape, generator=g, dtype=torch.float64)

    kind = d.batch["adv"]
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if kind == "token" else \
        torch.randn(B, generator=g, dtype=torch.float64) * (kind == "sequence")
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=mask, advantages=adv, old_per_token_logps=noisy(cur, d.batch["noise"]),
                  ref_per_token_logps=noisy(cur, d.batch["noise"]))
    counted = mask
    if d.batch["tool"]:
        inputs["tool_mask"] = (torch.rand(B, T, generator=g) > 0.2).long()
        counted = mask * inputs["tool_mask"]
    inputs["num_items_in_batch"] = counted.sum().double() + d.batch["extra_items"]
    if d.batch["sampling"]:
        samp = noisy(inputs["old_per_token_logps"], 0.2)
        if d.batch["nan_sampler"]:  # tokens the sampler could not score
            samp = samp.masked_fill(torch.rand(B, T, generator=g) < 0.25, float("nan"))
        inputs["sampling_per_token_logps"] = samp
    if d.opts["use_vllm_is"]:  # as TRL's generation step builds it
        ratio, _ = sampling_correction(inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], counted,
                                       mode=d.opts["is_mode"], clip_min=d.opts["is_clip"][0],
                                       clip_max=d.opts["is_clip"][1])
        inputs["importance_sampling_ratio"] = ratio
    return Batch(inputs, hidden, counted)


def policy_config(d: Draw) -> PolicyConfig:
    o = d.opts
    return PolicyConfig(
        loss_type=o["loss_type"], importance_sampling_level=o["importance_sampling_level"], epsilon=o["epsilon"],
        epsilon_high=o["epsilon_high"], delta=o["delta"], beta=o["beta"],
        use_bias_correction_kl=o["use_bias_correction_kl"], off_policy_mask_threshold=o["off_policy_mask_threshold"],
        top_entropy_quantile=o["top_entropy_quantile"], entropy_coef=o["entropy_coef"],
        gradient_accumulation_steps=o["gradient_accumulation_steps"], steps_per_generation=o["steps_per_generation"],
        max_completion_length=MAX_LEN, training=d.training)


# ----------------------------------------------------------------------------- the padding cases


def padding_cases(d: Draw, b: Batch) -> tuple[bool, bool]:
    """``(a, b)``: whether TRL's value depends on padding for this draw (see the module docstring)."""
    padded = bool((b.counted == 0).any())
    lo, hi = d.opts["is_clip"]
    one_clipped = (lo is not None and lo > 1) or (hi is not None and hi < 1)
    case_b = (d.opts["loss_type"] == "vespo" and d.opts["use_vllm_is"] and d.opts["is_mode"].startswith("token")
              and one_clipped and padded)
    return b.counted.shape[1] == 1 and padded, case_b


def padding_affected_metrics(d: Draw, b: Batch) -> set[str]:
    """Metrics TRL averages over padded positions at T = 1: those of [B, T]-shaped tensors
    (the clip ratios are [B, 1] per sequence only at sequence level with per-sequence advantages,
    VESPO's weight only with per-sequence advantages)."""
    per_sequence_adv = b.inputs["advantages"].dim() == 1
    per_sequence_clip = d.opts["importance_sampling_level"] == "sequence" and per_sequence_adv
    # VESPO's weight is [B, 1] with per-sequence advantages, [B, T] with per-token ones.
    return ({"kl", "entropy"} | (set() if per_sequence_clip else CLIP_METRICS)
            | (set() if per_sequence_adv else {"vespo/phi_seq_mean"}))


def padding_free_metrics(o: TRLOracle, d: Draw, b: Batch, names: set[str]) -> dict[str, float]:
    """The padding-independent values of ``names`` at T = 1: TRL's on the rows with a counted
    token (no padding is left), or the empty batch's (0 means, NaN extrema)."""
    keep = b.counted[:, 0].bool()
    if not keep.any():
        return {k: (math.nan if k.endswith(("_min", "_max")) else 0.0) for k in names}
    sub = {k: (v[keep] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == keep.shape[0] else v)
           for k, v in b.inputs.items()}
    *_, metrics, _ = o.run(sub, training=d.training)
    return {k: metrics[k] for k in names if k in metrics}


# ----------------------------------------------------------------------------- comparing


def rel_err(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-8)


def close(a: float, b: float, rtol: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    return abs(a - b) <= rtol * max(abs(b), 1e-3)


def compare(ours: tuple, ref: tuple, ref_metrics: dict, tag: str, rtol: float = LOSS_RTOL) -> None:
    """``ours``/``ref``: ``(loss, grads...)``; ``ref_metrics`` TRL's (or the padding-free) metrics."""
    *tensors, met = ours
    met = {k: v for k, v in met.items() if k not in SAMPLER_MISMATCH}
    for i, (a, b) in enumerate(zip(tensors, ref, strict=True)):
        name = "loss" if i == 0 else f"grad{i}"
        assert torch.isfinite(a).all(), f"{tag} {name} not finite"
        e = rel_err(a, b)
        STATS["worst"][f"{tag}/{name}"] = max(STATS["worst"][f"{tag}/{name}"], e)
        assert e <= rtol, f"{tag} {name}: rel err {e:.3e}"
    extra = CONTROLLER_INPUTS if "policy_loss" in ref_metrics and tag == "policy_loss" else set()
    assert set(met) == set(ref_metrics) | extra, f"{tag} metric names: ours {sorted(met)} TRL {sorted(ref_metrics)}"
    for k, v in ref_metrics.items():
        e = 0.0 if math.isnan(v) else abs(met[k] - v) / max(abs(v), 1e-3)
        STATS["worst"][f"{tag}/metrics"] = max(STATS["worst"][f"{tag}/metrics"], e)
        assert close(met[k], v, max(rtol, METRIC_RTOL)), f"{tag} {k}: ours {met[k]!r} TRL {v!r}"


def trl_reference(o: TRLOracle, d: Draw, b: Batch):
    """TRL's numbers for the draw, padding-free where TRL's depend on padding: ``(loss, grad_hidden,
    grad_weight), metrics``."""
    configure_trainer(o.trainer, **d.opts)
    case_a, case_b = padding_cases(d, b)
    inputs = dict(b.inputs)
    if case_b:
        inputs["importance_sampling_ratio"] = inputs["importance_sampling_ratio"].masked_fill(b.counted == 0, 1.0)
    loss, gh, gw, metrics, h = o.run(inputs, training=d.training)
    torch.testing.assert_close(h, b.hidden, rtol=0, atol=0)  # the same hidden states on both sides
    metrics = {k: v for k, v in metrics.items() if k not in TRAINER_ONLY_METRICS}
    if case_b:
        raw = o.run(b.inputs, training=d.training)[0]
        dev = rel_err(raw, loss)
        STATS["trl_padding_deviation"]["b/vespo_loss"] = max(STATS["trl_padding_deviation"]["b/vespo_loss"], dev)
    if case_a:
        names = padding_affected_metrics(d, b) & set(metrics)
        free = padding_free_metrics(o, d, b, names)
        for k in names:
            if not (math.isnan(free[k]) or math.isnan(metrics[k])):
                key = f"a/{k}"
                STATS["trl_padding_deviation"][key] = max(STATS["trl_padding_deviation"][key],
                                                          abs(metrics[k] - free[k]))
        metrics.update(free)
    return (loss, gh, gw), metrics, (case_a, case_b)


# ----------------------------------------------------------------------------- policy_loss


@_settings(EXAMPLES)
@given(configurations())
def test_policy_loss_matches_trl(oracle, draw):
    b = make_batch(oracle, draw)
    ref, ref_metrics, cases = trl_reference(oracle, draw, b)
    STATS["drawn"]["policy_loss"] += 1
    STATS["drawn"]["policy_loss/padding_a"] += cases[0]
    STATS["drawn"]["policy_loss/padding_b"] += cases[1]
    STATS["drawn"]["policy_loss/all_masked"] += int(b.counted.sum() == 0)
    STATS["drawn"]["policy_loss/T=1"] += int(b.counted.shape[1] == 1)
    inp = b.inputs
    h = b.hidden.clone().requires_grad_(True)
    w = oracle.model.lm_head.weight.detach().clone().requires_grad_(True)
    extra = {}
    if "sampling_per_token_logps" in inp:
        extra["sampling_logp"] = inp["sampling_per_token_logps"]
    if "importance_sampling_ratio" in inp:
        extra["importance_sampling_ratio"] = inp["importance_sampling_ratio"]
    loss, metrics = policy_loss(h, Head(w, transform=LogitTransform(temperature=draw.opts["temperature"])),
                                inp["completion_ids"], inp["completion_mask"], inp["advantages"],
                                inp["old_per_token_logps"], inp["ref_per_token_logps"], config=policy_config(draw),
                                num_items_in_batch=inp["num_items_in_batch"], tool_mask=inp.get("tool_mask"),
                                options=PassOptions(mode=draw.mode, chunk_bytes=draw.chunk_bytes), **extra)
    loss.backward()
    compare((loss.detach(), h.grad, w.grad, {k: v.item() for k, v in metrics.items()}), ref, ref_metrics,
            "policy_loss")


# ----------------------------------------------------------------------------- the drop-in trainer


@pytest.fixture(scope="module")
def trainer(oracle):
    from datasets import Dataset
    from tiny_models import word_tokenizer
    from trl import GRPOConfig

    from logitless.integrations.trl import LogitlessGRPOTrainer

    # bf16=False: no autocast, so the float64 model stays float64 through the head.
    args = GRPOConfig(output_dir=str(oracle.dir / "out-drop-in"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=MAX_LEN, beta=0.0, report_to=[], use_cpu=True, logging_steps=1,
                      bf16=False)
    tr = LogitlessGRPOTrainer(model=str(oracle.dir), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["t1 t2"] * 8}),
                              processing_class=word_tokenizer(oracle.vocab_size))
    tr.model.double()
    return tr


@contextlib.contextmanager
def trl_default_head(o: TRLOracle):
    """The oracle with TRL's own default head (its chunked kernel: fp32 statistics, zero log-prob and
    entropy at padded positions), which the drop-in trainer's T = 1 fallback runs, without
    mixed-precision autocast."""
    tr = o.trainer
    plain = tr.__dict__.pop("_get_per_token_logps_and_entropies")
    autocast = tr.accelerator.autocast
    tr.accelerator.autocast = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        tr._get_per_token_logps_and_entropies = plain
        tr.accelerator.autocast = autocast


def trainer_step(tr, inputs: dict, training: bool):
    """``(loss, every parameter's gradient flattened, metrics)`` of one ``_compute_loss``."""
    tr.model.train(training)
    tr.model.zero_grad(set_to_none=True)
    mode = "train" if training else "eval"
    tr._metrics[mode].clear()
    loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                       for p in tr.model.parameters()])
    return loss.detach(), grads, {k: v[-1] for k, v in tr._metrics[mode].items()}


@_settings(TRAINER_EXAMPLES)
@given(configurations())
def test_drop_in_trainer_matches_trl_or_falls_back(oracle, trainer, draw):
    from logitless.integrations.config import LogitlessConfig
    from logitless.integrations.trl import patch_grpo_trainer

    b = make_batch(oracle, draw)
    configure_trainer(oracle.trainer, **draw.opts)
    t1_padded = b.counted.shape[1] == 1 and bool((b.counted == 0).any())
    # The T = 1 fallback is compared with TRL's fp32 default head; its entropy quantile mask is cut at
    # an fp32 threshold, which a float64 entropy (ours, on this float64 model) can fall just below at
    # quantile 0, masking every token: a float64-model artefact, not a difference in the loss.
    assume(not (t1_padded and draw.opts["top_entropy_quantile"] < 1.0))
    with trl_default_head(oracle) if t1_padded else contextlib.nullcontext():
        t_loss, t_grads, t_met = trainer_step(oracle.trainer, b.inputs, draw.training)
    configure_trainer(trainer, **draw.opts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # fused_loss=True: what cannot be honoured says so (once) and runs TRL's path.
        patch_grpo_trainer(trainer, LogitlessConfig(fused_loss=True, mode=draw.mode, chunk_bytes=draw.chunk_bytes))
        ours = trainer_step(trainer, b.inputs, draw.training)
        ours_again = trainer_step(trainer, b.inputs, draw.training)  # a second step warns no more
    ours_warnings = [str(w.message) for w in caught if str(w.message).startswith("logitless:")]
    fell_back = not trainer.logitless.fused_loss or t1_padded
    STATS["drawn"]["trainer"] += 1
    STATS["drawn"]["trainer/fell_back"] += fell_back
    assert len(ours_warnings) == int(fell_back), ours_warnings
    assert torch.equal(ours[0], ours_again[0])
    # TRL's default head keeps fp32 statistics (float64 model or not): the T = 1 fallback is compared at
    # that precision; elsewhere both sides are float64 end to end.
    rtol = TRL_HEAD_RTOL if t1_padded else LOSS_RTOL
    t_met = {k: v for k, v in t_met.items() if k not in TRAINER_ONLY_METRICS}
    ours_met = {k: v for k, v in ours[2].items() if k not in TRAINER_ONLY_METRICS}
    compare((ours[0], ours[1], ours_met), (t_loss, t_grads), t_met, "trainer", rtol=rtol)


def test_vespo_padding_case_is_drawn_and_padding_free(oracle):
    """Padding case (b) on purpose (the grid draws it rarely): logitless's VESPO loss equals TRL's
    with ρ = 1 at padded positions, is the same for any amount of padding, and TRL's own differs."""
    base = Draw(opts=dict(TRL_DEFAULTS, loss_type="vespo", use_vllm_is=True, is_mode="token_truncate",
                          is_clip=(None, 0.95),
                          max_completion_length=MAX_LEN),
                training=True, shape=(4, 6, ["ragged", "one", "full", "ragged"]),
                batch=dict(adv="sequence", tool=False, sampling=True, nan_sampler=True, noise=0.3, extra_items=0),
                mode="fused", chunk_bytes=None, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    b = make_batch(oracle, base)
    assert padding_cases(base, b) == (False, True)
    ref, ref_metrics, _ = trl_reference(oracle, base, b)
    raw = oracle.run(b.inputs)[0]
    deviation = rel_err(raw, ref[0])
    print(f"vespo padding case: TRL {raw.item():.6g}, padding-free {ref[0].item():.6g} (rel {deviation:.3g})")
    assert deviation > 1e-3  # TRL's own value depends on the padding
    h = b.hidden.clone().requires_grad_(True)
    w = oracle.model.lm_head.weight.detach().clone().requires_grad_(True)
    inp = b.inputs
    loss, metrics = policy_loss(h, w, inp["completion_ids"], inp["completion_mask"], inp["advantages"],
                                inp["old_per_token_logps"], config=policy_config(base),
                                num_items_in_batch=inp["num_items_in_batch"],
                                sampling_logp=inp["sampling_per_token_logps"],
                                importance_sampling_ratio=inp["importance_sampling_ratio"])
    loss.backward()
    compare((loss.detach(), h.grad, w.grad, {k: v.item() for k, v in metrics.items()}), ref, ref_metrics,
            "policy_loss")
    # Two more padded positions per row change nothing in logitless.
    pad = {k: torch.nn.functional.pad(inp[k], (0, 2), value=v) for k, v in
           (("completion_mask", 0), ("old_per_token_logps", 0.0), ("sampling_per_token_logps", 0.0),
            ("importance_sampling_ratio", 0.0))}
    loss2, _ = policy_loss(torch.nn.functional.pad(b.hidden, (0, 0, 0, 2)), w.detach(),
                           torch.nn.functional.pad(inp["completion_ids"], (0, 2)), pad["completion_mask"],
                           inp["advantages"], pad["old_per_token_logps"], config=policy_config(base),
                           num_items_in_batch=inp["num_items_in_batch"], sampling_logp=pad["sampling_per_token_logps"],
                           importance_sampling_ratio=pad["importance_sampling_ratio"])
    assert rel_err(loss2, loss.detach()) < 1e-12
