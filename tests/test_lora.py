"""LoRA on the head: every entry point against the merged-weight oracle.

The oracle is the plain path on the merged head ``W + s·B·A`` in float64 (materialized logits,
``log_softmax``), differentiated by autograd, so gradients of ``A`` and ``B`` come from the
merge itself, not from our low-rank backward. Inputs in float32 (statistics and accumulators are
fp32 in both backends), so the tolerances are fp32 rounding of O(10) logits. Shapes are odd
(V = 123, N = 47, r = 5); chunk budgets force token chunking and vocabulary blocking, where the
adapter's rows must follow the weight's blocks.
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless import Head, HeadLoRA, LogitTransform, PassOptions, PolicyConfig, VocabShard
from logitless.model_heads import UnsupportedModelError, add_hidden_states_forward, find_head
from logitless.objectives.reference import reference_stats

V, H, N, R = 123, 16, 47, 5
IMPLS = ["torch", "triton"]
CHUNKS = {"whole": None, "token_chunks": 70_000, "vocab_blocks": 6_000}
TOL = dict(rtol=2e-5, atol=2e-5)


def _setup(seed: int, dtype=torch.float32, frozen: bool = True, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / 2).to(dtype).requires_grad_(not frozen)
    a = (torch.randn(R, H, generator=g, dtype=torch.float64) / 2).to(dtype).requires_grad_()
    b = torch.randn(V, R, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b_ = (torch.randn(V, generator=g, dtype=torch.float64)).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, a, b, b_, targets


def _merged(weight, a, b, scaling):
    """The oracle's head: ``W + s·B·A`` in float64, differentiable w.r.t. all three."""
    return weight.double() + scaling * b.double() @ a.double()


def _grads(loss, *ts):
    return torch.autograd.grad(loss, [t for t in ts if t is not None and t.requires_grad])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunk", list(CHUNKS))
@pytest.mark.parametrize("transform", [dict(), dict(temperature=0.7, softcap=5.0, logit_scale=1.5)],
                         ids=["plain", "temp_softcap_scale"])
def test_vocab_stats_with_lora_equal_merged_weight(impl, chunk, transform):
    hidden, weight, a, b, bias, targets = _setup(1, frozen=False, bias=True)
    targets[::7] = -100  # ignored rows are dropped before the adapter's projection
    scaling = 1.7
    lora = HeadLoRA(a=a, b=b, scaling=scaling)
    st = logitless.vocab_stats(hidden, Head(weight, bias, LogitTransform(**transform), lora), targets,
                               options=PassOptions(impl=impl, chunk_bytes=CHUNKS[chunk]))
    ref = reference_stats(hidden.double(), _merged(weight, a, b, scaling), targets, bias=bias.double(), **transform)
    for name in ("logp", "lse", "entropy"):
        torch.testing.assert_close(getattr(st, name).double(), getattr(ref, name), **TOL)
    ours = _grads((-st.logp.sum() + 0.3 * st.entropy.sum() + 0.1 * st.lse.sum()), hidden, weight, bias, a, b)
    want = _grads((-ref.logp.sum() + 0.3 * ref.entropy.sum() + 0.1 * ref.lse.sum()), hidden, weight, bias, a, b)
    for o, w in zip(ours, want, strict=True):
        torch.testing.assert_close(o.double(), w.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_policy_loss_with_lora_equal_merged_weight(impl, mode, loss_type):
    hidden, weight, a, b, _, targets = _setup(2)
    B, T = 5, 9
    hidden3 = hidden[: B * T].reshape(B, T, H)
    ids = targets[: B * T].reshape(B, T)
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(B, T, generator=g) > 0.2).long()
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    ref = -torch.rand(B, T, generator=g) * 3
    cfg = PolicyConfig(loss_type=loss_type, beta=0.05, epsilon_high=0.28)
    lora = HeadLoRA(a=a, b=b, scaling=0.8)
    transform = LogitTransform(temperature=0.9)
    loss, metrics = logitless.policy_loss(hidden3, Head(weight, transform=transform, lora=lora), ids, mask, adv, old,
                                          ref, config=cfg,
                                          options=PassOptions(mode=mode, impl=impl, chunk_bytes=20_000))
    # Oracle: the same loss on the merged head in float64, through the plain (non-LoRA) path,
    # which tests/test_policy_trl.py holds to TRL's own _compute_loss.
    merged = _merged(weight, a, b, 0.8)
    want, want_metrics = logitless.policy_loss(hidden3.double(), Head(merged, transform=transform), ids, mask, adv,
                                               old.double(), ref.double(), config=cfg,
                                               options=PassOptions(mode="recompute", impl="torch"))
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    for k in ("kl", "entropy", "clip_ratio/region_mean"):
        torch.testing.assert_close(metrics[k].double(), want_metrics[k], rtol=1e-5, atol=1e-6)
    ours = _grads(loss, hidden, a, b)
    ref_g = _grads(want, hidden, a, b)
    for o, w in zip(ours, ref_g, strict=True):
        torch.testing.assert_close(o.double(), w.double(), rtol=1e-4, atol=1e-5)
    assert weight.grad is None  # frozen head weight: no d-weight


@pytest.mark.parametrize("impl", IMPLS)
def test_token_logprobs_and_cross_entropy_with_lora(impl):
    hidden, weight, a, b, _, targets = _setup(4)
    lora = HeadLoRA(a=a, b=b, scaling=2.0)
    merged = _merged(weight, a, b, 2.0)
    logp, ent = logitless.token_logprobs(hidden, Head(weight, lora=lora), targets, entropy=True,
                                         options=PassOptions(impl=impl))
    ref = reference_stats(hidden.double(), merged, targets)
    torch.testing.assert_close(logp.double(), ref.logp, **TOL)
    torch.testing.assert_close(ent.double(), ref.entropy, **TOL)

    loss, _m = logitless.cross_entropy(hidden, Head(weight, lora=lora), targets, label_smoothing=0.1, z_loss=1e-3,
                                       options=PassOptions(mode="fused", impl=impl))
    want = torch.nn.functional.cross_entropy(hidden.double() @ merged.t(), targets, label_smoothing=0.1) \
        + 1e-3 * (ref.lse ** 2).mean()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    for o, w in zip(_grads(loss, hidden, a, b), _grads(want, hidden, a, b), strict=True):
        torch.testing.assert_close(o.double(), w.double(), rtol=1e-4, atol=1e-5)


def test_dropout_applies_to_the_adapter_input_only():
    hidden, weight, a, b, _, targets = _setup(5)
    lora = HeadLoRA(a=a, b=b, scaling=1.0, dropout=lambda h: 0.5 * h)  # deterministic stand-in for dropout
    st = logitless.vocab_stats(hidden, Head(weight, lora=lora), targets, options=PassOptions(impl="torch"))
    y = hidden.double() @ weight.double().t() + (0.5 * hidden.double()) @ a.double().t() @ b.double().t()
    want = torch.log_softmax(y, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(st.logp.double(), want, **TOL)


def test_lora_on_a_padded_vocabulary():
    # Rows past vocab_size (padding) of W and of B are left out of the softmax together.
    hidden, weight, a, b, _, targets = _setup(6)
    targets = targets % 100
    lora = HeadLoRA(a=a, b=b, scaling=1.1)
    for mode in ("fused", "recompute"):
        loss, _ = logitless.cross_entropy(hidden, Head(weight, lora=lora, shard=VocabShard(vocab_size=100)), targets,
                                          options=PassOptions(mode=mode, impl="torch"))
        merged = _merged(weight, a, b, 1.1)[:100]
        want = torch.nn.functional.cross_entropy(hidden.double() @ merged.t(), targets)
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
        gb, = torch.autograd.grad(loss, [b])
        assert gb[100:].abs().max() == 0 and gb[:100].abs().max() > 0


@pytest.mark.parametrize("bad, match", [
    (dict(a=torch.randn(R, H + 1)), r"HeadLoRA.a must be \[r, H\]"),
    (dict(b=torch.randn(V, R + 1)), r"HeadLoRA.b must be \[V, r\]"),
    (dict(b=torch.full((V, R), float("nan"))), "NaN or inf"),
    (dict(a=torch.randn(R, H, dtype=torch.float64).int()), "floating"),
])
def test_bad_adapter_is_refused_before_the_pass(bad, match):
    hidden, weight, a, b, _, targets = _setup(7)
    lora = HeadLoRA(**{"a": a, "b": b, **bad})
    with pytest.raises((ValueError, TypeError), match=match):
        logitless.vocab_stats(hidden, Head(weight, lora=lora), targets)


# ---- PEFT ------------------------------------------------------------------------------------

def _tiny_llama(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)  # O(10) logits, so a missed adapter term shows
    return model


def _peft(lora_kw, seed=0):
    peft = pytest.importorskip("peft")
    # init_lora_weights=False: B is not zero, so an adapter left out would change the numbers.
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora_kw)
    return peft.get_peft_model(_tiny_llama(seed), cfg).to(torch.float64)


def _ids(seed=1):
    return torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(seed))


def _own_vs_ours(model, ids, mode):
    """Loss ``-Σ logp + 0.1 Σ entropy`` of the next tokens from the model's own logits and from
    logitless, with the gradients of every trainable parameter."""
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(input_ids=ids).logits[:, :-1]
    logsm = logits.log_softmax(-1)
    own = -logsm.gather(-1, ids[:, 1:, None]).sum() + 0.1 * -(logsm.exp() * logsm).sum()
    own_g = torch.autograd.grad(own, params)

    add_hidden_states_forward(model)
    head = find_head(model)
    hidden = model(input_ids=ids, logitless_hidden_states=True)[:, :-1]
    loss, _ = logitless.head_loss(hidden, Head(head.weight, bias=head.bias, lora=head.lora), ids[:, 1:],
                                  {
        "nll": lambda s: -s.logp.sum(), "ent": lambda s: 0.1 * s.entropy.sum()},
                                  options=PassOptions(mode=mode))
    ours_g = torch.autograd.grad(loss, params, allow_unused=True)
    return own, own_g, loss, ours_g, params, head


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_peft_lora_head_matches_the_models_own_logits(mode):
    model = _peft(dict(target_modules=["q_proj", "lm_head"], lora_dropout=0.0))
    ids = _ids()
    own, own_g, loss, ours_g, _params, head = _own_vs_ours(model, ids, mode)
    assert head.lora is not None and head.lora.a.shape == (4, 32) and head.lora.scaling == 2.0
    assert not head.weight.requires_grad  # PEFT freezes the base head
    torch.testing.assert_close(loss, own, rtol=1e-10, atol=1e-10)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lm_head.lora_A" in n for n in names) and any("lm_head.lora_B" in n for n in names)
    for name, o, w in zip(names, ours_g, own_g, strict=True):
        assert o is not None, name
        torch.testing.assert_close(o, w, rtol=1e-9, atol=1e-10, msg=name)


def test_peft_disabled_or_merged_adapter_is_the_plain_head():
    model = _peft(dict(target_modules=["lm_head"]))
    with model.disable_adapter():
        assert find_head(model).lora is None
    merged = model.merge_and_unload()
    assert find_head(merged).lora is None


def test_peft_modules_to_save_head_uses_the_trainable_copy():
    model = _peft(dict(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():  # make the copy differ from the original head
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    own, own_g, loss, ours_g, _params, head = _own_vs_ours(model, _ids(2), "fused")
    assert head.weight.requires_grad and head.lora is None
    torch.testing.assert_close(loss, own, rtol=1e-10, atol=1e-10)
    for o, w in zip(ours_g, own_g, strict=True):
        torch.testing.assert_close(o, w, rtol=1e-9, atol=1e-10)


def test_peft_unsupported_head_adapters_are_refused():
    peft = pytest.importorskip("peft")
    dora = _peft(dict(target_modules=["lm_head"], use_dora=True))
    with pytest.raises(UnsupportedModelError, match="variant"):
        find_head(dora)
    two = _peft(dict(target_modules=["lm_head"]))
    two.add_adapter("second", peft.LoraConfig(r=2, target_modules=["lm_head"]))
    two.base_model.set_adapter(["default", "second"])
    with pytest.raises(UnsupportedModelError, match="2 active LoRA adapters"):
        find_head(two)
