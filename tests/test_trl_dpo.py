"""LogitlessDPOTrainer: TRL's own DPO loss, gradients and metrics, on a float64 tiny model."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from tiny_models import save_tiny_qwen2, word_tokenizer
from trl_head_oracle import PassCounter, flat_grads, install_plain_head, rel_err, trainer_step

from logitless.integrations.config import LogitlessConfig
from logitless.integrations.trl_dpo import LogitlessDPOTrainer, patch_dpo_trainer, reference_records, trl_own_path

V = 64


def _words(rng, n):
    return " ".join(f"t{rng.randrange(V - 3)}" for _ in range(n))


def _dpo(tmp_path, seed, cls=None, logitless_config=None, peft_config=None, **opts):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rng = random.Random(seed)
    save_tiny_qwen2(tmp_path / "m", vocab_size=V, seed=seed)
    rows = [dict(prompt=_words(rng, rng.randint(2, 5)), chosen=" " + _words(rng, rng.randint(1, 6)),
                 rejected=" " + _words(rng, rng.randint(1, 6))) for _ in range(8)]
    args = DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     bf16=False, max_steps=1, logging_steps=1, **opts)
    extra = {} if logitless_config is None else {"logitless_config": logitless_config}
    if peft_config is not None:
        extra["peft_config"] = peft_config
    return (cls or DPOTrainer)(**extra, model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=word_tokenizer(V))


def _float64_oracle_trainer(tr):
    """The trainer in float64, TRL's head replaced by the full-logits oracle, the policy moved
    away from its reference (:func:`_move_policy`)."""
    for m in (tr.model, tr.ref_model):
        if m is not None:
            m.double()
            install_plain_head(m)
    _move_policy(tr.model)
    return tr


def _move_policy(model):
    """Move the policy away from its reference (a trained step's worth): at the reference itself
    every reward is 0 up to rounding, and ``rewards/accuracies`` would compare rounding noise."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2)


def _step(tr, batch):
    return trainer_step(tr, lambda model: tr.compute_loss(model, batch))


class FusedPassCounter:
    """Counts the drop-in's fused DPO passes (``trl_dpo.dpo_fused_pass`` calls)."""

    def __init__(self, monkeypatch) -> None:
        import logitless.integrations.trl_dpo as trl_dpo

        self.n = 0
        inner = trl_dpo.dpo_fused_pass

        def counted(*args, **kwargs):
            self.n += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(trl_dpo, "dpo_fused_pass", counted)


# Seeded draws over TRL's DPO options that change the loss (loss types, their mixture and weights,
# beta, label smoothing, LD-DPO's ld_alpha, precomputed reference log-probs). The pool holds the
# batch-coupled aot types and the sft NLL term too (the fused route runs them in one chunk / as a
# per-pair share); f_divergence_type is left at reverse_kl: TRL's alpha-divergence has no float64 clamp.
def _options(seed):
    rng = random.Random(seed)
    types_ = rng.sample(["sigmoid", "hinge", "ipo", "robust", "bco_pair", "exo_pair", "nca_pair", "apo_zero",
                         "apo_down", "sppo_hard", "sigmoid_norm", "discopop", "sft", "aot", "aot_unpaired"],
                        k=rng.choice([1, 2]))
    opts = dict(loss_type=types_, beta=rng.choice([0.05, 0.1, 0.5]))
    if len(types_) == 2:
        opts["loss_weights"] = [rng.uniform(0.2, 1.0), rng.uniform(0.2, 1.0)]
    if "exo_pair" in types_ or (rng.random() < 0.5 and set(types_) <= {"sigmoid", "robust", "bco_pair", "aot"}):
        opts["label_smoothing"] = 0.1
    if rng.random() < 0.3:
        opts["ld_alpha"] = rng.uniform(0.3, 0.9)
    if rng.random() < 0.4:
        opts["precompute_ref_log_probs"] = True
    return opts


def _assert_same_step(ours, theirs, opts):
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0]))), opts
    assert rel_err(ours[1], theirs[1]) <= 1e-10, opts
    assert set(ours[2]) == set(theirs[2])
    for k, v in theirs[2].items():
        if k == "num_tokens":  # a running count of the trainer, not of this step
            continue
        assert ours[2][k] == pytest.approx(v, rel=1e-9, abs=1e-10), (k, opts)


# fused_loss None: the fused route (every option drawn has one, ld_alpha included); False: TRL's loss
# code on logitless log-probs. Both against TRL's own trainer step on the float64 full-logits head.
_SEEDS = (0, 2, 5, 7, 11, 13, 15, 16, 19)


@pytest.mark.parametrize(("seed", "fused_loss"), [*((s, None) for s in _SEEDS), (0, False), (2, False), (11, False)])
def test_loss_grads_metrics_match_trl_float64(tmp_path, monkeypatch, seed, fused_loss):
    _check_against_trl(tmp_path, monkeypatch, seed, _options(seed), fused_loss)


# LD-DPO beyond the seeded draws: ld_alpha = 0 (the tail masked) with the length-normalized ipo and
# the plain-NLL sft term, and with a batch-coupled type (its one-chunk route).
@pytest.mark.parametrize("opts", [dict(loss_type=["ipo", "sft"], loss_weights=[0.7, 0.4], beta=0.1, ld_alpha=0.0),
                                  dict(loss_type=["aot_unpaired", "sigmoid_norm"], beta=0.5, ld_alpha=0.4)])
def test_ld_dpo_matches_trl_float64(tmp_path, monkeypatch, seed, opts):
    _check_against_trl(tmp_path, monkeypatch, seed, opts, None)


def _check_against_trl(tmp_path, monkeypatch, seed, opts, fused_loss):
    calls, fused = PassCounter(monkeypatch), FusedPassCounter(monkeypatch)
    tr = patch_dpo_trainer(_float64_oracle_trainer(_dpo(tmp_path, seed, **opts)),
                           LogitlessConfig(fused_loss=fused_loss))
    assert tr.logitless.fused_logprobs, tr.logitless.why_not
    route = fused_loss is None
    assert tr.logitless.fused_loss == route, tr.logitless.why_not
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    if opts.get("precompute_ref_log_probs"):
        assert "ref_chosen_logps" in batch
    ours = _step(tr, batch)
    # the policy (one fused pass, or a pass behind TRL's head), and the reference unless TRL precomputed it
    assert (fused.n, calls.n) == (int(route), int(not route) + (not opts.get("precompute_ref_log_probs"))), opts
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert fused.n == int(route)
    _assert_same_step(ours, theirs, opts)


def test_seeds_cover_the_fused_routes_cases():
    # The draws above reach what the fused route treats apart: a batch-coupled type, the sft term,
    # precomputed references, and ld_alpha (alone, with sft, with precomputed references).
    drawn = [_options(s) for s in _SEEDS]
    types_ = {t for o in drawn for t in o["loss_type"]}
    assert types_ & {"aot", "aot_unpaired"} and "sft" in types_
    assert any(o.get("precompute_ref_log_probs") and "ld_alpha" not in o for o in drawn)
    assert any("ld_alpha" in o and "sft" in o["loss_type"] for o in drawn)
    assert any("ld_alpha" in o and o.get("precompute_ref_log_probs") for o in drawn)


def test_gradient_accumulation_training_step_matches_trl_float64(tmp_path):
    """``Trainer.training_step`` with gradient accumulation (it scales the loss; DPO takes no
    ``num_items_in_batch``): the fused route's step equals TRL's own."""
    tr = patch_dpo_trainer(_float64_oracle_trainer(_dpo(tmp_path, 9, loss_type=["sigmoid", "sft"], beta=0.1,
                                                        gradient_accumulation_steps=2)))
    assert tr.logitless.fused_loss
    tr.model.train()
    tr.current_gradient_accumulation_steps = 2  # as Trainer's loop sets it
    batch = next(iter(tr.get_train_dataloader()))
    results = []
    for own in (False, True):
        tr.model.zero_grad(set_to_none=True)
        if own:
            with trl_own_path(tr):
                loss = tr.training_step(tr.model, batch)
        else:
            loss = tr.training_step(tr.model, batch)
        results.append((loss, flat_grads(tr.model)))
    (ours, g_ours), (theirs, g_theirs) = results
    assert abs(float(ours - theirs)) <= 1e-10 * max(1.0, abs(float(theirs)))
    assert rel_err(g_ours, g_theirs) <= 1e-10


def test_matches_trls_own_fp32_head(tmp_path):
    """Against TRL's real (chunked, fp32-statistics) head, in fp32: agreement at fp32 accuracy."""
    tr = _dpo(tmp_path, 7, cls=LogitlessDPOTrainer, loss_type=["sigmoid"], beta=0.1)
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    assert rel_err(ours[1], theirs[1]) <= 1e-4


# WPO (use_weighting): its weights from the pass's log Σ p² on the fused route (a mixture of loss
# types; LD-DPO's scores with precomputed references) and under TRL's loss on logitless log-probs
# (fused_loss=False: log Σ p² behind TRL's head), against TRL's own step on the float64 full-logits head.
@pytest.mark.parametrize(("opts", "fused_loss"), [
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[0.6, 0.9], beta=0.1), None),
    (dict(loss_type=["bco_pair"], beta=0.5, ld_alpha=0.5, precompute_ref_log_probs=True), None),
    (dict(loss_type=["sigmoid"], beta=0.1), False),
])
def test_wpo_matches_trl_float64(tmp_path, monkeypatch, seed, opts, fused_loss):
    _check_against_trl(tmp_path, monkeypatch, seed, dict(opts, use_weighting=True), fused_loss)


def test_wpo_with_sft_runs_trls_loss(tmp_path):
    """TRL 1.16's own loss fails on WPO with the sft type (it weighs an expanded view in place): the
    fused route resolves off, saying why, and TRL's loss code runs on logitless log-probs."""
    tr = _dpo(tmp_path, 3, cls=LogitlessDPOTrainer, loss_type=["sigmoid", "sft"], use_weighting=True)
    assert tr.logitless.fused_logprobs and not tr.logitless.fused_loss
    assert "use_weighting with the sft loss type" in tr.logitless.why_not["fused_loss"]


def test_trains(tmp_path):
    tr = _dpo(tmp_path, 5, cls=LogitlessDPOTrainer)
    tr.train()
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged and "rewards/accuracies" in logged[-1] and torch.isfinite(torch.tensor(logged[-1]["loss"]))
    assert logged[-1]["logitless/active"] == 1.0  # logged with TRL's metrics


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_cache_matches_trls_reference_float64(tmp_path, seed):
    """``ref_cache=``: the reference log-probs come from a cache built from the trainer's own
    records (TRL's tokenization of the text rows) instead of the reference model; the loss,
    gradients and metrics equal TRL's own trainer running its reference model, in float64."""
    from logitless.integrations.trl_head import CachedReference
    from logitless.refcache import RefCache, build

    opts = dict(loss_type=["sigmoid", "ipo"][seed], beta=0.1, **({"ld_alpha": 0.6} if seed else {}))
    tr = _float64_oracle_trainer(_dpo(tmp_path, seed, **opts))
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    theirs = _step(tr, batch)  # TRL's trainer, its reference model, float64 full-logits head
    build(tr.ref_model, reference_records(tr), tmp_path / "cache", tokenizer=tr.processing_class)
    ref = tr.ref_model
    tr = patch_dpo_trainer(tr, ref_cache=RefCache.open(tmp_path / "cache"))
    assert isinstance(tr.ref_model, CachedReference)
    assert all(p.is_meta for p in ref.parameters())  # the reference model was freed
    ours = _step(tr, batch)
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0]))), opts
    assert rel_err(ours[1], theirs[1]) <= 1e-10, opts
    for k, v in theirs[2].items():
        if k != "num_tokens":
            assert ours[2][k] == pytest.approx(v, rel=1e-9, abs=1e-10), (k, opts)


def test_reference_cache_refuses_a_moving_or_precomputed_reference(tmp_path):
    from logitless.integrations.trl_head import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match="precompute_ref_log_probs"):
        _dpo(tmp_path, 4, cls=functools.partial(LogitlessDPOTrainer, ref_cache=tmp_path / "x"),
             precompute_ref_log_probs=True)


def test_peft_config_with_lm_head_matches_the_adapted_head_float64(tmp_path):
    """``peft_config`` with ``lm_head`` (refused by TRL: its head would ignore the adapter): the
    loss, gradients and metrics equal TRL's own DPO code on the model's own full float64 logits
    (the head's adapter included; the reference is the model with adapters disabled), and the
    head's adapter gets a gradient."""
    from trl import DPOTrainer

    from logitless.integrations.trl_head import lora_head_admitted

    peft = pytest.importorskip("peft")

    def cfg():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)

    with lora_head_admitted(DPOTrainer, (), {}):  # the oracle: TRL's trainer on the same PEFT model
        tr = _dpo(tmp_path, 8, peft_config=cfg(), loss_type=["sigmoid"], beta=0.1)
    assert tr.ref_model is None  # TRL's PEFT reference: the adapters disabled
    tr.model.double()
    install_plain_head(tr.model.get_base_model())
    tr = patch_dpo_trainer(tr)
    assert tr.logitless.fused_logprobs and tr.logitless.fused_loss  # the adapter's term inside the fused pass
    tr.model.train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    head_b = [p.grad for n, p in tr.model.named_parameters() if "lm_head.lora_B" in n]
    assert head_b[0] is not None and head_b[0].abs().max() > 0
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0])))
    assert rel_err(ours[1], theirs[1]) <= 1e-10
    for k, v in theirs[2].items():
        if k != "num_tokens":
            assert ours[2][k] == pytest.approx(v, rel=1e-9, abs=1e-10), k
    # Built directly, the drop-in takes the same peft_config (TRL's own DPOTrainer refuses it).
    with pytest.raises(ValueError, match="Remove `'lm_head'`"):
        _dpo(tmp_path / "trl", 8, peft_config=cfg())
    direct = _dpo(tmp_path / "ours", 8, cls=LogitlessDPOTrainer, peft_config=cfg())
    assert direct.logitless.fused_logprobs


def test_everything_off_on_purpose_does_not_warn(tmp_path):
    # fused_loss and fused_logprobs both False is a deliberate "all off", not a no-op to warn about.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tr = _dpo(tmp_path, 2, cls=LogitlessDPOTrainer,
                  logitless_config=LogitlessConfig(fused_loss=False, fused_logprobs=False))
    assert not tr.logitless.active
