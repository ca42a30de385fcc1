"""LogitlessSFTTrainer: TRL's own SFT loss, gradients and metrics on a float64 tiny model."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import save_tiny_qwen2, word_tokenizer
from trl_head_oracle import install_plain_head, rel_err, trainer_step

from logitless.integrations.config import LogitlessConfig
from logitless.integrations.trl_sft import LogitlessSFTTrainer, patch_sft_trainer, trl_own_path

V = 64


def _words(rng, n):
    return " ".join(f"t{rng.randrange(V - 3)}" for _ in range(n))


def _sft(tmp_path, seed, cls=None, logitless_config=None, prompt_completion=False, peft_config=None, **opts):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rng = random.Random(seed)
    save_tiny_qwen2(tmp_path / "m", vocab_size=V, seed=seed)
    if prompt_completion:
        rows = [dict(prompt=_words(rng, rng.randint(2, 5)), completion=" " + _words(rng, rng.randint(2, 7)))
                for _ in range(8)]
    else:
        rows = [dict(text=_words(rng, rng.randint(3, 10))) for _ in range(8)]
    extra = {} if logitless_config is None else {"logitless_config": logitless_config}
    if "compute_loss_func" in opts:
        extra["compute_loss_func"] = opts.pop("compute_loss_func")
    if peft_config is not None:
        extra["peft_config"] = peft_config
    args = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     bf16=False, max_steps=1, logging_steps=1, **opts)
    return (cls or SFTTrainer)(**extra, model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=word_tokenizer(V))


def _step(tr, batch, num_items_in_batch):
    loss, grads, metrics = trainer_step(
        tr, lambda model: tr.compute_loss(model, dict(batch), num_items_in_batch=num_items_in_batch))
    return loss, grads, {k: v for k, v in metrics.items() if k != "num_tokens"}


# Seeded draws over what changes SFT's loss: NLL or DFT, label smoothing (NLL only, as in TRL),
# prompt-completion (completion-only loss) or plain text, padding-free packed batches,
# gradient-accumulation normalization by num_items_in_batch.
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_loss_grads_metrics_match_trl_float64(tmp_path, seed):
    rng = random.Random(seed)
    packed = seed in (1, 3)  # BFD packing: padding-free rows with position_ids restarting per sequence
    opts = dict(loss_type=rng.choice(["nll", "dft"]), **(dict(packing=True, max_length=24) if packed else {}))
    if seed in (0, 2, 3):
        opts.update(loss_type="nll", label_smoothing_factor=rng.choice([0.05, 0.1]))
    tr = _sft(tmp_path, seed, prompt_completion=seed % 2 == 0, **opts)
    tr.model.double()
    install_plain_head(tr.model)
    tr = patch_sft_trainer(tr)
    assert tr.logitless.fused_loss, tr.logitless.why_not
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    if packed:
        assert "position_ids" in batch and "attention_mask" not in batch and batch["input_ids"].size(0) == 1
    n = (batch["labels"][:, 1:] != -100).sum() + 3 if seed % 3 == 0 else None
    ours = _step(tr, batch, n)
    with trl_own_path(tr):
        theirs = _step(tr, batch, n)
    # transformers' LabelSmoother sums -log p over the vocabulary in fp32 (dtype=torch.float32) even
    # for a float64 model: its loss value is good to fp32 there; its gradient is exact.
    tol = 1e-7 if opts.get("label_smoothing_factor") else 1e-10
    assert abs(float(ours[0] - theirs[0])) <= tol * max(1.0, abs(float(theirs[0]))), opts
    assert rel_err(ours[1], theirs[1]) <= 1e-10, opts
    assert ours[2] == pytest.approx(theirs[2], rel=1e-9, abs=1e-10)


def test_matches_trls_own_fp32_head(tmp_path):
    tr = _sft(tmp_path, 7, cls=LogitlessSFTTrainer)
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch, None)
    with trl_own_path(tr):
        theirs = _step(tr, batch, None)
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    assert rel_err(ours[1], theirs[1]) <= 1e-4
    assert ours[2] == pytest.approx(theirs[2], rel=1e-5, abs=1e-6)


def test_unsupported_option_falls_back_with_one_warning(tmp_path):
    def loss_on_logits(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().pow(2).mean()

    with pytest.warns(UserWarning, match=r"fused_loss=True cannot be honoured .*compute_loss_func") as rec:
        tr = _sft(tmp_path, 2, cls=LogitlessSFTTrainer, compute_loss_func=loss_on_logits,
                  logitless_config=LogitlessConfig(fused_loss=True))
    assert sum("cannot be honoured" in str(w.message) for w in rec) == 1
    assert not tr.logitless.fused_loss and "compute_loss_func" in tr.logitless.why_not["fused_loss"]
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch, None)
    with trl_own_path(tr):
        theirs = _step(tr, batch, None)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_trains(tmp_path):
    tr = _sft(tmp_path, 5, cls=LogitlessSFTTrainer, label_smoothing_factor=0.1)
    tr.train()
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged and "mean_token_accuracy" in logged[-1] and torch.isfinite(torch.tensor(logged[-1]["loss"]))


def test_peft_config_with_lm_head_matches_the_adapted_head_float64(tmp_path):
    """``peft_config`` with ``lm_head`` (refused by TRL): the fused loss runs the head's adapter
    term; loss, gradients and metrics equal TRL's own SFT loss on the model's own float64 logits."""
    from trl import SFTTrainer

    from logitless.integrations.trl_head import lora_head_admitted

    peft = pytest.importorskip("peft")

    def cfg():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "lm_head"], init_lora_weights=False)

    with lora_head_admitted(SFTTrainer, (), {}):  # the oracle: TRL's trainer on the same PEFT model
        tr = _sft(tmp_path, 5, prompt_completion=True, peft_config=cfg())
    tr.model.double()
    install_plain_head(tr.model.get_base_model())
    tr = patch_sft_trainer(tr)
    assert tr.logitless.fused_loss
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch, None)
    with trl_own_path(tr):
        theirs = _step(tr, batch, None)
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0])))
    assert rel_err(ours[1], theirs[1]) <= 1e-10
    assert ours[2] == pytest.approx(theirs[2], rel=1e-9, abs=1e-10)
    direct = _sft(tmp_path / "ours", 5, cls=LogitlessSFTTrainer, peft_config=cfg())
    assert direct.logitless.fused_loss
