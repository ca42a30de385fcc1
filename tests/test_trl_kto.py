"""LogitlessKTOTrainer: TRL's own KTO loss, gradients and metrics on a float64 tiny model."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import save_tiny_qwen2, word_tokenizer
from trl_head_oracle import PassCounter, install_plain_head, rel_err, trainer_step

from logitless.integrations.trl_kto import LogitlessKTOTrainer, patch_kto_trainer, reference_records, trl_own_path

V = 64


def _words(rng, n):
    return " ".join(f"t{rng.randrange(V - 3)}" for _ in range(n))


def _kto(tmp_path, seed, cls=None, peft_config=None, labels=lambda i: bool(i % 2), **opts):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    rng = random.Random(seed)
    save_tiny_qwen2(tmp_path / "m", vocab_size=V, seed=seed)
    rows = [dict(prompt=_words(rng, rng.randint(2, 5)), completion=" " + _words(rng, rng.randint(1, 6)),
                 label=labels(i)) for i in range(8)]
    args = KTOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     bf16=False, max_steps=1, logging_steps=1, **opts)
    extra = {} if peft_config is None else {"peft_config": peft_config}
    return (cls or KTOTrainer)(**extra, model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=word_tokenizer(V))


def _step(tr, batch):
    return trainer_step(tr, lambda model: tr.compute_loss(model, batch))


class FusedPassCounter:
    """Counts the drop-in's fused KTO passes (``trl_kto.kto_fused_pass`` calls)."""

    def __init__(self, monkeypatch) -> None:
        import logitless.integrations.trl_kto as trl_kto

        self.n = 0
        inner = trl_kto.kto_fused_pass

        def counted(*args, **kwargs):
            self.n += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(trl_kto, "kto_fused_pass", counted)


def _float64_oracle_trainer(tr):
    """The trainer in float64, TRL's head replaced by the full-logits oracle, the policy moved away
    from its reference (at the reference every reward and the KL estimate are 0 up to rounding,
    and the clamp of the KL at 0 would compare rounding noise)."""
    for m in (tr.model, tr.ref_model):
        if m is not None:
            m.double()
            install_plain_head(m)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2)
    return tr


def _assert_same_step(ours, theirs, opts):
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0]))), opts
    assert rel_err(ours[1], theirs[1]) <= 1e-10, opts
    assert set(ours[2]) == set(theirs[2]), opts
    for k, v in theirs[2].items():
        if k != "num_tokens":
            assert ours[2][k] == pytest.approx(v, rel=1e-9, abs=1e-10, nan_ok=True), (k, opts)


# Seeded draws over the KTO options that change the loss: loss type (with / without the KL
# estimate's extra passes), beta, class weights, precomputed reference log-probs; all desirable
# or all undesirable rows too (TRL then logs one side's metrics only). fused_loss None: the fused
# route; False: TRL's loss code on logitless log-probs.
@pytest.mark.parametrize(("seed", "fused_loss"), [(0, None), (1, None), (2, None), (3, None), (4, None),
                                                  (0, False), (2, False)])
def test_loss_grads_metrics_match_trl_float64(tmp_path, monkeypatch, seed, fused_loss):
    from logitless.integrations.config import LogitlessConfig

    rng = random.Random(seed)
    opts = dict(loss_type=["kto", "apo_zero_unpaired", "kto", "apo_zero_unpaired", "kto"][seed],
                beta=rng.choice([0.1, 0.5]), desirable_weight=rng.choice([1.0, 1.33]),
                undesirable_weight=rng.choice([1.0, 0.7]), precompute_ref_log_probs=seed in (2, 3))
    labels = {3: lambda i: True, 4: lambda i: False}.get(seed, lambda i: bool(i % 2))
    tr = patch_kto_trainer(_float64_oracle_trainer(_kto(tmp_path, seed, labels=labels, **opts)),
                           LogitlessConfig(fused_loss=fused_loss))
    assert tr.logitless.fused_loss == (fused_loss is None), tr.logitless.why_not
    calls, fused = PassCounter(monkeypatch), FusedPassCounter(monkeypatch)
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    assert fused.n == int(fused_loss is None)
    # behind TRL's head: the policy unless fused, the reference unless precomputed, both on the KL pairs for kto
    kl = opts["loss_type"] == "kto"
    assert calls.n == (fused_loss is not None) + (not opts["precompute_ref_log_probs"]) * (1 + kl) + kl, opts
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert fused.n == int(fused_loss is None)
    _assert_same_step(ours, theirs, opts)


def test_trains(tmp_path):
    tr = _kto(tmp_path, 5, cls=LogitlessKTOTrainer)
    assert tr.logitless.fused_logprobs
    tr.train()
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged and torch.isfinite(torch.tensor(logged[-1]["loss"]))


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_reference_cache_matches_trls_reference_float64(tmp_path, loss_type):
    """``ref_cache=``: the reference log-probs, KL pairs included (``kto``), come from a cache built
    from the trainer's own records; the step equals TRL's own with its reference model, float64."""
    from logitless.integrations.trl_head import CachedReference
    from logitless.refcache import RefCache, build

    tr = _float64_oracle_trainer(_kto(tmp_path, 4, loss_type=loss_type, beta=0.3))
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    theirs = _step(tr, batch)
    records = list(reference_records(tr))
    assert len(records) == (16 if loss_type == "kto" else 8)  # the KL pairs are scored only for "kto"
    build(tr.ref_model, records, tmp_path / "cache", tokenizer=tr.processing_class)
    tr = patch_kto_trainer(tr, ref_cache=RefCache.open(tmp_path / "cache"))
    assert isinstance(tr.ref_model, CachedReference) and tr.logitless.fused_loss
    ours = _step(tr, batch)
    _assert_same_step(ours, theirs, loss_type)


def test_peft_config_with_lm_head_matches_the_adapted_head_float64(tmp_path):
    """``peft_config`` with ``lm_head`` (refused by TRL): the fused route's loss, gradients and
    metrics equal TRL's own KTO code on the model's own full float64 logits, the reference and its
    KL pairs being the model with adapters disabled."""
    from trl import KTOTrainer

    from logitless.integrations.trl_head import lora_head_admitted

    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    with lora_head_admitted(KTOTrainer, (), {}):  # the oracle: TRL's trainer on the same PEFT model
        tr = _kto(tmp_path, 6, peft_config=cfg, loss_type="kto", beta=0.3)
    assert tr.ref_model is None
    tr.model.double()
    install_plain_head(tr.model.get_base_model())
    tr = patch_kto_trainer(tr)
    assert tr.logitless.fused_loss
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    _assert_same_step(ours, theirs, "peft")


def test_peft_config_with_lm_head_is_accepted(tmp_path):
    # TRL's own trainer refuses peft_config with lm_head ("Remove 'lm_head'"); the drop-in takes it,
    # with logitless behind the head (the adapter's term computed; DPO / SFT check the numbers).
    from logitless.model_heads import find_head

    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    tr = _kto(tmp_path, 3, cls=LogitlessKTOTrainer, peft_config=cfg)
    assert find_head(tr.model).lora is not None and tr.logitless.fused_logprobs
