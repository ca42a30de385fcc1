"""Tiny Hugging Face models and a locally built tokenizer (no model hub)."""

from __future__ import annotations

from pathlib import Path

import torch


def word_tokenizer(vocab_size: int):
    """A WordLevel tokenizer over tokens ``t0 … t{V-4}`` plus pad/eos/unk (ids V-3…V-1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 3)}
    vocab.update({"<pad>": vocab_size - 3, "<eos>": vocab_size - 2, "<unk>": vocab_size - 1})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_tiny_qwen2(path: Path, vocab_size: int = 64, hidden_size: int = 32, tie: bool = False,
                    seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=tie,
                      pad_token_id=vocab_size - 3, eos_token_id=vocab_size - 2, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    word_tokenizer(vocab_size).save_pretrained(path)
    return path


def tiny_llama(vocab_size: int, hidden_size: int, seed: int, **config):
    """A float64 one-layer Llama (2 heads, 1 KV head, MLP width 32) from ``torch.manual_seed(seed)``;
    ``config``: further ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, **config)
    return LlamaForCausalLM(cfg).double()
