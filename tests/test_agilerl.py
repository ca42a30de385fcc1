"""``logitless.integrations.agilerl.use_logitless`` against AgileRL's own path (agilerl 2.58,
installed without its dependencies: ``pip install --no-deps -r requirements-frameworks.txt``).

The oracle is the same AgileRL agent before the switch, with ``use_liger_loss=False`` and
``cast_logprobs_to_fp32=False`` so that its fused log-prob path runs in the float64 of the tiny
model: ``GRPO._objective_loss`` (log-probs through the seam, then AgileRL's loss code) gives the
loss and the gradients of every trainable parameter, over a randomized grid of AgileRL's options.
A LoRA adapter on ``lm_head``, which AgileRL's own path leaves out of the log-probs, is checked
against PEFT's materialized head instead."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from tiny_models import tiny_llama

from logitless.integrations.agilerl import use_logitless

V, H = 67, 16


@pytest.fixture(scope="module")
def agilerl():
    mod = pytest.importorskip("agilerl", reason="pip install --no-deps -r requirements-frameworks.txt")
    # agilerl's LLM algorithms import only when its `cpu-llm` extra's distributions are all
    # installed (bitsandbytes, liger-kernel, openenv among them); none of those is used by the
    # CPU float64 path under test, and CI does not install them.
    mod.HAS_LLM_DEPENDENCIES = True
    from agilerl.algorithms.cispo import CISPO
    from agilerl.algorithms.grpo import GRPO
    from agilerl.algorithms.gspo import GSPO
    from agilerl.algorithms.reinforce_llm import REINFORCE

    return {"grpo": GRPO, "cispo": CISPO, "gspo": GSPO, "reinforce": REINFORCE}


def _model(seed: int):
    return tiny_llama(V, H, seed, pad_token_id=0)


def _agent(classes, loss_type: str, seed: int, **kwargs):
    from peft import LoraConfig

    # AgileRL's default adapter has lora_dropout=0.05, which would make two forwards differ.
    kwargs.setdefault("cast_logprobs_to_fp32", False)  # AgileRL's path in the float64 of the model
    kwargs.setdefault("lora_config", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # AgileRL's notices (default LoRA config, CISPO with beta != 0, ...)
        if loss_type != "reinforce":
            kwargs.setdefault("group_size", 2)
        agent = classes[loss_type](
            pad_token_id=0,
            pad_token="<pad>",
            actor_network=_model(seed),
            device="cpu",
            gradient_checkpointing=False,
            batch_size=4,
            wrap=False,
            use_liger_loss=False,
            **kwargs,
        )
    # PEFT starts lora_B at zero; random adapters make every trainable parameter's gradient count.
    with torch.no_grad():
        for p in agent.actor.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    return agent


def _batch(agent, rng: random.Random, per_token_adv: bool, turns: bool, vllm: bool):
    b, length = 4, 11
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.randint(1, V, (b, length), generator=g)
    prompt = 3
    mask = torch.zeros(b, length - 1, dtype=torch.bool)
    for r in range(b):
        mask[r, prompt - 1 : length - 1 - rng.randrange(0, 4)] = True  # ragged completions
    ids[:, 1:][~mask & (torch.arange(length - 1) >= prompt)] = 0  # padding after each completion
    with torch.no_grad():
        logp = agent._get_logprobs(ids, batch_size=b)
    noise = lambda s: s * torch.randn(logp.shape, generator=g, dtype=logp.dtype)  # noqa: E731
    old = logp + noise(0.3)
    ref = logp + noise(0.5)
    sampling = logp + noise(0.2) if vllm else None
    adv = torch.randn(b, length - 1 if per_token_adv else 1, generator=g, dtype=logp.dtype)
    turn_ids = None
    if turns:
        turn_ids = torch.full(mask.shape, -1)
        for r in range(b):
            cols = mask[r].nonzero().flatten()
            cut = int(cols[len(cols) // 2])
            turn_ids[r, cols] = (cols >= cut).long()
    return ids, mask, adv, old, ref, turn_ids, sampling


def _loss_and_grads(agent, batch):
    for p in agent.actor.parameters():
        p.grad = None
    ids, mask, adv, old, ref, turn_ids, sampling = batch
    loss, kl, clipfrac, logp = agent._objective_loss(ids, mask, adv, old, ref, turn_ids, sampling)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in agent.actor.named_parameters() if p.requires_grad}
    return loss.detach(), kl.detach(), clipfrac.detach(), logp, grads


def _options(rng: random.Random) -> tuple[str, dict, dict]:
    loss_type = rng.choice(["grpo", "cispo", "gspo"])
    level = rng.choice(["token", "turn", "trajectory"])
    kwargs = {
        "beta": rng.choice([0.0, 0.04]),
        "kl_clamp": rng.choice([None, 0.3, 10.0]),
        "use_bias_correction_kl": rng.random() < 0.5,
        "temperature": rng.choice([1.0, 0.7]),
        "clip_coef": rng.choice([0.2, (0.1, 0.3)]),
        "off_policy_token_mask_bounds": rng.choice([None, (0.7, 1.4)]),
        "off_policy_sequence_mask_threshold": rng.choice([None, 0.03]),
        "use_kl_advantage_shaping": rng.random() < 0.3,
        "loss_norm": rng.choice(["micro_batch", "accumulation_window"]),
        "vllm_importance_sampling_cap": rng.choice([2.0, 1.1]),
    }
    if loss_type != "gspo":
        kwargs["importance_sampling_level"] = level
    batch = {"per_token_adv": rng.random() < 0.4, "turns": level == "turn", "vllm": rng.random() < 0.6}
    return loss_type, kwargs, batch


# Eight cases drawn from AgileRL's option space (loss type x importance-sampling level x KL
# penalty, clamp, bias correction, advantage shaping x off-policy masks x vLLM sampling
# correction x temperature x loss normalization x per-token advantages): each draw exercises
# several switches at once; a new case is a new draw, not a new test.
@pytest.mark.parametrize("case", range(8))
def test_loss_and_gradients_match_agilerls_own_path_float64(agilerl, seed, case):
    rng = random.Random(seed)
    loss_type, kwargs, shape = _options(rng)
    agent = _agent(agilerl, loss_type, seed, **kwargs)
    if kwargs["loss_norm"] == "accumulation_window":
        agent._window_action_tokens = torch.tensor(37.0, dtype=torch.float64)
    batch = _batch(agent, rng, **shape)
    expected = _loss_and_grads(agent, batch)

    use_logitless(agent)
    agent.cast_logprobs_to_fp32 = rng.random() < 0.5  # logitless keeps fp64 either way
    got = _loss_and_grads(agent, batch)
    assert type(agent).__name__.startswith("Logitless__") and got[0].dtype == got[3].dtype == torch.float64
    assert agent._fused_logprob_fn_and_head()[0].func.__module__ == "logitless.integrations.agilerl"
    for name, x, y in zip(("loss", "kl", "clipfrac", "logp"), got[:4], expected[:4], strict=True):
        assert x.dtype == y.dtype, name
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12, equal_nan=True), (name, x, y)
    assert got[4].keys() == expected[4].keys() and len(got[4]) > 0
    for name in expected[4]:
        assert torch.allclose(got[4][name], expected[4][name], rtol=1e-10, atol=1e-12), name


def test_llm_reinforce_log_probs_and_gradients(agilerl, seed):
    """LLMREINFORCE scores through the same seam (its loss is GRPO's code path's sibling)."""
    agent = _agent(agilerl, "reinforce", seed, temperature=0.9)
    ids = torch.randint(1, V, (3, 9))
    weights = torch.randn(3, 8, dtype=torch.float64)
    results = []
    for switch in (False, True):
        if switch:
            use_logitless(agent)
        for p in agent.actor.parameters():
            p.grad = None
        lp = agent._get_logprobs(ids, batch_size=3)
        (lp * weights).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in agent.actor.named_parameters() if p.requires_grad}))
    (expected, expected_grads), (got, grads) = results
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert grads.keys() == expected_grads.keys() and grads
    for n in grads:
        assert torch.allclose(grads[n], expected_grads[n], rtol=1e-10, atol=1e-12), n


def test_bf16_log_probs_keep_fp32_statistics(agilerl, seed):
    """On bf16 operands AgileRL's own path computes in fp32 and rounds the log-probs to bf16
    (``cast_logprobs_to_fp32``); logitless returns them in fp32. Both against float64."""
    agent = _agent(agilerl, "grpo", seed, cast_logprobs_to_fp32=True)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 9, H, generator=g).bfloat16()
    weight = torch.randn(V, H, generator=g).bfloat16()
    targets = torch.randint(0, V, (2, 9), generator=g)
    exact = (hidden.double() @ weight.double().T).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    kwargs = {"temperature": 1.0, "cast_to_fp32": True, "chunk_rows": 4}
    theirs = agent._fused_logprob_fn_and_head()[0](hidden, weight, None, targets, **kwargs)
    use_logitless(agent)
    ours = agent._fused_logprob_fn_and_head()[0](hidden, weight, None, targets, **kwargs)
    assert theirs.dtype == torch.bfloat16 and ours.dtype == torch.float32
    err_ours, err_theirs = (ours.double() - exact).abs().max(), (theirs.double() - exact).abs().max()
    assert err_ours < 1e-5 < err_theirs, (err_ours, err_theirs)


def test_lora_on_lm_head_is_kept(agilerl, seed):
    """AgileRL's own path scores with ``lm_head.weight`` (the base layer's); through logitless the
    head adapter is in the log-probs and gets its gradient, as PEFT's materialized head gives."""
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"])
    agent = _agent(agilerl, "grpo", seed, lora_config=config, temperature=0.8)
    lm_head = agent._get_lm_head()
    assert hasattr(lm_head, "lora_A"), "AgileRL dropped the LoRA adapter from lm_head"
    use_logitless(agent)
    ids = torch.randint(1, V, (3, 9))
    weights = torch.randn(3, 8, dtype=torch.float64)

    ours = agent._get_logprobs(ids, batch_size=3)
    (ours * weights).sum().backward()
    got = {n: p.grad.clone() for n, p in agent.actor.named_parameters() if p.requires_grad}
    for p in agent.actor.parameters():
        p.grad = None

    logits = agent.actor(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1] / 0.8
    theirs = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (theirs * weights).sum().backward()
    assert torch.allclose(ours.detach(), theirs.detach(), rtol=1e-10, atol=1e-12)
    head_grads = [n for n in got if "lm_head" in n]
    assert head_grads and all(got[n].abs().max() > 0 for n in head_grads)
    for n, p in agent.actor.named_parameters():
        if p.requires_grad:
            assert torch.allclose(got[n], p.grad, rtol=1e-10, atol=1e-12), n


def test_fallback_warns_once_and_uses_agilerls_path(agilerl, seed):
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"], use_dora=True)
    agent = _agent(agilerl, "grpo", seed, lora_config=config)
    ids = torch.randint(1, V, (2, 7))
    with torch.no_grad():
        expected = agent._get_logprobs(ids, batch_size=2)
    use_logitless(agent)
    with pytest.warns(UserWarning, match="AgileRL's own head path is used.*LoRA variant") as record:
        with torch.no_grad():
            got = agent._get_logprobs(ids, batch_size=2)
            agent._get_logprobs(ids, batch_size=2)
    assert sum("logitless" in str(w.message) for w in record) == 1
    assert torch.equal(got, expected)


def test_switch_survives_clone_and_turns_liger_off(agilerl, seed):
    agent = _agent(agilerl, "cispo", seed)
    agent.use_liger_loss = True
    use_logitless(agent)
    assert agent.use_liger_loss is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clone = agent.clone()
    assert type(clone) is type(agent) and isinstance(clone, agilerl["cispo"])
    import importlib

    mod = importlib.import_module("logitless.integrations.agilerl")
    assert getattr(mod, type(agent).__name__) is type(agent)


def test_not_an_agent_is_a_named_error():
    with pytest.raises(TypeError, match="AgileRL LLM algorithm"):
        use_logitless(torch.nn.Linear(2, 2))
