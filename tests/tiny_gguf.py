"""A tiny llama-architecture GGUF file written with the ``gguf`` package, laid out as
llama.cpp's converter writes one (q/k rows permuted, tied head, byte-level BPE tokenizer with a
ChatML template), and the float Hugging Face model it was written from (the oracle)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotary halves interleaved per head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocabulary(n_numbers: int) -> list[str]:
    """The GPT-2 byte alphabet, ChatML's two control tokens, then the numbers ``0..n_numbers-1``
    as whole tokens, so that most of a random model's samples are numbers."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    return alphabet + ["<|im_start|>", "<|im_end|>"] + [str(i) for i in range(10, n_numbers)]


def write_tiny_gguf(path: Path, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    n_numbers: int = 1000, seed: int = 0) -> torch.nn.Module:
    """Write ``path`` (a .gguf) and return the float ``LlamaForCausalLM`` whose weights it holds."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = vocabulary(n_numbers)
    eos = tokens.index("<|im_end|>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        # Random-init norms are 1; draw them so the test sees each one land in the right place.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(["1 0", "2 0"])  # any merges: the file carries its own
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(eos)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
