"""Head discovery per Hugging Face causal LM family: for each verified class, logitless's
log-probs and entropy from the final hidden states and the discovered head equal the ones
from the model's own logits (float64, so the tolerance is rounding, not a bound on fp32 error).

Each model is built tiny from its config with random weights; the head is re-drawn with a
large std so that logits are O(10) and soft-capping, logit scaling and temperature all move
the numbers (with the default 0.02 init they would be ~0.1 and a missed scale could pass).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from logitless import Head, LogitTransform, token_logprobs
from logitless.model_heads import (
    UnsupportedModelError,
    add_hidden_states_forward,
    find_head,
    supported_models,
)

V = 112  # head rows; not a multiple of the hidden size or a block size
TEMPERATURE = 0.7
TOL = dict(rtol=0, atol=1e-10)

# Common tiny sizes; configs ignore what they don't use and families with other names get them below.
_SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Eager experts: the grouped-GEMM kernel has no float64.
_MOE = dict(
    experts_implementation="eager",
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)

# (case id, CausalLM class, config class, config kwargs beyond _SIZES, tie_word_embeddings values to test)
CASES = [
    ("llama", "LlamaForCausalLM", "LlamaConfig", {}, (False, True)),
    ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", {}, (False, True)),
    ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", {}, (False, True)),
    ("gemma", "GemmaForCausalLM", "GemmaConfig", {}, (True,)),
    ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(final_logit_softcapping=3.0), (True, False)),
    ("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(final_logit_softcapping=3.0), (True, False)),
    ("mistral", "MistralForCausalLM", "MistralConfig", {}, (False, True)),
    ("phi3", "Phi3ForCausalLM", "Phi3Config", {}, (False, True)),
    ("phi-biased", "PhiForCausalLM", "PhiConfig", {}, (False,)),
    ("gpt2", "GPT2LMHeadModel", "GPT2Config", dict(n_embd=32, n_layer=1, n_head=4, n_positions=64), (True, False)),
    ("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", {}, (False, True)),
    (
        "gptj-biased",
        "GPTJForCausalLM",
        "GPTJConfig",
        dict(n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=64),
        (False,),
    ),
    ("opt", "OPTForCausalLM", "OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=32), (True,)),
    ("cohere", "CohereForCausalLM", "CohereConfig", dict(logit_scale=0.5), (True, False)),
    ("cohere2", "Cohere2ForCausalLM", "Cohere2Config", dict(logit_scale=0.5), (True,)),
    (
        "granite",
        "GraniteForCausalLM",
        "GraniteConfig",
        dict(logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3),
        (True, False),
    ),
    ("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig", dict(logits_scaling=4.0, **_MOE), (True,)),
    (
        "minicpm3",
        "MiniCPM3ForCausalLM",
        "MiniCPM3Config",
        dict(
            dim_model_base=8,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
        (False,),
    ),
    (
        "falcon_h1",
        "FalconH1ForCausalLM",
        "FalconH1Config",
        dict(
            lm_head_multiplier=0.25,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=8,
            mamba_chunk_size=8,
        ),
        (False,),
    ),
    ("hyperclovax", "HyperCLOVAXForCausalLM", "HyperCLOVAXConfig", dict(logits_scaling=2.5), (False,)),
    ("olmo2", "Olmo2ForCausalLM", "Olmo2Config", {}, (False,)),
    ("stablelm", "StableLmForCausalLM", "StableLmConfig", {}, (False,)),
    ("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", {}, (True,)),
    ("smollm3", "SmolLM3ForCausalLM", "SmolLM3Config", {}, (True,)),
    ("mixtral", "MixtralForCausalLM", "MixtralConfig", _MOE, (False,)),
    ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", _MOE, (False,)),
    ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", _MOE, (False,)),
]
PARAMS = [
    pytest.param(cls, cfg, kw, tie, id=f"{cid}-{'tied' if tie else 'untied'}")
    for cid, cls, cfg, kw, ties in CASES
    for tie in ties
]


def _build(cls: str, cfg_cls: str, kwargs: dict, tie: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**_SIZES, **kwargs, "tie_word_embeddings": tie})
    model = getattr(transformers, cls)(cfg).to(torch.float64).eval()
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0)
        if head.bias is not None:
            head.bias.normal_(0.0, 2.0)
    return model


def _inputs(seed: int = 1, vocab: int = V) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))


def _reference(model, ids):  # [B, T-1] log-probs of the next tokens and entropies, from the model's logits
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].double() / TEMPERATURE
    logp = logits.log_softmax(-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(-1)


def _ours(model, ids):
    add_hidden_states_forward(model)
    head = find_head(model)
    with torch.no_grad():
        hidden = model(input_ids=ids, logitless_hidden_states=True)[:, :-1]
        return token_logprobs(
            hidden,
            head.at_temperature(TEMPERATURE),
            ids[:, 1:],
            entropy=True,
        )


@pytest.mark.parametrize("cls, cfg_cls, kwargs, tie", PARAMS)
def test_logprobs_and_entropy_match_model_logits(cls, cfg_cls, kwargs, tie):
    model = _build(cls, cfg_cls, kwargs, tie)
    ids = _inputs()
    ref_logp, ref_ent = _reference(model, ids)
    head = find_head(model)
    assert type(model).__name__ == cls
    assert (head.weight is model.get_input_embeddings().weight) == tie
    assert head.weight.shape[0] == V
    logp, ent = _ours(model, ids)
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    # The patched model still returns logits by default.
    assert model(input_ids=ids).logits.shape == (*ids.shape, V)


def test_what_each_family_reads_from_its_config():
    # The numbers the forward passes apply, read back (the test above shows they are applied right).
    def head_of(cid):
        _, cls, cfg, kw, ties = next(c for c in CASES if c[0] == cid)
        return find_head(_build(cls, cfg, kw, ties[0]))

    assert (head_of("gemma2").transform.softcap, head_of("gemma2").transform.logit_scale) == (3.0, 1.0)
    assert head_of("cohere").transform.logit_scale == 0.5
    assert head_of("granite").transform.logit_scale == 0.25  # Granite divides by logits_scaling
    assert head_of("hyperclovax").transform.logit_scale == 2.5  # HyperCLOVA X multiplies
    assert head_of("minicpm3").transform.logit_scale == 8 / 32  # hidden / (hidden_size / dim_model_base)
    assert head_of("falcon_h1").transform.logit_scale == 0.25
    assert head_of("phi-biased").bias is not None and head_of("llama").bias is None
    assert head_of("llama").transform.softcap is None and head_of("llama").transform.logit_scale == 1.0


def test_every_supported_class_is_tested_here():
    assert set(supported_models()) == {c[1] for c in CASES}


def test_padded_vocab_rows_are_in_the_softmax():
    # A head with more rows than the tokenizer (here: ids < 100, 112 rows). The model's softmax runs
    # over all rows, so logitless's does: padding rows that carry mass change every log-prob.
    model = _build("Qwen2ForCausalLM", "Qwen2Config", {}, False)
    with torch.no_grad():
        model.lm_head.weight[100:] *= 3.0
    ids = _inputs(vocab=100)
    ref_logp, ref_ent = _reference(model, ids)
    logp, ent = _ours(model, ids)
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    with torch.no_grad():
        hidden = model(input_ids=ids, logitless_hidden_states=True)[:, :-1]
    truncated = token_logprobs(
        hidden, Head(model.lm_head.weight[:100], transform=LogitTransform(temperature=TEMPERATURE)), ids[:, 1:]
    )
    # Renormalizing over the tokenizer's rows only would raise every log-prob by -log(1 - padding mass).
    gap = truncated - logp
    assert gap.min() > 0 and gap.mean() > 1.0


@pytest.mark.parametrize(
    "cls, cfg_cls, kwargs, tie",
    [
        pytest.param("LlamaForCausalLM", "LlamaConfig", {}, True, id="llama-tied"),
        pytest.param("Gemma2ForCausalLM", "Gemma2Config", dict(final_logit_softcapping=3.0), True, id="gemma2"),
    ],
)
def test_peft_lora_on_backbone(cls, cfg_cls, kwargs, tie):
    peft = pytest.importorskip("peft")
    base = _build(cls, cfg_cls, kwargs, tie)
    # init_lora_weights=False: non-zero adapters, so a path that skipped them would differ.
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, cfg).to(torch.float64).eval()
    ids = _inputs()
    ref_logp, ref_ent = _reference(model, ids)
    with torch.no_grad():
        plain = base.model(input_ids=ids).last_hidden_state  # LoRA layers live inside base.model
        model.disable_adapter_layers()
        no_lora = base.model(input_ids=ids).last_hidden_state
        model.enable_adapter_layers()
    assert (plain - no_lora).abs().max() > 1e-3
    logp, ent = _ours(model, ids)
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)


def test_unrecognized_model_class_raises_with_its_name():
    class MyLlamaForCausalLM(transformers.LlamaForCausalLM):  # a subclass may change forward
        pass

    cfg = transformers.LlamaConfig(**_SIZES)
    model = MyLlamaForCausalLM(cfg)
    with pytest.raises(UnsupportedModelError, match="MyLlamaForCausalLM"):
        find_head(model)
    with pytest.raises(UnsupportedModelError, match="MyLlamaForCausalLM"):
        add_hidden_states_forward(model)

    # A transformers family not verified: RecurrentGemma caps logits with `logits_soft_cap`.
    rg = transformers.RecurrentGemmaForCausalLM(
        transformers.RecurrentGemmaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            lru_width=32,
            attention_window_size=8,
        )
    )
    with pytest.raises(UnsupportedModelError, match="RecurrentGemmaForCausalLM"):
        find_head(rg)


def test_compiled_model_gives_hidden_states_and_its_head():
    # torch.compile(model) wraps the model in an OptimizedModule; the head is found through it and
    # the compiled call returns the same final hidden states as the eager model (no logits formed).
    model = _build("LlamaForCausalLM", "LlamaConfig", {}, False)
    ids = _inputs(seed=4)
    compiled = torch.compile(model, backend="eager")
    add_hidden_states_forward(compiled)
    assert find_head(compiled).weight is model.lm_head.weight
    with torch.no_grad():
        want = model.model(input_ids=ids).last_hidden_state
        got = compiled(input_ids=ids, logitless_hidden_states=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch._dynamo.reset()


def test_value_head_wrapper_is_looked_through():
    # The layout of TRL's AutoModelForCausalLMWithValueHead: the causal LM as `pretrained_model`
    # next to a scalar `v_head`. The logits head found is the LM's, and the LM's own forward gives
    # the hidden states that both the head and the value head read.
    class WithValueHead(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.pretrained_model = lm
            self.v_head = torch.nn.Linear(lm.config.hidden_size, 1, dtype=torch.float64)

    lm = _build("Qwen2ForCausalLM", "Qwen2Config", {}, False)
    wrapper = WithValueHead(lm)
    assert find_head(wrapper).weight is lm.lm_head.weight
    add_hidden_states_forward(wrapper)
    ids = _inputs(seed=6)
    ref_logp, ref_ent = _reference(lm, ids)
    logp, ent = _ours(wrapper.pretrained_model, ids)
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
