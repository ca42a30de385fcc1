"""LogitlessRLOOTrainer: TRL's own RLOO loss, gradients, metrics and rollout log-probs, float64."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import save_tiny_qwen2, word_tokenizer
from trl_head_oracle import PassCounter, install_plain_head, rel_err, trainer_step

from logitless.integrations.config import LogitlessConfig
from logitless.integrations.trl_rloo import LogitlessRLOOTrainer, patch_rloo_trainer, trl_own_path

V = 64


def _rloo(tmp_path, seed, cls=None, logitless_config=None, peft_config=None, **opts):
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    save_tiny_qwen2(tmp_path / "m", vocab_size=V, seed=seed)
    args = RLOOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, report_to=[], use_cpu=True, bf16=False, max_steps=1, logging_steps=1,
                      **opts)
    extra = {} if logitless_config is None else {"logitless_config": logitless_config}
    if peft_config is not None:
        extra["peft_config"] = peft_config
    return (cls or RLOOTrainer)(**extra, model=str(tmp_path / "m"), args=args,
                                reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                                train_dataset=Dataset.from_dict({"prompt": ["t1 t2", "t3 t4 t5"] * 8}),
                                processing_class=word_tokenizer(V))


def _inputs(seed, b=4, p=3, t=6):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.25).long()
    mask[1, 3:] = 0
    ids = torch.randint(0, V - 3, (b, p + t), generator=g)
    pm = torch.ones(b, p, dtype=torch.long)
    pm[2, 0] = 0  # left-padded prompt
    return dict(prompt_ids=ids[:, :p], prompt_mask=pm, completion_ids=ids[:, p:], completion_mask=mask,
                advantages=torch.randn(b, generator=g, dtype=torch.float64))


def _step(tr, inputs):
    return trainer_step(tr, lambda model: tr._compute_loss(model, inputs))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_grads_metrics_and_logps_match_trl_float64(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    opts = dict(temperature=rng.choice([0.7, 1.0, 1.3]), epsilon=rng.choice([0.1, 0.2]),
                epsilon_high=rng.choice([None, 0.28]), beta=rng.choice([0.0, 0.05]))
    tr = _rloo(tmp_path, seed, **opts)
    for m in (tr.model, tr.ref_model):
        if m is not None:
            m.double()
            install_plain_head(m, temperature=tr.temperature)
    tr = patch_rloo_trainer(tr)
    calls = PassCounter(monkeypatch)
    inputs = _inputs(seed)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    t = inputs["completion_ids"].size(1)
    with torch.no_grad():  # the rollout side: old log-probs
        cur, ent, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, am, t, compute_entropy=True)
        with trl_own_path(tr):
            cur_t, ent_t, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, am, t, compute_entropy=True)
    assert calls.n == 1
    assert rel_err(cur, cur_t) <= 1e-12 and rel_err(ent, ent_t) <= 1e-12
    seq = (cur * inputs["completion_mask"]).sum(1)
    inputs["old_logps"] = seq + 0.2 * torch.randn(seq.shape, generator=torch.Generator().manual_seed(seed),
                                                   dtype=seq.dtype)
    tr.model.train()
    ours = _step(tr, inputs)
    assert calls.n == 2
    with trl_own_path(tr):
        theirs = _step(tr, inputs)
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0]))), opts
    assert rel_err(ours[1], theirs[1]) <= 1e-10, opts
    assert ours[2] == pytest.approx(theirs[2], rel=1e-9, abs=1e-10)


def test_trains_and_falls_back_for_multimodal_inputs(tmp_path):
    tr = _rloo(tmp_path, 4, cls=LogitlessRLOOTrainer, logitless_config=LogitlessConfig(fused_logprobs=True))
    tr.train()
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged and "entropy" in logged[-1]
    ids = torch.randint(0, V - 3, (2, 7), generator=torch.Generator().manual_seed(2))
    # A multimodal input (Qwen2 ignores token_type_ids) sends the call to TRL's head, with one warning.
    with pytest.warns(UserWarning, match=r"fused_logprobs=True cannot be honoured .*token_type_ids"):
        with torch.no_grad():
            a, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, torch.ones_like(ids), 4,
                                                            token_type_ids=torch.zeros_like(ids))
    with torch.no_grad(), trl_own_path(tr):
        b, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, torch.ones_like(ids), 4,
                                                        token_type_ids=torch.zeros_like(ids))
    assert torch.equal(a, b)


def test_peft_config_with_lm_head_is_accepted(tmp_path):
    # TRL's own trainer refuses peft_config with lm_head ("Remove 'lm_head'"); the drop-in takes it,
    # with logitless behind the head (the adapter's term computed; DPO / SFT check the numbers).
    from logitless.model_heads import find_head

    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    tr = _rloo(tmp_path, 3, cls=LogitlessRLOOTrainer, peft_config=cfg)
    assert find_head(tr.model).lora is not None and tr.logitless.fused_logprobs
