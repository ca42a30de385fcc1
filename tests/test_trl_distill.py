"""LogitlessGKDTrainer / LogitlessDistillationTrainer: TRL's own distillation loss, gradients and
entropy metric on float64 tiny models (a student and a wider teacher sharing a vocabulary)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from tiny_models import save_tiny_qwen2, word_tokenizer
from trl_head_oracle import flat_grads, rel_err

import logitless.integrations.trl_distill as trl_distill
from logitless.integrations.config import LogitlessConfig
from logitless.integrations.trl_distill import (
    LogitlessDistillationTrainer,
    LogitlessGKDTrainer,
    patch_distillation_trainer,
    patch_gkd_trainer,
    trl_own_path,
)

V = 64
# Random tiny heads give near-uniform softmaxes, whose divergences (~1e-3 nats) would hide errors
# in the pass; scaling both heads' weights spreads the logits over a few nats.
HEAD_GAIN = 8.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_models")
    return (save_tiny_qwen2(root / "student", vocab_size=V, hidden_size=32, seed=11),
            save_tiny_qwen2(root / "teacher", vocab_size=V, hidden_size=48, seed=12))


def _prompt(rng):
    return " ".join(f"t{rng.randrange(V - 3)}" for _ in range(rng.randint(2, 5)))


def _sharpen(*ms, dtype=torch.float64):
    for m in ms:
        m.to(dtype)
        with torch.no_grad():
            m.get_output_embeddings().weight.mul_(HEAD_GAIN)


def _gkd(models, tmp_path, cls=None, logitless_config=None, teacher_cls=None, **opts):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    rows = [dict(messages=[{"role": "user", "content": "t1"}, {"role": "assistant", "content": "t2"}])] * 4
    extra = {} if logitless_config is None else {"logitless_config": logitless_config}
    args = GKDConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     bf16=False, max_steps=1, max_new_tokens=6, **opts)
    teacher = (teacher_cls or AutoModelForCausalLM).from_pretrained(models[1])
    return (cls or GKDTrainer)(**extra, model=str(models[0]), teacher_model=teacher, args=args,
                               train_dataset=Dataset.from_list(rows), processing_class=word_tokenizer(V))


def _gkd_batch(tr, seed, on_policy):
    """A GKD batch: completions sampled by TRL's own ``generate_on_policy_outputs`` at
    ``GKDConfig.temperature`` (what ``lmbda``/``seq_kd`` do), or a padded off-policy batch with
    per-row prompt lengths (what the ChatML collator gives)."""
    g = torch.Generator().manual_seed(seed)
    b, p = 3, 5
    prompts = torch.randint(0, V - 3, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0
    if on_policy:
        torch.manual_seed(seed)
        ids, am, labels = tr.generate_on_policy_outputs(
            tr.model, dict(prompts=prompts, prompt_attention_mask=prompt_mask), tr.generation_config)
        return dict(input_ids=ids, attention_mask=am, labels=labels)
    length = 12
    ids = torch.randint(0, V - 3, (b, length), generator=g)
    am = torch.ones(b, length, dtype=torch.long)
    labels = ids.clone()
    for r in range(b):
        n_prompt, n_real = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(7, length + 1, (1,),
                                                                                             generator=g))
        am[r, n_real:] = 0
        labels[r, :n_prompt] = -100
        labels[r, n_real:] = -100
    return dict(input_ids=ids, attention_mask=am, labels=labels)


def _gkd_step(tr, batch, num_items_in_batch):
    tr.model.zero_grad(set_to_none=True)
    loss = tr.compute_loss(tr.model, dict(batch), num_items_in_batch=num_items_in_batch)
    loss.backward()
    return loss.detach(), flat_grads(tr.model)


# Seeded draws over what changes GKD's loss: beta (the forward / reverse KL end points and the JSD
# between), and what only changes the data: on-policy completions sampled at GKDConfig.temperature
# (TRL's loss itself is at temperature 1) or padded off-policy rows, and num_items_in_batch
# (gradient accumulation) or the batch's own token count.
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gkd_loss_grads_match_trl_float64(models, tmp_path, seed):
    rng = random.Random(seed)
    beta = [0.0, 1.0, 0.5, rng.uniform(0.05, 0.95)][seed]
    tr = _gkd(models, tmp_path, beta=beta, temperature=rng.choice([0.7, 1.0, 1.3]), lmbda=0.5)
    _sharpen(tr.model, tr.teacher_model)
    tr = patch_gkd_trainer(tr)
    assert tr.logitless.fused_loss, tr.logitless.why_not
    tr.model.train()
    batch = _gkd_batch(tr, seed, on_policy=seed % 2 == 0)
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    n = (batch["labels"][:, 1:] != -100).sum() + 2 if seed in (1, 2) else None
    ours = _gkd_step(tr, batch, n)
    with trl_own_path(tr):
        theirs = _gkd_step(tr, batch, n)
    assert float(theirs[0]) > 1e-2  # a divergence the pass must get right, not ~0
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * float(theirs[0]), (beta, n)
    assert rel_err(ours[1], theirs[1]) <= 1e-10, (beta, n)


def _divergence_ref(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                    completion_mask, beta, num_items_in_batch=None, **head):
    """TRL's ``_chunked_divergence_loss`` contract ``(loss, entropy_sum, n_valid)`` in float64 from
    full logits. TRL's ``ChunkedDivergenceFunction`` keeps fp32 statistics (good to ~1e-7 on a
    float64 model); the same divergence in the model's dtype is TRL's own
    ``GKDTrainer.generalized_jsd_loss``, the entropy TRL's ``entropy_from_logits``."""
    from trl.experimental.gkd import GKDTrainer
    from trl.trainer.utils import entropy_from_logits

    def logits(side, h, w):
        z = F.linear(h, w, head.get(f"{side}_lm_head_bias")) * head.get(f"{side}_logit_scale", 1.0)
        cap = head.get(f"{side}_final_logit_softcapping")
        return z if cap is None else cap * torch.tanh(z / cap)

    t = head.get("temperature", 1.0)
    zs, zt = logits("student", student_hidden_states, student_lm_head_weight), logits(
        "teacher", teacher_hidden_states, teacher_lm_head_weight)
    valid = completion_mask != 0
    labels = torch.where(valid, 0, -100)
    div = GKDTrainer.generalized_jsd_loss(zs, zt, labels=labels, beta=beta, temperature=t, reduction="sum")
    n_valid = valid.sum()
    denom = n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return div / denom, entropy_from_logits(zs / t)[valid].sum().detach(), n_valid


def _distill(models, tmp_path, cls=None, logitless_config=None, **opts):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    rng = random.Random(0)
    tok = word_tokenizer(V)
    tok.padding_side = "left"
    extra = {} if logitless_config is None else {"logitless_config": logitless_config}
    args = DistillationConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[],
                              use_cpu=True, bf16=False, max_steps=1, max_completion_length=6, logging_steps=1, **opts)
    return (cls or DistillationTrainer)(**extra, model=str(models[0]), teacher_model=str(models[1]), args=args,
                                        train_dataset=Dataset.from_list([dict(prompt=_prompt(rng)) for _ in range(8)]),
                                        processing_class=tok)


def _distill_step(tr, batch):
    tr.model.zero_grad(set_to_none=True)
    tr._metrics["train"].clear()
    loss = tr.compute_loss(tr.model, dict(batch))
    loss.backward()
    return loss.detach(), flat_grads(tr.model), tr._metrics["train"]["entropy"][-1]


# Seeded draws over what changes DistillationTrainer's loss: beta (0, 1, JSD), temperature (applied
# to both heads), and what only changes the data: completions cut short (EOS), a multi-turn
# tool_mask, and the generated batch's num_items_in_batch or none.
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_distillation_loss_grads_entropy_match_float64(models, tmp_path, monkeypatch, seed):
    from trl.trainer import distillation_trainer

    monkeypatch.setattr(distillation_trainer, "_chunked_divergence_loss", _divergence_ref)
    rng = random.Random(seed)
    beta = [0.0, 1.0, 0.5, rng.uniform(0.05, 0.95)][seed]
    tr = _distill(models, tmp_path, beta=beta, temperature=rng.choice([0.6, 1.0, 1.4]), seed=seed)
    _sharpen(tr.model, tr.teacher_model)
    tr = patch_distillation_trainer(tr)
    assert tr.logitless.fused_loss, tr.logitless.why_not
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    g = torch.Generator().manual_seed(seed)
    mask = batch["completion_mask"].clone()
    for r in range(mask.size(0)):
        mask[r, int(torch.randint(1, mask.size(1) + 1, (1,), generator=g)):] = 0
    batch["completion_mask"] = mask
    if seed % 2:
        batch["tool_mask"] = (torch.rand(mask.shape, generator=g) > 0.3).long()
    if seed in (0, 3):
        del batch["num_items_in_batch"]
    ours = _distill_step(tr, batch)
    with trl_own_path(tr):
        theirs = _distill_step(tr, batch)
    assert float(theirs[0]) > 1e-2
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * float(theirs[0]), beta
    assert rel_err(ours[1], theirs[1]) <= 1e-10, beta
    assert ours[2] == pytest.approx(theirs[2], rel=1e-9)


def test_distillation_matches_trls_own_kernel_and_trains(models, tmp_path, monkeypatch):
    tr = _distill(models, tmp_path, cls=LogitlessDistillationTrainer, beta=0.3, temperature=0.9)
    _sharpen(tr.model, tr.teacher_model, dtype=torch.float32)
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _distill_step(tr, batch)
    with trl_own_path(tr):
        theirs = _distill_step(tr, batch)
    # TRL's ChunkedDivergenceFunction (fp32 statistics) against logitless on a float32 model.
    assert abs(float(ours[0] - theirs[0])) <= 1e-5 * float(theirs[0])
    assert rel_err(ours[1], theirs[1]) <= 1e-4
    assert ours[2] == pytest.approx(theirs[2], rel=1e-5)

    calls = []
    inner = trl_distill.distill_loss
    monkeypatch.setattr(trl_distill, "distill_loss", lambda *a, **k: calls.append(1) or inner(*a, **k))
    tr.train()
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert calls and logged and torch.isfinite(torch.tensor([logged[-1]["loss"], logged[-1]["entropy"]])).all()


def test_gkd_unverified_teacher_falls_back_with_one_warning(models, tmp_path):
    from transformers import Qwen2ForCausalLM

    class CustomTeacher(Qwen2ForCausalLM):
        """A model class logitless has not verified (as a trust_remote_code class would be): its
        forward may change the logits after the head."""

    with pytest.warns(UserWarning, match=r"fused_loss=True cannot be honoured .*CustomTeacher") as rec:
        tr = _gkd(models, tmp_path, cls=LogitlessGKDTrainer, teacher_cls=CustomTeacher, beta=0.5,
                  logitless_config=LogitlessConfig(fused_loss=True))
    assert sum("cannot be honoured" in str(w.message) for w in rec) == 1
    assert not tr.logitless.fused_loss and "CustomTeacher" in tr.logitless.why_not["fused_loss"]
    tr.model.train()
    batch = _gkd_batch(tr, 5, on_policy=False)
    ours = _gkd_step(tr, batch, None)
    with trl_own_path(tr):
        theirs = _gkd_step(tr, batch, None)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_import_does_not_import_trl_experimental():
    """TRL warns (TRLExperimentalWarning) at the first import of ``trl.experimental``; the module's
    own code must not import it (only ``LogitlessGKDTrainer``, on first use, does). Its source is
    run into a fresh module object, every import it makes recorded."""
    import builtins
    import types
    from pathlib import Path

    seen = []
    real = builtins.__import__

    def recording(name, globals=None, locals=None, fromlist=(), level=0):
        seen.append(name if level == 0 else "." * level + name)
        return real(name, globals, locals, fromlist, level)

    mod = types.ModuleType("logitless.integrations._trl_distill_copy")
    mod.__package__ = "logitless.integrations"
    mod.__builtins__ = {**vars(builtins), "__import__": recording}
    exec(compile(Path(trl_distill.__file__).read_text(), trl_distill.__file__, "exec"), mod.__dict__)
    assert seen and not [n for n in seen if n.startswith("trl.experimental")], seen
    gkd = mod.LogitlessGKDTrainer  # built on first use
    from trl.experimental.gkd import GKDTrainer

    assert "trl.experimental.gkd" in seen and issubclass(gkd, GKDTrainer) and gkd.__name__ == "LogitlessGKDTrainer"
