"""LogitlessORPOTrainer: TRL's own ORPO loss, gradients and metrics on a float64 tiny model.

TRL's ``ORPOTrainer`` materializes the model's logits (float64 here), so its own trainer is the
oracle as it is, with one exception: ``odds_ratio_loss`` casts the mean log-probs to float32
(``.float()``), which bounds TRL's own float64 loss by float32 rounding. The ``odds_ratio_float64``
fixture makes that one cast keep float64 (in both paths: the drop-in's metrics are TRL's
``odds_ratio_loss``), so the comparison is float64-exact; ``test_trl_as_shipped`` checks against
the unpatched cast.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from tiny_models import save_tiny_qwen2, word_tokenizer
from trl_head_oracle import flat_grads, rel_err

from logitless.integrations.config import LogitlessConfig
from logitless.integrations.trl_orpo import LogitlessORPOTrainer, patch_orpo_trainer, trl_own_path

V = 64


def _words(rng, n):
    return " ".join(f"t{rng.randrange(V - 3)}" for _ in range(n))


def _orpo(tmp_path, seed, cls=None, peft_config=None, logitless_config=None, **opts):
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    rng = random.Random(seed)
    save_tiny_qwen2(tmp_path / "m", vocab_size=V, seed=seed % 2**31)
    rows = [
        dict(
            prompt=_words(rng, rng.randint(2, 5)),
            chosen=" " + _words(rng, rng.randint(1, 6)),
            rejected=" " + _words(rng, rng.randint(1, 6)),
        )
        for _ in range(8)
    ]
    args = ORPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_steps=1,
        logging_steps=1,
        max_length=64,
        **opts,
    )
    extra = {} if peft_config is None else {"peft_config": peft_config}
    if logitless_config is not None:
        extra["logitless_config"] = logitless_config
    return (cls or ORPOTrainer)(
        **extra,
        model=str(tmp_path / "m"),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=word_tokenizer(V),
    )


@contextlib.contextmanager
def _float64_kept():
    """``Tensor.float()`` leaves float64 tensors as they are."""
    own = torch.Tensor.float
    torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else own(t, *a, **k)
    try:
        yield
    finally:
        del torch.Tensor.float  # back to TensorBase's


@pytest.fixture
def odds_ratio_float64(monkeypatch):
    """TRL's ``odds_ratio_loss`` without its float32 cast (only there: the models' own code keeps it)."""
    from trl.experimental.orpo import ORPOTrainer

    own = ORPOTrainer.odds_ratio_loss

    def kept(self, chosen, rejected):
        with _float64_kept():
            return own(self, chosen, rejected)

    monkeypatch.setattr(ORPOTrainer, "odds_ratio_loss", kept)


@contextlib.contextmanager
def _no_logits(model):
    """The model's ``lm_head`` refuses to run: the fused pass reads its weight, never its output."""
    head = model.get_output_embeddings()

    def refuse(*args, **kwargs):
        raise AssertionError("lm_head ran: logits were materialized")

    head.forward = refuse
    try:
        yield
    finally:
        del head.forward


def _step(tr, batch):
    tr.model.zero_grad(set_to_none=True)
    loss, metrics = tr.get_batch_loss_metrics(tr.model, batch)
    loss.backward()
    return loss.detach(), flat_grads(tr.model), metrics


def _both(tr, batch):
    """``(ours, theirs)``: one step of the drop-in (with logits refused) and one of TRL's own code."""
    tr.model.train()
    with _no_logits(tr.model):
        ours = _step(tr, batch)
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    return ours, theirs


def _assert_equal(ours, theirs, what):
    assert abs(float(ours[0] - theirs[0])) <= 1e-10 * max(1.0, abs(float(theirs[0]))), what
    assert rel_err(ours[1], theirs[1]) <= 1e-10, what
    assert set(ours[2]) == set(theirs[2])
    for k, v in theirs[2].items():
        assert ours[2][k] == pytest.approx(v, rel=1e-9, abs=1e-10), (k, what)


# ORPO's one option is beta (the odds-ratio weight; the NLL weight is 1): a small, a TRL-default
# and a large one, on fresh random data and models each.
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_loss_grads_metrics_match_trl_float64(tmp_path, seed, beta, odds_ratio_float64):
    tr = _orpo(tmp_path, seed, beta=beta)
    tr.model.double()
    tr = patch_orpo_trainer(tr)
    assert tr.logitless.fused_loss, tr.logitless.why_not
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours, theirs = _both(tr, batch)
    _assert_equal(ours, theirs, beta)
    assert {"log_odds_ratio", "log_odds_chosen", "nll_loss", "logits/chosen"} <= set(ours[2])


def test_trl_as_shipped(tmp_path, seed):
    """Against TRL's unpatched float32 odds-ratio cast: equal to float32 rounding."""
    tr = patch_orpo_trainer(_orpo(tmp_path, seed))
    tr.model.double().train()
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert abs(float(ours[0] - theirs[0])) <= 1e-6 * max(1.0, abs(float(theirs[0])))
    assert rel_err(ours[1], theirs[1]) <= 1e-6
    for k, v in theirs[2].items():
        assert ours[2][k] == pytest.approx(v, rel=1e-9, abs=1e-10), k  # both TRL's odds_ratio_loss


def test_lora_head_matches_trl_float64(tmp_path, seed, odds_ratio_float64):
    """A LoRA adapter on ``lm_head`` (ORPO's own trainer takes it, on materialized logits): the
    adapter's term in the pass and in the ``logits/*`` sums."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False, lora_dropout=0.0
    )
    tr = _orpo(tmp_path, seed, peft_config=cfg, beta=0.2)
    tr.model.double()
    tr = patch_orpo_trainer(tr)
    assert tr.logitless.fused_loss, tr.logitless.why_not
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours, theirs = _both(tr, batch)
    _assert_equal(ours, theirs, "lora")


def test_trains_and_logs(tmp_path, seed):
    tr = _orpo(tmp_path, seed, cls=LogitlessORPOTrainer)
    assert tr.logitless.fused_loss
    tr.train()
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert logged and torch.isfinite(torch.tensor(logged[-1]["loss"])) and "log_odds_ratio" in logged[-1]
    assert logged[-1]["logitless/active"] == 1.0


def test_off_on_purpose_runs_trls_code(tmp_path, seed):
    tr = _orpo(tmp_path, seed, cls=LogitlessORPOTrainer, logitless_config=LogitlessConfig(fused_loss=False))
    assert not tr.logitless.active
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    ours = _step(tr, batch)
    with trl_own_path(tr):
        theirs = _step(tr, batch)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_completion_label_unlike_input_id_is_refused(tmp_path, seed):
    tr = patch_orpo_trainer(_orpo(tmp_path, seed))
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    labels = batch["chosen_labels"].clone()
    row, col = (labels != -100).nonzero()[0].tolist()
    labels[row, col] = (labels[row, col] + 1) % (V - 3)
    with pytest.raises(ValueError, match="fused_loss=False"):
        tr.get_batch_loss_metrics(tr.model, {**batch, "chosen_labels": labels})
