"""Peak GPU memory of a GRPO-style training step with the reference model resident vs with
the reference log-probs served from `logitless.refcache` (reference model freed), plus the
cache's build throughput and lookup latency on the GPU.

    python3 scripts/gpu_refcache_memory.py [--tiny --device cpu]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch

import logitless
from logitless import PolicyConfig
from logitless.model_heads import add_hidden_states_forward, find_head
from logitless.refcache import BuildOptions, RefCache, build, free_reference


def make_model(tiny: bool, device: str, dtype: torch.dtype, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if tiny:
        cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    else:
        cfg = Qwen2Config(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)
    add_hidden_states_forward(model)
    return model


def train_step(policy, ids, mask, p, ref_logp):
    head = find_head(policy)
    hidden = policy(input_ids=ids, attention_mask=mask, logitless_hidden_states=True)[:, p - 1:-1]
    b = ids.shape[0]
    comp = ids[:, p:]
    with torch.no_grad():
        old = logitless.token_logprobs(hidden.detach(), head.weight, comp)
    adv = torch.randn(b, device=ids.device)
    loss, _ = logitless.policy_loss(hidden, head.weight, comp, mask[:, p:], adv, old, ref_logp,
                                    config=PolicyConfig(loss_type="dapo", beta=0.04))
    loss.backward()
    policy.zero_grad(set_to_none=True)


def peak(fn, device):
    if device != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    b, p, c = (8, 256, 768) if not args.tiny else (4, 8, 24)
    policy = make_model(args.tiny, dev, dtype, seed=0)
    ref = make_model(args.tiny, dev, dtype, seed=0)
    v = policy.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v, (b, p + c), generator=g).to(dev)
    mask = torch.ones_like(ids)

    def ref_live():
        with torch.no_grad():
            h = ref(input_ids=ids, attention_mask=mask, logitless_hidden_states=True)[:, p - 1:-1]
            return logitless.token_logprobs(h, find_head(ref).weight, ids[:, p:])

    live = ref_live()
    resident = peak(lambda: train_step(policy, ids, mask, p, ref_live()), dev)

    records = [{"prompt_ids": ids[i, :p].cpu(), "completion_ids": ids[i, p:].cpu()} for i in range(b)]
    path = tempfile.mkdtemp(prefix="refcache-") + "/cache"
    n_build = 64 if not args.tiny else 16
    g2 = torch.Generator().manual_seed(2)
    more = [{"prompt_ids": torch.randint(0, v, (p,), generator=g2), "completion_ids": torch.randint(0, v, (c,),
             generator=g2)} for _ in range(n_build - b)]
    t0 = time.perf_counter()
    build(ref, records + more, path, options=BuildOptions(batch_size=8, progress=False))
    if dev == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    free_reference(ref)  # weights moved to meta, storage released
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    cache = RefCache.open(path)
    cached = cache.ref_logps_for(ids[:, :p], mask[:, :p], ids[:, p:], mask[:, p:])
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        cache.ref_logps_for(ids[:, :p], mask[:, :p], ids[:, p:], mask[:, p:])
    if dev == "cuda":
        torch.cuda.synchronize()
    lookup_ms = 1e3 * (time.perf_counter() - t0) / reps
    freed = peak(lambda: train_step(policy, ids, mask, p, cache.ref_logps_for(ids[:, :p], mask[:, :p], ids[:, p:],
                                                                             mask[:, p:])), dev)
    params = sum(x.numel() for x in policy.parameters()) / 1e6
    print(f"model {params:.0f}M params {dtype}, batch {b} x ({p}+{c}) tokens, device {dev}")
    print(f"cache vs live reference: max |diff| = {(cached - live.float()).abs().max().item():.2e}")
    print(f"build: {n_build} sequences in {build_s:.2f} s = {n_build / build_s:.1f} seq/s "
          f"({n_build * (p + c) / build_s:.0f} tokens/s)")
    print(f"lookup of the batch: {lookup_ms:.2f} ms")
    print(f"peak GPU memory of a training step: reference resident {resident:.2f} GiB, "
          f"cache (reference freed) {freed:.2f} GiB")


if __name__ == "__main__":
    main()
