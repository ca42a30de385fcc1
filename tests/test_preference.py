"""Preference objectives against TRL 1.16's own code, called on tensors.

* DPO: ``DPOTrainer._compute_loss`` itself, on a stub trainer whose "model" returns the float64
  oracle's per-token log-probs (``outputs.log_probs``, as TRL's fused head does) and whose
  accelerator gathers are identities; loss and every reward/logps metric compared, gradients
  through TRL's loss (it is differentiable w.r.t. the oracle's log-probs, hence the head).
* KTO: ``KTOTrainer._compute_loss`` the same way (precomputed reference and KL log-probs).
* CPO / SimPO: ``CPOTrainer.cpo_loss`` (a method: stub ``self``) on the oracle's sums / means,
  plus the NLL term as ``get_batch_loss_metrics`` adds it (replicated: it needs full logits).
* ORPO: ``ORPOTrainer.odds_ratio_loss`` likewise, NLL over prompt and response (replicated).

float64 inputs: agreement to ~1e-12. Sizes are odd (V = 123, 2B = 6 sequences of T = 9); a
small ``chunk_bytes`` cuts the vocabulary into blocks.
"""

from __future__ import annotations

import types
import warnings
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from logitless import (
    CPOLossConfig,
    DPOLossConfig,
    KTOLossConfig,
    PassOptions,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    sequence_logps,
    simpo_loss,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.kto_trainer import KTOTrainer

B, L, V, H = 3, 10, 123, 16  # input_ids [2B, L]; predictions [2B, L - 1]
CHUNK = 20_000
TOL = 1e-10


pytestmark = pytest.mark.usefixtures("seed")  # a fresh seed per test (conftest)


def _batch(rows=2 * B):
    """Hidden states ``[S, L-1, H]`` predicting ``input_ids[:, 1:]``, masks with prompts of
    different lengths and right padding, float64 leaves."""
    hidden = torch.randn(rows, L - 1, H, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(V, H, dtype=torch.float64) / 2).requires_grad_()
    input_ids = torch.randint(0, V, (rows, L))
    prompt = torch.randint(1, 4, (rows,))
    length = torch.randint(6, L + 1, (rows,))
    pos = torch.arange(L)
    attention = (pos[None] < length[:, None]).long()
    completion = ((pos[None] >= prompt[:, None]) & (pos[None] < length[:, None])).long()
    return hidden, weight, input_ids, attention, completion



def _accelerator():
    return types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)


def _fake_model(hidden, weight, shifted_mask):
    z = hidden @ weight.T

    def model(**kw):
        labels = kw["labels"]  # [S, L], -100 outside the completion
        lsm = z.log_softmax(-1)
        tgt = labels[:, 1:]
        lp = lsm.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1) * (tgt != -100)
        ent = -(lsm.exp() * lsm).sum(-1)
        # log Σ p² as TRL's head defines it (chunked_logprob.py), read by WPO's weights
        log_sum_sq = torch.logsumexp(2 * lsm, -1).detach() * (tgt != -100)
        return types.SimpleNamespace(log_probs=lp, entropy=ent.detach(), mean_logits=z.mean(-1).detach(),
                                     is_top1=z.argmax(-1) == tgt, log_sum_sq_probs=log_sum_sq)

    model.training = True
    return model


def _trl_stub(cls, model, **attrs):
    stub = types.SimpleNamespace(model=model, accelerator=_accelerator(), _metrics={"train": defaultdict(list)},
                                 precompute_ref_logps=True, aux_loss_enabled=False, _total_train_tokens=0,
                                 _tp_size=1, ld_alpha=None, use_weighting=False, **attrs)
    stub.args = types.SimpleNamespace(discopop_tau=attrs.get("discopop_tau", 0.05))
    return stub


def _close(a, b, tol=TOL, what=""):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"{what}: {err:.3e}"


def _grads(loss, *leaves):
    return torch.autograd.grad(loss, list(leaves))


DPO_CASES = [
    dict(loss_type=["sigmoid"]),
    dict(loss_type=["ipo"], beta=0.3),
    dict(loss_type=["hinge"]),
    dict(loss_type=["robust"], label_smoothing=0.2),
    dict(loss_type=["exo_pair"], label_smoothing=1e-3),
    dict(loss_type=["nca_pair", "bco_pair", "sppo_hard"], loss_weights=[0.5, 1.0, 0.2]),
    dict(loss_type=["aot", "aot_unpaired"], label_smoothing=0.1),
    dict(loss_type=["apo_zero", "apo_down"]),
    dict(loss_type=["discopop"]),
    dict(loss_type=["sigmoid", "sft"], loss_weights=[0.8, 0.2]),
    dict(loss_type=["sigmoid_norm"], f_divergence_type="js_divergence"),
    dict(loss_type=["sigmoid"], f_divergence_type="forward_kl"),
    # alpha_divergence is not compared: TRL's clamp table has no float64 entry (KeyError on fp64).
]


@pytest.mark.parametrize("case", DPO_CASES, ids=lambda c: "+".join(c["loss_type"]) + "-" + c.get(
    "f_divergence_type", "rkl"))
def test_dpo_matches_trl_compute_loss(case):
    hidden, weight, input_ids, attention, completion = _batch()
    ref_logps = torch.randn(2 * B, dtype=torch.float64) * 2 - 15
    cfg = DPOLossConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in case.items()})
    pol = sequence_logps(hidden, weight, input_ids[:, 1:], completion[:, 1:], options=PassOptions(chunk_bytes=CHUNK))
    loss, metrics = dpo_loss(pol, ref_logps[:B], ref_logps[B:], config=cfg)

    full = dict(beta=0.1, label_smoothing=0.0, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5,
                discopop_tau=0.05, loss_weights=None)
    full.update(case)
    stub = _trl_stub(DPOTrainer, _fake_model(hidden, weight, completion[:, 1:]), loss_types=full.pop("loss_type"),
                     **full)
    stub.loss_weights = full["loss_weights"] or [1.0] * len(stub.loss_types)
    inputs = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion,
              "ref_chosen_logps": ref_logps[:B], "ref_rejected_logps": ref_logps[B:]}
    ref = DPOTrainer._compute_loss(stub, stub.model, inputs, return_outputs=False)
    _close(loss.detach(), ref.detach(), what="loss")
    _close(torch.cat([g.reshape(-1) for g in _grads(loss, hidden, weight)]),
           torch.cat([g.reshape(-1) for g in _grads(ref, hidden, weight)]), what="grads")
    logged = stub._metrics["train"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "entropy"):
        _close(metrics[name], logged[name][-1], what=name)


# kl_gap: the KL completions' policy minus reference mean; TRL clamps the estimate at 0, so a
# negative gap must give kl = 0.
@pytest.mark.parametrize(("loss_type", "kl_gap"), [("kto", 2.0), ("kto", -2.0), ("apo_zero_unpaired", 2.0)])
def test_kto_matches_trl_compute_loss(loss_type, kl_gap):
    rows = 7
    hidden, weight, input_ids, attention, completion = _batch(rows)
    label = torch.tensor([True, False, True, True, False, False, True])
    ref_logps = torch.randn(rows, dtype=torch.float64) * 2 - 15
    ref_kl_logps = torch.randn(rows, dtype=torch.float64) - 15
    kl_logps = ref_kl_logps + kl_gap + 0.3 * torch.randn(rows, dtype=torch.float64)
    assert ((kl_logps - ref_kl_logps).mean() > 0) == (kl_gap > 0)
    cfg = KTOLossConfig(beta=0.2, loss_type=loss_type, desirable_weight=1.3, undesirable_weight=0.7)
    pol = sequence_logps(hidden, weight, input_ids[:, 1:], completion[:, 1:], options=PassOptions(chunk_bytes=CHUNK))
    loss, metrics = kto_loss(pol, label, ref_logps, kl_logps, ref_kl_logps, config=cfg)

    model = _fake_model(hidden, weight, completion[:, 1:])
    stub = _trl_stub(KTOTrainer, model, beta=0.2, loss_type=loss_type, desirable_weight=1.3, undesirable_weight=0.7,
                     calculate_KL=loss_type == "kto")
    stub._compute_kl_logps = lambda m, b: kl_logps if loss_type == "kto" else None
    inputs = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion, "label": label,
              "ref_logps": ref_logps, "ref_KL_logps": ref_kl_logps}
    ref = KTOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    _close(loss.detach(), ref.detach(), what="loss")
    _close(torch.cat([g.reshape(-1) for g in _grads(loss, hidden, weight)]),
           torch.cat([g.reshape(-1) for g in _grads(ref, hidden, weight)]), what="grads")
    logged = stub._metrics["train"]
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                 "entropy"):
        _close(metrics[name], logged[name][-1], what=name)


def _oracle_sums(hidden, weight, input_ids, mask):
    lp = (hidden @ weight.T).log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:].to(lp.dtype)
    return (lp * m).sum(1), m.sum(1), lp


@pytest.mark.parametrize("cfg", [
    CPOLossConfig(),
    CPOLossConfig(loss_type="hinge", cpo_alpha=0.5),
    CPOLossConfig(loss_type="ipo", beta=0.4),
    CPOLossConfig(loss_type="sigmoid", label_smoothing=0.1, alpha=0.05),
    CPOLossConfig(loss_type="simpo", beta=2.0, simpo_gamma=0.7, cpo_alpha=0.0),
], ids=["sigmoid", "hinge", "ipo", "alphapo", "simpo"])
def test_cpo_simpo_match_trl_cpo_loss(cfg):
    hidden, weight, input_ids, _, completion = _batch()
    pol = sequence_logps(hidden, weight, input_ids[:, 1:], completion[:, 1:], options=PassOptions(chunk_bytes=CHUNK))
    loss, metrics = cpo_loss(pol, config=cfg)

    sums, lens, lp = _oracle_sums(hidden, weight, input_ids, completion)
    scores = sums / lens if cfg.loss_type in ("ipo", "simpo") else sums
    stub = types.SimpleNamespace(accelerator=_accelerator(), **{k: getattr(cfg, k) for k in (
        "alpha", "loss_type", "beta", "simpo_gamma", "label_smoothing")})
    losses, chosen_r, rejected_r = CPOTrainer.cpo_loss(stub, scores[:B], scores[B:])
    # get_batch_loss_metrics: nn.CrossEntropyLoss over the chosen rows' completion tokens (replicated).
    m = completion[:B, 1:].bool()
    nll = -lp[:B][m].mean()
    ref = losses.mean() + cfg.cpo_alpha * nll
    _close(loss.detach(), ref.detach(), what="loss")
    _close(torch.cat([g.reshape(-1) for g in _grads(loss, hidden, weight)]),
           torch.cat([g.reshape(-1) for g in _grads(ref, hidden, weight)]), what="grads")
    expect = {"rewards/chosen": chosen_r.mean(), "rewards/rejected": rejected_r.mean(),
              "rewards/accuracies": (chosen_r > rejected_r).float().mean(),
              "rewards/margins": (chosen_r - rejected_r).mean(), "logps/chosen": scores[:B].mean(),
              "logps/rejected": scores[B:].mean(), "nll_loss": nll if cfg.cpo_alpha else 0.0}
    for name, v in expect.items():
        _close(metrics[name], v.detach() if isinstance(v, torch.Tensor) else v, what=name)
    if cfg.loss_type == "simpo":
        loss2, _ = simpo_loss(pol, beta=2.0, simpo_gamma=0.7)
        _close(loss2.detach(), loss.detach(), what="simpo_loss")


def test_orpo_matches_trl_odds_ratio_loss():
    hidden, weight, input_ids, attention, completion = _batch()
    nll_mask = attention.clone()
    nll_mask[B:] = 0  # the NLL covers the chosen rows' prompt and response
    pol = sequence_logps(hidden, weight, input_ids[:, 1:], completion[:, 1:], nll_mask=nll_mask[:, 1:],
                         options=PassOptions(chunk_bytes=CHUNK))
    loss, metrics = orpo_loss(pol, beta=0.25)

    sums, lens, _ = _oracle_sums(hidden, weight, input_ids, completion)
    means = sums / lens
    stub = types.SimpleNamespace(accelerator=_accelerator(), beta=0.25)
    losses, chosen_r, rejected_r, log_odds_ratio, log_odds_chosen = ORPOTrainer.odds_ratio_loss(
        stub, means[:B], means[B:])
    labels = torch.where(attention == 1, input_ids, -100)[:B, 1:]  # concatenated_forward's NLL labels (replicated)
    logits = (hidden[:B] @ weight.T)
    nll = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
    ref = nll - losses.mean()
    # TRL's odds_ratio_loss casts the log-probs to float32: agreement to fp32 rounding.
    _close(loss.detach(), ref.detach(), tol=1e-6, what="loss")
    _close(torch.cat([g.reshape(-1) for g in _grads(loss, hidden, weight)]),
           torch.cat([g.reshape(-1) for g in _grads(ref, hidden, weight)]), tol=1e-6, what="grads")
    for name, v in {"rewards/chosen": chosen_r.mean(), "rewards/margins": (chosen_r - rejected_r).mean(),
                    "log_odds_ratio": log_odds_ratio, "log_odds_chosen": log_odds_chosen, "nll_loss": nll,
                    "logps/rejected": means[B:].mean()}.items():
        _close(metrics[name], v.detach(), tol=1e-6, what=name)


def test_one_pass_for_chosen_rejected_and_nll(monkeypatch):
    """Chosen + rejected + the ORPO NLL tokens are one ``vocab_stats`` call."""
    import logitless.objectives.preference as pref

    calls = []
    real = pref.vocab_stats
    monkeypatch.setattr(pref, "vocab_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    hidden, weight, input_ids, attention, completion = _batch()
    pol = sequence_logps(hidden, weight, input_ids[:, 1:], completion[:, 1:], nll_mask=attention[:, 1:])
    orpo_loss(pol)[0].backward()
    assert len(calls) == 1


def test_errors():
    with pytest.raises(ValueError, match="loss_type"):
        DPOLossConfig(loss_type=("nope",))
    with pytest.raises(ValueError, match="f_divergence_type"):
        DPOLossConfig(loss_type=("bco_pair",), f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOLossConfig(loss_type=("robust",), label_smoothing=0.5)
    hidden, weight, input_ids, _, completion = _batch()
    pol = sequence_logps(hidden, weight, input_ids[:, 1:], completion[:, 1:])
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        dpo_loss(pol, torch.zeros(B + 1), torch.zeros(B))
    with pytest.raises(ValueError, match="kl_logps"):
        kto_loss(pol, torch.ones(2 * B, dtype=torch.bool), torch.zeros(2 * B))
