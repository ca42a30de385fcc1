"""``logitless.integrations.openrlhf.use_logitless`` against OpenRLHF's own ``Actor.forward`` and
``PolicyLoss`` (openrlhf 0.11.2 from PyPI, installed without its dependencies:
``pip install --no-deps -r requirements-frameworks.txt``).

OpenRLHF's ``openrlhf.models`` package imports DeepSpeed and flash-attn at its top; neither
installs on a CPU-only machine. The test imports ``actor.py``, ``loss.py`` and ``utils.py`` with
those two bound to stubs that raise if called (``framework_sources.package_modules``): the
forward, ``PolicyLoss``, ``compute_approx_kl`` and ``aggregate_loss`` never call them (the packed
forward's flash-attn padding helpers get stand-ins, ``_FlashAttnPadding``).
OpenRLHF casts the logits and the KL's log-probs to fp32 even for a float64 model; the test widens
those casts to float64 (the actor module's ``torch.float32``, ``Tensor.float()`` of float64
tensors) so that OpenRLHF's formulas run in float64. The loss of one PPO training step as
``PPOTrainer.training_step`` composes it (policy loss, KL loss, entropy bonus) and every
trainable parameter's gradient must agree in float64 to 1e-10 over a randomized grid of
OpenRLHF's options."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from framework_sources import WidenedTorch, package_modules
from tiny_models import tiny_llama

from logitless.integrations.openrlhf import use_logitless

V, H = 61, 16
STUBS = ("deepspeed", "flash_attn.bert_padding", "flash_attn.utils.distributed")


@pytest.fixture(scope="module")
def openrlhf():
    # Imported before the stubs exist: transformers probes for DeepSpeed when these load.
    import peft  # noqa: F401
    import transformers.generation.utils
    import transformers.integrations.deepspeed
    import transformers.models.llama.modeling_llama  # noqa: F401

    with package_modules("openrlhf.models.actor", "openrlhf.models.loss", "openrlhf.models.utils", stubs=STUBS) as (
        actor,
        loss,
        utils,
    ):
        actor.torch = WidenedTorch()  # Actor.forward's logits.to(torch.float32) runs in float64
        yield actor, loss, utils


@pytest.fixture
def widened(monkeypatch):
    """OpenRLHF's ``Tensor.float()`` casts (the KL's log-ratio) keep float64 tensors float64."""
    cast = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: t if t.dtype == torch.float64 else cast(t))


def _actor(openrlhf, seed: int, temperature: float, lora_head: bool):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(V, H, seed)
    if lora_head:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])
        model = get_peft_model(model, config)
        with torch.no_grad():  # PEFT starts lora_B at zero
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.3)
    actor = openrlhf[0].Actor(model, temperature=temperature)
    actor.packing_samples = False  # set by Actor.__init__ only when it loads the model from a path
    return actor


def _batch(rng: random.Random, b: int = 3, prompt: int = 4, response: int = 6):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    seq = torch.randint(1, V, (b, prompt + response), generator=g)
    attn = torch.ones_like(seq)
    action_mask = torch.zeros(b, response, dtype=torch.bool)
    for r in range(b):
        left = rng.randrange(0, 3)  # left-padded prompt
        n = rng.randrange(2, response + 1)  # right-padded response
        seq[r, :left], attn[r, :left] = 0, 0
        seq[r, prompt + n :], attn[r, prompt + n :] = 0, 0
        action_mask[r, :n] = True
    return seq, attn, action_mask, g


def _step(openrlhf, actor, batch, opts):
    """One PPO step's loss as PPOTrainer.training_step composes it, and the parameter gradients."""
    _, loss_mod, utils = openrlhf
    seq, attn, action_mask, old, base, rollout, adv = batch
    for p in actor.parameters():
        p.grad = None
    lp, output = actor(seq, action_mask, attention_mask=attn, return_output=True, return_entropy=True)
    policy_loss = loss_mod.PolicyLoss(**opts["policy"])
    actor_loss, clip_ratio, ppo_kl, vllm_kl, _ = policy_loss(
        lp, old, adv, action_mask=action_mask, rollout_log_probs=rollout
    )
    kl = utils.compute_approx_kl(lp, base, log_probs_old=old, **opts["kl"])
    tl = policy_loss.token_level_loss
    kl_loss = loss_mod.aggregate_loss(kl, action_mask, token_level_loss=tl)
    entropy_loss = loss_mod.aggregate_loss(output.entropy[:, -action_mask.shape[1] :], action_mask, token_level_loss=tl)
    loss = actor_loss + opts["kl_coef"] * kl_loss - opts["entropy_coef"] * entropy_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.requires_grad}
    return [t.detach() for t in (loss, lp, clip_ratio, ppo_kl)], grads, vllm_kl


def _options(rng: random.Random) -> dict:
    level = rng.choice(["off", "token", "seq"])
    gating = "ratio" if level == "off" or rng.random() < 0.6 else rng.choice(["binary_kl", "tv"])
    mode = "clip" if level == "token" and gating == "ratio" and rng.random() < 0.5 else "mask"
    policy = {
        "clip_eps_low": rng.choice([0.2, 0.1]),
        "clip_eps_high": rng.choice([0.2, 0.28]),
        "dual_clip": rng.choice([None, 3.0]),
        "token_level_loss": rng.random() < 0.5,
        "policy_loss_type": rng.choice(["ppo", "gspo"]),
        "is_correction_level": level,
        "is_correction_mode": mode,
        "is_correction_gating": gating,
        "is_correction_threshold": (0.8, 1.25) if gating == "ratio" else (0.0, 0.05),
    }
    return {
        "policy": policy,
        "kl": {"kl_estimator": rng.choice(["k1", "k2", "k3"]), "unbiased_gradient": rng.random() < 0.5},
        "kl_coef": rng.choice([0.0, 0.05]),
        "entropy_coef": rng.choice([0.0, 0.01]),
        "temperature": rng.choice([1.0, 0.6]),
        "lora_head": rng.random() < 0.5,
    }


def _own_then_logitless(openrlhf, actor, opts: dict, rng: random.Random) -> tuple[tuple, tuple]:
    """One PPO step of a random batch through OpenRLHF's own actor, then through the same actor
    after ``use_logitless``: ``(own, ours)``, each ``_step``'s ``(outputs, grads, vllm_kl)``. Old,
    reference and sampler log-probs are the current ones plus noise (0.2 / 0.4 / 0.1 nats)."""
    seq, attn, action_mask, g = _batch(rng)
    with torch.no_grad():
        lp = actor(seq, action_mask, attention_mask=attn)
    noise = lambda s: lp + s * torch.randn(lp.shape, generator=g, dtype=lp.dtype)  # noqa: E731
    adv = torch.randn(lp.shape, generator=g, dtype=lp.dtype)
    batch = (seq, attn, action_mask, noise(0.2), noise(0.4), noise(0.1), adv)
    own = _step(openrlhf, actor, batch, opts)
    use_logitless(actor)
    return own, _step(openrlhf, actor, batch, opts)


# Eight cases drawn from OpenRLHF's option space (PPO / GSPO x dual clip x token / sample
# aggregation x train-rollout mismatch correction level, mode and gating x KL estimator and its
# unbiased gradient x KL and entropy coefficients x temperature x LoRA on lm_head): each draw
# exercises several switches at once; a new case is a new draw.
@pytest.mark.parametrize("case", range(8))
def test_training_step_matches_openrlhfs_own_path_float64(openrlhf, widened, seed, case):
    rng = random.Random(seed)
    opts = _options(rng)
    actor = _actor(openrlhf, seed, opts["temperature"], opts["lora_head"])
    (expected, expected_grads, expected_vllm_kl), (got, grads, vllm_kl) = _own_then_logitless(openrlhf, actor, opts,
                                                                                               rng)
    for name, x, y in zip(("loss", "action_log_probs", "clip_ratio", "ppo_kl"), got, expected, strict=True):
        assert x.dtype == y.dtype, name
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12), (name, x, y)
    if expected_vllm_kl is not None:
        assert torch.allclose(vllm_kl, expected_vllm_kl, rtol=1e-10, atol=1e-12)
    assert grads.keys() == expected_grads.keys() and grads
    for name in grads:
        assert torch.allclose(grads[name], expected_grads[name], rtol=1e-10, atol=1e-12), name


class _FlashAttnPadding:
    """Stand-ins for the four flash-attn padding helpers that OpenRLHF's packing code
    (``ring_attn_utils.unpad_and_slice_tensor`` / ``gather_and_pad_tensor``) calls, with
    flash-attn 2.8's semantics (``flash_attn/bert_padding.py``); flash-attn has no CPU build."""

    @staticmethod
    def rearrange(x, pattern):
        assert pattern == "b s ... -> (b s) ..."
        return x.reshape(-1, *x.shape[2:])

    @staticmethod
    def index_first_axis(x, indices):
        return x[indices]

    @staticmethod
    def unpad_input(hidden, attention_mask):
        seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
        indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
        flat = hidden.reshape(-1, *hidden.shape[2:])
        return flat[indices], indices, cu_seqlens, int(seqlens.max()), seqlens

    @staticmethod
    def pad_input(hidden, indices, batch, seqlen):
        out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
        out = out.index_put((indices,), hidden)
        return out.reshape(batch, seqlen, *hidden.shape[1:])


@pytest.mark.parametrize("case", range(2))
def test_packed_samples_match_openrlhfs_packing_path(openrlhf, widened, monkeypatch, seed, case):
    """``packing_samples=True``: OpenRLHF's own unpad / gather code around both heads (with
    stand-ins for flash-attn's padding helpers, the same on both sides)."""
    import importlib

    ring = importlib.import_module("openrlhf.models.ring_attn_utils")
    for name in ("rearrange", "index_first_axis", "unpad_input", "pad_input"):
        monkeypatch.setattr(ring, name, getattr(_FlashAttnPadding, name))
    rng = random.Random(seed)
    opts = _options(rng)
    actor = _actor(openrlhf, seed, opts["temperature"], opts["lora_head"])
    actor.packing_samples = True
    (expected, expected_grads, _), (got, grads, _) = _own_then_logitless(openrlhf, actor, opts, rng)
    for name, x, y in zip(("loss", "action_log_probs", "clip_ratio", "ppo_kl"), got, expected, strict=True):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12), (name, x, y)
    for name in grads:
        assert torch.allclose(grads[name], expected_grads[name], rtol=1e-10, atol=1e-12), name


def test_rollout_log_probs_match_without_action_mask(openrlhf, widened, seed):
    """The no-grad calls: old-policy / reference action log-probs, and every position's log-prob
    (``return_logprobs`` without an action mask)."""
    actor = _actor(openrlhf, seed, 0.8, lora_head=False)
    seq, attn, action_mask, _ = _batch(random.Random(seed))
    with torch.no_grad():
        expected = (actor(seq, action_mask, attention_mask=attn), actor(seq, attention_mask=attn, return_logprobs=True))
        use_logitless(actor)
        got = (actor(seq, action_mask, attention_mask=attn), actor(seq, attention_mask=attn, return_logprobs=True))
    for x, y in zip(got, expected, strict=True):
        assert x.shape == y.shape
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12)


def test_logits_request_falls_back_with_one_warning(openrlhf, seed):
    actor = _actor(openrlhf, seed, 1.0, lora_head=False)
    seq, attn, _, _ = _batch(random.Random(seed))
    use_logitless(actor)
    with pytest.warns(UserWarning, match="OpenRLHF's own Actor.forward is used: a call that returns the logits"):
        out = actor(seq, attention_mask=attn, return_output=True)
    assert out["logits"].shape == (*seq.shape, V)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actor(seq, attention_mask=attn, return_output=True)  # warned once per actor


def test_not_an_actor_is_a_named_error():
    with pytest.raises(TypeError, match=r"openrlhf\.models\.Actor"):
        use_logitless(torch.nn.Linear(2, 2))
