"""LogitlessCPOTrainer: TRL's own CPO / SimPO / AlphaPO loss, gradients and metrics on a float64
tiny model.

TRL's ``CPOTrainer`` materializes the model's logits (float64 here), so its own trainer is the
oracle as it is: no head replacement needed.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import save_tiny_qwen2, word_tokenizer
from trl_head_oracle import flat_grads, rel_err

from logitless.integrations.config import LogitlessConfig
from logitless.integrations.trl_cpo import LogitlessCPOTrainer, patch_cpo_trainer, trl_own_path

V = 64


def _words(rng, n):
    return " ".join(f"t{rng.randrange(V - 3)}" for _ in range(n))


def _cpo(tmp_path, seed, cls=None, peft_config=None, logitless_config=None, **opts):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    rng = random.Random(seed)
    save_tiny_qwen2(tmp_path / "m", vocab_size=V, seed=seed)
    rows = [dict(prompt=_words(rng, rng.randint(2, 5)), chosen=" " + _words(rng, rng.randint(1, 6)),
                 rejected=" " + _words(rng, rng.randint(1, 6))) for _ in range(8)]
    args = CPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     bf16=False, max_steps=1, logging_steps=1, max_length=64, **opts)
    extra = {} if peft_config is None else {"peft_config": peft_config}
    if logitless_config is not None:
        extra["logitless_config"] = logitless_config
    return (cls or CPOTrainer)(**extra, model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=word_tokenizer(V))


def _step(tr, batch):
    tr.model.zero_grad(set_to_none=True)
    loss, metrics = tr.get_batch_loss_metrics(tr.model, batch)
    loss.backward()
    return loss.detach(), flat_grads(tr.model), metrics


# Seeded draws over the CPO options that change the loss: loss type (the sequence score is the sum,
# or the per-token mean for ipo / simpo), beta, label smoothing, the NLL weight, SimPO's margin and
# AlphaPO's reward transform.
def _options(seed):
    rng = random.Random(seed)
    loss_type = ["sigmoid", "simpo", "ipo", "hinge", "simpo", "sigmoid"][seed]
    opts = dict(loss_type=loss_type, beta=rng.choice([0.1, 0.5, 2.0]), cpo_alpha=rng.choice([0.0, 1.0, 0.3]))
    if loss_type in ("sigmoid", "simpo") and rng.random() < 0.5:
        opts["label_smoothing"] = 0.1
    if loss_type == "simpo":
        opts["simpo_gamma"] = rng.choice([0.5, 1.0])
    if seed == 5:
        opts["alpha"] = 0.25
    return opts


@pytest.mark.parametrize("seed", range(6))
def test_loss_grads_metrics_match_trl_float64(tmp_path, seed):
    opts = _options(seed)
    tr = _cpo(tmp_path, seed, **opts)
    tr.model.double()
    tr = patch_cpo_trainer(tr)
    assert tr.logitless.fused_loss, tr.logitless.why_not
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0]))), opts
    assert rel_err(ours[1], theirs[1]) <= 1e-10, opts
    assert set(ours[2]) == set(theirs[2])
    for k, v in theirs[2].items():
        assert ours[2][k] == pytest.approx(v, rel=1e-9, abs=1e-10), (k, opts)


def test_lora_head_matches_trl_float64(tmp_path):
    """A LoRA adapter on ``lm_head`` (CPO's own trainer takes it, on materialized logits): the
    adapter's term in the pass and in the ``logits/*`` sums, equal to TRL's float64 logits."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False,
                          lora_dropout=0.0)
    tr = _cpo(tmp_path, 7, peft_config=cfg, loss_type="simpo", beta=2.0, cpo_alpha=0.0)
    tr.model.double()
    tr = patch_cpo_trainer(tr)
    assert tr.logitless.fused_loss, tr.logitless.why_not
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0])))
    assert rel_err(ours[1], theirs[1]) <= 1e-10
    for k, v in theirs[2].items():
        assert ours[2][k] == pytest.approx(v, rel=1e-9, abs=1e-10), k


def test_trains_and_logs(tmp_path):
    tr = _cpo(tmp_path, 3, cls=LogitlessCPOTrainer, loss_type="simpo", cpo_alpha=0.0)
    assert tr.logitless.fused_loss
    tr.train()
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged and torch.isfinite(torch.tensor(logged[-1]["loss"])) and "rewards/margins" in logged[-1]
    assert logged[-1]["logitless/active"] == 1.0


def test_off_on_purpose_runs_trls_code_without_a_warning(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tr = _cpo(tmp_path, 2, cls=LogitlessCPOTrainer, logitless_config=LogitlessConfig(fused_loss=False))
    assert not tr.logitless.active


def test_soft_capped_head_runs_trls_code_and_says_why(tmp_path):
    # TRL's logits/* averages every soft-capped logit: not a matrix-vector product, so TRL's own code runs.
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, max_position_embeddings=256, final_logit_softcapping=5.0,
                       pad_token_id=V - 3, eos_token_id=V - 2, bos_token_id=None)
    path = tmp_path / "gemma"
    Gemma2ForCausalLM(cfg).save_pretrained(path)
    word_tokenizer(V).save_pretrained(path)
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig

    rows = [dict(prompt="t1 t2", chosen=" t3 t4", rejected=" t5") for _ in range(4)]
    args = CPOConfig(output_dir=str(tmp_path / "out2"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     bf16=False, max_steps=1, max_length=32)
    with pytest.warns(UserWarning, match="soft-capped"):
        tr = LogitlessCPOTrainer(model=str(path), args=args, train_dataset=Dataset.from_list(rows),
                                 processing_class=word_tokenizer(V))
    assert not tr.logitless.fused_loss and "soft-capped" in tr.logitless.why_not["fused_loss"]
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
