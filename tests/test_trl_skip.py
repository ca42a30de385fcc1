"""``LogitlessConfig(skip_zero_advantage=True)``: the GRPO drop-in runs only the completions that
carry a gradient, and its loss and every parameter's gradient are TRL's own step on the whole
micro-batch (TRL 1.16's ``GRPOTrainer._compute_loss`` with a float64 full-logits head,
``tests/trl_head_oracle.py``), to 1e-10."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import save_tiny_qwen2, word_tokenizer
from trl_head_oracle import install_plain_head
from trl_oracle import configure_trainer

from logitless.integrations.config import LogitlessConfig
from logitless.integrations.trl import patch_grpo_trainer, trl_own_path

V, P = 64, 3
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max", "cispo_clip_ratio")


def _grpo(path, reward=None, config=None, **opts):
    """TRL's own ``GRPOTrainer`` on a float64 tiny Qwen2 with the full-logits head."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    save_tiny_qwen2(path / "m", vocab_size=V, seed=1)
    args = dict(output_dir=str(path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=8, report_to=[], use_cpu=True, bf16=False, logging_steps=1, max_steps=1)
    tr = GRPOTrainer(model=str(path / "m"), args=GRPOConfig(**{**args, **opts}),
                     reward_funcs=reward or (lambda completions, **k: [float(len(c)) for c in completions]),
                     train_dataset=Dataset.from_dict({"prompt": ["t1 t2", "t3 t4 t5"] * 8}),
                     processing_class=word_tokenizer(V))
    tr.model.double()
    install_plain_head(tr.model, temperature=tr.temperature)
    return tr if config is None else patch_grpo_trainer(tr, config)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return _grpo(tmp_path_factory.mktemp("skip"), config=LogitlessConfig(skip_zero_advantage=True))


def _batch(tr, seed: int, zero_rows, b=6, t=7, per_token_adv=False, tool=False):
    """A TRL micro-batch: right-padded completions of random lengths (one empty, one full),
    left-padded prompts, off-policy old and sampler log-probs (so ratios cross the clip range),
    advantages with ``zero_rows`` exactly 0 (per token: 0 at every counted token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 3, (b, P + t), generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0], lengths[-1] = t, 0
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    pm = torch.ones(b, P, dtype=torch.long)
    pm[1, 0] = 0
    adv = torch.randn(b, t, generator=g, dtype=torch.float64) if per_token_adv else \
        torch.randn(b, generator=g, dtype=torch.float64)
    adv[list(zero_rows)] = 0.0
    inputs = dict(prompt_ids=ids[:, :P], prompt_mask=pm, completion_ids=ids[:, P:], completion_mask=mask,
                  advantages=adv, num_items_in_batch=3.0 * mask.sum().double())
    if tool:
        inputs["tool_mask"] = (torch.rand(b, t, generator=g) > 0.2).long()
    with torch.no_grad():
        cur, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, torch.cat([pm, mask], 1), t)
    noise = lambda s: s * torch.randn(b, t, generator=g, dtype=torch.float64)  # noqa: E731
    inputs["old_per_token_logps"] = cur + noise(0.3)
    inputs["sampling_per_token_logps"] = cur + noise(0.3)
    d = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * mask
    inputs["importance_sampling_ratio"] = torch.exp(d).clamp(max=1.5)  # TRL's token_truncate correction
    return inputs


def _step(tr, inputs, trl_own=False):
    """Loss, every parameter's gradient, the train metrics logged, and the rows that ran."""
    ran = []
    tr.model.train()
    tr.model.zero_grad(set_to_none=True)
    tr._metrics["train"].clear()
    fused = tr._fused_loss

    def counted(model, sub):
        ran.append(sub["completion_ids"].shape)
        return fused(model, sub)

    tr._fused_loss = counted
    try:
        if trl_own:
            with trl_own_path(tr):
                loss = tr._compute_loss(tr.model, inputs)
        else:
            loss = tr._compute_loss(tr.model, inputs)
    finally:
        del tr._fused_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {k: v[-1] for k, v in tr._metrics["train"].items()}, ran


def _assert_same_step(ours, theirs):
    scale = max(1.0, abs(float(theirs[0])))
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * scale, (float(ours[0]), float(theirs[0]))
    assert set(ours[1]) == set(theirs[1])
    g_max = max(float(g.abs().max()) for g in theirs[1].values())
    for name, g in theirs[1].items():
        assert float((ours[1][name] - g).abs().max()) <= 1e-10 * max(g_max, 1.0), name


def _entropy_of_rows(tr, inputs, rows):
    """TRL's ``entropy`` metric over ``rows`` only: what the drop-in logs with the switch on."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)[rows]
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)[rows]
    t = inputs["completion_ids"].shape[1]
    with torch.no_grad(), trl_own_path(tr):
        _, ent, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, am, t, compute_entropy=True)
    m = inputs["completion_mask"][rows] if "tool_mask" not in inputs else \
        (inputs["completion_mask"] * inputs["tool_mask"])[rows]
    return float((ent * m).sum() / m.sum().clamp(min=1))


# Every TRL 1.16 loss type; both importance-sampling levels; the off-policy mask, the sampler's
# importance-sampling correction, delta; per-token advantages and tool masks; gradient
# accumulation G and steps_per_generation (which enter TRL's normalizers).
CASES = [
    dict(loss_type="grpo", gradient_accumulation_steps=2),
    dict(loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=4),
    dict(loss_type="dr_grpo", gradient_accumulation_steps=3),
    dict(loss_type="bnpo", gradient_accumulation_steps=2, delta=1.3),
    dict(loss_type="grpo", importance_sampling_level="sequence", gradient_accumulation_steps=2),
    dict(loss_type="dapo", importance_sampling_level="sequence", off_policy_mask_threshold=0.05,
         steps_per_generation=2),
    dict(loss_type="cispo", epsilon_high=1.2, use_vllm_is=True, is_mode="token_truncate"),
    dict(loss_type="sapo", use_vllm_is=True, is_mode="token_truncate", gradient_accumulation_steps=2),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="vespo", use_vllm_is=True, is_mode="token_truncate", steps_per_generation=2),
    dict(loss_type="grpo", epsilon_high=0.28, off_policy_mask_threshold=0.05, use_vllm_is=True,
         is_mode="token_truncate", delta=1.4),
]


# Two rows removed for every case; only row 1 left (the full-length row 0 removed, so columns are cut)
# for one case per normalizer kind.
GRID = [(o, (1, 3)) for o in CASES] + [(CASES[i], (0, 2, 3, 4)) for i in (0, 3, 5, 9)]


@pytest.mark.parametrize(("opts", "zero_rows"), GRID,
                         ids=lambda x: "-".join(f"{v}" for v in x.values()) if isinstance(x, dict) else
                         f"zero{''.join(map(str, x))}")
def test_step_equals_trls_on_the_whole_micro_batch(trainer, opts, zero_rows, seed):
    configure_trainer(trainer, max_completion_length=8, **opts)
    per_token = opts["loss_type"] == "bnpo"
    inputs = _batch(trainer, seed, zero_rows, per_token_adv=per_token, tool=opts["loss_type"] == "dr_grpo")
    ours = _step(trainer, inputs)
    theirs = _step(trainer, inputs, trl_own=True)
    _assert_same_step(ours, theirs)
    # Ran: the rows with a nonzero advantage and a counted token (the last row has none), and the
    # completion columns up to the longest of them.
    counted = inputs["completion_mask"] * inputs.get("tool_mask", 1)
    rows = [i for i in range(6) if i not in zero_rows and counted[i].sum() > 0]
    assert 0 < len(rows) < 5
    assert ours[3] == [torch.Size([len(rows), int(inputs["completion_mask"][rows].sum(1).max())])]
    # Metrics: TRL's clip ratios are restored to the whole micro-batch; entropy is over the rows that ran.
    assert set(ours[2]) - {k for k in ours[2] if k.startswith("sampling/")} == set(theirs[2])
    for k in set(CLIP_METRICS) & set(theirs[2]):
        assert ours[2][k] == pytest.approx(theirs[2][k], rel=1e-6, abs=1e-12, nan_ok=True), k
    assert ours[2]["entropy"] == pytest.approx(_entropy_of_rows(trainer, inputs, rows), rel=1e-9)


@pytest.mark.parametrize("opts", [dict(loss_type="grpo"), dict(loss_type="bnpo"),
                                  dict(loss_type="dapo", importance_sampling_level="sequence")],
                         ids=["grpo", "bnpo", "gspo-dapo"])
def test_micro_batch_without_gradient_runs_one_row_times_zero(trainer, opts, seed):
    configure_trainer(trainer, max_completion_length=8, gradient_accumulation_steps=2, **opts)
    inputs = _batch(trainer, seed, zero_rows=range(5))  # row 5 has no counted token
    ours = _step(trainer, inputs)
    theirs = _step(trainer, inputs, trl_own=True)
    _assert_same_step(ours, theirs)
    assert float(ours[0]) == 0.0 and all(float(g.abs().max()) == 0.0 for g in ours[1].values())
    # One row ran (the one with the fewest counted tokens, at least one), so every parameter got
    # its (zero) gradient through a forward and backward: a DDP / FSDP rank joins the reduction.
    lengths = inputs["completion_mask"].sum(1)
    shortest = int(lengths[lengths > 0].min())
    assert ours[3] == [torch.Size([1, shortest])]
    for k in set(CLIP_METRICS) & set(theirs[2]):
        assert ours[2][k] == pytest.approx(theirs[2][k], rel=1e-6, abs=1e-12, nan_ok=True), k


@pytest.mark.parametrize(("opts", "reason"), [
    (dict(beta=0.04), "beta=0.04"), (dict(entropy_coef=0.01), "entropy bonus"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5")])
def test_options_that_give_every_row_a_gradient_run_every_row(trainer, opts, reason, seed):
    trainer.logitless._warned.clear()
    configure_trainer(trainer, max_completion_length=8, **opts)
    inputs = _batch(trainer, seed, zero_rows=(1, 2))
    inputs["ref_per_token_logps"] = inputs["old_per_token_logps"] - 0.1
    with pytest.warns(UserWarning, match=rf"skip_zero_advantage=True cannot be honoured \(.*{reason}"):
        ours = _step(trainer, inputs)
    theirs = _step(trainer, inputs, trl_own=True)
    assert ours[3] == [inputs["completion_ids"].shape]  # every row ran
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0])))


def test_off_by_default_and_refused_without_fused_loss(tmp_path):
    assert LogitlessConfig().skip_zero_advantage is False
    with pytest.raises(TypeError, match="skip_zero_advantage must be True or False"):
        LogitlessConfig(skip_zero_advantage=1)
    with pytest.warns(UserWarning, match=r"skip_zero_advantage=True cannot be honoured \(needs fused_loss"):
        _grpo(tmp_path, config=LogitlessConfig(fused_loss=False, skip_zero_advantage=True))


def _train_and_record(tr):
    """``tr.train()`` recording every micro-batch's loss and the gradients at each optimizer step."""
    from transformers import TrainerCallback

    losses, grads = [], []

    class AtOptimizerStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            grads.append({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})

    step = tr.training_step

    def recorded(*a, **k):
        out = step(*a, **k)
        losses.append(out.clone())
        return out

    tr.training_step = recorded
    tr.add_callback(AtOptimizerStep())
    tr.train()
    return losses, grads


def test_training_with_accumulation_equals_trls(tmp_path):
    """Trainer.train(): generation of 4 groups, steps_per_generation=4 micro-batches (shuffled
    rows), 2 accumulated per optimizer step, 2 optimizer steps (the second off-policy); the reward
    is constant for the prompt "t3 t4 t5", so half the completions carry no gradient and some
    micro-batches none at all. Both trainers draw the same completions (same seed)."""

    def reward(prompts, completions, **k):
        return [1.0 if "t3" in p else float(len(c)) for p, c in zip(prompts, completions, strict=True)]

    # grpo: its normalizer (rows of the micro-batch, G) is the one the removal changes.
    opts = dict(loss_type="grpo", gradient_accumulation_steps=2, steps_per_generation=4, max_steps=2,
                optim="sgd", learning_rate=0.5, max_grad_norm=0.0, seed=3, temperature=1.3)
    theirs = _train_and_record(_grpo(tmp_path / "trl", reward=reward, **opts))
    tr = _grpo(tmp_path / "ours", reward=reward, config=LogitlessConfig(skip_zero_advantage=True), **opts)
    ran = []
    fused = tr._fused_loss
    tr._fused_loss = lambda model, sub: ran.append(sub["completion_ids"].shape[0]) or fused(model, sub)
    ours = _train_and_record(tr)
    assert len(ours[0]) == len(theirs[0]) == 4 and len(ours[1]) == len(theirs[1]) == 2
    assert 1 in ran and max(ran) < 4, ran  # some micro-batch had no row with gradient (one ran), none ran all
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert abs(float(a - b)) <= 1e-10 * max(1.0, abs(float(b)))
    for mine, trl in zip(ours[1], theirs[1], strict=True):
        g_max = max(float(g.abs().max()) for g in trl.values())
        assert g_max > 0 and set(mine) == set(trl)
        for name, g in trl.items():
            assert float((mine[name] - g).abs().max()) <= 1e-10 * g_max, name
    assert not math.isnan(float(sum(ours[0])))
